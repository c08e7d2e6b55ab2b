"""QLoRA (issue 40, item 3): a base quantized to int8 codes + float32 scales (a pytree, as a user or a
quantization library writes it) with LoRA adapters beside it. Stage 3 partitions the codes and the scales (1/N of
them per device) and gathers them together on use, block by block; before, the contract kept every non-float leaf
whole on every device, so the quantized base was replicated. The LoRA parameters train as plain optax trains the
same QLoRA model on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh
from flax import nnx

import zero_jax as zj

N, D, RANK, DEPTH = 8, 64, 4, 3


def _quantize(w: np.ndarray) -> dict:
    scale = np.abs(w).max(axis=0, keepdims=True) / 127  # one scale per output column
    return {"codes": jnp.asarray(np.round(w / scale), jnp.int8), "scale": jnp.asarray(scale, jnp.float32)}


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {"blocks": [{"base": _quantize(rng.normal(size=(D, D)) / 8),
                        "a": jnp.asarray(rng.normal(size=(D, RANK)) / 8, jnp.float32),
                        "b": jnp.zeros((RANK, D), jnp.float32)} for _ in range(DEPTH)]}  # fmt: skip


def _block(p: dict, x: jax.Array) -> jax.Array:
    w = p["base"]["codes"].astype(jnp.float32) * p["base"]["scale"] + p["a"] @ p["b"]
    return x + jnp.tanh(x @ w)


def _batches() -> list[dict]:
    rng = np.random.default_rng(1)
    return [{"x": jnp.asarray(rng.normal(size=(16, D)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(16, D)), jnp.float32)} for _ in range(2)]  # fmt: skip


def _plain_loss(params: dict, batch: dict) -> jax.Array:
    x = batch["x"]
    for p in params["blocks"]:
        x = _block(p, x)
    return jnp.mean((x - batch["y"]) ** 2)


def _reference(params: dict, batches: list[dict]) -> tuple[list[dict], list[float]]:
    """Plain optax on one device, training the LoRA pair of each block only."""
    lora = [{"a": p["a"], "b": p["b"]} for p in params["blocks"]]
    tx = optax.adam(1e-2)
    opt, losses = tx.init(lora), []

    def loss(lora: list[dict], batch: dict) -> jax.Array:
        blocks = [{"base": p["base"], **q} for p, q in zip(params["blocks"], lora, strict=True)]
        return _plain_loss({"blocks": blocks}, batch)

    for b in batches:
        value, g = jax.value_and_grad(loss)(lora, b)
        updates, opt = tx.update(g, opt, lora)
        lora = optax.apply_updates(lora, updates)
        losses.append(float(value))
    return lora, losses


def _per_device(leaves: list[jax.Array]) -> int:
    """The largest bytes any device holds of ``leaves``."""
    return max(zj.measure.resident_bytes(leaves).values())


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_a_quantized_base_is_partitioned_at_stage_3_and_lora_trains_like_optax(stage: int) -> None:
    params, batches = _params(), _batches()
    ref_lora, ref_losses = _reference(params, batches)
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=0)
    mask = {"blocks": [{"base": {"codes": False, "scale": False}, "a": True, "b": True} for _ in range(DEPTH)]}
    tx = zj.shard_optimizer(optax.adam(1e-2), policy, trainable=mask)
    state = zj.init_state(params, tx, policy)

    def loss_fn(p: dict, batch: dict) -> jax.Array:
        return jnp.mean((zj.apply_layers(_block, p["blocks"], batch["x"], policy) - batch["y"]) ** 2)

    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))

    base = [x for blk in state.params["blocks"] for x in jax.tree.leaves(blk["base"])]
    whole = DEPTH * (D * D * 1 + D * 4)  # int8 codes and float32 scales
    assert sum(x.nbytes for x in base) == whole
    # Stage 3: 1/N of the codes and of the scales on each device (both divide by 8); stage 1 keeps them whole.
    assert _per_device(base) == (whole // N if stage == 3 else whole)
    full = zj.full_params(state)
    for blk, start, ref in zip(full["blocks"], params["blocks"], ref_lora, strict=True):
        assert blk["base"]["codes"].dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(blk["base"]["codes"]), np.asarray(start["base"]["codes"]))
        np.testing.assert_array_equal(np.asarray(blk["base"]["scale"]), np.asarray(start["base"]["scale"]))
        for k in ("a", "b"):  # fp32, Adam lr 1e-2, 2 steps: reduction order only. Measured <= 4e-8 absolute.
            np.testing.assert_allclose(np.asarray(blk[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    # The formula counts the base with the parameters (frozen: no gradient, no optimizer state).
    lora_elems = DEPTH * 2 * D * RANK
    frozen_elems = DEPTH * (D * D + D)
    formula = zj.model_state_bytes(lora_elems, N, stage, param_bytes=4, grad_bytes=4, optimizer_bytes=8,
                                   frozen_params=frozen_elems, frozen_bytes=whole / frozen_elems)  # fmt: skip
    assert formula.params == pytest.approx(_per_device(jax.tree.leaves(state.params)))
    assert formula.optimizer == pytest.approx(8 * lora_elems / N)  # Adam's moments of the LoRA pairs only
    # The audit counts the codes as parameters (frozen: gathered, never reduced): communication at the theory,
    # codes and scales gathered together block by block, the frozen base reported apart.
    report = zj.audit(step, state, batches[0], min_shard_size=0).check()
    assert report.frozen_bytes == (whole // N if stage == 3 else whole)
    if stage == 3:
        gathered = {c.dtype for c in report.collectives if c.kind == "all-gather"}
        assert gathered == {"f32", "s8"}, gathered
        assert report.layers is not None and report.layers.max_alive <= 2


class QLoRALinear(nnx.Module):
    """A quantized base the NNX way: int8 codes and float32 scales in ``nnx.Param``s, LoRA beside them."""

    def __init__(self, w: np.ndarray, rngs: nnx.Rngs) -> None:
        base = _quantize(w)
        self.codes, self.scale = nnx.Param(base["codes"]), nnx.Param(base["scale"])
        self.a = nnx.LoRAParam(jax.random.normal(rngs.params(), (D, RANK)) / 8)
        self.b = nnx.LoRAParam(jnp.zeros((RANK, D)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(x @ (self.codes[...].astype(jnp.float32) * self.scale[...] + self.a[...] @ self.b[...]))


class QNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        rng = np.random.default_rng(0)
        self.blocks = nnx.List([QLoRALinear(rng.normal(size=(D, D)) / 8, rngs) for _ in range(DEPTH)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.slow
def test_a_quantized_nnx_base_frozen_by_lora_param_is_partitioned_at_stage_3() -> None:
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    adapted = zj.adapters.from_nnx(QNet(nnx.Rngs(0)), loss, trainable=nnx.LoRAParam, layers="auto")
    assert adapted.frozen["blocks"][0] == {"codes": True, "scale": True, "a": False, "b": False}
    policy = adapted.policy(3, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state, step = adapted.init_state(tx, policy), adapted.make_train_step(tx, policy)
    batches, losses = _batches(), []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    base = [x for blk in state.params["blocks"].values() for k, x in blk.items() if k in ("codes", "scale")]
    assert _per_device(base) == DEPTH * (D * D + D * 4) // N  # 1/N of codes and scales per device

    graphdef, lora, rest = nnx.split(QNet(nnx.Rngs(0)), nnx.LoRAParam, ...)
    ref_tx = optax.adam(1e-2)
    opt, ref_losses = ref_tx.init(lora), []
    for b in batches:
        value, g = jax.value_and_grad(lambda lo, b=b: loss(nnx.merge(graphdef, lo, rest), b))(lora)
        updates, opt = ref_tx.update(g, opt, lora)
        lora = optax.apply_updates(lora, updates)
        ref_losses.append(float(value))
    ref = nnx.to_pure_dict(lora)
    full = zj.full_params(state)
    for i in range(DEPTH):  # fp32, Adam lr 1e-2, 2 steps: reduction order only
        for k in ("a", "b"):
            np.testing.assert_allclose(np.asarray(full["blocks"][i][k]), np.asarray(ref["blocks"][i][k]), rtol=1e-5,
                                       atol=1e-6)  # fmt: skip
    assert losses == pytest.approx(ref_losses, rel=1e-5)
