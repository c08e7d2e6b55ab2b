"""The schedule seam (``zero_jax._layerwise.schedule``): the tie changes no bit,
each trick can be switched off per backend, and every backend not measured
gets XLA:CPU's schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _models import make_mesh

import zero_jax as zj
from zero_jax._layerwise.schedule import MEASURED, Schedule, schedule_for, tie


def test_the_tie_changes_no_bit() -> None:
    values = jnp.array([1.5, -0.0, 0.0, jnp.inf, -jnp.inf, jnp.nan, 1e-45, -3.0], jnp.float32)
    for anchor in (jnp.array([2.0]), jnp.array([jnp.nan]), jnp.array([jnp.inf]), jnp.array([-0.0]), jnp.array([7])):
        for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
            v = values.astype(dtype)
            out = jax.jit(tie)(v, anchor)
            np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(v).view(np.uint8))
    ints = jnp.arange(3)
    assert tie(ints, jnp.ones(2)) is ints  # non-float values pass through
    assert tie(values, jnp.zeros((0,))) is values  # an anchor without elements ties nothing


def test_each_trick_switches_off_alone() -> None:
    x, anchor = jnp.arange(4.0), jnp.ones(2)
    off = Schedule("test", tie_gathers=False, tie_recompute=False, tie_backward_order=False, leafwise_prefetch=False)
    assert off.due(x, anchor) is x and off.after_reduction(x, anchor) is x
    assert off.recompute_after(x, anchor) == (x, False)
    assert off.prefetch_anchors([0, 1], [4, 4], [1, 0], [None, None], [4, 4], [None, None], "start", "x") == [
        "start",
        "start",
    ]
    on = Schedule("test")
    assert on.due(x, anchor) is not x  # tied: a new value, the same bits
    np.testing.assert_array_equal(np.asarray(on.due(x, anchor)), np.asarray(x))


def test_a_backend_not_measured_gets_the_cpu_schedule() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8))
    assert schedule_for(policy) == MEASURED["cpu"]._replace(backend="cpu")
    assert set(MEASURED) >= {"cpu"}


def test_a_trial_replaces_the_compiler_options() -> None:
    """zj.measure.trying_schedule(compiler_options=...) replaces the backend's options (the bound of
    bucket_bytes still added); it raised before, once bucket options joined the measured ones."""
    policy = zj.ZeroPolicy(3, make_mesh(8), bucket_bytes="1MiB")
    with zj.measure.trying_schedule(compiler_options={"xla_example_option": "true"}):
        assert schedule_for(policy).compiler_options == (("xla_example_option", "true"),)
    assert schedule_for(policy).compiler_options == MEASURED["cpu"].compiler_options


def test_integer_leaves_are_tied_only_when_asked() -> None:
    """hpZ's int8 secondary pieces are tied for their re-gather: bitwise unchanged, and untouched by default."""
    codes = jnp.arange(-4, 4, dtype=jnp.int8)
    anchor = jnp.array([jnp.nan, 1.0])
    assert tie(codes, anchor) is codes
    np.testing.assert_array_equal(np.asarray(tie(codes, anchor, integers=True)), np.asarray(codes))
    text = str(jax.make_jaxpr(lambda c, a: tie(c, a, integers=True))(codes, anchor))
    assert "or" in text  # the integer zero made from the anchor joins the codes
