"""The collectives of ``zero_jax._comm`` on their own, inside a ``jax.shard_map``
over 8 simulated devices, against NumPy: each device's piece of a reduce-scatter
is its slice of the (padded) sum, an all-gather for use is the whole unpadded
leaf and its gradient is the reduce-scattered cotangent, the replica-axis
reduction of a hybrid mesh, and ZeRO++'s int8 blocks (qwZ / qgZ) within their
stated bound. fp32 sums of 8 terms: compared to 1e-6 relative (reduction order)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _models import make_mesh
from jax.sharding import PartitionSpec as P

from zero_jax._comm import collectives as coll
from zero_jax._comm import quantized as _quantize
from zero_jax._layout.leaf import leaf_layout, pad
from zero_jax._theory.wire import WireFormat, wire_bytes

N = 8
RTOL = 1e-6  # fp32: eight-term sums in another order
#: A (10, 6) leaf cut into 8: dimension 1 padded to 8 wastes 20 elements, dimension 0 padded to 16 wastes 36.
LAYOUT = leaf_layout((10, 6), jnp.float32, N, min_shard_size=0)


def _per_device(seed: int) -> np.ndarray:
    """One (10, 6) value per device, stacked: (8, 10, 6)."""
    return np.random.default_rng(seed).normal(size=(N, 10, 6)).astype(np.float32)


def _run(fn, x: np.ndarray, out_spec: P, mesh=None):
    mesh = mesh or make_mesh(N)
    flat = jnp.asarray(x.reshape(N * x.shape[1], *x.shape[2:]))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=out_spec, axis_names={"data"}))(flat)


def test_the_layout_pads_the_dimension_that_wastes_least() -> None:
    assert (LAYOUT.dim, LAYOUT.stored_shape, LAYOUT.padding) == (1, (10, 8), 2)


def test_reduce_scatter_gives_each_device_its_slice_of_the_padded_sum() -> None:
    x = _per_device(0)
    got = _run(lambda g: coll.sum_reduce_scatter(g, LAYOUT, ("data",)), x, P(None, "data"))
    expected = np.pad(x.sum(0), ((0, 0), (0, 2)))  # (10, 8): device d holds column d
    np.testing.assert_allclose(np.asarray(got), expected, rtol=RTOL, atol=1e-6)


def test_a_leaf_kept_whole_is_all_reduced() -> None:
    whole = leaf_layout((10, 6), jnp.float32, N)  # 60 elements: below the default min_shard_size
    assert whole.dim is None
    x = _per_device(1)
    got = _run(lambda g: coll.sum_reduce_scatter(g, whole, ("data",))[None], x, P("data"))
    for d in range(N):  # every device holds the whole sum
        np.testing.assert_allclose(np.asarray(got)[d], x.sum(0), rtol=RTOL, atol=1e-6)


def test_gather_for_use_is_the_whole_leaf_and_its_gradient_is_the_reduce_scattered_cotangent() -> None:
    w = np.random.default_rng(2).normal(size=(10, 6)).astype(np.float32)
    pieces = np.asarray(pad(jnp.asarray(w), LAYOUT)).reshape(10, N, 1).transpose(1, 0, 2)  # device d: column d
    c = _per_device(3)  # each device's own cotangent

    def device(piece_and_c):
        piece, ct = piece_and_c[:, :1], piece_and_c[:, 1:]
        whole, vjp = jax.vjp(lambda p: coll.gather_for_use(p, LAYOUT, ("data",)), piece)
        return jnp.concatenate([whole, vjp(ct)[0]], axis=1)  # (10, 6 + 1)

    both = np.concatenate([pieces, c], axis=2)  # (8, 10, 7)
    got = np.asarray(_run(device, both, P("data")))
    for d in range(N):
        rows = got[d * 10 : (d + 1) * 10]
        np.testing.assert_array_equal(rows[:, :6], w)  # the whole, unpadded leaf on every device
        np.testing.assert_allclose(rows[:, 6], np.pad(c.sum(0), ((0, 0), (0, 2)))[:, d], rtol=RTOL, atol=1e-6)


def test_the_replica_reduction_sums_each_piece_across_replicas() -> None:
    mesh = make_mesh(N, ("replica", "data"), (2, 4))
    layout = leaf_layout((10, 8), jnp.float32, 4, min_shard_size=0)  # dimension 1: 8 = 4 x 2, no padding
    axes = coll.Axes(("data",), ("replica",))
    x = np.random.default_rng(4).normal(size=(N, 10, 8)).astype(np.float32)

    def device(g):
        return coll.reduce_across_replicas(coll.sum_reduce_scatter(g, layout, axes), layout, axes)

    flat = jnp.asarray(x.reshape(N * 10, 8))
    spec = P(("replica", "data"))
    got = jax.jit(jax.shard_map(device, mesh=mesh, in_specs=spec, out_specs=P(None, "data"),
                                axis_names={"replica", "data"}, check_vma=False))(flat)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), x.sum(0), rtol=RTOL, atol=1e-6)


def test_int8_reduce_scatter_and_gather_stay_within_their_block_bound() -> None:
    block = 4
    axes = coll.Axes(("data",), wire=WireFormat("int8", "int8", block))
    x = _per_device(5)
    got = _run(lambda g: coll.sum_reduce_scatter(g, LAYOUT, axes), x, P(None, "data"))
    exact = np.pad(x.sum(0), ((0, 0), (0, 2)))
    # Each device's piece of each sender is rounded to half a step of its block; the receiver sums 8 of them.
    pieces = np.pad(x, ((0, 0), (0, 0), (0, 2))).reshape(N, 10, N, 1).transpose(0, 2, 1, 3)  # sender, dest
    bound = sum(np.asarray(_quantize.round_trip_bound(pieces[s, d], block)) for s in range(N) for d in [0])
    err = np.abs(np.asarray(got) - exact)
    assert 0 < err.max() <= 8 * np.abs(pieces).max() / 127 / 2 * (1 + 1e-5), err.max()
    assert bound.shape == (10, 1)
    w = np.random.default_rng(6).normal(size=(10, 6)).astype(np.float32)
    stored = np.asarray(pad(jnp.asarray(w), LAYOUT)).reshape(10, N, 1).transpose(1, 0, 2)
    whole = np.asarray(_run(lambda p: coll.gather_for_use(p, LAYOUT, axes), stored, P("data")))[:10]
    per_piece = np.concatenate([np.asarray(_quantize.round_trip_bound(stored[d], block)) for d in range(N)], axis=1)
    assert np.all(np.abs(whole - w) <= per_piece[:, :6] * (1 + 1e-6) + 1e-30)


# -- the int8 blocks themselves ----------------------------------------------------------------


def test_round_trip_is_within_half_a_step_of_each_block() -> None:
    # Blocks of very different magnitudes, a tail shorter than a block, exact zeros.
    x = jax.random.normal(jax.random.key(3), (1000,)) * jnp.repeat(jnp.array([1e-3, 1.0, 50.0, 0.0]), 250)
    q, scale = _quantize.quantize_blocks(x, 64)
    assert q.dtype == jnp.int8 and q.shape == (16, 64) and scale.dtype == jnp.float32
    y = _quantize.dequantize_blocks(q, scale, x.shape, x.dtype)
    err, bound = np.abs(np.asarray(y - x)), np.asarray(_quantize.round_trip_bound(x, 64))
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30)  # half a step (+ the multiply's rounding)
    assert err.max() > 0 and np.all(err[750:] == 0)  # it does round; a zero block comes back exact
    # The bound is max|block| / 127 / 2, checked by hand on the second block:
    np.testing.assert_allclose(bound[64], np.abs(np.asarray(x[64:128])).max() / 127 / 2, rtol=1e-6)


def test_a_block_with_inf_or_nan_comes_back_non_finite_and_spares_the_others() -> None:
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        x = jnp.arange(96.0).at[40].set(bad)
        y = _quantize.dequantize_blocks(*_quantize.quantize_blocks(x, 32), x.shape, x.dtype)
        assert not np.isfinite(np.asarray(y[32:64])).any()
        assert np.isfinite(np.asarray(y[:32])).all() and np.isfinite(np.asarray(y[64:])).all()


def test_a_piece_smaller_than_the_block_is_one_block() -> None:
    q, scale = _quantize.quantize_blocks(jnp.ones((5, 4)), 256)
    assert q.shape == (1, 20) and scale.shape == (1,)
    assert wire_bytes(20, 256) == 20 + 4
