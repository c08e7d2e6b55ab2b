"""Measured on hardware: wrapper overhead and MFU, offload, overlap and XLA flags on one accelerator.

Run (one command, about 7 minutes on one NVIDIA H200; results in ``benchmarks/results/gpu.txt`` and
``gpu.json``, rewritten after every section so a run cut short still leaves what it measured)::

    python benchmarks/gpu.py

(on a machine whose results must be copied out, e.g. ``timeout 540 python benchmarks/gpu.py; cp
benchmarks/results/gpu.txt benchmarks/results/gpu.json "$OUT"/``: the files hold every finished
section even when the run is cut short). ``XLA_PYTHON_CLIENT_MEM_FRACTION`` defaults to 0.90 here.

``--dry-run`` runs the same code paths at tiny sizes (on CPU with 8 simulated devices when no
accelerator is installed, or with ``JAX_PLATFORMS=cpu`` where a plugin such as libtpu is installed
but no chip is) and writes to a temporary directory or ``--out``; it never touches
``benchmarks/results/gpu.*`` and says that its times, MFU and memory ceilings mean nothing.

Sections (run in the order 1, 3, 4, 2 so the riskiest, the host-memory search, comes last; a time
guard (``--budget`` seconds) stops adding variants or search probes when the budget is near and
records each skipped item in the output):

1. **Wrapper overhead and MFU at N = 1**: the reference transformer (``zero_jax.models``) at a
   GPU-sized config, bf16 compute, fp32 master, Adam: plain ``jax.jit`` + optax (fp32 master cast
   to bf16 inside the loss) against zero_jax stages 0-3 (``gather="manual"``). Step time (median of
   the compiled executable, state donated), tokens/s, MFU and compiled peak (``memory_analysis()``:
   argument + output + temp - alias). Model FLOPs per step = 6 * Phi * tokens + 12 * L * T * D *
   tokens, Phi = the parameters that enter a matmul (L * (4 D^2 + 2 D F) + D * V: blocks and head,
   not the embedding lookups, norms or biases), the second term the attention scores and values
   (the model computes the full T x T, forward and backward); recomputation is not counted (MFU,
   not HFU). Peak: the chip's dense bf16 peak, an assumption stated in the output (H100/H200:
   989 TFLOP/s; ``--peak-tflops`` for others).
2. **Offload**: the largest depth of the reference model that trains one real step with no
   offload, with ``offload_optimizer=True``, and with ``offload_optimizer=True`` plus stage-3
   ``offload_params=True`` (all stage 3, N = 1). Each depth is judged by ``compile()`` +
   ``memory_analysis()`` against the device memory left (``jax.devices()[0].memory_stats()``:
   ``bytes_limit - bytes_in_use``, 3% margin) and the host memory (``/proc/meminfo``
   MemAvailable x ``--host-fraction``); the search predicts the boundary from a linear fit of the
   peak over depth and keeps a [fits, does not fit] bracket until it is one apart, then one real
   step (state made leaf by leaf in its memory kind) confirms it. The step-time cost of each mode
   is measured at a common small depth, with the device temp of the streamed update against the
   size of one chunk (a parameter's master + Adam moments).
3. **Overlap**: stage 3 with ``offload_params=True`` (on one device the all-gather is trivial; the
   host-to-device copy of each layer is real), ``prefetch=0`` against ``1``, for ``zj.scan_layers``
   and for the unscanned block-wise ``zj.apply_layers``: step time and, read off the compiled
   schedule (``compiled.as_text()``), whether each layer's gather (ops named ``zj_block<i>_gather``)
   is issued before the previous layer's compute (``zj_block<i-1>_compute``) ends, forward and
   backward, and how many async start/done pairs (copies, gathers) have a matmul scheduled between
   their start and done (for the scan, in the loop bodies).
4. **XLA flags**: the flags every program here is compiled with (latency-hiding scheduler,
   collective combine thresholds, passed as compiler options), each with its effect on the
   block-wise prefetch=1 step of section 3 when turned off, one line each.
"""

from __future__ import annotations

import os
import sys

DRY_RUN = "--dry-run" in sys.argv


def accelerator_installed() -> bool:
    """Whether a GPU/TPU plugin for jax is installed (checked before jax starts a backend)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    import importlib.metadata as metadata

    names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions()}
    return any(n.startswith(("jax-cuda", "jax-rocm", "libtpu", "jax-tpu")) for n in names)


SIMULATED = DRY_RUN and not accelerator_installed()
if not DRY_RUN:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

import _common as common  # noqa: E402, I001

common.setup(devices=8 if SIMULATED else None)  # the dry run's 8 simulated devices, before anything makes an array

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch, unstack_params  # noqa: E402
from zero_jax.models import model_flops as zero_jax_model_flops  # noqa: E402

BF16 = jnp.bfloat16
LR = 1e-4
#: The flags every program of the run is compiled with (compiler options), and section 4's variants.
FLAGS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_all_gather_combine_threshold_bytes": 134217728,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 67108864,
    "xla_gpu_all_reduce_combine_threshold_bytes": 134217728,
}
FLAG_VARIANTS = (
    ("latency-hiding scheduler off", {"xla_gpu_enable_latency_hiding_scheduler": False}),
    (
        "collective combining off (thresholds 0)",
        {
            "xla_gpu_all_gather_combine_threshold_bytes": 0,
            "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
            "xla_gpu_all_reduce_combine_threshold_bytes": 0,
        },
    ),
)
#: The dry run on XLA:CPU, whose figures mean nothing, compiles fast: the schedule seam's options for a program
#: compiled only to be read (LLVM optimisation off, and on jaxlib 0.10.2 XLA:CPU's older loop emitters: together
#: they cut the dry run's CPU time by more than half; the emitters move float32 rounding, which no dry-run figure
#: is about), each one the running jaxlib accepts. The HLO passes, the schedule section 3 reads and
#: memory_analysis remain.
SIMULATED_OPTIONS: dict[str, Any] = zj.measure.read_only_options(jax.devices("cpu")) if SIMULATED else {}
PEAK_BF16 = {"H200": 989e12, "H100": 989e12}  # dense bf16 FLOP/s per chip (vendor figures, an assumption)
#: What the est. columns are: the estimate beside the measured step calibrates it on the first lent GPU.
ESTIMATE_LABEL = "XLA:GPU's latency-hiding schedule's step time (zj.measure): " + measure.ESTIMATE_LEAVES_OUT
OOM = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size of a run: the real one, or the dry run's tiny one."""

    s1: TransformerConfig
    s1_batch: int
    s2_model: dict[str, int]
    s2_batch: int
    s2_depths: tuple[int, int]  # the common depth (timed for every mode) and the second probe
    s2_max_depth: int
    s3: TransformerConfig
    s3_batch: int
    steps: int
    warmup: int
    compile_guess_s: float
    step_guess_s: float  # making a state and timing its steps
    workers: int


