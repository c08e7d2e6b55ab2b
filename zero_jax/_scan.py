"""``scan_layers``: stacked layers run layer-wise (ZeRO-2/3), one layer whole at a time.

``scan_layers`` is a ``jax.custom_vjp`` around two ``lax.scan`` loops, so the
schedule is ours, not the compiler's:

* forward: layer i's parameters are gathered (with ``prefetch=k``, the gather
  of layer i + k is issued before layer i's compute, so it can overlap), the
  layer runs, and only its input activation is kept;
* backward, in reverse: layer i is gathered *again* (ZeRO-3's 3Ψ), its
  forward recomputed to get its vector-Jacobian product, and its parameter
  gradient reduce-scattered at once, so at most ``1 + prefetch`` whole layers
  and never the whole-model gradient exist on a device.

(With JAX's own autodiff the prefetched layer would be a loop carry, and a
loop carry is saved for the backward pass: every layer would stay alive.)

With ``ZeroPolicy(partition_activations=True)`` (ZeRO-R's P_a) the kept input
of each layer is cut over the model axes (each device keeps its slice, 1/M)
and all-gathered over them just before the layer's recompute;
:func:`partition_saved` and :func:`regather_saved` do it here and for the
per-block primitive of ``_layerwise``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr, Literal
from jax.sharding import PartitionSpec

from zero_jax import _collectives as coll
from zero_jax._jaxpr import called, live_equations
from zero_jax._layers import Sharded, active_policy, check_parameter_pieces
from zero_jax._memory import to_device
from zero_jax._partition import LeafLayout
from zero_jax._policy import ZeroPolicy
from zero_jax._tree import PyTree, path_str


def _is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def _layer_layout(lay: LeafLayout, path: str) -> LeafLayout:
    if lay.dim == 0:
        raise ValueError(
            f"zj.scan_layers: parameter '{path}' is partitioned along its leading (layer) axis. "
            "Declare its subtree stacked so that axis is never cut: "
            "ZeroPolicy(..., stacked=('<prefix of the stacked subtree>',))."
        )
    return dataclasses.replace(
        lay, shape=lay.shape[1:], dim=None if lay.dim is None else lay.dim - 1, model=lay.model[1:] if lay.model else ()
    )


# -- partitioned activations (ZeRO-R's P_a), for scan_layers and the per-block primitive --


def _is_float_array(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def activation_axes(policy: ZeroPolicy | None) -> tuple[str, ...]:
    """The axes saved layer inputs are cut over (``partition_activations``):
    the policy's model axes of size > 1; none without the option."""
    if policy is None or not policy.partition_activations:
        return ()
    return tuple(a for a in policy.model_axes if policy.mesh.shape[a] > 1)


_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _constrain(tree: PyTree, axes: tuple[str, ...], size: int, cut: bool, materialize: bool = False) -> PyTree:
    """Each float leaf with a dimension that divides by ``size`` cut over
    ``axes`` (``cut``) or gathered back, in a ``shard_map`` nested over
    ``axes``: its specs are fixed boundaries, so the cut layout does not
    spread into the forward compute (a bare sharding constraint did: the
    compiler then all-gathered every block's input before its matmul).

    A cut is a slice of the local copy, unless ``materialize``: then a
    reduce-scatter, which XLA cannot fuse into a later consumer (a slice
    whose only consumer is in the backward pass was fused into it there,
    keeping the whole input alive through the forward pass)."""
    name = axes[0] if len(axes) == 1 else axes

    def one(x: Any) -> Any:
        if not _is_float_array(x):
            return x
        dims = [d for d in range(x.ndim - 1, -1, -1) if x.shape[d] % size == 0]
        if not dims:  # no dimension divides: kept as it is, in both passes
            return x
        d = dims[0]
        piece = PartitionSpec(*[name if j == d else None for j in range(x.ndim)])

        def slice_mine(a: jax.Array) -> jax.Array:
            if not materialize:
                k = a.shape[d] // size
                return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(name) * k, k, axis=d)
            # The same slice, by a reduce-scatter of the bits with zeros from every
            # device but one (integer sums: exact for every value, -0.0 and NaN included).
            bits = jax.lax.bitcast_convert_type(a, _UINT[jnp.dtype(a.dtype).itemsize])
            mine = jnp.where(jax.lax.axis_index(name) == 0, bits, jnp.zeros_like(bits))
            return jax.lax.bitcast_convert_type(
                jax.lax.psum_scatter(mine, name, scatter_dimension=d, tiled=True), a.dtype
            )

        def gather(a: jax.Array) -> jax.Array:
            return jax.lax.all_gather(a, name, axis=d, tiled=True, to="invarying")

        fn, specs = (slice_mine, (PartitionSpec(), piece)) if cut else (gather, (piece, PartitionSpec()))
        mesh = jax.sharding.get_abstract_mesh()
        return jax.shard_map(fn, mesh=mesh, in_specs=specs[0], out_specs=specs[1], axis_names=set(axes))(x)

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


