"""``zj.choose_keep_gathered``: spend a device memory budget on communication.

ZeRO-3's backward pass gathers every block again; ``keep_gathered=k`` keeps the
last k blocks gathered from their forward to their backward instead (k blocks
of memory for k re-gathers: :func:`zero_jax.keep_gathered_trade`), and
``prefetch`` holds one more block to overlap the next gather. Which pair fits
a budget is a question for the compiled program, not the formula: for each
prefetch (most first) the largest k whose compiled peak fits is found by
bisection (the peak grows with k), each candidate compiled in a child process
with ``num_devices`` simulated devices, as :func:`zero_jax.plan` does, or for a
TPU slice with the TPU compiler (``topology``: judged on the HBM its buffer
assignment allocates), and audited. The choice is the most
communication-saving pair that fits.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax

from zero_jax._audit.audit import audit
from zero_jax._base.units import fmt_bytes, is_whole_number, parse_bytes
from zero_jax._plan.plan import REFERENCE_STEP, TOPOLOGY_DEVICES, factory_path
from zero_jax._plan.topology import device_slice, topology_mesh
from zero_jax._processes.child import resolve, run_child
from zero_jax._theory.checks import check_devices

NOTHING_FITS = (
    "no keep_gathered / prefetch pair fits {budget} per device: the smallest compiled peak, keep_gathered=0 with "
    "prefetch={prefetch}, is {need} ({over} over). A budget of {need} would fit it; else see zj.plan(...) for "
    "what would (more devices, offload_optimizer=True)."
)
BAD_PREFETCHES = (
    "choose_keep_gathered: prefetch must be a non-empty list of ints from 0 to the depth ({depth}), got {got!r}."
)
NEEDS_DEPTH = (
    "choose_keep_gathered: pass depth=..., the number of blocks the factory's step runs layer-wise (the reference "
    "step's is factory_kwargs['depth'])."
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled ``(keep_gathered, prefetch)`` step.

    Attributes:
      keep_gathered: the blocks kept gathered for the backward pass.
      prefetch: the blocks gathered ahead.
      peak: the compiled peak per device (``report.memory["peak"]``; on a
        TPU slice the HBM the buffer assignment allocates).
      comm: bytes one device sends per step (``report.comm.measured``).
      all_gathers: layer all-gathers per step (``report.layers``).
    """

    keep_gathered: int
    prefetch: int
    peak: int
    comm: float
    all_gathers: int


