"""ZeRO-R's P_a+cpu (``offload_activations=True``) on the TPU compiler: the saved block inputs in host memory.

Run: ``nice -n 15 python benchmarks/offload_activations.py`` (libtpu installed; each step is compiled for
v5p:2x2x2, N = 8 chips, with ``zj.topology_mesh``: deviceless, nothing runs). ``--dim``, ``--depth``,
``--seq``, ``--batch`` (per chip) and ``--vocab`` size the reference transformer (``zero_jax.models``,
bf16 compute, fp32 master, AdamW, stage 3 layer-wise); ``--kinds scan apply`` picks the primitives
(``zj.scan_layers`` over stacked layers, ``zj.apply_layers`` over a Python list of blocks).

For each primitive the step is compiled without and with ``offload_activations`` and read:

* **device**: the allocated HBM (the TPU compiler's buffer assignment total), the estimate argument +
  output + temp - alias of ``memory_analysis()``, its temp, and XLA's live peak;
* **host**: ``memory_analysis()``'s ``host_*`` bytes (the host temp holds the offloaded inputs);
* **the saved inputs**: depth x batch x seq x dim x 2 bytes (bf16) per chip, the activation checkpoints
  the layer-wise primitives keep for the backward recompute; the drop of device memory against them
  (the issue's goal: >= 80 % leave the device) and the host bytes against them;
* **the HLO evidence**: how many buffers of the compiled program live in host memory (``S(5)``) and the
  asynchronous host transfers (``dynamic-update-slice-start`` / ``dynamic-slice-start`` on them, and
  ``copy-start`` / ``copy-done``).

Writes ``benchmarks/results/offload_activations.txt`` and ``.json``.
"""

from __future__ import annotations

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

common.setup(devices=8)

import argparse  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, unstack_params  # noqa: E402

MiB = 2**20
TOPOLOGY = "v5p:2x2x2"
BF16 = zj.Precision(compute_dtype=jnp.bfloat16)