GPU_SIZES = Sizes(
    s1=TransformerConfig(vocab=32768, dim=2048, depth=16, heads=16, seq=2048),
    s1_batch=8,
    s2_model={"vocab": 32768, "dim": 1024, "heads": 8, "seq": 1024},
    s2_batch=8,
    s2_depths=(8, 24),
    s2_max_depth=2048,
    s3=TransformerConfig(vocab=32768, dim=2048, depth=8, heads=16, seq=2048),
    s3_batch=8,
    steps=5,
    warmup=1,
    compile_guess_s=40.0,
    step_guess_s=15.0,
    workers=6,
)
DRY_SIZES = Sizes(
    s1=TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=16),
    s1_batch=8,
    s2_model={"vocab": 64, "dim": 32, "heads": 2, "seq": 16},
    s2_batch=8,
    s2_depths=(2, 3),
    s2_max_depth=4,
    s3=TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=16),
    s3_batch=8,
    steps=2,
    warmup=1,
    compile_guess_s=1.5,
    step_guess_s=0.5,
    workers=2,
)


# -- the clock and the record -------------------------------------------------------------------


class Run:
    """The time guard, the compiler options and everything measured so far."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes) -> None:
        self.args, self.sizes = args, sizes
        self.start = time.perf_counter()
        self.compile_s = sizes.compile_guess_s  # the longest compile seen (an estimate of the next)
        self.options = dict(FLAGS)
        if SIMULATED:  # XLA:CPU compiling fast (SIMULATED_OPTIONS)
            self.options.update(SIMULATED_OPTIONS)
        self.rejected: dict[str, str] = {}
        self.skipped: list[dict[str, str]] = []
        self.results: dict[str, Any] = {}
        self.section_s: dict[str, float] = {}
        self.errors: dict[str, str] = {}

    def timed(self, section: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one section; an error is recorded (the other sections still run) rather than raised."""
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except Exception as e:  # one chance on the GPU: keep what the other sections measure
            self.errors[section] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"section {section} failed: {self.errors[section]}", file=sys.stderr, flush=True)
            return None
        finally:
            self.section_s[section] = self.section_s.get(section, 0.0) + time.perf_counter() - t0
            print(f"section {section}: {self.section_s[section]:.1f} s", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def allows(self, section: str, what: str, seconds: float, share: float) -> bool:
        """Whether ``seconds`` more fit before this section's share of the budget is spent."""
        deadline = share * self.args.budget
        if self.elapsed() + seconds <= deadline:
            return True
        left = deadline - self.elapsed()
        self.skipped.append({"section": section, "what": what, "reason": f"needs ~{seconds:.0f} s, {left:.0f} s left"})
        return False

    def estimate(self, make: Callable[[], Any], flops: float | None = None, peak: float | None = None
                 ) -> dict[str, Any]:  # fmt: skip
        """The step time XLA:GPU's latency-hiding schedule estimates for this program (``zj.measure``'s
        estimate: compiled once more with the schedule dumped), to print beside the measured one: the first
        lent GPU calibrates the estimator. None, with the reason, where there is none."""
        if SIMULATED or jax.devices()[0].platform != "gpu":
            return {"estimate_s": None, "estimate_note": "not a GPU: no estimate"}
        done = measure.compile_with_dump(make(), dict(self.options), schedule=True)
        if done.schedule is None:
            return {"estimate_s": None, "estimate_note": "no async op: XLA:GPU's scheduler wrote no schedule"}
        kind = getattr(jax.devices()[0], "device_kind", "")
        est = measure.estimate_from_schedule(done.schedule, device_kind=kind, model_flops=flops, peak_flops=peak)
        return {"estimate_s": est.seconds, "estimate_complete": est.complete, "estimate_exposed_s": est.exposed_seconds,
                "estimate_mfu": est.mfu, "estimate_note": "" if est.complete else "lower bound: loop bodies untimed"}

    def compile(self, lowered: Any, extra: dict[str, Any] | None = None) -> tuple[Any, float]:
        """Compile with the run's options (an option this XLA refuses is dropped and recorded)."""
        while True:
            options = {**self.options, **(extra or {})}
            t0 = time.perf_counter()
            try:
                compiled = lowered.compile(compiler_options=options)
            except Exception as e:  # an XLA that does not know a flag: drop it, say so, retry
                m = re.search(r"No such compile option: '([\w]+)'", str(e))
                if not m or (m.group(1) not in self.options and m.group(1) not in (extra or {})):
                    raise
                self.rejected[m.group(1)] = str(e).splitlines()[0]
                self.options.pop(m.group(1), None)
                extra = {k: v for k, v in (extra or {}).items() if k != m.group(1)}
                continue
            seconds = time.perf_counter() - t0
            self.compile_s = max(self.compile_s * 0.5, seconds)
            return compiled, seconds

    def compile_many(
        self, items: dict[Any, Callable[[], Any]], extras: dict[Any, dict[str, Any]] | None = None
    ) -> dict:
        """Lower each (in this thread: tracing uses context variables) and compile them in a pool
        (``extras``: per item, options on top of the run's), each compile handed to the pool as soon as
        its item is lowered, so the compiles run while the next items are traced."""
        lowered: dict[Any, Any] = {}
        futures: dict[Any, concurrent.futures.Future] = {}
        workers = max(1, min(self.sizes.workers, len(items)))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for k, make in items.items():
                lowered[k] = make()
                futures[k] = pool.submit(self.compile, lowered[k], (extras or {}).get(k))
            concurrent.futures.wait(futures.values())
        out = {}
        for k, f in futures.items():  # a compile that failed in the pool is tried once more on its own
            out[k] = f.result() if f.exception() is None else self.compile(lowered[k], (extras or {}).get(k))
        return out


# -- models, states and steps ----------------------------------------------------------------------


HOST_GROUP_BYTES = 8 << 30  # host-resident leaves are made in groups of at most this many bytes
#: XLA:CPU in the dry run: the programs that make states compile fast too.
MAKER_OPTIONS = tuple(SIMULATED_OPTIONS.items()) if SIMULATED else ()


@functools.cache
def group_maker(specs: tuple[tuple[tuple[int, ...], Any, Any, bool], ...], options: tuple) -> Callable[[], Any]:
    """One program making leaves of (shape, dtype, sharding, fill): a small fixed pattern or zeros."""

    def make() -> tuple[jax.Array, ...]:
        out = []
        for i, (shape, dtype, _, fill) in enumerate(specs):
            if fill and jnp.issubdtype(dtype, jnp.floating):  # a cheap pattern in [-0.03, 0.03]: timing only
                ramp = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) if shape else jnp.int32(i)
                out.append((((ramp + i) % 7 - 3).astype(jnp.float32) * 0.01).astype(dtype))
            else:
                out.append(jnp.zeros(shape, dtype))
        return tuple(out)

    jitted = jax.jit(make, out_shardings=tuple(s for _, _, s, _ in specs))
    return jitted.lower().compile(compiler_options=dict(options))


