"""The few collectives every stage composes; all run inside ``jax.shard_map``.

Each takes one leaf and its :class:`LeafLayout`. A partitioned leaf moves by
reduce-scatter / all-gather on its cut dimension (padded to a multiple of N);
a leaf the policy keeps whole moves by all-reduce. Nothing else in the
library calls ``jax.lax`` collectives on state-sized data, so what the
compiled program communicates can be read off this module.

On a hybrid mesh (:class:`Axes` with replica axes) the partition collectives
run within the shard axes only; :func:`reduce_across_replicas` then moves
just the 1/N piece across the (slow) replica axes.

With tensor parallelism (a leaf whose layout has model axes) the step's
``shard_map`` leaves the model axes to the compiler, which would gather a
leaf's model shards together before a collective over data (tensor
parallelism silently lost, data-axis bytes M times the theory). So each such
collective runs inside a ``shard_map`` nested over the leaf's model axes
(:func:`per_model_shard`): every device moves its own model shard only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, PartitionSpec

from zero_jax._comm.quantized import dequantize_blocks, quantize_blocks
from zero_jax._layout.leaf import LeafLayout, is_real_float, pad, shard_shape, unpad
from zero_jax._theory.wire import WireFormat


class Axes(NamedTuple):
    """The mesh axes a step's collectives run over.

    ``shard``: state is cut across these (reduce-scatter, all-gather).
    ``replica``: the batch is split across these too, but they hold replicas
    of the partitioned state. ``scatter_replicas``: the reduced gradient
    piece is cut once more across ``replica`` (optimizer state partitioned
    over both). ``wire``: how weight gathers and gradient reduce-scatters
    travel (int8 blocks with ZeRO++'s qwZ / qgZ). ``secondary``: ZeRO++'s
    hpZ, the fast axis (chips of one node) of ``shard``, which it leads: a
    piece is gathered over the other shard axes (across nodes) into the
    secondary piece, then over ``secondary`` into the whole, and a backward
    re-gather starts from the secondary piece (:func:`secondary_piece`).
    ``cast``: the float dtype a piece is cast to before its all-gather
    (``Precision(compute_copy=False)``: float32 pieces, a bf16 wire); ``None``
    gathers pieces in their own dtype. ``major``: a piece cut along another
    dimension than its first is gathered and reduce-scattered along a new
    leading one (:func:`gather_along`, :func:`scatter_sum`), the same values;
    the schedule seam's ``major_axis_collectives`` says where.
    """

    shard: tuple[str, ...]
    replica: tuple[str, ...] = ()
    scatter_replicas: bool = False
    wire: WireFormat = WireFormat()
    secondary: str | None = None
    cast: Any = None
    major: bool = False

    @property
    def all(self) -> tuple[str, ...]:
        """Every axis the batch is split over."""
        return self.replica + self.shard

    @property
    def across(self) -> tuple[str, ...]:
        """With ``secondary``: the shard axes it leaves out (the slow ones,
        across nodes), which only the forward gather and the gradient
        reduction cross."""
        return tuple(a for a in self.shard if a != self.secondary)


AxisName = str | tuple[str, ...] | Axes


def _axes(axis: AxisName) -> Axes:
    if isinstance(axis, Axes):
        return axis
    return Axes((axis,) if isinstance(axis, str) else tuple(axis))


def _name(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The mesh axes over which ``x`` differs per device inside ``shard_map``."""
    manual = getattr(jax.typeof(x), "manual_axis_type", None)
    return manual.varying if manual is not None else getattr(jax.typeof(x), "vma", frozenset())


def sum_to_varying(ct: jax.Array, varying: frozenset[str]) -> jax.Array:
    """A cotangent typed like a primal that varies over ``varying`` only:
    summed over the other axes it varies over (the transpose of marking a
    replicated value per-device)."""
    extra = tuple(sorted(varying_axes(ct) - varying))
    return jax.lax.psum(ct, extra) if extra else ct


def to_varying(x: jax.Array, axis: AxisName) -> jax.Array:
    """Mark a replicated value as per-device inside ``shard_map``.

    Differentiating through a replicated (unvarying) value makes JAX psum its
    cotangent across the axis automatically (an all-reduce). Casting it to
    varying first keeps each device's gradient local, so we choose the
    collective ourselves.
    """
    axes = _axes(axis).all
    varying = varying_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    if not missing:  # already per-device
        return x
    return jax.lax.pcast(x, missing if len(missing) > 1 else missing[0], to="varying")  # pyright: ignore[reportGeneralTypeIssues] - missing is not empty here


def checks_varying() -> bool:
    """Whether the enclosing ``shard_map`` types values as varying or not over
    its manual axes (``check_vma=True``, the default; a stateful step runs
    unchecked). Read off the one observable effect: marking a zero varying
    over the manual axes is a no-op in an unchecked ``shard_map``."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True) if kind == AxisType.Manual)
    if not manual:
        return True
    probe = jax.eval_shape(lambda: jax.lax.pcast(jnp.zeros((), jnp.float32), manual, to="varying"))
    return bool(probe.manual_axis_type is not None and probe.manual_axis_type.varying)


def per_model_shard(fn: Any, layout: LeafLayout | None, x: jax.Array) -> jax.Array:
    """``fn(x)`` on this device's model shard of ``x``: inside the step's
    ``shard_map`` with model axes left to the compiler, a ``shard_map`` nested
    over them (``x`` split as the layout's model spec says, replicated over
    them without one); ``fn(x)`` itself when every mesh axis is manual
    already. ``fn`` must keep the model-sharded dimensions' sizes.

    Nesting even a leaf the model does not shard keeps each collective's
    reduction free of the compiler's sharding annotations (XLA:CPU's bf16
    all-reduce promotion aborts on a reducer that holds one). The nested
    ``shard_map`` checks varying types as the enclosing one does: a checked
    one inside an unchecked step would type its result varying over data
    while everything around it is untyped (a model-sharded weight's
    cotangent then fails autodiff's type check)."""
    mesh = jax.sharding.get_abstract_mesh()
    auto = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True) if kind != AxisType.Manual}
    if not auto:
        return fn(x)
    spec = PartitionSpec(*layout.model) if layout is not None and layout.model else PartitionSpec()
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=auto, check_vma=checks_varying())(x)


