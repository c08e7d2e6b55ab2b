"""The model-parallel layout a user declares: ``ZeroPolicy(param_specs=...)``.

One ``PartitionSpec`` per parameter over mesh axes other than ZeRO's (tensor,
sequence, expert axes), as the user's model already shards it. This module
checks every leaf's spec against the mesh and the leaf's shape (collecting
every bad leaf before one error) and normalises it to one entry per
dimension; ``_layout.leaf`` then picks the data-axis cut among the dimensions
the model leaves free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from zero_jax._base.tree import KeyPath, PyTree, path_str

#: One dimension's model axes: ``None``, one mesh axis, or several (major first).
Entry = str | tuple[str, ...] | None
#: A leaf's model layout: one :data:`Entry` per dimension, or ``()`` for none.
ModelEntries = tuple[Entry, ...]

NOT_MIRRORED = (
    "ZeroPolicy(param_specs=...): the spec tree does not mirror the parameters ({detail}). Give one "
    "PartitionSpec (or None) per parameter leaf, in the parameters' structure, e.g. "
    "jax.tree.map(lambda _: P(), params) edited where a leaf is model-sharded, or pass a callable "
    "(key_path, leaf) -> PartitionSpec."
)
BAD_SPECS = (
    "ZeroPolicy(param_specs=...): {count} parameter leaf spec(s) cannot shard their leaf on mesh {mesh}; "
    "model specs name only mesh axes outside ZeRO's {zero} (each at most once), have at most one entry per "
    "dimension, and each model-sharded dimension divides by its axes' size:\n{lines}"
)
NOT_A_SPEC = "'{path}': {value!r} is not a jax.sharding.PartitionSpec; use P(...) (or None for no model sharding)"
TUPLE_SPEC = (
    "'{path}': {value!r} is a {kind}, not a jax.sharding.PartitionSpec; write {spelled} "
    "(from jax.sharding import PartitionSpec as P)"
)
TOO_LONG = "'{path}' has shape {shape} but its spec {spec} has {count} entries; give at most one per dimension"
NOT_MODEL_AXIS = "'{path}': spec {spec} names {axis!r}, {why}"
REUSED_AXIS = "'{path}': spec {spec} names mesh axis {axis!r} twice; each axis can shard one dimension"
UNEVEN = (
    "'{path}' has shape {shape}: dimension {dim} ({size}) does not divide by {axes} = {n}; pad the model's "
    "hidden size to a multiple of {n} (ZeRO pads only its own data-axis cut)"
)


def _is_spec_leaf(x: Any) -> bool:
    return x is None or isinstance(x, PartitionSpec) or _spec_like(x)


def _spec_like(x: Any) -> bool:
    """A plain tuple or list written as a spec, ``(None, "model")``: a leaf of
    the spec tree (refused by name with its ``P(...)`` spelling), not a node."""
    if isinstance(x, PartitionSpec) or not isinstance(x, (tuple, list)) or not x:
        return False
    names = [e for e in x if e is not None]
    return bool(names) and all(
        isinstance(e, str) or (isinstance(e, (tuple, list)) and e and all(isinstance(a, str) for a in e)) for e in names
    )


def spec_leaves(param_specs: Any, params: PyTree) -> list[tuple[KeyPath, Any, Any]]:
    """``(key path, leaf, spec)`` per parameter leaf, in flatten order, for a
    spec tree mirroring ``params`` or a callable ``(key_path, leaf) -> spec``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    if param_specs is None:
        return [(p, leaf, None) for p, leaf in pairs]
    if callable(param_specs) and not isinstance(param_specs, PartitionSpec):
        return [(p, leaf, param_specs(p, leaf)) for p, leaf in pairs]
    spec_pairs = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=_is_spec_leaf)[0]
    if len(spec_pairs) != len(pairs):
        raise ValueError(NOT_MIRRORED.format(detail=mismatch(pairs, spec_pairs)))
    try:
        specs = treedef.flatten_up_to(param_specs)
    except (ValueError, TypeError) as err:
        raise ValueError(NOT_MIRRORED.format(detail=str(err).splitlines()[0])) from None
    return [(p, leaf, spec) for (p, leaf), spec in zip(pairs, specs, strict=True)]


def mismatch(pairs: list[tuple[KeyPath, Any]], spec_pairs: list[tuple[KeyPath, Any]]) -> str:
    """Which parameter leaves the spec tree lacks and which of its specs name no parameter.

    >>> from jax.sharding import PartitionSpec as P
    >>> params = {"w": 1, "b": 2, "layers": {"k": 3}}
    >>> mismatch(jax.tree_util.tree_flatten_with_path(params)[0],
    ...          jax.tree_util.tree_flatten_with_path({"w": P(), "bias": P(), "layers": {}})[0])
    '3 parameter leaves, 2 specs: no spec for b, layers/k; no parameter for bias'
    """
    have = [path_str(p) for p, _ in pairs]
    given = [path_str(p) for p, _ in spec_pairs]
    missing = [p for p in have if p not in set(given)]
    extra = [p for p in given if p not in set(have)]
    parts = [f"{len(have)} parameter leaves, {len(given)} specs"]
    parts += [f"no spec for {', '.join(missing)}"] if missing else []
    parts += [f"no parameter for {', '.join(extra)}"] if extra else []
    return "; ".join(parts[:1]) + (": " + "; ".join(parts[1:]) if parts[1:] else "")


