"""Bad input gets an error that names what is wrong and what to do."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params

import zero_jax as zj


def _policy(stage: int = 2, n: int = 8) -> zj.ZeroPolicy:
    return zj.ZeroPolicy(stage, make_mesh(n), min_shard_size=64)


@pytest.mark.parametrize("stage", [-1, 4, 1.5, True, "2"])
def test_stage_outside_0_to_3(stage) -> None:
    with pytest.raises(ValueError, match=r"stage must be 0, 1, 2 or 3, got"):
        zj.ZeroPolicy(stage, make_mesh(8))


def test_axis_the_mesh_lacks() -> None:
    with pytest.raises(ValueError, match=r"axis 'batch' is not an axis of the mesh, whose axes are \('data',\)"):
        zj.ZeroPolicy(1, make_mesh(8), axis="batch")


def test_batch_not_divisible_by_the_data_axis() -> None:
    policy = _policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    with pytest.raises(
        ValueError, match=r"batch leaf 'x' has shape \(12, 12\).*divide by the 8 devices.*multiple of 8"
    ):
        step(state, mlp_batch(n=12))


def test_loss_that_is_not_a_scalar() -> None:
    policy = _policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(lambda p, b: (b["x"] @ p["w1"]) ** 2, tx, policy)
    with pytest.raises(TypeError, match=r"must return a float scalar.*shape \(2, 100\).*jnp.mean"):
        step(state, mlp_batch())


def test_state_of_another_policy() -> None:
    a, b = _policy(1), _policy(3)
    state = zj.init_state(mlp_params(), zj.shard_optimizer(optax.adam(1e-2), a), a)
    tx_b = zj.shard_optimizer(optax.adam(1e-2), b)
    step = zj.make_train_step(mlp_loss, tx_b, b)
    with pytest.raises(ValueError, match=r"laid out for ZeroPolicy\(stage=1.*this step is for ZeroPolicy\(stage=3"):
        step(state, mlp_batch())


def test_optimizer_state_of_another_parameter_tree() -> None:
    policy = _policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    other = dict(mlp_params(), w1=jnp.zeros((12, 200)))
    foreign = zj.init_state(other, tx, policy).opt_state
    step = zj.make_train_step(mlp_loss, tx, policy)
    with pytest.raises(ValueError, match=r"optimizer state belongs to another policy or another parameter tree"):
        step(state.replace(opt_state=foreign), mlp_batch())


def test_optimizer_state_of_another_optimizer() -> None:
    policy = _policy()
    state = zj.init_state(mlp_params(), zj.shard_optimizer(optax.sgd(0.1), policy), policy)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    with pytest.raises(ValueError, match=r"made by another optimizer"):
        step(state, mlp_batch())


def test_parameter_tree_changed_shape_between_init_and_step() -> None:
    policy = _policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    grown = dict(state.params, w2=jnp.zeros((100, 7)))
    with pytest.raises(ValueError, match=r"parameter tree changed.*leaf 'w2' has shape \(100, 7\).*\(100, 6\)"):
        step(state.replace(params=grown), mlp_batch())
    fewer = {k: v for k, v in state.params.items() if k != "b2"}
    with pytest.raises(ValueError, match=r"different tree structure"):
        step(state.replace(params=fewer), mlp_batch())


def test_unwrapped_or_mismatched_optimizer() -> None:
    policy = _policy()
    with pytest.raises(TypeError, match=r"wrapped for the policy: pass zj.shard_optimizer\(tx, policy\)"):
        zj.init_state(mlp_params(), optax.adam(1e-2), policy)
    with pytest.raises(ValueError, match=r"sharded for ZeroPolicy\(stage=1"):
        zj.make_train_step(mlp_loss, zj.shard_optimizer(optax.adam(1e-2), _policy(1)), policy)
    with pytest.raises(TypeError, match=r"already sharded"):
        zj.shard_optimizer(zj.shard_optimizer(optax.adam(1e-2), policy), policy)


def test_stacked_prefix_that_matches_nothing() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers")
    with pytest.raises(ValueError, match=r"prefix 'layers' matches no parameter.*\['b1', 'b2', 'scale', 'w1', 'w2'\]"):
        policy.layouts(mlp_params())


def test_device_count() -> None:
    # Not a skip: the suite needs its 8 devices, and says so when it lacks them.
    assert jax.device_count() == 8