def sum_all_reduce(x: jax.Array, axis: AxisName) -> jax.Array:
    """Sum ``x`` over every batch axis; every device gets the whole result.

    Gradients are summed, not averaged: the step scales each device's loss by
    1/N before differentiating, so the sum *is* the global mean.
    """
    return jax.lax.psum(x, _name(_axes(axis).all))


def sum_all_reduce_leaf(x: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """:func:`sum_all_reduce` of one leaf, on each device's model shard."""
    return per_model_shard(lambda g: sum_all_reduce(g, axis), layout, x)


def sum_reduce_scatter(x: jax.Array, layout: LeafLayout, axis: AxisName, how: str = "psum_scatter") -> jax.Array:
    """Sum a whole per-device gradient over the shard axes and keep this
    device's piece of it (stored, padded form). A leaf the policy keeps whole
    is all-reduced (over every batch axis) instead. On a hybrid mesh the
    piece still differs per replica: :func:`reduce_across_replicas` finishes.
    ``how``: by which collectives (:func:`scatter_sum`; the schedule's
    ``grad_reduction``); int8 wires (qgZ) keep their all-to-all."""
    if layout.dim is None:
        return sum_all_reduce_leaf(x, layout, axis)
    axes = _axes(axis)
    block = axes.wire.block
    # hpZ: within the node first (into the secondary piece), then across nodes: the transpose of the gathers.
    steps = [axes.secondary, _name(axes.across)] if axes.secondary else [_name(axes.shard)]

    def scatter(g: jax.Array) -> jax.Array:
        g = pad(g, layout)
        for over in steps:
            if axes.wire.grads is not None:
                g = _quantized_reduce_scatter(g, over, layout.dim, block)  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
            else:
                g = scatter_sum(g, over, layout.dim, how, major=axes.major)  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
        return g

    return per_model_shard(scatter, layout, x)


#: How :func:`scatter_sum` may reduce-scatter a gradient (the schedule's ``grad_reduction``).
REDUCE_SCATTERS = ("psum_scatter", "ring", "bidirectional_ring", "all_to_all")
#: The name scope of a gradient reduce-scatter made of other collectives (the audit reads it as one), and of
#: its first collective, which the audit counts as the reduction (a ring has N - 1 steps each way).
GRAD_REDUCTION_SCOPE = "zj_grad_reduction"
GRAD_REDUCTION_FIRST = "zj_grad_reduction_first"
UNKNOWN_REDUCE_SCATTER = "grad_reduction={how!r}: a gradient is reduce-scattered by one of {known}."


def scatter_sum(g: jax.Array, over: Any, dim: int, how: str = "psum_scatter", *, major: bool = False) -> jax.Array:
    """``psum_scatter(g, over, scatter_dimension=dim, tiled=True)``: ``g``
    summed over ``over`` and cut along ``dim``, this device's slice; ``how``
    (:data:`REDUCE_SCATTERS`) says by which collectives: ``psum_scatter``
    itself, a ring of ``ppermute`` steps (:func:`ring_reduce_scatter`, one
    or both ways round), or one ``all_to_all`` of the N slices and a local
    sum (:func:`all_to_all_reduce_scatter`). ``major`` (``psum_scatter``
    only): ``dim`` split into (N, slice) and the N moved first, so that the
    collective cuts its operand's leading dimension (:class:`Axes`)."""
    if how == "psum_scatter":
        if major and dim != 0:
            n = jax.lax.psum(1, over)
            split = g.reshape(*g.shape[:dim], n, g.shape[dim] // n, *g.shape[dim + 1:])
            return jax.lax.psum_scatter(jnp.moveaxis(split, dim, 0), over, scatter_dimension=0, tiled=False)
        return jax.lax.psum_scatter(g, over, scatter_dimension=dim, tiled=True)
    if how not in REDUCE_SCATTERS:
        raise ValueError(UNKNOWN_REDUCE_SCATTER.format(how=how, known=REDUCE_SCATTERS))
    with jax.named_scope(GRAD_REDUCTION_SCOPE):
        if how == "all_to_all":
            return all_to_all_reduce_scatter(g, over, dim)
        return ring_reduce_scatter(g, over, dim, bidirectional=how == "bidirectional_ring")


def all_to_all_reduce_scatter(g: jax.Array, over: Any, dim: int) -> jax.Array:
    """:func:`scatter_sum` as one ``all_to_all`` (device j receives slice j
    of every device's ``g``: (N - 1) / N of ``g`` sent, one pass) and a sum
    in device order on the receiver."""
    pieces = _cut_into_pieces(g, dim, jax.lax.axis_size(over))
    with jax.named_scope(GRAD_REDUCTION_FIRST):
        received = jax.lax.all_to_all(pieces, over, 0, 0)
    return jnp.sum(received, axis=0)


def ring_reduce_scatter(g: jax.Array, over: Any, dim: int, *, bidirectional: bool = True) -> jax.Array:
    """:func:`scatter_sum` as a ring of ``ppermute`` steps: N - 1 steps, each
    sending one 1/N slice to the next device and adding the slice it
    receives to its own, so the bytes on the wire are (N - 1) / N of ``g``,
    one pass (a compiler may run a ``psum_scatter`` as an all-reduce and a
    slice: two). ``bidirectional``: half of each slice goes each way round
    the ring (both links of a torus axis busy, half the bytes each; one way
    when the slice does not halve). The sums run in ring order, not the
    collective's: equal to float rounding. ``over``: an axis name or a tuple
    of them (devices in ``axis_index`` order)."""
    n = jax.lax.axis_size(over)
    if n == 1:
        return g
    pieces = _cut_into_pieces(g, dim, n)  # (n, *piece)
    me = jax.lax.axis_index(over)
    if bidirectional and pieces.shape[1 + dim] % 2 == 0:
        halves = jnp.split(pieces, 2, axis=1 + dim)
        one_way = _ring(halves[0], over, n, me, 1)
        return jnp.concatenate([one_way, _ring(halves[1], over, n, me, -1, first=False)], axis=dim)
    return _ring(pieces, over, n, me, 1)


def _ring(pieces: jax.Array, over: Any, n: int, me: jax.Array, step: int, *, first: bool = True) -> jax.Array:
    """One direction of :func:`ring_reduce_scatter`: device i ends with the sum
    over devices of ``pieces[i]``. Each device starts with the piece that
    reaches its owner after n - 1 hops (``me - step``), and adds to what it
    receives its own piece of the same index. ``first``: its first step is
    named the reduction's (:data:`GRAD_REDUCTION_FIRST`)."""
    perm = [(i, (i + step) % n) for i in range(n)]
    acc = jax.lax.dynamic_index_in_dim(pieces, (me - step) % n, 0, keepdims=False)
    for s in range(1, n):
        with jax.named_scope(GRAD_REDUCTION_FIRST) if s == 1 and first else contextlib.nullcontext():
            acc = jax.lax.ppermute(acc, over, perm)
        acc = acc + jax.lax.dynamic_index_in_dim(pieces, (me - step * (s + 1)) % n, 0, keepdims=False)
    return acc


def _quantized_reduce_scatter(g: jax.Array, shard: Any, dim: int, block: int) -> jax.Array:
    """qgZ: ``psum_scatter(g, shard, scatter_dimension=dim, tiled=True)`` with
    each destination's piece sent as int8 blocks + float32 scales by one
    all-to-all, then dequantized and summed in float32 on the receiver (the
    sum itself is exact float32, in device order: deterministic)."""
    pieces = _cut_into_pieces(g, dim, jax.lax.axis_size(shard))
    q, scale = jax.vmap(lambda piece: quantize_blocks(piece, block))(pieces)
    q = jax.lax.all_to_all(q, shard, 0, 0)
    scale = jax.lax.all_to_all(scale, shard, 0, 0)
    received = jax.vmap(lambda qi, si: dequantize_blocks(qi, si, pieces.shape[1:], jnp.float32))(q, scale)
    return jnp.sum(received, axis=0).astype(g.dtype)


def _cut_into_pieces(whole: jax.Array, dim: int, n: int) -> jax.Array:
    """``whole`` (``dim`` divisible by ``n``) as ``(n, *piece)``: piece i is
    the i-th of ``n`` equal slices along ``dim``."""
    shape = whole.shape
    return jnp.moveaxis(whole.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1 :]), dim, 0)


