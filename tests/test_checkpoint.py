"""Checkpoints: save at one (N, stage), restore at another; crash safety; export; bad input."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import child_env, make_mesh, mlp_batch, mlp_loss, mlp_params
from safetensors.numpy import load_file

import zero_jax as zj
from zero_jax._base.tree import key_name
from zero_jax.checkpoint._record import state_entries as _entries
from zero_jax.models import TransformerConfig, init_params

ROOT = Path(__file__).resolve().parents[1]


def _setup(stage: int, n: int, opt=None, **kw):
    policy = zj.ZeroPolicy(stage, make_mesh(n), min_shard_size=0, **kw)  # every float leaf cut, most padded
    return policy, zj.shard_optimizer(opt or optax.adamw(3e-2), policy)


def _logical(state: zj.TrainState) -> dict[str, np.ndarray]:
    """Every array of a state, unpadded, on the host, by checkpoint name."""
    return {
        e.name: np.asarray(x)[tuple(slice(0, n) for n in e.shape)]
        for e, x in zip(_entries(state), jax.tree.leaves(state), strict=True)
    }


def _padding_is_zero(state: zj.TrainState) -> bool:
    for e, x in zip(_entries(state), jax.tree.leaves(state), strict=True):
        full = np.asarray(x)
        mask = np.ones(full.shape, bool)
        mask[tuple(slice(0, n) for n in e.shape)] = False
        if full[mask].any():
            return False
    return True


def _assert_bitwise(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name, strict=True)


def _run(state, step, batches):
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state, losses


# -- save at N = 8, stage 3; restore at other (N, stage) -----------------------------------------------


@pytest.mark.slow  # > 3 s on 2 idle cores
def test_restore_across_device_counts_and_stages(tmp_path):
    policy, tx = _setup(3, 8)
    step = zj.make_train_step(mlp_loss, tx, policy)
    state = zj.init_state(mlp_params(), tx, policy)
    state, _ = _run(state, step, [mlp_batch(16, seed=s) for s in range(3)])
    zj.save(tmp_path, state, step=3)
    saved = _logical(state)
    assert saved["params/w1"].shape == (12, 100) and state.params["w2"].shape != (100, 6)  # padded in the store
    further = [mlp_batch(16, seed=s) for s in range(3, 8)]
    _, uninterrupted = _run(state, step, further)

    for n, stage in [(2, 1), (4, 2), (1, 0), (8, 3)]:
        pol, ttx = _setup(stage, n)
        back = zj.restore(tmp_path, policy=pol, tx=ttx)
        assert back.policy == pol and int(back.step) == 3
        _assert_bitwise(_logical(back), saved)  # parameters and optimizer state, bitwise, after unpadding
        assert _padding_is_zero(back)
        fresh = zj.init_state(mlp_params(), ttx, pol)  # restored leaves land in the target layout
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(fresh), strict=True):
            assert a.shape == b.shape and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        _, losses = _run(back, zj.make_train_step(mlp_loss, ttx, pol), further)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, uninterrupted, strict=True))
        print(f"restore at N={n}, stage {stage}: 5 losses {losses}, max relative difference {rel:.2e}")
        if (n, stage) == (8, 3):
            assert losses == uninterrupted  # same layout, same program: bitwise
        else:  # another N sums in another order: float32 rounding only
            np.testing.assert_allclose(losses, uninterrupted, rtol=2e-6)


@pytest.mark.slow  # > 3 s on 2 idle cores
def test_restore_stacked_transformer_and_precision_changes(tmp_path):
    cfg = TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=8)
    params = init_params(cfg, jax.random.key(0))
    mixed = zj.Precision(compute_dtype=jnp.bfloat16)
    policy, tx = _setup(3, 8, stacked="layers", precision=mixed)
    state = zj.init_state(params, tx, policy)  # (training is covered above; this is about layouts and dtypes)
    zj.save(tmp_path / "mixed", state, step=1)
    saved = _logical(state)

    # Same precision, N = 4, stage 2, with the model's parameters as the template.
    pol, ttx = _setup(2, 4, stacked="layers", precision=mixed)
    back = zj.restore(tmp_path / "mixed", policy=pol, tx=ttx, like=params)
    _assert_bitwise(_logical(back), saved)

    # Mixed -> float32: params come from the float32 master, the master is dropped.
    pol, ttx = _setup(1, 2, stacked="layers")
    back = zj.restore(tmp_path / "mixed", policy=pol, tx=ttx)
    got = _logical(back)
    assert back.master is None and not any(k.startswith("master/") for k in got)
    for name, value in saved.items():
        if name.startswith("params/"):
            np.testing.assert_array_equal(got[name], saved["master/" + name[len("params/") :]], strict=True)
        elif not name.startswith("master/"):
            np.testing.assert_array_equal(got[name], value, strict=True)

    # float32 -> mixed: the master is built from the float32 params, params cast to bfloat16.
    zj.save(tmp_path / "fp32", back, step=1)
    pol, ttx = _setup(3, 8, stacked="layers", precision=mixed)
    again = _logical(zj.restore(tmp_path / "fp32", policy=pol, tx=ttx))
    for name in saved:
        np.testing.assert_array_equal(again[name], saved[name], strict=True)  # bf16(master) == saved bf16 params


def test_loss_scale_restored_or_started(tmp_path):
    fp16 = zj.Precision(compute_dtype=jnp.float16, loss_scale=zj.DynamicLossScale(initial=2.0**10))
    policy, tx = _setup(2, 8, precision=fp16)
    state = zj.init_state(mlp_params(), tx, policy)
    state, _ = _run(state, zj.make_train_step(mlp_loss, tx, policy), [mlp_batch(16, seed=0)])
    zj.save(tmp_path, state, step=1)
    pol, ttx = _setup(1, 4, precision=fp16)
    back = zj.restore(tmp_path, policy=pol, tx=ttx, like=state)  # a template state gives the tree
    assert int(back.loss_scale.good_steps) == int(state.loss_scale.good_steps) == 1
    pol, ttx = _setup(1, 4)  # float32: no loss scale, no master
    plain = zj.restore(tmp_path, policy=pol, tx=ttx)
    assert plain.loss_scale is None and plain.master is None


# -- the manager: keep the last K, save asynchronously while training ------------------------------------


def test_async_manager_keeps_last_k_while_training(tmp_path):
    policy, tx = _setup(2, 8)
    step = zj.make_train_step(mlp_loss, tx, policy)
    state = zj.init_state(mlp_params(), tx, policy)
    expected = {}
    with zj.CheckpointManager(tmp_path, max_to_keep=2, async_save=True) as mgr:
        for s in range(4):
            expected[s] = _logical(state)
            mgr.save(state, step=s)  # returns before the files are written ...
            state, _ = step(state, mlp_batch(16, seed=s))  # ... and the saved state is donated at once
        assert mgr.all_steps() == [2, 3]
        for s in (2, 3):
            _assert_bitwise(_logical(mgr.restore(policy=policy, tx=tx, step=s)), expected[s])
        with pytest.raises(FileExistsError, match="step 3 already exists"):
            mgr.save(state, step=3)


# -- crash safety: SIGKILL part-way through a save -------------------------------------------------------

_KILLED_SAVE = textwrap.dedent(
    """
    import asyncio, sys, time
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    import numpy as np, optax, jax.numpy as jnp
    import zero_jax as zj
    from orbax.checkpoint._src.path import atomicity
    from orbax.checkpoint._src.serialization import serialization

    directory, mode, oracle = sys.argv[1:4]
    policy = zj.ZeroPolicy(stage=3, mesh=jax.sharding.Mesh(np.array(jax.devices()), ("data",)))
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.normal(size=(1001, 129)), jnp.float32) for i in range(6)}
    loss = lambda p, b: sum(jnp.mean((v - b["t"]) ** 2) for v in jax.tree.leaves(p))
    step = zj.make_train_step(loss, tx, policy)
    state, _ = step(zj.init_state(params, tx, policy), {"t": jnp.ones((8,))})
    zj.save(directory, state, step=1)
    np.savez(oracle, **{str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))})
    state, _ = step(state, {"t": jnp.zeros((8,))})

    def stall(message):
        print(message, flush=True)
        while True:
            time.sleep(1)

    if mode == "data":  # stop once a few arrays are written: the rest never is
        original, calls = serialization.async_serialize_from_host, [0]
        async def partway(*args, **kwargs):
            calls[0] += 1
            if calls[0] > 4:
                print("STALLED", flush=True)
                await asyncio.sleep(3600)
            return await original(*args, **kwargs)
        serialization.async_serialize_from_host = partway
    else:  # every file written; stop just before the commit (the rename)
        async def finalize(self):
            stall("STALLED")
        atomicity.AtomicRenameTemporaryPath.finalize = finalize
    zj.save(directory, state, step=2)
    print("FINISHED", flush=True)
    """
)


def _env() -> dict[str, str]:
    return child_env()


@pytest.mark.parametrize("mode", ["data", "commit"])
def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path, mode):
    script, directory, oracle = tmp_path / "save.py", tmp_path / "ckpt", tmp_path / "step1.npz"
    script.write_text(_KILLED_SAVE)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(directory), mode, str(oracle)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=_env(),
    )
    try:
        line = proc.stdout.readline().strip()  # blocks until the save of step 2 is part-way
        assert line == "STALLED", f"the saving process ended early: {line!r}"
        partial = zj.checkpoint.partial_saves(directory)
        assert partial and partial[0].startswith("2."), partial  # step 2 is being written ...
        os.kill(proc.pid, signal.SIGKILL)  # ... when the process dies
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert zj.checkpoint.steps(directory) == [1]  # the partial step is ignored
    policy = zj.ZeroPolicy(stage=3, mesh=make_mesh(8))
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    back = zj.restore(directory, policy=policy, tx=tx)
    with np.load(oracle) as want:
        for i, x in enumerate(jax.tree.leaves(back)):
            np.testing.assert_array_equal(np.asarray(x), want[str(i)], strict=True)  # bitwise
    zj.save(directory, back, step=3)  # the next save removes the partial one
    assert zj.checkpoint.steps(directory) == [1, 3] and not zj.checkpoint.partial_saves(directory)


# -- streamed export -----------------------------------------------------------------------------------

_EXPORT = textwrap.dedent(
    """
    import gc, json, sys, tracemalloc
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    import numpy as np, optax
    import zero_jax as zj
    from zero_jax.models import TransformerConfig, init_params

    def status(key):
        return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024

    cfg = TransformerConfig(vocab=256, dim=512, depth=8, heads=8, seq=64)
    policy = zj.ZeroPolicy(stage=3, mesh=jax.sharding.Mesh(np.array(jax.devices()), ("data",)), stacked="layers")
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = jax.block_until_ready(zj.init_state(lambda: init_params(cfg, jax.random.key(0)), tx, policy))
    path = sys.argv[1]
    gc.collect()
    base = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    tracemalloc.start()
    zj.export_params(path, state)
    host_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rss_peak = status("VmHWM") - base
    back = zj.load_params(path, policy, stored=True)
    pairs = list(zip(jax.tree.leaves(back), jax.tree.leaves(state.params)))
    equal = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
    same_layout = all(a.sharding == b.sharding for a, b in pairs)
    print(json.dumps({
        "rss_peak": rss_peak, "host_peak": host_peak, "equal": equal, "same_layout": same_layout,
        "largest_leaf": max(l.nbytes for l in state.layouts.layouts),
        "model_bytes": int(sum(np.prod(l.shape) * 4 for l in state.layouts.layouts)),
    }))
    """
)


@pytest.mark.slow  # > 3 s on 2 idle cores
def test_export_streams_with_bounded_host_memory(tmp_path):
    """Reference model (26M parameters, 103 MB fp32), stage 3 on 8 devices."""
    script = tmp_path / "export.py"
    script.write_text(_EXPORT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "model.safetensors")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    print("export MiB:", {k: round(v / 2**20, 2) for k, v in m.items() if not isinstance(v, bool)})
    assert m["equal"] and m["same_layout"]  # re-import equals the live parameters, in their layout
    bound = 2 * m["largest_leaf"] + 16 * 2**20
    assert m["rss_peak"] < bound < m["model_bytes"], m  # the whole model never sits in host memory at once
    assert m["host_peak"] < bound, m
    tensors = load_file(tmp_path / "model.safetensors")  # the safetensors library alone reads it
    assert tensors["layers.mlp_in"].shape == (8, 512, 2048) and len(tensors) == 15


@pytest.mark.parametrize("stage", [1, 3])
def test_export_equals_full_params_and_loads_partitioned(tmp_path, stage):
    cfg = TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=8)
    policy, tx = _setup(stage, 8, stacked="layers", precision=zj.Precision(compute_dtype=jnp.bfloat16))
    state = zj.init_state(init_params(cfg, jax.random.key(0)), tx, policy)
    file = zj.export_params(tmp_path / "m.safetensors", state)
    full = jax.tree_util.tree_flatten_with_path(zj.full_params(state))[0]
    tensors = load_file(file)
    assert sorted(tensors) == sorted(".".join(key_name(k) for k in p) for p, _ in full)
    for p, x in full:
        np.testing.assert_array_equal(tensors[".".join(key_name(k) for k in p)], np.asarray(x), strict=True)
    pol3, _ = _setup(3, 4, stacked="layers")
    back = zj.load_params(file, pol3, stored=True)
    fresh = zj.init_state(init_params(cfg, jax.random.key(0)), zj.shard_optimizer(optax.sgd(0.1), pol3), pol3)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(fresh.params), strict=True):
        assert a.shape == b.shape and a.sharding == b.sharding  # stage 3 pieces, padded for N = 4
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
    bf16 = zj.export_params(tmp_path / "h.safetensors", state, dtype=jnp.bfloat16)
    assert os.path.getsize(bf16) < os.path.getsize(file) * 0.55


# -- bad input --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("saved")
    policy, tx = _setup(3, 8)
    state = zj.init_state(mlp_params(), tx, policy)
    state, _ = zj.make_train_step(mlp_loss, tx, policy)(state, mlp_batch(16))
    zj.save(directory, state, step=3)
    zj.save(directory, state, step=5)
    return directory, policy, tx


def test_missing_empty_and_unknown_step(tmp_path, saved):
    directory, policy, tx = saved
    with pytest.raises(FileNotFoundError, match="no checkpoint directory .*nope"):
        zj.restore(tmp_path / "nope", policy=policy, tx=tx)
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        zj.restore(tmp_path, policy=policy, tx=tx)
    with pytest.raises(FileNotFoundError, match=r"checkpoint step 7 not found in .*; steps present: \[3, 5\]"):
        zj.restore(directory, policy=policy, tx=tx, step=7)
    assert int(zj.restore(directory, policy=policy, tx=tx).step) == 1  # the latest, step 5


def test_checkpoint_of_another_model_or_optimizer(saved):
    directory, policy, tx = saved
    other = dict(mlp_params(), w2=jnp.zeros((100, 7)))
    with pytest.raises(ValueError, match=r"another model: parameter 'w2' has shape \(100, 6\) .* but \(100, 7\)"):
        zj.restore(directory, policy=policy, tx=tx, like=other)
    with pytest.raises(ValueError, match="another model: it has no parameter 'extra'"):
        zj.restore(directory, policy=policy, tx=tx, like=dict(mlp_params(), extra=jnp.zeros(3)))
    with pytest.raises(ValueError, match="optimizer state has no leaf 'opt_state/0/trace/b1'"):
        zj.restore(directory, policy=policy, tx=zj.shard_optimizer(optax.sgd(0.1, momentum=0.9), policy))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _settle() -> None:
    """After a failed read orbax closes its event loop while tensorstore reads still
    finish; their callbacks then report "Event loop is closed" as unraisable
    exceptions (harmless noise of orbax's error path). Let them land in this test."""
    time.sleep(0.5)
    gc.collect()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_truncated_or_corrupted_files(tmp_path, saved):
    directory, policy, tx = saved
    files = lambda d: [f for f in (d / "5" / "state").rglob("*") if f.is_file() and f.parent.name == "d"]  # noqa: E731

    truncated = _copy(directory, tmp_path / "truncated")
    for f in files(truncated):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"step 5 in .* could not be read: .*truncated or corrupted.*\[3, 5\]"):
        zj.restore(truncated, policy=policy, tx=tx)
    _settle()
    assert int(zj.restore(truncated, policy=policy, tx=tx, step=3).step) == 1  # the other step is intact

    flipped = _copy(directory, tmp_path / "flipped")  # one bit in the array bytes: only a checksum sees it
    big = zj.ZeroPolicy(3, make_mesh(8))
    btx = zj.shard_optimizer(optax.sgd(0.1), big)
    state = zj.init_state({"w": jnp.asarray(np.random.default_rng(0).normal(size=(512, 512)), jnp.float32)}, btx, big)
    zj.save(flipped, state, step=9)
    data = max((f for f in (flipped / "9" / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="step 9 .* corrupted"):  # zstd's frame check or our checksums
        zj.restore(flipped, policy=big, tx=btx)
    _settle()

    tampered = _copy(directory, tmp_path / "tampered")  # data that no longer matches what was saved
    meta_file = tampered / "5" / "zero_jax" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["leaves"]["opt_state/0/mu/w1"]["checksum"][1] ^= 1
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(
        ValueError, match="step 5 .* is corrupted: leaf 'opt_state/0/mu/w1' does not match the checksum"
    ):
        zj.restore(tampered, policy=policy, tx=tx)

    broken = _copy(directory, tmp_path / "meta")
    (broken / "5" / "zero_jax" / "metadata").write_text('{"format": "zero_jax.chec')
    with pytest.raises(ValueError, match="metadata of checkpoint step 5 .* unreadable"):
        zj.restore(broken, policy=policy, tx=tx)


def test_bad_export_files(tmp_path):
    policy, _ = _setup(3, 8)
    with pytest.raises(FileNotFoundError, match="no file"):
        zj.load_params(tmp_path / "none.safetensors", policy)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    file = zj.export_params(tmp_path / "m.safetensors", zj.init_state(mlp_params(), tx, policy))
    raw = Path(file).read_bytes()
    Path(file).write_bytes(raw[: len(raw) - 100])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        zj.load_params(file, policy)
    Path(file).write_bytes(raw)
    with pytest.raises(ValueError, match=r"tensor 'w1' has shape \(12, 100\) .* but \(12, 99\)"):
        zj.load_params(file, policy, like=dict(mlp_params(), w1=jnp.zeros((12, 99))))


# -- several processes: each writes its own shards --------------------------------------------------------

_PROCESS = textwrap.dedent(
    """
    import sys
    import jax
    pid, port, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_platforms", "cpu")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np, optax, jax.numpy as jnp
    import zero_jax as zj
    from _models import mlp_batch, mlp_loss, mlp_params

    policy = zj.ZeroPolicy(3, jax.sharding.Mesh(np.array(jax.devices()), ("data",)), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adamw(3e-2), policy)
    host = jax.tree.map(np.asarray, mlp_params())
    state = zj.init_state(lambda: jax.tree.map(jnp.asarray, host), tx, policy)
    put = lambda v: jax.make_array_from_callback(v.shape, policy.batch_sharding(), lambda i: v[i])
    batch = jax.tree.map(put, jax.tree.map(np.asarray, mlp_batch(16)))
    state, metrics = zj.make_train_step(mlp_loss, tx, policy)(state, batch)
    zj.save(directory, state, step=1)
    zj.export_params(directory + ".safetensors", state)
    print("LOSS", float(metrics["loss"]), flush=True)
    """
)


@pytest.mark.slow  # > 3 s on 2 idle cores
def test_two_processes_save_their_shards_one_restores(tmp_path):
    script, directory = tmp_path / "proc.py", tmp_path / "ckpt"
    script.write_text(_PROCESS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env["PYTHONPATH"]])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(i), str(port), str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    losses = [float(line.split()[1]) for out in outs for line in out.splitlines() if line.startswith("LOSS")]
    assert len(losses) == 2 and losses[0] == losses[1]
    assert {p.name for p in (directory / "1" / "state").iterdir() if p.name.startswith("ocdbt.process_")} == {
        "ocdbt.process_0",
        "ocdbt.process_1",
    }  # each process wrote its own shards

    # One process, 8 devices: the same step, for comparison (gloo sums in another order).
    policy, tx = _setup(3, 8)
    state, metrics = zj.make_train_step(mlp_loss, tx, policy)(zj.init_state(mlp_params(), tx, policy), mlp_batch(16))
    np.testing.assert_allclose(losses[0], float(metrics["loss"]), rtol=1e-6)
    want = _logical(state)
    for n, stage in [(8, 3), (2, 1)]:
        pol, ttx = _setup(stage, n)
        got = _logical(zj.restore(directory, policy=pol, tx=ttx))  # checksums of both processes' shards verified
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-7, err_msg=name)
    exported = load_file(str(directory) + ".safetensors")
    for name, value in exported.items():
        np.testing.assert_array_equal(value, got["params/" + name], strict=True)  # the same multi-process state


