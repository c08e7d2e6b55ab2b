"""The command line: ``python -m zero_jax demo | plan | audit``.

``demo`` trains the reference transformer with each ZeRO stage (see
:mod:`zero_jax._cli.demo`); ``plan --params 7e9 --devices 8 --device-memory
80GB`` says which stage fits (per-stage model states, communication, a
recommendation; ``--plot`` draws the chart, ``--compile`` checks the reference
transformer's compiled step on simulated devices, ``--topology v5p:4x4x8
--compile`` with the TPU compiler for that slice, on this machine); ``audit``
audits the reference model's compiled step for each stage (``zj.audit``).

Without an accelerator the commands simulate CPU devices (set before JAX
starts a backend); on GPUs or TPUs they use the real devices unchanged.
Bad input is one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from rich.console import Console
from rich.table import Table

from zero_jax._audit.audit import audit
from zero_jax._base.units import fmt_bytes, parse_bandwidth, parse_count, parse_size_argument
from zero_jax._cli import demo as _demo
from zero_jax._plan.budget import choose_keep_gathered
from zero_jax._plan.plan import Plan, plan, sized_config
from zero_jax._plan.topology import DeviceSlice, device_slice, deviceless_environment
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._policy.precision import Precision
from zero_jax._step.optimizer import shard_optimizer
from zero_jax._step.state import init_state
from zero_jax._step.train import make_train_step
from zero_jax._theory.checks import quantization_at, wire_rates
from zero_jax._theory.choice import StageChoice, choose_stage
from zero_jax._theory.formulas import (
    STAGE_NAMES,
    comm_bytes,
    comm_bytes_per_axis,
    efficiency,
    model_state_bytes,
    required_bandwidth,
)
from zero_jax._theory.wire import DEFAULT_BLOCK, FORMATS
from zero_jax.models.transformer import TransformerConfig, init_params, make_loss_fn, synthetic_batch

DEFAULT_DEVICES = int(os.environ.get("ZERO_JAX_CPU_DEVICES", "8"))
COMPILED_AS_GIVEN = (
    "Compiling the reference transformer as given (--depth {depth}, --dim {dim}): Φ = {phi:,} parameters, not "
    "--params {params} as in the table above; leave out --depth to size the model to --params."
)
FP32_NOTE = "fp32: 4 + 4 + 8 bytes per parameter; --bf16 compiles 2 + 2 + 12"
COMPILED_SIZED = (
    "Compiling the reference transformer sized to --params {params}: dim {dim}, depth {depth}, vocab {vocab}, "
    "seq {seq} -> Φ = {phi:,} parameters ({ratio:.3f}x the requested Ψ)."
)
COMPILE_TP = (
    "--compile with --tensor-parallel {m} is not supported yet: the compiled check runs on a data-only mesh of "
    "--devices simulated devices, so it would report M = 1 figures, not those of the {n} x {m} (data, model) "
    "mesh the table describes. Leave out --compile for the formula table, or --tensor-parallel to compile the "
    "data-only step."
)
WIRE_CAPTION = (
    "; ZeRO++ wire: {what}, int8 + a float32 scale per {block} elements = {rate:.4g} bytes per element in those "
    "passes (stage 0 and the stage 1-2 gathers of updated parameters stay in --grad-bytes)"
)
COMPILED_WIRE = (
    "; compiled with ZeroPolicy(quantize_weights={quantize_weights!r}, quantize_grads={quantize_grads!r}, "
    "quant_block={quant_block}) where the stage has each (qwZ: stage 3; qgZ: stages 1-3)"
)
BUCKETS_LINE = (
    "Communication buffers: at most {bound} each per device (ZeroPolicy(..., bucket_bytes={bucket}); a single tensor "
    "larger goes alone); one buffer fused from every gradient would grow with the model to {fused} (Ψ x "
    "--grad-bytes{tp})."
)
QUANT_BLOCK_ALONE = (
    "--quant-block sets the block of the int8 wire formats, but none is asked for: add --quantize-weights int8 "
    "and/or --quantize-grads int8, or drop --quant-block."
)
HYBRID_WIRE = "; the ZeRO++ wire formats quantize within N only: ZeroPolicy reduces across R in --grad-bytes."
TOPOLOGY_DEVICES = (
    "--topology {topology} has {n} devices{per}, but --devices {devices} disagrees: leave out --devices (N is then "
    "the slice's) or pass --devices {want}."
)
NO_DEVICE_MEMORY = (
    "pass --device-memory (e.g. 80GB or 16GiB), or --topology NAME to judge against a TPU chip's HBM or a GPU's "
    "memory."
)
NO_HBM = "--topology {topology}: the HBM of a {kind} chip is not in zero_jax's table; pass --device-memory."
REPLICAS_SPLIT = (
    "--replicas {r} x --tensor-parallel {m} must divide the {n} devices of --topology {topology} (N = devices / "
    "(R x M)); pick sizes whose product divides {n}."
)
TOPOLOGY_REPLICAS = (
    "--compile --topology compiles a 1-D data mesh of the whole slice; leave out --replicas {r} (the hybrid table "
    "is formulas only), or build the (replica, data) step on zj.topology_mesh(...) and pass it to zj.plan."
)
TPU_CAPTION = (
    "; compiled by the {compiler} for {tpu}; HBM = the {kind} buffer assignment's total of device memory "
    "(the compile's memory-usage report): the peak above overestimates it on TPU, and fit is judged on HBM"
)
#: The compiler that compiles for each platform of a ``--topology``, as the messages name it.
COMPILERS = {"tpu": "TPU compiler (libtpu)", "gpu": "GPU compiler (the CUDA plugin)"}
TP_CAPTION = (
    "; tensor-parallel over M = {m}: every model-state term and ZeRO's data-axis communication / M (the model's own "
    "traffic over the model axis, its activation all-reduces, is not counted: zj.audit measures it)"
)


def _si(x: float) -> str:
    return fmt_bytes(x, decimal=True)


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {value}")
    return value


def console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 150, highlight=False)


def add_model_arguments(
    parser: Any,
    *,
    vocab: int = 256,
    dim: int = 128,
    depth: int | None = 4,
    heads: int = 4,
    seq: int = 64,
    batch_per_device: int = 4,
) -> None:
    """The reference model's command-line options (shared by demo, audit and plan)."""
    parser.add_argument("--vocab", type=positive_int, default=vocab)
    parser.add_argument("--dim", type=positive_int, default=dim)
    help_depth = "layers (default: sized to --params, else 20)" if depth is None else f"layers (default {depth})"
    parser.add_argument("--depth", type=positive_int, default=depth, help=help_depth)
    parser.add_argument("--heads", type=positive_int, default=heads, help="attention heads; must divide --dim")
    parser.add_argument("--seq", type=positive_int, default=seq)
    parser.add_argument("--batch-per-device", type=positive_int, default=batch_per_device)
    parser.add_argument("--bf16", action="store_true", help="bf16 compute copy and gradients, fp32 master copy")


