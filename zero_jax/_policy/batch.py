"""How the batch is laid out: dimension 0 over the batch axes (ZeRO's data and
replica axes), the other dimensions as ``ZeroPolicy(batch_spec=...)`` says
(a sequence axis splitting the sequence dimension); scalars (a step count, a
typed RNG key) whole on every device; and the checks that every batch leaf
can be laid out so, each bad leaf named.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from zero_jax._base.tree import PyTree, path_str

BATCH_NOT_DIVISIBLE = (
    "{where}: {leaves}; the leading (batch) dimension must divide by the {n} devices of the batch "
    "axes {axes}. Use a global batch size that is a multiple of {n}. (Scalars, typed RNG keys included, are "
    "handed to every device whole.)"
)
BATCH_NOT_MICROBATCHED = (
    "{where}: {leaves}: accum_steps={k} microbatches on each of {n} devices need a global batch that "
    "is a multiple of {nk}. Change the batch size or accum_steps."
)
BATCH_SPEC_UNFIT = (
    "{where}: ZeroPolicy(batch_spec={spec}) splits batch dimensions over model axes, but {leaves}. Every batch "
    "leaf needs those dimensions, each a multiple of its axes' size (pad the sequence), or drop batch_spec."
)
BAD_BATCH_SPEC = (
    "ZeroPolicy: batch_spec must be a PartitionSpec whose entry 0 is None (ZeRO splits the batch dimension over "
    "the batch axes itself) and whose other entries name model axes (mesh axes other than axis= and "
    "replica_axis=, here {model}), e.g. P(None, 'seq') to split the sequence dimension; got {spec!r}."
)


BATCH_NOT_ARRAYS = (
    "{where}: {leaves}: a batch holds arrays (and scalars), one row per example along dimension 0. Keep other "
    "values out of it: close over them in loss_fn (a string, a flag, a config), or encode them as arrays "
    "(token ids for text)."
)
BATCH_NESTED_LISTS = (
    "{where}: {leaves}: a batch leaf must be an array, one row per example along dimension 0. JAX takes a "
    "Python list as a pytree of separate scalars (each number would go to every device whole, and the loss "
    "would get lists, not arrays), so convert it first: jnp.asarray(...) or np.asarray(...), e.g. batch = "
    "jax.tree.map(np.asarray, batch, is_leaf=lambda v: isinstance(v, list))."
)
LEGACY_KEY_HINT = (
    " ('{leaf}' looks like a raw jax.random.PRNGKey: pass a typed key, jax.random.key(seed), which the step "
    "replicates, or one key per example, jax.random.split(key, batch_size))"
)


def is_replicated_leaf(leaf: Any) -> bool:
    """A batch leaf the step hands every device whole instead of splitting its
    rows: a scalar (a step count, a temperature, a typed RNG key), or a Python
    number."""
    return isinstance(leaf, (int, float, complex, np.number, np.bool_)) or getattr(leaf, "shape", None) == ()


def is_batch_value(leaf: Any) -> bool:
    """What may be a batch leaf: an array (or ``jax.ShapeDtypeStruct``) or a number."""
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype") or is_replicated_leaf(leaf)


def legacy_key_hint(batch: PyTree) -> str:
    """For a batch error: which leaf looks like a raw ``jax.random.PRNGKey``
    (``uint32[2]``) and what to pass instead; empty when none does."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if tuple(getattr(leaf, "shape", ())) == (2,) and getattr(leaf, "dtype", None) == np.uint32:
            return LEGACY_KEY_HINT.format(leaf=path_str(path))
    return ""


def batch_leaf_specs(batch: PyTree, rows: PartitionSpec) -> PyTree:
    """Per batch leaf, its spec: ``rows`` (split by rows), or ``P()`` for a
    replicated leaf (:func:`is_replicated_leaf`)."""
    return jax.tree.map(lambda x: PartitionSpec() if is_replicated_leaf(x) else rows, batch)


def _number_list(x: Any) -> bool:
    """A Python ``list`` whose leaves are all Python numbers (nested lists
    included, as ``ndarray.tolist()`` gives): an array written as lists."""
    if type(x) is not list:
        return False
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(v, (bool, int, float, complex)) for v in leaves)