# -- issue 13: relative paths, nothing on stderr, failed saves, another optimizer, donated states ---------------


def _printed_nothing(capfd, caplog) -> None:
    """Nothing reached stderr, and orbax logged no absl record (pytest's log capture would hide them from stderr)."""
    assert capfd.readouterr().err == ""
    assert [r.getMessage()[:200] for r in caplog.records if r.name == "absl"] == []


def test_relative_paths_resolve_against_the_current_directory(tmp_path, monkeypatch, capfd, caplog):
    policy, tx = _setup(3, 8)
    state = zj.init_state(mlp_params(), tx, policy)
    want = _logical(state)
    monkeypatch.chdir(tmp_path)
    zj.save("runs/a", state, step=1)
    mgr = zj.CheckpointManager("runs/b", max_to_keep=1)  # resolved now, where the caller is
    file = zj.export_params("m.safetensors", state)
    assert file == str(tmp_path / "m.safetensors")
    _assert_bitwise(_logical(zj.restore("runs/a", policy=policy, tx=tx)), want)
    monkeypatch.chdir(tmp_path / "runs")
    mgr.save(state, step=2)  # still into <tmp>/runs/b, not <tmp>/runs/runs/b
    mgr.close()
    assert zj.checkpoint.steps(tmp_path / "runs" / "b") == [2] and not (tmp_path / "runs" / "runs").exists()
    _assert_bitwise(_logical(zj.restore("b", policy=policy, tx=tx)), want)
    loaded = zj.load_params("../m.safetensors", policy, stored=True)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
    _printed_nothing(capfd, caplog)  # no absl records from orbax


