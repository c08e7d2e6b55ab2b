"""Choose the fast tier by measurement: read a ``pytest --durations=0`` log of
the whole suite and write ``tests/slow.txt``, the tests the fast tier
(``pytest -m "not slow"``) leaves out.

    python -m pytest -q --durations=0 > /tmp/durations.txt
    python tools/pick_slow.py /tmp/durations.txt --budget 110

It also writes ``tests/file_seconds.txt``, the seconds per file, by which
``conftest.py`` orders the files (longest first, for ``-n 2``'s workers).
Tests already marked ``@pytest.mark.slow`` in their files stay slow. Of the
rest, the quickest are kept until their summed time (call + setup +
teardown, as measured) reaches ``--budget`` seconds; every other test is
listed. ``conftest.py`` marks the listed node ids slow. Rerun this after a
change that adds or slows tests (stdlib only).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "slow.txt"
FILES = ROOT / "tests" / "file_seconds.txt"
FILES_HEADER = (
    "# Measured seconds per test file (call + setup + teardown), longest first: conftest.py collects the files in\n"
    "# this order so that -n 2's workers start on the longest. Written by tools/pick_slow.py with tests/slow.txt.\n"
)
HEADER = (
    "# Tests the fast tier (pytest -m 'not slow') leaves out, chosen by measurement:\n"
    "# written by tools/pick_slow.py from a --durations=0 run ({total:.0f} s in all on {machine});\n"
    "# the {kept} quickest unmarked tests, {kept_s:.0f} s together, stay in the fast tier.\n"
)


def durations(log: Path) -> tuple[dict[str, float], set[str]]:
    """Seconds per node id (call + setup + teardown) from a ``--durations=0``
    log, and the node ids whose setup took over a second (a shared fixture)."""
    out: dict[str, float] = collections.defaultdict(float)
    heavy_setup = set()
    for line in log.read_text().splitlines():
        m = re.match(r"\s*([\d.]+)s (call|setup|teardown)\s+(\S+)", line)
        if m:
            out[m.group(3)] += float(m.group(1))
            if m.group(2) == "setup" and float(m.group(1)) > 1.0:
                heavy_setup.add(m.group(3))
    return out, heavy_setup


def groups(nodes: list[str], heavy_setup: set[str]) -> list[list[str]]:
    """Units that stay or go together: a test function one of whose cases
    built an expensive fixture goes whole (leaving out the case that built it
    only moves the cost to the next case); every other case on its own."""
    shared = {node.split("[")[0] for node in heavy_setup} | {node.split("::")[0] for node in heavy_setup}
    whole: dict[str, list[str]] = collections.defaultdict(list)
    out = []
    for node in nodes:
        key = next((k for k in (node.split("[")[0], node.split("::")[0]) if k in shared), None)
        if key is None:
            out.append([node])
        else:
            whole[key].append(node)
    return out + list(whole.values())


def unmarked() -> list[str]:
    """Node ids of the tests not marked slow in their files (``tests/slow.txt`` ignored)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-m", "not slow", "-p", "no:randomly"],
        capture_output=True, text=True, cwd=ROOT, env={**__import__("os").environ, "ZERO_JAX_IGNORE_SLOW_LIST": "1"},
    )
    return [line.strip() for line in run.stdout.splitlines() if "::" in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path)
    parser.add_argument("--budget", type=float, default=110.0, help="seconds of measured test time kept fast")
    parser.add_argument("--machine", default="2 idle cores")
    args = parser.parse_args()
    seconds, heavy_setup = durations(args.log)
    cost = lambda group: sum(seconds.get(node, 0.0) for node in group)  # noqa: E731
    units = sorted(groups(unmarked(), heavy_setup), key=lambda group: (cost(group), group))
    kept, kept_s, slow = 0, 0.0, []
    for group in units:
        if kept_s + cost(group) > args.budget:
            slow += group
        else:
            kept, kept_s = kept + len(group), kept_s + cost(group)
    slow.sort()
    header = HEADER.format(total=sum(seconds.values()), count=len(seconds), machine=args.machine, kept=kept,
                           kept_s=kept_s)  # fmt: skip
    OUT.write_text(header + "".join(f"{node}\n" for node in slow))
    per_file: dict[str, float] = collections.defaultdict(float)
    for node, s in seconds.items():
        per_file[node.split("::")[0]] += s
    ranked = sorted(per_file.items(), key=lambda kv: (-kv[1], kv[0]))
    FILES.write_text(FILES_HEADER + "".join(f"{path} {s:.1f}\n" for path, s in ranked))
    print(f"{OUT.relative_to(ROOT)}: {len(slow)} tests listed slow; fast tier {kept} tests, {kept_s:.0f} s measured")


if __name__ == "__main__":
    main()
