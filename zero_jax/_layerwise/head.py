"""The output head and its cross-entropy, a vocabulary chunk at a time, from
the head's pieces: :func:`head_cross_entropy`.

A language model's last matmul (width x vocabulary) is its largest leaf and
its logits (tokens x vocabulary, in float32 for the softmax) its largest
activation. ``zj.gather(head, policy)`` followed by ``log_softmax`` holds the
whole head, its whole gradient and the whole logits on every device. Here the
head's columns are gathered one chunk at a time (the next chunk's gather in
flight while this one's matmul runs), the softmax's normaliser is carried
across chunks (a running max and sum), and the backward pass gathers each
chunk again, recomputes its logits and reduce-scatters its gradient at once:
one chunk of the head and of the logits alive at a time, the same bytes sent
as the gather.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zero_jax._comm import collectives as coll
from zero_jax._layerwise.pieces import Sharded, check_parameter_pieces, gather
from zero_jax._layerwise.schedule import schedule_for, tie
from zero_jax._layerwise.scope import active_policy
from zero_jax._layout.leaf import LeafLayout
from zero_jax._policy.memory import to_device
from zero_jax._policy.policy import ZeroPolicy

BAD_CHUNKS = "zj.head_cross_entropy: chunks={chunks!r} must be a positive integer (vocabulary chunks, e.g. 4)."
BAD_SHAPES = (
    "zj.head_cross_entropy: x of shape {x} and a head of shape {head} do not fit: x's last dimension is the head's "
    "first (x @ head), and targets {targets} are x's shape without the last dimension."
)


def head_cross_entropy(
    x: jax.Array, head: Any, targets: jax.Array, policy: ZeroPolicy | None, *, chunks: int = 4
) -> jax.Array:
    """The cross-entropy of integer ``targets`` under ``x @ head``, per token
    (``targets``' shape, float32), without the whole head or the whole logits.

    ``head`` is a (width, vocabulary) parameter as a manual-gather step hands
    it to ``loss_fn``. In stage 3, when the policy cuts it by vocabulary
    (its larger dimension), each device's piece is split into ``chunks``
    column chunks; chunk *c* of every device is gathered (the gather of chunk
    *c + 1* issued before chunk *c*'s matmul), its logits computed in float32
    and folded into a running max, sum of exponentials and target logit; the
    backward pass gathers each chunk again, recomputes its logits and
    reduce-scatters its gradient (in the reduce dtype) into this device's
    piece at once. Alive at a time: two chunks of the head and one of the
    logits, instead of the whole head, its whole gradient and the whole
    logits (at a 128k vocabulary, width 4096 and 2048 tokens a device:
    1 GiB + 1 GiB + 1 GiB of float32 logits, against a quarter of the head
    and of the logits with ``chunks=4``). Sent: the same as gathering the
    head (twice) and reduce-scattering its gradient. Chunks are gathered in
    an order of the vocabulary of their own; the result does not depend on it.

    Stages 0-2, ``policy=None`` and heads it cannot use so (kept whole, cut
    on the width, model-sharded, hpZ, int8 gathers, a mesh with axes left to
    the compiler): ``x @ zj.gather(head, policy)`` and a float32
    ``log_softmax``, the same values. ``targets`` must lie in
    [0, vocabulary).

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh, min_shard_size=0)
    >>> def loss_fn(params, batch):
    ...     losses = zj.head_cross_entropy(batch["x"], params["head"], batch["y"], policy, chunks=2)
    ...     return jnp.mean(losses)
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> state = zj.init_state({"head": jnp.zeros((8, 64))}, tx, policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    >>> batch = {"x": jnp.ones((jax.device_count(), 8)), "y": jnp.zeros(jax.device_count(), jnp.int32)}
    >>> state, metrics = step(state, batch)
    >>> round(float(metrics["loss"]), 4)  # log(64): uniform over the vocabulary at zero weights
    4.1589
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(BAD_CHUNKS.format(chunks=chunks))
    shape = tuple(getattr(head, "shape", ()))
    if len(shape) != 2 or x.shape[-1] != shape[0] or tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(BAD_SHAPES.format(x=tuple(x.shape), head=shape, targets=tuple(targets.shape)))
    policy = active_policy(policy, "zj.head_cross_entropy")
    if policy is not None and isinstance(head, Sharded):
        check_parameter_pieces(head, policy, "zj.head_cross_entropy")
        layout = head.layout
        if head.gathers and layout.dim == 1 and not coll.why_not_from_pieces(layout, policy.comm):
            source, *slot = head.arrays  # a frozen head has no gradient slot
            with jax.named_scope("zero_jax_head"):  # the library's own use of the piece (the manual step's check)
                return _chunked(x, to_device(source), slot[0] if slot else None, targets, layout, policy, chunks)
    logits = (x @ gather(head, policy)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _chunked(
    x: jax.Array, source: jax.Array, slot: jax.Array | None, targets: jax.Array, layout: LeafLayout,
    policy: ZeroPolicy, chunks: int,
) -> jax.Array:  # fmt: skip
    """:func:`head_cross_entropy` in stage 3 from this device's piece ``source``
    (width, stored vocabulary / N) of a head cut by vocabulary."""
    axes = policy.comm
    shard = axes.shard
    n = jax.lax.axis_size(shard)
    source = coll.cast_for_wire(source, axes)
    width, vocab = layout.shape
    per = source.shape[1]  # this device's columns (the stored, padded vocabulary / N)
    w = -(-per // chunks)  # columns of one chunk of one device's piece (the piece padded to chunks * w)
    seam = schedule_for(policy)
    how = seam.grad_reduction_head or seam.grad_reduction  # the seam's choice: a chunk is layer-sized
    # Chunk c gathers columns [c w, (c + 1) w) of every device's piece: gathered column j = i w + k is vocabulary
    # entry i per + c w + k of device i's piece; a column past the piece's or the vocabulary's end is masked.
    owner, offset = targets // per, targets % per
    t_chunk, t_col = offset // w, owner * w + offset % w
    j = jnp.arange(n * w)

    def valid(c: jax.Array) -> jax.Array:
        k = c * w + j % w
        return (k < per) & ((j // w) * per + k < vocab)

    def pieces(src: jax.Array) -> jax.Array:  # (chunks, width, w)
        src = jnp.pad(src, ((0, 0), (0, chunks * w - per)))
        return jnp.moveaxis(src.reshape(width, chunks, w), 1, 0)

    def gathered(p: jax.Array, c: jax.Array) -> jax.Array:
        return jax.lax.all_gather(p[c], shard, axis=1, tiled=True)  # (width, n w)

    def logits_of(x: jax.Array, whole: jax.Array, c: jax.Array) -> jax.Array:
        z = jnp.einsum("...d,dv->...v", x, whole, preferred_element_type=jnp.float32)
        return jnp.where(valid(c), z, -jnp.inf)

    def forward(x: jax.Array, src: jax.Array) -> tuple[jax.Array, jax.Array]:
        p = pieces(tie(src, x))  # gathered once x exists: not hoisted to the step's start

        def fold(stats: Any, current: jax.Array, c: jax.Array) -> Any:
            top, total, picked = stats
            z = logits_of(x, current, c)
            new_top = jnp.maximum(top, jnp.max(z, axis=-1))
            total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(z - new_top[..., None]), axis=-1)
            here = jnp.take_along_axis(z, t_col[..., None], axis=-1)[..., 0]
            return new_top, total, jnp.where(t_chunk == c, here, picked)

        def body(carry: Any, c: jax.Array) -> tuple[Any, None]:
            stats, current = carry
            upcoming = gathered(p, c + 1)  # in flight during this chunk's matmul
            return (fold(stats, current, c), upcoming), None

        lead = coll.to_varying(jnp.full(targets.shape, -jnp.inf, jnp.float32), axes)
        zero = coll.to_varying(jnp.zeros(targets.shape, jnp.float32), axes)
        start = ((lead, zero, zero), gathered(p, jnp.zeros((), jnp.int32)))
        (stats, last), _ = jax.lax.scan(body, start, jnp.arange(chunks - 1))
        top, total, picked = fold(stats, last, jnp.asarray(chunks - 1))
        lse = top + jnp.log(total)
        return lse - picked, lse

    def backward(
        x: jax.Array, src: jax.Array, lse: jax.Array, ct: jax.Array, dtype: Any
    ) -> tuple[jax.Array, jax.Array | None]:
        p = pieces(tie(src, ct))  # gathered again once the cotangent exists: not merged with the forward's gathers

        def chunk(dx: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array | None]:
            whole = gathered(p, c)
            z = logits_of(x, whole, c)
            g = jnp.exp(z - lse[..., None]) - ((t_chunk == c)[..., None] & (j == t_col[..., None]))
            g = g * ct[..., None]
            dx = dx + jnp.einsum("...v,dv->...d", g.astype(whole.dtype), whole, preferred_element_type=jnp.float32)
            if dtype is None:
                return dx, None
            dw = jnp.einsum("...d,...v->dv", x, g.astype(x.dtype), preferred_element_type=jnp.float32)
            return dx, dw.astype(dtype)

        dx = coll.to_varying(jnp.zeros(x.shape, jnp.float32), axes)
        if dtype is None:  # a frozen head: its input's cotangent only
            dx, _ = jax.lax.scan(lambda dx, c: (chunk(dx, c)[0], None), dx, jnp.arange(chunks))
            return dx.astype(x.dtype), None

        def body(carry: Any, c: jax.Array) -> tuple[Any, jax.Array]:
            dx, pending = carry
            reduced = coll.scatter_sum(pending, shard, 1, how)  # chunk c - 1's gradient, in flight during chunk c
            return chunk(dx, c), reduced

        dx, first = chunk(dx, jnp.zeros((), jnp.int32))
        (dx, last), reduced = jax.lax.scan(body, (dx, first), jnp.arange(1, chunks))
        reduced = jnp.concatenate([reduced, coll.scatter_sum(last, shard, 1, how)[None]])  # (chunks, width, w)
        return dx.astype(x.dtype), jnp.moveaxis(reduced, 0, 1).reshape(width, chunks * w)[:, :per]

    return _differentiable(forward, backward, x, source, slot)


def _differentiable(forward: Any, backward: Any, x: jax.Array, source: jax.Array, slot: jax.Array | None) -> jax.Array:
    """``forward(x, source)[0]`` (the per-token losses) as a custom VJP:
    ``backward(x, source, lse, ct, dtype)`` gives ``x``'s cotangent and, with
    a gradient ``slot``, the piece's gradient (in ``slot``'s dtype); none for
    ``source`` itself (the piece: its gradient goes to the slot)."""
    if slot is None:

        @jax.custom_vjp
        def zero_jax_head_frozen(x: jax.Array, src: jax.Array) -> jax.Array:
            return forward(x, src)[0]

        def fwd_frozen(x: jax.Array, src: jax.Array) -> tuple[jax.Array, Any]:
            losses, lse = forward(x, src)
            return losses, (x, src, lse)

        def bwd_frozen(res: Any, ct: jax.Array) -> tuple[jax.Array, None]:
            return backward(*res, ct, None)[0], None

        zero_jax_head_frozen.defvjp(fwd_frozen, bwd_frozen)
        return zero_jax_head_frozen(x, source)

    @jax.custom_vjp
    def zero_jax_head(x: jax.Array, src: jax.Array, slot_: jax.Array) -> jax.Array:
        return forward(x, src)[0]

    def fwd(x: jax.Array, src: jax.Array, slot_: jax.Array) -> tuple[jax.Array, Any]:
        losses, lse = forward(x, src)
        return losses, (x, src, lse)

    def bwd(res: Any, ct: jax.Array) -> tuple[jax.Array, None, jax.Array]:
        dx, dw = backward(*res, ct, slot.dtype)
        return dx, None, coll.sum_to_varying(dw, coll.varying_axes(slot))  # pyright: ignore[reportArgumentType] - a slot's gradient

    zero_jax_head.defvjp(fwd, bwd)
    return zero_jax_head(x, source, slot)
