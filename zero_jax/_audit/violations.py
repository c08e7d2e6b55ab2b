"""The stage's contract on one model, and how a compiled step breaks it.

The ``*_violations`` functions name each broken promise (the communication
theory and the wire check live in :mod:`zero_jax._audit.communication`), and
:func:`layer_schedule` reads the per-layer schedule of a compiled step (int8
gathers and all-to-all reductions included). Which state a stage partitions
is asked of the policy (``policy.partitions_params`` and its siblings), never
read off the stage number.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping

from zero_jax._audit.hlo import Collective
from zero_jax._audit.model_axes import is_model_only, local_shape
from zero_jax._audit.report import (
    GRADIENT_ALL_REDUCE,
    LAYERS_ALIVE,
    REDUCE_IN_ACCUM_LOOP,
    REPLICATED_LEAF,
    LayerSchedule,
    LeafBytes,
    ParamInfo,
    Violation,
)
from zero_jax._base.units import fmt_bytes
from zero_jax._layout.leaf import (
    REASON_ALL_MODEL_SHARDED,
    REASON_FEW_MATRICES,
    REASON_NO_DIMENSION,
    REASON_WHOLE_MATRIX,
    is_float,
    leaf_layout,
    shard_shape,
)
from zero_jax._policy.policy import ZeroPolicy

_WHAT = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
REPLICATED_MESSAGE = (
    "'{path}' ({dtype}{shape}, {size:,} elements, {nbytes}) is held {how} on a device ({per_device}), but stage "
    "{stage} partitions {what} and the leaf has >= {threshold} elements. The policy keeps it whole (its "
    "min_shard_size is {policy_threshold}): lower ZeroPolicy(min_shard_size=...) or fix the sharding; pass "
    "audit(..., min_shard_size=...) if keeping it whole is intended."
)
ALL_REDUCE_MESSAGE = (
    "all-reduce '{name}' (op {op_name}) of {shape} ({nbytes}, x{trips}{where}) over {axes} in stage {stage}{match}: "
    "a gradient-sized all-reduce (>= {threshold} elements). Stages 1-3 reduce-scatter gradients over the data axis "
    "(with model axes: inside a shard_map nested over the leaf's model axes); only leaves kept whole (below "
    "min_shard_size, or whole_matrices) may be all-reduced. An optimizer that multiplies a matrix by itself (Muon) "
    "all-reduces products of cut matrices: pass ZeroPolicy(..., **zj.matrix_leaves(tx, params))."
)
ACCUM_MESSAGE = (
    "{kind} '{name}' of {shape} runs inside the {steps}-trip accumulation loop ({trips}x per step), but "
    "accum_mode='local' promises one gradient reduction per step: accumulate locally and reduce after the loop."
)

LAYERS_MESSAGE = (
    "the stage-3 step holds {alive} whole layers at once (at {where} in the compiled schedule; {layer} per layer), "
    "more than prefetch + 1{kept} = {limit}: layers are gathered ahead of use (XLA hoists an all-gather whose "
    "operand does not depend on the layer's input to the start of the program, e.g. zj.gather of each block in a "
    "Python loop). "
    "Run each block through zj.apply_layers / zj.apply_layer (zj.scan_layers for stacked layers) or the adapters' "
    "layers=; pass zj.audit(..., prefetch=k) if the step prefetches k blocks."
)


def _shapes(p: ParamInfo) -> set[tuple[int, ...]]:
    """The shapes a leaf's gradient may be reduced in: whole or stored, or one
    layer of either; whole or one model shard."""
    lay = p.layout
    shapes = {lay.shape, lay.stored_shape, lay.shape[1:], lay.stored_shape[1:]}
    return shapes | {local_shape(s, p.split) for s in shapes}


def _shape(c: Collective) -> str:
    return f"{c.dtype}[{','.join(map(str, c.shape))}]"


def partitioned_categories(policy: ZeroPolicy) -> set[str]:
    """The report categories ``policy`` partitions."""
    flags = {"optimizer": policy.partitions_opt_state, "grads": policy.partitions_grads}
    return {cat for cat, on in (flags | {"params": policy.partitions_params}).items() if on}


def stacked_paths(params: Iterable[ParamInfo]) -> set[tuple[str, ...]]:
    """The stacked parameters' paths, as tuples of names."""
    return {tuple(p.path.split("/")) for p in params if p.stacked}