def materialize(abstract: Any, fill: Any = True) -> Any:
    """Arrays for a tree of ``ShapeDtypeStruct``s with shardings (``fill``: a bool, or a tree of them
    matching ``abstract``: a small fixed pattern, else zeros), each in its memory kind: the
    device-resident leaves in one program, the host-resident ones in groups of at most 8 GiB (so no
    program holds the whole host state on the device at once)."""
    leaves, treedef = jax.tree.flatten(abstract)
    flags = [fill] * len(leaves) if isinstance(fill, bool) else jax.tree.leaves(fill)
    specs = [(tuple(a.shape), jnp.dtype(a.dtype), a.sharding, bool(f)) for a, f in zip(leaves, flags, strict=True)]
    groups: list[list[int]] = [[]]
    host: list[list[int]] = []
    size = HOST_GROUP_BYTES
    for i, (shape, dtype, sharding, _) in enumerate(specs):
        if getattr(sharding, "memory_kind", None) != "pinned_host":
            groups[0].append(i)
            continue
        nbytes = math.prod(shape) * dtype.itemsize
        if size + nbytes > HOST_GROUP_BYTES:
            host.append([])
            size = 0
        host[-1].append(i)
        size += nbytes
    out: list[Any] = [None] * len(leaves)
    for group in (g for g in groups + host if g):
        made = group_maker(tuple(specs[i] for i in group), MAKER_OPTIONS)()
        for i, x in zip(group, made, strict=True):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def materialize_state(abstract: zj.TrainState) -> zj.TrainState:
    """A state for ``abstract``: parameters and master copy a small pattern, optimizer state zeros."""
    flags = abstract.replace(
        step=False,
        params=jax.tree.map(lambda _: True, abstract.params),
        master=jax.tree.map(lambda _: True, abstract.master),
        opt_state=jax.tree.map(lambda _: False, abstract.opt_state),
    )
    return materialize(abstract, flags)


def abstract_batch(cfg: TransformerConfig, batch: int, sharding: Any) -> dict[str, jax.ShapeDtypeStruct]:
    return {"tokens": jax.ShapeDtypeStruct((batch, cfg.seq + 1), jnp.int32, sharding=sharding)}


def real_batch(cfg: TransformerConfig, batch: int, sharding: Any) -> dict[str, jax.Array]:
    return jax.device_put(synthetic_batch(cfg, batch, jax.random.key(1)), sharding)


@dataclasses.dataclass
class Variant:
    """One zero_jax step: its policy, step and abstract state."""

    policy: zj.ZeroPolicy
    step: zj.TrainStep
    abstract: zj.TrainState
    batch: dict[str, jax.ShapeDtypeStruct]

    def lower(self) -> Any:
        return self.step.jitted.lower(self.abstract, self.batch)


def zero_variant(
    cfg: TransformerConfig, batch: int, mesh: Any, stage: int, *, blockwise: bool = False, prefetch: int = 1, **offload
) -> Variant:
    policy = zj.ZeroPolicy(
        stage, mesh, stacked=() if blockwise else "layers", precision=zj.Precision(compute_dtype=BF16), **offload
    )
    tx = zj.shard_optimizer(optax.adam(LR), policy)
    # blockwise: the unscanned form, a Python list of blocks that make_loss_fn runs with zj.apply_layers
    make = (lambda key: unstack_params(init_params(cfg, key))) if blockwise else functools.partial(init_params, cfg)
    abstract = zj.init_state(jax.eval_shape(make, jax.random.key(0)), tx, policy)
    loss = make_loss_fn(cfg, policy, prefetch=prefetch)
    step = zj.make_train_step(loss, tx, policy, gather="manual")
    return Variant(policy, step, abstract, abstract_batch(cfg, batch, policy.batch_sharding()))


def plain_variant(cfg: TransformerConfig, batch: int, device: Any) -> tuple[Callable[[], Any], Any]:
    """Plain ``jax.jit`` + optax: fp32 master and Adam, the loss on its bf16 cast."""
    tx = optax.adam(LR)
    loss_fn = make_loss_fn(cfg)
    one = jax.sharding.make_single_device_sharding(device)

    def step(state: Any, batch: Any) -> Any:
        master, opt = state

        def loss(m: Any) -> jax.Array:
            return loss_fn(jax.tree.map(lambda x: x.astype(BF16), m), batch)

        value, grads = jax.value_and_grad(loss)(master)
        updates, opt = tx.update(grads, opt, master)
        return (optax.apply_updates(master, updates), opt), {"loss": value}

    def with_sharding(tree: Any) -> Any:
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), tree)

    master = with_sharding(jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0)))
    abstract = (master, with_sharding(jax.eval_shape(tx.init, master)))
    jitted = jax.jit(step, donate_argnums=0)
    return (lambda: jitted.lower(abstract, abstract_batch(cfg, batch, one))), abstract


def host_state_bytes(abstract: Any) -> int:
    return sum(
        math.prod(a.shape) * jnp.dtype(a.dtype).itemsize
        for a in jax.tree.leaves(abstract)
        if getattr(a.sharding, "memory_kind", None) == "pinned_host"
    )


def timed_steps(compiled: Any, state: Any, batch: Any, warmup: int, steps: int) -> tuple[Any, list[float], float]:
    """Run the compiled step (state donated); seconds of each timed step and the last loss."""
    metrics: Any = None
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    return state, times, float(metrics["loss"])


def free(*trees: Any) -> None:
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
    gc.collect()


def is_oom(e: BaseException) -> bool:
    return any(s in str(e) for s in OOM)


