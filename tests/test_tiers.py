"""The suite's tiers (conftest.py, tools/pick_tiers.py): a test named on the command line runs whatever its tier.
(That the lists name tests that exist, conftest.py checks whenever the whole suite is collected.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collected(*args: str) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-n", "0", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return [line.strip() for line in run.stdout.splitlines() if "::" in line]


def test_a_test_named_on_the_command_line_runs_whatever_its_tier() -> None:
    lines = (ROOT / "tests" / "full.txt").read_text().splitlines()
    node = next(line for line in lines if line.strip() and not line.startswith("#"))
    assert collected(node) == [node]
