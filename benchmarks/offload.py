"""Offload (``ZeroPolicy(offload_optimizer=..., offload_params=...)``): device bytes, host bytes, step time.

Run: ``python benchmarks/offload.py`` (8 simulated CPU devices in one process; about a minute on
2 cores). It prints one table and writes it, with the command and the machine, to
``benchmarks/results/offload.txt`` and the raw numbers to ``offload.json``.

The model is the reference transformer (``zero_jax.models``: vocab 256, dim 256, depth 4, 4 heads,
seq 64, MLP 1024, fp32), trained with Adam on a global batch of 16 sequences (2 per device) over
a mesh of N = 8 devices, ``gather="manual"`` (``scan_layers``), ``stacked="layers"``. Variants:
stages 1 and 3, each with ``offload_optimizer`` 0, 0.5 and 1, and stage 3 with
``offload_params=True`` as well.

Measured for each variant:

* **state bytes per device, by memory kind**: ``shard.data.nbytes`` of every state leaf, summed
  per device and per its sharding's ``memory_kind`` (``device`` / ``pinned_host``); the maximum
  over devices.
* **compiled**: ``compiled.memory_analysis()`` argument, temp and the peak estimate argument +
  output + temp - alias, and its ``host_argument_size_in_bytes``.
* **chunks**: how many chunks the update streams the offloaded state in: one per parameter whose
  master copy or Adam moments are offloaded (Adam updates each parameter from its own leaves only).
* **step time**: median of ``--steps`` steps after one warm-up, the variants taking turns.
* **bitwise**: whether the parameters after the timed steps equal the same stage's run without
  offload exactly.

On XLA:CPU "pinned_host" and "device" are the same RAM and the compiler emits no transfer for an
in-jit ``device_put`` between them, so the compiled figures and step times show what offload
costs in bookkeeping here, not what a GPU's host link costs.
"""

from __future__ import annotations

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

common.setup(devices=8)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch  # noqa: E402

VARIANTS = [
    (1, 0.0, False),
    (1, 0.5, False),
    (1, 1.0, False),
    (3, 0.0, False),
    (3, 0.5, False),
    (3, 1.0, False),
    (3, 1.0, True),
]


def name(stage: int, fraction: float, params: bool) -> str:
    return f"ZeRO-{stage} opt={fraction:g}" + (" +params" if params else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    record = common.Record()
    cfg = TransformerConfig(vocab=256, dim=256, depth=args.depth, heads=4, seq=64)
    mesh = jax.make_mesh((8,), ("data",))
    params = init_params(cfg, jax.random.key(0))
    batch = synthetic_batch(cfg, 16, jax.random.key(1))

    runs = {}
    for stage, fraction, off_params in VARIANTS:
        policy = zj.ZeroPolicy(
            stage=stage, mesh=mesh, stacked="layers", offload_optimizer=fraction, offload_params=off_params
        )
        tx = zj.shard_optimizer(optax.adam(1e-3), policy)
        state = zj.init_state(params, tx, policy)
        step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
        held = measure.resident_bytes_by_kind(state)
        compiled = step.lower(state, batch).compile()
        mem = measure.memory(compiled)
        state, _ = step(state, batch)  # warm-up (the executable above is reused)
        jax.block_until_ready(state)
        runs[(stage, fraction, off_params)] = {
            "step": step,
            "state": state,
            "times": [],
            "device": max(b for (_, kind), b in held.items() if kind == "device"),
            "host": max((b for (_, kind), b in held.items() if kind == "pinned_host"), default=0),
            "memory": mem,
            "host_argument": compiled.memory_analysis().host_argument_size_in_bytes,
            "chunks": len(common.offload_chunks(state)),
        }
    for _ in range(args.steps):
        for run in runs.values():
            t0 = time.perf_counter()
            run["state"], metrics = run["step"](run["state"], batch)
            jax.block_until_ready(run["state"])
            run["times"].append(time.perf_counter() - t0)
    finals = {k: [np.asarray(x) for x in jax.tree.leaves(zj.full_params(r["state"]))] for k, r in runs.items()}

    def mib(b: float) -> str:
        return f"{b / 2**20:8.2f}"

    header = (
        f"{'variant':<22}| state MiB/device | compiled MiB/device (CPU)  | chunks | step ms  /no-offload | bitwise\n"
        f"{'':<22}|  device     host |   arg    temp    peak  host |        |                      |"
    )
    lines = [header, "-" * len(header.splitlines()[0])]
    rows = []
    for (stage, fraction, off_params), r in runs.items():
        base = runs[(stage, 0.0, False)]
        ms = statistics.median(r["times"]) * 1e3
        base_ms = statistics.median(base["times"]) * 1e3
        pairs = zip(finals[(stage, fraction, off_params)], finals[(stage, 0.0, False)], strict=True)
        same = all(np.array_equal(a, b) for a, b in pairs)
        m = r["memory"]
        lines.append(
            f"{name(stage, fraction, off_params):<22}|{mib(r['device'])} {mib(r['host'])} |"
            f"{mib(m['argument'])}{mib(m['temp'])}{mib(m['peak'])} {r['host_argument']:4d} | {r['chunks']:6d} |"
            f" {ms:7.1f}  {ms / base_ms:5.2f}       | {'yes' if same else 'NO'}"
        )
        rows.append(
            {
                "stage": stage,
                "offload_optimizer": fraction,
                "offload_params": off_params,
                "state_device_bytes": r["device"],
                "state_host_bytes": r["host"],
                "compiled": m,
                "compiled_host_argument_bytes": r["host_argument"],
                "chunks": r["chunks"],
                "step_ms_median": ms,
                "step_ms_all": [t * 1e3 for t in r["times"]],
                "bitwise_equal_to_no_offload": same,
            }
        )
    header = record.header(
        "Offload: device bytes, host bytes and step time (benchmarks/offload.py)",
        "devices: 8 simulated cpu devices, mesh ('data',) = 8",
        f"model: transformer vocab 256, dim 256, depth {args.depth}, 4 heads, seq 64, mlp 1024, fp32 "
        f"({cfg.num_params():,} parameters), optax.adam(1e-3), global batch 16, gather='manual'; "
        f"step time: median of {args.steps} after 1 warm-up, variants taking turns",
    )
    notes = [
        "",
        "state MiB/device: measured from the arrays (shard bytes per sharding memory kind), max over devices.",
        "compiled: memory_analysis() of the compiled step. XLA:CPU counts pinned_host arguments as device",
        "arguments (host_argument_size_in_bytes is 0) and compiles in-jit transfers to nothing, so these",
        "columns do not move with offload on CPU; on GPU/TPU the offloaded bytes leave the device columns.",
    ]
    text = "\n".join([header, "", *lines, *notes])
    print(text)
    common.write_results("offload", text, {"meta": record.meta(), "rows": rows})


if __name__ == "__main__":
    main()
