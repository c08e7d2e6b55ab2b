"""Layer-wise ZeRO: ``gather`` one layer's parameters just before use and drop
them after; ``scan_layers`` runs stacked layers that way.

Inside a step built with ``make_train_step(..., gather="manual")`` the loss
function receives each partitioned parameter as a :class:`Sharded` node, not
an array: in stage 3 it holds this device's piece, in stage 2 the whole
parameter plus a slot that receives its reduce-scattered gradient. ``gather``
turns such nodes into ordinary arrays; in stages 0–1 the parameters are
ordinary arrays already and ``gather`` is the identity, so one model runs
under every stage.

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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zero_jax import _collectives as coll
from zero_jax._memory import to_device
from zero_jax._partition import LeafLayout
from zero_jax._policy import ZeroPolicy
from zero_jax._tree import PyTree, path_str


@dataclasses.dataclass(frozen=True)
class TraceScope:
    """What the loss function being traced runs under: the house's one piece
    of trace-time context (one ``ContextVar``, so nested and concurrent
    traces in other threads each see their own).

    Attributes:
      policy: the manual-gather step's policy; None outside such a step.
      pieces: False when the step hands ``loss_fn`` whole parameters even in
        stages 2–3 (local accumulation gathers once per step), so ``gather``
        and ``scan_layers`` pass them through.
      state_updates: the NNX adapter's mode for model-state updates.
      adapter_scans: a one-element counter of the adapters' ``scan_layers``
        calls in this trace (None outside an adapted loss).
    """

    policy: ZeroPolicy | None = None
    pieces: bool = True
    state_updates: str | None = None
    adapter_scans: list[int] | None = None


_EMPTY_SCOPE = TraceScope()
_SCOPE: contextvars.ContextVar[TraceScope | None] = contextvars.ContextVar("zero_jax_trace_scope", default=None)


def current_scope() -> TraceScope:
    """The :class:`TraceScope` of the trace in progress (empty outside one)."""
    return _SCOPE.get() or _EMPTY_SCOPE


@contextlib.contextmanager
def trace_scope(**changes: Any) -> Iterator[TraceScope]:
    """Run a block with the current :class:`TraceScope`'s fields replaced."""
    scope = dataclasses.replace(current_scope(), **changes)
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


@contextlib.contextmanager
def manual_gather_scope(policy: ZeroPolicy, *, pieces: bool = True) -> Iterator[None]:
    """Marks the tracing of a manual-gather loss function (set by the step).

    ``pieces=False``: the step hands ``loss_fn`` whole parameters even in
    stages 2–3 (local gradient accumulation gathers once per step), so
    ``gather`` and ``scan_layers`` pass them through.
    """
    with trace_scope(policy=policy, pieces=pieces):
        yield


@jax.tree_util.register_pytree_node_class
class Sharded:
    """A partitioned parameter as a ``gather="manual"`` loss function sees it.

    ``arrays[0]`` is the source: this device's (padded) piece in stage 3, the
    whole parameter in stage 2. ``arrays[1]``, absent for frozen parameters,
    is a zero piece (in the reduce dtype) whose gradient is the parameter's
    reduce-scattered gradient. Use ``zj.gather(node, policy)`` to get the
    parameter. ``policy`` is the step's policy (static).
    """

    def __init__(self, arrays: tuple[jax.Array, ...], layout: LeafLayout, policy: ZeroPolicy) -> None:
        self.arrays = tuple(arrays)
        self.layout = layout
        self.policy = policy

    def tree_flatten(self) -> tuple[tuple[jax.Array, ...], tuple[LeafLayout, ZeroPolicy]]:
        return self.arrays, (self.layout, self.policy)

    @classmethod
    def tree_unflatten(cls, aux: tuple[LeafLayout, ZeroPolicy], arrays: Any) -> Sharded:
        return cls(tuple(arrays), *aux)

    @property
    def stage(self) -> int:
        """The ZeRO stage of the step that made this piece."""
        return self.policy.stage

    @property
    def gathers(self) -> bool:
        """Whether using it all-gathers (a stage-3 piece) or not (stage 2:
        the whole parameter with a gradient slot)."""
        return self.policy.partitions_params

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's logical shape (what ``gather`` returns)."""
        return self.layout.shape

    @property
    def dtype(self) -> Any:
        return self.layout.dtype

    def __jax_array__(self) -> jax.Array:
        raise TypeError(
            f"a partitioned parameter of shape {self.layout.shape} was used as an array: inside "
            "make_train_step(..., gather='manual') run blocks with zj.apply_layers(block_fn, blocks, x, policy) "
            "(or zj.scan_layers for stacked ones) and call zj.gather(params_subtree, policy) for the rest, to get "
            "whole parameters just before use."
        )

    def __repr__(self) -> str:
        return f"Sharded(shape={self.layout.shape}, stage={self.stage})"

    def _not_an_array(self, *args: Any, **kwargs: Any) -> Any:
        return self.__jax_array__()

    # Arithmetic, indexing and array methods on a piece are always a mistake:
    # say what to do instead of Python's "unsupported operand".
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _not_an_array
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __pow__ = _not_an_array
    __neg__ = __getitem__ = __array__ = astype = reshape = _not_an_array

    def fetch(self, axis: Any) -> jax.Array:
        """The whole, unpadded parameter (all-gather in stage 3)."""
        source = to_device(self.arrays[0])  # offload_params: the host piece comes in just before use
        if len(self.arrays) == 1:  # frozen: forward only
            return coll.fetch(source, self.layout, axis, gather=self.gathers)
        slot = self.arrays[1]
        return coll.fetch_with_grad_slot(source, slot, self.layout, axis, gather=self.gathers)


