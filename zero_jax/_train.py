"""TrainState, init_state and make_train_step: one jit-compiled ZeRO step.

The step has three parts, each in the view that suits it:

1. gradients, in ``jax.shard_map``: each device runs ``loss_fn`` on its slice
   of the batch (in microbatches when accumulating) and the collectives of
   ``_collectives`` reduce the gradients in the precision policy's reduce
   dtype (all-reduce in stage 0, reduce-scatter from stage 1; stages 2–3
   reduce-scatter each gradient the moment the backward pass produces it;
   stage 3 also gathers the parameters for use). The global gradient norm,
   which is also the overflow check, costs one scalar all-reduce;
2. the optimizer, in the global view: :func:`shard_optimizer` runs the
   optax update on the partitioned (fp32 master) state, where the compiler
   keeps elementwise math local and adds only the small reductions an
   optimizer itself needs;
3. stages 1 and 2 all-gather the updated parameters (in the compute dtype).

The collectives ZeRO is about are therefore explicit (the compiler never
chooses them), which is what makes their cost provable from the program.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec

from zero_jax import _collectives as coll
from zero_jax import _offload
from zero_jax._layers import Sharded, manual_gather_scope
from zero_jax._multihost import check_same_on_all_processes, policy_fingerprint
from zero_jax._optimizer import (
    ShardedOptState,
    ShardedTransformation,
    TreeLayouts,
    check_tree,
    frozen_leaves,
    store,
    to_logical,
)
from zero_jax._partition import LeafLayout, is_layout
from zero_jax._policy import ZeroPolicy
from zero_jax._precision import LossScaleState, cast_floats
from zero_jax._tree import PyTree, check_live, path_str


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that lives between steps, placed per a policy.

    Attributes:
      step: the number of steps taken (an int32 scalar).
      params: the parameters the forward pass uses, in the compute dtype and
        in stored form: whole on every device in stages 0–2; in stage 3 each
        partitioned leaf is cut (and padded) per the policy.
        ``zj.full_params(state)`` gives the ordinary parameters.
      opt_state: the :class:`ShardedOptState` of the sharded optimizer.
      master: with mixed precision, the float32 master copy, partitioned like
        the optimizer state (from stage 1); ``None`` otherwise.
      loss_scale: with float16, the :class:`LossScaleState`; ``None`` otherwise.
      model_state: non-trainable model state that training updates (batch-norm
        running statistics, RNG counts, an ``eqx.nn.State``), replicated on
        every device, never differentiated, never seen by the optimizer;
        stepped by ``make_train_step(..., stateful=True)``. ``None`` when
        the model has none.
      policy: the policy the state is laid out for (static).
      layouts: the parameters' layouts (static).
    """

    step: jax.Array
    params: PyTree
    opt_state: ShardedOptState
    master: PyTree = None
    loss_scale: LossScaleState | None = None
    model_state: PyTree = None
    policy: ZeroPolicy = dataclasses.field(default=None, metadata={"static": True})  # type: ignore[assignment]
    layouts: TreeLayouts = dataclasses.field(default=None, metadata={"static": True})  # type: ignore[assignment]

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState,
    data_fields=["step", "params", "opt_state", "master", "loss_scale", "model_state"],
    meta_fields=["policy", "layouts"],
)


def _check_tx(tx: Any, policy: ZeroPolicy, where: str) -> ShardedTransformation:
    if not isinstance(tx, ShardedTransformation):
        raise TypeError(
            f"{where}: tx must be wrapped for the policy: pass zj.shard_optimizer(tx, policy), got {type(tx).__name__}."
        )
    if tx.policy != policy:
        raise ValueError(
            f"{where}: the optimizer is sharded for {tx.policy!r}, but the policy is {policy!r}. "
            "Wrap it with zj.shard_optimizer(tx, policy) for this policy."
        )
    return tx


def _stored_params(params: PyTree, layouts: PyTree, policy: ZeroPolicy) -> PyTree:
    return store(params, layouts, policy, policy.partitions_params)


def _with_dtype(layouts: PyTree, dtype: Any) -> PyTree:
    """The same layouts for another copy of the parameters (compute / master)."""
    return jax.tree.map(
        lambda lay: dataclasses.replace(lay, dtype=dtype) if jnp.issubdtype(lay.dtype, jnp.floating) else lay,
        layouts,
        is_leaf=is_layout,
    )


def _state_shardings(state: TrainState) -> TrainState:
    """The sharding of every leaf of a (possibly abstract) state."""
    policy = state.policy

    def shardings(layouts: PyTree, partitioned: bool, axes: tuple[str, ...] | None = None) -> PyTree:
        return jax.tree.map(lambda lay: policy.named_sharding(lay, partitioned, axes), layouts, is_leaf=is_layout)

    layouts = state.layouts.tree()
    placed = state.replace(
        step=policy.replicated(),
        params=shardings(layouts, policy.partitions_params),
        opt_state=ShardedOptState(
            shardings(state.opt_state.layouts.tree(), policy.partitions_opt_state, policy.state_axes),
            policy,
            state.opt_state.params,
            state.opt_state.layouts,
        ),
        master=None if state.master is None else shardings(layouts, policy.partitions_opt_state, policy.state_axes),
        loss_scale=None if state.loss_scale is None else jax.tree.map(lambda _: policy.replicated(), state.loss_scale),
        model_state=jax.tree.map(lambda _: policy.replicated(), state.model_state),
    )
    return _offload.place(state, placed)  # offloaded leaves live in pinned_host


