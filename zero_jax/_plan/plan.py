"""``zj.plan``: will it fit? Compile the real step for a simulated mesh of the
target size and read the compiled program.

:func:`plan` lowers and compiles a step on abstract inputs
(``jax.ShapeDtypeStruct``; nothing is allocated) for a mesh of
``num_devices`` simulated CPU devices in a child process
(:func:`zero_jax._processes.child.run_child`), and audits it (:func:`zero_jax.audit`).
The formulas it is checked against live in :mod:`zero_jax._theory.formulas`.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zero_jax._audit.audit import audit
from zero_jax._audit.report import AuditReport
from zero_jax._base.units import fmt_bytes, parse_bytes
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import Precision
from zero_jax._processes.child import importable_path, resolve, run_child
from zero_jax._step.optimizer import shard_optimizer
from zero_jax._step.state import init_state
from zero_jax._step.train import make_train_step
from zero_jax._theory.checks import check_devices, check_stage, quantization_at
from zero_jax._theory.wire import DEFAULT_BLOCK
from zero_jax.models.transformer import TransformerConfig, init_params, make_loss_fn

#: The default factory of :func:`plan`.
REFERENCE_STEP = "zero_jax._plan.plan:reference_step"
BATCH_NOT_SPLIT = "plan: the global batch of {batch} cannot be split over {n} devices{micro}; use a multiple of {m}."
STEP_SPANS_OTHER_SIZE = (
    "plan: the step's policy spans {n} devices, not num_devices={num_devices}. To plan for another "
    "size, pass a factory (or its 'module:function' path), which runs on a simulated mesh of that size."
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
    """

    reports: tuple[AuditReport, ...]
    num_devices: int
    device_bytes: float | None
    max_rss_bytes: int
    seconds: float
    model_parallel: int = 1

    @property
    def peaks(self) -> dict[int, int]:
        """stage -> the compiled step's peak bytes per device."""
        return {r.stage: r.memory["peak"] for r in self.reports}

    @property
    def fits(self) -> dict[int, bool | None]:
        return {s: None if self.device_bytes is None else p <= self.device_bytes for s, p in self.peaks.items()}

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

    def __str__(self) -> str:
        lines = [
            f"zj.plan: N = {self.num_devices}"
            + (f", M = {self.model_parallel} tensor-parallel" if self.model_parallel > 1 else "")
            + (f", {fmt_bytes(self.device_bytes, decimal=True)} per device" if self.device_bytes is not None else "")
            + f"; compiled in {self.seconds:.1f} s, peak RSS {fmt_bytes(self.max_rss_bytes)}",
            f"{'stage':>5} {'params':>11} {'grads':>11} {'optimizer':>11} {'temp':>11} {'peak':>11} {'fits':>5} "
            f"{'comm/step':>11} {'/theory':>7}",
        ]
        for r in self.reports:
            b = r.state_bytes
            fit = self.fits[r.stage]
            lines.append(
                f"{r.stage:>5} {fmt_bytes(b['params']):>11} {fmt_bytes(b['grads']) if 'grads' in b else '-':>11} "
                f"{fmt_bytes(b['optimizer']):>11} {fmt_bytes(r.memory['temp']):>11} {fmt_bytes(r.memory['peak']):>11} "
                f"{'-' if fit is None else 'yes' if fit else 'no':>5} {fmt_bytes(r.comm.measured):>11} "
                f"{r.comm.ratio:>7.3f}"
            )
        lines.extend(self.layer_notes())
        if self.device_bytes is not None:
            rec = self.recommended
            lines.append(f"recommended: stage {rec}" if rec is not None else "recommended: none fits")
        return "\n".join(lines)


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
    gather: str = "manual",
    min_shard_size: int | None = None,
    accum_steps: int = 1,
    learning_rate: float = 1e-3,
    quantize_weights: str | None = None,
    quantize_grads: str | None = None,
    quant_block: int = DEFAULT_BLOCK,
) -> tuple[Any, Any, Any]:
    """The default :func:`plan` factory: the reference transformer
    (``zero_jax.models``) with AdamW, stacked layers run layer-wise
    (``gather="manual"``), on abstract inputs: ``(step, abstract_state,
    abstract_batch)``. ``compute_dtype="bfloat16"`` plans mixed precision.
    ``quantize_weights`` / ``quantize_grads`` (ZeRO++, ``ZeroPolicy``'s
    arguments) apply where the stage has them: qwZ at stage 3, qgZ at stages
    1–3 (a plan of every stage compiles stages 0–2 without qwZ, 0 without qgZ)."""
    n = mesh.size
    batch = global_batch if global_batch is not None else batch_per_device * n * accum_steps
    check_global_batch(batch, n, accum_steps)
    cfg = TransformerConfig(vocab=vocab, dim=dim, depth=depth, heads=heads, seq=seq, mlp=mlp)
    extra: dict[str, Any] = {} if min_shard_size is None else {"min_shard_size": min_shard_size}
    if compute_dtype is not None:
        extra["precision"] = Precision(compute_dtype=jnp.dtype(compute_dtype))
    extra |= quantization_at(stage, quantize_weights, quantize_grads)
    policy = ZeroPolicy(stage, mesh, stacked="layers", quant_block=quant_block, **extra)
    tx = shard_optimizer(optax.adamw(learning_rate), policy)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    state = init_state(params, tx, policy)
    model_policy = policy if gather == "manual" else None
    step = make_train_step(make_loss_fn(cfg, model_policy), tx, policy, gather=gather, accum_steps=accum_steps)
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


