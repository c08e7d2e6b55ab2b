"""Checkpoint save / restore / export time and throughput for the reference transformer.

Run: ``python benchmarks/checkpoint.py`` (8 simulated CPU devices in one process; about a
minute on 2 cores). It prints one table and writes it, with the command and the machine, to
``benchmarks/results/checkpoint.txt``. ``--dim/--depth`` change the model (default: the
reference transformer at dim 512, depth 8: 25.7M float32 parameters, 103 MB; AdamW state
twice that).

The state is trained one step under ZeRO-3 on N = 8 and then, each timed ``--repeat`` times
(median reported; files on the local disk, in a temporary directory):

* **save (sync)**: ``zj.save`` until the step is committed (every array written, checksums
  computed, the step directory renamed into place);
* **save (async)**: ``CheckpointManager(async_save=True).save``: the time until training may
  go on (the blocking part: arrays copied off the devices), then until committed (``wait``);
* **restore** into (N, stage) = (8, 3), (2, 1), (1, 0): ``zj.restore`` with checksum
  verification, until every array is ready (the target state's layout is built once per
  policy; the first, compiling, restore is not counted);
* **export** (``zj.export_params``: one safetensors file, streamed) and **load**
  (``zj.load_params`` into the stage-3 layout).

Throughput is the logical bytes of what was moved (whole state; parameters for export/load)
per second.
"""

from __future__ import annotations

import jax

# Before anything makes an array: the process sees 8 CPU devices.
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.checkpoint._record import state_entries as _entries  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

MB = 1e6


def _policy(stage: int, n: int) -> zj.ZeroPolicy:
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("data",))
    return zj.ZeroPolicy(stage, mesh, stacked="layers")


def _timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "checkpoint.txt"))
    args = parser.parse_args()
    start = time.perf_counter()
    load_before = os.getloadavg()[0]

    cfg = TransformerConfig(vocab=256, dim=args.dim, depth=args.depth, heads=8, seq=64)
    opt = optax.adamw(1e-3)
    policy = _policy(3, 8)
    tx = zj.shard_optimizer(opt, policy)
    state = zj.init_state(lambda: init_params(cfg, jax.random.key(0)), tx, policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    state, _ = step(state, synthetic_batch(cfg, 8, jax.random.key(1)))
    jax.block_until_ready(state)
    state_bytes = sum(math.prod(e.shape) * e.dtype.itemsize for e in _entries(state))
    param_bytes = sum(math.prod(lay.shape) * 4 for lay in state.layouts.layouts)

    rows: list[tuple[str, float, float]] = []
    root = tempfile.mkdtemp(prefix="zj-bench-")
    try:
        counter = iter(range(10**6))

        def save_sync() -> None:
            zj.save(os.path.join(root, "sync"), state, step=next(counter), max_to_keep=1)

        save_sync()  # warm-up (first use of orbax, checksum code paths)
        t, _ = _timed(save_sync, args.repeat)
        rows.append(("save (sync, committed)", t, state_bytes / t / MB))
        disk = _dir_bytes(os.path.join(root, "sync"))

        blocking, total = [], []
        with zj.CheckpointManager(os.path.join(root, "async"), max_to_keep=1, async_save=True) as mgr:
            mgr.save(state, step=0)
            mgr.wait()
            for i in range(1, args.repeat + 1):
                t0 = time.perf_counter()
                mgr.save(state, step=i)
                blocking.append(time.perf_counter() - t0)
                mgr.wait()
                total.append(time.perf_counter() - t0)
        t = statistics.median(blocking)
        rows.append(("save (async): until training resumes", t, state_bytes / t / MB))
        t = statistics.median(total)
        rows.append(("save (async): until committed", t, state_bytes / t / MB))

        directory = os.path.join(root, "sync")
        for n, stage in [(8, 3), (2, 1), (1, 0)]:
            pol = _policy(stage, n)
            ttx = zj.shard_optimizer(opt, pol)
            jax.block_until_ready(zj.restore(directory, policy=pol, tx=ttx))  # builds the layout once
            t, _ = _timed(lambda pol=pol, ttx=ttx: zj.restore(directory, policy=pol, tx=ttx), args.repeat)
            rows.append((f"restore into N={n}, stage {stage}", t, state_bytes / t / MB))

        file = os.path.join(root, "model.safetensors")
        t, _ = _timed(lambda: zj.export_params(file, state), args.repeat)
        rows.append(("export_params (safetensors, fp32)", t, param_bytes / t / MB))
        zj.load_params(file, policy)
        t, _ = _timed(lambda: zj.load_params(file, policy), args.repeat)
        rows.append(("load_params into N=8, stage 3", t, param_bytes / t / MB))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    import orbax.checkpoint as ocp
    import safetensors

    lines = [
        "Checkpoint save / restore / export (benchmarks/checkpoint.py)",
        f"command: {shlex.join(['python', *sys.argv])}",
        f"date: {datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()}",
        f"jax {jax.__version__}, optax {optax.__version__}, orbax-checkpoint {ocp.__version__}, "
        f"safetensors {safetensors.__version__}, zero_jax {zj.__version__}",
        f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
        f"load average before {load_before:.2f}, after {os.getloadavg()[0]:.2f}",
        f"model: reference transformer dim {cfg.dim}, depth {cfg.depth}, mlp {cfg.mlp_dim}, vocab {cfg.vocab}: "
        f"{cfg.num_params() / 1e6:.1f}M fp32 parameters ({param_bytes / MB:.0f} MB), optax.adamw",
        f"state: ZeRO-3 on 8 simulated CPU devices, {state_bytes / MB:.0f} MB logical "
        f"(params + Adam mu, nu); checkpoint on disk {disk / MB:.0f} MB (orbax OCDBT)",
        f"times: median of {args.repeat}, local disk; wall time {time.perf_counter() - start:.0f} s",
        "",
        f"{'operation':<40} {'seconds':>8} {'MB/s':>8}",
        "-" * 58,
        *(f"{name:<40} {t:>8.3f} {rate:>8.0f}" for name, t, rate in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