@dataclasses.dataclass(frozen=True)
class KeepGatheredChoice:
    """What :func:`choose_keep_gathered` compiled and chose.

    Attributes:
      device_bytes: the budget per device.
      num_devices: the simulated mesh size.
      depth: the blocks the step runs layer-wise.
      candidates: every compiled candidate, in the order tried.
      seconds: wall time.
      topology: the TPU slice compiled for (``None``: simulated CPU devices).
    """

    device_bytes: float
    num_devices: int
    depth: int
    candidates: tuple[Candidate, ...]
    seconds: float
    topology: str | None = None

    @property
    def chosen(self) -> Candidate | None:
        """The candidate that fits and keeps the most blocks (the most prefetch among those); None if none fits."""
        fits = [c for c in self.candidates if c.peak <= self.device_bytes]
        return max(fits, key=lambda c: (c.keep_gathered, c.prefetch), default=None)

    @property
    def keep_gathered(self) -> int | None:
        return None if self.chosen is None else self.chosen.keep_gathered

    @property
    def prefetch(self) -> int | None:
        return None if self.chosen is None else self.chosen.prefetch

    def verdict(self) -> str:
        """One line: the choice, its compiled peak under the budget and what it saves, or by how much nothing fits."""
        budget, c = fmt_bytes(self.device_bytes), self.chosen
        if c is None:
            least = min(self.candidates, key=lambda x: x.peak)
            return NOTHING_FITS.format(budget=budget, prefetch=least.prefetch, need=fmt_bytes(least.peak),
                                       over=fmt_bytes(least.peak - self.device_bytes))  # fmt: skip
        base = self._baseline(c.prefetch)
        saved = "" if base is None else f", {fmt_bytes(base.comm - c.comm)} less communication per step than keep 0"
        return (f"keep_gathered={c.keep_gathered}, prefetch={c.prefetch}: compiled peak {fmt_bytes(c.peak)} <= "
                f"{budget} per device ({fmt_bytes(self.device_bytes - c.peak)} under){saved}")  # fmt: skip

    def check(self) -> KeepGatheredChoice:
        """Raise ``ValueError`` with :meth:`verdict` when nothing fits."""
        if self.chosen is None:
            raise ValueError(f"choose_keep_gathered: {self.verdict()}")
        return self

    def _baseline(self, prefetch: int) -> Candidate | None:
        return next((x for x in self.candidates if x.keep_gathered == 0 and x.prefetch == prefetch), None)

    def __str__(self) -> str:
        lines = [
            f"zj.choose_keep_gathered: {self.topology or f'N = {self.num_devices}'}, {self.depth} blocks, budget "
            f"{fmt_bytes(self.device_bytes)} per device; {len(self.candidates)} compiled in {self.seconds:.1f} s",
            f"{'keep':>5} {'prefetch':>8} {'peak':>11} {'fits':>5} {'comm/step':>11} {'all-gathers':>11}",
        ]
        for c in sorted(self.candidates, key=lambda x: (-x.prefetch, x.keep_gathered)):
            fits = "yes" if c.peak <= self.device_bytes else "no"
            lines.append(f"{c.keep_gathered:>5} {c.prefetch:>8} {fmt_bytes(c.peak):>11} {fits:>5} "
                         f"{fmt_bytes(c.comm):>11} {c.all_gathers:>11}")  # fmt: skip
        return "\n".join([*lines, f"chosen: {self.verdict()}"])


def compile_candidate(build: Any, mesh: Any, stage: int, kwargs: dict[str, Any], keep: int, prefetch: int) -> Candidate:
    """Compile and audit one candidate step (in the planning child)."""
    step, state, batch = build(stage, mesh, **kwargs, keep_gathered=keep, prefetch=prefetch)
    report = audit(step, state, batch, grads=False, prefetch=prefetch)
    layers = report.layers
    gathers = 0 if layers is None else sum(b.forward + b.backward for b in layers.blocks)
    peak = int(report.memory.get("allocated", report.memory["peak"]))  # on TPU: the HBM allocated
    return Candidate(keep, prefetch, peak, float(report.comm.measured), gathers)


def search_candidates(
    factory: str, kwargs: dict[str, Any], stage: int, budget: float, depth: int, prefetches: Sequence[int],
    topology: str | None = None,
) -> list[Candidate]:
    """The planning child's job: per prefetch (most first), bisect for the
    largest keep_gathered whose compiled peak fits ``budget``, starting above
    the best one found so far; every compiled candidate. On the simulated
    devices, or a ``topology``'s TPU devices."""
    mesh = jax.make_mesh((jax.device_count(),), ("data",)) if topology is None else topology_mesh(topology)
    build = resolve(factory)
    seen: dict[tuple[int, int], Candidate] = {}

    def fits(k: int, pf: int) -> bool:
        if (k, pf) not in seen:
            seen[k, pf] = compile_candidate(build, mesh, stage, kwargs, k, pf)
        return seen[k, pf].peak <= budget

    best = -1
    for pf in sorted(prefetches, reverse=True):
        lo = best + 1
        if lo > depth or not fits(lo, pf):
            continue
        if fits(depth, pf):
            best = depth
            continue
        fit, miss = lo, depth  # fit fits, miss does not
        while miss - fit > 1:
            mid = (fit + miss) // 2
            fit, miss = (mid, miss) if fits(mid, pf) else (fit, mid)
        best = fit
    return list(seen.values())


