"""``zj.plan``: will it fit? Compile the real step for a mesh of the target
size and read the compiled program.

:func:`plan` lowers and compiles a step on abstract inputs
(``jax.ShapeDtypeStruct``; nothing is allocated) in a child process
(:func:`zero_jax._processes.child.run_child`), for a mesh of ``num_devices``
simulated CPU devices or, with ``topology=``, of a TPU slice's or GPU hosts'
devices compiled by the real TPU or GPU compiler (:mod:`zero_jax._plan.topology`;
no TPU or GPU needed), and audits it (:func:`zero_jax.audit`). On TPU and GPU
each stage's peak is also read from the buffer assignment of the same compile
(the device memory it allocates; argument + output + temp − alias overestimates
it on TPU), and fit is judged on it. The formulas it is
checked against live in :mod:`zero_jax._theory.formulas`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from zero_jax._audit.audit import audit
from zero_jax._audit.report import AuditReport
from zero_jax._base.problems import raise_problems
from zero_jax._base.units import fmt_bytes, parse_bytes
from zero_jax._plan.topology import DeviceSlice, device_slice, topology_mesh
from zero_jax._policy.arguments import bucket_problems, bucket_size
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import Precision
from zero_jax._processes.child import importable_path, resolve, run_child
from zero_jax._step.optimizer import shard_optimizer
from zero_jax._step.state import init_state
from zero_jax._step.train import make_train_step
from zero_jax._theory.checks import check_devices, check_stage, quantization_at
from zero_jax._theory.wire import DEFAULT_BLOCK
from zero_jax.models.transformer import TransformerConfig, init_params, make_loss_fn

NO_COPY_WITHOUT_COMPUTE_DTYPE = (
    "plan: compute_copy=False drops the bf16 compute copy of mixed precision; pass compute_dtype='bfloat16' with it."
)
#: The default factory of :func:`plan`.
REFERENCE_STEP = "zero_jax._plan.plan:reference_step"
BATCH_NOT_SPLIT = "plan: the global batch of {batch} cannot be split over {n} devices{micro}; use a multiple of {m}."
BUCKETS_OF_BUILT_STEP = (
    "plan: bucket_bytes goes to the reference step or a factory; a built step already has its policy's bound. "
    "Build its policy with ZeroPolicy(..., bucket_bytes=...) instead."
)
STEP_SPANS_OTHER_SIZE = (
    "plan: the step's policy spans {n} devices, not num_devices={num_devices}. To plan for another "
    "size, pass a factory (or its 'module:function' path), which runs on a simulated mesh of that size."
)
SECONDARY_SIZE = (
    "plan: secondary={s} (hpZ's chips per node) must divide the {n} devices and lie between 2 and {n} - 1: "
    "the devices are laid out as N/S nodes x S chips."
)
TP_NOT_COMPILED = (
    "plan: compiling a factory with tensor_parallel={m} is not supported yet: the planning process builds a "
    "data-only mesh of num_devices devices, whose compiled figures would be those of M = 1, not M = {m}. For the "
    "formulas use zj.choose_stage(..., model_parallel={m}) or zj.model_state_bytes(..., model_parallel={m}); to "
    "compile, pass a step built on your (data, model) mesh: zj.plan(step, abstract_state, abstract_batch)."
)
STEP_HAS_OTHER_TP = (
    "plan: the step's policy has model_parallel = {m} (the product of its model axes' sizes; 1 on a data-only "
    "mesh), not tensor_parallel={tp}; leave tensor_parallel out to plan the step as built."
)
TOPOLOGY_DEVICES = (
    "plan: topology {topology} has {n} devices, but num_devices={num_devices}; leave num_devices out (N is the "
    "slice's device count) or name a slice of {num_devices} devices."
)
STEP_NOT_ON_TOPOLOGY = (
    "plan: the step's mesh spans {m} devices, but topology {topology} has {n}; build the step on "
    "zj.topology_mesh({name!r}) or pass the topology it was built for."
)
DOES_NOT_FIT = (
    "no planned stage fits {budget} per device{where}: the smallest, stage {stage}, needs {need} ({over} "
    "over). {advice}"
)
REFUSED_ALL = (
    "no planned stage fits {budget} per device{where}: the TPU compiler refused each ({refusals}). Plan a "
    "higher stage, offload_optimizer=True or a larger slice."
)
#: How libtpu refuses a program that does not fit HBM ("G" is GiB): the compile fails, with "RESOURCE_EXHAUSTED:
#: Ran out of memory ..." (libtpu 0.0.42.1) or "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out ..." (0.0.52).
OUT_OF_HBM = re.compile(r"RESOURCE_EXHAUSTED: (?:E\d+: \w+: )?(?P<what>Ran out of memory[^\n]*)")
_GIB_FIGURES = (  # the exception's wording, and the compiler log's
    re.compile(r"\((?P<need>[\d.]+)G\) exceeds available HBM \((?P<have>[\d.]+)G\)"),
    re.compile(r"Used (?P<need>[\d.]+)G of (?P<have>[\d.]+)G hbm"),
)
NOT_IMPORTABLE = (
    "plan: the factory {factory!r} cannot be imported by the planning process (it is defined in "
    "__main__ or locally). Define it at the top level of an importable module, or pass its path as "
    "'module:function'."
)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`plan` found: one :class:`~zero_jax.AuditReport` per stage
    compiled, and what planning cost.

    Attributes:
      reports: the audits (bytes from the abstract state's shardings,
        ``memory_analysis()``, collectives) of each stage's compiled step.
      num_devices: the simulated mesh size.
      device_bytes: the memory per device to fit (``None``: not checked).
      max_rss_bytes: the peak resident memory of the process that compiled
        (a child process, unless a step was passed in): far below the
        model's size, since nothing was allocated.
      seconds: wall time of planning.
      model_parallel: the tensor-parallel size M of the compiled step (1: a
        data-only mesh).
      topology: the TPU slice or GPU hosts compiled for (``None``: simulated
        CPU devices).
      hbm: stage -> the device memory the TPU or GPU buffer assignment gives
        the step (the dump's memory-usage report; empty on CPU, where it
        equals the peak).
      out_of_memory: stage -> the TPU compiler's refusal, for a stage whose
        step does not fit HBM at all (libtpu fails the compile: no report).
      bucket_bytes: the bound on any communication buffer the steps were
        compiled with (``ZeroPolicy(bucket_bytes=...)``; ``None``: unbounded).
      secondary: hpZ's chips per node the steps were compiled with (0: none);
        ``str(plan)`` then shows stage 3's bytes across and within the nodes.
    """

    reports: tuple[AuditReport, ...]
    num_devices: int
    device_bytes: float | None
    max_rss_bytes: int
    seconds: float
    model_parallel: int = 1
    topology: DeviceSlice | None = None
    hbm: dict[int, float] = dataclasses.field(default_factory=dict)
    out_of_memory: dict[int, str] = dataclasses.field(default_factory=dict)
    bucket_bytes: int | None = None
    secondary: int = 0

    def secondary_notes(self) -> list[str]:
        """hpZ: what stage 3 sends across the nodes and within each, per device per step."""
        if not self.secondary:
            return []
        out = []
        for r in self.reports:
            kinds = r.comm_per_axis_kind
            if r.stage != 3 or "node" not in kinds:
                continue
            across = " + ".join(f"{k} {fmt_bytes(b)}" for k, b in sorted(kinds["node"].items()))
            within = sum(kinds.get("chip", {}).values())
            out.append(f"stage 3, hpZ ({self.num_devices // self.secondary} nodes x {self.secondary} chips): across "
                       f"the nodes {across} per device per step (no backward re-gather crosses them), within "
                       f"{fmt_bytes(within)}")  # fmt: skip
        return out

    @property
    def largest_buffers(self) -> dict[int, int]:
        """stage -> the step's largest single communication buffer in bytes per
        device (the compiled program's, else the post-SPMD one's): with
        ``bucket_bytes``, what the bound leaves of the buffer memory that
        would otherwise grow with the model (a single tensor larger than the
        bound goes alone)."""
        out = {}
        for r in self.reports:
            b = r.buffers
            big = None if b is None else (b.largest("compiled") or b.largest())
            if big is not None:
                out[r.stage] = big.bytes
        return out

    def buffer_notes(self) -> list[str]:
        """With ``bucket_bytes``, one line: the bound and each stage's largest communication buffer."""
        if self.bucket_bytes is None or not self.largest_buffers:
            return []
        largest = ", ".join(f"stage {s} {fmt_bytes(b)}" for s, b in self.largest_buffers.items())
        return [f"communication buffers bounded by bucket_bytes = {fmt_bytes(self.bucket_bytes)}: the largest per "
                f"device, {largest}"]  # fmt: skip

    @property
    def peaks(self) -> dict[int, float]:
        """stage -> the compiled step's peak bytes per device (argument +
        output + temp − alias of ``memory_analysis()``)."""
        return {r.stage: r.memory["peak"] for r in self.reports}

    @property
    def needs(self) -> dict[int, float]:
        """stage -> the bytes per device fit is judged on: the TPU or GPU
        buffer assignment's total where measured (:attr:`hbm`), else the peak; for a stage the TPU
        compiler refused, what it said the program needs (infinite if unsaid)."""
        needs: dict[int, float] = {s: self.hbm.get(s, p) for s, p in self.peaks.items()}
        for s, said in self.out_of_memory.items():
            m = next((m for m in (r.search(said) for r in _GIB_FIGURES) if m), None)
            needs[s] = float(m["need"]) * 2**30 if m else math.inf
        return dict(sorted(needs.items()))

    @property
    def fits(self) -> dict[int, bool | None]:
        fits = {s: None if self.device_bytes is None else p <= self.device_bytes for s, p in self.needs.items()}
        return fits | dict.fromkeys(self.out_of_memory, False)

    @property
    def layer_working_sets(self) -> dict[int, int]:
        """stage -> the whole layers a layer-wise step may hold at once, in
        bytes per device: (prefetch + 1) x the largest block's gathered bytes,
        for the stages whose compiled step gathers blocks (``report.layers``;
        part of the compiled peak, and what grows with the block size, not
        the depth)."""
        return {
            r.stage: (r.layers.prefetch + 1) * r.layers.layer_bytes
            for r in self.reports
            if r.layers is not None and any(b.forward for b in r.layers.blocks)
        }

    @property
    def host_activations(self) -> dict[int, int]:
        """stage -> bytes per device the compiled step keeps in host memory
        while it runs (``memory_analysis()``'s host temp: the saved block
        inputs with ``offload_activations``, on TPU; XLA:CPU reports none).
        Each crosses the host link twice per step."""
        return {r.stage: int(r.memory["host_temp"]) for r in self.reports if r.memory.get("host_temp")}

    def layer_notes(self) -> list[str]:
        """One line per layer-wise stage: blocks, working set, layers alive in the compiled schedule."""
        out = []
        for r in self.reports:
            if r.stage not in self.layer_working_sets or r.layers is None:
                continue
            s, lay = r.layers, fmt_bytes(r.layers.layer_bytes)
            working = fmt_bytes(self.layer_working_sets[r.stage])
            out.append(
                f"stage {r.stage} layer-wise: {sum(b.layers for b in s.blocks)} layers of {lay}; whole-layer working "
                f"set (prefetch {s.prefetch} + 1) x {lay} = {working} of the peak; the compiled schedule holds at "
                f"most {s.max_alive}"
            )
        return out

    @property
    def recommended(self) -> int | None:
        """The lowest planned stage whose compiled peak fits ``device_bytes``."""
        return next((s for s, ok in sorted(self.fits.items()) if ok), None)

    def fit_note(self, stage: int) -> str:
        """``"yes"``, ``"no (X over)"`` or ``"-"`` (no budget) for one stage."""
        fit = self.fits[stage]
        if stage in self.out_of_memory:
            return "no (the TPU compiler: out of HBM)"
        if fit is None or self.device_bytes is None:
            return "-"
        return "yes" if fit else f"no ({fmt_bytes(self.needs[stage] - self.device_bytes)} over)"

    def verdict(self) -> str:
        """One line: the lowest stage that fits and its margin, or by how much
        the best one misses and what would fit (:meth:`check` raises it)."""
        if self.device_bytes is None:
            return "no device memory given: nothing judged"
        rec, budget = self.recommended, fmt_bytes(self.device_bytes)
        if rec is not None:
            need = fmt_bytes(self.needs[rec])
            return f"stage {rec} is the lowest planned stage that fits ({need} of {budget} per device)"
        compiled = {s: b for s, b in self.needs.items() if s not in self.out_of_memory}
        where = f" on {self.topology.topology}" if self.topology is not None else ""
        if not compiled:
            refusals = "; ".join(f"stage {s}: {said}" for s, said in self.out_of_memory.items())
            return REFUSED_ALL.format(budget=budget, where=where, refusals=refusals)
        best = min(compiled, key=compiled.__getitem__)
        need = compiled[best]
        return DOES_NOT_FIT.format(
            budget=budget, where=where, stage=best, need=fmt_bytes(need), over=fmt_bytes(need - self.device_bytes),
            advice=fit_advice(self, best),
        )  # fmt: skip

    def check(self) -> Plan:
        """Raise ``ValueError`` with :meth:`verdict` when no planned stage fits."""
        if self.device_bytes is not None and self.recommended is None:
            raise ValueError(f"plan: {self.verdict()}")
        return self

    def _budget_differs(self) -> bool:
        """Whether the budget is worth printing beside the slice (which names its own HBM)."""
        own = None if self.topology is None else self.topology.hbm_per_device
        return self.device_bytes is not None and self.device_bytes != own

    def __str__(self) -> str:
        hbm = bool(self.hbm)
        where = str(self.topology) if self.topology is not None else f"N = {self.num_devices}"
        lines = [
            f"zj.plan: {where}"
            + (f", M = {self.model_parallel} tensor-parallel" if self.model_parallel > 1 else "")
            + (f", {fmt_bytes(self.device_bytes, decimal=True)} per device" if self._budget_differs() else "")  # pyright: ignore[reportArgumentType] - a differing budget is set
            + f"; compiled in {self.seconds:.1f} s, peak RSS {fmt_bytes(self.max_rss_bytes)}",
            f"{'stage':>5} {'params':>11} {'grads':>11} {'optimizer':>11} {'temp':>11} {'peak':>11} "
            + (f"{'HBM':>11} " if hbm else "")
            + f"{'fits':>5} {'comm/step':>11} {'/theory':>7}",
        ]
        for r in self.reports:
            b = r.state_bytes
            lines.append(
                f"{r.stage:>5} {fmt_bytes(b['params']):>11} {fmt_bytes(b['grads']) if 'grads' in b else '-':>11} "
                f"{fmt_bytes(b['optimizer']):>11} {fmt_bytes(r.memory['temp']):>11} {fmt_bytes(r.memory['peak']):>11} "
                + (f"{fmt_bytes(self.hbm[r.stage]) if r.stage in self.hbm else '-':>11} " if hbm else "")
                + f"{self.fit_note(r.stage):>5} {fmt_bytes(r.comm.measured):>11} {r.comm.ratio:>7.3f}"
            )
        lines.extend(f"{s:>5} refused by the TPU compiler: {said}" for s, said in self.out_of_memory.items())
        lines.extend(self.layer_notes())
        lines.extend(self.buffer_notes())
        lines.extend(self.secondary_notes())
        lines.extend(
            f"stage {s}: {fmt_bytes(b)} per device in host memory while the step runs (offload_activations), "
            f"{fmt_bytes(2 * b)} over the host link per step"
            for s, b in self.host_activations.items()
        )
        if self.device_bytes is not None:
            rec = self.recommended
            lines.append(f"recommended: stage {rec}" if rec is not None else "recommended: none fits")
        return "\n".join(lines)


