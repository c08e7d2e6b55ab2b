"""from_nnx(..., layers=...): an unscanned NNX model (a Python loop over an nnx.List of blocks) trained
block-wise in a gather="manual" step, against gather="all" and plain optax."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import compile_adapted, reference_run, relative_update_error, train_adapted
from flax import nnx

import zero_jax as zj

D = 16


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs, bn: bool = False) -> None:
        self.lin = nnx.Linear(d, d, use_bias=not bn, rngs=rngs)  # a bias before batch norm has no gradient
        self.bn = nnx.BatchNorm(d, momentum=0.5, rngs=rngs) if bn else None
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x: jax.Array, *, scale: float = 1.0) -> jax.Array:
        h = self.lin(x)
        if self.bn is not None:
            h = self.bn(h)
        return x + scale * self.out(jnp.tanh(h))


class Net(nnx.Module):
    """Unscanned, as people write it: blocks in an nnx.List, called in a Python loop."""

    def __init__(self, depth: int = 3, d: int = D, bn: bool = False, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Linear(8, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs, bn) for _ in range(depth)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x, scale=0.5)
        return self.head(self.ln_f(x))


def loss(model: Net, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches(n: int = 2, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
            "y": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32),
        }
        for _ in range(n)
    ]


def _err(a, b, start) -> float:
    return max(relative_update_error(a, b, start).values())


# Both stages and both accumulation counts, pairwise: (3, 1) and (2, 2) (the layer-wise code of stage 2 and 3
# differs in the gather, accumulation in the gradient's loop; neither depends on the other).
@pytest.mark.parametrize(("stage", "accum"), [(3, 1), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_nnx_layerwise_equals_gather_all_and_optax(stage: int, accum: int) -> None:
    model, batches = Net(), _batches()
    adapted = zj.adapters.from_nnx(model, loss, layers="blocks/*")
    layerwise, step, losses = train_adapted(adapted, stage, batches, accum_steps=accum)
    assert step.gather == "manual"  # the default with layers=
    whole, _, losses_all = train_adapted(adapted, stage, batches, accum_steps=accum, gather="all")
    ref, ref_losses = reference_run(
        optax.adam(1e-2), adapted.params, batches, lambda p, b: loss(adapted.to_model(p), b)
    )
    assert _err(zj.full_params(layerwise), zj.full_params(whole), adapted.params) <= 1e-5
    assert _err(zj.full_params(layerwise), ref, adapted.params) <= 1e-5
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(losses, losses_all, rtol=1e-6)


@pytest.mark.slow
def test_nnx_layerwise_bf16_compute_matches_gather_all() -> None:
    model, batches = Net(), _batches()
    adapted = zj.adapters.from_nnx(model, loss, layers="auto")
    bf16 = zj.Precision(compute_dtype=jnp.bfloat16)
    layerwise, _, losses = train_adapted(adapted, 3, batches, precision=bf16)
    whole, _, losses_all = train_adapted(adapted, 3, batches, precision=bf16, gather="all")
    fp32, _, _ = train_adapted(adapted, 3, batches, gather="all")
    start = adapted.params
    gap = _err(zj.full_params(layerwise), zj.full_params(whole), start)
    # The same bf16 arithmetic, block by block (measured: bitwise equal, 0.0; bf16 vs fp32 is 5e-3 to 1.3e-2).
    assert gap <= 1e-4 and gap < 0.01 * _err(zj.full_params(whole), zj.full_params(fp32), start)
    np.testing.assert_allclose(losses, losses_all, rtol=1e-4)


@pytest.mark.slow
def test_nnx_batch_norm_inside_blocks() -> None:
    model, batches = Net(bn=True), _batches(3)
    adapted = zj.adapters.from_nnx(model, loss, layers=Block)
    assert adapted.stateful and adapted.layers.count == 3
    layerwise, _, losses = train_adapted(adapted, 3, batches)
    whole, _, losses_all = train_adapted(adapted, 3, batches, gather="all")
    assert _err(zj.full_params(layerwise), zj.full_params(whole), adapted.params) <= 1e-5
    for a, b, start in zip(
        jax.tree.leaves(layerwise.model_state),
        jax.tree.leaves(whole.model_state),
        jax.tree.leaves(adapted.model_state),
        strict=True,
    ):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * float(jnp.max(jnp.abs(b - start)))
    np.testing.assert_allclose(losses, losses_all, rtol=1e-6)
    trained = adapted.to_model(layerwise)
    np.testing.assert_allclose(trained.blocks[1].bn.mean[...], whole.model_state["blocks"][1]["bn"]["mean"], rtol=1e-5)


def test_nnx_layers_by_class_pattern_and_auto_and_plain_outside_a_step() -> None:
    model, batch = Net(), _batches(1)[0]
    found = [zj.adapters.from_nnx(model, loss, layers=spec).layers for spec in (Block, "blocks/*", "auto")]
    assert {f.paths for f in found} == {("blocks/0", "blocks/1", "blocks/2")}
    assert found[0].count == 3 and found[0].bytes_per_layer == (2 * D * D + 2 * D) * 4
    assert zj.adapters.from_nnx(model, loss).layers is None
    adapted = zj.adapters.from_nnx(model, loss, layers="auto")
    # Outside a manual step the model runs as written, bit for bit.
    assert jnp.array_equal(adapted.loss_fn(adapted.params, batch), loss(model, batch))
    g1 = jax.grad(adapted.loss_fn)(adapted.params, batch)
    g2 = jax.grad(zj.adapters.from_nnx(model, loss).loss_fn)(adapted.params, batch)
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True))
    assert type(adapted.to_model(adapted.params).blocks[0]) is Block


def test_nnx_layers_bad_input() -> None:
    model = Net()
    with pytest.raises(ValueError, match=r"layers='h/\*' matches no block.*Repeated subtrees found: 'blocks/\*'"):
        zj.adapters.from_nnx(model, loss, layers="h/*")
    mixed = Net()
    mixed.blocks[2] = Block(8, nnx.Rngs(1))  # another width
    # Numbered blocks of one name may differ (each runs as its own block: issue 29); "auto" leaves the odd one
    # whole and says so.
    assert zj.adapters.from_nnx(mixed, loss, layers="blocks/*").layers.paths == ("blocks/0", "blocks/1", "blocks/2")
    with pytest.warns(UserWarning, match=r"left 1 numbered subtree\(s\) beside its blocks whole: 'blocks/2'"):
        assert zj.adapters.from_nnx(mixed, loss, layers="auto").layers.paths == ("blocks/0", "blocks/1")
    for prefetch in (-1, 4):
        with pytest.raises(ValueError, match=r"prefetch must be an int from 0 to the number of blocks \(3\)"):
            zj.adapters.from_nnx(model, loss, layers="auto", prefetch=prefetch)
    with pytest.raises(ValueError, match=r"stacked='blocks' names unscanned blocks.*layers='blocks/\*'"):
        zj.adapters.from_nnx(model, loss, stacked="blocks")
    plain = zj.adapters.from_nnx(model, loss)
    with pytest.raises(ValueError, match=r"blocks are unscanned and undeclared.*layers='auto'"):
        train_adapted(plain, 3, _batches(1), gather="manual")


@pytest.mark.slow
def test_nnx_layerwise_memory_and_gathers_per_block() -> None:
    model, batch = Net(depth=8, d=64), _batches(1)[0]
    adapted = zj.adapters.from_nnx(model, loss, layers="auto")
    layerwise = compile_adapted(adapted, batch)
    whole = compile_adapted(adapted, batch, gather="all")
    temp, temp_all = layerwise.memory_analysis().temp_size_in_bytes, whole.memory_analysis().temp_size_in_bytes
    assert temp < 0.5 * temp_all, (temp, temp_all)
    text = layerwise.as_text()
    for i in range(8):
        forward = re.findall(rf"= (\S+) all-gather\([^\n]*jvp\(zj_block{i}_gather", text)
        backward = re.findall(rf"= (\S+) all-gather\([^\n]*zj_block\d+_compute\)\)/zj_block{i}_gather", text)
        # Each of the 4 weights once before the block's forward; in its backward the two kernels again (the
        # output bias is not needed by the vector-Jacobian product, so XLA drops its re-gather).
        assert sorted(forward) == ["f32[64,64]{1,0}"] * 2 + ["f32[64]{0}"] * 2, (i, forward)
        assert sorted(backward)[:2] == ["f32[64,64]{1,0}"] * 2 and len(backward) == 3, (i, backward)


class DropBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.drop(jnp.tanh(self.lin(x)))


class DropNet(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0, dropout=1)
        self.embed = nnx.Linear(8, D, rngs=rngs)
        self.blocks = nnx.List([DropBlock(rngs) for _ in range(3)])
        self.head = nnx.Linear(D, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.slow
def test_nnx_dropout_rng_counts_inside_blocks() -> None:
    adapted = zj.adapters.from_nnx(DropNet(), loss, layers="auto")
    batches = _batches()
    layerwise, _, losses = train_adapted(adapted, 3, batches)
    whole, _, losses_all = train_adapted(adapted, 3, batches, gather="all")
    # The same dropout masks: each block's uint32 RNG count goes into its call and comes back exactly.
    assert losses == losses_all
    assert _err(zj.full_params(layerwise), zj.full_params(whole), adapted.params) <= 1e-6
    counts = jax.tree.leaves(layerwise.model_state)
    assert [(c.dtype, int(c)) for c in counts] == [(jnp.dtype(jnp.uint32), 2)] * 3
    assert counts == jax.tree.leaves(whole.model_state)
