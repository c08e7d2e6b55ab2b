"""Trees of leaf layouts: a hashable record of one (:class:`TreeLayouts`, static
pytree metadata of every state) and the walks that pair a tree of values with
its layouts (:func:`per_leaf`, :func:`leaf_values`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zero_jax._base.tree import PyTree
from zero_jax._layout.leaf import LeafLayout, is_layout, is_real_float


class TreeLayouts(NamedTuple):
    """A hashable record of a pytree's leaf layouts (usable as static aux data)."""

    treedef: Any
    layouts: tuple[LeafLayout, ...]

    @classmethod
    def of(cls, layout_tree: PyTree) -> TreeLayouts:
        leaves, treedef = jax.tree_util.tree_flatten(layout_tree, is_leaf=is_layout)
        return cls(treedef, tuple(leaves))

    def tree(self) -> PyTree:
        return jax.tree_util.tree_unflatten(self.treedef, list(self.layouts))


def with_dtype(layouts: PyTree, dtype: Any) -> PyTree:
    """The same layouts for another copy of the parameters (compute / master)."""
    return jax.tree.map(
        lambda lay: dataclasses.replace(lay, dtype=dtype) if is_real_float(lay) else lay,
        layouts,
        is_leaf=is_layout,
    )


def full_shapes(layouts: TreeLayouts) -> PyTree:
    """Zeros of the logical parameter shapes (for ``eval_shape`` only)."""
    return jax.tree.map(lambda lay: jnp.zeros(lay.shape, lay.dtype), layouts.tree(), is_leaf=is_layout)


def per_leaf(fn: Callable[..., Any], layouts: PyTree, *trees: PyTree) -> PyTree:
    """``fn(*values, layout)`` at each parameter leaf: the trees' values there
    may be ``None`` (a frozen leaf's gradient), and a ``None`` parameter
    subtree is empty (as in JAX)."""
    return jax.tree.map(lambda lay, *xs: fn(*xs, lay), layouts, *trees, is_leaf=is_layout)


def leaf_values(tree: PyTree, layouts: PyTree) -> list[Any]:
    """The values of ``tree`` at the parameter leaves, ``None`` kept in place."""
    return jax.tree.structure(layouts, is_leaf=is_layout).flatten_up_to(tree)