def _as_array(x: list) -> str:
    try:
        return f"np.asarray gives shape {np.asarray(x).shape}"
    except ValueError:  # rows of different lengths
        return "ragged: its rows differ in length"


def _nested_lists(batch: PyTree) -> list[str]:
    """Each subtree of ``batch`` that is a (nested) list of numbers, named with its size."""
    pairs = jax.tree_util.tree_flatten_with_path(batch, is_leaf=_number_list)[0]
    return [f"'{path_str(p)}' is a nested list of {len(jax.tree.leaves(x))} numbers ({_as_array(x)})"
            for p, x in pairs if _number_list(x)]  # fmt: skip


def _listing(leaves: list[str]) -> str:
    return ", ".join(f"batch leaf {leaf}" for leaf in leaves)


def _axes(entry: Any) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def batch_spec_problem(batch_spec: Any, mesh: Any, zero_axes: tuple[str, ...]) -> str | None:
    """Why ``batch_spec`` cannot lay a batch out on ``mesh``, or None."""
    if batch_spec is None:
        return None
    model = tuple(a for a in getattr(mesh, "axis_names", ()) if a not in zero_axes)
    fits = (
        isinstance(batch_spec, PartitionSpec)
        and len(batch_spec) >= 1
        and batch_spec[0] is None
        and all(a in model for entry in batch_spec[1:] for a in _axes(entry))
    )
    return None if fits else BAD_BATCH_SPEC.format(model=model, spec=batch_spec)


def batch_partition_spec(batch_axes: tuple[str, ...], batch_spec: PartitionSpec | None) -> PartitionSpec:
    """The whole ``PartitionSpec`` of every batch leaf."""
    lead = batch_axes[0] if len(batch_axes) == 1 else batch_axes
    rest = [] if batch_spec is None else list(batch_spec[1:])
    while rest and rest[-1] is None:
        rest.pop()
    return PartitionSpec(lead, *rest)


def check_batch(
    batch: PyTree,
    *,
    where: str,
    n: int,
    axes: tuple[str, ...],
    microbatches: int = 1,
    batch_spec: PartitionSpec | None = None,
    mesh: Mesh | None = None,
) -> None:
    """Raise a ValueError naming every batch leaf whose leading (batch)
    dimension does not split over the ``n`` devices of ``axes`` (and
    ``microbatches``), or whose ``batch_spec`` dimensions do not split."""
    k = microbatches
    uneven, unsplit, unfit = [], [], []
    split = [] if batch_spec is None or mesh is None else list(enumerate(batch_spec))[1:]
    lists = _nested_lists(batch)
    if lists:
        raise TypeError(BATCH_NESTED_LISTS.format(where=where, leaves=_listing(lists)))
    pairs = jax.tree_util.tree_flatten_with_path(batch)[0]
    not_arrays = [f"'{path_str(p)}' is a {type(x).__name__}" for p, x in pairs if not is_batch_value(x)]
    if not_arrays:
        raise TypeError(BATCH_NOT_ARRAYS.format(where=where, leaves=_listing(not_arrays)))
    for path, leaf in pairs:
        if is_replicated_leaf(leaf):
            continue  # handed to every device whole
        shape = tuple(leaf.shape)
        if shape[0] % n:
            uneven.append(f"'{path_str(path)}' has shape {shape}")
        elif shape[0] % (n * k):
            unsplit.append(f"'{path_str(path)}' has shape {shape}")
        for dim, entry in split:
            size = math.prod(mesh.shape[a] for a in _axes(entry)) if mesh is not None else 1
            if size > 1 and (dim >= len(shape) or shape[dim] % size):
                unfit.append(f"'{path_str(path)}' has shape {shape} (dimension {dim} over {_axes(entry)}: {size})")
                break
    if uneven:
        message = BATCH_NOT_DIVISIBLE.format(where=where, leaves=_listing(uneven), n=n, axes=axes)
        raise ValueError(message + legacy_key_hint(batch))
    if unsplit:
        raise ValueError(BATCH_NOT_MICROBATCHED.format(where=where, leaves=_listing(unsplit), k=k, n=n, nk=n * k))
    if unfit:
        raise ValueError(BATCH_SPEC_UNFIT.format(where=where, spec=batch_spec, leaves=_listing(unfit)))
