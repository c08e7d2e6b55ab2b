"""ZeRO on (data, model) meshes: the model's own layout (``param_specs``) plus ZeRO's cut over data.

Every stage against plain optax on one device (fp32: relative update <= 1e-5 per leaf, losses
1e-5) on meshes (4, 2) and (2, 4), dims that do not divide by N; the per-device bytes; the
collectives moving only local model shards; checkpoints across layouts; the spec errors.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import reference_run, relative_update_error
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax import measure as _measure

FP32_RTOL = 1e-5  # relative L2 of each leaf's accumulated update against plain optax
LOSS_ATOL = 1e-5
BF16_RTOL = 5e-2  # bf16 compute, tensor-parallel against data-parallel: see the test
D, F, L = 21, 36, 3  # D divides by no data-axis size (padding); F by every model-axis size


def _mesh(data: int, model: int, explicit: bool = False) -> jax.sharding.Mesh:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh((data, model), ("data", "model"), axis_types=(kind, AxisType.Auto))


def _params() -> dict:
    k = jax.random.split(jax.random.key(0), 6)
    return {
        "embed": jax.random.normal(k[0], (D, D)) / np.sqrt(D),
        "up": jax.random.normal(k[1], (D, F)) / np.sqrt(D),  # column-parallel
        "up_bias": 0.1 * jax.random.normal(k[2], (F,)),  # only its model-sharded dimension
        "down": jax.random.normal(k[3], (F, D)) / np.sqrt(F),  # row-parallel
        "layers": {  # stacked for zj.scan_layers
            "up": jax.random.normal(k[4], (L, D, F)) / np.sqrt(D),
            "down": jax.random.normal(k[5], (L, F, D)) / np.sqrt(F),
        },
    }


SPECS = {
    "embed": None,
    "up": P(None, "model"),
    "up_bias": P("model"),
    "down": P("model", None),
    "layers": {"up": P(None, None, "model"), "down": P(None, "model")},
}


def _block(p: dict, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["up"]) @ p["down"]


def _plain_loss(params: dict, batch: dict) -> jax.Array:
    x = batch["x"] @ params["embed"]
    x = x + jnp.tanh(x @ params["up"] + params["up_bias"]) @ params["down"]
    for i in range(L):
        x = _block(jax.tree.map(lambda a, i=i: a[i], params["layers"]), x)
    return jnp.mean((x - batch["y"]) ** 2)


def _manual_loss(policy: zj.ZeroPolicy):
    """The same model with gather="manual": zj.gather, zj.apply_layer and zj.scan_layers."""

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        x = batch["x"] @ zj.gather(params["embed"], policy)
        first = {"up": params["up"], "bias": params["up_bias"], "down": params["down"]}
        x = zj.apply_layer(lambda p, h: h + jnp.tanh(h @ p["up"] + p["bias"]) @ p["down"], first, x, policy=policy)
        x = zj.scan_layers(_block, params["layers"], x, policy)
        return jnp.mean((x - batch["y"]) ** 2)

    return loss_fn


def _batches(steps: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(7), 2 * steps)
    return [
        {"x": jax.random.normal(keys[2 * s], (16, D)), "y": jax.random.normal(keys[2 * s + 1], (16, D))}
        for s in range(steps)
    ]


def _tx() -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))


def _train(policy: zj.ZeroPolicy, steps: int, *, gather: str = "all", **step_kwargs):
    tx = zj.shard_optimizer(_tx(), policy)
    state = zj.init_state(_params(), tx, policy)
    loss = _manual_loss(policy) if gather == "manual" else _plain_loss
    step = zj.make_train_step(loss, tx, policy, gather=gather, **step_kwargs)
    losses = []
    for batch in _batches(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses, step


@pytest.fixture(scope="module")
def reference() -> tuple[dict, list[float]]:
    return reference_run(_tx(), _params(), _batches(4), loss_fn=_plain_loss)


def _assert_matches(state, losses, reference) -> None:
    ref_params, ref_losses = reference
    errors = relative_update_error(zj.full_params(state), ref_params, _params())
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, ref_losses[: len(losses)], atol=LOSS_ATOL, rtol=0)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("data", "model", "explicit"), [(4, 2, False), (2, 4, True)])
def test_every_stage_equals_plain_optax(stage: int, data: int, model: int, explicit: bool, reference) -> None:
    policy = zj.ZeroPolicy(stage, _mesh(data, model, explicit), param_specs=SPECS, min_shard_size=0, stacked="layers")
    state, losses, _ = _train(policy, 4)
    _assert_matches(state, losses, reference)
    # The model's layout plus ZeRO's cut on a free dimension, in the stored state.
    specs = {k: v.sharding.spec for k, v in state.params.items() if k != "layers"}
    if stage == 3:
        assert specs == {
            "embed": P("data"),
            "up": P("data", "model"),
            "up_bias": P("model"),
            "down": P("model", "data"),
        }
    else:
        assert specs == {"embed": P(), "up": P(None, "model"), "up_bias": P("model"), "down": P("model")}
    mu = state.opt_state.inner_state[1][0].mu
    if stage >= 1:
        assert mu["up"].sharding.spec == P("data", "model") and mu["layers"]["down"].sharding.spec == P(
            None, "model", "data"
        )


@pytest.mark.parametrize(("stage", "accum_steps"), [(2, 1), (3, 1), (3, 2)])
def test_manual_layers_and_accumulation_equal_plain_optax(stage: int, accum_steps: int, reference) -> None:
    policy = zj.ZeroPolicy(stage, _mesh(4, 2), param_specs=SPECS, min_shard_size=0, stacked="layers")
    state, losses, _ = _train(policy, 4, gather="manual", accum_steps=accum_steps)
    _assert_matches(state, losses, reference)


def test_a_callable_spec_and_bf16_compute() -> None:
    def spec(path, leaf) -> P:
        name = jax.tree_util.keystr(path)
        return SPECS["layers"]["up" if "up" in name else "down"] if "layers" in name else SPECS[name[2:-2]]

    mesh = _mesh(4, 2)
    tp = zj.ZeroPolicy(3, mesh, param_specs=spec, min_shard_size=0, stacked="layers",
                       precision=zj.Precision(compute_dtype=jnp.bfloat16))  # fmt: skip
    dp = tp.replace(mesh=jax.make_mesh((8,), ("data",)), param_specs=None)
    (tp_state, tp_losses, _), (dp_state, dp_losses, _) = _train(tp, 2), _train(dp, 2)
    # bf16 matmuls split another way over the model axis round differently (8-bit
    # mantissa); Adam's first steps magnify it on small entries: the worst leaf measured
    # 2.6% (layers/up), the others <= 1.1%. Gradients reduce in bf16 here (the reduce
    # dtype follows the compute dtype), the all-reduce XLA:CPU promotes to float32.
    errors = relative_update_error(zj.full_params(tp_state), zj.full_params(dp_state), _params())
    assert max(errors.values()) <= BF16_RTOL, errors
    np.testing.assert_allclose(tp_losses, dp_losses, rtol=1e-2)


def _per_device_bytes(tree) -> dict[int, int]:
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


@pytest.mark.parametrize(("data", "model"), [(4, 2), (2, 4)])
def test_bytes_per_device_are_the_formula_over_n_and_m(data: int, model: int) -> None:
    """Stage 3, every leaf cut by both axes: parameters and Adam's two moments are
    1/(N*M) of the whole (the data cut's padding included), on every device alike."""
    params = {"w1": jnp.ones((64, 128)), "w2": jnp.ones((128, 64))}
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    policy = zj.ZeroPolicy(3, _mesh(data, model), param_specs=specs, min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state(params, tx, policy)
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    for tree, copies in ((state.params, 1), (state.opt_state, 2)):
        per_device = _per_device_bytes(tree)
        counted = {d: b for d, b in per_device.items()}
        expected = copies * whole / (data * model)
        assert max(counted.values()) <= 1.01 * min(counted.values())  # balanced
        assert all(abs(b - expected) <= 0.02 * expected + 8 for b in counted.values()), (counted, expected)


def _data_and_model_collectives(text: str, mesh: jax.sharding.Mesh) -> list[tuple[str, str, tuple[str, ...]]]:
    """(kind, result shape, mesh axes) of every all-gather / reduce-scatter in a compiled program (its replica
    groups as XLA prints them: ``{{0,2,4,6},{1,3,5,7}}`` in jaxlib 0.10.2, ``mesh['data'=4,'model'=2] {'data'}``
    in 0.12.1; the audit's reader reads both)."""
    colls = _measure.parse_collectives(text, mesh.size)
    def shape(c: Any) -> str:
        return f"{c.dtype}[{','.join(map(str, c.shape))}]"
    return [(c.kind, shape(c), c.axes(mesh)) for c in colls if c.kind in ("all-gather", "reduce-scatter")]


def test_zero_collectives_move_local_model_shards_over_data_only() -> None:
    """Stage 3 on (4, 2): each weight's all-gathers and reduce-scatters run over the data
    groups {0,2,4,6},{1,3,5,7} on its local model shard (half the model dimension); no
    weight is gathered across the model axis."""
    policy = zj.ZeroPolicy(3, _mesh(4, 2), param_specs=SPECS, min_shard_size=0, stacked="layers")
    _, _, step = _train(policy, 1)
    tx = zj.shard_optimizer(_tx(), policy)
    text = step.lower(zj.init_state(_params(), tx, policy), _batches(1)[0]).compile().as_text()
    found = _data_and_model_collectives(text, policy.mesh)
    assert found, "no all-gather or reduce-scatter in the stage-3 program"
    assert all(axes == ("data",) for _, _, axes in found), found  # the groups {0,2,4,6}, {1,3,5,7}
    gathered = {shape for kind, shape, _ in found if kind == "all-gather"}
    # up (21, 36) over ('data', 'model'): the local model shard of 18 columns, D padded 21 -> 24.
    assert "f32[24,18]" in gathered and "f32[18,24]" in gathered
    assert not any("36" in s for s in gathered), gathered  # never a whole model dimension
    colls = _measure.parse_collectives(text, 8)
    assert colls  # the measure module reads this program too


def test_checkpoints_move_between_layouts_bitwise(tmp_path) -> None:
    """(4, 2) stage 3 -> (2, 4) stage 1 -> (8, 1) stage 2: parameters and moments bitwise."""
    first = zj.ZeroPolicy(3, _mesh(4, 2), param_specs=SPECS, min_shard_size=0, stacked="layers")
    state, _, _ = _train(first, 2)
    zj.save(tmp_path / "a", state)
    chain = [
        zj.ZeroPolicy(1, _mesh(2, 4), param_specs=SPECS, min_shard_size=0, stacked="layers"),
        zj.ZeroPolicy(2, _mesh(8, 1), param_specs=SPECS, min_shard_size=0, stacked="layers"),
    ]

    def moments(s: zj.TrainState) -> dict:  # Adam's mu and nu, unpadded to the parameters' shapes
        adam = s.opt_state.inner_state[1][0]
        return jax.tree.map(lambda m, p: np.asarray(m)[tuple(slice(0, n) for n in p.shape)],
                            {"mu": adam.mu, "nu": adam.nu}, {"mu": _params(), "nu": _params()})  # fmt: skip

    want_params, want_mu = zj.full_params(state), moments(state)
    where = tmp_path / "a"
    for i, policy in enumerate(chain):
        restored = zj.restore(where, policy=policy, tx=zj.shard_optimizer(_tx(), policy), like=_params())
        got_params, got_mu = zj.full_params(restored), moments(restored)
        for want, got in ((want_params, got_params), (want_mu, got_mu)):
            jax.tree.map(lambda w, g: np.testing.assert_array_equal(np.asarray(w), np.asarray(g)), want, got)
        assert restored.params["up"].sharding.spec == policy.param_sharding(_params())["up"].spec
        where = tmp_path / f"b{i}"
        zj.save(where, restored)


def test_bad_specs_name_every_leaf_and_the_fix() -> None:
    mesh = _mesh(4, 2)
    bad = {**SPECS, "up": P(None, "data"), "down": P("model", None, None), "embed": "model"}
    with pytest.raises(ValueError) as err:
        zj.ZeroPolicy(3, mesh, param_specs=bad, stacked="layers").layouts(_params())
    text = str(err.value)
    assert "3 parameter leaf spec(s)" in text
    assert "'up': spec P(None, 'data') names 'data', a ZeRO axis" in text
    assert "'down' has shape (36, 21) but its spec P('model', None, None) has 3 entries" in text
    assert "'embed': 'model' is not a jax.sharding.PartitionSpec" in text
    uneven = {**SPECS, "embed": P("model")}  # 21 rows over 2 model devices
    with pytest.raises(ValueError, match=r"'embed' has shape \(21, 21\): dimension 0 \(21\) does not divide by"):
        zj.ZeroPolicy(3, mesh, param_specs=uneven, stacked="layers").layouts(_params())
    with pytest.raises(ValueError, match="does not mirror the parameters"):
        zj.ZeroPolicy(3, mesh, param_specs={"up": P()}).layouts(_params())


def test_a_spec_tree_that_lacks_or_adds_a_leaf_names_it() -> None:
    mesh = _mesh(4, 2)
    lacking = {k: v for k, v in SPECS.items() if k != "down"}
    with pytest.raises(ValueError, match=r"\(6 parameter leaves, 5 specs: no spec for down\)"):
        zj.ZeroPolicy(3, mesh, param_specs=lacking, stacked="layers").layouts(_params())
    extra = {**SPECS, "bias_typo": P()}
    with pytest.raises(ValueError, match=r"no parameter for bias_typo"):
        zj.ZeroPolicy(3, mesh, param_specs=extra, stacked="layers").layouts(_params())


def test_a_leaf_with_no_free_dimension_is_reported_not_hidden() -> None:
    policy = zj.ZeroPolicy(3, _mesh(4, 2), param_specs=SPECS, min_shard_size=0, stacked="layers")
    replicated = {r.path: r.reason for r in policy.replicated_leaves(_params())}
    assert replicated == {"up_bias": "every dimension is model-sharded (param_specs): none is free for the data axis"}
    assert policy.model_axes == ("model",) and policy.model_parallel == 2


@pytest.mark.parametrize("policy_kind", ["hsdp_over_replicas", "offloaded"])
def test_hybrid_and_offloaded_policies_on_a_model_axis(policy_kind: str, reference) -> None:
    if policy_kind == "offloaded":
        policy = zj.ZeroPolicy(3, _mesh(4, 2), param_specs=SPECS, min_shard_size=0, stacked="layers",
                               offload_optimizer=True, offload_params=True)  # fmt: skip
    else:  # (replica, data, model) = (2, 2, 2): HSDP with the optimizer over the replicas too
        mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "model"))
        policy = zj.ZeroPolicy(3, mesh, replica_axis="replica", optimizer_over_replicas=True, param_specs=SPECS,
                               min_shard_size=0, stacked="layers")  # fmt: skip
    state, losses, _ = _train(policy, 4)
    host = jax.tree.map(np.asarray, zj.full_params(state))  # offloaded leaves live in host memory
    errors = relative_update_error(host, reference[0], _params())
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, reference[1], atol=LOSS_ATOL, rtol=0)