def build(cfg: TransformerConfig, kind: str, offload: bool, batch: int) -> tuple[Any, Any, Any]:
    """(step, abstract state, abstract batch): stage 3 layer-wise on the v5p-8 mesh."""
    mesh = zj.topology_mesh(TOPOLOGY)
    unscanned = kind == "apply"
    make = (lambda: unstack_params(init_params(cfg, jax.random.key(0)))) if unscanned else (
        lambda: init_params(cfg, jax.random.key(0)))  # fmt: skip
    policy = zj.ZeroPolicy(3, mesh, stacked=() if unscanned else "layers", precision=BF16,
                           offload_activations=offload)  # fmt: skip
    tx = zj.shard_optimizer(optax.adamw(1e-4), policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    tokens = jax.ShapeDtypeStruct((batch * mesh.size, cfg.seq + 1), jnp.int32, sharding=policy.batch_sharding())
    return step, zj.init_state(jax.eval_shape(make), tx, policy), {"tokens": tokens}


def hlo_evidence(text: str) -> dict[str, int]:
    """Host-memory buffers (``S(5)``) and the asynchronous transfers of the compiled TPU program."""
    lines = text.splitlines()
    host_defs = [ln for ln in lines if re.search(r"= \S*S\(5\)\S* ", ln)]
    return {
        "host_buffers": len(host_defs),
        "host_dus_start": sum(" dynamic-update-slice-start(" in ln and "S(5)" in ln for ln in lines),
        "host_ds_start": sum(" dynamic-slice-start(" in ln and "S(5)" in ln for ln in lines),
        "copy_start": sum(" copy-start(" in ln for ln in lines),
        "copy_done": sum(" copy-done(" in ln for ln in lines),
    }


def in_flight(text: str) -> list[dict[str, Any]]:
    """Each asynchronous host transfer of the compiled program (a ``dynamic-update-slice-start`` into, or a
    ``dynamic-slice-start`` from, a host buffer): its computation and the fusions scheduled between its start
    and its done (the compute it overlaps)."""
    lines, found, computation = text.splitlines(), [], ""
    for i, line in enumerate(lines):
        head = re.match(r"^(ENTRY )?(%\S+) .*\{$", line)
        if head and " = " not in line:
            computation = head.group(2)
        start = re.match(r"\s*(%\S+) = .* (dynamic-update-slice-start|dynamic-slice-start)\(", line)
        if not start or "S(5)" not in line:
            continue
        done = next(j for j in range(i + 1, len(lines)) if f"-done({start.group(1)})" in lines[j])
        fusions = sum(bool(re.search(r" (fusion|convolution)\(", b)) for b in lines[i + 1 : done])
        found.append({"computation": computation, "kind": start.group(2), "fusions_in_flight": fusions})
    return found


def measure_one(cfg: TransformerConfig, kind: str, offload: bool, batch: int,
                options: dict[str, str], switches: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    with measure.trying_schedule(**switches):  # traced in the block: the switches reach the layer primitives
        step, state, tokens = build(cfg, kind, offload, batch)
        t = time.perf_counter()
        done = measure.compile_with_dump(step.lower(state, tokens), {**step.compiler_options, **options})
    mem = common.memory(done.executable)
    row = {"kind": kind, "offload_activations": offload, "compile_s": round(time.perf_counter() - t, 1),
           "allocated": done.allocated, "live_peak": done.live_peak.bytes if done.live_peak else None, **mem,
           **hlo_evidence(done.executable.as_text()), "in_flight": in_flight(done.executable.as_text())}  # fmt: skip
    return row


def saved_bytes(cfg: TransformerConfig, batch: int) -> int:
    """Per chip: the block inputs the layer-wise primitives keep for the recompute (bf16)."""
    return cfg.depth * batch * cfg.seq * cfg.dim * 2


def table(cfg: TransformerConfig, batch: int, rows: list[dict[str, Any]]) -> list[str]:
    saved = saved_bytes(cfg, batch)
    out = [f"{'variant':<26}{'allocated':>11}{'arg+out+temp-alias':>20}{'temp':>10}{'live peak':>11}"
           f"{'host temp':>11}{'host S(5) bufs':>15}{'compile':>9}"]  # fmt: skip
    for r in rows:
        name = f"{r['kind']}, offload {'on' if r['offload_activations'] else 'off'}"
        live = f"{r['live_peak'] / MiB:.1f}" if r["live_peak"] else "-"
        alloc = f"{r['allocated'] / MiB:.1f}" if r["allocated"] else "-"
        out.append(f"{name:<26}{alloc:>11}{r['peak'] / MiB:>20.1f}{r['temp'] / MiB:>10.1f}{live:>11}"
                   f"{r['host_temp'] / MiB:>11.1f}{r['host_buffers']:>15}{r['compile_s']:>8.0f}s")  # fmt: skip
    out.append("(MiB per chip)")
    out.append(
        f"saved block inputs: {cfg.depth} x {batch} x {cfg.seq} x {cfg.dim} x 2 B = {saved / MiB:.1f} MiB per chip"
    )
    for kind in dict.fromkeys(r["kind"] for r in rows):
        pair = {r["offload_activations"]: r for r in rows if r["kind"] == kind}
        if set(pair) != {False, True}:
            continue
        off, on = pair[False], pair[True]
        drops = {"allocated": (off["allocated"] or 0) - (on["allocated"] or 0),
                 "arg+out+temp-alias": off["peak"] - on["peak"], "temp": off["temp"] - on["temp"]}  # fmt: skip
        if off["live_peak"] and on["live_peak"]:
            drops["live peak"] = off["live_peak"] - on["live_peak"]
        shown = ", ".join(f"{k} {v / MiB:.1f} MiB ({v / saved:.0%} of the saved inputs)" for k, v in drops.items())
        out.append(f"{kind}: device drop with offload_activations: {shown}")
        out.append(f"{kind}: host temp {on['host_temp'] / MiB:.1f} MiB = {on['host_temp'] / saved:.0%} of the saved "
                   f"inputs; transfers: {on['host_dus_start']} async writes to host, {on['host_ds_start']} async "
                   f"reads from host, {on['copy_start']} copy-start")  # fmt: skip
        for t in on["in_flight"]:
            out.append(f"  {t['kind']} in {t['computation']}: {t['fusions_in_flight']} fusions scheduled in flight")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1, help="sequences per chip")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kinds", nargs="+", default=["scan"], choices=["scan", "apply"])
    parser.add_argument("--name", default="offload_activations")
    parser.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a TPU compiler option on top of the step's own, for both variants")  # fmt: skip
    parser.add_argument("--hold-host-copies", type=int, default=None,
                        help="the schedule's hold_host_copies, tried (zj.measure.trying_schedule)")  # fmt: skip
    args = parser.parse_args()
    switches = {} if args.hold_host_copies is None else {"hold_host_copies": args.hold_host_copies}
    options = dict(o.split("=", 1) for o in args.compiler_option)
    record = common.Record()
    cfg = TransformerConfig(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq)
    rows = []
    for kind in args.kinds:
        for offload in (False, True):
            rows.append(measure_one(cfg, kind, offload, args.batch, options, switches))
            print(rows[-1], flush=True)
    lines = table(cfg, args.batch, rows)
    text = record.header(
        "P_a+cpu (offload_activations) on the TPU compiler, deviceless",
        f"slice: {TOPOLOGY} (N = 8 chips), stage 3 layer-wise, bf16 compute, fp32 master, AdamW",
        f"model: the reference transformer, vocab {cfg.vocab}, dim {cfg.dim}, depth {cfg.depth}, heads {cfg.heads}, "
        f"seq {cfg.seq}, batch {args.batch} per chip",
        *([f"compiler options on top of the step's: {options}"] if options else []),
        *([f"schedule switches tried: {switches}"] if switches else []),
        "",
        *lines,
    )
    print(text)
    common.write_results(args.name, text, {"meta": record.meta(), "config": vars(args), "rows": rows,
                                           "saved_bytes": saved_bytes(cfg, args.batch)})  # fmt: skip


if __name__ == "__main__":
    main()
