"""Offload: optimizer state, master copy and stage-3 parameters in pinned_host memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params

import zero_jax as zj
from zero_jax import measure as _measure
from zero_jax._policy import memory as _memory
from zero_jax._step import offload as _offload
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

MESH = make_mesh(8)


def _train(stage: int, fraction: float, *, precision: zj.Precision | None = None, steps: int = 2):
    policy = zj.ZeroPolicy(stage=stage, mesh=MESH, offload_optimizer=fraction, precision=precision)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    before = _measure.resident_bytes_by_kind(state)
    compiled = step.lower(state, mlp_batch()).compile()
    flags = zj.offload_plan(state)
    for i in range(steps):
        state, metrics = step(state, mlp_batch(seed=i))
    return state, metrics, before, compiled, flags


_BASE: dict[int, tuple] = {}


def _base(stage: int):
    if stage not in _BASE:
        _BASE[stage] = _train(stage, 0.0)
    return _BASE[stage]


def _kinds(tree) -> list[str]:
    return [leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_offloaded_training_is_bitwise_equal_and_placed(stage: int, fraction: float) -> None:
    base, base_metrics, base_bytes, base_compiled, _ = _base(stage)
    state, metrics, offl_bytes, compiled, plan = _train(stage, fraction)

    # Bitwise equal to the run that keeps everything on the device.
    assert float(metrics["loss"]) == float(base_metrics["loss"])
    for a, b in zip(jax.tree.leaves(zj.full_params(state)), jax.tree.leaves(zj.full_params(base)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(base.opt_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Exactly the planned leaves report pinned_host, and they stay there across steps.
    expected = ["pinned_host" if h else "device" for h in plan.opt_state]
    assert _kinds(state.opt_state) == expected
    assert _kinds(state.params) == ["device"] * 5
    float_bytes = sum(leaf.nbytes for leaf in plan.leaves if leaf.path.startswith("opt_state/"))
    if fraction == 1.0:
        assert expected == ["device"] + ["pinned_host"] * 10  # the int step count stays on the device
        assert plan.host_bytes == float_bytes
    else:
        # Largest leaves (per device) first: whole, w1 (12 x 100) is the largest; partitioned, w1 is
        # cut into 8 pieces but w2 (600 elements, below min_shard_size) stays whole: 2400 bytes.
        big = "w1" if stage == 0 else "w2"
        host_paths = sorted(leaf.path for leaf in plan.leaves if leaf.host)
        assert host_paths == [f"opt_state/0/mu/{big}", f"opt_state/0/nu/{big}"]
        assert plan.host_bytes == (2 * 4800 if stage == 0 else 2 * 2400)
        assert 0.5 * float_bytes <= plan.host_bytes < float_bytes

    # Measured per device: device bytes drop by exactly the offloaded bytes, which sit in pinned_host.
    for device in MESH.devices.flat:
        assert offl_bytes[(device, "device")] == base_bytes[(device, "device")] - plan.host_bytes
        assert offl_bytes[(device, "pinned_host")] == plan.host_bytes

    # XLA:CPU: host arguments are counted as device arguments and no transfer exists in the
    # compiled program, so the compiled figures are unchanged by offload (see _offload's docstring); jaxlib
    # 0.12.1 adds one 256-byte temp when every float optimizer leaf is on the host (measured, stages 1-3).
    mem, base_mem = _measure.memory(compiled), _measure.memory(base_compiled)
    assert mem["argument"] == base_mem["argument"]
    extra = 256 if fraction == 1.0 and stage > 0 and _measure.compiler_version("cpu")[1] >= (0, 12) else 0
    assert mem["temp"] == base_mem["temp"] + extra
    analysis = compiled.memory_analysis()
    assert analysis.host_argument_size_in_bytes == 0 and analysis.host_temp_size_in_bytes == 0


def test_update_streams_one_chunk_per_parameter() -> None:
    """Adam's chunks are (mu, nu) of one parameter; chunk k enters the device only
    after chunk k-1 is written back (an optimization_barrier per later chunk)."""
    policy = zj.ZeroPolicy(stage=2, mesh=MESH, offload_optimizer=True)
    tx = zj.shard_optimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    seen = []
    real = _offload.chunks

    def spy(fn, args, host):
        groups = real(fn, args, host)
        seen.append((groups, [args[i].shape for g in groups for i in g]))
        return groups

    step = zj.make_train_step(mlp_loss, tx, policy)
    _offload.chunks = spy
    try:
        jaxpr = str(jax.make_jaxpr(step._step)(state, mlp_batch()))
    finally:
        _offload.chunks = real
    ((groups, shapes),) = seen
    # Master (stage 2: a slice of the whole parameters) stays on the device; the clip reads only
    # gradients, so it links nothing: 5 parameters -> 5 chunks of 2 leaves (mu and nu of one).
    assert len(groups) == 5 and all(len(g) == 2 for g in groups)
    pairs = sorted(zip(shapes[::2], shapes[1::2], strict=True))
    assert all(a == b for a, b in pairs)
    stored = [lay.stored_shape for lay in state.layouts.layouts]  # padded: w1 (12, 100) -> (12, 104)
    assert sorted(a for a, _ in pairs) == sorted(stored)
    # Chunks 2..5 each wait for the previous chunk's write-back.
    assert jaxpr.count("optimization_barrier") == 4


def test_mixed_precision_master_is_offloaded_bitwise() -> None:
    prec = zj.Precision(compute_dtype=jnp.bfloat16)
    base = _train(2, 0.0, precision=prec)[0]
    state, _, before, _, plan = _train(2, 1.0, precision=prec)
    assert _kinds(state.master) == ["pinned_host"] * 5
    assert sum(plan.master) == 5
    for a, b in zip(jax.tree.leaves(state.master), jax.tree.leaves(base.master), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert before[(MESH.devices.flat[0], "pinned_host")] == plan.host_bytes


def _find_in_scan(jaxpr, name: str) -> bool:
    """Whether a ``name`` equation sits inside the body of a scan (at any depth)."""

    def walk(j, in_scan: bool) -> bool:
        for eqn in j.eqns:
            if in_scan and eqn.primitive.name == name:
                return True
            for v in eqn.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns") and walk(inner, in_scan or eqn.primitive.name == "scan"):
                        return True
        return False

    return walk(jaxpr.jaxpr, False)


@pytest.mark.slow
def test_offload_params_stage3_scan_layers() -> None:
    cfg = TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=16)
    params = init_params(cfg, jax.random.key(0))
    batch = synthetic_batch(cfg, 16, jax.random.key(1))

    def run(**offload):
        policy = zj.ZeroPolicy(stage=3, mesh=MESH, stacked="layers", **offload)
        tx = zj.shard_optimizer(optax.adam(1e-2), policy)
        state = zj.init_state(params, tx, policy)
        step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
        held = _measure.resident_bytes_by_kind(state.params)
        jaxpr = jax.make_jaxpr(step._step)(state, batch)
        state, metrics = step(state, batch)
        return state, metrics, held, jaxpr

    base, base_metrics, base_held, _ = run()
    state, metrics, held, jaxpr = run(offload_params=True, offload_optimizer=True)
    assert float(metrics["loss"]) == float(base_metrics["loss"])
    for a, b in zip(jax.tree.leaves(zj.full_params(state)), jax.tree.leaves(zj.full_params(base)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Partitioned pieces live on the host; leaves kept whole (below min_shard_size) stay on the device.
    lays = jax.tree.leaves(state.layouts.tree(), is_leaf=lambda x: isinstance(x, zj.LeafLayout))
    assert _kinds(state.params) == ["pinned_host" if lay.partitioned else "device" for lay in lays]
    d0 = MESH.devices.flat[0]
    moved = held[(d0, "pinned_host")]
    assert moved > 0 and held[(d0, "device")] == base_held[(d0, "device")] - moved
    # Each layer's piece is moved to the device inside the scan over layers.
    assert _find_in_scan(jaxpr, "device_put")


@pytest.mark.parametrize("fraction", [1.5, -0.1, float("nan")])
def test_fraction_outside_unit_interval(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"offload_optimizer=.* is outside \[0, 1\].*fraction"):
        zj.ZeroPolicy(stage=1, mesh=MESH, offload_optimizer=fraction)


def test_fraction_type() -> None:
    with pytest.raises(TypeError, match="bool or a fraction"):
        zj.ZeroPolicy(stage=1, mesh=MESH, offload_optimizer="all")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_offload_needs_stage_3(stage: int) -> None:
    with pytest.raises(ValueError, match=f"offload_params=True needs stage=3 \\(got stage={stage}\\)"):
        zj.ZeroPolicy(stage=stage, mesh=MESH, offload_params=True)


def test_backend_without_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_memory, "memory_kinds", lambda device: frozenset({"device"}))
    with pytest.raises(ValueError, match=r"the 'cpu' backend's devices have \['device'\].*Run without offload"):
        zj.ZeroPolicy(stage=2, mesh=MESH, offload_optimizer=0.5)
    with pytest.raises(ValueError, match="'cpu' backend"):
        zj.ZeroPolicy(stage=3, mesh=MESH, offload_params=True)
    zj.ZeroPolicy(stage=2, mesh=MESH)  # no offload: no probe


def test_policy_key_and_repr() -> None:
    a = zj.ZeroPolicy(stage=3, mesh=MESH, offload_optimizer=True, offload_params=True)
    assert a != zj.ZeroPolicy(stage=3, mesh=MESH)
    assert a.offload_optimizer == 1.0 and a.offload_params is True
    assert "offload_optimizer=1.0, offload_params=True" in repr(a)


def test_audit_counts_host_and_device_bytes_separately() -> None:
    reports = {}
    for fraction in (0.0, 1.0):
        policy = zj.ZeroPolicy(stage=2, mesh=MESH, offload_optimizer=fraction)
        tx = zj.shard_optimizer(optax.adam(1e-2), policy)
        state = zj.init_state(mlp_params(), tx, policy)
        step = zj.make_train_step(mlp_loss, tx, policy)
        reports[fraction] = (zj.audit(step, state, mlp_batch(), grads=False), zj.offload_plan(state))
    (base, _), (offl, plan) = reports[0.0], reports[1.0]
    assert base.host_bytes == {}
    assert offl.host_bytes == {"optimizer": plan.host_bytes}
    assert offl.state_bytes["optimizer"] == base.state_bytes["optimizer"] - plan.host_bytes
    assert offl.state_bytes["optimizer"] == 4  # only Adam's int32 step count stays on the device
    assert "offloaded to pinned_host per device: optimizer" in str(offl)
    assert {leaf.memory_kind for leaf in offl.leaves if leaf.category == "optimizer" and leaf.dtype == "float32"} == {
        "pinned_host"
    }


def test_planner_offload() -> None:
    full = zj.model_state_bytes(1e9, 8, 3)
    half = zj.model_state_bytes(1e9, 8, 3, offload_optimizer=0.5)
    assert half.optimizer == full.optimizer / 2
    assert half.total == full.total - full.optimizer / 2
    inf = zj.model_state_bytes(1e9, 8, 3, offload_optimizer=1.0, offload_params=True)
    assert (inf.params, inf.optimizer, inf.grads) == (0.0, 0.0, full.grads)
    with pytest.raises(ValueError, match="offload_params needs stage 3"):
        zj.model_state_bytes(1e9, 8, 2, offload_params=True)
    with pytest.raises(ValueError, match=r"fraction in \[0, 1\]"):
        zj.model_state_bytes(1e9, 8, 2, offload_optimizer=2)
    # 7.5B on 8 x 16 GB with 14 GB of activations: stage 3 needs 15 + 14 GB; with the optimizer
    # offloaded 3.75 + 14 GB; with the parameters offloaded too, 1.875 GB of gradients + 14 GB fit.
    choice = zj.choose_stage(7.5e9, 8, "16GB", "14GB")
    assert (choice.stage, choice.offload_stage, choice.offload_params) == (None, None, True)
    assert "offload_params=True" in choice.reason
    choice = zj.choose_stage(7.5e9, 8, "16GB", "4GB")
    assert (choice.offload_stage, choice.offload_fraction, choice.offload_params) == (3, 0.27, False)
    # The fraction suffices: stage 3 with 27% of its optimizer state offloaded fits, 26% does not.
    assert zj.model_state_bytes(7.5e9, 8, 3, offload_optimizer=0.27).total + 4e9 <= 16e9
    assert zj.model_state_bytes(7.5e9, 8, 3, offload_optimizer=0.26).total + 4e9 > 16e9
