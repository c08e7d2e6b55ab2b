"""``python -m zero_jax demo``: train the reference transformer with each ZeRO
stage and print, per stage, the final loss, the bytes each device holds next
to the ZeRO formula, and the step time.

``python -m zero_jax plan --params 7e9 --devices 8 --device-memory 80GB``: which
stage fits (per-stage model states, communication, a recommendation; ``--plot``
draws the chart, ``--compile`` checks the reference transformer's compiled
step on simulated devices). ``python -m zero_jax audit``: audit the reference
model's compiled step for each stage (``zj.audit``) and print the reports.

Without an accelerator it simulates 8 CPU devices (set before JAX starts);
on GPUs or TPUs it uses the real devices unchanged.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence


def _simulate_cpu_devices(n: int) -> None:
    # Must happen before JAX creates its first array; harmless on accelerator
    # hosts (it only sizes the CPU backend, which is then not the default).
    import jax

    jax.config.update("jax_num_cpu_devices", n)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def demo(args: argparse.Namespace) -> int:
    if args.processes > 1:
        # A simulated pod: P processes on 127.0.0.1 joined by jax.distributed,
        # each with its own devices; process 0's report is printed.
        if args.devices % args.processes:
            raise SystemExit(f"demo: --devices {args.devices} must divide by --processes {args.processes}.")
        import zero_jax as zj

        reports = zj.launch(
            _demo_process, vars(args), processes=args.processes, local_devices=args.devices // args.processes
        )
        print("\n".join(reports[0]))
        return 0
    _simulate_cpu_devices(args.devices)
    for line in _demo_lines(args):
        print(line, flush=True)
    return 0


def _demo_process(options: dict) -> list[str]:
    """One process of ``demo --processes P`` (run by ``zj.launch``)."""
    return list(_demo_lines(argparse.Namespace(**options)))


def _demo_lines(args: argparse.Namespace) -> Iterator[str]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zero_jax as zj
    from zero_jax import _measure
    from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

    devices = jax.devices()
    processes = jax.process_count()
    if processes > 1:
        # One replica per process (host), partitions within it: HSDP, the multi-host layout.
        mesh = jax.sharding.Mesh(np.asarray(devices).reshape(processes, -1), ("replica", "data"))
        hybrid = {"replica_axis": "replica"}
        where = f"{processes} processes x {jax.local_device_count()} {devices[0].platform} devices, HSDP"
    else:
        mesh = jax.make_mesh((len(devices),), ("data",))
        hybrid = {}
        where = f"N = {len(devices)} {devices[0].platform} devices"
    cfg = TransformerConfig(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq)
    params = init_params(cfg, jax.random.key(0))
    batch_size = args.batch_per_device * len(devices)
    rows = batch_size // processes  # each process loads only its own rows
    pid = jax.process_index()
    local_batches = [
        jax.tree.map(
            lambda x: np.asarray(x)[pid * rows : (pid + 1) * rows],
            synthetic_batch(cfg, batch_size, jax.random.key(100 + i)),
        )
        for i in range(args.steps)
    ]
    yield (
        f"zero_jax demo: {cfg.num_params():,} parameters (depth {cfg.depth}, width {cfg.dim}), "
        f"{where}, global batch {batch_size}, AdamW, "
        f"{'bf16 compute / fp32 master' if args.bf16 else 'fp32'}, {args.steps} steps\n"
    )
    precision = zj.Precision(compute_dtype=jnp.bfloat16) if args.bf16 else zj.Precision()
    # Bytes per parameter: (compute copy, gradient, master + Adam's two moments).
    per_param = (2, 2, 12) if args.bf16 else (4, 4, 8)
    header = (
        f"{'stage':>5} {'loss':>8} {'params/dev':>11} {'formula':>11} {'grads/dev':>11} {'formula':>11} "
        f"{'opt/dev':>11} {'formula':>11} {'peak/dev':>10} {'step ms':>8}"
    )
    yield header
    yield "-" * len(header)
    for stage in args.stages:
        policy = zj.ZeroPolicy(stage, mesh, "data", **hybrid, stacked="layers", precision=precision)
        n = policy.num_shards
        batches = [zj.shard_batch(b, policy) for b in local_batches]
        tx = zj.shard_optimizer(optax.adamw(3e-3, weight_decay=0.01), policy)
        state = zj.init_state(params, tx, policy)
        # Layer-wise: the model gathers each layer just before use (zj.scan_layers).
        step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")

        layouts = jax.tree.leaves(policy.layouts(params), is_leaf=lambda x: isinstance(x, zj.LeafLayout))
        # Parameters per device when whole, and when partitioned (padding included).
        whole = sum(math.prod(lay.shape) for lay in layouts)
        cut = sum(math.prod(lay.stored_shape) // (n if lay.partitioned else 1) for lay in layouts)
        formula = {
            "params": per_param[0] * (cut if stage >= 3 else whole),
            "grads": per_param[1] * (cut if stage >= 2 else whole),
            "opt": per_param[2] * (cut if stage >= 1 else whole),
        }
        peak = _measure.memory(step.lower(state, batches[0]).compile())["peak"]
        grads = step.grads(state, batches[0])
        measured = {
            "params": max(_measure.resident_bytes(state.params).values()),
            "grads": max(_measure.resident_bytes(grads).values()),
            "opt": max(_measure.resident_bytes((state.opt_state, state.master)).values()),
        }
        del grads
        times = []
        for batch in batches:
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
        step_ms = 1e3 * sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else 1e3 * times[0]
        yield (
            f"{stage:>5} {float(metrics['loss']):>8.4f} "
            + " ".join(
                f"{_fmt_bytes(measured[k]):>11} {_fmt_bytes(formula[k]):>11}" for k in ("params", "grads", "opt")
            )
            + f" {_fmt_bytes(peak):>10} {step_ms:>8.1f}"
        )
    yield (
        "\nbytes/dev: measured on the live arrays (largest device); formula: ZeRO's Φ/N for what the stage "
        "partitions\n(padding included; leaves under min_shard_size stay whole). Optimizer: master copy (with "
        "--bf16) + Adam's moments and int32 count.\n"
        "peak/dev: the compiled step's argument + output + temp - alias (memory_analysis)."
        + ("\nN is the partition (data) axis within each process; processes hold replicas." if processes > 1 else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    from zero_jax.models.transformer import add_model_arguments  # the models import zero_jax

    parser = argparse.ArgumentParser(prog="python -m zero_jax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the reference model with each stage and print memory and time")
    d.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    d.add_argument("--steps", type=int, default=20)
    add_model_arguments(d)
    d.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run as P processes on 127.0.0.1 joined by jax.distributed (a simulated pod; HSDP across them)",
    )
    d.add_argument(
        "--devices",
        type=int,
        default=int(os.environ.get("ZERO_JAX_CPU_DEVICES", "8")),
        help="simulated CPU devices when no accelerator is present (default 8)",
    )
    # plan / audit: formulas and the compiled fit check (zero_jax/_planner.py), proof from the
    # compiled program (zero_jax/_audit.py). Importing them starts no JAX backend.
    from zero_jax._audit import add_audit_arguments, run_audit_command
    from zero_jax._planner import add_plan_arguments, run_plan_command

    add_plan_arguments(
        sub.add_parser("plan", help="which ZeRO stage fits: per-stage memory, communication, recommendation")
    )
    a = sub.add_parser("audit", help="audit the reference model's compiled step for each stage")
    add_audit_arguments(a)
    a.add_argument(
        "--devices",
        type=int,
        default=int(os.environ.get("ZERO_JAX_CPU_DEVICES", "8")),
        help="simulated CPU devices when no accelerator is present (default 8)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    if args.command == "plan":
        return run_plan_command(args)
    if args.command == "audit":
        _simulate_cpu_devices(args.devices)
        return run_audit_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
