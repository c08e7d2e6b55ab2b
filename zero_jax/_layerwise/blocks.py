"""Layer-wise ZeRO for models written as a Python loop over blocks:
``apply_layer`` runs one block, ``apply_layers`` a list of them, and
:class:`LayerChain` is what both (and the adapters) use.

``scan_layers`` needs the layers stacked; most models are not. Here each
call of a block is one ``jax.custom_vjp`` whose schedule is ours:

* forward: the block's pieces are all-gathered just before use (with
  ``prefetch=k``, block i + k's gather is issued when block i starts), the
  block runs, and only its inputs are kept (cut over the model axes with
  ``partition_activations``, in host memory with ``offload_activations``);
* backward: the block is gathered *again* (ZeRO-3's 3Ψ), recomputed for its
  vector-Jacobian product, and its gradient reduce-scattered at once. With
  prefetch, block i's backward issues the re-gather of block i − 1 and hands
  it over as the cotangent of a "token" output of block i − 1's call (the
  only channel from one custom VJP's backward to another's).

With ``keep_gathered=k`` the last k blocks of the chain keep their gathered
parameters from the forward pass as residuals of their custom VJP, and their
backward pass uses them: no re-gather, neither in place nor handed over by the
next block's backward (:mod:`zero_jax._layerwise.keep`).

An unrolled program gives the compiler more freedom than a loop: what keeps
it to this schedule (gathers due only when their block is, recomputes and the
backward pass in order, the backward prefetch leaf by leaf) is
:mod:`zero_jax._layerwise.schedule`.

Stages 0–1 (and ``policy=None``): a plain ``jax.checkpoint``-ed call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import get_opaque_trace_state

from zero_jax._base.tree import PyTree
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
from zero_jax._layerwise.schedule import inputs_anchor, schedule_for, use_order
from zero_jax._layerwise.scope import active_policy
from zero_jax._layout.leaf import LeafLayout, is_float
from zero_jax._policy.memory import to_device
from zero_jax._policy.policy import ZeroPolicy


def _is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def batched_by_vmap(x: Any) -> bool:
    """Whether ``x`` is batched by an enclosing ``jax.vmap`` (a probe whose vmap rule records it)."""
    seen = []

    @jax.custom_batching.custom_vmap
    def probe(a: Any) -> Any:
        return a

    @probe.def_vmap
    def rule(axis_size: int, in_batched: list[bool], a: Any) -> tuple[Any, bool]:
        seen.append(in_batched[0])
        return a, in_batched[0]

    probe(jax.lax.stop_gradient(x))
    return bool(seen and seen[0])


UNDER_VMAP = (
    "{where}: block {index} was called inside jax.vmap (its inputs are batched). The per-block gathers and "
    "reduce-scatters must see the whole per-device batch, not one example: call the block primitive outside the "
    "vmap and vmap inside the block instead, e.g. zj.apply_layers(jax.vmap(block, in_axes=(None, 0)), blocks, "
    "x, policy). (zj.adapters.from_equinox(..., layers=...) does this for jax.vmap(model) itself.)"
)


@dataclasses.dataclass(frozen=True)
class _Block:
    """One block's parameters, flattened: what is partitioned (``Sharded``
    nodes) and what is an ordinary array."""

    index: int  # its place in the chain (names its gathers in the compiled program: "zj_block<i>_gather")
    treedef: Any
    sharded: tuple[bool, ...]
    sources: tuple[Any, ...]  # a Sharded leaf's piece (stage 3) or whole parameter (stage 2); else None
    slots: tuple[Any, ...]  # a Sharded leaf's gradient slot; None when frozen or not Sharded
    plain: tuple[Any, ...]  # a leaf that is not Sharded, as given; None for Sharded leaves
    layouts: tuple[LeafLayout | None, ...]

    @classmethod
    def of(cls, index: int, params: PyTree) -> _Block:
        leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=_is_sharded)
        sharded = tuple(_is_sharded(x) for x in leaves)
        return cls(
            index=index,
            treedef=treedef,
            sharded=sharded,
            sources=tuple(x.arrays[0] if s else None for x, s in zip(leaves, sharded, strict=True)),
            slots=tuple(x.arrays[1] if s and len(x.arrays) > 1 else None for x, s in zip(leaves, sharded, strict=True)),
            plain=tuple(None if s else x for x, s in zip(leaves, sharded, strict=True)),
            layouts=tuple(x.layout if s else None for x, s in zip(leaves, sharded, strict=True)),
        )

    def wholes(
        self, sources: Sequence[Any], policy: ZeroPolicy, anchor: Any, anchors: Sequence[Any] = (), kept: bool = False
    ) -> list[Any]:
        """The whole parameters of the Sharded leaves (all-gathered in stage 3,
        each piece due after ``anchor``, or its entry of ``anchors``; named
        kept with ``kept``); else None. ``sources`` are what the backward
        re-gathers from (:meth:`first_gather`)."""
        return self._gathered(sources, policy, anchor, anchors, again=True, kept=kept)[0]

    def first_gather(
        self, sources: Sequence[Any], policy: ZeroPolicy, anchor: Any, anchors: Sequence[Any] = (), kept: bool = False
    ) -> tuple[list[Any], list[Any]]:
        """The forward pass's gather: the whole parameters, and what the
        backward pass re-gathers them from: the pieces themselves, or with
        hpZ (``secondary_axis``) the secondary pieces this gather made on
        its way (then the re-gather stays within the node)."""
        return self._gathered(sources, policy, anchor, anchors, again=False, kept=kept)

    def _gathered(
        self, sources: Sequence[Any], policy: ZeroPolicy, anchor: Any, anchors: Sequence[Any], *, again: bool,
        kept: bool,
    ) -> tuple[list[Any], list[Any]]:  # fmt: skip
        gather, schedule, axis = policy.partitions_params, schedule_for(policy), policy.comm
        anchors = list(anchors) or [anchor] * len(sources)
        wholes, regather_from, pieces = [], [], [None] * len(sources)  # pieces: the stage-3 ones gathered below
        scope = f"zj_block{self.index}_gather" + (f"/{KEPT_SCOPE}" if kept else "")
        with jax.named_scope(scope):
            for k, (src, lay, a) in enumerate(zip(sources, self.layouts, anchors, strict=True)):
                if src is None or not gather:
                    wholes.append(None if src is None else coll.fetch(src, lay, axis, gather=False))  # pyright: ignore[reportArgumentType] - a gathered block's layouts are all set
                    regather_from.append(src)
                    continue
                # A secondary piece (hpZ's re-gather) is made in the step, on the device.
                ready = schedule.due(src if again and axis.secondary else to_device(src), a)
                if axis.secondary:  # hpZ
                    piece = ready if again else coll.secondary_piece(ready, lay, axis)  # pyright: ignore[reportArgumentType] - a gathered block's layouts are all set
                    wholes.append(coll.gather_secondary(piece, lay, axis))  # pyright: ignore[reportArgumentType] - a gathered block's layouts are all set
                    regather_from.append(piece)
                else:  # the backward starts again from the piece as stored (in host memory with offload_params)
                    pieces[k] = ready
                    wholes.append(None)
                    regather_from.append(src)
            gathered = coll.gather_leaves(pieces, list(self.layouts), axis, self.together(policy))  # pyright: ignore[reportArgumentType] - a gathered block's layouts are all set
        return [w if p is None else g for w, p, g in zip(wholes, pieces, gathered, strict=True)], regather_from

    def together(self, policy: ZeroPolicy) -> tuple[tuple[int, ...], ...]:
        """The leaves of this block that move in one collective (the schedule's ``together_bytes``)."""
        return schedule_for(policy).together(self.layouts, policy.comm)

    def tree(self, wholes: Sequence[Any], plain: Sequence[Any]) -> PyTree:
        leaves = [w if s else p for s, w, p in zip(self.sharded, wholes, plain, strict=True)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _split(values: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Float values (differentiated) and the rest (fixed), each in order."""
    return [v for v in values if is_float(v)], [v for v in values if not is_float(v)]


def _merge(is_float: Sequence[bool], floats: Sequence[Any], fixed: Sequence[Any]) -> list[Any]:
    f, o = iter(floats), iter(fixed)
    return [next(f) if flag else next(o) for flag in is_float]


def _instantiate(ct: Any, axis: Any) -> Any:
    """A cotangent as an array: zeros for a symbolic zero, varying over the
    axes its output varies over (an output the same on every device, such as
    a constant a block hands on, takes unvarying zeros)."""
    if not isinstance(ct, SymbolicZero):
        return ct
    if ct.aval.dtype == jax.dtypes.float0:  # pyright: ignore[reportAttributeAccessIssue] - a cotangent's aval is a ShapedArray
        return jnp.zeros(ct.aval.shape, jax.dtypes.float0)  # pyright: ignore[reportAttributeAccessIssue] - a cotangent's aval is a ShapedArray
    zeros = jnp.zeros(ct.aval.shape, ct.aval.dtype)  # pyright: ignore[reportAttributeAccessIssue] - a cotangent's aval is a ShapedArray
    manual = getattr(ct.aval, "manual_axis_type", None)
    if manual is None:  # no varying-axis type to match
        return coll.to_varying(zeros, axis)
    return jax.lax.pcast(zeros, tuple(sorted(manual.varying)), to="varying") if manual.varying else zeros


@dataclasses.dataclass
class _Call:
    """One call of a block in the trace: for the next call's prefetch."""

    index: int
    trace: Any
    token: list[Any]  # its token output: zeros shaped like its block's whole parameters
    block: _Block
    needed: list[int]  # its leaves in the order its forward pass first uses them (see schedule.use_order)
    regather_from: list[Any]  # what its backward pass re-gathers from (_Block.first_gather)
    kept: bool = False  # its gathered parameters kept for its backward pass: the next block hands it nothing


class LayerChain:
    """The blocks of a model in the order it calls them, and the prefetch
    queue of one trace of its loss.

    ``layers[i]`` is block i's parameter subtree as the step hands it to the
    loss (``Sharded`` pieces and ordinary arrays). :meth:`call` runs block i;
    the forward pass of block i issues the gathers of blocks i + 1 … i +
    ``prefetch``, and its backward pass the re-gather of the block called
    before it. Blocks called in another order, or again, still run (a
    prefetched gather nobody uses is removed by the compiler).
    ``keep_gathered`` (an int k or a byte budget: :mod:`zero_jax._layerwise.keep`)
    keeps the gathered parameters of blocks ``count - k`` … ``count - 1`` for
    their backward pass (stage 3; :attr:`kept` is k).

    ``pinned``: each block's parameters belong to the trace they were handed
    in (here, or later by :meth:`see`), and a block is prefetched only from
    the parameters of the trace in progress. A transform the model wraps
    around several blocks (Flax's ``nn.jit`` on a ``__call__`` that loops
    over them) caches its trace by its arguments' structure: a gather of the
    next block made from the enclosing trace's values would be closed over by
    that cached trace, and the next trace of the loss would meet a stale
    tracer. Unpinned (the default), a block is prefetched from the parameters
    as last handed in, whatever trace they belong to: right where every
    transform between them is traced afresh (the NNX and Equinox stand-ins
    are static data hashed by identity, new in every trace of the loss).
    """

    def __init__(
        self, policy: ZeroPolicy | None, layers: Sequence[PyTree], prefetch: int = 1, where: str = "zj.apply_layers",
        offload_activations: bool | None = None, keep_gathered: Any = 0, pinned: bool = False,
    ) -> None:  # fmt: skip
        self.policy = policy
        self.where = where
        # The saved inputs in host memory (P_a+cpu); None: the policy's choice.
        # (Without an active policy -- stages 0-1, local accumulation -- the caller checked it against its own.)
        self.offload = bool(offload_activations) if policy is None else offloads_activations(
            policy, offload_activations, where)
        self.layers = list(layers)
        # On a backend whose compiler overlaps a gather with its own consumers (the schedule's prefetch_blocks
        # off: TPU) every block is gathered in place.
        self.prefetch = prefetch if policy is None or schedule_for(policy).prefetch_blocks else 0
        # Checked in every stage; only stage 3 gathers, so only stage 3 keeps anything.
        kept = kept_count(keep_gathered, [gathered_bytes(p) for p in self.layers], where)
        self.kept = kept if self._gathers else 0
        self._queue: dict[int, tuple[Any, tuple[list[Any], list[Any]]]] = {}
        self._last: _Call | None = None
        self._hosted: list[tuple[Any, list[Any]]] = []  # (trace, host copies) of blocks whose copies nothing waits for
        self.calls = 0
        self.pinned = pinned
        self._traces = [get_opaque_trace_state()] * len(self.layers)  # the trace each block's parameters belong to

    def see(self, layers: Mapping[int, PyTree]) -> None:
        """Blocks' parameters (by index) as the trace in progress holds them:
        what a lifted transform around their calls passes in."""
        trace = get_opaque_trace_state()
        for i, params in layers.items():
            self.layers[i], self._traces[i] = params, trace

    def _prefetchable(self, index: int, trace: Any) -> bool:
        """Whether block ``index`` may be gathered ahead from the trace ``trace`` (see ``pinned``)."""
        return not self.pinned or self._traces[index] == trace

    @property
    def _gathers(self) -> bool:
        return self.policy is not None and self.policy.partitions_params

    def call(self, index: int, layer_fn: Callable[..., Any], *args: Any) -> Any:
        """``layer_fn(whole parameters of block index, *args)``, block-wise."""
        self.calls += 1
        params = self.layers[index]
        policy = self.policy
        if (
            policy is None
            or not policy.partitions_grads
            or not any(_is_sharded(x) for x in jax.tree.leaves(params, is_leaf=_is_sharded))
        ):
            return checkpointed(layer_fn, self.offload)(params, *args)
        if any(batched_by_vmap(a) for a in jax.tree.leaves(args)):
            raise ValueError(UNDER_VMAP.format(where=self.where, index=index))
        block = _Block.of(index, params)
        trace = get_opaque_trace_state()
        wholes, regather_from = self._forward_wholes(index, block, trace, args)
        for ahead in range(index + 1, min(index + 1 + self.prefetch, len(self.layers))) if self._gathers else ():
            if ahead not in self._queue and self._prefetchable(ahead, trace):
                nxt = _Block.of(ahead, self.layers[ahead])
                self._queue[ahead] = (
                    trace,
                    nxt.first_gather(nxt.sources, policy, inputs_anchor(args), kept=self.keeps(ahead)),
                )
        previous = self._last if self._last is not None and self._last.trace == trace else None
        hosted = self._to_host(args) if self.offload else None
        out, call = _run_block(policy, self.prefetch if self._gathers else 0, index, trace, layer_fn, block, wholes,
                               regather_from, args, previous, self.keeps(index), hosted)  # fmt: skip
        self._last = call
        return self._hold(out, trace, hosted)

    def _to_host(self, args: Any) -> list[Any]:
        """P_a+cpu: the host copies of a block's float inputs (cut with
        ``partition_activations``), made here rather than in the block's
        forward pass so that a later block can wait for them (``_hold``)."""
        floats = [jax.lax.stop_gradient(a) for a in jax.tree.leaves(args) if is_float(a)]
        return saved_to_host(partition_saved(floats, self.policy, materialize=schedule_for(self.policy).unfusable_cut),
                             True)  # fmt: skip

    def _hold(self, out: Any, trace: Any, hosted: list[Any] | None) -> Any:
        """``out``, waiting for the host copies of the inputs of the block
        called ``hold_host_copies`` calls before (the schedule's): the TPU
        compiler otherwise finishes those copies when the backward needs them,
        keeping every block's inputs in device memory through the forward."""
        schedule = schedule_for(self.policy)
        if hosted is None or not schedule.hold_host_copies:
            return out
        self._hosted = [h for h in self._hosted if h[0] == trace] + [(trace, hosted)]
        if len(self._hosted) <= schedule.hold_host_copies:
            return out
        leaves, tree = jax.tree.flatten(out)
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        held = schedule.hold([leaves[i] for i in arrays], self._hosted.pop(0)[1])
        for i, x in zip(arrays, held, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(tree, leaves)

    def keeps(self, index: int) -> bool:
        """Whether block ``index`` keeps its gathered parameters for its backward pass (one of the last ``kept``)."""
        return self.kept > 0 and index >= len(self.layers) - self.kept

    def _forward_wholes(self, index: int, block: _Block, trace: Any, args: Any) -> tuple[list[Any], list[Any]]:
        queued = self._queue.pop(index, None)
        if queued is not None and queued[0] == trace:
            return queued[1]
        return block.first_gather(block.sources, self.policy, inputs_anchor(args), kept=self.keeps(index))  # pyright: ignore[reportArgumentType] - a chain that gathers has a policy


def _token_zeros(wholes: list[Any], axis: Any) -> list[Any]:
    return [None if w is None else coll.to_varying(jnp.zeros(w.shape, w.dtype), axis) for w in wholes]


def _handed(
    prev: _Call | None, sources: list[Any], block: _Block, produced: list[int], g_slots: list[Any],
    slot_dtypes: list[Any], policy: ZeroPolicy, ct_out: Any,
) -> list[Any]:  # fmt: skip
    """The previous block's parameters, re-gathered in this block's backward
    pass (leaf by leaf with the schedule's ``leafwise_prefetch``)."""
    if prev is None:
        return []
    slots = iter(g_slots)
    grads = [None if dt is None else next(slots) for dt in slot_dtypes]
    sizes = [0 if src is None else lay.nbytes for src, lay in zip(sources, prev.block.layouts, strict=True)]  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
    freed = [0 if lay is None else lay.nbytes for lay in block.layouts]
    anchors = schedule_for(policy).prefetch_anchors(prev.needed, sizes, produced, grads, freed, list(block.layouts),
                                                    ct_out, ct_out, prev.block.together(policy))  # fmt: skip
    return prev.block.wholes(sources, policy, ct_out, anchors)


def _recompute_inputs(arg_f: Any, ws: Any, ct_out: Any, policy: ZeroPolicy, offload: bool) -> tuple[Any, Any]:
    """A block's backward recompute inputs, due after its output's cotangent
    (the schedule's ``tie_recompute``). A saved piece
    (``partition_activations``) is brought back from host memory
    (``offload_activations``), waits, then is gathered. An input the same on
    every device cannot be tied without becoming per-device: then the block's
    weights wait instead."""
    schedule = schedule_for(policy)
    arg_f, tied = schedule.recompute_after(saved_to_device(arg_f, offload), ct_out)
    arg_f = regather_saved(arg_f, policy)
    if not tied:
        ws = schedule.recompute_after(ws, ct_out)[0]
    return arg_f, ws


def _run_block(  # house: one custom VJP's forward and backward read as one unit, over 80 lines
    policy: ZeroPolicy,
    prefetch: int,
    index: int,
    trace: Any,
    layer_fn: Callable[..., Any],
    block: _Block,
    wholes: list[Any],  # its whole parameters, gathered (or handed over by the prefetch queue)
    regather_from: list[Any],  # what its backward re-gathers from (_Block.first_gather)
    args: tuple[Any, ...],
    previous: _Call | None,
    keep: bool = False,
    hosted: list[Any] | None = None,  # P_a+cpu: the host copies of its float inputs (LayerChain._to_host)
) -> tuple[Any, _Call]:
    """One block's call as a custom VJP (see the module docstring); ``keep``:
    its gathered parameters are residuals, used by its backward pass."""
    axis = policy.comm
    offload = hosted is not None
    fn, consts = jax.closure_convert(lambda p, *a: layer_fn(p, *a), block.tree(wholes, block.plain), *args)
    needed, produced = use_order(fn, block.tree(wholes, block.plain), args, consts) if prefetch else ([], [])
    arg_leaves, arg_def = jax.tree.flatten(args)
    plain_floats, plain_fixed = _split([p for p in block.plain if p is not None])
    plain_is_float = [is_float(p) for p in block.plain if p is not None]
    arg_floats, arg_fixed = _split(arg_leaves)
    arg_is_float = [is_float(a) for a in arg_leaves]
    const_floats, const_fixed = _split(consts)
    # A value the same on every device (a constant, a replicated input) gets
    # the sum over the devices of its per-device cotangents, as autodiff gives it.
    varying = [[coll.varying_axes(x) for x in xs] for xs in (plain_floats, arg_floats, const_floats)]
    const_is_float = [is_float(c) for c in consts]
    slot_dtypes = [None if s is None else s.dtype for s in block.slots]
    slots = [s for s in block.slots if s is not None]
    # The channel from this block's backward pass to the previous call's: that call's token
    # output, whose cotangent is its re-gathered block (none for a kept block: no re-gather).
    chained = prefetch > 0 and previous is not None and not previous.kept
    token_in, prev_sources = (previous.token, list(previous.regather_from)) if chained else ([], [])  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow

    # Values that are not differentiated (integers, keys) enter the custom VJP
    # as inputs too: its backward pass is traced later and may not close over them.
    fixed = (plain_fixed, arg_fixed, const_fixed)

    def apply(ws: Sequence[Any], plain_f: Sequence[Any], arg_f: Sequence[Any], const_f: Sequence[Any],
              fixed: tuple[list[Any], ...]) -> Any:  # fmt: skip
        plain = iter(_merge(plain_is_float, plain_f, fixed[0]))
        params = block.tree(ws, [None if p is None else next(plain) for p in block.plain])
        a = jax.tree.unflatten(arg_def, _merge(arg_is_float, arg_f, fixed[1]))
        return fn(params, *a, *_merge(const_is_float, const_f, fixed[2]))

    def unwrap(tree: Any) -> Any:
        return jax.tree.map(lambda p: p.value, tree, is_leaf=lambda p: hasattr(p, "perturbed"))

    @jax.custom_vjp
    def zero_jax_block(slots, plain_f, arg_f, const_f, token_in, ws, sources, prev_sources, fixed, hosted):  # type: ignore[no-untyped-def]
        del slots, token_in, sources, prev_sources, hosted
        out = apply(ws, plain_f, arg_f, const_f, fixed)
        return out, _token_zeros(ws, axis) if prefetch else []

    def fwd(*primals):  # type: ignore[no-untyped-def]
        slots, plain_f, arg_f, const_f, token_in, ws, sources, prev_sources, fixed, hosted = unwrap(primals)
        del slots, token_in
        out = apply(ws, plain_f, arg_f, const_f, fixed)
        token = _token_zeros(ws, axis) if prefetch else []
        # Only the inputs are kept (and the pieces, which the step holds anyway; with keep the
        # gathered parameters), cut with partition_activations, in host memory with offload_activations.
        saved = hosted if offload else partition_saved(arg_f, policy, materialize=schedule_for(policy).unfusable_cut)
        return (out, token), (plain_f, saved, const_f, sources, prev_sources, fixed, ws if keep else None)

    def bwd(res, cts):  # type: ignore[no-untyped-def]
        plain_f, arg_f, const_f, sources, prev_sources, fixed, kept_ws = res
        ct_out, ct_token = cts
        ct_out = jax.tree.map(lambda c: _instantiate(c, axis), ct_out, is_leaf=lambda x: isinstance(x, SymbolicZero))
        handed = ct_token if prefetch and not any(isinstance(c, SymbolicZero) for c in jax.tree.leaves(
            ct_token, is_leaf=lambda x: isinstance(x, SymbolicZero))) else None  # fmt: skip
        ws = list(kept_ws) if keep else handed if handed is not None else block.wholes(sources, policy, ct_out)
        arg_f, ws = _recompute_inputs(arg_f, ws, ct_out, policy, offload)
        _, vjp = jax.vjp(lambda *d: apply(*d, fixed), ws, plain_f, arg_f, const_f)  # pyright: ignore[reportCallIssue] - jax.vjp takes any number of primals
        g_ws, g_plain, g_args, g_consts = vjp(ct_out)
        with jax.named_scope(f"zj_block{index}_reduce"):
            cast = [None if dt is None else g.astype(dt) for g, dt in zip(g_ws, slot_dtypes, strict=True)]
            how = schedule_for(policy).grad_reduction
            reduced = coll.reduce_scatter_leaves(cast, list(block.layouts), axis, block.together(policy), how)  # pyright: ignore[reportArgumentType] - a gathered block's layouts are all set
            g_slots = [r for r, dt in zip(reduced, slot_dtypes, strict=True) if dt is not None]
        # The block before this one runs its backward pass only once this
        # block's gradient is reduce-scattered (and its whole gradient freed).
        g_args = schedule_for(policy).after_reduction(g_args, g_slots)
        g_plain, g_args, g_consts = (
            [coll.sum_to_varying(g, v) for g, v in zip(gs, vs, strict=True)]
            for gs, vs in zip((g_plain, g_args, g_consts), varying, strict=True)
        )
        # Hand the block called before this one its re-gathered parameters.
        prev = previous if chained else None
        g_token = _handed(prev, prev_sources, block, produced, g_slots, slot_dtypes, policy, ct_out)
        return g_slots, g_plain, g_args, g_consts, g_token, None, None, None, None, None

    zero_jax_block.defvjp(fwd, bwd, symbolic_zeros=True)
    with jax.named_scope(f"zj_block{index}_compute"):
        out, token = zero_jax_block(
            slots, plain_floats, arg_floats, const_floats, token_in, wholes, regather_from, prev_sources, fixed, hosted
        )
    call = _Call(index=index, trace=trace, token=token, block=block, needed=needed, regather_from=regather_from,
                 kept=keep)
    return out, call


def apply_layer(
    layer_fn: Callable[..., Any],
    layer_params: PyTree,
    *args: Any,
    policy: ZeroPolicy | None,
    offload_activations: bool | None = None,
    keep_gathered: bool | int | str = False,
) -> Any:
    """``layer_fn(layer_params, *args)`` with the block's parameters whole only
    while it runs: the per-block counterpart of ``zj.scan_layers``.

    Stage 3: the block's pieces are all-gathered just before its forward
    compute and again before its backward recompute, and its gradient is
    reduce-scattered as soon as it exists. Stage 2: the same without gathers
    (the gradient of the block is reduce-scattered at once). Stages 0–1 and
    ``policy=None``: ``jax.checkpoint(layer_fn)(layer_params, *args)`` (its
    saved inputs in host memory with ``offload_activations``).
    For a loop over several blocks, :func:`apply_layers` also prefetches.
    ``offload_activations``: ZeRO-R's P_a+cpu (any stage), the block's saved
    inputs wait for its recompute in host memory (``None``: the policy's
    ``offload_activations``). ``keep_gathered=True`` (stage 3): the block
    keeps its gathered parameters from its forward pass for its backward pass
    instead of gathering them again (one block of memory for one all-gather
    saved; a byte budget such as ``"64MiB"`` keeps it when it fits). In a
    loop of blocks, keep the last ones (``keep_gathered=i >= len(blocks) -
    k``), or use :func:`apply_layers`'s ``keep_gathered=k``.

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh, min_shard_size=0)
    >>> def block(p, x):
    ...     return jnp.tanh(x @ p["w"])
    >>> def loss_fn(params, batch):
    ...     x = batch["x"]
    ...     for p in params["blocks"]:
    ...         x = zj.apply_layer(block, p, x, policy=policy)
    ...     return jnp.mean(x ** 2)
    >>> params = {"blocks": [{"w": jnp.eye(8)} for _ in range(3)]}
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> state = zj.init_state(params, tx, policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    >>> state, metrics = step(state, {"x": jnp.ones((jax.device_count(), 8))})
    >>> round(float(metrics["loss"]), 4)
    0.3207
    """
    offload = offloads_activations(policy, offload_activations, "zj.apply_layer")  # checked against the policy given
    policy = active_policy(policy, "zj.apply_layer")
    if policy is not None:
        check_parameter_pieces(layer_params, policy, "zj.apply_layer")
    keep = int(keep_gathered) if isinstance(keep_gathered, (bool, np.bool_)) else keep_gathered
    chain = LayerChain(policy, [layer_params], prefetch=0, where="zj.apply_layer", offload_activations=offload,
                       keep_gathered=keep)  # fmt: skip
    return chain.call(0, layer_fn, *args)


def apply_layers(
    layer_fn: Callable[[PyTree, Any], Any] | Sequence[Callable[[PyTree, Any], Any]],
    layers_params: Sequence[PyTree],
    carry: Any,
    policy: ZeroPolicy | None,
    *,
    prefetch: int = 1,
    offload_activations: bool | None = None,
    keep_gathered: int | str = 0,
) -> Any:
    """Run ``carry = layer_fn(layers_params[i], carry)`` for each block of a
    Python list, block-wise (see :func:`apply_layer`), with block i +
    ``prefetch``'s all-gather issued when block i starts (in the backward
    pass, block i - 1's first half at once and the rest leaf by leaf as block
    i's gradients are reduce-scattered): at most ``prefetch + 1`` blocks are
    whole at a time.

    Args:
      layer_fn: one function for every block, or a list of one per block
        (blocks may differ in structure).
      layers_params: the blocks' parameter subtrees, in call order (a list
        of the pieces ``loss_fn`` received).
      carry: the activation handed from block to block.
      policy: the step's policy, or ``None`` outside a step.
      prefetch: how many blocks ahead to gather (stage 3); 0 gathers each
        block only when it runs. On a backend whose compiler overlaps a
        gather only with its own consumers (the TPU compiler: see
        ``zero_jax._layerwise.schedule``) the blocks are gathered in place
        whatever ``prefetch`` says.
      offload_activations: ZeRO-R's P_a+cpu (any stage): each block's saved
        inputs go to host memory after its forward pass and come back just
        before its recompute; ``None`` follows the policy's
        ``offload_activations``.
      keep_gathered: stage 3: the last k blocks keep their gathered
        parameters from the forward pass for the backward pass (k fewer
        all-gathers per step, k blocks more memory; the last blocks of the
        forward are the first of the backward, so nothing waits); or a byte
        budget (``"2GiB"``): the most trailing blocks whose gathered bytes fit
        it. 0 gathers every block again. Stages 0-2 gather nothing again: it
        is checked and ignored.

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh, min_shard_size=0)
    >>> def loss_fn(params, batch):
    ...     block = lambda p, x: jnp.tanh(x @ p["w"])
    ...     return jnp.mean(zj.apply_layers(block, params["blocks"], batch["x"], policy) ** 2)
    >>> params = {"blocks": [{"w": jnp.eye(8)} for _ in range(3)]}
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    >>> state, metrics = step(zj.init_state(params, tx, policy), {"x": jnp.ones((jax.device_count(), 8))})
    >>> round(float(metrics["loss"]), 4)
    0.3207
    """
    offload = offloads_activations(policy, offload_activations, "zj.apply_layers")  # checked against the policy given
    policy = active_policy(policy, "zj.apply_layers")
    layers = list(layers_params) if isinstance(layers_params, (list, tuple)) else None
    if layers is None:
        raise TypeError(
            f"zj.apply_layers: layers_params must be a list (or tuple) of the blocks' parameter subtrees, got "
            f"{type(layers_params).__name__}. For stacked parameters (a leading layer axis) use zj.scan_layers."
        )
    fns = list(layer_fn) if isinstance(layer_fn, (list, tuple)) else [layer_fn] * len(layers)
    if len(fns) != len(layers) or not all(callable(f) for f in fns):
        raise ValueError(
            f"zj.apply_layers: layer_fn must be one function or a list of one per block; got {len(fns)} for "
            f"{len(layers)} blocks."
        )
    if not is_whole_number(prefetch) or not 0 <= prefetch <= len(layers):
        raise ValueError(
            f"zj.apply_layers: prefetch must be an int from 0 to the number of blocks ({len(layers)}), got "
            f"{prefetch!r}. 1 overlaps the next block's gather with this block's compute."
        )
    if policy is not None:
        check_parameter_pieces(layers, policy, "zj.apply_layers")
    chain = LayerChain(policy, layers, prefetch=int(prefetch), offload_activations=offload, keep_gathered=keep_gathered)
    for i, fn in enumerate(fns):
        carry = chain.call(i, fn, carry)  # pyright: ignore[reportArgumentType] - one function per block here
    return carry
