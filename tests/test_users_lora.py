"""LoRA as users write it (issue 40, item 2): ``from_nnx(model, loss, trainable=nnx.LoRAParam)`` and the same
model frozen with ``shard_optimizer(trainable=mask)``. Both put the frozen base in ``params``: stage 3 holds 1/N of
it per device (it was whole on every device in ``adapted.non_trainable`` before), with no gradient, no optimizer
state and no gradient communication, and trains the LoRA parameters as plain optax does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh
from flax import nnx

import zero_jax as zj

N, D, RANK = 8, 64, 4


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.LoRALinear(D, D, lora_rank=RANK, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.lin(jnp.tanh(x))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(rngs) for _ in range(3)])
        self.head = nnx.LoRALinear(D, 8, lora_rank=RANK, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(model: Net, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batches() -> list[dict]:
    keys = jax.random.split(jax.random.key(1), 4)
    return [{"x": jax.random.normal(keys[2 * i], (16, D)), "y": jax.random.normal(keys[2 * i + 1], (16, 8))}
            for i in range(2)]  # fmt: skip


def _reference(batches: list[dict]) -> tuple[dict, dict, list[float]]:
    """Plain optax on one device, training only the LoRA parameters: (lora, base, losses)."""
    graphdef, lora, base = nnx.split(Net(nnx.Rngs(0)), nnx.LoRAParam, ...)
    tx = optax.adam(1e-2)
    opt, losses = tx.init(lora), []

    @jax.jit
    def step(lora, opt, batch):
        loss, g = jax.value_and_grad(lambda lo: _loss(nnx.merge(graphdef, lo, base), batch))(lora)
        updates, opt = tx.update(g, opt, lora)
        return optax.apply_updates(lora, updates), opt, loss

    for b in batches:
        lora, opt, loss = step(lora, opt, b)
        losses.append(float(loss))
    return nnx.to_pure_dict(lora), nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, lora, base), nnx.Param)), losses


def _per_device(leaves: list[jax.Array]) -> int:
    """The largest bytes any device holds of ``leaves``."""
    return max(zj.measure.resident_bytes(leaves).values())


def _paths(tree: dict) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.slow
@pytest.mark.parametrize("form", ["LoRAParam", "mask"])
def test_the_frozen_base_is_partitioned_at_stage_3_and_lora_trains_like_optax(form: str) -> None:
    batches = _batches()
    ref_lora, ref_all, ref_losses = _reference(batches)
    if form == "LoRAParam":
        adapted = zj.adapters.from_nnx(Net(nnx.Rngs(0)), _loss, trainable=nnx.LoRAParam, layers="auto")
        frozen = adapted.frozen
        assert adapted.non_trainable == nnx.State({})  # the base is no longer whole on every device
    else:  # every Param adapted, the base frozen by the optimizer
        adapted = zj.adapters.from_nnx(Net(nnx.Rngs(0)), _loss, layers="auto")
        assert adapted.frozen is None
        frozen = jax.tree_util.tree_map_with_path(lambda p, _: "lora_" not in jax.tree_util.keystr(p), adapted.params)
    policy = adapted.policy(3, make_mesh(N), min_shard_size=0)
    mask = jax.tree.map(lambda f: not f, frozen)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy, **({"trainable": mask} if form == "mask" else {}))
    state, step = adapted.init_state(tx, policy), adapted.make_train_step(tx, policy)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))

    flat = dict(zip(_paths(state.params), jax.tree.leaves(state.params), strict=True))
    is_frozen = dict(zip(_paths(frozen), jax.tree.leaves(frozen), strict=True))
    base = [x for k, x in flat.items() if is_frozen[k]]
    base_bytes = sum(x.nbytes for x in base)
    assert len(base) == 8 and base_bytes == 4 * (D * D + D) * 3 + 4 * (D * 8 + 8)  # 3 blocks and the head
    assert _per_device(base) == base_bytes // N  # 1/N per device (every base leaf divides by 8: no padding)
    # No optimizer state for the base: Adam's two moments cover the LoRA parameters only.
    lora_elems = sum(x.size for k, x in flat.items() if not is_frozen[k])
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * lora_elems
    # No gradient and no gradient communication for the base: the step's gradients are None there.
    grads = jax.tree.leaves(step.grads(state, batches[0]), is_leaf=lambda x: x is None)
    assert [g is None for g in grads] == list(jax.tree.leaves(frozen))

    # fp32, Adam lr 1e-2, 2 steps of 16 rows: per-block reduction order against one device. Measured <= 2e-6.
    full = zj.full_params(state)
    full_flat = dict(zip(_paths(full), jax.tree.leaves(full), strict=True))
    ref = dict(zip(_paths(ref_all), jax.tree.leaves(ref_all), strict=True))
    start = dict(zip(_paths(adapted.params), jax.tree.leaves(adapted.params), strict=True))
    for k, x in full_flat.items():
        if is_frozen[k]:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(start[k]))  # the base never moves
        else:
            moved = np.linalg.norm(np.asarray(ref[k]) - np.asarray(start[k]))
            assert np.linalg.norm(np.asarray(x) - np.asarray(ref[k])) <= 1e-5 * max(moved, 1e-30), k
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert len(ref_lora["head"]["lora"]) == 2
    # The audit counts the frozen base apart, inside the parameters' bytes.
    report = zj.audit(step, state, batches[0], min_shard_size=0)
    assert report.frozen_bytes == base_bytes // N
    assert "\n    of which frozen (no gradient, no optimizer state) 6.35 KiB\n" in str(report)


def test_a_lora_filter_that_matches_nothing_is_one_line_naming_the_fix() -> None:
    plain = nnx.Linear(D, D, rngs=nnx.Rngs(0))  # no LoRA layers: nnx.LoRAParam matches nothing
    with pytest.raises(ValueError) as e:
        zj.adapters.from_nnx(plain, lambda m, b: jnp.mean(m(b["x"]) ** 2), trainable=nnx.LoRAParam)
    text = str(e.value)
    assert "\n" not in text and text.startswith("zj.adapters.from_nnx: trainable=")
    assert "LoRAParam" in text and "matches no variable of the model (its variables are ['Param'])" in text
    assert "nnx.LoRA / nnx.LoRALinear" in text
