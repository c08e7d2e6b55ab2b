"""Which subtrees of a model's parameters are its blocks: ``layers=`` of the
adapters, resolved on the parameter pytree alone (no Flax or Equinox here).

``layers`` is ``"auto"``, a key-path pattern with ``*`` (``"transformer/h/*"``,
``"layers_*"``), a list of patterns, or a module class (or tuple of them),
matched through the ``classes`` map the adapter provides (key path -> class of
the submodule there).

``"auto"`` takes every *group of blocks* (:func:`block_groups`): sibling
subtrees named ``<stem><number>`` (``h/0 … h/11``, ``layers_0 … layers_5``,
list entries), at least two of them, whose parameters share one structure,
the *core* (the structure most of them have; with no two alike, the smallest),
a member with extra leaves besides the core counting as a block too (T5's
block 0, which also holds the relative-attention bias). Every stack of an
encoder–decoder is a group; groups inside another group's blocks are part of
those blocks. A member whose parameters differ from the core in any other way
is left whole, and said so (``Blocks.left_whole``, a warning).

A pattern (or each pattern of a list) may match blocks of differing structure
when they are numbered siblings of one stem (``encoder/block/*``: block 0 with
its position bias); each matched block runs on its own. Blocks run in the
order the parameters were created (``order=``: the model's own variables, in
the order its ``init`` made them), which is the order a model calls them.

>>> import jax.numpy as jnp
>>> params = {"embed": jnp.zeros((10, 4)), "h": [{"w": jnp.zeros((4, 4))} for _ in range(3)]}
>>> blocks = find_blocks(params, "auto", where="example")
>>> blocks.paths, blocks.count, blocks.bytes_per_layer
(('h/0', 'h/1', 'h/2'), 3, 64)
>>> print(blocks)
3 blocks at h/0 … h/2, 64 B each

An encoder–decoder: both stacks, block 0 of each with an extra bias.

>>> def stack(n, extra):
...     return [{"w": jnp.zeros((4, 4)), **({"bias": jnp.zeros(2)} if i == 0 else {})} | extra for i in range(n)]
>>> t5 = {"encoder": stack(3, {}), "decoder": stack(3, {"x": jnp.zeros(4)})}
>>> print(find_blocks(t5, "auto", where="example", order=t5))
6 blocks at encoder/0 … encoder/2, decoder/0 … decoder/2, up to 88 B each
>>> [sorted(p) for p in block_params(params, blocks)]
[['w'], ['w'], ['w']]
"""

from __future__ import annotations

import collections
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax import _layers
from zero_jax._layers import Sharded
from zero_jax._tree import PyTree, key_name
from zero_jax._units import fmt_bytes

__all__ = [
    "Blocks",
    "block_groups",
    "block_params",
    "check_layer_options",
    "classes_by_auto_name",
    "describe_group",
    "find_blocks",
    "gather_outside",
    "Groups",
    "group_pattern",
    "inside",
    "instances_in",
    "repeated_groups",
    "split_arrays",
    "subtree_paths",
]

Path = tuple[str, ...]
Signature = tuple[tuple[Path, tuple[int, ...], str], ...]


class Blocks(NamedTuple):
    """The blocks ``layers=`` matched (``adapted.layers``).

    Attributes:
      paths: key paths of the matched blocks (``"h/0"``, ``"layers_3"``) in
        call order: the order the parameters were created in when the adapter
        knows it (``encoder/…`` before ``decoder/…``), else numeric-aware key
        order (``h/2`` before ``h/10``).
      count: how many.
      bytes_per_layer: parameter bytes of one block (the largest, if they differ).
      note: how they were found (``"auto"``: the groups taken, what was left whole).
      left_whole: ``"auto"``: the numbered siblings of a group that are not
        blocks (their parameters differ from the group's), each as
        ``"'path' (bytes): why"``; they are gathered whole with the rest of
        the model.
    """

    paths: tuple[str, ...]
    count: int
    bytes_per_layer: int
    note: str = ""
    left_whole: tuple[str, ...] = ()

    def summary(self) -> str:
        """``"12 blocks at transformer/h/0 … transformer/h/11, 7.1 MiB each"``; several groups:
        ``"8 blocks at encoder/block/0 … encoder/block/3, decoder/block/0 … decoder/block/3, up to 8.2 KiB each"``."""
        if not self.paths:
            return "no blocks"
        runs = _runs([_split(p) for p in self.paths])
        where = ", ".join(_join(r[0]) if len(r) == 1 else f"{_join(r[0])} … {_join(r[-1])}" for r in runs)
        noun = "block" if self.count == 1 else "blocks"
        size = f"{'' if len(runs) == 1 else 'up to '}{fmt_bytes(self.bytes_per_layer)} each"
        text = f"{self.count} {noun} at {where}, {size}"
        return f"{text} ({self.note})" if self.note else text

    def __str__(self) -> str:
        return self.summary()