def fit_advice(p: Plan, stage: int) -> str:
    """What would make ``stage`` of a plan that does not fit fit: offloading
    its optimizer state, a higher stage, or (stage 3) more devices, estimated
    from its bytes (state held between steps is cut N ways at stage 3; the
    rest, temporaries and activations, is not)."""
    assert p.device_bytes is not None
    r = next(r for r in p.reports if r.stage == stage)
    need, budget, optimizer = p.needs[stage], p.device_bytes, r.state_bytes.get("optimizer", 0)
    held = sum(r.state_bytes.get(c, 0) for c in ("params", "optimizer", "other"))
    advice = []
    if need - optimizer <= budget:
        advice.append(
            f"ZeroPolicy({stage}, ..., offload_optimizer=True), which moves its {fmt_bytes(optimizer)} of optimizer "
            "state per device to host memory (an estimate: plan it to check)"
        )
    rest = need - held  # what does not shrink with N: temporaries, activations
    if stage < 3:
        advice.append(f"a higher stage than {stage}, which partitions more of the state (plan it)")
    elif rest < budget and held:
        n = math.ceil(p.num_devices * held / (budget - rest))
        advice.append(f"stage 3 on about {n} devices instead of {p.num_devices} (its state is cut N ways)")
    if advice:
        return "Try " + "; or ".join(advice) + "."
    return f"The step's {fmt_bytes(rest)} of temporaries alone exceed it: try a smaller batch per device or sequence."


