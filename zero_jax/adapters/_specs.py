"""The layout a Flax model already declares, as ``param_specs`` for ``zj.ZeroPolicy``.

Linen parameters made with ``nn.with_partitioning(init, names)`` are boxed in
``nn.Partitioned`` (``nn.with_logical_partitioning``: ``nn.LogicallyPartitioned``);
NNX variables carry ``out_sharding`` metadata (``nnx.with_partitioning``,
``nnx.Param(value, out_sharding=...)``; ``sharding=`` is Flax's deprecated
spelling of it). :func:`linen_specs` and :func:`nnx_specs` read them into one
``PartitionSpec`` per parameter, in the tree the adapter trains; a leaf with no
names is ``P()``, and a model that declares nothing gives ``None``.

Linen ``nn.LogicallyPartitioned`` names are logical: each needs a rule (from the
adapter's ``logical_axis_rules=``, pairs ``(logical, mesh_axis)`` as
``nn.logical_to_mesh_axes`` takes them, the box's own rules or an enclosing
``nn.logical_axis_rules`` context); a name with none is an error, not a silently
replicated dimension. ``nn.Partitioned`` names are mesh axes, except those
``logical_axis_rules=`` has a rule for. NNX ``out_sharding`` names are mesh axes
until rules apply (the adapter's, the variable's ``sharding_rules``, the
context's); then every name needs one (a mesh axis named directly: the pair
``(name, name)``). Stacked leaves may
leave the leading layer axis unnamed (``ScanLayers`` vmaps a block's init): it
is never model-sharded.

Names as tunix and MaxText write them (``nnx.Param(..., sharding=("fsdp", "tp"))``) need no rule: a name
that means data parallelism (``"fsdp"``, ``"data"``, ``"dp"``, ``"batch"``, ...) is ZeRO's own cut and one
that means tensor parallelism (``"tp"``, ``"model"``, ...) the mesh's model axis, placed by
``adapted.policy()`` (:mod:`zero_jax.adapters._axis_names`); a rule in ``logical_axis_rules=`` for such a name
wins.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from zero_jax.adapters._specs import linen_specs
>>> dense = nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")))
>>> params = dense.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
>>> linen_specs(params, [("mlp", "model"), ("embed", None)], (), "example")
{'bias': P(), 'kernel': P(None, 'model')}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
from flax import nnx
from flax.core import meta
from jax.sharding import PartitionSpec

from zero_jax._base.tree import PyTree, key_names, path_str, split_prefix, under_any
from zero_jax.adapters._axis_names import DATA_PARALLEL_NAMES, TENSOR_PARALLEL_NAMES

Rules = tuple[tuple[str, Any], ...]

__all__ = [
    "check_rules",
    "linen_layout",
    "linen_specs",
    "nnx_specs",
    "rebox",
    "resolve",
    "unbox",
]

_KNOWN_NAMES = DATA_PARALLEL_NAMES | TENSOR_PARALLEL_NAMES


class Declared(NamedTuple):
    """One parameter's declared layout: its path and shape, the names given (one per dimension), the rules that
    turn them into mesh axes (None: they are mesh axes), the axes of the mesh the box names, if any, whether it
    is stacked (its leading layer axis may go unnamed) and whether names without a rule are mesh axes."""

    path: str
    shape: tuple[int, ...]
    names: tuple[Any, ...] | None
    rules: Rules | None = None
    mesh_axes: tuple[str, ...] | None = None
    stacked: bool = False
    passthrough: bool = False  # under rules, a name with none is a mesh axis (nn.Partitioned), not an error


BAD_RULES = (
    "{where}: logical_axis_rules must be a sequence of (logical_name, mesh_axis) pairs, mesh_axis a mesh axis "
    "name, a tuple of them or None (as nn.logical_to_mesh_axes takes them), e.g. [('mlp', 'model'), "
    "('embed', None)]; got {bad}."
)
NO_RULE = (
    "{leaves}: logical axis names with no rule (missing: {missing}; rules in effect: {rules}). Pass a "
    "(logical, mesh_axis) pair for each, mesh_axis None to leave that dimension unsharded, e.g. "
    "logical_axis_rules={example} (a name that is itself a mesh axis: the pair (name, name))."
)
RANK = (
    "{leaves}: a layout names one axis (or None) per dimension. Give the parameter as many names as it has "
    "dimensions in nn.with_partitioning / nnx.with_partitioning (out_sharding=)."
)
NOT_IN_MESH = (
    "{leaves}: the mesh the annotation carries has no such axis. Name axes of that mesh (or map the logical name "
    "to one in logical_axis_rules)."
)
UNRESOLVED = "{leaves}. Fix the names (each logical name at most once per parameter) or the rules."


def check_rules(rules: Any, where: str) -> Rules | None:
    """``logical_axis_rules`` as a tuple of pairs (None stays None); every malformed entry named in one error.

    >>> check_rules([["mlp", "model"], ("embed", None)], "example")
    (('mlp', 'model'), ('embed', None))
    """
    if rules is None:
        return None
    entries = list(rules) if isinstance(rules, Sequence) and not isinstance(rules, str) else None
    if entries is None:
        raise TypeError(BAD_RULES.format(where=where, bad=repr(rules)))
    bad = [repr(r) for r in entries if not _is_rule(r)]
    if bad:
        raise TypeError(BAD_RULES.format(where=where, bad=", ".join(bad)))
    return tuple((r[0], tuple(r[1]) if isinstance(r[1], list) else r[1]) for r in entries)


def _is_rule(rule: Any) -> bool:
    if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
        return False
    target = rule[1]
    return (
        target is None
        or isinstance(target, str)
        or (isinstance(target, (tuple, list)) and all(isinstance(t, str) for t in target))
    )


def _axes(entry: Any) -> tuple[str, ...]:
    """The mesh-axis (or logical) names one spec entry holds: ``'model'``, ``('data', 'model')`` or None."""
    if isinstance(entry, str):
        return (entry,)
    return tuple(a for a in entry if isinstance(a, str)) if isinstance(entry, (tuple, list)) else ()


def _shown(d: Declared) -> str:
    return f"'{d.path}' (shape {d.shape}, names {d.names})"


def _problem(d: Declared, convert: Callable[[tuple[Any, ...], Rules], PartitionSpec]) -> tuple[str, Any]:
    """``("spec", P)`` for a leaf that resolves, else ``(kind, detail)`` of what is wrong with it."""
    names = tuple(d.names)  # pyright: ignore[reportArgumentType] - logical partitioning metadata has names
    if d.stacked and len(names) == len(d.shape) - 1:
        names = (None, *names)  # the layer axis of a stack, never model-sharded
    if len(names) != len(d.shape):
        return "rank", f"{_shown(d)} has {len(names)} names for {len(d.shape)} dimensions"
    if d.rules is None:
        spec = PartitionSpec(*names)
    else:
        known = {logical for logical, _ in d.rules}
        passed = [any(n not in known for n in _axes(entry)) for entry in names]
        # A data- or tensor-parallel name needs no rule (specs_for_mesh places it); any other does.
        missing = [n for entry in names for n in _axes(entry) if n not in known and n not in _KNOWN_NAMES]
        if missing and not d.passthrough:
            return "rule", (d, missing)
        try:
            spec = convert(tuple(None if p else e for p, e in zip(passed, names, strict=True)), d.rules)
        except ValueError as e:
            return "unresolved", f"{_shown(d)}: {e}"
        spec = PartitionSpec(*(e if p else s for p, e, s in zip(passed, names, spec, strict=True)))
    absent = [a for entry in spec for a in _axes(entry) if d.mesh_axes is not None and a not in d.mesh_axes]
    if absent:
        return "mesh", f"{_shown(d)} -> {spec} names {absent}, its mesh has axes {d.mesh_axes}"
    return "spec", spec


def resolve(
    declared: Sequence[Declared], where: str, convert: Callable[[tuple[Any, ...], Rules], PartitionSpec]
) -> list[PartitionSpec]:
    """One ``PartitionSpec`` per declared leaf (``P()`` where ``names`` is None), or one error naming every leaf
    that does not resolve: names of the wrong length, logical names without a rule, axes the box's mesh lacks.

    >>> resolve([Declared("w", (4, 8), (None, "model"))], "example", None)
    [P(None, 'model')]
    """
    specs, problems = [], {"rank": [], "rule": [], "mesh": [], "unresolved": []}
    for d in declared:
        kind, value = ("spec", PartitionSpec()) if d.names is None else _problem(d, convert)
        if kind == "spec":
            specs.append(value)
        else:
            problems[kind].append(value)
    if any(problems.values()):
        raise ValueError(f"{where}: " + " ".join(_messages(problems)))
    return specs


def _messages(problems: Mapping[str, list[Any]]) -> list[str]:
    out = []
    if problems["rule"]:
        leaves = "; ".join(_shown(d) for d, _ in problems["rule"])
        missing = sorted({n for _, names in problems["rule"] for n in names})
        rules: list[tuple[str, Any]] = []
        for rule in (r for d, _ in problems["rule"] for r in d.rules):
            pair = (rule[0], tuple(rule[1]) if isinstance(rule[1], list) else rule[1])
            rules += [] if pair in rules else [pair]
        example = [*rules, *((n, None) for n in missing)]
        out.append(NO_RULE.format(leaves=leaves, missing=missing, rules=list(rules) or None, example=example))
    if problems["rank"]:
        out.append(RANK.format(leaves="; ".join(problems["rank"])))
    if problems["mesh"]:
        out.append(NOT_IN_MESH.format(leaves="; ".join(problems["mesh"])))
    if problems["unresolved"]:
        out.append(UNRESOLVED.format(leaves="; ".join(problems["unresolved"])))
    return out


def _is_box(x: Any) -> bool:
    return isinstance(x, meta.Partitioned)


def _mesh_axes(mesh: Any) -> tuple[str, ...] | None:
    return tuple(mesh.axis_names) if mesh is not None and hasattr(mesh, "axis_names") else None


def _linen_convert(names: tuple[Any, ...], rules: Rules) -> PartitionSpec:
    return nn.logical_to_mesh_axes(names, rules)  # pyright: ignore[reportPrivateImportUsage, reportReturnType] - public at runtime, not re-exported in the stubs


def linen_specs(trained: PyTree, rules: Rules | None, stacked: tuple[str, ...], where: str) -> PyTree | None:
    """The ``PartitionSpec`` tree of a Linen parameter tree whose leaves may be ``nn.Partitioned`` boxes, in the
    structure of :func:`unbox` of it; None when no leaf is boxed. ``nn.Partitioned`` names are mesh axes, except
    those ``rules`` (when given) has a rule for (logical names in ``nn.with_partitioning``, the way
    ``nn.logical_to_mesh(nn.get_partition_spec(variables), rules)`` reads them); ``nn.LogicallyPartitioned`` names
    are logical, each needing a rule in ``rules``, the box's own rules or an enclosing ``nn.logical_axis_rules``
    context (in that order of precedence).

    >>> import jax.numpy as jnp
    >>> boxed = {"w": nn.Partitioned(jnp.zeros((4, 8)), (None, "model")), "b": jnp.zeros(8)}
    >>> linen_specs(boxed, None, (), "example")
    {'b': P(), 'w': P(None, 'model')}
    """
    pairs, treedef = jax.tree_util.tree_flatten_with_path(trained, is_leaf=_is_box)
    if not any(_is_box(x) for _, x in pairs):
        return None
    context = tuple(nn.get_logical_axis_rules() or ())
    prefixes = [split_prefix(p) for p in stacked]
    declared = []
    for path, x in pairs:
        if not _is_box(x):
            declared.append(Declared(path_str(path), tuple(getattr(x, "shape", ())), None))
            continue
        logical = isinstance(x, nn.LogicallyPartitioned)
        box_rules = (*(rules or ()), *(x.rules or ()), *context) if logical else rules
        shape = tuple(getattr(x.value, "shape", ()))
        declared.append(Declared(path_str(path), shape, tuple(x.names), box_rules, _mesh_axes(x.mesh),
                                 under_any(path, prefixes), passthrough=not logical))  # fmt: skip
    return jax.tree.unflatten(treedef, resolve(declared, where, _linen_convert))


def unbox(tree: PyTree) -> PyTree:
    """``tree`` with every ``nn.Partitioned`` box replaced by its value (no sharding constraint applied)."""
    return jax.tree.map(lambda x: x.value if _is_box(x) else x, tree, is_leaf=_is_box)


def rebox(boxed: PyTree, values: PyTree) -> PyTree:
    """``values`` (the tree :func:`unbox` made of ``boxed``, updated) boxed again as ``boxed`` was."""
    return jax.tree.map(lambda b, v: b.replace_boxed(v) if _is_box(b) else v, boxed, values, is_leaf=_is_box)


def linen_layout(
    boxed: PyTree, rules: Any, stacked: tuple[str, ...], where: str
) -> tuple[PyTree, PyTree | None, Callable[[PyTree], PyTree]]:
    """What ``from_linen`` trains of a (possibly boxed) parameter tree: ``(params, param_specs, outward)``, the
    arrays unboxed, their :func:`linen_specs` (checked ``rules``), and the function that boxes trained params
    again for ``to_model``. A tree without boxes comes back as it is, with ``None`` and the identity.

    >>> import jax.numpy as jnp
    >>> params, specs, outward = linen_layout({"w": nn.Partitioned(jnp.zeros(4), ("model",))}, None, (), "example")
    >>> type(params["w"]).__name__, specs, type(outward(params)["w"]).__name__
    ('ArrayImpl', {'w': P('model',)}, 'Partitioned')
    """
    specs = linen_specs(boxed, check_rules(rules, where), stacked, where)
    if specs is None:
        return boxed, None, lambda p: p
    return unbox(boxed), specs, lambda p: rebox(boxed, p)


def _nnx_convert(names: tuple[Any, ...], rules: Rules) -> PartitionSpec:
    table: dict[str, Any] = {}
    for logical, target in rules:
        table.setdefault(logical, target)  # the first rule for a name wins (the adapter's over the variable's)
    return PartitionSpec(*(table[n] if isinstance(n, str) else n for n in names))


def _nnx_declared(path: str, var: nnx.Variable, rules: Rules | None, context: Rules, stacked: bool) -> Declared:
    """One NNX variable's ``out_sharding`` (a tuple of names, a ``PartitionSpec`` or a ``NamedSharding``)."""
    shape = tuple(getattr(var.get_value(), "shape", ()))
    md = var.get_metadata()
    names, mesh = md.get("out_sharding"), md.get("mesh")
    if not names:
        return Declared(path, shape, None)
    if isinstance(names, jax.sharding.NamedSharding):
        names, mesh = names.spec, names.mesh
    combined = (*(rules or ()), *(md.get("sharding_rules") or ()), *context)
    logical = rules is not None or bool(combined)
    return Declared(path, shape, tuple(names), combined if logical else None, _mesh_axes(mesh), stacked)


