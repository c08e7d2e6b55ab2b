"""The compiled program as the backend runs it: its instructions in schedule
order, and every collective however the backend spells it.

XLA:CPU runs each collective as one synchronous op named for what it does.
The TPU backend (libtpu 0.0.42.1, compiled deviceless for v5p, v5e and v4
slices by ``benchmarks/tpu_aot.py``) spells the same collective in
several ways, and :func:`read_compiled` reads each of them as the one
collective it is (:class:`CompiledCollective`):

* a synchronous op, ``all-gather(...)``: libtpu's default for all-gather,
  all-reduce and all-to-all;
* an ``X-start`` / ``X-done`` pair (``collective-permute-start``), followed
  through ``get-tuple-element`` and ``X-update`` to its done. XLA:GPU
  (jax-cuda12-plugin 0.10.2, compiled deviceless for ``h100:1x8`` by
  ``tests/test_gpu_aot.py``) runs every collective so, on NCCL:
  ``all-gather-start``, ``reduce-scatter-start`` (a real reduce-scatter, never
  decomposed) and ``all-reduce-start``, after its combiners: one start of a
  tuple ``((operands...), (results...))`` carries a whole layer's leaves, each
  a member of its own here, and the compute scheduled between start and done
  is the overlap. Its collective pipeliner peels loop iterations, so a
  compiled loop's trip count is the ``known_trip_count`` it carries
  (:func:`zero_jax._audit.hlo.trip_counts`), not its condition's bound;
* ``async-start`` / ``async-done`` wrapping a computation that holds it;
* libtpu's *continuation fusions*: a fusion named ``async-collective-start.K``,
  fusions calling ``async_collective_fusion.N`` (each a clone of the
  collective and a slice of compute), then ``async-collective-done.K``, paired
  by name (every clone has ``channel_id=1``). libtpu emits them for
  all-gathers under ``xla_tpu_enable_async_collective_fusion_fuse_all_gather=true``
  and ``xla_enable_async_all_gather=true``, and on v5e for some by default
  (with ``..._fuse_kloop_fusions=true`` a start may read a value another
  collective's steps carry: it starts a collective of its own);
* a collective *offloaded to SparseCore* (libtpu 0.0.52 on v5p with
  ``xla_tpu_enable_sparse_core_collective_offload_all_gather=true``): a
  ``custom-call-start`` (``call-start`` on 0.0.46.3) with
  ``async_execution_thread="sparsecore"`` whose ``called_computations``
  hold the collective, then ``custom-call-update`` (reading its operand)
  and ``custom-call-done``; the TensorCore computes between start and done.
  An XLA dump of the same program (``xla_dump_to``: how a peer's program is
  read) spells it ``async-start`` / ``async-update`` / ``async-done`` with
  ``async_execution_thread="sparsecore"``, its ``calls`` computation
  ``call``-ing the collective's (libtpu 0.0.46.3) or holding a
  ``custom-call`` whose ``called_computations`` hold it (0.0.52);
* a reduce-scatter *done as all-reduce*: an ``all-reduce`` of the whole
  operand whose result feeds a ``dynamic-slice`` (bare or inside a fusion) of
  1/N of it. Pass ``reduce-scatter-decomposer`` does this to every
  reduce-scatter on v5p and v4, and on v5e to those that scatter a minor
  dimension. It moves two ring passes of the whole operand, twice a
  reduce-scatter's bytes (:attr:`CompiledCollective.ring_bytes`);
* a small all-gather *done as all-reduce*: an all-reduce whose operand is a
  zero-filled ``dynamic-update-slice`` of 1/N of it (also two passes), named
  by the op that made the piece.

The all-reduce combiner merges several reductions into one tuple op whose
``op_name`` is one member's only: here each member is a collective of its
own, named by the op that produced its operand. Loops carry no
``known_trip_count`` on TPU: trip counts are read off the loop conditions
(:func:`zero_jax._audit.hlo.trip_counts`).

:func:`read_compiled` also rewrites the scheduled computations into the
plain spelling XLA:CPU uses (``all-gather`` / ``all-gather-start`` +
``all-gather-done``, ``reduce-scatter`` for a decomposed one), so the per-layer
schedule (:mod:`zero_jax._audit.schedule`) reads every backend alike.

>>> text = chr(10).join([
...     "ENTRY %main (p: f32[64,256]) -> f32[8,256] {",
...     "  %p = f32[64,256]{1,0} parameter(0)",
...     "  %ar = f32[64,256]{1,0} all-reduce(%p), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
...     "  ROOT %ds = f32[8,256]{1,0} fusion(%ar, %p), kind=kLoop, calls=%fused_slice", "}",
...     "%fused_slice (param_0: f32[64,256], param_1: u32[]) -> f32[8,256] {",
...     "  %param_0 = f32[64,256]{1,0} parameter(0)",
...     "  ROOT %dynamic-slice.1 = f32[8,256]{1,0} dynamic-slice(%param_0, %c, %c), dynamic_slice_sizes={8,256}", "}"])
>>> (c,) = read_compiled(text, 8).collectives
>>> c.kind, c.op, c.decomposed, c.shape, c.bytes, c.ring_bytes  # 2 passes of the whole 64 KiB
('reduce-scatter', 'all-reduce', True, (8, 256), 65536, 114688.0)

XLA:GPU's spelling: a scanned layer's body (run 4 times) gathers its weight and
bias with one combined start, runs a GEMM fusion meanwhile, and reduce-scatters a
gradient with nothing in flight beside it:

>>> gpu = chr(10).join([
...     "%body (p: (s32[], bf16[16,128], bf16[16])) -> (s32[], bf16[16,128], bf16[16]) {",
...     "  %p = (s32[], bf16[16,128]{1,0}, bf16[16]{0}) parameter(0)",
...     "  %w = bf16[16,128]{1,0} get-tuple-element(%p), index=1",
...     "  %b = bf16[16]{0} get-tuple-element(%p), index=2",
...     "  %ag = ((bf16[16,128]{1,0}, bf16[16]{0}), (bf16[128,128]{1,0}, bf16[128]{0})) all-gather-start(%w, %b), "
...     "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
...     "  %gemm = bf16[128,128]{1,0} fusion(%w), kind=kCustom, calls=%gemm_fusion",
...     "  %agd = (bf16[128,128]{1,0}, bf16[128]{0}) all-gather-done(%ag)",
...     "  %rs = ((bf16[128,128]{1,0}), (bf16[16,128]{1,0})) reduce-scatter-start(%gemm), channel_id=2, "
...     "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add",
...     "  %rsd = bf16[16,128]{1,0} reduce-scatter-done(%rs)",
...     "  ROOT %t = (s32[], bf16[16,128]{1,0}, bf16[16]{0}) tuple(%i, %rsd, %b)", "}",
...     "ENTRY %main (a: (s32[], bf16[16,128], bf16[16])) -> (s32[], bf16[16,128], bf16[16]) {",
...     "  %a = (s32[], bf16[16,128]{1,0}, bf16[16]{0}) parameter(0)",
...     "  ROOT %loop = (s32[], bf16[16,128]{1,0}, bf16[16]{0}) while(%a), condition=%cond, body=%body, "
...     'backend_config={"known_trip_count":{"n":"4"}}', "}"])
>>> for c in read_compiled(gpu, 8).collectives:
...     print(c.kind, c.spelling, c.shape, c.bytes, "x", c.trips, "overlapped" if c.overlapped else "exposed")
all-gather start/done (128, 128) 32768 x 4 overlapped
all-gather start/done (128,) 256 x 4 overlapped
reduce-scatter start/done (16, 128) 32768 x 4 exposed
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from zero_jax._audit.hlo import (
    COMPUTATION,
    OP_NAME,
    array_bytes,
    expand_tuple_elements,
    replica_group,
    ring_bytes_of,
    trip_counts,
)

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
#: What counts as compute between a collective's start and its done (the overlap read off the schedule).
COMPUTE_OPS = frozenset({"fusion", "convolution", "dot", "custom-call"})
SYNC, START_DONE, ASYNC_WRAPPED, CONTINUATION = "synchronous", "start/done", "async-start/done", "continuation fusion"
OFFLOADED = "offloaded (sparsecore)"
#: The start / update / done of a collective offloaded to the chip's SparseCores (libtpu 0.0.46+).
_OFFLOAD_OPS = {"start": ("custom-call-start", "call-start"), "update": ("custom-call-update", "call-update"),
                "done": ("custom-call-done", "call-done")}  # fmt: skip

_SCHEDULED = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)
_PASSES = frozenset({"bitcast", "copy", "copy-start", "copy-done", "reshape", "get-tuple-element"})  # same data
_START = "async-collective-start"
_BRANCHES = re.compile(r"(?:branch_computations=\{[^}]*\}|(?:true|false)_computation=%?[\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a compiled (scheduled) HLO computation."""

    name: str
    op: str
    arrays: tuple[tuple[str, tuple[int, ...], int], ...]  # (dtype, dims, bytes) of each result array
    operands: tuple[str, ...]
    op_name: str  # the JAX name stack (``jit(step)/.../zj_block3_gather/all_gather``)
    attrs: str  # the rest of the line (``index=``, ``body=``, ``kind=``)
    root: bool

    @property
    def elements(self) -> int:
        return sum(math.prod(dims) for _, dims, _ in self.arrays)


