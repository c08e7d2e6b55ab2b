"""Properties of the train step: placement, memory, communication, no recompiles."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import HIDDEN, IN, OUT, make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax import measure as _measure

N = 8
F32 = 4


def _setup(stage: int, n: int = N, opt=None, mesh=None, **policy_kw):
    policy = zj.ZeroPolicy(stage, mesh if mesh is not None else make_mesh(n), min_shard_size=64, **policy_kw)
    tx = zj.shard_optimizer(opt or optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    return policy, tx, state, zj.make_train_step(mlp_loss, tx, policy)


def _shardings(tree):
    return [x.sharding for x in jax.tree.leaves(tree)]


# Hand-counted for N = 8 and min_shard_size = 64: w1 (12, 100) is cut on dim 1
# padded to 104, b1 (100,) padded to 104, w2 (100, 6) cut on dim 0 padded to
# 104; b2 (6,) and scale () stay whole.
PARTITIONED_PADDED = (IN * 104 + 104 + 104 * OUT) * F32
PARTITIONED_LOGICAL = (IN * HIDDEN + HIDDEN + HIDDEN * OUT) * F32
REPLICATED = (OUT + 1) * F32
W1_PADDED = IN * 104 * F32


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resident_bytes_match_the_formula_on_every_device(stage: int) -> None:
    _, _, state, step = _setup(stage)
    params_b = _measure.resident_bytes(state.params)
    opt_b = _measure.resident_bytes(state.opt_state)
    grads_b = _measure.resident_bytes(step.grads(state, mlp_batch()))
    whole = PARTITIONED_LOGICAL + REPLICATED
    cut = PARTITIONED_PADDED // N + REPLICATED
    expect_params = cut if stage >= 3 else whole
    expect_grads = cut if stage >= 2 else whole
    expect_opt = 2 * (cut if stage >= 1 else whole) + 4  # Adam mu + nu, int32 count
    assert len(params_b) == len(opt_b) == len(grads_b) == N
    assert set(params_b.values()) == {expect_params}, params_b
    assert set(grads_b.values()) == {expect_grads}, grads_b
    assert set(opt_b.values()) == {expect_opt}, opt_b


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_communication_matches_zero_theory(stage: int) -> None:
    _, _, state, step = _setup(stage)
    colls = _measure.collectives(step.jitted, state, mlp_batch())
    ring = (N - 1) / N
    # Scalars: the loss mean, `scale`'s gradient and the global squared norm.
    tensor = [c for c in colls if math.prod(c.shape) > 2]
    scalars = [c for c in colls if math.prod(c.shape) <= 2]
    moved = _measure.ring_bytes(tensor)
    b2 = OUT * F32  # the whole-kept vector leaf; the scalar `scale` is counted with the scalars
    if stage == 0:
        theory = 2 * ring * (PARTITIONED_LOGICAL + b2)
    elif stage in (1, 2):
        theory = 2 * ring * PARTITIONED_PADDED + 2 * ring * b2
    else:
        # Forward gather + backward re-gather + reduce-scatter. The backward pass
        # needs no w1 (the input is data, no gradient flows to it): 3Ψ - Ψ_w1.
        theory = ring * (3 * PARTITIONED_PADDED - W1_PADDED) + 2 * ring * b2
    assert moved == pytest.approx(theory, rel=1e-9), _measure.summarize(colls)
    kinds = {c.kind for c in tensor}
    assert kinds == ({"all-reduce"} if stage == 0 else {"all-reduce", "reduce-scatter", "all-gather"})
    if stage >= 1:  # no gradient-sized all-reduce: only the whole-kept leaves are all-reduced
        assert max(c.bytes for c in tensor if c.kind == "all-reduce") <= OUT * F32
    assert len(scalars) <= 6  # `scale`'s gradient, loss mean, gradient norm, optimizer scalars


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_keeps_shardings_and_compiles_once(stage: int) -> None:
    _, _, state, step = _setup(stage)
    before = _shardings(state)
    for s in range(3):
        state, _ = step(state, mlp_batch(seed=s))
    assert _shardings(state) == before
    assert step.jitted._cache_size() == 1


@pytest.mark.parametrize("stage", [0, 3])
def test_abstract_init_places_nothing_and_matches_concrete(stage: int) -> None:
    policy, tx, state, _ = _setup(stage)
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_params())
    abstract = zj.init_state(abstract_params, tx, policy)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert [(a.shape, a.sharding) for a in jax.tree.leaves(abstract)] == [
        (x.shape, x.sharding) for x in jax.tree.leaves(state)
    ]
    # The optimizer's own init works on abstract inputs too.
    assert jax.tree.structure(jax.eval_shape(tx.init, abstract_params)) == jax.tree.structure(state.opt_state)


def test_init_from_a_function_equals_init_from_arrays() -> None:
    policy, tx, state, _ = _setup(3)
    lazy = zj.init_state(mlp_params, tx, policy)
    for a, b in zip(jax.tree.leaves(lazy), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grads_and_grad_norm_equal_unsharded(stage: int) -> None:
    policy, _, state, step = _setup(stage)
    batch = mlp_batch()
    ref = jax.grad(mlp_loss)(mlp_params(), batch)
    grads = step.grads(state, batch)
    lays = policy.layouts(mlp_params())
    for k in ref:
        g = grads[k]
        if stage >= 2 and lays[k].padding:
            g = jax.lax.slice_in_dim(g, 0, lays[k].shape[lays[k].dim], axis=lays[k].dim)
        np.testing.assert_allclose(g, ref[k], rtol=1e-5, atol=1e-7)
    _, metrics = step(state, batch)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(ref)), rel=1e-6)


def test_aux_is_averaged_over_the_data_axis() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(N), min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(mlp_params(), tx, policy)

    def loss_with_aux(p, b):
        loss = mlp_loss(p, b)
        return loss, {"loss_again": loss, "rows": jnp.asarray(b["x"].shape[0], jnp.int32)}

    _, metrics = zj.make_train_step(loss_with_aux, tx, policy)(state, mlp_batch())
    assert float(metrics["aux"]["loss_again"]) == pytest.approx(float(metrics["loss"]), rel=1e-6)
    assert int(metrics["aux"]["rows"]) == 16  # integers are summed: the global batch


def _per_example_loss(p, b):
    """mlp_loss with per-example aux: each row's error, the worst one, a count."""
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    errors = jnp.mean(((h @ p["w2"] + p["b2"]) * p["scale"] - b["y"]) ** 2, axis=1)
    return jnp.mean(errors), {"per_example": errors, "worst": jnp.max(errors), "best": jnp.min(errors),
                              "rows": jnp.asarray(errors.shape[0], jnp.int32), "mean": jnp.mean(errors)}  # fmt: skip


