"""Communication buffers of a layer-wise ZeRO-3 step, unbounded and with ``ZeroPolicy(bucket_bytes=...)``
(issue 28, C_B), and its fragmentation (M_D).

Run: ``python benchmarks/buckets.py`` (the bounds; libtpu installed for the TPU rows: ``pip install -e
".[test]"``): the reference transformer (vocab 256, dim 256, heads 4, seq 64, f32, Adam), stage 3
``gather="manual"`` on 8 devices, unscanned (``zj.apply_layers``) at depth 4 and 8 and scanned
(``zj.scan_layers``) at depth 32, compiled on XLA:CPU, on the TPU compiler for v5p:2x2x2 and on XLA:GPU for
1 x 8 H100 (the CUDA plugin installed), without and with ``bucket_bytes`` of 1, 4 and 64 MiB, and read by
``zj.audit``: collectives per block, the largest communication buffer (post-SPMD and compiled), the buffers
over the bound, the bytes on the wire against the theory; and on CPU, the parameters after 2 steps with and
without a bound (bitwise). Writes ``benchmarks/results/buckets.{txt,json}``.

``python benchmarks/buckets.py --measured`` (about 2-3 minutes on 2 loaded cores): the first measurement,
before the bound existed. The reference transformer (``zero_jax.models``, small dims),
unscanned (``zj.apply_layers`` over a Python list of blocks), stage 3 ``gather="manual"`` on 8 devices,
at depth 4 and 8, compiled on XLA:CPU and on the TPU compiler for v5p:2x2x2 (deviceless: nothing runs)
and read by ``zj.audit``: per block the collectives it runs per step by kind (the post-SPMD program,
and the compiled ops the backend launches: a combined op once), the largest single communication
buffer of the step in each program, and the allocated device memory beside XLA's live peak.

That writes ``benchmarks/results/buckets_measured.txt`` (the table, the command, the machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, unstack_params  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dict(vocab=256, dim=128, heads=4, seq=64)
DEPTHS = (4, 8)
BACKENDS = ("cpu", "tpu v5p:2x2x2", "gpu h100:1x8")


def mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def audited(backend: str, depth: int) -> zj.AuditReport:
    """The unscanned reference transformer at stage 3, layer-wise, audited on abstract inputs."""
    if backend == "cpu":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    else:
        mesh = zj.topology_mesh(backend.split()[-1])
    cfg = TransformerConfig(depth=depth, **MODEL)
    policy = zj.ZeroPolicy(3, mesh)
    params = jax.eval_shape(lambda: unstack_params(init_params(cfg, jax.random.key(0))))
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    batch = {"tokens": jax.ShapeDtypeStruct((16, cfg.seq + 1), jnp.int32, sharding=policy.batch_sharding())}
    return zj.audit(step, state, batch, grads=False)


def kinds(counts: Any) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "-"


def rows(backend: str, depth: int, report: zj.AuditReport, seconds: float) -> list[str]:
    """The figures of one compile, as text."""
    b, m = report.buffers, report.memory
    blocks = [blk for blk in b.blocks if blk.name.startswith("block ")]
    same = all((x.post_spmd, x.compiled) == (blocks[0].post_spmd, blocks[0].compiled) for x in blocks)
    out = [f"{backend}, depth {depth} ({seconds:.0f} s to compile and audit):"]
    if same:
        out.append(f"  each of the {len(blocks)} blocks per step: post-SPMD {kinds(blocks[0].post_spmd)}; "
                   f"compiled ops {kinds(blocks[0].compiled)}")  # fmt: skip
    else:
        out += [f"  {x.name}: post-SPMD {kinds(x.post_spmd)}; compiled ops {kinds(x.compiled)}" for x in blocks]
    out += [f"  {x.name}: post-SPMD {kinds(x.post_spmd)}; compiled ops {kinds(x.compiled)}"
            for x in b.blocks if not x.name.startswith("block ")]  # fmt: skip
    for program in ("post-SPMD", "compiled"):
        big = b.largest(program)
        if big is not None:
            out.append(f"  largest buffer ({program}): {mib(big.bytes)} = {big.kind} '{big.name}' "
                       f"({big.shape_text}; {big.block})")  # fmt: skip
    out.append(f"  memory: allocated {mib(m['allocated'])}, XLA live peak {mib(m['live_peak'])}, "
               f"allocated / live peak {m['fragmentation']:.3f}")  # fmt: skip
    return out


def measured() -> None:
    started = time.perf_counter()
    lines = [
        "Communication buffers and fragmentation: the reference transformer "
        f"({', '.join(f'{k}={v}' for k, v in MODEL.items())}, f32, Adam), unscanned (zj.apply_layers), stage 3 "
        "gather='manual', prefetch 1, N = 8, batch 16; zj.audit of each compile.",
        "",
    ]
    for backend in BACKENDS:
        for depth in DEPTHS:
            t = time.perf_counter()
            report = audited(backend, depth)
            block = rows(backend, depth, report, time.perf_counter() - t)
            print("\n".join(block), flush=True)
            lines += [*block, ""]
    lines += [
        f"command: python {shlex.join(sys.argv)}",
        f"machine: {platform.platform()}, {os.cpu_count()} cores, jax {jax.__version__}, "
        f"{datetime.date.today().isoformat()}, {time.perf_counter() - started:.0f} s in all",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "buckets_measured.txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / 'buckets_measured.txt'}")


# -- the bounds ---------------------------------------------------------------------------------------

BOUND_MODEL = dict(vocab=256, dim=256, heads=4, seq=64)
BOUNDS = (None, 2**20, 4 * 2**20, 64 * 2**20)
#: (layer primitive, depth): apply_layers unrolls (the combiner sees every block), scan_layers loops.
SHAPES = (("apply_layers", 4), ("apply_layers", 8), ("scan_layers", 32))


def bounded_step(backend: str, layers: str, depth: int, bound: int | None) -> tuple[Any, Any, Any, Any]:
    """The reference transformer's stage-3 layer-wise step, its abstract state and batch, and its config."""
    if backend == "cpu":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    else:
        mesh = zj.topology_mesh(backend.split()[-1])
    cfg = TransformerConfig(depth=depth, **BOUND_MODEL)
    stacked = layers == "scan_layers"
    policy = zj.ZeroPolicy(3, mesh, bucket_bytes=bound, stacked="layers" if stacked else ())
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    params = params if stacked else jax.eval_shape(unstack_params, params)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    batch = {"tokens": jax.ShapeDtypeStruct((16, cfg.seq + 1), jnp.int32, sharding=policy.batch_sharding())}
    return step, state, batch, cfg