def scheduled_computations(hlo: str) -> tuple[dict[str, list[Instruction]], str, dict[str, int]]:
    """Each computation's instructions in order (``is_scheduled=true``: the
    order they run in), the entry computation's name, and how many times each
    computation runs per step (loops' trip counts multiplied). An XLA dump's
    text is read as ``compiled.as_text()``'s (:func:`~zero_jax._audit.hlo.expand_tuple_elements`)."""
    hlo = expand_tuple_elements(hlo)
    comps: dict[str, list[Instruction]] = {}
    current, entry = None, ""
    for line in hlo.splitlines():
        m = COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            entry = current if line.lstrip().startswith("ENTRY") else entry
            continue
        m = _SCHEDULED.match(line)
        if m is None or current is None:
            continue
        rest = m.group("rest")
        op_name = OP_NAME.search(rest)
        args = rest.split(", metadata=")[0]
        arrays = array_bytes(m.group("type"))
        arrays = arrays[len(arrays) // 2 :] if m.group("op").endswith("-start") else arrays  # (operands, results)
        comps[current].append(Instruction(
            m.group("name"), m.group("op"), tuple(arrays),
            tuple(re.findall(r"%([\w.\-]+)", args)), op_name.group(1) if op_name else "", args, bool(m.group("root")),
        ))  # fmt: skip
    return comps, entry, trip_counts(hlo)


@dataclasses.dataclass(frozen=True)
class CompiledCollective:
    """One collective of the compiled program (one member of a combined op).

    Attributes:
      kind: what it does (``all-gather``, ``reduce-scatter``, ``all-reduce``,
        ``all-to-all``, ``collective-permute``).
      op: the compiled op that does it (``all-reduce`` for a decomposed
        reduce-scatter or a small gather done as all-reduce).
      spelling: :data:`SYNC`, :data:`START_DONE`, :data:`ASYNC_WRAPPED` or
        :data:`CONTINUATION`.
      dtype, shape: a gather's result, a reduce-scatter's piece (its result),
        the others' operand.
      bytes: the whole tensor (a gather's result, a reduce-scatter's input).
      group_size: the devices of one replica group; trips: executions per step.
      name, done: the instruction that starts it and the one that ends it (the
        same for a synchronous op); computation, start, end: where they sit in
        the schedule.
      op_name: the JAX op that made it (a combined op's member: the op that
        produced its operand).
      decomposed: a reduce-scatter or all-gather the backend does as all-reduce.
      steps: continuation fusions between start and done.
      compute: compute ops (:data:`COMPUTE_OPS`) scheduled between start and
        done that are not part of the collective.
      member: its index in a combined (tuple) op.
    """

    kind: str
    op: str
    spelling: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    group_size: int
    trips: int
    name: str
    done: str
    computation: str
    start: int
    end: int
    op_name: str = ""
    decomposed: bool = False
    steps: int = 0
    compute: int = 0
    member: int = 0

    @property
    def is_async(self) -> bool:
        return self.spelling != SYNC

    @property
    def overlapped(self) -> bool:
        """Compute runs while it is in flight: an async collective with compute
        scheduled between its start and its done, or fused into its
        continuation steps. A synchronous one is exposed by definition."""
        return self.is_async and (self.compute > 0 or self.steps > 0)

    @property
    def ring_bytes(self) -> float:
        """Bytes one device sends per execution in a ring: two passes of the
        whole tensor for an all-reduce (a decomposed collective included)."""
        return ring_bytes_of("collective-permute" if self.kind == "collective-permute" else self.op, self.bytes,
                          self.group_size)  # fmt: skip

    @property
    def total_ring_bytes(self) -> float:
        return self.ring_bytes * self.trips


class CompiledProgram(NamedTuple):
    """The compiled program read once: its scheduled computations in the plain
    spelling (see the module docstring), the entry, trip counts per
    computation, and its collectives in schedule order."""

    computations: dict[str, list[Instruction]]
    entry: str
    trips: dict[str, int]
    collectives: tuple[CompiledCollective, ...]


def _callee(ins: Instruction, key: str = "calls") -> str | None:
    m = re.search(rf"\b{key}=\{{?%?([\w.\-]+)", ins.attrs)
    return m.group(1) if m else None


def scheduled_names(comps: Mapping[str, list[Instruction]], entry: str) -> list[str]:
    """The computations that run as scheduled code, entry first: while bodies
    and conditions, called computations and conditional branches (not fusion
    bodies, reducers or the computations an ``async-start`` wraps)."""
    out, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name in out or name not in comps:
            continue
        out.append(name)
        for ins in comps[name]:
            keys = {"while": ("body", "condition"), "call": ("to_apply",)}.get(ins.op, ())
            todo += [c for c in (_callee(ins, k) for k in keys) if c]
            if ins.op == "conditional":
                todo += [c for b in _BRANCHES.findall(ins.attrs) for c in re.findall(r"[\w.\-]+", b.split("=", 1)[1])]
    return out


def _inner(ins: Instruction, comps: Mapping[str, list[Instruction]], key: str = "calls") -> Instruction | None:
    """The collective inside a fusion or ``async-start`` (a continuation fusion's clone), or (``key``
    ``called_computations``) a SparseCore offload's."""
    callee = _callee(ins, key)
    return next((j for j in comps.get(callee or "", []) if j.op in KINDS), None)


def _offloaded(ins: Instruction, comps: Mapping[str, list[Instruction]]) -> Instruction | None:
    """The collective a SparseCore offload's start runs: in its called computation (``as_text()``'s
    ``custom-call-start`` / ``call-start``), or one call further down (an XLA dump's ``async-start``
    whose ``calls`` computation ``call``-s the collective's, libtpu 0.0.46.3, or holds a ``custom-call``
    whose ``called_computations`` do, 0.0.52)."""
    for key in ("called_computations", "to_apply", "calls"):
        for j in comps.get(_callee(ins, key) or "", []):
            if j.op in KINDS:
                return j
            further = {"call": "to_apply", "custom-call": "called_computations"}.get(j.op)
            if further and (inner := _inner(j, comps, further)) is not None:
                return inner
    return None


def _kind(ins: Instruction, comps: Mapping[str, list[Instruction]]) -> tuple[str, str, Instruction] | None:
    """(kind, spelling, the instruction that holds the collective's own line) of a start, else None."""
    if ins.op in KINDS:
        return ins.op, SYNC, ins
    if ins.op.endswith("-start") and ins.op[: -len("-start")] in KINDS:
        return ins.op[: -len("-start")], START_DONE, ins
    if (ins.op in _OFFLOAD_OPS["start"] or ins.op == "async-start") and "sparsecore" in ins.attrs:
        inner = _offloaded(ins, comps)
        return (inner.op, OFFLOADED, inner) if inner is not None else None
    if ins.op in ("async-start", "fusion") and (inner := _inner(ins, comps)) is not None:
        if ins.op == "async-start":
            return inner.op, ASYNC_WRAPPED, inner
        if ins.name.startswith(_START):
            return inner.op, CONTINUATION, inner
    return None


def _chain(ins: Instruction, kind: str, spelling: str, body: list[Instruction],
           users: Mapping[str, list[Instruction]], comps: Mapping[str, list[Instruction]]
           ) -> tuple[set[str], Instruction | None]:  # fmt: skip
    """The instructions that carry an async collective from its start to its
    done (get-tuple-elements, updates, continuation fusions) and the done."""
    if spelling == SYNC:
        return set(), None
    done_name = ins.name.replace(_START, "async-collective-done", 1) if spelling == CONTINUATION else None
    dones = (f"{kind}-done", "async-done", *(_OFFLOAD_OPS["done"] if spelling == OFFLOADED else ()))
    updates = (f"{kind}-update", "async-update", *(_OFFLOAD_OPS["update"] if spelling == OFFLOADED else ()))
    chain, frontier, done = set(), [ins.name], None
    while frontier:
        nxt = []
        for name in frontier:
            for u in users.get(name, []):
                carries = u.op == "get-tuple-element" or u.op in dones or u.op in updates
                # A continuation step, not the start of another collective that reads a value this chain carries.
                carries |= (spelling == CONTINUATION and u.op == "fusion" and not u.name.startswith(_START)
                            and _inner(u, comps) is not None)  # fmt: skip
                if u.name in chain or not carries:
                    continue
                chain.add(u.name)
                if u.op in dones or u.name == done_name:
                    done = u
                else:
                    nxt.append(u.name)
        frontier = nxt
    if done is None and done_name is not None:
        done = next((j for j in body if j.name == done_name), None)
    return chain, done


def _source(name: str, by_name: Mapping[str, Instruction]) -> Instruction | None:
    """The instruction that made a value, looking through copies and bitcasts."""
    ins, seen = by_name.get(name), set()
    while ins is not None and ins.op in _PASSES and ins.operands and ins.name not in seen:
        seen.add(ins.name)
        ins = by_name.get(ins.operands[0]) or ins
    return ins


def _named(ins: Instruction, comps: Mapping[str, list[Instruction]], by_name: Mapping[str, Instruction]) -> str:
    """An instruction's op_name, or (a fusion that has none) the last one in its body: nearest its result; a
    bare dynamic-update-slice that has none (a small gather's piece written into zeros) is named by its update."""
    if ins.op == "dynamic-update-slice" and not ins.op_name and len(ins.operands) > 1:
        update = _source(ins.operands[1], by_name)
        return _named(update, comps, by_name) if update is not None and update is not ins else ""
    if ins.op_name or ins.op != "fusion":
        return ins.op_name
    return next((j.op_name for j in reversed(comps.get(_callee(ins) or "", [])) if j.op_name), "")


def _fused(fusion: Instruction, comps: Mapping[str, list[Instruction]]) -> tuple[list[Instruction], dict[int, str]]:
    """A fusion's body and its parameters' names by number."""
    body = comps.get(_callee(fusion) or "", [])
    params = {int(m.group(1)): j.name for j in body if j.op == "parameter" and (m := re.match(r"\s*(\d+)", j.attrs))}
    return body, params


def _slices(value: str, users: Mapping[str, list[Instruction]], comps: Mapping[str, list[Instruction]],
            index: int | None) -> list[Instruction]:  # fmt: skip
    """The dynamic-slices (bare, or inside a fusion) that read ``value``
    (member ``index`` of a tuple), through get-tuple-element, copies and bitcasts."""
    out, frontier, seen = [], [(value, index)], set()
    while frontier:
        name, idx = frontier.pop()
        for u in users.get(name, []):
            if (u.name, idx) in seen:
                continue
            seen.add((u.name, idx))
            if u.op == "get-tuple-element":
                if idx is None or re.search(rf"\bindex={idx}\b", u.attrs):
                    frontier.append((u.name, None))
            elif idx is not None:
                continue
            elif u.op in _PASSES:
                frontier.append((u.name, None))
            elif u.op == "dynamic-slice" and u.operands[:1] == (name,):
                out.append(u)
            elif u.op == "fusion":
                body, params = _fused(u, comps)
                mine = {params.get(i) for i, o in enumerate(u.operands) if o == name}
                out += [j for j in body if j.op == "dynamic-slice" and j.operands[:1] and j.operands[0] in mine]
    return out


def _writes_piece(source: Instruction | None, whole: int, n: int, by_name: Mapping[str, Instruction],
                  comps: Mapping[str, list[Instruction]]) -> bool:  # fmt: skip
    """Whether a value is a dynamic-update-slice of 1/N of ``whole`` elements
    into a buffer (bare or fused): a small gather's zero-filled piece."""
    if source is None:
        return False
    writes, lookup = ([source], by_name) if source.op == "dynamic-update-slice" else ([], {})
    if source.op == "fusion":
        body, _ = _fused(source, comps)
        writes, lookup = [j for j in body if j.op == "dynamic-update-slice"], {j.name: j for j in body}
    updates = [lookup.get(w.operands[1]) for w in writes if len(w.operands) > 1]
    return any(u is not None and u.elements * n == whole for u in updates)


def _real_kind(member: tuple[str, tuple[int, ...], int], n: int, slices: list[Instruction], writes: bool
               ) -> tuple[str, tuple[int, ...]]:  # fmt: skip
    """An all-reduce member's real kind and shape: ``("reduce-scatter",
    piece)`` when a dynamic-slice of 1/N of it reads its result,
    ``("all-gather", whole)`` when its operand is a 1/N piece written into
    zeros (``writes``), else ``("all-reduce", whole)``."""
    dims = member[1]
    pieces = {s.name: s.arrays[0][1] if s.arrays else () for s in slices}
    for piece in pieces.values():
        if n > 1 and math.prod(piece) * n == math.prod(dims):
            return "reduce-scatter", piece
    # Several leaves reduced as one joined array (``Schedule.together``): libtpu 0.0.52 slices each leaf's part
    # of this device's 1/N straight out of the result, so the slices together make the piece.
    if n > 1 and len(pieces) > 1 and sum(math.prod(p) for p in pieces.values()) * n == math.prod(dims):
        return "reduce-scatter", (dims[0] // n, *dims[1:]) if dims and dims[0] % n == 0 else (math.prod(dims) // n,)
    return ("all-gather" if writes and n > 1 else "all-reduce"), dims


def _members(ins: Instruction, spelling: str, holder: Instruction, done: Instruction | None
             ) -> list[tuple[str, tuple[int, ...], int]]:  # fmt: skip
    """The data arrays a collective moves (flags and offsets left out)."""
    if holder is not ins:  # the collective's own line, inside a fusion or an async wrapper
        return list(holder.arrays)
    if spelling == START_DONE and done is not None:
        return [a for a in done.arrays if not (a[0] in ("u32", "s32") and len(a[1]) <= 1)]
    return list(ins.arrays)


class _Where(NamedTuple):
    """One scheduled computation: its name, instructions, users of each value and trips."""

    name: str
    body: list[Instruction]
    users: dict[str, list[Instruction]]
    by_name: dict[str, Instruction]
    trips: int


def _collective(where: _Where, t: int, found: tuple[str, str, Instruction], comps: Mapping[str, list[Instruction]],
                num_devices: int) -> tuple[list[CompiledCollective], set[str], Instruction | None]:  # fmt: skip
    """The collective started at position ``t`` (one per member), the
    instructions that carry it and its done."""
    ins, (kind, spelling, holder) = where.body[t], found
    chain, done = _chain(ins, kind, spelling, where.body, where.users, comps)
    end = next((s for s in range(t, len(where.body)) if where.body[s] is done), t)
    compute = sum(
        1 for j in where.body[t + 1 : end] if j.op in COMPUTE_OPS and j.name not in chain and _kind(j, comps) is None
    )
    steps = sum(1 for c in chain if where.by_name[c].op == "fusion") - (spelling == CONTINUATION and done is not None)
    n, _ = replica_group(holder.attrs, num_devices)
    members, out = _members(ins, spelling, holder, done), []
    for i, member in enumerate(members):
        operand = ins.operands[i] if spelling == SYNC and i < len(ins.operands) else None
        source = _source(operand, where.by_name) if operand else None
        real, shape, nbytes = kind, member[1], member[2] * (n if kind == "reduce-scatter" else 1)
        if kind == "all-reduce":
            result, index = (done or ins).name, i if len(members) > 1 else None
            writes = _writes_piece(source, math.prod(member[1]), n, where.by_name, comps)
            real, shape = _real_kind(member, n, _slices(result, where.users, comps, index), writes)
        # A combined all-reduce carries one member's op_name, a decomposed reduce-scatter none: name a member by
        # the op that made its operand.
        borrowed = kind == "all-reduce" and (len(members) > 1 or real == "reduce-scatter")
        mine = _named(source, comps, where.by_name) if borrowed and source is not None else holder.op_name
        if spelling == OFFLOADED:  # libtpu shares one called computation among same-shaped offloads: its name is one's
            mine = (done.op_name if done is not None else "") or ins.op_name or holder.op_name
        out.append(CompiledCollective(
            real, kind, spelling, member[0], shape, nbytes, n, where.trips, ins.name, (done or ins).name, where.name,
            t, end, mine or holder.op_name, real != kind, max(steps, 0), compute, i,
        ))  # fmt: skip
    return out, chain, done


def _read(where: _Where, comps: Mapping[str, list[Instruction]], num_devices: int
          ) -> tuple[list[CompiledCollective], dict[str, list[Instruction]]]:  # fmt: skip
    """The collectives of one scheduled computation, and the plain rewrite
    (a start's name -> the instructions that replace it; a done's -> its alias)."""
    out, rewrite, consumed = [], {}, set()
    for t, ins in enumerate(where.body):
        found = None if ins.name in consumed else _kind(ins, comps)
        if found is None:
            continue
        colls, chain, done = _collective(where, t, found, comps, num_devices)
        consumed |= chain
        out += colls
        rewrite[ins.name] = _plain(ins, found[1], colls)
        if done is not None:
            rewrite[done.name] = [dataclasses.replace(done, op=f"{found[0]}-done", operands=(ins.name,))]
    return out, rewrite


def _plain(ins: Instruction, spelling: str, colls: list[CompiledCollective]) -> list[Instruction]:
    """A collective's start in XLA:CPU's spelling: one instruction per (kind,
    op_name) of its members (``-start`` when async), each with its arrays."""
    groups: dict[tuple[str, str], list[CompiledCollective]] = {}
    for c in colls:
        groups.setdefault((c.kind, c.op_name), []).append(c)
    out = []
    # The gathers keep the op's name: what reads the op reads them (a gathered layer is alive while it is read).
    for k, ((kind, op_name), members) in enumerate(sorted(groups.items(), key=lambda g: g[0][0] != "all-gather")):
        arrays = tuple((c.dtype, c.shape, math.prod(c.shape) * _itemsize(c.dtype)) for c in members)
        out.append(dataclasses.replace(
            ins, name=ins.name if k == 0 else f"{ins.name}#{k}", op=kind if spelling == SYNC else f"{kind}-start",
            arrays=arrays, op_name=op_name,
        ))  # fmt: skip
    return out


def _itemsize(dtype: str) -> int:
    return next((b for _, _, b in array_bytes(f"{dtype}[1]")), 4)


def read_compiled(hlo: str, num_devices: int) -> CompiledProgram:
    """Read a compiled (scheduled) program: every collective of its scheduled
    computations, in schedule order, and those computations rewritten in the
    plain spelling (fusion bodies, reducers and async-wrapped computations
    left out). ``num_devices``: the group size of a collective that lists no
    replica groups."""
    comps, entry, trips = scheduled_computations(hlo)
    colls, plain = [], {}
    for name in scheduled_names(comps, entry):
        body = comps[name]
        users: dict[str, list[Instruction]] = {}
        for ins in body:
            for o in dict.fromkeys(ins.operands):
                users.setdefault(o, []).append(ins)
        where = _Where(name, body, users, {i.name: i for i in body}, trips.get(name, 1))
        found, rewrite = _read(where, comps, num_devices)
        colls += found
        plain[name] = [r for ins in comps[name] for r in rewrite.get(ins.name, [ins])]
    return CompiledProgram(plain, entry, trips, tuple(colls))


def as_program(program: str | CompiledProgram, num_devices: int = 1) -> CompiledProgram:
    """``program`` read (:func:`read_compiled`) if it is HLO text."""
    return read_compiled(program, num_devices) if isinstance(program, str) else program


def ops(colls: Iterable[CompiledCollective]) -> int:
    """How many compiled instructions the collectives are (a combined op's members count once)."""
    return len({(c.computation, c.name) for c in colls})