def _config(args: argparse.Namespace, depth: int | None = None) -> TransformerConfig:
    """The reference transformer of the model arguments (``ValueError`` on bad sizes)."""
    return TransformerConfig(vocab=args.vocab, dim=args.dim, depth=depth or args.depth, heads=args.heads, seq=args.seq)


# -- plan ---------------------------------------------------------------------------------------------------------


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's options."""
    p.add_argument("--params", help="number of parameters, e.g. 7e9 or 7B (default: the --compile model's)")
    p.add_argument(
        "--topology",
        help="a TPU slice, e.g. v5p:4x4x8, v5p-128, v5e:4x4, v6e:16x16, or GPU hosts, HOSTSxGPUS per host: h100:2x8, "
        "h200:1x8, b200:1x8, a100:4x8 (N and --device-memory are then theirs; --compile uses the TPU or GPU "
        "compiler, here, without the hardware: needs libtpu or the CUDA plugin)",
    )
    p.add_argument(
        "--devices", type=positive_int, default=None, help="data-parallel devices N (default 8, or the --topology's)"
    )
    p.add_argument(
        "--replicas", type=positive_int, default=1,
        help="hybrid mesh: R replicas of N-device partitions (HSDP, R*N devices); adds per-axis figures",
    )  # fmt: skip
    p.add_argument(
        "--tensor-parallel", type=positive_int, default=1,
        help="tensor-parallel size M (model axes beside the data axis, N*M devices): model states and ZeRO's "
        "data-axis communication per device / M (default 1)",
    )  # fmt: skip
    p.add_argument("--device-memory", help="memory per device, e.g. 80GB or 16GiB (default with --topology: its HBM)")
    p.add_argument("--activations", default="0", help="activation memory per device, e.g. 10GB (default 0)")
    p.add_argument(
        "--bucket-bytes",
        help="bound every communication buffer, e.g. 4MiB (ZeroPolicy's bucket_bytes): the buffer memory it implies; "
        "with --compile, the compiled steps' largest buffers",
    )  # fmt: skip
    p.add_argument(
        "--secondary-axis", type=positive_int, metavar="S", default=0,
        help="ZeRO++'s hpZ at stage 3 (ZeroPolicy's secondary_axis): S chips per node of the N devices; prints the "
        "memory it adds and the bytes across and within the nodes (with --compile, compiled so)",
    )  # fmt: skip
    p.add_argument("--bandwidth", help="bandwidth per device, e.g. 300GB/s or 200Gb/s (with --compute-time)")
    p.add_argument("--compute-time", help="compute time per step, e.g. 10s or 250ms (with --bandwidth)")
    p.add_argument("--target-efficiency", type=float, default=0.9, help="efficiency to size bandwidth for (0.9)")
    p.add_argument("--param-bytes", type=float, default=2, help="bytes per parameter (2: bf16 compute copy)")
    p.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element (2)")
    p.add_argument("--optimizer-bytes", type=float, default=12, help="optimizer bytes per parameter, K (12: Adam)")
    p.add_argument("--plot", help="write the stacked-bar chart of model states per stage to this file (matplotlib)")
    w = p.add_argument_group("ZeRO++ wire formats (ZeroPolicy's quantize_weights, quantize_grads, quant_block)")
    w.add_argument("--quantize-weights", choices=FORMATS, help="qwZ: stage 3's weight all-gathers in int8 blocks")
    w.add_argument("--quantize-grads", choices=FORMATS, help="qgZ: the gradient reduction of stages 1-3 in int8 blocks")
    w.add_argument("--quant-block", type=positive_int, help="elements per float32 scale (256), with a --quantize-*")
    c = p.add_argument_group("compile: check the reference transformer's compiled step (simulated devices)")
    c.add_argument("--compile", action="store_true", help="also compile each stage's step for N simulated devices")
    add_model_arguments(c, vocab=32000, dim=2048, depth=None, heads=16, seq=512, batch_per_device=1)
    c.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    c.add_argument("--timeout", type=float, default=600.0, help="seconds the compiling process may take (600)")
    c.add_argument(
        "--keep-gathered", action="store_true",
        help="with --compile: also choose the stage-3 keep_gathered and prefetch that fit --device-memory, compiled "
        "(zj.choose_keep_gathered)",
    )  # fmt: skip


