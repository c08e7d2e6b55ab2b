"""Every stage x many optax transformations (N = 8; stage 3 also on N = 1 and 2): the sharded step
reproduces plain, unsharded optax on the same global batch.

Tolerance: float32, relative L2 error of each leaf's accumulated update
(p_final - p0) <= 1e-5 (reduction order alone moves it ~1e-7 here).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error

import zero_jax as zj

FP32_RTOL = 1e-5
STEPS = 5


def _labels(params):
    return {k: ("adam" if k.startswith("w") else "sgd") for k in params}


OPTIMIZERS = {
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "inject_schedule": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 5), weight_decay=0.01
    ),
    "masked_decay": lambda: optax.chain(
        optax.masked(optax.add_decayed_weights(0.1), lambda p: {k: v.ndim == 2 for k, v in p.items()}),
        optax.adam(1e-2),
    ),
    "multi_transform": lambda: optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.05)}, _labels),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "lamb": lambda: optax.lamb(1e-2),
    "lion": lambda: optax.lion(1e-3),
}


@functools.cache
def _reference(name: str):
    batches = [mlp_batch(seed=s) for s in range(STEPS)]
    params, losses = reference_run(OPTIMIZERS[name](), mlp_params(), batches)
    return params, losses


# Every optimizer in every stage on 8 devices (padding: 100 and 6 do not divide 8), and on 1 and 2 devices
# in stage 3, which partitions all three (the other stages' small meshes take no other code path).
CASES = [(stage, 8) for stage in range(4)] + [(3, 1), (3, 2)]


@pytest.mark.parametrize(("stage", "n"), CASES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_unsharded_optax(name: str, stage: int, n: int) -> None:
    ref_params, ref_losses = _reference(name)
    policy = zj.ZeroPolicy(stage=stage, mesh=make_mesh(n), min_shard_size=64)
    tx = zj.shard_optimizer(OPTIMIZERS[name](), policy)
    start = mlp_params()
    state = zj.init_state(start, tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    losses = []
    for s in range(STEPS):
        state, metrics = step(state, mlp_batch(seed=s))
        losses.append(float(metrics["loss"]))
    errors = relative_update_error(zj.full_params(state), ref_params, start)
    assert max(errors.values()) <= FP32_RTOL, errors
    assert jnp.allclose(jnp.asarray(losses), jnp.asarray(ref_losses), rtol=1e-5, atol=0)
    assert int(state.step) == STEPS
    assert step.jitted._cache_size() == 1, "the step recompiled after its first call"