def check_global_batch(batch: int, n: int, accum_steps: int) -> None:
    """The global batch must split over ``n`` devices x ``accum_steps`` microbatches."""
    if batch % (n * accum_steps):
        micro = f" x {accum_steps} microbatches" if accum_steps > 1 else ""
        raise ValueError(BATCH_NOT_SPLIT.format(batch=batch, n=n, micro=micro, m=n * accum_steps))


def reference_step(
    stage: int,
    mesh: Any,
    *,
    vocab: int = 256,
    dim: int = 128,
    depth: int = 4,
    heads: int = 4,
    seq: int = 64,
    mlp: int | None = None,
    batch_per_device: int = 1,
    global_batch: int | None = None,
    compute_dtype: str | None = None,
    compute_copy: bool = True,
    gather: str = "manual",
    min_shard_size: int | None = None,
    accum_steps: int = 1,
    learning_rate: float = 1e-3,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
    quant_block: int = DEFAULT_BLOCK,
    offload_activations: bool = False,
    bucket_bytes: int | str | None = None,
    secondary: int = 0,
    prefetch: int = 1,
    keep_gathered: int | str = 0,
) -> tuple[Any, Any, Any]:
    """The default :func:`plan` factory: the reference transformer
    (``zero_jax.models``) with AdamW, stacked layers run layer-wise
    (``gather="manual"``), on abstract inputs: ``(step, abstract_state,
    abstract_batch)``. ``compute_dtype="bfloat16"`` plans mixed precision;
    with ``compute_copy=False`` stage 3 keeps no bf16 copy between steps
    (``zj.Precision``'s; stages 0–2 keep theirs).
    ``quantize_weights`` / ``quantize_grads`` (ZeRO++, ``ZeroPolicy``'s
    arguments) apply where the stage has them: qwZ at stage 3, qgZ at stages
    1–3 (a plan of every stage compiles stages 0–2 without qwZ, 0 without qgZ).
    ``offload_activations`` (ZeRO-R's P_a+cpu) applies at stages 2–3, whose
    layer-wise schedule keeps the block inputs (see :attr:`Plan.host_activations`).
    ``bucket_bytes`` bounds every communication buffer (``ZeroPolicy``'s).
    ``secondary``: ZeRO++'s hpZ with S chips per node: the mesh's devices as
    (N/S nodes, S chips), partitioned over both, ``secondary_axis="chip"`` at
    stage 3 (stages 0–2 on the same two axes, without it: they gather no
    parameters in the step). ``prefetch`` and ``keep_gathered`` go to
    ``zj.scan_layers`` (a manual step)."""
    n = mesh.size
    hpz: dict[str, Any] = {}
    if secondary:
        if n % secondary or not 1 < secondary < n:
            raise ValueError(SECONDARY_SIZE.format(s=secondary, n=n))
        mesh = Mesh(mesh.devices.reshape(n // secondary, secondary), ("node", "chip"))
        hpz = {"axis": ("node", "chip")} | ({"secondary_axis": "chip"} if stage == 3 else {})
    batch = global_batch if global_batch is not None else batch_per_device * n * accum_steps
    check_global_batch(batch, n, accum_steps)
    cfg = TransformerConfig(vocab=vocab, dim=dim, depth=depth, heads=heads, seq=seq, mlp=mlp)
    extra: dict[str, Any] = {} if min_shard_size is None else {"min_shard_size": min_shard_size}
    if compute_dtype is not None:
        extra["precision"] = Precision(compute_dtype=jnp.dtype(compute_dtype), compute_copy=compute_copy or stage != 3)
    elif not compute_copy:
        raise ValueError(NO_COPY_WITHOUT_COMPUTE_DTYPE)
    extra |= quantization_at(stage, quantize_weights, quantize_grads)
    extra["offload_activations"] = bool(offload_activations) and stage >= 2 and gather == "manual"
    extra |= hpz | {"quant_block": quant_block, "bucket_bytes": bucket_bytes}
    policy = ZeroPolicy(stage, mesh, stacked="layers", **extra)
    tx = shard_optimizer(optax.adamw(learning_rate), policy)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    state = init_state(params, tx, policy)
    model_policy = policy if gather == "manual" else None
    loss_fn = make_loss_fn(cfg, model_policy, prefetch=prefetch, keep_gathered=keep_gathered)
    step = make_train_step(loss_fn, tx, policy, gather=gather, accum_steps=accum_steps)  # pyright: ignore[reportArgumentType] - gather is checked by make_train_step
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=policy.batch_sharding())
    return step, state, {"tokens": tokens}


def sized_config(base: TransformerConfig, num_params: float) -> TransformerConfig:
    """The reference transformer of about ``num_params`` parameters: ``base``'s
    vocabulary, sequence and heads; its width, halved while the embeddings
    and head alone would exceed half the budget; as many layers as fit."""
    dim = base.dim
    while dim % 2 == 0 and (dim // 2) % base.heads == 0 and dim // 2 >= 8 * base.heads:
        shell = TransformerConfig(vocab=base.vocab, dim=dim, depth=1, heads=base.heads, seq=base.seq)
        if shell.num_params() <= num_params / 2:
            break
        dim //= 2
    one = TransformerConfig(vocab=base.vocab, dim=dim, depth=1, heads=base.heads, seq=base.seq)
    two = TransformerConfig(vocab=base.vocab, dim=dim, depth=2, heads=base.heads, seq=base.seq)
    per_layer = two.num_params() - one.num_params()
    depth = max(1, round((num_params - (one.num_params() - per_layer)) / per_layer))
    return TransformerConfig(vocab=base.vocab, dim=dim, depth=depth, heads=base.heads, seq=base.seq)


def factory_path(factory: Any) -> str:
    """The import path of a :func:`plan` factory (``None``: the reference step)."""
    if factory is None:
        return REFERENCE_STEP
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(f"plan: a factory path is 'module:function', got {factory!r}.")
    if not isinstance(factory, str) and not callable(factory):
        raise TypeError(
            f"plan: the factory must be callable or a 'module:function' path, got {type(factory).__name__}."
        )
    try:
        path = importable_path(factory, "plan")
    except TypeError as e:
        raise ValueError(NOT_IMPORTABLE.format(factory=factory)) from e
    if path.startswith("__main__:"):
        raise ValueError(NOT_IMPORTABLE.format(factory=factory))
    return path


def max_rss() -> int:
    """This process's peak resident memory.

    On Linux, read the high-water mark of the current address space
    (``VmHWM``): ``ru_maxrss`` survives ``exec``, so in a freshly started
    child it still reports the parent's size at ``fork`` time.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def compile_stages(
    factory: str, kwargs: dict[str, Any], stages: Sequence[int], grads: bool, topology: str | None = None
) -> dict[str, Any]:
    """The planning child's job (JAX already sized to N CPU devices): audit
    ``factory``'s step for each stage on a mesh of those devices, or of the
    TPU slice's or GPU hosts' ``topology``; the reports, the buffer assignments'
    device-memory totals (TPU, GPU) and the peak RSS."""
    build = resolve(factory)
    mesh = jax.make_mesh((jax.device_count(),), ("data",)) if topology is None else topology_mesh(topology)
    reports, hbm, refused = [], {}, {}
    for stage in stages:
        step, state, batch = build(stage, mesh, **kwargs)
        report, hbm[stage], said = audit_stage(step, state, batch, grads)
        del step, state, batch
        if report is None:
            refused[stage] = said
        else:
            reports.append(report)
    hbm = {s: b for s, b in hbm.items() if b is not None}
    return {"reports": reports, "hbm": hbm, "out_of_memory": refused, "max_rss": max_rss()}


def audit_stage(step: Any, state: Any, batch: Any, grads: bool) -> tuple[AuditReport | None, float | None, str]:
    """:func:`zero_jax.audit` of one step and, for a step on TPU or GPU
    devices, the device memory its buffer assignment gives it, read from the
    dump of the same compile; or, when the TPU compiler refuses a step that cannot fit HBM,
    no report and its words."""
    try:
        report = audit(step, state, batch, grads=None if grads else False)
    except jax.errors.JaxRuntimeError as e:  # libtpu fails the compile of a program that cannot fit HBM
        said = OUT_OF_HBM.search(str(e))
        if said is None:
            raise
        return None, None, said["what"].rstrip(".")
    mesh = getattr(getattr(step, "policy", None), "mesh", None)
    assigned = mesh is not None and mesh.devices.flat[0].platform in ("tpu", "gpu")  # XLA:CPU's equals the peak
    return report, (report.memory.get("allocated") if assigned else None), ""


def plan(  # house: one public entry, its argument checks in order beside what they guard
    target: Any = None,
    abstract_state: Any = None,
    abstract_batch: Any = None,
    *,
    num_devices: int | None = None,
    device_bytes: float | str | None = None,
    stages: Sequence[int] = (0, 1, 2, 3),
    factory_kwargs: dict[str, Any] | None = None,
    grads: bool = True,
    timeout: float = 600.0,
    tensor_parallel: int | None = None,
    topology: str | None = None,
    bucket_bytes: int | str | None = None,
    secondary: int = 0,
) -> Plan:
    """Will the step fit on ``num_devices`` devices of ``device_bytes``?
    Compile it for a simulated mesh of that size and read the compiled program.

    Nothing is allocated: the step is lowered on ``jax.ShapeDtypeStruct``
    inputs and compiled, and each stage's compiled step is audited
    (:func:`zero_jax.audit`: state bytes from the shardings,
    ``memory_analysis()``, collectives). A laptop can check a 7B model's
    ZeRO-3 step on 64 devices before renting them.

    Args:
      target: what to compile; one of

        * ``None``: the reference transformer (:func:`reference_step`; size it
          with ``factory_kwargs``, e.g. ``dict(vocab=32000, dim=4096,
          depth=32, heads=32, seq=2048)``);
        * a factory ``factory(stage, mesh, **factory_kwargs) -> (step,
          abstract_state, abstract_batch)``, or its path ``"module:function"``:
          run for each of ``stages`` in a child process that has
          ``num_devices`` simulated CPU devices (this process already has its
          own); the factory must be importable there;
        * a built step (``zj.make_train_step``) with ``abstract_state`` and
          ``abstract_batch``: compiled here, on this process's devices.
      num_devices: the data-parallel size to plan for (with a step: its
        policy's, by default).
      device_bytes: memory per device (``"80GB"``) to check the compiled peak
        against; ``None`` reports without judging (with a ``topology``: the
        chip's HBM per device, :data:`zero_jax._plan.topology.HBM_GIB_PER_CHIP`,
        or the GPU's memory in XLA's spec of it).
      stages: the stages to compile (factories only).
      factory_kwargs: keyword arguments for the factory (picklable).
      grads: also compile the gradient function to measure gradient bytes.
      timeout: seconds the child process may take.
      tensor_parallel: the tensor-parallel size M (with a step: its
        policy's, by default). A factory compiles on a data-only mesh, so it
        takes only 1; for M > 1 see :func:`zero_jax.choose_stage`'s
        ``model_parallel``, or pass a step built on a (data, model) mesh.
      topology: a TPU slice (``"v5p:4x4x8"``, ``"v5p-128"``, ``"v5e:4x4"``)
        or GPU hosts (``"h100:2x8"``: HOSTS x GPUS per host), any of
        :func:`zero_jax.topology_mesh`'s names, to compile for with the TPU
        or GPU compiler, on this machine (libtpu: ``pip install -e
        ".[tpu]"``; the CUDA plugin: ``pip install -e ".[gpu]"``). A factory
        then runs on a 1-D mesh of the target's devices (N = its device
        count); a built step must be built on ``zj.topology_mesh(topology,
        ...)``. Fit is judged on the device memory of each stage's buffer
        assignment (``Plan.hbm``).
      secondary: ZeRO++'s hpZ: compile the reference step's stage 3 with
        this many chips per node as ``secondary_axis`` (the N devices as N/S
        nodes x S chips; factories only: passed as ``secondary=``).
      bucket_bytes: compile with ``ZeroPolicy(..., bucket_bytes=...)``, the
        bound on any communication buffer (an int or ``"4MiB"``; factories
        only: passed to the factory as ``bucket_bytes=``): the plan reports
        the bound and the largest buffer per stage
        (:attr:`Plan.largest_buffers`), and each audit judges the buffers by
        it.

    Example (compiles the 865k-parameter reference model's stage-3 step for 8
    simulated devices in a child process; any count, ``num_devices=64`` as well):

    >>> import zero_jax as zj
    >>> p = zj.plan(num_devices=8, device_bytes="80GB", stages=[3], grads=False)
    >>> p.recommended, p.reports[0].num_devices
    (3, 8)

    The same for a TPU slice or GPU hosts, compiled by the TPU or GPU
    compiler (see :func:`zero_jax.topology_mesh`): ``zj.plan(topology="v5p:4x4x8",
    stages=[3])``, ``zj.plan(topology="h100:2x8", stages=[3])``.
    """
    started = time.perf_counter()
    mem = None if device_bytes is None else parse_bytes(device_bytes, "plan: device_bytes")
    if mem is not None and mem <= 0:
        raise ValueError(f"plan: device_bytes must be positive, got {device_bytes!r}.")
    tpu = None if topology is None else device_slice(topology)  # no compiler, a bad name: fail here, not in a child
    if mem is None and tpu is not None:
        mem = tpu.hbm_per_device
    raise_problems(bucket_problems(bucket_bytes), "plan")
    bucket = bucket_size(bucket_bytes)
    if hasattr(target, "lower"):  # a built step: compile here
        if bucket is not None:
            raise TypeError(BUCKETS_OF_BUILT_STEP)
        m = _built_step_model_parallel(target, tensor_parallel)
        _check_step_on(target, tpu)
        report, hbm, said = _plan_built_step(target, abstract_state, abstract_batch, num_devices, grads)
        seconds = time.perf_counter() - started
        if report is None:
            policy = getattr(target, "policy", None)
            n, stage = getattr(policy, "num_shards", 0), getattr(policy, "stage", 0)
            return Plan((), n, mem, max_rss(), seconds, m, tpu, {}, {stage: said})
        hbms = {} if hbm is None else {report.stage: hbm}
        own = getattr(getattr(target, "policy", None), "bucket_bytes", None)
        return Plan((report,), report.num_devices, mem, max_rss(), seconds, m, tpu, hbms, bucket_bytes=own)
    if abstract_state is not None or abstract_batch is not None:
        raise TypeError("plan: abstract_state and abstract_batch go with a built step, not with a factory.")
    if tpu is not None:
        if num_devices is not None and num_devices != tpu.num_devices:
            raise ValueError(TOPOLOGY_DEVICES.format(topology=tpu.topology, n=tpu.num_devices, num_devices=num_devices))
        num_devices = tpu.num_devices
    if num_devices is None:
        raise TypeError("plan: pass num_devices=..., the data-parallel size to plan for (or a topology=).")
    n = check_devices(num_devices, "plan")
    m = 1 if tensor_parallel is None else check_devices(tensor_parallel, "plan", "tensor_parallel")
    if m > 1:
        raise ValueError(TP_NOT_COMPILED.format(m=m))
    stages = [check_stage(s, "plan") for s in stages]
    if not stages:
        raise ValueError("plan: stages is empty; pass some of 0, 1, 2, 3.")
    kwargs = dict(factory_kwargs or {}) | ({} if bucket is None else {"bucket_bytes": bucket})
    kwargs |= {"secondary": int(secondary)} if secondary else {}  # hpZ: the reference step's mesh, nodes x chips
    path = factory_path(target)
    if path == REFERENCE_STEP and kwargs.get("global_batch") is not None:  # fail fast, without a process
        check_global_batch(kwargs["global_batch"], n, kwargs.get("accum_steps", 1))
    where = f"{tpu.topology} ({n} {tpu.platform.upper()} devices)" if tpu is not None else f"N = {n} simulated devices"
    try:
        out = run_child(
            compile_stages, path, kwargs, stages, grads, None if tpu is None else tpu.topology,
            devices=1 if tpu is not None else n, timeout=timeout, where=f"plan ({where}, {path})",
        )  # fmt: skip
    except TimeoutError as e:
        raise TimeoutError(f"plan: compiling for {where} took longer than timeout={timeout} s.") from e
    seconds = time.perf_counter() - started
    return Plan(
        tuple(out["reports"]),
        n,
        mem,
        out["max_rss"],
        seconds,
        1,
        tpu,
        out["hbm"],
        out["out_of_memory"],
        bucket_bytes=bucket_size(kwargs.get("bucket_bytes")),
        secondary=int(kwargs.get("secondary", 0) or 0),
    )


def _check_step_on(step: Any, tpu: DeviceSlice | None) -> None:
    """A built step planned for a ``topology`` must span its devices."""
    if tpu is None:
        return
    mesh = getattr(getattr(step, "policy", None), "mesh", None)
    m = None if mesh is None else mesh.size
    if m is not None and m != tpu.num_devices:
        raise ValueError(STEP_NOT_ON_TOPOLOGY.format(m=m, topology=tpu.topology, n=tpu.num_devices, name=tpu.name))


def _built_step_model_parallel(step: Any, tensor_parallel: Any) -> int:
    """The built step's tensor-parallel size M (``policy.model_parallel``; 1 on a
    data-only mesh), checked against ``tensor_parallel`` when one is given."""
    m = int(getattr(getattr(step, "policy", None), "model_parallel", 1))
    if tensor_parallel is not None and check_devices(tensor_parallel, "plan", "tensor_parallel") != m:
        raise ValueError(STEP_HAS_OTHER_TP.format(m=m, tp=tensor_parallel))
    return m


def _plan_built_step(
    step: Any, abstract_state: Any, abstract_batch: Any, num_devices: Any, grads: bool
) -> tuple[AuditReport | None, float | None, str]:
    """:func:`plan` of a built step: compiled here, on its mesh's devices
    (:func:`audit_stage`'s report, HBM total on TPU, or the compiler's refusal)."""
    if abstract_state is None or abstract_batch is None:
        raise TypeError("plan: with a built step, pass abstract_state and abstract_batch too.")
    n = step.policy.num_shards if hasattr(step, "policy") else None
    if num_devices is not None and n is not None and check_devices(num_devices, "plan") != n:
        raise ValueError(STEP_SPANS_OTHER_SIZE.format(n=n, num_devices=num_devices))
    return audit_stage(step, abstract_state, abstract_batch, grads)
