"""The llama-style model (zero_jax.models.llama): layer-wise stages 0-3, scanned and unscanned, and
``gather="all"`` train like plain optax; the audit passes; the parameter count is the formula's."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, reference_run, relative_update_error

import zero_jax as zj
from zero_jax.models import (
    LlamaConfig,
    llama_block,
    llama_init_params,
    make_llama_loss_fn,
    synthetic_batch,
    unstack_params,
)

CFG = LlamaConfig(vocab=64, dim=32, depth=2, heads=4, kv_heads=2, seq=16)
STEPS = 3
# float32 throughout. The layer-wise runs differ from plain optax's autodiff in how XLA fuses the backward
# pass (each block's forward recomputed inside zj.scan_layers' custom VJP) and in the order of the gradient's
# sums over 8 devices: float32 ulps in the gradient. Adam divides each gradient by its own root mean square, so
# where a gradient entry is near zero (SwiGLU's gate at initialisation) an ulp moves the update further: the
# worst leaf, mlp_gate, is 1.4e-5 (scanned) and 2.0e-5 (unscanned) relative to its 3-step update; every other
# leaf stays under 3e-6, as the reference transformer's (1e-5) do.
FP32_RTOL = 5e-5


def _batches() -> list[dict[str, jax.Array]]:
    return [synthetic_batch(CFG, 16, jax.random.key(10 + s)) for s in range(STEPS)]


def _params(unscanned: bool = False):
    params = llama_init_params(CFG, jax.random.key(0))
    return unstack_params(params) if unscanned else params


@functools.cache
def _reference(unscanned: bool = False):
    return reference_run(optax.adam(1e-2), _params(unscanned), _batches(), make_llama_loss_fn(CFG))


# One run per (stage, gather, form), shared by the tests below.
@functools.cache
def _run(stage: int, gather: str = "manual", unscanned: bool = False):
    stacked = None if unscanned else "layers"
    policy = zj.ZeroPolicy(stage, make_mesh(8), stacked=stacked, min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_params(unscanned), tx, policy)
    loss_fn = make_llama_loss_fn(CFG, policy if gather == "manual" else None)
    step = zj.make_train_step(loss_fn, tx, policy, gather=gather)
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, step, losses


def _assert_trains_like_optax(state, losses, unscanned: bool = False) -> None:
    ref_params, ref_losses = _reference(unscanned)
    errors = relative_update_error(zj.full_params(state), ref_params, _params(unscanned))
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0] < 5.0  # it learns, from about log(64) = 4.16


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_llama_layerwise_stages_train_like_optax(stage: int) -> None:
    state, step, losses = _run(stage)
    _assert_trains_like_optax(state, losses)
    assert step.jitted._cache_size() == 1


@pytest.mark.slow
def test_llama_unscanned_and_gather_all_train_like_optax() -> None:
    for gather, unscanned in (("manual", True), ("all", False)):
        state, _, losses = _run(3, gather, unscanned)
        _assert_trains_like_optax(state, losses, unscanned)


@functools.cache
def _run_head_chunks():
    # The head and the cross-entropy in 3 vocabulary chunks (zj.head_cross_entropy), the embedding looked up from
    # its pieces (zj.embedding_lookup).
    cfg = dataclasses.replace(CFG, head_chunks=3)
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_params(), tx, policy)
    step = zj.make_train_step(make_llama_loss_fn(cfg, policy), tx, policy, gather="manual")
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, step, losses


def test_llama_with_head_chunks_trains_like_optax() -> None:
    # Layer-wise stage 3 trains like plain optax on the whole-logits loss.
    state, _, losses = _run_head_chunks()
    _assert_trains_like_optax(state, losses)
    with pytest.raises(ValueError, match="head_chunks"):
        LlamaConfig(head_chunks=-1)


def test_llama_with_head_chunks_passes_the_audit() -> None:
    state, step, _ = _run_head_chunks()
    report = zj.audit(step, state, _batches()[0])  # communication within 2% of theory, nothing replicated
    assert report.ok, report


@pytest.mark.slow
def test_llama_stage3_audit_passes() -> None:
    state, step, _ = _run(3)
    report = zj.audit(step, state, _batches()[0])
    assert report.ok, report
    (block,) = report.layers.blocks
    assert (block.layers, block.gathers_per_weight, block.reduces_per_weight) == (CFG.depth, 2.0, 1.0)


def test_llama_parameter_count_is_the_formula() -> None:
    for cfg in (CFG, LlamaConfig(vocab=100, dim=48, depth=3, heads=6, mlp=40), LlamaConfig()):
        shapes = jax.eval_shape(lambda c=cfg: llama_init_params(c, jax.random.key(0)))
        d, kv, f = cfg.dim, cfg.kv_dim, cfg.mlp_dim
        per_layer = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * f  # two norms, q and out, k and v, gate, up and down
        assert (
            sum(x.size for x in jax.tree.leaves(shapes))
            == cfg.num_params()
            == 2 * cfg.vocab * d + d + cfg.depth * per_layer
        )
    assert LlamaConfig(dim=4096, heads=32).mlp_dim == 10928  # 8/3 x 4096 = 10922.7, rounded up to a multiple of 8


@pytest.mark.parametrize(
    ("kw", "words"),
    [({"dim": 30, "heads": 4}, r"2 \* heads"), ({"heads": 4, "kv_heads": 3}, "kv_heads"), ({"depth": 0}, "positive"),
     ({"seq": 64, "attention": "chunked", "attention_chunk": 48}, "divisor of seq"),
     ({"attention": "flash"}, "not one of")],
)
def test_llama_config_refuses_bad_sizes(kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LlamaConfig(**kw)


def test_chunked_attention_is_the_default_attention_and_its_gradient() -> None:
    # float32: the chunked scores are the same dot products as the default's, summed in the same order; what
    # differs is the softmax's max and sum over a chunk's rows (the same rows) and XLA's fusion: a few ulps.
    cfg = dataclasses.replace(CFG, seq=64)
    chunked = dataclasses.replace(cfg, attention="chunked", attention_chunk=16)
    layer = jax.tree.map(lambda a: a[0], llama_init_params(cfg, jax.random.key(0))["layers"])
    x = jax.random.normal(jax.random.key(1), (2, cfg.seq, cfg.dim))

    @functools.partial(jax.jit, static_argnums=2)
    def loss_and_grads(layer, x, c):
        def loss(layer, x):
            out = llama_block(layer, x, heads=c.heads, kv_heads=c.kv_heads, attention=c.attention,
                              attention_chunk=c.attention_chunk)  # fmt: skip
            return jnp.sum(jnp.sin(out))

        return jax.value_and_grad(loss, argnums=(0, 1))(layer, x)

    (got_loss, got_grads), (want_loss, want_grads) = loss_and_grads(layer, x, chunked), loss_and_grads(layer, x, cfg)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        # (entries near zero: within 1e-5 of the leaf's largest gradient entry, a few float32 ulps of it)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@pytest.mark.slow
def test_chunked_attention_trains_like_optax_at_stage_3() -> None:
    # Layer-wise stage 3 with chunked attention against plain optax with the default attention: FP32_RTOL above.
    chunked = dataclasses.replace(CFG, attention="chunked", attention_chunk=4)
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(make_llama_loss_fn(chunked, policy), tx, policy, gather="manual")
    state, losses = zj.init_state(_params(), tx, policy), []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    _assert_trains_like_optax(state, losses)
