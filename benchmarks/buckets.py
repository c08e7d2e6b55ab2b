"""Communication buffers and fragmentation of a layer-wise ZeRO-3 step, measured (issue 28, C_B and M_D).

Run: ``python benchmarks/buckets.py`` (about 2-3 minutes on 2 loaded cores; libtpu installed for the
TPU rows: ``pip install -e ".[test]"``). The reference transformer (``zero_jax.models``, small dims),
unscanned (``zj.apply_layers`` over a Python list of blocks), stage 3 ``gather="manual"`` on 8 devices,
at depth 4 and 8, compiled on XLA:CPU and on the TPU compiler for v5p:2x2x2 (deviceless: nothing runs)
and read by ``zj.audit``: per block the collectives it runs per step by kind (the post-SPMD program,
and the compiled ops the backend launches: a combined op once), the largest single communication
buffer of the step in each program, and the allocated device memory beside XLA's live peak.

Writes ``benchmarks/results/buckets_measured.txt`` (the table, the command, the machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import datetime  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, unstack_params  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = dict(vocab=256, dim=128, heads=4, seq=64)
DEPTHS = (4, 8)
BACKENDS = ("cpu", "tpu v5p:2x2x2")


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


def main() -> None:
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


if __name__ == "__main__":
    main()