def bound_row(backend: str, layers: str, depth: int, bound: int | None) -> dict[str, Any]:
    """One compile, audited: the figures of one row."""
    t = time.perf_counter()
    step, state, batch, _ = bounded_step(backend, layers, depth, bound)
    report = zj.audit(step, state, batch, grads=False)
    b = report.buffers
    block = next(x for x in b.blocks if x.name.startswith(("block 0", "loop")))
    post, comp = b.largest("post-SPMD"), b.largest("compiled")
    over = [v for v in report.violations if v.subject.startswith(("post-SPMD:", "compiled:"))]
    return {
        "backend": backend, "layers": layers, "depth": depth, "bucket_bytes": bound,
        "compiler_options": dict(step.compiler_options or {}),
        "block": block.name, "block_post_spmd": dict(block.post_spmd), "block_compiled": dict(block.compiled),
        "largest_post_spmd": post.bytes, "largest_compiled": comp.bytes if comp else None,
        "largest_compiled_what": f"{comp.kind} '{comp.name}' ({comp.shape_text}; {comp.block})" if comp else "",
        "largest_compiled_members": len(comp.shapes) if comp else 0,
        "over_bound": len(over), "ring_bytes": report.comm.measured, "theory": report.comm.theory,
        "ratio": report.comm.ratio, "seconds": time.perf_counter() - t,
    }  # fmt: skip


def bound_text(r: dict[str, Any]) -> str:
    bound = "unbounded" if r["bucket_bytes"] is None else f"bucket {r['bucket_bytes'] // 2**20} MiB"
    comp = "-" if r["largest_compiled"] is None else mib(r["largest_compiled"])
    return (
        f"{r['backend']:<15} {r['layers']:<12} {r['depth']:>5} {bound:<14} "
        f"{kinds(r['block_compiled']):<46} {mib(r['largest_post_spmd']):>10} {comp:>10} {r['over_bound']:>5} "
        f"{r['ring_bytes'] / 2**20:>9.3f} {r['ratio']:>7.4f} {r['seconds']:>5.0f}"
    )


