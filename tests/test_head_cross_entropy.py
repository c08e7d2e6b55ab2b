"""``zj.head_cross_entropy``: a language model's head and cross-entropy a vocabulary chunk at a time from the
head's ZeRO-3 pieces. It trains like plain optax (the head, and the layers below through its input's gradient)
for heads cut by vocabulary, evenly or padded, in any number of chunks; a frozen head still passes its input's
gradient; other stages and layouts give ``log_softmax``'s values; its program never gathers the whole head and
holds less than the gather it replaces; bad chunks and shapes are refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import assert_trains_frozen_like, assert_trains_like, make_mesh, reference_run, train_steps

import zero_jax as zj
from zero_jax import measure

STEPS = 3
# float32 throughout. The chunked softmax adds the same exponentials as log_softmax in another order (a running
# max and sum over chunks) and the head's gradient sums the same products in another order (per chunk, then
# reduce-scattered): float32 ulps; Adam's updates agree to a few ulps of their size (worst leaf measured 2e-6).
FP32_RTOL = 1e-5

# (width, vocab) -> the dimension the policy cuts on 8 devices: the vocabulary, evenly (64 -> 8 columns a device)
# or padded (50 -> 56: 7 columns a device, the last device's last 6 past the vocabulary); or the width (fallback).
HEADS = {(16, 64): 1, (12, 50): 1, (64, 16): 0}


def _params(width: int, vocab: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"embed": jax.random.normal(k1, (40, width)), "head": jax.random.normal(k2, (width, vocab)) / width**0.5}


def _batches(vocab: int) -> list[dict[str, jax.Array]]:
    keys = [jax.random.split(jax.random.key(10 + s)) for s in range(STEPS)]
    return [{"ids": jax.random.randint(k1, (16, 3), 0, 40), "y": jax.random.randint(k2, (16, 3), 0, vocab)}
            for k1, k2 in keys]  # fmt: skip


def _loss(policy: zj.ZeroPolicy | None, chunks: int = 4):
    def loss_fn(params, batch):
        x = jnp.tanh(zj.embedding_lookup(params["embed"], batch["ids"], policy))
        return jnp.mean(zj.head_cross_entropy(x, params["head"], batch["y"], policy, chunks=chunks))

    return loss_fn


def _plain(params, batch):
    logits = jnp.tanh(params["embed"][batch["ids"]]) @ params["head"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][..., None], axis=-1))


@functools.cache
def _reference(width: int, vocab: int):
    return reference_run(optax.adam(1e-2), _params(width, vocab), _batches(vocab), _plain)


def _train(stage: int, width: int, vocab: int, chunks: int = 4, gather: str = "manual", trainable=None):
    policy = zj.ZeroPolicy(stage, make_mesh(8), min_shard_size=0)
    loss_fn = _loss(policy if gather == "manual" else None, chunks)
    state, _, losses = train_steps(policy, _params(width, vocab), loss_fn, _batches(vocab), gather=gather,
                                   trainable=trainable)  # fmt: skip
    return policy, state, losses


def _assert_like_optax(state, losses, width: int, vocab: int) -> None:
    assert_trains_like(state, losses, _reference(width, vocab), _params(width, vocab), FP32_RTOL)


@pytest.mark.parametrize(("width", "vocab", "chunks"), [(16, 64, 1), (16, 64, 4), (16, 64, 3), (12, 50, 2),
                                                         (12, 50, 7), (64, 16, 4)])  # fmt: skip
def test_stage3_head_trains_like_optax(width: int, vocab: int, chunks: int) -> None:
    policy, state, losses = _train(3, width, vocab, chunks)
    assert policy.leaf_layout(jnp.zeros((width, vocab)), stacked=False).dim == HEADS[(width, vocab)]
    _assert_like_optax(state, losses, width, vocab)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_other_stages_and_gather_all(stage: int) -> None:
    for gather in ("manual", "all"):
        _, state, losses = _train(stage, 16, 64, gather=gather)
        _assert_like_optax(state, losses, 16, 64)


def test_a_frozen_head_passes_its_inputs_gradient() -> None:
    frozen = {"embed": True, "head": False}
    _, state, losses = _train(3, 16, 64, trainable=frozen)
    assert_trains_frozen_like(state, losses, _params(16, 64), _batches(64), _plain, frozen, FP32_RTOL)


def _compiled(chunked: bool, width: int, vocab: int):
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(_params(width, vocab), tx, policy)

    def loss_fn(params, batch):
        x = jnp.tanh(zj.embedding_lookup(params["embed"], batch["ids"], policy))
        if chunked:
            return jnp.mean(zj.head_cross_entropy(x, params["head"], batch["y"], policy, chunks=8))
        # As zero_jax.models' project_head: gathered inside jax.checkpoint, so that the backward pass gathers it
        # again rather than keeping it alive from the forward pass.
        logp = jax.nn.log_softmax(jax.checkpoint(lambda h, w: h @ zj.gather(w, policy))(x, params["head"]))
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], axis=-1))

    return zj.make_train_step(loss_fn, tx, policy, gather="manual"), state


def test_the_head_is_gathered_a_chunk_at_a_time() -> None:
    width, vocab = 64, 8192  # 2 MiB of float32 head; 8 chunks: each gathered chunk is 256 KiB
    head = width * vocab * 4
    batch = _batches(vocab)[0]
    step, state = _compiled(True, width, vocab)
    colls = measure.collectives(step.jitted, state, batch)
    head_moves = [c for c in colls if c.kind in ("all-gather", "reduce-scatter") and c.bytes >= head // 8]
    assert head_moves and all(c.bytes == head // 8 for c in head_moves), head_moves
    # Each chunk gathered twice (forward, backward) and reduce-scattered once: the gather's bytes, in 8 pieces.
    assert sum(c.trips for c in head_moves) == 3 * 8
    step_g, state_g = _compiled(False, width, vocab)
    gathered = measure.collectives(step_g.jitted, state_g, batch)
    assert measure.ring_bytes(head_moves) == pytest.approx(
        measure.ring_bytes(c for c in gathered if c.bytes >= head), rel=1e-6
    )
    # Memory: the gather holds the whole head and its whole gradient (and the whole logits); the chunks do not.
    chunked = measure.memory(step.lower(state, batch).compile())
    whole = measure.memory(step_g.lower(state_g, batch).compile())
    assert whole["temp"] - chunked["temp"] >= head, (whole, chunked)


@pytest.mark.parametrize(("kw", "words"), [({"chunks": 0}, "positive integer"), ({"chunks": 2.0}, "positive"),
                                           ({"targets": jnp.zeros((2, 4), jnp.int32)}, "do not fit")])  # fmt: skip
def test_bad_chunks_and_shapes_are_refused(kw: dict, words: str) -> None:
    args = {"x": jnp.ones((2, 3, 16)), "head": jnp.ones((16, 64)), "targets": jnp.zeros((2, 3), jnp.int32)}
    chunks = kw.pop("chunks", 4)
    with pytest.raises(ValueError, match=words):
        zj.head_cross_entropy(**(args | kw), policy=None, chunks=chunks)