NO_MATCH = (
    "{where}: {what} no block of the parameters. {candidates} Pass layers='auto', a key-path "
    "pattern with '*' naming the repeated subtrees (e.g. {example!r}), or the block's module class."
)
NO_CANDIDATES = (
    "The parameters have no repeated subtrees (siblings named like h/0, h/1 or layers_0, layers_1 with identical "
    "structure)."
)
CANDIDATES = "Repeated subtrees found: {groups}."
DIFFERENT = (
    "{where}: layers={layers!r} matches subtrees of different structure that are not numbered siblings of one "
    "name: '{a}' and '{b}' differ ({diff}). A pattern matches blocks like h/0 … h/11 (each may differ, as a first "
    "block with a position bias) or blocks with identical parameters: narrow the pattern so it matches only "
    "blocks like '{a}', give a list of patterns (one per kind of block), or name the block class."
)
NESTED = (
    "{where}: layers={layers!r} matches blocks inside other matched blocks: {pairs}. A block is gathered whole, "
    "so match only the outer blocks (or only the inner ones)."
)
BAD_LAYERS = (
    "{where}: layers must be 'auto', a key-path pattern with '*' (e.g. 'transformer/h/*', 'layers_*'), a list of "
    "such patterns (['encoder/block/*', 'decoder/block/*']), a module class or a tuple of classes; got {got}."
)
NO_CLASSES = (
    "{where}: layers={layers!r} names module classes, but no submodule of that class is known before the model "
    "runs (Linen: read from setup() submodules and from automatic names like Block_0; a compact submodule given "
    "its own name is not). Pass a key-path pattern such as {example!r}, or 'auto'."
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


def describe_group(group: tuple[Path, ...]) -> str:
    """``"'h/*' (12 blocks: h/0 … h/11)"``: a group of :func:`repeated_groups` as messages name it."""
    parent, stem = _join(group[0][:-1]) if len(group[0]) > 1 else "", _stem(group[0][-1])
    pattern = f"{parent}/{stem}*" if parent else f"{stem}*"
    return f"{pattern!r} ({len(group)} blocks: {_join(group[0])} … {_join(group[-1])})"


def group_pattern(group: tuple[Path, ...]) -> str:
    """The ``layers=`` pattern that matches a group of :func:`repeated_groups` (``"h/*"``)."""
    return _join((*group[0][:-1], f"{_stem(group[0][-1])}*"))


def _match_pattern(pattern: str, nodes: Mapping[Path, Any]) -> list[Path]:
    parts = [re.compile(".*".join(re.escape(s) for s in seg.split("*"))) for seg in _split(pattern)]
    return [p for p in nodes if len(p) == len(parts) and all(r.fullmatch(s) for r, s in zip(parts, p, strict=True))]


def _match_classes(
    layers: Any, classes: Mapping[str, type] | None, nodes: Mapping[Path, Any], where: str
) -> list[Path]:
    wanted = layers if isinstance(layers, tuple) else (layers,)
    if not any(isinstance(c, type) and issubclass(c, wanted) for c in (classes or {}).values()):
        groups = repeated_groups(nodes[()])
        example = group_pattern(groups[0]) if groups else "h/*"
        raise ValueError(NO_CLASSES.format(where=where, layers=layers, example=example))
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


def _sibling_key(path: Path) -> tuple[Path, str] | None:
    """``(parent, stem)`` of a numbered subtree (``h/3`` -> ``(('h',), '')``), else None."""
    stem = _stem(path[-1]) if path else None
    return None if stem is None else (path[:-1], stem)


def _runs(paths: list[Path]) -> list[list[Path]]:
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
    return len(diff) == 1 and _sibling_key(a[: diff[0] + 1]) is not None and (_stem(a[diff[0]]) == _stem(b[diff[0]]))


def _check_nested(matched: list[Path], layers: Any, where: str) -> None:
    nested = [(o, i) for o in matched for i in matched if o != i and i[: len(o)] == o]
    if nested:
        pairs = ", ".join(f"'{_join(i)}' inside '{_join(o)}'" for o, i in nested[:4])
        raise ValueError(NESTED.format(where=where, layers=layers, pairs=pairs))


def _pattern_problem(pattern: str, matched: list[Path], leaves: Mapping[Path, Any], where: str) -> str | None:
    """Blocks of one pattern must be numbered siblings of one stem (whatever their structure: each runs on
    its own) or share one structure: a pattern over unrelated subtrees is a mistake worth naming."""
    stems = {None if k is None else k[1] for k in map(_sibling_key, matched)}
    if len(stems) == 1 and None not in stems:
        return None
    first = _signature(matched[0], leaves)
    for other in matched[1:]:
        sig = _signature(other, leaves)
        if sig != first:
            diff = _difference(first, sig)
            return DIFFERENT.format(where=where, layers=pattern, a=_join(matched[0]), b=_join(other), diff=diff)
    return None


def subtree_paths(params: PyTree) -> list[str]:
    """The key path of every subtree (internal node) of ``params`` that holds a leaf."""
    nodes, leaves = _index(params)
    return [_join(p) for p in nodes if p and _signature(p, leaves)]


def _no_match(params: PyTree, layers: Any, where: str, empty: Sequence[str] = ()) -> ValueError:
    groups = repeated_groups(params)
    text = CANDIDATES.format(groups=", ".join(describe_group(g) for g in groups)) if groups else NO_CANDIDATES
    example = group_pattern(groups[0]) if groups else "h/*"
    what = f"layers={layers!r} matches"
    if empty:
        what = f"layers={layers!r}: the pattern(s) {', '.join(repr(p) for p in empty)} match"
    return ValueError(NO_MATCH.format(where=where, what=what, candidates=text, example=example))


def _is_classes(layers: Any) -> bool:
    if isinstance(layers, type):
        return True
    return isinstance(layers, tuple) and bool(layers) and all(isinstance(c, type) for c in layers)


def _is_patterns(layers: Any) -> bool:
    return isinstance(layers, (list, tuple)) and bool(layers) and all(isinstance(p, str) and _split(p) for p in layers)


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
    nodes, leaves = _index(params)
    sets: dict[tuple[Path, str], list[Path]] = {}
    for path in nodes:
        key = _sibling_key(path)
        if key is not None and _signature(path, leaves):
            sets.setdefault(key, []).append(path)
    groups: list[tuple[Path, ...]] = []
    left: list[tuple[Path, str]] = []
    for key in sorted(sets, key=lambda k: (len(k[0]), _natural(k[0]), k[1])):
        members = [p for p in sets[key] if not any(p[: len(b)] == b for g in groups for b in g)]
        sigs = {p: _signature(p, leaves) for p in members}
        counts = collections.Counter(sigs.values())
        if len(members) < 2:
            continue
        common, n = counts.most_common(1)[0]
        core = common if n >= 2 else min(counts, key=lambda g: (len(g), sum(math.prod(s) for _, s, _ in g)))
        blocks = sorted((p for p in members if set(core) <= set(sigs[p])), key=_natural)
        if len(blocks) < 2:
            continue
        like = next(p for p in blocks if sigs[p] == core)
        groups.append(tuple(blocks))
        left += [
            (p, f"its parameters differ from '{_join(like)}' ({_difference(core, sigs[p])})")
            for p in sorted(set(members) - set(blocks), key=_natural)
        ]
    left = [(p, why) for p, why in left if not any(p[: len(b)] == b for g in groups for b in g)]
    return Groups(tuple(groups), tuple(left))


LEFT_WHOLE = (
    "{where}: layers='auto' left {count} numbered subtree(s) beside its blocks whole: {items}. They are gathered "
    "whole once for the step (no block-by-block saving for them). If they are blocks too, name them: "
    "layers=[{patterns}] runs every match of each pattern as its own block, whatever its structure."
)


def _creation_rank(tree: Any) -> dict[Path, int]:
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
            kids = _children(node) or []
        for name, child in kids:
            walk(child, (*path, name))

    walk(tree, ())
    return rank


def _call_order(matched: list[Path], order: Any) -> list[Path]:
    """``matched`` in the order the model calls its blocks, as far as the creation order of ``order`` tells:
    creation order where it agrees with the numbers within each group of siblings; else groups by their
    first creation, numeric order within each; without ``order`` (or a path it lacks), numeric-aware order."""
    natural = sorted(set(matched), key=_natural)
    rank = _creation_rank(order) if order is not None else {}
    if not all(p in rank for p in natural):
        return natural
    sets: dict[Any, list[Path]] = {}
    for p in natural:
        sets.setdefault(_sibling_key(p) or p, []).append(p)
    if all(sorted(g, key=rank.__getitem__) == g for g in sets.values()):
        return sorted(natural, key=rank.__getitem__)
    first = {k: min(rank[p] for p in g) for k, g in sets.items()}
    return sorted(natural, key=lambda p: (first[_sibling_key(p) or p], _natural(p)))


def find_blocks(
    params: PyTree, layers: Any, *, where: str, classes: Mapping[str, type] | None = None, order: Any = None
) -> Blocks:
    """The blocks ``layers`` names in ``params`` (see the module docstring), in
    call order (``order``: the model's parameters as it created them, when
    ``params`` may have lost that order; default numeric-aware key order).

    Raises ``ValueError`` when ``layers`` (or a pattern of a list) matches
    nothing (naming the repeated subtrees there are), a pattern matches
    unrelated blocks of different structure (naming both and what differs)
    or blocks inside other blocks; ``TypeError`` for a ``layers`` of another
    kind. ``"auto"`` warns about numbered siblings it left whole.

    >>> import jax.numpy as jnp
    >>> params = {"layers_0": {"w": jnp.zeros(4)}, "layers_1": {"w": jnp.zeros(4)}, "head": {"w": jnp.zeros(2)}}
    >>> find_blocks(params, "layers_*", where="example").paths
    ('layers_0', 'layers_1')
    >>> find_blocks(params, ["layers_*", "head"], where="example").paths
    ('head', 'layers_0', 'layers_1')
    """
    nodes, leaves = _index(params)
    note, left_whole = "", ()
    if isinstance(layers, str) and layers == "auto":
        found = block_groups(params)
        if not found.groups:
            raise _no_match(params, layers, where)
        matched = [p for g in found.groups for p in g]
        shown = [f"'{_join(p)}' ({fmt_bytes(_bytes(p, leaves))}): {why}" for p, why in found.left_whole]
        left_whole = tuple(shown)
        note = f"auto left whole: {'; '.join(shown)}" if shown else ""
        if shown:
            patterns = ", ".join(repr(group_pattern(g)) for g in found.groups)
            warnings.warn(
                LEFT_WHOLE.format(where=where, count=len(shown), items="; ".join(shown), patterns=patterns),
                stacklevel=3,
            )
    elif isinstance(layers, str) and _split(layers) or _is_patterns(layers):
        patterns = [layers] if isinstance(layers, str) else list(layers)
        per = {pat: [p for p in _match_pattern(pat, nodes) if _signature(p, leaves)] for pat in patterns}
        empty = [pat for pat, m in per.items() if not m]
        if empty and len(patterns) > 1:
            raise _no_match(params, layers, where, empty)
        problems = [q for pat, m in per.items() if m for q in [_pattern_problem(pat, m, leaves, where)] if q]
        if problems:
            raise ValueError(" ".join(problems))
        matched = [p for m in per.values() for p in m]
    elif _is_classes(layers):
        matched = _match_classes(layers, classes, nodes, where)
    else:
        raise TypeError(BAD_LAYERS.format(where=where, got=f"{type(layers).__name__} {layers!r}"[:120]))
    matched = [p for p in matched if _signature(p, leaves)]
    if not matched:
        raise _no_match(params, layers, where)
    matched = _call_order(matched, order)
    _check_nested(matched, layers, where)
    paths = tuple(_join(p) for p in matched)
    return Blocks(paths, len(paths), max(_bytes(p, leaves) for p in matched), note, left_whole)


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


def gather_outside(params: PyTree, blocks: Blocks, where: str, *, keep: tuple[str, ...] = ()) -> PyTree:
    """In a manual-gather step: every ``zj.Sharded`` leaf outside the blocks
    (and outside the subtrees ``keep`` names: ``stacked=`` prefixes for
    ``scan_layers``) gathered whole (with the step's policy); the blocks'
    leaves stay pieces for the per-block primitive. Whole parameters pass
    through."""
    if not any(_is_leaf(x) for x in jax.tree.leaves(params, is_leaf=_is_leaf)):
        return params
    policy = _layers.current_scope().policy
    if policy is None:  # pragma: no cover - Sharded nodes only exist inside a manual step
        raise RuntimeError(f"{where}: got partitioned parameters outside a train step.")

    kept = blocks._replace(paths=blocks.paths + tuple(keep))

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if _is_leaf(x) and not inside(tuple(key_name(k) for k in path), kept):
            return _layers.gather(x, policy)
        return x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_leaf)