@pytest.mark.parametrize(("stage", "accum_steps"), [(0, 1), (3, 2)])
def test_aux_reduce_gathers_per_example_rows_and_takes_max_and_min(stage: int, accum_steps: int) -> None:
    """Issue 29: a per-example aux was averaged elementwise over the devices (a (2,) average of 8 devices'
    different examples) and a max averaged too. aux_reduce= says how each leaf combines; the result equals
    the loss on the whole batch unsharded (fp32: 1e-6 relative, the same per-row arithmetic)."""
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    batch = mlp_batch(32)
    step = zj.make_train_step(_per_example_loss, tx, policy, accum_steps=accum_steps,
                              aux_reduce={"per_example": "gather", "worst": "max", "best": "min"})  # fmt: skip
    _, metrics = step(zj.init_state(mlp_params(), tx, policy), batch)
    _, want = _per_example_loss(mlp_params(), batch)
    aux = metrics["aux"]
    assert aux["per_example"].shape == (32,)
    np.testing.assert_allclose(aux["per_example"], want["per_example"], rtol=1e-6)  # in batch order
    for key in ("worst", "best", "mean"):
        np.testing.assert_allclose(aux[key], want[key], rtol=1e-6)
    assert int(aux["rows"]) == 32  # integers summed (every device, every microbatch)


def test_per_example_aux_without_aux_reduce_warns_and_bad_aux_reduce_is_named() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(N), min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    step = zj.make_train_step(_per_example_loss, tx, policy)
    with pytest.warns(UserWarning, match=r"aux leaf 'per_example' \(4,\) has as many rows as each device's batch"
                                         r".*aux_reduce=\{'per_example': 'gather'\}"):  # fmt: skip
        _, metrics = step(zj.init_state(mlp_params(), tx, policy), mlp_batch(32))
    assert metrics["aux"]["per_example"].shape == (4,)  # the elementwise average the warning names
    with pytest.raises(ValueError, match=r"'worst' is 'maximum'"):
        zj.make_train_step(_per_example_loss, tx, policy, aux_reduce={"worst": "maximum"})
    typo = zj.make_train_step(_per_example_loss, tx, policy, aux_reduce={"per_exampel": "gather"})
    with pytest.raises(ValueError, match=r"\['per_exampel'\] at aux are not keys of the aux.*'per_example'"):
        typo(zj.init_state(mlp_params(), tx, policy), mlp_batch(32))


@pytest.mark.parametrize("explicit", [True, False])
def test_explicit_and_auto_meshes_give_the_same_numbers(explicit: bool) -> None:
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((N,), ("data",), axis_types=(kind,))
    batch = jax.device_put(mlp_batch(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    _, _, state, step = _setup(3, mesh=mesh)
    state, _ = step(state, batch)
    ref, _ = reference_run(optax.adam(1e-2), mlp_params(), [mlp_batch()])
    errors = relative_update_error(zj.full_params(state), ref, mlp_params())
    assert max(errors.values()) <= 1e-5


@pytest.mark.parametrize("axis", ["data", ("replica", "data")])
@pytest.mark.parametrize("stage", [1, 3])
def test_hybrid_mesh(axis, stage: int) -> None:
    mesh = make_mesh(N, ("replica", "data"), (2, 4))
    policy, _, state, step = _setup(stage, mesh=mesh, axis=axis)
    batches = [mlp_batch(seed=s) for s in range(3)]
    for b in batches:
        state, _ = step(state, b)
    ref, _ = reference_run(optax.adam(1e-2), mlp_params(), batches)
    errors = relative_update_error(zj.full_params(state), ref, mlp_params())
    assert max(errors.values()) <= 1e-5
    opt_b = _measure.resident_bytes(state.opt_state)
    shards = math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))
    assert policy.num_shards == shards
    assert set(opt_b.values()) == {
        2
        * (
            sum(
                lay.nbytes // shards if lay.partitioned else lay.nbytes
                for lay in jax.tree.leaves(policy.layouts(mlp_params()), is_leaf=lambda x: isinstance(x, zj.LeafLayout))
            )
        )
        + 4
    }


def test_full_params_returns_logical_replicated_arrays() -> None:
    _, _, state, _ = _setup(3)
    full = zj.full_params(state)
    for k, v in mlp_params().items():
        assert full[k].shape == v.shape
        assert full[k].sharding.is_fully_replicated
        np.testing.assert_array_equal(full[k], v)
