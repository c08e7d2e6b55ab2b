"""The layer-wise gradient reduce-scatter built from other collectives (the schedule's ``grad_reduction``):
a ring of ``ppermute`` steps (one way or both), or one ``all_to_all`` and a sum. Each equals ``psum_scatter``
(bitwise on integer-valued float32, to float32 rounding otherwise), trains like plain optax on XLA:CPU's 8
simulated devices (partition dims 0 and 1, padding, a hybrid mesh, scanned and unscanned), leaves the int8
wire (qgZ) on its all-to-all; on the TPU compiler the ring runs as async collective-permutes, one pass of the
bytes, overlapped with the backward pass (``benchmarks/results/grad_reduction.txt``)."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # a deviceless TPU compile below, beside other workers

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from _models import make_mesh, reference_run, relative_update_error  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure as _measure  # noqa: E402
from zero_jax._comm.collectives import REDUCE_SCATTERS, scatter_sum  # noqa: E402

OTHERS = [h for h in REDUCE_SCATTERS if h != "psum_scatter"]
FP32_RTOL = 1e-5  # relative L2 of each leaf's accumulated update against plain optax, as tests/test_scan_layers.py


def _each_form(x: jax.Array, over, dim: int) -> dict[str, jax.Array]:
    """Every form of ``scatter_sum`` of ``x`` (one row per device) on a (2, 4) mesh, stacked per device."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jax.device_put(x, NamedSharding(mesh, P(("a", "b"))))

    def f(g):
        return {how: scatter_sum(g[0], over, dim, how)[None] for how in REDUCE_SCATTERS}

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))(x)


@pytest.mark.parametrize(("over", "dim"), [("b", 0), (("a", "b"), 2)])
def test_each_form_equals_psum_scatter(over, dim: int) -> None:
    # (8 devices, 16, 24, 8): dim 0's slices over 4 devices halve (both ways round), dim 2's over 8 do not
    # (8 / 8 = 1: one way round). Integer values sum exactly in any order: bitwise equal.
    whole = jax.random.randint(jax.random.key(0), (8, 16, 24, 8), -1000, 1000).astype(jnp.float32)
    out = _each_form(whole, over, dim)
    for how in OTHERS:
        np.testing.assert_array_equal(out[how], out["psum_scatter"], err_msg=how)
    # Floats sum in ring order, not the collective's: float32 rounding apart.
    out = _each_form(jax.random.normal(jax.random.key(1), (8, 16, 24, 8)), over, dim)
    for how in OTHERS:
        np.testing.assert_allclose(out[how], out["psum_scatter"], rtol=0, atol=4e-6, err_msg=how)


def test_an_unknown_form_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"grad_reduction='tree': a gradient is reduce-scattered by one of"):
        scatter_sum(jnp.zeros(8), "b", 0, "tree")


# -- training: layer-wise stage 3 against plain optax ----------------------------------------------------------

STEPS = 3
# Blocks whose leaves do not divide 4 or 8: w1 (12, 102) is cut on dim 1 (padded to 104), w2 (102, 6) on dim 0.
SHAPES = {"w1": (12, 102), "b1": (102,), "w2": (102, 6)}
DEPTH = 2


def _params(stacked: bool) -> dict:
    rng = np.random.default_rng(0)
    blocks = [{k: jnp.asarray(rng.normal(size=s) / np.sqrt(s[0]), jnp.float32) for k, s in SHAPES.items()}
              for _ in range(DEPTH)]  # fmt: skip
    return {"layers": jax.tree.map(lambda *x: jnp.stack(x), *blocks)} if stacked else {"blocks": blocks}


def _block(p, x):
    """(16, 12) -> (16, 12): the MLP's output added to the first 6 features."""
    y = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return jnp.concatenate([x[:, :6] + y, x[:, 6:]], axis=1)


def _batches() -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(1)
    return [{"x": jnp.asarray(rng.normal(size=(16, 12)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, 6)), jnp.float32)} for _ in range(STEPS)]  # fmt: skip


def _loss(policy):
    def loss(p, b):
        if policy is None:  # plain: the blocks one after another
            h = functools.reduce(lambda x, q: _block(q, x), p["blocks"], b["x"])
        elif "layers" in p:
            h = zj.scan_layers(_block, p["layers"], b["x"], policy, prefetch=1)
        else:
            h = zj.apply_layers(_block, p["blocks"], b["x"], policy, prefetch=1)
        return jnp.mean((h[:, :6] - b["y"]) ** 2)

    return loss


@functools.cache
def _reference():
    return reference_run(optax.adam(1e-2), _params(False), _batches(), _loss(None))[0]


def _train(policy: zj.ZeroPolicy, how: str, steps: int = STEPS) -> tuple[zj.TrainState, object]:
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    params = _params(stacked=bool(policy.stacked_prefixes))
    with zj.measure.trying_schedule(grad_reduction=how):
        step = zj.make_train_step(_loss(policy), tx, policy, gather="manual")
        state = zj.init_state(params, tx, policy)
        for batch in _batches()[:steps]:
            state, _ = step(state, batch)
    return state, step


def _as_blocks(params: dict) -> dict:
    if "blocks" in params:
        return params
    return {"blocks": [jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(DEPTH)]}


CASES = [("flat", True, "ring"), ("flat", False, "bidirectional_ring"), ("flat", True, "all_to_all"),
         ("hybrid", False, "ring"), ("hpz", True, "ring")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "stacked", "how"), CASES)