LAYERS_STACKED = (
    "{where}: block '{block}' lies in the stacked= subtree '{prefix}'. A subtree is either stacked (one scan over a "
    "leading layer axis, run by scan_layers) or a set of unscanned blocks (layers=), not both."
)
BAD_PREFETCH = (
    "{where}: prefetch must be an int from 0 to the number of blocks ({count}), got {got!r}. 1 overlaps the next "
    "block's gather with this block's compute; 0 gathers each block only when it runs."
)


def check_layer_options(blocks: Blocks, stacked: tuple[str, ...], prefetch: Any, where: str) -> None:
    """``layers=`` blocks outside every ``stacked=`` subtree, and ``prefetch``
    an int from 0 to the number of blocks."""
    for path in blocks.paths:
        for prefix in stacked:
            names, pre = _split(path), _split(prefix)
            if names[: len(pre)] == pre or pre[: len(names)] == names:
                raise ValueError(LAYERS_STACKED.format(where=where, block=path, prefix=prefix))
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= blocks.count:
        raise ValueError(BAD_PREFETCH.format(where=where, count=blocks.count, got=prefetch))


def split_arrays(args: Any, kwargs: Any) -> tuple[list[Any], Callable[[list[Any]], tuple[Any, Any]]]:
    """A block call's ``(args, kwargs)`` as its array leaves (what may go
    through the per-block primitive) and ``rebuild(arrays) -> (args,
    kwargs)`` with every other leaf (``deterministic=True``, sizes, strings)
    left as the static Python value it was.

    >>> import jax.numpy as jnp
    >>> arrays, rebuild = split_arrays((jnp.ones(2), 3), {"deterministic": True})
    >>> len(arrays), rebuild([jnp.zeros(2)])[1]
    (1, {'deterministic': True})
    """
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]

    def rebuild(arrays: list[Any]) -> tuple[Any, Any]:
        it = iter(arrays)
        return jax.tree.unflatten(treedef, [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)])

    return [x for x, a in zip(leaves, is_array, strict=True) if a], rebuild


def classes_by_auto_name(params: PyTree, classes: tuple[type, ...]) -> dict[str, type]:
    """Key path -> class for subtrees named as Linen names an unnamed
    submodule of a class (``Block_3`` is a ``Block``).

    >>> class Block: ...
    >>> found = classes_by_auto_name({"Block_0": {"w": np.zeros(2)}, "Dense_0": {"w": np.zeros(2)}}, (Block,))
    >>> {path: cls.__name__ for path, cls in found.items()}
    {'Block_0': 'Block'}
    """
    found: dict[str, type] = {}
    for path in subtree_paths(params):
        name = path.rsplit("/", 1)[-1]
        for cls in classes:
            if name.startswith(f"{cls.__name__}_") and name[len(cls.__name__) + 1 :].isdigit():
                found.setdefault(path, cls)
    return found


def instances_in(values: Any, kind: type) -> list[Any]:
    """The ``kind`` instances among ``values``, looking into lists, tuples and dicts."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, kind):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += instances_in(v, kind)
        elif isinstance(v, Mapping):
            out += instances_in(v.values(), kind)
    return out
