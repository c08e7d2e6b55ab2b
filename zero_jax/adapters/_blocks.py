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

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from zero_jax._base.tree import PyTree, key_name
from zero_jax._base.units import fmt_bytes, is_whole_number
from zero_jax._layerwise.keep import check_keep
from zero_jax._layerwise.pieces import gather
from zero_jax._layerwise.scope import current_scope
from zero_jax.adapters._groups import (
    Groups,
    Path,
    block_groups,
    block_runs,
    call_order,
    children,
    describe_group,
    difference,
    group_pattern,
    index_tree,
    is_leaf,
    join_path,
    repeated_groups,
    sibling_key,
    signature,
    split_path,
    subtree_bytes,
    subtree_paths,
)

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
        runs = block_runs([split_path(p) for p in self.paths])
        where = ", ".join(join_path(r[0]) if len(r) == 1 else f"{join_path(r[0])} … {join_path(r[-1])}" for r in runs)
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


def _match_pattern(pattern: str, nodes: Mapping[Path, Any]) -> list[Path]:
    parts = [re.compile(".*".join(re.escape(s) for s in seg.split("*"))) for seg in split_path(pattern)]
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
        split_path(path)
        for path, cls in classes.items()  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        if isinstance(cls, type) and issubclass(cls, wanted) and split_path(path) in nodes
    ]


def _check_nested(matched: list[Path], layers: Any, where: str) -> None:
    nested = [(o, i) for o in matched for i in matched if o != i and i[: len(o)] == o]
    if nested:
        pairs = ", ".join(f"'{join_path(i)}' inside '{join_path(o)}'" for o, i in nested[:4])
        raise ValueError(NESTED.format(where=where, layers=layers, pairs=pairs))


def _pattern_problem(pattern: str, matched: list[Path], leaves: Mapping[Path, Any], where: str) -> str | None:
    """Blocks of one pattern must be numbered siblings of one stem (whatever their structure: each runs on
    its own) or share one structure: a pattern over unrelated subtrees is a mistake worth naming."""
    stems = {None if k is None else k[1] for k in map(sibling_key, matched)}
    if len(stems) == 1 and None not in stems:
        return None
    first = signature(matched[0], leaves)
    for other in matched[1:]:
        sig = signature(other, leaves)
        if sig != first:
            diff = difference(first, sig)
            return DIFFERENT.format(where=where, layers=pattern, a=join_path(matched[0]), b=join_path(other), diff=diff)
    return None


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
    return (
        isinstance(layers, (list, tuple)) and bool(layers) and all(isinstance(p, str) and split_path(p) for p in layers)
    )


LEFT_WHOLE = (
    "{where}: layers='auto' left {count} numbered subtree(s) beside its blocks whole: {items}. They are gathered "
    "whole once for the step (no block-by-block saving for them). If they are blocks too, name them: "
    "layers=[{patterns}] runs every match of each pattern as its own block, whatever its structure."
)


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
    nodes, leaves = index_tree(params)
    note, left_whole = "", ()
    if isinstance(layers, str) and layers == "auto":
        found = block_groups(params)
        if not found.groups:
            raise _no_match(params, layers, where)
        matched = [p for g in found.groups for p in g]
        shown = [f"'{join_path(p)}' ({fmt_bytes(subtree_bytes(p, leaves))}): {why}" for p, why in found.left_whole]
        left_whole = tuple(shown)
        note = f"auto left whole: {'; '.join(shown)}" if shown else ""
        if shown:
            patterns = ", ".join(repr(group_pattern(g)) for g in found.groups)
            warnings.warn(
                LEFT_WHOLE.format(where=where, count=len(shown), items="; ".join(shown), patterns=patterns),
                stacklevel=3,
            )
    elif isinstance(layers, str) and split_path(layers) or _is_patterns(layers):
        patterns = [layers] if isinstance(layers, str) else list(layers)
        per = {pat: [p for p in _match_pattern(pat, nodes) if signature(p, leaves)] for pat in patterns}
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
    matched = [p for p in matched if signature(p, leaves)]
    if not matched:
        raise _no_match(params, layers, where)
    matched = call_order(matched, order)
    _check_nested(matched, layers, where)
    paths = tuple(join_path(p) for p in matched)
    return Blocks(paths, len(paths), max(subtree_bytes(p, leaves) for p in matched), note, left_whole)


