"""Adapters: a Flax NNX, a Flax Linen and an Equinox model, each trained 5 steps
under every ZeRO stage on 8 simulated devices, equal their library's own
unsharded optax training; layer-wise ZeRO-3 through the adapters' scan; bad
input errors."""

from __future__ import annotations

import collections
import functools
import pathlib
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, relative_update_error
from flax import nnx

import zero_jax as zj
from zero_jax.adapters import equinox as zj_eqx
from zero_jax.adapters import linen as zj_linen
from zero_jax.adapters import nnx as zj_nnx

IN, WIDTH, OUT, DEPTH = 12, 40, 6, 3  # 12 and 6 do not divide 8: padded pieces
STEPS = 5
FP32_RTOL = 1e-5
LR = 1e-2
MIN_SHARD = 64  # small enough that every weight matrix is partitioned


def _batches(rows: int = 16) -> list[dict[str, jax.Array]]:
    """A learnable task (a fixed random teacher), so the loss falls in 5 steps."""
    rng = np.random.default_rng(7)
    teacher = rng.normal(size=(IN, OUT)) / np.sqrt(IN)
    xs = [rng.normal(size=(rows, IN)) for _ in range(STEPS)]
    return [{"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(np.tanh(x @ teacher) * 2, jnp.float32)} for x in xs]


def _mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((pred - y) ** 2)


def _train(adapted: zj.adapters.Adapted, stage: int, gather: str = "all", rows: int = 16):
    policy = adapted.policy(stage, make_mesh(8), min_shard_size=MIN_SHARD)
    tx = zj.shard_optimizer(optax.adam(LR), policy)
    state = adapted.init_state(tx, policy)  # with the model state, if the model has one
    step = adapted.make_train_step(tx, policy, gather=gather)
    losses = []
    for batch in _batches(rows):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, step, losses


def _np(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


def _assert_matches(final: Any, reference: Any, start: Any, losses: list[float], ref_losses: list[float]) -> float:
    errors = relative_update_error(_np(final), _np(reference), _np(start))
    assert len(errors) >= 6, errors  # every trained leaf compared
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it trains
    return max(errors.values())


# -- Flax NNX ------------------------------------------------------------------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        # Stacked non-trainable state (per-layer statistics): sliced per layer, never trained.
        self.stats = nnx.BatchNorm(WIDTH, use_running_average=True, rngs=rngs)
        self.stats.mean[...] = jnp.full((WIDTH,), 0.1)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.lin(self.stats(self.norm(x))))


class NNXModel(nnx.Module):
    """Input and output layers around a stack made with nnx.vmap, run with the
    adapter's scan_layers; batch norm (eval mode) adds non-trainable state."""

    def __init__(self, rngs: nnx.Rngs, depth: int = DEPTH) -> None:
        self.inp = nnx.Linear(IN, WIDTH, rngs=rngs)
        self.layers = nnx.vmap(NNXBlock, in_axes=0)(rngs.split(depth))
        self.bn = nnx.BatchNorm(WIDTH, use_running_average=True, rngs=rngs)
        self.out = nnx.Linear(WIDTH, OUT, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = zj_nnx.scan_layers(lambda layer, h: layer(h), self.layers, self.inp(x))
        return self.out(self.bn(h))


def _nnx_model() -> NNXModel:
    model = NNXModel(nnx.Rngs(0))
    # Non-trivial batch statistics: the constant state must reach the loss.
    model.bn.mean[...] = jnp.linspace(-0.5, 0.5, WIDTH)
    model.bn.var[...] = jnp.linspace(0.5, 2.0, WIDTH)
    return model


def _nnx_loss(model: NNXModel, batch: dict[str, jax.Array]) -> jax.Array:
    return _mse(model(batch["x"]), batch["y"])


@functools.cache
def _nnx_reference() -> tuple[Any, list[float]]:
    """NNX's own unsharded training: nnx.Optimizer and nnx.value_and_grad."""
    model = _nnx_model()
    optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)

    @nnx.jit
    def step(model: NNXModel, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]) -> jax.Array:
        loss, grads = nnx.value_and_grad(_nnx_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, b)) for b in _batches()]
    return nnx.to_pure_dict(nnx.state(model, nnx.Param)), losses