def _entry(raw: Any) -> Entry:
    if raw is None:
        return None
    axes = (raw,) if isinstance(raw, str) else tuple(raw)
    return axes[0] if len(axes) == 1 else (axes or None)


def _entry_axes(entry: Entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else entry)


def _problems(path: str, shape: tuple[int, ...], spec: Any, mesh: Mesh, zero_axes: Sequence[str]) -> list[str]:
    if _spec_like(spec):
        return [TUPLE_SPEC.format(path=path, value=spec, kind=type(spec).__name__, spelled=PartitionSpec(*spec))]
    if not isinstance(spec, PartitionSpec):
        return [NOT_A_SPEC.format(path=path, value=spec)]
    if len(spec) > len(shape):
        return [TOO_LONG.format(path=path, shape=shape, spec=spec, count=len(spec))]
    problems, seen = [], set()
    for dim, raw in enumerate(spec):
        axes = _entry_axes(_entry(raw))
        for axis in axes:
            if axis not in mesh.shape:
                problems.append(NOT_MODEL_AXIS.format(path=path, spec=spec, axis=axis, why="not a mesh axis"))
            elif axis in zero_axes:
                why = "a ZeRO axis (the policy's axis= / replica_axis=); ZeRO adds its own cut"
                problems.append(NOT_MODEL_AXIS.format(path=path, spec=spec, axis=axis, why=why))
            elif axis in seen:
                problems.append(REUSED_AXIS.format(path=path, spec=spec, axis=axis))
            seen.add(axis)
        if axes and all(a in mesh.shape for a in axes):
            n = math.prod(mesh.shape[a] for a in axes)
            if shape[dim] % n:
                problems.append(UNEVEN.format(path=path, shape=shape, dim=dim, size=shape[dim], axes=axes, n=n))
    return problems


def normalise(spec: PartitionSpec | None, ndim: int) -> ModelEntries:
    """One entry per dimension, or ``()`` when no dimension is model-sharded.

    >>> from jax.sharding import PartitionSpec as P
    >>> normalise(P(None, "model"), 2), normalise(P(("model",)), 1), normalise(P(), 2)
    ((None, 'model'), ('model',), ())
    """
    if spec is None:
        return ()
    entries = tuple(_entry(raw) for raw in spec) + (None,) * (ndim - len(spec))
    return entries if any(e is not None for e in entries) else ()


def model_entries(
    param_specs: Any, params: PyTree, mesh: Mesh, zero_axes: Sequence[str], shape_of: Callable[[Any], tuple[int, ...]]
) -> list[ModelEntries]:
    """Every parameter leaf's checked, normalised model layout (flatten
    order); one ``ValueError`` naming every leaf whose spec cannot apply."""
    rows = spec_leaves(param_specs, params)
    problems = []
    for path, leaf, spec in rows:
        if spec is not None:
            problems += _problems(path_str(path), shape_of(leaf), spec, mesh, zero_axes)
    if problems:
        raise ValueError(
            BAD_SPECS.format(
                count=len(problems),
                mesh=dict(mesh.shape),
                zero=tuple(zero_axes),
                lines="\n".join(f"  - {p}" for p in problems),
            )
        )
    # Axes of size 1 shard nothing; dropping them keeps each spec in the form
    # the compiler reports back (one compilation, not two).
    return [normalise(_without_unit_axes(spec, mesh), len(shape_of(leaf))) for _, leaf, spec in rows]


def _without_unit_axes(spec: PartitionSpec | None, mesh: Mesh) -> PartitionSpec | None:
    if spec is None:
        return None
    return PartitionSpec(*(tuple(a for a in _entry_axes(_entry(raw)) if mesh.shape[a] > 1) or None for raw in spec))


def spec_key(param_specs: Any) -> Any:
    """A hashable fingerprint of the ``param_specs`` argument (a callable is its own)."""
    if param_specs is None or callable(param_specs) and not isinstance(param_specs, PartitionSpec):
        return param_specs
    leaves, treedef = jax.tree_util.tree_flatten(param_specs, is_leaf=_is_spec_leaf)
    return (treedef, tuple(leaves))


def axes_of(entries: ModelEntries) -> tuple[str, ...]:
    """The mesh axes a leaf's model layout uses, in dimension order."""
    return tuple(a for e in entries for a in _entry_axes(e))
