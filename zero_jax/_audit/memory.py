"""What a step holds: bytes per device of live arrays (``resident_bytes``,
``resident_bytes_by_kind``), ``memory_analysis()``'s figures (``memory``), and
the buffer assignment's own total per memory space, read from an XLA dump
(``memory_usage_totals``, ``hbm_bytes_from_dump``; ``zj.audit`` reads it from
its one compile into ``report.memory["allocated"]``), and XLA's live peak
(``live_peak``, ``live_peak_from_dump``): the bytes of the values alive at once
at the busiest point of the schedule (``HloLiveRange``), before the heap packs
them into buffers, and which buffers are alive there.

XLA plans device memory statically, so fragmentation is the gap between what
the buffer assignment allocates and the live peak (``report.fragmentation``).
Measured with libtpu 0.0.42.1 (v5p, layer-wise stage 3): the TPU compiler
allocates several times its live peak; XLA:CPU within a few percent of it.

On TPU argument + output + temp − alias overestimates HBM (temp counts buffers
the assignment shares); the memory-usage report's "Total bytes" of the
default memory space is the HBM the program is given. On XLA:CPU the two agree;
on XLA:GPU too, within 1% (``h100:1x8``, a tiny stage-3 step), the report's
device spaces summed (:func:`gpu_device_bytes`).
"""

from __future__ import annotations

import collections
import glob
import os
import re
from typing import Any, NamedTuple

import jax

#: A memory space's total in XLA's ``*memory-usage-report*`` dump file.
_SPACE_TOTAL = re.compile(r"Memory Space: (?P<space>\S+) \(color=(?P<color>\d+)\)\s*\nTotal bytes: (?P<bytes>\d+)")
#: The live-range dump (``*after_optimizations-live-range.txt``, CPU and TPU alike): the position of the
#: busiest point in the instruction sequence, each buffer alive there, and their total.
_PEAK_AT = re.compile(r"^\s*Live ranges at (\d+) \(peak\):$", re.M)
_PEAK_BUFFER = re.compile(r"^\s+(?P<name>[^\s{]+)(?P<index>\{[\d,]*\}): (?P<bytes>\d+) bytes \(cumulative", re.M)
_PEAK_TOTAL = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+) bytes")
_SEQUENCE = re.compile(r"^\s+(\d+):(\S+)$", re.M)
LIVE_RANGE_GLOB = "*after_optimizations-live-range.txt"
#: XLA's colour of host memory (``S(5)`` in a layout): offloaded buffers, not device memory.
HOST_COLOR = 5
MEMORY_USAGE_GLOB = "*memory-usage-report*"


class LivePeak(NamedTuple):
    """XLA's live peak of one compiled program (its ``HloLiveRange`` dump).

    Attributes:
      bytes: the values alive at once at the busiest point of the schedule
        (arguments still in use included), before the heap packs them.
      at: the instruction scheduled at that point.
      buffers: every buffer alive there as (name, shape index, bytes), largest
        first; the name is the instruction that defines it.
    """

    bytes: int
    at: str
    buffers: tuple[tuple[str, str, int], ...]