@pytest.mark.parametrize(("stage", "gather"), [(0, "all"), (1, "all"), (2, "all"), (3, "all"), (2, "manual"),
                                               (3, "manual")])  # fmt: skip
def test_nnx_matches_unsharded_training(stage: int, gather: str) -> None:
    adapted = zj.adapters.from_nnx(_nnx_model(), _nnx_loss, stacked="layers")
    assert adapted.stacked == ("layers",)
    assert adapted.params["layers"]["lin"]["kernel"].shape == (DEPTH, WIDTH, WIDTH)
    assert set(nnx.to_pure_dict(adapted.non_trainable)["bn"]) == {"mean", "var"}
    assert nnx.to_pure_dict(adapted.non_trainable)["layers"]["stats"]["mean"].shape == (DEPTH, WIDTH)
    state, step, losses = _train(adapted, stage, gather)
    ref, ref_losses = _nnx_reference()
    trained = adapted.to_model(state)
    assert isinstance(trained, NNXModel)
    err = _assert_matches(nnx.to_pure_dict(nnx.state(trained, nnx.Param)), ref, adapted.params, losses, ref_losses)
    print(f"nnx stage {stage} gather={gather}: max relative update error {err:.2e}")
    # Eval-mode batch statistics are model state the loss never changes: bitwise unchanged, used by the model.
    assert adapted.stateful and "mean" in adapted.model_state["bn"]
    np.testing.assert_array_equal(trained.bn.mean[...], jnp.linspace(-0.5, 0.5, WIDTH))
    np.testing.assert_array_equal(state.model_state["layers"]["stats"]["mean"], jnp.full((DEPTH, WIDTH), 0.1))
    assert step.jitted._cache_size() == 1  # noqa: SLF001  (jax has no public accessor for the jit cache size)


def _tally(colls: list[Any]) -> dict[tuple[str, tuple[int, ...]], int]:
    out: dict[tuple[str, tuple[int, ...]], int] = collections.Counter()
    for c in colls:
        out[(c.kind, c.shape)] += c.trips
    return dict(out)


def _layerwise_counts(adapted: zj.adapters.Adapted) -> dict[tuple[str, tuple[int, ...]], int]:
    policy = adapted.policy(3, make_mesh(8), min_shard_size=MIN_SHARD)
    tx = zj.shard_optimizer(optax.adam(LR), policy)
    state = adapted.init_state(tx, policy)
    step = adapted.make_train_step(tx, policy, gather="manual")
    # The audit reads the partitioned program once: ZeRO-3's contract (no gradient-sized all-reduce, nothing
    # partitionable kept whole, communication within 2% of 3Ψ) and the collectives with their loop trip counts.
    report = zj.audit(step, state, _batches()[0], min_shard_size=MIN_SHARD, grads=False).check()
    return _tally(list(report.collectives))


