"""Train a byte-level language model with zero_jax, end to end.

    python examples/train_lm.py --devices 8 --steps 200            # 8 simulated CPU devices, the docs' text
    python examples/train_lm.py --devices 8 --steps 400 --resume   # carry on from runs/train_lm's checkpoint
    python examples/train_lm.py --data corpus/ --stage 3 --gather manual --precision bf16 --accum-steps 2

The data: every text file under ``--data`` (a file, a folder, or a glob; by
default this repository's ``docs/**/*.md``) read as bytes (the tokenizer: a
byte is a token, vocabulary 256), cut into windows of ``--seq + 1`` bytes; a
twentieth of them held out for evaluation. A grain ``MapDataset`` shuffles
them (reshuffled each epoch, from ``--seed``) and batches them; its iterator
state is saved with every checkpoint, so a resumed run sees the batches the
uninterrupted one would have seen.

The model: ``zero_jax.models``' reference transformer. The policy: any
ZeRO stage, layer-wise or whole gathers, mixed precision, gradient
accumulation, from the flags. The run directory (``--out``) receives:
``ckpt/`` (``zj.CheckpointManager``, every ``--save-every`` steps and on
SIGTERM), ``data/<step>.json`` (the grain iterator's state at that step),
``metrics.jsonl`` (one JSON object per step and per evaluation),
``run.json`` (the flags) and ``loss.png`` (with matplotlib).

Resume is bitwise: training 2k steps straight, or k steps, a kill (SIGKILL
anywhere, or SIGTERM: the step in progress finishes, is saved, and the run
exits 0) and ``--resume`` to 2k, gives the same parameters, optimizer state
and batches, bit for bit (``tests/test_train_lm.py``), on the same devices and
flags. Resumed on another device count or stage, the checkpoint is restored
across the layout (the numbers then differ by the new reduction order).

Several hosts: run the same command on each with ``--distributed`` (JAX
finds the coordinator under SLURM, Open MPI and on TPU pods; elsewhere add
``--coordinator host:port --num-processes P --process-id i``). Each process
loads only its rows of every global batch; the mesh is one replica per host,
ZeRO within it (HSDP).

``--baseline`` trains the same model on the same batches with plain
``jax.jit`` + optax (parameters and optimizer state replicated, the batch
split across the devices: stage 0 without zero_jax) and prints both step times.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_DATA = str(Path(__file__).resolve().parent.parent / "docs" / "**" / "*.md")
VOCAB = 256  # bytes
NO_DATA = "--data {path}: no such file, folder or glob match; point it at text files (a file, a folder, a glob)."
NO_TEXT = "--data {path}: no text files there ({skipped}); point it at UTF-8 text files."
BINARY = "--data {path}: {file} is not text ({why}); point --data at UTF-8 text files (or a glob that leaves it out)."
TOO_SMALL = (
    "--data {path}: {n_bytes:,} bytes make {windows} training windows of --seq {seq} + 1, fewer than one global batch "
    "of {batch} ({per} per device x {devices} devices); give more text or lower "
    "--seq / --batch-per-device."
)
OTHER_MODEL = (
    "--resume: {out} holds a run of another model ({diff}); pass the same model flags, or a new --out to start afresh."
)
OTHER_DATA = (
    "--resume: {out} was trained on other data ({diff}); pass the same --data, --seq, --seed and global batch "
    "(--batch-per-device x devices: the saved data order depends on them), or a new --out."
)
NOTHING_TO_RESUME = "--resume: no checkpoint in {ckpt}; run without --resume to start, or point --out at a run folder."
EXISTS = "--out {out}: already holds a run's checkpoints; pass --resume to continue it, or a new --out."
MODEL_KEYS = ("dim", "depth", "heads", "mlp", "seq")
DATA_KEYS = ("data", "seq", "global_batch", "seed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=DEFAULT_DATA, help="text files: a file, a folder or a glob (docs/**/*.md)")
    p.add_argument("--out", default="runs/train_lm", help="run folder: checkpoints, metrics, plot (runs/train_lm)")
    p.add_argument("--resume", action="store_true", help="continue from --out's latest checkpoint")
    p.add_argument("--steps", type=int, default=200, help="train until this step (200)")
    m = p.add_argument_group("model (zero_jax.models' reference transformer over bytes)")
    m.add_argument("--dim", type=int, default=128)
    m.add_argument("--depth", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--mlp", type=int, default=None, help="MLP width (4 x --dim)")
    m.add_argument("--seq", type=int, default=128, help="context length in bytes (128)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--batch-per-device", type=int, default=4, help="sequences per device per step, all microbatches")
    o.add_argument("--accum-steps", type=int, default=1, help="microbatches per step (gradient accumulation)")
    o.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (3e-3)")
    o.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine decay to --steps")
    o.add_argument("--clip-norm", type=float, default=1.0, help="global gradient-norm clip (1.0; 0: none)")
    o.add_argument("--seed", type=int, default=0, help="initialisation and data order (0)")
    z = p.add_argument_group("ZeRO (zj.ZeroPolicy)")
    z.add_argument("--stage", type=int, default=2, choices=range(4), help="ZeRO stage (2)")
    z.add_argument("--gather", choices=("all", "manual"), default="manual", help="layer-wise (manual) or whole")
    z.add_argument("--accum-mode", choices=("local", "partitioned"), default=None)
    z.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="compute dtype; bf16/fp16 keep an fp32 master copy (fp16 with a dynamic loss scale)")
    z.add_argument("--quantize-weights", choices=("int8",), default=None, help="ZeRO++ qwZ (stage 3)")
    z.add_argument("--quantize-grads", choices=("int8",), default=None, help="ZeRO++ qgZ (stages 1-3)")
    z.add_argument("--offload-optimizer", action="store_true", help="optimizer state in host memory")
    r = p.add_argument_group("run")
    r.add_argument("--devices", type=int, default=None, help="simulate this many CPU devices (testing on a laptop)")
    r.add_argument("--eval-every", type=int, default=50, help="evaluate on the held-out windows every k steps (50)")
    r.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation (4)")
    r.add_argument("--save-every", type=int, default=100, help="checkpoint every k steps (100)")
    r.add_argument("--keep", type=int, default=3, help="checkpoints kept (3)")
    r.add_argument("--pause-per-step", type=float, default=0.0, metavar="S",
                   help="sleep S seconds after each step (time to try a kill or a SIGTERM by hand; the tests do)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    r.add_argument("--no-plot", action="store_true", help="no loss-curve PNG")
    r.add_argument("--baseline", action="store_true",
                   help="also train the model with plain jax.jit + optax (stage 0) and compare step times")
    d = p.add_argument_group("several hosts (jax.distributed)")
    d.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first")
    d.add_argument("--coordinator", help="host:port of process 0 (auto-detected under SLURM / MPI / TPU)")
    d.add_argument("--num-processes", type=int)
    d.add_argument("--process-id", type=int)
    args = p.parse_args(argv)
    for name in ("steps", "dim", "depth", "heads", "seq", "batch_per_device", "accum_steps", "eval_every",
                 "eval_batches", "save_every", "keep"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}.")
    return args


# -- data: bytes, windows, grain -------------------------------------------------------------


def text_files(path: str) -> list[Path]:
    """The files ``--data`` names, sorted (a file, a folder's files recursively, or a glob)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    if not files:
        raise ValueError(NO_DATA.format(path=path))
    return files


def read_corpus(path: str) -> np.ndarray:
    """Every file's bytes, joined by a blank line: uint8 tokens. A NUL byte or
    invalid UTF-8 is a binary file: one error naming it."""
    parts = []
    files = text_files(path)
    if not files:
        raise ValueError(NO_TEXT.format(path=path, skipped="an empty folder"))
    for f in files:
        raw = f.read_bytes()
        nul = raw.find(b"\0")
        if nul >= 0:
            raise ValueError(BINARY.format(path=path, file=f, why=f"a NUL byte at offset {nul}"))
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(BINARY.format(path=path, file=f, why=f"invalid UTF-8 at byte {e.start}")) from None
        parts.append(raw)
    if not any(parts):
        raise ValueError(NO_TEXT.format(path=path, skipped=f"{len(files)} empty file(s)"))
    return np.frombuffer(b"\n\n".join(parts), np.uint8)


def datasets(tokens: np.ndarray, args: argparse.Namespace, global_batch: int) -> tuple[Any, np.ndarray]:
    """The training pipeline (an endless grain ``MapDataset`` of global batches)
    and the held-out windows (int32, shape (n, seq + 1))."""
    n = (len(tokens) - 1) // args.seq
    held_out = max(1, n // 20)
    if n - held_out < global_batch:
        raise ValueError(TOO_SMALL.format(
            path=args.data, n_bytes=len(tokens), windows=max(0, n - held_out), seq=args.seq, batch=global_batch,
            per=args.batch_per_device, devices=global_batch // args.batch_per_device, accum=args.accum_steps))
    windows = np.lib.stride_tricks.sliding_window_view(tokens, args.seq + 1)[: n * args.seq : args.seq]
    train = windows[: n - held_out]
    import grain  # noqa: PLC0415 - the example's dependency (pip install 'zero_jax[examples]')

    ds = (
        grain.MapDataset.range(len(train))
        .shuffle(seed=args.seed)  # a fresh permutation each epoch (after repeat)
        .repeat(None)
        .map(lambda i: train[i].astype(np.int32))
        .batch(global_batch, drop_remainder=True)
    )
    return ds, windows[n - held_out :].astype(np.int32)


def my_rows(batch: np.ndarray) -> np.ndarray:
    """This process's rows of the global batch (all of it on one host)."""
    import jax  # noqa: PLC0415

    return np.split(batch, jax.process_count())[jax.process_index()]


# -- the run folder --------------------------------------------------------------------------


def write_json(path: Path, obj: Any) -> None:
    """Atomically (a killed writer leaves the old file or none)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def check_resumable(out: Path, run: dict[str, Any]) -> None:
    """A resumed run must be the same model on the same data order; another
    stage, device count, precision or accumulation mode is restored across."""
    old = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else None
    if old is None:
        return
    model = [f"--{k} {old.get(k)} there, {run[k]} here" for k in MODEL_KEYS if old.get(k) != run[k]]
    if model:
        raise ValueError(OTHER_MODEL.format(out=out, diff="; ".join(model)))
    data = [f"{k} {old.get(k)!r} there, {run[k]!r} here" for k in DATA_KEYS if old.get(k) != run[k]]
    if data:
        raise ValueError(OTHER_DATA.format(out=out, diff="; ".join(data)))


def resume_step(mgr: Any, out: Path) -> int:
    """The newest checkpoint step whose data state was written too."""
    steps = [s for s in mgr.all_steps() if (out / "data" / f"{s}.json").exists()]
    if not steps:
        raise ValueError(NOTHING_TO_RESUME.format(ckpt=mgr.directory))
    return steps[-1]


def restore(mgr: Any, out: Path, b: dict[str, Any]) -> Any:
    """The newest checkpoint with its data state, laid out for this run's policy (another stage or
    device count is restored across); a corrupt step falls back to the one before, with a warning."""
    zj = b["zj"]
    try:
        return mgr.restore(policy=b["policy"], tx=b["tx"], step=resume_step(mgr, out), like=b["params"],
                           fallback=True)
    except zj.checkpoint.CorruptCheckpointError:
        raise
    except ValueError as e:  # zj.restore lists every differing leaf: its first sentence, and the fix
        first = str(e).splitlines()[0].split(" All ")[0]
        raise ValueError(f"--resume: {first} Pass the flags it was trained with, or a new --out.") from None


def digest(tree: Any) -> str:
    """A CRC of every leaf's bytes, in tree order (equal only if bitwise equal)."""
    import jax  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415

    crc = 0
    for leaf in jax.tree.leaves(tree):
        host = multihost_utils.process_allgather(leaf, tiled=True) if jax.process_count() > 1 else leaf
        crc = zlib.crc32(np.ascontiguousarray(np.asarray(host)).tobytes(), crc)
    return f"{crc:08x}"


# -- training --------------------------------------------------------------------------------


def start_jax(args: argparse.Namespace) -> Any:
    import jax  # noqa: PLC0415

    if args.devices:  # before anything starts a backend
        jax.config.update("jax_num_cpu_devices", args.devices)
        jax.config.update("jax_platforms", "cpu")
    if args.distributed:
        kw = {"coordinator_address": args.coordinator, "num_processes": args.num_processes,
              "process_id": args.process_id}
        jax.distributed.initialize(**{k: v for k, v in kw.items() if v is not None})
    return jax


def build(args: argparse.Namespace, jax: Any) -> dict[str, Any]:
    """Mesh, policy, model, optimizer and train step, from the flags."""
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import zero_jax as zj  # noqa: PLC0415
    from zero_jax.models import TransformerConfig, init_params, make_loss_fn  # noqa: PLC0415

    devices = jax.devices()
    if jax.process_count() > 1:  # one replica per host, ZeRO within it (HSDP)
        mesh = jax.sharding.Mesh(np.asarray(devices).reshape(jax.process_count(), -1), ("replica", "data"))
        hybrid = {"replica_axis": "replica"}
    else:
        mesh, hybrid = jax.make_mesh((len(devices),), ("data",)), {}
    compute = {"fp32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}[args.precision]
    precision = zj.Precision(compute_dtype=compute,
                             loss_scale=zj.DynamicLossScale() if args.precision == "fp16" else None)
    policy = zj.ZeroPolicy(
        args.stage, mesh, "data", **hybrid, stacked="layers", precision=precision,
        quantize_weights=args.quantize_weights, quantize_grads=args.quantize_grads,
        offload_optimizer=args.offload_optimizer,
    )
    cfg = TransformerConfig(vocab=VOCAB, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq,
                            mlp=args.mlp)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, args.steps // 2), args.steps,
                                                  end_value=args.lr / 10)
    optimizer = optax.adamw(schedule, b2=0.95, weight_decay=0.1)
    tx = zj.shard_optimizer(optimizer, policy)
    manual = args.gather == "manual"
    step = zj.make_train_step(
        make_loss_fn(cfg, policy if manual else None), tx, policy, gather=args.gather,
        accum_steps=args.accum_steps, accum_mode=args.accum_mode, clip_norm=args.clip_norm or None,
    )
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(args.seed))
    loss_fn = make_loss_fn(cfg)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    evaluate = jax.jit(loss_fn, out_shardings=replicated)
    return {"zj": zj, "cfg": cfg, "policy": policy, "tx": tx, "step": step, "params": params,
            "optimizer": optimizer, "loss_fn": loss_fn, "evaluate": evaluate, "mesh": mesh}


class Logger:
    """metrics.jsonl (process 0) and the rich progress bar."""

    def __init__(self, out: Path, total: int, start: int, quiet: bool) -> None:
        import jax  # noqa: PLC0415

        self.main = jax.process_index() == 0
        self.file = open(out / "metrics.jsonl", "a") if self.main else None  # noqa: SIM115 - closed in close()
        self.bar = None
        if self.main and not quiet:
            from rich.progress import (  # noqa: PLC0415
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  {task.fields[speed]}"),
                                TimeElapsedColumn(), TimeRemainingColumn())
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=start, loss="-", eval="-", speed="")

    def log(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.bar is not None:
            if record["kind"] == "train":
                speed = f"{1e3 * record['step_s']:.0f} ms/step"
                self.bar.update(self.task, completed=record["step"], loss=f"{record['loss']:.3f}", speed=speed)
            elif record["kind"] == "eval":
                self.bar.update(self.task, eval=f"{record['eval_loss']:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.file is not None:
            self.file.close()


def run_eval(b: dict[str, Any], state: Any, held_out: np.ndarray, args: argparse.Namespace, jax: Any) -> float:
    """Mean loss over the first ``--eval-batches`` held-out batches (whole parameters)."""
    zj, policy = b["zj"], b["policy"]
    params = zj.full_params(state)
    rows = args.batch_per_device * jax.device_count()
    losses = []
    for i in range(args.eval_batches):
        idx = np.arange(i * rows, (i + 1) * rows) % len(held_out)
        batch = zj.shard_batch({"tokens": my_rows(held_out[idx])}, policy)
        losses.append(float(b["evaluate"](params, batch)))
    return float(np.mean(losses))


def train(args: argparse.Namespace) -> int:  # house: the example's loop, kept in one piece to read top to bottom
    tokens = read_corpus(args.data)  # bad --data fails here, before JAX starts
    jax = start_jax(args)
    main = jax.process_index() == 0
    out = Path(args.out).resolve()
    global_batch = args.batch_per_device * jax.device_count()
    ds, held_out = datasets(tokens, args, global_batch)
    b = build(args, jax)
    zj, policy, cfg = b["zj"], b["policy"], b["cfg"]
    run = {"data": args.data, "global_batch": global_batch, **{k: getattr(args, k) for k in (
        *MODEL_KEYS, "batch_per_device", "accum_steps", "seed", "stage", "gather", "precision")}}
    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    ckpt = out / "ckpt"
    with zj.CheckpointManager(ckpt, max_to_keep=args.keep, save_on_preemption=True) as mgr:
        data = iter(ds)
        if args.resume:
            check_resumable(out, run)
            state = restore(mgr, out, b)
            data.set_state(json.loads((out / "data" / f"{int(state.step)}.json").read_text()))
        else:
            if mgr.all_steps():
                raise ValueError(EXISTS.format(out=out))
            if main:  # a fresh run: no metrics of an earlier attempt that saved nothing
                (out / "metrics.jsonl").unlink(missing_ok=True)
            state = zj.init_state(b["params"], b["tx"], policy)
        if main:
            write_json(out / "run.json", run)
            print(f"train_lm: {cfg.num_params():,} parameters (dim {cfg.dim}, depth {cfg.depth}), ZeRO-{args.stage} "
                  f"{args.gather} gathers, {args.precision}, {jax.device_count()} {jax.devices()[0].platform} "
                  f"devices x {jax.process_count()} process(es), global batch {global_batch} x {args.seq} bytes, "
                  f"{len(tokens):,} bytes of text", flush=True)
            if args.resume:
                print(f"train_lm: resumed from step {int(state.step)} of {ckpt}", flush=True)
        start = int(state.step)
        logger = Logger(out, args.steps, start, args.no_progress)
        times: list[float] = []
        try:
            while int(state.step) < args.steps:
                global_tokens = next(data)
                batch = zj.shard_batch({"tokens": my_rows(global_tokens)}, policy)
                t0 = time.perf_counter()
                state, metrics = b["step"](state, batch)
                loss = float(metrics["loss"])  # waits for the step
                times.append(time.perf_counter() - t0)
                i = int(state.step)
                logger.log({"kind": "train", "step": i, "loss": loss, "step_s": times[-1],
                            "data": f"{zlib.crc32(global_tokens.tobytes()):08x}"})
                if i % args.eval_every == 0 or i == args.steps:
                    logger.log({"kind": "eval", "step": i, "eval_loss": run_eval(b, state, held_out, args, jax)})
                if i % args.save_every == 0 or i == args.steps:
                    if main:
                        write_json(out / "data" / f"{i}.json", data.get_state())
                    mgr.save(state)
                time.sleep(args.pause_per_step)
                if mgr.save_if_preempted(state):  # SIGTERM: this step is saved (and waited for); stop
                    if main:
                        write_json(out / "data" / f"{i}.json", data.get_state())
                    logger.log({"kind": "preempted", "step": i})
                    return 0
        finally:
            logger.close()
        mgr.wait()
        final = {"kind": "final", "step": int(state.step), "params": digest(state.params),
                 "opt_state": digest(state.opt_state), "master": digest(state.master)}
        logger = Logger(out, args.steps, args.steps, True)
        logger.log(final)
        if times:
            steady = sorted(times[1:]) or times
            logger.log({"kind": "summary", "median_step_s": steady[len(steady) // 2], "steps": len(times)})
        logger.close()
    if main:
        report(out, args, times)
    if args.baseline:
        baseline(args, b, ds, jax, times)
    return 0


def report(out: Path, args: argparse.Namespace, times: list[float]) -> None:
    """Print the first and last losses, and draw the loss curve (matplotlib)."""
    train_rows: dict[int, float] = {}
    evals: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "train":
            train_rows[r["step"]] = r["loss"]  # the last line per step: a resumed run re-logs steps after a kill
        elif r["kind"] == "eval":
            evals[r["step"]] = r["eval_loss"]
    steps = sorted(train_rows)
    if steps:
        first, last = train_rows[steps[0]], train_rows[steps[-1]]
        median = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else math.nan
        print(f"train_lm: loss {first:.4f} (step {steps[0]}) -> {last:.4f} (step {steps[-1]}); "
              f"eval {evals[max(evals)]:.4f}; median step {1e3 * median:.1f} ms; metrics in {out / 'metrics.jsonl'}",
              flush=True)
    if args.no_plot:
        return
    try:
        import matplotlib  # noqa: PLC0415 - optional

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("train_lm: matplotlib is not installed: no loss plot (pip install matplotlib).")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [train_rows[s] for s in steps], lw=1, label="train")
    ax.plot(sorted(evals), [evals[s] for s in sorted(evals)], "o-", label="held out")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title=f"ZeRO-{args.stage}, {args.precision}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    print(f"train_lm: loss curve in {out / 'loss.png'}", flush=True)


def baseline(args: argparse.Namespace, b: dict[str, Any], ds: Any, jax: Any, zero_times: list[float]) -> None:
    """The same model, optimizer and batches with plain ``jax.jit`` + optax:
    everything replicated, the batch split across the devices (stage 0)."""
    import optax  # noqa: PLC0415

    P = jax.sharding.PartitionSpec
    mesh = b["policy"].auto_mesh  # plain jit: the mesh's axes Auto (jax.make_mesh makes them Explicit)
    rows = jax.sharding.NamedSharding(mesh, P(mesh.axis_names))
    whole = jax.sharding.NamedSharding(mesh, P())
    optimizer = optax.chain(optax.clip_by_global_norm(args.clip_norm), b["optimizer"]) if args.clip_norm else b[
        "optimizer"]
    params = jax.device_put(b["params"], whole)
    opt_state = jax.device_put(optimizer.init(params), whole)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(b["loss_fn"])(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = iter(ds)
    times = []
    for _ in range(min(50, max(len(zero_times), 5))):  # a median needs no more
        batch = {"tokens": jax.device_put(next(data), rows)}
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
        times.append(time.perf_counter() - t0)
    med = sorted(times[1:])[len(times[1:]) // 2]
    zmed = sorted(zero_times[1:])[len(zero_times[1:]) // 2] if len(zero_times) > 1 else math.nan
    print(f"train_lm --baseline: median step {1e3 * zmed:.2f} ms with zero_jax (ZeRO-{args.stage}, {args.gather}), "
          f"{1e3 * med:.2f} ms with plain jax.jit + optax ({len(times)} steps, first (compile) left out); "
          f"ratio {zmed / med:.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return train(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"train_lm.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
