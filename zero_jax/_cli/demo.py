"""``python -m zero_jax demo``: train the reference transformer with each ZeRO
stage, with a progress bar per stage (steps, loss), and print per stage the
final loss, the bytes each device holds next to the ZeRO formula, the compiled
peak and the step time; then draw the measured bytes beside the formula as
stacked bars in a PNG (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from zero_jax._audit.audit import measure_grads
from zero_jax._audit.memory import memory, resident_bytes
from zero_jax._base.units import fmt_bytes
from zero_jax._layerwise.schedule import read_only_options
from zero_jax._layout.leaf import is_layout
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import Precision
from zero_jax._processes.launch import launch
from zero_jax._processes.multihost import shard_batch
from zero_jax._step.optimizer import shard_optimizer
from zero_jax._step.state import init_state
from zero_jax._step.train import make_train_step
from zero_jax._theory.formulas import STAGE_NAMES
from zero_jax.models.transformer import TransformerConfig, init_params, make_loss_fn, synthetic_batch

NO_MATPLOTLIB = "matplotlib is not installed (pip install matplotlib): skipping the memory figure."
CANNOT_WRITE = "{flag}: cannot write the figure to {path!r}: {reason}."
ALREADY_STARTED = "--devices {n}: JAX already started with {count} devices in this process; run the command anew."
CATEGORIES = ("params", "grads", "opt")
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "opt": "#55A868"}
FOOTNOTE = (
    "bytes/dev: measured on the live arrays (largest device); formula: ZeRO's Φ/N for what the stage "
    "partitions\n(padding included; leaves under min_shard_size stay whole). Optimizer: master copy (with "
    "--bf16) + Adam's moments and int32 count.\n"
    "peak/dev: the compiled step's argument + output + temp - alias (memory_analysis)."
)


def simulate_cpu_devices(n: int) -> None:
    """Size the CPU backend to ``n`` devices. Must happen before JAX creates
    its first array; harmless on accelerator hosts (it only sizes the CPU
    backend, which is then not the default)."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend is up (a second command in one process): fine if it has n devices
        if jax.device_count() != n:
            raise ValueError(ALREADY_STARTED.format(n=n, count=jax.device_count())) from None


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``None`` when matplotlib is absent."""
    try:
        import matplotlib  # noqa: PLC0415 - optional: not a dependency of zero_jax
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional

    return plt


def save_figure(plt: Any, fig: Any, path: str, flag: str) -> None:
    """Write ``fig`` to ``path``; an unwritable path is one ``ValueError`` line."""
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ValueError(CANNOT_WRITE.format(flag=flag, path=path, reason=e.strerror or e)) from None
    finally:
        plt.close(fig)


@dataclasses.dataclass(frozen=True)
class StageRun:
    """One stage of the demo: the last loss, bytes per device measured and by
    the formula (``params``, ``grads``, ``opt``), compiled peak, median step."""

    stage: int
    loss: float
    measured: dict[str, int]
    formula: dict[str, int]
    peak: int
    step_ms: float


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every stage of the demo shares."""

    mesh: jax.sharding.Mesh
    hybrid: dict[str, Any]
    where: str
    cfg: TransformerConfig
    params: Any
    batches: list[Any]
    precision: Precision
    per_param: tuple[int, int, int]  # bytes per parameter: compute copy, gradient, master + Adam's moments