@pytest.mark.parametrize("library", ["nnx", "linen", "equinox"])
def test_layerwise_stage3_passes_the_audit_and_gathers_each_layer_twice(library: str) -> None:
    if library == "nnx":
        adapted = zj.adapters.from_nnx(_nnx_model(), _nnx_loss, stacked="layers")
    elif library == "linen":
        adapted = zj.adapters.from_linen(LINEN[True], _linen_variables(True), _linen_loss_of(True), stacked="layers")
    else:
        adapted = zj.adapters.from_equinox(_eqx_model(), _eqx_loss, stacked="layers")
    counts = _layerwise_counts(adapted)
    # One layer's kernel, whole (40, 40), and its piece (40 / 8, 40).
    assert counts[("all-gather", (WIDTH, WIDTH))] == 2 * DEPTH, counts  # forward gather + backward re-gather
    assert counts[("reduce-scatter", (WIDTH // 8, WIDTH))] == DEPTH, counts  # each layer's gradient, once
    assert ("all-gather", (DEPTH, WIDTH, WIDTH)) not in counts  # the stack is never gathered whole


def test_nnx_updates_to_non_trainable_state_are_carried_or_an_error_or_discarded() -> None:
    model = _nnx_model()
    model.bn.use_running_average = False  # training mode: the loss updates the running statistics

    def run(adapted: zj.adapters.Adapted) -> Any:
        policy = adapted.policy(2, make_mesh(8), min_shard_size=MIN_SHARD)
        tx = zj.shard_optimizer(optax.adam(LR), policy)
        step = adapted.make_train_step(tx, policy)
        return step(adapted.init_state(tx, policy), _batches()[0])

    updated = r"updated BatchStat 'bn/mean' \(an array of shape \(40,\).*state_updates='discard'"
    with pytest.raises(ValueError, match=updated):
        run(zj.adapters.from_nnx(model, _nnx_loss, stacked="layers", state_updates="error"))
    discarded = zj.adapters.from_nnx(model, _nnx_loss, stacked="layers", state_updates="discard")
    assert not discarded.stateful and discarded.model_state is None
    _, metrics = run(discarded)
    assert np.isfinite(float(metrics["loss"]))
    state, _ = run(zj.adapters.from_nnx(model, _nnx_loss, stacked="layers"))  # carried (the default)
    assert not np.array_equal(state.model_state["bn"]["mean"], jnp.linspace(-0.5, 0.5, WIDTH))
    # Updates inside the adapter's layer scan cannot leave it: an error, even when carrying.
    inner = _nnx_model()
    inner.layers.stats.use_running_average = False
    with pytest.raises(ValueError, match=r"updated BatchStat 'stats/mean'.*cannot be carried out of the layer scan"):
        run(zj.adapters.from_nnx(inner, _nnx_loss, stacked="layers"))
    # The plain path on a stateful adapter says what to do.
    adapted = zj.adapters.from_nnx(model, _nnx_loss, stacked="layers")
    policy = adapted.policy(2, make_mesh(8), min_shard_size=MIN_SHARD)
    tx = zj.shard_optimizer(optax.adam(LR), policy)
    with pytest.raises(
        TypeError, match=r"has model state.*adapted.init_state\(tx, policy\) and adapted.make_train_step"
    ):
        zj.make_train_step(adapted.loss_fn, tx, policy)(zj.init_state(adapted.params, tx, policy), _batches()[0])


class NNXScanModel(NNXModel):
    """The same model running its stack with NNX's own nnx.scan."""

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(layer: NNXBlock, h: jax.Array) -> jax.Array:
            return layer(h)

        return self.out(self.bn(run(self.layers, self.inp(x))))


def test_nnx_scan_model_trains_stage3_whole_and_explains_manual_gather() -> None:
    adapted = zj.adapters.from_nnx(NNXScanModel(nnx.Rngs(0)), _nnx_loss, stacked="layers")
    policy = adapted.policy(3, make_mesh(8), min_shard_size=MIN_SHARD)
    tx = zj.shard_optimizer(optax.adam(LR), policy)
    batch = _batches()[0]
    _, metrics = adapted.make_train_step(tx, policy)(adapted.init_state(tx, policy), batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(_nnx_loss(NNXScanModel(nnx.Rngs(0)), batch)), rtol=1e-6)
    step = adapted.make_train_step(tx, policy, gather="manual")
    with pytest.raises(TypeError, match=r"partitioned pieces \(e.g. 'layers/.*zj.adapters.nnx.scan_layers\(fn, self"):
        step(adapted.init_state(tx, policy), batch)


def test_nnx_stacked_layers_that_disagree_on_depth() -> None:
    model = _nnx_model()
    model.layers.extra = nnx.vmap(lambda r: nnx.Linear(WIDTH, WIDTH, rngs=r), in_axes=0)(nnx.Rngs(1).split(DEPTH + 1))
    with pytest.raises(
        ValueError,
        match=r"stacked layers under 'layers' disagree on depth: most leaves have 3 layers.*"
        r"'layers/extra/kernel' \(4, 40, 40\) \(depth 4\).*nnx.vmap",
    ):
        zj.adapters.from_nnx(model, _nnx_loss, stacked="layers")
    with pytest.raises(ValueError, match=r"stacked prefix 'blocks' matches no trainable parameter.*'layers'"):
        zj.adapters.from_nnx(_nnx_model(), _nnx_loss, stacked="blocks")


# -- Flax Linen ----------------------------------------------------------------------------------------------------


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(nn.Dense(WIDTH)(nn.LayerNorm()(x)))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return LinenLayer()(x), None


class LinenModel(nn.Module):
    """A stack made with nn.scan (params stacked on axis 0), or with the
    adapter's ScanLayers (layer-by-layer gathering); batch norm in eval mode
    (a "batch_stats" collection)."""

    zero_scan: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(WIDTH)(x)
        if self.zero_scan:
            h = zj_linen.ScanLayers(LinenLayer(), length=DEPTH, name="layers")(h)
        else:
            stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=DEPTH)
            h, _ = stack(name="layers")(h, None)
        h = nn.BatchNorm(use_running_average=True)(h)
        return nn.Dense(OUT)(h)


LINEN = {False: LinenModel(), True: LinenModel(zero_scan=True)}


def _linen_variables(zero_scan: bool = False) -> dict[str, Any]:
    variables = LINEN[zero_scan].init(jax.random.key(0), jnp.ones((1, IN)))
    stats = variables["batch_stats"]["BatchNorm_0"]
    stats["mean"] = jnp.linspace(-0.5, 0.5, WIDTH)
    stats["var"] = jnp.linspace(0.5, 2.0, WIDTH)
    return variables


def _linen_loss_of(zero_scan: bool) -> Callable[[dict[str, Any], dict[str, jax.Array]], jax.Array]:
    return lambda variables, batch: _mse(LINEN[zero_scan].apply(variables, batch["x"]), batch["y"])


_linen_loss = _linen_loss_of(False)


@functools.cache
def _linen_reference(zero_scan: bool) -> tuple[Any, list[float]]:
    """Linen's usual unsharded training: grad of apply w.r.t. "params", optax."""
    variables = _linen_variables(zero_scan)
    params, stats = variables["params"], variables["batch_stats"]
    loss = _linen_loss_of(zero_scan)
    tx = optax.adam(LR)
    opt_state = tx.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> Any:
        value, grads = jax.value_and_grad(lambda p: loss({"params": p, "batch_stats": stats}, batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    losses = []
    for batch in _batches():
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    return params, losses


@pytest.mark.parametrize(("stage", "zero_scan"), [(0, False), (1, False), (2, False), (3, False), (2, True),
                                                  (3, True)])  # fmt: skip
def test_linen_matches_unsharded_training(stage: int, zero_scan: bool) -> None:
    variables = _linen_variables(zero_scan)
    adapted = zj.adapters.from_linen(LINEN[zero_scan], variables, _linen_loss_of(zero_scan), stacked="layers")
    layer = adapted.params["layers"]["stack"] if zero_scan else adapted.params["layers"]["LinenLayer_0"]
    assert layer["Dense_0"]["kernel"].shape == (DEPTH, WIDTH, WIDTH)
    assert list(adapted.non_trainable) == ["batch_stats"]
    gather = "manual" if zero_scan else "all"  # ScanLayers: layer by layer; nn.scan: the step gathers
    state, step, losses = _train(adapted, stage, gather)
    ref, ref_losses = _linen_reference(zero_scan)
    trained = adapted.to_model(state)
    assert sorted(trained) == ["batch_stats", "params"]
    err = _assert_matches(trained["params"], ref, adapted.params, losses, ref_losses)
    print(f"linen stage {stage} gather={gather}: max relative update error {err:.2e}")
    if stage == 3:  # the layer axis is never cut: every stacked leaf is partitioned on another dimension
        layouts = step.policy.layouts(adapted.params)["layers"]
        assert all(lay.dim != 0 for lay in jax.tree.leaves(layouts, is_leaf=lambda x: isinstance(x, zj.LeafLayout)))


def test_linen_nn_scan_under_manual_gather_says_to_use_scan_layers() -> None:
    adapted = zj.adapters.from_linen(LINEN[False], _linen_variables(), _linen_loss, stacked="layers")
    policy = adapted.policy(3, make_mesh(8), min_shard_size=MIN_SHARD)
    tx = zj.shard_optimizer(optax.sgd(LR), policy)
    step = zj.make_train_step(adapted.loss_fn, tx, policy, gather="manual")
    with pytest.raises(TypeError, match=r"partitioned pieces.*zj.adapters.linen.ScanLayers.*gather='all'"):
        step(zj.init_state(adapted.params, tx, policy), _batches()[0])


def test_linen_module_without_its_variables() -> None:
    with pytest.raises(TypeError, match=r"LinenModel module was passed without its variables.*module.init\("):
        zj.adapters.from_linen(LINEN[False], _linen_loss)  # the loss in the variables' place
    with pytest.raises(TypeError, match=r"without its variables"):
        zj.adapters.from_linen(LINEN[False], loss=_linen_loss)
    params_only = _linen_variables()["params"]
    unwrapped = r"no 'params' collection.*contents of the 'params' collection.*\{'params': params\}"
    with pytest.raises(ValueError, match=unwrapped):
        zj.adapters.from_linen(LINEN[False], params_only, _linen_loss)
    with pytest.raises(TypeError, match=r"looks like a Flax NNX module: use zj.adapters.from_nnx"):
        zj.adapters.from_linen(_nnx_model(), {}, _linen_loss)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(OUT)(jnp.tanh(nn.Dense(WIDTH)(x)))


class PretrainedStandIn:
    """The two attributes of a Hugging Face ``FlaxPreTrainedModel`` that from_linen reads (transformers is not a
    dependency): ``.module``, the Linen module, and ``.params``, its "params" collection (a property that
    raises when the model was made with ``_do_init=False``); called as ``model(x, params=...)``."""

    def __init__(self, module: nn.Module, params: Any, init: bool = True) -> None:
        self.module, self._params, self._init = module, params, init

    @property
    def params(self) -> Any:
        if not self._init:
            raise ValueError("`params` cannot be accessed from model when the model is created with `_do_init=False`")
        return self._params

    def __call__(self, x: jax.Array, params: Any = None) -> jax.Array:
        return self.module.apply({"params": self.params if params is None else params}, x)


def _same_leaves(a: Any, b: Any) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_linen_takes_a_hugging_face_style_model() -> None:
    module = LinenMLP()
    params0 = module.init(jax.random.key(0), jnp.ones((1, IN)))["params"]
    hf = PretrainedStandIn(module, params0)

    def loss(variables: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        return _mse(hf(batch["x"], params=variables["params"]), batch["y"])

    adapted = zj.adapters.from_linen(hf, loss)  # module = hf.module, variables = {"params": hf.params}
    assert _same_leaves(adapted.params, params0) and adapted.non_trainable == {}
    tx = optax.adam(LR)
    params, opt_state, ref_losses = params0, tx.init(params0), []
    for batch in _batches():  # the unsharded optax reference
        value, grads = jax.value_and_grad(lambda p, b=batch: loss({"params": p}, b))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params, ref_losses = optax.apply_updates(params, updates), [*ref_losses, float(value)]
    for stage in (3,):  # what the adapter does is the same in every stage
        state, _, losses = _train(adapted, stage)
        trained = adapted.to_model(state)
        assert sorted(trained) == ["params"]
        errors = relative_update_error(_np(trained["params"]), _np(params), _np(params0))
        assert len(errors) == 4 and max(errors.values()) <= FP32_RTOL, errors
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        x = _batches()[0]["x"]  # the trained parameters run in the model object (hf_model.params = ...)
        np.testing.assert_allclose(hf(x, params=trained["params"]), module.apply({"params": params}, x), atol=1e-5)
    # Variables given explicitly win; a .params that holds collections is the variables dict itself.
    variables = _linen_variables()
    explicit = zj.adapters.from_linen(PretrainedStandIn(LINEN[False], {}), variables, _linen_loss)
    with_collections = zj.adapters.from_linen(PretrainedStandIn(LINEN[False], variables), loss=_linen_loss)
    for got in (explicit, with_collections):
        assert _same_leaves(got.params, variables["params"]) and list(got.non_trainable) == ["batch_stats"]
    unreadable = PretrainedStandIn(module, params0, init=False)
    message = (
        r"PretrainedStandIn looks like a Hugging Face Flax model \(its .module is a Linen LinenMLP\), but its "
        r".params cannot be read \(ValueError: `params` cannot be accessed.*"
        r"from_linen\(model.module, \{'params': params\}, loss\)"
    )
    with pytest.raises(TypeError, match=message):
        zj.adapters.from_linen(unreadable, loss)


# -- Equinox -------------------------------------------------------------------------------------------------------


class EqxBlock(eqx.Module):
    lin: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    seed: jax.Array  # a stacked integer leaf: sliced per layer, never trained

    def __init__(self, key: jax.Array) -> None:
        self.lin = eqx.nn.Linear(WIDTH, WIDTH, key=key)
        self.norm = eqx.nn.LayerNorm(WIDTH)
        self.seed = jax.random.key_data(key)[-1] % 7

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.lin(self.norm(x))) * (1.0 + 0.01 * self.seed)


class EqxModel(eqx.Module):
    """A stack made with eqx.filter_vmap, run with the adapter's scan_layers;
    non-array (activation, Python float) and integer leaves stay constant."""

    inp: eqx.nn.Linear
    layers: EqxBlock
    out: eqx.nn.Linear
    activation: Callable[[jax.Array], jax.Array]
    gain: float
    vocab_ids: jax.Array

    def __init__(self, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.inp = eqx.nn.Linear(IN, WIDTH, key=k1)
        self.layers = eqx.filter_vmap(EqxBlock)(jax.random.split(k2, DEPTH))
        self.out = eqx.nn.Linear(WIDTH, OUT, key=k3)
        self.activation = jax.nn.gelu
        self.gain = 0.5
        self.vocab_ids = jnp.arange(OUT)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.activation(jax.vmap(self.inp)(x))
        h = zj_eqx.scan_layers(lambda layer, h: jax.vmap(layer)(h), self.layers, h)
        return jax.vmap(self.out)(h) * self.gain + 0.0 * self.vocab_ids


def _eqx_model() -> EqxModel:
    return EqxModel(jax.random.key(0))


def _eqx_loss(model: EqxModel, batch: dict[str, jax.Array]) -> jax.Array:
    return _mse(model(batch["x"]), batch["y"])


@functools.cache
def _eqx_reference() -> tuple[Any, list[float]]:
    """Equinox's usual unsharded training: filter_value_and_grad, optax."""
    model = _eqx_model()
    tx = optax.adam(LR)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model: EqxModel, opt_state: Any, batch: dict[str, jax.Array]) -> Any:
        loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for batch in _batches():
        model, opt_state, loss = step(model, opt_state, batch)
        losses.append(float(loss))
    return eqx.filter(model, eqx.is_inexact_array), losses


@pytest.mark.parametrize(("stage", "gather"), [(0, "all"), (1, "all"), (2, "all"), (3, "all"), (2, "manual"),
                                               (3, "manual")])  # fmt: skip
def test_equinox_matches_unsharded_training(stage: int, gather: str) -> None:
    adapted = zj.adapters.from_equinox(_eqx_model(), _eqx_loss, stacked="layers")
    assert adapted.params.layers.lin.weight.shape == (DEPTH, WIDTH, WIDTH)
    assert jax.tree.leaves((adapted.params.activation, adapted.params.vocab_ids)) == []  # constants, not trained
    state, _, losses = _train(adapted, stage, gather)
    ref, ref_losses = _eqx_reference()
    trained = adapted.to_model(state)
    assert isinstance(trained, EqxModel) and trained.activation is jax.nn.gelu and trained.gain == 0.5
    err = _assert_matches(eqx.filter(trained, eqx.is_inexact_array), ref, adapted.params, losses, ref_losses)
    print(f"equinox stage {stage} gather={gather}: max relative update error {err:.2e}")


def test_equinox_non_array_leaves_marked_trainable() -> None:
    everything = lambda leaf: eqx.is_inexact_array(leaf) or callable(leaf)  # noqa: E731  (functions too)
    function_leaf = r"leaf 'activation' is marked trainable but is a function \(<function gelu.*exclude it"
    with pytest.raises(ValueError, match=function_leaf):
        zj.adapters.from_equinox(_eqx_model(), _eqx_loss, trainable=everything)
    spec = jax.tree.map(lambda _: False, _eqx_model())
    spec = eqx.tree_at(lambda m: (m.gain, m.out), spec, (True, True))
    with pytest.raises(ValueError, match=r"leaf 'gain' is marked trainable but is a float \(0.5\).*jnp.asarray\(0.5"):
        zj.adapters.from_equinox(_eqx_model(), _eqx_loss, trainable=spec)
    spec = eqx.tree_at(lambda m: m.vocab_ids, jax.tree.map(lambda _: False, _eqx_model()), True)
    int_leaf = r"'vocab_ids' is marked trainable but is an array of shape \(6,\) and dtype int32"
    with pytest.raises(ValueError, match=int_leaf):
        zj.adapters.from_equinox(_eqx_model(), _eqx_loss, trainable=spec)


class EqxDefaultBatchNormNet(eqx.Module):
    """eqx.nn.BatchNorm in its default mode ("ema" in equinox 0.13, with a bool "first time" flag in its state)."""

    lin1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    lin2: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(IN, WIDTH, use_bias=False, key=k1)
        with warnings.catch_warnings():  # equinox warns that the unspecified mode defaults to "ema"
            warnings.filterwarnings("ignore", message=r".*BatchNorm\(\.\.\., mode=\.\.\.\)", category=UserWarning)
            self.bn = eqx.nn.BatchNorm(WIDTH, axis_name="batch", momentum=BN_MOMENTUM)
        self.lin2 = eqx.nn.Linear(WIDTH, OUT, key=k2)

    def __call__(self, x: jax.Array, state: eqx.nn.State) -> tuple[jax.Array, eqx.nn.State]:
        h, state = self.bn(self.lin1(x), state)
        return self.lin2(jnp.tanh(h)), state


BN_MOMENTUM = 0.8
DEVICES = 8
BN_ROWS = 32  # 4 rows per device: per-device batch statistics of 2 rows are too ill-conditioned for 1e-5


def _eqx_bn_loss(model: EqxDefaultBatchNormNet, state: eqx.nn.State, batch: dict[str, jax.Array]) -> Any:
    run = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    pred, state = run(batch["x"], state)
    return _mse(pred, batch["y"]), state


def _combine_over_devices(x: jax.Array) -> jax.Array:
    """What the step does with each device's model state: floats averaged, the rest (the flag) agreed (max)."""
    return jnp.mean(x, 0) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.max(x, 0)


@functools.cache
def _eqx_bn_reference() -> tuple[Any, Any, list[float]]:
    """Per-device reference: the loss of each of the 8 slices (jax.vmap), gradient of their mean, state combined."""
    net, state0 = eqx.nn.make_with_state(EqxDefaultBatchNormNet)(jax.random.key(0))
    params, static = eqx.partition(net, eqx.is_inexact_array)

    def total(p: Any, ms: Any, batch: dict[str, jax.Array]) -> Any:
        slices = jax.tree.map(lambda x: x.reshape(DEVICES, x.shape[0] // DEVICES, *x.shape[1:]), batch)
        per_slice = lambda sl: _eqx_bn_loss(eqx.combine(p, static), ms, sl)  # noqa: E731
        losses, news = jax.vmap(per_slice)(slices)
        return jnp.mean(losses), jax.tree.map(_combine_over_devices, news)

    tx = optax.adam(LR)

    @jax.jit
    def step(p: Any, opt: Any, ms: Any, batch: dict[str, jax.Array]) -> Any:
        (loss, ms), g = jax.value_and_grad(total, has_aux=True)(p, ms, batch)
        updates, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, updates), opt, ms, loss

    opt, ms, losses = tx.init(params), state0, []
    for batch in _batches(BN_ROWS):
        params, opt, ms, loss = step(params, opt, ms, batch)
        losses.append(float(loss))
    return params, ms, losses


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_equinox_default_batch_norm_state_with_a_bool_flag_trains(stage: int) -> None:
    net, bn_state = eqx.nn.make_with_state(EqxDefaultBatchNormNet)(jax.random.key(0))
    assert net.bn.mode == "ema"  # the installed equinox's default, whose state holds a bool flag
    assert [x.dtype for x in jax.tree.leaves(bn_state)].count(jnp.bool_) == 1
    adapted = zj.adapters.from_equinox(net, _eqx_bn_loss, state=bn_state)
    state, _, losses = _train(adapted, stage, rows=BN_ROWS)
    ref_params, ref_state, ref_losses = _eqx_bn_reference()
    trained, trained_state = adapted.to_model(state)
    assert isinstance(trained, EqxDefaultBatchNormNet) and isinstance(trained_state, eqx.nn.State)
    errors = relative_update_error(
        _np(jax.tree.leaves(eqx.filter(trained, eqx.is_inexact_array))),
        _np(jax.tree.leaves(ref_params)),
        _np(jax.tree.leaves(adapted.params)),
    )
    assert len(errors) == 5 and max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert ref_losses[-1] < ref_losses[0]
    got, want = jax.tree.leaves(trained_state), jax.tree.leaves(ref_state)
    assert [x.dtype for x in got] == [x.dtype for x in want]
    for g, w in zip(got, want, strict=True):  # the flag (False after the first step) and the running statistics
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
    assert not bool(trained_state.get(net.bn.ema_first_time_index))
    print(f"equinox default BatchNorm stage {stage}: max relative update error {max(errors.values()):.2e}")


class NNXIntParams(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.ones((2,)))
        self.ids = nnx.Param(jnp.arange(3))
        self.mask = nnx.Param(jnp.ones((2,), jnp.bool_))


def test_checks_name_every_offending_leaf_at_once() -> None:
    spec = jax.tree.map(lambda _: False, _eqx_model())
    spec = eqx.tree_at(lambda m: (m.gain, m.vocab_ids, m.out), spec, (True, True, True))
    both = r"leaf 'gain' is marked trainable but is a float \(0.5\).*; leaf 'vocab_ids' is marked trainable.*int32"
    with pytest.raises(ValueError, match=both + r".*jnp.asarray\(0.5, jnp.float32\).*exclude them"):
        zj.adapters.from_equinox(_eqx_model(), _eqx_loss, trainable=spec)
    with pytest.raises(ValueError, match=r"state leaf 'a' is a float \(1.0\), not an array; state leaf 'c' is a str"):
        zj.adapters.from_equinox(_eqx_model(), lambda m, s, b: 0.0, state={"a": 1.0, "b": jnp.ones(2), "c": "x"})
    with pytest.raises(ValueError, match=r"'ids' is an array of shape \(3,\) and dtype int32.*'mask' .* dtype bool"):
        zj.adapters.from_nnx(NNXIntParams(), lambda m, b: 0.0)
    variables = {"params": {"ids": jnp.arange(3), "w": jnp.ones(2), "mask": jnp.ones(2, jnp.bool_)}}
    linen_both = r"variable 'params/ids' is .*int32, not a float array; trainable variable 'params/mask'"
    with pytest.raises(ValueError, match=linen_both):
        zj.adapters.from_linen(LinenMLP(), variables, _linen_loss)
    model = _nnx_model()
    model.layers.extra = nnx.vmap(lambda r: nnx.Linear(WIDTH, WIDTH, rngs=r), in_axes=0)(nnx.Rngs(1).split(DEPTH + 1))
    two = r"prefix 'blocks' matches no trainable parameter.*under 'layers' disagree on depth.*'layers/extra/kernel'"
    with pytest.raises(ValueError, match=two + r".*nnx.vmap"):
        zj.adapters.from_nnx(model, _nnx_loss, stacked=("blocks", "layers"))
    with pytest.raises(TypeError, match=r"got '', 3\."):
        zj.adapters.from_nnx(_nnx_model(), _nnx_loss, stacked=("layers", "", 3))
    training = _nnx_model()
    training.bn.use_running_average = False  # updates both running statistics
    adapted = zj.adapters.from_nnx(training, _nnx_loss, stacked="layers", state_updates="error")
    policy = adapted.policy(0, make_mesh(8))
    tx = zj.shard_optimizer(optax.sgd(LR), policy)
    with pytest.raises(ValueError, match=r"updated BatchStat 'bn/mean' \(.*\), BatchStat 'bn/var' \("):
        adapted.make_train_step(tx, policy)(adapted.init_state(tx, policy), _batches()[0])


# -- packaging -----------------------------------------------------------------------------------------------------


def test_import_zero_jax_needs_neither_flax_nor_equinox() -> None:
    code = "import sys, zero_jax; assert 'flax' not in sys.modules and 'equinox' not in sys.modules; print('ok')"
    root = pathlib.Path(__file__).resolve().parents[1]  # this checkout's zero_jax, not an installed one
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "ok"
