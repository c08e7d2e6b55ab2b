"""Encoder-decoder shapes under the layer-wise ZeRO-3 schedule (issue 29, CORE.md B).

A decoder block's first argument (the target embedding) exists at the program's start, beside the encoder
output; its forward gathers must still wait for the encoder."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, reference_run, relative_update_error

import zero_jax as zj
from zero_jax import measure

D, DEPTH = 32, 3


def _enc(p: dict, carry: tuple) -> tuple:
    tgt, x = carry
    return tgt, x + jnp.tanh(x @ p["w"]) @ p["v"]


def _dec(p: dict, carry: tuple) -> tuple:
    h, enc = carry  # h: the target embedding for the first decoder block
    return h + jnp.tanh(h @ p["w"] + enc @ p["c"]) @ p["v"], enc


def _loss(policy: zj.ZeroPolicy | None, prefetch: int):
    def loss_fn(params: dict, batch: dict) -> jax.Array:
        # One chain: encoder blocks 0-2, then decoder blocks 3-5 (the carry's first leaf: the target, then h).
        fns = [_enc] * DEPTH + [_dec] * DEPTH
        h, _ = zj.apply_layers(fns, params["blocks"], (batch["tgt"], batch["src"]), policy, prefetch=prefetch)
        return jnp.mean((h - batch["y"]) ** 2)

    return loss_fn


def _params() -> dict:
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32)  # noqa: E731
    enc = [{"w": w(D, D), "v": w(D, D)} for _ in range(DEPTH)]
    dec = [{"w": w(D, D), "c": w(D, D), "v": w(D, D)} for _ in range(DEPTH)]
    return {"blocks": enc + dec}


def _batch(seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.normal(size=(16, D)), jnp.float32) for k in ("src", "tgt", "y")}


def forward_order(text: str) -> tuple[dict[int, int], dict[int, int]]:
    """Per block: the entry-schedule position of its first forward all-gather, and of its first forward compute
    op (read from the names the step gives them: ``zj_block<i>_gather`` / ``zj_block<i>_compute``; a backward op
    sits under ``transpose(``)."""
    comps, entry, _ = measure.scheduled_computations(text)
    gathers: dict[int, int] = {}
    computes: dict[int, int] = {}
    for t, ins in enumerate(comps[entry]):
        if "transpose(" in ins.op_name:
            continue
        named = re.findall(r"zj_block(\d+)_gather", ins.op_name)
        if ins.op.startswith("all-gather") and named:
            gathers.setdefault(int(named[-1]), t)
        elif not named and (computed := re.findall(r"zj_block(\d+)_compute", ins.op_name)):
            computes.setdefault(int(computed[-1]), t)
    return gathers, computes


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_decoder_block_gathers_only_after_the_encoder_ran(prefetch: int) -> None:
    # Base commit (the anchor was the first argument leaf, here the target, there at the program's start): every
    # gather hoisted; prefetch 0: gathers of blocks 0-3 at entry positions 73, 72, 71, 69, block 0's first compute
    # at 81 (prefetch 1: block 2 gathered at 76, block 0 computed at 87).
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    params, batch = _params(), _batch()
    step = zj.make_train_step(_loss(policy, prefetch), tx, policy, gather="manual")
    state = zj.init_state(params, tx, policy)
    gathers, computes = forward_order(step.lower(state, batch).compile().as_text())
    assert sorted(gathers) == sorted(computes) == list(range(2 * DEPTH)), (gathers, computes)
    # Block i's gather is due with the inputs of the block that issues it (i itself, or i - prefetch): after
    # block i - 1 - prefetch computed them. In particular no decoder block is gathered before the encoder ran.
    for i in range(1 + prefetch, 2 * DEPTH):
        assert gathers[i] > computes[i - 1 - prefetch], (i, gathers, computes)
    assert min(gathers[i] for i in range(DEPTH, 2 * DEPTH)) > computes[DEPTH - 1 - prefetch]
    # The tie changes no bit: two steps train like plain optax on one device.
    batches = [batch, _batch(2)]
    for b in batches:
        state, _ = step(state, b)
    ref, _ = reference_run(optax.adam(1e-2), params, batches, _loss(None, prefetch))
    gap = relative_update_error(zj.full_params(state), ref, params)
    assert max(gap.values()) <= 1e-5, gap  # fp32, Adam lr 1e-2, 2 steps of 16 rows: reduction order only
