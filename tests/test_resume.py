"""Bitwise resume, a tested promise (issue 43 item 5): for every stage, both gather modes, with gradient
accumulation, mixed precision (bfloat16 and float16 compute over a float32 master, float16 with a loss scale;
pure bfloat16), int8 wires and offload, training 2k steps straight gives bitwise the parameters and optimizer
state of k steps + save + restore in a NEW process + k steps.

Two fresh processes run the whole matrix (zj.launch, one process with 8 simulated devices each): the first
trains every case 2k steps straight and, afresh, k steps and saves; the second restores each case and trains
k more. Same program, same compile flags (conftest.py's), so any difference is the checkpoint's.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_batch, mlp_params

import zero_jax as zj

K, BATCH = 2, 16
BF16 = {"compute_dtype": "bfloat16"}  # ZeRO's mixed precision: bf16 compute copy, float32 master copy
PURE_BF16 = {"param_dtype": "bfloat16"}  # no master copy: parameters and optimizer state in bf16
FP16 = {"compute_dtype": "float16", "loss_scale": True}  # a float32 master and a dynamic loss scale
# (name, stage, gather, policy options, step options, precision): each stage in both gather modes; accumulation,
# bfloat16 and float16 compute over a float32 master (with a loss scale for float16), pure bfloat16, int8 weights /
# gradients and offload (optimizer state and master, stage-3 parameters) spread over them.
INT8_GRADS = {"quantize_grads": "int8", "quant_block": 32}
INT8_BOTH = {"quantize_weights": "int8", **INT8_GRADS}
ACCUM = {"accum_steps": 2}
CASES = [
    ("s0-all", 0, "all", {}, {}, None),
    ("s0-manual-accum-bf16", 0, "manual", {}, ACCUM, BF16),
    ("s1-all-int8grads-accum", 1, "all", INT8_GRADS, ACCUM, None),
    ("s1-manual-fp16", 1, "manual", {}, {}, FP16),
    ("s2-all-offload-bf16", 2, "all", {"offload_optimizer": True}, {}, BF16),
    ("s2-manual-int8grads-accum", 2, "manual", INT8_GRADS, {**ACCUM, "accum_mode": "partitioned"}, None),
    ("s3-all-int8-offload-accum", 3, "all", {**INT8_BOTH, "offload_params": True}, ACCUM, None),
    ("s3-manual-int8-purebf16-offload-accum", 3, "manual", {**INT8_BOTH, "offload_optimizer": True}, ACCUM, PURE_BF16),
]


def _params() -> dict:
    """Two leaves of the tests' MLP, (12, 100) and (100, 6): 100 and 6 do not divide 8 (padding); two leaves
    compile in 0.6x the time of its five (the matrix is mostly compile time)."""
    return {k: v for k, v in mlp_params().items() if k in ("w1", "w2")}


def _loss(params: dict, batch: dict):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def _case(name: str):
    """(policy, tx, train step) of one case, on this process's 8 devices."""
    _, stage, gather, options, step_options, precision = next(c for c in CASES if c[0] == name)
    prec = None
    if precision is not None:
        scale = zj.DynamicLossScale(initial=2.0**10, growth_interval=2) if precision.get("loss_scale") else None
        dtypes = {k: jnp.dtype(v) for k, v in precision.items() if k != "loss_scale"}
        prec = zj.Precision(loss_scale=scale, **dtypes)
    policy = zj.ZeroPolicy(stage, jax.make_mesh((8,), ("data",)), min_shard_size=0, precision=prec, **options)
    tx = zj.shard_optimizer(optax.adamw(3e-2), policy)
    if gather == "manual":  # the loss gathers what it uses itself (the identity below stage 3)
        loss = lambda params, batch: _loss(zj.gather(params, policy), batch)  # noqa: E731
    else:
        loss = _loss
    return policy, tx, zj.make_train_step(loss, tx, policy, gather=gather, **step_options)


def _batch(i: int) -> dict:
    return mlp_batch(BATCH, seed=100 + i)


def _host(state: zj.TrainState) -> dict[str, np.ndarray]:
    """Every array of the state (parameters, optimizer state, master copy, loss scale, step) on the host."""
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


def straight_and_first_half(directory: str) -> dict[str, dict[str, np.ndarray]]:
    """First process: every case 2k steps straight (returned), and afresh k steps, saved (runs in zj.launch)."""
    out = {}
    for name, *_ in CASES:
        policy, tx, step = _case(name)
        state = zj.init_state(_params(), tx, policy)
        for i in range(2 * K):
            state, _ = step(state, _batch(i))
        out[name] = _host(state)
        state = zj.init_state(_params(), tx, policy)
        for i in range(K):
            state, _ = step(state, _batch(i))
        zj.save(os.path.join(directory, name), state)
        out[name + "@k"] = _host(state)
    return out


def second_half(directory: str) -> dict[str, dict[str, np.ndarray]]:
    """Second process: every case restored and trained k more steps (runs in zj.launch)."""
    out = {}
    for name, *_ in CASES:
        policy, tx, step = _case(name)
        state = zj.restore(os.path.join(directory, name), policy=policy, tx=tx)
        for i in range(K, 2 * K):
            state, _ = step(state, _batch(i))
        out[name] = _host(state)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    directory = str(tmp_path_factory.mktemp("resume"))
    # conftest.py's compile flags, and one compilation cache: the second process loads the programs the first
    # compiled (the same executables, and half the test's time); a state restored in another layout would miss it.
    cache = str(tmp_path_factory.mktemp("compiled"))
    fast = {
        "XLA_FLAGS": os.environ["ZERO_JAX_TEST_XLA_FLAGS"],
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    (straight,) = zj.launch(straight_and_first_half, directory, processes=1, local_devices=8, env=fast, timeout_s=300)
    (resumed,) = zj.launch(second_half, directory, processes=1, local_devices=8, env=fast, timeout_s=300)
    assert os.listdir(cache), "the first process cached no program"
    return straight, resumed


@pytest.mark.slow  # two fresh processes train 8 cases (about 20 s on 2 cores)
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_resume_in_a_new_process_is_bitwise(runs, name: str) -> None:
    straight, resumed = runs
    want, got = straight[name], resumed[name]
    assert sorted(got) == sorted(want)
    assert any("opt_state" in k for k in want) and any(".params" in k for k in want)
    precision = next(c[5] for c in CASES if c[0] == name) or {}
    assert any(k.startswith(".master") for k in want) == ("compute_dtype" in precision)  # the master copy too
    assert any(k.startswith(".loss_scale") for k in want) == bool(precision.get("loss_scale"))
    assert int(got[".step"]) == 2 * K
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{name} {key}", strict=True)  # bitwise
    halfway = straight[name + "@k"]  # the first process's state after k steps, as saved
    moved = [k for k in want if "params" in k and not np.array_equal(halfway[k], want[k])]
    assert moved, "the last k steps changed no parameter"  # so the comparison is of trained values
