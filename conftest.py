"""One place sets up every pytest process (tests/ and the doctests in
zero_jax/): 8 simulated CPU devices, before any array exists. Warnings are
errors (pyproject's filterwarnings).

Dtype promotion stays "standard": optax itself (``tree.bias_correction``
raises a Python float to an int32 count) fails under "strict", and every
training test runs optax. Our own padding code is checked under "strict" in
tests/test_layout.py.
"""

import os
import shutil
import tempfile
from pathlib import Path

# The suite is compile-bound (hundreds of small train steps): LLVM's optimisation of the CPU code is most
# of each compile and buys nothing on arrays this small (measured: a 3-layer step compiles in 1.55 s instead
# of 2.5 s). HLO passes, buffer assignment and so every byte, collective and schedule the tests assert are
# the same; both sides of every comparison compile alike. Set before jax starts; subprocesses inherit it.
# (Not XLA:CPU's older loop emitters, --xla_cpu_use_fusion_emitters=false, though they compile a stage-3
# layer-wise step 2.6x faster again: with LLVM's optimisation off they moved a layer-wise BatchNorm model's
# parameters by 2e-3 relative against the same model gathered whole, where the default emitters agree bitwise.)
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE_FLAGS).strip()
os.environ["ZERO_JAX_TEST_XLA_FLAGS"] = FAST_COMPILE_FLAGS  # what tests/_models.child_env gives child processes

# Most of the suite's compiles are of programs another test (or another process: the workers, the README's
# and notebooks' children) already compiled: a fresh closure per test misses jax's in-process cache, but the
# HLO is the same. One persistent compilation cache per run, made here by the first process (the xdist
# controller) and inherited by every worker and child, turns those into loads; it starts empty, so no run
# reads another's executables. Executables are loaded whole: bytes, schedules and numbers are the compiled
# ones (tests/test_train.py + test_scan_layers.py: 91 -> 76 s).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zero_jax_test_compiles_")
    os.environ["ZERO_JAX_TEST_OWNS_COMPILE_CACHE"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The key must hold the ops' names: the audit reads each block's collectives by their name scopes, and two
# programs that differ only there would otherwise share one executable (and the first one's names).
os.environ.setdefault("JAX_COMPILATION_CACHE_INCLUDE_METADATA_IN_KEY", "true")
# ... but not the source lines: with no traceback frames in the ops' locations, the same program built by two
# tests (the plain optax reference, a stage's step of a shared model) is one cache entry, where the lines of each
# test's own closure made two (6 training files, 249 tests: 477 -> 400 CPU s; persistent-cache hits 349 -> 626).
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402

NUM_DEVICES = 8


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("ZERO_JAX_TEST_OWNS_COMPILE_CACHE") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    # Device tests need all 8 devices: fail loudly instead of skipping.
    assert jax.device_count() == NUM_DEVICES, (
        f"tests need {NUM_DEVICES} simulated CPU devices, got {jax.device_count()}: "
        "was a jax array created before conftest.py ran?"
    )


# Three tiers, chosen by measurement (tools/pick_tiers.py writes the lists; CONTRIBUTING.md): the fast tier
# (-m "not slow"; tests/slow.txt lists what it leaves out, besides the tests marked slow in their files), the CI
# tier (the README's test command: every test not in tests/full.txt) and the full tier (--full: everything).
SLOW_LIST = Path(__file__).parent / "tests" / "slow.txt"
FULL_LIST = Path(__file__).parent / "tests" / "full.txt"


# The files longest first (tests/file_seconds.txt, measured by tools/pick_tiers.py): --dist loadfile hands the two
# workers whole files in collection order, so the longest start first and the short ones fill the gaps at the end
# (longest-processing-time first), not one worker running a long file alone while the other idles.
FILE_SECONDS = Path(__file__).parent / "tests" / "file_seconds.txt"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full", action="store_true",
        help="run the full tier too: the tests tests/full.txt lists (the other cases of each matrix and the "
        "end-to-end runs; before a release, on both ends of the supported range)",
    )  # fmt: skip


def listed(path: Path) -> set[str]:
    """The node ids a tier list names (``#`` comments)."""
    if os.environ.get("ZERO_JAX_IGNORE_TIER_LISTS") or not path.exists():
        return set()
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and line[0] != "#"}


def file_seconds(full: bool) -> dict[str, float]:
    """Measured seconds per test file in the CI tier, or the full tier (``path ci full`` lines; ``#`` comments)."""
    if not FILE_SECONDS.exists():
        return {}
    rows = (line.split() for line in FILE_SECONDS.read_text().splitlines() if line.strip() and line[0] != "#")
    return {row[0]: float(row[2] if full and len(row) > 2 else row[1]) for row in rows}


STALE = (
    "{path} names {count} tests the suite does not have (renamed or removed?): {names}. Pick the tiers again "
    "(CONTRIBUTING.md: tools/test_costs.py, then tools/pick_tiers.py) or delete those lines."
)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the whole suite is in items when no path was given
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        ids = {item.nodeid for item in items}
        for path in (SLOW_LIST, FULL_LIST):
            stale = sorted(listed(path) - ids)
            if stale:
                raise pytest.UsageError(STALE.format(path=path.name, count=len(stale), names=stale[:5]))
    seconds = file_seconds(config.getoption("--full"))
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable: a file keeps its order
    slow, full = listed(SLOW_LIST), listed(FULL_LIST)
    for item in items:
        if item.nodeid in slow or item.nodeid in full:
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--full"):
        # A test named on the command line (path::name) runs whatever its tier; the rest of the full tier waits.
        named = tuple(arg for arg in config.args if "::" in arg)
        left_out = [item for item in items if item.nodeid in full and not (named and item.nodeid.startswith(named))]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.nodeid not in full]
