"""Adapters read the layout a Flax model declares into ``adapted.param_specs``: Linen ``nn.with_partitioning`` and
``nn.with_logical_partitioning`` with ``logical_axis_rules=``, NNX ``out_sharding`` metadata; Equinox declares
nothing. Bad layouts are one error naming every leaf; an annotated model trains on a data-only mesh, without
``param_specs``, bit for bit as the same model unannotated."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import make_mesh, train_adapted
from flax import nnx
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax.adapters import linen as zj_linen

IN, HIDDEN = 12, 40

MEGATRON = {  # column-parallel up (kernel and bias), row-parallel down (its bias replicated)
    "up": {"kernel": P(None, "model"), "bias": P("model")},
    "down": {"kernel": P("model", None), "bias": P()},
}
RULES = (("mlp", "model"), ("embed", None))


class LinenMLP(nn.Module):
    """Megatron-style: ``names`` maps each of "embed" / "mlp" to the name the boxes carry (None: no boxes)."""

    names: tuple[tuple[str, Any], ...] | None = (("embed", None), ("mlp", "model"))
    logical: bool = False

    def _init(self, init: Any, *axes: str) -> Any:
        if self.names is None:
            return init
        table = dict(self.names)
        wrap = nn.with_logical_partitioning if self.logical else nn.with_partitioning
        return wrap(init, tuple(table[a] for a in axes))

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros
        h = nn.Dense(HIDDEN, kernel_init=self._init(kernel, "embed", "mlp"), bias_init=self._init(zeros, "mlp"),
                     name="up")(x)  # fmt: skip
        return nn.Dense(IN, kernel_init=self._init(kernel, "mlp", "embed"), name="down")(jnp.tanh(h))


LOGICAL = (("embed", "embed"), ("mlp", "mlp"))  # the boxes carry the logical names themselves


def _linen(module: LinenMLP, **kwargs: Any) -> zj.adapters.Adapted:
    variables = module.init(jax.random.key(0), jnp.ones((1, IN)))

    def loss(variables: Any, batch: Any) -> jax.Array:
        return jnp.mean((module.apply(variables, batch["x"]) - batch["y"]) ** 2)

    return zj.adapters.from_linen(module, variables, loss, **kwargs)


def test_linen_with_partitioning_gives_the_megatron_specs() -> None:
    adapted = _linen(LinenMLP())
    assert adapted.param_specs == MEGATRON
    assert jax.tree.structure(adapted.param_specs) == jax.tree.structure(adapted.params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(adapted.params))  # unboxed


def test_linen_logical_names_with_rules_give_the_megatron_specs() -> None:
    adapted = _linen(LinenMLP(LOGICAL, logical=True), logical_axis_rules=RULES)
    assert adapted.param_specs == MEGATRON
    # nn.with_partitioning boxes holding logical names are read the same way once rules are given
    assert _linen(LinenMLP(LOGICAL), logical_axis_rules=[list(r) for r in RULES]).param_specs == MEGATRON
    # and Flax agrees: nn.logical_to_mesh(nn.get_partition_spec(variables), rules)
    variables = LinenMLP(LOGICAL, logical=True).init(jax.random.key(0), jnp.ones((1, IN)))
    flax_specs = nn.logical_to_mesh(nn.get_partition_spec(variables), RULES)["params"]
    assert flax_specs == MEGATRON
    with nn.logical_axis_rules(RULES):  # rules from Flax's context
        assert _linen(LinenMLP(LOGICAL, logical=True)).param_specs == MEGATRON


def test_linen_stacked_layers_leave_the_layer_axis_unsharded() -> None:
    dense = nn.Dense(HIDDEN, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")))
    module = zj_linen.ScanLayers(nn.Sequential([dense, nn.Dense(HIDDEN)]), length=3, name="layers")
    variables = module.init(jax.random.key(0), jnp.ones((1, HIDDEN)))
    adapted = zj.adapters.from_linen(module, variables, lambda v, b: 0.0, stacked="stack")
    assert adapted.param_specs == {"stack": {"layers_0": {"kernel": P(None, None, "model"), "bias": P()},
                                             "layers_1": {"kernel": P(), "bias": P()}}}  # fmt: skip
    assert adapted.params["stack"]["layers_0"]["kernel"].shape == (3, HIDDEN, HIDDEN)
    # nn.scan names the layer axis itself (metadata_params): a logical name, given its rule
    scan = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
                   metadata_params={nn.PARTITION_NAME: "layers"})(name="layers")  # fmt: skip
    variables = scan.init(jax.random.key(0), jnp.ones((1, HIDDEN)), None)
    rules = [("layers", None), *RULES]
    adapted = zj.adapters.from_linen(scan, variables, lambda v, b: 0.0, logical_axis_rules=rules)
    assert adapted.param_specs == {"Dense_0": {"kernel": P(None, None, "model"), "bias": P()}}


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        return nn.Dense(HIDDEN, kernel_init=init)(x), None


def test_linen_trains_without_param_specs_exactly_as_before() -> None:
    """M = 1: on a data-only mesh the annotated model trains (stage 3, no param_specs) bit for bit as the same
    model without annotations, and to_model gives the boxes back."""
    rng = np.random.default_rng(0)
    batches = [{"x": jnp.asarray(rng.normal(size=(16, IN)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(16, IN)), jnp.float32)} for _ in range(3)]  # fmt: skip
    plain = _linen(LinenMLP(None))
    assert plain.param_specs is None
    annotated = _linen(LinenMLP())
    state, _, losses = train_adapted(annotated, 3, batches)
    ref_state, _, ref_losses = train_adapted(plain, 3, batches)
    assert losses == ref_losses and losses[-1] < losses[0]
    trained, ref = annotated.to_model(state), plain.to_model(ref_state)
    assert isinstance(trained["params"]["up"]["kernel"], nn.Partitioned)
    assert nn.get_partition_spec(trained)["params"] == MEGATRON
    for a, b in zip(jax.tree.leaves(nn.unbox(trained)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class NnxMLP(nnx.Module):
    def __init__(self, names: dict[str, Any], rngs: nnx.Rngs, **meta: Any) -> None:
        up, down = (None, names["mlp"]), (names["mlp"], None)
        init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.up = nnx.Linear(IN, HIDDEN, kernel_init=nnx.with_partitioning(init, up, **meta),
                             bias_init=nnx.with_partitioning(zeros, (names["mlp"],), **meta), rngs=rngs)  # fmt: skip
        self.down = nnx.Linear(HIDDEN, IN, kernel_init=nnx.with_partitioning(init, down, **meta), rngs=rngs)
        self.scale = nnx.Param(jnp.ones((HIDDEN,)), out_sharding=("hidden",), sharding_rules=(("hidden", "model"),))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jnp.tanh(self.up(x)) * self.scale)


def _nnx(names: dict[str, Any], **kwargs: Any) -> zj.adapters.Adapted:
    with nnx.use_eager_sharding(False):  # no mesh here: keep the annotations, place nothing
        model = NnxMLP(names, nnx.Rngs(0))
    return zj.adapters.from_nnx(model, lambda m, b: jnp.mean(m(b["x"]) ** 2), **kwargs)


def test_nnx_sharding_metadata_gives_the_megatron_specs() -> None:
    expected = {**MEGATRON, "scale": P("model")}  # scale: its own sharding_rules
    adapted = _nnx({"mlp": "model"})
    assert adapted.param_specs == expected
    assert jax.tree.structure(adapted.param_specs) == jax.tree.structure(adapted.params)
    assert _nnx({"mlp": "mlp"}, logical_axis_rules=RULES).param_specs == expected


def test_equinox_declares_no_layout() -> None:
    model = eqx.nn.Linear(IN, 4, key=jax.random.key(0))
    adapted = zj.adapters.from_equinox(model, lambda m, b: jnp.mean(jax.vmap(m)(b["x"]) ** 2))
    assert adapted.param_specs is None


def test_logical_names_without_a_rule_name_every_leaf_and_the_missing_names() -> None:
    with pytest.raises(ValueError, match="logical axis names with no rule") as e:
        _linen(LinenMLP(LOGICAL, logical=True), logical_axis_rules=[("mlp", "model")])
    text = str(e.value)
    assert text.startswith("zj.adapters.from_linen: ")
    assert "'up/kernel' (shape (12, 40), names ('embed', 'mlp'))" in text
    assert "'down/kernel' (shape (40, 12), names ('mlp', 'embed'))" in text
    assert "'up/bias'" not in text  # ('mlp',) has its rule
    assert "missing: ['embed']" in text and "rules in effect: [('mlp', 'model')]" in text
    assert "logical_axis_rules=[('mlp', 'model'), ('embed', None)]" in text
    with pytest.raises(ValueError, match=r"missing: \['embed', 'mlp'\]; rules in effect: None"):
        _linen(LinenMLP(LOGICAL, logical=True))  # logical boxes and no rules anywhere
    with pytest.raises(ValueError, match=r"zj.adapters.from_nnx: 'down/kernel' .*missing: \['mlp'\]"):
        _nnx({"mlp": "mlp"}, logical_axis_rules=[("embed", None)])


def test_bad_layouts_are_one_error_naming_each_leaf_and_the_fix() -> None:
    data_only = jax.make_mesh((jax.device_count(),), ("data",))
    params = {
        "short": {"kernel": nn.Partitioned(jnp.zeros((4, 8)), ("model",))},
        "elsewhere": {"kernel": nn.Partitioned(jnp.zeros((8, 8)), (None, "model"), mesh=data_only)},
        "typo": {"kernel": nn.LogicallyPartitioned(jnp.zeros((8, 8)), ("embed", "typo")), "bias": jnp.zeros(8)},
    }
    with pytest.raises(ValueError) as e:
        zj.adapters.from_linen(nn.Dense(8), {"params": params}, lambda v, b: 0.0, logical_axis_rules=[("embed", None)])
    text = str(e.value)
    assert "'typo/kernel' (shape (8, 8), names ('embed', 'typo'))" in text and "missing: ['typo']" in text
    assert "'short/kernel' (shape (4, 8), names ('model',)) has 1 names for 2 dimensions" in text
    assert "as many names as it has dimensions" in text
    assert "'elsewhere/kernel' (shape (8, 8), names (None, 'model')) -> P(None, 'model') names ['model']" in text
    assert "its mesh has axes ('data',)" in text
    with pytest.raises(TypeError, match=r"sequence of \(logical_name, mesh_axis\) pairs.*got 'mlp', \('embed', 3\)"):
        _linen(LinenMLP(), logical_axis_rules=["mlp", ("embed", 3)])


# -- names as tunix and MaxText write them (issue 40, item 4) ----------------------------------------------------


class TunixMLP(nnx.Module):
    """tunix's spelling: every parameter names its axes by role, ('fsdp', 'tp') (Flax remaps tunix's
    ``sharding=`` to ``out_sharding``)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Param(init(rngs.params(), (IN, HIDDEN)), out_sharding=("fsdp", "tp"))
        self.bias = nnx.Param(jnp.zeros((HIDDEN,)), out_sharding=("tp",))
        self.down = nnx.Param(init(rngs.params(), (HIDDEN, IN)), out_sharding=("tp", "fsdp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ self.up + self.bias) @ self.down


def _tunix(**kwargs: Any) -> zj.adapters.Adapted:
    with nnx.use_eager_sharding(False):
        model = TunixMLP(nnx.Rngs(0))
    return zj.adapters.from_nnx(model, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), **kwargs)


TUNIX = {"up": P("fsdp", "tp"), "bias": P("tp"), "down": P("tp", "fsdp")}
PLACED = {"up": P(None, "model"), "bias": P("model"), "down": P("model", None)}  # on a (data, model) mesh


def _tp_mesh(names: tuple[str, str] = ("data", "model")) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), names, axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.slow
def test_fsdp_and_tp_names_are_placed_by_adapted_policy_and_train_like_optax() -> None:
    import optax

    adapted = _tunix()
    assert adapted.param_specs == TUNIX  # read as declared; no rule needed for role names
    policy = adapted.policy(3, _tp_mesh(), min_shard_size=0)
    assert policy.param_specs == PLACED  # 'fsdp' is ZeRO's own cut, 'tp' the model axis
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state, step = adapted.init_state(tx, policy), adapted.make_train_step(tx, policy)
    assert state.params["up"].sharding.spec == P("data", "model")  # ZeRO over data on the free dim, TP over model
    rng = np.random.default_rng(0)
    batches = [{"x": jnp.asarray(rng.normal(size=(16, IN)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(16, IN)), jnp.float32)} for _ in range(2)]  # fmt: skip
    params, ref_tx = adapted.params, optax.adam(1e-2)
    opt = ref_tx.init(params)
    for b in batches:
        state, metrics = step(state, b)
        loss, g = jax.value_and_grad(adapted.loss_fn)(params, b)
        updates, opt = ref_tx.update(g, opt, params)
        params = optax.apply_updates(params, updates)
        # fp32: the same loss up to the reduction order over 4 x 2 devices.
        assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    for k, ref in params.items():  # fp32, Adam lr 1e-2, 2 steps: reduction order only (measured < 1e-6)
        np.testing.assert_allclose(np.asarray(zj.full_params(state)[k]), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_role_names_on_other_meshes_and_rules_that_override_them() -> None:
    adapted = _tunix()
    # The mesh named as tunix names it: ZeRO over 'fsdp', 'tp' is a mesh axis.
    on_own = adapted.policy(3, _tp_mesh(("fsdp", "tp")), axis="fsdp", min_shard_size=0)
    assert on_own.param_specs == {"up": P(None, "tp"), "bias": P("tp"), "down": P("tp", None)}
    assert adapted.policy(3, make_mesh(8), min_shard_size=0).param_specs is None  # data-only: no model axis
    assert adapted.policy(3, _tp_mesh(), min_shard_size=0, param_specs=None).param_specs is None  # explicit wins
    # A rule wins over the default: 'tp' left unsharded.
    ruled = _tunix(logical_axis_rules=[("tp", None)])
    assert ruled.param_specs == {"up": P("fsdp", None), "bias": P(None), "down": P(None, "fsdp")}
    assert ruled.policy(3, _tp_mesh(), min_shard_size=0).param_specs == {
        "up": P(None, None), "bias": P(None), "down": P(None, None)}  # fmt: skip
    # Linen's nn.with_partitioning with the same names reads and places alike.
    linen = _linen(LinenMLP((("embed", "fsdp"), ("mlp", "tp"))))
    assert linen.param_specs == {"up": {"kernel": P("fsdp", "tp"), "bias": P("tp")},
                                 "down": {"kernel": P("tp", "fsdp"), "bias": P()}}  # fmt: skip
    assert linen.policy(3, _tp_mesh(), min_shard_size=0).param_specs == MEGATRON


def test_an_unknown_axis_name_is_one_line_naming_the_leaf_and_the_fix() -> None:
    adapted = _nnx({"mlp": "hidden_units"})  # neither a mesh axis nor a role name
    with pytest.raises(ValueError) as e:
        adapted.policy(3, _tp_mesh(), min_shard_size=0)
    text = str(e.value)
    assert "\n" not in text and text.startswith("adapted.policy: ")
    assert "'up/kernel' names 'hidden_units' (in P(None, 'hidden_units'))" in text
    assert "'down/kernel' names 'hidden_units'" in text and "'up/bias' names 'hidden_units'" in text
    assert "logical_axis_rules=[(name, mesh_axis or None), ...] in from_nnx / from_linen" in text