def test_layerwise_stage3_trains_like_plain_optax(mesh: str, stacked: bool, how: str) -> None:
    # Partition dims 1 and 0, padded; scan_layers and apply_layers; on the hybrid mesh (HSDP) the ring runs
    # over the 4 shards and the 1/4 pieces are all-reduced over the 2 replicas; with hpZ a ring over each axis.
    kw = {"stacked": "layers"} if stacked else {}
    if mesh == "flat":
        policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=64, **kw)
    elif mesh == "hpz":  # ZeRO++'s hpZ: reduced within each node (4 chips), then across the 2 nodes
        policy = zj.ZeroPolicy(3, make_mesh(8, ("node", "chip"), (2, 4)), ("node", "chip"), secondary_axis="chip",
                               min_shard_size=64, **kw)  # fmt: skip
    else:
        policy = zj.ZeroPolicy(3, make_mesh(8, ("replica", "data"), (2, 4)), "data", replica_axis="replica",
                               min_shard_size=64, **kw)  # fmt: skip
    layouts = jax.tree.leaves(policy.layouts(_params(stacked)), is_leaf=lambda x: hasattr(x, "padding"))
    cuts = {(lay.shape[-2:], lay.dim - stacked, lay.padding) for lay in layouts if len(lay.shape) > 1 + stacked}
    w1 = ((12, 102), 0, 0) if mesh == "hybrid" else ((12, 102), 1, 2)  # 12 rows divide 4 shards, not 8
    assert cuts == {w1, ((102, 6), 0, 2)}
    state, step = _train(policy, how)
    errors = relative_update_error(_as_blocks(zj.full_params(state)), _reference(), _params(False))
    assert max(errors.values()) <= FP32_RTOL, errors
    kinds = {c.kind for c in _measure.collectives(step.jitted, state, _batches()[0])}
    assert ("collective-permute" in kinds) == how.endswith("ring")


@pytest.mark.slow
def test_the_int8_wire_keeps_its_all_to_all() -> None:
    # qgZ sends int8 blocks by one all-to-all: grad_reduction leaves it be (the same numbers, no permute).
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=64, quantize_grads="int8",
                            quant_block=64)
    runs = {how: _train(policy, how, steps=1) for how in ("psum_scatter", "ring")}
    for how, (state, step) in runs.items():
        kinds = {c.kind for c in _measure.collectives(step.jitted, state, _batches()[0])}
        assert "all-to-all" in kinds and "collective-permute" not in kinds, how
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), *(zj.full_params(s) for s, _ in runs.values()))
    assert all(jax.tree.leaves(same))


# -- the TPU compiler (deviceless, v5p:2x2x2): one pass, async and overlapped -------------------------------------

TPU_SHAPES = {"w1": (256, 512), "w2": (512, 256)}
TPU_DEPTH = 3


@functools.cache
def _tpu_audit(how: str | None) -> zj.AuditReport:
    """Layer-wise stage 3 (``scan_layers``, prefetch 1) compiled for v5p:2x2x2 with the seam's schedule
    (``how=None``) or another ``grad_reduction``, audited."""
    mesh = zj.topology_mesh("v5p:2x2x2", axis_types=(jax.sharding.AxisType.Auto,))
    policy = zj.ZeroPolicy(3, mesh, stacked="layers")
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    params = {"layers": {k: f32((TPU_DEPTH, *s)) for k, s in TPU_SHAPES.items()}}
    block = lambda p, x: x + jnp.tanh(x @ p["w1"]) @ p["w2"]  # noqa: E731
    loss = lambda p, b: jnp.mean(zj.scan_layers(block, p["layers"], b["x"], policy, prefetch=1) ** 2)  # noqa: E731
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    with zj.measure.trying_schedule(**({"grad_reduction": how} if how else {})):
        step = zj.make_train_step(loss, tx, policy, gather="manual")
        batch = {"x": jax.ShapeDtypeStruct((2 * mesh.size, 256), jnp.float32, sharding=policy.batch_sharding())}
        return zj.audit(step, zj.init_state(params, tx, policy), batch, grads=False)


@pytest.mark.slow
def test_on_v5p_the_seams_ring_sends_the_gradients_once_and_overlaps_them() -> None:
    # libtpu 0.0.42.1 and 0.0.52 alike: psum_scatter runs as all-reduce + dynamic-slice (two passes, synchronous);
    # the ring as N - 1 = 7 async collective-permutes per leaf and layer, one pass, with compute in flight.
    ring, plain = _tpu_audit(None), _tpu_audit("psum_scatter")
    assert zj.measure.schedule_for(zj.ZeroPolicy(3, zj.topology_mesh("v5p:2x2x2"))).grad_reduction == "ring"
    reductions = TPU_DEPTH * len(TPU_SHAPES)
    grads = reductions * 256 * 512 * 4  # float32 gradients, whole
    rs = plain.compiled.kind("reduce-scatter")
    assert (rs.executions, rs.decomposed, rs.ring_bytes) == (reductions, reductions, 2 * 7 / 8 * grads)
    assert plain.overlap.row("layer reduction").overlapped == 0
    assert ring.compiled.kind("reduce-scatter") is None
    cp = ring.compiled.kind("collective-permute")
    assert (cp.executions, cp.async_executions, cp.ring_bytes) == (7 * reductions, 7 * reductions, 7 / 8 * grads)
    row = ring.overlap.row("layer reduction")
    assert row.executions == 7 * reductions and row.overlapped_bytes / row.bytes > 0.9
    assert ring.compiled.ring_bytes == pytest.approx(plain.compiled.ring_bytes - 7 / 8 * grads)
    assert [(b.layers, b.weights, b.reduces_per_weight) for b in ring.layers.blocks] == [(TPU_DEPTH, 2, 1.0)]
    gathers = [r.overlap.row("layer all-gather") for r in (ring, plain)]
    assert gathers[0][1:] == gathers[1][1:]  # the layer gathers overlap as they did
    assert ring.check() is ring and plain.check() is plain
