"""Which subtrees of a parameter pytree repeat: the tree walk, block signatures, the groups of numbered
siblings ``layers="auto"`` takes, and the order a model calls them in. Pure pytree analysis (no Flax or
Equinox); :mod:`zero_jax.adapters._blocks` resolves ``layers=`` with it.

>>> import jax.numpy as jnp
>>> params = {"h": [{"w": jnp.zeros(4)}, {"w": jnp.zeros(4), "pos": jnp.zeros(2)}], "head": {"w": jnp.zeros(2)}}
>>> block_groups(params).groups
((('h', '0'), ('h', '1')),)
>>> describe_group(block_groups(params).groups[0])
"'h/*' (2 blocks: h/0 … h/1)"
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax._base.tree import PyTree, key_name
from zero_jax._layerwise.pieces import Sharded

__all__ = [
    "Groups",
    "Path",
    "Signature",
    "block_groups",
    "call_order",
    "children",
    "creation_rank",
    "describe_group",
    "difference",
    "group_pattern",
    "index_tree",
    "is_leaf",
    "join_path",
    "natural_key",
    "repeated_groups",
    "block_runs",
    "sibling_key",
    "signature",
    "split_path",
    "name_stem",
    "subtree_bytes",
    "subtree_paths",
]

Path = tuple[str, ...]
Signature = tuple[tuple[Path, tuple[int, ...], str], ...]


def is_leaf(x: Any) -> bool:
    return isinstance(x, Sharded)


def children(node: Any) -> list[tuple[str, Any]] | None:
    """One level of a pytree node as ``(name, child)``; None for a leaf."""
    if is_leaf(node):
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(flat) == 1 and not flat[0][0] and flat[0][1] is node:
        return None
    return [(key_name(path[0]), child) for path, child in flat]


def _walk(tree: Any, prefix: Path, nodes: dict[Path, Any], leaves: dict[Path, Any]) -> None:
    kids = children(tree)
    if kids is None:
        if tree is not None:
            leaves[prefix] = tree
        return
    nodes[prefix] = tree
    for name, child in kids:
        _walk(child, (*prefix, name), nodes, leaves)


def index_tree(params: PyTree) -> tuple[dict[Path, Any], dict[Path, Any]]:
    """Every internal node and every leaf of ``params``, by key path."""
    nodes: dict[Path, Any] = {}
    leaves: dict[Path, Any] = {}
    _walk(params, (), nodes, leaves)
    return nodes, leaves


def split_path(path: str) -> Path:
    return tuple(p for p in path.split("/") if p)


def join_path(path: Path) -> str:
    return "/".join(path) or "<root>"


def natural_key(path: Path) -> tuple[tuple[tuple[int, Any], ...], ...]:
    return tuple(tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", s) if t) for s in path)


def _leaf_bytes(leaf: Any) -> int:
    shape = tuple(getattr(leaf, "shape", ()))
    dtype = getattr(leaf, "dtype", None)
    return math.prod(shape) * (np.dtype(dtype).itemsize if dtype is not None else 0)


def signature(path: Path, leaves: Mapping[Path, Any]) -> Signature:
    n = len(path)
    return tuple(
        (p[n:], tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
        for p, x in sorted(leaves.items())
        if p[:n] == path and len(p) > n
    )


def subtree_bytes(path: Path, leaves: Mapping[Path, Any]) -> int:
    n = len(path)
    return sum(_leaf_bytes(x) for p, x in leaves.items() if p[:n] == path and len(p) > n)


def name_stem(name: str) -> str | None:
    m = re.fullmatch(r"(.*?)(\d+)", name)
    return m.group(1) if m else None


def repeated_groups(params: PyTree) -> list[tuple[Path, ...]]:
    """Every group of sibling subtrees named ``<stem><number>`` with identical
    parameter structure, at least two strong, most parameter bytes first."""
    nodes, leaves = index_tree(params)
    groups: dict[tuple[Path, str, Signature], list[Path]] = {}
    for path in nodes:
        stem = name_stem(path[-1]) if path else None
        sig = signature(path, leaves) if stem is not None else ()
        if sig:
            groups.setdefault((path[:-1], stem, sig), []).append(path)  # pyright: ignore[reportArgumentType] - a node's path is a tuple of names
    found = [tuple(sorted(g, key=natural_key)) for g in groups.values() if len(g) >= 2]
    return sorted(found, key=lambda g: (-len(g) * subtree_bytes(g[0], leaves), natural_key(g[0])))


def describe_group(group: tuple[Path, ...]) -> str:
    """``"'h/*' (12 blocks: h/0 … h/11)"``: a group of :func:`repeated_groups` as messages name it."""
    parent, stem = join_path(group[0][:-1]) if len(group[0]) > 1 else "", name_stem(group[0][-1])  # pyright: ignore[reportGeneralTypeIssues] - a node's path is a tuple of names
    pattern = f"{parent}/{stem}*" if parent else f"{stem}*"
    return f"{pattern!r} ({len(group)} blocks: {join_path(group[0])} … {join_path(group[-1])})"


def group_pattern(group: tuple[Path, ...]) -> str:
    """The ``layers=`` pattern that matches a group of :func:`repeated_groups` (``"h/*"``)."""
    return join_path((*group[0][:-1], f"{name_stem(group[0][-1])}*"))


def difference(a: Signature, b: Signature) -> str:
    sa, sb = {p: (s, d) for p, s, d in a}, {p: (s, d) for p, s, d in b}
    parts = [f"only the first has '{join_path(p)}'" for p in sorted(set(sa) - set(sb))]
    parts += [f"only the second has '{join_path(p)}'" for p in sorted(set(sb) - set(sa))]
    parts += [
        f"'{join_path(p)}' is {sa[p][0]} {sa[p][1]} vs {sb[p][0]} {sb[p][1]}"
        for p in sorted(set(sa) & set(sb))
        if sa[p] != sb[p]
    ]
    return "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")


def sibling_key(path: Path) -> tuple[Path, str] | None:
    """``(parent, stem)`` of a numbered subtree (``h/3`` -> ``(('h',), '')``), else None."""
    stem = name_stem(path[-1]) if path else None
    return None if stem is None else (path[:-1], stem)


def block_runs(paths: list[Path]) -> list[list[Path]]:
    """Consecutive blocks that differ in one numbered name, as runs (for messages)."""
    out: list[list[Path]] = []
    for p in paths:
        if out and _next_sibling(out[-1][-1], p):
            out[-1].append(p)
        else:
            out.append([p])
    return out


def _next_sibling(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` differ in one numbered name of one stem (``h/0/mlp`` and ``h/1/mlp``)."""
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y] if len(a) == len(b) else []
    return (
        len(diff) == 1
        and sibling_key(a[: diff[0] + 1]) is not None
        and (name_stem(a[diff[0]]) == name_stem(b[diff[0]]))
    )


