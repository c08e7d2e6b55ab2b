"""Explicit meshes and ``jax.set_mesh`` (issue 43): every public entry point on a mesh made with
``AxisType.Explicit`` axes (``jax.make_mesh``'s default), with and without ``with jax.set_mesh(mesh):``,
gives the numbers of the same policy on an Auto mesh (bitwise: the step runs on the policy's Auto mesh
either way) and of plain optax (relative L2 of the accumulated update per leaf below ``TOL``), and a
checkpoint saved under one kind of mesh and context restores under the other. ``zj.launch`` there (2 processes,
each passing its half of the batch to ``zj.shard_batch``) is exercised by
``tests/test_preemption.py::test_several_processes_fall_back_to_the_same_step``, which shares its one pair of
processes with the restore agreement.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_batch, mlp_loss, mlp_params, reference_run, relative_update_error
from jax.sharding import AxisType, Mesh

import zero_jax as zj

TOL = 1e-5  # relative L2 of the accumulated update against plain optax (float32, 3 Adam steps)
STEPS = 3
ADAM = optax.adam(1e-2)


@functools.cache
def mesh(kind: str) -> Mesh:
    """The 8 devices as one data axis, Auto or Explicit (``jax.make_mesh``'s default on new jax)."""
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit if kind == "explicit" else AxisType.Auto,))


@contextlib.contextmanager
def context(name: str, kind: str) -> Iterator[None]:
    """``"none"``: no mesh in context; ``"set_mesh"``: ``jax.set_mesh`` of the policy's own mesh;
    ``"set_other"``: ``jax.set_mesh`` of the same devices with the other axis type."""
    if name == "none":
        yield
        return
    other = {"auto": "explicit", "explicit": "auto"}[kind]
    with jax.set_mesh(mesh(kind if name == "set_mesh" else other)):
        yield


def batches() -> list[dict[str, jax.Array]]:
    return [mlp_batch(16, seed=s) for s in range(1, STEPS + 1)]


def manual_mlp_loss(policy: zj.ZeroPolicy) -> Callable[..., jax.Array]:
    return lambda p, b: mlp_loss(zj.gather(p, policy), b)


def train(kind: str, ctx: str, stage: int, gather: str) -> tuple[dict[str, np.ndarray], list[float]]:
    """``STEPS`` steps of the MLP from ``init_state`` to ``full_params``, every call inside ``ctx``."""
    with context(ctx, kind):
        policy = zj.ZeroPolicy(stage, mesh(kind), min_shard_size=64)
        tx = zj.shard_optimizer(ADAM, policy)
        state = zj.init_state(mlp_params(), tx, policy)
        loss = mlp_loss if gather == "all" else manual_mlp_loss(policy)
        step = zj.make_train_step(loss, tx, policy, gather=gather)
        losses = []
        for b in batches():
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        return jax.tree.map(np.asarray, zj.full_params(state)), losses


@functools.cache
def auto_run(stage: int, gather: str) -> tuple[dict[str, np.ndarray], list[float]]:
    return train("auto", "none", stage, gather)


@functools.cache
def optax_run() -> tuple[Any, list[float]]:
    return reference_run(ADAM, mlp_params(), batches())


def assert_parity(got: tuple[Any, list[float]], want: tuple[Any, list[float]]) -> None:
    """Bitwise the Auto mesh's run, and within ``TOL`` of plain optax."""
    jax.tree.map(np.testing.assert_array_equal, got[0], want[0])
    assert got[1] == want[1]
    ref, ref_losses = optax_run()
    errors = relative_update_error(got[0], ref, mlp_params())
    assert max(errors.values()) < TOL, errors
    np.testing.assert_allclose(got[1], ref_losses, rtol=1e-5)


# --- the step, stages 0-3, both gather modes --------------------------------------------------------------


@pytest.mark.parametrize("gather", ["all", "manual"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("kind", "ctx"), [("explicit", "set_mesh"), ("explicit", "none"), ("auto", "set_other")])
def test_step_on_explicit_mesh_matches_auto_mesh_and_optax(kind: str, ctx: str, stage: int, gather: str) -> None:
    assert_parity(train(kind, ctx, stage, gather), auto_run(stage, gather))


# --- the manual primitives: gather, apply_layer(s), scan_layers -------------------------------------------

DEPTH, WIDTH = 3, 16


def layered_params() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    w = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-2]), jnp.float32)  # noqa: E731
    return {
        "inp": w(12, WIDTH),
        "blocks": [{"w": w(WIDTH, WIDTH), "b": jnp.full((WIDTH,), 0.1)} for _ in range(2)],
        "stack": {"w": w(DEPTH, WIDTH, WIDTH), "b": jnp.zeros((DEPTH, WIDTH))},
        "out": w(WIDTH, 6),
    }


