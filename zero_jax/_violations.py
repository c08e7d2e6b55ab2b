"""The stage's contract on one model, and how a compiled step breaks it.

The ``*_violations`` functions name each broken promise (the communication
theory and the wire check live in :mod:`zero_jax._comm_audit`), and
:func:`layer_schedule` reads the per-layer schedule of a compiled step (int8
gathers and all-to-all reductions included). Which state a stage partitions
is asked of the policy (``policy.partitions_params`` and its siblings), never
read off the stage number.

Floor 6 (with ``_audit``): imports the policy, the partition rules, the
communication audit and the report types.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from zero_jax import _measure
from zero_jax._comm_audit import (
    ParamInfo,
    is_float_dtype,
    joined_arrays,
    scale_heads,
    wire_shape,
    wire_stored_by_shape,
)
from zero_jax._measure import Collective, Instruction
from zero_jax._model_axes import is_model_only, local_shape, model_axes
from zero_jax._partition import REASON_ALL_MODEL_SHARDED, REASON_NO_DIMENSION, LeafLayout, leaf_layout, shard_shape
from zero_jax._policy import ZeroPolicy
from zero_jax._report import (
    GRADIENT_ALL_REDUCE,
    LAYERS_ALIVE,
    REDUCE_IN_ACCUM_LOOP,
    REPLICATED_LEAF,
    BlockSchedule,
    LayerSchedule,
    LeafBytes,
    Violation,
)
from zero_jax._units import fmt_bytes

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
    "min_shard_size) may be all-reduced."
)
ACCUM_MESSAGE = (
    "{kind} '{name}' of {shape} runs inside the {steps}-trip accumulation loop ({trips}x per step), but "
    "accum_mode='local' promises one gradient reduction per step: accumulate locally and reduce after the loop."
)

LAYERS_MESSAGE = (
    "the stage-3 step holds {alive} whole layers at once (at {where} in the compiled schedule; {layer} per layer), "
    "more than prefetch + 1 = {limit}: layers are gathered ahead of use (XLA hoists an all-gather whose operand does "
    "not depend on the layer's input to the start of the program, e.g. zj.gather of each block in a Python loop). "
    "Run each block through zj.apply_layers / zj.apply_layer (zj.scan_layers for stacked layers) or the adapters' "
    "layers=; pass zj.audit(..., prefetch=k) if the step prefetches k blocks."
)
_BLOCK_SCOPE = re.compile(r"zj_block(\d+)_(gather|reduce)")


def is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.inexact))


def _model_shard(p: ParamInfo) -> LeafLayout:
    """The layout of one model shard of a parameter (itself without model axes)."""
    if p.model_split <= 1:
        return p.layout
    return dataclasses.replace(p.layout, shape=local_shape(p.layout.shape, p.split))


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


def mirrors_stacked(leaf_path: str, stacked: set[tuple[str, ...]]) -> bool:
    """Whether a state leaf (``params/...``, ``grads/...``, ``opt_state/.../mu/...``)
    is, or mirrors, a stacked parameter: its path past the field ends with one
    (the rule ``ZeroPolicy.state_layouts`` lays optimizer state out by)."""
    names = tuple(leaf_path.split("/"))[1:]
    return any(names[i:] in stacked for i in range(len(names)))


def replicated_violations(
    leaves: list[LeafBytes], policy: ZeroPolicy, min_shard_size: int, stacked: set[tuple[str, ...]]
) -> list[Violation]:
    """Float leaves kept whole in a category the stage partitions, though the
    partition rule at ``min_shard_size`` would cut them."""
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
    replica_axes, model = set(policy.replica_axes), set(model_axes(policy))
    # A leaf model-sharded on every free dimension stays whole over data (the policy says so): its
    # gradient is all-reduced by design, one all-reduce of its model-shard shape, whatever shares it.
    expected = collections.Counter(
        local_shape(p.layout.shape, p.split) for p in params if p.layout.reason == REASON_ALL_MODEL_SHARDED
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
    model = set(model_axes(policy)) if policy is not None else set()
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


# -- the per-layer schedule -------------------------------------------------------------------------------------


class _Group(NamedTuple):
    """Layers the parameter tree declares (a scan's stacked leaves, or repeated
    sibling blocks): the shapes one layer gathers and reduce-scatters, those
    no other parameter has (``counted``, for the counts), and its size."""

    name: str
    layers: int
    gathered: set[tuple[int, ...]]
    pieces: set[tuple[int, ...]]
    counted: set[tuple[int, ...]]
    weights: int  # partitioned leaves per layer whose shapes are counted
    elements: int
    bytes: int
    wire: set[tuple[int, ...]]  # on a quantized wire: one layer's int8 (N, nb, block) shapes,
    wire_counted: set[tuple[int, ...]]  # and the counted leaves' ones


def _group(name: str, layers: int, lays: list[tuple[LeafLayout, np.dtype]], others: list[LeafLayout], n: int,
           block: int) -> _Group:  # fmt: skip
    """One group from its layers' leaf layouts (one layer) and the other
    parameters' layouts (``block``: the wire's elements per scale; 0 when
    nothing is quantized). A layer leaf is counted when no other parameter,
    and no leaf of the layer left uncounted, moves in its shapes, float or int8."""
    wire = lambda lay: wire_shape(lay, n, block) if block else ()  # noqa: E731
    shapes = lambda lay: {lay.stored_shape, shard_shape(lay, n)} | ({wire(lay)} if block else set())  # noqa: E731
    taken = set().union(*(shapes(lay) for lay in others))
    mine = [lay for lay, _ in lays if not shapes(lay) & taken]
    while True:  # nor one left out of this layer (int8 blocks of two weights often share a shape)
        left = set().union(*(shapes(lay) for lay, _ in lays if lay not in mine))
        if not any(shapes(lay) & left for lay in mine):
            break
        mine = [lay for lay in mine if not shapes(lay) & left]
    mine = mine or [lay for lay, _ in lays]
    return _Group(
        name, layers, {lay.stored_shape for lay, _ in lays}, {shard_shape(lay, n) for lay, _ in lays},
        {lay.stored_shape for lay in mine} | {shard_shape(lay, n) for lay in mine}, len(mine),
        sum(math.prod(lay.stored_shape) for lay, _ in lays),
        sum(math.prod(lay.stored_shape) * dt.itemsize for lay, dt in lays),
        {wire(lay) for lay, _ in lays}, {wire(lay) for lay in mine},
    )  # fmt: skip


def _layer_groups(params: list[ParamInfo], policy: ZeroPolicy) -> list[_Group]:
    """The scans (``stacked=`` prefixes) and repeated blocks (siblings named
    ``0, 1, …`` or ``h_0, h_1, …`` with identical leaves) of the parameters."""
    quantized = policy.wire.weights is not None or policy.wire.grads is not None
    n, block, out = policy.num_shards, policy.wire.block if quantized else 0, []
    cut = [p for p in params if p.layout.partitioned]
    for prefix in policy.stacked:
        members = [p for p in cut if p.stacked and tuple(p.path.split("/"))[: len(prefix)] == prefix]
        lays = [(LeafLayout(p.layout.shape[1:], p.dtype, p.layout.dim - 1, p.layout.padded_size), p.dtype)
                for p in members if p.layout.dim]  # fmt: skip
        others = [p.layout for p in cut if id(p) not in {id(q) for q in members}]
        if lays:
            out.append(_group(f"scan {'/'.join(prefix)}/*", members[0].layout.shape[0], lays, others, n, block))
    siblings: dict[tuple[str, ...], dict[str, list[ParamInfo]]] = {}
    for p in params:
        names = p.path.split("/")
        j = next((j for j, nm in enumerate(names) if re.fullmatch(r"\d+|.+_\d+", nm)), None)
        if not p.stacked and j is not None:
            siblings.setdefault(tuple(names[:j]), {}).setdefault(names[j], []).append(p)
    for parent, blocks in siblings.items():
        structures = {
            tuple((q.path.split("/", len(parent) + 1)[-1], q.layout.shape) for q in b) for b in blocks.values()
        }
        members = [q for b in blocks.values() for q in b]
        lays = [(q.layout, q.dtype) for q in next(iter(blocks.values())) if q.layout.partitioned]
        if len(blocks) >= 2 and len(structures) == 1 and lays:
            others = [p.layout for p in cut if id(p) not in {id(q) for q in members}]
            out.append(_group(f"{'/'.join(parent)}/*", len(blocks), lays, others, n, block))
    return out


def _scope(ins: Instruction) -> tuple[int, str] | None:
    """(block index, "forward" | "backward" | "reduce") of a named collective, or None."""
    found = list(_BLOCK_SCOPE.finditer(ins.op_name))
    if not found:
        return None
    m = found[-1]
    if m.group(2) == "reduce":
        return int(m.group(1)), "reduce"
    return int(m.group(1)), "backward" if "transpose(" in ins.op_name[: m.start()] else "forward"


def _count(
    hlo: str, groups: list[_Group], policy: ZeroPolicy, stored: Mapping[tuple[int, ...], tuple[int, int]]
) -> tuple[dict[int, list[int]], dict[str, list[int]]]:
    """Per named block [weights, forward, backward, reduces, bytes, elements,
    weights, bytes] and per group [forward, backward, reduces]: all-gather /
    reduce-scatter arrays per step (weights, bytes, elements: of one forward
    gather; the last two: of one reduction, whole). On a quantized wire an
    int8 all-gather is a gather, an int8 all-to-all a reduction, its float32
    scales ride along uncounted, and its whole bytes are the leaf's
    (``stored``: int8 shape -> the dequantized stored elements and bytes)."""
    comps, _, trips = _measure.scheduled_computations(hlo)
    heads = scale_heads(comps.values(), policy.wire.block)
    named: dict[int, list[int]] = {}
    unnamed = {g.name: [0, 0, 0] for g in groups}
    slot = {"forward": 1, "backward": 2, "reduce": 3}
    for comp, instrs in comps.items():
        for ins in instrs:
            arrays = [a for a in joined_arrays(ins) if not (is_float_dtype(a[0]) and a[1] in heads)]
            int8 = bool(arrays) and all(dt == "s8" for dt, _, _ in arrays)
            if not arrays or ins.op not in ("all-gather", "all-gather-start", "reduce-scatter", "all-to-all"):
                continue
            k, scope = trips.get(comp, 1), _scope(ins)
            gather = ins.op.startswith("all-gather")
            if (gather and not policy.partitions_params) or (ins.op == "all-to-all" and not int8):
                continue  # stage 2: the update's all-gathers, not layers; a float all-to-all: the model's
            whole = [stored.get(d, (0, b))[1] if dt == "s8" else b * (1 if gather else policy.num_shards)
                     for dt, d, b in arrays]  # fmt: skip
            if scope is not None:
                row = named.setdefault(scope[0], [0] * 8)
                row[slot[scope[1]]] += k * len(arrays)
                if scope[1] == "forward":
                    row[0] += len(arrays)
                    row[4] += sum(whole)
                    row[5] += sum(stored.get(d, (0,))[0] if dt == "s8" else math.prod(d) for dt, d, _ in arrays)
                elif scope[1] == "reduce":
                    row[6] += len(arrays)
                    row[7] += sum(whole)
                continue
            for dt, dims, _ in arrays:
                g = next((g for g in groups if (dims in g.wire_counted if dt == "s8" else dims in g.counted and dims
                          in (g.gathered if gather else g.pieces))), None)  # fmt: skip
                if g is not None:
                    unnamed[g.name][(1 if "transpose(" in ins.op_name else 0) if gather else 2] += k
    return named, unnamed


def layer_schedule(hlo: str, params: list[ParamInfo], policy: ZeroPolicy, prefetch: int) -> LayerSchedule | None:
    """The per-layer schedule of a compiled (scheduled) stage-2/3 program, or
    None when it runs no blocks (see :class:`LayerSchedule`)."""
    if not policy.partitions_grads:
        return None
    stored = wire_stored_by_shape(params, policy)
    params = [p._replace(layout=_model_shard(p)) for p in params]  # with model axes: what one device gathers
    groups, wire = _layer_groups(params, policy), policy.wire
    named, unnamed = _count(hlo, groups, policy, stored)
    blocks = [
        BlockSchedule(f"block {i}", 1, r[0] or r[6], r[1], r[2], r[3], r[4] or r[7]) for i, r in sorted(named.items())
    ]
    blocks += [
        BlockSchedule(g.name, g.layers, g.weights, *unnamed[g.name], g.bytes) for g in groups if any(unnamed[g.name])
    ]
    if not blocks:
        return None
    # On an int8 weight wire a layer is alive as its int8 gathers (then their dequantized copy), each
    # counting the stored elements it carries: what the same gather holds in float.
    shapes = set().union(*((g.wire if wire.weights else g.gathered) for g in groups))
    elements = max([g.elements for g in groups] + [r[5] for r in named.values()], default=1)

    def classify(ins: Instruction) -> Any:
        if not policy.partitions_params:
            return None
        scope = _scope(ins)
        if scope is not None:
            return ("block", *scope)
        held = [stored.get(dims, (0,))[0] if dt == "s8" else math.prod(dims) for dt, dims, _ in ins.arrays]
        return sum(held) if any(dims in shapes for _, dims, _ in ins.arrays) else None

    alive = _measure.layers_alive(hlo, classify, elements)
    return LayerSchedule(tuple(blocks), max(b.bytes for b in blocks), alive.layers, alive.where, prefetch, True)


def layer_violations(schedule: LayerSchedule | None, policy: ZeroPolicy, manual: bool) -> list[Violation]:
    """A stage-3 manual step holding more than ``prefetch + 1`` whole layers."""
    if schedule is None or not schedule.judged or not manual or not policy.partitions_params:
        return []
    limit = schedule.prefetch + 1
    if schedule.max_alive <= limit:
        return []
    message = LAYERS_MESSAGE.format(
        alive=schedule.max_alive, where=schedule.where, layer=fmt_bytes(schedule.layer_bytes), limit=limit
    )
    return [Violation(LAYERS_ALIVE, schedule.where or "layers", message)]
