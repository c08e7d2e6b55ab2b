"""Muon under ZeRO (issue 41, part 1): the leaves an optimizer multiplies by
themselves are found from the traced update (``zj.matrix_leaves``) and never
cut across a matrix: stacks of matrices are cut on the stack axis (each device
owns whole matrices), single matrices stay whole. The step then sends the
stage's theory bytes, passes the audit, keeps optimizer state balanced, and
trains like plain optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax._layout.leaf import REASON_FEW_MATRICES, REASON_WHOLE_MATRIX
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

#: Parity after 3 steps: relative L2 of each leaf's accumulated update against plain optax. Measured
#: worst 7.3e-6 (a Newton-Schulz update is normalised, so fp32 reduction order shows at ~1e-6).
PARITY = 1e-5
#: Communication against the per-leaf theory (ring-counted), and optimizer-state balance across devices.
COMM_TOLERANCE = 0.05
BALANCE = 0.10

CFG = TransformerConfig(vocab=32, dim=16, depth=8, heads=2, seq=8)  # depth 8: one layer's matrices per device


def _batched_muon(lr: float = 1e-2, stacks: str = "layers") -> optax.GradientTransformation:
    """Muon on every matrix, stacked ones included: a 3-D leaf under ``stacks`` is a stack of matrices on its
    leading axis (a 2-D one there is a stack of vectors: Adam)."""

    def one(path: tuple, x: jax.Array) -> optax.contrib.MuonDimensionNumbers | None:
        matrix = x.ndim == (3 if jax.tree_util.keystr(path[:1]) == f"['{stacks}']" else 2)
        return optax.contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1) if matrix else None

    def dims(tree: object) -> object:
        return jax.tree_util.tree_map_with_path(one, tree)

    return optax.contrib.muon(lr, muon_weight_dimension_numbers=dims)


# A small scanned model: `depth` square matrices stacked on axis 0, applied in a lax.scan.
def _stack_params(depth: int, width: int = 16) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {"stack": jnp.asarray(rng.normal(size=(depth, width, width)) / np.sqrt(width), jnp.float32),
            "bias": jnp.zeros((width,), jnp.float32)}  # fmt: skip


def _stack_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w.astype(h.dtype)), None), batch["x"], params["stack"])
    return jnp.mean((h + params["bias"].astype(h.dtype) - batch["y"]) ** 2)


def _stack_batch(n: int = 32, width: int = 16, seed: int = 1) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.normal(size=(n, width)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(n, width)), jnp.float32)}  # fmt: skip


def test_matrix_leaves_are_read_off_the_traced_update() -> None:
    params = mlp_params()
    assert zj.matrix_leaves(optax.contrib.muon(1e-2), params) == {"whole_matrices": ("w1", "w2"), "matrix_stacks": ()}
    assert zj.matrix_leaves(optax.adam(1e-3), params) == {"whole_matrices": (), "matrix_stacks": ()}
    assert zj.matrix_leaves(optax.adafactor(1e-3), params)["whole_matrices"] == ()  # row/column means: no product
    routed = optax.multi_transform({"m": optax.contrib.muon(1e-2), "a": optax.adam(1e-3)},
                                   {"w1": "a", "b1": "a", "w2": "m", "b2": "a", "scale": "a"})  # fmt: skip
    assert zj.matrix_leaves(routed, params)["whole_matrices"] == ("w2",)
    scanned = init_params(CFG, jax.random.key(0))
    found = zj.matrix_leaves(_batched_muon(), scanned)
    layer_matrices = ("layers/attn_out", "layers/attn_qkv", "layers/mlp_in", "layers/mlp_out")
    assert found["matrix_stacks"] == layer_matrices
    assert found["whole_matrices"] == ("embed/positions", "embed/tokens", "head", *layer_matrices)
    # The stack axis is followed through a global-norm clip (a reduction over it, not a product).
    clipped = optax.chain(optax.clip_by_global_norm(1.0), _batched_muon())
    assert zj.matrix_leaves(clipped, scanned)["matrix_stacks"] == layer_matrices
    # optax's own Muon labels by ndim: 3-D stacks go to Adam, 2-D leaves (stacked vectors too) to Muon.
    own = zj.matrix_leaves(optax.contrib.muon(1e-2), scanned)
    assert own["matrix_stacks"] == () and not set(layer_matrices) & set(own["whole_matrices"])
    assert {"head", "embed/tokens", "layers/norm1_scale"} <= set(own["whole_matrices"])


def test_matrix_layouts_cut_stacks_between_whole_matrices() -> None:
    mesh = make_mesh(8)
    params = {"s12": jnp.zeros((12, 16, 16)), "s4": jnp.zeros((4, 16, 16)), "w": jnp.zeros((64, 64))}
    found = {"whole_matrices": ("s12", "s4", "w"), "matrix_stacks": ("s12", "s4")}
    lays = zj.ZeroPolicy(1, mesh, **found).layouts(params)
    assert (lays["s12"].dim, lays["s12"].stored_shape) == (0, (16, 16, 16))  # 12 matrices padded to 16: 2 a device
    assert lays["s4"].dim is None and lays["s4"].reason == REASON_FEW_MATRICES  # fewer matrices than devices
    assert lays["w"].dim is None and lays["w"].reason == REASON_WHOLE_MATRIX
    under_stacked = zj.ZeroPolicy(3, mesh, stacked="s12", **found).layouts(params)["s12"]
    assert under_stacked.dim is None and under_stacked.reason == REASON_WHOLE_MATRIX  # its layer axis is never cut
    with pytest.raises(ValueError, match=r"whole_matrices=\.\.\.\): the prefix 'nope' matches no parameter"):
        zj.ZeroPolicy(1, mesh, whole_matrices="nope").layouts(params)
    with pytest.raises(TypeError, match="matrix_stacks must be key paths"):
        zj.ZeroPolicy(1, mesh, matrix_stacks=[3])


def test_muon_on_cut_matrices_warns_and_fails_the_audit() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.contrib.muon(1e-2), policy)
    with pytest.warns(UserWarning, match=r"multiplies 'w1', 'w2' by itself.*\*\*zj.matrix_leaves"):
        state = zj.init_state(mlp_params(), tx, policy)
    with pytest.warns(UserWarning, match="matrix_leaves"):
        report = zj.audit(zj.make_train_step(mlp_loss, tx, policy), state, mlp_batch())
    kinds = [v.kind for v in report.violations]
    assert kinds.count("gradient-sized all-reduce") >= 5, kinds  # Newton-Schulz on row-cut matrices
    assert report.comm.ratio > 1.3  # measured 1.47 on this small MLP (2.2x at 64x256)


def _check(params, loss_fn, opt, batches, stage, *, accum_steps=1, **policy_args):  # noqa: ANN001, ANN202
    """Train 3 steps with ``**zj.matrix_leaves``; audit: check() passes, communication within the tolerance of
    the theory, each state category balanced across devices."""
    found = zj.matrix_leaves(opt, params)
    policy = zj.ZeroPolicy(stage, make_mesh(8), **found, **policy_args)
    tx = zj.shard_optimizer(opt, policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(loss_fn, tx, policy, accum_steps=accum_steps)
    report = zj.audit(step, state, batches[0])
    report.check()
    assert abs(report.comm.ratio - 1) <= COMM_TOLERANCE, report.comm
    for cat in ("optimizer", "grads", "params"):
        hi, lo = report.state_bytes[cat], report.state_bytes_min[cat]
        assert hi - lo <= BALANCE * (hi + lo) / 2, (cat, hi, lo)
    for b in batches:
        state, _ = step(state, b)
    return found, state, report


@pytest.mark.parametrize("stage", [1, 3])
def test_single_matrices_stay_whole_and_train_like_plain_optax(stage: int) -> None:
    params, batches = mlp_params(), [mlp_batch(seed=s) for s in range(3)]
    ref, _ = reference_run(optax.contrib.muon(1e-2), params, batches)
    found, state, report = _check(params, mlp_loss, optax.contrib.muon(1e-2), batches, stage)
    assert found["whole_matrices"] == ("w1", "w2")
    assert report.whole_matrices == ("w1",)  # w2 (100 x 6) is below min_shard_size: whole anyway
    assert "matrices kept whole for the optimizer (single matrices, or stacks of fewer than N=8): 1" in str(report)
    errors = relative_update_error(zj.full_params(state), ref, params)
    assert max(errors.values()) < PARITY, errors


@pytest.mark.parametrize("stage", [2, 3])
def test_stacks_are_owned_whole_and_train_like_plain_optax(stage: int) -> None:
    """12 matrices on 8 devices: cut on the stack (padded to 16, 2 whole matrices a device)."""
    params, batches = _stack_params(12), [_stack_batch(seed=s) for s in range(3)]
    opt = _batched_muon(stacks="stack")
    ref, _ = reference_run(opt, params, batches, loss_fn=_stack_loss)
    found, state, report = _check(params, _stack_loss, opt, batches, stage)
    assert found["matrix_stacks"] == ("stack",) and report.whole_matrices == ()
    errors = relative_update_error(zj.full_params(state), ref, params)
    assert max(errors.values()) < PARITY, errors
    # Muon's momentum: 2 of the 16 (padded) 16x16 matrices on each device, plus the small bias state.
    assert report.state_bytes["optimizer"] < 2 * 16 * 16 * 4 + 4096


@pytest.mark.slow
def test_stacks_with_accumulation_and_mixed_precision() -> None:
    """bf16 compute, float32 master, 2 microbatches, stage 2: theory bytes, audit clean, balanced state, and
    where today's cut form lands (the same bf16 gradients; Newton-Schulz on whole or on cut matrices)."""
    params, batches = _stack_params(8), [_stack_batch(seed=s) for s in range(3)]
    opt = _batched_muon(stacks="stack")
    prec = zj.Precision(compute_dtype=jnp.bfloat16)
    _, state, _ = _check(params, _stack_loss, opt, batches, 2, accum_steps=2, precision=prec)
    cut = zj.ZeroPolicy(2, make_mesh(8), precision=prec)
    tx = zj.shard_optimizer(opt, cut)
    with pytest.warns(UserWarning, match="multiplies 'stack' by itself"):
        cut_state = zj.init_state(params, tx, cut)
        step = zj.make_train_step(_stack_loss, tx, cut, accum_steps=2)
        for b in batches:
            cut_state, _ = step(cut_state, b)
    errors = relative_update_error(zj.full_params(state), zj.full_params(cut_state), params)
    assert max(errors.values()) < 1e-2, errors  # bf16 rounding of the two programs' gradients