def layered_loss(policy: zj.ZeroPolicy | None) -> Callable[..., jax.Array]:
    def block(p: dict[str, jax.Array], h: jax.Array) -> jax.Array:
        return jnp.tanh(h @ p["w"] + p["b"])

    def loss(p: dict[str, Any], b: dict[str, jax.Array]) -> jax.Array:
        h = b["x"] @ zj.gather(p["inp"], policy)
        h = zj.apply_layer(block, p["blocks"][0], h, policy=policy)
        h = zj.apply_layers(block, p["blocks"][1:], h, policy)
        h = zj.scan_layers(block, p["stack"], h, policy)
        return jnp.mean((h @ zj.gather(p["out"], policy) - b["y"]) ** 2)

    return loss


def train_layered(kind: str, ctx: str, stage: int) -> tuple[Any, list[float]]:
    with context(ctx, kind):
        policy = zj.ZeroPolicy(stage, mesh(kind), stacked="stack", min_shard_size=0)
        tx = zj.shard_optimizer(ADAM, policy)
        state = zj.init_state(layered_params(), tx, policy)
        step = zj.make_train_step(layered_loss(policy), tx, policy, gather="manual")
        losses = []
        for b in batches():
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        return jax.tree.map(np.asarray, zj.full_params(state)), losses


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize(("kind", "ctx"), [("explicit", "set_mesh"), ("auto", "set_other")])
def test_manual_primitives_on_explicit_mesh(kind: str, ctx: str, stage: int) -> None:
    got, got_losses = train_layered(kind, ctx, stage)
    want, want_losses = train_layered("auto", "none", stage)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert got_losses == want_losses
    ref, ref_losses = reference_run(ADAM, layered_params(), batches(), layered_loss(None))
    errors = relative_update_error(got, ref, layered_params())
    assert max(errors.values()) < TOL, errors
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 3])
def test_shard_batch_under_set_mesh_of_an_explicit_mesh(stage: int) -> None:
    """``zj.shard_batch`` of host (NumPy) batches inside ``jax.set_mesh`` of the policy's Explicit mesh: each
    batch lands as the policy's batch sharding, holds the host rows, and the step trains on it to the
    numbers of the Auto mesh's run (bitwise) and of plain optax."""
    with jax.set_mesh(mesh("explicit")):
        policy = zj.ZeroPolicy(stage, mesh("explicit"), min_shard_size=64)
        tx = zj.shard_optimizer(ADAM, policy)
        state = zj.init_state(mlp_params(), tx, policy)
        step = zj.make_train_step(mlp_loss, tx, policy)
        losses = []
        for b in batches():
            host = jax.tree.map(np.asarray, b)
            batch = zj.shard_batch(host, policy)
            for leaf, want in zip(jax.tree.leaves(batch), jax.tree.leaves(host), strict=True):
                assert leaf.sharding == policy.batch_sharding()  # split over the batch axis, 2 rows per device
                assert [s.data.shape[0] for s in leaf.addressable_shards] == [2] * 8
                np.testing.assert_array_equal(np.asarray(leaf), want, strict=True)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        got = jax.tree.map(np.asarray, zj.full_params(state))
    assert_parity((got, losses), auto_run(stage, "all"))


def test_sharded_optimizer_inside_a_users_jit_under_set_mesh() -> None:
    """``tx.init`` / ``tx.update`` traced by the user's own ``jax.jit`` inside ``jax.set_mesh`` of an
    Explicit mesh (where ``jax.set_mesh`` itself is refused): the numbers of plain optax."""
    policy = zj.ZeroPolicy(2, mesh("explicit"), min_shard_size=64)
    tx = zj.shard_optimizer(ADAM, policy)
    rng = np.random.default_rng(5)  # dimensions that divide by 8: jit's outputs here are the logical (unpadded) arrays
    params = {"w": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32), "b": jnp.zeros((64,))}
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    with jax.set_mesh(mesh("explicit")):
        opt_state = jax.jit(tx.init)(params)
        updates, _ = jax.jit(tx.update)(grads, opt_state, params)
    want, _ = ADAM.update(grads, ADAM.init(params), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9), updates, want)


# --- checkpoints: saved under one kind of mesh and context, restored under the other ----------------------

SIDES = [("auto", "none"), ("explicit", "set_mesh"), ("explicit", "none"), ("auto", "set_other")]


def started(kind: str, ctx: str, stage: int) -> tuple[zj.TrainState, zj.TrainStep]:
    """A state after one step (the optimizer state is not zeros) and the step that made it."""
    with context(ctx, kind):
        policy = zj.ZeroPolicy(stage, mesh(kind), min_shard_size=64)
        tx = zj.shard_optimizer(ADAM, policy)
        step = zj.make_train_step(mlp_loss, tx, policy, donate=False)
        state, _ = step(zj.init_state(mlp_params(), tx, policy), batches()[0])
        return state, step


