"""Mixed precision, loss scaling, gradient accumulation, clipping, frozen leaves."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import IN, OUT, make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax import measure as _measure

N = 8
BF16 = zj.Precision(compute_dtype=jnp.bfloat16)


def _run(stage: int, steps: int, *, precision=None, opt=None, batches=None, trainable=None, **step_kw):
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=64, precision=precision)
    tx = zj.shard_optimizer(opt or optax.adam(1e-2), policy, trainable=trainable)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy, **step_kw)
    metrics = None
    for batch in batches or [mlp_batch(seed=s) for s in range(steps)]:
        state, metrics = step(state, batch)
    return policy, state, step, metrics


# -- mixed precision --------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_stages_agree_better_than_bf16_agrees_with_fp32() -> None:
    start = mlp_params()
    fp32 = zj.full_params(_run(0, 10)[1])
    bf16_dp = zj.full_params(_run(0, 10, precision=BF16)[1])
    precision_gap = relative_update_error(bf16_dp, fp32, start)
    for stage in (1, 2, 3):
        bf16 = zj.full_params(_run(stage, 10, precision=BF16)[1])
        assert all(v.dtype == jnp.float32 for v in bf16.values())  # the master copy
        stage_gap = relative_update_error(bf16, bf16_dp, start)
        for leaf, gap in stage_gap.items():
            assert gap < precision_gap[leaf], (stage, leaf, gap, precision_gap[leaf])


# Hand-counted for N = 8, min_shard_size = 64 (see test_train.py): partitioned
# leaves padded to 1,352 elements in all, 7 whole-kept elements, 1,312 logical.
PART_PADDED, PART_LOGICAL, WHOLE = IN * 104 + 104 + 104 * OUT, IN * 100 + 100 + 100 * OUT, OUT + 1


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_follow_2_2_12(stage: int) -> None:
    _, state, step, _ = _run(stage, 0, precision=BF16)
    per_device = lambda tree: set(_measure.resident_bytes(tree).values())  # noqa: E731

    def bytes_of(k: int, partitioned: bool) -> int:  # k bytes per parameter
        return k * (PART_PADDED // N + WHOLE) if partitioned else k * (PART_LOGICAL + WHOLE)

    assert per_device(state.params) == {bytes_of(2, stage >= 3)}  # bf16 compute copy
    assert per_device(step.grads(state, mlp_batch())) == {bytes_of(2, stage >= 2)}  # bf16 gradients
    # fp32 master + Adam mu + nu (+ the int32 count): 12 bytes per parameter.
    assert per_device(state.master) | per_device(state.opt_state) == {
        bytes_of(4, stage >= 1),
        bytes_of(8, stage >= 1) + 4,
    }
    assert state.params["w1"].dtype == jnp.bfloat16 and state.master["w1"].dtype == jnp.float32


def test_stage3_gathers_the_compute_copy_and_reduces_in_reduce_dtype() -> None:
    precision = zj.Precision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    _, state, step, _ = _run(3, 0, precision=precision)
    colls = [c for c in _measure.collectives(step.jitted, state, mlp_batch()) if math.prod(c.shape) > 2]
    assert {c.dtype for c in colls if c.kind == "all-gather"} == {"bf16"}
    assert {c.dtype for c in colls if c.kind == "reduce-scatter"} == {"f32"}


def _bf16_params() -> dict[str, jax.Array]:
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), mlp_params())


def test_bf16_parameters_without_a_precision_are_cast_with_a_warning_that_says_how_to_keep_them() -> None:
    """Issue 29: bf16 parameters and no precision= were silently trained in float32 (2x the memory given).
    The default stays float32 (the README's table), but init_state now says so, naming every leaf, and
    names both ways out; any precision= silences it, and so does a policy made from one by .replace."""
    policy = zj.ZeroPolicy(2, make_mesh(N), min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    with pytest.warns(UserWarning, match=r"5 float parameter leaf\(s\) are not float32") as record:
        state = zj.init_state(_bf16_params(), tx, policy)
    text = str(record[0].message)
    for words in ("'w1' (12, 100) bfloat16", "'scale' () bfloat16", "2x the bytes given",
                  "zj.Precision(param_dtype=jnp.bfloat16)", "zj.Precision(compute_dtype=jnp.bfloat16)"):  # fmt: skip
        assert words in text, (words, text)
    assert state.params["w1"].dtype == jnp.float32
    for precision in (zj.Precision(), zj.Precision(param_dtype=jnp.bfloat16), BF16):
        chosen = zj.ZeroPolicy(2, make_mesh(N), min_shard_size=64, precision=precision).replace(stage=3)
        zj.init_state(_bf16_params(), zj.shard_optimizer(optax.sgd(0.1), chosen), chosen)  # no warning (an error)
    assert policy.replace(stage=3).precision_chosen is False and policy == policy.replace(precision=zj.Precision())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_bf16_parameters_kept_in_bf16_train_like_plain_optax_in_bf16(stage: int) -> None:
    """precision=zj.Precision(param_dtype=jnp.bfloat16): no float32 copy anywhere (parameters, Adam's
    moments), and the result is plain optax on the bf16 parameters to bf16 rounding (5e-2 relative
    update: the gradient sums run in bf16, in another order)."""
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=64, precision=zj.Precision(param_dtype=jnp.bfloat16))
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_bf16_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    batches = [jax.tree.map(lambda x: x.astype(jnp.bfloat16), mlp_batch(seed=s)) for s in range(3)]
    for b in batches:
        state, _ = step(state, b)
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype(jnp.bfloat16)}
    assert state.master is None
    ref, _ = reference_run(optax.adam(1e-2), _bf16_params(), batches)
    got = jax.tree.map(lambda x: x.astype(jnp.float32), zj.full_params(state))
    errors = relative_update_error(got, jax.tree.map(lambda x: x.astype(jnp.float32), ref),
                                   jax.tree.map(lambda x: x.astype(jnp.float32), _bf16_params()))  # fmt: skip
    print(f"stage {stage}: bf16 against plain optax in bf16, max relative update error {max(errors.values()):.2e}")
    assert max(errors.values()) <= 5e-2, errors


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_parameters_with_a_loss_scale_train_like_plain_optax_in_fp16(stage: int) -> None:
    """Pure fp16 (param_dtype float16, no master copy) with a dynamic loss scale: the unscaled gradient stays
    float16, the optimizer state keeps its dtype through the overflow check (base: the unscaling divided by a
    float32 scale, so the update returned float32 state against float16: "cond branches must have equal output
    types" in the first step), and training is plain optax on the float16 parameters to float16 rounding (the
    scale is a power of two: scaling and unscaling are exact; 1e-2 relative update: the gradient sums run in
    float16, in another order). Adam's eps 1e-4: its default 1e-8 is 0 in float16 (the smallest subnormal is
    6e-8), and an element whose squared gradient underflows would divide 0 by 0, here and in plain optax."""
    fp16 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float16), tree)  # noqa: E731
    precision = zj.Precision(param_dtype=jnp.float16, loss_scale=zj.DynamicLossScale(initial=4.0))
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=64, precision=precision)
    tx = zj.shard_optimizer(optax.adam(1e-2, eps=1e-4), policy)
    state = zj.init_state(fp16(mlp_params()), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    batches = [fp16(mlp_batch(seed=s)) for s in range(3)]
    for b in batches:
        state, m = step(state, b)
        assert int(m["skipped"]) == 0
    assert {x.dtype for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim} == {jnp.dtype(jnp.float16)}
    ref, _ = reference_run(optax.adam(1e-2, eps=1e-4), fp16(mlp_params()), batches)
    errors = relative_update_error(zj.full_params(state), ref, fp16(mlp_params()))
    assert max(errors.values()) <= 1e-2, errors


# -- loss scaling -----------------------------------------------------------------------

FP16 = zj.Precision(compute_dtype=jnp.float16, loss_scale=zj.DynamicLossScale(initial=2.0**10, growth_interval=2))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_overflow_skips_the_step_everywhere_and_lowers_the_scale(stage: int) -> None:
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=64, precision=FP16)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    state, m = step(state, mlp_batch(seed=0))
    assert int(m["skipped"]) == 0
    before = jax.tree.map(np.asarray, state)
    poisoned = mlp_batch(seed=1)
    poisoned["x"] = poisoned["x"].at[3, 0].set(jnp.inf)  # one row on one device
    state, m = step(state, poisoned)
    assert int(m["skipped"]) == 1 and int(state.loss_scale.skipped) == 1
    assert float(state.loss_scale.scale) == 2.0**9
    for name in ("params", "master", "opt_state"):
        for a, b in zip(jax.tree.leaves(getattr(state, name)), jax.tree.leaves(getattr(before, name)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)  # bitwise unchanged
    # Training continues; two finite steps in a row grow the scale back.
    for s in (2, 3):
        state, m = step(state, mlp_batch(seed=s))
        assert int(m["skipped"]) == 0 and np.isfinite(float(m["loss"]))
    assert float(state.loss_scale.scale) == 2.0**10
    assert not np.array_equal(np.asarray(state.master["w1"]), before.master["w1"])


# -- gradient accumulation --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["local", "partitioned"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_equals_one_step_on_the_whole_batch(stage: int, mode: str) -> None:
    batch = mlp_batch(n=64, seed=7)
    start = mlp_params()
    _, whole, _, m1 = _run(stage, 0, opt=optax.sgd(0.1, momentum=0.9), batches=[batch, batch])
    _, accum, step, mk = _run(
        stage, 0, opt=optax.sgd(0.1, momentum=0.9), batches=[batch, batch], accum_steps=4, accum_mode=mode
    )
    errors = relative_update_error(zj.full_params(accum), zj.full_params(whole), start)
    assert max(errors.values()) <= 1e-6, errors
    assert float(mk["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-6)
    # One gradient reduction per step (local) or one per microbatch (partitioned).
    colls = _measure.collectives(step.jitted, accum, batch)
    grad_reductions = [
        c
        for c in colls
        if c.kind in ("reduce-scatter", "all-reduce") and c.shape == ((13, 6) if stage >= 1 else (100, 6))
    ]  # w2's gradient: a piece from stage 1, whole in stage 0
    assert sum(c.trips for c in grad_reductions) == (1 if mode == "local" else 4), grad_reductions


def test_multisteps_still_works_with_accumulation_by_optax() -> None:
    batches = [mlp_batch(seed=s) for s in range(4)]
    ref, _ = reference_run(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), mlp_params(), batches)
    _, state, _, _ = _run(2, 0, opt=optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), batches=batches)
    assert max(relative_update_error(zj.full_params(state), ref, mlp_params()).values()) <= 1e-5


# -- clipping -----------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_clipping_uses_the_global_norm(stage: int) -> None:
    batches = [mlp_batch(seed=s) for s in range(3)]
    threshold = 0.05
    ref, _ = reference_run(optax.chain(optax.clip_by_global_norm(threshold), optax.sgd(0.5)), mlp_params(), batches)
    unclipped_norm = float(optax.tree.norm(jax.grad(mlp_loss)(mlp_params(), batches[0])))
    assert unclipped_norm > 5 * threshold  # the test is not vacuous: clipping changes every step
    _, state, _, metrics = _run(stage, 0, opt=optax.sgd(0.5), batches=batches, clip_norm=threshold)
    assert float(metrics["grad_norm"]) > threshold
    errors = relative_update_error(zj.full_params(state), ref, mlp_params())
    assert max(errors.values()) <= 1e-5, errors


# -- frozen parameters ------------------------------------------------------------------

TRAINABLE = {"w1": False, "b1": True, "w2": True, "b2": True, "scale": True}


def _frozen_via_optax():
    labels = {k: ("train" if v else "frozen") for k, v in TRAINABLE.items()}
    return optax.multi_transform({"train": optax.adam(1e-2), "frozen": optax.set_to_zero()}, labels)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["mask", "optax"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_leaves_get_no_state_no_gradient_no_communication(stage: int, how: str) -> None:
    kw = {"trainable": TRAINABLE} if how == "mask" else {"opt": _frozen_via_optax()}
    _, frozen_state, frozen_step, _ = _run(stage, 2, **kw)
    _, state, step, _ = _run(stage, 0)
    batch = mlp_batch()
    w1_opt = 2 * IN * 104 * 4 // N  # Adam mu + nu of w1's piece
    w1_grad = IN * 104 * 4 // N if stage >= 2 else IN * 100 * 4
    opt_b = set(_measure.resident_bytes(frozen_state.opt_state).values())
    assert opt_b == {b - w1_opt for b in _measure.resident_bytes(state.opt_state).values()}
    grads = frozen_step.grads(frozen_state, batch)
    assert grads["w1"] is None
    assert set(_measure.resident_bytes(grads).values()) == {
        b - w1_grad for b in _measure.resident_bytes(step.grads(state, batch)).values()
    }
    # No collective carries w1's gradient or update; stage 3 still gathers it for use.
    colls = _measure.collectives(frozen_step.jitted, frozen_state, batch)
    w1_shapes = {(IN, 100), (IN, 104), (IN, 13)}
    touching = [c for c in colls if c.shape in w1_shapes]
    assert [c.kind for c in touching] == (["all-gather"] if stage == 3 else []), touching
    np.testing.assert_array_equal(zj.full_params(frozen_state)["w1"], mlp_params()["w1"])
    assert not np.array_equal(zj.full_params(frozen_state)["w2"], mlp_params()["w2"])


def test_frozen_leaves_are_detected_from_the_optimizer() -> None:
    params = mlp_params()
    assert zj.frozen_leaves(_frozen_via_optax(), params) == {k: not v for k, v in TRAINABLE.items()}
    # A leaf whose gradient feeds a global norm is not frozen, even if its update is zero.
    clip_first = optax.chain(optax.clip_by_global_norm(1.0), _frozen_via_optax())
    assert not any(zj.frozen_leaves(clip_first, params).values())


# -- bad input ----------------------------------------------------------------------------


def test_precision_errors() -> None:
    with pytest.raises(ValueError, match=r"compute_dtype must be a floating dtype.*got int32"):
        zj.Precision(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"loss_scale is for float16 compute only; compute_dtype is bfloat16"):
        zj.Precision(compute_dtype=jnp.bfloat16, loss_scale=zj.DynamicLossScale())
    with pytest.raises(ValueError, match=r"float16 compute needs loss scaling.*zj.DynamicLossScale\(\)"):
        zj.Precision(compute_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"0 < backoff < 1"):
        zj.DynamicLossScale(backoff=2.0)


def test_accum_steps_that_do_not_divide_the_batch() -> None:
    policy = zj.ZeroPolicy(1, make_mesh(N), min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy, accum_steps=3)
    with pytest.raises(ValueError, match=r"accum_steps=3 microbatches on each of 8 devices.*multiple of 24"):
        step(state, mlp_batch(n=16))
    with pytest.raises(ValueError, match=r"accum_steps must be an int >= 1, got 0"):
        zj.make_train_step(mlp_loss, tx, policy, accum_steps=0)
    with pytest.raises(ValueError, match=r"accum_mode must be 'local'.*got 'sometimes'"):
        zj.make_train_step(mlp_loss, tx, policy, accum_steps=2, accum_mode="sometimes")
    with pytest.raises(ValueError, match=r"clip_norm must be a positive number"):
        zj.make_train_step(mlp_loss, tx, policy, clip_norm=-1.0)


def test_trainable_mask_that_does_not_match_the_parameters() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(N), min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy, trainable={"w1": True, "w2": False})
    with pytest.raises(ValueError, match=r"trainable=...\): the mask's tree does not match the parameters"):
        zj.init_state(mlp_params(), tx, policy)