# -- the order a layer uses its parameters in, for the backward prefetch of both primitives --


def _uses(jaxpr: Jaxpr, names: dict[Any, int], prefix: tuple[int, ...], found: dict[int, list[Any]]) -> None:
    """Record in ``found`` each position (nested equation indices) where a ``names`` variable is read; a
    call (``_jaxpr.called``: a program run once on the equation's own inputs) is walked inside."""
    for i, eqn in enumerate(live_equations(jaxpr)):
        hits = [(j, names[v]) for j, v in enumerate(eqn.invars) if not isinstance(v, Literal) and v in names]
        inner = called(eqn)
        if hits and inner is not None:
            _uses(inner, {inner.invars[j]: k for j, k in hits}, (*prefix, i), found)
            continue
        for _, k in hits:
            found.setdefault(k, []).append((*prefix, i))


def use_order(
    fn: Callable[..., Any], params: PyTree, args: tuple[Any, ...], consts: Sequence[Any]
) -> tuple[list[int], list[int]]:
    """The block's parameter leaves (positions) in the order its forward
    first uses them, and in the order its backward produces their gradients
    (last uses reversed), from its program (calls walked inside)."""
    count = len(jax.tree.leaves(params))
    closed = jax.make_jaxpr(fn)(params, *args, *consts)
    found: dict[int, list[Any]] = {}
    _uses(closed.jaxpr, {v: k for k, v in enumerate(closed.jaxpr.invars[:count])}, (), found)
    needed = sorted(range(count), key=lambda k: min(found.get(k, [(len(closed.jaxpr.eqns),)])))
    produced = sorted(range(count), key=lambda k: max(found.get(k, [()])), reverse=True)
    return needed, produced


#: The share of the next layer's bytes that the backward re-gather issues as
#: soon as the layer's backward starts (the leaves that layer uses first);
#: each later leaf waits for one of this layer's gradients (paired_anchors).
#: Measured (reference transformer): 0, 0.34 and 0.5 all cost scan_layers 0.38
#: of a layer, and 0.5 issues every leaf before this layer's attention backward
#: (0: the MLP weights at the loop trip's end); apply_layers: 0.33, not 0.08.
HEAD_START = 0.5


def paired_anchors(
    needed: list[int], sizes: list[int], produced: list[int], grads: list[Any], freed: list[int],
    layouts: list[Any], start: Any, fallback: Any,
) -> list[Any]:  # fmt: skip
    """What each leaf of the next layer's backward re-gather waits for. In
    ``needed`` order (that layer's forward's; ``sizes[k]``: bytes of leaf k,
    0 if not gathered) the first ``HEAD_START`` of the bytes wait for
    ``start`` (this layer's backward starting), each later leaf for the
    gradient (``grads[k]``, reduce-scattered, or None) after which this
    layer's leaves done with (``freed`` bytes, ``produced`` order) outweigh
    those fetched: the two layers' whole leaves stay under 1 + ``HEAD_START``
    layers (all at the start, prefetch=1 cost 1.00 whole layer of compiled
    peak for scan_layers, 1.06-1.25 for apply_layers, reference model). A
    gradient cut over model axes is no anchor (reading one element of it
    made the SPMD partitioner all-gather it); else ``fallback``."""
    order = iter(produced)
    anchors, head, total = [fallback] * len(sizes), HEAD_START * sum(sizes), 0
    done, anchor, early = 0, fallback, True
    for k in (k for k in needed if sizes[k]):
        total += sizes[k]
        early = early and total <= head
        while not early and done < total - head and (j := next(order, None)) is not None:
            done += freed[j]
            anchor = grads[j] if grads[j] is not None and not any(layouts[j].model) else anchor
        anchors[k] = start if early else anchor
    return anchors


