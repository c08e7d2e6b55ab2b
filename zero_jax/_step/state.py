"""TrainState: everything that lives between steps, placed per a policy;
init_state, full_params and the one map from a state to its shardings.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from zero_jax._base.tree import PyTree, check_live, path_str
from zero_jax._layout.leaf import LeafLayout, is_layout
from zero_jax._layout.trees import TreeLayouts, with_dtype
from zero_jax._policy.placement import store, to_logical
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import LossScaleState, cast_floats, warn_default_cast
from zero_jax._processes.multihost import check_same_on_all_processes, policy_fingerprint
from zero_jax._step import offload as _offload
from zero_jax._step.optimizer import ShardedOptState, ShardedTransformation


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


def check_tx(tx: Any, policy: ZeroPolicy, where: str) -> ShardedTransformation:
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(f"{where}: policy must be a zj.ZeroPolicy, got {type(policy).__name__} ({policy!r}).")
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


def stored_params(params: PyTree, layouts: PyTree, policy: ZeroPolicy) -> PyTree:
    return store(params, layouts, policy, policy.partitions_params)


def state_shardings(state: TrainState) -> TrainState:
    """The sharding of every leaf of a (possibly abstract) state, offloaded
    leaves in ``pinned_host``. A step computes it once per trace: the new
    state has the old one's layouts, hence its shardings."""
    policy = state.policy

    layouts = state.layouts.tree()
    placed = state.replace(
        step=policy.replicated(),
        params=policy.shardings(layouts, policy.partitions_params),
        opt_state=ShardedOptState(
            policy.shardings(state.opt_state.layouts.tree(), policy.partitions_opt_state, policy.state_axes),
            policy,
            state.opt_state.param_layouts,
            state.opt_state.layouts,
        ),
        master=None
        if state.master is None
        else policy.shardings(layouts, policy.partitions_opt_state, policy.state_axes),
        loss_scale=None if state.loss_scale is None else jax.tree.map(lambda _: policy.replicated(), state.loss_scale),
        model_state=jax.tree.map(lambda _: policy.replicated(), state.model_state),
    )
    if not policy.offloads:
        return placed
    plan = _offload.offload_plan(state)  # offloaded leaves live in pinned_host
    opt = placed.opt_state
    return placed.replace(
        params=_offload.with_host(placed.params, plan.params),
        opt_state=ShardedOptState(
            _offload.with_host(opt.inner_state, plan.opt_state), policy, opt.param_layouts, opt.layouts
        ),
        master=None if placed.master is None else _offload.with_host(placed.master, plan.master),
    )


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
    ``compute_dtype`` (``state.params``); without ``precision=`` both are
    float32, and float leaves of another dtype (bf16 parameters) are cast up
    with a warning that names them and says how to keep their dtype
    (``zj.Precision(param_dtype=jnp.bfloat16)``) or ask for mixed precision
    (``zj.Precision(compute_dtype=jnp.bfloat16)``). A Python number leaf is converted
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
    check_tx(tx, policy, "init_state")
    # Several processes: agree on the policy before the first collective, so
    # a mismatch is an error on every process rather than a hang.
    check_same_on_all_processes("zj.init_state", policy_fingerprint(policy))
    with policy.program_mesh():  # the policy's mesh context, whatever jax.set_mesh says
        make, abstract_only = _params_maker(params, policy)
        prec = policy.precision
        shapes = jax.eval_shape(make)
        warn_default_cast(shapes, prec, policy.precision_chosen)  # pyright: ignore[reportArgumentType] - policy.precision is always set
        layouts = with_dtype(policy.layouts(shapes), prec.param_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        model_state = _model_state_values(model_state)

        def build() -> TrainState:
            logical = cast_floats(make(), prec.param_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
            return TrainState(
                step=jnp.zeros((), jnp.int32),
                params=stored_params(cast_floats(logical, prec.stored_dtype), layouts, policy),  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
                opt_state=tx.init(logical),  # pyright: ignore[reportArgumentType] - shard_optimizer's init returns a ShardedOptState
                master=store(logical, layouts, policy, policy.partitions_opt_state, axes=policy.state_axes)
                if prec.keeps_master  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
                else None,
                loss_scale=LossScaleState.create(prec.loss_scale) if prec.loss_scale is not None else None,  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
                model_state=jax.tree.map(
                    lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, model_state
                ),
                policy=policy,
                layouts=TreeLayouts.of(layouts),
            )

        shardings = state_shardings(jax.eval_shape(build))
        if abstract_only:
            return jax.tree.map(
                lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(build), shardings
            )
        return jax.jit(build, out_shardings=shardings)()


def _params_maker(params: PyTree | Callable[[], PyTree], policy: ZeroPolicy) -> tuple[Callable[[], PyTree], bool]:
    """``init_state``'s parameters as a zero-argument function (traced inside
    the init program) and whether they are abstract (``ShapeDtypeStruct``s).
    Arrays laid out on another mesh enter as host values (the init program
    runs on the policy's mesh)."""
    # A factory is a callable with no array leaves: an Equinox module is callable
    # too, but it is a pytree of parameters.
    factory = callable(params) and not any(hasattr(x, "shape") for x in jax.tree.leaves(params))
    abstract_only = not factory and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if abstract_only:  # only ever traced, under eval_shape: nothing is allocated
        make = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)  # noqa: E731
    elif factory:
        _check_zero_arguments(params)
        make = lambda: _param_values(params())  # noqa: E731
    else:
        params = _from_other_meshes(_param_values(params), policy)
        if jax.process_count() > 1:
            # Arrays on this process's devices cannot enter a program over every
            # process's devices: pass them as host values (each process holds them).
            params = jax.tree.map(
                lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x, params
            )
        make = lambda: params  # noqa: E731
    return make, abstract_only


OTHER_MESH = (
    "init_state: {count} parameter(s) are laid out on another mesh than the policy's {mesh} and span other "
    "processes' devices: {listing}. Move them first, e.g. jax.device_put(params, "
    "NamedSharding(policy.mesh, P())), or pass a zero-argument function that makes them."
)


def _on_other_mesh(x: Any, policy: ZeroPolicy) -> bool:
    """Whether ``x`` is laid out on a mesh other than the policy's Auto mesh
    (:attr:`ZeroPolicy.auto_mesh`): other axis names, devices or axis types."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(x, jax.Array) or not isinstance(sharding, jax.sharding.NamedSharding):
        return False
    return sharding.mesh != policy.auto_mesh


def _same_devices(x: jax.Array, policy: ZeroPolicy) -> bool:
    """``x``'s mesh is the policy's but for its axis types (``jax.make_mesh``'s Explicit axes)."""
    mesh = x.sharding.mesh  # pyright: ignore[reportAttributeAccessIssue] - a NamedSharding: _on_other_mesh
    return mesh.axis_names == policy.mesh.axis_names and np.array_equal(mesh.device_ids, policy.mesh.device_ids)


def _from_other_meshes(params: PyTree, policy: ZeroPolicy) -> PyTree:
    """Parameters sharded on another mesh re-placed per the policy before the
    init program reads them: on the policy's devices with other axis types
    (an Explicit mesh), the same cut on its Auto mesh (no data moves); on
    other devices or axes (their own model-parallel mesh, devices 4-7), cut
    as the policy stores them where that divides evenly, else whole. Those
    on another mesh that span other processes are named in an error."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    foreign = [(p, x) for p, x in pairs if _on_other_mesh(x, policy)]
    if not foreign:
        return params
    remote = [f"'{path_str(p)}' {x.sharding.spec} on {dict(x.sharding.mesh.shape)}" for p, x in foreign
              if not x.is_fully_addressable and not _same_devices(x, policy)]  # fmt: skip
    if remote:
        raise ValueError(OTHER_MESH.format(count=len(remote), mesh=dict(policy.mesh.shape), listing="; ".join(remote)))
    layouts = jax.tree.leaves(policy.layouts(params), is_leaf=is_layout)

    def placed(x: Any, lay: LeafLayout) -> Any:
        if not _on_other_mesh(x, policy):
            return x
        if _same_devices(x, policy):
            return jax.device_put(x, NamedSharding(policy.auto_mesh, x.sharding.spec))
        return jax.device_put(x, policy.named_sharding(lay, lay.dim is not None and not lay.padding))

    return jax.tree.unflatten(treedef, [placed(x, lay) for (_, x), lay in zip(pairs, layouts, strict=True)])


FACTORY_WITH_ARGUMENTS = (
    "init_state: params is a function, so it is taken as a zero-argument factory of the parameters (called "
    "inside the init program, so nothing is allocated twice), but {name} needs arguments: {error}. Bind them "
    "first: zj.init_state(lambda: {name}(key), tx, policy) or functools.partial({name}, key)."
)


def _check_zero_arguments(factory: Callable[..., Any]) -> None:
    try:
        inspect.signature(factory).bind()
    except TypeError as e:
        raise TypeError(FACTORY_WITH_ARGUMENTS.format(name=getattr(factory, "__name__", "it"), error=e)) from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        return


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


MODEL_STATE_NOT_ARRAYS = (
    "init_state: model_state leaf {listing}, not an array; model state must be a pytree of arrays. Keep "
    "other values out of it (e.g. in the loss's closure)."
)


def _model_state_values(model_state: PyTree) -> PyTree:
    """Model state as arrays (``ShapeDtypeStruct``s kept): Python numbers
    become arrays; on several processes, arrays on this process's devices
    become host values (each process holds them)."""
    if model_state is None:
        return None

    pairs = jax.tree_util.tree_flatten_with_path(model_state)[0]
    bad = [
        f"'{path_str(p)}' is a {type(x).__name__}"
        for p, x in pairs
        if not hasattr(x, "shape") and not isinstance(x, (bool, int, float, complex))
    ]
    if bad:
        raise TypeError(MODEL_STATE_NOT_ARRAYS.format(listing=", ".join(bad)))

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            if jax.process_count() > 1 and x.is_fully_addressable:
                return np.asarray(x)
            return x
        return jnp.asarray(x)

    return jax.tree.map(one, model_state)


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
    with policy.program_mesh():
        if not partitioned:  # a copy: the state's own buffers are donated to the next step
            return jax.jit(lambda t: jax.tree.map(jnp.copy, t))(stored)
        return jax.jit(lambda t: _unstore(t, layouts, policy))(stored)


def _unstore(stored: PyTree, layouts: PyTree, policy: ZeroPolicy) -> PyTree:
    logical = to_logical(stored, layouts, policy, False)  # replicated: the cut axes do not matter
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, policy.replicated()), logical)