def whole_paths(params: Iterable[ParamInfo]) -> set[tuple[str, ...]]:
    """The paths of the parameters kept whole for an optimizer that multiplies
    them by themselves (``ZeroPolicy(whole_matrices=...)``), as tuples of names."""
    return {tuple(p.path.split("/")) for p in params if p.layout.reason in (REASON_WHOLE_MATRIX, REASON_FEW_MATRICES)}


def mirrors_stacked(leaf_path: str, stacked: set[tuple[str, ...]]) -> bool:
    """Whether a state leaf (``params/...``, ``grads/...``, ``opt_state/.../mu/...``)
    is, or mirrors, a stacked parameter: its path past the field ends with one
    (the rule ``ZeroPolicy.state_layouts`` lays optimizer state out by)."""
    names = tuple(leaf_path.split("/"))[1:]
    return any(names[i:] in stacked for i in range(len(names)))


def replicated_violations(
    leaves: list[LeafBytes],
    policy: ZeroPolicy,
    min_shard_size: int,
    stacked: set[tuple[str, ...]],
    whole: frozenset[tuple[str, ...]] = frozenset(),
) -> list[Violation]:
    """Float leaves kept whole in a category the stage partitions, though the
    partition rule at ``min_shard_size`` would cut them (those that are, or
    mirror, a parameter in ``whole``, kept whole by ``whole_matrices``, are
    expected)."""
    n = policy.num_shards
    if n <= 1:
        return []
    cats, out = partitioned_categories(policy), []
    for leaf in leaves:
        if (
            leaf.category not in cats
            or not is_float(leaf.dtype)
            or leaf.per_device * n * leaf.model_split <= leaf.nbytes
        ):
            continue
        if mirrors_stacked(leaf.path, set(whole)):
            continue  # kept whole by whole_matrices: the optimizer multiplies it by itself
        size = math.prod(leaf.shape)
        skip = mirrors_stacked(leaf.path, stacked)
        model = tuple("model" if cut else None for cut in leaf.model_dims) if any(leaf.model_dims) else ()
        lay = leaf_layout(leaf.shape, leaf.dtype, n, min_shard_size=min_shard_size, skip_leading=skip, model=model)
        if not lay.partitioned and (
            lay.reason in (REASON_NO_DIMENSION, REASON_ALL_MODEL_SHARDED) or size < min_shard_size
        ):
            continue  # small, nothing to cut but a stacked layer axis, or every free dimension the model's
        message = REPLICATED_MESSAGE.format(
            path=leaf.path, dtype=leaf.dtype, shape=list(leaf.shape), size=size, nbytes=fmt_bytes(leaf.nbytes),
            how="whole" if leaf.replicated else f"{leaf.per_device / leaf.nbytes:.0%}",
            per_device=fmt_bytes(leaf.per_device), stage=policy.stage, what=_WHAT[leaf.category],
            threshold=min_shard_size, policy_threshold=policy.min_shard_size,
        )  # fmt: skip
        out.append(Violation(REPLICATED_LEAF, leaf.path, message))
    return out