def parity(depth: int = 4, steps: int = 2) -> bool:
    """On XLA:CPU: whether the parameters after ``steps`` steps are bitwise the same with a 1 MiB bound."""
    finals = []
    for bound in (None, 2**20):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        cfg = TransformerConfig(depth=depth, **BOUND_MODEL)
        policy = zj.ZeroPolicy(3, mesh, bucket_bytes=bound)
        params = unstack_params(init_params(cfg, jax.random.key(0)))
        tx = zj.shard_optimizer(optax.adam(1e-3), policy)
        state = zj.init_state(params, tx, policy)
        step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
        tokens = jax.random.randint(jax.random.key(1), (16, cfg.seq + 1), 0, cfg.vocab)
        for _ in range(steps):
            state, _ = step(state, {"tokens": tokens})
        finals.append([np.asarray(x) for x in jax.tree.leaves(state.params)])
    return all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(*finals, strict=True))


def bounds() -> None:
    """The table, written again after each row (a long run leaves what it measured)."""
    started = time.perf_counter()
    head = (f"{'backend':<15} {'layers':<12} {'depth':>5} {'bound':<14} "
            f"{'compiled ops per block (block 0 / loop)':<46} {'post-SPMD':>10} {'compiled':>10} {'over':>5} "
            f"{'ring MiB':>9} {'/theory':>7} {'s':>5}")  # fmt: skip
    intro = [
        "Communication buffers with ZeroPolicy(bucket_bytes=...): the reference transformer "
        f"({', '.join(f'{k}={v}' for k, v in BOUND_MODEL.items())}, f32, Adam), stage 3 gather='manual', prefetch 1, "
        "N = 8, batch 16; zj.audit of each compile. Columns: the compiled ops one block runs per step (of a scan: "
        "the loop's, all layers), the largest buffer of the post-SPMD and of the compiled program, the buffers over "
        "the bound (combined ones; a single tensor larger goes alone), ring bytes per device per step and their "
        "ratio to the theory, seconds to compile and audit.",
        "",
    ]
    same = parity()
    notes = [f"XLA:CPU parity (apply_layers depth 4, 2 steps, bucket 1 MiB vs unbounded): parameters bitwise "
             f"{'identical' if same else 'DIFFERENT'}"]  # fmt: skip
    print(notes[0], "\n" + head, flush=True)
    rows: list[dict[str, Any]] = []
    table = [head]
    for backend in (*BACKENDS[1:], BACKENDS[0]):  # the TPU and GPU compilers' rows first: they are the ones that differ
        for layers, depth in SHAPES:
            for bound in BOUNDS:
                rows.append(bound_row(backend, layers, depth, bound))
                table.append(bound_text(rows[-1]))
                print(table[-1], flush=True)
                options = {b: {k: v for r in rows if r["backend"] == b for k, v in r["compiler_options"].items()
                               if "combine" in k} for b in BACKENDS if b != "cpu"}  # fmt: skip
                tail = [
                    "compiler options a bound adds (the last bounded row's, per backend): "
                    + "; ".join(f"{b}: {o or '-'}" for b, o in options.items()) + "; on XLA:CPU: none",
                    "",
                    f"command: python {shlex.join(sys.argv)}",
                    f"machine: {platform.platform()}, {os.cpu_count()} cores, jax {jax.__version__}, "
                    f"{datetime.date.today().isoformat()}, {time.perf_counter() - started:.0f} s in all "
                    f"({len(rows)} of {len(BACKENDS) * len(SHAPES) * len(BOUNDS)} compiles)",
                ]
                RESULTS.mkdir(exist_ok=True)
                (RESULTS / "buckets.txt").write_text("\n".join(intro + table + ["", *notes, *tail]) + "\n")
                record = {"model": BOUND_MODEL, "rows": rows, "parity_bitwise": same,
                          "command": shlex.join(sys.argv), "machine": tail[-1]}  # fmt: skip
                (RESULTS / "buckets.json").write_text(json.dumps(record, indent=1) + "\n")
        table.append("")
    print(f"wrote {RESULTS / 'buckets.txt'} and .json")


if __name__ == "__main__":
    measured() if "--measured" in sys.argv[1:] else bounds()
