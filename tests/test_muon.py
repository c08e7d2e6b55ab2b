"""Muon under ZeRO (issue 41, part 1): the leaves an optimizer multiplies by
themselves are found from the traced update (``zj.matrix_leaves``) and kept
whole (``ZeroPolicy(whole_matrices=...)``): the step then sends the stage's
theory bytes, passes the audit, and trains like plain optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax._layout.leaf import REASON_WHOLE_MATRIX
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch, unstack_params

#: Parity after 3 steps: relative L2 of each leaf's accumulated update against plain optax. Measured
#: worst 7.3e-6 (a Newton-Schulz update is normalised, so fp32 reduction order shows at ~1e-6).
PARITY = 1e-5
#: Communication against the per-leaf theory (ring-counted), and optimizer-state balance across devices.
COMM_TOLERANCE = 0.05
BALANCE = 0.10

CFG = TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=8)


def _batched_muon(lr: float = 1e-2) -> optax.GradientTransformation:
    """Muon on every matrix, stacked ones included: a 3-D leaf under ``layers`` is a stack of matrices on its
    leading axis (a 2-D one there is a stack of vectors: Adam)."""

    def one(path: tuple, x: jax.Array) -> optax.contrib.MuonDimensionNumbers | None:
        matrix = x.ndim == (3 if jax.tree_util.keystr(path[:1]) == "['layers']" else 2)
        return optax.contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1) if matrix else None

    def dims(tree: object) -> object:
        return jax.tree_util.tree_map_with_path(one, tree)

    return optax.contrib.muon(lr, muon_weight_dimension_numbers=dims)


def test_matrix_leaves_are_read_off_the_traced_update() -> None:
    params = mlp_params()
    assert zj.matrix_leaves(optax.contrib.muon(1e-2), params) == ("w1", "w2")  # its own split: Adam on the rest
    assert zj.matrix_leaves(optax.adam(1e-3), params) == ()
    assert zj.matrix_leaves(optax.adafactor(1e-3), params) == ()  # row/column means are no matrix product
    routed = optax.multi_transform({"m": optax.contrib.muon(1e-2), "a": optax.adam(1e-3)},
                                   {"w1": "a", "b1": "a", "w2": "m", "b2": "a", "scale": "a"})  # fmt: skip
    assert zj.matrix_leaves(routed, params) == ("w2",)
    scanned = init_params(CFG, jax.random.key(0))
    found = zj.matrix_leaves(_batched_muon(), scanned)
    assert {"layers/attn_qkv", "layers/mlp_in", "layers/mlp_out", "head"} <= set(found)
    assert not any("norm" in path or "bias" in path for path in found)
    policy = zj.ZeroPolicy(1, make_mesh(8), whole_matrices=found)
    lays = policy.layouts(scanned)
    assert lays["layers"]["attn_qkv"].reason == REASON_WHOLE_MATRIX and lays["layers"]["attn_qkv"].dim is None
    assert lays["layers"]["norm1_scale"].dim is not None or lays["layers"]["norm1_scale"].reason != REASON_WHOLE_MATRIX
    with pytest.raises(ValueError, match=r"whole_matrices=\.\.\.\): the prefix 'nope' matches no parameter"):
        zj.ZeroPolicy(1, make_mesh(8), whole_matrices="nope").layouts(scanned)
    with pytest.raises(TypeError, match="whole_matrices must be key paths"):
        zj.ZeroPolicy(1, make_mesh(8), whole_matrices=[3])


def test_muon_on_cut_matrices_warns_and_fails_the_audit() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.contrib.muon(1e-2), policy)
    with pytest.warns(UserWarning, match=r"multiplies 'w1', 'w2' by itself.*whole_matrices=zj.matrix_leaves"):
        state = zj.init_state(mlp_params(), tx, policy)
    with pytest.warns(UserWarning, match="whole_matrices"):
        report = zj.audit(zj.make_train_step(mlp_loss, tx, policy), state, mlp_batch())
    kinds = [v.kind for v in report.violations]
    assert kinds.count("gradient-sized all-reduce") >= 5, kinds  # Newton-Schulz on row-cut matrices
    assert report.comm.ratio > 1.3  # measured 1.47 on this small MLP (2.2x at 64x256)


def _check_whole(params, loss_fn, opt, batches, stage, **policy_args):  # noqa: ANN001, ANN202 - a test helper
    whole = zj.matrix_leaves(opt, params)
    policy = zj.ZeroPolicy(stage, make_mesh(8), whole_matrices=whole, **policy_args)
    tx = zj.shard_optimizer(opt, policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(loss_fn, tx, policy)
    report = zj.audit(step, state, batches[0])
    report.check()
    assert report.comm.ratio <= 1 + COMM_TOLERANCE, report.comm
    for cat in ("optimizer", "grads", "params"):
        hi, lo = report.state_bytes[cat], report.state_bytes_min[cat]
        assert hi - lo <= BALANCE * (hi + lo) / 2, (cat, hi, lo)
    for b in batches:
        state, _ = step(state, b)
    return whole, state, report


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_whole_matrices_mlp_trains_like_plain_optax_at_theory_bytes(stage: int) -> None:
    params, batches = mlp_params(), [mlp_batch(seed=s) for s in range(3)]
    ref, _ = reference_run(optax.contrib.muon(1e-2), params, batches)
    whole, state, report = _check_whole(params, mlp_loss, optax.contrib.muon(1e-2), batches, stage)
    assert whole == ("w1", "w2")
    errors = relative_update_error(zj.full_params(state), ref, params)
    assert max(errors.values()) < PARITY, errors
    assert {r.path for r in zj.ZeroPolicy(stage, make_mesh(8), whole_matrices=whole).replicated_leaves(params)} >= {
        "w1",
        "w2",
    }
    assert report.comm.ratio >= 1 - COMM_TOLERANCE  # every byte the theory counts is sent, no more


@pytest.mark.slow
@pytest.mark.parametrize(("scanned", "stage"), [(True, 2), (False, 3)])
def test_whole_matrices_transformer_trains_like_plain_optax(scanned: bool, stage: int) -> None:
    params = init_params(CFG, jax.random.key(0))
    params = params if scanned else unstack_params(params)
    opt = _batched_muon() if scanned else optax.contrib.muon(1e-2)
    batches = [synthetic_batch(CFG, 16, jax.random.key(s)) for s in range(3)]
    loss_fn = make_loss_fn(CFG)
    ref, _ = reference_run(opt, params, batches, loss_fn=loss_fn)
    stacked = {"stacked": "layers"} if scanned else {}
    whole, state, _ = _check_whole(params, loss_fn, opt, batches, stage, **stacked)
    assert len(whole) >= (4 if scanned else 2 * CFG.depth + 3)
    errors = relative_update_error(zj.full_params(state), ref, params)
    assert max(errors.values()) < PARITY, errors


@pytest.mark.slow
def test_whole_matrices_with_accumulation_and_mixed_precision_match_the_cut_form() -> None:
    """bf16 compute, float32 master, 2 microbatches: the whole form sends the theory bytes, passes the audit and
    lands where today's cut form lands (the same gradients; Newton-Schulz on whole or cut matrices)."""
    params, batch = mlp_params(), mlp_batch(n=32)
    prec = zj.Precision(compute_dtype=jnp.bfloat16)
    finals = {}
    for whole in ((), ("w1", "w2")):
        policy = zj.ZeroPolicy(2, make_mesh(8), whole_matrices=whole, precision=prec, min_shard_size=0)
        tx = zj.shard_optimizer(optax.contrib.muon(1e-2), policy)
        with pytest.warns(UserWarning, match="whole_matrices") if not whole else _no_warning():
            state = zj.init_state(params, tx, policy)
            step = zj.make_train_step(mlp_loss, tx, policy, accum_steps=2)
            if whole:
                report = zj.audit(step, state, batch)
                report.check()
                assert report.comm.ratio <= 1 + COMM_TOLERANCE
            for _ in range(3):
                state, metrics = step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
        finals[whole] = zj.full_params(state)
    errors = relative_update_error(finals[("w1", "w2")], finals[()], params)
    assert max(errors.values()) < 1e-2, errors  # bf16 activations: the two forms differ at bf16 rounding


class _no_warning:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.slow
def test_whole_matrices_checkpoint_restores_across_device_counts(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    params, batch = mlp_params(), mlp_batch()
    opt = optax.contrib.muon(1e-2)
    whole = zj.matrix_leaves(opt, params)
    p8 = zj.ZeroPolicy(2, make_mesh(8), whole_matrices=whole)
    tx8 = zj.shard_optimizer(opt, p8)
    state = zj.init_state(params, tx8, p8)
    step8 = zj.make_train_step(mlp_loss, tx8, p8)
    state, _ = step8(state, batch)
    zj.save(str(tmp_path / "ck"), state)
    saved = zj.full_params(state)
    p4 = zj.ZeroPolicy(2, make_mesh(4), whole_matrices=whole)
    tx4 = zj.shard_optimizer(opt, p4)
    restored = zj.restore(str(tmp_path / "ck"), policy=p4, tx=tx4)
    for a, b in zip(jax.tree.leaves(zj.full_params(restored)), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state8, _ = step8(state, batch)
    state4, _ = zj.make_train_step(mlp_loss, tx4, p4)(restored, batch)
    errors = relative_update_error(zj.full_params(state4), zj.full_params(state8), saved)
    assert max(errors.values()) < PARITY, errors
