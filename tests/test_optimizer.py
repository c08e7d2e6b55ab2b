"""zj.shard_optimizer: the sharded optax transformation is a pytree-safe value,
hides non-float parameters from the wrapped optimizer, and finds frozen leaves
with the one data-dependence walk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax._base import jaxpr as _jaxpr
from zero_jax._layout.leaf import REASON_NOT_FLOAT
from zero_jax._layout.trees import TreeLayouts
from zero_jax._step.optimizer import sharded_parts

# -- the sharded optimizer is a pytree-safe value -------------------------------------------


def _rebuilt(tx: optax.GradientTransformation) -> dict[str, optax.GradientTransformation]:
    return {
        "tree_map": jax.tree.map(lambda f: f, tx),
        "unflatten": jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(tx))),
    }


@pytest.mark.parametrize(("stage", "how"), [(1, "tree_map"), pytest.param(3, "unflatten", marks=pytest.mark.slow)])
def test_rebuilt_sharded_optimizer_still_trains_like_plain_optax(stage: int, how: str) -> None:
    policy = zj.ZeroPolicy(stage, make_mesh(8), min_shard_size=0)
    tx = _rebuilt(zj.shard_optimizer(optax.adam(1e-2), policy))[how]
    assert isinstance(tx, optax.GradientTransformation) and isinstance(tx, zj.ShardedTransformation)
    assert tx.policy == policy and sharded_parts(tx).policy == policy
    step = zj.make_train_step(mlp_loss, tx, policy)
    state = zj.init_state(mlp_params(), tx, policy)
    batches = [mlp_batch(seed=s) for s in range(3)]
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    ref, ref_losses = reference_run(optax.adam(1e-2), mlp_params(), batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    errors = relative_update_error(zj.full_params(state), ref, mlp_params())
    assert max(errors.values()) < 1e-4, errors


def test_sharded_parts_survive_and_plain_optax_has_none() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8))
    inner = optax.sgd(0.1)
    tx = zj.shard_optimizer(inner, policy)
    for rebuilt in _rebuilt(tx).values():
        parts = sharded_parts(rebuilt)
        assert parts is not None and parts.inner is inner and parts.policy == policy
    # Only the functions kept, in optax's own NamedTuple: still recognised.
    assert sharded_parts(optax.GradientTransformationExtraArgs(tx.init, tx.update)).inner is inner
    assert sharded_parts(inner) is None
    with pytest.raises(TypeError, match=r"already sharded"):
        zj.shard_optimizer(jax.tree.map(lambda f: f, tx), policy)
    with pytest.raises(TypeError, match=r"carries no inner transformation or policy.*zj.shard_optimizer"):
        _ = zj.ShardedTransformation(inner.init, inner.update).policy


def test_opt_state_names_its_parameter_layouts() -> None:
    policy = zj.ZeroPolicy(1, make_mesh(8))
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    opt = jax.eval_shape(tx.init, mlp_params())
    assert isinstance(opt.param_layouts, TreeLayouts)
    shapes = [lay.shape for lay in opt.param_layouts.layouts]
    assert shapes == [tuple(x.shape) for x in jax.tree.leaves(mlp_params())]
    assert opt.params is opt.param_layouts  # the old name, read-only alias


def test_check_tree_names_every_leaf_of_the_wrong_shape() -> None:
    policy = zj.ZeroPolicy(1, make_mesh(8))
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = tx.init(mlp_params())
    grads = dict(mlp_params(), w1=jnp.zeros((12, 99)), b2=jnp.zeros((5,)))
    with pytest.raises(ValueError, match=r"leaf 'b2' has shape \(5,\).*; leaf 'w1' has shape \(12, 99\)"):
        tx.update(grads, state, mlp_params())


# -- non-float parameter leaves pass through untouched --------------------------------------


def _mixed_params() -> dict:
    """The MLP plus an int32 counter (large enough to be partitioned, were it
    float), a bool mask and an int scalar."""
    return dict(
        mlp_params(),
        count=jnp.arange(4096, dtype=jnp.int32),
        mask=jnp.asarray(np.random.default_rng(3).random((64, 32)) > 0.5),
        steps=jnp.int32(7),
    )


NON_FLOAT = ("count", "mask", "steps")


def _float_part(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k not in NON_FLOAT}


def _grads(params: dict, seed: int, *, float0: bool) -> dict:
    rng = np.random.default_rng(seed)
    out = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in _float_part(params).items()}
    for k in NON_FLOAT:  # what jax.grad(..., allow_int=True) gives, or an int "gradient"
        v = params[k]
        out[k] = np.zeros(v.shape, jax.dtypes.float0) if float0 else jnp.ones(v.shape, v.dtype)
    return out


def _whole(tree: dict, policy: zj.ZeroPolicy) -> dict:
    """Every leaf placed whole on every device (``float0`` ones stay host values)."""
    return {k: v if v.dtype == jax.dtypes.float0 else jax.device_put(v, policy.replicated()) for k, v in tree.items()}


@pytest.mark.parametrize("float0", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_non_float_leaves_get_no_state_and_no_update(stage: int, float0: bool) -> None:
    policy = zj.ZeroPolicy(stage, make_mesh(8), min_shard_size=0)
    params = _mixed_params()
    # Whole on every device, whatever their size.
    whole = {r.path: r.reason for r in policy.replicated_leaves(params)}
    assert {k: whole.get(k) for k in NON_FLOAT} == dict.fromkeys(NON_FLOAT, REASON_NOT_FLOAT)
    assert all(policy.param_sharding(params)[k].spec == jax.sharding.PartitionSpec() for k in NON_FLOAT)
    assert zj.frozen_leaves(optax.adam(1e-2), params) == {k: k in NON_FLOAT for k in params}

    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    ref_tx = optax.adam(1e-2)
    state, ref_state = jax.jit(tx.init)(params), ref_tx.init(_float_part(params))
    # No optimizer state for the non-float leaves: the same state leaves as plain optax on the float ones.
    assert [lay.shape for lay in state.layouts.layouts] == [x.shape for x in jax.tree.leaves(ref_state)]

    @jax.jit  # whole logical parameters and gradients in, as a user's own jit would hold them
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        # Logical arrays out of jit: whole (the train step stores them per the policy instead).
        whole = lambda t: jax.lax.with_sharding_constraint(t, policy.replicated())  # noqa: E731
        return whole(optax.apply_updates(params, updates)), state, whole(updates)

    ref_params = _float_part(params)
    for seed in range(3):
        grads = _grads(params, seed, float0=float0)
        params, state, updates = step(_whole(params, policy), state, _whole(grads, policy))
        ref_updates, ref_state = ref_tx.update(_float_part(grads), ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    for k in NON_FLOAT:
        assert updates[k].dtype == params[k].dtype and not np.any(np.asarray(updates[k]))
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(_mixed_params()[k]), strict=True)
    for k, v in ref_params.items():
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(v), rtol=1e-6, atol=1e-7, err_msg=k)


def test_trainable_masks_and_non_float_leaves_together() -> None:
    policy = zj.ZeroPolicy(1, make_mesh(8))
    params = _mixed_params()
    mask = {k: k in ("w1", "b1") for k in params}  # a full mask: one bool per leaf, non-float ones included
    for trainable in (mask, lambda p: jax.tree.map(lambda x: x.ndim == 2 and x.shape[0] == 12, p)):
        tx = zj.shard_optimizer(optax.sgd(0.5), policy, trainable=trainable)
        state = tx.init(params)
        grads = _grads(params, 0, float0=False)
        updates, _ = jax.jit(tx.update)(grads, state, params)
        moved = {k for k, u in updates.items() if np.any(np.asarray(u))}
        assert moved == ({"w1", "b1"} if trainable is mask else {"w1"})
        np.testing.assert_allclose(np.asarray(updates["w1"]), -0.5 * np.asarray(grads["w1"]), rtol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_train_step_with_non_float_leaves_equals_optax_on_the_float_ones(stage: int) -> None:
    policy = zj.ZeroPolicy(stage, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)

    def loss(p, b):  # reads the int and bool leaves, as a model's step counter or mask would
        gate = jnp.where(p["mask"].any(), 1.0, 0.0) + 0.0 * p["count"][0] + 0.0 * p["steps"]
        return mlp_loss(_float_part(p), b) * gate

    state = zj.init_state(_mixed_params(), tx, policy)
    step = zj.make_train_step(loss, tx, policy)
    batches = [mlp_batch(seed=s) for s in range(2)]
    for b in batches:
        state, _ = step(state, b)
    out = zj.full_params(state)
    for k in NON_FLOAT:
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(_mixed_params()[k]), strict=True)
    ref, _ = reference_run(optax.adam(1e-2), mlp_params(), batches)
    errors = relative_update_error(_float_part(out), ref, mlp_params())
    assert max(errors.values()) < 1e-4, errors


# -- the one data-dependence walk ------------------------------------------------------------


def test_dependence_walk_sees_through_calls_and_is_conservative_in_loops() -> None:
    @jax.custom_jvp
    def double(x):
        return 2 * x

    double.defjvp(lambda primals, tangents: (double(primals[0]), 2 * tangents[0]))

    def fn(a, b, c):
        inside_jit = jax.jit(lambda a, b: (a * 2, b + 1))(a, b)
        (p, q), _ = jax.lax.scan(lambda carry, _: ((carry[1], carry[0]), None), (a, c), None, length=2)
        return inside_jit, jax.checkpoint(lambda z: z * 3)(c), double(b), p, q, jnp.ones(3)

    x = jnp.zeros(3)
    # a=1, b=2, c=4: calls keep their outputs apart; a loop's carry may mix (after 2 swaps p is a again).
    assert _jaxpr.output_dependencies(fn, x, x, x) == [1, 2, 4, 2, 5, 5, 0]


def test_frozen_leaves_see_through_a_jitted_update() -> None:
    params = {"w": jnp.zeros((4,)), "b": jnp.zeros((4,))}
    frozen = optax.multi_transform({"a": optax.adam(1e-3), "f": optax.set_to_zero()}, {"w": "a", "b": "f"})
    jitted = optax.GradientTransformation(frozen.init, jax.jit(frozen.update))
    assert zj.frozen_leaves(jitted, params) == {"b": True, "w": False}