def init_state(
    params: PyTree | Callable[[], PyTree],
    tx: ShardedTransformation,
    policy: ZeroPolicy,
    *,
    model_state: PyTree = None,
) -> TrainState:
    """Create the :class:`TrainState`, every leaf placed per ``policy``.

    The state is created inside ``jax.jit`` with output shardings, so the
    optimizer state (and, in stage 3, the parameters) is only ever created
    in pieces. ``params`` may be a pytree of arrays, a zero-argument function
    returning one (then the whole parameters never exist in stage 3 either),
    or a pytree of ``jax.ShapeDtypeStruct`` (then the result is abstract:
    ``ShapeDtypeStruct``s carrying their shardings, for planning). Floating
    leaves are cast to the policy's ``param_dtype`` (the master copy) and
    ``compute_dtype`` (``state.params``). A Python number leaf is converted
    to a scalar array (``int`` -> ``int32``, ``bool`` -> ``bool``, ``float``
    -> the float dtypes above); any other non-array leaf is refused, naming
    it; ``None`` is an empty subtree, as everywhere in JAX. Non-float leaves
    (int counters, bool masks) pass through training untouched: never
    differentiated, no gradient, no communication, whole on every device.

    ``model_state`` (optional): non-trainable state the loss updates (batch
    statistics, RNG counts, an ``eqx.nn.State``): a pytree of arrays (or
    ``jax.ShapeDtypeStruct``s for an abstract state), kept in its own dtypes
    and replicated on every device as ``state.model_state``. Train it with
    ``make_train_step(..., stateful=True)``.

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh)
    >>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    >>> state = zj.init_state({"w": jnp.ones((1000, 3))}, tx, policy)
    >>> state.params["w"].shape  # stored padded to a multiple of N; full_params undoes it
    (1000, 3)
    """
    _check_tx(tx, policy, "init_state")
    # Several processes: agree on the policy before the first collective, so
    # a mismatch is an error on every process rather than a hang.
    check_same_on_all_processes("zj.init_state", policy_fingerprint(policy))
    # A factory is a callable with no array leaves: an Equinox module is callable
    # too, but it is a pytree of parameters.
    factory = callable(params) and not any(hasattr(x, "shape") for x in jax.tree.leaves(params))
    abstract_only = not factory and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if abstract_only:  # only ever traced, under eval_shape: nothing is allocated
        make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)  # noqa: E731
    elif factory:
        make = lambda: _param_values(params())  # noqa: E731
    else:
        params = _param_values(params)
        if jax.process_count() > 1:
            # Arrays on this process's devices cannot enter a program over every
            # process's devices: pass them as host values (each process holds them).
            params = jax.tree.map(
                lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x, params
            )
        make = lambda: params  # noqa: E731
    prec = policy.precision
    layouts = _with_dtype(policy.layouts(jax.eval_shape(make)), prec.param_dtype)
    model_state = _model_state_values(model_state)

    def build() -> TrainState:
        logical = cast_floats(make(), prec.param_dtype)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=_stored_params(cast_floats(logical, prec.compute_dtype), layouts, policy),
            opt_state=tx.init(logical),
            master=store(logical, layouts, policy, policy.partitions_opt_state, axes=policy.state_axes)
            if prec.mixed
            else None,
            loss_scale=LossScaleState.create(prec.loss_scale) if prec.loss_scale is not None else None,
            model_state=jax.tree.map(
                lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, model_state
            ),
            policy=policy,
            layouts=TreeLayouts.of(layouts),
        )

    shardings = _state_shardings(jax.eval_shape(build))
    if abstract_only:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(build), shardings
        )
    return jax.jit(build, out_shardings=shardings)()


NOT_AN_ARRAY = (
    "init_state: {count} parameter leaf/leaves are not arrays: {listing}. Parameters must be a pytree of "
    "arrays (Python numbers are converted; None is an empty subtree): keep other values (strings, "
    "functions, configs) out of the parameter tree, e.g. in the loss's closure."
)


def _param_values(params: PyTree) -> PyTree:
    """Parameters as arrays: a Python ``bool``/``int``/``float`` leaf becomes
    a scalar array (``int32``, ``bool``, or a float cast to the policy's
    dtypes); anything else that is not an array is refused, naming each leaf."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    bad = [f"'{path_str(p)}' ({type(x).__name__})" for p, x in pairs if not _array_like(x)]
    if bad:
        raise TypeError(NOT_AN_ARRAY.format(count=len(bad), listing=", ".join(bad)))
    numbers = (bool, int, float, np.number, np.bool_)
    return jax.tree.unflatten(treedef, [jnp.asarray(x) if isinstance(x, numbers) else x for _, x in pairs])


def _array_like(x: Any) -> bool:
    if isinstance(x, (bool, int, float, np.number, np.bool_)):
        return True
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _model_state_values(model_state: PyTree) -> PyTree:
    """Model state as arrays (``ShapeDtypeStruct``s kept): Python numbers
    become arrays; on several processes, arrays on this process's devices
    become host values (each process holds them)."""
    if model_state is None:
        return None

    def one(path: Any, x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            if jax.process_count() > 1 and x.is_fully_addressable:
                return np.asarray(x)
            return x
        if not hasattr(x, "shape") and not isinstance(x, (bool, int, float, complex)):
            raise TypeError(
                f"init_state: model_state leaf '{path_str(path)}' is a {type(x).__name__}, not an array; model "
                "state must be a pytree of arrays. Keep other values out of it (e.g. in the loss's closure)."
            )
        return jnp.asarray(x)

    return jax.tree_util.tree_map_with_path(one, model_state)


def full_params(state: TrainState) -> PyTree:
    """The ordinary parameters: logical shapes, whole on every device, in
    ``param_dtype`` (the float32 master copy under mixed precision).

    The result is a fresh copy, valid after the next train step (which
    consumes the state's own buffers). When they are partitioned this gathers them (use it for evaluation and
    export, not inside a training loop on a model too big for one device).
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"full_params: expected a zero_jax TrainState, got {type(state).__name__}.")
    check_live(state, where="full_params")
    policy = state.policy
    layouts = state.layouts.tree()
    if state.master is not None:
        stored, partitioned = state.master, policy.partitions_opt_state
    else:
        stored, partitioned = state.params, policy.partitions_params
    if not partitioned:  # a copy: the state's own buffers are donated to the next step
        return jax.jit(lambda t: jax.tree.map(jnp.copy, t))(stored)
    return jax.jit(lambda t: _unstore(t, layouts, policy))(stored)


