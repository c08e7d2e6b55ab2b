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

import collections
import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

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


def resident_bytes(tree: Any) -> dict[Any, int]:
    """Bytes held by each device for the arrays of ``tree`` (padding included)."""
    out: dict[Any, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return dict(out)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the partitioned program.

    ``bytes`` is the size of the full (per-device) operand for all-reduce,
    collective-permute and all-to-all, the gathered result for all-gather and
    the scattered input for reduce-scatter. ``ring_bytes`` is what one device
    sends per execution in a ring of ``group_size``; ``trips`` how many times
    the enclosing loops run it.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    group_size: int
    trips: int = 1
    name: str = ""
    group: tuple[int, ...] = ()  # the devices (partition ids) of one replica group, when the HLO lists them

    def axes(self, mesh: Any) -> tuple[str, ...]:
        """The mesh axes this collective runs across: those along which the
        devices of its group differ (every axis when the group is unknown).

        Partition ids are positions in ``mesh.devices.flat`` (jit's device
        assignment), so this reads ``replica_groups={{0,4},{1,5},...}`` on a
        ``("replica", "data")`` mesh of shape (2, 4) as ``("replica",)``.
        """
        names = tuple(mesh.axis_names)
        if not self.group:
            return tuple(n for n in names if mesh.shape[n] > 1)
        coords = np.array(np.unravel_index(np.asarray(self.group), mesh.devices.shape))
        return tuple(n for i, n in enumerate(names) if len(set(coords[i].tolist())) > 1)

    @property
    def ring_bytes(self) -> float:
        n = self.group_size
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * self.bytes
        if self.kind == "collective-permute":
            return float(self.bytes)
        return (n - 1) / n * self.bytes

    @property
    def total_ring_bytes(self) -> float:
        return self.ring_bytes * self.trips


def _array_bytes(text: str) -> list[tuple[str, tuple[int, ...], int]]:
    out = []
    for m in _ARRAY.finditer(text):
        dtype = m.group("dtype")
        if dtype not in DTYPE_BYTES:
            continue
        dims = tuple(int(d) for d in m.group("dims").split(",") if d)
        out.append((dtype, dims, math.prod(dims) * DTYPE_BYTES[dtype]))
    return out


def _first_group(line: str) -> tuple[int, ...]:
    """The first replica group of a collective, from either HLO spelling:
    ``{{0,4},{1,5}}`` or the iota form ``[G,S]<=[dims]T(perm)``."""
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", line)
    if m:
        return tuple(int(x) for x in m.group(1).split(",") if x.strip())
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        g, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return tuple(int(i) for i in ids.reshape(g, size)[0])
    return ()


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", line)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        names = re.findall(r"'(\w+)'", m.group(2))
        return math.prod(int(sizes[n]) for n in names)
    m = re.search(r"source_target_pairs=\{(.*?)\}\s*(,|$)", line)
    if m:
        return 2
    return num_devices


def _trip_counts(hlo: str) -> dict[str, int]:
    """Computation name -> how many times it runs per step (nested loops multiply).

    Right after SPMD partitioning the while loops carry no trip-count
    annotation, so it is read off the loop condition ``compare(i, constant(K)),
    direction=LT``.
    """
    comps: dict[str, str] = {}
    current = None
    for line in hlo.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+(?:\(.*\)\s*->.*)?\{\s*$", line)
        if m:
            current = m.group(1)
            comps[current] = ""
        elif current is not None:
            comps[current] += line + "\n"
    parent: dict[str, tuple[str, int]] = {}
    for name, body in comps.items():
        for m in re.finditer(r"while\(.*?condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)", body):
            cond, loop_body = m.group(1), m.group(2)
            trips = 1
            c = re.search(r"constant\((\d+)\)", comps.get(cond, ""))
            if c:
                trips = int(c.group(1))
            parent[loop_body] = (name, trips)
        for m in re.finditer(
            r"(?:to_apply|calls|branch_computations|true_computation|false_computation)=\{?%?([\w.\-]+)", body
        ):
            parent.setdefault(m.group(1), (name, 1))

    def count(name: str, seen: frozenset[str] = frozenset()) -> int:
        if name not in parent or name in seen:
            return 1
        p, trips = parent[name]
        return trips * count(p, seen | {name})

    return {name: count(name) for name in comps}


def parse_collectives(hlo: str, num_devices: int) -> list[Collective]:
    """Every collective in an HLO module's text, with loop trip counts."""
    trips = _trip_counts(hlo)
    out = []
    current = ""
    for line in hlo.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+(?:\(.*\)\s*->.*)?\{\s*$", line)
        if m:
            current = m.group(1)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        kind = m.group("kind")
        n = _group_size(line, num_devices)
        for dtype, shape, nbytes in _array_bytes(m.group("type")):
            if kind == "reduce-scatter":  # count the input: N pieces of the result
                nbytes *= n
            out.append(
                Collective(kind, dtype, shape, nbytes, n, trips.get(current, 1), m.group("name"), _first_group(line))
            )
    return out


def partitioned_hlo(jitted: Any, *args: Any) -> str:
    """The HLO text right after SPMD partitioning of ``jitted(*args)``."""
    return compile_with_hlo(jitted.lower(*args))[1]


def collectives(jitted: Any, *args: Any) -> list[Collective]:
    """The collectives of ``jitted(*args)`` after SPMD partitioning."""
    return parse_collectives(partitioned_hlo(jitted, *args), jax.device_count())


def ring_bytes(colls: Iterable[Collective]) -> float:
    """Bytes one device sends per step, as a ring moves them."""
    return float(sum(c.total_ring_bytes for c in colls))


def memory(compiled: Any) -> dict[str, int]:
    """Per-device figures of ``compiled.memory_analysis()`` and the peak estimate."""
    m = compiled.memory_analysis()
    fig = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
    }
    fig["peak"] = fig["argument"] + fig["output"] + fig["temp"] - fig["alias"]
    return fig


def ring_bytes_per_axis(colls: Iterable[Collective], mesh: Any) -> dict[str, float]:
    """Ring bytes one device sends per step, by the mesh axes each collective
    spans: ``"data"``, ``"replica"``, or ``"replica+data"`` for one spanning
    both (the loss, stage 0's all-reduce, stages 1–2's all-gather with
    ``optimizer_over_replicas``)."""
    out: dict[str, float] = collections.defaultdict(float)
    for c in colls:
        out["+".join(c.axes(mesh)) or "none"] += c.total_ring_bytes
    return dict(out)


def summarize(colls: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Count and ring bytes per collective kind."""
    out: dict[str, dict[str, float]] = {k: {"count": 0, "ring_bytes": 0.0} for k in _KINDS}
    for c in colls:
        out[c.kind]["count"] += c.trips
        out[c.kind]["ring_bytes"] += c.total_ring_bytes
    return {k: v for k, v in out.items() if v["count"]}


# -- helpers for zj.audit / zj.plan (appended) -----------------------------------------------------------

_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s+(?:\(.*\)\s*->.*)?\{\s*$")


#: Compiler options for programs compiled only to be read (audit, plan): LLVM
#: optimisation off. The HLO passes, buffer assignment and so
#: ``memory_analysis()`` are unchanged; XLA:CPU compiles about 3x faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_with_hlo(lowered: Any, compiler_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """Compile a ``jax.stages.Lowered`` once and return the executable and the
    HLO text right after SPMD partitioning (what :func:`parse_collectives` reads)."""
    with tempfile.TemporaryDirectory() as d:
        options = dict(compiler_options or {}, xla_dump_to=d, xla_dump_hlo_pass_re="spmd-partitioning")
        compiled = lowered.compile(compiler_options=options)
        files = sorted(glob.glob(os.path.join(d, "*after_spmd-partitioning*")))
        if files:
            with open(files[-1]) as f:
                return compiled, f.read()
        if len(_devices(compiled)) <= 1:  # one device: nothing to partition, no collectives
            return compiled, compiled.as_text()
        raise RuntimeError(NO_SPMD_DUMP)


def _devices(compiled: Any) -> set[Any]:
    """The devices a compiled program runs on (from its input and output shardings)."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return {d for s in shardings for d in s.device_set}


def loop_nesting(hlo: str) -> dict[str, tuple[int, ...]]:
    """Collective instruction name -> the trip counts of the while loops around
    it, outermost first (``()`` outside any loop). The product is
    :attr:`Collective.trips`; the nesting tells an accumulation loop from a
    layer scan inside it."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif current is not None:
            comps[current].append(line)
    parent: dict[str, tuple[str, int | None]] = {}  # computation -> (caller, trips if a loop body)
    for name, lines in comps.items():
        body = "\n".join(lines)
        for m in re.finditer(r"while\(.*?condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)", body):
            c = re.search(r"constant\((\d+)\)", "\n".join(comps.get(m.group(1), [])))
            parent[m.group(2)] = (name, int(c.group(1)) if c else 1)
        for m in re.finditer(
            r"(?:to_apply|calls|branch_computations|true_computation|false_computation)=\{?%?([\w.\-]+)", body
        ):
            parent.setdefault(m.group(1), (name, None))

    def chain(name: str) -> tuple[int, ...]:
        out: list[int] = []
        seen = set()
        while name in parent and name not in seen:
            seen.add(name)
            name, trips = parent[name]
            if trips is not None:
                out.append(trips)
        return tuple(reversed(out))

    nesting = {}
    for name, lines in comps.items():
        loops = chain(name)
        for line in lines:
            m = _INSTR.match(line)
            if m:
                nesting[m.group("name")] = loops
    return nesting


def resident_bytes_by_kind(tree: Any) -> dict[tuple[Any, str], int]:
    """Bytes held per (device, memory kind) for the arrays of ``tree``:
    offloaded leaves count under ``"pinned_host"``, the rest under ``"device"``.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.device_put(jnp.zeros(4), jax.devices()[0])
    >>> resident_bytes_by_kind(x)[(jax.devices()[0], "device")]
    16
    """
    out: dict[tuple[Any, str], int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        kind = leaf.sharding.memory_kind or "device"
        for shard in leaf.addressable_shards:
            out[(shard.device, kind)] += shard.data.nbytes
    return dict(out)