def leaves(state: zj.TrainState) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((state.step, state.params, state.opt_state))]


SLOW = pytest.mark.slow


@pytest.mark.parametrize(("save_side", "restore_side", "stage"), [
    pytest.param(SIDES[0], SIDES[1], 3, marks=SLOW), pytest.param(SIDES[1], SIDES[0], 1, marks=SLOW),
    pytest.param(SIDES[2], SIDES[1], 2, marks=SLOW), (SIDES[1], SIDES[3], 3),
])  # fmt: skip
def test_checkpoint_saved_under_one_restores_under_the_other(
    tmp_path: Any, save_side: tuple[str, str], restore_side: tuple[str, str], stage: int
) -> None:
    state, _ = started(*save_side, stage)
    with context(save_side[1], save_side[0]):
        zj.save(tmp_path / "ckpt", state)
    kind, ctx = restore_side
    with context(ctx, kind):
        policy = zj.ZeroPolicy(stage, mesh(kind), min_shard_size=64)
        tx = zj.shard_optimizer(ADAM, policy)
        restored = zj.restore(tmp_path / "ckpt", policy=policy, tx=tx)
        for a, b in zip(leaves(restored), leaves(state), strict=True):
            np.testing.assert_array_equal(a, b)
        # And it trains on: the next step equals the saving side's next step, bitwise.
        step = zj.make_train_step(mlp_loss, tx, policy, donate=False)
        got, _ = step(restored, batches()[1])
    want, _ = started(*save_side, stage)[1](state, batches()[1])
    for a, b in zip(leaves(got), leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_manager_and_safetensors_under_set_mesh(tmp_path: Any) -> None:
    state, _ = started("auto", "none", 3)
    with jax.set_mesh(mesh("explicit")):
        policy = zj.ZeroPolicy(3, mesh("explicit"), min_shard_size=64)
        tx = zj.shard_optimizer(ADAM, policy)
        with zj.CheckpointManager(tmp_path / "mgr") as mgr:
            mgr.save(state, step=1)
            restored = mgr.restore(policy=policy, tx=tx)
        path = zj.export_params(tmp_path / "params.safetensors", restored)
        params = zj.load_params(path, policy)
        again = zj.init_state(params, tx, policy)
    for a, b in zip(leaves(restored), leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    want = {k: np.asarray(v) for k, v in zj.full_params(state).items()}
    jax.tree.map(np.testing.assert_array_equal, {k: np.asarray(v) for k, v in params.items()}, want)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, zj.full_params(again)), want)


# --- audit and plan ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_audit_and_plan_under_set_mesh_of_an_explicit_mesh(stage: int) -> None:
    def report(ctx: str) -> tuple[Any, ...]:
        kind = "explicit" if ctx == "set_mesh" else "auto"
        with context(ctx, kind):
            policy = zj.ZeroPolicy(stage, mesh(kind), min_shard_size=64)
            tx = zj.shard_optimizer(ADAM, policy)
            state = zj.init_state(mlp_params(), tx, policy)
            step = zj.make_train_step(mlp_loss, tx, policy)
            r = zj.audit(step, state, mlp_batch(16), min_shard_size=64).check()
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_batch(16))
            p = zj.plan(step, abstract, batch)
        colls = lambda rep: sorted((c.kind, c.shape, c.trips) for c in rep.collectives)  # noqa: E731
        return colls(r), r.state_bytes, colls(p.reports[0]), p.reports[0].state_bytes

    assert report("set_mesh") == report("none")


# --- the adapters: a model built under jax.set_mesh of an Explicit mesh, gathered block by block ------------