UNSCANNED_BLOCKS = (
    "zj.scan_layers: stacked_params is a list of {count} blocks (0 … {last}), not stacked layers: its leaves have "
    "no common leading layer axis (their leading sizes are hidden sizes). Run a list of blocks with "
    "zj.apply_layers(layer_fn, blocks, carry, policy) (and leave it out of ZeroPolicy(stacked=...)), or stack "
    "them (jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)) for zj.scan_layers."
)


def _depth(stacked: PyTree) -> int:
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stacked, is_leaf=_is_sharded)[0]:
        shape = leaf.shape if not _is_sharded(leaf) else leaf.arrays[0].shape
        sizes[path_str(path)] = shape[0] if shape else None
    depths = set(sizes.values())
    if not sizes:
        raise ValueError("zj.scan_layers: stacked_params has no leaves.")
    tops = {path_str(p[:1]) for p, _ in jax.tree_util.tree_flatten_with_path(stacked, is_leaf=_is_sharded)[0]}
    if len(tops) >= 2 and all(t.isdigit() for t in tops) and (None in depths or len(depths) != 1):
        raise ValueError(UNSCANNED_BLOCKS.format(count=len(tops), last=len(tops) - 1))
    if None in depths or len(depths) != 1:
        listing = ", ".join(f"{p}: {d}" for p, d in sorted(sizes.items()))
        raise ValueError(
            "zj.scan_layers: the stacked parameters disagree on the layer count (leading "
            f"dimension): {listing}. Every leaf needs the same leading layer axis."
        )
    return depths.pop()


def scan_layers(
    layer_fn: Callable[[PyTree, Any], Any],
    stacked_params: PyTree,
    carry: Any,
    policy: ZeroPolicy | None,
    *,
    remat: bool = True,
    prefetch: int = 1,
) -> Any:
    """Run ``layer_fn(layer_params, carry) -> carry`` over the leading layer
    axis of ``stacked_params``, gathering each layer just in time.

    Stage 3: each layer's parameters are all-gathered just before use and
    dropped after; the backward pass gathers again and reduce-scatters each
    layer's gradient as soon as it exists. Stage 2: same schedule without the
    gathers: each layer's gradient is reduce-scattered in the backward pass,
    so the whole-model gradient never exists. Stages 0–1 and
    ``policy=None``: a plain ``lax.scan`` (checkpointed per layer if
    ``remat``).

    Args:
      layer_fn: one layer; may close over other values (masks, shared
        parameters), whose gradients flow as usual.
      stacked_params: the stacked subtree (declared ``stacked=`` in the policy).
      carry: the activation passed from layer to layer.
      policy: the step's policy, or ``None`` outside a step.
      remat: keep only each layer's input activation and recompute the layer
        in the backward pass. Stages 2–3 always do (that is where the
        backward re-gather happens); ``remat=False`` is for stages 0–1.
      prefetch: how many layers ahead to issue the all-gather (stage 3), so
        it can overlap the current layer's compute; each costs at most one
        more whole layer of memory (prefetch=1: 0.38 of a layer of compiled
        peak measured on the reference model at depths 4 to 16, the backward
        pass re-gathering leaf by leaf, see ``paired_anchors``). 0 gathers
        each layer only when it is needed. Lowered to
        ``depth - 2`` where needed so each loop runs at least twice.
    """
    policy = active_policy(policy, "zj.scan_layers")
    depth = _depth(stacked_params)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or not 0 <= prefetch <= depth:
        raise ValueError(
            f"zj.scan_layers: prefetch must be an int from 0 to the depth ({depth}), got {prefetch!r}. "
            "1 overlaps the next layer's gather with this layer's compute."
        )
    leaves = jax.tree.leaves(stacked_params, is_leaf=_is_sharded)
    if policy is None or not policy.partitions_grads or not any(_is_sharded(x) for x in leaves):
        check_parameter_pieces(stacked_params, policy, "zj.scan_layers") if policy is not None else None
        body = jax.checkpoint(layer_fn) if remat else layer_fn
        return jax.lax.scan(lambda c, layer: (body(layer, c), None), carry, stacked_params)[0]
    if not remat:
        raise ValueError(
            "zj.scan_layers: remat=False is only available in stages 0–1; stages 2–3 recompute each "
            "layer in the backward pass to gather it again and reduce-scatter its gradient."
        )
    check_parameter_pieces(stacked_params, policy, "zj.scan_layers")
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(stacked_params, is_leaf=_is_sharded)
    nodes = [
        Sharded(x.arrays, _layer_layout(x.layout, path_str(p)), x.policy) if _is_sharded(x) else x
        for p, x in paths_leaves
    ]
    # Stage 2 gathers nothing, so there is nothing to prefetch (and a queue
    # would only copy whole layers into the loop state). In stage 3 each loop
    # keeps at least two trips: XLA inlines a one-trip loop and then merges the
    # backward re-gathers into the forward gathers, keeping every layer alive.
    ahead = min(prefetch, max(depth - 2, 0)) if policy.partitions_params else 0
    return _zero_scan(layer_fn, treedef, nodes, carry, policy, ahead, depth)