def _unstore(stored: PyTree, layouts: PyTree, policy: ZeroPolicy) -> PyTree:
    logical = to_logical(stored, layouts, policy, False)  # replicated: the cut axes do not matter
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, policy.replicated()), logical)


def _split_loss(out: Any) -> tuple[jax.Array, Any]:
    if isinstance(out, tuple) and len(out) == 2:
        return out[0], out[1]
    return out, None


def _split_stateful(out: Any) -> tuple[Any, PyTree]:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            "make_train_step(..., stateful=True): loss_fn(params, model_state, batch) must return "
            "(out, new_model_state), where out is what an ordinary loss returns (loss or (loss, aux)); got "
            f"{type(out).__name__}{'' if not isinstance(out, tuple) else f' of length {len(out)}'}."
        )
    return out[0], out[1]


def _check_model_state(old: PyTree, new: PyTree) -> None:
    """The new model state must be the old one's tree with the same shapes and dtypes."""
    old_pairs, old_def = jax.tree_util.tree_flatten_with_path(old)
    new_pairs, new_def = jax.tree_util.tree_flatten_with_path(new)
    fix = (
        "The step keeps the model state in one fixed layout: return a state with the same tree, shapes and "
        "dtypes as the one loss_fn received (cast updated values back, e.g. new.astype(old.dtype))."
    )
    if old_def != new_def:
        old_paths = {path_str(p) for p, _ in old_pairs}
        new_paths = {path_str(p) for p, _ in new_pairs}
        missing, extra = sorted(old_paths - new_paths), sorted(new_paths - old_paths)
        detail = f"missing {missing[:6]}, unexpected {extra[:6]}" if missing or extra else f"{old_def} became {new_def}"
        raise ValueError(
            f"make_train_step: loss_fn returned a new model state whose tree differs from the old one: {detail}. {fix}"
        )
    for (path, a), (_, b) in zip(old_pairs, new_pairs, strict=True):
        a_shape, b_shape = tuple(jnp.shape(a)), tuple(jnp.shape(b))
        a_dtype, b_dtype = (x.dtype if hasattr(x, "dtype") else jnp.result_type(x) for x in (a, b))
        if a_shape != b_shape or a_dtype != b_dtype:
            raise ValueError(
                f"make_train_step: loss_fn returned model state leaf '{path_str(path)}' with shape {b_shape} and "
                f"dtype {b_dtype}, but it was {a_shape} {a_dtype}. {fix}"
            )


