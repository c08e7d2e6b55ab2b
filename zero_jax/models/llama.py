"""A llama-style decoder: untied token embedding and head, pre-norm blocks of
RMSNorm, causal self-attention with rotary positions (grouped-query when
``kv_heads < heads``) through ``jax.nn.dot_product_attention``, and a SwiGLU
MLP; no biases. The blocks are stacked along a leading layer axis
(``params["layers"]``, run with ``zj.scan_layers``), or a Python list with
:func:`~zero_jax.models.unstack_params` (run with ``zj.apply_layers``).

The model of MaxText's and Meta's llama-2 family, written like the reference
transformer (:mod:`zero_jax.models.transformer`): the same ``synthetic_batch``,
``unstack_params``, and loss.

>>> import jax
>>> from zero_jax.models import LlamaConfig, llama_init_params, make_llama_loss_fn, synthetic_batch
>>> cfg = LlamaConfig(vocab=64, dim=32, depth=2, heads=4, kv_heads=2, seq=16)
>>> params = llama_init_params(cfg, jax.random.key(0))
>>> params["layers"]["attn_k"].shape, cfg.mlp_dim  # (depth, dim, kv_heads * head_dim); 8/3 dim, rounded up to 8
((2, 32, 16), 88)
>>> sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
True
>>> loss = make_llama_loss_fn(cfg)(params, synthetic_batch(cfg, 8, jax.random.key(1)))
>>> bool(3.0 < float(loss) < 5.0)  # about log(64) at initialisation
True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zero_jax._layerwise.head import head_cross_entropy
from zero_jax._layerwise.pieces import embedding_lookup, gather
from zero_jax._policy.policy import ZeroPolicy
from zero_jax.models.transformer import check_sizes, next_token_loss_fn, project_head, run_layers, scaled_normal

Params = dict[str, Any]
#: The attention implementations of :class:`LlamaConfig` (its docstring).
ATTENTIONS = ("default", "chunked")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The llama model's shape. ``kv_heads`` defaults to ``heads`` (multi-head
    attention; fewer is grouped-query attention); ``mlp`` (the SwiGLU hidden
    width) to 8/3 × ``dim`` rounded up to a multiple of 8; ``rope_base`` is the
    rotary frequency base (llama-2's 10000). ``attention``: ``"default"``,
    ``jax.nn.dot_product_attention``'s own choice (XLA's, which holds the whole
    (heads, seq, seq) score matrix, on CPU and TPU; cuDNN's flash attention
    where it applies on GPU), or ``"chunked"``: the queries in chunks of
    ``attention_chunk`` (a divisor of ``seq``) run one after another, each
    chunk's scores recomputed in the backward pass, so at most (heads,
    ``attention_chunk``, seq) scores are alive on any backend (the memory a
    flash-attention kernel saves, as MaxText's on TPU, in plain JAX; the same
    FLOPs as ``"default"`` plus the recompute). ``head_chunks``: 0 computes
    the whole logits and then the loss; k > 0 computes the loss of
    :func:`make_llama_loss_fn` with :func:`zero_jax.head_cross_entropy` in k
    vocabulary chunks (in layer-wise stage 3 the head is never whole, nor
    are the logits)."""

    vocab: int = 256
    dim: int = 128
    depth: int = 4
    heads: int = 4
    seq: int = 64
    kv_heads: int | None = None
    mlp: int | None = None
    rope_base: float = 10000.0
    attention: str = "default"
    attention_chunk: int = 512
    head_chunks: int = 0

    @property
    def mlp_dim(self) -> int:
        return self.mlp if self.mlp is not None else 8 * math.ceil(8 * self.dim / 24)

    @property
    def kv_dim(self) -> int:
        """The width of the key (and of the value) projection."""
        return (self.kv_heads or self.heads) * (self.dim // self.heads)

    def __post_init__(self) -> None:
        sizes = {"vocab": self.vocab, "dim": self.dim, "depth": self.depth, "heads": self.heads, "seq": self.seq}
        sizes |= {k: v for k, v in (("kv_heads", self.kv_heads), ("mlp", self.mlp)) if v is not None}
        check_sizes("LlamaConfig", sizes)
        if self.dim % (2 * self.heads):
            raise ValueError(
                f"LlamaConfig: dim={self.dim} must divide by 2 * heads={2 * self.heads} (each head gets an even "
                "number of channels for its rotary pairs); pick heads so that dim / heads is even."
            )
        if self.heads % (self.kv_heads or self.heads):
            raise ValueError(
                f"LlamaConfig: heads={self.heads} must divide by kv_heads={self.kv_heads} (each key/value head "
                "serves a whole group of query heads); pick kv_heads among the divisors of heads."
            )
        if self.attention not in ATTENTIONS:
            raise ValueError(f"LlamaConfig: attention={self.attention!r} is not one of {ATTENTIONS}.")
        if self.attention == "chunked" and (self.attention_chunk < 1 or self.seq % self.attention_chunk):
            raise ValueError(
                f"LlamaConfig: attention='chunked' needs attention_chunk={self.attention_chunk} to divide "
                f"seq={self.seq}; pick a divisor of seq (e.g. {math.gcd(self.seq, 512)})."
            )
        if self.head_chunks < 0:
            raise ValueError(f"LlamaConfig: head_chunks={self.head_chunks} must be 0 (whole logits) or positive.")
        if not self.rope_base > 0:
            raise ValueError(f"LlamaConfig: rope_base={self.rope_base!r} must be positive (llama-2 uses 10000).")

    def num_params(self) -> int:
        d, kv, f = self.dim, self.kv_dim, self.mlp_dim
        per_layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * f
        return self.vocab * d + self.depth * per_layer + d + d * self.vocab


def llama_init_params(config: LlamaConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random parameters; ``layers`` holds each block's leaves stacked on axis 0."""
    d, kv, f, depth = config.dim, config.kv_dim, config.mlp_dim, config.depth
    normal = scaled_normal(key, 9, dtype)
    return {
        "embed": normal((config.vocab, d), 1),
        "layers": {
            "attn_norm": jnp.ones((depth, d), dtype),
            "attn_q": normal((depth, d, d), d),
            "attn_k": normal((depth, d, kv), d),
            "attn_v": normal((depth, d, kv), d),
            "attn_out": normal((depth, d, d), d) / math.sqrt(2 * depth),
            "mlp_norm": jnp.ones((depth, d), dtype),
            "mlp_gate": normal((depth, d, f), d),
            "mlp_up": normal((depth, d, f), d),
            "mlp_down": normal((depth, f, d), f) / math.sqrt(2 * depth),
        },
        "final_norm": jnp.ones((d,), dtype),
        "head": normal((d, config.vocab), d),
    }


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm, computed in float32 (llama's), returned in ``x``'s dtype."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + 1e-5)
    return (h * scale.astype(jnp.float32)).astype(x.dtype)


def _rotate(x: jax.Array, base: float) -> jax.Array:
    """Rotary positions on ``x`` of shape (batch, seq, heads, channels): the
    channel halves rotated as pairs by an angle that grows with the position."""
    t, c = x.shape[1], x.shape[-1]
    freq = base ** (-jnp.arange(0, c, 2, dtype=jnp.float32) / c)
    angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]  # (seq, channels / 2)
    angle = jnp.concatenate([angle, angle], axis=-1)[None, :, None, :]
    cos, sin = jnp.cos(angle).astype(x.dtype), jnp.sin(angle).astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-second, first], axis=-1) * sin


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, attention: str, chunk: int) -> jax.Array:
    """Causal attention of (batch, seq, heads, channels) queries over keys and values with ``heads`` or fewer
    (grouped-query) heads, by ``attention`` (:data:`ATTENTIONS`)."""
    if attention == "default":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)
    b, t, h, c = q.shape
    kv = k.shape[2]
    positions = jnp.arange(t)

    @jax.checkpoint  # the backward pass recomputes one chunk's scores at a time
    def one(qi: jax.Array, start: jax.Array) -> jax.Array:
        grouped = qi.reshape(b, chunk, kv, h // kv, c)  # each key/value head serves h / kv query heads
        scores = jnp.einsum("bqkgc,bskc->bkgqs", grouped, k, preferred_element_type=jnp.float32) / math.sqrt(c)
        causal = (start + positions[:chunk])[:, None] >= positions[None, :]
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
        return jnp.einsum("bkgqs,bskc->bqkgc", probs, v).reshape(b, chunk, h, c)

    chunks = q.reshape(b, t // chunk, chunk, h, c).swapaxes(0, 1)
    out = jax.lax.map(lambda xs: one(*xs), (chunks, jnp.arange(0, t, chunk)))
    return out.swapaxes(0, 1).reshape(b, t, h, c)


def llama_block(
    layer: Params,
    x: jax.Array,
    *,
    heads: int,
    kv_heads: int | None = None,
    rope_base: float = 10000.0,
    attention: str = "default",
    attention_chunk: int = 512,
) -> jax.Array:
    """One llama block on ``x`` of shape (batch, seq, dim). The attention is
    causal, by ``attention`` and ``attention_chunk`` (:class:`LlamaConfig`'s:
    ``"default"``, ``jax.nn.dot_product_attention``; ``"chunked"``, the
    queries a chunk at a time)."""
    b, t, d = x.shape
    c = d // heads
    h = _rms_norm(x, layer["attn_norm"])
    q = _rotate((h @ layer["attn_q"]).reshape(b, t, heads, c), rope_base)
    k = _rotate((h @ layer["attn_k"]).reshape(b, t, kv_heads or heads, c), rope_base)
    v = (h @ layer["attn_v"]).reshape(b, t, kv_heads or heads, c)
    attn = _attend(q, k, v, attention, attention_chunk).reshape(b, t, d)
    x = x + attn @ layer["attn_out"]
    h = _rms_norm(x, layer["mlp_norm"])
    return x + (jax.nn.silu(h @ layer["mlp_gate"]) * (h @ layer["mlp_up"])) @ layer["mlp_down"]


def llama_apply(
    config: LlamaConfig,
    params: Params,
    tokens: jax.Array,
    policy: ZeroPolicy | None = None,
    *,
    prefetch: int = 1,
    keep_gathered: int | str = 0,
    head: bool = True,
) -> jax.Array:
    """Logits of shape (batch, seq, vocab) for int tokens of shape (batch, seq);
    ``policy``, ``prefetch`` and ``keep_gathered`` as in the reference
    transformer's (each parameter gathered just before use; the token
    embedding is not gathered: :func:`zero_jax.embedding_lookup`).
    ``head=False``: what the head sees instead, the blocks' output after the
    final norm, of shape (batch, seq, dim)."""
    x = embedding_lookup(params["embed"], tokens, policy)
    one = functools.partial(llama_block, heads=config.heads, kv_heads=config.kv_heads, rope_base=config.rope_base,
                            attention=config.attention, attention_chunk=config.attention_chunk)  # fmt: skip
    x = run_layers(one, params, x, policy, prefetch=prefetch, keep_gathered=keep_gathered)
    x = _rms_norm(x, gather(params["final_norm"], policy))
    return project_head(x, params["head"], policy) if head else x


def make_llama_loss_fn(
    config: LlamaConfig,
    policy: ZeroPolicy | None = None,
    *,
    prefetch: int = 1,
    keep_gathered: int | str = 0,
    one_hot_labels: bool = False,
) -> Callable[[Params, Any], jax.Array]:
    """``loss_fn(params, batch)``: mean next-token cross-entropy of
    ``batch["tokens"]`` (int, shape (batch, seq + 1)), as
    :func:`~zero_jax.models.make_loss_fn` for the reference transformer: pass
    the ``policy`` for ``gather="manual"`` (layer-wise ZeRO-3), ``None`` for
    ``gather="all"`` or evaluation. With ``config.head_chunks`` the head and
    the cross-entropy run together, a vocabulary chunk at a time
    (:func:`zero_jax.head_cross_entropy`; ``one_hot_labels`` has no effect)."""
    if config.head_chunks:

        def loss_fn(params: Params, batch: Any) -> jax.Array:
            tokens = batch["tokens"]
            x = llama_apply(config, params, tokens[:, :-1], policy, prefetch=prefetch, keep_gathered=keep_gathered,
                            head=False)  # fmt: skip
            return jnp.mean(head_cross_entropy(x, params["head"], tokens[:, 1:], policy, chunks=config.head_chunks))

        return loss_fn
    return next_token_loss_fn(llama_apply, config, policy, prefetch=prefetch, keep_gathered=keep_gathered,
                              one_hot_labels=one_hot_labels)  # fmt: skip
