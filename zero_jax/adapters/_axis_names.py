"""What the axis names in a model's declared layout mean, and that layout placed on a mesh.

tunix and MaxText name their sharding axes by role (``nnx.Param(..., sharding=("fsdp", "tp"))``): a name that
means data parallelism (:data:`DATA_PARALLEL_NAMES`) is ZeRO's own cut, a name that means tensor parallelism
(:data:`TENSOR_PARALLEL_NAMES`) the mesh's model axis. :func:`specs_for_mesh` turns ``adapted.param_specs`` into
the ``param_specs`` of a policy on a given mesh (``Adapted.policy`` does, by default); a rule the adapter was
given in ``logical_axis_rules=`` was applied before (``zero_jax.adapters._specs``) and wins.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from zero_jax._base.tree import PyTree, path_str

__all__ = ["DATA_PARALLEL_NAMES", "TENSOR_PARALLEL_NAMES", "specs_for_mesh"]

#: Axis names that mean data parallelism (FSDP included) in the layouts models declare: ZeRO's own cut.
DATA_PARALLEL_NAMES = frozenset({"fsdp", "fsdp_transpose", "data", "dp", "ddp", "batch", "replica", "zero"})
#: Axis names that mean tensor (model) parallelism: the mesh's model axis.
TENSOR_PARALLEL_NAMES = frozenset({"tp", "tensor", "tensor_transpose", "model", "mp"})


def _axes(entry: object) -> tuple[str, ...]:
    """The names one spec entry holds: ``'model'``, ``('fsdp', 'tp')`` or None."""
    if isinstance(entry, str):
        return (entry,)
    return tuple(a for a in entry if isinstance(a, str)) if isinstance(entry, (tuple, list)) else ()


UNKNOWN_NAMES = (
    "{where}: {leaves}: axis names that are neither axes of the mesh {mesh} nor known data-parallel names "
    "({dp}: ZeRO's own cut) or tensor-parallel names ({tp}: the model axis). Map each with "
    "logical_axis_rules=[(name, mesh_axis or None), ...] in from_nnx / from_linen, or pass param_specs= to "
    "adapted.policy() yourself."
)
SEVERAL_MODEL_AXES = (
    "{where}: {leaves}: tensor-parallel names, and the mesh has several model axes {axes}: say which with "
    "logical_axis_rules=[(name, mesh_axis), ...] in from_nnx / from_linen, or pass param_specs= to "
    "adapted.policy() yourself."
)


def _placed(name: str, zero_axes: tuple[str, ...], model_axes: tuple[str, ...]) -> tuple[str | None, str | None]:
    """``(mesh axis or None, problem or None)`` for one declared name (see :func:`specs_for_mesh`)."""
    if name in zero_axes or (name in DATA_PARALLEL_NAMES and name not in model_axes):
        return None, None
    if name in model_axes:
        return name, None
    if name in TENSOR_PARALLEL_NAMES:
        return (model_axes[0] if model_axes else None), ("several" if len(model_axes) > 1 else None)
    return None, "unknown"


def specs_for_mesh(
    specs: PyTree, zero_axes: tuple[str, ...], model_axes: tuple[str, ...], where: str
) -> PyTree:
    """``param_specs`` as a model declares them, placed on a mesh whose ZeRO axes (``axis=`` and
    ``replica_axis=``) are ``zero_axes`` and whose other axes are ``model_axes``: a ZeRO axis or a
    data-parallel name is dropped (ZeRO cuts over its own axis), a model axis stays, a tensor-parallel name
    becomes the model axis (dropped when the mesh has none). Any other name, or a tensor-parallel name on a
    mesh with several model axes, is one error naming each leaf and the fix.

    >>> from jax.sharding import PartitionSpec as P
    >>> specs_for_mesh({"w": P("fsdp", "tp"), "b": P("tp")}, ("data",), ("model",), "example")
    {'b': P('model',), 'w': P(None, 'model')}
    >>> specs_for_mesh({"w": P("fsdp", "tp")}, ("fsdp",), ("tp",), "example")
    {'w': P(None, 'tp')}
    >>> specs_for_mesh({"w": P("fsdp", "tp")}, ("data",), (), "example")  # a data-only mesh
    {'w': P(None, None)}
    """
    pairs, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    out, bad = [], {"unknown": [], "several": []}
    for path, spec in pairs:
        entries = []
        for entry in spec:
            placed = [_placed(n, zero_axes, model_axes) for n in _axes(entry)]
            for (_, problem), n in zip(placed, _axes(entry), strict=True):
                if problem is not None:
                    bad[problem].append(f"'{path_str(path)}' names {n!r} (in {spec})")
            axes = tuple(dict.fromkeys(a for a, _ in placed if a is not None))
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        out.append(PartitionSpec(*entries))
    messages = []
    if bad["unknown"]:
        messages.append(UNKNOWN_NAMES.format(where=where, leaves="; ".join(bad["unknown"]),
                                             mesh=zero_axes + model_axes, dp=", ".join(sorted(DATA_PARALLEL_NAMES)),
                                             tp=", ".join(sorted(TENSOR_PARALLEL_NAMES))))  # fmt: skip
    if bad["several"]:
        messages.append(SEVERAL_MODEL_AXES.format(where=where, leaves="; ".join(bad["several"]), axes=model_axes))
    if messages:
        raise ValueError(" ".join(messages))
    return jax.tree.unflatten(treedef, out)
