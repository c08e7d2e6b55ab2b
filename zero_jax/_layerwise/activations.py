"""ZeRO-R's P_a and P_a+cpu: the layer inputs the layer-wise primitives keep
for their backward recompute (the activation checkpoints), cut over the model
axes (each device keeps 1/M) and all-gathered over them just before the
recompute (``ZeroPolicy(partition_activations=True)``), and kept in host
memory between a layer's forward pass and its recompute
(``offload_activations=True``: the piece, with P_a, is what travels). Values
are bitwise unchanged.

On XLA:CPU an in-jit move between memory kinds lowers to nothing (the
lowered program still carries the ``annotate_device_placement`` calls); the
TPU compiler turns them into host transfers
(``benchmarks/results/offload_activations.txt``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec

from zero_jax._base.tree import PyTree
from zero_jax._comm import collectives as coll
from zero_jax._layerwise.schedule import slice_unfusable
from zero_jax._layout.leaf import is_float
from zero_jax._policy.memory import to_device
from zero_jax._policy.policy import ZeroPolicy


def activation_axes(policy: ZeroPolicy | None) -> tuple[str, ...]:
    """The axes saved layer inputs are cut over (``partition_activations``):
    the policy's model axes of size > 1; none without the option."""
    if policy is None or not policy.partition_activations:
        return ()
    return tuple(a for a in policy.model_axes if policy.mesh.shape[a] > 1)


#: The name scope of P_a's cuts and regathers of saved activations (in each op's HLO ``op_name``).
ACTIVATION_SCOPE = "zj_activations"


def _constrain(tree: PyTree, axes: tuple[str, ...], size: int, cut: bool, materialize: bool = False) -> PyTree:
    """Each float leaf with a dimension that divides by ``size`` cut over
    ``axes`` (``cut``) or gathered back, in a ``shard_map`` nested over
    ``axes``: its specs are fixed boundaries, so the cut layout does not
    spread into the forward compute (a bare sharding constraint did: the
    compiler then all-gathered every block's input before its matmul).

    A cut is a slice of the local copy, unless ``materialize``: then
    :func:`~zero_jax._layerwise.schedule.slice_unfusable` (the schedule's
    ``unfusable_cut``)."""
    name = axes[0] if len(axes) == 1 else axes

    def one(x: Any) -> Any:
        if not is_float(x):
            return x
        dims = [d for d in range(x.ndim - 1, -1, -1) if x.shape[d] % size == 0]
        if not dims:  # no dimension divides: kept as it is, in both passes
            return x
        d = dims[0]
        piece = PartitionSpec(*[name if j == d else None for j in range(x.ndim)])

        def slice_mine(a: jax.Array) -> jax.Array:
            if materialize:
                return slice_unfusable(a, name, d)
            k = a.shape[d] // size
            return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(name) * k, k, axis=d)

        def gather(a: jax.Array) -> jax.Array:
            with jax.named_scope(ACTIVATION_SCOPE):  # inside the body: a nested shard_map drops outer scopes
                return jax.lax.all_gather(a, name, axis=d, tiled=True, to="invarying")

        fn, specs = (slice_mine, (PartitionSpec(), piece)) if cut else (gather, (piece, PartitionSpec()))
        mesh = jax.sharding.get_abstract_mesh()
        return jax.shard_map(fn, mesh=mesh, in_specs=specs[0], out_specs=specs[1], axis_names=set(axes),
                             check_vma=coll.checks_varying())(x)  # fmt: skip

    return jax.tree.map(one, tree)


def partition_saved(tree: PyTree, policy: ZeroPolicy | None, *, materialize: bool = False) -> PyTree:
    """ZeRO-R's P_a: each float leaf of a saved layer input cut over
    :func:`activation_axes` on its last dimension that divides by their size
    (each device keeps its slice; ``materialize``: see ``_constrain``);
    ``tree`` itself without the option. Only a layout: no value changes."""
    axes = activation_axes(policy)
    if not axes:
        return tree
    size = math.prod(policy.mesh.shape[a] for a in axes)  # type: ignore[union-attr]
    return _constrain(tree, axes, size, True, materialize)


