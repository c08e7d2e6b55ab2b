"""What a step holds: bytes per device of live arrays (``resident_bytes``,
``resident_bytes_by_kind``), ``memory_analysis()``'s figures (``memory``), and
the buffer assignment's own total per memory space, read from an XLA dump
(``memory_usage_totals``, ``hbm_bytes_from_dump``; ``zj.audit`` reads it from
its one compile into ``report.memory["allocated"]``).

On TPU argument + output + temp − alias overestimates HBM (temp counts buffers
the assignment shares); the memory-usage report's "Total bytes" of the
default memory space is the HBM the program is given. On XLA:CPU the two agree.
"""

from __future__ import annotations

import collections
import glob
import os
import re
from typing import Any

import jax

#: A memory space's total in XLA's ``*memory-usage-report*`` dump file.
_SPACE_TOTAL = re.compile(r"Memory Space: (?P<space>\S+) \(color=(?P<color>\d+)\)\s*\nTotal bytes: (?P<bytes>\d+)")


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


def hbm_bytes_from_dump(dump_dir: str) -> int | None:
    """The device-memory total (HBM on TPU) of the program XLA dumped to
    ``dump_dir`` (``xla_dump_to``): the default memory space of its
    memory-usage report, ``None`` if there is none. With several modules,
    the one written last (the step; the small helper programs come first)."""
    reports = sorted(glob.glob(os.path.join(dump_dir, "*memory-usage-report*")), key=os.path.getmtime)
    if not reports:
        return None
    with open(reports[-1]) as f:
        return memory_usage_totals(f.read()).get("default")