def _is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def active_policy(policy: ZeroPolicy | None, where: str) -> ZeroPolicy | None:
    """The policy whose pieces to gather, or None when there is nothing to gather."""
    if policy is None:
        return None
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(f"{where}: policy must be a ZeroPolicy or None, got {type(policy).__name__}.")
    scope = current_scope()
    if scope.policy is None:
        raise RuntimeError(
            f"{where} was called outside a train step. It gathers parameter pieces inside "
            "make_train_step(loss_fn, tx, policy, gather='manual'); to run the model on ordinary "
            f"parameters (evaluation, zj.full_params(state)), pass policy=None to {where}."
        )
    if scope.policy != policy:
        raise ValueError(f"{where}: called with {policy!r}, but the step runs {scope.policy!r}.")
    return policy if scope.pieces else None


NOT_A_PIECE = (
    "{where}: {leaves} of the policy's parameters. Pass the parameters loss_fn received (or a "
    "subtree of them), not arrays computed from them."
)
OTHER_POLICY = (
    "{where}: {leaves} pieces of another policy than the step's ({policy!r}). Pass the parameters this step's "
    "loss_fn received."
)


def check_parameter_pieces(tree: PyTree, policy: ZeroPolicy, where: str) -> None:
    """Every leaf the policy would partition must be one of the step's
    pieces; all that are not are named in one error."""
    if not policy.partitions_grads:
        return
    foreign, computed = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_sharded)[0]:
        if _is_sharded(leaf):
            if leaf.policy != policy:
                foreign.append(f"'{path_str(path)}'")
        elif policy.leaf_layout(leaf, stacked=False).partitioned:
            computed.append(f"'{path_str(path)}' (shape {tuple(getattr(leaf, 'shape', ()))})")
    if foreign:
        leaves = f"leaf {foreign[0]} is" if len(foreign) == 1 else f"leaves {', '.join(foreign)} are"
        raise ValueError(OTHER_POLICY.format(where=where, leaves=leaves, policy=policy))
    if computed:
        one = len(computed) == 1
        leaves = f"leaf {computed[0]} is not a piece" if one else f"leaves {', '.join(computed)} are not pieces"
        raise ValueError(NOT_A_PIECE.format(where=where, leaves=leaves))


def gather(tree: PyTree, policy: ZeroPolicy | None) -> PyTree:
    """Whole parameters for use, from the pieces a manual-gather step hands
    ``loss_fn``. In the backward pass each gradient is reduce-scattered (the
    transpose of the all-gather). Stages 0–1: the identity. ``policy=None``:
    the identity anywhere (to run the same model on ordinary parameters).

    For the blocks of a model use ``zj.apply_layers`` (or ``zj.scan_layers``)
    instead: XLA moves standalone gathers to the start of the program, so a
    Python loop of ``gather`` calls holds every block whole for the whole step
    (``zj.audit(...).check()`` flags that); the block primitives tie each
    gather to the block's input.

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh, min_shard_size=0)
    >>> def loss_fn(params, batch):
    ...     w = zj.gather(params["w"], policy)  # whole only for this use
    ...     return jnp.mean((batch["x"] @ w) ** 2)
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> state = zj.init_state({"w": jnp.ones((4, 8))}, tx, policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    >>> state, metrics = step(state, {"x": jnp.ones((jax.device_count(), 4))})
    >>> float(metrics["loss"])
    16.0
    """
    policy = active_policy(policy, "zj.gather")
    if policy is None:
        return tree
    check_parameter_pieces(tree, policy, "zj.gather")
    return jax.tree.map(lambda x: x.fetch(policy.comm) if _is_sharded(x) else x, tree, is_leaf=_is_sharded)


