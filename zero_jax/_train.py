"""TrainState, init_state and make_train_step: one jit-compiled ZeRO step.

The step has three parts, each in the view that suits it:

1. gradients, in ``jax.shard_map``: each device runs ``loss_fn`` on its slice
   of the batch and the collectives of ``_collectives`` reduce the gradients
   (all-reduce in stage 0, reduce-scatter from stage 1; stage 3 also gathers
   the parameters for use);
2. the optimizer, in the global view: :func:`shard_optimizer` runs the
   optax update on partitioned state, where the compiler keeps elementwise
   math local and adds only the small reductions an optimizer itself needs;
3. stages 1 and 2 all-gather the updated parameter pieces in ``shard_map``.

The collectives ZeRO is about are therefore explicit (the compiler never
chooses them), which is what makes their cost provable from the program.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from zero_jax import _collectives as coll
from zero_jax._layers import Sharded, manual_gather_scope
from zero_jax._optimizer import (
    ShardedOptState,
    ShardedTransformation,
    TreeLayouts,
    check_tree,
    store,
    to_logical,
)
from zero_jax._partition import LeafLayout
from zero_jax._policy import PyTree, ZeroPolicy, path_str

_is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that lives between steps, placed per a policy.

    Attributes:
      step: the number of steps taken (an int32 scalar).
      params: the parameters in stored form: whole on every device in stages
        0–2; in stage 3 each partitioned leaf is cut (and padded) per the
        policy. ``zj.full_params(state)`` gives the ordinary parameters.
      opt_state: the :class:`ShardedOptState` of the sharded optimizer.
      policy: the policy the state is laid out for (static).
      layouts: the parameters' layouts (static).
    """

    step: jax.Array
    params: PyTree
    opt_state: ShardedOptState
    policy: ZeroPolicy = dataclasses.field(metadata={"static": True})
    layouts: TreeLayouts = dataclasses.field(metadata={"static": True})

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState, data_fields=["step", "params", "opt_state"], meta_fields=["policy", "layouts"]
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


def _state_shardings(state: TrainState) -> TrainState:
    """The sharding of every leaf of a (possibly abstract) state."""
    policy = state.policy
    param_sh = jax.tree.map(
        lambda lay: policy._named(lay, policy.partitions_params), state.layouts.tree(), is_leaf=_is_layout
    )
    opt_sh = jax.tree.map(
        lambda lay: policy._named(lay, policy.partitions_opt_state),
        state.opt_state.layouts.tree(),
        is_leaf=_is_layout,
    )
    return state.replace(
        step=policy.replicated(),
        params=param_sh,
        opt_state=ShardedOptState(opt_sh, policy, state.opt_state.params, state.opt_state.layouts),
    )


def init_state(params: PyTree | Callable[[], PyTree], tx: ShardedTransformation, policy: ZeroPolicy) -> TrainState:
    """Create the :class:`TrainState`, every leaf placed per ``policy``.

    The state is created inside ``jax.jit`` with output shardings, so the
    optimizer state (and, in stage 3, the parameters) is only ever created
    in pieces. ``params`` may be a pytree of arrays, a zero-argument function
    returning one (then the whole parameters never exist in stage 3 either),
    or a pytree of ``jax.ShapeDtypeStruct`` (then the result is abstract:
    ``ShapeDtypeStruct``s carrying their shardings, for planning).

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
    abstract_only = not callable(params) and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if abstract_only:  # only ever traced, under eval_shape: nothing is allocated
        make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)  # noqa: E731
    else:
        make = params if callable(params) else (lambda: params)
    abstract = jax.eval_shape(make)
    layouts = policy.layouts(abstract)

    def build() -> TrainState:
        logical = make()
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=_stored_params(logical, layouts, policy),
            opt_state=tx.init(logical),
            policy=policy,
            layouts=TreeLayouts.of(layouts),
        )

    shardings = _state_shardings(jax.eval_shape(build))
    if abstract_only:
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(build), shardings
        )
    return jax.jit(build, out_shardings=shardings)()


def full_params(state: TrainState) -> PyTree:
    """The ordinary parameters: logical shapes, whole on every device.

    In stage 3 this gathers them (use it for evaluation and export, not
    inside a training loop on a model too big for one device).
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"full_params: expected a zero_jax TrainState, got {type(state).__name__}.")
    policy = state.policy
    layouts = state.layouts.tree()
    if not policy.partitions_params:
        return state.params

    def unstore(params: PyTree) -> PyTree:
        logical = to_logical(params, layouts, policy, False)
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, policy.replicated()), logical)

    return jax.jit(unstore)(state.params)


def _split_loss(out: Any) -> tuple[jax.Array, Any]:
    if isinstance(out, tuple) and len(out) == 2:
        return out[0], out[1]
    return out, None


