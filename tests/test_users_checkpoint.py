"""Checkpoint inputs that were silently wrong (issue 29, item 4): load_params fed to init_state on a mesh that
pads, two CheckpointManagers taking turns on one directory, and save steps that are no step."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh

import zero_jax as zj


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(64, 256)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(256,)), jnp.float32),  # 256 = 3 * 85 + 1: stored (258,) on 3 devices
    }


def _state(n: int = 8, stage: int = 3, params: dict | None = None) -> tuple[zj.TrainState, zj.ZeroPolicy, object]:
    policy = zj.ZeroPolicy(stage, make_mesh(n), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    return zj.init_state(_params() if params is None else params, tx, policy), policy, tx


def test_load_params_then_init_state_on_three_devices_keeps_the_logical_shapes(tmp_path) -> None:
    # Base commit: load_params returned the stored (258,) / (64, 258) pieces and init_state took them as the
    # model's shapes: a (258,) bias, silently.
    file = zj.export_params(tmp_path / "m.safetensors", _state()[0])
    _, policy3, tx3 = _state(3)
    loaded = zj.load_params(file, policy3)
    assert {k: v.shape for k, v in loaded.items()} == {"w": (64, 256), "b": (256,)}
    state = zj.init_state(loaded, tx3, policy3)
    back = zj.full_params(state)
    assert {k: v.shape for k, v in back.items()} == {"w": (64, 256), "b": (256,)}
    for k, v in _params().items():
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v))
    assert state.params["b"].shape == (258,)  # stored padded, as any stage-3 state on 3 devices
    stored = zj.load_params(file, policy3, stored=True)  # the form state.params holds
    for k in ("w", "b"):
        assert stored[k].shape == state.params[k].shape and stored[k].sharding == state.params[k].sharding
        np.testing.assert_array_equal(np.asarray(stored[k]), np.asarray(state.params[k]))
    whole = zj.load_params(file, _state(8)[1])  # 8 divides everything: the pieces themselves
    assert whole["b"].shape == (256,) and len({s.data.shape for s in whole["b"].addressable_shards}) == 1
    assert whole["b"].addressable_shards[0].data.shape == (32,)


def test_two_managers_taking_turns_on_one_directory_keep_the_newest_steps(tmp_path) -> None:
    # Base commit: each orbax manager pruned only the steps it had saved: [2, 3, 4] were left.
    state = _state(2, 1, {"w": jnp.ones((4, 4))})[0]
    a = zj.CheckpointManager(tmp_path, max_to_keep=2, async_save=False)
    b = zj.CheckpointManager(tmp_path, max_to_keep=2, async_save=True)
    try:
        for step, mgr in ((1, a), (2, b), (3, a), (4, b)):
            mgr.save(state, step=step)
            mgr.wait()
        assert a.all_steps() == b.all_steps() == [3, 4]
    finally:
        a.close()
        b.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]


@pytest.mark.parametrize("step", [-1, True, 1.5, "3", np.int32(-2)])
def test_save_refuses_a_step_that_is_no_step(tmp_path, step) -> None:
    # Base commit: step=-1 and step=True (saved as step 1) were accepted; 1.5 became step 1.
    state = _state(2, 1, {"w": jnp.ones((4, 4))})[0]
    with pytest.raises(ValueError, match=r"zj.save: step must be a non-negative int .*got .*Pass step=int"):
        zj.save(tmp_path / "a", state, step=step)
    with zj.CheckpointManager(tmp_path / "b", async_save=False) as mgr:
        with pytest.raises(ValueError, match=r"CheckpointManager.save: step must be a non-negative int"):
            mgr.save(state, step=step)
    assert not (tmp_path / "a").exists() and zj.checkpoint.partial_saves(tmp_path / "b") == []


def test_save_takes_numpy_and_array_integer_steps(tmp_path) -> None:
    state = _state(2, 1, {"w": jnp.ones((4, 4))})[0]
    zj.save(tmp_path, state, step=np.int64(7))
    zj.save(tmp_path, state, step=jnp.asarray(8))
    with zj.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [7, 8]
