"""Measure what a compiled step holds and sends, from the program itself.

* :func:`resident_bytes` — bytes each device holds for a pytree of arrays.
* :func:`collectives` — every collective in the program right after SPMD
  partitioning (where dtypes are still the logical ones; XLA:CPU later runs
  bf16 collectives in f32), with its per-device ring traffic, multiplied by
  the trip count of the loop it sits in.
* :func:`memory` — ``compiled.memory_analysis()`` with the peak estimate
  argument + output + temp − alias (CPU's ``peak_memory_in_bytes`` omits temp).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax._audit.memory import LivePeak, hbm_bytes_from_dump, live_peak_from_dump
from zero_jax._layerwise.schedule import read_only_options

_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
NO_SPMD_DUMP = "XLA wrote no post-SPMD-partitioning dump of a program on several devices; is this a sharded program?"
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(?:-start)?\((?P<args>.*)$"
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]\w*)\[(?P<dims>[\d,]*)\]")
#: XLA's own trip count of a compiled while loop (XLA:GPU writes it into the loop's backend_config).
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+(?:\(.*\)\s*->.*)?\{\s*$")
OP_NAME = re.compile(r'op_name="([^"]*)"')
_PAIR = re.compile(r"\{(\d+),(\d+)\}")
_ANY_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+(?P<op>[\w\-]+)\((?P<args>.*)$")

#: Ops that only move their operand (no arithmetic): a collective's result that reaches another collective through
#: them is that collective's operand (:attr:`Collective.feeds`).
PASS_THROUGH = frozenset({"copy", "bitcast", "reshape", "transpose", "convert", "get-tuple-element", "tuple"})


def ring_bytes_of(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes one device sends for one execution of a collective of ``kind``
    moving ``nbytes`` over ``group_size`` devices, as a ring moves it: two
    passes of the whole tensor for an all-reduce, the tensor once for a
    collective-permute, (n - 1) / n of it otherwise."""
    if group_size <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (group_size - 1) / group_size * nbytes
    if kind == "collective-permute":
        return float(nbytes)
    return (group_size - 1) / group_size * nbytes


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the partitioned program.

    ``bytes`` is the size of the full (per-device) operand for all-reduce,
    collective-permute and all-to-all, the gathered result for all-gather and
    the scattered input for reduce-scatter. ``ring_bytes`` is what one device
    sends per execution in a ring of ``group_size``; ``trips`` how many times
    the enclosing loops run it. ``group``: the devices (partition ids) of one
    replica group, or of every source-target pair of a collective-permute,
    when the HLO lists them; ``op_name``: the JAX name of the op that made it
    (HLO ``metadata={op_name=...}``); ``feeds``: the collectives of the same
    computation that take its result as their operand, directly or through
    ops that only move it (:data:`PASS_THROUGH`), by instruction name.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    group_size: int
    trips: int = 1
    name: str = ""
    group: tuple[int, ...] = ()
    op_name: str = ""
    pairs: tuple[tuple[int, int], ...] = ()  # a collective-permute's source-target pairs
    feeds: tuple[str, ...] = ()

    def axes(self, mesh: Any) -> tuple[str, ...]:
        """The mesh axes this collective runs across: those along which the
        devices of its group differ, in the mesh's order (every axis of size
        > 1 when the group is unknown). A collective-permute runs across the
        axes along which any of its pairs differ.

        Partition ids are positions in ``mesh.devices.flat`` (jit's device
        assignment), so this reads ``replica_groups={{0,4},{1,5},...}`` on a
        ``("replica", "data")`` mesh of shape (2, 4) as ``("replica",)`` and
        ``{{0,2,4,6},{1,3,5,7}}`` on a ``("data", "model")`` mesh of shape
        (4, 2) as ``("data",)``.
        """
        names = tuple(mesh.axis_names)
        sets = [p for p in self.pairs if p[0] != p[1]] or ([self.group] if self.group else [])
        if not sets:
            return tuple(n for n in names if mesh.shape[n] > 1)
        varying: set[int] = set()
        for ids in sets:
            coords = np.array(np.unravel_index(np.asarray(ids), mesh.devices.shape))
            varying |= {i for i in range(len(names)) if len(set(coords[i].tolist())) > 1}
        return tuple(n for i, n in enumerate(names) if i in varying)

    @property
    def ring_bytes(self) -> float:
        return ring_bytes_of(self.kind, self.bytes, self.group_size)

    @property
    def total_ring_bytes(self) -> float:
        return self.ring_bytes * self.trips


