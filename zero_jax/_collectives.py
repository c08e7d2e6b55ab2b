"""The few collectives every stage composes; all run inside ``jax.shard_map``.

Each takes one leaf and its :class:`LeafLayout`. A partitioned leaf moves by
reduce-scatter / all-gather on its cut dimension (padded to a multiple of N);
a leaf the policy keeps whole moves by all-reduce. Nothing else in the
library calls ``jax.lax`` collectives on state-sized data, so what the
compiled program communicates can be read off this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zero_jax._partition import LeafLayout, pad, shard_shape, unpad

AxisName = str | tuple[str, ...]


def to_varying(x: jax.Array, axis: AxisName) -> jax.Array:
    """Mark a replicated value as per-device inside ``shard_map``.

    Differentiating through a replicated (unvarying) value makes JAX psum its
    cotangent across the axis automatically (an all-reduce). Casting it to
    varying first keeps each device's gradient local, so we choose the
    collective ourselves.
    """
    return jax.lax.pcast(x, axis, to="varying")


def sum_all_reduce(x: jax.Array, axis: AxisName) -> jax.Array:
    """Sum ``x`` over the data axis; every device gets the whole result.

    Gradients are summed, not averaged: the step scales each device's loss by
    1/N before differentiating, so the sum *is* the global mean.
    """
    return jax.lax.psum(x, axis)


def sum_reduce_scatter(x: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """Sum a whole per-device gradient over the data axis and keep this
    device's piece of it (stored, padded form). A leaf the policy keeps whole
    is all-reduced instead."""
    if layout.dim is None:
        return sum_all_reduce(x, axis)
    return jax.lax.psum_scatter(pad(x, layout), axis, scatter_dimension=layout.dim, tiled=True)


def gather_for_use(x: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """All-gather this device's piece of a parameter into the whole, unpadded
    leaf, as a per-device (varying) value. Its transpose is a reduce-scatter,
    so differentiating through it gives each device its piece of the *summed*
    gradient: ZeRO-3's backward communication for free."""
    if layout.dim is None:
        return x
    whole = jax.lax.all_gather(x, axis, axis=layout.dim, tiled=True)
    return unpad(whole, layout)


def gather_replicated(x: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """All-gather pieces into the whole, unpadded leaf, typed as replicated
    (so it may leave ``shard_map`` with ``out_specs=P()``)."""
    if layout.dim is None:
        return x
    whole = jax.lax.all_gather(x, axis, axis=layout.dim, tiled=True, to="invarying")
    return unpad(whole, layout)


def local_piece(x: jax.Array, layout: LeafLayout, axis: AxisName, num_shards: int) -> jax.Array:
    """This device's piece of a replicated, logical leaf (no communication)."""
    if layout.dim is None:
        return x
    size = layout.padded_size // num_shards
    start = jax.lax.axis_index(axis) * size
    return jax.lax.dynamic_slice_in_dim(pad(x, layout), start, size, axis=layout.dim)


def scatter_grad_in_backward(whole: jax.Array, piece_slot: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """Use ``whole`` in the forward pass; in the backward pass, send its
    cotangent, reduce-scattered, to ``piece_slot`` (a per-device zero array of
    the piece's shape that the caller differentiates against).

    This is ZeRO-2: a parameter replicated in the forward pass whose gradient
    is partitioned the moment it exists, so the whole-model gradient is
    never held.
    """

    @jax.custom_vjp
    def use(w: jax.Array, slot: jax.Array) -> jax.Array:
        del slot
        return w

    def fwd(w: jax.Array, slot: jax.Array) -> tuple[jax.Array, None]:
        del slot
        return w, None

    def bwd(_: None, ct: jax.Array) -> tuple[None, jax.Array]:
        return None, sum_reduce_scatter(ct, layout, axis)

    use.defvjp(fwd, bwd)
    return use(to_varying(whole, axis), piece_slot)


def zeros_like_piece(layout: LeafLayout, num_shards: int, axis: AxisName) -> jax.Array:
    """A per-device zero array shaped like this device's piece of a leaf."""
    return to_varying(jnp.zeros(shard_shape(layout, num_shards), layout.dtype), axis)
