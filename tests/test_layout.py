"""Pure partition rules and the policy's sharding answers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import make_mesh

import zero_jax as zj
from zero_jax._layout import leaf as _partition


def test_rule_prefers_a_dividing_dimension() -> None:
    assert zj.leaf_layout((10, 640), "float32", 8).dim == 1
    assert zj.leaf_layout((640, 10), "float32", 8).dim == 0
    # Both divide: the larger one (smaller pieces of the rest).
    assert zj.leaf_layout((16, 4096), "float32", 8).dim == 1


def test_rule_pads_the_dimension_that_wastes_least() -> None:
    lay = zj.leaf_layout((100, 6), "float32", 8, min_shard_size=0)
    # Padding dim 0 to 104 wastes 4*6 elements; dim 1 to 8 would waste 2*100.
    assert (lay.dim, lay.padded_size, lay.stored_shape, lay.padding) == (0, 104, (104, 6), 4)


def test_rule_leaves_small_and_non_float_leaves_whole() -> None:
    assert zj.leaf_layout((10, 10), "float32", 8).reason == _partition.REASON_BELOW_THRESHOLD
    assert zj.leaf_layout((4096,), "int32", 8).reason == _partition.REASON_NOT_FLOAT
    assert zj.leaf_layout((), "float32", 8, min_shard_size=0).reason == _partition.REASON_NO_DIMENSION
    assert zj.leaf_layout((2048,), "bfloat16", 8).dim == 0


def test_stacked_leaves_never_cut_their_layer_axis() -> None:
    # Layer axis 16 divides 8, the other dimension does not: still never dim 0.
    lay = zj.leaf_layout((16, 100), "float32", 8, min_shard_size=0, skip_leading=True)
    assert lay.dim == 1 and lay.stored_shape == (16, 104)
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=0)
    params = {"layers": {"w": jnp.zeros((16, 100))}, "head": jnp.zeros((16, 100))}
    lays = policy.layouts(params)
    assert lays["layers"]["w"].dim == 1 and lays["head"].dim == 0


def test_pad_unpad_round_trip_under_strict_promotion() -> None:
    lay = zj.leaf_layout((10, 3), "float32", 4, min_shard_size=0)
    x = jnp.arange(30, dtype=jnp.float32).reshape(10, 3)
    with jax.numpy_dtype_promotion("strict"):
        padded = _partition.pad(x, lay)
        assert padded.shape == lay.stored_shape == (12, 3)
        assert float(padded[10:].sum()) == 0.0
        np.testing.assert_array_equal(_partition.unpad(padded, lay), x)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_policy_shardings_per_stage(stage: int) -> None:
    policy = zj.ZeroPolicy(stage, make_mesh(8))
    params = {"w": jax.ShapeDtypeStruct((4096, 100), jnp.float32), "b": jax.ShapeDtypeStruct((100,), jnp.float32)}
    cut = jax.sharding.PartitionSpec("data")
    whole = jax.sharding.PartitionSpec()
    assert policy.param_sharding(params)["w"].spec == (cut if stage == 3 else whole)
    assert policy.grad_sharding(params)["w"].spec == (cut if stage >= 2 else whole)
    opt = {"mu": params}
    assert policy.opt_state_sharding(opt, params)["mu"]["w"].spec == (cut if stage >= 1 else whole)
    assert policy.param_sharding(params)["b"].spec == whole  # below min_shard_size


def test_mirrored_state_takes_its_parameters_layout_even_when_stacked() -> None:
    policy = zj.ZeroPolicy(1, make_mesh(8), stacked="layers", min_shard_size=0)
    params = {"layers": {"w": jax.ShapeDtypeStruct((8, 24), jnp.float32)}}
    state = (
        {"mu": params, "row": {"layers": {"w": jax.ShapeDtypeStruct((8,), jnp.float32)}}},
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    lays = policy.state_layouts(state, params)
    assert lays[0]["mu"]["layers"]["w"].dim == 1  # mirrors the stacked parameter
    assert lays[0]["row"]["layers"]["w"].dim == 0  # its own rule: a plain vector
    assert lays[1].dim is None


def test_replicated_leaves_are_reported_with_bytes() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8))
    params = {"b": np.zeros(16, np.float32), "w": np.zeros((64, 64), np.float32), "step": np.zeros((), np.int32)}
    report = {r.path: r for r in policy.replicated_leaves(params)}
    assert set(report) == {"b", "step"}
    assert report["b"].nbytes == 64 and report["b"].reason == _partition.REASON_BELOW_THRESHOLD
    assert report["step"].reason == _partition.REASON_NOT_FLOAT


def test_hybrid_axes_partition_over_their_product() -> None:
    mesh = make_mesh(8, ("replica", "data"), (2, 4))
    both = zj.ZeroPolicy(3, mesh, axis=("replica", "data"))
    inner = zj.ZeroPolicy(3, mesh, axis="data")
    assert (both.num_shards, inner.num_shards) == (8, 4)
    params = {"w": jax.ShapeDtypeStruct((1024, 8), jnp.float32)}
    assert both.param_sharding(params)["w"].spec == jax.sharding.PartitionSpec(("replica", "data"))
    assert inner.param_sharding(params)["w"].spec == jax.sharding.PartitionSpec("data")
