"""Block quantization for the wire (ZeRO++'s qwZ and qgZ): pure functions.

A piece travels as symmetric int8 values plus one float32 scale per block of
``block`` consecutive elements (the piece flattened, its tail padded with
zeros; a piece smaller than ``block`` is one block): ``scale = max|block| /
127`` and ``q = round(x / scale)``. The round trip is off by at most
``scale / 2`` per element (plus the float rounding of the multiply), and a
block holding a NaN or an infinity comes back non-finite everywhere, so a
loss-scaled fp16 overflow step is still seen (and skipped). Quantization exists only on the wire: ``collectives``
dequantizes right after the collective, and the master copy, the optimizer
and the reduced gradients never hold int8.

>>> import jax.numpy as jnp
>>> x = jnp.linspace(-1.0, 1.0, 10)
>>> q, scale = quantize_blocks(x, 4)
>>> q.dtype, q.shape, scale.shape
(dtype('int8'), (3, 4), (3,))
>>> y = dequantize_blocks(q, scale, x.shape, x.dtype)
>>> bool(jnp.all(jnp.abs(y - x) <= scale.max() / 2 + 1e-7))
True
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._theory.wire import block_size, num_blocks

#: The largest magnitude of a symmetric int8 value.
_INT8_MAX = 127


def quantize_blocks(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """``x`` (any shape) flattened into blocks of ``block`` values: int8
    values of shape ``(blocks, block)`` and float32 scales ``(blocks,)``
    (several pieces at once: ``jax.vmap`` it)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    blocks, block = num_blocks(flat.size, block), block_size(flat.size, block)
    flat = jnp.pad(flat, (0, blocks * block - flat.size))
    grid = flat.reshape(blocks, block)
    scale = jnp.max(jnp.abs(grid), axis=1) / _INT8_MAX
    # A zero block has scale 0 (every value 0); a block with a NaN or an
    # infinity gets a non-finite scale, and its values are sent as 0: the
    # receiver's 0 * scale is NaN, so non-finiteness survives the wire.
    finite = jnp.isfinite(grid) & (scale[:, None] > 0) & jnp.isfinite(scale[:, None])
    safe = jnp.where(finite, grid / jnp.where(finite, scale[:, None], 1.0), 0.0)
    q = jnp.clip(jnp.round(safe), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
    return q, scale


def dequantize_blocks(q: jax.Array, scale: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The inverse of :func:`quantize_blocks`: ``q * scale`` per block, the
    padding dropped, reshaped to ``shape`` and cast to ``dtype``."""
    values = (q.astype(jnp.float32) * scale[:, None]).reshape(-1)[: math.prod(shape)]
    return values.reshape(shape).astype(dtype)


def round_trip_bound(x: np.ndarray | jax.Array, block: int) -> jax.Array:
    """Per element, the largest error the round trip may make: half a
    quantization step of its block (``max|block| / 127 / 2``)."""
    _, scale = quantize_blocks(x, block)  # pyright: ignore[reportArgumentType] - quantize_blocks takes numpy arrays too
    size = int(np.size(x))
    return jnp.repeat(scale / 2, block_size(size, block))[:size].reshape(jnp.shape(x))