def setup(args: argparse.Namespace) -> Setup:
    """The mesh (HSDP across processes), the model and this process's batches."""
    devices = jax.devices()
    processes = jax.process_count()
    if processes > 1:  # one replica per process (host), partitions within it: the multi-host layout
        mesh = jax.sharding.Mesh(np.asarray(devices).reshape(processes, -1), ("replica", "data"))
        hybrid = {"replica_axis": "replica"}
        where = f"{processes} processes x {jax.local_device_count()} {devices[0].platform} devices, HSDP"
    else:
        mesh, hybrid = jax.make_mesh((len(devices),), ("data",)), {}
        where = f"N = {len(devices)} {devices[0].platform} devices"
    cfg = TransformerConfig(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq)
    batch_size = args.batch_per_device * len(devices)
    rows, pid = batch_size // processes, jax.process_index()  # each process loads only its own rows
    batches = [
        jax.tree.map(
            lambda x: np.asarray(x)[pid * rows : (pid + 1) * rows],
            synthetic_batch(cfg, batch_size, jax.random.key(100 + i)),
        )
        for i in range(args.steps)
    ]
    precision = Precision(compute_dtype=jnp.bfloat16) if args.bf16 else Precision()
    # Run once: compiled with the options of a program compiled only to be read (LLVM optimisation off on
    # XLA:CPU), which compile it in a fraction of the time and give the same parameters.
    init = jax.jit(init_params, static_argnums=0).lower(cfg, jax.random.key(0))
    params = init.compile(compiler_options=read_only_options(devices))(jax.random.key(0))
    per_param = (2, 2, 12) if args.bf16 else (4, 4, 8)
    return Setup(mesh, hybrid, where, cfg, params, batches, precision, per_param)


