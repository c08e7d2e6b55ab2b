"""The audit on a mesh with model axes (tensor, sequence, expert parallelism).

ZeRO's collectives run over the data (and replica) axes; every other mesh
axis is a *model axis*, partitioned by the user's own layout. The audit splits
what a compiled step sends by the axes each collective spans
(:meth:`zero_jax._audit.hlo.Collective.axes`): the ZeRO side (any collective
spanning a data or replica axis) is judged against the stage's theory for the
per-model-shard bytes, a collective spanning model axes only is the model's
own business, and one all-gather is always wrong: a weight gathered whole
across a model axis (:func:`model_gather_violations`), the silent loss of
tensor parallelism when XLA gathers the operand of a data-axis collective
across the automatic model axis first.

>>> import jax
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> mesh = jax.make_mesh((4, 2), ("data", "model"))
>>> split_of(NamedSharding(mesh, P("data", "model")), 2, ("model",))
(1, 2)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from typing import Any

from zero_jax._audit.hlo import Collective
from zero_jax._audit.report import MODEL_AXIS_GATHER, ParamInfo, Violation
from zero_jax._base.units import fmt_bytes
from zero_jax._layerwise.activations import ACTIVATION_SCOPE
from zero_jax._layout.leaf import LeafLayout
from zero_jax._policy.policy import ZeroPolicy

MODEL_GATHER_MESSAGE = (
    "all-gather '{name}' (op {op_name}) of {shape} ({nbytes}, x{trips}) runs over mesh axes {axes} and its result "
    "has the shape of {what} gathered whole over model axes {model}: every device then holds and computes with the "
    "whole weight, so tensor parallelism is silently lost (and the data axis moves up to M times the theory). "
    "Inside a shard_map manual over data only, XLA gathers the operand of a data-axis all-gather or reduce-scatter "
    "across the automatic model axes first: run ZeRO's collectives in a shard_map nested over the leaf's model axes "
    "(in_specs / out_specs = its model spec) so each device moves only its model shard; in the model's own code, "
    "constrain the activations' sharding (jax.lax.with_sharding_constraint) so the compiler keeps the weight cut."
)


def split_of(sharding: Any, ndim: int, axes: Iterable[str]) -> tuple[int, ...]:
    """How many ways each dimension of a leaf is cut over the model ``axes``,
    read off its ``NamedSharding`` spec (all 1 for any other sharding)."""
    spec, mesh, model = getattr(sharding, "spec", None), getattr(sharding, "mesh", None), set(axes)
    if spec is None or mesh is None or not model:
        return (1,) * ndim
    out = []
    for i in range(ndim):
        entry = spec[i] if i < len(spec) else None
        names = entry if isinstance(entry, tuple) else (() if entry is None else (entry,))
        out.append(math.prod(int(mesh.shape[a]) for a in names if a in model))
    return tuple(out)


def local_shape(shape: tuple[int, ...], split: tuple[int, ...]) -> tuple[int, ...]:
    """One model shard of ``shape`` (``split`` aligned to its trailing dims:
    a stacked leaf's layer slice drops the leading one)."""
    split = split[len(split) - len(shape) :] if len(split) >= len(shape) else (1,) * len(shape)
    return tuple(d // s if s > 1 else d for d, s in zip(shape, split, strict=True))


def is_model_only(c: Collective, policy: ZeroPolicy, model: frozenset[str] | set[str]) -> bool:
    """A collective spanning model axes only: the model's own layout, not ZeRO's."""
    axes = set(c.axes(policy.mesh))
    return bool(model) and bool(axes) and axes <= set(model)


def weight_shapes(p: Any, num_shards: int) -> set[tuple[int, ...]]:
    """The shapes a model-sharded parameter (a ``ParamInfo``: ``layout``,
    ``split``, ``stacked``) takes once gathered whole over at least one of its
    model-sharded dims: the data dim at any of its sizes (whole, padded, one
    data piece), each model-sharded dim whole or still cut, the rest whole; a
    stacked leaf's layer slices too. Empty for a leaf not model-sharded."""
    lay, split = p.layout, tuple(p.split) or (1,) * len(p.layout.shape)
    if math.prod(split) <= 1 or len(split) != len(lay.shape):
        return set()
    choices = []
    for i, d in enumerate(lay.shape):
        if i == lay.dim:
            choices.append({d, lay.padded_size, lay.padded_size // max(num_shards, 1)})
        else:
            choices.append({d, d // split[i]} if split[i] > 1 else {d})
    whole = [s for s in itertools.product(*choices) if any(k > 1 and s[i] == lay.shape[i] for i, k in enumerate(split))]
    return set(whole) | ({s[1:] for s in whole} if p.stacked else set())


def _int8_over_data_and_model(c: Collective, axes: tuple[str, ...], policy: ZeroPolicy, model: set[str]) -> bool:
    """A qwZ gather (int8 blocks, ``(G, nb, block)``) spanning a data axis and
    a model axis: ZeRO gathers each model shard's int8 pieces over data only."""
    quantized = c.dtype == "s8" and len(c.shape) == 3 and c.shape[2] <= policy.wire.block
    return quantized and bool(set(axes) & model) and bool(set(axes) & set(policy.axes))


def made_for_a_zero_collective(c: Collective, colls: dict[str, Collective], policy: ZeroPolicy) -> bool:
    """Whether a model-axis all-gather is the operand of a ZeRO collective
    (its result reaches, unchanged, a collective spanning a data or replica
    axis: :attr:`Collective.feeds`), not the model's own computation (a
    matmul's or reshape's activations) nor P_a's regather of a saved
    activation (:data:`ACTIVATION_SCOPE`): a shape alone does not say weight,
    a (rows, features) activation can have a stacked bias's shape. Read off
    the dataflow, not the op_name: jax 0.10.2 names the partitioner's gather
    for the collective it feeds, jax 0.12.1 for the ``shard_map`` around it
    or for nothing at all (measured on ``tests/test_audit_axes.py`` and
    ``tests/test_bad_inputs.py``'s P_a case)."""
    if ACTIVATION_SCOPE in c.op_name:
        return False
    zero = set(policy.axes + policy.replica_axes)
    return any(set(colls[f].axes(policy.mesh)) & zero for f in c.feeds if f in colls)


def model_gather_violations(colls: Iterable[Collective], params: Iterable[Any], policy: ZeroPolicy) -> list[Violation]:
    """All-gathers across a model axis, made for a ZeRO collective, whose
    result has the shape of a model-sharded parameter gathered whole over
    (one of) its model axes, or (qwZ) int8 weight blocks gathered across a
    model axis and data together."""
    model = set(policy.model_axes)
    if not model:
        return []
    shapes: dict[tuple[int, ...], list[str]] = {}
    for p in params:
        for s in weight_shapes(p, policy.num_shards):
            shapes.setdefault(s, []).append(p.path)
    colls = list(colls)
    by_name = {c.name: c for c in colls}
    out = []
    for c in colls:
        axes = c.axes(policy.mesh)
        int8 = _int8_over_data_and_model(c, axes, policy, model)
        if c.kind != "all-gather" or not set(axes) & model or (c.shape not in shapes and not int8):
            continue
        if not int8 and not made_for_a_zero_collective(c, by_name, policy):
            continue
        message = MODEL_GATHER_MESSAGE.format(
            name=c.name, op_name=c.op_name or "-", shape=f"{c.dtype}[{','.join(map(str, c.shape))}]",
            nbytes=fmt_bytes(c.bytes), trips=c.trips, axes=axes,
            what=", ".join(f"'{path}'" for path in shapes[c.shape]) if c.shape in shapes else "int8 weight blocks",
            model=tuple(a for a in axes if a in model),
        )  # fmt: skip
        out.append(Violation(MODEL_AXIS_GATHER, c.name, message))
    return out


def model_shard_layout(p: ParamInfo) -> LeafLayout:
    """The layout of one model shard of a parameter (itself without model axes)."""
    if p.model_split <= 1:
        return p.layout
    return dataclasses.replace(p.layout, shape=local_shape(p.layout.shape, p.split))