def compile_stages(factory: str, kwargs: dict[str, Any], stages: Sequence[int], grads: bool) -> dict[str, Any]:
    """The planning child's job (JAX already sized to N CPU devices): audit
    ``factory``'s step for each stage; the reports and the peak RSS."""
    build = resolve(factory)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    reports = []
    for stage in stages:
        step, state, batch = build(stage, mesh, **kwargs)
        reports.append(audit(step, state, batch, grads=None if grads else False))
        del step, state, batch
    return {"reports": reports, "max_rss": max_rss()}


def plan(
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
        against; ``None`` reports without judging.
      stages: the stages to compile (factories only).
      factory_kwargs: keyword arguments for the factory (picklable).
      grads: also compile the gradient function to measure gradient bytes.
      timeout: seconds the child process may take.
      tensor_parallel: the tensor-parallel size M (with a step: its
        policy's, by default). A factory compiles on a data-only mesh, so it
        takes only 1; for M > 1 see :func:`zero_jax.choose_stage`'s
        ``model_parallel``, or pass a step built on a (data, model) mesh.

    Example (compiles the 865k-parameter reference model's stage-3 step for 64
    simulated devices in a child process):

    >>> import zero_jax as zj
    >>> p = zj.plan(num_devices=64, device_bytes="80GB", stages=[3], grads=False)
    >>> p.recommended, p.reports[0].num_devices
    (3, 64)
    """
    started = time.perf_counter()
    mem = None if device_bytes is None else parse_bytes(device_bytes, "plan: device_bytes")
    if mem is not None and mem <= 0:
        raise ValueError(f"plan: device_bytes must be positive, got {device_bytes!r}.")
    if hasattr(target, "lower"):  # a built step: compile here
        m = _built_step_model_parallel(target, tensor_parallel)
        report = _plan_built_step(target, abstract_state, abstract_batch, num_devices, grads)
        return Plan((report,), report.num_devices, mem, max_rss(), time.perf_counter() - started, m)
    if abstract_state is not None or abstract_batch is not None:
        raise TypeError("plan: abstract_state and abstract_batch go with a built step, not with a factory.")
    if num_devices is None:
        raise TypeError("plan: pass num_devices=..., the data-parallel size to plan for.")
    n = check_devices(num_devices, "plan")
    m = 1 if tensor_parallel is None else check_devices(tensor_parallel, "plan", "tensor_parallel")
    if m > 1:
        raise ValueError(TP_NOT_COMPILED.format(m=m))
    stages = [check_stage(s, "plan") for s in stages]
    if not stages:
        raise ValueError("plan: stages is empty; pass some of 0, 1, 2, 3.")
    kwargs = dict(factory_kwargs or {})
    path = factory_path(target)
    if path == REFERENCE_STEP and kwargs.get("global_batch") is not None:  # fail fast, without a process
        check_global_batch(kwargs["global_batch"], n, kwargs.get("accum_steps", 1))
    try:
        out = run_child(
            compile_stages, path, kwargs, stages, grads, devices=n, timeout=timeout,
            where=f"plan (N = {n} simulated devices, {path})",
        )  # fmt: skip
    except TimeoutError as e:
        raise TimeoutError(f"plan: compiling for N = {n} took longer than timeout={timeout} s.") from e
    return Plan(tuple(out["reports"]), n, mem, out["max_rss"], time.perf_counter() - started)


def _built_step_model_parallel(step: Any, tensor_parallel: Any) -> int:
    """The built step's tensor-parallel size M (``policy.model_parallel``; 1 on a
    data-only mesh), checked against ``tensor_parallel`` when one is given."""
    m = int(getattr(getattr(step, "policy", None), "model_parallel", 1))
    if tensor_parallel is not None and check_devices(tensor_parallel, "plan", "tensor_parallel") != m:
        raise ValueError(STEP_HAS_OTHER_TP.format(m=m, tp=tensor_parallel))
    return m


def _plan_built_step(step: Any, abstract_state: Any, abstract_batch: Any, num_devices: Any, grads: bool) -> AuditReport:
    """:func:`plan` of a built step: compiled here, on this process's devices."""
    if abstract_state is None or abstract_batch is None:
        raise TypeError("plan: with a built step, pass abstract_state and abstract_batch too.")
    n = step.policy.num_shards if hasattr(step, "policy") else None
    if num_devices is not None and n is not None and check_devices(num_devices, "plan") != n:
        raise ValueError(STEP_SPANS_OTHER_SIZE.format(n=n, num_devices=num_devices))
    return audit(step, abstract_state, abstract_batch, grads=None if grads else False)
