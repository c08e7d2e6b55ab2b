"""The train step under inputs a new user plausibly gives it (issue 13): non-float
parameter leaves, a donated state used again, ragged batches, non-finite steps,
frozen parameters with gradient accumulation. Each compares against unsharded
optax on the same batch, per stage."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import HIDDEN, make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax import measure as _measure

N = 8
STAGES = [0, 1, 2, 3]
TOL = 1e-4  # relative L2 of the accumulated update, fp32 (reduction order only)


def _policy(stage: int, **kw) -> zj.ZeroPolicy:
    return zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=64, **kw)


def _floats(tree):
    return {k: v for k, v in tree.items() if isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.floating)}


def _assert_close_to(final, reference, start, tol=TOL) -> None:
    errs = relative_update_error(final, reference, start)
    assert max(errs.values()) < tol, errs


# -- 1. non-float leaves -------------------------------------------------------------


def _with_non_float(params):
    return {
        **params,
        "count": jnp.arange(N * 4, dtype=jnp.int32),  # large enough to be cut, were it a float
        "mask": jnp.arange(HIDDEN) % 3 != 0,
        "nested": {"step": jnp.asarray(7, jnp.int32)},
    }


def _masked_loss(params, batch):
    """Reads the int and bool leaves (as data, not as something to differentiate)."""
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"]) * params["mask"]
    pred = (h @ params["w2"] + params["b2"]) * params["scale"]
    return jnp.mean((pred - batch["y"]) ** 2) + 0.0 * params["count"].sum() * params["nested"]["step"]


@pytest.mark.parametrize("stage", STAGES)
def test_non_float_leaves_train_untouched_and_floats_match_optax(stage: int) -> None:
    params = _with_non_float(mlp_params())
    policy = _policy(stage)
    opt = optax.adamw(1e-2, weight_decay=0.1)  # weight decay would move an int leaf if it reached it
    tx = zj.shard_optimizer(opt, policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(_masked_loss, tx, policy)
    grads = step.grads(state, mlp_batch())
    assert grads["count"] is None and grads["mask"] is None and grads["nested"]["step"] is None
    batches = [mlp_batch(seed=s) for s in range(3)]
    for b in batches:
        state, metrics = step(state, b)
    non_float = {"count": params["count"], "mask": params["mask"], "nested": params["nested"]}
    for name in ("count", "mask"):
        leaf = state.params[name]
        assert leaf.dtype == params[name].dtype and leaf.sharding.is_fully_replicated
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(params[name]))
    assert int(state.params["nested"]["step"]) == 7
    full = zj.full_params(state)
    np.testing.assert_array_equal(np.asarray(full["count"]), np.asarray(params["count"]))

    floats = _floats(params)
    ref, _ = reference_run(opt, floats, batches, loss_fn=lambda p, b: _masked_loss({**p, **non_float}, b))
    _assert_close_to(_floats(full), ref, floats)
    # The optimizer state keeps its dtypes step after step (no retrace).
    before = [x.dtype for x in jax.tree.leaves(state.opt_state)]
    state, _ = step(state, batches[0])
    assert [x.dtype for x in jax.tree.leaves(state.opt_state)] == before


def test_non_float_leaves_cost_no_communication() -> None:
    policy = _policy(3)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    plain = zj.init_state(mlp_params(), tx, policy)
    with_ints = zj.init_state(_with_non_float(mlp_params()), tx, policy)
    loss = lambda p, b: mlp_loss(p, b)  # noqa: E731 - ignores the extra leaves
    a = _measure.collectives(zj.make_train_step(loss, tx, policy).jitted, plain, mlp_batch())
    b = _measure.collectives(zj.make_train_step(loss, tx, policy).jitted, with_ints, mlp_batch())
    assert _measure.ring_bytes(a) == _measure.ring_bytes(b)


def test_python_numbers_are_converted_and_none_is_empty() -> None:
    policy = _policy(2)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    params = {**mlp_params(), "k": 3, "flag": True, "temp": 2.0, "unused": None}
    state = zj.init_state(params, tx, policy)
    assert state.params["k"].dtype == jnp.int32 and state.params["flag"].dtype == jnp.bool_
    assert state.params["temp"].dtype == jnp.float32 and state.params["unused"] is None

    def loss(p, b):
        return mlp_loss(p, b) * p["temp"] / 2.0 + 0.0 * p["k"]

    state, metrics = zj.make_train_step(loss, tx, policy)(state, mlp_batch())
    assert int(state.params["k"]) == 3 and bool(state.params["flag"])
    assert np.isfinite(float(metrics["loss"])) and float(state.params["temp"]) != 2.0  # temp is trained


def test_non_array_parameter_leaves_are_refused_naming_each() -> None:
    policy = _policy(1)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    params = {**mlp_params(), "name": "mlp", "act": {"fn": jnp.tanh}}
    with pytest.raises(TypeError, match=r"2 parameter leaf.*'act/fn' \(.*'name' \(str\)"):
        zj.init_state(params, tx, policy)


# -- 2. a donated state used again ------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_donated_state_raises_and_full_params_outlive_the_step(stage: int) -> None:
    policy = _policy(stage)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    kept = zj.full_params(state)
    new_state, _ = step(state, mlp_batch())
    # What full_params handed out before the step is still there, unchanged.
    for name, x in mlp_params().items():
        np.testing.assert_array_equal(np.asarray(kept[name]), np.asarray(x))
    for call in (step, step.lower, step.grads):
        with pytest.raises(ValueError, match="donated to an earlier train step"):
            call(state, mlp_batch())
    with pytest.raises(ValueError, match="full_params: .* donated"):
        zj.full_params(state)
    new_kept = zj.full_params(new_state)
    step(new_state, mlp_batch())
    assert np.isfinite(np.asarray(new_kept["w1"])).all()


@pytest.mark.slow
def test_reusing_a_donated_stage3_state_is_an_error_not_a_segfault() -> None:
    """On the base commit this path (the jitted stage-3 step on deleted buffers) segfaulted."""
    code = textwrap.dedent(
        """
        import sys
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        import optax, zero_jax as zj
        sys.path.insert(0, "tests")
        from _models import HIDDEN, make_mesh, mlp_batch, mlp_loss, mlp_params
        policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=64)
        tx = zj.shard_optimizer(optax.adam(1e-2), policy)
        state = zj.init_state(mlp_params(), tx, policy)
        step = zj.make_train_step(mlp_loss, tx, policy)
        step(state, mlp_batch())
        try:
            step(state, mlp_batch())
        except ValueError as e:
            print("ERROR:", e)
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERROR: train_step:" in out.stdout and "donated" in out.stdout


