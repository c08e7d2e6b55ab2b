"""How the layer-wise backward reduce-scatters each layer's gradient, on the TPU compiler (deviceless).

libtpu rewrites an explicit ``psum_scatter`` on v5p into an all-reduce of the whole gradient + a
dynamic-slice: two passes of the bytes, synchronous. The schedule seam's ``grad_reduction`` switch
(``zj.measure.trying_schedule(grad_reduction=...)``) builds the same reduction from other collectives;
this compiles layer-wise stage 3 of the reference transformer for v5p:2x2x2 with each and reads it with
``zj.audit``:

* ``psum_scatter``: the collective itself;
* ``ring``: N - 1 ``ppermute`` steps of 1/N of the gradient, each adding what it receives;
* ``bidirectional_ring``: the same with half of each slice going each way round;
* ``all_to_all``: one ``all_to_all`` of the N slices and a local sum.

Per row: ring bytes the compiled program sends per device per step by collective kind, compiled / theory,
the layer reductions' executions, how many are async and overlapped with compute (and their bytes), the
layer gathers overlapped, the allocated HBM and XLA's live peak, and the compile time. Run once per
toolchain; the rows of each libtpu version join ``benchmarks/results/grad_reduction.json``::

    python benchmarks/grad_reduction.py                              # Python 3.11: jax 0.10.2, libtpu 0.0.42.1
    <venv of Python 3.13 with ".[test]">/bin/python benchmarks/grad_reduction.py   # jax 0.12.1, libtpu 0.0.52

``--dim`` / ``--depth`` / ``--seq``: the model (default dim 256, depth 4, seq 256, vocab 512, 4 heads: a
compile takes ~20 s here); ``--variants``: ``3/scan`` (``scan_layers``) and ``3/apply`` (``apply_layers``).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tpu_aot  # noqa: E402, I001  (sets the process up: JAX_PLATFORMS=cpu, 8 CPU devices)

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import _common as common  # noqa: E402
import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20
HOWS = ("psum_scatter", "ring", "bidirectional_ring", "all_to_all")
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
REDUCTION = "layer reduction"


def measure(topology: str, variant: str, cfg: TransformerConfig, how: str) -> dict[str, Any]:
    """One compile of layer-wise stage 3 with ``grad_reduction=how``, audited."""
    mesh = zj.topology_mesh(topology)
    t = time.perf_counter()
    with zj.measure.trying_schedule(grad_reduction=how):
        step, state, batch = tpu_aot.build(mesh, variant, cfg)
        r = zj.audit(step, state, batch, grads=False)
        schedule = zj.measure.schedule_for(step.policy)
    compile_s = time.perf_counter() - t
    kinds = {k.kind: k for k in r.compiled.kinds} if r.compiled else {}
    red = r.overlap.row(REDUCTION) if r.overlap else None
    return {
        "compile_s": round(compile_s, 1),
        "by_kind_MiB": {k: kinds[k].ring_bytes / MiB for k in KINDS if k in kinds},
        "decomposed": {k: kinds[k].decomposed for k in KINDS if k in kinds and kinds[k].decomposed},
        "compiled_MiB": r.compiled.ring_bytes / MiB if r.compiled else None,
        "post_spmd_MiB": r.comm.measured / MiB,
        "theory_MiB": r.comm.theory / MiB,
        "compiled_over_theory": r.compiled.ring_bytes / r.comm.theory if r.compiled and r.comm.theory else None,
        "reductions": red.executions if red else 0,
        "reductions_async": red.async_executions if red else 0,
        "reductions_overlapped": red.overlapped if red else 0,
        "reduction_overlap_bytes": red.overlapped_bytes / red.bytes if red and red.bytes else 0.0,
        "gather_overlap_bytes": r.overlap.gather_bytes_fraction if r.overlap else None,
        "exposed": r.overlap.exposed if r.overlap else None,
        "allocated_MiB": r.memory.get("allocated", r.memory["peak"]) / MiB,
        "live_peak_MiB": r.memory["live_peak"] / MiB if r.memory.get("live_peak") else None,
        "violations": [v.kind for v in r.violations],
        "schedule": schedule.describe(),
    }


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    head = (f"{'libtpu':<9} {'case':<32} {'grad_reduction':<19} {'compiled MiB':>12} {'/theory':>8} "
            f"{'reduce-scatter':>14} {'all-reduce':>10} {'permute':>8} {'all-to-all':>10} {'reductions':>10} "
            f"{'async':>6} {'overlap':>8} {'by bytes':>8} {'gathers':>8} {'HBM MiB':>8} {'live MiB':>8} "
            f"{'s':>4}")  # fmt: skip
    out = [head]

    def rank(r: dict[str, Any]) -> tuple[Any, ...]:
        return zj.measure.parse_version(r["libtpu"]), r["case"], HOWS.index(r["how"])

    for r in sorted(rows.values(), key=rank):
        k = r["by_kind_MiB"]
        cells = [f"{r['libtpu']:<9}", f"{r['case']:<32}", f"{r['how']:<19}", f"{r['compiled_MiB']:>12.2f}",
                 f"{r['compiled_over_theory']:>8.3f}"] + [f"{k.get(kind, 0.0):>{w}.2f}" for kind, w in (
                     ("reduce-scatter", 14), ("all-reduce", 10), ("collective-permute", 8), ("all-to-all", 10))] + [
                 f"{r['reductions']:>10}", f"{r['reductions_async']:>6}", f"{r['reductions_overlapped']:>8}",
                 f"{r['reduction_overlap_bytes']:>8.0%}", f"{r['gather_overlap_bytes'] or 0:>8.0%}",
                 f"{r['allocated_MiB']:>8.2f}",
                 f"{r['live_peak_MiB'] or 0:>8.2f}", f"{r['compile_s']:>4.0f}"]  # fmt: skip
        out.append(" ".join(cells))
    return out


NOTES = """\
Columns: what the compiled program sends per device per step (ring bytes: an all-reduce counts two passes, a
reduce-scatter libtpu runs as all-reduce + dynamic-slice too); compiled / the stage's theory; the ring bytes by
collective kind (reduce-scatter: the psum_scatters left, the head's and embedding's included, which the layer-wise
schedule does not reduce); the layer reductions (executions per step; a ring's steps each count), how many are
async and how many have compute between start and done, and the share of their bytes overlapped; the share of the
layer all-gathers' bytes overlapped; the allocated
HBM (buffer assignment) and XLA's live peak; compile seconds. The model line of the record is the last run's: each
row's case names its dim, depth and seq (vocab 512 and 4 heads at dim 256; vocab 32000 and 16 heads at dim 1024
and 2048, the 1B class); each version's own commands are the runs of the JSON."""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=["3/scan", "3/apply"])
    parser.add_argument("--hows", nargs="+", default=list(HOWS), choices=HOWS)
    parser.add_argument("--name", default="grad_reduction")
    parser.add_argument("--table-only", action="store_true", help="compile nothing: the table of the rows measured")
    args = parser.parse_args(argv)
    record = common.Record()
    path = RESULTS / f"{args.name}.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    rows: dict[str, dict[str, Any]] = saved.get("rows", {})
    runs: dict[str, Any] = saved.get("runs", {})
    libtpu = importlib.metadata.version("libtpu")
    cfg = TransformerConfig(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq)
    model = f"dim {cfg.dim} depth {cfg.depth} seq {cfg.seq}"
    for variant in [] if args.table_only else args.variants:
        for how in args.hows:
            case = f"{variant} {model}"
            print(f"[{time.strftime('%H:%M:%S')}] libtpu {libtpu} {args.topology} {case} {how}", flush=True)
            row = measure(args.topology, variant, cfg, how)
            rows[f"libtpu {libtpu} {args.topology} {case} {how}"] = {
                "libtpu": libtpu, "jax": jax.__version__, "topology": args.topology, "case": case, "how": how,
            } | row  # fmt: skip
    if not args.table_only:
        runs[f"libtpu {libtpu}"] = record.meta()
    header = record.header(
        f"The layer-wise gradient reduction on the TPU compiler: each grad_reduction, deviceless ({args.topology})",
        f"libtpu {libtpu}; reference transformer (vocab {cfg.vocab}, {cfg.heads} heads), bf16 compute over fp32 "
        "master, AdamW, one sequence per chip; layer-wise stage 3 (3/scan: scan_layers, 3/apply: apply_layers), "
        "prefetch 1, the schedule seam's compiler options for the running libtpu",
        "each libtpu version's rows come from its own run (runs in the JSON); this run's record:",
        versions=f"libtpu {libtpu}",
    )
    text = "\n".join([header, "", *table(rows), "", NOTES])
    common.write_results(args.name, text, {"rows": rows, "runs": runs})
    print(text)


if __name__ == "__main__":
    main()