def _agree(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """One replicated value of a per-device model state leaf: floats are
    averaged over the batch axes, anything else (counts, keys, flags) must
    agree across devices and is taken as its maximum."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jax.lax.pmean(x, axes)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jax.lax.pmax(jax.random.key_data(x), axes), impl=jax.random.key_impl(x))
    if x.dtype == jnp.bool_:
        return jax.lax.pmax(x.astype(jnp.int32), axes).astype(jnp.bool_)
    return jax.lax.pmax(x, axes)


def _check_scalar_loss(loss: Any) -> None:
    shape = getattr(loss, "shape", None)
    if shape is None or shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            "make_train_step: loss_fn(params, batch) must return a float scalar (the mean loss "
            "over its batch), optionally as (loss, aux); got "
            f"{type(loss).__name__} with shape {shape} and dtype {getattr(loss, 'dtype', None)}. "
            "Reduce it with jnp.mean before returning."
        )


BATCH_SIZES_DIFFER = (
    "train_step: the batch leaves have different leading (batch) sizes: {listing}. Every batch leaf holds "
    "one row per example along its leading dimension, so they must all agree; pass the same number of "
    "examples in each (e.g. x and y of one batch)."
)


def _check_batch_sizes(batch: PyTree) -> None:
    """Every batch leaf must have the same leading size (one row per example)."""
    pairs = [(path_str(p), tuple(getattr(x, "shape", ()))) for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]]
    sizes = {shape[0] for _, shape in pairs if shape}
    if len(sizes) > 1:
        listing = ", ".join(f"'{p}' {shape}" for p, shape in pairs)
        raise ValueError(BATCH_SIZES_DIFFER.format(listing=listing))


class TrainStep:
    """A jit-compiled ZeRO train step: ``state, metrics = step(state, batch)``.

    ``step.lower(state, batch).compile()`` works as for any ``jax.jit``
    function; the old state is donated. ``step.grads(state, batch)`` returns
    the batch-mean gradient as the policy holds it (for inspection).
    Made by :func:`make_train_step`.
    """

    def __init__(
        self,
        loss_fn: Callable[[PyTree, PyTree], Any],
        tx: ShardedTransformation,
        policy: ZeroPolicy,
        *,
        gather: Literal["all", "manual"],
        accum_steps: int,
        accum_mode: Literal["local", "partitioned"],
        clip_norm: float | None,
        donate: bool,
        stateful: bool = False,
    ) -> None:
        self.loss_fn = loss_fn
        self.stateful = stateful
        self.tx = tx
        self.policy = policy
        self.gather = gather
        self.accum_steps = accum_steps
        self.accum_mode = accum_mode
        self.clip_norm = clip_norm
        batch_sharding = policy.batch_sharding()
        self.jitted = jax.jit(self._step, in_shardings=(None, batch_sharding), donate_argnums=(0,) if donate else ())
        self._grads_jitted = jax.jit(
            functools.partial(self._grads, for_optimizer=False), in_shardings=(None, batch_sharding)
        )
        functools.update_wrapper(self, loss_fn, updated=())

    # -- the public face -------------------------------------------------------------

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        self._validate(state, batch)
        return self.jitted(state, batch)

    def lower(self, state: TrainState, batch: PyTree) -> Any:
        self._validate(state, batch)
        return self.jitted.lower(state, batch)

    def grads(self, state: TrainState, batch: PyTree) -> PyTree:
        """The batch-mean gradient as the policy holds it: in the reduce dtype
        (float32 accumulators when accumulating), partitioned and padded in
        stages 2–3, whole in stages 0–1; ``None`` for frozen leaves. Loss
        scaling is not undone here."""
        self._validate(state, batch)
        return self._grads_jitted(state, batch)[0]

    # -- checks with errors that say what to do -----------------------------------------

    def _validate(self, state: Any, batch: PyTree) -> None:
        policy = self.policy
        if not isinstance(state, TrainState):
            raise TypeError(
                f"train_step: expected a zero_jax TrainState, got {type(state).__name__}. "
                "Create it with zj.init_state(params, tx, policy)."
            )
        check_live(state, where="train_step")
        if state.policy != policy:
            raise ValueError(
                f"train_step: the state is laid out for {state.policy!r}, but this step is for "
                f"{policy!r}. Re-create the state with zj.init_state(params, tx, policy), or move it "
                "with zj.restore(..., policy=policy)."
            )
        check_tree(
            state.params,
            state.layouts,
            "train_step: the parameter tree changed between init and step; it",
            "Re-create the state with zj.init_state(new_params, tx, policy) after changing the model.",
        )
        for (path, leaf), lay in zip(
            jax.tree_util.tree_flatten_with_path(state.params)[0], state.layouts.layouts, strict=True
        ):
            if tuple(leaf.shape) != self._stored_shape(lay):
                raise ValueError(
                    f"train_step: parameter '{path_str(path)}' has shape {tuple(leaf.shape)}, but this "
                    f"policy stores it as {self._stored_shape(lay)}. Build the state with "
                    "zj.init_state(params, tx, policy) rather than by hand."
                )
        opt = state.opt_state
        if not isinstance(opt, ShardedOptState) or opt.policy != policy or opt.params != state.layouts:
            raise ValueError(
                "train_step: the optimizer state belongs to another policy or another parameter "
                "tree than the parameters. Create both together with zj.init_state(params, tx, policy)."
            )
        expected = self._expected_opt_state(state.layouts)
        if jax.tree.structure(expected) != jax.tree.structure(opt) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(opt), strict=True)
        ):
            raise ValueError(
                "train_step: the optimizer state was made by another optimizer than this step's tx. "
                "Create the state with zj.init_state(params, tx, policy) using the same tx."
            )
        if self.stateful and state.model_state is None:
            raise ValueError(
                "train_step: this step was made with make_train_step(..., stateful=True), but the state has no "
                "model_state. Create the state with zj.init_state(params, tx, policy, model_state=...) (for an "
                "adapted model: adapted.init_state(tx, policy)), or make the step without stateful=True."
            )
        if not self.stateful and state.model_state is not None:
            raise ValueError(
                "train_step: the state carries a model_state, but this step was made without stateful=True, so "
                "it would never update it. Make the step with zj.make_train_step(..., stateful=True) and a "
                "loss_fn(params, model_state, batch) -> (out, new_model_state) (for an adapted model: "
                "adapted.make_train_step(tx, policy)), or create the state without model_state."
            )
        if state.model_state is not None:
            for path, leaf in jax.tree_util.tree_flatten_with_path(state.model_state)[0]:
                if not isinstance(leaf, jax.Array):
                    raise TypeError(
                        f"train_step: model_state leaf '{path_str(path)}' is a {type(leaf).__name__}, not a "
                        "jax.Array. Create the state with zj.init_state(..., model_state=...)."
                    )
        _check_batch_sizes(batch)
        policy.check_batch(batch, where="train_step", microbatches=self.accum_steps)

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a step object lives as long as its training run
    def _expected_opt_state(self, layouts: TreeLayouts) -> PyTree:
        return jax.eval_shape(self.tx.init, jax.eval_shape(lambda: full_shapes(layouts)))

    @functools.lru_cache(maxsize=8)  # noqa: B019
    def _frozen(self, layouts: TreeLayouts) -> PyTree:
        """Leaves the step never differentiates: those the optimizer never
        changes (see ``zj.frozen_leaves``) and every non-float leaf (an int
        counter, a bool mask), which passes through the step untouched."""
        frozen = frozen_leaves(self.tx.inner, jax.eval_shape(lambda: full_shapes(layouts)))
        return jax.tree.map(lambda fz, lay: bool(fz) or not _is_float(lay), frozen, layouts.tree(), is_leaf=is_layout)

    def _stored_shape(self, lay: LeafLayout) -> tuple[int, ...]:
        return lay.stored_shape if self.policy.partitions_params else lay.shape

    # -- the program ---------------------------------------------------------------------

    def _grads(
        self, state: TrainState, batch: PyTree, *, for_optimizer: bool
    ) -> tuple[PyTree, jax.Array, Any, Any, PyTree]:
        """Reduced gradients, loss, aux, the global squared norm of the
        unscaled gradients and the new model state (``None`` unless
        stateful), in one ``shard_map``.

        With ``for_optimizer`` (the step) gradients come back partitioned
        from stage 1 on (the optimizer works on pieces); otherwise as the
        policy holds them (whole in stage 1).
        """
        policy = self.policy
        stage, prec = policy.stage, policy.precision
        # Collectives run within the partition axes; on a hybrid mesh the
        # replica axes split the batch too and see only the 1/N pieces.
        axis, n, k = policy.comm, policy.num_shards, self.accum_steps
        batch_shards = policy.num_batch_shards
        layouts = state.layouts.tree()
        frozen = self._frozen(state.layouts)
        manual = self.gather == "manual"
        local = k > 1 and self.accum_mode == "local"
        # Stages 2-3 reduce-scatter each gradient inside the backward pass, into
        # a zero "slot" piece -- except when accumulating locally, where every
        # microbatch's gradient stays whole and is reduced once at the end.
        slots = stage >= 2 and not local
        scale_loss = state.loss_scale is not None

        def cut(lay: LeafLayout) -> bool:
            """Whether this leaf's reduced gradient is a piece."""
            return lay.dim is not None and (stage >= 2 or (stage == 1 and for_optimizer))

        stateful = self.stateful
        touched: list[bool] = []  # per model-state leaf: did the loss return a new value (set while tracing)

        def body(
            params: PyTree, local_batch: PyTree, scale: jax.Array, model_state: PyTree
        ) -> tuple[PyTree, jax.Array, Any, jax.Array, PyTree]:
            if policy.offload_params and (local or not manual):
                # Host pieces to the device; the manual path moves each piece in zj.gather
                # (one layer at a time in scan_layers), these gather everything anyway.
                params = jax.tree.map(_offload.to_device, params)
            if stage == 3 and local:
                # Local accumulation in stage 3: gather once per step (Ψ), compute
                # every microbatch on the whole parameters, reduce-scatter once (Ψ).
                params = jax.tree.map(lambda p, lay: coll.fetch(p, lay, axis, gather=True), params, layouts)
                params_are_pieces = False
            else:
                params_are_pieces = stage == 3

            def diff_var(p: jax.Array, lay: LeafLayout, fz: bool) -> jax.Array | None:
                """What the gradient is taken against, per leaf."""
                if fz:
                    return None
                if slots and lay.dim is not None:
                    return coll.zeros_like_piece(lay, n, axis, prec.reduce_dtype)
                return coll.to_varying(p, axis)

            def handed(p: jax.Array, d: jax.Array | None, lay: LeafLayout) -> Any:
                """What loss_fn receives for one leaf."""
                partitioned_use = lay.dim is not None and (slots or (params_are_pieces and d is None))
                if not partitioned_use:
                    return d if d is not None else p
                gather = params_are_pieces
                if manual:
                    return Sharded((p,) if d is None else (p, d), lay, stage)
                if d is None:
                    return coll.fetch(p, lay, axis, gather=gather)
                return coll.fetch_with_grad_slot(p, d, lay, axis, gather=gather)

            def micro(d: PyTree, mb: PyTree, ms: PyTree) -> tuple[jax.Array, tuple[jax.Array, Any, PyTree]]:
                tree = _per_leaf(handed, layouts, params, d)
                args = (tree, ms, mb) if stateful else (tree, mb)
                if manual:
                    with manual_gather_scope(policy, pieces=slots or params_are_pieces):
                        out = self.loss_fn(*args)
                else:
                    out = self.loss_fn(*args)
                new_ms = None
                if stateful:
                    out, new_ms = _split_stateful(out)
                    _check_model_state(ms, new_ms)
                    # A leaf the loss returned untouched (the very value it received) keeps
                    # its value bitwise: it is neither averaged nor combined.
                    new_leaves, treedef = jax.tree.flatten(new_ms)
                    touched[:] = [n is not o for n, o in zip(new_leaves, jax.tree.leaves(ms), strict=True)]
                    # Per device until the step combines them (a count that does not
                    # depend on the batch is typed per-device too, for the scan carry).
                    new_ms = jax.tree.unflatten(treedef, [coll.to_varying(x, axis) for x in new_leaves])
                loss, aux = _split_loss(out)
                _check_scalar_loss(loss)
                # Each device's loss / (devices k): the summed gradient is the global mean.
                scaled = loss.astype(jnp.float32) / (batch_shards * k)
                if scale_loss:
                    scaled = scaled * scale
                return scaled, (loss.astype(jnp.float32), aux, new_ms)

            if stage == 3 and not manual and not local:
                # Stage 3 gathers inside jax.checkpoint and keeps only matmul outputs
                # (activations) for the backward pass: everything computed from the
                # gathered parameters is recomputed, so the backward pass gathers again
                # (ZeRO-3's 3Ψ) instead of holding whole parameters from forward to
                # backward. (A name-based policy is not enough: ops applied after the
                # gather -- unpadding, the model's own transposes and casts -- would
                # produce unnamed whole-parameter values that get saved instead.)
                micro = jax.checkpoint(micro, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
            grad_fn = jax.value_and_grad(micro, has_aux=True)
            diff = jax.tree.map(diff_var, params, layouts, frozen)

            def reduce(g: jax.Array | None, lay: LeafLayout) -> jax.Array | None:
                """One local gradient -> its reduced form (sum over the data axis)."""
                if g is None:
                    return None
                if slots and lay.dim is not None:
                    return g  # reduce-scattered by the backward pass already
                g = g.astype(prec.reduce_dtype)
                if cut(lay):
                    return coll.sum_reduce_scatter(g, lay, axis)
                return coll.sum_all_reduce(g, axis)

            def reduce_all(g: PyTree) -> PyTree:
                return _per_leaf(reduce, layouts, g)

            def across_replicas(g: PyTree) -> PyTree:
                """Pieces summed within the partition axes -> summed over the
                replicas too, once per step (after accumulation)."""
                return _per_leaf(
                    lambda x, lay: x if x is None or not cut(lay) else coll.reduce_across_replicas(x, lay, axis),
                    layouts,
                    g,
                )

            if k == 1:
                (_, (loss, aux, new_ms)), g = grad_fn(diff, local_batch, model_state)
                grads = across_replicas(reduce_all(g))
            else:
                micro_batches = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), local_batch)
                acc_dtype = prec.param_dtype

                def accumulate(carry: tuple[PyTree, PyTree], mb: PyTree) -> tuple[tuple[PyTree, PyTree], Any]:
                    acc, ms = carry  # the model state flows through the microbatches in order
                    (_, (loss, aux, new_ms)), g = grad_fn(diff, mb, ms)
                    g = g if local else reduce_all(g)  # partitioned mode: reduce every microbatch
                    acc = jax.tree.map(lambda a, x: a + x.astype(acc_dtype), acc, g)
                    return (acc, new_ms), (loss, aux)

                example = jax.eval_shape(
                    lambda: grad_fn(diff, jax.tree.map(lambda x: x[0], micro_batches), model_state)[1]
                )
                if not local:
                    example = jax.eval_shape(reduce_all, example)

                def zeros(x: jax.ShapeDtypeStruct | None, lay: LeafLayout) -> jax.Array | None:
                    if x is None:  # frozen or non-float: no gradient, no accumulator
                        return None
                    z = jnp.zeros(x.shape, acc_dtype)
                    # Whole local gradients and pieces differ per device; all-reduced
                    # gradients are the same everywhere (and must be typed so).
                    per_device = local or cut(lay) or (slots and lay.dim is not None)
                    return coll.to_varying(z, axis) if per_device else z

                acc0 = _per_leaf(zeros, layouts, example)
                ms0 = jax.tree.map(lambda x: coll.to_varying(x, axis), model_state) if stateful else None
                (acc, new_ms), (losses, auxes) = jax.lax.scan(accumulate, (acc0, ms0), micro_batches)
                grads = across_replicas(reduce_all(acc) if local else acc)
                loss = jnp.mean(losses)
                aux = jax.tree.map(
                    lambda a: jnp.mean(a, 0) if jnp.issubdtype(a.dtype, jnp.inexact) else jnp.sum(a, 0), auxes
                )

            # The global squared norm of the unscaled gradients, in one scalar
            # all-reduce: pieces differ per device and are summed; whole gradients
            # are the same everywhere. It doubles as the overflow check: any inf or
            # NaN anywhere makes it non-finite on every device alike.
            def unscaled(g: jax.Array) -> jax.Array:
                g = g.astype(jnp.float32)
                return g / scale if scale_loss else g

            part, whole = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
            layout_leaves = jax.tree.leaves(layouts, is_leaf=is_layout)
            for g, lay in zip(_leaves(grads, layouts), layout_leaves, strict=True):
                if g is None:
                    continue
                u = unscaled(g)
                if cut(lay):
                    part = part + jnp.sum(u * u)
                else:
                    whole = whole + jnp.sum(u * u)
            any_cut = any(cut(lay) for lay, fz in zip(layout_leaves, _leaves(frozen, layouts), strict=True) if not fz)
            sq_norm = (jax.lax.psum(part, policy.state_axes) if any_cut else part) + whole
            every = axis.all
            loss = jax.lax.pmean(loss, every)
            aux = jax.tree.map(
                lambda a: jax.lax.pmean(a, every) if jnp.issubdtype(a.dtype, jnp.inexact) else jax.lax.psum(a, every),
                aux,
            )
            if stateful:
                # Data-parallel model state: each device updated it from its own slice;
                # floats are averaged over every batch axis, the rest must agree (max).
                new_leaves, treedef = jax.tree.flatten(new_ms)
                new_ms = jax.tree.unflatten(
                    treedef,
                    [
                        _agree(x, every) if t else old
                        for x, t, old in zip(new_leaves, touched, jax.tree.leaves(model_state), strict=True)
                    ],
                )
            return grads, loss, aux, sq_norm, new_ms

        def spec(lay: LeafLayout, partitioned: bool, axes: tuple[str, ...]) -> PartitionSpec:
            return lay.spec(axes) if partitioned else PartitionSpec()

        param_specs = jax.tree.map(
            lambda lay: spec(lay, policy.partitions_params, policy.axes), layouts, is_leaf=is_layout
        )
        grad_specs = jax.tree.map(
            lambda lay, fz: None if fz else spec(lay, cut(lay), policy.state_axes), layouts, frozen, is_leaf=is_layout
        )
        scale = state.loss_scale.scale if scale_loss else jnp.ones((), jnp.float32)
        return jax.shard_map(
            body,
            mesh=policy.auto_mesh,
            in_specs=(param_specs, policy.batch_sharding().spec, PartitionSpec(), PartitionSpec()),
            out_specs=(grad_specs, PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec()),
            # JAX 0.10 cannot type a collective over a vmap axis (a batch norm's
            # pmean over jax.vmap(..., axis_name=...), as eqx.nn.BatchNorm does)
            # inside a vma-checked shard_map; stateful steps run unchecked.
            check_vma=not stateful,
        )(state.params, batch, scale, state.model_state if stateful else None)

    def _gather_updated(self, pieces: PyTree, layouts: PyTree) -> PyTree:
        """Stages 1–2: all-gather the updated parameter pieces (cut over the
        optimizer's axes); every device gets the whole, unpadded parameters
        back. Stage 3 with ``optimizer_over_replicas``: all-gather across the
        replica axes only, into the parameters' 1/N pieces (still padded)."""
        policy = self.policy
        specs = jax.tree.map(lambda lay: lay.spec(policy.state_axes), layouts, is_leaf=is_layout)
        if policy.partitions_params:
            out_specs = jax.tree.map(lambda lay: lay.spec(policy.axes), layouts, is_leaf=is_layout)
            gather = lambda x, lay: coll.gather_replicated(x, lay, policy.replica_axes, unpadded=False)  # noqa: E731
        else:
            out_specs = PartitionSpec()
            gather = lambda x, lay: coll.gather_replicated(x, lay, policy.state_axes)  # noqa: E731
        return jax.shard_map(
            lambda p: jax.tree.map(gather, p, layouts),
            mesh=policy.auto_mesh,
            in_specs=(specs,),
            out_specs=out_specs,
        )(pieces)

    def _step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        policy = self.policy
        prec = policy.precision
        layouts = state.layouts.tree()
        frozen = self._frozen(state.layouts)
        grads, loss, aux, sq_norm, new_model_state = self._grads(state, batch, for_optimizer=True)
        grad_norm = jnp.sqrt(sq_norm)
        scale = state.loss_scale.scale if state.loss_scale is not None else None

        def to_optimizer(g: jax.Array | None, lay: LeafLayout) -> jax.Array:
            if g is None:  # frozen or non-float: the optimizer never reads it (compiled away)
                partitioned = policy.partitions_opt_state and lay.dim is not None
                shape = lay.stored_shape if partitioned else lay.shape
                return jnp.zeros(shape, prec.param_dtype if _is_float(lay) else lay.dtype)
            g = g.astype(prec.param_dtype)
            if scale is not None:
                g = g / scale
            if self.clip_norm is not None:
                # optax.clip_by_global_norm's formula, on the global norm.
                g = jax.lax.select(grad_norm < self.clip_norm, g, (g / grad_norm.astype(g.dtype)) * self.clip_norm)
            return g

        grads = _per_leaf(to_optimizer, layouts, grads)

        # The optimizer's view of the parameters: the float32 master copy
        # (partitioned from stage 1), or the parameters themselves.
        if state.master is not None:
            master = state.master
        elif policy.stage in (1, 2) or policy.optimizer_over_replicas:
            # This device's piece of the optimizer's cut (a local slice).
            master = store(state.params, layouts, policy, True, axes=policy.state_axes)
        else:
            master = state.params

        def update(master: PyTree, opt_state: ShardedOptState) -> tuple[PyTree, ShardedOptState]:
            updates, opt_state = self.tx.update(grads, opt_state, master)
            return optax.apply_updates(master, updates), opt_state

        if policy.offload_optimizer or policy.offload_params:
            update = _offload.stream_update(update, master, state, _state_shardings(state))
        if state.loss_scale is None:
            finite = jnp.asarray(True)
            new_master, opt_state = update(master, state.opt_state)
        else:
            # An overflow anywhere skips the step everywhere: the flag comes from
            # the all-reduced norm, so every device takes the same branch.
            finite = jnp.isfinite(sq_norm)
            new_master, opt_state = jax.lax.cond(finite, update, lambda m, o: (m, o), master, state.opt_state)
            if self.stateful:  # a skipped step keeps the old model state too
                new_model_state = jax.lax.cond(finite, lambda n, o: n, lambda n, o: o, new_model_state,
                                               state.model_state)  # fmt: skip

        if policy.offload_optimizer or policy.offload_params:
            new_master = _offload.for_compute(new_master, _state_shardings(state).params, prec.compute_dtype)
        compute = cast_floats(new_master, prec.compute_dtype)
        if policy.stage in (1, 2) or policy.optimizer_over_replicas:
            # The updated pieces, cut over the optimizer's axes, are all-gathered:
            # into whole parameters (stages 1-2), or across the replicas into
            # parameter pieces (stage 3 with the optimizer cut R times finer).
            # Only what changed: frozen leaves keep their copy.
            compute = store(compute, layouts, policy, True, axes=policy.state_axes)
            trained_layouts = jax.tree.map(lambda lay, fz: None if fz else lay, layouts, frozen, is_leaf=is_layout)
            trained = jax.tree.map(lambda c, fz: None if fz else c, compute, frozen)
            gathered = self._gather_updated(trained, trained_layouts)
            params = jax.tree.map(lambda old, new: old if new is None else new, state.params, gathered)
        else:
            params = compute
        # Non-float leaves pass through bitwise (an optimizer's weight decay
        # would otherwise touch an int counter), and the optimizer state keeps
        # its dtypes (an int leaf's moments stay int).
        params = _keep_non_float(params, state.params, layouts)
        if state.master is not None:
            new_master = _keep_non_float(new_master, state.master, layouts)
        opt_state = jax.tree.map(_same_dtype, opt_state, state.opt_state)
        new_state = state.replace(
            step=state.step + 1,
            params=_stored_params(params, _with_dtype(layouts, prec.compute_dtype), policy),
            opt_state=opt_state,
            master=new_master if state.master is not None else None,
            loss_scale=None if state.loss_scale is None else state.loss_scale.next(finite, prec.loss_scale),
            model_state=new_model_state if self.stateful else state.model_state,
        )
        if policy.offload_optimizer or policy.offload_params:
            new_state = _offload.to_memory_kinds(new_state, _state_shardings(new_state))
        new_state = jax.tree.map(jax.lax.with_sharding_constraint, new_state, _state_shardings(new_state))
        metrics: dict[str, Any] = {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(sq_norm)}
        if aux is not None:
            metrics["aux"] = aux
        if state.loss_scale is not None:
            metrics["loss_scale"] = new_state.loss_scale.scale
            metrics["skipped"] = (~finite).astype(jnp.int32)
        return new_state, metrics


