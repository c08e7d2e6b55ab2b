"""The preemption save against a plain save, for the reference transformer.

Run: ``python benchmarks/preemption.py`` (8 simulated CPU devices; about two minutes on 2 cores).
It prints one table and writes it, with the command and the machine, to
``benchmarks/results/preemption.txt`` (and ``.json``). ``--dim/--depth`` change the model (default:
the reference transformer at dim 512, depth 8: 25.5M float32 parameters; AdamW state twice that).

A scheduler's SIGTERM leaves a grace period (30 s on GKE and SLURM's default) before SIGKILL; what
matters is whether the save fits it. The state is trained under ZeRO-3 on N = 8, then, each
timed ``--repeat`` times (median; files on the local disk, in a temporary directory):

* **plain save**: ``zj.save`` until the step is committed;
* **preemption save**: ``CheckpointManager(save_on_preemption=True).save_if_preempted`` at the step
  boundary after a SIGTERM, until it returns (committed);
* the same **with an asynchronous save in flight** (the SIGTERM came while ``mgr.save`` was
  writing the step before): until both are committed;
* **SIGTERM to committed**: the signal sent while a train step runs, to the preemption save's
  return: the rest of the step, then the save;
* **2 processes**: ``zj.launch`` of 2 processes x 4 devices; process 1 signals itself during a
  step; each process's time from that signal to its ``save_if_preempted`` returning (JAX's
  preemption service names the step both save at, a few steps later), and the preemption save
  itself (the state of a finished step) against a plain ``zj.save`` in the same processes;
* the per-step cost of ``save_if_preempted`` when no notice came.
"""

from __future__ import annotations

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

if __name__ == "__main__":  # (zj.launch's processes import this module with their own 4 devices)
    common.setup(devices=8)

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch  # noqa: E402

MB = 1e6