def _join_pieces(pieces: jax.Array, dim: int) -> jax.Array:
    """The inverse of :func:`_cut_into_pieces`: ``(n, *piece)`` concatenated along ``dim``."""
    n, shape = pieces.shape[0], pieces.shape[1:]
    return jnp.moveaxis(pieces, 0, dim).reshape(shape[:dim] + (n * shape[dim],) + shape[dim + 1 :])


def _quantized_all_gather(p: jax.Array, shard: Any, dim: int, block: int) -> jax.Array:
    """qwZ: ``all_gather(p, shard, axis=dim, tiled=True)`` sent as int8 blocks
    + float32 scales, dequantized to ``p``'s dtype after the gather."""
    q, scale = quantize_blocks(p, block)
    q = jax.lax.all_gather(q, shard)
    scale = jax.lax.all_gather(scale, shard)
    pieces = jax.vmap(lambda qi, si: dequantize_blocks(qi, si, p.shape, p.dtype))(q, scale)
    return _join_pieces(pieces, dim)


def reduce_across_replicas(piece: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """Finish a partitioned gradient's reduction across the replica axes: an
    all-reduce of the 1/N piece (HSDP), or a reduce-scatter of it into
    1/(R·N) pieces (optimizer state partitioned over the replicas too).
    Identity without replica axes, and for leaves kept whole (their
    all-reduce spanned every axis already)."""
    axes = _axes(axis)
    if not axes.replica or layout.dim is None:
        return piece
    replica = _name(axes.replica)
    if axes.scatter_replicas:
        return per_model_shard(
            lambda g: jax.lax.psum_scatter(g, replica, scatter_dimension=layout.dim, tiled=True), layout, piece  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
        )
    return per_model_shard(lambda g: jax.lax.psum(g, replica), layout, piece)


def cast_for_wire(x: jax.Array, axis: AxisName) -> jax.Array:
    """A float piece in the dtype it travels in (``Axes.cast``, when set):
    the cast FSDP2 makes right before each gather, so that no compute copy
    of the parameters outlives the layer that uses it."""
    cast = _axes(axis).cast
    return x.astype(cast) if cast is not None and is_real_float(x) and x.dtype != cast else x


def gather_along(p: jax.Array, over: Any, dim: int, *, major: bool = False) -> jax.Array:
    """``all_gather(p, over, axis=dim, tiled=True)``; ``major``: gathered
    along a new leading dimension, which then moves to ``dim`` and merges
    with it. XLA:GPU gathers along an operand's major dimension: a gather
    along another re-lays-out its operand, and when that operand is a slice
    of a stacked piece in a loop, the whole stack is copied into the new
    layout before the loop (``Axes.major``).

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> mesh = jax.make_mesh((2,), ("d",))
    >>> x = jax.device_put(jnp.arange(12.0).reshape(2, 6), jax.NamedSharding(mesh, jax.P(None, "d")))
    >>> f = lambda major: jax.shard_map(lambda p: gather_along(p, "d", 1, major=major), mesh=mesh,
    ...                                 in_specs=jax.P(None, "d"), out_specs=jax.P(), check_vma=False)(x)
    >>> bool(np.array_equal(f(True), f(False))) and f(True).shape == (2, 6)
    True
    """
    if not major or dim == 0:
        return jax.lax.all_gather(p, over, axis=dim, tiled=True)
    stacked = jnp.moveaxis(jax.lax.all_gather(p, over, axis=0, tiled=False), 0, dim)
    return stacked.reshape(*p.shape[:dim], -1, *p.shape[dim + 1:])


def gather_for_use(x: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """All-gather this device's piece of a parameter into the whole, unpadded
    leaf, as a per-device (varying) value. Its transpose is a reduce-scatter,
    so differentiating through it gives each device its piece of the *summed*
    gradient: ZeRO-3's backward communication for free."""
    if layout.dim is None:
        return to_varying(x, axis)
    x = cast_for_wire(x, axis)
    if _axes(axis).wire.weights is not None and is_real_float(x):  # a quantized base's codes travel as they are
        return _quantized_gather_for_use(x, layout, _axes(axis))
    if _axes(axis).secondary:
        return gather_secondary(secondary_piece(x, layout, axis), layout, axis)
    shard, major = _name(_axes(axis).shard), _axes(axis).major
    whole = per_model_shard(lambda p: gather_along(p, shard, layout.dim, major=major), layout, x)  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
    # Per-replica too: the gathered weights meet replica-varying activations,
    # and an invariant value there would make autodiff all-reduce the whole
    # gradient across the replicas behind our back.
    return to_varying(unpad(whole, layout), axis)


@dataclasses.dataclass(frozen=True)
class Int8Pieces:
    """hpZ with qwZ: a secondary piece as the int8 blocks (``codes``) and
    float32 ``scales`` of the primary pieces it is made of (leading axis:
    one per primary piece, in order), each of ``shape`` and ``dtype``."""

    codes: jax.Array
    scales: jax.Array
    shape: tuple[int, ...]
    dtype: Any


jax.tree_util.register_dataclass(Int8Pieces, data_fields=["codes", "scales"], meta_fields=["shape", "dtype"])


def secondary_piece(x: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """hpZ: this device's piece of the secondary partition (over the fast
    ``secondary`` axis only, N/S times the primary piece): the primary pieces
    all-gathered across the other shard axes (the forward pass's only
    crossing of the slow link). With qwZ they cross as int8 blocks and the
    secondary piece holds their dequantized values, so the whole parameter
    gathered from it is the one a single int8 gather gives. A leaf kept
    whole is returned as it is."""
    axes = _axes(axis)
    if layout.dim is None:
        return x
    across = _name(axes.across)
    if axes.wire.weights is not None and is_real_float(x):
        q, scale = quantize_blocks(x, axes.wire.block)
        return Int8Pieces(jax.lax.all_gather(q, across), jax.lax.all_gather(scale, across), x.shape, x.dtype)  # pyright: ignore[reportReturnType] - the int8 wire hands its pieces on
    return per_model_shard(lambda p: jax.lax.all_gather(p, across, axis=layout.dim, tiled=True), layout, x)  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim


def gather_secondary(piece: jax.Array, layout: LeafLayout, axis: AxisName) -> jax.Array:
    """hpZ: the whole, unpadded parameter from a :func:`secondary_piece`,
    all-gathered over the fast axis only (within the node), per-device
    (varying). Its transpose reduce-scatters within the node only: the
    layer-wise primitives reduce gradients themselves
    (:func:`sum_reduce_scatter`, which also crosses the nodes)."""
    if layout.dim is None:
        return to_varying(piece, axis)
    secondary = _axes(axis).secondary
    if isinstance(piece, Int8Pieces):  # qwZ: (S, A, blocks...) -> the S·A primary pieces, secondary-major
        q, scale = jax.lax.all_gather(piece.codes, secondary), jax.lax.all_gather(piece.scales, secondary)
        q, scale = q.reshape(-1, *q.shape[2:]), scale.reshape(-1, *scale.shape[2:])
        dequantize = lambda qi, si: dequantize_blocks(qi, si, piece.shape, piece.dtype)  # noqa: E731
        whole = _join_pieces(jax.vmap(dequantize)(q, scale), layout.dim)
    else:
        whole = per_model_shard(lambda p: jax.lax.all_gather(p, secondary, axis=layout.dim, tiled=True), layout, piece)  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
    return to_varying(unpad(whole, layout), axis)


def _quantized_gather_for_use(x: jax.Array, layout: LeafLayout, axes: Axes) -> jax.Array:
    """:func:`gather_for_use` over an int8 wire (qwZ). Integers carry no
    gradient, so the transpose is spelled out: the cotangent is
    reduce-scattered (int8 too with qgZ) and summed over the axes the piece
    does not vary over (the replicas), as autodiff of the plain gather does."""
    varying, shard = varying_axes(x), _name(axes.shard)

    @jax.custom_vjp
    def zero_jax_quantized_gather(piece: jax.Array) -> jax.Array:
        if axes.secondary:
            return gather_secondary(secondary_piece(piece, layout, axes), layout, axes)
        gather = lambda p: _quantized_all_gather(p, shard, layout.dim, axes.wire.block)  # noqa: E731  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
        return to_varying(unpad(per_model_shard(gather, layout, piece), layout), axes)

    def fwd(piece: jax.Array) -> tuple[jax.Array, None]:
        return zero_jax_quantized_gather(piece), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array]:
        return (sum_to_varying(sum_reduce_scatter(ct, layout, axes), varying),)

    zero_jax_quantized_gather.defvjp(fwd, bwd)
    return zero_jax_quantized_gather(x)


def gather_replicated(x: jax.Array, layout: LeafLayout, axes: tuple[str, ...], *, unpadded: bool = True) -> jax.Array:
    """All-gather pieces cut over ``axes`` (in that order, major first) into
    the whole (unpadded) leaf, typed as replicated over them (so it may
    leave ``shard_map`` without those axes in its spec)."""
    if layout.dim is None:
        return x
    name = _name(axes)
    whole = per_model_shard(
        lambda p: jax.lax.all_gather(p, name, axis=layout.dim, tiled=True, to="invarying"), layout, x  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
    )
    return unpad(whole, layout) if unpadded else whole


def can_move_together(layout: LeafLayout, axis: AxisName) -> bool:
    """Whether a partitioned leaf's gather and reduce-scatter may share one
    collective with other leaves' (:func:`gather_together`,
    :func:`reduce_scatter_together`): a plain float wire (no int8 blocks),
    no hpZ, no model axes (each leaf would need its own nested ``shard_map``)."""
    axes = _axes(axis)
    plain = axes.wire.weights is None and axes.wire.grads is None and axes.secondary is None
    return plain and layout.dim is not None and not any(layout.model)


def joined_layout(layouts: Sequence[LeafLayout], num_shards: int) -> LeafLayout:
    """The layout of the one array that leaves moving together
    (:func:`gather_together`) travel as: a row per device holding its pieces
    end to end, rows in device order, each device's piece its own row. The
    audit reads a joined collective by these shapes."""
    piece = sum(math.prod(shard_shape(lay, num_shards)) for lay in layouts)
    return LeafLayout((num_shards, piece), layouts[0].dtype, 0, num_shards)


def gather_together(pieces: list[jax.Array], layouts: list[LeafLayout], axis: AxisName) -> list[jax.Array]:
    """:func:`gather_for_use` of several leaves (one dtype, each
    :func:`can_move_together`) by one all-gather of their
    :func:`joined_layout`: each device's pieces, flattened, travel end to
    end, and each leaf is joined back from the gathered rows (one per
    device, in device order: :func:`_join_pieces`). A latency-bound
    collective per leaf becomes one per group (FSDP's flat parameter, for a
    layer's small leaves)."""
    shard = _name(_axes(axis).shard)

    def gather(ps: list[jax.Array]) -> list[jax.Array]:
        ps = [cast_for_wire(p, axis) for p in ps]
        rows = jax.lax.all_gather(jnp.concatenate([p.ravel() for p in ps])[None], shard, tiled=True)
        wholes, start = [], 0
        for p, lay in zip(ps, layouts, strict=True):
            wholes.append(_join_pieces(rows[:, start : start + p.size].reshape(rows.shape[0], *p.shape), lay.dim))  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
            start += p.size
        return wholes

    wholes = per_model_shard(gather, None, pieces)  # pyright: ignore[reportArgumentType] - per_model_shard maps lists of arrays too
    return [to_varying(unpad(w, lay), axis) for w, lay in zip(wholes, layouts, strict=True)]


def reduce_scatter_together(grads: list[jax.Array], layouts: list[LeafLayout], axis: AxisName,
                            how: str = "psum_scatter") -> list[jax.Array]:  # fmt: skip
    """:func:`sum_reduce_scatter` of several whole gradients (one dtype, each
    :func:`can_move_together`) by one reduce-scatter: the transpose of
    :func:`gather_together`, so each device keeps its pieces."""
    shard = _name(_axes(axis).shard)

    def scatter(gs: list[jax.Array]) -> list[jax.Array]:
        n = jax.lax.axis_size(shard)
        cut = [_cut_into_pieces(pad(g, lay), lay.dim, n) for g, lay in zip(gs, layouts, strict=True)]  # pyright: ignore[reportArgumentType] - a partitioned leaf's layout has a dim
        rows = jnp.concatenate([c.reshape(n, -1) for c in cut], axis=1)
        mine = scatter_sum(rows, shard, 0, how)[0]
        pieces, start = [], 0
        for c in cut:
            size = math.prod(c.shape[1:])
            pieces.append(mine[start : start + size].reshape(c.shape[1:]))
            start += size
        return pieces

    return per_model_shard(scatter, None, grads)  # pyright: ignore[reportArgumentType, reportReturnType] - per_model_shard maps lists of arrays too


def _by_groups(values: list[Any], layouts: list[LeafLayout], axis: AxisName, together: Sequence[Sequence[int]],
               joined: Any, alone: Any) -> list[Any]:  # fmt: skip
    """``joined(values, layouts, axis)`` for the leaves of each group of
    ``together`` that share a dtype (two or more), ``alone(value, layout,
    axis)`` for every other leaf; ``None`` values stay ``None``."""
    out, done = list(values), set()
    for group in together:
        by_dtype: dict[Any, list[int]] = {}
        for i in group:
            if values[i] is not None:
                by_dtype.setdefault(values[i].dtype, []).append(i)
        for run in (run for run in by_dtype.values() if len(run) >= 2):
            for i, v in zip(run, joined([values[i] for i in run], [layouts[i] for i in run], axis), strict=True):
                out[i] = v
            done.update(run)
    return [v if i in done or v is None else alone(v, layouts[i], axis) for i, v in enumerate(out)]


def gather_leaves(pieces: list[Any], layouts: list[LeafLayout], axis: AxisName,
                  together: Sequence[Sequence[int]] = ()) -> list[Any]:  # fmt: skip
    """:func:`gather_for_use` of each piece (``None`` stays ``None``); the
    leaves of each group of ``together`` (indices, see
    ``Schedule.together``) of one dtype by one :func:`gather_together`."""
    return _by_groups(pieces, layouts, axis, together, gather_together, gather_for_use)


def reduce_scatter_leaves(grads: list[Any], layouts: list[LeafLayout], axis: AxisName,
                          together: Sequence[Sequence[int]] = (), how: str = "psum_scatter") -> list[Any]:  # fmt: skip
    """:func:`sum_reduce_scatter` of each gradient (``None`` stays ``None``),
    grouped as :func:`gather_leaves` groups the gathers (``how``: by which
    collectives, :func:`scatter_sum`)."""
    joined = functools.partial(reduce_scatter_together, how=how)
    return _by_groups(grads, layouts, axis, together, joined, functools.partial(sum_reduce_scatter, how=how))


def fetch(source: jax.Array, layout: LeafLayout, axis: AxisName, *, gather: bool) -> jax.Array:
    """A parameter for forward use only: all-gathered from this device's piece
    (``gather=True``, ZeRO-3) or the whole parameter already held (ZeRO-2)."""
    return gather_for_use(source, layout, axis) if gather else to_varying(source, axis)


def fetch_with_grad_slot(
    source: jax.Array, slot: jax.Array, layout: LeafLayout, axis: AxisName, *, gather: bool,
    how: str = "psum_scatter",
) -> jax.Array:  # fmt: skip
    """:func:`fetch` ``source`` for the forward pass; in the backward pass send
    its cotangent, cast to ``slot``'s dtype and reduce-scattered (by ``how``:
    :func:`scatter_sum`), to ``slot`` (a per-device zero piece the caller
    differentiates against).

    This is how ZeRO-2 and ZeRO-3 keep gradients partitioned: each parameter's
    gradient is reduced the moment the backward pass produces it, in the
    reduce dtype of the precision policy (not the compute dtype), and the
    whole-model gradient is never held. In ZeRO-3 the forward gather runs
    again whenever the caller's remat recomputes it.
    """

    if gather and layout.dim is not None and _axes(axis).secondary:
        return _fetch_secondary_with_grad_slot(source, slot, layout, axis)

    @jax.custom_vjp
    def zero_jax_fetch(src: jax.Array, slot: jax.Array) -> jax.Array:
        del slot
        return fetch(src, layout, axis, gather=gather)

    def fwd(src: jax.Array, slot: jax.Array) -> tuple[jax.Array, None]:
        return zero_jax_fetch(src, slot), None

    def bwd(_: None, ct: jax.Array) -> tuple[None, jax.Array]:
        return None, sum_reduce_scatter(ct.astype(slot.dtype), layout, axis, how)

    zero_jax_fetch.defvjp(fwd, bwd)
    return zero_jax_fetch(source, slot)


#: The name (``jax.ad_checkpoint.checkpoint_name``) of hpZ's secondary pieces
#: outside the layer-wise primitives: a remat policy that saves it keeps them
#: from the forward pass to the backward (``gather="all"``'s stage 3 does).
SECONDARY_PIECE = "zero_jax_secondary_piece"


def _fetch_secondary_with_grad_slot(source: jax.Array, slot: jax.Array, layout: LeafLayout, axis: AxisName) -> Any:
    """hpZ's :func:`fetch_with_grad_slot`: the secondary piece is made (across
    the nodes) outside the custom VJP and named :data:`SECONDARY_PIECE`, so a
    remat that recomputes the whole parameter for the backward gathers it
    again from that piece, within the node."""
    piece = jax.tree.map(lambda a: checkpoint_name(a, SECONDARY_PIECE), secondary_piece(source, layout, axis))

    @jax.custom_vjp
    def zero_jax_fetch_secondary(piece: Any, slot: jax.Array) -> jax.Array:
        del slot
        return gather_secondary(piece, layout, axis)

    def fwd(piece: Any, slot: jax.Array) -> tuple[jax.Array, None]:
        return zero_jax_fetch_secondary(piece, slot), None

    def bwd(_: None, ct: jax.Array) -> tuple[None, jax.Array]:
        return None, sum_reduce_scatter(ct.astype(slot.dtype), layout, axis)

    zero_jax_fetch_secondary.defvjp(fwd, bwd)
    return zero_jax_fetch_secondary(piece, slot)


def zeros_like_piece(layout: LeafLayout, num_shards: int, axis: AxisName, dtype: object) -> jax.Array:
    """A per-device zero array shaped like this device's piece of a leaf."""
    return to_varying(jnp.zeros(shard_shape(layout, num_shards), dtype), axis)  # pyright: ignore[reportArgumentType] - a dtype


#: Why a 2-D leaf is not used from its pieces (:func:`why_not_from_pieces`: :func:`look_up_rows`, the head's
#: cross-entropy in ``_layerwise.head``): it is then gathered whole and used, which is correct but moves and holds
#: the whole leaf.
LOOKUP_NOT_2D = "not a 2-D matrix"
LOOKUP_WHOLE = "kept whole (not partitioned)"
LOOKUP_MODEL = "model-sharded (param_specs)"
LOOKUP_SECONDARY = "hpZ gathers through a secondary partition"
LOOKUP_INT8 = "int8 weight gathers (qwZ)"
LOOKUP_AUTO_AXES = "the mesh has axes left to the compiler"


def why_not_from_pieces(layout: LeafLayout, axis: AxisName) -> str:
    """Empty when a 2-D leaf can be used from this device's piece by plain
    collectives over the shard axes (:func:`look_up_rows`, the head's
    cross-entropy); otherwise why not (one of the ``LOOKUP_*`` reasons)."""
    axes = _axes(axis)
    mesh = jax.sharding.get_abstract_mesh()
    if len(layout.shape) != 2:
        return LOOKUP_NOT_2D
    if layout.dim is None:
        return LOOKUP_WHOLE
    if layout.model and any(m is not None for m in layout.model):
        return LOOKUP_MODEL
    if axes.secondary:
        return LOOKUP_SECONDARY
    if axes.wire.weights is not None and is_real_float(layout.dtype):
        return LOOKUP_INT8
    if any(kind != AxisType.Manual for kind in mesh.axis_types):
        return LOOKUP_AUTO_AXES
    return ""


def _by_columns(piece: jax.Array, layout: LeafLayout, shard: Any, padded_width: int) -> jax.Array:
    """This device's piece of a (rows, width) table as its slice of every
    row: the piece itself when the table is cut on its width, else one
    ``all_to_all`` from a slice of the rows (width padded to
    ``padded_width``, a multiple of N): the piece's own size moved, (N - 1) / N
    of it sent."""
    if layout.dim == 1:
        return piece
    piece = jnp.pad(piece, ((0, 0), (0, padded_width - layout.shape[1])))
    return jax.lax.all_to_all(piece, shard, 1, 0, tiled=True)


def _by_rows(columns: jax.Array, layout: LeafLayout, shard: Any) -> jax.Array:
    """The transpose of :func:`_by_columns`: a slice of every row back to
    this device's (stored, padded) piece of the table."""
    if layout.dim == 1:
        return columns
    return jax.lax.all_to_all(columns, shard, 0, 1, tiled=True)[:, : layout.shape[1]]


def look_up_rows(
    source: jax.Array, slot: jax.Array | None, ids: jax.Array, layout: LeafLayout, axis: AxisName
) -> jax.Array:
    """``table[ids]`` (shape ``ids.shape + (width,)``) from this device's
    piece ``source`` of a partitioned (rows, width) table, without gathering
    the table: every device's ids are all-gathered (integers: small), each
    device looks them up in its slice of every row's width
    (:func:`_by_columns`), and one ``all_to_all`` hands each device its own
    ids' rows, whole: an activation-sized exchange instead of the table's
    all-gather. In the backward pass (with a gradient ``slot``) the
    cotangent takes the same way back, is added into the rows of this
    device's width slice, and (a table cut by rows) one more ``all_to_all``
    turns that into this device's piece of the gradient: already summed
    over every device's ids, so no reduce-scatter follows. Negative ids
    count from the end, ids out of range are clamped (the piece holds no
    row beyond the table's). Only when :func:`why_not_from_pieces` is empty."""
    with jax.named_scope(LOOKUP_SCOPE):  # the library's own use of the piece (the manual step's check reads it)
        return _look_up_rows(source, slot, ids, layout, axis)


#: The name scope of :func:`look_up_rows`.
LOOKUP_SCOPE = "zero_jax_lookup"


def _look_up_rows(
    source: jax.Array, slot: jax.Array | None, ids: jax.Array, layout: LeafLayout, axis: AxisName
) -> jax.Array:
    axes = _axes(axis)
    shard = _name(axes.shard)
    n = jax.lax.axis_size(shard)
    rows, width = layout.shape
    padded_width = -(-width // n) * n  # the width slices of the lookup, one a device
    source = cast_for_wire(source, axis)
    ids = jnp.clip(jnp.where(ids < 0, ids + rows, ids), 0, rows - 1)

    def forward(src: jax.Array) -> tuple[jax.Array, jax.Array]:
        every = jax.lax.all_gather(ids, shard)  # (n, *ids.shape): each device's ids
        columns = _by_columns(src, layout, shard, padded_width)
        found = jnp.take(columns, every, axis=0, mode="clip")  # (n, *ids.shape, padded width / n)
        mine = jax.lax.all_to_all(found, shard, 0, found.ndim - 1, tiled=True)  # (1, *ids.shape, width)
        return mine[0, ..., :width], every

    if slot is None:  # frozen: forward only
        return forward(source)[0]

    @jax.custom_vjp
    def zero_jax_lookup(src: jax.Array, slot: jax.Array) -> jax.Array:
        del slot
        return forward(src)[0]

    def fwd(src: jax.Array, slot: jax.Array) -> tuple[jax.Array, jax.Array]:
        del slot
        return forward(src)

    def bwd(every: jax.Array, ct: jax.Array) -> tuple[None, jax.Array]:
        ct = jnp.pad(ct.astype(slot.dtype), [(0, 0)] * (ct.ndim - 1) + [(0, padded_width - width)])
        back = jax.lax.all_to_all(ct[None], shard, ct.ndim, 0, tiled=True)  # (n, *ids.shape, width / n)
        stored_rows = layout.padded_size if layout.dim == 0 else rows
        columns = jnp.zeros((stored_rows, padded_width // n), slot.dtype)
        columns = columns.at[every.reshape(-1)].add(back.reshape(-1, back.shape[-1]))
        return None, sum_to_varying(_by_rows(columns, layout, shard), varying_axes(slot))

    zero_jax_lookup.defvjp(fwd, bwd)
    return zero_jax_lookup(source, slot)
