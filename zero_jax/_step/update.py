"""The optimizer update of a step, in the global view, and what follows it.

:func:`shard_optimizer` runs the optax update on the partitioned (fp32
master) state, where the compiler keeps elementwise math local and adds only
the small reductions an optimizer itself needs. Around it: the gradients as
the optimizer takes them (unscaled, clipped on the global norm), the float16
loss scale (an overflow skips the step on every device), and, where the
optimizer sees a slice of whole parameters, the all-gather of the updated
pieces (in the compute dtype).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from zero_jax._base.tree import PyTree
from zero_jax._comm import collectives as coll
from zero_jax._layout.leaf import LeafLayout, is_float
from zero_jax._layout.trees import per_leaf, with_dtype
from zero_jax._policy.placement import store
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import cast_floats
from zero_jax._step import offload as _offload
from zero_jax._step.optimizer import ShardedOptState, ShardedTransformation
from zero_jax._step.state import TrainState, stored_params


class Updated(NamedTuple):
    """The optimizer's results: the new optimizer view of the parameters
    (master copy or parameters), the new optimizer state, and whether the
    step was finite (always ``True`` without a loss scale)."""

    master: PyTree
    opt_state: ShardedOptState
    finite: jax.Array


def optimizer_grads(grads: PyTree, state: TrainState, grad_norm: jax.Array, clip_norm: float | None) -> PyTree:
    """The gradients as the optimizer takes them: in ``param_dtype``, the loss
    scale undone, clipped to ``clip_norm`` on the global norm (optax's
    ``clip_by_global_norm`` formula); zeros for leaves without a gradient."""
    policy = state.policy
    prec = policy.precision
    scale = state.loss_scale.scale if state.loss_scale is not None else None

    def one(g: jax.Array | None, lay: LeafLayout) -> jax.Array:
        if g is None:  # frozen or non-float: the optimizer never reads it (compiled away)
            partitioned = policy.partitions_opt_state and lay.dim is not None
            shape = lay.stored_shape if partitioned else lay.shape
            return jnp.zeros(shape, prec.param_dtype if is_float(lay) else lay.dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        g = g.astype(prec.param_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        if scale is not None:  # in float32 (the scale's dtype), back to param_dtype: float16 stays float16
            g = (g / scale).astype(prec.param_dtype)  # pyright: ignore[reportOptionalMemberAccess] - as above
        if clip_norm is not None:
            g = jax.lax.select(grad_norm < clip_norm, g, (g / grad_norm.astype(g.dtype)) * clip_norm)
        return g

    return per_leaf(one, state.layouts.tree(), grads)


def optimizer_view(state: TrainState) -> PyTree:
    """The parameters as the optimizer sees them: the float32 master copy
    (partitioned from stage 1), this device's slice of whole parameters, or
    the (stage-3 pieces of the) parameters themselves."""
    policy = state.policy
    if state.master is not None:
        return state.master
    if policy.optimizer_sees_slice:
        return store(state.params, state.layouts.tree(), policy, True, axes=policy.state_axes)
    return state.params


def apply_optimizer(
    tx: ShardedTransformation, state: TrainState, grads: PyTree, sq_norm: jax.Array, shardings: TrainState
) -> Updated:
    """Run the optimizer update (streamed chunk by chunk with offload); with
    a loss scale, an overflow anywhere skips it everywhere (the flag comes
    from the all-reduced norm, so every device takes the same branch)."""
    policy = state.policy

    def update(master: PyTree, opt_state: ShardedOptState) -> tuple[PyTree, ShardedOptState]:
        updates, opt_state = tx.update(grads, opt_state, master)  # pyright: ignore[reportArgumentType, reportAssignmentType] - a ShardedTransformation's state
        return optax.apply_updates(master, updates), opt_state

    master = optimizer_view(state)
    if policy.offloads:
        update = _offload.stream_update(update, master, state, shardings)  # pyright: ignore[reportAssignmentType] - a ShardedTransformation's state
    if state.loss_scale is None:
        return Updated(*update(master, state.opt_state), jnp.asarray(True))
    finite = jnp.isfinite(sq_norm)
    new_master, opt_state = jax.lax.cond(finite, update, lambda m, o: (m, o), master, state.opt_state)
    return Updated(new_master, opt_state, finite)


def gather_updated(policy: ZeroPolicy, pieces: PyTree, layouts: PyTree) -> PyTree:
    """All-gather the updated parameter pieces (cut over the optimizer's
    axes): every device gets the whole, unpadded parameters back (stages
    1–2), or with ``optimizer_over_replicas`` in stage 3 the gather runs
    across the replica axes only, into the parameters' 1/N pieces (still
    padded)."""
    specs = per_leaf(lambda lay: lay.spec(policy.state_axes), layouts)
    if policy.partitions_params:
        out_specs = per_leaf(lambda lay: lay.spec(policy.axes), layouts)
        gather = lambda x, lay: coll.gather_replicated(x, lay, policy.replica_axes, unpadded=False)  # noqa: E731
    else:
        out_specs = PartitionSpec()
        gather = lambda x, lay: coll.gather_replicated(x, lay, policy.state_axes)  # noqa: E731
    return jax.shard_map(
        lambda p: per_leaf(gather, layouts, p),
        mesh=policy.auto_mesh,
        in_specs=(specs,),
        out_specs=out_specs,
        axis_names=policy.manual_axes,
    )(pieces)


def master_for_compute(state: TrainState, new_master: PyTree, shardings: TrainState) -> PyTree:
    """With offload: the updated master leaves in the memory the compute copy
    is made in (see ``_offload.for_compute``); otherwise unchanged."""
    policy = state.policy
    if policy.offloads:
        return _offload.for_compute(new_master, shardings.params, policy.precision.compute_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
    return new_master


def updated_params(state: TrainState, new_master: PyTree, frozen: PyTree) -> PyTree:
    """The new stored parameters in the compute dtype (in the master's without
    a compute copy: the updated master itself). Where the optimizer
    saw a slice, only what changed is all-gathered (frozen leaves keep their
    copy). Non-float leaves pass through bitwise."""
    policy = state.policy
    prec = policy.precision
    layouts = state.layouts.tree()
    compute = cast_floats(new_master, prec.stored_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
    if policy.optimizer_sees_slice:
        compute = store(compute, layouts, policy, True, axes=policy.state_axes)
        trained_layouts = per_leaf(lambda fz, lay: None if fz else lay, layouts, frozen)
        trained = per_leaf(lambda c, fz, lay: None if fz else c, layouts, compute, frozen)
        gathered = gather_updated(policy, trained, trained_layouts)
        params = per_leaf(lambda old, new, lay: old if new is None else new, layouts, state.params, gathered)
    else:
        params = compute
    params = keep_non_float(params, state.params, layouts)
    return stored_params(params, with_dtype(layouts, prec.stored_dtype), policy)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow


def keep_non_float(new: PyTree, old: PyTree, layouts: PyTree) -> PyTree:
    """``new`` with every non-float leaf replaced by its ``old`` value (an
    optimizer's weight decay would otherwise touch an int counter)."""
    return per_leaf(lambda n, o, lay: n if is_float(lay) else o, layouts, new, old)


def same_dtypes(new: PyTree, old: PyTree) -> PyTree:
    """``new`` in ``old``'s dtypes: the state keeps one fixed layout between
    steps (an int leaf's optimizer moments stay int)."""
    return jax.tree.map(lambda n, o: n if n.dtype == o.dtype else n.astype(o.dtype), new, old)


def finish_state(state: TrainState, new_state: TrainState, shardings: TrainState) -> TrainState:
    """The new state placed: offloaded leaves written to host memory, every
    leaf constrained to the state's sharding."""
    policy = state.policy
    if policy.offloads:
        new_state = _offload.to_memory_kinds(new_state, shardings)
    return jax.tree.map(jax.lax.with_sharding_constraint, new_state, shardings)


def step_metrics(loss: jax.Array, aux: Any, grad_norm: jax.Array, new_state: TrainState, finite: Any) -> dict:
    """``loss``, ``grad_norm``, ``finite`` (a bool: the gradient norm is
    finite), ``aux``; with a loss scale also ``loss_scale`` and ``skipped``."""
    metrics: dict[str, Any] = {"loss": loss, "grad_norm": grad_norm, "finite": jnp.isfinite(grad_norm)}
    if aux is not None:
        metrics["aux"] = aux
    if new_state.loss_scale is not None:
        metrics["loss_scale"] = new_state.loss_scale.scale
        metrics["skipped"] = (~finite).astype(jnp.int32)
    return metrics