def choose_keep_gathered(
    device_bytes: float | str | None = None,
    *,
    num_devices: int | None = None,
    topology: str | None = None,
    factory: Any = None,
    factory_kwargs: dict[str, Any] | None = None,
    depth: int | None = None,
    prefetch: Sequence[int] = (1, 0),
    stage: int = 3,
    timeout: float = 600.0,
) -> KeepGatheredChoice:
    """The ``keep_gathered`` and ``prefetch`` of a layer-wise stage-3 step that
    fit ``device_bytes`` per device and save the most communication, verified
    by compiling the step.

    Args:
      device_bytes: the budget per device (``"16GiB"`` or a number; with a
        ``topology``, by default its chip's HBM).
      num_devices: the data-parallel size, simulated in a child process.
      topology: a TPU slice or GPU hosts (``"v5p:2x2x2"``, ``"h100:1x8"``,
        :func:`zero_jax.topology_mesh`'s names): compile each candidate for
        its devices with the TPU or GPU compiler, here (libtpu or the CUDA
        plugin installed), judged on the device memory it allocates.
      factory: ``factory(stage, mesh, **factory_kwargs, keep_gathered=k,
        prefetch=p) -> (step, abstract_state, abstract_batch)`` (or its
        ``"module:function"`` path); ``None``: the reference transformer
        (:func:`zero_jax._plan.plan.reference_step`).
      factory_kwargs: keyword arguments for the factory (picklable).
      depth: the blocks the step runs layer-wise (default: the reference
        step's ``factory_kwargs["depth"]``, 4).
      prefetch: the prefetch values to try.
      stage: the stage to compile (3: only it gathers).
      timeout: seconds the child process may take.

    Example (the reference model, depth 4; keep 4 fits an ample budget):

    >>> import zero_jax as zj
    >>> c = zj.choose_keep_gathered("1GiB", num_devices=8, factory_kwargs=dict(dim=32, heads=2, seq=16, vocab=64))
    >>> c.keep_gathered, c.prefetch, c.chosen.peak < 2**30
    (4, 1, True)
    """
    started = time.perf_counter()
    tpu = None if topology is None else device_slice(topology)  # no compiler, a bad name: fail here, not in a child
    if device_bytes is None and tpu is None:
        raise TypeError("choose_keep_gathered: pass device_bytes=... (e.g. '16GiB'), or a topology= whose HBM it is.")
    budget = tpu.hbm_per_device if device_bytes is None else parse_bytes(device_bytes, "choose_keep_gathered")  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
    if budget <= 0:  # pyright: ignore[reportOptionalOperand] - set here: a check above pyright cannot follow
        raise ValueError(f"choose_keep_gathered: device_bytes must be positive, got {device_bytes!r}.")
    if tpu is not None and num_devices not in (None, tpu.num_devices):
        said = TOPOLOGY_DEVICES.format(topology=tpu.topology, n=tpu.num_devices, num_devices=num_devices)
        raise ValueError("choose_keep_gathered: " + said.removeprefix("plan: "))
    if tpu is None and num_devices is None:
        raise TypeError("choose_keep_gathered: pass num_devices=..., the data-parallel size (or a topology=).")
    n = tpu.num_devices if tpu is not None else check_devices(num_devices, "choose_keep_gathered")
    path, kwargs = factory_path(factory), dict(factory_kwargs or {})
    if depth is None:
        if path != REFERENCE_STEP:
            raise TypeError(NEEDS_DEPTH)
        depth = int(kwargs.get("depth", 4))
    prefetches = list(prefetch)
    if not prefetches or not all(is_whole_number(p) and 0 <= p <= depth for p in prefetches):
        raise ValueError(BAD_PREFETCHES.format(depth=depth, got=prefetch))
    on = f"{tpu.topology} ({n} {tpu.platform.upper()} devices)" if tpu is not None else f"N = {n} simulated devices"
    rows = run_child(search_candidates, path, kwargs, stage, budget, depth, prefetches,
                     None if tpu is None else tpu.topology, devices=1 if tpu is not None else n, timeout=timeout,
                     where=f"choose_keep_gathered ({on}, {path})")  # fmt: skip
    seconds = time.perf_counter() - started
    return KeepGatheredChoice(budget, n, depth, tuple(rows), seconds, None if tpu is None else tpu.topology)  # pyright: ignore[reportArgumentType] - the budget is parsed above
