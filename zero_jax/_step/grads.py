"""The gradient program: one ``jax.shard_map`` over the batch axes.

Each device runs ``loss_fn`` on its slice of the batch (in microbatches when
accumulating) and the collectives of ``_comm.collectives`` reduce the gradients in
the precision policy's reduce dtype: all-reduce in stage 0, reduce-scatter
from stage 1; stages 2–3 reduce-scatter each gradient the moment the
backward pass produces it (into a zero "slot" piece), and stage 3 also
gathers the parameters for use. The global gradient norm, which is also the
overflow check, costs one scalar all-reduce.

Everything here is a function of a :class:`GradPlan`, built once per trace;
the program talks through return values (:class:`Grads`). Frozen and
non-float leaves have no gradient (``None``): never differentiated, never
communicated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from zero_jax._base.tree import PyTree, path_str
from zero_jax._comm import collectives as coll
from zero_jax._layerwise.pieces import Sharded, check_only_gathered
from zero_jax._layerwise.scope import manual_gather_scope
from zero_jax._layout.leaf import LeafLayout, is_float, is_layout, is_real_float, shard_shape
from zero_jax._layout.trees import leaf_values, per_leaf
from zero_jax._policy.batch import is_replicated_leaf
from zero_jax._policy.memory import to_device
from zero_jax._policy.policy import ZeroPolicy


class GradPlan(NamedTuple):
    """What the gradient program does, decided once per trace.

    Attributes:
      loss_fn: the user's loss.
      policy: the step's policy.
      layouts: the parameters' layouts (a pytree of ``LeafLayout``).
      frozen: per leaf, ``True`` for leaves never differentiated (frozen by
        the optimizer, or not floating point).
      manual: ``gather="manual"``: the loss gathers what it uses.
      local: local accumulation: whole gradients per microbatch, reduced once.
      slots: the backward pass reduce-scatters into zero slot pieces
        (stages 2–3, unless accumulating locally).
      pieces: the parameters enter the loss as pieces (stage 3, not local).
      accum_steps: microbatches per step.
      stateful: the loss threads a model state.
      scale_loss: the loss is multiplied by a (float16) loss scale.
      for_optimizer: gradients come back as the optimizer takes them (cut
        from stage 1), not as the policy holds them.
      aux_reduce: how each aux leaf combines over devices and microbatches
        (``make_train_step(aux_reduce=)``; ``None``: floats averaged,
        integers summed).
      keep_gathered: stage 3, ``gather="all"``: the parameters gathered for
        the forward pass are kept for the backward (no ``jax.checkpoint``, no
        re-gather; ``make_train_step(keep_gathered=True)``).
    """

    loss_fn: Callable[..., Any]
    policy: ZeroPolicy
    layouts: PyTree
    frozen: PyTree
    manual: bool
    local: bool
    slots: bool
    pieces: bool
    accum_steps: int
    stateful: bool
    scale_loss: bool
    for_optimizer: bool
    aux_reduce: Any = None
    keep_gathered: bool = False


class Grads(NamedTuple):
    """The gradient program's results.

    Attributes:
      grads: the reduced gradients (``None`` for frozen leaves), in the
        reduce dtype (float32 accumulators when accumulating).
      loss: the global mean loss.
      aux: the loss's aux (floats averaged, integers summed), or ``None``.
      sq_norm: the global squared norm of the unscaled gradients.
      model_state: the new replicated model state (``None`` unless stateful).
    """

    grads: PyTree
    loss: jax.Array
    aux: Any
    sq_norm: jax.Array
    model_state: PyTree


def grad_plan(
    loss_fn: Callable[..., Any],
    policy: ZeroPolicy,
    layouts: PyTree,
    frozen: PyTree,
    *,
    gather: str,
    accum_steps: int,
    accum_mode: str,
    stateful: bool,
    scale_loss: bool,
    for_optimizer: bool,
    aux_reduce: Any = None,
    keep_gathered: bool = False,
) -> GradPlan:
    local = accum_steps > 1 and accum_mode == "local"
    return GradPlan(
        loss_fn=loss_fn,
        policy=policy,
        layouts=layouts,
        frozen=frozen,
        manual=gather == "manual",
        local=local,
        slots=policy.partitions_grads and not local,
        pieces=policy.partitions_params and not local,
        accum_steps=accum_steps,
        stateful=stateful,
        scale_loss=scale_loss,
        for_optimizer=for_optimizer,
        aux_reduce=aux_reduce,
        keep_gathered=keep_gathered,
    )


def cut(plan: GradPlan, lay: LeafLayout) -> bool:
    """Whether this leaf's reduced gradient is a piece."""
    policy = plan.policy
    return lay.dim is not None and (policy.partitions_grads or (plan.for_optimizer and policy.partitions_opt_state))