# -- section 1: wrapper overhead and MFU ----------------------------------------------------------


def model_flops(cfg: TransformerConfig, tokens: int) -> tuple[int, int]:
    """(``zero_jax.models.model_flops``, Phi) for the reference transformer."""
    d, f, depth = cfg.dim, cfg.mlp_dim, cfg.depth
    return zero_jax_model_flops(cfg, tokens), depth * (4 * d * d + 2 * d * f) + d * cfg.vocab


def section_overhead(run: Run) -> None:
    cfg, b, sz = run.sizes.s1, run.sizes.s1_batch, run.sizes
    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("data",), devices=[device])
    tokens = b * cfg.seq
    flops, phi = model_flops(cfg, tokens)
    peak = run.args.peak_tflops * 1e12 if run.args.peak_tflops else PEAK_BF16.get(device_model(device))
    plain_lower, plain_abstract = plain_variant(cfg, b, device)
    variants: dict[str, Any] = {"jax.jit + optax": (plain_lower, plain_abstract)}
    for stage in range(4):
        v = zero_variant(cfg, b, mesh, stage)
        variants[f"zero_jax stage {stage}"] = (v.lower, v.abstract)
    out = run.results["overhead"] = {
        "config": {**dataclasses.asdict(cfg), "batch": b, "tokens_per_step": tokens, "params": cfg.num_params()},
        "matmul_params_phi": phi,
        "model_flops_per_step": flops,
        "formula": "6*Phi*tokens + 12*L*T*D*tokens; Phi = L*(4*D^2 + 2*D*F) + D*V (recompute not counted)",
        "peak_flops": None if DRY_RUN else peak,
        "peak_assumption": f"{device_model(device)} dense bf16 {peak / 1e12:.0f} TFLOP/s" if peak else "unknown",
        "rows": [],
    }
    est = run.compile_s * math.ceil(len(variants) / sz.workers)
    if not run.allows("1", "all variants", est, 0.27):
        return
    compiled = run.compile_many({k: v[0] for k, v in variants.items()})
    batch = real_batch(cfg, b, jax.sharding.make_single_device_sharding(device))
    for name, (_, abstract) in variants.items():
        if not run.allows("1", f"{name} steps", sz.step_guess_s, 0.30):
            continue
        exe, compile_s = compiled.pop(name)
        state = materialize(abstract, True) if name == "jax.jit + optax" else materialize_state(abstract)
        state, times, loss = timed_steps(exe, state, batch, sz.warmup, sz.steps)
        free(state)
        step_s = statistics.median(times)
        mem = common.memory(exe)
        out["rows"].append(
            {
                "variant": name,
                "step_s": step_s,
                "step_s_all": times,
                "tokens_per_s": tokens / step_s,
                "mfu": None if (DRY_RUN or not peak) else flops / (step_s * peak),
                "peak_bytes": mem["peak"],
                "temp_bytes": mem["temp"],
                "compile_s": compile_s,
                "loss": loss,
            }
            | run.estimate(variants[name][0], flops, None if DRY_RUN else peak)
        )
    base = next((r["step_s"] for r in out["rows"] if r["variant"] == "jax.jit + optax"), None)
    for r in out["rows"]:
        r["vs_plain"] = r["step_s"] / base if base else None


def device_model(device: Any) -> str:
    kind = getattr(device, "device_kind", "") or ""
    return next((k for k in PEAK_BF16 if k in kind), kind)


# -- reading the compiled schedule ------------------------------------------------------------------

_CALLED = re.compile(
    r"(?:calls|to_apply|called_computations|branch_computations|async_execution_thread_calls)=(\{[^}]*\}|%?[\w.\-]+)"
)
_MATMUL_TARGET = re.compile(r"custom_call_target=\"[^\"]*(?:gemm|matmul|cublas|dot)[^\"]*\"", re.I)
_TRANSFER_STARTS = ("copy-start", "all-gather-start", "collective-permute-start", "async-start", "send", "recv")


def _called(ins: Any) -> list[str]:
    return [n for m in _CALLED.finditer(ins.attrs) for n in re.findall(r"%?([\w.\-]+)", m.group(1))]


def _unit_facts(comps: dict[str, list[Any]]) -> Callable[[Any], tuple[frozenset[str], bool]]:
    """For an instruction: the op names inside it (its own and its called computations') and
    whether it does a matmul."""

    @functools.cache
    def comp(name: str) -> tuple[frozenset[str], bool]:
        names, mm = set(), False
        for ins in comps.get(name, []):
            n, m = unit(ins)
            names |= n
            mm |= m
        return frozenset(names), mm

    def unit(ins: Any) -> tuple[frozenset[str], bool]:
        names = {ins.op_name} if ins.op_name else set()
        mm = ins.op in ("dot", "convolution") or bool(_MATMUL_TARGET.search(ins.attrs))
        for c in _called(ins):
            n, m = comp(c)
            names |= n
            mm |= m
        return frozenset(names), mm

    return unit


def async_pairs(instrs: list[Any], unit: Callable[[Any], tuple[frozenset[str], bool]]) -> dict[str, int]:
    """Async start/done pairs of one computation, how many have a matmul scheduled between, and
    how many of the copies come from host memory."""
    starts = {ins.name: t for t, ins in enumerate(instrs) if ins.op in _TRANSFER_STARTS}
    matmul = [unit(ins)[1] for ins in instrs]
    pairs = overlapped = host = 0
    for t, ins in enumerate(instrs):
        if not ins.op.endswith("-done") or not ins.operands or ins.operands[0] not in starts:
            continue
        s = starts[ins.operands[0]]
        pairs += 1
        overlapped += any(matmul[s + 1 : t])
        host += instrs[s].op == "copy-start" and "S(5)" in instrs[s].attrs
    return {"pairs": pairs, "overlapping_matmul": overlapped, "host_copies": host}


