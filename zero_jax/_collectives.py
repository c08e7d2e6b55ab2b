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
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    varying = manual.varying if manual is not None else getattr(jax.typeof(x), "vma", frozenset())
    missing = tuple(a for a in axes if a not in varying)
    if not missing:  # already per-device
        return x
    return jax.lax.pcast(x, missing if len(missing) > 1 else missing[0], to="varying")


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


def fetch(source: jax.Array, layout: LeafLayout, axis: AxisName, *, gather: bool) -> jax.Array:
    """A parameter for forward use only: all-gathered from this device's piece
    (``gather=True``, ZeRO-3) or the whole parameter already held (ZeRO-2)."""
    return gather_for_use(source, layout, axis) if gather else to_varying(source, axis)


def fetch_with_grad_slot(
    source: jax.Array, slot: jax.Array, layout: LeafLayout, axis: AxisName, *, gather: bool
) -> jax.Array:
    """:func:`fetch` ``source`` for the forward pass; in the backward pass send
    its cotangent, cast to ``slot``'s dtype and reduce-scattered, to ``slot``
    (a per-device zero piece the caller differentiates against).

    This is how ZeRO-2 and ZeRO-3 keep gradients partitioned: each parameter's
    gradient is reduced the moment the backward pass produces it, in the
    reduce dtype of the precision policy (not the compute dtype), and the
    whole-model gradient is never held. In ZeRO-3 the forward gather runs
    again whenever the caller's remat recomputes it.
    """

    @jax.custom_vjp
    def use(src: jax.Array, slot: jax.Array) -> jax.Array:
        del slot
        return fetch(src, layout, axis, gather=gather)

    def fwd(src: jax.Array, slot: jax.Array) -> tuple[jax.Array, None]:
        return use(src, slot), None

    def bwd(_: None, ct: jax.Array) -> tuple[None, jax.Array]:
        return None, sum_reduce_scatter(ct.astype(slot.dtype), layout, axis)

    use.defvjp(fwd, bwd)
    return use(source, slot)


def zeros_like_piece(layout: LeafLayout, num_shards: int, axis: AxisName, dtype: object) -> jax.Array:
    """A per-device zero array shaped like this device's piece of a leaf."""
    return to_varying(jnp.zeros(shard_shape(layout, num_shards), dtype), axis)