# -- 3. ragged batches -------------------------------------------------------------------


def test_batch_leaves_of_different_sizes_name_both() -> None:
    policy = _policy(2)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    batch = mlp_batch(16)
    batch["y"] = batch["y"][:8]
    with pytest.raises(ValueError, match=r"different leading .*'x' \(16, 12\), 'y' \(8, 6\)"):
        step(state, batch)


# -- 4. non-finite steps ---------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_apply_if_finite_keeps_params_after_a_nan_batch(stage: int) -> None:
    policy = _policy(stage)
    tx = zj.shard_optimizer(optax.apply_if_finite(optax.adam(1e-2), 3), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    bad = mlp_batch()
    bad["x"] = bad["x"].at[3, 2].set(jnp.nan)
    before = zj.full_params(state)
    state, metrics = step(state, bad)
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["grad_norm"]))
    after = zj.full_params(state)
    for name in before:
        np.testing.assert_array_equal(np.asarray(after[name]), np.asarray(before[name]))
    state, metrics = step(state, mlp_batch())
    assert bool(metrics["finite"]) and metrics["finite"].dtype == jnp.bool_
    ref, _ = reference_run(optax.adam(1e-2), mlp_params(), [mlp_batch()])
    _assert_close_to(zj.full_params(state), ref, mlp_params())


# -- 6. frozen parameters with accumulation -----------------------------------------------

FROZEN = {"w1": True, "b1": True, "w2": False, "b2": True, "scale": False}  # True: trainable


def _labels(mask):
    return {k: "train" if v else "frozen" for k, v in mask.items()}


