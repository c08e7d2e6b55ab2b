"""Pytree vocabulary shared by every floor: key paths as users write them,
the one meaning of "under a prefix", and the donated-state check.

>>> import jax
>>> from zero_jax._base.tree import path_str, under
>>> (path, _), = jax.tree_util.tree_flatten_with_path({"layers": {"w": 1}})[0]
>>> path_str(path), under(path, ("layers",)), under(path, ("w",))
('layers/w', True, False)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax

PyTree = Any
KeyPath = tuple[Any, ...]


def key_name(key: Any) -> str:
    """The plain name of one key-path entry (``'w'``, ``'0'``, ``'mu'``)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def key_names(path: KeyPath) -> tuple[str, ...]:
    """A key path as a tuple of plain names: ``('layers', 'mlp', 'w')``."""
    return tuple(key_name(k) for k in path)


def path_str(path: KeyPath) -> str:
    """A key path as users write it: ``layers/mlp/w``."""
    return "/".join(key_names(path)) or "<root>"


def split_prefix(prefix: str) -> tuple[str, ...]:
    """A user's prefix string (``"decoder/blocks"`` or ``"decoder.blocks"``) as names."""
    return tuple(p for p in prefix.replace(".", "/").split("/") if p)


def under(path: KeyPath | str, prefix: tuple[str, ...]) -> bool:
    """Whether ``path`` lies in the subtree named by ``prefix`` (a tuple of
    names, matched from the root): the one meaning of ``stacked=``."""
    names = split_prefix(path) if isinstance(path, str) else key_names(path)
    return len(prefix) > 0 and names[: len(prefix)] == prefix


def under_any(path: KeyPath | str, prefixes: Iterable[tuple[str, ...]]) -> bool:
    """Whether ``path`` lies under any of ``prefixes``."""
    return any(under(path, p) for p in prefixes)


DONATED_STATE = (
    "{where}: {count} array(s) of this state were donated to an earlier train step and no longer exist "
    "(first: {paths}). A train step consumes the state it is given: keep the state it returns "
    "(`state, metrics = train_step(state, batch)`) and use that one; to keep a copy that outlives the "
    "next step, take `zj.full_params(state)` or `jax.tree.map(jnp.copy, state)` before calling the step."
)


def check_live(tree: PyTree, *, where: str) -> None:
    """Raise one ``ValueError`` naming every array of ``tree`` whose buffers
    were donated (deleted), instead of letting XLA read freed memory. Traced
    values (inside ``jax.jit`` or ``eval_shape``) are never deleted."""
    dead = [
        path_str(path)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted()  # pyright: ignore[reportAttributeAccessIssue] - jax.core is loaded by import jax
    ]
    if dead:
        shown = ", ".join(dead[:5]) + (", ..." if len(dead) > 5 else "")
        raise ValueError(DONATED_STATE.format(where=where, count=len(dead), paths=shown))
