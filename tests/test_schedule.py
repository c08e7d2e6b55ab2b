"""The schedule seam (``zero_jax._layerwise.schedule``): the tie changes no bit,
each trick can be switched off per backend, and every backend not measured
gets XLA:CPU's schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _models import make_mesh, train_steps

import zero_jax as zj
from zero_jax._base.toolchain import compiler_version, version_text
from zero_jax._layerwise.schedule import (
    MEASURED,
    Schedule,
    accepted_options,
    entry_for,
    read_only_options,
    schedule_for,
    tie,
)
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch


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
    running = compiler_version("cpu")[1]
    entry = entry_for("cpu", running)
    assert schedule_for(policy) == entry._replace(backend="cpu", running=f"jaxlib {version_text(running)}")
    assert set(MEASURED) >= {"cpu", "tpu", "gpu"}
    assert entry_for("rocm", running) == entry  # a backend without entries: XLA:CPU's


def test_the_entry_of_the_running_compiler_or_the_nearest() -> None:
    """Each backend's entries are keyed by compiler version: the running version's, else the nearest older
    one, else the oldest; a schedule built on a version without its own entry says which it took."""
    for backend, entries in MEASURED.items():
        versions = sorted(e.version for e in entries)
        assert len(set(versions)) == len(versions), backend  # one entry per version
        for v in versions:
            assert entry_for(backend, v).version == v
        assert entry_for(backend, (*versions[-1], 9)).version == versions[-1]
        assert entry_for(backend, (0,)).version == versions[0]
    nearest = entry_for("tpu", (0, 0, 50, 1))._replace(running="libtpu 0.0.50.1")
    assert nearest.nearest and "running libtpu 0.0.50.1: the nearest entry" in nearest.describe()


def test_options_the_compiler_refuses_are_left_out() -> None:
    """An option set the running compiler refuses (here an option XLA:CPU does not know) is never the reason
    a step fails: the next set is taken (or none), and the refusal is said; the read-only options are each
    kept only where accepted (jaxlib 0.12 has no xla_cpu_use_fusion_emitters)."""
    devices = jax.devices()
    unknown = (("xla_zero_jax_no_such_option", "true"),)
    known = (("xla_backend_optimization_level", "0"),)
    options, refused = accepted_options(devices, (unknown, known))
    assert options == known and len(refused) == 1 and "xla_zero_jax_no_such_option" in refused[0]
    assert accepted_options(devices, (unknown,)) == ((), refused)
    read_only = read_only_options(devices)
    assert read_only["xla_backend_optimization_level"] == 0
    assert set(read_only) <= {name for name, _ in entry_for("cpu", compiler_version("cpu")[1]).read_only_options}
    jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile(compiler_options=read_only)  # all accepted


def test_a_trial_replaces_the_compiler_options() -> None:
    """zj.measure.trying_schedule(compiler_options=...) replaces the backend's options (the bound of
    bucket_bytes still added); it raised before, once bucket options joined the measured ones."""
    policy = zj.ZeroPolicy(3, make_mesh(8), bucket_bytes="1MiB")
    with zj.measure.trying_schedule(compiler_options={"xla_example_option": "true"}):
        assert schedule_for(policy).compiler_options == (("xla_example_option", "true"),)
    assert schedule_for(policy).compiler_options == entry_for("cpu", compiler_version("cpu")[1]).compiler_options


def test_integer_leaves_are_tied_only_when_asked() -> None:
    """hpZ's int8 secondary pieces are tied for their re-gather: bitwise unchanged, and untouched by default."""
    codes = jnp.arange(-4, 4, dtype=jnp.int8)
    anchor = jnp.array([jnp.nan, 1.0])
    assert tie(codes, anchor) is codes
    np.testing.assert_array_equal(np.asarray(tie(codes, anchor, integers=True)), np.asarray(codes))
    text = str(jax.make_jaxpr(lambda c, a: tie(c, a, integers=True))(codes, anchor))
    assert "or" in text  # the integer zero made from the anchor joins the codes


def test_the_audit_says_which_entry_a_step_was_built_with_and_when_it_is_the_nearest() -> None:
    """A compiler version the seam has no entry for: the nearest entry is used and the audit's report says so."""
    from unittest import mock

    import optax

    policy = zj.ZeroPolicy(2, make_mesh(8))
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state({"w": jnp.ones((64, 8))}, tx, policy)
    step = zj.make_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), tx, policy)
    batch = jnp.ones((16, 64))
    own = entry_for("cpu", compiler_version("cpu")[1]).compiler
    assert f"schedule seam: the cpu entry measured on {own}" in str(zj.audit(step, state, batch))
    with mock.patch("zero_jax._layerwise.schedule.compiler_version", return_value=("jaxlib", (0, 11, 1))):
        text = str(zj.audit(step, state, batch))
    assert "the cpu entry measured on jaxlib 0.10.2 (running jaxlib 0.11.1: the nearest entry)" in text


def test_the_gpu_entrys_own_switches_change_when_and_along_which_axis_not_what_is_computed() -> None:
    """``loop_head_start`` (how much of the next layer the backward re-gathers at once) and
    ``major_axis_collectives`` (pieces gathered and reduce-scattered along a new leading axis) are the gpu
    entry's; switched on on XLA:CPU, layer-wise stage 3 of the reference transformer (scanned: every
    parameter's gradient through them; its column-cut pieces take the new axis) trains bit for bit as with
    the cpu entry."""
    cfg = TransformerConfig(vocab=64, dim=32, depth=4, heads=2, seq=16)
    params = init_params(cfg, jax.random.key(0))
    batches = [synthetic_batch(cfg, 8, jax.random.key(k)) for k in (1, 2)]
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers")
    loss = make_loss_fn(cfg, policy)
    plain_state, _, plain_losses = train_steps(policy, params, loss, batches)
    with zj.measure.trying_schedule(loop_head_start=1.0, major_axis_collectives=True):
        assert schedule_for(policy).major_axis_collectives
        state, _, losses = train_steps(policy, params, loss, batches)
    assert losses == plain_losses
    for a, b in zip(jax.tree.leaves(zj.full_params(state)), jax.tree.leaves(zj.full_params(plain_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
