"""Block-wise ZeRO for unscanned models: zj.apply_layer, zj.apply_layers and the tie."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, reference_run, relative_update_error
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax import measure as _measure

N = 8
D = 32
FP32_RTOL = 1e-5  # the relative L2 of each leaf's accumulated update against plain optax
BF16_RTOL = 2e-2  # bf16 compute: against the same run with gather="all"


def _params(depth: int = 4, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), depth + 1)
    blocks = [
        {"w": jax.random.normal(k, (D, D)) / np.sqrt(D), "b": 0.1 * jax.random.normal(k, (D,)), "g": jnp.ones((D,))}
        for k in keys[1:]
    ]
    return {"embed": jax.random.normal(keys[0], (D, D)) / np.sqrt(D), "blocks": blocks}


def _block(p: dict, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["w"] + p["b"]) * p["g"]


def _batches(steps: int = 3, n: int = 16) -> list[dict]:
    return [
        {"x": jax.random.normal(jax.random.key(10 + s), (n, D)), "y": jax.random.normal(jax.random.key(50 + s), (n, D))}
        for s in range(steps)
    ]


def _loss(policy, mode: str, prefetch: int = 1):
    """The same model three ways: a plain Python loop (gather="all" / optax), one
    zj.apply_layer per block, or zj.apply_layers."""

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        embed = zj.gather(params["embed"], policy) if mode != "plain" else params["embed"]
        x = batch["x"] @ embed
        if mode == "plain":
            for p in params["blocks"]:
                x = _block(p, x)
        elif mode == "apply_layer":
            for p in params["blocks"]:
                x = zj.apply_layer(_block, p, x, policy=policy)
        else:
            x = zj.apply_layers(_block, params["blocks"], x, policy, prefetch=prefetch)
        return jnp.mean((x - batch["y"]) ** 2)

    return loss_fn


def _run(stage: int, mode: str, *, prefetch: int = 1, steps: int = 3, depth: int = 4, **step_kwargs):
    policy = zj.ZeroPolicy(
        stage, make_mesh(N), min_shard_size=0, precision=step_kwargs.pop("precision", zj.Precision())
    )
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_params(depth), tx, policy)
    gather = "all" if mode == "plain" else "manual"
    step = zj.make_train_step(_loss(policy, mode, prefetch), tx, policy, gather=gather, **step_kwargs)
    losses = []
    for batch in _batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, step, losses


@functools.cache
def _reference():
    return reference_run(optax.adam(1e-2), _params(), _batches(), _loss(None, "plain"))


@pytest.mark.parametrize("mode", ["apply_layer", "apply_layers"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_block_wise_training_equals_unsharded_optax(stage: int, mode: str) -> None:
    ref_params, ref_losses = _reference()
    state, step, losses = _run(stage, mode)
    errors = relative_update_error(zj.full_params(state), ref_params, _params())
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_prefetch_changes_nothing_bitwise(stage: int) -> None:
    runs = [zj.full_params(_run(stage, "apply_layers", prefetch=k, steps=2)[0]) for k in (0, 1, 2, 4)]
    for other in runs[1:]:
        for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(other), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_blocks_small_leaves_moved_together_train_the_same_bits(stage: int) -> None:
    # The TPU schedule's together_bytes, tried on XLA:CPU: each block's bias and scale (D floats each) travel in
    # one all-gather (stage 3) and one reduce-scatter, the weight alone. The same bits as one collective per
    # leaf, and the audit reads two collectives a block where it read three.
    batch = _batches(1)[0]
    reports = {}
    for together in (0, 4 * D):
        with zj.measure.trying_schedule(together_bytes=together):
            state, step, losses = _run(stage, "apply_layers", steps=2)
            reports[together] = (zj.full_params(state), losses, zj.audit(step, state, batch))
    (plain, plain_losses, per_leaf), (joined, joined_losses, report) = reports[0], reports[4 * D]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), joined, plain))
    assert joined_losses == plain_losses
    blocks = [(b.weights, b.gathers_per_weight, b.reduces_per_weight) for b in report.layers.blocks]
    assert blocks == [(2, 2.0 if stage == 3 else 0.0, 1.0)] * 4
    assert [b.weights for b in per_leaf.layers.blocks] == [3] * 4
    assert report.ok and report.comm.measured == per_leaf.comm.measured and report.comm.theory == per_leaf.comm.theory


@pytest.mark.parametrize("mesh_kind", ["model axis", "replica axis"])
def test_small_leaves_move_together_beside_a_model_axis_and_across_replicas(mesh_kind: str) -> None:
    # Joined on a (data 4, model 2) mesh where only the weight is cut over "model" (the bias and scale join,
    # the weight stays alone), and on a (replica 2, data 4) mesh with the optimizer state over both.
    axes = ("data", "model") if mesh_kind == "model axis" else ("replica", "data")
    mesh = jax.make_mesh((4, 2) if mesh_kind == "model axis" else (2, 4), axes, axis_types=(AxisType.Auto,) * 2)
    options = ({"param_specs": {"embed": None, "blocks": [{"w": P(None, "model"), "b": None, "g": None}] * 4}}
               if mesh_kind == "model axis" else {"replica_axis": "replica", "optimizer_over_replicas": True})
    runs = {}
    for together in (0, 4 * D):
        with zj.measure.trying_schedule(together_bytes=together):
            policy = zj.ZeroPolicy(3, mesh, min_shard_size=0, **options)
            tx = zj.shard_optimizer(optax.adam(1e-2), policy)
            state = zj.init_state(_params(), tx, policy)
            step = zj.make_train_step(_loss(policy, "apply_layers"), tx, policy, gather="manual")
            for batch in _batches(2):
                state, metrics = step(state, batch)
            report = zj.audit(step, state, batch)
        runs[together] = (zj.full_params(state), float(metrics["loss"]), [b.weights for b in report.layers.blocks])
        assert report.ok
    (apart, loss, per_leaf), (joined, joined_loss, per_group) = runs[0], runs[4 * D]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), joined, apart)) and joined_loss == loss
    assert per_group == [w - 1 for w in per_leaf]  # the bias and the scale: one collective
    if mesh_kind == "model axis":  # the gathers of w over "model" are the model's own: in no block's count
        assert per_leaf == [3] * 4


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("mode", ["local", "partitioned"])
def test_accumulation_equals_gather_all(stage: int, mode: str) -> None:
    plain, _, plain_losses = _run(stage, "plain", accum_steps=2, accum_mode=mode)
    layered, _, losses = _run(stage, "apply_layers", accum_steps=2, accum_mode=mode)
    errors = relative_update_error(zj.full_params(layered), zj.full_params(plain), _params())
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)


def test_bf16_compute_equals_gather_all() -> None:
    precision = zj.Precision(compute_dtype=jnp.bfloat16)
    plain, plain_step, plain_losses = _run(3, "plain", precision=precision)
    layered, step, losses = _run(3, "apply_layers", precision=precision)
    errors = relative_update_error(zj.full_params(layered), zj.full_params(plain), _params())
    assert max(errors.values()) <= BF16_RTOL, errors
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-2)
    # Right after SPMD partitioning (XLA:CPU later runs bf16 collectives in f32): the blocks are
    # gathered in the compute dtype and their gradients reduced in float32.
    colls = _measure.collectives(step.jitted, layered, _batches()[0])
    assert {c.dtype for c in colls if c.kind == "all-gather"} == {"bf16"}
    plain_colls = _measure.collectives(plain_step.jitted, plain, _batches()[0])
    assert {c.dtype for c in colls if c.kind == "reduce-scatter"} == {
        c.dtype for c in plain_colls if c.kind == "reduce-scatter"
    }


FP16 = zj.Precision(compute_dtype=jnp.float16, loss_scale=zj.DynamicLossScale(initial=2.0**10, growth_interval=2))


@pytest.mark.parametrize("poison", [jnp.inf, jnp.nan])
def test_a_non_finite_fp16_step_is_skipped_exactly_as_with_gather_all(poison: float) -> None:
    results = {}
    for mode in ("plain", "apply_layers"):
        policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0, precision=FP16)
        tx = zj.shard_optimizer(optax.adam(1e-2), policy)
        state = zj.init_state(_params(), tx, policy)
        step = zj.make_train_step(_loss(policy, mode), tx, policy, gather="all" if mode == "plain" else "manual")
        batches = _batches(3)
        state, _ = step(state, batches[0])
        before = jax.tree.map(np.asarray, state.master)
        batches[1]["x"] = batches[1]["x"].at[3, 0].set(poison)  # one row on one device
        state, m = step(state, batches[1])
        assert int(m["skipped"]) == 1 and float(state.loss_scale.scale) == 2.0**9
        for a, b in zip(jax.tree.leaves(state.master), jax.tree.leaves(before), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)  # bitwise unchanged
        state, m = step(state, batches[2])
        assert int(m["skipped"]) == 0
        results[mode] = zj.full_params(state)
    errors = relative_update_error(results["apply_layers"], results["plain"], _params())
    assert max(errors.values()) <= 1e-2, errors  # fp16 compute


def _compiled(stage: int, depth: int, prefetch: int, mode: str = "apply_layers"):
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_params(depth), tx, policy)
    step = zj.make_train_step(_loss(policy, mode, prefetch), tx, policy, gather="all" if mode == "plain" else "manual")
    return step.lower(state, _batches(1)[0]).compile()


def _per_block(text: str, kind: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for line in text.splitlines():
        if f" {kind}(" in line:
            # The innermost name: block i's backward pass re-gathers block i - 1 (prefetch).
            blocks = re.findall(r"zj_block(\d+)_(?:gather|reduce)", line)
            if blocks:
                counts[int(blocks[-1])] = counts.get(int(blocks[-1]), 0) + 1
    return counts


@pytest.mark.slow
def test_stage3_keeps_one_block_whole_at_any_depth() -> None:
    whole_block = (D * D + 2 * D) * 4
    temps = {}
    deep = 8  # 4 blocks more than the shallow model (each block is unrolled: compile time grows with depth)
    for depth in (4, deep):
        for prefetch in (0, 1):
            compiled = _compiled(3, depth, prefetch)
            temps[depth, prefetch] = compiled.memory_analysis().temp_size_in_bytes
            text = compiled.as_text()
            # Forward gather + backward re-gather of w, b and g; one reduce-scatter each.
            assert _per_block(text, "all-gather") == dict.fromkeys(range(depth), 6)
            assert _per_block(text, "reduce-scatter") == dict.fromkeys(range(depth), 3)
    plain = {depth: _compiled(3, depth, 1, "plain").memory_analysis().temp_size_in_bytes for depth in (4, deep)}
    more = deep - 4
    # gather="all" keeps every block whole (XLA hoists the gathers): temp grows with depth.
    assert plain[deep] - plain[4] >= more * whole_block
    # Block-wise: the blocks added add only their gradient pieces (1/N of a block each) and one saved
    # input each (2 rows per device), +30% ...
    added = more * (whole_block / N + 16 // N * D * 4) * 1.3
    assert temps[deep, 0] - temps[4, 0] <= added
    assert temps[deep, 1] - temps[4, 1] <= added
    # ... and prefetching one block ahead costs at most one whole block more.
    assert 0 <= temps[deep, 1] - temps[deep, 0] <= whole_block * 1.05


def test_prefetch_costs_one_block_when_activations_dominate() -> None:
    """The backward recompute of block i waits for block i's cotangent: with the
    prefetched (handed) block already whole, XLA otherwise recomputed block i
    beside block i + 1's backward pass, both blocks' activations alive at once
    (4.8 whole blocks of temp here before the recompute was tied, 0.94 after)."""

    def temp(prefetch: int) -> int:
        policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)
        tx = zj.shard_optimizer(optax.adam(1e-2), policy)
        state = zj.init_state(_params(4), tx, policy)
        step = zj.make_train_step(_loss(policy, "apply_layers", prefetch), tx, policy, gather="manual")
        batch = {"x": jnp.ones((1024, D)), "y": jnp.ones((1024, D))}  # 128 rows per device: activations > a block
        return step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes

    whole_block = (D * D + 2 * D) * 4
    assert 0 <= temp(1) - temp(0) <= whole_block


def _manual_params(stage: int, loss_with, params: dict, *, min_shard_size: int = 0, steps: int = 2) -> dict:
    """``steps`` Adam steps of a gather="manual" step on ``loss_with(policy)``: the full parameters."""
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=min_shard_size)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(loss_with(policy), tx, policy, gather="manual")
    for batch in _batches(steps):
        state, _ = step(state, batch)
    return zj.full_params(state)


def test_closed_over_floats_and_heterogeneous_blocks_get_their_gradients() -> None:
    def make():
        return {
            "scale": jnp.full((D,), 0.5),
            "blocks": [{"w": jnp.eye(D) * 0.9}, {"w": jnp.eye(D) * 1.1, "v": jnp.ones((D, D)) / D}],
        }

    def first(p, x, scale):
        return jnp.tanh(x @ p["w"]) * scale

    def second(p, x):
        return x @ p["w"] + x @ p["v"]

    def loss_with(policy):
        def loss_fn(params, batch):
            scale = params["scale"]  # a whole (tiny) leaf, closed over by the first block
            fns = [lambda p, x: first(p, x, scale), second]
            out = zj.apply_layers(fns, params["blocks"], batch["x"], policy)
            return jnp.mean((out - batch["y"]) ** 2)

        return loss_fn

    ref, _ = reference_run(optax.adam(1e-2), make(), _batches(2), loss_with(None))
    trained = _manual_params(3, loss_with, make(), min_shard_size=64)
    errors = relative_update_error(trained, ref, make())
    assert max(errors.values()) <= FP32_RTOL, errors
    assert float(jnp.abs(trained["scale"] - 0.5).max()) > 1e-3  # it trained


def test_frozen_and_integer_leaves_inside_blocks() -> None:
    def make():
        p = _params(3)
        for blk in p["blocks"]:
            blk["steps"] = jnp.arange(4, dtype=jnp.int32)
        return p

    def loss_with(policy, fn):
        def loss_fn(params, batch):
            x = zj.apply_layers(fn, params["blocks"], batch["x"], policy) if policy else functools.reduce(
                lambda x, p: fn(p, x), params["blocks"], batch["x"])  # fmt: skip
            return jnp.mean((x - batch["y"]) ** 2)

        return loss_fn

    def block(p, x):
        return _block(p, x) + 0 * p["steps"][0]

    def labels(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: "frozen" if "'g'" in str(path) else "train", params)

    opt = optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)
    floats = _params(3)  # the reference differentiates float leaves only
    ref, _ = reference_run(opt, floats, _batches(2), loss_with(None, _block))
    policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(opt, policy)
    state = zj.init_state(make(), tx, policy)
    step = zj.make_train_step(loss_with(policy, block), tx, policy, gather="manual")
    for batch in _batches(2):
        state, _ = step(state, batch)
    out = zj.full_params(state)
    floats_out = {**out, "blocks": [{k: v for k, v in b.items() if k != "steps"} for b in out["blocks"]]}
    trained = {k: v for k, v in relative_update_error(floats_out, ref, floats).items() if "'g'" not in k}
    assert max(trained.values()) <= FP32_RTOL, trained
    for blk, start in zip(out["blocks"], make()["blocks"], strict=True):
        np.testing.assert_array_equal(np.asarray(blk["g"]), np.asarray(start["g"]))
        np.testing.assert_array_equal(np.asarray(blk["steps"]), np.asarray(start["steps"]))


# -- bad input --------------------------------------------------------------------------------


def test_outside_a_step_it_says_pass_policy_none() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(N))
    with pytest.raises(RuntimeError, match=r"zj.apply_layers was called outside a train step.*policy=None"):
        zj.apply_layers(_block, _params()["blocks"], jnp.ones((2, D)), policy)
    with pytest.raises(RuntimeError, match=r"zj.apply_layer was called outside a train step"):
        zj.apply_layer(_block, _params()["blocks"][0], jnp.ones((2, D)), policy=policy)
    # policy=None runs the same model on ordinary parameters.
    out = zj.apply_layers(_block, _params()["blocks"], jnp.ones((2, D)), None)
    expected = functools.reduce(lambda x, p: _block(p, x), _params()["blocks"], jnp.ones((2, D)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6)


def _manual_step(loss_fn, stage: int = 3):
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(_params(), tx, policy)
    return policy, state, functools.partial(zj.make_train_step, tx=tx, policy=policy, gather="manual")


def test_arrays_that_are_not_pieces_are_named() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(_params(), tx, policy)

    def loss_fn(params, batch):
        computed = [{"w": jnp.ones((D, D)), "b": jnp.ones((D,)), "g": jnp.ones((D,))}]
        return jnp.mean(zj.apply_layers(_block, computed, batch["x"], policy))

    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    expected = r"leaves '0/b' \(shape \(32,\)\), '0/g' \(shape \(32,\)\), '0/w' \(shape \(32, 32\)\) are not pieces"
    with pytest.raises(ValueError, match=expected):
        step(state, _batches(1)[0])


@pytest.mark.parametrize("prefetch", [-1, 5, 1.0, True])
def test_prefetch_must_be_an_int_up_to_the_number_of_blocks(prefetch) -> None:
    policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(_params(), tx, policy)
    step = zj.make_train_step(_loss(policy, "apply_layers", prefetch), tx, policy, gather="manual")
    with pytest.raises(ValueError, match=r"prefetch must be an int from 0 to the number of blocks \(4\)"):
        step(state, _batches(1)[0])


def test_layer_list_and_fn_list_are_checked() -> None:
    with pytest.raises(TypeError, match=r"layers_params must be a list.*zj.scan_layers"):
        zj.apply_layers(_block, {"w": jnp.ones((2, D, D))}, jnp.ones((2, D)), None)
    with pytest.raises(ValueError, match=r"one function or a list of one per block; got 1 for 4 blocks"):
        zj.apply_layers([_block], _params()["blocks"], jnp.ones((2, D)), None)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_manual_loss_that_touches_pieces_directly_is_an_error(stage: int) -> None:
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(_params(2), tx, policy)

    def loss_fn(params, batch):  # a weight-decay term over jax.tree.leaves reaches the pieces
        decay = sum(jnp.sum(p**2) for p in jax.tree.leaves(params["blocks"][1]))
        return _loss(policy, "apply_layers")(params, batch) + 1e-3 * decay

    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    expected = r"used the partitioned parameters 'blocks/1/b' \(in integer_pow\), 'blocks/1/g' .*'blocks/1/w'"
    with pytest.raises(TypeError, match=expected + r".*silently wrong.*zj.gather\(params\['w'\], policy\)"):
        step(state, _batches(1)[0])


def _policy_run(policy, mode: str, steps: int = 2):
    tx = zj.shard_optimizer(optax.sgd(0.1, momentum=0.9), policy)
    state = zj.init_state(_params(), tx, policy)
    step = zj.make_train_step(_loss(policy, mode), tx, policy, gather="all" if mode == "plain" else "manual")
    for batch in _batches(steps):
        state, metrics = step(state, batch)
    return state, metrics


@pytest.mark.parametrize("over_replicas", [False, True])
def test_hybrid_meshes_equal_gather_all(over_replicas: bool) -> None:
    mesh = make_mesh(8, ("replica", "data"), (2, 4))

    def policy():
        return zj.ZeroPolicy(3, mesh, "data", replica_axis="replica", optimizer_over_replicas=over_replicas,
                             min_shard_size=0)  # fmt: skip

    plain, m_plain = _policy_run(policy(), "plain")
    layered, m = _policy_run(policy(), "apply_layers")
    errors = relative_update_error(zj.full_params(layered), zj.full_params(plain), _params())
    assert max(errors.values()) <= FP32_RTOL, errors
    assert float(m["loss"]) == pytest.approx(float(m_plain["loss"]), rel=1e-6)


def test_offloaded_pieces_train_the_same_bits() -> None:
    def policy(**offload):
        return zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0, **offload)

    base, _ = _policy_run(policy(), "apply_layers")
    offloaded, _ = _policy_run(policy(offload_params=True, offload_optimizer=True), "apply_layers")
    for a, b in zip(jax.tree.leaves(zj.full_params(offloaded)), jax.tree.leaves(zj.full_params(base)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_integer_and_key_values_pass_through_blocks() -> None:
    def blk(p, carry):  # a carry with a counter and a PRNG key, as models thread them
        x, n, key = carry
        key, sub = jax.random.split(key)
        return jnp.tanh(x @ p["w"] + 1e-2 * jax.random.normal(sub, (D,))), n + 1, key  # same on every device

    def loss_with(policy):
        def loss_fn(params, batch):
            start = (batch["x"], jnp.int32(0), jax.random.key(0))
            if policy is None:
                x, n, _ = functools.reduce(lambda c, p: blk(p, c), params["blocks"], start)
            else:
                x, n, _ = zj.apply_layers(blk, params["blocks"], start, policy)
            return jnp.mean((x - batch["y"]) ** 2) * (n / 3)

        return loss_fn

    make = lambda: {"blocks": [{"w": jnp.eye(D) * 0.9 + 0.01} for _ in range(3)]}  # noqa: E731
    ref, _ = reference_run(optax.adam(1e-2), make(), _batches(2), loss_with(None))
    for stage in (2, 3):
        errors = relative_update_error(_manual_params(stage, loss_with, make()), ref, make())
        assert max(errors.values()) <= FP32_RTOL, (stage, errors)


def test_under_a_users_vmap_it_says_to_vmap_inside_the_block() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(_params(), tx, policy)

    def per_example(params, x):
        return zj.apply_layers(_block, params["blocks"], x @ zj.gather(params["embed"], policy), policy)

    def vmapped(params, batch):
        return jnp.mean((jax.vmap(per_example, in_axes=(None, 0))(params, batch["x"]) - batch["y"]) ** 2)

    step = zj.make_train_step(vmapped, tx, policy, gather="manual")
    with pytest.raises(ValueError, match=r"block 0 was called inside jax.vmap.*jax.vmap\(block, in_axes=\(None, 0\)\)"):
        step(state, _batches(1)[0])

    def fixed(params, batch):  # what the message says: the vmap inside the block
        x = batch["x"] @ zj.gather(params["embed"], policy)
        x = zj.apply_layers(jax.vmap(_block, in_axes=(None, 0)), params["blocks"], x, policy)
        return jnp.mean((x - batch["y"]) ** 2)

    _, metrics = zj.make_train_step(fixed, tx, policy, gather="manual")(state, _batches(1)[0])
    assert float(metrics["loss"]) == pytest.approx(_reference()[1][0], rel=1e-5)


def test_an_unused_constant_block_output_gets_a_zero_cotangent_of_its_type() -> None:
    """A block that hands on a value the same on every device (T5's zero cross-attention bias) that the
    last block's caller never uses: its symbolic-zero cotangent becomes zeros of the output's own type."""
    policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)

    def block(p: dict, carry: tuple) -> tuple:
        x, _ = carry
        return jnp.tanh(x @ p["w"]), jnp.zeros((4, 4), jnp.float32)  # the same on every device

    def loss_fn(params: dict, batch: dict, policy: zj.ZeroPolicy | None = policy) -> jax.Array:
        x, _ = zj.apply_layers(block, params["blocks"], (batch["x"], jnp.zeros((4, 4))), policy)
        return jnp.mean(x**2)

    rng = np.random.default_rng(0)
    params = {"blocks": [{"w": jnp.asarray(rng.normal(size=(8, 8)) / 3, jnp.float32)} for _ in range(3)]}
    batch = {"x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)}
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    state, metrics = step(zj.init_state(params, tx, policy), batch)
    expected_loss, g = jax.value_and_grad(lambda p: loss_fn(p, batch, None))(params)
    np.testing.assert_allclose(float(metrics["loss"]), float(expected_loss), rtol=1e-6)
    expected = jax.tree.map(lambda w, d: w - 0.1 * d, params, g)
    got = zj.full_params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)  # fp32, 8 summands
