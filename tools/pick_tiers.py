"""Choose the suite's tiers by measurement, from a run of the whole suite under
``tools/test_costs.py`` (CPU seconds and the lines of ``zero_jax/`` each test
runs):

    PYTHONPATH=tools python -m pytest -q -n 2 -p test_costs --full   # Python 3.12+
    python tools/pick_tiers.py test_costs.*.jsonl

Three tiers, each containing the one before:

- **fast** (``pytest -m "not slow"``; while you work): of the tests not marked
  ``slow`` in their files, the cheapest, until their CPU seconds reach
  ``--fast-budget``. ``tests/slow.txt`` lists the rest.
- **CI** (``pytest``, the README's test command; what ``.ci/run`` runs): the
  fast tier; then, greedily, the slow test that runs the most lines of
  ``zero_jax/`` no chosen test runs yet per CPU second, until the chosen tests
  run every line the whole suite runs or the next one would add fewer than
  ``--min-rate`` lines per CPU second (the lines left are printed and named in
  ``tests/full.txt``: a cheap test for them moves them into CI); then, cheapest first within
  ``--ci-budget`` CPU seconds, one case of each test function not yet chosen
  (so every claim is checked once where the budget allows). ``ALWAYS_CI``
  stays in whatever it costs.
- **full** (``pytest --full``; before a release, on both ends of the supported
  range): everything. ``tests/full.txt`` lists what only it runs: the other
  cases of a matrix (optimizers x stages, meshes, dtypes) and end-to-end
  runs whose code paths the CI tier runs otherwise.

It also writes ``tests/file_seconds.txt``, by which ``conftest.py`` orders the
files (longest first, for ``-n 2``'s workers). The cases of a test function
one of which built fixtures of over ``HEAVY_SETUP`` CPU seconds stay or go
together. Rerun after a change that adds or slows tests (stdlib only).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW = ROOT / "tests" / "slow.txt"
FULL = ROOT / "tests" / "full.txt"
FILES = ROOT / "tests" / "file_seconds.txt"
# In the CI tier whatever they cost: the documentation site (.ci/run) renders the notebooks as these executed them;
# the tiers' own test; the README's first claim, the ZeRO formulas on the reference transformer, at stage 3.
ALWAYS_CI = (
    "tests/test_notebooks.py::",
    "tests/test_tiers.py::",
    "tests/test_audit.py::test_reference_model_bytes_and_communication_match_the_formulas[8-3]",
)
HEAVY_SETUP = 5.0  # CPU seconds of fixtures that make a test function one unit
FILES_HEADER = (
    "# Measured CPU seconds per test file (the test process and its children) in the CI tier, then in the full tier:\n"
    "# conftest.py collects the files longest first (by the tier it runs): -n 2's workers start on the longest.\n"
    "# Written by tools/pick_tiers.py.\n"
)
SLOW_HEADER = (
    "# Tests the fast tier (pytest -m 'not slow') leaves out, chosen by measurement: written by tools/pick_tiers.py\n"
    "# from a run of the whole suite under tools/test_costs.py ({total:.0f} CPU s in all, {machine}); the {kept}\n"
    "# cheapest unmarked tests, {kept_s:.0f} CPU s together, stay in the fast tier.\n"
)
FULL_HEADER = (
    "# Tests only the full tier (pytest --full) runs, chosen by measurement: written by tools/pick_tiers.py from a\n"
    "# run of the whole suite under tools/test_costs.py ({total:.0f} CPU s in all; {machine}). The CI tier (the\n"
    "# README's test command) keeps {ci} tests, {ci_s:.0f} CPU s: the fast tier, tests that run {covered} of the\n"
    "# {lines} lines of zero_jax/ the whole suite runs, and one case of {functions} of the {all_functions} test\n"
    "# functions. These {count} tests ({full_s:.0f} CPU s) are the other cases and end-to-end runs.\n"
    "# Lines only these run: {uncovered}\n"
)


def read_costs(paths: list[Path]) -> dict[str, dict]:
    """Node id -> ``{"cost": CPU seconds with children, "lines": set}`` from test_costs.py's files."""
    out: dict[str, dict] = collections.defaultdict(lambda: {"cost": None, "setup": 0.0, "lines": set()})
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["id"]]["lines"] |= set(row["lines"])  # a child process's rows have lines only
            if "cpu" in row:
                out[row["id"]]["cost"] = row["cpu"] + row["child"]
                out[row["id"]]["setup"] = row.get("setup", 0.0)
    unmeasured = [node for node, c in out.items() if c["cost"] is None]
    if unmeasured:
        raise SystemExit(f"{len(unmeasured)} tests have lines from a child but no cost of their own: {unmeasured[:3]}")
    return dict(out)


