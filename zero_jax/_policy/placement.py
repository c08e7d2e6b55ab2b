"""TODO."""

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
