"""ZeroPolicy is a value: frozen, replaced whole, checked at construction
(every problem named at once)."""

from __future__ import annotations

import numpy as np
import pytest
from _models import make_mesh, mlp_params

import zero_jax as zj

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
    for words in (
        "stage must be 0, 1, 2 or 3, got 7",
        "axis 'batch' is not an axis of the mesh",
        "min_shard_size must be >= 0, got -1",
        "precision must be a zj.Precision, got str",
    ):
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