class _ScanPlan(NamedTuple):
    """The stage 2–3 layer scan, per flattened stacked leaf."""

    treedef: Any
    sharded: list[bool]  # a Sharded node (partitioned) or a plain (whole-kept) stacked leaf
    layouts: list[LeafLayout | None]  # one layer's layout of each Sharded leaf
    gathers: list[bool]  # stage-3 pieces: all-gathered for use
    slot_dtypes: list[Any]  # the gradient slot's dtype (the reduce dtype); None: frozen or plain
    axis: Any
    prefetch: int
    depth: int
    order: tuple[list[int], list[int]] | None = None  # use_order of the layer, for the backward prefetch


def _fetch(
    plan: _ScanPlan, i: jax.Array, diff: list[Any], wholes: list[Any], anchor: Any = None, anchors: Any = None
) -> PyTree:
    """Layer i's whole parameters (all-gathers for stage-3 pieces; one layer in
    from the host), each piece tied to ``anchor`` when given (``coll.tie``),
    or to its own entry of ``anchors``."""
    anchors = anchors or [anchor] * len(diff)
    out = [
        coll.fetch(coll.tie(to_device(w[i]), a), lay, plan.axis, gather=g) if s else d[i]
        for s, d, w, lay, g, a in zip(plan.sharded, diff, wholes, plan.layouts, plan.gathers, anchors, strict=True)
    ]
    return jax.tree_util.tree_unflatten(plan.treedef, out)


def _reduce_layer(plan: _ScanPlan, g_layer: PyTree) -> list[Any]:
    """Layer i's parameter gradient: reduce-scattered (in the slot's dtype)
    for partitioned leaves; none for frozen ones."""
    gs = jax.tree_util.tree_flatten(g_layer)[0]
    return [
        (None if dt is None else coll.sum_reduce_scatter(g.astype(dt), lay, plan.axis)) if s else g
        for s, dt, g, lay in zip(plan.sharded, plan.slot_dtypes, gs, plan.layouts, strict=True)
    ]