def all_reduce_violations(
    colls: tuple[Collective, ...],
    loops: Mapping[str, tuple[int, ...]],
    params: list[ParamInfo],
    min_shard_size: int,
    policy: ZeroPolicy,
) -> list[Violation]:
    """Gradient-sized all-reduces over the data (or replica) axes in a stage
    that reduce-scatters gradients: at least ``min_shard_size`` elements, or
    the smallest partitioned leaf's model shard if smaller. One spanning model
    axes only is the model's own layout (a row-parallel matmul's all-reduce)."""
    if not policy.partitions_opt_state:  # data parallelism all-reduces by design
        return []
    sizes = [math.prod(p.layout.shape) // p.model_split for p in params if p.layout.partitioned]
    threshold = max(2, min([min_shard_size, *sizes]))  # a scalar (a loss, a norm) is never a gradient
    # HSDP all-reduces each gradient's 1/N piece (of its model shard) across the replica axes: expected.
    pieces = {local_shape(shard_shape(p.layout, policy.num_shards), p.split) for p in params if p.layout.partitioned}
    replica_axes, model = set(policy.replica_axes), set(policy.model_axes)
    # A leaf model-sharded on every free dimension stays whole over data (the policy says so): its
    # gradient is all-reduced by design, one all-reduce of its model-shard shape, whatever shares it.
    # So is the gradient of a leaf kept whole for an optimizer that multiplies it by itself (whole_matrices).
    by_design = (REASON_ALL_MODEL_SHARDED, REASON_WHOLE_MATRIX, REASON_FEW_MATRICES)
    expected = collections.Counter(
        local_shape(p.layout.shape, p.split) for p in params if p.layout.reason in by_design and not p.frozen
    )
    out = []
    for c in colls:
        if c.kind != "all-reduce" or math.prod(c.shape) < threshold or is_model_only(c, policy, model):
            continue
        if replica_axes and set(c.axes(policy.mesh)) <= replica_axes and c.shape in pieces:
            continue
        if expected[c.shape] > 0:
            expected[c.shape] -= 1
            continue
        match = [p.path for p in params if c.shape in _shapes(p)]
        message = ALL_REDUCE_MESSAGE.format(
            name=c.name, op_name=c.op_name or "-", shape=_shape(c), nbytes=fmt_bytes(c.bytes), trips=c.trips,
            stage=policy.stage, axes="+".join(c.axes(policy.mesh)) or "-",
            where=f" inside loops of {'x'.join(map(str, loops[c.name]))} trips" if loops.get(c.name) else "",
            match=f", the shape of {', '.join(match)}" if match else "", threshold=threshold,
        )  # fmt: skip
        out.append(Violation(GRADIENT_ALL_REDUCE, c.name, message))
    return out


def accum_violations(
    colls: tuple[Collective, ...], loops: Mapping[str, tuple[int, ...]], steps: int, policy: ZeroPolicy | None = None
) -> list[Violation]:
    """Gradient reductions inside the accumulation loop of a local-accumulation
    step (over the data or replica axes: the model's own reductions over model
    axes run per microbatch by design); with qgZ an int8 all-to-all is one."""
    model = set(policy.model_axes) if policy is not None else set()
    out = []
    for c in colls:
        nest = loops.get(c.name, ())
        if policy is not None and is_model_only(c, policy, model):
            continue
        reduction = c.kind in ("all-reduce", "reduce-scatter") or (c.kind == "all-to-all" and c.dtype == "s8")  # qgZ
        if reduction and c.shape != () and nest and nest[0] == steps:
            message = ACCUM_MESSAGE.format(kind=c.kind, name=c.name, shape=_shape(c), steps=steps, trips=c.trips)
            out.append(Violation(REDUCE_IN_ACCUM_LOOP, c.name, message))
    return out


def layer_violations(schedule: LayerSchedule | None, policy: ZeroPolicy, manual: bool) -> list[Violation]:
    """A stage-3 manual step holding more than ``prefetch + 1`` whole layers
    (plus the layers it keeps gathered for the backward pass, ``keep_gathered``)."""
    if schedule is None or not schedule.judged or not manual or not policy.partitions_params:
        return []
    if schedule.max_alive <= schedule.limit:
        return []
    kept = f" + {schedule.kept} kept (keep_gathered)" if schedule.kept else ""
    message = LAYERS_MESSAGE.format(
        alive=schedule.max_alive, where=schedule.where, layer=fmt_bytes(schedule.layer_bytes), limit=schedule.limit,
        kept=kept,
    )  # fmt: skip
    return [Violation(LAYERS_ALIVE, schedule.where or "layers", message)]