def _is_float(lay: LeafLayout) -> bool:
    return bool(jnp.issubdtype(lay.dtype, jnp.inexact))


def _keep_non_float(new: PyTree, old: PyTree, layouts: PyTree) -> PyTree:
    """``new`` with every non-float leaf replaced by its ``old`` value."""
    return jax.tree.map(lambda n, o, lay: n if _is_float(lay) else o, new, old, layouts)


def _same_dtype(new: jax.Array, old: jax.Array) -> jax.Array:
    return new if new.dtype == old.dtype else new.astype(old.dtype)


def _leaves(tree: PyTree, layouts: PyTree) -> list[Any]:
    """The values of ``tree`` at the parameter leaves, ``None`` (a frozen
    leaf's gradient) kept in place; a ``None`` parameter subtree has none."""
    return jax.tree.structure(layouts, is_leaf=is_layout).flatten_up_to(tree)


def _per_leaf(fn: Callable[..., Any], layouts: PyTree, *trees: PyTree) -> PyTree:
    """``fn(*values, layout)`` at each parameter leaf: the trees' values there
    may be ``None`` (a frozen leaf's gradient), and a ``None`` parameter
    subtree is empty (as in JAX)."""
    return jax.tree.map(lambda lay, *xs: fn(*xs, lay), layouts, *trees, is_leaf=is_layout)


