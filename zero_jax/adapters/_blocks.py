"""Which subtrees of a model's parameters are its blocks: ``layers=`` of the
adapters, resolved on the parameter pytree alone (no Flax or Equinox here).

``layers`` is ``"auto"`` (sibling subtrees named ``<stem><number>`` whose
parameters have identical structure, repeated at least twice: ``h/0 … h/11``,
``layers_0 … layers_5``, list entries), a key-path pattern with ``*``
(``"transformer/h/*"``, ``"layers_*"``), or a module class (or tuple of them),
matched through the ``classes`` map the adapter provides (key path -> class of
the submodule there).

>>> import jax.numpy as jnp
>>> params = {"embed": jnp.zeros((10, 4)), "h": [{"w": jnp.zeros((4, 4))} for _ in range(3)]}
>>> blocks = find_blocks(params, "auto", where="example")
>>> blocks.paths, blocks.count, blocks.bytes_per_layer
(('h/0', 'h/1', 'h/2'), 3, 64)
>>> print(blocks)
3 blocks at h/0 … h/2, 64 B each
>>> [sorted(p) for p in block_params(params, blocks)]
[['w'], ['w'], ['w']]
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax import _layers
from zero_jax._layers import Sharded
from zero_jax._tree import PyTree, key_name
from zero_jax._units import fmt_bytes

__all__ = [
    "Blocks",
    "block_params",
    "find_blocks",
    "gather_outside",
    "inside",
    "repeated_groups",
]

Path = tuple[str, ...]
Signature = tuple[tuple[Path, tuple[int, ...], str], ...]


class Blocks(NamedTuple):
    """The blocks ``layers=`` matched (``adapted.layers``).

    Attributes:
      paths: key paths of the matched blocks (``"h/0"``, ``"layers_3"``) in
        call order (numeric-aware: ``h/2`` before ``h/10``).
      count: how many.
      bytes_per_layer: parameter bytes of one block (the largest, if they differ).
      note: how they were found (``"auto"``: the group chosen among several).
    """

    paths: tuple[str, ...]
    count: int
    bytes_per_layer: int
    note: str = ""

    def summary(self) -> str:
        """``"12 blocks at transformer/h/0 … transformer/h/11, 7.1 MiB each"``."""
        if not self.paths:
            return "no blocks"
        where = self.paths[0] if self.count == 1 else f"{self.paths[0]} … {self.paths[-1]}"
        noun = "block" if self.count == 1 else "blocks"
        text = f"{self.count} {noun} at {where}, {fmt_bytes(self.bytes_per_layer)} each"
        return f"{text} ({self.note})" if self.note else text

    def __str__(self) -> str:
        return self.summary()


NO_MATCH = (
    "{where}: layers={layers!r} matches no block of the parameters. {candidates} Pass layers='auto', a key-path "
    "pattern with '*' naming the repeated subtrees (e.g. {example!r}), or the block's module class."
)
NO_CANDIDATES = (
    "The parameters have no repeated subtrees (siblings named like h/0, h/1 or layers_0, layers_1 with identical "
    "structure)."
)
CANDIDATES = "Repeated subtrees found: {groups}."
DIFFERENT = (
    "{where}: layers={layers!r} matches blocks of different structure: '{a}' and '{b}' differ ({diff}). One "
    "layers= group must match blocks with identical parameters: narrow the pattern so it matches only blocks "
    "like '{a}', or name one block class."
)
NESTED = (
    "{where}: layers={layers!r} matches blocks inside other matched blocks: {pairs}. A block is gathered whole, "
    "so match only the outer blocks (or only the inner ones)."
)
BAD_LAYERS = (
    "{where}: layers must be 'auto', a key-path pattern with '*' (e.g. 'transformer/h/*', 'layers_*'), a module "
    "class or a tuple of classes; got {got}."
)
NO_CLASSES = (
    "{where}: layers={layers!r} names module classes, but this model gives no submodule classes to match; pass a "
    "key-path pattern such as {example!r} or 'auto'."
)


def _is_leaf(x: Any) -> bool:
    return isinstance(x, Sharded)


def _children(node: Any) -> list[tuple[str, Any]] | None:
    """One level of a pytree node as ``(name, child)``; None for a leaf."""
    if _is_leaf(node):
        return None
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(flat) == 1 and not flat[0][0] and flat[0][1] is node:
        return None
    return [(key_name(path[0]), child) for path, child in flat]


def _walk(tree: Any, prefix: Path, nodes: dict[Path, Any], leaves: dict[Path, Any]) -> None:
    kids = _children(tree)
    if kids is None:
        if tree is not None:
            leaves[prefix] = tree
        return
    nodes[prefix] = tree
    for name, child in kids:
        _walk(child, (*prefix, name), nodes, leaves)


def _index(params: PyTree) -> tuple[dict[Path, Any], dict[Path, Any]]:
    """Every internal node and every leaf of ``params``, by key path."""
    nodes: dict[Path, Any] = {}
    leaves: dict[Path, Any] = {}
    _walk(params, (), nodes, leaves)
    return nodes, leaves


def _split(path: str) -> Path:
    return tuple(p for p in path.split("/") if p)


def _join(path: Path) -> str:
    return "/".join(path) or "<root>"


def _natural(path: Path) -> tuple[tuple[tuple[int, Any], ...], ...]:
    return tuple(tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", s) if t) for s in path)


def _leaf_bytes(leaf: Any) -> int:
    shape = tuple(getattr(leaf, "shape", ()))
    dtype = getattr(leaf, "dtype", None)
    return math.prod(shape) * (np.dtype(dtype).itemsize if dtype is not None else 0)


def _signature(path: Path, leaves: Mapping[Path, Any]) -> Signature:
    n = len(path)
    return tuple(
        (p[n:], tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
        for p, x in sorted(leaves.items())
        if p[:n] == path and len(p) > n
    )


def _bytes(path: Path, leaves: Mapping[Path, Any]) -> int:
    n = len(path)
    return sum(_leaf_bytes(x) for p, x in leaves.items() if p[:n] == path and len(p) > n)


def _stem(name: str) -> str | None:
    m = re.fullmatch(r"(.*?)(\d+)", name)
    return m.group(1) if m else None


def repeated_groups(params: PyTree) -> list[tuple[Path, ...]]:
    """Every group of sibling subtrees named ``<stem><number>`` with identical
    parameter structure, at least two strong, most parameter bytes first."""
    nodes, leaves = _index(params)
    groups: dict[tuple[Path, str, Signature], list[Path]] = {}
    for path in nodes:
        stem = _stem(path[-1]) if path else None
        sig = _signature(path, leaves) if stem is not None else ()
        if sig:
            groups.setdefault((path[:-1], stem, sig), []).append(path)
    found = [tuple(sorted(g, key=_natural)) for g in groups.values() if len(g) >= 2]
    return sorted(found, key=lambda g: (-len(g) * _bytes(g[0], leaves), _natural(g[0])))


def _group_text(group: tuple[Path, ...]) -> str:
    parent, stem = _join(group[0][:-1]) if len(group[0]) > 1 else "", _stem(group[0][-1])
    pattern = f"{parent}/{stem}*" if parent else f"{stem}*"
    return f"{pattern!r} ({len(group)} blocks: {_join(group[0])} … {_join(group[-1])})"


def _pattern_of(group: tuple[Path, ...]) -> str:
    return _join((*group[0][:-1], f"{_stem(group[0][-1])}*"))


def _match_pattern(pattern: str, nodes: Mapping[Path, Any]) -> list[Path]:
    parts = [re.compile(".*".join(re.escape(s) for s in seg.split("*"))) for seg in _split(pattern)]
    return [p for p in nodes if len(p) == len(parts) and all(r.fullmatch(s) for r, s in zip(parts, p, strict=True))]


def _match_classes(
    layers: Any, classes: Mapping[str, type] | None, nodes: Mapping[Path, Any], where: str
) -> list[Path]:
    if not classes:
        raise ValueError(NO_CLASSES.format(where=where, layers=layers, example="h/*"))
    wanted = layers if isinstance(layers, tuple) else (layers,)
    return [
        _split(path)
        for path, cls in classes.items()
        if isinstance(cls, type) and issubclass(cls, wanted) and _split(path) in nodes
    ]


def _difference(a: Signature, b: Signature) -> str:
    sa, sb = {p: (s, d) for p, s, d in a}, {p: (s, d) for p, s, d in b}
    parts = [f"only the first has '{_join(p)}'" for p in sorted(set(sa) - set(sb))]
    parts += [f"only the second has '{_join(p)}'" for p in sorted(set(sb) - set(sa))]
    parts += [
        f"'{_join(p)}' is {sa[p][0]} {sa[p][1]} vs {sb[p][0]} {sb[p][1]}"
        for p in sorted(set(sa) & set(sb))
        if sa[p] != sb[p]
    ]
    return "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")


def _check_matches(matched: list[Path], layers: Any, leaves: Mapping[Path, Any], where: str) -> None:
    nested = [(o, i) for o in matched for i in matched if o != i and i[: len(o)] == o]
    if nested:
        pairs = ", ".join(f"'{_join(i)}' inside '{_join(o)}'" for o, i in nested[:4])
        raise ValueError(NESTED.format(where=where, layers=layers, pairs=pairs))
    first = _signature(matched[0], leaves)
    for other in matched[1:]:
        sig = _signature(other, leaves)
        if sig != first:
            diff = _difference(first, sig)
            raise ValueError(
                DIFFERENT.format(where=where, layers=layers, a=_join(matched[0]), b=_join(other), diff=diff)
            )


def _no_match(params: PyTree, layers: Any, where: str) -> ValueError:
    groups = repeated_groups(params)
    text = CANDIDATES.format(groups=", ".join(_group_text(g) for g in groups)) if groups else NO_CANDIDATES
    example = _pattern_of(groups[0]) if groups else "h/*"
    return ValueError(NO_MATCH.format(where=where, layers=layers, candidates=text, example=example))


def _is_classes(layers: Any) -> bool:
    if isinstance(layers, type):
        return True
    return isinstance(layers, tuple) and bool(layers) and all(isinstance(c, type) for c in layers)


def find_blocks(params: PyTree, layers: Any, *, where: str, classes: Mapping[str, type] | None = None) -> Blocks:
    """The blocks ``layers`` names in ``params`` (see the module docstring).

    Raises ``ValueError`` when ``layers`` matches nothing (naming the repeated
    subtrees there are), matches blocks of different structure (naming both
    and what differs) or blocks inside other blocks; ``TypeError`` for a
    ``layers`` of another kind.

    >>> import jax.numpy as jnp
    >>> params = {"layers_0": {"w": jnp.zeros(4)}, "layers_1": {"w": jnp.zeros(4)}, "head": {"w": jnp.zeros(2)}}
    >>> find_blocks(params, "layers_*", where="example").paths
    ('layers_0', 'layers_1')
    """
    nodes, leaves = _index(params)
    note = ""
    if isinstance(layers, str) and layers == "auto":
        groups = repeated_groups(params)
        if not groups:
            raise _no_match(params, layers, where)
        matched = list(groups[0])
        if len(groups) > 1:
            others = ", ".join(_group_text(g) for g in groups[1:4])
            note = f"auto: the repeated group with the most parameter bytes; also found {others}"
    elif isinstance(layers, str) and _split(layers):
        matched = _match_pattern(layers, nodes)
    elif _is_classes(layers):
        matched = _match_classes(layers, classes, nodes, where)
    else:
        raise TypeError(BAD_LAYERS.format(where=where, got=f"{type(layers).__name__} {layers!r}"[:120]))
    matched = [p for p in matched if _signature(p, leaves)]
    if not matched:
        raise _no_match(params, layers, where)
    matched = sorted(set(matched), key=_natural)
    _check_matches(matched, layers, leaves, where)
    paths = tuple(_join(p) for p in matched)
    return Blocks(paths, len(paths), max(_bytes(p, leaves) for p in matched), note)


def _subtree(params: PyTree, path: Path) -> Any:
    node = params
    for name in path:
        kids = dict(_children(node) or ())
        if name not in kids:
            raise KeyError(f"no subtree '{_join(path)}' in the parameters (stopped at '{name}')")
        node = kids[name]
    return node


def block_params(params: PyTree, blocks: Blocks) -> list[PyTree]:
    """The parameter subtrees at ``blocks.paths``, in order (as ``params`` holds
    them: ``Sharded`` pieces inside a manual step)."""
    return [_subtree(params, _split(p)) for p in blocks.paths]


def inside(path: str | Path, blocks: Blocks | None) -> bool:
    """Whether the key path ``path`` lies in (or is) one of the blocks."""
    names = _split(path) if isinstance(path, str) else tuple(path)
    return blocks is not None and any(names[: len(b)] == b for b in map(_split, blocks.paths))


def gather_outside(params: PyTree, blocks: Blocks, where: str) -> PyTree:
    """In a manual-gather step: every ``zj.Sharded`` leaf outside the blocks
    gathered whole (with the step's policy); the blocks' leaves stay pieces
    for the per-block primitive. Whole parameters pass through."""
    if not any(_is_leaf(x) for x in jax.tree.leaves(params, is_leaf=_is_leaf)):
        return params
    policy = _layers.current_scope().policy
    if policy is None:  # pragma: no cover - Sharded nodes only exist inside a manual step
        raise RuntimeError(f"{where}: got partitioned parameters outside a train step.")

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if _is_leaf(x) and not inside(tuple(key_name(k) for k in path), blocks):
            return _layers.gather(x, policy)
        return x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_leaf)