def unmarked() -> list[str]:
    """Node ids of the tests not marked slow in their files (the lists ignored)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--co", "-n", "0", "-m", "not slow", "--full"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "ZERO_JAX_IGNORE_TIER_LISTS": "1"},
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"collecting the suite failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return [line.strip() for line in run.stdout.splitlines() if "::" in line]


def function(node: str) -> str:
    return node.split("[")[0]


def units(costs: dict[str, dict], nodes: set[str]) -> list[tuple[str, ...]]:
    """What stays or goes together: the cases of a test function one of which built fixtures of over
    ``HEAVY_SETUP`` CPU seconds (leaving out the case that built them only moves the cost to the next case); any
    other test alone."""
    heavy = {function(n) for n in nodes if costs[n]["setup"] > HEAVY_SETUP}
    grouped: dict[str, list[str]] = collections.defaultdict(list)
    for node in sorted(nodes):
        grouped[function(node) if function(node) in heavy else node].append(node)
    return [tuple(group) for group in grouped.values()]


def cost_of(costs: dict[str, dict], nodes: Iterable[str]) -> float:
    return sum(costs[n]["cost"] for n in nodes)


def pick_fast(costs: dict[str, dict], candidates: set[str], budget: float) -> set[str]:
    """The cheapest units of candidates until their costs reach ``budget``."""
    fast, spent = set(), 0.0
    for unit in sorted(units(costs, candidates), key=lambda u: (cost_of(costs, u), u)):
        cost = cost_of(costs, unit)
        if spent + cost > budget:
            break
        fast |= set(unit)
        spent += cost
    return fast


def pick_ci(costs: dict[str, dict], fast: set[str], budget: float, min_rate: float) -> set[str]:
    """The fast tier, then a greedy cover of the lines (while a test runs ``min_rate`` new lines per CPU second or
    more), then one case per test function within ``budget``."""
    ci = set(fast) | {n for n in costs if n.startswith(ALWAYS_CI)}
    rest = [u for u in units(costs, set(costs)) if not set(u) <= ci]
    ci |= {n for u in rest if set(u) & ci for n in u}  # a unit the fast tier started goes whole
    rest = [u for u in rest if not set(u) <= ci]
    lines = {u: set().union(*(costs[n]["lines"] for n in u)) for u in rest}
    cost = {u: cost_of(costs, u) for u in rest}
    covered = set().union(*(costs[n]["lines"] for n in ci))
    everything = set().union(*(c["lines"] for c in costs.values()))
    while covered != everything:
        best = max(rest, key=lambda u: (len(lines[u] - covered) / max(cost[u], 0.05), u))
        if len(lines[best] - covered) / max(cost[best], 0.05) < min_rate:
            break  # what is left costs more than it runs: reported as the lines only the full tier runs
        ci |= set(best)
        rest.remove(best)
        covered |= lines[best]
    spent = cost_of(costs, ci)
    chosen_functions = {function(n) for n in ci}
    for unit in sorted(rest, key=lambda u: (cost[u], u)):
        if {function(n) for n in unit} <= chosen_functions or spent + cost[unit] > budget:
            continue
        ci |= set(unit)
        chosen_functions |= {function(n) for n in unit}
        spent += cost[unit]
    return ci


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("costs", type=Path, nargs="+", help="test_costs.py's files (one per xdist worker)")
    parser.add_argument("--fast-budget", type=float, default=60.0, help="CPU seconds of the fast tier")
    parser.add_argument("--ci-budget", type=float, default=480.0, help="CPU seconds of the CI tier")
    parser.add_argument(
        "--min-rate", type=float, default=0.5,
        help="new lines per CPU second below which a test is not added to the CI tier for its lines alone",
    )  # fmt: skip
    parser.add_argument("--machine", default="2 idle cores, Python 3.13, jax 0.12.1")
    args = parser.parse_args()
    costs = read_costs(args.costs)
    candidates = set(unmarked())
    missing = sorted(candidates - set(costs))
    if missing:
        raise SystemExit(f"{len(missing)} tests have no measured cost (run the whole suite with --full): {missing[:5]}")
    fast = pick_fast(costs, candidates, args.fast_budget)
    ci = pick_ci(costs, fast, args.ci_budget, args.min_rate)
    total = sum(c["cost"] for c in costs.values())
    everything = set().union(*(c["lines"] for c in costs.values()))
    uncovered = everything - set().union(*(costs[n]["lines"] for n in ci))
    slow, full = sorted(set(costs) - fast), sorted(set(costs) - ci)
    SLOW.write_text(
        SLOW_HEADER.format(total=total, machine=args.machine, kept=len(fast), kept_s=cost_of(costs, fast))
        + "".join(f"{n}\n" for n in slow)
    )
    functions = {function(n) for n in costs}
    FULL.write_text(
        FULL_HEADER.format(
            total=total, machine=args.machine, ci=len(ci), ci_s=cost_of(costs, ci),
            functions=len({function(n) for n in ci}),
            all_functions=len(functions), lines=len(everything), covered=len(everything - uncovered),
            uncovered=", ".join(sorted(uncovered)) or "none",
            count=len(full), full_s=cost_of(costs, full),
        )
        + "".join(f"{n}\n" for n in full)
    )
    in_ci: dict[str, float] = collections.defaultdict(float)
    in_full: dict[str, float] = collections.defaultdict(float)
    for node, c in costs.items():
        in_full[node.split("::")[0]] += c["cost"]
        in_ci[node.split("::")[0]] += c["cost"] if node in ci else 0.0
    ranked = sorted(in_full, key=lambda path: (-in_ci[path], -in_full[path], path))
    FILES.write_text(FILES_HEADER + "".join(f"{path} {in_ci[path]:.1f} {in_full[path]:.1f}\n" for path in ranked))
    print(f"fast tier: {len(fast)} tests, {cost_of(costs, fast):.0f} CPU s; "
          f"CI tier: {len(ci)} tests, {cost_of(costs, ci):.0f} CPU s "
          f"({len({function(n) for n in ci})} of {len(functions)} test functions); full: {len(costs)} tests, "
          f"{total:.0f} CPU s); lines only the full tier runs: {sorted(uncovered) or 'none'}")  # fmt: skip


if __name__ == "__main__":
    main()
