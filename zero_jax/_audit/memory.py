"""TODO."""

from __future__ import annotations

import collections
from typing import Any

import jax


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
