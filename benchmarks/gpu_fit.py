"""The largest model that fits 8 H100 per ZeRO stage: the formula's answer against the compiled program's, compiled
here without a GPU (XLA:GPU for ``zj.topology_mesh("h100:1x8")``).

Run: ``JAX_PLATFORMS=cpu python benchmarks/gpu_fit.py`` (the CUDA plugin installed). The family: the reference
transformer at dim 8192 (64 heads, seq 2048, vocab 32000; 0.81B parameters a layer), bf16 compute over fp32
master, AdamW, one sequence per GPU, scanned; depth is what grows. Per stage (0-2 and 3 with ``gather="all"``, 3
layer-wise): the deepest model whose state fits each GPU by ZeRO's formula (``zj.model_state_bytes``: parameters,
gradients and optimizer state, nothing else), then the compiled step at that depth and, up one layer at a time
or by bisection below it, the deepest depth whose buffer assignment fits the GPU's memory (79.11 GiB, XLA's H100 SXM
spec). Offload is not compiled: the deviceless GPU devices have no memory kinds (``pinned_host``). Writes
``benchmarks/results/gpu_fit.{txt,json}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import _common as common  # noqa: E402
from gpu_aot import all_step, versions  # noqa: E402
from tpu_aot import build  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig  # noqa: E402

GiB = 2**30
TOPOLOGY = "h100:1x8"
FAMILY = dict(vocab=32000, dim=8192, heads=64, seq=2048)
#: (label, stage, how): stages 0-2 and 3 gather="all" over the stacked layers, 3 layer-wise (scan_layers).
STAGES = (("0", 0, "all"), ("1", 1, "all"), ("2", 2, "all"), ("3/all", 3, "all"), ("3/lw", 3, "lw"))


def formula_depth(stage: int, hbm: float, n: int) -> int:
    """The deepest model whose ZeRO state (bf16 parameters and gradients, fp32 master and Adam: 2 + 2 + 12 bytes a
    parameter, partitioned per the stage) fits ``hbm`` per device by the formula."""
    depth = 0
    while True:
        cfg = TransformerConfig(**FAMILY, depth=depth + 1)
        if zj.model_state_bytes(cfg.num_params(), n, stage).total > hbm:
            return depth
        depth += 1


def compiled_gib(stage: int, how: str, depth: int, mesh: Any) -> float:
    """The buffer assignment's total per GPU of one step, compiled."""
    cfg = TransformerConfig(**FAMILY, depth=depth)
    step, state, batch = build(mesh, "3/scan", cfg) if how == "lw" else all_step(mesh, stage, cfg, "scan")
    r = zj.audit(step, state, batch, grads=False)
    return r.memory.get("allocated", r.memory["peak"]) / GiB


def main() -> None:
    mesh, gpus, record = zj.topology_mesh(TOPOLOGY), zj.gpu_slice(TOPOLOGY), common.Record()
    hbm = gpus.hbm_per_device
    assert hbm is not None
    rows: dict[str, Any] = {}
    for label, stage, how in STAGES:
        t = time.perf_counter()
        start = max(1, formula_depth(stage, hbm, mesh.size))
        tried: dict[int, float | str] = {}

        def fits(depth: int) -> bool:
            try:
                tried[depth] = compiled_gib(stage, how, depth, mesh)  # noqa: B023 - called in this iteration
            except Exception as e:  # noqa: BLE001 - a compile that fails is recorded as not fitting
                traceback.print_exc()
                tried[depth] = f"{type(e).__name__}"  # noqa: B023
                return False
            return tried[depth] * GiB <= hbm  # noqa: B023

        depth = start
        if fits(depth):
            while fits(depth + 1):
                depth += 1
        else:  # bisect: ``lo`` fits (0 layers trivially), ``hi`` does not
            lo, hi = 0, depth
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            depth = lo
        cfg = TransformerConfig(**FAMILY, depth=depth)
        rows[label] = {"formula_depth": start, "compiled_depth": depth, "params_B": cfg.num_params() / 1e9,
                       "formula_params_B": TransformerConfig(**FAMILY, depth=start).num_params() / 1e9,
                       "tried_GiB": tried, "seconds": round(time.perf_counter() - t)}  # fmt: skip
        print(label, json.dumps(rows[label]), flush=True)
        lines = [f"{'stage':<7}{'formula depth':>14}{'params':>9}{'compiled depth':>16}{'params':>9}   "
                 "compiled GiB/GPU by depth"]
        for k, r in rows.items():
            gib = ", ".join(f"{d}: {v:.2f}" if isinstance(v, float) else f"{d}: {v}"
                            for d, v in sorted(r["tried_GiB"].items()))  # fmt: skip
            lines.append(f"{k:<7}{r['formula_depth']:>14}{r['formula_params_B']:>8.1f}B{r['compiled_depth']:>16}"
                         f"{r['params_B']:>8.1f}B   {gib}")  # fmt: skip
        text = record.header(
            "The largest model that fits 8 H100 per stage: formula against compiled (benchmarks/gpu_fit.py)",
            f"target: {gpus}",
            f"family: the reference transformer, {', '.join(f'{k} {v}' for k, v in FAMILY.items())}, depth growing; "
            "bf16 compute, fp32 master, AdamW, one sequence per GPU, scanned",
            "formula depth: the deepest whose ZeRO state (2 + 2 + 12 bytes a parameter, partitioned per the stage) "
            "fits by zj.model_state_bytes, nothing else counted; compiled depth: the deepest whose buffer assignment "
            "fits",
            "",
            *lines,
            versions=versions(),
        )
        common.write_results("gpu_fit", text, {"meta": record.meta(), "rows": rows})
        print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