def _layer_layout(lay: LeafLayout, path: str) -> LeafLayout:
    if lay.dim == 0:
        raise ValueError(
            f"zj.scan_layers: parameter '{path}' is partitioned along its leading (layer) axis. "
            "Declare its subtree stacked so that axis is never cut: "
            "ZeroPolicy(..., stacked=('<prefix of the stacked subtree>',))."
        )
    return dataclasses.replace(lay, shape=lay.shape[1:], dim=None if lay.dim is None else lay.dim - 1)


def _depth(stacked: PyTree) -> int:
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(stacked, is_leaf=_is_sharded)[0]:
        shape = leaf.shape if not _is_sharded(leaf) else leaf.arrays[0].shape
        sizes[path_str(path)] = shape[0] if shape else None
    depths = set(sizes.values())
    if not sizes:
        raise ValueError("zj.scan_layers: stacked_params has no leaves.")
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
        it can overlap the current layer's compute; each costs about one more
        whole layer of memory (1.4 layers measured on the reference model at
        depth 12). 0 gathers each layer only when it is needed. Lowered to
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
    return _zero_scan(layer_fn, treedef, nodes, carry, policy.comm, ahead, depth)


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


def _fetch(plan: _ScanPlan, i: jax.Array, diff: list[Any], wholes: list[Any], anchor: Any = None) -> PyTree:
    """Layer i's whole parameters (all-gathers for stage-3 pieces; one layer in
    from the host), each piece tied to ``anchor`` when given (``coll.tie``)."""
    out = [
        coll.fetch(coll.tie(to_device(w[i]), anchor), lay, plan.axis, gather=g) if s else d[i]
        for s, d, w, lay, g in zip(plan.sharded, diff, wholes, plan.layouts, plan.gathers, strict=True)
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

    def fetch(t: Any, anchor: Any = None) -> PyTree:
        return _fetch(plan, index(t), diff, wholes, anchor)

    if prefetch == 0:
        return jax.lax.scan(lambda s, t: step(s, index(t), fetch(t)), state, jnp.arange(depth))
    # The queue's first gathers wait for the loop's input (in the backward
    # pass, the cotangent): untied, XLA issues the backward's first re-gather
    # during the forward pass, one more whole layer alive there.
    queue = tuple(fetch(t, state) for t in range(prefetch))

    def body(carry: Any, t: jax.Array) -> Any:
        s, q = carry
        ahead = fetch(t + prefetch)  # issued before this layer's compute
        s, y = step(s, index(t), q[0])
        return (s, (*q[1:], ahead)), y

    # The last `prefetch` layers are already in the queue: run them without
    # fetching (a clipped index would gather the last layer again).
    (state, queue), ys = jax.lax.scan(body, (state, queue), jnp.arange(depth - prefetch))
    tail = []
    for j in range(prefetch):
        state, y = step(state, index(depth - prefetch + j), queue[j])
        tail.append(y)
    ys = jax.tree.map(lambda main, *rest: jnp.concatenate([main, jnp.stack(rest)]), ys, *tail)
    return state, ys


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
    axis: Any,
    prefetch: int,
    depth: int,
) -> Any:
    """The stage 2–3 schedule (see the module docstring)."""
    plan, diff, wholes = _scan_plan(treedef, nodes, axis, prefetch, depth)
    sharded = plan.sharded
    with jax.named_scope("zero_jax_scan_example"):  # layer 0, only to trace layer_fn (dead code)
        example = _fetch(plan, jnp.asarray(0), diff, wholes)
    fn, all_consts = jax.closure_convert(layer_fn, example, carry)
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
            return layer(params, c, float_consts), c  # keep only the layer's input

        out, inputs = _pipelined(plan, step, carry, diff, wholes, reverse=False)
        plain = [None if s else d for s, d in zip(sharded, diff, strict=True)]
        return out, (plain, wholes, inputs, float_consts)

    def backward(res: Any, g_out: Any) -> tuple[Any, ...]:
        plain, wholes, inputs, float_consts = res

        def step(state: tuple[Any, Any], i: Any, params: PyTree) -> tuple[Any, Any]:
            g, g_consts = state
            carry_in = jax.tree.map(lambda a: a[i], inputs)
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
