"""Policies and sharded optimizers are values: frozen, pytree-safe, and what
they do to non-float parameters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj
from zero_jax._optimizer import TreeLayouts, sharded_parts

# -- ZeroPolicy is immutable --------------------------------------------------------------


def test_policy_is_immutable_and_replace_builds_a_new_one() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8), min_shard_size=64)
    key = policy.key
    with pytest.raises(AttributeError, match=r"ZeroPolicy is immutable: cannot set 'stage'.*policy.replace\(stage="):
        policy.stage = 3
    with pytest.raises(AttributeError, match=r"ZeroPolicy is immutable: cannot set 'novel'"):
        policy.novel = 1
    with pytest.raises(AttributeError, match=r"ZeroPolicy is immutable: cannot delete 'mesh'"):
        del policy.mesh
    assert policy.stage == 2 and policy.key == key
    three = policy.replace(stage=3)
    assert (three.stage, three.min_shard_size, three.partitions_params) == (3, 64, True)
    assert policy.stage == 2 and three != policy
    # Equality and hashing are the layout fingerprint, as before.
    assert policy.replace() == policy and hash(policy.replace()) == hash(policy)
    assert len({policy, policy.replace(), three}) == 2
    with pytest.raises(TypeError, match=r"\['stages'\] are not ZeroPolicy arguments"):
        policy.replace(stages=3)


def test_policy_validation_names_every_problem_at_once() -> None:
    mesh = make_mesh(8)
    with pytest.raises(ValueError) as e:
        zj.ZeroPolicy(7, mesh, axis="batch", min_shard_size=-1, precision="bf16")
    message = str(e.value)
    assert message.startswith("ZeroPolicy: 4 problems with the arguments")
    for words in ("stage must be 0, 1, 2 or 3, got 7", "axis 'batch' is not an axis of the mesh",
                  "min_shard_size must be >= 0, got -1", "precision must be a zj.Precision, got str"):
        assert words in message, words
    # One problem: its own error, as before.
    with pytest.raises(TypeError, match=r"^ZeroPolicy: mesh must be a jax.sharding.Mesh, got list"):
        zj.ZeroPolicy(1, [0, 1])
    with pytest.raises(TypeError, match=r"2 problems.*\n.*mesh must be.*\n.*min_shard_size must be an int"):
        zj.ZeroPolicy(1, [0, 1], min_shard_size="big")


def test_stacked_prefixes_that_match_nothing_are_named_together() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked=("layers", "blocks", "w1"))
    with pytest.raises(ValueError, match=r"prefixes 'layers', 'blocks' matches no parameter.*\['b1', 'b2'"):
        policy.layouts(mlp_params())


def test_check_batch_names_every_bad_leaf() -> None:
    policy = zj.ZeroPolicy(1, make_mesh(8))
    batch = {"x": np.zeros((12, 3)), "y": np.zeros((20,)), "z": np.zeros((16, 2))}
    with pytest.raises(ValueError, match=r"batch leaf 'x' has shape \(12, 3\), batch leaf 'y' has shape \(20,\); "):
        policy.check_batch(batch, where="t")
    with pytest.raises(ValueError, match=r"batch leaf 'z' has shape \(16, 2\): accum_steps=4 .* multiple of 32"):
        policy.check_batch({"z": batch["z"]}, where="t", microbatches=4)


# -- the sharded optimizer is a pytree-safe value -------------------------------------------


def _rebuilt(tx: optax.GradientTransformation) -> dict[str, optax.GradientTransformation]:
    return {
        "tree_map": jax.tree.map(lambda f: f, tx),
        "unflatten": jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(tx))),
    }


@pytest.mark.parametrize("how", ["tree_map", "unflatten"])
@pytest.mark.parametrize("stage", [1, 3])
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