def block_order(instrs: list[Any], unit: Callable[..., Any], depth: int) -> dict[str, Any]:
    """Per block i >= 1: is the forward gather of block i issued before the last forward matmul of
    block i - 1 (and in the backward, the re-gather of block i - 1 before block i's last backward matmul)?"""
    first_gather: dict[tuple[str, int], int] = {}
    last_compute: dict[tuple[str, int], int] = {}
    for t, ins in enumerate(instrs):
        for name in unit(ins)[0]:
            back = "transpose(" in name
            for m in re.finditer(r"zj_block(\d+)_(gather|compute)", name):
                i, kind = int(m.group(1)), m.group(2)
                if kind == "gather":
                    first_gather.setdefault(("b" if back else "f", i), t)
                elif unit(ins)[1] and not re.search(r"zj_block\d+_(gather|reduce)", name[m.end() :]):
                    last_compute[("b" if back else "f", i)] = t  # the block's last matmul
    fwd = [first_gather.get(("f", i), 1 << 30) < last_compute.get(("f", i - 1), -1) for i in range(1, depth)]
    bwd = [first_gather.get(("b", i - 1), 1 << 30) < last_compute.get(("b", i), -1) for i in range(1, depth)]
    return {
        "forward": bool(fwd) and all(fwd),
        "backward": bool(bwd) and all(bwd),
        "forward_each": fwd,
        "backward_each": bwd,
        "named_gathers_found": len(first_gather),
    }


def schedule(hlo: str, depth: int, scanned: bool) -> dict[str, Any]:
    comps, entry, _ = measure.scheduled_computations(hlo)
    unit = _unit_facts(comps)
    bodies = {  # every loop body, wherever the loop sits (the entry, a call, a command buffer)
        n for c in comps.values() for ins in c if ins.op == "while" for n in re.findall(r"body=%?([\w.\-]+)", ins.attrs)
    }
    where = sorted(bodies) if scanned else [entry]
    stats = [async_pairs(comps[name], unit) for name in where if name in comps]
    total = {k: sum(s[k] for s in stats) for k in ("pairs", "overlapping_matmul", "host_copies")}
    collectives = sum(
        1
        for ins in (i for c in comps.values() for i in c)
        if re.match(r"(all-gather|reduce-scatter|all-reduce)", ins.op)
    )
    out = {
        "async_pairs": total["pairs"],
        "async_pairs_overlapping_matmul": total["overlapping_matmul"],
        "host_copies": total["host_copies"],
        "collectives": collectives,
    }
    if scanned:
        out["gather_issued_early"] = total["overlapping_matmul"] > 0
    else:
        order = block_order(comps[entry], unit, depth)
        out.update(
            order_forward=order["forward"],
            order_backward=order["backward"],
            named_gathers_found=order["named_gathers_found"],
        )
        out["gather_issued_early"] = order["forward"] and order["backward"]
    return out


# -- section 3 (overlap) and 4 (flags) ----------------------------------------------------------


def overlap_variants(run: Run) -> dict[tuple[str, int], Variant]:
    cfg, b = run.sizes.s3, run.sizes.s3_batch
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    return {
        (path, p): zero_variant(cfg, b, mesh, 3, blockwise=path == "blockwise", prefetch=p, offload_params=True)
        for path in ("scan", "blockwise")
        for p in (0, 1)
    }


def section_overlap(run: Run, variants: dict[tuple[str, int], Variant]) -> dict[str, Any]:
    cfg, b, sz = run.sizes.s3, run.sizes.s3_batch, run.sizes
    out = run.results["overlap"] = {
        "config": {
            **dataclasses.asdict(cfg),
            "batch": b,
            "devices": jax.device_count(),
            "stage": 3,
            "offload_params": True,
        },
        "rows": [],
    }
    est = run.compile_s * math.ceil(len(variants) / sz.workers)
    if not run.allows("3", "all variants", est, 0.47):
        return {}
    compiled = run.compile_many({f"{k[0]} {k[1]}": v.lower for k, v in variants.items()})
    states: dict[str, Any] = {}
    batch = real_batch(cfg, b, next(iter(variants.values())).policy.batch_sharding())
    for (path, p), v in variants.items():
        exe, compile_s = compiled[f"{path} {p}"]
        if not run.allows("3", f"{path} prefetch={p} steps", sz.step_guess_s, 0.50):
            continue
        state = states.pop(path, None) or materialize_state(v.abstract)  # prefetch changes the step, not the state
        state, times, _ = timed_steps(exe, state, batch, sz.warmup, sz.steps)
        states[path] = state
        row = {
            "path": path,
            "prefetch": p,
            "step_s": statistics.median(times),
            "step_s_all": times,
            "compile_s": compile_s,
            "peak_bytes": common.memory(exe)["peak"],
        }
        row.update(schedule(exe.as_text(), cfg.depth, scanned=path == "scan"))
        row.update(run.estimate(v.lower))
        out["rows"].append(row)
    return {"states": states, "batch": batch, "used": compiled.get("blockwise 1")}


def section_flags(run: Run, variants: dict[tuple[str, int], Variant], kept: dict[str, Any]) -> None:
    sz, cfg = run.sizes, run.sizes.s3
    out = run.results["flags"] = {"used": dict(run.options), "rejected": run.rejected, "rows": []}
    base = next(
        (r for r in run.results.get("overlap", {}).get("rows", []) if r["path"] == "blockwise" and r["prefetch"] == 1),
        None,
    )
    if base is None or "blockwise" not in kept.get("states", {}):
        run.skipped.append(
            {"section": "4", "what": "all flags", "reason": "section 3's block-wise prefetch=1 step did not run"}
        )
        return
    chosen = [(name, {k: v for k, v in change.items() if k in run.options}) for name, change in FLAG_VARIANTS]
    chosen = [(name, change) for name, change in chosen if change]
    est = run.compile_s * math.ceil(len(chosen) / sz.workers)
    if not chosen or not run.allows("4", "flag variants", est, 0.57):
        return
    v = variants[("blockwise", 1)]
    compiled = run.compile_many({name: v.lower for name, _ in chosen}, dict(chosen))
    state = kept["states"].pop("blockwise")
    for name, change in chosen:
        exe, _ = compiled[name]
        state, times, _ = timed_steps(exe, state, kept["batch"], sz.warmup, sz.steps)
        sched = schedule(exe.as_text(), cfg.depth, scanned=False)
        step_s = statistics.median(times)
        for flag, value in change.items():
            out["rows"].append(
                {
                    "flag": flag,
                    "used": run.options[flag],
                    "variant": value,
                    "variant_name": name,
                    "step_s_used": base["step_s"],
                    "step_s_variant": step_s,
                    "gather_issued_early_used": base["gather_issued_early"],
                    "gather_issued_early_variant": sched["gather_issued_early"],
                    "collectives_used": base["collectives"],
                    "collectives_variant": sched["collectives"],
                }
            )
    kept["states"]["blockwise"] = state


# -- section 2: the largest model per offload mode -------------------------------------------------