KEEP_GATHERED_NEEDS_COMPILE = (
    "--keep-gathered compiles the reference transformer's stage-3 step on simulated CPU devices: add --compile "
    "(and leave --topology out)."
)


def run_plan_command(args: argparse.Namespace) -> int:
    """``python -m zero_jax plan``: the formula table, the recommendation,
    communication and efficiency; optionally the chart and the compiled check."""
    try:
        return _plan_command(args)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as e:  # ImportError: no libtpu / CUDA plugin
        print(f"python -m zero_jax plan: error: {e}", file=sys.stderr)
        return 2


def plan_target(args: argparse.Namespace) -> tuple[int, float, DeviceSlice | None]:
    """N, the memory per device and the TPU slice or GPU hosts (``None`` without
    ``--topology``) that ``plan`` plans for, with ``--topology``,
    ``--devices``, ``--replicas`` and ``--device-memory`` checked against each other."""
    tpu = None if args.topology is None else device_slice(args.topology)
    if tpu is None:
        if args.device_memory is None:
            raise ValueError(NO_DEVICE_MEMORY)
        return args.devices or 8, parse_size_argument(args.device_memory, "--device-memory"), None
    r, m = args.replicas, args.tensor_parallel
    if tpu.num_devices % (r * m):
        raise ValueError(REPLICAS_SPLIT.format(r=r, m=m, n=tpu.num_devices, topology=tpu.topology))
    n = tpu.num_devices // (r * m)
    if args.devices is not None and args.devices != n:
        per = f" (R = {r} x N = {n} x M = {m})" if r * m > 1 else ""
        raise ValueError(
            TOPOLOGY_DEVICES.format(topology=tpu.topology, n=tpu.num_devices, per=per, devices=args.devices, want=n)
        )
    if args.compile and r > 1:
        raise ValueError(TOPOLOGY_REPLICAS.format(r=r))
    if args.device_memory is not None:
        return n, parse_size_argument(args.device_memory, "--device-memory"), tpu
    if tpu.hbm_per_device is None:
        raise ValueError(NO_HBM.format(topology=tpu.topology, kind=tpu.device_kind))
    return n, float(tpu.hbm_per_device), tpu