def nnx_specs(
    param_state: nnx.State, params: PyTree, rules: Rules | None, stacked: tuple[str, ...], where: str
) -> PyTree | None:
    """The ``PartitionSpec`` tree of the NNX variables in ``param_state``, in the structure of ``params`` (its
    pure dict); None when no variable has ``out_sharding``. Names are mesh axes unless rules apply: ``rules``,
    the variable's ``sharding_rules`` and those of an enclosing ``nn.logical_axis_rules`` context (the first rule
    for a name wins).

    >>> from flax import nnx
    >>> with nnx.use_eager_sharding(False):
    ...     layer = nnx.Linear(4, 8, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
    ...                                                                 (None, "model")), rngs=nnx.Rngs(0))
    >>> state = nnx.state(layer, nnx.Param)
    >>> nnx_specs(state, nnx.to_pure_dict(state), None, (), "example")
    {'bias': P(), 'kernel': P(None, 'model')}
    """
    context = tuple(nn.get_logical_axis_rules() or ())
    prefixes = [split_prefix(p) for p in stacked]
    by_path = {}
    for keys, var in nnx.to_flat_state(param_state):
        names = tuple(str(k) for k in keys)
        by_path[names] = _nnx_declared("/".join(names), var, rules, context, under_any("/".join(names), prefixes))
    if all(d.names is None for d in by_path.values()):
        return None
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = resolve([by_path[key_names(p)] for p, _ in pairs], where, _nnx_convert)
    return jax.tree.unflatten(treedef, specs)