@pytest.mark.slow
def test_scanned_reference_transformer_trains_like_plain_optax() -> None:
    """Stage 2, Muon batched over the layer axis: the 4 layer stacks (8 matrices each) owned whole, one layer's
    matrices a device; embeddings and head single matrices, kept whole. (The unscanned form, every matrix a
    separate leaf kept whole, takes the MLP's path; ``benchmarks/muon.py`` measures it at every stage.)"""
    params = jax.jit(init_params, static_argnums=0)(CFG, jax.random.key(0))  # one compile, not eager ops
    batches = [synthetic_batch(CFG, 16, jax.random.key(s)) for s in range(3)]
    loss_fn = make_loss_fn(CFG)
    ref, _ = reference_run(_batched_muon(), params, batches, loss_fn=loss_fn)
    found, state, report = _check(params, loss_fn, _batched_muon(), batches, 2)
    assert len(found["matrix_stacks"]) == 4 and len(found["whole_matrices"]) == 7
    assert set(report.whole_matrices) <= {"embed/positions", "embed/tokens", "head"}
    errors = relative_update_error(zj.full_params(state), ref, params)
    assert max(errors.values()) < PARITY, errors


@pytest.mark.slow
def test_stacks_restore_across_device_counts(tmp_path) -> None:  # noqa: ANN001 - pytest fixture
    """12 matrices: padded to 16 on 8 devices, 12 on 4; the checkpoint holds the logical stack."""
    params, batch = _stack_params(12), _stack_batch()
    opt = _batched_muon(stacks="stack")
    found = zj.matrix_leaves(opt, params)
    p8 = zj.ZeroPolicy(2, make_mesh(8), **found)
    tx8 = zj.shard_optimizer(opt, p8)
    step8 = zj.make_train_step(_stack_loss, tx8, p8)
    state, _ = step8(zj.init_state(params, tx8, p8), batch)
    zj.save(str(tmp_path / "ck"), state)
    saved = zj.full_params(state)
    p4 = zj.ZeroPolicy(2, make_mesh(4), **found)
    tx4 = zj.shard_optimizer(opt, p4)
    restored = zj.restore(str(tmp_path / "ck"), policy=p4, tx=tx4)
    stored = [x.shape for x in jax.tree.leaves(restored.opt_state) if x.ndim == 3]
    assert stored and all(shape[0] == 12 for shape in stored), stored  # 16 on 8 devices, re-padded: 3 each on 4
    for a, b in zip(jax.tree.leaves(zj.full_params(restored)), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state8, _ = step8(state, batch)
    state4, _ = zj.make_train_step(_stack_loss, tx4, p4)(restored, batch)
    errors = relative_update_error(zj.full_params(state4), zj.full_params(state8), saved)
    assert max(errors.values()) < PARITY, errors


@pytest.mark.parametrize("variant", ["multi_transform", "offload"])
def test_stacks_under_multi_transform_and_offload(variant: str) -> None:
    """Muon routed by ``optax.multi_transform`` (Adam on the rest), or the optimizer state in host memory
    (``offload_optimizer``): stacks found and cut alike, theory bytes, parity with plain optax."""
    params, batches = _stack_params(16), [_stack_batch(seed=s) for s in range(3)]
    opt = _batched_muon(stacks="stack")
    extra: dict = {}
    if variant == "multi_transform":
        opt = optax.multi_transform({"m": opt, "a": optax.adam(1e-2)}, {"stack": "m", "bias": "a"})
    else:
        extra["offload_optimizer"] = True
    ref, _ = reference_run(opt, params, batches, loss_fn=_stack_loss)
    found, state, report = _check(params, _stack_loss, opt, batches, 2, **extra)
    assert found == {"whole_matrices": ("stack",), "matrix_stacks": ("stack",)}
    if variant == "offload":
        assert report.host_bytes["optimizer"] > 16 * 16 * 16 * 4 / 8  # Muon's momentum: 2 whole matrices a device
    errors = relative_update_error(zj.full_params(state), ref, params)
    assert max(errors.values()) < PARITY, errors