def _formula(policy: ZeroPolicy, params: Any, per_param: tuple[int, int, int]) -> dict[str, int]:
    """Bytes per device by ZeRO's rule on this model's layouts (padding included)."""
    layouts = jax.tree.leaves(policy.layouts(params), is_leaf=is_layout)
    whole = sum(math.prod(lay.shape) for lay in layouts)
    cut = sum(math.prod(lay.stored_shape) // (policy.num_shards if lay.partitioned else 1) for lay in layouts)
    flags = (policy.partitions_params, policy.partitions_grads, policy.partitions_opt_state)
    return {k: b * (cut if on else whole) for k, b, on in zip(CATEGORIES, per_param, flags, strict=True)}


def run_stage(s: Setup, stage: int, on_step: Callable[[int, float], None] = lambda i, loss: None) -> StageRun:
    """Train ``len(s.batches)`` steps with ``stage``; ``on_step(i, loss)`` after each."""
    policy = ZeroPolicy(stage, s.mesh, "data", **s.hybrid, stacked="layers", precision=s.precision)
    batches = [shard_batch(b, policy) for b in s.batches]
    tx = shard_optimizer(optax.adamw(3e-3, weight_decay=0.01), policy)
    state = init_state(s.params, tx, policy)
    # Layer-wise: the model gathers each layer just before use (zj.scan_layers).
    step = make_train_step(make_loss_fn(s.cfg, policy), tx, policy, gather="manual")
    peak = memory(step.lower(state, batches[0]).compile())["peak"]
    grads = measure_grads(step, state, batches[0], False, {})  # step.grads, compiled only to be measured
    measured = {
        "params": max(resident_bytes(state.params).values()),
        "grads": max(resident_bytes(grads).values()),
        "opt": max(resident_bytes((state.opt_state, state.master)).values()),
    }
    del grads
    times, loss = [], math.nan
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        loss = float(metrics["loss"])  # waits for the step
        times.append(time.perf_counter() - start)
        on_step(i + 1, loss)
    steady = sorted(times[1:]) or times
    step_ms = 1e3 * steady[len(steady) // 2]
    return StageRun(stage, loss, measured, _formula(policy, s.params, s.per_param), peak, step_ms)


def demo_process(options: dict[str, Any]) -> tuple[str, list[StageRun]]:
    """One process of ``demo --processes P`` (run by ``zj.launch``)."""
    args = argparse.Namespace(**options)
    s = setup(args)
    return s.where, [run_stage(s, stage) for stage in args.stages]


def _progress(out: Console) -> Progress:
    return Progress(
        TextColumn("stage {task.fields[stage]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps  loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        console=out,
    )


def run_demo_command(args: argparse.Namespace) -> int:
    """``python -m zero_jax demo``: the first line at once, a progress bar per
    stage, the table, and the figure's path; bad input is one line, exit 2."""
    try:
        return _demo(args)
    except ValueError as e:
        print(f"python -m zero_jax demo: error: {e}", file=sys.stderr)
        return 2


def _demo(args: argparse.Namespace) -> int:
    out = Console(highlight=False)
    cfg = TransformerConfig(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq)
    precision = "bf16 compute / fp32 master" if args.bf16 else "fp32"
    print(
        f"zero_jax demo: ZeRO stages {' '.join(map(str, args.stages))} on the reference transformer "
        f"({cfg.num_params():,} parameters, depth {cfg.depth}, width {cfg.dim}), AdamW, {precision}, "
        f"{args.steps} steps per stage",
        flush=True,
    )
    if args.processes > 1:
        if args.devices % args.processes:
            raise ValueError(f"demo: --devices {args.devices} must divide by --processes {args.processes}.")
        print(f"running {args.processes} processes x {args.devices // args.processes} devices...", flush=True)
        results = launch(
            demo_process, vars(args), processes=args.processes, local_devices=args.devices // args.processes
        )
        where, runs = results[0]
        footnote = "\nN is the partition (data) axis within each process; processes hold replicas."
    else:
        simulate_cpu_devices(args.devices)
        s = setup(args)
        where, footnote = s.where, ""
        print(f"{where}, global batch {args.batch_per_device * jax.device_count()}", flush=True)
        runs = []
        with _progress(out) as bars:
            for stage in args.stages:
                task = bars.add_task("", total=args.steps, stage=f"{stage} {STAGE_NAMES[stage]:<8}", loss="-")
                runs.append(
                    run_stage(s, stage, lambda i, loss, t=task: bars.update(t, completed=i, loss=f"{loss:.4f}"))
                )
    print("\n".join(table_lines(runs)) + "\n\n" + FOOTNOTE + footnote, flush=True)
    if not args.no_plot:
        plt = pyplot()
        if plt is None:
            print(NO_MATPLOTLIB)
        else:
            plot_runs(plt, runs, args.plot, f"{cfg.num_params():,} parameters, {where}")
            print(f"memory figure written to {os.path.abspath(args.plot)}")
    return 0


def table_lines(runs: list[StageRun]) -> list[str]:
    """The demo's table: loss, bytes per device measured / formula, peak, step time."""
    header = (
        f"{'stage':>5} {'loss':>8} {'params/dev':>11} {'formula':>11} {'grads/dev':>11} {'formula':>11} "
        f"{'opt/dev':>11} {'formula':>11} {'peak/dev':>11} {'step ms':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in runs:
        cells = " ".join(f"{fmt_bytes(r.measured[k]):>11} {fmt_bytes(r.formula[k]):>11}" for k in CATEGORIES)
        lines.append(f"{r.stage:>5} {r.loss:>8.4f} {cells} {fmt_bytes(r.peak):>11} {r.step_ms:>8.1f}")
    return lines


def plot_runs(plt: Any, runs: list[StageRun], path: str, title: str) -> None:
    """Per stage, two stacked bars: params / grads / optimizer bytes per device
    as measured, and by the formula (hatched)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = np.arange(len(runs))
    for offset, key, hatch in ((-0.2, "measured", None), (0.2, "formula", "//")):
        bottom = np.zeros(len(runs))
        for cat in CATEGORIES:
            values = np.array([getattr(r, key)[cat] for r in runs]) / 2**20
            label = f"{cat} ({key})"
            ax.bar(x + offset, values, 0.38, bottom=bottom, color=COLORS[cat], hatch=hatch, alpha=0.6 if hatch else 1,
                   edgecolor="white", label=label)  # fmt: skip
            bottom += values
    ax.set_xticks(x, [f"{r.stage}: {STAGE_NAMES[r.stage]}" for r in runs])
    ax.set_ylabel("MiB per device")
    ax.set_title(f"ZeRO model states per device, measured (left) and formula (right)\n{title}", fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    save_figure(plt, fig, path, "--plot")
