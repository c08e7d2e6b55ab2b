"""A pytest plugin that measures what each test costs and which lines of
``zero_jax/`` it runs: the input of ``tools/pick_tiers.py``.

    PYTHONPATH=tools python -m pytest -q -n 2 -p test_costs --full   # writes test_costs.<worker>.jsonl

One JSON line per test: its node id, wall seconds, CPU seconds of the test
process and of the child processes it waited for (``getrusage``: a loaded
machine stretches the wall time, hardly the CPU time; ``setup``: what building
its fixtures took, which a module fixture charges to the first test using it), and the ``file:line``
pairs of ``zero_jax/`` it executed, in the test process and in the Python
child processes it started (``sys.monitoring``, Python 3.12+: each line
reported once per test, then disabled until the next; children load a
``sitecustomize`` this plugin puts first on ``PYTHONPATH``, and report at
exit). The output goes to ``$TEST_COSTS`` (a path prefix; default
``test_costs`` in the working directory), one file per xdist worker.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

PACKAGE = str(Path(__file__).resolve().parent.parent / "zero_jax") + os.sep
_lines: set[tuple[str, int]] = set()
_in_package: dict[str, bool] = {}


def _on_line(code: Any, line: int) -> Any:
    name = code.co_filename
    inside = _in_package.get(name)
    if inside is None:
        inside = _in_package[name] = name.startswith(PACKAGE)
    if inside:
        _lines.add((name[len(PACKAGE) :], line))
    return sys.monitoring.DISABLE


if sys.version_info < (3, 12):
    raise RuntimeError("tools/test_costs.py reads lines with sys.monitoring: run it on Python 3.12 or newer")
_monitor = sys.monitoring
_monitor.use_tool_id(_monitor.COVERAGE_ID, "zero_jax test costs")
_monitor.register_callback(_monitor.COVERAGE_ID, _monitor.events.LINE, _on_line)
_monitor.set_events(_monitor.COVERAGE_ID, _monitor.events.LINE)
atexit.register(_monitor.set_events, _monitor.COVERAGE_ID, 0)  # no callbacks while the interpreter shuts down


# A child process reports its lines to the file and test named in TEST_COSTS_CHILD (set per test, inherited).
CHILD = f"""import atexit, json, os, sys
_, _out, _test = os.environ["TEST_COSTS_CHILD"].split("|", 2)
_lines, _package = set(), {PACKAGE!r}
def _on_line(code, line):
    if code.co_filename.startswith(_package):
        _lines.add(code.co_filename[len(_package):] + ":" + str(line))
    return sys.monitoring.DISABLE
sys.monitoring.use_tool_id(sys.monitoring.COVERAGE_ID, "zero_jax test costs")
sys.monitoring.register_callback(sys.monitoring.COVERAGE_ID, sys.monitoring.events.LINE, _on_line)
sys.monitoring.set_events(sys.monitoring.COVERAGE_ID, sys.monitoring.events.LINE)
@atexit.register
def _report():
    with open(_out, "a") as f:
        f.write(json.dumps({{"id": _test, "lines": sorted(_lines)}}) + "\\n")
"""
_site = tempfile.mkdtemp(prefix="test_costs_site_")
with open(os.path.join(_site, "sitecustomize.py"), "w") as _f:
    _f.write("import os\nif os.environ.get('TEST_COSTS_CHILD', '').startswith('on|'):\n")
    _f.write("".join(f"    {line}\n" for line in CHILD.splitlines()))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_site, os.environ.get("PYTHONPATH")]))


def _out(kind: str) -> str:
    return f"{os.environ.get('TEST_COSTS', 'test_costs')}.{kind}{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


_setup_cpu = [0.0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):  # noqa: ARG001 - pytest's signature
    own0, children0 = _cpu()
    yield
    own1, children1 = _cpu()
    _setup_cpu[0] = own1 - own0 + children1 - children0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ARG001 - pytest's signature
    _lines.clear()
    _monitor.restart_events()
    os.environ["TEST_COSTS_CHILD"] = f"on|{os.path.abspath(_out('child.'))}|{item.nodeid}"
    start, (own0, children0) = time.perf_counter(), _cpu()
    yield
    wall, (own1, children1) = time.perf_counter() - start, _cpu()
    row = {
        "id": item.nodeid, "wall": round(wall, 3), "cpu": round(own1 - own0, 3),
        "child": round(children1 - children0, 3), "setup": round(_setup_cpu[0], 3),
        "lines": sorted(f"{f}:{n}" for f, n in _lines),
    }  # fmt: skip
    with open(_out(""), "a") as f:
        f.write(json.dumps(row) + "\n")