MODES = (
    ("no offload", {}),
    ("offload_optimizer", {"offload_optimizer": True}),
    ("offload_optimizer + offload_params", {"offload_optimizer": True, "offload_params": True}),
)


@dataclasses.dataclass
class Search:
    """One mode's bracket: probes by depth, the compiled step of the largest that fits."""

    mode: str
    offload: dict[str, Any]
    probes: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    keep: dict[int, Any] = dataclasses.field(default_factory=dict)

    def bracket(self, max_depth: int) -> tuple[int, int]:
        lo = max((d for d, p in self.probes.items() if p["fits"]), default=0)
        hi = min((d for d, p in self.probes.items() if not p["fits"]), default=max_depth + 1)
        return lo, hi

    def next_depth(self, cap: dict[str, int], max_depth: int) -> int | None:
        lo, hi = self.bracket(max_depth)
        if hi - lo <= 1:
            return None
        pts = sorted(self.probes.items())
        (d1, p1), (d2, p2) = (pts[0], pts[-1]) if len(pts) >= 2 else (pts[0], pts[0])
        guess = float(max_depth)
        for key, c in (("device_peak", cap["device"]), ("host_need", cap["host"])):
            slope = (p2[key] - p1[key]) / (d2 - d1) if d2 != d1 else 0.0
            if slope > 0:
                guess = min(guess, d1 + (c - p1[key]) / slope)
        return int(min(max(math.floor(guess), lo + 1), hi - 1))


def offload_variant(run: Run, offload: dict[str, Any], depth: int) -> Variant:
    cfg = TransformerConfig(depth=depth, **run.sizes.s2_model)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    return zero_variant(cfg, run.sizes.s2_batch, mesh, 3, **offload)


def probe_round(run: Run, searches: list[Search], depths: dict[int, list[int]], cap: dict[str, int] | None) -> None:
    items = {
        (i, d): functools.partial(lambda i, d: offload_variant(run, searches[i].offload, d), i, d)
        for i, ds in depths.items()
        for d in ds
    }
    made = {k: make() for k, make in items.items()}
    compiled = run.compile_many({k: v.lower for k, v in made.items()})
    for (i, d), (exe, seconds) in compiled.items():
        mem = common.memory(exe)
        # host memory: what memory_analysis reports for the host (GPU/TPU), else the state's host bytes (CPU)
        need = mem["host_peak"] if mem["host_peak"] > 0 else host_state_bytes(made[(i, d)].abstract)
        searches[i].probes[d] = {
            "depth": d,
            "device_peak": mem["peak"],
            "host_need": need,
            "compile_s": seconds,
            "temp": mem["temp"],
            "variant": made[(i, d)],
            "exe": exe,
        }
    if cap is not None:
        judge(searches, cap)


def judge(searches: list[Search], cap: dict[str, int]) -> None:
    for s in searches:
        for p in s.probes.values():
            p["fits"] = p["device_peak"] <= cap["device"] and p["host_need"] <= cap["host"]
            p["bound"] = None if p["fits"] else ("device" if p["device_peak"] > cap["device"] else "host")


def capacity(run: Run, searches: list[Search]) -> dict[str, Any]:
    """The device memory left and the host memory this search may fill (dry run: simulated)."""
    if SIMULATED:
        # Device: a ceiling 1.5 layers above the first probe of "no offload", so its search has a round of work.
        # Host: between the offload modes' host needs at the two first probes (when those leave a gap), so
        # their brackets close host-bound at once and their confirming steps reuse the first probe's program.
        (d1, p1), (d2, p2) = sorted(searches[0].probes.items())[:2]
        slope = (p2["device_peak"] - p1["device_peak"]) / (d2 - d1)
        first = max(s.probes[d1]["host_need"] for s in searches[1:])
        second = min(s.probes[d2]["host_need"] for s in searches[1:])
        host = (first + second) // 2 if first < second else 1 << 40
        return {
            "device": int(p1["device_peak"] + 1.5 * slope),
            "host": host,
            "source": "simulated (dry run): device = no-offload peak 1.5 layers above the first probe; host = "
            + ("between the offload modes' needs at the first two probes" if first < second else "1 TiB"),
        }
    stats = jax.devices()[0].memory_stats() or {}
    device = int((stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)) * 0.97)
    with open("/proc/meminfo") as f:
        info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f if ":" in ln}
    host = int(info.get("MemAvailable", 0) * run.args.host_fraction)
    return {
        "device": device,
        "host": host,
        "bytes_limit": stats.get("bytes_limit"),
        "source": "device: memory_stats bytes_limit - bytes_in_use, x0.97; "
        f"host: MemAvailable x {run.args.host_fraction}",
    }


def common_costs(run: Run, searches: list[Search], depth: int) -> list[dict[str, Any]]:
    """Each mode's step time at the common depth (the first probe's executable)."""
    rows = []
    cfg = TransformerConfig(depth=depth, **run.sizes.s2_model)
    for s in searches:
        p = s.probes.get(depth)
        if (
            p is None
            or not p["fits"]
            or not run.allows("2", f"{s.mode} at depth {depth}", run.sizes.step_guess_s, 0.80)
        ):
            continue
        batch = real_batch(cfg, run.sizes.s2_batch, p["variant"].policy.batch_sharding())
        state = materialize_state(p["variant"].abstract)
        state, times, _ = timed_steps(p["exe"], state, batch, run.sizes.warmup, run.sizes.steps)
        free(state)
        rows.append(
            {
                "mode": s.mode,
                "depth": depth,
                "step_s": statistics.median(times),
                "step_s_all": times,
                "device_peak": p["device_peak"],
                "temp": p["temp"],
            }
        )
    base = next((r["step_s"] for r in rows if r["mode"] == "no offload"), None)
    for r in rows:
        r["vs_no_offload"] = r["step_s"] / base if base else None
    return rows