def compute_grads(plan: GradPlan, params: PyTree, batch: PyTree, scale: jax.Array, model_state: PyTree) -> Grads:
    """The gradient program: :func:`device_grads` on every device's slice."""
    policy = plan.policy

    def spec(lay: LeafLayout, partitioned: bool, axes: tuple[str, ...]) -> PartitionSpec:
        return lay.spec(axes) if partitioned else PartitionSpec()

    param_specs = per_leaf(lambda lay: spec(lay, policy.partitions_params, policy.axes), plan.layouts)
    grad_specs = per_leaf(
        lambda fz, lay: None if fz else spec(lay, cut(plan, lay), policy.state_axes), plan.layouts, plan.frozen
    )
    out = jax.shard_map(
        lambda *args: tuple(device_grads(plan, *args)),
        mesh=policy.auto_mesh,
        in_specs=(param_specs, policy.batch_manual_spec(batch), PartitionSpec(), PartitionSpec()),
        out_specs=(grad_specs, PartitionSpec(), PartitionSpec(), PartitionSpec(), PartitionSpec()),
        axis_names=policy.manual_axes,
        # JAX 0.10 cannot type a collective over a vmap axis (a batch norm's
        # pmean over jax.vmap(..., axis_name=...), as eqx.nn.BatchNorm does)
        # inside a vma-checked shard_map; stateful steps run unchecked.
        check_vma=not plan.stateful,
    )(params, batch, scale, model_state if plan.stateful else None)
    return Grads(*out)


def device_grads(plan: GradPlan, params: PyTree, batch: PyTree, scale: jax.Array, model_state: PyTree) -> Grads:
    """One device's part: local gradients, reduced; loss, aux and model state combined."""
    params = params_for_use(plan, params)
    diff = per_leaf(lambda p, fz, lay: diff_var(plan, p, lay, fz), plan.layouts, params, plan.frozen)
    check_pieces_are_gathered(plan, params, diff, batch, scale, model_state)
    grad_fn = jax.value_and_grad(micro_loss_fn(plan, params, scale), has_aux=True)
    if plan.accum_steps == 1:
        (_, (loss, aux, new_ms)), g = grad_fn(diff, batch, model_state)
        grads = across_replicas(plan, reduce_grads(plan, g))
    else:
        grads, loss, aux, new_ms = accumulate(plan, grad_fn, diff, batch, model_state)
    every = plan.policy.comm.all
    aux = combine_aux(aux, aux_kinds(plan, aux, batch), every)
    if plan.stateful:
        new_ms = combine_model_state(new_ms, model_state, every)
    return Grads(grads, jax.lax.pmean(loss, every), aux, squared_norm(plan, grads, scale), new_ms)


def check_pieces_are_gathered(
    plan: GradPlan, params: PyTree, diff: PyTree, batch: PyTree, scale: jax.Array, model_state: PyTree
) -> None:
    """A manual step's loss may touch partitioned leaves only through the
    library's gathers (see :func:`zero_jax._layerwise.piece_uses.check_only_gathered`)."""
    if not plan.manual or not (plan.slots or plan.pieces):
        return
    k = plan.accum_steps
    stacked, rebuild = split_microbatches(batch, k)
    micro_batch = rebuild([x[0] for x in stacked])

    def loss(p: PyTree, d: PyTree) -> Any:
        return micro_loss_fn(plan, p, scale)(d, micro_batch, model_state)[0]

    check_only_gathered(loss, params, diff, plan.layouts, slots=plan.slots)