def test_failed_save_leaves_nothing_and_prints_nothing(tmp_path, monkeypatch, capfd, caplog):
    from orbax.checkpoint._src.serialization import serialization

    policy, tx = _setup(3, 8)
    state = zj.init_state(mlp_params(), tx, policy)
    directory = tmp_path / "ckpt"
    zj.save(directory, state, step=1)

    async def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
    held = r"could not be written to .*No space left on device.*holds the steps it held before \({}\)"
    with pytest.raises(OSError, match="zj.save: checkpoint step 2 " + held.format(r"\[1\]")):
        zj.save(directory, state, step=2)
    with zj.CheckpointManager(directory, async_save=True) as mgr:  # a background failure surfaces at wait()
        mgr.save(state, step=3)
        with pytest.raises(OSError, match="CheckpointManager.wait: checkpoint step 3 " + held.format(r"\[1\]")):
            mgr.wait()
    with pytest.raises(OSError, match="step 1 " + held.format(r"\[\]")):
        zj.save(tmp_path / "new" / "run", state, step=1)
    monkeypatch.undo()
    assert not (tmp_path / "new").exists()  # the directories the failed save created are gone
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match=r"zj.save: checkpoint step 1 could not be written to .*a_file/run \("):
        zj.save(tmp_path / "a_file" / "run", state, step=1)  # a directory that cannot be made
    assert sorted(p.name for p in directory.iterdir()) == ["1"] and zj.checkpoint.partial_saves(directory) == []
    _assert_bitwise(_logical(zj.restore(directory, policy=policy, tx=tx)), _logical(state))
    zj.save(directory, state, step=2)  # the step that failed saves now
    assert zj.checkpoint.steps(directory) == [1, 2]
    _printed_nothing(capfd, caplog)  # neither orbax's absl tracebacks nor its closed-event-loop noise


