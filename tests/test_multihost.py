"""Several processes on 127.0.0.1 (zj.launch) against one process with 8 devices.

One launch of 2 processes x 4 simulated devices runs everything the
processes must do (training every stage, the hybrid policy, the bad inputs);
the tests below read its results. Only loopback addresses are used.
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np
import optax
import pytest
from _models import make_mesh, relative_update_error

import zero_jax as zj
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

CFG = TransformerConfig(vocab=64, dim=32, depth=3, heads=2, seq=16)
STEPS, BATCH = 5, 16
# (name, stage, mesh shape, policy keywords): plain ZeRO over all 8 devices of
# both processes, and HSDP with one replica per process.
# (optimizer_over_replicas is tested in one process: tests/test_hybrid.py.)
# Stages 1 and 3 cover what crosses processes (a gradient reduce-scatter, the updated parameters' gather,
# the layer-wise gathers); stages 0 and 2 differ from them only inside a process.
RUNS = [(f"stage{s}", s, (8,), {}) for s in (1, 3)] + [("hsdp3", 3, (2, 4), {"replica_axis": "replica"})]


def _policy(stage: int, shape: tuple[int, ...], kw: dict, devices=None) -> zj.ZeroPolicy:
    devices = np.asarray(devices if devices is not None else jax.devices()).reshape(shape)
    names = ("data",) if len(shape) == 1 else ("replica", "data")
    return zj.ZeroPolicy(stage, jax.sharding.Mesh(devices, names), "data", stacked="layers", **kw)


def _batches() -> list[dict[str, np.ndarray]]:
    return [jax.tree.map(np.asarray, synthetic_batch(CFG, BATCH, jax.random.key(10 + i))) for i in range(STEPS)]


def _train(policy: zj.ZeroPolicy, put) -> tuple[list[tuple[float, float]], dict[str, np.ndarray]]:
    """Losses and gradient norms of 5 steps, and the final parameters."""
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(lambda: init_params(CFG, jax.random.key(0)), tx, policy)
    step = zj.make_train_step(make_loss_fn(CFG, policy), tx, policy, gather="manual")
    losses = []
    for batch in _batches():
        state, metrics = step(state, put(batch))
        # Replicated scalars: readable on every process. The gradient norm sees the
        # gradient's scale (Adam's update would not).
        losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    full = zj.full_params(state)  # gathered: whole on every device of every process
    return losses, {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(full)[0]}


def _errors(fn) -> str:
    try:
        fn()
    except (ValueError, TimeoutError) as e:
        return str(e)
    return "no error"


def process_main() -> dict:
    """What each of the 2 processes runs (top-level: zj.launch imports it)."""
    pid, count = jax.process_index(), jax.process_count()
    rows = BATCH // count
    local = lambda b: jax.tree.map(lambda x: x[pid * rows : (pid + 1) * rows], b)  # noqa: E731  this process's rows
    out: dict = {"devices": (jax.device_count(), jax.local_device_count()), "runs": {}}
    start = time.perf_counter()
    for name, stage, shape, kw in RUNS:
        policy = _policy(stage, shape, kw)
        out["runs"][name] = _train(policy, lambda b, policy=policy: zj.shard_batch(local(b), policy))
    out["seconds"] = time.perf_counter() - start

    # Bad input, each detected on every process (so they stay in step).
    tx_for = lambda p: zj.shard_optimizer(optax.sgd(0.1), p)  # noqa: E731
    params = {"w": np.ones((64, 8), np.float32)}
    stage_differs = _policy(1 + pid, (8,), {})
    out["stage_differs"] = _errors(lambda: zj.init_state(params, tx_for(stage_differs), stage_differs))
    mesh_differs = _policy(2, (8,), {}) if pid == 0 else _policy(2, (2, 4), {"replica_axis": "replica"})
    out["mesh_differs"] = _errors(lambda: zj.init_state(params, tx_for(mesh_differs), mesh_differs))
    policy = _policy(2, (8,), {})
    wrong_rows = {"x": np.ones((8 if pid == 0 else 6, 3), np.float32)}
    out["batch_differs"] = _errors(lambda: zj.shard_batch(wrong_rows, policy))
    return out


@pytest.fixture(scope="module")
def two_processes() -> tuple[list[dict], float]:
    start = time.perf_counter()
    # conftest.py's fast-compile flags: the same HLO and numerics checks, compiled several times faster.
    fast = {"XLA_FLAGS": os.environ["ZERO_JAX_TEST_XLA_FLAGS"]}
    results = zj.launch(process_main, processes=2, local_devices=4, timeout_s=240, env=fast)
    return results, time.perf_counter() - start


@pytest.fixture(scope="module")
def one_process() -> dict:
    assert jax.device_count() == 8
    host = lambda b: jax.tree.map(np.asarray, b)  # noqa: E731
    return {name: _train(_policy(stage, shape, kw), host) for name, stage, shape, kw in RUNS}


def test_the_processes_form_one_pod(two_processes) -> None:
    results, seconds = two_processes
    assert [r["devices"] for r in results] == [(8, 4), (8, 4)]
    # Wall time is recorded, not asserted (a shared machine varies): about 30 s on 2 idle cores.
    print(f"MULTIHOST launch {seconds:.1f} s, training in each process {[round(r['seconds'], 1) for r in results]} s")


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_two_processes_equal_one_process(two_processes, one_process, name: str) -> None:
    results, _ = two_processes
    (losses0, params0), (losses1, params1) = (r["runs"][name] for r in results)
    # The processes agree bitwise: every value they read is one global array.
    assert losses0 == losses1
    for k in params0:
        np.testing.assert_array_equal(params0[k], params1[k], err_msg=k)
    # ... and equal one process with 8 devices up to float32 reduction order (gloo sums differently).
    ref_losses, ref_params = one_process[name]
    np.testing.assert_allclose(losses0, ref_losses, rtol=1e-6)  # loss and gradient norm of every step
    start = {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(init_params(CFG, jax.random.key(0)))[0]
    }
    relative = {k: np.linalg.norm(params0[k] - ref_params[k]) / np.linalg.norm(ref_params[k]) for k in params0}
    assert max(relative.values()) <= 1e-6, relative
    # Stricter: relative to the size of the 5-step update itself (Adam's normalisation amplifies rounding).
    errors = relative_update_error(params0, ref_params, start)
    print(f"MULTIHOST {name}: params {max(relative.values()):.2e}, update {max(errors.values()):.2e}")
    assert max(errors.values()) <= 2e-6, errors


def test_processes_that_disagree_fail_at_start_up(two_processes) -> None:
    for r in two_processes[0]:
        assert "zj.init_state: the processes disagree" in r["stage_differs"]
        assert "ZeroPolicy(stage=1" in r["stage_differs"] and "ZeroPolicy(stage=2" in r["stage_differs"]
        assert "zj.init_state: the processes disagree" in r["mesh_differs"]
        assert "'replica'" in r["mesh_differs"]


def test_a_local_batch_of_the_wrong_size_is_named(two_processes) -> None:
    for r in two_processes[0]:
        msg = r["batch_differs"]
        assert "shard_batch: the processes' batch slices differ" in msg
        assert "leaf 'x' of shape (8, 3)" in msg and "leaf 'x' of shape (6, 3)" in msg


def test_shard_batch_in_one_process_places_the_batch() -> None:
    policy = _policy(3, (2, 4), {"replica_axis": "replica"}, devices=make_mesh(8).devices)
    batch = zj.shard_batch({"x": np.arange(32, dtype=np.float32).reshape(16, 2)}, policy)
    assert batch["x"].sharding == policy.batch_sharding()
    np.testing.assert_array_equal(np.asarray(batch["x"]), np.arange(32).reshape(16, 2))
    with pytest.raises(ValueError, match=r"'x' has 12 local rows .* 8 batch shards"):
        zj.shard_batch({"x": np.ones((12, 2), np.float32)}, policy)
    with pytest.raises(ValueError, match="is a scalar"):
        zj.shard_batch({"x": np.float32(1)}, policy)
    # Every bad leaf at once.
    with pytest.raises(ValueError, match=r"'x' has 12 local rows, batch leaf 'z' has 4 local rows on process 0"):
        zj.shard_batch({"x": np.ones((12, 2)), "y": np.ones((16,)), "z": np.ones((4, 2))}, policy)
    with pytest.raises(ValueError, match=r"'a' is a scalar, batch leaf 'b' is a scalar; every leaf"):
        zj.shard_batch({"a": np.float32(1), "b": np.float32(2), "c": np.ones((8,))}, policy)


def test_launch_reports_a_failing_process() -> None:
    with pytest.raises(TypeError, match="cannot be found by a new process"):
        zj.launch(lambda: 1)
    with pytest.raises(RuntimeError, match=r"(?s)process 1 of 2 failed .*process 1 fails on purpose"):
        zj.launch(_fail_on_process_one, processes=2, local_devices=1, timeout_s=120)


def _fail_on_process_one() -> int:
    if jax.process_index() == 1:
        raise RuntimeError("process 1 fails on purpose")
    return 0
