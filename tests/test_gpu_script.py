"""benchmarks/gpu.py --dry-run: the one-command GPU benchmark runs its every code path at tiny sizes
(8 simulated CPU devices) and writes a complete record, with numbers of the right kind."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _models import child_env

ROOT = Path(__file__).resolve().parent.parent


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


@pytest.mark.slow
def test_gpu_script_dry_run_writes_every_section(tmp_path: Path) -> None:
    done = subprocess.run(
        # --budget: the time guard's deadlines are for the lent GPU's session; on a loaded CI machine the
        # default dry-run budget would skip a section this test exists to run. JAX_PLATFORMS=cpu: libtpu is
        # installed (the test extra) but there is no chip; the dry run simulates 8 CPU devices.
        [sys.executable, "benchmarks/gpu.py", "--dry-run", "--budget", "3000", "--out", str(tmp_path)],
        cwd=ROOT, env=child_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "gpu.txt").read_text()
    assert "DRY RUN" in text and "NOT meaningful" in text
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["complete"] is True and data["meta"]["dry_run"] is True
    assert data["meta"]["command"].startswith("python benchmarks/gpu.py --dry-run")
    for key in ("device", "jax", "jaxlib", "compiler_options"):
        assert data["meta"][key]
    assert data["skipped"] == [] and data["errors"] == {}

    overhead = data["overhead"]
    assert [r["variant"] for r in overhead["rows"]] == ["jax.jit + optax"] + [f"zero_jax stage {s}" for s in range(4)]
    assert positive(overhead["model_flops_per_step"]) and overhead["peak_flops"] is None
    for r in overhead["rows"]:
        assert positive(r["step_s"]) and positive(r["tokens_per_s"]) and positive(r["peak_bytes"])
        assert r["mfu"] is None  # no made-up figure on CPU

    offload = data["offload"]
    assert [m["mode"] for m in offload["modes"]] == [
        "no offload", "offload_optimizer", "offload_optimizer + offload_params",
    ]  # fmt: skip
    for m in offload["modes"]:
        assert isinstance(m["max_depth"], int) and not isinstance(m["max_depth"], bool) and m["max_depth"] >= 1
        assert m["confirmed"] is True and positive(m["step_s"]) and m["searched_to_one"] is True
        lo, hi = m["bracket"]
        assert isinstance(lo, int) and isinstance(hi, int) and hi == lo + 1 == m["max_depth"] + 1
        assert all(isinstance(p["depth"], int) and positive(p["device_peak"]) for p in m["probes"])
    assert len(offload["common"]) == 3 and all(positive(c["step_s"]) for c in offload["common"])
    assert positive(offload["chunk"]["largest_chunk_bytes"]) and positive(offload["chunk"]["temp_streaming"])

    rows = data["overlap"]["rows"]
    assert [(r["path"], r["prefetch"]) for r in rows] == [("scan", 0), ("scan", 1), ("blockwise", 0), ("blockwise", 1)]
    for r in rows:
        assert positive(r["step_s"]) and positive(r["peak_bytes"])
        assert isinstance(r["gather_issued_early"], bool)
        assert all(isinstance(r[k], int) for k in ("async_pairs", "async_pairs_overlapping_matmul", "host_copies"))
    blockwise = {r["prefetch"]: r for r in rows if r["path"] == "blockwise"}
    # 8 simulated devices: the block-wise gathers are real all-gathers, named per block in the schedule;
    # with prefetch=1 block i's gather is issued before block i-1's compute ends, in both passes.
    assert blockwise[1]["named_gathers_found"] > 0
    assert blockwise[1]["order_forward"] is True and blockwise[1]["order_backward"] is True
    assert blockwise[0]["order_forward"] is False

    flags = data["flags"]
    assert {r["flag"] for r in flags["rows"]} == {
        "xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_all_gather_combine_threshold_bytes",
        "xla_gpu_reduce_scatter_combine_threshold_bytes", "xla_gpu_all_reduce_combine_threshold_bytes",
    }  # fmt: skip
    for r in flags["rows"]:
        assert positive(r["step_s_used"]) and positive(r["step_s_variant"])
        assert isinstance(r["gather_issued_early_used"], bool) and isinstance(r["gather_issued_early_variant"], bool)
