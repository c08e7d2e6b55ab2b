"""The layer-wise schedule's compiler tricks (``zero_jax._layerwise.schedule``) on XLA:GPU, each switched off
(or on) alone: what each buys on the GPU compiler, compiled here without a GPU for 8 H100 on one host.

Run: ``JAX_PLATFORMS=cpu python benchmarks/gpu_schedule.py`` (the CUDA plugin installed; ``--quick``: a tiny
model, written to a temporary folder). For layer-wise stage 3 of the reference transformer (dim 1024, depth 8,
16 heads, seq 2048, vocab 32000; bf16 compute, fp32 master, AdamW, one sequence per GPU), scanned
(``zj.scan_layers``) and unscanned (``zj.apply_layers``), with the schedule the step gets on GPU and with each
switch changed (``zj.measure.trying_schedule``): the memory per GPU (the buffer assignment's total), XLA's live
peak, the most layers whole at once, the share of layer all-gather bytes with a matmul between start and done,
the step time XLA:GPU's latency-hiding schedule estimates and the communication it leaves exposed. Writes
``benchmarks/results/gpu_schedule.{txt,json}``; the seam's ``gpu`` entry is chosen from these rows.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common as common  # noqa: E402
from gpu_aot import versions  # noqa: E402
from tpu_aot import build  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig  # noqa: E402

GiB, MiB = 2**30, 2**20
TOPOLOGY = "h100:1x8"
MODEL = dict(vocab=32000, dim=1024, depth=8, heads=16, seq=2048)
#: ``--model 1B``: the 1B class of benchmarks/gpu_aot.py, for the trials that moved at dim 1024 (``--only``).
MODEL_1B = dict(vocab=32000, dim=2048, depth=16, heads=16, seq=2048)
#: ``--model 8B``: the 8B class of benchmarks/gpu_aot.py (results: gpu_schedule_8b.*).
MODEL_8B = dict(vocab=32000, dim=4096, depth=32, heads=32, seq=2048)
QUICK = dict(vocab=512, dim=256, depth=4, heads=4, seq=128)
#: (label, switches, layouts it applies to): each trick turned the other way from the schedule the step gets.
TRIALS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("as built", {}, ("scan", "apply")),
    ("tie_gathers off", {"tie_gathers": False}, ("scan", "apply")),
    ("tie_recompute off", {"tie_recompute": False}, ("scan", "apply")),
    ("tie_backward_order off", {"tie_backward_order": False}, ("scan", "apply")),
    ("leafwise_prefetch off", {"leafwise_prefetch": False}, ("scan", "apply")),
    ("prefetch_across_trips off", {"prefetch_across_trips": False}, ("scan",)),
    ("prefetch_blocks off", {"prefetch_blocks": False}, ("apply",)),
    ("unroll_layers 2", {"unroll_layers": 2}, ("scan",)),
    ("in place, unroll_layers 2", {"prefetch_across_trips": False, "unroll_layers": 2}, ("scan",)),
    ("together_bytes 64 KiB", {"together_bytes": 2**16}, ("scan", "apply")),
    # the gpu entry's own: the backward re-gathers the next layer at once in scan_layers' loop (half at first,
    # the rest paired with this layer's reductions: every other backend's), and its pieces gather and reduce
    # along a new leading axis (off: along the dimension they are cut on)
    ("loop_head_start 0.5", {"loop_head_start": 0.5}, ("scan",)),
    ("major_axis_collectives off", {"major_axis_collectives": False}, ("scan", "apply")),
    # the layer gradients reduced by a ring of ppermutes (the TPU entry's grad_reduction) instead of psum_scatter
    ("grad_reduction ring", {"grad_reduction": "ring"}, ("scan", "apply")),
    ("grad_reduction bidirectional", {"grad_reduction": "bidirectional_ring"}, ("scan", "apply")),
]


def measure_one(layout: str, switches: dict[str, Any], cfg: TransformerConfig, mesh: Any) -> dict[str, Any]:
    with zj.measure.trying_schedule(**switches):
        step, state, batch = build(mesh, "3/scan" if layout == "scan" else "3/apply", cfg)
        t = time.perf_counter()
        r = zj.audit(step, state, batch, grads=False, fast_compile=False)
    est = r.estimate
    return {
        "compile_s": round(time.perf_counter() - t, 1),
        "allocated_GiB": r.memory.get("allocated", r.memory["peak"]) / GiB,
        "live_peak_GiB": r.memory["live_peak"] / GiB if r.memory.get("live_peak") else None,
        "layers_alive": r.layers.max_alive if r.layers else None,
        "gather_overlap_bytes": r.overlap.gather_bytes_fraction if r.overlap else None,
        "ag_executions": next((k.executions for k in r.compiled.kinds if k.kind == "all-gather"), 0)
        if r.compiled else None,
        "comm_over_theory": r.comm.measured / r.comm.theory if r.comm.theory else None,
        "step_ms": est.seconds * 1e3 if est else None,
        "exposed_ms": est.exposed_seconds * 1e3 if est else None,
        "complete": est.complete if est else None,
        "violations": [v.kind for v in r.violations],
        "schedule": r.schedule,
    }  # fmt: skip


def table(rows: dict[str, Any]) -> list[str]:
    out = [f"{'layout':<7}{'trial':<28}{'GiB/GPU':>9}{'live GiB':>9}{'alive':>6}{'AG ovl':>8}{'AGs':>6}"
           f"{'/theory':>8}{'est. ms':>9}{'exposed':>9}  violations"]  # fmt: skip
    for layout in ("scan", "apply"):
        for label, _, layouts in TRIALS:
            if layout not in layouts:
                continue
            r = rows.get(f"{layout} {label}")
            if r is None or "error" in r:
                out.append(f"{layout:<7}{label:<28}" + ("  (not measured)" if r is None else f"  {r['error'][:80]}"))
                continue
            f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
            out.append(f"{layout:<7}{label:<28}{r['allocated_GiB']:>9.3f}{f(r['live_peak_GiB'], '.3f'):>9}"
                       f"{f(r['layers_alive'], 'd'):>6}{f(r['gather_overlap_bytes'], '.0%'):>8}"
                       f"{f(r['ag_executions'], 'd'):>6}{f(r['comm_over_theory'], '.3f'):>8}"
                       f"{f(r['step_ms'], '.2f'):>9}{f(r['exposed_ms'], '.2f'):>9}"
                       f"  {','.join(r['violations'])}")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", choices=["1B", "8B"], default=None,
                    help="the 1B or 8B class (results: gpu_schedule_1b.*, gpu_schedule_8b.*)")
    ap.add_argument("--only", nargs="*", default=None, help="these trials (labels) and layouts (scan, apply)")
    args = ap.parse_args(argv)
    out = args.out or (tempfile.mkdtemp(prefix="gpu_schedule_") if args.quick else common.RESULTS)
    name = "gpu_schedule" + (f"_{args.model.lower()}" if args.model else "")
    cache = Path(out) / f"{name}.json"
    rows: dict[str, Any] = {} if args.fresh or not cache.exists() else json.loads(cache.read_text())["rows"]
    models = {None: MODEL, "1B": MODEL_1B, "8B": MODEL_8B}
    cfg = TransformerConfig(**(QUICK if args.quick else models[args.model]))
    mesh, record = zj.topology_mesh(TOPOLOGY), common.Record()
    for layout in ("scan", "apply"):
        for label, switches, layouts in TRIALS:
            k = f"{layout} {label}"
            if layout not in layouts or (k in rows and "error" not in rows[k]):
                continue
            if args.only is not None and not (label in args.only and layout in args.only):
                continue
            print(f"-- {k}", flush=True)
            try:
                rows[k] = measure_one(layout, switches, cfg, mesh)
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                traceback.print_exc()
                rows[k] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            text = record.header(
                "The schedule seam's tricks on XLA:GPU, each switched alone (benchmarks/gpu_schedule.py)",
                f"target: {zj.gpu_slice(TOPOLOGY)}",
                f"model: layer-wise stage 3, the reference transformer vocab {cfg.vocab}, dim {cfg.dim}, depth "
                f"{cfg.depth}, heads {cfg.heads}, seq {cfg.seq}; bf16 compute, fp32 master, AdamW, one sequence per "
                "GPU; prefetch 1",
                "GiB/GPU: the buffer assignment's total; live: XLA's live peak; alive: most layers whole at once; "
                "AG ovl: layer all-gather bytes with a matmul between start and done; AGs: all-gather "
                "executions per step (compiled); est. ms / exposed: XLA:GPU's latency-hiding schedule (an estimate: "
                + zj.measure.ESTIMATE_LEAVES_OUT + ")",
                "",
                *table(rows),
                versions=versions(),
            )  # fmt: skip
            common.write_results(name, text, {"meta": record.meta(), "rows": rows}, out=out)
            print(text.split("\n\n")[-1], flush=True)


if __name__ == "__main__":
    sys.exit(main())
