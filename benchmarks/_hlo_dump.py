"""The compiled programs the layer-wise benchmarks read, in one place.

Importing this module (before jax) makes every compilation of the process dump its HLO right after
SPMD partitioning, and XLA's live-range report, into one temporary folder removed at exit. The flags
are set for the whole process (not as per-call compiler options) so that ``lower(...).compile()``
and the jit-dispatched call compile with the same options: the step then reuses the executable
instead of compiling a second time.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile
from typing import Any, NamedTuple

DUMP_DIR = tempfile.mkdtemp(prefix="zero-jax-hlo-")
atexit.register(shutil.rmtree, DUMP_DIR, ignore_errors=True)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP_DIR} --xla_dump_hlo_pass_re=spmd-partitioning"
)

from zero_jax import measure  # noqa: E402  (after XLA_FLAGS: the flags are read when jax starts its backend)


class Compiled(NamedTuple):
    """One compilation: the executable, its HLO right after SPMD partitioning (what
    ``_measure.parse_collectives`` reads) and XLA's live peak, the bytes of the values alive at once
    at the busiest point of the schedule (``HloLiveRange``), before the heap packs them into buffers."""

    executable: Any
    spmd_hlo: str
    live_peak: int


def compile_with_hlo(lowerable: Any, *args: Any) -> Compiled:
    """Compile ``lowerable(*args)`` and read what this compilation dumped (then delete it)."""
    pattern = os.path.join(DUMP_DIR, "*after_spmd-partitioning*")
    ranges = os.path.join(DUMP_DIR, measure.LIVE_RANGE_GLOB)
    before = set(glob.glob(pattern)) | set(glob.glob(ranges))
    executable = lowerable.lower(*args).compile()
    new = sorted(set(glob.glob(pattern)) - before)
    new_ranges = sorted(set(glob.glob(ranges)) - before)
    if not new or not new_ranges:
        raise RuntimeError("XLA wrote no post-SPMD-partitioning or live-range dump")
    with open(new[-1]) as f:
        hlo = f.read()
    with open(new_ranges[-1]) as f:
        found = measure.live_peak(f.read())
    if found is None:
        raise RuntimeError(f"no peak-usage line in {new_ranges[-1]}")
    for path in new + new_ranges:
        os.remove(path)
    return Compiled(executable, hlo, found.bytes)
