"""The per-layer schedule of a compiled step, read off the program the backend runs.

* :func:`layer_schedule`: for each block (``zj.apply_layer(s)``, named
  ``zj_block<i>_gather`` / ``zj_block<i>_reduce`` in the program), scan
  (``zj.scan_layers``, recognised by its layer shapes) or repeated block of
  the parameter tree: its all-gathers and gradient reductions per step, and
  the most whole layers alive at once (:func:`layers_alive`).
* :func:`layer_overlap`: for each layer gather and reduction, whether compute
  is scheduled between its start and its done (``report.overlap``).

Both read the compiled program through :func:`zero_jax._audit.compiled.read_compiled`,
so every spelling a backend uses counts alike: TPU's continuation fusions and
async pairs, a reduce-scatter the TPU backend decomposes into all-reduce +
dynamic-slice (named by the block whose backward produced its operand:
``zj_block<i>_compute``), a small gather done as all-reduce, and combined
tuple all-reduces, member by member.
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import numpy as np

from zero_jax._audit.communication import QUANTIZED_KINDS, is_float_dtype, wire_shape, wire_stored_by_shape
from zero_jax._audit.compiled import CompiledCollective, CompiledProgram, Instruction, as_program
from zero_jax._audit.hlo import Collective, replica_group
from zero_jax._audit.model_axes import model_shard_layout
from zero_jax._audit.report import BlockSchedule, LayerSchedule, Overlap, OverlapRow, ParamInfo
from zero_jax._comm.collectives import GRAD_REDUCTION_FIRST, GRAD_REDUCTION_SCOPE, joined_layout
from zero_jax._layerwise.keep import KEPT_SCOPE
from zero_jax._layerwise.schedule import schedule_for
from zero_jax._layout.leaf import LeafLayout, shard_shape
from zero_jax._policy.policy import ZeroPolicy

#: Ops whose result holds the same (gathered) data as their operand: a layer
#: stays whole while any of them is alive.
_ALIASES = frozenset({
    "bitcast", "bitcast-convert", "copy", "copy-start", "copy-done", "reshape", "transpose", "convert", "slice",
    "tuple", "get-tuple-element", "all-gather-done", "optimization-barrier",
})  # fmt: skip


Classify = Any  # all-gather -> ("block", 3, "forward"), "elements" / a count (unnamed layer-shaped) or None


Alive = collections.namedtuple("Alive", "layers where")  # the most whole layers alive at once, and where


def _intervals(
    instrs: list[Instruction], classify: Classify, carried: set[int]
) -> tuple[dict[Any, list[int]], dict[Any, int], set[int]]:
    """Per group [first def, last use] and its elements; the ROOT tuple slots
    holding gathered data (``carried``: the body parameter's slots that do)."""
    holders: dict[str, frozenset[Any]] = {}
    narrow: dict[str, int] = {}  # held int8 buffers (qwZ) -> elements: a read of one about as big dequantizes it
    span: dict[Any, list[int]] = {}
    size: dict[Any, int] = {}
    end, root_slots = len(instrs), set[int]()
    params = {ins.name for ins in instrs if ins.op == "parameter"}
    for t, ins in enumerate(instrs):
        groups: set[Any] = set()
        if ins.op in ("all-gather", "all-gather-start"):
            key = classify(ins)  # an int: an unnamed layer-shaped gather holding that many elements whole
            if key is not None:
                # One buffer per gather, a named one too: a block counts by the bytes of it still alive (a
                # block's norm weight kept to the program's end is not its whole layer).
                held = ("elements", ins.name) if key == "elements" or type(key) is int else (key, ins.name)
                groups.add(held)
                size[held] = key if type(key) is int else ins.elements
        elif ins.op == "get-tuple-element" and carried and ins.operands and ins.operands[0] in params:
            slot = re.search(r"index=(\d+)", ins.attrs)
            if slot and int(slot.group(1)) in carried:
                groups.add(("carry", ins.name))
                size[("carry", ins.name)] = ins.elements
        for i, operand in enumerate(ins.operands):
            got = holders.get(operand)
            if got is None:
                continue
            for g in got:
                span[g][1] = max(span[g][1], end if ins.root else t)
            if ins.op in _ALIASES or narrow.get(operand, 0) // 2 < ins.elements <= narrow.get(operand, 0):
                groups |= got
            if ins.root and ins.op == "tuple":
                root_slots.add(i)
        for g in groups:
            span.setdefault(g, [t, end if ins.root else t])
        if groups:
            holders[ins.name] = frozenset(groups)
            narrow |= {ins.name: ins.elements} if ins.arrays and all(dt == "s8" for dt, _, _ in ins.arrays) else {}
    return span, size, root_slots


def layers_alive(program: str | CompiledProgram, classify: Classify, layer_elements: int) -> Alive:
    """The largest number of whole layers alive at once in a scheduled
    (compiled) HLO module.

    Walks each computation in schedule order, tracking every gathered
    buffer ``classify`` names from its all-gather to its last use (through
    bitcasts, copies, slices, tuples; from an int8 gather into a read of it
    of more than half its elements: its dequantized copy). Every gathered
    buffer alive, named (a block's) or unnamed (layer-shaped), and in a loop
    body the gathered layers carried from the previous trip (a prefetch
    queue), counts its elements: the count is their sum / ``layer_elements``,
    rounded down (a small piece of a block alive is no whole layer). At a while loop the count is what stays
    alive across the loop plus the most its body holds. ``program``: HLO text,
    or the program :func:`zero_jax._audit.compiled.read_compiled` read (an
    async gather is alive from its start).

    >>> lines = ["ENTRY %main (p: f32[2,8]) -> f32[2,8] {", "  %p = f32[2,8] parameter(0)",
    ...          "  %g0 = f32[8,8] all-gather(%p)", "  %g1 = f32[8,8] all-gather(%p)",
    ...          "  %d0 = f32[2,8] dot(%p, %g0)", "  ROOT %d1 = f32[2,8] dot(%d0, %g1)", "}"]
    >>> layers_alive(chr(10).join(lines), lambda ins: "elements", 64)  # g0, g1 alive together from g1 to d0
    Alive(layers=2, where='main/g1')
    """
    program = as_program(program)
    comps, entry = program.computations, program.entry
    found = (re.search(r"body=%?([\w.\-]+)", i.attrs) for b in comps.values() for i in b if i.op == "while")
    bodies = {m.group(1) for m in found if m}
    memo: dict[str, Alive] = {}

    def walk(name: str) -> Alive:
        if name in memo:
            return memo[name]
        memo[name] = Alive(0, "")  # recursion guard
        instrs = comps.get(name, [])
        slots: set[int] = set()
        span, size, new = _intervals(instrs, classify, slots)
        while name in bodies and not new <= slots:  # the slots carried from trip to trip: to a fixed point
            slots |= new
            span, size, new = _intervals(instrs, classify, slots)
        best = Alive(0, "")
        for t, ins in enumerate(instrs):
            body = re.search(r"body=%?([\w.\-]+)", ins.attrs) if ins.op == "while" else None
            inner = walk(body.group(1)).layers if body else 0
            # Buffers handed to the loop are counted inside it (as carried layers).
            alive = [g for g, (a, b) in span.items() if a <= t <= b and (b > t or not inner)]
            whole = sum(size.get(g, 0) for g in alive) // max(layer_elements, 1)
            if whole + inner > best.layers:
                best = Alive(whole + inner, f"{name}/{ins.name}")
        memo[name] = best
        return best

    return walk(entry)


_BLOCK_SCOPE = re.compile(r"zj_block(\d+)_(gather|reduce|compute)")
_REDUCTIONS = ("reduce-scatter", "all-to-all")


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


def _major_shape(lay: LeafLayout, n: int) -> tuple[int, ...]:
    """A leaf cut along a dimension other than its first as the schedule's
    ``major_axis_collectives`` gathers it: the N pieces along a new leading
    dimension (``_comm.collectives.gather_along``)."""
    s, d = lay.stored_shape, lay.dim or 0
    return (n, *s[:d], s[d] // n, *s[d + 1:]) if d else s


def _group(name: str, layers: int, lays: list[tuple[LeafLayout, np.dtype]], others: list[LeafLayout], n: int,
           block: int, major: bool = False) -> _Group:  # fmt: skip
    """One group from its layers' leaf layouts (one layer) and the other
    parameters' layouts (``block``: the wire's elements per scale; 0 when
    nothing is quantized; ``major``: gathered along a new leading dimension,
    :func:`_major_shape`). A layer leaf is counted when no other parameter,
    and no leaf of the layer left uncounted, moves in its shapes, float or int8."""
    wire = lambda lay: wire_shape(lay, n, block) if block else ()  # noqa: E731
    whole = lambda lay: {lay.stored_shape} | ({_major_shape(lay, n)} if major else set())  # noqa: E731
    shapes = lambda lay: whole(lay) | {shard_shape(lay, n)} | ({wire(lay)} if block else set())  # noqa: E731
    taken = set().union(*(shapes(lay) for lay in others))
    mine = [lay for lay, _ in lays if not shapes(lay) & taken]
    while True:  # nor one left out of this layer (int8 blocks of two weights often share a shape)
        left = set().union(*(shapes(lay) for lay, _ in lays if lay not in mine))
        if not any(shapes(lay) & left for lay in mine):
            break
        mine = [lay for lay in mine if not shapes(lay) & left]
    mine = mine or [lay for lay, _ in lays]
    return _Group(
        name, layers, set().union(*(whole(lay) for lay, _ in lays)), {shard_shape(lay, n) for lay, _ in lays},
        set().union(*(whole(lay) for lay in mine)) | {shard_shape(lay, n) for lay in mine}, len(mine),
        sum(math.prod(lay.stored_shape) for lay, _ in lays),
        sum(math.prod(lay.stored_shape) * dt.itemsize for lay, dt in lays),
        {wire(lay) for lay, _ in lays}, {wire(lay) for lay in mine},
    )  # fmt: skip


def _as_moved(lays: list[tuple[LeafLayout, np.dtype]], policy: ZeroPolicy) -> list[tuple[LeafLayout, np.dtype]]:
    """One layer's partitioned leaves as its collectives move them: those the
    schedule moves together (``Schedule.together``) as their one joined array."""
    groups = schedule_for(policy).together([lay for lay, _ in lays], policy.comm)
    joined = {i for g in groups for i in g}
    return [lt for i, lt in enumerate(lays) if i not in joined] + [
        (joined_layout([lays[i][0] for i in g], policy.num_shards), lays[g[0]][1]) for g in groups
    ]


def _layer_groups(params: list[ParamInfo], policy: ZeroPolicy) -> list[_Group]:
    """The scans (``stacked=`` prefixes) and repeated blocks (siblings named
    ``0, 1, …`` or ``h_0, h_1, …`` with identical leaves) of the parameters."""
    quantized = policy.wire.weights is not None or policy.wire.grads is not None
    n, block, out = policy.num_shards, policy.wire.block if quantized else 0, []
    cut = [p for p in params if p.layout.partitioned]
    for prefix in policy.stacked_prefixes:
        members = [p for p in cut if p.stacked and tuple(p.path.split("/"))[: len(prefix)] == prefix]
        lays = [(LeafLayout(p.layout.shape[1:], p.dtype, p.layout.dim - 1, p.layout.padded_size,
                            model=p.layout.model[1:]), p.dtype) for p in members if p.layout.dim]  # fmt: skip
        others = [p.layout for p in cut if id(p) not in {id(q) for q in members}]
        if lays:
            out.append(_group(f"scan {'/'.join(prefix)}/*", members[0].layout.shape[0], _as_moved(lays, policy), others,
                              n, block, schedule_for(policy).major_axis_collectives))  # fmt: skip
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
            out.append(_group(f"{'/'.join(parent)}/*", len(blocks), _as_moved(lays, policy), others, n, block))
    return out


def _scope(op: str, op_name: str) -> tuple[int, str] | None:
    """(block index, "forward" | "backward" | "reduce") of a named collective
    (``op``: its plain op), or None. A gradient reduction is named by its
    block's reduce scope, or (a reduce-scatter the backend decomposed, which
    keeps no name of its own) by the block whose backward made its operand."""
    if op.removesuffix("-start") in _REDUCTIONS:
        found = [m for m in _BLOCK_SCOPE.finditer(op_name) if m.group(2) in ("reduce", "compute")]
        m = found[-1] if found else None
        if m is not None and (m.group(2) == "reduce" or "transpose(" in op_name[: m.start()]):
            return int(m.group(1)), "reduce"
        return None
    found = [m for m in _BLOCK_SCOPE.finditer(op_name) if m.group(2) != "compute"]
    if not found:
        return None
    m = found[-1]
    if m.group(2) == "reduce":
        return int(m.group(1)), "reduce"
    return int(m.group(1)), "backward" if "transpose(" in op_name[: m.start()] else "forward"


def _squeezed(dims: tuple[int, ...]) -> tuple[int, ...]:
    """Leading size-1 dimensions dropped (the TPU program gathers one layer of
    a scan as ``[1, d, f]``)."""
    while len(dims) > 1 and dims[0] == 1:
        dims = dims[1:]
    return dims


def _in(dims: tuple[int, ...], shapes: set[tuple[int, ...]]) -> bool:
    """Whether a collective's array has one of ``shapes``, up to size-1
    dimensions or flattened: the TPU program gathers a layer's joined small
    leaves, ``(N, L)``, as ``[N, 1, L]`` or ``[N·L]``."""
    if dims in shapes or _squeezed(dims) in shapes:
        return True
    bare = tuple(d for d in dims if d != 1)
    return any(tuple(d for d in s if d != 1) == bare or (len(bare) == 1 and math.prod(s) == bare[0]) for s in shapes)


def _count(
    program: CompiledProgram,
    groups: list[_Group],
    policy: ZeroPolicy,
    stored: Mapping[tuple[int, ...], tuple[int, int]],
) -> tuple[dict[int, list[int]], dict[str, list[int]]]:
    """Per named block [weights, forward, backward, reduces, bytes, elements,
    weights, bytes, kept] and per group [forward, backward, reduces, kept]:
    all-gather / reduce-scatter arrays per step (a reduce-scatter made of
    other collectives, the schedule's ``grad_reduction``: its first one,
    shaped like the piece one way round a ring; weights, bytes, elements: of
    one forward gather; the next two: of one reduction, whole; kept: forward
    gathers named kept, ``keep_gathered``). On a quantized wire an
    int8 all-gather is a gather, an int8 all-to-all a reduction, its float32
    scales ride along uncounted, and its whole bytes are the leaf's
    (``stored``: int8 shape -> the dequantized stored elements and bytes)."""
    comps, trips = program.computations, program.trips
    heads = scale_heads(comps.values(), policy.wire.block)
    named: dict[int, list[int]] = {}
    unnamed = {g.name: [0, 0, 0, 0] for g in groups}
    slot = {"forward": 1, "backward": 2, "reduce": 3}
    for comp, instrs in comps.items():
        for ins in instrs:
            arrays = [a for a in joined_arrays(ins) if not (is_float_dtype(a[0]) and a[1] in heads)]
            int8 = bool(arrays) and all(dt == "s8" for dt, _, _ in arrays)
            op = ins.op.removesuffix("-start")
            if GRAD_REDUCTION_SCOPE in ins.op_name:  # a reduce-scatter made of other collectives: its first one
                if GRAD_REDUCTION_FIRST not in ins.op_name or op not in ("collective-permute", "all-to-all"):
                    continue
                op, int8 = "reduce-scatter", False
            if not arrays or op not in ("all-gather", "reduce-scatter", "all-to-all"):
                continue
            k, scope = trips.get(comp, 1), _scope(op, ins.op_name)
            gather = op == "all-gather"
            if gather and makes_secondary_pieces(ins, policy):
                continue  # hpZ's gather across the nodes: a secondary piece, not a whole layer
            if model_axes_only(ins, policy):
                continue  # the model's own layout (a tensor-parallel gather), whatever block its op_name names
            if (gather and not policy.partitions_params) or (op == "all-to-all" and not int8):
                continue  # stage 2: the update's all-gathers, not layers; a float all-to-all: the model's
            whole = [stored.get(d, (0, b))[1] if dt == "s8" else b * (1 if gather else policy.num_shards)
                     for dt, d, b in arrays]  # fmt: skip
            kept = gather and KEPT_SCOPE in ins.op_name
            if scope is not None:
                row = named.setdefault(scope[0], [0] * 9)
                row[slot[scope[1]]] += k * len(arrays)
                if scope[1] == "forward":
                    row[0] += len(arrays)
                    row[8] += k * len(arrays) * kept
                    row[4] += sum(whole)
                    row[5] += sum(stored.get(d, (0,))[0] if dt == "s8" else math.prod(d) for dt, d, _ in arrays)
                elif scope[1] == "reduce":
                    row[6] += len(arrays)
                    row[7] += sum(whole)
                continue
            for dt, dims, _ in arrays:
                g = next((g for g in groups if (_in(dims, g.wire_counted) if dt == "s8" else _in(dims, g.counted) and
                          _in(dims, g.gathered if gather else g.pieces))), None)  # fmt: skip
                if g is not None:
                    unnamed[g.name][(1 if "transpose(" in ins.op_name else 0) if gather else 2] += k
                    unnamed[g.name][3] += k * kept
    return named, unnamed


def layer_schedule(
    program: str | CompiledProgram, params: list[ParamInfo], policy: ZeroPolicy, prefetch: int
) -> LayerSchedule | None:
    """The per-layer schedule of a compiled (scheduled) stage-2/3 program, or
    None when it runs no blocks (see :class:`LayerSchedule`)."""
    if not policy.partitions_grads:
        return None
    program = as_program(program, policy.mesh.size)
    stored = wire_stored_by_shape(params, policy)
    params = [p._replace(layout=model_shard_layout(p)) for p in params]  # with model axes: what one device gathers
    groups = _layer_groups(params, policy)
    named, unnamed = _count(program, groups, policy, stored)
    blocks = [
        BlockSchedule(f"block {i}", 1, r[0] or r[6], r[1], r[2], r[3], r[4] or r[7], int(r[8] > 0))
        for i, r in sorted(named.items())
    ]
    blocks += [
        BlockSchedule(g.name, g.layers, g.weights, *unnamed[g.name][:3], g.bytes, unnamed[g.name][3] // g.weights)  # pyright: ignore[reportCallIssue] - unnamed[name] is a 4-tuple
        for g in groups
        if any(unnamed[g.name])
    ]
    if not blocks:
        return None
    # On an int8 weight wire a layer is alive as its int8 gathers (then their dequantized copy), each
    # counting the stored elements it carries: what the same gather holds in float.
    shapes = _layer_shapes(groups, policy)[0]
    elements = max([g.elements for g in groups] + [r[5] for r in named.values()], default=1)

    def classify(ins: Instruction) -> Any:
        if not policy.partitions_params or makes_secondary_pieces(ins, policy) or model_axes_only(ins, policy):
            return None
        scope = _scope(ins.op, ins.op_name)
        if scope is not None:
            return ("block", *scope)
        held = [stored.get(dims, (0,))[0] if dt == "s8" else math.prod(dims) for dt, dims, _ in ins.arrays]
        return sum(held) if any(_in(dims, shapes) for _, dims, _ in ins.arrays) else None

    alive = layers_alive(program, classify, elements)
    return LayerSchedule(tuple(blocks), max(b.bytes for b in blocks), alive.layers, alive.where, prefetch, True)


def makes_secondary_pieces(ins: Instruction, policy: ZeroPolicy) -> bool:
    """hpZ: whether an all-gather runs across the nodes only (the policy's
    shard axes but its ``secondary_axis``): it makes secondary pieces, which
    live from the forward pass to the backward by design, not whole layers."""
    if not policy.secondary_axis or ins.op.removesuffix("-start") != "all-gather":
        return False
    size, group = replica_group(ins.attrs, policy.mesh.size)
    axes = Collective("all-gather", "", (), 0, size, group=group).axes(policy.mesh)
    return bool(axes) and policy.secondary_axis not in axes and set(axes) <= set(policy.axes)


def model_axes_only(ins: Instruction, policy: ZeroPolicy) -> bool:
    """Whether a collective runs across the policy's model axes only (its
    replica group known): the model's own layout, such as the gather of a
    weight cut over ``"model"`` that the SPMD partitioner inserts, never a
    layer's ZeRO gather or reduction. Its op_name is no guide: jax 0.10.2
    names such a gather for the block scope around it
    (``jvp(zj_block0_gather)/reshape``), jax 0.12.1 for the op beside it
    (``jvp()/dot_general``).

    >>> import jax
    >>> from zero_jax._audit.compiled import read_compiled
    >>> policy = ZeroPolicy(3, jax.make_mesh((4, 2), ("data", "model")))
    >>> text = chr(10).join(["ENTRY %main (p: f32[4,32]) -> f32[8,32] {", "  %p = f32[4,32]{1,0} parameter(0)",
    ...     "  ROOT %g = f32[8,32]{1,0} all-gather(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}", "}"])
    >>> model_axes_only(read_compiled(text, 8).computations["main"][-1], policy)
    True
    """
    if not policy.model_axes:
        return False
    size, group = replica_group(ins.attrs, policy.mesh.size)
    if not group:
        return False
    axes = Collective(ins.op, "", (), 0, size, group=group).axes(policy.mesh)
    return bool(axes) and set(axes) <= set(policy.model_axes)


def _layer_shapes(groups: list[_Group], policy: ZeroPolicy) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """The shapes a layer is gathered in (int8 ones on a quantized weight
    wire) and its gradient pieces are reduced in."""
    gathered = set().union(*((g.wire if policy.wire.weights else g.gathered) for g in groups))
    pieces = set().union(*((g.wire if policy.wire.grads else g.pieces) for g in groups))
    return gathered, pieces


#: The rows of ``report.overlap``.
LAYER_GATHER, LAYER_REDUCTION, OTHER = "layer all-gather", "layer reduction", "other"


def layer_overlap(program: str | CompiledProgram, params: list[ParamInfo], policy: ZeroPolicy) -> Overlap:
    """Overlap read off the compiled schedule: for each layer all-gather,
    each layer gradient reduction and every other collective, whether compute
    (:data:`zero_jax._audit.compiled.COMPUTE_OPS` not part of the collective)
    is scheduled between its start and its done, or fused into its
    continuation steps. A synchronous collective (no start / done) is exposed
    by definition: XLA:CPU runs every collective so, and libtpu runs
    all-gathers so unless asked for async ones. A layer collective is one
    named by a block scope (``zj_block<i>_gather`` / ``_reduce``) or shaped
    like a layer of a scan or repeated block; counts are executions per step,
    and their whole tensors' bytes.

    >>> import jax
    >>> from zero_jax._audit.compiled import read_compiled
    >>> policy = ZeroPolicy(3, jax.make_mesh((8,), ("data",)))
    >>> text = chr(10).join(["ENTRY %main (p: f32[8,256]) -> f32[64,256] {", "  %p = f32[8,256]{1,0} parameter(0)",
    ...     '  ROOT %g = f32[64,256]{1,0} all-gather(%p), metadata={op_name="zj_block0_gather/ag"}', "}"])
    >>> row = layer_overlap(read_compiled(text, 8), [], policy).rows[0]  # synchronous: exposed
    >>> row.role, row.executions, row.overlapped, row.bytes, row.overlapped_bytes
    ('layer all-gather', 1, 0, 65536, 0)
    """
    program = as_program(program, policy.mesh.size)
    params = [p._replace(layout=model_shard_layout(p)) for p in params]
    gathered, pieces = _layer_shapes(_layer_groups(params, policy), policy) if params else (set(), set())
    rows: dict[str, list[Any]] = {role: [set(), 0, 0, 0, 0, 0] for role in (LAYER_GATHER, LAYER_REDUCTION, OTHER)}
    model_own = {
        (comp, ins.name)
        for comp, instrs in program.computations.items()
        for ins in instrs
        if ins.op.startswith(("all-gather", "reduce-scatter", "all-to-all")) and model_axes_only(ins, policy)
    }
    for c in program.collectives:
        row = rows[OTHER if (c.computation, c.name) in model_own else _role(c, policy, gathered, pieces)]
        row[0].add((c.computation, c.name))
        row[1] += c.trips
        row[2] += c.trips * c.is_async
        row[3] += c.trips * c.overlapped
        row[4] += c.trips * c.bytes
        row[5] += c.trips * c.bytes * c.overlapped
    return Overlap(tuple(OverlapRow(role, len(r[0]), *r[1:]) for role, r in rows.items() if r[1]))


def _role(c: CompiledCollective, policy: ZeroPolicy, gathered: set[tuple[int, ...]],
          pieces: set[tuple[int, ...]]) -> str:  # fmt: skip
    """A compiled collective's row in :func:`layer_overlap` (a gradient
    reduce-scatter made of ``ppermute`` or ``all_to_all`` steps, the schedule's
    ``grad_reduction``, is a layer reduction by its name scope)."""
    if policy.partitions_grads and GRAD_REDUCTION_SCOPE in c.op_name:
        return LAYER_REDUCTION
    scope = _scope(c.kind, c.op_name)
    if c.kind == "all-gather" and policy.partitions_params:
        named = scope is not None and scope[1] != "reduce"
        return LAYER_GATHER if named or _in(c.shape, gathered) else OTHER
    if c.kind in _REDUCTIONS and policy.partitions_grads and (c.kind != "all-to-all" or c.dtype == "s8"):
        return LAYER_REDUCTION if scope is not None or _in(c.shape, pieces) else OTHER
    return OTHER


def joined_arrays(ins: Instruction) -> list[tuple[str, tuple[int, ...], int]]:
    """A collective's (dtype, dims, bytes) arrays, an all-to-all's N pieces
    joined into one: the compiled program splits ``all-to-all s8[N, nb, block]``
    into a tuple of N ``s8[1, nb, block]``."""
    arrays = list(ins.arrays)
    if ins.op == "all-to-all" and len(arrays) > 1 and len({(dt, d) for dt, d, _ in arrays}) == 1 and arrays[0][1]:
        dt, dims, _ = arrays[0]
        return [(dt, (dims[0] * len(arrays), *dims[1:]), sum(b for _, _, b in arrays))]
    return arrays


def scale_heads(computations: Iterable[Iterable[Instruction]], block: int) -> set[tuple[int, ...]]:
    """The ``(N, nb)`` shapes of a scheduled program's float32 scale
    collectives: the leading dims of its int8 ``(N, nb, block)`` ones."""
    return {
        dims[:2]
        for instrs in computations
        for ins in instrs
        if ins.op.startswith(QUANTIZED_KINDS)
        for dt, dims, _ in joined_arrays(ins)
        if dt == "s8" and len(dims) == 3 and dims[2] <= block
    }
