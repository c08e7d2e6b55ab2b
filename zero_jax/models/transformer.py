"""A small decoder-only transformer: token and position embeddings, pre-norm
blocks of causal self-attention and an MLP, stacked along a leading layer axis
(``params["layers"]``) and run with ``zj.scan_layers``.

>>> import jax, zero_jax as zj
>>> from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch
>>> cfg = TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=16)
>>> params = init_params(cfg, jax.random.key(0))
>>> params["layers"]["attn_qkv"].shape  # (depth, dim, 3 * dim)
(2, 32, 96)
>>> loss = make_loss_fn(cfg)(params, synthetic_batch(cfg, 8, jax.random.key(1)))
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
from jax.sharding import PartitionSpec

from zero_jax._layerwise.blocks import apply_layers
from zero_jax._layerwise.pieces import gather
from zero_jax._layerwise.scan import scan_layers
from zero_jax._policy.policy import ZeroPolicy

Params = dict[str, Any]


def check_sizes(model: str, sizes: dict[str, Any]) -> None:
    """Every size a positive integer, or one ``ValueError`` naming each that is not (``model``: the config's name)."""
    bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise ValueError(f"{model}: {', '.join(bad)}: every size must be a positive integer.")


def scaled_normal(key: jax.Array, count: int, dtype: Any) -> Callable[[tuple[int, ...], int], jax.Array]:
    """``normal(shape, fan_in)``: a standard normal over sqrt(fan_in) in ``dtype``, each call on the next of
    ``count`` keys split from ``key`` (the models' initialiser)."""
    keys = iter(jax.random.split(key, count))

    def normal(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(next(keys), shape) / math.sqrt(fan_in)).astype(dtype)

    return normal


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The model's shape. ``mlp`` defaults to 4 × ``dim``."""

    vocab: int = 256
    dim: int = 128
    depth: int = 4
    heads: int = 4
    seq: int = 64
    mlp: int | None = None

    @property
    def mlp_dim(self) -> int:
        return self.mlp if self.mlp is not None else 4 * self.dim

    def __post_init__(self) -> None:
        sizes = {"vocab": self.vocab, "dim": self.dim, "depth": self.depth, "heads": self.heads, "seq": self.seq}
        if self.mlp is not None:
            sizes["mlp"] = self.mlp
        check_sizes("TransformerConfig", sizes)
        if self.dim % self.heads:
            raise ValueError(
                f"TransformerConfig: dim={self.dim} must divide by heads={self.heads} (each head gets dim / heads "
                "channels); pick heads among the divisors of dim."
            )

    def num_params(self) -> int:
        d, f = self.dim, self.mlp_dim
        per_layer = 4 * d + 3 * d * d + d * d + d * f + f + f * d + d
        return self.vocab * d + self.seq * d + self.depth * per_layer + 2 * d + d * self.vocab


def init_params(config: TransformerConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random parameters; ``layers`` holds each block's leaves stacked on axis 0."""
    d, f, depth = config.dim, config.mlp_dim, config.depth
    normal = scaled_normal(key, 8, dtype)
    return {
        "embed": {
            "tokens": normal((config.vocab, d), 1),
            "positions": normal((config.seq, d), 1) * 0.1,
        },
        "layers": {
            "norm1_scale": jnp.ones((depth, d), dtype),
            "norm1_bias": jnp.zeros((depth, d), dtype),
            "attn_qkv": normal((depth, d, 3 * d), d),
            "attn_out": normal((depth, d, d), d) / math.sqrt(2 * depth),
            "norm2_scale": jnp.ones((depth, d), dtype),
            "norm2_bias": jnp.zeros((depth, d), dtype),
            "mlp_in": normal((depth, d, f), d),
            "mlp_in_bias": jnp.zeros((depth, f), dtype),
            "mlp_out": normal((depth, f, d), f) / math.sqrt(2 * depth),
            "mlp_out_bias": jnp.zeros((depth, d), dtype),
        },
        "final_norm": {"scale": jnp.ones((d,), dtype), "bias": jnp.zeros((d,), dtype)},
        "head": normal((d, config.vocab), d),
    }


def megatron_specs(axis: str = "model") -> Params:
    """The reference model's tensor-parallel layout (``ZeroPolicy(param_specs=...)``),
    Megatron-style over mesh axis ``axis``: the QKV and MLP-in matrices (and
    the MLP-in bias) split by output column, the attention-out and MLP-out
    matrices by input row, the token embedding and the head by vocabulary,
    the position embedding by channel; norms and the MLP-out bias whole (a
    few thousand parameters). The QKV columns are ``[q | k | v]``, so a model shard holds
    whole heads of none of them: the compiler moves the pieces it needs (a
    layout change the model would make to keep attention local).

    >>> import jax
    >>> from zero_jax.models import megatron_specs
    >>> megatron_specs()["layers"]["mlp_in"], megatron_specs()["layers"]["mlp_out"]
    (P(None, None, 'model'), P(None, 'model', None))
    """
    column, row = PartitionSpec(None, None, axis), PartitionSpec(None, axis, None)
    whole = PartitionSpec()
    return {
        "embed": {"tokens": PartitionSpec(axis, None), "positions": PartitionSpec(None, axis)},
        "layers": {
            "norm1_scale": whole,
            "norm1_bias": whole,
            "attn_qkv": column,
            "attn_out": row,
            "norm2_scale": whole,
            "norm2_bias": whole,
            "mlp_in": column,
            "mlp_in_bias": PartitionSpec(None, axis),
            "mlp_out": row,
            "mlp_out_bias": whole,
        },
        "final_norm": {"scale": whole, "bias": whole},
        "head": PartitionSpec(None, axis),
    }


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def block(layer: Params, x: jax.Array, *, heads: int) -> jax.Array:
    """One pre-norm transformer block on ``x`` of shape (batch, seq, dim)."""
    b, t, d = x.shape
    h = _layer_norm(x, layer["norm1_scale"], layer["norm1_bias"])
    q, k, v = jnp.split(h @ layer["attn_qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // heads)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    attn = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, d)
    x = x + attn @ layer["attn_out"]
    h = _layer_norm(x, layer["norm2_scale"], layer["norm2_bias"])
    h = jax.nn.gelu(h @ layer["mlp_in"] + layer["mlp_in_bias"])
    return x + h @ layer["mlp_out"] + layer["mlp_out_bias"]


def apply(
    config: TransformerConfig,
    params: Params,
    tokens: jax.Array,
    policy: ZeroPolicy | None = None,
    *,
    prefetch: int = 1,
    keep_gathered: int | str = 0,
) -> jax.Array:
    """Logits of shape (batch, seq, vocab) for int tokens of shape (batch, seq).

    With a ``policy`` (inside ``make_train_step(..., gather="manual")``) each
    parameter is gathered just before use: the layers through
    ``zj.scan_layers`` (``zj.apply_layers`` for the unscanned form of
    :func:`unstack_params`), the head inside ``jax.checkpoint`` so that its
    backward pass gathers it again rather than keeping it alive. With
    ``policy=None`` the same code runs on ordinary parameters. ``prefetch``
    and ``keep_gathered`` go to the layer primitive.
    """
    t = tokens.shape[1]
    embed = gather(params["embed"], policy)
    x = embed["tokens"][tokens] + embed["positions"][:t]
    one = functools.partial(block, heads=config.heads)
    x = run_layers(one, params, x, policy, prefetch=prefetch, keep_gathered=keep_gathered)
    norm = gather(params["final_norm"], policy)
    return project_head(_layer_norm(x, norm["scale"], norm["bias"]), params["head"], policy)


def run_layers(
    one: Callable[[Params, jax.Array], jax.Array],
    params: Params,
    x: jax.Array,
    policy: ZeroPolicy | None,
    *,
    prefetch: int,
    keep_gathered: int | str,
) -> jax.Array:
    """Run the blocks on ``x``: ``params["layers"]`` (stacked) through
    ``zj.scan_layers``, or ``params["blocks"]`` (the unscanned form of
    :func:`unstack_params`, a Python list) through ``zj.apply_layers``."""
    if "blocks" in params:
        return apply_layers(one, params["blocks"], x, policy, prefetch=prefetch, keep_gathered=keep_gathered)
    return scan_layers(one, params["layers"], x, policy, prefetch=prefetch, keep_gathered=keep_gathered)


def project_head(x: jax.Array, head: jax.Array, policy: ZeroPolicy | None) -> jax.Array:
    """``x @ head``, the head gathered inside ``jax.checkpoint`` so that its
    backward pass gathers it again rather than keeping it alive."""
    return jax.checkpoint(lambda h, w: h @ gather(w, policy))(x, head)


def next_token_loss(logits: jax.Array, targets: jax.Array, *, one_hot_labels: bool = False) -> jax.Array:
    """Mean cross-entropy of int ``targets`` under ``logits`` (computed in float32);
    ``one_hot_labels`` as in :func:`make_loss_fn`."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if one_hot_labels:
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype), axis=-1))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def model_flops(cfg: TransformerConfig, tokens: int) -> int:
    """Model FLOPs of one training step over ``tokens`` tokens (MFU's
    numerator, no recomputation): 6 Φ tokens + 12 L T D tokens, Φ the
    parameters that enter a matmul (L (4 D² + 2 D F) + D V: the blocks and the
    head; not the embedding lookups, norms or biases), the second term the
    attention scores and values (the full T x T, forward and backward).

    >>> model_flops(TransformerConfig(vocab=256, dim=128, depth=2, seq=64), tokens=64)
    176160768
    """
    d, f, depth = cfg.dim, cfg.mlp_dim, cfg.depth
    phi = depth * (4 * d * d + 2 * d * f) + d * cfg.vocab
    return 6 * phi * tokens + 12 * depth * cfg.seq * d * tokens


def make_loss_fn(
    config: TransformerConfig,
    policy: ZeroPolicy | None = None,
    *,
    prefetch: int = 1,
    keep_gathered: int | str = 0,
    one_hot_labels: bool = False,
) -> Callable[[Params, Any], jax.Array]:
    """``loss_fn(params, batch)``: mean next-token cross-entropy of
    ``batch["tokens"]`` (int, shape (batch, seq + 1)).

    Pass the ``policy`` to train with ``make_train_step(..., gather="manual")``
    (layer-wise ZeRO-3); leave it ``None`` for ``gather="all"`` or evaluation.
    ``one_hot_labels``: pick each target's log-probability with a one-hot mask
    instead of ``take_along_axis`` (what optax's integer-label cross-entropy
    does): the same gradients, bit for bit, the loss to float32 rounding; the
    backward pass is elementwise instead of a scatter, which the TPU compiler
    runs through float32 buffers the size of the logits
    (``benchmarks/tpu_aot.py``'s gspmd section measures both).
    """

    return next_token_loss_fn(apply, config, policy, prefetch=prefetch, keep_gathered=keep_gathered,
                              one_hot_labels=one_hot_labels)  # fmt: skip


def next_token_loss_fn(
    apply_fn: Callable[..., jax.Array],
    config: Any,
    policy: ZeroPolicy | None,
    *,
    prefetch: int,
    keep_gathered: int | str,
    one_hot_labels: bool,
) -> Callable[[Params, Any], jax.Array]:
    """``loss_fn(params, batch)`` of a model's ``apply_fn(config, params, tokens, policy, prefetch=...,
    keep_gathered=...)``: :func:`next_token_loss` of ``batch["tokens"]`` (the models' loss functions)."""

    def loss_fn(params: Params, batch: Any) -> jax.Array:
        tokens = batch["tokens"]
        logits = apply_fn(config, params, tokens[:, :-1], policy, prefetch=prefetch, keep_gathered=keep_gathered)
        return next_token_loss(logits, tokens[:, 1:], one_hot_labels=one_hot_labels)

    return loss_fn


def unstack_params(params: Params) -> Params:
    """The same model written as users often write one: ``params["blocks"]``,
    a Python list of per-block dicts, instead of ``params["layers"]`` stacked on
    a leading axis (``apply`` then runs them with ``zj.apply_layers``).

    >>> import jax
    >>> p = unstack_params(init_params(TransformerConfig(vocab=16, dim=8, depth=3, heads=2, seq=4), jax.random.key(0)))
    >>> len(p["blocks"]), p["blocks"][0]["attn_qkv"].shape, "layers" in p
    (3, (8, 24), False)
    """
    layers = params["layers"]
    depth = jax.tree.leaves(layers)[0].shape[0]
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, "blocks": [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(depth)]}


def synthetic_batch(config: Any, batch_size: int, key: jax.Array) -> dict[str, jax.Array]:
    """A learnable toy language: each sequence counts up from a random start
    with a random stride (mod vocab), so the loss falls well below log(vocab).
    ``config`` is any model config with ``vocab`` and ``seq`` (a
    :class:`TransformerConfig` or a :class:`~zero_jax.models.LlamaConfig`)."""
    k1, k2 = jax.random.split(key)
    start = jax.random.randint(k1, (batch_size, 1), 0, config.vocab)
    stride = jax.random.randint(k2, (batch_size, 1), 1, 4)
    steps = jnp.arange(config.seq + 1)[None, :]
    return {"tokens": ((start + stride * steps) % config.vocab).astype(jnp.int32)}