def resident_bytes(tree: Any) -> dict[Any, int]:
    """Bytes held by each device for the arrays of ``tree`` (padding included)."""
    out: dict[Any, int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return dict(out)


def memory(compiled: Any) -> dict[str, int]:
    """Per-device figures of ``compiled.memory_analysis()`` and the peak estimate."""
    m = compiled.memory_analysis()
    fig = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    fig["peak"] = fig["argument"] + fig["output"] + fig["temp"] - fig["alias"]
    return fig


def resident_bytes_by_kind(tree: Any) -> dict[tuple[Any, str], int]:
    """Bytes held per (device, memory kind) for the arrays of ``tree``:
    offloaded leaves count under ``"pinned_host"``, the rest under ``"device"``.

    >>> import jax, jax.numpy as jnp
    >>> x = jax.device_put(jnp.zeros(4), jax.devices()[0])
    >>> resident_bytes_by_kind(x)[(jax.devices()[0], "device")]
    16
    """
    out: dict[tuple[Any, str], int] = collections.defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        kind = leaf.sharding.memory_kind or "device"
        for shard in leaf.addressable_shards:
            out[(shard.device, kind)] += shard.data.nbytes
    return dict(out)


def memory_usage_totals(report: str) -> dict[str, int]:
    """Memory space -> "Total bytes" of an XLA memory-usage report
    (``default`` is device memory: HBM on TPU; ``vmem`` is on-chip; host
    memory appears as another space).

    >>> memory_usage_totals("Memory Space: default (color=0)\\nTotal bytes: 5072256 (4.84MiB)")
    {'default': 5072256}
    """
    return {m["space"]: int(m["bytes"]) for m in _SPACE_TOTAL.finditer(report)}


def gpu_device_bytes(report: str) -> int | None:
    """The GPU memory an XLA:GPU memory-usage report gives its program: every
    memory space but host memory (colour 5, :data:`HOST_COLOR`). jax-cuda12-plugin
    0.10.2 reports one space, ``default``; jax-cuda13-plugin 0.12.1 puts the
    temporaries in a space of their own, ``color_7``, beside the parameters
    and outputs in ``default`` (measured on ``h100:1x8``): both are the GPU's.

    >>> gpu_device_bytes(chr(10).join(["Memory Space: default (color=0)", "Total bytes: 841253 (821.5KiB)",
    ...                                   "Memory Space: color_7 (color=7)", "Total bytes: 1755880 (1.67MiB)"]))
    2597133
    """
    spaces = [int(m["bytes"]) for m in _SPACE_TOTAL.finditer(report) if int(m["color"]) != HOST_COLOR]
    return sum(spaces) if spaces else None


def _last_written(dump_dir: str, pattern: str) -> tuple[str, str] | None:
    """The name and text of the newest file matching ``pattern`` in an XLA dump folder: with several
    modules, the step (the small helper programs are written first); ``None`` if there is none."""
    found = sorted(glob.glob(os.path.join(dump_dir, pattern)), key=os.path.getmtime)
    if not found:
        return None
    with open(found[-1]) as f:
        return os.path.basename(found[-1]), f.read()


def hbm_bytes_from_dump(dump_dir: str) -> int | None:
    """The device-memory total (HBM on TPU) of the program XLA dumped to
    ``dump_dir`` (``xla_dump_to``): the default memory space of its
    memory-usage report (on GPU every device space, :func:`gpu_device_bytes`),
    ``None`` if there is none. With several modules, the one written last (the
    step; the small helper programs come first)."""
    written = _last_written(dump_dir, MEMORY_USAGE_GLOB)
    if written is None:
        return None
    name, report = written
    if "_gpu_after_optimizations" in name:  # XLA:GPU's dump (``module_N.jit_f.sm_9.0a_gpu_after_optimizations-...``)
        return gpu_device_bytes(report)
    return memory_usage_totals(report).get("default")


def live_peak(report: str) -> LivePeak | None:
    """XLA's live peak read from the text of a ``*live-range.txt`` dump
    (``None`` if it has no peak).

    >>> text = chr(10).join(["HloLiveRange (max 3):", "  InstructionSequence:", "    0:p", "    1:dot.1", "    2:add",
    ...     "  BufferLiveRange:", "    p{}:0-3", "  Live ranges at 1 (peak):",
    ...     "    dot.1{}: 512 bytes (cumulative: 512 bytes)", "    p{}: 64 bytes (cumulative: 576 bytes)",
    ...     "  Stack trace breakdown for peak usage: 576 bytes"])
    >>> live_peak(text)
    LivePeak(bytes=576, at='dot.1', buffers=(('dot.1', '{}', 512), ('p', '{}', 64)))
    """
    total, at = _PEAK_TOTAL.search(report), _PEAK_AT.search(report)
    if total is None or at is None:
        return None
    section = report[at.end() : total.start()]
    buffers = sorted(
        ((m["name"], m["index"], int(m["bytes"])) for m in _PEAK_BUFFER.finditer(section)), key=lambda b: -b[2]
    )
    sequence = dict(_SEQUENCE.findall(report[: at.start()]))
    return LivePeak(int(total.group(1).replace(" ", "")), sequence.get(at.group(1), ""), tuple(buffers))


def live_peak_from_dump(dump_dir: str) -> LivePeak | None:
    """XLA's live peak of the program dumped to ``dump_dir`` (the newest
    live-range report: the step's, as :func:`hbm_bytes_from_dump`); ``None``
    if there is none."""
    written = _last_written(dump_dir, LIVE_RANGE_GLOB)
    return None if written is None else live_peak(written[1])