def confirm(run: Run, s: Search, cap: dict[str, int]) -> dict[str, Any]:
    """One real step at the largest depth that fits (stepping down on an out-of-memory error)."""
    lo, hi = s.bracket(run.sizes.s2_max_depth)
    result = {"mode": s.mode, "max_depth": lo, "confirmed": False, "bound": None, "error": None}
    if hi in s.probes:
        result["bound"] = s.probes[hi]["bound"]
    elif lo == run.sizes.s2_max_depth:
        result["bound"] = "max depth searched"
    while lo > 0 and run.allows(
        "2",
        f"{s.mode}: one step at depth {lo}",
        (0 if lo in s.probes else run.compile_s) + 2 * run.sizes.step_guess_s,
        1.0,
    ):
        p = s.probes.get(lo)
        if p is None or "exe" not in p:  # a depth below the bracket, or one whose executable was dropped
            s.probes.pop(lo, None)
            probe_round(run, [s], {0: [lo]}, cap)
            p = s.probes[lo]
        cfg = TransformerConfig(depth=lo, **run.sizes.s2_model)
        state = None
        try:
            state = materialize_state(p["variant"].abstract)
            batch = real_batch(cfg, run.sizes.s2_batch, p["variant"].policy.batch_sharding())
            state, times, _ = timed_steps(p["exe"], state, batch, 0, 2 if run.elapsed() < 0.9 * run.args.budget else 1)
            result.update(
                max_depth=lo,
                confirmed=True,
                params=cfg.num_params(),
                step_s=times[-1],
                device_peak=p["device_peak"],
                host_need=p["host_need"],
            )
            return result
        except Exception as e:  # an out-of-memory at this depth: record it, try a smaller one
            if not is_oom(e):
                raise
            result["error"] = f"depth {lo}: {str(e).splitlines()[0][:200]}"
            lo = max(lo - max(1, lo // 16), 0)
        finally:
            free(state)
            gc.collect()
    result["max_depth"] = lo
    return result


def section_offload(run: Run) -> None:
    d0, d1 = run.sizes.s2_depths
    searches = [Search(mode, offload) for mode, offload in MODES]
    out = run.results["offload"] = {
        "config": {
            **run.sizes.s2_model,
            "batch": run.sizes.s2_batch,
            "stage": 3,
            "devices": 1,
            "depths_probed_first": [d0, d1],
        },
        "modes": [],
    }
    if not run.allows("2", "first probes", run.compile_s * math.ceil(6 / run.sizes.workers), 0.75):
        return
    probe_round(run, searches, {i: [d0, d1] for i in range(len(searches))}, None)
    cap = capacity(run, searches)
    judge(searches, cap)
    out["capacity"] = cap
    out["common"] = common_costs(run, searches, d0)
    streaming = searches[1].probes[d0]["variant"]
    out["chunk"] = {
        "largest_chunk_bytes": max(common.offload_chunks(streaming.abstract).values(), default=0),
        "temp_streaming": searches[1].probes[d0]["temp"],
        "temp_no_offload": searches[0].probes[d0]["temp"],
        "depth": d0,
    }
    for s in searches:  # drop what the search no longer needs: keep the executables of the bracket
        s.probes[d1].pop("exe") if d1 != s.bracket(run.sizes.s2_max_depth)[0] else None
    while True:
        todo = {i: [d] for i, s in enumerate(searches) if (d := s.next_depth(cap, run.sizes.s2_max_depth)) is not None}
        if not todo or not run.allows(
            "2", "search round", run.compile_s * math.ceil(len(todo) / run.sizes.workers), 0.85
        ):
            break
        probe_round(run, searches, todo, cap)
    for s in searches:
        result = confirm(run, s, cap)
        lo, hi = s.bracket(run.sizes.s2_max_depth)
        result["bracket"] = [lo, hi]
        result["searched_to_one"] = hi - lo <= 1
        result["probes"] = [
            {k: v for k, v in p.items() if k not in ("variant", "exe")} for _, p in sorted(s.probes.items())
        ]
        out["modes"].append(result)
        write(run, final=False)


# -- output ------------------------------------------------------------------------------------------


def meta(run: Run) -> dict[str, Any]:
    dev = jax.devices()[0]
    try:
        platform_version = dev.client.platform_version
    except Exception:  # a backend that does not say
        platform_version = "?"
    return {
        "command": common.command(),
        "dry_run": DRY_RUN,
        "simulated_devices": SIMULATED,
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "platform_version": platform_version,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "optax": optax.__version__,
        "zero_jax": f"{zj.__version__} from {common.library_source()}",
        "machine": common.machine(),
        "env_XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "env_XLA_PYTHON_CLIENT_MEM_FRACTION": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", ""),
        "compiler_options": dict(run.options),
        "rejected_flags": run.rejected,
        "date": common.utc_now(),
        "budget_s": run.args.budget,
        "wall_s": run.elapsed(),
        "section_s": dict(run.section_s),
    }


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:9.2f}"


def gib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**30:8.3f}"


def text_overhead(r: dict[str, Any]) -> list[str]:
    cfg = r["config"]
    lines = [
        f"1. Wrapper overhead and MFU at N = 1: transformer vocab {cfg['vocab']}, dim {cfg['dim']}, depth "
        f"{cfg['depth']}, heads {cfg['heads']}, seq {cfg['seq']}, batch {cfg['batch']} ({cfg['params']:,} params), "
        "bf16 compute, fp32 master, Adam",
        f"   model FLOPs/step = {r['formula']} = {r['model_flops_per_step']:.4g}; peak: {r['peak_assumption']}",
        f"   {'variant':<20} {'step ms':>9} {'vs plain':>8} {'tokens/s':>12} {'MFU':>6} "
        f"{'peak GiB':>8} {'temp GiB':>8} {'est. ms':>9} {'est. MFU':>8}",
    ]
    for row in r["rows"]:
        mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:5.1f}%"
        est_mfu = "-" if row.get("estimate_mfu") is None else f"{100 * row['estimate_mfu']:5.1f}%"
        lines.append(
            f"   {row['variant']:<20} {fmt_ms(row['step_s'])} {row['vs_plain'] or 0:8.3f} "
            f"{row['tokens_per_s']:12.0f} {mfu:>6} {gib(row['peak_bytes'])} {gib(row['temp_bytes'])} "
            f"{fmt_ms(row.get('estimate_s'))} {est_mfu:>8}" + (f"  ({row['estimate_note']})" if row.get(
                "estimate_note") else "")  # fmt: skip
        )
    lines.append(f"   est.: {ESTIMATE_LABEL}")
    return lines