def adapted_model(library: str) -> Any:
    """An unscanned model of two blocks in each library, adapted with ``layers="auto"``."""
    if library == "linen":
        from flax import linen as nn  # noqa: PLC0415

        class LBlock(nn.Module):
            @nn.compact
            def __call__(self, x: jax.Array) -> jax.Array:
                return jnp.tanh(nn.Dense(WIDTH)(x))

        class LNet(nn.Module):
            @nn.compact
            def __call__(self, x: jax.Array) -> jax.Array:
                h = nn.Dense(WIDTH)(x)
                for _ in range(2):
                    h = LBlock()(h)
                return nn.Dense(6)(h)

        net = LNet()
        variables = net.init(jax.random.key(0), jnp.ones((1, 12)))
        loss = lambda v, b: jnp.mean((net.apply(v, b["x"]) - b["y"]) ** 2)  # noqa: E731
        return zj.adapters.from_linen(net, variables, loss, layers="auto")
    if library == "nnx":
        from flax import nnx  # noqa: PLC0415

        class NBlock(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

            def __call__(self, x: jax.Array) -> jax.Array:
                return jnp.tanh(self.lin(x))

        class NNet(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.inp = nnx.Linear(12, WIDTH, rngs=rngs)
                self.blocks = nnx.List([NBlock(rngs) for _ in range(2)])
                self.out = nnx.Linear(WIDTH, 6, rngs=rngs)

            def __call__(self, x: jax.Array) -> jax.Array:
                h = self.inp(x)
                for block in self.blocks:
                    h = block(h)
                return self.out(h)

        loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
        return zj.adapters.from_nnx(NNet(nnx.Rngs(0)), loss, layers="auto")
    import equinox as eqx  # noqa: PLC0415

    keys = jax.random.split(jax.random.key(0), 4)

    class EBlock(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(self.lin(x))

    class ENet(eqx.Module):
        inp: eqx.nn.Linear
        blocks: list
        out: eqx.nn.Linear

        def __call__(self, x: jax.Array) -> jax.Array:
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.out(h)

    blocks = [EBlock(eqx.nn.Linear(WIDTH, WIDTH, key=k)) for k in keys[1:3]]
    model = ENet(eqx.nn.Linear(12, WIDTH, key=keys[0]), blocks, eqx.nn.Linear(WIDTH, 6, key=keys[3]))
    loss = lambda m, b: jnp.mean((jax.vmap(m)(b["x"]) - b["y"]) ** 2)  # noqa: E731
    return zj.adapters.from_equinox(model, loss, layers="auto")


def train_adapted(library: str, kind: str, ctx: str) -> tuple[list[np.ndarray], list[float], Any]:
    with context(ctx, kind):
        adapted = adapted_model(library)
        policy = adapted.policy(3, mesh(kind), min_shard_size=0)
        tx = zj.shard_optimizer(ADAM, policy)
        state = adapted.init_state(tx, policy)
        step = adapted.make_train_step(tx, policy)
        assert step.gather == "manual"
        losses = []
        for b in batches():
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        adapted.to_model(state)  # the trained model rebuilds under the context too
        return [np.asarray(x) for x in jax.tree.leaves(zj.full_params(state))], losses, adapted


@pytest.mark.slow
@pytest.mark.parametrize("library", ["linen", "nnx", "equinox"])
def test_adapters_on_explicit_mesh_under_set_mesh(library: str) -> None:
    got, got_losses, adapted = train_adapted(library, "explicit", "set_mesh")
    want, want_losses, _ = train_adapted(library, "auto", "none")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_losses == want_losses
    _, ref_losses = reference_run(ADAM, adapted.params, batches(), adapted.loss_fn)
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5)


# --- tensor parallelism: a (data, model) mesh, every axis Explicit, and the user's activation constraint ------


def tp_params() -> dict[str, jax.Array]:
    rng = np.random.default_rng(7)
    return {
        "up": jnp.asarray(rng.normal(size=(12, 32)) / np.sqrt(12), jnp.float32),  # column-parallel
        "down": jnp.asarray(rng.normal(size=(32, 6)) / np.sqrt(32), jnp.float32),  # row-parallel
    }


def tp_loss(p: dict[str, jax.Array], b: dict[str, jax.Array], constrain: bool = True) -> jax.Array:
    # The spelling the step makes valid: a bare PartitionSpec over the model axis (the step's mesh in context).
    h = jnp.tanh(b["x"] @ p["up"])
    h = jax.lax.with_sharding_constraint(h, jax.P(None, "model")) if constrain else h
    return jnp.mean((h @ p["down"] - b["y"]) ** 2)


def train_tp(kind: str, ctx: str, stage: int) -> tuple[Any, list[float]]:
    types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,) * 2
    tp_mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
    specs = {"up": jax.P(None, "model"), "down": jax.P("model", None)}
    with jax.set_mesh(tp_mesh) if ctx == "set_mesh" else contextlib.nullcontext():
        policy = zj.ZeroPolicy(stage, tp_mesh, param_specs=specs, min_shard_size=0)
        tx = zj.shard_optimizer(ADAM, policy)
        state = zj.init_state(tp_params(), tx, policy)
        step = zj.make_train_step(tp_loss, tx, policy)
        losses = []
        for b in batches():
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        return jax.tree.map(np.asarray, zj.full_params(state)), losses


@pytest.mark.parametrize("stage", [1, 3])
def test_tensor_parallel_on_an_explicit_mesh_under_set_mesh(stage: int) -> None:
    got, got_losses = train_tp("explicit", "set_mesh", stage)
    want, want_losses = train_tp("auto", "none", stage)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert got_losses == want_losses
    ref, ref_losses = reference_run(ADAM, tp_params(), batches(), functools.partial(tp_loss, constrain=False))
    errors = relative_update_error(got, ref, tp_params())
    assert max(errors.values()) < TOL, errors
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-5)