def regather_saved(tree: PyTree, policy: ZeroPolicy | None) -> PyTree:
    """A :func:`partition_saved` input made whole again for its recompute (an
    all-gather over the model axes); ``tree`` itself without the option."""
    axes = activation_axes(policy)
    if not axes:
        return tree
    size = math.prod(policy.mesh.shape[a] for a in axes)  # type: ignore[union-attr]
    return _constrain(tree, axes, size, False)


BAD_OFFLOAD_ARGUMENT = "{where}: offload_activations must be True, False or None (the policy's), got {value!r}."


def offloads_activations(policy: ZeroPolicy | None, offload: bool | None, where: str) -> bool:
    """Whether saved layer inputs go to host memory: ``offload`` as a call
    gives it, ``None`` the policy's ``offload_activations``. A call that asks
    for it is checked as the policy's own option is (stage, host memory)."""
    if offload is not None and not isinstance(offload, bool):
        raise TypeError(BAD_OFFLOAD_ARGUMENT.format(where=where, value=offload))
    if not isinstance(policy, ZeroPolicy):  # None, or a wrong type the caller's active_policy names
        return False
    if offload is None or offload == policy.offload_activations:
        return policy.offload_activations
    if offload:
        try:  # what the policy's own option would raise: no host memory
            policy.replace(offload_activations=True)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{where}(offload_activations=True): {e}") from None
    return offload


def saved_to_host(tree: PyTree, offload: bool) -> PyTree:
    """P_a+cpu: each float leaf of a saved layer input moved to host memory
    (``pinned_host``); ``tree`` itself without ``offload``."""
    if not offload:
        return tree
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host) if is_float(x) else x, tree)


def saved_to_device(tree: PyTree, offload: bool) -> PyTree:
    """A :func:`saved_to_host` input brought back to device memory for its
    recompute; ``tree`` itself without ``offload``."""
    return jax.tree.map(to_device, tree) if offload else tree


def checkpointed(layer_fn: Callable[..., Any], offload: bool) -> Callable[..., Any]:
    """Stages 0-1 (and no policy): ``jax.checkpoint(layer_fn)`` (called as
    ``(params, *inputs)``), whose residuals are the layer's parameters and
    inputs; with ``offload`` (P_a+cpu) the inputs wait for the recompute in
    host memory (a custom VJP whose residuals are their host copies:
    ``jax.checkpoint`` keeps its inputs where they are). Values are bitwise
    those of ``jax.checkpoint``."""
    if not offload:
        return jax.checkpoint(layer_fn)

    def call(params: PyTree, *inputs: Any) -> Any:
        fn, consts = jax.closure_convert(layer_fn, params, *inputs)
        floats = [is_float(c) for c in consts]
        fixed = [c for c, f in zip(consts, floats, strict=True) if not f]

        def run(p: PyTree, a: tuple[Any, ...], c: tuple[Any, ...]) -> Any:
            given, others = iter(c), iter(fixed)
            return fn(p, *a, *[next(given) if f else next(others) for f in floats])

        @jax.custom_vjp
        def zero_jax_offloaded_layer(p: PyTree, a: tuple[Any, ...], c: tuple[Any, ...]) -> Any:
            return run(p, a, c)

        def fwd(p: PyTree, a: tuple[Any, ...], c: tuple[Any, ...]) -> tuple[Any, Any]:
            return run(p, a, c), (p, saved_to_host(a, True), c)

        def bwd(res: Any, ct: Any) -> tuple[Any, Any, Any]:
            p, a, c = res
            return jax.vjp(run, p, saved_to_device(a, True), c)[1](ct)

        zero_jax_offloaded_layer.defvjp(fwd, bwd)
        return zero_jax_offloaded_layer(params, inputs, tuple(c for c, f in zip(consts, floats, strict=True) if f))

    return call
