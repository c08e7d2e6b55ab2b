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

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

common.setup(devices=8)

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch  # noqa: E402

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


def logical_bytes(state: zj.TrainState) -> int:
    """Bytes of every array of ``state`` at its logical (unpadded) shape, what a checkpoint records:
    the parameters, optimizer state and master copy at their layouts' shapes, the rest as stored."""

    def of(tree: Any, layouts: Any = None) -> int:
        leaves = jax.tree.leaves(tree)
        shapes = [x.shape for x in leaves] if layouts is None else [lay.shape for lay in layouts]
        return sum(math.prod(s) * x.dtype.itemsize for s, x in zip(shapes, leaves, strict=True))

    total = of(state.step) + of(state.params, state.layouts.layouts) + of(state.loss_scale) + of(state.model_state)
    total += of(state.opt_state.inner_state, state.opt_state.layouts.layouts)
    return total + (of(state.master, state.layouts.layouts) if state.master is not None else 0)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=common.RESULTS, help="the folder for checkpoint.txt")
    args = parser.parse_args()
    record = common.Record()

    cfg = TransformerConfig(vocab=256, dim=args.dim, depth=args.depth, heads=8, seq=64)
    opt = optax.adamw(1e-3)
    policy = _policy(3, 8)
    tx = zj.shard_optimizer(opt, policy)
    state = zj.init_state(lambda: init_params(cfg, jax.random.key(0)), tx, policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    state, _ = step(state, synthetic_batch(cfg, 8, jax.random.key(1)))
    jax.block_until_ready(state)
    state_bytes = logical_bytes(state)
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

    header = record.header(
        "Checkpoint save / restore / export (benchmarks/checkpoint.py)",
        f"model: reference transformer dim {cfg.dim}, depth {cfg.depth}, mlp {cfg.mlp_dim}, vocab {cfg.vocab}: "
        f"{cfg.num_params() / 1e6:.1f}M fp32 parameters ({param_bytes / MB:.0f} MB), optax.adamw",
        f"state: ZeRO-3 on 8 simulated CPU devices, {state_bytes / MB:.0f} MB logical "
        f"(params + Adam mu, nu); checkpoint on disk {disk / MB:.0f} MB (orbax OCDBT)",
        f"times: median of {args.repeat}, local disk",
        versions=f"orbax-checkpoint {ocp.__version__}, safetensors {safetensors.__version__}",
    )
    lines = [
        header,
        "",
        f"{'operation':<40} {'seconds':>8} {'MB/s':>8}",
        "-" * 58,
        *(f"{name:<40} {t:>8.3f} {rate:>8.0f}" for name, t, rate in rows),
    ]
    text = "\n".join(lines)
    print(text)
    common.write_results("checkpoint", text, out=args.out)


if __name__ == "__main__":
    main()