def axes_key(axes: Iterable[str]) -> str:
    """The report's name for a set of mesh axes: ``"data"``, ``"model"``,
    ``"data+model"`` (in the mesh's order), ``"none"`` for no axis.

    >>> axes_key(("data", "model")), axes_key(())
    ('data+model', 'none')
    """
    return "+".join(axes) or "none"


def array_bytes(text: str) -> list[tuple[str, tuple[int, ...], int]]:
    out = []
    for m in _ARRAY.finditer(text):
        dtype = m.group("dtype")
        if dtype not in DTYPE_BYTES:
            continue
        dims = tuple(int(d) for d in m.group("dims").split(",") if d)
        out.append((dtype, dims, math.prod(dims) * DTYPE_BYTES[dtype]))
    return out


def replica_group(line: str, num_devices: int) -> tuple[int, tuple[int, ...]]:
    """The group size of a collective and its first replica group, from any
    HLO spelling: ``{{0,4},{1,5}}``, the iota form ``[G,S]<=[dims]T(perm)``,
    ``mesh['data'=4,'model'=2]{'data'}`` or ``source_target_pairs``."""
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", line)
    if m:
        group = tuple(int(x) for x in m.group(1).split(",") if x.strip())
        return len(group), group
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        g, size, dims = int(m.group(1)), int(m.group(2)), [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return size, tuple(int(i) for i in ids.reshape(g, size)[0])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = [(n, int(k)) for n, k in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
        names = set(re.findall(r"'(\w+)'", m.group(2)))
        ids = np.arange(math.prod(k for _, k in sizes)).reshape([k for _, k in sizes])
        first = ids[tuple(slice(None) if n in names else 0 for n, _ in sizes)]
        return math.prod(k for n, k in sizes if n in names), tuple(int(i) for i in np.ravel(first))
    if re.search(r"source_target_pairs=\{(.*?)\}\s*(,|$)", line):
        return 2, ()
    return num_devices, ()


#: An instruction's called computations other than a while loop's body: ``to_apply=%f``, ``calls=%f``,
#: ``branch_computations={%a, %b}``, ``true_computation=%t``.
_CALLED = re.compile(
    r"(?:to_apply|calls|branch_computations|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)"
)


def _call_graph(hlo: str) -> tuple[dict[str, list[str]], dict[str, list[tuple[str, int | None]]]]:
    """Each computation's lines, and computation -> its call sites: (the
    caller, the trip count if it is a while loop's body, else None), one per
    calling instruction (the TPU compiler's post-SPMD program of an unrolled
    ``lax.scan`` calls the loop body's computation once per unrolled layer).

    Right after SPMD partitioning (and in libtpu's compiled programs) the
    while loops carry no trip-count annotation, so it is read off the loop's
    induction variable (:func:`loop_trips`; its bound in the condition or in
    the fusion the condition calls: XLA:GPU's ``fused_compare``). A compiled
    loop that carries XLA's own count (``backend_config={"known_trip_count":
    {"n":"K"}}``: XLA:CPU's, and XLA:GPU's after its collective pipeliner
    peeled iterations out of the loop) is taken at its word.
    """
    comps: dict[str, list[str]] = {}
    current = None
    for line in expand_tuple_elements(hlo).splitlines():
        m = COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    callers: dict[str, list[tuple[str, int | None]]] = {}
    for name, lines in comps.items():
        for line in lines:
            m = re.search(r"while\((.*?)\),\s*condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)", line)
            if m:
                known, bound = _KNOWN_TRIPS.search(line), _condition_bound(m.group(2), comps)
                init, cond, body = m.group(1).strip().lstrip("%"), comps.get(m.group(2), []), comps.get(m.group(3), [])
                trips = int(known.group(1)) if known else loop_trips(lines, init, cond, body, bound)
                callers.setdefault(m.group(3), []).append((name, trips))
            for called in _CALLED.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", called):
                    callers.setdefault(callee, []).append((name, None))
    return comps, callers


def _condition_bound(condition: str, comps: Mapping[str, list[str]]) -> int:
    """The constant a loop condition compares its counter with: in the condition itself, or in a fusion it
    calls (1 when there is none)."""
    lines = comps.get(condition, [])
    fused = [c for line in lines for called in _CALLED.findall(line) for c in re.findall(r"%?([\w.\-]+)", called)]
    c = re.search(r"constant\((\d+)\)", "\n".join(lines + [x for f in fused for x in comps.get(f, [])]))
    return int(c.group(1)) if c else 1


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\(.*?\)|\S+)\s+([\w\-]+)\((.*)$")


_ELEMENT = re.compile(r"%([\w.\-]+)#(\d+)")


def expand_tuple_elements(hlo: str) -> str:
    """``hlo`` with an XLA dump's shorthand ``%t#k`` (element ``k`` of tuple
    ``t``, written in place of an operand) spelled as ``compiled.as_text()``
    spells it: a ``get-tuple-element`` instruction (``%t.element.k``) just
    before the first instruction that reads it. A program dumped with
    ``xla_dump_to`` (a peer's own tool's, e.g.) then reads as the compiled
    text does: loop induction variables, a reduce-scatter done as all-reduce.

    >>> print(expand_tuple_elements(chr(10).join(["ENTRY %m (p: (s32[], f32[2])) -> f32[2] {",
    ...     "  %p = (s32[], f32[2]) parameter(0)", "  ROOT %r = f32[2] negate(%p#1)", "}"])))
    ENTRY %m (p: (s32[], f32[2])) -> f32[2] {
      %p = (s32[], f32[2]) parameter(0)
      %p.element.1 = () get-tuple-element(%p), index=1
      ROOT %r = f32[2] negate(%p.element.1)
    }
    """
    if "#" not in hlo:
        return hlo
    out: list[str] = []
    written: set[tuple[str, str]] = set()
    for line in hlo.splitlines():
        found = _ELEMENT.findall(line.split(", metadata=")[0]) if _DEF.match(line) else []
        if COMPUTATION.match(line):
            written = set()
        for name, index in dict.fromkeys(found):
            if (name, index) not in written:
                written.add((name, index))
                out.append(f"  %{name}.element.{index} = () get-tuple-element(%{name}), index={index}")
        out.append(_ELEMENT.sub(r"%\1.element.\2", line) if found else line)
    return "\n".join(out)


def _defs(lines: list[str]) -> dict[str, tuple[str, list[str], str]]:
    """A computation's instructions: name -> (op, operand names, the rest of the line)."""
    out = {}
    for line in lines:
        m = _DEF.match(line)
        if m:
            args, _, rest = m.group(3).partition(")")
            out[m.group(1)] = (m.group(2), [a.strip().lstrip("%") for a in args.split(",") if a.strip()], rest)
    return out


def _constant(defs: Mapping[str, tuple[str, list[str], str]], name: str) -> int | None:
    """The integer value of a scalar constant instruction (through copies and converts), else None."""
    for _ in range(4):
        op, args, _ = defs.get(name, ("", [], ""))
        if op == "constant" and len(args) == 1 and re.fullmatch(r"-?\d+", args[0]):
            return int(args[0])
        if op not in ("copy", "convert", "bitcast") or not args:
            return None
        name = args[0]
    return None


def _tuple_index(defs: Mapping[str, tuple[str, list[str], str]], name: str) -> int | None:
    """The tuple index a ``get-tuple-element`` of the computation's parameter reads, else None."""
    op, args, rest = defs.get(name, ("", [], ""))
    m = re.search(r"index=(\d+)", rest)
    if op != "get-tuple-element" or not m or not args or defs.get(args[0], ("",))[0] != "parameter":
        return None
    return int(m.group(1))


def loop_trips(caller: list[str], init: str, condition: list[str], body: list[str], fallback: int | None = None) -> int:
    """How many times a while loop runs, from its induction variable: the
    condition's ``compare(i, K)`` (``i`` a tuple element of the loop state),
    the body's ``i + step`` and the initial value of that element in the
    tuple the caller passes (0 when not a constant). A loop whose induction is
    not spelled so is read as before: ``fallback``, else the condition's first
    constant. The
    SPMD partitioner's windowed einsum steps its loops by 2, which the limit
    alone would count twice.

    >>> cond = ["  %p = (s32[], f32[8]) parameter(0)", "  %i = s32[] get-tuple-element(%p), index=0",
    ...         "  %k = s32[] constant(8)", "  ROOT %lt = pred[] compare(%i, %k), direction=LT"]
    >>> body = ["  %p = (s32[], f32[8]) parameter(0)", "  %i = s32[] get-tuple-element(%p), index=0",
    ...         "  %two = s32[] constant(2)", "  %next = s32[] add(%i, %two)",
    ...         "  %x = f32[8] get-tuple-element(%p), index=1", "  ROOT %t = (s32[], f32[8]) tuple(%next, %x)"]
    >>> caller = ["  %zero = s32[] constant(0)", "  %x0 = f32[8] parameter(0)",
    ...           "  %init = (s32[], f32[8]) tuple(%zero, %x0)"]
    >>> by_one = [line.replace("(2)", "(1)") for line in body]
    >>> loop_trips(caller, "init", cond, body), loop_trips(caller, "init", cond, by_one)
    (4, 8)
    """
    if fallback is None:
        first = re.search(r"constant\((\d+)\)", "\n".join(condition))
        fallback = int(first.group(1)) if first else 1
    cdefs, bdefs, kdefs = _defs(condition), _defs(body), _defs(caller)
    root = next((m.group(1) for line in condition if (m := _DEF.match(line)) and "ROOT" in line.split("=")[0]), None)
    op, args, rest = cdefs.get(root or "", ("", [], ""))
    direction = re.search(r"direction=(\w+)", rest)
    if op != "compare" or len(args) != 2 or not direction:
        return fallback
    a, b = args
    index, limit, flip = _tuple_index(cdefs, a), _constant(cdefs, b), False
    if index is None or limit is None:
        index, limit, flip = _tuple_index(cdefs, b), _constant(cdefs, a), True
    if index is None or limit is None:
        return fallback
    broot = next((m.group(1) for line in body if (m := _DEF.match(line)) and "ROOT" in line.split("=")[0]), None)
    bop, outs, _ = bdefs.get(broot or "", ("", [], ""))
    if bop != "tuple" or index >= len(outs):
        return fallback
    aop, terms, _ = bdefs.get(outs[index], ("", [], ""))
    if aop not in ("add", "subtract") or len(terms) != 2:
        return fallback
    own = [_tuple_index(bdefs, t) == index for t in terms]
    step = _constant(bdefs, terms[1] if own[0] else terms[0]) if any(own) else None
    if step is None or step == 0:
        return fallback
    step = -step if aop == "subtract" else step
    iop, inits, _ = kdefs.get(init, ("", [], ""))
    start = (_constant(kdefs, inits[index]) if iop == "tuple" and index < len(inits) else None) or 0
    cmp = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(direction.group(1), direction.group(1)) if flip else (
        direction.group(1))  # fmt: skip
    span = {"LT": limit - start, "LE": limit - start + 1, "GT": start - limit, "GE": start - limit + 1,
            "NE": abs(limit - start)}.get(cmp)  # fmt: skip
    if span is None:
        return fallback
    return max(0, -(-span // abs(step)))


def _loops(name: str, callers: Mapping[str, list[tuple[str, int | None]]]) -> tuple[int, ...]:
    """The trip counts of the while loops around computation ``name`` (through its first call site), outermost
    first."""
    out: list[int] = []
    seen = set()
    while callers.get(name) and name not in seen:
        seen.add(name)
        name, trips = callers[name][0]
        if trips is not None:
            out.append(trips)
    return tuple(reversed(out))


def trip_counts(hlo: str) -> dict[str, int]:
    """Computation name -> how many times it runs per step: summed over its call sites, nested loops
    multiplying (the entry, and any computation nothing calls, once)."""
    comps, callers = _call_graph(hlo)
    counts: dict[str, int] = {}

    def count(name: str, visiting: frozenset[str] = frozenset()) -> int:
        if name not in counts:
            sites = [(c, t) for c, t in callers.get(name, []) if c not in visiting and c != name]
            counts[name] = sum(count(c, visiting | {name}) * (t or 1) for c, t in sites) if sites else 1
        return counts[name]

    return {name: count(name) for name in comps}


def _feeds(hlo: str) -> dict[str, tuple[str, ...]]:
    """Each collective's :attr:`Collective.feeds`, read off the operands of
    every instruction (names are unique across an HLO module, so one map)."""
    users: dict[str, list[tuple[str, str]]] = {}
    collectives = []
    kinds = {"all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all"}
    for line in hlo.splitlines():
        m = _ANY_INSTR.match(line)
        if m:
            op = m.group("op").removesuffix("-start")
            args = m.group("args").split("), ", 1)[0]
            for operand in re.findall(r"%([\w.\-]+)", args):
                users.setdefault(operand, []).append((m.group("name"), op))
            if op in kinds:
                collectives.append(m.group("name"))

    def reached(name: str, seen: set[str]) -> list[str]:
        out = []
        for user, op in users.get(name, []):
            if user in seen:
                continue
            seen.add(user)
            out += [user] if op in kinds else reached(user, seen) if op in PASS_THROUGH else []
        return out

    return {name: tuple(reached(name, {name})) for name in collectives}


def parse_collectives(hlo: str, num_devices: int) -> list[Collective]:
    """Every collective in an HLO module's text, with loop trip counts."""
    hlo = expand_tuple_elements(hlo)  # a dump's text (the post-SPMD program is one) as the compiled text reads
    trips = trip_counts(hlo)
    feeds = _feeds(hlo)
    out = []
    current = ""
    for line in hlo.splitlines():
        m = COMPUTATION.match(line)
        if m:
            current = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        kind = m.group("kind")
        n, group = replica_group(line, num_devices)
        op_name = OP_NAME.search(line)
        pairs = line.split("source_target_pairs=")[1].split("}}")[0] + "}" if "source_target_pairs=" in line else ""
        for dtype, shape, nbytes in array_bytes(m.group("type")):
            if kind == "reduce-scatter":  # count the input: N pieces of the result
                nbytes *= n
            out.append(Collective(
                kind, dtype, shape, nbytes, n, trips.get(current, 1), m.group("name"), group,
                op_name.group(1) if op_name else "", tuple((int(a), int(b)) for a, b in _PAIR.findall(pairs)),
                feeds.get(m.group("name"), ()),
            ))  # fmt: skip
    return out


def partitioned_hlo(jitted: Any, *args: Any) -> str:
    """The HLO text right after SPMD partitioning of ``jitted(*args)``."""
    return compile_with_hlo(jitted.lower(*args), read_only_options(jax.devices("cpu")) if on_cpu(args) else None)[1]


def on_cpu(args: Any) -> bool:
    """Whether the arrays ``args`` (or, holding no sharding, the default backend) are on CPU devices only."""
    shardings = [s for s in (getattr(x, "sharding", None) for x in jax.tree.leaves(args)) if s is not None]
    platforms = {d.platform for s in shardings for d in s.device_set}
    return platforms == {"cpu"} if platforms else jax.default_backend() == "cpu"


def collectives(jitted: Any, *args: Any) -> list[Collective]:
    """The collectives of ``jitted(*args)`` after SPMD partitioning."""
    return parse_collectives(partitioned_hlo(jitted, *args), jax.device_count())


def ring_bytes(colls: Iterable[Collective]) -> float:
    """Bytes one device sends per step, as a ring moves them."""
    return float(sum(c.total_ring_bytes for c in colls))


def ring_bytes_per_axis(colls: Iterable[Collective], mesh: Any) -> dict[str, float]:
    """Ring bytes one device sends per step, by the exact set of mesh axes each
    collective spans (:func:`axes_key`): ``"data"``, ``"replica"``,
    ``"replica+data"`` for one spanning both (the loss, stage 0's all-reduce,
    stages 1–2's all-gather with ``optimizer_over_replicas``); on a
    ``("data", "model")`` mesh ``"data"``, ``"model"`` and ``"data+model"``."""
    return {key: sum(kinds.values()) for key, kinds in ring_bytes_per_axis_kind(colls, mesh).items()}


def ring_bytes_per_axis_kind(colls: Iterable[Collective], mesh: Any) -> dict[str, dict[str, float]]:
    """:func:`ring_bytes_per_axis`, split by collective kind: axes key ->
    kind -> ring bytes one device sends per step."""
    out: dict[str, dict[str, float]] = {}
    for c in colls:
        kinds = out.setdefault(axes_key(c.axes(mesh)), {})
        kinds[c.kind] = kinds.get(c.kind, 0.0) + c.total_ring_bytes
    return out


def summarize(colls: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Count and ring bytes per collective kind."""
    out: dict[str, dict[str, float]] = {k: {"count": 0, "ring_bytes": 0.0} for k in _KINDS}
    for c in colls:
        out[c.kind]["count"] += c.trips
        out[c.kind]["ring_bytes"] += c.total_ring_bytes
    return {k: v for k, v in out.items() if v["count"]}


# -- helpers for zj.audit / zj.plan (appended) -----------------------------------------------------------

#: Compiler options for programs compiled only to be read (audit, plan): LLVM
#: optimisation off. The HLO passes, buffer assignment and so
#: ``memory_analysis()`` are unchanged; XLA:CPU compiles about 3x faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class CompiledWithDump(NamedTuple):
    """One compile read four ways: the executable, its HLO right after SPMD
    partitioning (what :func:`parse_collectives` reads), the device memory
    its buffer assignment allocates (the default memory space of the dump's
    memory-usage report: HBM on TPU; ``None`` without a report), and XLA's
    live peak (:class:`zero_jax._audit.memory.LivePeak`, from the live-range
    report; ``None`` without one); with ``schedule=True``, the text of
    XLA:GPU's latency-hiding schedule (``*.schedule.txt``; ``None`` when the
    backend wrote none)."""

    executable: Any
    spmd_hlo: str
    allocated: int | None
    live_peak: LivePeak | None = None
    schedule: str | None = None


def compile_with_dump(lowered: Any, compiler_options: dict[str, Any] | None = None, *,
                      schedule: bool = False) -> CompiledWithDump:  # fmt: skip
    """Compile a ``jax.stages.Lowered`` once, dumping what :class:`CompiledWithDump` reads
    (``schedule``: XLA:GPU's latency-hiding schedule too)."""
    with tempfile.TemporaryDirectory() as d:
        # A hit in jax's persistent compilation cache (jax_compilation_cache_dir) compiles nothing and so
        # dumps nothing; the cache key leaves out xla_dump_to but not xla_dump_emitter_re, so a pattern unique
        # to this call (it names no emitter: nothing more is dumped) makes the key this call's own.
        options = dict(
            compiler_options or {},
            xla_dump_to=d,
            xla_dump_hlo_pass_re="spmd-partitioning",
            xla_dump_emitter_re=f"zero-jax-audit-{os.path.basename(d)}",
        ) | ({"xla_dump_latency_hiding_schedule": True} if schedule else {})
        compiled = lowered.compile(compiler_options=options)
        allocated, peak = hbm_bytes_from_dump(d), live_peak_from_dump(d)
        sched = _read_first(glob.glob(os.path.join(d, "*.schedule.txt"))) if schedule else None
        files = sorted(glob.glob(os.path.join(d, "*after_*spmd-partitioning*")))  # TPU: after_tpu-spmd-...
        if files:
            with open(files[-1]) as f:
                return CompiledWithDump(compiled, f.read(), allocated, peak, sched)
        if len(_devices(compiled)) <= 1:  # one device: nothing to partition, no collectives
            return CompiledWithDump(compiled, compiled.as_text(), allocated, peak, sched)
        raise RuntimeError(NO_SPMD_DUMP)


def _read_first(files: list[str]) -> str | None:
    """The text of the first of ``files`` in name order (None when there is none)."""
    if not files:
        return None
    with open(sorted(files)[0]) as f:
        return f.read()


def compile_with_hlo(lowered: Any, compiler_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Compile a ``jax.stages.Lowered`` once and return the executable and the
    HLO text right after SPMD partitioning (what :func:`parse_collectives` reads)."""
    compiled = compile_with_dump(lowered, compiler_options)
    return compiled.executable, compiled.spmd_hlo


def _devices(compiled: Any) -> set[Any]:
    """The devices a compiled program runs on (from its input and output shardings)."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return {d for s in shardings for d in s.device_set}


def loop_nesting(hlo: str) -> dict[str, tuple[int, ...]]:
    """Collective instruction name -> the trip counts of the while loops around
    it, outermost first (``()`` outside any loop), through the first call
    site of its computation. The product is :attr:`Collective.trips` for a
    computation called once; the nesting tells an accumulation loop from a
    layer scan inside it."""
    comps, callers = _call_graph(hlo)
    nesting = {}
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if m:
                nesting[m.group("name")] = _loops(name, callers)
    return nesting