# Every stage, each accumulation mode and each way of freezing met twice, pairwise (the freezing is the
# optimizer's, the accumulation the gradient's: neither path reads the other).
FROZEN_CASES = [(0, "local", "trainable"), (1, "partitioned", "set_to_zero"), (2, "local", "set_to_zero"),
                (3, "partitioned", "trainable"), (3, "local", "set_to_zero")]  # fmt: skip


@pytest.mark.parametrize(("stage", "mode", "how"), FROZEN_CASES)
def test_frozen_parameters_with_accumulation_match_optax(stage: int, mode: str, how: str) -> None:
    policy = _policy(stage)
    adam = optax.adam(1e-2)
    masked = optax.multi_transform({"train": adam, "frozen": optax.set_to_zero()}, _labels(FROZEN))
    if how == "trainable":
        tx = zj.shard_optimizer(adam, policy, trainable=FROZEN)
    else:
        tx = zj.shard_optimizer(masked, policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy, accum_steps=2, accum_mode=mode)
    batches = [mlp_batch(32, seed=s) for s in range(2)]
    for b in batches:
        state, _ = step(state, b)
    full = zj.full_params(state)
    ref, _ = reference_run(masked, mlp_params(), batches)
    trained = [k for k, v in FROZEN.items() if v]
    _assert_close_to({k: full[k] for k in trained}, {k: ref[k] for k in trained}, {k: mlp_params()[k] for k in trained})
    np.testing.assert_array_equal(np.asarray(full["w2"]), np.asarray(mlp_params()["w2"]))


@pytest.mark.slow
def test_readme_precision_block_trains() -> None:
    """The README's "Precision, accumulation, clipping, frozen parameters" block."""
    mesh = make_mesh(N)
    mask = FROZEN
    policy = zj.ZeroPolicy(
        stage=2,
        mesh=mesh,
        min_shard_size=64,
        precision=zj.Precision(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32),
    )
    tx = zj.shard_optimizer(optax.adamw(1e-3), policy, trainable=mask)
    train_step = zj.make_train_step(mlp_loss, tx, policy, accum_steps=4, clip_norm=1.0)
    state = zj.init_state(mlp_params(), tx, policy)
    batches = [mlp_batch(64, seed=s) for s in range(3)]
    for b in batches:
        state, metrics = train_step(state, b)
    full = zj.full_params(state)
    np.testing.assert_array_equal(np.asarray(full["w2"]), np.asarray(mlp_params()["w2"]))
    ref_tx = optax.multi_transform(
        {"train": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), "frozen": optax.set_to_zero()},
        _labels(mask),
    )
    ref, _ = reference_run(ref_tx, mlp_params(), batches)
    trained = [k for k, v in mask.items() if v]
    # bf16 forward/backward against an fp32 reference: a loose but real bound.
    _assert_close_to({k: full[k] for k in trained}, {k: ref[k] for k in trained},
                     {k: mlp_params()[k] for k in trained}, tol=0.1)  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1])
def test_full_params_of_a_master_copy_outlive_the_step(stage: int) -> None:
    """Mixed precision: full_params reads the fp32 master copy (whole in stage 0)."""
    policy = _policy(stage, precision=zj.Precision(compute_dtype=jnp.bfloat16))
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    kept = zj.full_params(state)
    zj.make_train_step(mlp_loss, tx, policy)(state, mlp_batch())
    for name, x in mlp_params().items():
        np.testing.assert_array_equal(np.asarray(kept[name]), np.asarray(x))


# -- the stage predicates the step asks (issue 14) ---------------------------------------------


def test_stage_predicates() -> None:
    mesh = make_mesh(8, ("replica", "data"), (2, 4))
    sees_slice = [zj.ZeroPolicy(s, mesh, axis="data").optimizer_sees_slice for s in STAGES]
    assert sees_slice == [False, True, True, False]
    over = zj.ZeroPolicy(3, mesh, axis="data", replica_axis="replica", optimizer_over_replicas=True)
    assert over.optimizer_sees_slice
    assert [zj.ZeroPolicy(s, mesh, axis="data").default_accum_mode for s in STAGES] == [
        "local",
        "local",
        "partitioned",
        "partitioned",
    ]