def _subtree(params: PyTree, path: Path) -> Any:
    node = params
    for name in path:
        kids = dict(children(node) or ())
        if name not in kids:
            raise KeyError(f"no subtree '{join_path(path)}' in the parameters (stopped at '{name}')")
        node = kids[name]
    return node


def block_params(params: PyTree, blocks: Blocks) -> list[PyTree]:
    """The parameter subtrees at ``blocks.paths``, in order (as ``params`` holds
    them: ``Sharded`` pieces inside a manual step)."""
    return [_subtree(params, split_path(p)) for p in blocks.paths]


def inside(path: str | Path, blocks: Blocks | None) -> bool:
    """Whether the key path ``path`` lies in (or is) one of the blocks."""
    names = split_path(path) if isinstance(path, str) else tuple(path)
    return blocks is not None and any(names[: len(b)] == b for b in map(split_path, blocks.paths))


def gather_outside(params: PyTree, blocks: Blocks, where: str, *, keep: tuple[str, ...] = ()) -> PyTree:
    """In a manual-gather step: every ``zj.Sharded`` leaf outside the blocks
    (and outside the subtrees ``keep`` names: ``stacked=`` prefixes for
    ``scan_layers``) gathered whole (with the step's policy); the blocks'
    leaves stay pieces for the per-block primitive. Whole parameters pass
    through."""
    if not any(is_leaf(x) for x in jax.tree.leaves(params, is_leaf=is_leaf)):
        return params
    policy = current_scope().policy
    if policy is None:  # pragma: no cover - Sharded nodes only exist inside a manual step
        raise RuntimeError(f"{where}: got partitioned parameters outside a train step.")

    kept = blocks._replace(paths=blocks.paths + tuple(keep))

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if is_leaf(x) and not inside(tuple(key_name(k) for k in path), kept):
            return gather(x, policy)
        return x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_leaf)


LAYERS_STACKED = (
    "{where}: block '{block}' lies in the stacked= subtree '{prefix}'. A subtree is either stacked (one scan over a "
    "leading layer axis, run by scan_layers) or a set of unscanned blocks (layers=), not both."
)
BAD_PREFETCH = (
    "{where}: prefetch must be an int from 0 to the number of blocks ({count}), got {got!r}. 1 overlaps the next "
    "block's gather with this block's compute; 0 gathers each block only when it runs."
)


KEEP_WITHOUT_LAYERS = (
    "{where}: keep_gathered={got!r} keeps the last blocks of layers= gathered for the backward pass, but no layers= "
    "was given. Name the blocks (layers='auto', a pattern such as 'blocks/*', or the block class), or pass "
    "keep_gathered=k to zj.scan_layers for stacked= layers."
)


def check_layer_options(
    blocks: Blocks | None, stacked: tuple[str, ...], prefetch: Any, where: str, keep_gathered: Any = 0
) -> None:
    """``layers=`` blocks outside every ``stacked=`` subtree, ``prefetch`` an
    int from 0 to the number of blocks and ``keep_gathered`` an int up to it
    or a byte budget (only with blocks: ``blocks`` None is no ``layers=``)."""
    if blocks is None:
        if keep_gathered not in (None, False):  # 0 is False: nothing kept
            raise ValueError(KEEP_WITHOUT_LAYERS.format(where=where, got=keep_gathered))
        return
    check_keep(keep_gathered, blocks.count, where)
    for path in blocks.paths:
        for prefix in stacked:
            names, pre = split_path(path), split_path(prefix)
            if names[: len(pre)] == pre or pre[: len(names)] == names:
                raise ValueError(LAYERS_STACKED.format(where=where, block=path, prefix=prefix))
    if not is_whole_number(prefetch) or not 0 <= prefetch <= blocks.count:
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