def _check_scalar_loss(loss: Any) -> None:
    shape = getattr(loss, "shape", None)
    if shape is None or shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(
            "make_train_step: loss_fn(params, batch) must return a float scalar (the mean loss "
            "over its batch), optionally as (loss, aux); got "
            f"{type(loss).__name__} with shape {shape} and dtype {getattr(loss, 'dtype', None)}. "
            "Reduce it with jnp.mean before returning."
        )


class TrainStep:
    """A jit-compiled ZeRO train step: ``state, metrics = step(state, batch)``.

    ``step.lower(state, batch).compile()`` works as for any ``jax.jit``
    function; the old state is donated. ``step.grads(state, batch)`` returns
    the batch-mean gradient as the policy holds it (for inspection).
    """

    def __init__(
        self,
        loss_fn: Callable[[PyTree, PyTree], Any],
        tx: ShardedTransformation,
        policy: ZeroPolicy,
        *,
        gather: Literal["all", "manual"] = "all",
        donate: bool = True,
    ) -> None:
        self.loss_fn = loss_fn
        self.tx = tx
        self.policy = policy
        self.gather = gather
        batch_sharding = policy.batch_sharding()
        self.jitted = jax.jit(self._step, in_shardings=(None, batch_sharding), donate_argnums=(0,) if donate else ())
        self._grads_jitted = jax.jit(
            functools.partial(self._local_grads, reduce_to_policy=True), in_shardings=(None, batch_sharding)
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
        """The batch-mean gradient in the policy's gradient form (stored:
        partitioned and padded in stages 2–3, whole in stages 0–1)."""
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
        n = policy.num_shards
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            shape = tuple(getattr(leaf, "shape", ()))
            if not shape or shape[0] % n:
                raise ValueError(
                    f"train_step: batch leaf '{path_str(path)}' has shape {shape}; its leading "
                    f"(batch) dimension must divide by the {n} devices of the data axis "
                    f"{policy.axis_name!r}. Use a global batch size that is a multiple of {n}."
                )

    @functools.lru_cache(maxsize=8)  # noqa: B019 - a step object lives as long as its training run
    def _expected_opt_state(self, layouts: TreeLayouts) -> PyTree:
        return jax.eval_shape(self.tx.init, jax.eval_shape(lambda: full_shapes(layouts)))

    def _stored_shape(self, lay: LeafLayout) -> tuple[int, ...]:
        return lay.stored_shape if self.policy.partitions_params else lay.shape

    # -- the program ---------------------------------------------------------------------

    def _local_grads(
        self, state: TrainState, batch: PyTree, *, reduce_to_policy: bool
    ) -> tuple[PyTree, jax.Array, Any]:
        """Gradients, loss and aux, reduced across the data axis.

        With ``reduce_to_policy=False`` (the step) gradients come back
        partitioned from stage 1 on (the optimizer works on pieces); with
        ``True`` they come back as the policy holds them.
        """
        policy = self.policy
        stage = policy.stage
        axis, n = policy.axis_name, policy.num_shards
        layouts = state.layouts.tree()
        partitioned_out = stage >= 1 and not (reduce_to_policy and stage == 1)
        manual = self.gather == "manual"

        def body(params: PyTree, local_batch: PyTree) -> tuple[PyTree, jax.Array, Any]:
            # Per leaf: what we differentiate against, and how it becomes the
            # whole parameter loss_fn uses.
            def diff_var(p: jax.Array, lay: LeafLayout) -> jax.Array:
                if lay.dim is None or stage < 2:
                    return coll.to_varying(p, axis)
                if stage == 2:  # a zero slot the backward pass fills with this device's piece
                    return coll.zeros_like_piece(lay, n, axis)
                return p  # stage 3: this device's piece of the parameter

            def whole(p: jax.Array, d: jax.Array, lay: LeafLayout) -> jax.Array:
                if lay.dim is None or stage < 2:
                    return d
                if stage == 2:
                    return coll.scatter_grad_in_backward(p, d, lay, axis)
                return coll.gather_for_use(d, lay, axis)

            def handed(p: jax.Array, d: jax.Array, lay: LeafLayout) -> Any:
                """gather="manual": what loss_fn receives for one leaf."""
                if lay.dim is None or stage < 2:
                    return d
                return Sharded((p, d) if stage == 2 else (d,), lay, stage)

            def scaled_loss(d: PyTree) -> tuple[jax.Array, tuple[jax.Array, Any]]:
                if manual:
                    with manual_gather_scope(policy):
                        out = self.loss_fn(jax.tree.map(handed, params, d, layouts), local_batch)
                else:
                    out = self.loss_fn(jax.tree.map(whole, params, d, layouts), local_batch)
                loss, aux = _split_loss(out)
                _check_scalar_loss(loss)
                # Each device's loss / N: the summed gradient is the global mean.
                return loss / n, (loss, aux)

            if stage == 3 and not manual:
                # Stage 3 gathers inside jax.checkpoint and keeps only matmul outputs
                # (activations) for the backward pass: everything computed from the
                # gathered parameters is recomputed, so the backward pass gathers again
                # (ZeRO-3's 3Ψ) instead of holding whole parameters from forward to
                # backward. (A name-based policy is not enough: ops applied after the
                # gather -- unpadding, the model's own transposes and casts -- would
                # produce unnamed whole-parameter values that get saved instead.)
                scaled_loss = jax.checkpoint(
                    scaled_loss, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable
                )
            diff = jax.tree.map(diff_var, params, layouts)
            (_, (loss, aux)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(diff)

            def reduce(g: jax.Array, lay: LeafLayout) -> jax.Array:
                if lay.dim is None or not partitioned_out:
                    return coll.sum_all_reduce(g, axis)
                if stage == 1:
                    return coll.sum_reduce_scatter(g, lay, axis)
                return g  # stages 2-3: the backward pass already reduce-scattered it

            grads = jax.tree.map(reduce, grads, layouts)
            loss = jax.lax.pmean(loss, axis)
            aux = jax.tree.map(
                lambda a: jax.lax.pmean(a, axis) if jnp.issubdtype(a.dtype, jnp.inexact) else jax.lax.psum(a, axis),
                aux,
            )
            return grads, loss, aux

        def spec(lay: LeafLayout, partitioned: bool) -> PartitionSpec:
            return lay.spec(policy.axes) if partitioned else PartitionSpec()

        param_specs = jax.tree.map(lambda lay: spec(lay, policy.partitions_params), layouts, is_leaf=_is_layout)
        grad_specs = jax.tree.map(lambda lay: spec(lay, partitioned_out), layouts, is_leaf=_is_layout)
        batch_spec = PartitionSpec(policy.axis_name)
        return jax.shard_map(
            body,
            mesh=policy._mesh,
            in_specs=(param_specs, batch_spec),
            out_specs=(grad_specs, PartitionSpec(), PartitionSpec()),
        )(state.params, batch)

    def _gather_updated(self, pieces: PyTree, layouts: PyTree) -> PyTree:
        """Stages 1–2: all-gather the updated parameter pieces; every device
        gets the whole, unpadded parameters back."""
        policy = self.policy
        specs = jax.tree.map(lambda lay: lay.spec(policy.axes), layouts, is_leaf=_is_layout)
        return jax.shard_map(
            lambda p: jax.tree.map(lambda x, lay: coll.gather_replicated(x, lay, policy.axis_name), p, layouts),
            mesh=policy._mesh,
            in_specs=(specs,),
            out_specs=PartitionSpec(),
        )(pieces)

    def _step(self, state: TrainState, batch: PyTree) -> tuple[TrainState, dict[str, Any]]:
        policy = self.policy
        layouts = state.layouts.tree()
        grads, loss, aux = self._local_grads(state, batch, reduce_to_policy=False)
        # Zero padding does not change a norm, so this is the global norm.
        grad_norm = optax.tree.norm(grads)
        if policy.stage in (1, 2):
            # The optimizer works on this device's piece of the parameters too.
            pieces = store(state.params, layouts, policy, True)
            updates, opt_state = self.tx.update(grads, state.opt_state, pieces)
            params = self._gather_updated(optax.apply_updates(pieces, updates), layouts)
        else:
            updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        params = _stored_params(params, layouts, policy)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        new_state = jax.tree.map(jax.lax.with_sharding_constraint, new_state, _state_shardings(new_state))
        metrics = {"loss": loss, "grad_norm": grad_norm}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics


def full_shapes(layouts: TreeLayouts) -> PyTree:
    """Zeros of the logical parameter shapes (for ``eval_shape`` only)."""
    return jax.tree.map(lambda lay: jnp.zeros(lay.shape, lay.dtype), layouts.tree(), is_leaf=_is_layout)


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], Any],
    tx: ShardedTransformation,
    policy: ZeroPolicy,
    *,
    gather: Literal["all", "manual"] = "all",
    donate: bool = True,
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
      donate: donate the old state's buffers to the new one.

    Returns:
      A :class:`TrainStep`: ``state, metrics = step(state, batch)`` with
      ``metrics["loss"]`` (global mean) and ``metrics["grad_norm"]`` (the
      global norm of the mean gradient), plus ``metrics["aux"]``.

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
    """
    tx = _check_tx(tx, policy, "make_train_step")
    if gather not in ("all", "manual"):
        raise ValueError(
            f"make_train_step: gather must be 'all' (loss_fn gets whole parameters) or 'manual' "
            f"(loss_fn gathers them with zj.gather / zj.scan_layers), got {gather!r}."
        )
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: loss_fn must be callable, got {type(loss_fn).__name__}.")
    return TrainStep(loss_fn, tx, policy, gather=gather, donate=donate)
