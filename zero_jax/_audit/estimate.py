"""A step-time *estimate* read off the GPU compiler's own latency-hiding
schedule (XLA:GPU, compiled here without a GPU: ``zj.topology_mesh``).

XLA:GPU's latency-hiding scheduler times every instruction with its own cost
model (the SOL estimator: GEMMs and fusions at the target's rates, NCCL
collectives from a bandwidth/latency model of NVLink and, across hosts,
InfiniBand) and, with ``xla_dump_latency_hiding_schedule``, writes each
computation it schedules to ``<module>.schedule.txt``: each instruction's
start and end on the scheduler's own timeline (µs), where an async
collective's done waits until the collective's modelled latency has passed
since its start. A computation's makespan here is that timeline's end, and
the communication it leaves exposed is the timeline's idle time before each
collective's done (the compute scheduled between its start and done did not
hide it), per kind. Idle time before a non-collective async op's done
(jax-cuda13-plugin 0.12.1 wraps some fusions in a loop body as
``async-start`` / ``-done`` and times them with a fixed default latency, not a
model) is reported apart (``unmodelled_seconds``) and left out of the step.
The schedule's ``scheduler_statistics`` (``total_cycles``, ``*_wasted_cycles``)
are not used: jax-cuda12-plugin 0.10.2 computes a loop body's statistics
on an instruction order other than the one it compiles (measured: an
all-gather under a 700 µs matmul in a ``lax.scan`` body is counted as wholly
exposed there, and as hidden in the entry computation and by plugin 0.12.1;
``tests/test_gpu_aot.py``); the timeline is the schedule the program runs.

The dump covers only computations holding an async collective, and a while
loop's body is a computation of its own whose node in the caller costs
nothing. :func:`estimate_from_schedule` therefore adds each loop body's
makespan times the number of times it runs per step: the loop's
``known_trip_count`` (XLA's own, in the while's backend config), times the
runs of the computation that calls it (nested loops multiply). A body the
scheduler did not dump (no async collective in it: e.g. a scanned stage 0–2
step, whose gradient reduction follows the loop) is listed in
:attr:`StepEstimate.untimed`, and the estimate is then a lower bound
(:attr:`StepEstimate.complete` is False).

What it leaves out (:data:`LEAVES_OUT`): no kernel autotuning (the cost model,
not measured kernels), no kernel-launch or host gaps, XLA's default network
parameters (NVLink within a host, InfiniBand across hosts), and a conditional's
branches. Model FLOPs (``model_flops``) and MFU are the caller's: MFU = model
FLOPs / (estimated seconds x the GPU's dense bf16 peak, :data:`PEAK_BF16`).

TPU programs get no estimate: libtpu's ``cost_analysis()["optimal_seconds"]``
is a per-device sum of per-op costs with no ICI time, no overlap credit and each
loop body counted once; it is not a step time.

>>> text = '''hlo_module {
...   entry_computation_name: "main"
...   computations { name: "main" id: 1
...     instructions { name: "w" opcode: "while" id: 10 called_computation_ids: 2
...       backend_config: "known_trip_count n 3" }
...     instructions { name: "ag" opcode: "all-gather-start" id: 11 }
...     instructions { name: "mm" opcode: "fusion" id: 12 }
...     instructions { name: "agd" opcode: "all-gather-done" id: 13 operand_ids: 11 }
...   }
...   computations { name: "body" id: 2 }
... }
... computation_schedules { computation_id: 1
...   instructions { id: 11 start_timestamp_cycles: 0 end_timestamp_cycles: 1 }
...   instructions { id: 12 start_timestamp_cycles: 1 end_timestamp_cycles: 8 }
...   instructions { id: 13 start_timestamp_cycles: 9 end_timestamp_cycles: 10 } }
... computation_schedules { computation_id: 2
...   instructions { id: 21 start_timestamp_cycles: 0 end_timestamp_cycles: 5 } }'''
>>> e = estimate_from_schedule(text)
>>> round(e.seconds * 1e6), round(e.exposed_seconds * 1e6), e.loops[0].runs, e.complete
(25, 1, 3, True)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

from zero_jax._audit.hlo import compile_with_dump

#: What the estimate is not (printed with it).
LEAVES_OUT = (
    "an estimate from XLA's cost model: no kernel autotuning, no kernel-launch or host gaps, XLA's default "
    "network parameters (NVLink within a host, InfiniBand across hosts), conditionals' branches not timed"
)
#: Dense bf16 FLOP/s per GPU by ``device_kind`` (vendor figures, without sparsity): MFU's denominator.
PEAK_BF16 = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200 141GB HBM3e": 989e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
}
NOT_GPU = (
    "step_estimate: {platform} programs get no estimate here; it reads XLA:GPU's latency-hiding schedule. "
    "(On TPU, libtpu's cost_analysis()['optimal_seconds'] has no ICI time, no overlap and counts each loop "
    "once: not a step time.) Compile for GPU hosts: zj.topology_mesh('h100:1x8')."
)
NO_SCHEDULE = (
    "step_estimate: the compile wrote no latency-hiding schedule (no async collective in the program, or the "
    "latency-hiding scheduler is off: xla_gpu_enable_latency_hiding_scheduler)."
)
_SYNC_COLLECTIVES = frozenset({"all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all"})
#: Async dones that name their collective in the opcode (others are ``async-done`` around a computation).
_DONES = {"all-gather-done": "all-gather", "all-reduce-done": "all-reduce", "collective-permute-done":
          "collective-permute", "send-done": "send", "recv-done": "recv"}  # fmt: skip
_TRIPS = re.compile(r'known_trip_count\W+n\W+(\d+)')


@dataclasses.dataclass(frozen=True)
class LoopTime:
    """One while loop's body: its makespan per iteration (µs, None when the
    scheduler did not dump it) and how many times it runs per step."""

    body: str
    runs: int
    micros: float | None


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """A step's time as XLA:GPU's scheduler estimates it (an *estimate*; see
    :data:`LEAVES_OUT`).

    Attributes:
      seconds: the entry computation's makespan plus each timed loop body's
        times its runs per step.
      exposed_seconds: communication left exposed (async collectives' latency
        not hidden by compute, and synchronous collectives), loops included.
      exposed_by_kind: the same per collective kind.
      loops: every while loop's body, its runs per step and its makespan.
      untimed: loop bodies without a schedule (``complete`` is False).
      entry_seconds: the entry computation's makespan alone (its loops cost
        nothing there).
      unmodelled_seconds: the schedule's idle time before non-collective
        async ops' dones (jax-cuda13-plugin 0.12.1 wraps some fusions
        in a loop body as ``async-start`` / ``-done``), which XLA times with a
        fixed default latency rather than a model; left out of ``seconds``.
      device_kind: the GPU compiled for; ``model_flops`` (the whole step's),
        ``peak_flops`` (one GPU's), ``devices``: for MFU.
    """

    seconds: float
    exposed_seconds: float
    exposed_by_kind: Mapping[str, float]
    loops: tuple[LoopTime, ...] = ()
    untimed: tuple[str, ...] = ()
    entry_seconds: float = 0.0
    device_kind: str = ""
    model_flops: float | None = None
    peak_flops: float | None = None
    devices: int = 1
    unmodelled_seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.untimed

    @property
    def mfu(self) -> float | None:
        """Model FLOPs / (estimated seconds x peak x devices), when both are known."""
        if not self.model_flops or not self.peak_flops or not self.seconds:
            return None
        return self.model_flops / (self.seconds * self.peak_flops * self.devices)

    def with_flops(self, model_flops: float, devices: int = 1, peak_flops: float | None = None) -> StepEstimate:
        """The same estimate with the model FLOPs of the whole step over ``devices`` GPUs (each runs the
        program whose time this is), and a peak per GPU other than :data:`PEAK_BF16`'s."""
        peak = peak_flops if peak_flops is not None else PEAK_BF16.get(self.device_kind, self.peak_flops)
        return dataclasses.replace(self, model_flops=model_flops, peak_flops=peak, devices=devices)

    def lines(self) -> list[str]:
        bound = "" if self.complete else f" (lower bound: {len(self.untimed)} loop bodies untimed)"
        out = [
            f"step time (estimate, XLA:GPU latency-hiding schedule): {self.seconds * 1e3:.2f} ms{bound}, "
            f"communication exposed {self.exposed_seconds * 1e3:.2f} ms"
            + (f" ({self.exposed_seconds / self.seconds:.0%})" if self.seconds else "")
        ]
        if self.unmodelled_seconds:
            out.append(f"  left out: {self.unmodelled_seconds * 1e3:.2f} ms of waits on non-collective async ops "
                       "that XLA times with a fixed default latency, not a model")  # fmt: skip
        if self.loops:
            out.append("  loops: " + ", ".join(
                f"{lp.body} {lp.runs} x " + ("untimed" if lp.micros is None else f"{lp.micros / 1e3:.3f} ms")
                for lp in self.loops))  # fmt: skip
        if self.mfu is not None and self.peak_flops is not None:
            out.append(f"  model FLOPs/step {self.model_flops:.4g} over {self.devices} GPU(s), MFU (estimate) "
                       f"{self.mfu:.1%} of {self.peak_flops / 1e12:.0f} TFLOP/s bf16 dense each")  # fmt: skip
        out.append(f"  ({LEAVES_OUT})")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _parse(text: str) -> dict[str, list[Any]]:
    """Protobuf text format -> nested dicts of lists (fields may share a line)."""
    root: dict[str, list[Any]] = {}
    stack = [root]
    for tok in re.finditer(r'(\w+)\s*\{|(\w+)\s*:\s*("(?:[^"\\]|\\.)*"|[^\s}]+)|\}', text):
        if tok.group(1):
            node: dict[str, list[Any]] = {}
            stack[-1].setdefault(tok.group(1), []).append(node)
            stack.append(node)
        elif tok.group(2):
            value = tok.group(3)
            stack[-1].setdefault(tok.group(2), []).append(value[1:-1] if value.startswith('"') else value)
        else:
            stack.pop()
    return root


def _first(node: Mapping[str, list[Any]], key: str, default: Any = None) -> Any:
    return node.get(key, [default])[0]


def estimate_from_schedule(text: str, *, device_kind: str = "", model_flops: float | None = None,
                           peak_flops: float | None = None) -> StepEstimate:  # fmt: skip
    """The :class:`StepEstimate` of one ``*.schedule.txt`` (XLA's
    ``ScheduleProto`` in text form, every computation it scheduled)."""
    proto = _parse(text)
    module = _first(proto, "hlo_module", {})
    comps = {_first(c, "id"): c for c in module.get("computations", [])}
    names = {i: _first(c, "name") for i, c in comps.items()}
    waits_for = _waits_for(comps)
    timed = {_first(s, "computation_id"): _Timed.of(s, waits_for) for s in proto.get("computation_schedules", [])}
    entry = next((i for i, n in names.items() if n == _first(module, "entry_computation_name")), None)
    total, unmodelled, by_kind = 0.0, 0.0, dict[str, float]()
    loops, untimed = list[LoopTime](), list[str]()
    todo = [(entry, 1)] if entry in timed else []
    while todo:  # the entry, then each timed loop body with its runs per step (nested loops multiply)
        cid, runs = todo.pop(0)
        total += runs * timed[cid].micros
        unmodelled += runs * timed[cid].unmodelled
        for kind, micros in timed[cid].exposed.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + runs * micros
        for ins in comps.get(cid, {}).get("instructions", []):
            op = _first(ins, "opcode")
            if op in _SYNC_COLLECTIVES:  # a synchronous collective: all its time is exposed
                by_kind[op] = by_kind.get(op, 0.0) + runs * timed[cid].costs.get(_first(ins, "id"), 0.0)
            if op != "while":
                continue
            body = _first(ins, "called_computation_ids")  # a while calls its body, then its condition
            trips = _TRIPS.search(_first(ins, "backend_config", "") or "")
            n = runs * int(trips.group(1)) if trips else runs
            ok = body in timed and trips is not None
            loops.append(LoopTime(names.get(body, str(body)), n, timed[body].micros if ok else None))
            if ok:
                todo.append((body, n))
            else:
                untimed.append(names.get(body, str(body)))
    entry_micros = timed[entry].micros if entry in timed else 0.0
    return StepEstimate(total / 1e6, sum(by_kind.values()) / 1e6, {k: v / 1e6 for k, v in sorted(by_kind.items())},
                        tuple(loops), tuple(untimed), entry_micros / 1e6, device_kind, model_flops,
                        peak_flops if peak_flops is not None else PEAK_BF16.get(device_kind),
                        unmodelled_seconds=unmodelled / 1e6)  # fmt: skip


class _Timed(NamedTuple):
    """One scheduled computation: its makespan and the communication it leaves exposed per kind (µs)."""

    micros: float
    exposed: dict[str, float]
    costs: dict[str, float]  # instruction id -> its cost in the schedule
    unmodelled: float  # waits on non-collective async ops, timed by a fixed default (left out of micros)

    @classmethod
    def of(cls, schedule: Mapping[str, list[Any]], waits_for: Mapping[Any, tuple[Any, str | None]]) -> _Timed:
        """Read off the scheduler's timeline; ``waits_for``: each async done's start and collective kind (None:
        not a collective) by instruction id."""
        per_us = float(_first(schedule, "cycles_per_microsecond", 1)) or 1.0
        spans = sorted((float(_first(i, "start_timestamp_cycles", 0)) / per_us,
                        float(_first(i, "end_timestamp_cycles", 0)) / per_us, _first(i, "id"))
                       for i in schedule.get("instructions", []))  # fmt: skip
        costs = {iid: end - start for start, end, iid in spans}
        at = {iid: (start, end) for start, end, iid in spans}
        # Each async op in flight: (its start's end, its done's start, kind).
        flights = sorted((at[first][1], at[done][0], kind) for done, (first, kind) in waits_for.items()
                         if done in at and first in at)  # fmt: skip
        exposed, unmodelled, clock = dict[str, float](), 0.0, 0.0
        for start, end, _ in spans:
            if start - clock > 1e-9 * max(clock, 1.0):
                # Idle time (nothing runs) is the wait of the first async op in flight over it to be done: the
                # timeline places zero-cost ops that read a done's result beside the done, not always after it.
                waiting = [(done, kind) for begun, done, kind in flights
                           if begun <= clock + 1e-6 and done >= start - 1e-6]  # fmt: skip
                if waiting:
                    kind = min(waiting, key=lambda w: w[0])[1]
                    if kind is None:
                        unmodelled += start - clock
                    else:
                        exposed[kind] = exposed.get(kind, 0.0) + start - clock
            clock = max(clock, end)
        return cls(clock - unmodelled, exposed, costs, unmodelled)


def _waits_for(comps: Mapping[Any, Mapping[str, list[Any]]]) -> dict[Any, tuple[Any, str | None]]:
    """Every async done of the module by instruction id: its start (its operand) and the collective kind it
    waits for, or None for a non-collective async op (an async fusion, a copy): an ``async-done``'s start
    names the computation it runs."""
    by_id = {_first(i, "id"): i for comp in comps.values() for i in comp.get("instructions", [])}
    out: dict[Any, tuple[Any, str | None]] = {}
    for iid, ins in by_id.items():
        op, first = _first(ins, "opcode", ""), _first(ins, "operand_ids")
        if op in _DONES:
            out[iid] = (first, _DONES[op])
        elif op in ("async-done", "copy-done"):
            inner = {_first(i, "opcode") for c in by_id.get(first, {}).get("called_computation_ids", [])
                     for i in comps.get(c, {}).get("instructions", [])}  # fmt: skip
            out[iid] = (first, next((k for k in sorted(inner) if k in _SYNC_COLLECTIVES), None))
    return out


def _platform(args: Any) -> tuple[str, str]:
    """(platform, device_kind) of the devices the arguments are placed on (("", "") when none is)."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and sharding.device_set:
            device = next(iter(sharding.device_set))
            return device.platform, getattr(device, "device_kind", "")
    return "", ""


def _device_count(args: Any) -> int:
    """How many devices the arguments span (1 when none is placed)."""
    return max((len(leaf.sharding.device_set) for leaf in jax.tree.leaves(args)
                if getattr(leaf, "sharding", None) is not None), default=1)  # fmt: skip


def step_estimate(jitted: Any, *args: Any, model_flops: float | None = None, peak_flops: float | None = None,
                  compiler_options: Mapping[str, Any] | None = None) -> StepEstimate:  # fmt: skip
    """Compile ``jitted(*args)`` for GPU hosts (arguments placed on a
    ``zj.topology_mesh("h100:1x8")``; ``jax.ShapeDtypeStruct`` s do) and
    estimate its step time from XLA:GPU's latency-hiding schedule
    (:func:`estimate_from_schedule`); ``model_flops``: the model FLOPs per
    step over all the devices, for MFU. ``zj.audit`` gives the same estimate as ``report.estimate``.
    Any other platform raises ``ValueError`` (:data:`NOT_GPU`); the module's
    example reads a schedule without compiling.

    >>> import jax, jax.numpy as jnp
    >>> try:
    ...     step_estimate(jax.jit(jnp.sum), jnp.ones(8))
    ... except ValueError as e:
    ...     print(str(e)[:48])
    step_estimate: cpu programs get no estimate here
    """
    platform, kind = _platform(args)
    if platform != "gpu":
        raise ValueError(NOT_GPU.format(platform=platform or "unplaced"))
    compiled = compile_with_dump(jitted.lower(*args), dict(compiler_options or {}), schedule=True)
    if compiled.schedule is None:
        raise ValueError(NO_SCHEDULE)
    est = estimate_from_schedule(compiled.schedule, device_kind=kind, model_flops=model_flops, peak_flops=peak_flops)
    return dataclasses.replace(est, devices=_device_count(args))