def _pipelined(
    plan: _ScanPlan, step: Callable[..., Any], state: Any, diff: list[Any], wholes: list[Any], reverse: bool
) -> Any:
    """Run ``step(state, i, layer_i_params)`` for every layer, in order or in
    reverse, with the gathers of the next ``prefetch`` layers in flight."""
    depth, prefetch = plan.depth, plan.prefetch

    def index(t: Any) -> Any:
        return depth - 1 - t if reverse else t

    def fetch(t: Any, anchor: Any = None, anchors: Any = None) -> PyTree:
        return _fetch(plan, index(t), diff, wholes, anchor, anchors)

    if prefetch == 0:
        return jax.lax.scan(lambda s, t: step(s, index(t), fetch(t)), state, jnp.arange(depth))
    # The queue's first gathers wait for the loop's input (in the backward
    # pass, the cotangent): untied, XLA issues the backward's first re-gather
    # during the forward pass, one more whole layer alive there.
    queue = tuple(fetch(t, state) for t in range(prefetch))
    # The outputs go into one buffer for every layer, updated in place: the
    # loop's own stacked outputs with the last layers' concatenated to them
    # were one more copy of all of them (and worse packing): 0.17 / 0.50 more
    # whole layers of compiled peak at depth 8 / 16 of the reference model.
    ys = _ys_buffer(step, state, queue[0], index, depth)

    def body(carry: Any, t: jax.Array) -> Any:
        s, q, buf = carry
        if reverse and plan.order is not None:  # the backward pass: leaf by leaf (paired_anchors)
            s_in, (s, y) = s, step(s, index(t), q[0])
            grads = [None if dt is None else g for dt, g in zip(plan.slot_dtypes, y, strict=True)]
            sizes = [lay.nbytes if g else 0 for g, lay in zip(plan.gathers, plan.layouts, strict=True)]
            ahead = fetch(t + prefetch, s, paired_anchors(plan.order[0], sizes, plan.order[1], grads, sizes,
                                                          plan.layouts, s_in, s))  # fmt: skip
        else:
            ahead = fetch(t + prefetch)  # issued before this layer's compute
            s, y = step(s, index(t), q[0])
        return (s, (*q[1:], ahead), _put(buf, y, t)), None

    # The last `prefetch` layers are already in the queue: run them without
    # fetching (a clipped index would gather the last layer again).
    (state, queue, ys), _ = jax.lax.scan(body, (state, queue, ys), jnp.arange(depth - prefetch))
    for j in range(prefetch):
        state, y = step(state, index(depth - prefetch + j), queue[j])
        ys = _put(ys, y, depth - prefetch + j)
    return state, ys


def _ys_buffer(step: Callable[..., Any], state: Any, params: PyTree, index: Callable[[Any], Any], depth: int) -> Any:
    """Zeros shaped like every layer's ``step`` output, stacked, typed as
    varying as the output is (a loop carry's type may not change)."""
    shapes = jax.eval_shape(lambda: step(state, index(0), params)[1])

    def zeros(a: Any) -> jax.Array:
        manual = getattr(a, "manual_axis_type", None)
        z, axes = jnp.zeros((depth, *a.shape), a.dtype), tuple(sorted(manual.varying if manual is not None else ()))
        return jax.lax.pcast(z, axes, to="varying") if axes else z

    return jax.tree.map(zeros, shapes)


def _put(buf: Any, y: Any, t: Any) -> Any:
    return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(b, v, t, 0), buf, y)


def _scan_plan(
    treedef: Any, nodes: list[Any], axis: Any, prefetch: int, depth: int
) -> tuple[_ScanPlan, list[Any], list[Any]]:
    """The plan of the stage 2–3 scan and its two lists of stacked arrays:
    what is differentiated (the gradient slots of partitioned leaves, the
    whole-kept plain leaves; ``None`` for frozen ones) and the sources (stage-3
    pieces, stage-2 whole parameters), which only feed the forward pass."""
    sharded = [_is_sharded(x) for x in nodes]
    diff = [(x.arrays[1] if len(x.arrays) > 1 else None) if s else x for x, s in zip(nodes, sharded, strict=True)]
    wholes = [x.arrays[0] if s else None for x, s in zip(nodes, sharded, strict=True)]
    plan = _ScanPlan(
        treedef=treedef,
        sharded=sharded,
        layouts=[x.layout if s else None for x, s in zip(nodes, sharded, strict=True)],
        gathers=[s and x.gathers for x, s in zip(nodes, sharded, strict=True)],
        # Slots are zeros: only their dtype (the reduce dtype) matters, so they are
        # not kept for the backward pass (that would hold a gradient-sized buffer).
        slot_dtypes=[d.dtype if s and d is not None else None for s, d in zip(sharded, diff, strict=True)],
        axis=axis,
        prefetch=prefetch,
        depth=depth,
    )
    return plan, diff, wholes