def _compile_model(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """The model ``--compile`` compiles, and a sentence saying plainly which:
    sized to ``--params`` unless ``--depth`` was given."""
    note = ""
    if args.params is None:
        cfg = _config(args, depth=args.depth or 20)
    elif args.depth is None:
        cfg = sized_config(_config(args, depth=1), parse_count(args.params, "--params"))
        ratio = cfg.num_params() / parse_count(args.params, "--params")
        sizes = dict(dim=cfg.dim, depth=cfg.depth, vocab=cfg.vocab, seq=cfg.seq, phi=cfg.num_params())
        note = COMPILED_SIZED.format(params=args.params, ratio=ratio, **sizes)
    else:
        cfg = _config(args)
        note = COMPILED_AS_GIVEN.format(depth=cfg.depth, dim=cfg.dim, phi=cfg.num_params(), params=args.params)
    model = dict(vocab=cfg.vocab, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads, seq=cfg.seq)
    model.update(batch_per_device=args.batch_per_device, compute_dtype="bfloat16" if args.bf16 else None)  # pyright: ignore[reportArgumentType] - the model dict mixes ints and dtype names
    if args.quantize_weights or args.quantize_grads:  # reference_step applies each where the stage has it
        wire = dict(quantize_weights=args.quantize_weights, quantize_grads=args.quantize_grads)
        model.update(wire, quant_block=args.quant_block)
    return model, note


def _wire(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    """The ``--quantize-*`` flags that apply at ``stage``, as :func:`comm_bytes`' keywords."""
    return quantization_at(stage, args.quantize_weights, args.quantize_grads) | {"quant_block": args.quant_block}


def _plan_command(args: argparse.Namespace) -> int:
    out = console()
    if args.params is None:
        if not args.compile:
            raise ValueError("pass --params (e.g. --params 7e9), or --compile to plan the reference transformer.")
        num_params: float = _config(args, depth=args.depth or 20).num_params()
    else:
        num_params = parse_count(args.params, "--params")
    if args.quant_block is not None and not (args.quantize_weights or args.quantize_grads):
        raise ValueError(QUANT_BLOCK_ALONE)
    args.quant_block = DEFAULT_BLOCK if args.quant_block is None else args.quant_block
    if (args.bandwidth is None) != (args.compute_time is None):
        raise ValueError("--bandwidth and --compute-time go together (efficiency = t_compute / (t_compute + t_comm)).")
    bandwidth = None if args.bandwidth is None else parse_bandwidth(args.bandwidth, "--bandwidth")
    per = dict(param_bytes=args.param_bytes, grad_bytes=args.grad_bytes, optimizer_bytes=args.optimizer_bytes)
    devices, memory, tpu = plan_target(args)
    activations = parse_size_argument(args.activations, "--activations")
    m = args.tensor_parallel
    if args.compile and m > 1:
        raise ValueError(COMPILE_TP.format(m=m, n=devices))
    choice = choose_stage(num_params, devices, memory, activations, model_parallel=m, **per)
    bucket = None if args.bucket_bytes is None else int(parse_size_argument(args.bucket_bytes, "--bucket-bytes"))
    if bucket is not None and bucket < 1:
        raise ValueError(f"--bucket-bytes must be at least 1 byte, e.g. 4MiB; got {args.bucket_bytes!r}.")
    if args.keep_gathered and (not args.compile or tpu is not None):
        raise ValueError(KEEP_GATHERED_NEEDS_COMPILE)
    model, note = _compile_model(args) if args.compile else (None, "")  # bad model sizes fail before printing
    if model is not None and bucket is not None:
        model["bucket_bytes"] = bucket
    if tpu is not None:
        out.print(f"{'TPU slice' if tpu.platform == 'tpu' else 'GPU hosts'} {tpu}")
    out.print(_formula_table(choice, args, bandwidth))
    head = f"stage {choice.stage}" if choice.stage is not None else "no stage fits"
    out.print(f"[bold]Recommendation: {head}.[/bold] {choice.reason}")
    n = choice.num_devices
    if bandwidth is not None and n > 1:
        s = choice.stage if choice.stage is not None else 3
        target, dtype_bytes = args.target_efficiency, args.grad_bytes
        need = required_bandwidth(
            num_params, n, s, compute_time=args.compute_time, target=target, dtype_bytes=dtype_bytes, model_parallel=m,
            **_wire(args, s),
        )  # fmt: skip
        out.print(f"Bandwidth for {args.target_efficiency:.0%} efficiency at stage {s}: {_si(need)}/s per device.")
    if bucket is not None:
        fused = fmt_bytes(num_params * args.grad_bytes / m)
        out.print(BUCKETS_LINE.format(bound=fmt_bytes(bucket), bucket=bucket, fused=fused, tp=" / M" if m > 1 else ""))
    if args.replicas > 1:
        out.print(_hybrid_table(num_params, n, args, per, m))
    if args.secondary_axis:
        out.print(_secondary_line(num_params, n, args, per, m))
        if model is not None:
            model["secondary"] = args.secondary_axis
    if args.plot:
        plot_choice(choice, args.plot)
        out.print(f"Chart written to {args.plot}")
    if model is not None:
        if note:
            out.print(note)
        code = _compiled_table(out, n, choice.device_bytes, model, args.stages, tpu, args.timeout) or 0
        if args.keep_gathered:
            kept = choose_keep_gathered(choice.device_bytes, num_devices=n, factory_kwargs=model, timeout=args.timeout)
            out.print(str(kept))
        return code
    return 0


def _formula_table(choice: StageChoice, args: argparse.Namespace, bandwidth: float | None) -> Table:
    """Model states, fit and communication per stage (and time and efficiency given a bandwidth)."""
    psi, n, act, mem = choice.num_params, choice.num_devices, choice.activation_bytes, choice.device_bytes
    m, quantized = choice.model_parallel, bool(args.quantize_weights or args.quantize_grads)
    tp = f", M = {m} tensor-parallel ({n * m} devices)" if m > 1 else ""
    table = Table(
        title=f"ZeRO model states per device: Ψ = {psi / 1e9:.2f}B parameters, N = {n}{tp}, {_si(mem)} per device",
        caption=f"{args.param_bytes:g} + {args.grad_bytes:g} + {args.optimizer_bytes:g} bytes per parameter "
        f"(params + grads + optimizer); activations {_si(act)} per device; communication counted as a ring moves it"
        + (TP_CAPTION.format(m=m) if m > 1 else "")
        + (_wire_caption(args) if quantized else ""),
    )
    cols = ("stage", "params", "grads", "optimizer", "total") + (("+ activations",) if act else ()) + ("fits",)
    cols += ("comm/step", *(("unquantized",) if quantized else ()))
    for col in (*cols, *(("t_comm", "efficiency") if bandwidth is not None else ())):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in range(4):
        st = choice.state[s]
        row = [f"{s} {STAGE_NAMES[s]}", _si(st.params), _si(st.grads), _si(st.optimizer), _si(st.total)]
        row += [_si(st.total + act)] if act else []
        row.append("[green]yes[/green]" if choice.fits[s] else "[red]no[/red]")
        comm = comm_bytes(psi, n, s, dtype_bytes=args.grad_bytes, model_parallel=m, **_wire(args, s))
        row.append(_si(comm))
        row += [_si(comm_bytes(psi, n, s, dtype_bytes=args.grad_bytes, model_parallel=m))] if quantized else []
        if bandwidth is not None:
            eff = efficiency(
                psi, n, s, compute_time=args.compute_time, bandwidth=bandwidth, dtype_bytes=args.grad_bytes,
                model_parallel=m, **_wire(args, s),
            )  # fmt: skip
            row += [f"{comm / bandwidth:.2f} s", f"{eff:.1%}"]
        table.add_row(*row, style="bold" if s == choice.stage else None)
    return table


def _wire_caption(args: argparse.Namespace) -> str:
    """What the ``--quantize-*`` flags put on the wire, for a table's caption."""
    qw, qg = wire_rates(3, args.quantize_weights, args.quantize_grads, args.quant_block, "plan")  # 3: both apply
    what = [f"qwZ {args.quantize_weights} at stage 3"] if qw else []
    what += [f"qgZ {args.quantize_grads} at stages 1-3"] if qg else []
    return WIRE_CAPTION.format(what=" + ".join(what), block=args.quant_block, rate=qw or qg)


def _secondary_line(num_params: float, n: int, args: argparse.Namespace, per: dict[str, float], m: int) -> str:
    """hpZ at stage 3 by the formulas: the memory it adds, the bytes across and within the nodes."""
    s = args.secondary_axis
    with_hpz = model_state_bytes(num_params, n, 3, secondary=s, model_parallel=m, **per)  # pyright: ignore[reportArgumentType] - **per holds the byte sizes only
    without = model_state_bytes(num_params, n, 3, model_parallel=m, **per)  # pyright: ignore[reportArgumentType] - **per holds the byte sizes only
    comm = comm_bytes_per_axis(num_params, n, 3, secondary=s, dtype_bytes=args.grad_bytes, model_parallel=m,
                               **_wire(args, 3))  # fmt: skip
    flat = comm["across"] * 3 / 2 if not (args.quantize_weights or args.quantize_grads) else None
    was = f" (without hpZ {_si(flat)}: the backward re-gather crosses them too)" if flat else ""
    return (
        f"hpZ, stage 3 ({n // s} nodes x {s} chips, ZeroPolicy(axis=('node', 'chip'), secondary_axis='chip')): "
        f"{_si(with_hpz.total)} per device ({_si(with_hpz.params - without.params)} of secondary pieces); per step "
        f"{_si(comm['across'])} across the nodes{was}, {_si(comm['within'])} within each."
    )


def _hybrid_table(num_params: float, n: int, args: argparse.Namespace, per: dict[str, float], m: int = 1) -> Table:
    """Per-device model states and per-axis communication of the hybrid policies (tensor-parallel over ``m``)."""
    r, b = args.replicas, args.grad_bytes
    tp = f" x M = {m} tensor-parallel" if m > 1 else ""
    table = Table(
        title=f"Hybrid mesh: R = {r} replicas x N = {n} partitions{tp} ({r * n * m} devices)",
        caption="HSDP: ZeroPolicy(..., replica_axis=...); over R: also optimizer_over_replicas=True. Per step, per "
        "device, as a ring moves it: within the partition axis (fast), across the replica axis (slow)"
        + (HYBRID_WIRE if args.quantize_weights or args.quantize_grads else "."),
    )
    for col in ("stage", "HSDP per device", "over R per device", "comm within N", "comm across R"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in range(1, 4):
        hsdp = model_state_bytes(num_params, n, s, replicas=r, model_parallel=m, **per).total  # pyright: ignore[reportArgumentType] - **per holds the byte sizes only
        hpz = model_state_bytes(num_params, n, s, replicas=r, optimizer_over_replicas=True, model_parallel=m, **per)  # pyright: ignore[reportArgumentType] - **per holds the byte sizes only
        comm = comm_bytes_per_axis(num_params, n, s, replicas=r, dtype_bytes=b, model_parallel=m, **_wire(args, s))
        table.add_row(f"{s} {STAGE_NAMES[s]}", _si(hsdp), _si(hpz.total), _si(comm["shard"]), _si(comm["replica"]))
    return table


def plot_choice(choice: StageChoice, path: str) -> None:
    """The stacked-bar chart of model states per stage, against the device's memory."""
    plt = _demo.pyplot()
    if plt is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or leave out --plot).")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [f"{s}: {STAGE_NAMES[s]}" for s in range(4)]
    bottom = [0.0] * 4
    parts = [("params", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868")]
    if choice.activation_bytes:
        parts.append(("activations", "#C8C8C8"))
    for name, color in parts:
        values = [
            (choice.activation_bytes if name == "activations" else getattr(choice.state[s], name)) / 1e9
            for s in range(4)
        ]
        ax.bar(labels, values, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.axhline(choice.device_bytes / 1e9, color="black", linestyle="--", linewidth=1)
    ax.text(3.45, choice.device_bytes / 1e9, f" {_si(choice.device_bytes)}", va="bottom", ha="right")
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GB per device")
    tp = f", M = {choice.model_parallel} tensor-parallel" if choice.model_parallel > 1 else ""
    ax.set_title(f"ZeRO model states: Ψ = {choice.num_params / 1e9:.2f}B, N = {choice.num_devices}{tp}")
    ax.legend()
    fig.tight_layout()
    _demo.save_figure(plt, fig, path, "--plot")


def _compiled_table(
    out: Console, n: int, mem: float, model: dict[str, Any], stages: Sequence[int], tpu: DeviceSlice | None = None,
    timeout: float = 600.0,
) -> int:  # fmt: skip
    """Compile and print the per-stage table; exit status 1 when no stage fits (the reason on stderr)."""
    if tpu is None:
        out.print(f"Compiling for {n} simulated devices (nothing is allocated)...")
    else:
        compiler = COMPILERS[tpu.platform].split(" (")[0]
        out.print(f"Compiling for {tpu.topology} with the {compiler}, on this machine (nothing is allocated)...")
    topology = None if tpu is None else tpu.name
    result = plan(
        num_devices=n, device_bytes=mem, stages=stages, factory_kwargs=model, topology=topology, timeout=timeout
    )
    out.print(_result_table(result, model))
    for stage, said in result.out_of_memory.items():
        out.print(f"stage {stage}: the TPU compiler refused the step: {said}")
    for line in result.layer_notes() + result.buffer_notes() + result.secondary_notes():
        out.print(line)
    if result.recommended is None:
        out.print("[bold]Compiled: no stage fits.[/bold]")
        print(f"python -m zero_jax plan: error: {result.verdict()}", file=sys.stderr)
        return 1
    out.print(f"[bold]Compiled: {result.verdict()}.[/bold]")
    return 0


def _topology_caption(target: DeviceSlice) -> str:
    return TPU_CAPTION.format(compiler=COMPILERS[target.platform], tpu=target, kind=target.platform.upper())


def _result_table(result: Plan, model: dict[str, Any]) -> Table:
    """The compiled plan per stage: state bytes, temp, peak (and TPU HBM), fit, communication, the audit."""
    phi = f"{result.reports[0].num_params:,}" if result.reports else "?"
    hbm = bool(result.hbm)
    table = Table(
        title=f"Compiled step (reference transformer, Φ = {phi}, AdamW, "
        f"{'bf16 compute / fp32 master' if model['compute_dtype'] else FP32_NOTE})",
        caption=f"compiled in {result.seconds:.1f} s; peak resident memory of the compiling process "
        f"{fmt_bytes(result.max_rss_bytes)}; peak = argument + output + temp - alias (memory_analysis)"
        + (_topology_caption(result.topology) if result.topology is not None else "")
        + (COMPILED_WIRE.format(**model) if "quant_block" in model else ""),
    )
    cols = ("stage", "params", "grads", "optimizer", "temp", "peak", *(("HBM",) if hbm else ()), "fits")
    for col in (*cols, "comm/step", "/theory", "check"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    reports = {r.stage: r for r in result.reports}
    for stage in sorted({*reports, *result.out_of_memory}):
        fit = result.fit_note(stage)
        fits = f"[green]{fit}[/green]" if fit == "yes" else f"[red]{fit}[/red]"
        if stage not in reports:  # refused by the TPU compiler: no program, no figures (its words follow the table)
            table.add_row(f"{stage} {STAGE_NAMES[stage]}", *["-"] * (len(cols) - 2), fits, "-", "-", "-")
            continue
        r = reports[stage]
        b = r.state_bytes
        table.add_row(
            f"{r.stage} {STAGE_NAMES[r.stage]}", _si(b["params"]), _si(b.get("grads", 0)),
            _si(b["optimizer"]), _si(r.memory["temp"]), _si(r.memory["peak"]),
            *((_si(result.hbm[r.stage]) if r.stage in result.hbm else "-",) if hbm else ()),
            fits, _si(r.comm.measured), f"{r.comm.ratio:.3f}",
            "[green]ok[/green]" if r.ok else f"[red]{len(r.violations)} violation(s)[/red]",
        )  # fmt: skip
    return table


# -- audit --------------------------------------------------------------------------------------------------------


def add_audit_arguments(p: argparse.ArgumentParser) -> None:
    """The ``audit`` subcommand's options."""
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    add_model_arguments(p)
    p.add_argument("--gather", choices=("manual", "all"), default="manual", help="layer-wise (manual) or whole")
    p.add_argument("--accum-steps", type=positive_int, default=1)
    p.add_argument("--accum-mode", choices=("local", "partitioned"), default=None)
    p.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="HSDP: a (replica, data) = (R, devices / R) mesh, state partitioned within data (default 1: flat)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="print every stage's full report")
    p.add_argument(
        "--devices", type=positive_int, default=DEFAULT_DEVICES,
        help="simulated CPU devices when no accelerator is present (default 8)",
    )  # fmt: skip


def run_audit_command(args: argparse.Namespace) -> int:
    """``python -m zero_jax audit``: audit the reference transformer's step for
    each stage on this process's devices and print the reports. Exit status 1
    when a check fails, 2 on bad input."""
    try:
        cfg = _config(args)
        _demo.simulate_cpu_devices(args.devices)
        return _audit_command(args, cfg)
    except (ValueError, TypeError) as e:
        print(f"python -m zero_jax audit: error: {e}", file=sys.stderr)
        return 2


def _audit_mesh(replicas: int) -> tuple[jax.sharding.Mesh, dict[str, Any]]:
    n = jax.device_count()
    if n % replicas:
        raise ValueError(f"--replicas {replicas} must divide the {n} devices.")
    if replicas > 1:
        return jax.make_mesh((replicas, n // replicas), ("replica", "data")), {"replica_axis": "replica"}
    return jax.make_mesh((n,), ("data",)), {}


def _audit_command(args: argparse.Namespace, cfg: TransformerConfig) -> int:
    out = console()
    devices = jax.devices()
    n, replicas = len(devices), args.replicas
    mesh, hybrid = _audit_mesh(replicas)
    # Jitted: one compilation each instead of one per eager op.
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    batch = jax.jit(synthetic_batch, static_argnums=(0, 1))(cfg, args.batch_per_device * n, jax.random.key(1))
    precision = Precision(compute_dtype=jnp.bfloat16) if args.bf16 else Precision()
    table = Table(
        title=f"zj.audit: reference transformer, Φ = {cfg.num_params():,}, "
        + (f"HSDP R = {replicas} x N = {n // replicas}" if replicas > 1 else f"N = {n}")
        + f" {devices[0].platform} devices, "
        f"AdamW, {'bf16 compute / fp32 master' if args.bf16 else 'fp32'}, gather={args.gather!r}",
        caption="bytes per device (max over devices), measured on the live arrays / ZeRO formula for the run's bytes "
        "per parameter; comm: post-SPMD collectives, ring bytes per device per step / the stage's theory",
    )
    for col in ("stage", "params", "grads", "optimizer", "/formula", "peak", "comm/step", "/theory", "/accounted",
                "max all-reduce", *(("across replica",) if replicas > 1 else ()), "check"):  # fmt: skip
        table.add_column(col, justify="left" if col == "stage" else "right")
    reports = []
    for stage in args.stages:
        policy = ZeroPolicy(stage, mesh, "data", **hybrid, stacked="layers", precision=precision)
        tx = shard_optimizer(optax.adamw(1e-3), policy)
        loss_fn = make_loss_fn(cfg, policy if args.gather == "manual" else None)
        step = make_train_step(
            loss_fn, tx, policy, gather=args.gather, accum_steps=args.accum_steps, accum_mode=args.accum_mode
        )
        r = audit(step, init_state(params, tx, policy), batch)
        reports.append(r)
        b = r.state_bytes
        worst = max((b[c] / r.formula[c] for c in r.formula if r.formula[c]), default=1.0)
        biggest = max((c.bytes for c in r.collectives if c.kind == "all-reduce"), default=0)
        table.add_row(
            f"{stage} {STAGE_NAMES[stage]}", fmt_bytes(b["params"]), fmt_bytes(b.get("grads", 0)),
            fmt_bytes(b["optimizer"]), f"{worst:.3f}", fmt_bytes(r.memory["peak"]), fmt_bytes(r.comm.measured),
            f"{r.comm.ratio:.3f}", f"{r.comm.accounted_ratio:.3f}", fmt_bytes(biggest),
            *((fmt_bytes(r.comm_per_axis.get("replica", 0.0)),) if replicas > 1 else ()),
            "[green]passed[/green]" if r.ok else f"[red]{len(r.violations)} violation(s)[/red]",
        )  # fmt: skip
    out.print(table)
    failed = sum(not r.ok for r in reports)
    for r in reports:
        if args.verbose or not r.ok:
            out.print(str(r), markup=False)
            out.print()
    out.print(
        "All checks passed: no gradient-sized all-reduce in stages 1-3, no partitionable leaf replicated, "
        "communication within 2% of theory."
        if not failed
        else f"[red]{failed} stage(s) failed the check.[/red]"
    )
    return 1 if failed else 0


# -- main ---------------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The ``python -m zero_jax`` parser and its three subcommands."""
    top = argparse.ArgumentParser(prog="python -m zero_jax", description=__doc__.split("\n\n")[0])  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
    sub = top.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the reference model with each stage and print memory and time")
    d.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    d.add_argument("--steps", type=positive_int, default=10, help="training steps per stage (10)")
    add_model_arguments(d)
    d.add_argument(
        "--processes", type=positive_int, default=1,
        help="run as P processes on 127.0.0.1 joined by jax.distributed (a simulated pod; HSDP across them)",
    )  # fmt: skip
    d.add_argument(
        "--devices", type=positive_int, default=DEFAULT_DEVICES,
        help="simulated CPU devices when no accelerator is present (default 8)",
    )  # fmt: skip
    d.add_argument("--plot", default="zero_jax_demo.png", help="the memory figure's PNG (default ./zero_jax_demo.png)")
    d.add_argument("--no-plot", action="store_true", help="skip the memory figure")
    add_plan_arguments(sub.add_parser("plan", help="which ZeRO stage fits: per-stage memory, communication"))
    add_audit_arguments(sub.add_parser("audit", help="audit the reference model's compiled step for each stage"))
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (argparse exits 2 itself on bad flags)."""
    deviceless_environment()  # with libtpu installed, JAX loads it on a machine without a TPU: quietly, then
    args = parser().parse_args(argv)
    if args.command == "demo":
        return _demo.run_demo_command(args)
    if args.command == "plan":
        return run_plan_command(args)
    return run_audit_command(args)
