"""zj.audit's per-layer schedule: gathers and reduce-scatters per block, whole layers alive, and check()."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh

import zero_jax as zj
from zero_jax._audit import report as _report

D = 32
LAYER_BYTES = (D * D + D) * 4  # one block's w and b, whole: 4,224 B


def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w"] + p["b"])


def blocks_params(depth: int) -> dict[str, list[dict[str, jax.Array]]]:
    rng = np.random.default_rng(0)
    return {
        "blocks": [
            {"w": jnp.asarray(rng.normal(size=(D, D)) / np.sqrt(D), jnp.float32), "b": jnp.zeros(D, jnp.float32)}
            for _ in range(depth)
        ]
    }


def stacked_params(depth: int) -> dict[str, dict[str, jax.Array]]:
    blocks = blocks_params(depth)["blocks"]
    return {"layers": {k: jnp.stack([b[k] for b in blocks]) for k in ("w", "b")}}


def run_audit(loss_fn, params, policy: zj.ZeroPolicy, gather: str = "manual", **kw) -> zj.AuditReport:
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    step = zj.make_train_step(loss_fn, tx, policy, gather=gather)
    batch = {"x": jnp.asarray(np.random.default_rng(1).normal(size=(16, D)), jnp.float32)}
    return zj.audit(step, zj.init_state(params, tx, policy), batch, **kw)


def layerwise_loss(policy: zj.ZeroPolicy, prefetch: int):
    def loss_fn(params, batch):
        return jnp.mean(zj.apply_layers(block, params["blocks"], batch["x"], policy, prefetch=prefetch) ** 2)

    return loss_fn


def gather_all_loss(policy: zj.ZeroPolicy):
    def loss_fn(params, batch):
        whole = [zj.gather(p, policy) for p in params["blocks"]]  # XLA hoists these: every block whole at once
        x = batch["x"]
        for p in whole:
            x = block(p, x)
        return jnp.mean(x**2)

    return loss_fn


@pytest.mark.parametrize(("depth", "prefetch"), [(4, 0), (4, 1), (6, 0), (6, 1)])
def test_layerwise_stage3_gathers_each_block_twice_and_holds_prefetch_plus_one(depth: int, prefetch: int) -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0)
    report = run_audit(layerwise_loss(policy, prefetch), blocks_params(depth), policy).check()
    layers = report.layers
    assert layers is not None and layers.judged and layers.prefetch == 1
    assert [b.name for b in layers.blocks] == [f"block {i}" for i in range(depth)]
    for b in layers.blocks:  # w and b: each gathered forward and again backward, reduce-scattered once
        assert (b.layers, b.weights, b.forward, b.backward, b.reduce_scatters) == (1, 2, 2, 2, 2)
        assert b.gathers_per_weight == 2 and b.reduces_per_weight == 1
        assert b.bytes == LAYER_BYTES
    assert layers.layer_bytes == LAYER_BYTES
    assert layers.max_alive == prefetch + 1
    text = str(report)
    assert f"layer schedule: at most {prefetch + 1} whole layer(s) alive at once" in text
    assert "block 3" in text and "(2 per weight)" in text and "check: passed" in text


def test_layerwise_stage2_reduces_each_block_once_and_gathers_nothing() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8), min_shard_size=0)
    report = run_audit(layerwise_loss(policy, 1), blocks_params(4), policy).check()
    assert report.layers is not None and report.layers.max_alive == 0
    rows = [(b.weights, b.forward, b.backward, b.reduce_scatters, b.bytes) for b in report.layers.blocks]
    assert rows == [(2, 0, 0, 2, LAYER_BYTES)] * 4  # each block's gradient reduce-scattered once, in its backward
    assert "no layer all-gathers" in str(report)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_scan_layers_schedule(prefetch: int) -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0, stacked="layers")

    def loss_fn(params, batch):
        return jnp.mean(zj.scan_layers(block, params["layers"], batch["x"], policy, prefetch=prefetch) ** 2)

    report = run_audit(loss_fn, stacked_params(4), policy).check()
    (scan,) = report.layers.blocks
    assert (scan.name, scan.layers, scan.weights) == ("scan layers/*", 4, 2)
    assert (scan.forward, scan.backward, scan.reduce_scatters) == (8, 8, 8)  # 2 gathers, 1 reduce per weight
    assert scan.bytes == LAYER_BYTES and report.layers.judged
    # prefetch + 1: the backward queue's first gathers are tied to the cotangent
    # (untied, XLA issued them during the forward loop: 3 layers at prefetch 1).
    assert report.layers.max_alive == prefetch + 1


@pytest.mark.parametrize("depth", [4, 6])
def test_check_flags_a_manual_step_that_gathers_every_block_up_front(depth: int) -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0)
    report = run_audit(gather_all_loss(policy), blocks_params(depth), policy)
    (group,) = report.layers.blocks
    assert (group.name, group.layers, group.weights) == ("blocks/*", depth, 2)
    assert (group.forward, group.backward, group.reduce_scatters) == (2 * depth, 0, 2 * depth)  # no re-gather
    assert report.layers.max_alive == depth and report.layers.judged
    with pytest.raises(_report.AuditError) as err:
        report.check()
    (violation,) = err.value.violations
    assert violation.kind == _report.LAYERS_ALIVE
    assert f"holds {depth} whole layers at once" in violation.message
    assert "4.12 KiB per layer" in violation.message and "prefetch + 1 = 2" in violation.message
    assert "zj.apply_layers" in violation.message


def test_prefetch_sets_the_limit_and_gather_all_steps_are_not_judged() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0)
    params = blocks_params(4)
    report = run_audit(gather_all_loss(policy), params, policy, prefetch=3).check()  # limit 4 layers
    assert report.layers.max_alive == 4 and report.layers.prefetch == 3

    def whole_loss(p, batch):  # gather="all": the step hands whole parameters by design
        x = batch["x"]
        for b in p["blocks"]:
            x = block(b, x)
        return jnp.mean(x**2)

    assert run_audit(whole_loss, params, policy, gather="all").check().ok
    with pytest.raises(ValueError, match="prefetch must be a non-negative int"):
        run_audit(layerwise_loss(policy, 1), params, policy, prefetch=-1)


def test_plan_reports_the_whole_layer_working_set_of_a_layerwise_step() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    step = zj.make_train_step(layerwise_loss(policy, 1), tx, policy, gather="manual")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), blocks_params(6))
    batch = {"x": jax.ShapeDtypeStruct((16, D), jnp.float32, sharding=policy.batch_sharding())}
    result = zj.plan(step, zj.init_state(abstract, tx, policy), batch, grads=False)
    assert result.layer_working_sets == {3: 2 * LAYER_BYTES}  # (prefetch 1 + 1) x one block, at any depth
    (note,) = result.layer_notes()
    assert note.startswith("stage 3 layer-wise: 6 layers of 4.12 KiB")
    assert "(prefetch 1 + 1) x 4.12 KiB = 8.25 KiB" in note and "holds at most 2" in note
    assert note in str(result)


@pytest.mark.parametrize("accum_mode", ["partitioned", "local"])
def test_accumulation_gathers_per_microbatch_or_once_by_design(accum_mode: str) -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    step = zj.make_train_step(
        layerwise_loss(policy, 1), tx, policy, gather="manual", accum_steps=2, accum_mode=accum_mode
    )
    batch = {"x": jnp.ones((32, D), jnp.float32)}
    report = zj.audit(step, zj.init_state(blocks_params(4), tx, policy), batch).check()
    if accum_mode == "partitioned":  # each microbatch gathers every block twice and reduces it once
        assert [(b.forward, b.backward, b.reduce_scatters) for b in report.layers.blocks] == [(4, 4, 4)] * 4
        assert report.layers.blocks[0].gathers_per_weight == 4 and report.layers.max_alive == 2
    else:  # local accumulation gathers the model once per step, by design: reported, not flagged
        (group,) = report.layers.blocks
        assert (group.forward, group.backward) == (8, 0) and report.layers.max_alive == 4
