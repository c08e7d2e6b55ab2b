"""Small models and the unsharded reference the tests compare against."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zero_jax as zj


def make_mesh(n: int, names: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
    """A mesh over the first ``n`` of the 8 simulated devices."""
    devices = np.asarray(jax.devices()[:n]).reshape(shape or (n,))
    return jax.sharding.Mesh(devices, names)


IN, HIDDEN, OUT = 12, 100, 6  # 100 and 6 do not divide 8: exercises padding


def mlp_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(HIDDEN,)) * 0.1, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN), jnp.float32),
        "b2": jnp.zeros((OUT,), jnp.float32),  # below min_shard_size: stays whole
        "scale": jnp.ones((), jnp.float32),
    }


def mlp_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    pred = (h @ params["w2"] + params["b2"]) * params["scale"]
    return jnp.mean((pred - batch["y"]) ** 2)


def mlp_batch(n: int = 16, seed: int = 1) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(n, IN)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n, OUT)), jnp.float32),
    }


def reference_run(
    tx: optax.GradientTransformation, params: Any, batches: list[Any], loss_fn=mlp_loss
) -> tuple[Any, list[float]]:
    """Plain optax on one device: the numbers every stage must reproduce."""
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses


def relative_update_error(final: Any, reference: Any, start: Any) -> dict[str, float]:
    """Per leaf: |final - reference| / |reference - start| (relative L2 of the update)."""
    out = {}
    for (path, f), r, s in zip(
        jax.tree_util.tree_flatten_with_path(final)[0], jax.tree.leaves(reference), jax.tree.leaves(start), strict=True
    ):
        denom = float(jnp.linalg.norm((r - s).ravel()))
        out[jax.tree_util.keystr(path)] = float(jnp.linalg.norm((f - r).ravel())) / max(denom, 1e-30)
    return out


@contextlib.contextmanager
def working_directory(path: Any) -> Iterator[None]:
    """``contextlib.chdir`` for Python 3.10 too: run the body in ``path``, then come back."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_as_main(package: str, argv: Sequence[str]) -> None:
    """``python -m package ARGV`` in this process; a ``SystemExit`` comes out as the command raises it.

    The package's ``__main__`` runs afresh even if a test imported it before (runpy would warn)."""
    main = f"{package}.__main__"
    saved_argv, saved_main = sys.argv, sys.modules.pop(main, None)
    sys.argv = [f"python -m {package}", *argv]
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules[main] = saved_main


def train_adapted(adapted: Any, stage: int, batches: list[Any], *, precision: Any = None, **step_kw: Any):
    """Train an adapted model with Adam on 8 devices (min_shard_size 0): (state, step, losses)."""
    policy = adapted.policy(stage, make_mesh(8), min_shard_size=0, precision=precision)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = adapted.init_state(tx, policy)
    step = adapted.make_train_step(tx, policy, **step_kw)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state, step, losses


def compile_adapted(adapted: Any, batch: Any, **step_kw: Any) -> Any:
    """An adapted model's stage-3 step (Adam, 8 devices, min_shard_size 0), compiled."""
    policy = adapted.policy(3, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    return adapted.make_train_step(tx, policy, **step_kw).lower(adapted.init_state(tx, policy), batch).compile()