def subtree_paths(params: PyTree) -> list[str]:
    """The key path of every subtree (internal node) of ``params`` that holds a leaf."""
    nodes, leaves = index_tree(params)
    return [join_path(p) for p in nodes if p and signature(p, leaves)]


class Groups(NamedTuple):
    """What :func:`block_groups` found: the groups of blocks, and the numbered
    siblings of a group left whole (``(path, why)``)."""

    groups: tuple[tuple[Path, ...], ...]
    left_whole: tuple[tuple[Path, str], ...]


def block_groups(params: PyTree) -> Groups:
    """Every group of blocks ``layers="auto"`` takes (see the module docstring),
    outermost first: numbered siblings sharing a core structure, members with
    extra leaves besides it included; members that differ otherwise left whole.

    >>> import jax.numpy as jnp
    >>> params = {"h": [{"w": jnp.zeros(4)}, {"w": jnp.zeros(4)}, {"w": jnp.zeros(4), "pos": jnp.zeros(2)},
    ...                 {"w": jnp.zeros(5)}]}
    >>> found = block_groups(params)
    >>> found.groups
    ((('h', '0'), ('h', '1'), ('h', '2')),)
    >>> found.left_whole
    ((('h', '3'), "its parameters differ from 'h/0' ('w' is (4,) float32 vs (5,) float32)"),)
    """
    nodes, leaves = index_tree(params)
    sets: dict[tuple[Path, str], list[Path]] = {}
    for path in nodes:
        key = sibling_key(path)
        if key is not None and signature(path, leaves):
            sets.setdefault(key, []).append(path)
    groups: list[tuple[Path, ...]] = []
    left: list[tuple[Path, str]] = []
    for key in sorted(sets, key=lambda k: (len(k[0]), natural_key(k[0]), k[1])):
        members = [p for p in sets[key] if not any(p[: len(b)] == b for g in groups for b in g)]
        sigs = {p: signature(p, leaves) for p in members}
        counts = collections.Counter(sigs.values())
        if len(members) < 2:
            continue
        common, n = counts.most_common(1)[0]
        core = common if n >= 2 else min(counts, key=lambda g: (len(g), sum(math.prod(s) for _, s, _ in g)))
        blocks = sorted((p for p in members if set(core) <= set(sigs[p])), key=natural_key)
        if len(blocks) < 2:
            continue
        like = next(p for p in blocks if sigs[p] == core)
        groups.append(tuple(blocks))
        left += [
            (p, f"its parameters differ from '{join_path(like)}' ({difference(core, sigs[p])})")
            for p in sorted(set(members) - set(blocks), key=natural_key)
        ]
    left = [(p, why) for p, why in left if not any(p[: len(b)] == b for g in groups for b in g)]
    return Groups(tuple(groups), tuple(left))


def creation_rank(tree: Any) -> dict[Path, int]:
    """Preorder rank of every subtree of ``tree``, children in the order the
    containers hold them (a dict: insertion order, which for a model's
    variables is the order ``init`` created, i.e. called, its submodules)."""
    rank: dict[Path, int] = {}

    def walk(node: Any, path: Path) -> None:
        rank.setdefault(path, len(rank))
        if isinstance(node, Mapping):
            kids = [(str(k), v) for k, v in node.items()]
        elif isinstance(node, (list, tuple)):
            kids = [(str(i), v) for i, v in enumerate(node)]
        else:
            kids = children(node) or []
        for name, child in kids:
            walk(child, (*path, name))

    walk(tree, ())
    return rank


def call_order(matched: list[Path], order: Any) -> list[Path]:
    """``matched`` in the order the model calls its blocks, as far as the creation order of ``order`` tells:
    creation order where it agrees with the numbers within each group of siblings; else groups by their
    first creation, numeric order within each; without ``order`` (or a path it lacks), numeric-aware order."""
    ordered = sorted(set(matched), key=natural_key)
    rank = creation_rank(order) if order is not None else {}
    if not all(p in rank for p in ordered):
        return ordered
    sets: dict[Any, list[Path]] = {}
    for p in ordered:
        sets.setdefault(sibling_key(p) or p, []).append(p)
    if all(sorted(g, key=rank.__getitem__) == g for g in sets.values()):
        return sorted(ordered, key=rank.__getitem__)
    first = {k: min(rank[p] for p in g) for k, g in sets.items()}
    return sorted(ordered, key=lambda p: (first[sibling_key(p) or p], natural_key(p)))