def text_offload(r: dict[str, Any]) -> list[str]:
    cfg, cap = r["config"], r.get("capacity", {})
    lines = [
        f"2. Offload (stage 3, N = 1): transformer vocab {cfg['vocab']}, dim {cfg['dim']}, heads {cfg['heads']}, "
        f"seq {cfg['seq']}, batch {cfg['batch']}, depth searched",
        f"   capacity: device {gib(cap.get('device'))} GiB, host {gib(cap.get('host'))} GiB ({cap.get('source', '-')})",
    ]
    for m in r["modes"]:
        lines.append(
            f"   {m['mode']:<36} largest depth {m['max_depth']:5d} (bracket {m['bracket']}, bound: {m['bound']}), "
            f"one real step: {'yes' if m['confirmed'] else 'NO'}"
            + (f", {m['params']:,} params, step {fmt_ms(m['step_s'])} ms" if m["confirmed"] else "")
            + (f"; {m['error']}" if m.get("error") else "")
        )
    for c in r.get("common", []):
        lines.append(
            f"   at depth {c['depth']}: {c['mode']:<36} step {fmt_ms(c['step_s'])} ms "
            f"(x{c['vs_no_offload'] or 0:.3f} of no offload), device peak {gib(c['device_peak'])} GiB"
        )
    if "chunk" in r:
        ch = r["chunk"]
        lines.append(
            f"   streamed update at depth {ch['depth']}: device temp {gib(ch['temp_streaming'])} GiB "
            f"(no offload {gib(ch['temp_no_offload'])} GiB) vs one chunk {gib(ch['largest_chunk_bytes'])} GiB"
        )
    return lines


def text_overlap(r: dict[str, Any]) -> list[str]:
    cfg = r["config"]
    lines = [
        f"3. Overlap: stage 3, offload_params=True, {cfg['devices']} device(s), depth {cfg['depth']}, dim "
        f"{cfg['dim']}, seq {cfg['seq']}, batch {cfg['batch']}",
        f"   {'path':<10} {'prefetch':>8} {'step ms':>9} {'gather early':>12} {'async pairs':>11} "
        f"{'w/ matmul':>9} {'host copies':>11} {'est. ms':>9}",
    ]
    for row in r["rows"]:
        lines.append(
            f"   {row['path']:<10} {row['prefetch']:8d} {fmt_ms(row['step_s'])} {str(row['gather_issued_early']):>12} "
            f"{row['async_pairs']:11d} {row['async_pairs_overlapping_matmul']:9d} {row['host_copies']:11d} "
            f"{fmt_ms(row.get('estimate_s'))}" + (f"  ({row['estimate_note']})" if row.get("estimate_note") else "")
        )
    lines.append(f"   est.: {ESTIMATE_LABEL}")
    return lines


def text_flags(r: dict[str, Any]) -> list[str]:
    lines = ["4. XLA flags (compiler options of every program here; effect on the block-wise prefetch=1 step):"]
    measured = {row["flag"]: row for row in r["rows"]}
    for flag, value in r["used"].items():
        row = measured.get(flag)
        if row is None:
            lines.append(f"   {flag}={value}: not varied")
            continue
        lines.append(
            f"   {flag}={value} (vs {row['variant']}, '{row['variant_name']}'): step {fmt_ms(row['step_s_used'])} vs "
            f"{fmt_ms(row['step_s_variant'])} ms, gather issued early {row['gather_issued_early_used']} vs "
            f"{row['gather_issued_early_variant']}, collectives {row['collectives_used']} vs "
            f"{row['collectives_variant']}"
        )
    for flag, why in r.get("rejected", {}).items():
        lines.append(f"   {flag}: refused by this XLA ({why})")
    return lines


def write(run: Run, final: bool) -> None:
    data = {"meta": meta(run), "complete": final, **run.results, "skipped": run.skipped, "errors": run.errors}
    head = [f"{k}: {v}" for k, v in data["meta"].items()]
    if DRY_RUN:
        head.insert(
            0,
            "DRY RUN: tiny sizes"
            + (" on simulated CPU devices" if SIMULATED else "")
            + "; step times, tokens/s, MFU and memory ceilings are NOT meaningful.",
        )
    body: list[str] = []
    for key, fn in (
        ("overhead", text_overhead),
        ("offload", text_offload),
        ("overlap", text_overlap),
        ("flags", text_flags),
    ):
        if key in run.results:
            body += ["", *fn(run.results[key])]
    body += [
        "",
        "skipped (time guard): "
        + ("; ".join(f"[{s['section']}] {s['what']} ({s['reason']})" for s in run.skipped) or "nothing"),
    ]
    body += [f"ERROR in section {k}: {v}" for k, v in run.errors.items()]
    if not final:
        body.append("INCOMPLETE: the run has not finished (or was cut short).")
    common.write_results("gpu", "\n".join(head + body), data, run.args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny sizes (CPU when no accelerator); writes to --out or a temp dir"
    )
    parser.add_argument(
        "--out", default=None, help="output directory (default benchmarks/results; dry run: a temp dir)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds of work before the time guard stops adding (420; dry run 300)",
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak, if not an H100/H200"
    )
    parser.add_argument("--host-fraction", type=float, default=0.8, help="share of MemAvailable offload may fill")
    args = parser.parse_args()
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="zero_jax_gpu_dry_") if args.dry_run else common.RESULTS
    if args.dry_run and os.path.realpath(args.out) == os.path.realpath(common.RESULTS):
        parser.error(
            "a dry run never writes to benchmarks/results (its figures are not measurements); pass another --out"
        )
    if not args.dry_run and jax.default_backend() == "cpu":
        parser.error("no accelerator: the full run measures a GPU; use --dry-run here")
    if args.dry_run and not SIMULATED and jax.default_backend() == "cpu":
        # libtpu (the test extra's TPU compiler) or a CUDA plugin is installed but found no chip: the dry run
        # would read device memory that the CPU does not report and size its searches to nothing.
        parser.error(
            "an accelerator plugin is installed but jax runs on the CPU: for a dry run on the CPU, "
            "set JAX_PLATFORMS=cpu (JAX_PLATFORMS=cpu python benchmarks/gpu.py --dry-run)"
        )
    args.budget = args.budget or (300.0 if args.dry_run else 420.0)
    run = Run(args, DRY_SIZES if args.dry_run else GPU_SIZES)
    run.timed("1", section_overhead, run)
    write(run, final=False)
    variants = run.timed("3", overlap_variants, run) or {}
    kept = run.timed("3", section_overlap, run, variants) or {} if variants else {}
    write(run, final=False)
    run.timed("4", section_flags, run, variants, kept)
    free(kept.get("states"))
    kept.clear()
    gc.collect()
    write(run, final=False)
    run.timed("2", section_offload, run)
    write(run, final=True)
    print(open(os.path.join(args.out, "gpu.txt")).read())
    print(f"wrote {os.path.join(args.out, 'gpu.txt')} and gpu.json")


if __name__ == "__main__":
    main()
