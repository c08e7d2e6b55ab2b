"""``zj.embedding_lookup``: a token embedding indexed from its ZeRO-3 pieces without gathering the table. It trains
like plain optax for tables cut by rows and by width, padded or not, with negative ids; its
program moves the batch's ids and rows, never the table whole; it holds less than the gather it replaces; and
every other case (stages 0-2, ``policy=None``, hpZ, frozen tables) gives ``table[ids]``'s values."""

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
OUT = 4
# float32 throughout. Each row's gradient is the same sum of the same products either way; what differs is the
# order of that sum (all devices' ids added on the owner of a width slice, against each device's own ids summed
# and then reduce-scattered): float32 ulps in the gradient, and Adam divides by the gradient's own root mean
# square, so the updates agree to a few ulps of their size.
FP32_RTOL = 1e-5

# (rows, width) -> the dimension the policy cuts on 8 devices (the rule in zero_jax._layout.leaf): by rows or by
# width, evenly or padded (50 rows -> 56; 50 wide -> 56, and 12 wide padded to 16 for the all_to_all).
TABLES = {(64, 16): 0, (16, 64): 1, (50, 12): 0, (12, 50): 1}


def _params(rows: int, width: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"embed": jax.random.normal(k1, (rows, width)), "w": jax.random.normal(k2, (width, OUT)) / width**0.5}


def _batches(rows: int) -> list[dict[str, jax.Array]]:
    out = []
    for s in range(STEPS):
        k1, k2 = jax.random.split(jax.random.key(10 + s))
        # Negative ids count from the end, as in table[ids].
        ids = jax.random.randint(k1, (16, 3), -rows, rows)
        out.append({"ids": ids, "y": jax.random.normal(k2, (16, 3, OUT))})
    return out


def _loss(policy: zj.ZeroPolicy | None):
    def loss_fn(params, batch):
        x = zj.embedding_lookup(params["embed"], batch["ids"], policy)
        w = zj.gather(params["w"], policy)
        return jnp.mean((jnp.tanh(x) @ w - batch["y"]) ** 2)

    return loss_fn


def _policy(stage: int, **kw) -> zj.ZeroPolicy:
    return zj.ZeroPolicy(stage, kw.pop("mesh", None) or make_mesh(8), min_shard_size=0, **kw)


@functools.cache
def _reference(rows: int, width: int):
    return reference_run(optax.adam(1e-2), _params(rows, width), _batches(rows), _loss(None))


def _train(policy: zj.ZeroPolicy, rows: int, width: int, gather: str = "manual", trainable=None):
    loss_fn = _loss(policy if gather == "manual" else None)
    return train_steps(policy, _params(rows, width), loss_fn, _batches(rows), gather=gather, trainable=trainable)


def _assert_like_optax(state, losses, rows: int, width: int) -> None:
    assert_trains_like(state, losses, _reference(rows, width), _params(rows, width), FP32_RTOL)


@pytest.mark.parametrize(("rows", "width"), list(TABLES))
def test_stage3_lookup_trains_like_optax(rows: int, width: int) -> None:
    policy = _policy(3)
    assert policy.leaf_layout(jnp.zeros((rows, width)), stacked=False).dim == TABLES[(rows, width)]
    state, _, losses = _train(policy, rows, width)
    _assert_like_optax(state, losses, rows, width)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_other_stages_and_gather_all_index_the_table(stage: int) -> None:
    rows, width = 64, 16
    for gather in ("manual", "all"):
        state, _, losses = _train(_policy(stage), rows, width, gather)
        _assert_like_optax(state, losses, rows, width)


def test_stage3_hpz_and_a_frozen_table() -> None:
    rows, width = 64, 16
    # hpZ: the table is gathered through its secondary partition and indexed (the lookup needs the plain cut).
    hpz = _policy(3, mesh=make_mesh(8, ("node", "chip"), (2, 4)), axis=("node", "chip"), secondary_axis="chip")
    state, _, losses = _train(hpz, rows, width)
    _assert_like_optax(state, losses, rows, width)
    # A frozen table: looked up from its pieces, forward only; the head still trains like optax's with it frozen.
    frozen = {"embed": False, "w": True}
    state, _, losses = _train(_policy(3), rows, width, trainable=frozen)
    assert_trains_frozen_like(state, losses, _params(rows, width), _batches(rows), _loss(None), frozen, FP32_RTOL)


def _compiled(stage3_lookup: bool, rows: int, width: int):
    policy = _policy(3)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_params(rows, width), tx, policy)

    def loss_fn(params, batch):
        if stage3_lookup:
            x = zj.embedding_lookup(params["embed"], batch["ids"], policy)
        else:
            x = zj.gather(params["embed"], policy)[batch["ids"]]
        return jnp.mean((jnp.tanh(x) @ zj.gather(params["w"], policy) - batch["y"]) ** 2)

    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    return step, state


@pytest.mark.parametrize(("rows", "width"), [(4096, 64), (64, 4096)])
def test_the_table_is_never_whole(rows: int, width: int) -> None:
    # 16 x 3 ids, 8 devices: the lookup sends ids (int32) and rows (float32), each device's 6 ids' rows each
    # way, and (a table cut by rows) its piece twice; the gather it replaces sends the whole table twice.
    table = rows * width * 4
    batch = _batches(rows)[0]
    step, state = _compiled(True, rows, width)
    colls = measure.collectives(step.jitted, state, batch)
    by_kind = measure.summarize(colls)
    assert "all-to-all" in by_kind
    assert not [c for c in colls if c.kind in ("all-gather", "reduce-scatter") and c.bytes >= table], colls
    sent_lookup = measure.ring_bytes(colls)
    step_g, state_g = _compiled(False, rows, width)
    sent_gather = measure.ring_bytes(measure.collectives(step_g.jitted, state_g, batch))
    piece_moves = 2 * (7 / 8) * table / 8 if rows > width else 0  # the piece to width slices and back
    rows_moved = 2 * (7 / 8) * 6 * 8 * width * 4  # 6 ids a device, 8 devices' rows, each way
    assert sent_lookup <= piece_moves + rows_moved + 2 * (7 / 8) * width * OUT * 4 + 8 * 48 * 4 + 4096, sent_lookup
    assert sent_gather >= 2 * (7 / 8) * table
    # Memory: the gather holds the whole table (and its whole gradient) at some point; the lookup never does.
    lookup = measure.memory(step.lower(state, batch).compile())
    gathered = measure.memory(step_g.lower(state_g, batch).compile())
    assert gathered["temp"] - lookup["temp"] >= table, (gathered, lookup)