def params_for_use(plan: GradPlan, params: PyTree) -> PyTree:
    """The parameters as this step hands them on: host pieces moved to the
    device (the manual path moves each piece in ``zj.gather``, one layer at a
    time in ``scan_layers``); with local accumulation in stage 3, gathered
    once per step (Ψ), every microbatch computed on the whole parameters.
    Without a compute copy (``Precision(compute_copy=False)``) the leaves
    no gather casts (those whole on every device) are cast here."""
    policy = plan.policy
    if policy.offload_params and (plan.local or not plan.manual):
        params = jax.tree.map(to_device, params)
    cast = policy.comm.cast
    if cast is not None:
        whole_float = lambda lay: lay.dim is None and is_float(lay)  # noqa: E731
        params = per_leaf(lambda p, lay: p.astype(cast) if whole_float(lay) else p, plan.layouts, params)
    if policy.partitions_params and plan.local:
        params = per_leaf(lambda p, lay: coll.fetch(p, lay, policy.comm, gather=True), plan.layouts, params)
    return params


def diff_var(plan: GradPlan, p: jax.Array, lay: LeafLayout, frozen: bool) -> jax.Array | None:
    """What the gradient is taken against, per leaf (``None``: not differentiated)."""
    if frozen:
        return None
    policy = plan.policy
    if plan.slots and lay.dim is not None:
        return coll.zeros_like_piece(lay, policy.num_shards, policy.comm, policy.precision.reduce_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
    return coll.to_varying(p, policy.comm)


def handed(plan: GradPlan, p: jax.Array, d: jax.Array | None, lay: LeafLayout, path: str) -> Any:
    """What ``loss_fn`` receives for one leaf (at key ``path``)."""
    if not (lay.dim is not None and (plan.slots or (plan.pieces and d is None))):
        return d if d is not None else p
    if plan.manual:
        return Sharded((p,) if d is None else (p, d), lay, plan.policy, path)
    if d is None:
        return coll.fetch(p, lay, plan.policy.comm, gather=plan.pieces)
    return coll.fetch_with_grad_slot(p, d, lay, plan.policy.comm, gather=plan.pieces)


def micro_loss_fn(plan: GradPlan, params: PyTree, scale: jax.Array) -> Callable[..., Any]:
    """``micro(diff, microbatch, model_state) -> (scaled loss, (loss, aux, new
    model state))``: each device's loss / (devices × microbatches), so the
    summed gradient is the global mean. In the new model state a leaf the
    loss returned untouched (the very value it received) is ``None``: it
    keeps its value bitwise (neither averaged nor combined)."""
    policy = plan.policy
    divisor = policy.num_batch_shards * plan.accum_steps

    def micro(d: PyTree, mb: PyTree, ms: PyTree) -> tuple[jax.Array, tuple[jax.Array, Any, PyTree]]:
        paths = jax.tree_util.tree_map_with_path(lambda k, _: path_str(k), plan.layouts, is_leaf=is_layout)
        tree = per_leaf(lambda p, di, k, lay: handed(plan, p, di, lay, k), plan.layouts, params, d, paths)
        args = (tree, ms, mb) if plan.stateful else (tree, mb)
        if plan.manual:
            with manual_gather_scope(policy, pieces=plan.slots or plan.pieces):
                out = call_loss(plan.loss_fn, args)
        else:
            out = call_loss(plan.loss_fn, args)
        new_ms = None
        if plan.stateful:
            out, new_ms = split_stateful(out)
            new_ms = updated_model_state(ms, new_ms, policy.comm)
        loss, aux = split_loss(out)
        check_scalar_loss(loss)
        scaled = loss.astype(jnp.float32) / divisor
        if plan.scale_loss:
            scaled = scaled * scale
        return scaled, (loss.astype(jnp.float32), aux, new_ms)

    if policy.partitions_params and not plan.manual and not plan.local and not plan.keep_gathered:
        # Stage 3 gathers inside jax.checkpoint and keeps only matmul outputs
        # (activations) for the backward pass: everything computed from the
        # gathered parameters is recomputed, so the backward pass gathers again
        # (ZeRO-3's 3Ψ) instead of holding whole parameters from forward to
        # backward. (A name-based policy is not enough: ops applied after the
        # gather -- unpadding, the model's own transposes and casts -- would
        # produce unnamed whole-parameter values that get saved instead.)
        # keep_gathered=True skips it: autodiff keeps what it needs of the gathered
        # parameters for the backward pass (ZeRO-2's parameter memory, 2Ψ).
        # hpZ: the secondary pieces are kept too, so the backward gathers within the node only.
        saved = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        if policy.secondary_axis:
            keep = jax.checkpoint_policies.save_only_these_names(coll.SECONDARY_PIECE)
            saved = jax.checkpoint_policies.save_from_both_policies(saved, keep)
        return jax.checkpoint(micro, policy=saved)
    return micro


LOSS_RAISED = (
    "zero_jax: raised inside loss_fn({names}), called by the step on each device's slice of the batch; the "
    "batch it got: {batch}."
)


def call_loss(loss_fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """``loss_fn(*args)``; an exception from inside it gets a note (Python
    3.11+) that says where it came from and what the batch held: a batch
    passed as a list to a loss that indexes it by name fails in the user's
    own code, and the note shows the mismatch."""
    try:
        return loss_fn(*args)
    except Exception as e:
        if hasattr(e, "add_note"):
            names = "params, model_state, batch" if len(args) == 3 else "params, batch"
            e.add_note(LOSS_RAISED.format(names=names, batch=describe_batch(args[-1])))
        raise


def describe_batch(batch: PyTree) -> str:
    """A batch in a few words: its container and its leaves' paths, shapes and dtypes."""
    pairs = jax.tree_util.tree_flatten_with_path(batch)[0]
    shown = ", ".join(f"'{path_str(p)}' {tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', type(x).__name__)}"
                      for p, x in pairs[:6])  # fmt: skip
    more = f", and {len(pairs) - 6} more" if len(pairs) > 6 else ""
    return f"a {type(batch).__name__} of {len(pairs)} leaves ({shown}{more})"


def reduce_grads(plan: GradPlan, g: PyTree) -> PyTree:
    """Local gradients -> their reduced form (sum over the data axis)."""
    policy = plan.policy

    def one(x: jax.Array | None, lay: LeafLayout) -> jax.Array | None:
        if x is None:
            return None
        if plan.slots and lay.dim is not None:
            return x  # reduce-scattered by the backward pass already
        x = x.astype(policy.precision.reduce_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        if cut(plan, lay):
            return coll.sum_reduce_scatter(x, lay, policy.comm)
        return coll.sum_all_reduce_leaf(x, lay, policy.comm)

    return per_leaf(one, plan.layouts, g)


def reduced_shapes(plan: GradPlan, g: PyTree) -> PyTree:
    """The shapes and dtypes :func:`reduce_grads` gives for local gradients
    ``g`` (computed, not traced: ``jax.eval_shape`` cannot trace the nested
    per-model-shard ``shard_map`` of a tensor-parallel leaf here)."""
    policy = plan.policy

    def one(x: Any, lay: LeafLayout) -> Any:
        if x is None or (plan.slots and lay.dim is not None):
            return x
        shape = shard_shape(lay, policy.num_shards) if cut(plan, lay) else x.shape
        return jax.ShapeDtypeStruct(shape, policy.precision.reduce_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow

    return per_leaf(one, plan.layouts, g)


def across_replicas(plan: GradPlan, g: PyTree) -> PyTree:
    """Pieces summed within the partition axes -> summed over the replicas
    too, once per step (after accumulation)."""
    axis = plan.policy.comm
    return per_leaf(
        lambda x, lay: x if x is None or not cut(plan, lay) else coll.reduce_across_replicas(x, lay, axis),
        plan.layouts,
        g,
    )


def accumulate(
    plan: GradPlan, grad_fn: Callable[..., Any], diff: PyTree, batch: PyTree, model_state: PyTree
) -> tuple[PyTree, jax.Array, Any, PyTree]:
    """Scan the microbatches, summing gradients into float32 accumulators
    (whole with local accumulation, reduced every microbatch otherwise); the
    model state flows through the microbatches in order."""
    k, axis = plan.accum_steps, plan.policy.comm
    micro_batches, rebuild = split_microbatches(batch, k)
    acc_dtype = plan.policy.precision.param_dtype  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow

    def step(carry: tuple[PyTree, PyTree], rows: list[jax.Array]) -> tuple[tuple[PyTree, PyTree], Any]:
        acc, ms = carry
        (_, (loss, aux, new_ms)), g = grad_fn(diff, rebuild(rows), ms)
        g = g if plan.local else reduce_grads(plan, g)
        acc = jax.tree.map(lambda a, x: a + x.astype(acc_dtype), acc, g)
        return (acc, keep_untouched(new_ms, ms)), (loss, aux)

    first = rebuild([x[0] for x in micro_batches])
    example = jax.eval_shape(lambda: grad_fn(diff, first, model_state))
    kept = example[0][1][2]  # which model-state leaves the loss returns untouched
    example = example[1] if plan.local else reduced_shapes(plan, example[1])

    def zeros(x: jax.ShapeDtypeStruct | None, lay: LeafLayout) -> jax.Array | None:
        if x is None:  # frozen or non-float: no gradient, no accumulator
            return None
        z = jnp.zeros(x.shape, acc_dtype)
        # Whole local gradients and pieces differ per device; all-reduced
        # gradients are the same everywhere (and must be typed so).
        per_device = plan.local or cut(plan, lay) or (plan.slots and lay.dim is not None)
        return coll.to_varying(z, axis) if per_device else z

    acc0 = per_leaf(zeros, plan.layouts, example)
    ms0 = jax.tree.map(lambda x: coll.to_varying(x, axis), model_state) if plan.stateful else None
    (acc, new_ms), (losses, auxes) = jax.lax.scan(step, (acc0, ms0), micro_batches, length=k)
    grads = across_replicas(plan, reduce_grads(plan, acc) if plan.local else acc)
    aux = jax.tree.map(over_microbatches, aux_kinds(plan, jax.tree.map(lambda a: a[0], auxes)), auxes)
    new_ms = None if kept is None else mark_untouched(new_ms, kept)
    return grads, jnp.mean(losses), aux, new_ms


def split_microbatches(batch: PyTree, k: int) -> tuple[list[jax.Array], Callable[[list[jax.Array]], PyTree]]:
    """A device's batch as ``k`` microbatches: its row leaves reshaped to
    ``(k, rows / k, ...)`` (what ``lax.scan`` runs over) and ``rebuild(rows)``,
    one microbatch with the replicated leaves (scalars, keys) as they are."""
    leaves, treedef = jax.tree.flatten(batch)
    split = [not is_replicated_leaf(x) for x in leaves]
    stacked = [x.reshape(k, x.shape[0] // k, *x.shape[1:]) for x, s in zip(leaves, split, strict=True) if s]

    def rebuild(rows: list[jax.Array]) -> PyTree:
        it = iter(rows)
        return jax.tree.unflatten(treedef, [next(it) if s else x for x, s in zip(leaves, split, strict=True)])

    return stacked, rebuild


def squared_norm(plan: GradPlan, grads: PyTree, scale: jax.Array) -> jax.Array:
    """The global squared norm of the unscaled gradients, in one scalar
    all-reduce: pieces differ per device and are summed; whole gradients are
    the same everywhere. It doubles as the overflow check: any inf or NaN
    anywhere makes it non-finite on every device alike."""
    part, whole = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    layout_leaves = jax.tree.leaves(plan.layouts, is_leaf=is_layout)
    for g, lay in zip(leaf_values(grads, plan.layouts), layout_leaves, strict=True):
        if g is None:
            continue
        u = g.astype(jnp.float32)
        u = u / scale if plan.scale_loss else u
        if cut(plan, lay):
            part = part + jnp.sum(u * u)
        else:
            whole = whole + jnp.sum(u * u)
    frozen = leaf_values(plan.frozen, plan.layouts)
    any_cut = any(cut(plan, lay) for lay, fz in zip(layout_leaves, frozen, strict=True) if not fz)
    return (jax.lax.psum(part, plan.policy.state_axes) if any_cut else part) + whole


# -- the loss's outputs --------------------------------------------------------------------

#: How an aux leaf combines over the devices (and microbatches): ``make_train_step(aux_reduce=)``.
AUX_REDUCTIONS = ("mean", "sum", "max", "min", "gather")

AUX_REDUCE_TREE = (
    "make_train_step(aux_reduce=...): at {where}, aux_reduce {given!r} does not fit the aux loss_fn returns "
    "({aux}): give one of {kinds} for a whole subtree, a dict naming some keys of an aux dict, or a list / "
    "tuple as long as the aux one."
)
AUX_REDUCE_KEYS = (
    "make_train_step(aux_reduce=...): {extra} at {where} are not keys of the aux loss_fn returns (its keys: "
    "{keys}); name only keys the aux has."
)
AUX_PER_EXAMPLE = (
    "make_train_step: aux leaf {listing} has as many rows as each device's batch ({rows}): if it holds one "
    "value per example, averaging it elementwise over the {devices} devices (the default for float aux) mixes "
    "different examples. Say how it combines: make_train_step(..., aux_reduce={{{key!r}: 'gather'}}) gives the "
    "whole batch's rows in batch order, 'mean' keeps the elementwise average (and silences this warning); "
    "'sum', 'max' and 'min' are there too."
)


def aux_kinds(plan: GradPlan, aux: Any, batch: PyTree = None) -> Any:
    """Per aux leaf, its reduction (one of :data:`AUX_REDUCTIONS`): the
    user's ``aux_reduce`` (a prefix of aux's tree, or one string), else
    floats ``"mean"`` and the rest ``"sum"``. Without ``aux_reduce``, a
    float leaf with a row per example of the device's (micro)batch is
    averaged with a warning that says how to gather it instead (given the
    device's ``batch``)."""
    given = plan.aux_reduce
    if given is None:
        if batch is not None:
            warn_per_example_aux(plan, aux, batch)
        return default_kinds(aux)
    return kinds_as_given(given, aux, ())


def kinds_as_given(given: Any, aux: Any, where: tuple[str, ...]) -> Any:
    """``aux_reduce`` laid over the aux tree: a string covers its whole
    subtree; a dict names some keys of an aux dict (the others take the
    defaults); a list or tuple mirrors one of the same length."""
    if isinstance(given, str):
        return jax.tree.map(lambda _: given, aux)
    if isinstance(given, dict) and isinstance(aux, dict):
        extra = sorted(map(str, set(given) - set(aux)))
        if extra:
            raise ValueError(AUX_REDUCE_KEYS.format(extra=extra, where="/".join(where) or "aux", keys=sorted(aux)))
        return {k: kinds_as_given(given[k], v, (*where, str(k))) if k in given else default_kinds(v)
                for k, v in aux.items()}  # fmt: skip
    if isinstance(given, (list, tuple)) and isinstance(aux, (list, tuple)) and len(given) == len(aux):
        pairs = enumerate(zip(given, aux, strict=True))
        return type(aux)(kinds_as_given(g, a, (*where, str(i))) for i, (g, a) in pairs)
    raise ValueError(AUX_REDUCE_TREE.format(kinds=AUX_REDUCTIONS, aux=jax.tree.structure(aux), given=given,
                                            where="/".join(where) or "aux"))  # fmt: skip


def default_kinds(aux: Any) -> Any:
    """Floats averaged, the rest (counts) summed."""
    return jax.tree.map(lambda a: "mean" if is_float(a) else "sum", aux)


def warn_per_example_aux(plan: GradPlan, aux: Any, batch: PyTree) -> None:
    rows = {x.shape[0] // plan.accum_steps for x in jax.tree.leaves(batch) if getattr(x, "ndim", 0)}
    devices = plan.policy.num_batch_shards
    if len(rows) != 1 or devices == 1:
        return
    (row,) = rows
    hits = [(p, a) for p, a in jax.tree_util.tree_flatten_with_path(aux)[0]
            if is_float(a) and a.ndim and a.shape[0] == row]  # fmt: skip
    if hits:
        listing = ", ".join(f"'{path_str(p)}' {tuple(a.shape)}" for p, a in hits)
        key = path_str(hits[0][0]) if len(hits[0][0]) == 1 else "name"
        warnings.warn(AUX_PER_EXAMPLE.format(listing=listing, rows=row, devices=devices, key=key), UserWarning,
                      stacklevel=2)  # fmt: skip


def combine_aux(aux: Any, kinds: Any, axes: tuple[str, ...]) -> Any:
    """Each device's aux -> one value, per leaf as its kind says (``gather``:
    the devices' rows concatenated in batch order)."""

    def one(kind: str, a: jax.Array) -> jax.Array:
        if kind == "mean":
            return jax.lax.pmean(a if is_float(a) else a.astype(jnp.float32), axes)
        if kind == "gather":
            return jax.lax.all_gather(a if a.ndim else a[None], axes, axis=0, tiled=True, to="invarying")
        return {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[kind](a, axes)

    return jax.tree.map(one, kinds, aux)


def over_microbatches(kind: str, a: jax.Array) -> jax.Array:
    """One device's aux over its microbatches (stacked on axis 0), as its kind says."""
    if kind == "gather":
        return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) if a.ndim > 1 else a
    if kind == "mean":
        return jnp.mean(a if is_float(a) else a.astype(jnp.float32), 0)
    return {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[kind](a, 0)


def split_loss(out: Any) -> tuple[jax.Array, Any]:
    if isinstance(out, tuple) and len(out) == 2:
        return out[0], out[1]
    return out, None  # pyright: ignore[reportReturnType] - the loss's output, as the user returns it


STATEFUL_OUTPUT = (
    "make_train_step(..., stateful=True): loss_fn(params, model_state, batch) must return "
    "(out, new_model_state), where out is what an ordinary loss returns (loss or (loss, aux)); got {got}."
)


def split_stateful(out: Any) -> tuple[Any, PyTree]:
    if not (isinstance(out, tuple) and len(out) == 2):
        got = f"{type(out).__name__}{'' if not isinstance(out, tuple) else f' of length {len(out)}'}"
        raise TypeError(STATEFUL_OUTPUT.format(got=got))
    return out[0], out[1]


SCALAR_LOSS = (
    "make_train_step: loss_fn(params, batch) must return a float scalar (the mean loss over its batch), "
    "optionally as (loss, aux); got {kind} with shape {shape} and dtype {dtype}. Reduce it with jnp.mean "
    "before returning."
)


def check_scalar_loss(loss: Any) -> None:
    shape = getattr(loss, "shape", None)
    if shape is None or shape != () or not is_real_float(loss):
        raise TypeError(SCALAR_LOSS.format(kind=type(loss).__name__, shape=shape, dtype=getattr(loss, "dtype", None)))


MODEL_STATE_FIX = (
    "The step keeps the model state in one fixed layout: return a state with the same tree, shapes and "
    "dtypes as the one loss_fn received (cast updated values back, e.g. new.astype(old.dtype))."
)


def check_model_state(old: PyTree, new: PyTree) -> None:
    """The new model state must be the old one's tree with the same shapes and
    dtypes; names every leaf that differs."""
    old_pairs, old_def = jax.tree_util.tree_flatten_with_path(old)
    new_pairs, new_def = jax.tree_util.tree_flatten_with_path(new)
    if old_def != new_def:
        old_paths = {path_str(p) for p, _ in old_pairs}
        new_paths = {path_str(p) for p, _ in new_pairs}
        missing, extra = sorted(old_paths - new_paths), sorted(new_paths - old_paths)
        detail = f"missing {missing[:6]}, unexpected {extra[:6]}" if missing or extra else f"{old_def} became {new_def}"
        raise ValueError(
            "make_train_step: loss_fn returned a new model state whose tree differs from the old one: "
            f"{detail}. {MODEL_STATE_FIX}"
        )
    bad = []
    for (path, a), (_, b) in zip(old_pairs, new_pairs, strict=True):
        a_shape, b_shape = tuple(jnp.shape(a)), tuple(jnp.shape(b))
        a_dtype, b_dtype = (x.dtype if hasattr(x, "dtype") else jnp.result_type(x) for x in (a, b))
        if a_shape != b_shape or a_dtype != b_dtype:
            bad.append(f"'{path_str(path)}' with shape {b_shape} and dtype {b_dtype}, but it was {a_shape} {a_dtype}")
    if bad:
        raise ValueError(f"make_train_step: loss_fn returned model state leaf {'; '.join(bad)}. {MODEL_STATE_FIX}")


def updated_model_state(old: PyTree, new: PyTree, axis: Any) -> PyTree:
    """The loss's new model state, per device (a count that does not depend on
    the batch is typed per device too, for the scan carry), with ``None``
    where the loss returned the very value it received."""
    check_model_state(old, new)
    new_leaves, treedef = jax.tree.flatten(new)
    old_leaves = jax.tree.leaves(old)
    return jax.tree.unflatten(
        treedef,
        [None if n is o else coll.to_varying(n, axis) for n, o in zip(new_leaves, old_leaves, strict=True)],
    )


def keep_untouched(new: PyTree, old: PyTree) -> PyTree:
    """``new`` (``None`` where untouched) completed with ``old``'s values."""
    treedef = jax.tree.structure(old)
    return jax.tree.unflatten(
        treedef, [o if n is None else n for n, o in zip(treedef.flatten_up_to(new), jax.tree.leaves(old), strict=True)]
    )


def mark_untouched(values: PyTree, kept: PyTree) -> PyTree:
    """``values`` with ``None`` wherever ``kept`` (a traced example) has one."""
    treedef = jax.tree.structure(values)
    marks = treedef.flatten_up_to(kept)
    return jax.tree.unflatten(
        treedef, [None if m is None else v for v, m in zip(jax.tree.leaves(values), marks, strict=True)]
    )


def combine_model_state(new: PyTree, old: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Data-parallel model state: each device updated it from its own slice;
    floats are averaged over every batch axis, the rest must agree (max);
    untouched leaves (``None``) keep their old value bitwise."""
    treedef = jax.tree.structure(old)
    return jax.tree.unflatten(
        treedef,
        [
            o if n is None else agree(n, axes)
            for n, o in zip(treedef.flatten_up_to(new), jax.tree.leaves(old), strict=True)
        ],
    )


def agree(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """One replicated value of a per-device model state leaf: floats are
    averaged over the batch axes, anything else (counts, keys, flags) must
    agree across devices and is taken as its maximum."""
    if is_float(x):
        return jax.lax.pmean(x, axes)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # pyright: ignore[reportPrivateImportUsage] - public at runtime, not re-exported in the stubs
        return jax.random.wrap_key_data(jax.lax.pmax(jax.random.key_data(x), axes), impl=jax.random.key_impl(x))
    if x.dtype == jnp.bool_:
        return jax.lax.pmax(x.astype(jnp.int32), axes).astype(jnp.bool_)
    return jax.lax.pmax(x, axes)
