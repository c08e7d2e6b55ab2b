"""zero_jax's TPU-compiler claims on each libtpu version, side by side (deviceless, ahead of time).

Run once per toolchain; each run compiles with the libtpu installed and adds its rows (keyed by the
libtpu version) to ``benchmarks/results/tpu_versions.json``, then writes the table of every version
measured so far to ``tpu_versions.txt``::

    python benchmarks/tpu_versions.py                                    # Python 3.11: jax 0.10.2, libtpu 0.0.42.1
    <venv of Python 3.12 with "jax[tpu]==0.11.1">/bin/python benchmarks/tpu_versions.py   # libtpu 0.0.46.3
    <venv of Python 3.12/3.13 with ".[test]">/bin/python benchmarks/tpu_versions.py       # jax 0.12.1, libtpu 0.0.52

``--table-only`` writes the table of the rows measured, compiling nothing.

The cases are the README's TPU claims at the 1B class (``tpu_aot.py``'s reference transformer: dim 2048,
depth 16, seq 2048, vocab 32000, bf16 compute over fp32 master, AdamW, one sequence per chip) on v5p-8:
stage 1, and stage 3 layer-wise scanned (``scan_layers``) and unscanned (``apply_layers``): the allocated
HBM (the memory-usage report's default memory space total), argument + output + temp - alias
(``memory_analysis()``), XLA's live peak, stage 3 / stage 1 (of the allocated HBM), what the post-SPMD
program sends against the theory, what the compiled program sends, and the share of layer all-gathers (by
count and bytes) overlapped with compute; and which entry of the schedule seam each step was built with
(the option set the compiler accepted). ``--quick``: the small model (dim 256, depth 4), a smoke run.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tpu_aot  # noqa: E402, I001  (sets the process up: JAX_PLATFORMS=cpu, 8 CPU devices)

import argparse  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

import zero_jax as zj  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CASES = [("v5p:2x2x2", "1"), ("v5p:2x2x2", "3/scan"), ("v5p:2x2x2", "3/apply")]
COLUMNS = [
    ("allocated_GiB", "HBM alloc GiB", "{:.2f}"),
    ("peak_est_GiB", "arg+out+temp-alias", "{:.2f}"),
    ("live_peak_GiB", "live peak GiB", "{:.2f}"),
    ("over_stage1", "/ stage 1", "{:.2f}"),
    ("comm_over_theory", "comm/theory", "{:.3f}"),
    ("compiled_over_theory", "compiled/theory", "{:.3f}"),
    ("gather_overlap", "gathers overlapped", "{:.0%}"),
    ("gather_overlap_bytes", "by bytes", "{:.0%}"),
    ("compile_s", "compile s", "{:.0f}"),
]


def libtpu_version() -> str:
    return importlib.metadata.version("libtpu")


def measure_case(topology: str, variant: str, quick: bool, defaults: bool) -> dict[str, Any]:
    mesh, tpu = zj.topology_mesh(topology), zj.tpu_slice(topology)
    cfg = tpu_aot.config("1B", quick)
    with zj.measure.trying_schedule(**({"compiler_options": {}} if defaults else {})):
        step, state, batch = tpu_aot.build(mesh, variant, cfg)
    row = tpu_aot.measure(step, state, batch, hbm=tpu.hbm_per_device)
    schedule = zj.measure.schedule_for(step.policy)
    row["schedule"] = schedule.describe()
    row["options"] = [name for name, _ in schedule.compiler_options]
    if row.get("compiled_MiB") and row.get("theory_MiB"):
        row["compiled_over_theory"] = row["compiled_MiB"] / row["theory_MiB"]
    return row


def rank(row: dict[str, Any]) -> tuple[bool, int]:
    """A row's place in its version's table: the seam's cases in CASES order, then the libtpu-defaults ones."""
    return row["variant"].endswith("defaults"), [c[1] for c in CASES].index(row["variant"].split()[0])


def table(rows: dict[str, dict[str, Any]]) -> list[str]:
    versions = sorted({r["libtpu"] for r in rows.values()}, key=zj.measure.parse_version)
    out = [f"{'libtpu':<10} {'jax':<7} {'case':<27}" + "".join(f" {title:>18}" for _, title, _ in COLUMNS)]
    for version in versions:
        mine = {k: r for k, r in rows.items() if r["libtpu"] == version}
        for r in sorted(mine.values(), key=rank):
            tail = " defaults" if r["variant"].endswith("defaults") else ""
            stage1 = next((q for q in mine.values() if q["variant"] == "1" + tail), {})
            if stage1.get("allocated_GiB") and r.get("allocated_GiB"):
                r["over_stage1"] = r["allocated_GiB"] / stage1["allocated_GiB"]
            cells = "".join(f" {(fmt.format(r[k]) if r.get(k) is not None else '-'):>18}" for k, _, fmt in COLUMNS)
            out.append(f"{version:<10} {r['jax']:<7} {r['topology'] + ' ' + r['variant']:<27}{cells}")
        seams = sorted({r["schedule"] for r in mine.values() if not r["variant"].endswith("defaults")})
        out += [f"  libtpu {version}: {s}" for s in seams]
        used = sorted({o for r in mine.values() for o in r["options"]})
        out += [f"  libtpu {version} options: {', '.join(used)} (rows '... defaults': none, libtpu's defaults)"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--libtpu-defaults", action="store_true",
                        help="compile without the schedule seam's options (libtpu's defaults): rows marked so")
    parser.add_argument("--table-only", action="store_true", help="compile nothing: the table of the rows measured")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "tpu_versions_quick" if args.quick else "tpu_versions"
    path = args.out / f"{stem}.json"
    rows: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
    version = libtpu_version()
    for topology, variant in [] if args.table_only else CASES:
        case = variant + (" defaults" if args.libtpu_defaults else "")
        key = f"libtpu {version} {topology} {case}"
        print(f"[{time.strftime('%H:%M:%S')}] {key}", flush=True)
        row = measure_case(topology, variant, args.quick, args.libtpu_defaults)
        rows[key] = {"libtpu": version, "jax": jax.__version__, "topology": topology, "variant": case,
                     "python": platform.python_version(),
                     "date": datetime.date.today().isoformat()} | row  # fmt: skip
        path.write_text(json.dumps(rows, indent=1, default=str))
    header = [
        "# python benchmarks/tpu_versions.py" + (" --quick" if args.quick else "") + ", once per toolchain "
        "(the module docstring); each row names its libtpu, jax and Python",
        f"# last run {datetime.datetime.now().isoformat(timespec='seconds')} on {platform.node()}, {os.cpu_count()} "
        "CPUs; deviceless TPU compiles (JAX_PLATFORMS=cpu); 1B class (quick: dim 256), v5p-8, bf16 / fp32 AdamW",
    ]
    text = "\n".join(header + table(rows)) + "\n"
    (args.out / f"{stem}.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
