"""Placing trees of leaves per the policy: state in its stored (padded,
partitioned) or logical form, inside the programs that make and read it, and
a batch on the step's layout before the call."""

from __future__ import annotations

import jax

from zero_jax._base.tree import PyTree
from zero_jax._layout.leaf import LeafLayout, pad, unpad
from zero_jax._policy.policy import ZeroPolicy


def place(
    x: jax.Array, policy: ZeroPolicy, layout: LeafLayout, partitioned: bool, axes: tuple[str, ...] | None
) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, policy.named_sharding(layout, partitioned, axes))


def store(
    tree: PyTree, layouts: PyTree, policy: ZeroPolicy, partitioned: bool, *, axes: tuple[str, ...] | None = None
) -> PyTree:
    """Logical (or already stored) arrays -> stored form: padded if
    partitioned (over ``axes``: the parameters' axes by default), and placed."""

    def one(x: jax.Array, lay: LeafLayout) -> jax.Array:
        if not partitioned or lay.dim is None:
            return place(x, policy, lay, False, axes)
        if tuple(x.shape) == lay.shape:
            x = pad(x, lay)
        return place(x, policy, lay, True, axes)

    return jax.tree.map(one, tree, layouts)


def to_logical(
    tree: PyTree, layouts: PyTree, policy: ZeroPolicy, partitioned: bool, *, axes: tuple[str, ...] | None = None
) -> PyTree:
    """Stored (or already logical) arrays -> logical arrays, still partitioned.

    Inside ``jit`` the compiler keeps the unpadded array on the same devices
    (the cut lines of the padded and unpadded arrays coincide), so this moves
    no data.
    """

    def one(x: jax.Array, lay: LeafLayout) -> jax.Array:
        if tuple(x.shape) == lay.stored_shape and lay.padding:
            x = unpad(x, lay)
        return place(x, policy, lay, partitioned and lay.dim is not None, axes)

    return jax.tree.map(one, tree, layouts)


def place_batch(batch: PyTree, shardings: PyTree) -> PyTree:
    """A batch on the step's layout: each committed array laid out otherwise
    (put on one device, or split over another mesh) moved to its sharding;
    anything else (host values, uncommitted arrays, another process's
    global arrays) left for ``jit`` to place as it would."""

    def one(x: object, sharding: jax.sharding.Sharding) -> object:
        concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)  # traced: jit places it  # pyright: ignore[reportAttributeAccessIssue] - jax.core is loaded by import jax
        if concrete and x.committed and x.is_fully_addressable:  # pyright: ignore[reportAttributeAccessIssue] - concrete: x is a jax.Array
            if not x.sharding.is_equivalent_to(sharding, x.ndim):  # pyright: ignore[reportAttributeAccessIssue] - concrete: x is a jax.Array
                return jax.device_put(x, sharding)
        return x

    return jax.tree.map(one, batch, shardings)