def test_restore_with_another_optimizer_raises_unless_reinit(tmp_path, capfd, caplog):
    policy, tx = _setup(3, 8)  # adamw
    state, _ = _run(zj.init_state(mlp_params(), tx, policy), zj.make_train_step(mlp_loss, tx, policy), [mlp_batch(16)])
    zj.save(tmp_path, state, step=1)
    saved = _logical(state)

    pol, sgd = _setup(2, 4, optax.sgd(0.1))  # no optimizer state at all: Adam's would be dropped silently
    with pytest.raises(ValueError, match=r"optimizer state has leaf 'opt_state/0/count' \(\(\) int32\) that tx's") as e:
        zj.restore(tmp_path, policy=pol, tx=sgd)
    assert "All 11 differing optimizer-state leaves" in str(e.value) and "'opt_state/0/nu/w2'" in str(e.value)
    assert 'optimizer_state="reinit"' in str(e.value)
    with pytest.raises(ValueError, match="optimizer_state must be 'restore' .* or 'reinit'"):
        zj.restore(tmp_path, policy=pol, tx=sgd, optimizer_state="fresh")

    pol, momentum = _setup(2, 4, optax.sgd(0.1, momentum=0.9))
    back = zj.restore(tmp_path, policy=pol, tx=momentum, optimizer_state="reinit")
    fresh = zj.init_state(zj.full_params(state), momentum, pol)  # tx's initial state for those parameters
    got = _logical(back)
    assert sorted(n for n in got if n.startswith("opt_state/")) == [
        f"opt_state/0/trace/{k}" for k in sorted(mlp_params())
    ]
    _assert_bitwise(
        {n: v for n, v in got.items() if n != "step"}, {n: v for n, v in _logical(fresh).items() if n != "step"}
    )
    assert int(back.step) == int(saved["step"]) == 1
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(fresh), strict=True):  # in the target layout
        assert a.shape == b.shape and a.sharding.is_equivalent_to(b.sharding, a.ndim)
    step = zj.make_train_step(mlp_loss, momentum, pol)
    _, losses = _run(back, step, [mlp_batch(16, seed=s) for s in range(2)])
    _, expected = _run(fresh, step, [mlp_batch(16, seed=s) for s in range(2)])
    assert losses == expected
    _printed_nothing(capfd, caplog)


