"""Layer-wise ZeRO: zj.gather, zj.scan_layers and the reference transformer."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, reference_run, relative_update_error

import zero_jax as zj
from zero_jax import measure as _measure
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

CFG = TransformerConfig(vocab=64, dim=32, depth=3, heads=2, seq=16)
STEPS = 5
FP32_RTOL = 1e-5


def _batches() -> list[dict[str, jax.Array]]:
    return [synthetic_batch(CFG, 16, jax.random.key(10 + s)) for s in range(STEPS)]


@functools.cache
def _reference():
    return reference_run(optax.adam(1e-2), init_params(CFG, jax.random.key(0)), _batches(), make_loss_fn(CFG))


# One run per (stage, prefetch), shared by the tests below (each compile once): they read the state and the
# step, none trains it further.
@functools.cache
def _manual_run(stage: int, prefetch: int = 1):
    policy = zj.ZeroPolicy(stage, make_mesh(8), stacked="layers", min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(init_params(CFG, jax.random.key(0)), tx, policy)
    step = zj.make_train_step(make_loss_fn(CFG, policy, prefetch=prefetch), tx, policy, gather="manual")
    losses = []
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return policy, state, step, losses


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reference_model_matches_unsharded_training(stage: int) -> None:
    ref_params, ref_losses = _reference()
    _, state, step, losses = _manual_run(stage)
    errors = relative_update_error(zj.full_params(state), ref_params, init_params(CFG, jax.random.key(0)))
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert step.jitted._cache_size() == 1


@pytest.mark.parametrize("prefetch", [1, 0])
def test_a_loop_of_several_layers_a_trip_trains_like_one_layer_a_trip(prefetch: int) -> None:
    # The TPU schedule (no prefetch carried across trips, unroll_layers 4), tried on XLA:CPU: depth 4 runs as 2
    # trips of 2 layers with prefetch 1 (each layer's gathers tied to the layer before it), one layer a trip
    # with prefetch 0; stage 3, 3 steps, against one layer a trip.
    cfg = TransformerConfig(vocab=64, dim=32, depth=4, heads=2, seq=16)
    params = init_params(cfg, jax.random.key(0))
    runs = {}
    for unroll in (4, 1):
        policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=64)
        tx = zj.shard_optimizer(optax.adam(1e-2), policy)
        with zj.measure.trying_schedule(unroll_layers=unroll, prefetch_across_trips=False):
            step = zj.make_train_step(make_loss_fn(cfg, policy, prefetch=prefetch), tx, policy, gather="manual")
            assert zj.measure.schedule_for(policy).layers_per_trip(cfg.depth) == (2 if unroll == 4 else 1)
            state = zj.init_state(params, tx, policy)
            losses = []
            for s in range(3):
                state, metrics = step(state, synthetic_batch(cfg, 16, jax.random.key(10 + s)))
                losses.append(float(metrics["loss"]))
            gathers = [c for c in _measure.collectives(step.jitted, state, synthetic_batch(cfg, 16, jax.random.key(0)))
                       if c.kind == "all-gather"]  # fmt: skip
        runs[unroll] = (zj.full_params(state), losses, gathers)
    errors = relative_update_error(runs[4][0], runs[1][0], params)
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(runs[4][1], runs[1][1], rtol=1e-6)
    # The layer gathers run in 2 loop trips, twice each, unrolled; in 4 otherwise; as many in all either way.
    trips = {u: max(c.trips for c in g) for u, (_, _, g) in runs.items()}
    assert trips == ({4: 2, 1: 4} if prefetch else {4: 4, 1: 4})
    assert sum(c.trips for c in runs[4][2]) == sum(c.trips for c in runs[1][2])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_layers_small_leaves_moved_together_train_the_same_bits(stage: int) -> None:
    # The TPU schedule's together_bytes, tried on XLA:CPU: each layer's six norm and bias vectors (128 and 512
    # bytes) travel in one all-gather (stage 3) and one reduce-scatter, the four matrices alone. The same bits
    # as one collective per leaf, and the audit reads the joined collectives as the layer's.
    batch = _batches()[0]
    _, state, step, losses = _manual_run(stage)
    with zj.measure.trying_schedule(together_bytes=512):
        _, joined_state, joined_step, joined_losses = _manual_run.__wrapped__(stage)
        report = zj.audit(joined_step, joined_state, batch)
    assert joined_losses == losses
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), zj.full_params(joined_state), zj.full_params(state))
    assert jax.tree.all(same)
    per_leaf = zj.audit(step, state, batch)
    kinds = []
    for r in (per_leaf, report):  # the collectives each audit read off its step's post-SPMD program
        kinds.append(collections.Counter())
        for c in r.collectives:
            kinds[-1][c.kind] += c.trips
    depth = CFG.depth
    assert kinds[1]["reduce-scatter"] == kinds[0]["reduce-scatter"] - 5 * depth  # 10 a layer -> 5
    if stage == 3:
        assert kinds[1]["all-gather"] < kinds[0]["all-gather"] - 8 * depth  # 6 -> 1 forward and backward
    (block,) = report.layers.blocks
    assert (block.layers, block.gathers_per_weight, block.reduces_per_weight) == (depth, 2.0 if stage == 3 else 0, 1.0)
    # The bytes of one collective per leaf, and one vector a layer more: the backward regather of a vector XLA
    # drops when it travels alone (one of the five the audit names as regathered fewer times than in theory).
    assert report.ok and report.comm.theory == per_leaf.comm.theory
    assert report.comm.measured == per_leaf.comm.measured + (7 / 8) * 4 * CFG.dim * depth * (stage == 3)


def test_one_hot_labels_give_the_same_bits_as_take_along_axis() -> None:
    # The reference loss's two ways of picking the targets (make_loss_fn's one_hot_labels): the TPU benchmarks
    # compare their buffers, so their numbers must not differ. Plain, and in a layer-wise stage-3 step.
    # The gradients bit for bit; the loss to float32 rounding (XLA sums the mean's terms in another order).
    params, batch = init_params(CFG, jax.random.key(0)), _batches()[0]
    same = lambda a, b: jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), a, b))  # noqa: E731
    (loss_take, g_take), (loss_one_hot, g_one_hot) = (
        jax.jit(jax.value_and_grad(make_loss_fn(CFG, one_hot_labels=o)))(params, batch) for o in (False, True)
    )
    assert same(g_take, g_one_hot) and not same(g_take, jax.tree.map(jnp.zeros_like, g_take))
    np.testing.assert_allclose(loss_one_hot, loss_take, rtol=1e-6)
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    runs = []
    for o in (False, True):
        step = zj.make_train_step(make_loss_fn(CFG, policy, one_hot_labels=o), tx, policy, gather="manual")
        state, metrics = step(zj.init_state(params, tx, policy), batch)
        runs.append((zj.full_params(state), metrics["loss"]))
    assert same(runs[0][0], runs[1][0])
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-6)


@pytest.mark.slow
def test_prefetch_changes_the_schedule_not_the_numbers() -> None:
    start = init_params(CFG, jax.random.key(0))
    # prefetch=depth: past depth - 2 the scan keeps two trips in its loop (the prefetch is clamped); prefetch=2
    # takes the same clamp here (depth 3), so it is not run again.
    runs = {k: zj.full_params(_manual_run(3, prefetch=k)[1]) for k in (0, 1, CFG.depth)}
    for k, params in runs.items():
        # Same math in another order of XLA fusions: float32 rounding only.
        errors = relative_update_error(params, runs[0], start)
        assert max(errors.values()) <= FP32_RTOL, (k, errors)


def _tally(colls: list[_measure.Collective]) -> dict[tuple[str, tuple[int, ...]], int]:
    out: dict[tuple[str, tuple[int, ...]], int] = collections.Counter()
    for c in colls:
        out[(c.kind, c.shape)] += c.trips
    return dict(out)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [0, 1])
def test_stage3_gathers_each_layer_twice_and_scatters_its_gradient_once(prefetch: int) -> None:
    _, state, step, _ = _manual_run(3, prefetch=prefetch)
    batch = _batches()[0]
    post = _tally(_measure.collectives(step.jitted, state, batch))
    compiled = _tally(_measure.parse_collectives(step.lower(state, batch).compile().as_text(), 8))
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=64)
    layouts = policy.layouts(init_params(CFG, jax.random.key(0)))["layers"]
    depth = CFG.depth
    weights = {}
    for name in ("attn_qkv", "attn_out", "mlp_in", "mlp_out"):
        lay = layouts[name]
        piece = list(lay.shape[1:])
        piece[lay.dim - 1] //= 8
        weights[name] = (lay.shape[1:], tuple(piece))
    for name, (whole, piece) in weights.items():
        for counts, where in ((post, "post-SPMD"), (compiled, "compiled")):
            # Forward gather + backward re-gather: 2 per layer per step, even after
            # XLA's optimisations (a scan keeps them apart; nothing merges them).
            assert counts[("all-gather", whole)] == 2 * depth, (name, where, counts)
            assert counts[("reduce-scatter", piece)] == depth, (name, where, counts)


@pytest.mark.slow
def test_stage2_scatters_each_layer_gradient_and_gathers_only_updated_params() -> None:
    policy, state, step, _ = _manual_run(2)
    post = _tally(_measure.collectives(step.jitted, state, _batches()[0]))
    d, n, depth = CFG.dim, 8, CFG.depth
    assert post[("reduce-scatter", (d, 3 * d // n))] == depth  # inside the backward loop
    # The only all-gathers are of updated parameters, once per step (whole stack).
    assert post[("all-gather", (depth, d, 3 * d))] == 1
    assert not any(k == ("all-gather", (d, 3 * d)) for k in post)


def _run_inside_step(loss_fn, stage: int = 3):
    policy = zj.ZeroPolicy(stage, make_mesh(8), stacked="layers", min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(init_params(CFG, jax.random.key(0)), tx, policy)
    step = zj.make_train_step(functools.partial(loss_fn, policy=policy), tx, policy, gather="manual")
    return step(state, _batches()[0])


def test_gather_outside_a_step() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8))
    with pytest.raises(RuntimeError, match=r"zj.gather was called outside a train step.*policy=None"):
        zj.gather({"w": jnp.ones((64, 64))}, policy)
    assert zj.gather({"w": 1.0}, None) == {"w": 1.0}  # policy=None: the identity anywhere


def test_gather_on_something_that_is_not_a_parameter_piece() -> None:
    def loss_fn(params, batch, policy):
        activations = jnp.ones((16, 128))
        return jnp.mean(zj.gather({"act": activations}, policy)["act"])

    with pytest.raises(ValueError, match=r"leaf 'act' \(shape \(16, 128\)\) is not a piece of the policy's parameters"):
        _run_inside_step(loss_fn)


def test_using_a_partitioned_parameter_without_gathering_it() -> None:
    def loss_fn(params, batch, policy):
        return jnp.mean(params["head"] * 2.0)

    with pytest.raises(TypeError, match=r"partitioned parameter of shape \(32, 64\) \('head'\) was used as an array"
                       r".*zj.gather"):  # fmt: skip
        _run_inside_step(loss_fn)


def test_stacked_leaves_that_disagree_on_depth() -> None:
    def loss_fn(params, batch, policy):
        layers = dict(params["layers"], extra=jnp.zeros((CFG.depth + 1, 4)))
        x = jnp.zeros((2, CFG.dim))
        return jnp.mean(zj.scan_layers(lambda lp, h: h, layers, x, policy))

    with pytest.raises(ValueError, match=r"disagree on the layer count.*attn_qkv: 3.*extra: 4"):
        _run_inside_step(loss_fn)


@pytest.mark.parametrize("prefetch", [-1, CFG.depth + 1])
def test_prefetch_out_of_range(prefetch: int) -> None:
    def loss_fn(params, batch, policy):
        return jnp.mean(zj.scan_layers(lambda lp, h: h, params["layers"], jnp.zeros(3), policy, prefetch=prefetch))

    with pytest.raises(ValueError, match=rf"prefetch must be an int from 0 to the depth \(3\), got {prefetch}"):
        _run_inside_step(loss_fn)


def test_stacked_subtree_not_declared_to_the_policy() -> None:
    # 16 layers of 100 features: without stacked=, the rule cuts the layer axis
    # (16 divides 8, 100 does not), which scan_layers cannot iterate over.
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=64)
    params = {"layers": {"w": jnp.ones((16, 100))}}
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(params, tx, policy)

    def loss_fn(params, batch):
        out = zj.scan_layers(lambda lp, h: h * lp["w"], params["layers"], batch["x"], policy)
        return jnp.mean(out)

    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    with pytest.raises(ValueError, match=r"'w' is partitioned along its leading \(layer\) axis.*stacked="):
        step(state, {"x": jnp.ones((8, 100))})