def full_shapes(layouts: TreeLayouts) -> PyTree:
    """Zeros of the logical parameter shapes (for ``eval_shape`` only)."""
    return jax.tree.map(lambda lay: jnp.zeros(lay.shape, lay.dtype), layouts.tree(), is_leaf=is_layout)


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], Any],
    tx: ShardedTransformation,
    policy: ZeroPolicy,
    *,
    gather: Literal["all", "manual"] = "all",
    accum_steps: int = 1,
    accum_mode: Literal["local", "partitioned"] | None = None,
    clip_norm: float | None = None,
    donate: bool = True,
    stateful: bool = False,
) -> TrainStep:
    """Build the jit-compiled train step for ``policy``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``: the mean
        loss over the batch it is given (each device gives it its slice of
        the global batch). It receives ordinary, whole parameters in every
        stage. Float aux leaves are averaged over the data axis, integer ones
        summed.
      tx: the optimizer, wrapped by :func:`shard_optimizer` for ``policy``.
      policy: the :class:`ZeroPolicy`.
      gather: ``"all"``: the step hands ``loss_fn`` whole parameters (in
        stage 3 it gathers them inside ``jax.checkpoint``, so the backward
        pass gathers again rather than keeping the model alive).
        ``"manual"``: ``loss_fn`` receives the partitioned parameters and
        gathers what it uses itself, layer by layer, with ``zj.gather`` and
        ``zj.scan_layers`` (ZeRO-3 that never holds the whole model; in
        stages 0–1 both are the identity / a plain scan).
      accum_steps: split each device's batch into this many microbatches,
        scanned inside the one compiled step; the update equals one step on
        the whole batch.
      accum_mode: ``"partitioned"`` reduces every microbatch's gradient
        (reduce-scatter from stage 1) into a partitioned float32 accumulator:
        stage 2/3 memory, ``accum_steps`` reductions per step. ``"local"``
        accumulates whole gradients on each device and reduces once: one
        reduction per step, but a whole float32 accumulator (stage 1 memory;
        stage 3 gathers the parameters once per step). Default: partitioned
        in stages 2–3 (their point is memory), local in stages 0–1 (nothing
        to save by reducing more often). Pick local when communication is
        the bottleneck and the whole gradient fits.
      clip_norm: clip the gradient to this global norm (computed across all
        pieces with one scalar all-reduce), exactly as
        ``optax.clip_by_global_norm`` on unsharded gradients.
      donate: donate the old state's buffers to the new one.
      stateful: the model has non-trainable state that training updates
        (batch-norm statistics, RNG counts): ``loss_fn(params, model_state,
        batch) -> (out, new_model_state)``, where ``out`` is what an ordinary
        loss returns (``loss`` or ``(loss, aux)``) and ``new_model_state`` has
        the tree, shapes and dtypes of ``model_state``. The state must carry
        it (``zj.init_state(..., model_state=...)``). Each device runs the
        loss on its slice of the batch (threading the model state through
        its microbatches in order when accumulating); the new state is then
        made one replicated value, as data-parallel training does: float
        leaves are averaged over the devices (``jax.lax.pmean`` over the batch
        axes: batch norm with per-device batch statistics, like PyTorch DDP),
        integer, boolean and key leaves must agree across devices and their
        maximum is taken (``pmax``). A float16 step skipped for overflow keeps
        the old model state.

    Returns:
      A :class:`TrainStep`: ``state, metrics = step(state, batch)`` with
      ``metrics["loss"]`` (global mean), ``metrics["grad_norm"]`` (the
      global norm of the mean gradient, before clipping; non-finite when any
      gradient holds an inf or NaN) and ``metrics["finite"]`` (a bool: the
      gradient norm is finite), plus ``metrics["aux"]``. To skip non-finite
      steps in float32, wrap the optimizer: ``zj.shard_optimizer(
      optax.apply_if_finite(tx, max_consecutive_errors), policy)`` keeps the
      parameters unchanged after such a step in every stage.

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=2, mesh=mesh)
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> state = zj.init_state({"w": jnp.zeros((4, 1))}, tx, policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy)
    >>> batch = {"x": jnp.ones((8 * jax.device_count(), 4)), "y": jnp.ones((8 * jax.device_count(), 1))}
    >>> state, metrics = step(state, batch)
    >>> float(metrics["loss"])
    1.0

    A stateful loss (here a running mean of the inputs, averaged over devices):

    >>> def stateful_loss(p, ms, b):
    ...     new = {"mean": 0.5 * ms["mean"] + 0.5 * jnp.mean(b["x"], 0)}
    ...     return loss_fn(p, b), new
    >>> state = zj.init_state({"w": jnp.zeros((4, 1))}, tx, policy, model_state={"mean": jnp.zeros(4)})
    >>> step = zj.make_train_step(stateful_loss, tx, policy, stateful=True)
    >>> state, metrics = step(state, batch)
    >>> state.model_state["mean"].tolist()
    [0.5, 0.5, 0.5, 0.5]
    """
    tx = _check_tx(tx, policy, "make_train_step")
    if gather not in ("all", "manual"):
        raise ValueError(
            f"make_train_step: gather must be 'all' (loss_fn gets whole parameters) or 'manual' "
            f"(loss_fn gathers them with zj.gather / zj.scan_layers), got {gather!r}."
        )
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: loss_fn must be callable, got {type(loss_fn).__name__}.")
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1:
        raise ValueError(f"make_train_step: accum_steps must be an int >= 1, got {accum_steps!r}.")
    if accum_mode is None:
        accum_mode = "partitioned" if policy.stage >= 2 else "local"
    if accum_mode not in ("local", "partitioned"):
        raise ValueError(
            f"make_train_step: accum_mode must be 'local' (reduce once per step) or 'partitioned' "
            f"(reduce every microbatch into a partitioned accumulator), got {accum_mode!r}."
        )
    if clip_norm is not None and not (
        isinstance(clip_norm, (int, float)) and math.isfinite(clip_norm) and clip_norm > 0
    ):
        raise ValueError(f"make_train_step: clip_norm must be a positive number or None, got {clip_norm!r}.")
    if not isinstance(stateful, bool):
        raise TypeError(f"make_train_step: stateful must be True or False, got {stateful!r}.")
    return TrainStep(
        loss_fn,
        tx,
        policy,
        gather=gather,
        accum_steps=accum_steps,
        accum_mode=accum_mode,
        clip_norm=None if clip_norm is None else float(clip_norm),
        donate=donate,
        stateful=stateful,
    )
