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

With ``keep_gathered=k`` (stage 3) the layers are split: the first depth − k
run as above, the last k by the same machinery in a loop of their own whose
forward pass also saves each layer's gathered parameters (stacked, per layer)
and whose backward pass uses them instead of gathering again: k layers of
memory for k all-gathers (:mod:`zero_jax._layerwise.keep`). Kept layers keep
their inputs on the device (their backward pass comes first).

With ``ZeroPolicy(partition_activations=True)`` (ZeRO-R's P_a) the kept input
of each layer is cut over the model axes, and with ``offload_activations``
(P_a+cpu) it waits in host memory for its recompute
(:mod:`zero_jax._layerwise.activations`).
What keeps the compiler to this schedule is :mod:`zero_jax._layerwise.schedule`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zero_jax._base.tree import PyTree, path_str
from zero_jax._base.units import is_whole_number
from zero_jax._comm import collectives as coll
from zero_jax._layerwise.activations import (
    checkpointed,
    offloads_activations,
    partition_saved,
    regather_saved,
    saved_to_device,
    saved_to_host,
)
from zero_jax._layerwise.keep import KEPT_SCOPE, gathered_bytes, kept_count
from zero_jax._layerwise.pieces import Sharded, check_parameter_pieces
from zero_jax._layerwise.schedule import Schedule, schedule_for, use_order
from zero_jax._layerwise.scope import active_policy
from zero_jax._layout.leaf import LeafLayout, is_float
from zero_jax._policy.memory import to_device
from zero_jax._policy.policy import ZeroPolicy


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


# -- the order a layer uses its parameters in, for the backward prefetch of both primitives --


UNSCANNED_BLOCKS = (
    "zj.scan_layers: stacked_params is a list of {count} blocks (0 … {last}), not stacked layers: its leaves have "
    "no common leading layer axis (their leading sizes are hidden sizes). Run a list of blocks with "
    "zj.apply_layers(layer_fn, blocks, carry, policy) (and leave it out of ZeroPolicy(stacked=...)), or stack "
    "them (jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)) for zj.scan_layers."
)


OFFLOAD_WITHOUT_REMAT = (
    "zj.scan_layers: offload_activations moves the layer inputs a remat keeps to host memory, but remat=False "
    "keeps every intermediate instead. Pass remat=True (the default), or drop offload_activations."
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
    offload_activations: bool | None = None,
    keep_gathered: int | str = 0,
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
        more whole layer of memory (``benchmarks/results/layerwise.txt``). 0
        gathers each layer only when it is needed. Lowered to ``depth - 2``
        where needed so each loop runs at least twice. On a backend whose
        compiler overlaps a gather only with its own consumers (the TPU
        compiler: see ``zero_jax._layerwise.schedule``) the layers are
        gathered in place whatever ``prefetch`` says.
      offload_activations: ZeRO-R's P_a+cpu (any stage): each layer's
        saved input goes to host memory (``pinned_host``) after the layer's
        forward pass and comes back just before its recompute; ``None``
        follows ``ZeroPolicy(offload_activations=...)``. Bitwise the same
        values.
      keep_gathered: stage 3: the last k layers keep their gathered
        parameters from the forward pass for the backward pass (k fewer
        all-gathers per step, k layers more memory), or a byte budget
        (``"2GiB"``): the most trailing layers whose gathered bytes fit it.
        0 gathers every layer again; stages 0-2: checked and ignored. Kept
        layers run in a loop of their own (no prefetch across the two loops)
        and keep their inputs on the device.

    Example (P_a+cpu; on XLA:CPU the moves are only annotations, the TPU
    compiler turns them into host transfers):

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh, stacked="layers", min_shard_size=0)
    >>> def loss_fn(params, batch):
    ...     layer = lambda p, x: jnp.tanh(x @ p["w"])
    ...     x = zj.scan_layers(layer, params["layers"], batch["x"], policy, offload_activations=True)
    ...     return jnp.mean(x ** 2)
    >>> params = {"layers": {"w": jnp.stack([jnp.eye(8)] * 3)}}
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    >>> state, metrics = step(zj.init_state(params, tx, policy), {"x": jnp.ones((jax.device_count(), 8))})
    >>> round(float(metrics["loss"]), 4)
    0.3207
    """
    given, policy = policy, active_policy(policy, "zj.scan_layers")
    # Checked against the policy given: where no pieces are handed (stage 1) the keyword is still wrong.
    offload = offloads_activations(given, offload_activations, "zj.scan_layers")
    depth = _depth(stacked_params)
    if not is_whole_number(prefetch) or not 0 <= prefetch <= depth:
        raise ValueError(
            f"zj.scan_layers: prefetch must be an int from 0 to the depth ({depth}), got {prefetch!r}. "
            "1 overlaps the next layer's gather with this layer's compute."
        )
    kept = kept_count(keep_gathered, [gathered_bytes(stacked_params, stacked=True)] * depth, "zj.scan_layers")
    leaves = jax.tree.leaves(stacked_params, is_leaf=_is_sharded)
    if policy is None or not policy.partitions_grads or not any(_is_sharded(x) for x in leaves):
        check_parameter_pieces(stacked_params, policy, "zj.scan_layers") if policy is not None else None
        if offload and not remat:
            raise ValueError(OFFLOAD_WITHOUT_REMAT)
        body = checkpointed(layer_fn, offload) if remat else layer_fn
        return jax.lax.scan(lambda c, layer: (body(layer, c), None), carry, stacked_params)[0]
    if not remat:
        raise ValueError(
            "zj.scan_layers: remat=False is only available in stages 0–1; stages 2–3 recompute each "
            "layer in the backward pass to gather it again and reduce-scatter its gradient."
        )
    check_parameter_pieces(stacked_params, policy, "zj.scan_layers")
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(stacked_params, is_leaf=_is_sharded)
    nodes = [
        Sharded(x.arrays, _layer_layout(x.layout, path_str(p)), x.policy, x.path, x.context) if _is_sharded(x) else x
        for p, x in paths_leaves
    ]
    # Stage 2 gathers nothing, so there is nothing to prefetch (and a queue
    # would only copy whole layers into the loop state). In stage 3 each loop
    # keeps at least two trips: XLA inlines a one-trip loop and then merges the
    # backward re-gathers into the forward gathers, keeping every layer alive.
    carried = policy.partitions_params and schedule_for(policy).prefetch_across_trips

    def ahead(trips: int) -> int:
        return min(prefetch, max(trips - 2, 0)) if carried else 0

    # Not carried across trips, a prefetch runs inside them: several layers a trip (the schedule's unroll_layers),
    # the next one's gathers issued as this one computes. Not with the saved inputs in host memory.
    unrolls = prefetch and policy.partitions_params and not carried and not offload
    first = depth - kept if policy.partitions_params else depth
    diff = differentiated(nodes)
    parts = zero_jax_split_layers(diff, first) if 0 < first < depth else (diff, diff)
    if first:
        per_trip = schedule_for(policy).layers_per_trip(first) if unrolls else 1
        carry = _zero_scan(layer_fn, treedef, nodes, parts[0], carry, policy, ahead(first), first, offload,  # pyright: ignore[reportIndexIssue] - parts is a pair of subtrees
                           per_trip=per_trip)  # fmt: skip
    if first < depth:
        carry = _zero_scan(layer_fn, treedef, nodes, parts[1], carry, policy, ahead(depth - first), depth - first,  # pyright: ignore[reportIndexIssue] - parts is a pair of subtrees
                           False, start=first, keep=True)  # fmt: skip
    return carry


def differentiated(nodes: list[Any]) -> list[Any]:
    """What the scan differentiates, per flattened stacked leaf: a partitioned
    leaf's gradient slot (``None`` when frozen), a plain leaf itself."""
    return [(x.arrays[1] if len(x.arrays) > 1 else None) if _is_sharded(x) else x for x in nodes]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def zero_jax_split_layers(diff: list[Any], first: int) -> tuple[list[Any], list[Any]]:
    """``diff`` cut into layers ``:first`` and ``first:`` (named ``zero_jax_*``:
    the library's own use of the slots, ``pieces.OWN_SCOPES``). The two parts'
    gradients are joined by a concatenation: with autodiff's transpose of a
    slice (a pad and an add) XLA:CPU fused the optimizer update differently and
    training was no longer bitwise that of ``keep_gathered=0``."""
    return [None if d is None else d[:first] for d in diff], [None if d is None else d[first:] for d in diff]


def _split_fwd(diff: list[Any], first: int) -> tuple[tuple[list[Any], list[Any]], None]:
    return zero_jax_split_layers(diff, first), None


def _split_bwd(first: int, _: None, cts: tuple[list[Any], list[Any]]) -> tuple[list[Any]]:
    del first
    return ([None if a is None else jnp.concatenate([a, b]) for a, b in zip(*cts, strict=True)],)


zero_jax_split_layers.defvjp(_split_fwd, _split_bwd)


class _ScanPlan(NamedTuple):
    """The stage 2–3 layer scan, per flattened stacked leaf."""

    treedef: Any
    sharded: list[bool]  # a Sharded node (partitioned) or a plain (whole-kept) stacked leaf
    layouts: list[LeafLayout | None]  # one layer's layout of each Sharded leaf
    gathers: list[bool]  # stage-3 pieces: all-gathered for use
    slot_dtypes: list[Any]  # the gradient slot's dtype (the reduce dtype); None: frozen or plain
    axis: Any
    prefetch: int
    depth: int  # the layers this loop runs: start … start + depth - 1 of the stacked ones
    schedule: Schedule
    order: tuple[list[int], list[int]] | None = None  # use_order of the layer, for the backward prefetch
    per_trip: int = 1  # layers one loop trip runs (the schedule's unroll_layers; no carried prefetch then)
    together: tuple[tuple[int, ...], ...] = ()  # leaves gathered and reduced as one (the schedule's together)
    start: int = 0
    # hpZ (secondary_axis): "make" -- the forward gathers across nodes and hands on the secondary pieces;
    # "use" -- the backward gathers from them, within the node. "": no hpZ.
    secondary: str = ""


class _Fetched(NamedTuple):
    """One layer's whole parameters, and (hpZ's forward) its secondary pieces."""

    params: PyTree
    secondary: list[Any]


def _fetch(
    plan: _ScanPlan, i: jax.Array, diff: list[Any], wholes: list[Any], anchor: Any = None, anchors: Any = None
) -> _Fetched:
    """Layer i's whole parameters (all-gathers for stage-3 pieces; one layer in
    from the host), each piece due after ``anchor`` when given (the
    schedule's ``tie_gathers``), or after its own entry of ``anchors``."""
    anchors = anchors or [anchor] * len(diff)
    out, secondary, pieces = [], [], [None] * len(diff)  # pieces: the stage-3 ones gathered below
    for k, (s, d, w, lay, g, a) in enumerate(zip(plan.sharded, diff, wholes, plan.layouts, plan.gathers, anchors,
                                                 strict=True)):  # fmt: skip
        if not s:
            out.append(d[i])
            continue
        if plan.secondary == "use":  # hpZ's secondary pieces (int8 blocks with qwZ): this loop's, made on device
            source = plan.schedule.due(jax.tree.map(lambda x: x[i], w), a)
        else:  # the whole stack (indexed, never sliced: it may live in host memory); diff is this loop's
            source = plan.schedule.due(to_device(w[plan.start + i]), a)
        if g and plan.secondary:
            piece = coll.secondary_piece(source, lay, plan.axis) if plan.secondary == "make" else source
            secondary.append(piece)
            out.append(coll.gather_secondary(piece, lay, plan.axis))
        else:
            pieces[k] = source if g else None
            out.append(None if g else coll.fetch(source, lay, plan.axis, gather=False))
    gathered = coll.gather_leaves(pieces, plan.layouts, plan.axis, plan.together)  # pyright: ignore[reportArgumentType] - a gathered layer's layouts are all set
    out = [o if p is None else w for o, p, w in zip(out, pieces, gathered, strict=True)]
    return _Fetched(jax.tree_util.tree_unflatten(plan.treedef, out), secondary)


def _reduce_layer(plan: _ScanPlan, g_layer: PyTree) -> list[Any]:
    """Layer i's parameter gradient: reduce-scattered (in the slot's dtype)
    for partitioned leaves; none for frozen ones."""
    gs = jax.tree_util.tree_flatten(g_layer)[0]
    cast = [g.astype(dt) if s and dt is not None else None for s, dt, g in zip(plan.sharded, plan.slot_dtypes, gs,
                                                                                strict=True)]  # fmt: skip
    how = plan.schedule.grad_reduction
    reduced = coll.reduce_scatter_leaves(cast, plan.layouts, plan.axis, plan.together, how)  # pyright: ignore[reportArgumentType] - a gathered layer's layouts are all set
    return [r if s else g for s, r, g in zip(plan.sharded, reduced, gs, strict=True)]


def _pipelined(
    plan: _ScanPlan, step: Callable[..., Any], state: Any, diff: list[Any], wholes: list[Any], reverse: bool,
    host_ys: bool = False,
) -> Any:  # fmt: skip
    """Run ``step(state, i, layer_i_params)`` for every layer, in order or in
    reverse, with the gathers of the next ``prefetch`` layers in flight
    (``host_ys``: the float leaves of the first of ``step``'s outputs, the
    saved inputs, live in host memory)."""
    depth, prefetch = plan.depth, plan.prefetch

    def index(t: Any) -> Any:
        return depth - 1 - t if reverse else t

    def fetch(t: Any, anchor: Any = None, anchors: Any = None) -> PyTree:
        return _fetch(plan, index(t), diff, wholes, anchor, anchors)

    if plan.per_trip > 1:
        return _unrolled(step, state, index, fetch, depth, plan.per_trip)
    if prefetch == 0:
        # A one-trip loop is inlined: its gather is tied to the pass's input (the forward's carry, the backward's
        # cotangent), else XLA merges the backward re-gather into the forward gather (the schedule's tie_gathers).
        return jax.lax.scan(lambda s, t: step(s, index(t), fetch(t, s if depth == 1 else None)), state,
                            jnp.arange(depth))  # fmt: skip
    # The queue's first gathers wait for the loop's input (in the backward
    # pass, the cotangent): else the backward's first re-gather may be issued
    # during the forward pass (the schedule's tie_gathers).
    queue = tuple(fetch(t, state) for t in range(prefetch))
    # The outputs go into one buffer for every layer, updated in place: the
    # loop's own stacked outputs with the last layers' concatenated to them
    # are one more copy of all of them.
    ys = _ys_buffer(step, state, queue[0], index, depth)
    ys = (saved_to_host(ys[0], True), *ys[1:]) if host_ys else ys

    def body(carry: Any, t: jax.Array) -> Any:
        s, q, buf = carry
        if reverse and plan.order is not None:  # the backward pass: leaf by leaf (paired_anchors)
            s_in, (s, y) = s, step(s, index(t), q[0])
            grads = [None if dt is None else g for dt, g in zip(plan.slot_dtypes, y, strict=True)]
            sizes = [lay.nbytes if g else 0 for g, lay in zip(plan.gathers, plan.layouts, strict=True)]  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
            anchors = plan.schedule.prefetch_anchors(plan.order[0], sizes, plan.order[1], grads, sizes, plan.layouts,
                                                     s_in, s, plan.together, looped=True)  # fmt: skip
            ahead = fetch(t + prefetch, s, anchors)
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


def _unrolled(step: Callable[..., Any], state: Any, index: Callable[[Any], Any], fetch: Callable[..., PyTree],
              depth: int, per_trip: int) -> Any:  # fmt: skip
    """The loop of :func:`_pipelined` without a carried prefetch, ``per_trip``
    layers a trip (the schedule's ``unroll_layers``). Each layer's gathers wait
    for the input of the layer before it in the trip (``tie_gathers``):
    issued while that layer computes, as a prefetch of one, never at the
    trip's start for every layer of it. The first layer's gathers wait only
    for the trip."""

    def trip(s: Any, t: jax.Array) -> Any:
        ys, before = [], None
        for j in range(per_trip):
            i, s_in = t * per_trip + j, s
            s, y = step(s, index(i), fetch(i, before))
            before = s_in
            ys.append(y)
        return s, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    state, ys = jax.lax.scan(trip, state, jnp.arange(depth // per_trip))
    return state, jax.tree.map(lambda a: a.reshape(depth, *a.shape[2:]), ys)


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
    treedef: Any,
    nodes: list[Any],
    diff: list[Any],
    axis: Any,
    prefetch: int,
    depth: int,
    schedule: Schedule,
    start: int = 0,
) -> tuple[_ScanPlan, list[Any], list[Any]]:
    """The plan of the stage 2–3 scan of layers ``start`` … ``start + depth -
    1`` and its two lists of stacked arrays: what is differentiated (the
    gradient slots of partitioned leaves, the whole-kept plain leaves; ``None``
    for frozen ones), cut to those layers, and the sources (stage-3 pieces,
    stage-2 whole parameters; the whole stack), which only feed the forward pass
    (``diff``: :func:`differentiated`, cut to those layers)."""
    sharded = [_is_sharded(x) for x in nodes]
    wholes = [x.arrays[0] if s else None for x, s in zip(nodes, sharded, strict=True)]
    layouts = [x.layout if s else None for x, s in zip(nodes, sharded, strict=True)]
    plan = _ScanPlan(
        treedef=treedef,
        sharded=sharded,
        layouts=layouts,
        together=schedule.together(layouts, axis),
        gathers=[s and x.gathers for x, s in zip(nodes, sharded, strict=True)],
        # Slots are zeros: only their dtype (the reduce dtype) matters, so they are
        # not kept for the backward pass (that would hold a gradient-sized buffer).
        slot_dtypes=[d.dtype if s and d is not None else None for s, d in zip(sharded, diff, strict=True)],
        axis=axis,
        prefetch=int(prefetch),
        depth=depth,
        schedule=schedule,
        secondary="make" if axis.secondary else "",
        start=start,
    )
    return plan, diff, wholes


def _kept_layer(plan: _ScanPlan, kept: list[Any], plain: list[Any], i: Any) -> PyTree:
    """Layer i's whole parameters from the forward pass's saved ones (``keep_gathered``) and the plain leaves."""
    out = [k[i] if s else p[i] for s, k, p in zip(plan.sharded, kept, plain, strict=True)]
    return jax.tree_util.tree_unflatten(plan.treedef, out)


def _zero_scan(
    layer_fn: Callable[[PyTree, Any], Any],
    treedef: Any,
    nodes: list[Any],
    diff: list[Any],
    carry: Any,
    policy: ZeroPolicy,
    prefetch: int,
    depth: int,
    offload: bool = False,
    *,
    start: int = 0,
    keep: bool = False,
    per_trip: int = 1,
) -> Any:
    """The stage 2–3 schedule (see the module docstring) of layers ``start``
    … ``start + depth - 1``; ``keep``: their gathered parameters are saved
    for the backward pass, which gathers nothing; ``per_trip`` layers a loop
    trip."""
    schedule = schedule_for(policy)
    axes = schedule.collective_axes(policy.comm)
    plan, diff, wholes = _scan_plan(treedef, nodes, diff, axes, prefetch, depth, schedule, start)
    plan = plan._replace(per_trip=per_trip)
    sharded = plan.sharded
    with jax.named_scope("zero_jax_scan_example"):  # layer 0, only to trace layer_fn (dead code)
        example = _fetch(plan, jnp.asarray(0), diff, wholes).params
    fn, all_consts = jax.closure_convert(layer_fn, example, carry)
    if prefetch and policy.partitions_params:
        plan = plan._replace(order=use_order(fn, example, (carry,), all_consts))
    # Values layer_fn closes over: float ones get gradients, the rest are fixed.
    float_flags = [is_float(c) for c in all_consts]
    fixed = [c for c, f in zip(all_consts, float_flags, strict=True) if not f]

    def layer(params: PyTree, c: Any, float_consts: tuple[Any, ...]) -> Any:
        floats, others = iter(float_consts), iter(fixed)
        return fn(params, c, *[next(floats) if f else next(others) for f in float_flags])

    @jax.custom_vjp
    def zero_jax_scan(diff: list[Any], wholes: list[Any], carry: Any, float_consts: tuple[Any, ...]) -> Any:
        return forward(diff, wholes, carry, float_consts)[0]

    def forward(diff: list[Any], wholes: list[Any], carry: Any, float_consts: tuple[Any, ...]) -> tuple[Any, Any]:
        def step(c: Any, i: Any, fetched: _Fetched) -> tuple[Any, Any]:
            # Keep only the layer's input (cut over the model axes with partition_activations,
            # in host memory with offload_activations), with keep its gathered parameters, and with hpZ
            # (unless kept) its secondary pieces.
            saved = saved_to_host(partition_saved(c, policy), offload)
            leaves = plan.treedef.flatten_up_to(fetched.params)
            gathered = [w if s else None for s, w in zip(sharded, leaves, strict=True)] if keep else []
            return layer(fetched.params, c, float_consts), (saved, gathered, [] if keep else fetched.secondary)

        with jax.named_scope(KEPT_SCOPE) if keep else contextlib.nullcontext():  # the audit reads kept layers off it
            out, (inputs, kept, secondary) = _pipelined(plan, step, carry, diff, wholes, reverse=False,
                                                        host_ys=offload)  # fmt: skip
        plain = [None if s else d for s, d in zip(sharded, diff, strict=True)]
        if plan.secondary and not keep:  # the backward re-gathers from the secondary pieces
            pieces = iter(secondary)
            wholes = [next(pieces) if g else w for g, w in zip(plan.gathers, wholes, strict=True)]
        return out, (plain, wholes, inputs, float_consts, kept)

    def backward(res: Any, g_out: Any) -> tuple[Any, ...]:
        plain, wholes, inputs, float_consts, kept = res

        def step(state: tuple[Any, Any], i: Any, fetched: _Fetched) -> tuple[Any, Any]:
            g, g_consts = state
            params = fetched.params
            # The recompute waits for the layer's cotangent (the schedule's tie_recompute).
            brought = saved_to_device(jax.tree.map(lambda a: a[i], inputs), offload)
            saved = plan.schedule.recompute_after(brought, g)[0]
            carry_in = regather_saved(saved, policy)
            # Recompute layer i from its input (remat) to get its VJP.
            _, vjp = jax.vjp(layer, params, carry_in, float_consts)
            g_params, g_in, g_k = vjp(g)
            return (g_in, jax.tree.map(jnp.add, g_consts, g_k)), _reduce_layer(plan, g_params)

        zeros = jax.tree.map(jnp.zeros_like, float_consts)
        if keep:  # the saved layers, last first: nothing to gather
            def run(s: Any, t: Any) -> Any:
                return step(s, depth - 1 - t, _Fetched(_kept_layer(plan, kept, plain, depth - 1 - t), []))

            (g_carry, g_consts), g_reversed = jax.lax.scan(run, (g_out, zeros), jnp.arange(depth))
        else:
            back = plan._replace(secondary="use") if plan.secondary else plan
            (g_carry, g_consts), g_reversed = _pipelined(back, step, (g_out, zeros), plain, wholes, reverse=True)
        # The loop ran from the last layer to the first: put layer 0 first again.
        g_diff = [None if g is None else jnp.flip(g, axis=0) for g in g_reversed]
        return g_diff, [None] * len(wholes), g_carry, g_consts

    zero_jax_scan.defvjp(forward, backward)
    float_consts = tuple(c for c, f in zip(all_consts, float_flags, strict=True) if f)
    return zero_jax_scan(diff, wholes, carry, float_consts)
