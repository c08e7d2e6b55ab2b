"""Encoder-decoder shapes under the layer-wise ZeRO-3 schedule (issue 29, CORE.md B and C).

B: a decoder block's first argument (the target embedding) exists at the program's start, beside the encoder
output; its forward gathers must still wait for the encoder. C: the audit counts layers alive by their bytes, so a
tiny piece of a block (a norm weight) kept alive to the program's end is not counted as a whole layer."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, reference_run, relative_update_error, t5, t5_batches, t5_loss

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
    assert max(gap.values()) <= 1e-5, gap  # fp32, Adam lr 1e-2, 2 steps of 16 rows: reduction order (measured 9.2e-7)


def test_layers_alive_counts_a_named_block_by_the_bytes_of_it_alive() -> None:
    # Block 0's 64-element weight dies after d0; its 2-element norm weight n0 lives to the ROOT (XLA:CPU fused the
    # norm weights of every block into one op at the end of a T5 step). Block 1 is whole while n0 is alive.
    lines = [
        "ENTRY %main (p: f32[1,8], q: f32[2]) -> f32[2,8] {",
        "  %p = f32[1,8] parameter(0)", "  %q = f32[2] parameter(1)",
        "  %w0 = f32[8,8] all-gather(%p)", "  %n0 = f32[2] all-gather(%q)",
        "  %d0 = f32[2,8] dot(%p, %w0)", "  %w1 = f32[8,8] all-gather(%p)",
        "  %d1 = f32[2,8] dot(%d0, %w1)", "  ROOT %out = (f32[2,8], f32[2]) tuple(%d1, %n0)", "}",
    ]  # fmt: skip
    block = {"w0": 0, "n0": 0, "w1": 1}
    alive = measure.layers_alive("\n".join(lines), lambda ins: ("block", block[ins.name], "forward"), 64)
    assert alive.layers == 1, alive  # base commit: 2 (block 0 counted whole while only n0 was alive)


@pytest.mark.slow  # two compiles of a depth-4 T5 step (the test's and the audit's own)
def test_t5_layerwise_step_holds_at_most_two_layers_and_gathers_in_block_order() -> None:
    model, variables = t5(4)
    adapted = zj.adapters.from_linen(model, variables, t5_loss(model), layers="auto")
    policy = adapted.policy(3, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step, state, batch = adapted.make_train_step(tx, policy), adapted.init_state(tx, policy), t5_batches(1)[0]
    gathers, _ = forward_order(step.lower(state, batch).compile().as_text())
    # B: blocks 0-3 the encoder's, 4-7 the decoder's. Base commit: decoder block 1 (block 5) was gathered first,
    # at the program's start (its prefetch waited for decoder block 0's first argument, the target embedding).
    assert sorted(gathers) == list(range(8))
    assert [gathers[i] for i in range(8)] == sorted(gathers.values()), gathers
    # C: base commit: max_alive 8 and check() failed ("holds 8 whole layers at once"): each block's backward
    # re-gather of its (32,) norm weight is alive to the end of the program (all 8 feed one fusion there).
    # grads=False: measuring the gradient compiles a third program; tests/test_users_t5.py's audit checks the T5
    # gradient pieces (stages 2 and 3).
    report = zj.audit(step, state, batch, grads=False).check()
    assert report.layers.judged and report.layers.max_alive <= 2, report.layers