def test_save_and_export_refuse_a_donated_state(tmp_path):
    policy, tx = _setup(3, 8)
    state = zj.init_state(mlp_params(), tx, policy)
    new, _ = zj.make_train_step(mlp_loss, tx, policy)(state, mlp_batch(16))  # consumes `state`
    assert state.params["w1"].is_deleted()
    donated = r"donated to an earlier train step .*keep the state it returns"
    with pytest.raises(ValueError, match="zj.save: .*" + donated):
        zj.save(tmp_path / "a", state, step=0)
    with zj.CheckpointManager(tmp_path / "b") as mgr, pytest.raises(ValueError, match=donated):
        mgr.save(state, step=0)
    with pytest.raises(ValueError, match="zj.export_params: .*" + donated):
        zj.export_params(tmp_path / "m.safetensors", state)
    assert list(tmp_path.iterdir()) == []  # nothing was written
    zj.save(tmp_path / "a", new, step=1)  # the state the step returned is live
    assert zj.checkpoint.steps(tmp_path / "a") == [1]


def test_bad_input_prints_nothing(tmp_path, saved, capfd, caplog):
    directory, policy, tx = saved
    truncated = _copy(directory, tmp_path / "truncated")
    for f in (truncated / "5" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    cases = [
        lambda: zj.restore(tmp_path / "nope", policy=policy, tx=tx),
        lambda: zj.restore(directory, policy=policy, tx=tx, step=7),
        lambda: zj.restore(directory, policy=policy, tx=tx, like=dict(mlp_params(), extra=jnp.zeros(3))),
        lambda: zj.restore(directory, policy=policy, tx=zj.shard_optimizer(optax.sgd(0.1), policy)),
        lambda: zj.restore(truncated, policy=policy, tx=tx),
    ]
    for case in cases:
        with pytest.raises((FileNotFoundError, ValueError)):
            case()
    gc.collect()
    _printed_nothing(capfd, caplog)


# -- issue 43: a corrupt latest step, and a mesh with other axis names and types ----------------------------------


@pytest.mark.slow  # eight restores, five of them of corrupt steps (about 5 s on 2 cores)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's failed-read noise
def test_a_corrupt_latest_step_says_so_and_falls_back_when_asked(tmp_path):
    # Base commit: restore had no fallback (TypeError); a corrupt step was a plain ValueError.
    policy, tx = _setup(3, 8, optax.adam(1e-2))
    step = zj.make_train_step(mlp_loss, tx, policy)
    state, want = zj.init_state(mlp_params(), tx, policy), {}
    for s in (1, 2, 3):
        state, _ = step(state, mlp_batch(16, seed=s))
        zj.save(tmp_path, state, step=s)
        want[s] = _logical(state)
    for f in (tmp_path / "3" / "state").rglob("*"):  # step 3's array files, truncated
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(zj.checkpoint.CorruptCheckpointError, match=r"step 3 .* could not be read.*fallback=True"):
        zj.restore(tmp_path, policy=policy, tx=tx)
    with pytest.warns(UserWarning, match=r"restored checkpoint step 2 .* corrupt: step 3 \(zj.restore: checkpoint"):
        back = zj.restore(tmp_path, policy=policy, tx=tx, fallback=True)
    _assert_bitwise(_logical(back), want[2])

    (tmp_path / "2" / "zero_jax" / "metadata").write_text('{"format": "zero_')  # step 2's record, cut short
    with zj.CheckpointManager(tmp_path) as mgr, pytest.warns(UserWarning, match=r"step 1 .* step 3 \(.*; step 2 \("):
        back = mgr.restore(policy=policy, tx=tx, fallback=True)
    _assert_bitwise(_logical(back), want[1])
    with pytest.raises(ValueError, match="another model: parameter 'w2'"):  # not corruption: no fallback
        zj.restore(tmp_path, policy=policy, tx=tx, fallback=True, like=dict(mlp_params(), w2=jnp.zeros((100, 7))))

    meta_file = tmp_path / "1" / "zero_jax" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["leaves"]["params/w1"]["checksum"][0] ^= 1  # step 1 no longer matches what was saved
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(zj.checkpoint.CorruptCheckpointError, match=r"every checkpoint step .* is corrupt: step 3 "):
        zj.restore(tmp_path, policy=policy, tx=tx, fallback=True)
    _settle()  # let orbax's failed reads finish inside this test


def test_restore_onto_a_mesh_with_other_axis_names_and_types(tmp_path):
    policy, tx = _setup(3, 8)
    state, _ = zj.make_train_step(mlp_loss, tx, policy)(zj.init_state(mlp_params(), tx, policy), mlp_batch(16))
    zj.save(tmp_path, state, step=1)  # an Auto mesh, axis "data"
    devices = np.asarray(jax.devices()[:4]).reshape(2, 2)
    explicit = jax.sharding.AxisType.Explicit
    other = jax.sharding.Mesh(devices, ("rows", "cols"), axis_types=(explicit, explicit))
    target = zj.ZeroPolicy(2, other, ("rows", "cols"), min_shard_size=0)  # other names, types, N and stage
    back = zj.restore(tmp_path, policy=target, tx=zj.shard_optimizer(optax.adamw(3e-2), target))
    assert back.params["w1"].sharding.mesh.axis_names == ("rows", "cols")
    _assert_bitwise(_logical(back), _logical(state))
