"""Hybrid policies on a (replica, data) = (2, 4) mesh: HSDP, and the optimizer
partitioned over both axes (optimizer_over_replicas) -- numbers, bytes and
the collectives per mesh axis."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax import measure as _measure
from zero_jax._layout.leaf import shard_shape
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

R, N = 2, 4
KINDS = {"hsdp": {}, "hpz": {"optimizer_over_replicas": True}}
CASES = [("hsdp", s) for s in range(4)] + [("hpz", s) for s in (1, 2, 3)]


def _mesh() -> jax.sharding.Mesh:
    assert jax.device_count() == 8
    return make_mesh(8, ("replica", "data"), (R, N))


def _policy(kind: str, stage: int, **kw) -> zj.ZeroPolicy:
    return zj.ZeroPolicy(stage, _mesh(), "data", replica_axis="replica", **KINDS[kind], **kw)


# SGD with momentum sees the gradient's scale (Adam would hide a gradient summed twice);
# AdamW with a global-norm clip exercises the norm across pieces.
OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(0.1, momentum=0.9), None),
    "adamw_clip": (lambda: optax.adamw(1e-2, weight_decay=0.1), 1.0),
}


@functools.cache
def _mlp_reference(opt: str) -> tuple[Any, list[float]]:
    """Plain optax on one device, once per optimizer (the same for every kind and stage)."""
    make_tx, clip = OPTIMIZERS[opt]
    ref_tx = make_tx() if clip is None else optax.chain(optax.clip_by_global_norm(clip), make_tx())
    return reference_run(ref_tx, mlp_params(), [mlp_batch(seed=s) for s in range(4)])


# SGD in every case; AdamW with the clip (the norm across pieces and replicas) in each kind's stage 3.
@pytest.mark.parametrize(
    ("kind", "stage", "opt"), [(k, s, "sgd") for k, s in CASES] + [(k, 3, "adamw_clip") for k in KINDS]
)
def test_hybrid_policies_equal_unsharded_optax(kind: str, stage: int, opt: str) -> None:
    make_tx, clip = OPTIMIZERS[opt]
    policy = _policy(kind, stage, min_shard_size=0)  # cut every leaf, padding included (100 and 6 do not divide 8)
    tx = zj.shard_optimizer(make_tx(), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy, clip_norm=clip)
    batches = [mlp_batch(seed=s) for s in range(4)]
    losses, norms = [], []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    ref, ref_losses = _mlp_reference(opt)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    first = jax.grad(mlp_loss)(mlp_params(), batches[0])
    assert norms[0] == pytest.approx(float(optax.tree.norm(first)), rel=1e-6)
    errors = relative_update_error(zj.full_params(state), ref, mlp_params())
    assert max(errors.values()) <= 1e-5, errors  # fp32; observed <= 4e-7
    assert step.jitted._cache_size() == 1  # the state comes back with its own shardings


LAYERED = TransformerConfig(vocab=64, dim=32, depth=3, heads=2, seq=16)


def _layered_batches() -> list[dict[str, jax.Array]]:
    return [synthetic_batch(LAYERED, 16, jax.random.key(10 + i)) for i in range(3)]


@functools.cache
def _layered_reference() -> Any:
    """Plain optax on one device, once for every case below."""
    params = init_params(LAYERED, jax.random.key(0))
    return reference_run(optax.adam(1e-2), params, _layered_batches(), loss_fn=make_loss_fn(LAYERED))[0]


# Three of kind x accumulation: both kinds accumulate (the replica axis crossed once per step, each kind's own
# pieces); without accumulation, the replica-partitioned optimizer. HSDP's layer-wise stage 3 without
# accumulation is the same scan with one microbatch (hsdp-2 runs it twice per step; tests/test_multihost.py's
# hsdp3 and tests/test_apply_layers.py's hybrid meshes train it).
@pytest.mark.parametrize(("kind", "accum_steps"), [("hsdp", 2), ("hpz", 1), ("hpz", 2)])
def test_hybrid_layerwise_stage3_and_accumulation(kind: str, accum_steps: int) -> None:
    cfg = LAYERED
    policy = _policy(kind, 3, stacked="layers")
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    params = init_params(cfg, jax.random.key(0))
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual", accum_steps=accum_steps)
    batches = _layered_batches()
    for b in batches:
        state, _ = step(state, b)
    ref = _layered_reference()
    errors = relative_update_error(zj.full_params(state), ref, params)
    assert max(errors.values()) <= 1e-5, errors
    if accum_steps == 2:
        # The replica axis sees each piece once per step, after the accumulation loop.
        colls = _measure.collectives(step.jitted, state, batches[0])
        crossing = [c for c in colls if c.axes(policy.mesh) == ("replica",) and c.kind != "all-gather"]
        assert crossing and all(c.trips == 1 for c in crossing)


# -- bytes and collectives: a model whose leaves divide R*N, so the formulas are exact up to one bias ----------

BIG = {"w1": (128, 256), "w2": (256, 32), "b": (32,)}  # b: below min_shard_size, kept whole (0.08% of Φ)


def _big_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.normal(size=s) * 0.05, jnp.float32) for k, s in BIG.items()}


def _big_loss(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] + p["b"] - b["y"]) ** 2)


def _big_batch() -> dict[str, jax.Array]:
    rng = np.random.default_rng(1)
    return {"x": jnp.asarray(rng.normal(size=(16, 128)), jnp.float32), "y": jnp.zeros((16, 32), jnp.float32)}


def _big(kind: str, stage: int):
    policy = _policy(kind, stage)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state(_big_params(), tx, policy)
    return policy, state, zj.make_train_step(_big_loss, tx, policy)


@pytest.mark.parametrize(("kind", "stage"), CASES)
def test_hybrid_bytes_per_device_match_the_formula(kind: str, stage: int) -> None:
    policy, state, step = _big(kind, stage)
    phi = sum(math.prod(s) for s in BIG.values())
    formula = zj.model_state_bytes(
        phi, N, stage, param_bytes=4, grad_bytes=4, optimizer_bytes=8, replicas=R,
        optimizer_over_replicas=kind == "hpz",
    )  # fmt: skip
    grads = step.grads(state, _big_batch())
    measured = {
        "params": _measure.resident_bytes(state.params),
        "grads": _measure.resident_bytes(grads),
        "optimizer": _measure.resident_bytes(state.opt_state),
    }
    for cat, per_device in measured.items():
        assert len(per_device) == 8
        largest = max(per_device.values())
        want = getattr(formula, cat) + (4 if cat == "optimizer" else 0)  # + Adam's int32 step count
        assert largest == pytest.approx(want, rel=0.01), (cat, largest, want)
        assert max(per_device.values()) == min(per_device.values())  # balanced


@pytest.mark.parametrize(("kind", "stage"), [(k, s) for k, s in CASES if s >= 1])
def test_hybrid_collectives_per_axis(kind: str, stage: int) -> None:
    policy, state, step = _big(kind, stage)
    mesh = policy.mesh
    colls = _measure.collectives(step.jitted, state, _big_batch())
    weights = {name: BIG[name] for name in ("w1", "w2")}
    whole = set(weights.values())
    layouts = policy.layouts(_big_params())
    piece = {shard_shape(layouts[name], N) for name in weights}
    finer = {shard_shape(layouts[name], R * N) for name in weights}
    gradient_sized = [c for c in colls if math.prod(c.shape) >= 1024]
    by_kind: dict[tuple[str, tuple[str, ...]], set] = {}
    for c in gradient_sized:
        by_kind.setdefault((c.kind, c.axes(mesh)), set()).add(c.shape)
    # Within `data`: every whole gradient reduce-scattered (HLO shows the 1/N result).
    assert by_kind[("reduce-scatter", ("data",))] == piece
    if kind == "hsdp":
        # Across `replica`: only the 1/N pieces, all-reduced; nothing whole crosses it.
        assert by_kind[("all-reduce", ("replica",))] == piece
        expected_gather = ("all-gather", ("data",))
    else:
        # Across `replica`: the 1/N pieces reduce-scattered (into 1/(R N)), no all-reduce.
        assert by_kind[("reduce-scatter", ("replica",))] == finer
        assert not any(k == "all-reduce" for k, _ in by_kind)
        expected_gather = ("all-gather", ("replica",) if stage == 3 else ("replica", "data"))
    if stage == 3:
        assert by_kind[("all-gather", ("data",))] == whole  # forward and backward gathers
    if kind == "hpz" and stage == 3:
        assert by_kind[expected_gather] == piece  # the updated 1/(R N) pieces -> 1/N parameter pieces
    else:
        assert by_kind[expected_gather] == whole  # stages 1-2: the updated parameters
    kinds = {k for k in by_kind} - {("reduce-scatter", ("data",)), expected_gather, ("all-gather", ("data",))}
    kinds -= {("all-reduce", ("replica",)), ("reduce-scatter", ("replica",))}
    assert not kinds, kinds  # nothing else gradient-sized moves

    report = zj.audit(step, state, _big_batch()).check()  # no gradient-sized all-reduce flagged, comm on theory
    assert report.comm.accounted_ratio == pytest.approx(1.0, abs=0.01)
    assert report.formula["optimizer"] == pytest.approx(report.state_bytes["optimizer"], rel=0.01)

    # Ring bytes per axis equal the formula (the small bias and scalars aside). In stage 3
    # the backward pass does not re-gather w1 (its gradient does not use it): the audit's
    # accounting names it, and we take it off.
    skipped = report.comm.theory - report.comm.accounted
    phi = sum(math.prod(s) for s in weights.values())
    theory = zj.comm_bytes_per_axis(phi, N, stage, replicas=R, dtype_bytes=4)
    per_axis = _measure.ring_bytes_per_axis(gradient_sized, mesh)
    if kind == "hpz" and stage < 3:  # the update's all-gather spans both axes: compare the total
        assert sum(per_axis.values()) == pytest.approx(sum(theory.values()), rel=1e-9)
    else:
        assert per_axis["data"] == pytest.approx(theory["shard"] - skipped, rel=1e-9)
        assert per_axis["replica"] == pytest.approx(theory["replica"], rel=1e-9)
    assert "by mesh axes" in str(report)


def test_hybrid_policy_errors_say_what_to_do() -> None:
    mesh = _mesh()
    with pytest.raises(ValueError, match=r"replica_axis 'pods' is not a set of axes of the mesh.*'replica', 'data'"):
        zj.ZeroPolicy(2, mesh, "data", replica_axis="pods")
    with pytest.raises(ValueError, match=r"\['data'\] is both a partition axis"):
        zj.ZeroPolicy(2, mesh, ("replica", "data"), replica_axis="data")
    with pytest.raises(ValueError, match="optimizer_over_replicas=True .* pass replica_axis"):
        zj.ZeroPolicy(2, mesh, "data", optimizer_over_replicas=True)
    with pytest.raises(ValueError, match="optimizer_over_replicas=True needs stage >= 1"):
        zj.ZeroPolicy(0, mesh, "data", replica_axis="replica", optimizer_over_replicas=True)
    with pytest.raises(ValueError, match=r"axis 'model' is not an axis of the mesh"):
        zj.ZeroPolicy(2, mesh, "model", replica_axis="replica")
    policy = _policy("hsdp", 2)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    state = zj.init_state(mlp_params(), tx, policy)
    with pytest.raises(ValueError, match=r"'x' has shape \(12, 12\).*8 devices of the batch axes \('replica', 'data"):
        step(state, mlp_batch(12))
    # A policy for another mesh layout cannot step this state.
    other = zj.ZeroPolicy(2, make_mesh(8), "data")
    with pytest.raises(ValueError, match="the state is laid out for"):
        zj.make_train_step(mlp_loss, zj.shard_optimizer(optax.sgd(0.1), other), other)(state, mlp_batch())


@pytest.mark.parametrize("kind", ["hsdp", "hpz"])
def test_hybrid_checkpoints_move_to_and_from_a_flat_mesh(kind: str, tmp_path) -> None:
    hybrid = _policy(kind, 3, min_shard_size=0)
    flat = zj.ZeroPolicy(2, make_mesh(8), "data", min_shard_size=0)
    tx_h, tx_f = (zj.shard_optimizer(optax.adam(1e-2), p) for p in (hybrid, flat))
    state = zj.init_state(mlp_params(), tx_h, hybrid)
    state, _ = zj.make_train_step(mlp_loss, tx_h, hybrid)(state, mlp_batch())
    zj.save(tmp_path / "h", state, step=1)
    moved = zj.restore(tmp_path / "h", policy=flat, tx=tx_f)
    want = zj.full_params(state)
    for k, v in zj.full_params(moved).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(want[k]), err_msg=k)
    zj.save(tmp_path / "f", moved, step=1)
    back = zj.restore(tmp_path / "f", policy=hybrid, tx=tx_h)
    shardings = lambda tree: [x.sharding for x in jax.tree.leaves(tree)]  # noqa: E731
    assert shardings(back.opt_state) == shardings(state.opt_state)
    for a, b in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(state.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
