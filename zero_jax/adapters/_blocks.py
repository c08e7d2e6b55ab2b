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
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax._base.tree import PyTree, key_name
from zero_jax._base.units import fmt_bytes
from zero_jax._layerwise.pieces import Sharded, gather
from zero_jax._layerwise.scope import current_scope

__all__ = [
    "Blocks",
    "block_params",
    "check_layer_options",
    "classes_by_auto_name",
    "describe_group",
    "find_blocks",
    "gather_outside",
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


def subtree_paths(params: PyTree) -> list[str]:
    """The key path of every subtree (internal node) of ``params`` that holds a leaf."""
    nodes, leaves = _index(params)
    return [_join(p) for p in nodes if p and _signature(p, leaves)]


def _no_match(params: PyTree, layers: Any, where: str) -> ValueError:
    groups = repeated_groups(params)
    text = CANDIDATES.format(groups=", ".join(describe_group(g) for g in groups)) if groups else NO_CANDIDATES
    example = group_pattern(groups[0]) if groups else "h/*"
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
            others = ", ".join(describe_group(g) for g in groups[1:4])
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


def gather_outside(params: PyTree, blocks: Blocks, where: str, *, keep: tuple[str, ...] = ()) -> PyTree:
    """In a manual-gather step: every ``zj.Sharded`` leaf outside the blocks
    (and outside the subtrees ``keep`` names: ``stacked=`` prefixes for
    ``scan_layers``) gathered whole (with the step's policy); the blocks'
    leaves stay pieces for the per-block primitive. Whole parameters pass
    through."""
    if not any(_is_leaf(x) for x in jax.tree.leaves(params, is_leaf=_is_leaf)):
        return params
    policy = current_scope().policy
    if policy is None:  # pragma: no cover - Sharded nodes only exist inside a manual step
        raise RuntimeError(f"{where}: got partitioned parameters outside a train step.")

    kept = blocks._replace(paths=blocks.paths + tuple(keep))

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if _is_leaf(x) and not inside(tuple(key_name(k) for k in path), kept):
            return gather(x, policy)
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