def test_export_is_whole_over_both_axes_and_loads_at_another_layout(tmp_path) -> None:
    import safetensors.numpy

    policy = zj.ZeroPolicy(3, _mesh(4, 2), param_specs=SPECS, min_shard_size=0, stacked="layers")
    state, _, _ = _train(policy, 1)
    path = zj.export_params(tmp_path / "model.safetensors", state)
    tensors, full = safetensors.numpy.load_file(path), zj.full_params(state)
    assert tensors["up"].shape == (D, F) and tensors["layers.down"].shape == (L, F, D)
    np.testing.assert_array_equal(tensors["up"], np.asarray(full["up"]))
    np.testing.assert_array_equal(tensors["layers.down"], np.asarray(full["layers"]["down"]))
    other = zj.ZeroPolicy(1, _mesh(2, 4), param_specs=SPECS, min_shard_size=0, stacked="layers")
    loaded = zj.load_params(path, other, like=_params())
    assert loaded["up"].sharding.spec == P(None, "model")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), loaded, full)


def test_a_sequence_axis_splits_the_sequence_dimension() -> None:
    """Sequence parallelism: batch_spec=P(None, "seq") lays (batch, seq, dim) leaves out over the
    sequence axis too; the loss sees whole sequences, the numbers are plain optax's."""
    mesh = jax.make_mesh((4, 2), ("data", "seq"))
    params = {"w": jax.random.normal(jax.random.key(0), (D, D)) / np.sqrt(D), "v": jnp.ones((D,))}

    def loss_fn(p: dict, batch: dict) -> jax.Array:
        h = jnp.tanh(batch["x"] @ p["w"]) * p["v"]  # per token
        mixed = jnp.cumsum(h, axis=1) / jnp.arange(1, h.shape[1] + 1)[:, None]  # causal mean: crosses "seq"
        return jnp.mean((mixed - batch["y"]) ** 2)

    keys = jax.random.split(jax.random.key(3), 6)
    batches = [{"x": jax.random.normal(keys[2 * s], (8, 6, D)), "y": jax.random.normal(keys[2 * s + 1], (8, 6, D))}
               for s in range(3)]  # fmt: skip
    ref_params, ref_losses = reference_run(optax.adam(1e-2), params, batches, loss_fn=loss_fn)
    policy = zj.ZeroPolicy(3, mesh, min_shard_size=0, batch_spec=P(None, "seq"))
    assert policy.batch_sharding().spec == P("data", "seq") and policy.manual_axes == {"data"}
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(loss_fn, tx, policy)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    errors = relative_update_error(zj.full_params(state), ref_params, params)
    assert max(errors.values()) <= FP32_RTOL, errors
    np.testing.assert_allclose(losses, ref_losses, atol=LOSS_ATOL, rtol=0)


def test_a_batch_spec_must_fit_the_batch_and_the_mesh() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "seq"))
    with pytest.raises(ValueError, match=r"batch_spec must be a PartitionSpec whose entry 0 is None .* \('seq',\)"):
        zj.ZeroPolicy(3, mesh, batch_spec=P("data", "seq"))
    policy = zj.ZeroPolicy(3, mesh, batch_spec=P(None, "seq"))
    with pytest.raises(ValueError, match=r"batch leaf 'x' has shape \(8, 5\) \(dimension 1 over \('seq',\): 2\)"):
        policy.check_batch({"x": jnp.ones((8, 5))}, where="train_step")