def _trained(cfg: TransformerConfig, devices: list) -> tuple[zj.TrainState, zj.TrainStep, dict]:
    """The reference transformer under ZeRO-3 on ``devices``, one step trained, and its step and batch."""
    policy = zj.ZeroPolicy(3, jax.sharding.Mesh(np.asarray(devices), ("data",)), stacked="layers")
    tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
    state = zj.init_state(lambda: init_params(cfg, jax.random.key(0)), tx, policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    batch = synthetic_batch(cfg, 8, jax.random.key(1))
    if jax.process_count() > 1:
        rows = jax.tree.map(lambda x: np.split(np.asarray(x), jax.process_count())[jax.process_index()], batch)
        batch = zj.shard_batch(rows, policy)
    state, _ = step(state, batch)
    return jax.block_until_ready(state), step, batch


def _preempted_save(directory: str, state: zj.TrainState, *, in_flight: bool) -> float:
    """Seconds ``save_if_preempted`` takes at the boundary after a SIGTERM (with a save in flight or not)."""
    with zj.CheckpointManager(directory, max_to_keep=None, save_on_preemption=True) as mgr:
        if in_flight:
            mgr.save(state, step=int(state.step) - 1)  # the periodic save, still writing
        os.kill(os.getpid(), signal.SIGTERM)
        t = time.perf_counter()
        assert mgr.save_if_preempted(state)
        return time.perf_counter() - t


def _signal_to_committed(
    directory: str, state: zj.TrainState, step: zj.TrainStep, batch: dict
) -> tuple[float, zj.TrainState]:
    """Seconds from a SIGTERM sent while a step runs to the preemption save's return, and the new state."""
    with zj.CheckpointManager(directory, max_to_keep=None, save_on_preemption=True) as mgr:
        state, _ = step(state, batch)  # dispatched: the step runs while the signal arrives
        t = time.perf_counter()
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.save_if_preempted(state)
        return time.perf_counter() - t, state


def two_processes(dim: int, depth: int, directory: str) -> dict:
    """Each of 2 processes (zj.launch): train until process 1's own SIGTERM is acted on, on both."""
    cfg = TransformerConfig(vocab=256, dim=dim, depth=depth, heads=8, seq=64)
    state, step, batch = _trained(cfg, jax.devices())
    zj.save(directory + "-warm", state)  # orbax's first use, the checksum program
    t = time.perf_counter()
    zj.save(directory + "-plain", state)
    plain = time.perf_counter() - t
    sent, steps = None, 0
    with zj.CheckpointManager(directory, save_on_preemption=True) as mgr:
        while True:
            state, _ = jax.block_until_ready(step(state, batch))  # the save below is timed alone
            steps += 1
            if steps == 3 and jax.process_index() == 1:
                sent = time.time()
                os.kill(os.getpid(), signal.SIGTERM)
            t = time.perf_counter()
            if mgr.save_if_preempted(state):
                done, save_s = time.time(), time.perf_counter() - t
                return {"sent": sent, "done": done, "save_s": save_s, "plain_s": plain, "steps": steps}
            if steps > 1000:
                raise RuntimeError("no preemption sync point in 1000 steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=common.RESULTS, help="the folder for preemption.txt / .json")
    args = parser.parse_args()
    record = common.Record()
    cfg = TransformerConfig(vocab=256, dim=args.dim, depth=args.depth, heads=8, seq=64)
    state, step, batch = _trained(cfg, jax.devices())
    root = tempfile.mkdtemp(prefix="zj-bench-")
    rows: dict[str, float] = {}
    try:
        names = iter(range(10**6))
        fresh = lambda: os.path.join(root, str(next(names)))  # noqa: E731
        zj.save(fresh(), state)  # warm-up: orbax's first use, the checksum program
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            state, _ = jax.block_until_ready(step(state, batch))
            times.append(time.perf_counter() - t)
        rows["one train step (context)"] = statistics.median(times)
        rows["plain save: zj.save, committed"] = statistics.median(
            _timed(lambda: zj.save(fresh(), state)) for _ in range(args.repeat)
        )
        rows["preemption save: save_if_preempted"] = statistics.median(
            _preempted_save(fresh(), state, in_flight=False) for _ in range(args.repeat)
        )
        rows["preemption save, an async save in flight"] = statistics.median(
            _preempted_save(fresh(), state, in_flight=True) for _ in range(args.repeat)
        )
        times = []
        for _ in range(args.repeat):
            t, state = _signal_to_committed(fresh(), state, step, batch)
            times.append(t)
        rows["SIGTERM during a step -> committed"] = statistics.median(times)
        with zj.CheckpointManager(fresh(), save_on_preemption=True) as mgr:
            t = time.perf_counter()
            for _ in range(10000):
                mgr.save_if_preempted(state)
            rows["save_if_preempted, no notice (per call)"] = (time.perf_counter() - t) / 10000
        path = os.pathsep.join([common.HERE, common.ROOT, os.environ.get("PYTHONPATH", "")])
        env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "PYTHONPATH": path}
        member = "preemption:two_processes"  # by name: run as a script, this module is __main__
        pair = zj.launch(member, args.dim, args.depth, fresh(), processes=2, local_devices=4, env=env, timeout_s=600)
        sent = next(r["sent"] for r in pair if r["sent"] is not None)
        for i, r in enumerate(pair):
            rows[f"2 processes: SIGTERM to 1 -> process {i} committed"] = r["done"] - sent
        rows["2 processes: plain save, zj.save (process 0)"] = pair[0]["plain_s"]
        rows["2 processes: the preemption save itself (process 0)"] = pair[0]["save_s"]
        agreed = [r["steps"] for r in pair]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    import orbax.checkpoint as ocp

    header = record.header(
        "The preemption save against a plain save (benchmarks/preemption.py)",
        f"model: reference transformer dim {cfg.dim}, depth {cfg.depth}, vocab {cfg.vocab}: "
        f"{cfg.num_params() / 1e6:.1f}M fp32 parameters, optax.adamw; ZeRO-3, 8 simulated CPU devices",
        f"times: median of {args.repeat}, local disk; 2 processes: steps trained when they saved {agreed} "
        "(the signal at step 3)",
        versions=f"orbax-checkpoint {ocp.__version__}",
    )
    lines = [header, "", f"{'operation':<52} {'seconds':>9}", "-" * 62]
    lines += [f"{name:<52} {t:>9.4f}" if t >= 1e-3 else f"{name:<52} {t * 1e6:>6.1f} us" for name, t in rows.items()]
    text = "\n".join(lines)
    print(text)
    common.write_results("preemption", text, {"meta": record.meta(), "seconds": rows, "steps": agreed}, out=args.out)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