def _zero_scan(
    layer_fn: Callable[[PyTree, Any], Any],
    treedef: Any,
    nodes: list[Any],
    carry: Any,
    policy: ZeroPolicy,
    prefetch: int,
    depth: int,
) -> Any:
    """The stage 2–3 schedule (see the module docstring)."""
    plan, diff, wholes = _scan_plan(treedef, nodes, policy.comm, prefetch, depth)
    sharded = plan.sharded
    with jax.named_scope("zero_jax_scan_example"):  # layer 0, only to trace layer_fn (dead code)
        example = _fetch(plan, jnp.asarray(0), diff, wholes)
    fn, all_consts = jax.closure_convert(layer_fn, example, carry)
    if prefetch and policy.partitions_params:
        plan = plan._replace(order=use_order(fn, example, (carry,), all_consts))
    # Values layer_fn closes over: float ones get gradients, the rest are fixed.
    is_float = [jnp.issubdtype(c.dtype, jnp.inexact) for c in all_consts]
    fixed = [c for c, f in zip(all_consts, is_float, strict=True) if not f]

    def layer(params: PyTree, c: Any, float_consts: tuple[Any, ...]) -> Any:
        floats, others = iter(float_consts), iter(fixed)
        return fn(params, c, *[next(floats) if f else next(others) for f in is_float])

    @jax.custom_vjp
    def zero_jax_scan(diff: list[Any], wholes: list[Any], carry: Any, float_consts: tuple[Any, ...]) -> Any:
        return forward(diff, wholes, carry, float_consts)[0]

    def forward(diff: list[Any], wholes: list[Any], carry: Any, float_consts: tuple[Any, ...]) -> tuple[Any, Any]:
        def step(c: Any, i: Any, params: PyTree) -> tuple[Any, Any]:
            # Keep only the layer's input (cut over the model axes with partition_activations).
            return layer(params, c, float_consts), partition_saved(c, policy)

        out, inputs = _pipelined(plan, step, carry, diff, wholes, reverse=False)
        plain = [None if s else d for s, d in zip(sharded, diff, strict=True)]
        return out, (plain, wholes, inputs, float_consts)

    def backward(res: Any, g_out: Any) -> tuple[Any, ...]:
        plain, wholes, inputs, float_consts = res

        def step(state: tuple[Any, Any], i: Any, params: PyTree) -> tuple[Any, Any]:
            g, g_consts = state
            # The recompute waits for the layer's cotangent (as the per-block
            # primitive's does). Measured: untied, XLA packed the backward's buffers
            # worse, and prefetch=1 cost 0.42 whole layers of compiled peak over
            # prefetch=0 (reference model, depth 4 to 16) instead of 0.38.
            saved = coll.tie_keeping_types(jax.tree.map(lambda a: a[i], inputs), g)[0]
            carry_in = regather_saved(saved, policy)
            # Recompute layer i from its input (remat) to get its VJP.
            _, vjp = jax.vjp(layer, params, carry_in, float_consts)
            g_params, g_in, g_k = vjp(g)
            return (g_in, jax.tree.map(jnp.add, g_consts, g_k)), _reduce_layer(plan, g_params)

        zeros = jax.tree.map(jnp.zeros_like, float_consts)
        (g_carry, g_consts), g_reversed = _pipelined(plan, step, (g_out, zeros), plain, wholes, reverse=True)
        # The loop ran from the last layer to the first: put layer 0 first again.
        g_diff = [None if g is None else jnp.flip(g, axis=0) for g in g_reversed]
        return g_diff, [None] * len(wholes), g_carry, g_consts

    zero_jax_scan.defvjp(forward, backward)
    float_consts = tuple(c for c, f in zip(all_consts, is_float, strict=True) if f)
    return zero_jax_scan(diff, wholes, carry, float_consts)
