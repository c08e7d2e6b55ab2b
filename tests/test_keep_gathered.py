"""keep_gathered: the last k blocks keep their gathered parameters from the forward pass for the backward
(zj.scan_layers, zj.apply_layer(s), the adapters' layers=, make_train_step's gather="all"), the audit's view
of it, zj.keep_gathered_trade and zj.choose_keep_gathered's budgeted choice."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh

import zero_jax as zj
from zero_jax._cli import cli
from zero_jax._plan.budget import KeepGatheredChoice, compile_candidate, search_candidates
from zero_jax._processes.child import resolve

N, D, DEPTH = 8, 32, 4
BLOCK_BYTES = (D * D + D) * 4  # one block's gathered w and b (float32; both divide by 8: no padding)
WEIGHTS = 2  # partitioned leaves per block


def _block(p: dict, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["w"] + p["b"])


def _params(mode: str) -> dict:
    w = jax.random.normal(jax.random.key(0), (DEPTH, D, D)) / np.sqrt(D)
    b = 0.1 * jax.random.normal(jax.random.key(1), (DEPTH, D))
    if mode == "scan_layers":
        return {"layers": {"w": w, "b": b}}
    return {"blocks": [{"w": w[i], "b": b[i]} for i in range(DEPTH)]}


def _batch(seed: int = 2) -> dict:
    return {"x": jax.random.normal(jax.random.key(seed), (16, D))}


def _loss(policy, mode: str, keep, prefetch: int = 1):
    def loss_fn(params: dict, batch: dict) -> jax.Array:
        if mode == "scan_layers":
            x = zj.scan_layers(_block, params["layers"], batch["x"], policy, prefetch=prefetch, keep_gathered=keep)
        else:
            x = zj.apply_layers(_block, params["blocks"], batch["x"], policy, prefetch=prefetch, keep_gathered=keep)
        return jnp.mean(x**2)

    return loss_fn


@functools.cache
def _run(mode: str, keep, stage: int = 3, steps: int = 2):
    """The audit of the step and its state after ``steps`` Adam steps (parameters and optimizer state, numpy)."""
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=0, stacked="layers" if mode == "scan_layers" else ())
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_params(mode), tx, policy)
    step = zj.make_train_step(_loss(policy, mode, keep), tx, policy, gather="manual")
    report = zj.audit(step, state, _batch(), grads=False)
    for seed in (2, 3)[:steps]:
        state, _ = step(state, _batch(seed))
    trained = [np.asarray(x) for x in jax.tree.leaves((zj.full_params(state), state.opt_state))]
    return report, trained


def _gathers(report) -> int:
    return sum(b.forward + b.backward for b in report.layers.blocks)


def _blocks(count: float) -> str:
    """A byte budget of ``count`` blocks."""
    return f"{count * BLOCK_BYTES / 1024}KiB"


# One kept block; depth - 1 as a budget (the other layers: a one-trip loop); two as a budget of 2.5 blocks.
@pytest.mark.parametrize(
    ("mode", "keep", "k"), [("scan_layers", 1, 1), ("scan_layers", _blocks(3.5), 3), ("apply_layers", _blocks(2.5), 2)]
)
def test_keeping_k_blocks_saves_k_regathers_exactly_for_at_most_k_blocks_and_trains_the_same_bits(
    mode: str, keep, k: int
) -> None:
    base, trained0 = _run(mode, 0)
    report, trained = _run(mode, keep)
    assert _gathers(base) == 2 * DEPTH * WEIGHTS and base.layers.kept == 0
    assert _gathers(report) == _gathers(base) - k * WEIGHTS
    assert report.layers.kept == k and f"+ {k} kept" in str(report)
    trade = zj.keep_gathered_trade(BLOCK_BYTES, N, depth=DEPTH, ks=[k])[0]
    assert base.comm.measured - report.comm.measured == trade.comm_saved == k * (N - 1) / N * BLOCK_BYTES
    assert report.memory["peak"] - base.memory["peak"] <= 1.1 * trade.memory_spent
    assert not report.violations  # the kept blocks' missing re-gathers and their memory are by design
    assert all(np.array_equal(a, b) for a, b in zip(trained, trained0, strict=True))  # bitwise


def test_the_audit_names_each_kept_block() -> None:
    report, _ = _run("apply_layers", _blocks(2.5))
    assert [b.name for b in report.layers.blocks if b.kept] == [f"block {DEPTH - 2}", f"block {DEPTH - 1}"]
    assert [(b.forward, b.backward) for b in report.layers.blocks] == [(WEIGHTS, WEIGHTS)] * 2 + [(WEIGHTS, 0)] * 2
    assert "kept gathered (no backward re-gather)" in "\n".join(report.layers.lines())


@pytest.mark.parametrize("mode", ["scan_layers", "apply_layers"])
@pytest.mark.parametrize(
    ("keep", "words"),
    [
        (-1, "keep_gathered must be an int from 0 to the number of blocks (4)"),
        (5, "got 5"),
        (1.5, "or a byte budget such as '2GiB'"),
        ("2048", "(no unit)"),
        ("two blocks", "(not a size)"),
        ("-1KiB", "(it is negative)"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_fix(mode: str, keep, words: str) -> None:
    params = _params(mode)
    with pytest.raises(ValueError, match="keep_gathered") as e:
        _loss(None, mode, keep)(params, _batch())
    assert words in str(e.value) and "\n" not in str(e.value)
    assert ("pass an int k" in str(e.value)) or ("keeps the last k blocks" in str(e.value))


def test_apply_layer_keeps_one_block_with_true() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)

    def loss_fn(params: dict, batch: dict) -> jax.Array:
        x = batch["x"]
        for i, p in enumerate(params["blocks"]):
            x = zj.apply_layer(_block, p, x, policy=policy, keep_gathered=i == DEPTH - 1)
        return jnp.mean(x**2)

    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    report = zj.audit(step, zj.init_state(_params("apply_layers"), tx, policy), _batch(), prefetch=0, grads=False)
    assert report.layers.kept == 1 and _gathers(report) == (2 * DEPTH - 1) * WEIGHTS


def test_stage_2_accepts_and_ignores_it() -> None:
    report, _ = _run("scan_layers", 2, stage=2, steps=0)
    assert report.layers.kept == 0 and _gathers(report) == 0


def _plain_loss(params: dict, batch: dict) -> jax.Array:
    x = batch["x"]
    for p in params["blocks"]:
        x = _block(p, x)
    return jnp.mean(x**2)


def test_gather_all_keep_gathered_skips_the_backward_regather_and_trains_the_same_bits() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    out = {}
    for keep in (False, True):
        state = zj.init_state(_params("apply_layers"), tx, policy)
        step = zj.make_train_step(_plain_loss, tx, policy, keep_gathered=keep)
        report = zj.audit(step, state, _batch(), grads=False)
        for seed in (2, 3):
            state, _ = step(state, _batch(seed))
        out[keep] = report, [np.asarray(x) for x in jax.tree.leaves(zj.full_params(state))]
    # 2Ψ: one gather and one reduce-scatter of every block (and a few scalar all-reduces: the loss, the norm).
    assert abs(out[True][0].comm.measured - 2 * DEPTH * (N - 1) / N * BLOCK_BYTES) <= 64
    assert out[True][0].comm.measured < out[False][0].comm.measured
    assert all(np.array_equal(a, b) for a, b in zip(out[True][1], out[False][1], strict=True))


@pytest.mark.parametrize(
    ("stage", "gather", "keep", "words"),
    [
        (3, "manual", True, "Pass keep_gathered=k to zj.scan_layers / zj.apply_layers"),
        (2, "all", True, "stage 2 hands the loss parameters it already holds whole"),
        (3, "all", 1, "got 1. Pass True or False."),
    ],
)
def test_make_train_step_keep_gathered_is_for_gather_all_at_stage_3(stage, gather, keep, words) -> None:
    policy = zj.ZeroPolicy(stage, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    with pytest.raises(ValueError, match="make_train_step: keep_gathered=True") as e:
        zj.make_train_step(_plain_loss, tx, policy, gather=gather, keep_gathered=keep)
    assert words in str(e.value)


def test_the_trade_per_k_and_its_errors() -> None:
    trades = zj.keep_gathered_trade([100, 200, 300], 4)
    assert [(t.kept, t.comm_saved, t.memory_spent) for t in trades] == [
        (0, 0.0, 0.0), (1, 225.0, 300.0), (2, 375.0, 500.0), (3, 450.0, 600.0),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="ks must be ints from 0 to the number of blocks"):
        zj.keep_gathered_trade("1MiB", 8, depth=4, ks=[5])
    with pytest.raises(TypeError, match="pass depth="):
        zj.keep_gathered_trade("1MiB", 8)


def test_nnx_layers_keep_gathered() -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.lin = nnx.Linear(D, D, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + jnp.tanh(self.lin(x))

    class Net(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(0)
            self.blocks = nnx.List([Block(rngs) for _ in range(3)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for block in self.blocks:
                x = block(x)
            return x

    loss = lambda model, batch: jnp.mean(model(batch["x"]) ** 2)  # noqa: E731
    adapted = zj.adapters.from_nnx(Net(), loss, layers="blocks/*", keep_gathered=2)
    policy = adapted.policy(3, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    report = zj.audit(adapted.make_train_step(tx, policy), adapted.init_state(tx, policy), _batch(), grads=False)
    assert report.layers.kept == 2 and _gathers(report) == (2 * 3 - 2) * WEIGHTS
    with pytest.raises(ValueError, match="keep_gathered=2 keeps the last blocks of layers="):
        zj.adapters.from_nnx(Net(), loss, keep_gathered=2)
    with pytest.raises(ValueError, match=r"number of blocks \(3\)"):
        zj.adapters.from_nnx(Net(), loss, layers="blocks/*", keep_gathered=4)


def budget_factory(stage: int, mesh, *, keep_gathered=0, prefetch: int = 1):
    """A choose_keep_gathered factory: this file's scanned model, abstract."""
    policy = zj.ZeroPolicy(stage, mesh, min_shard_size=0, stacked="layers")
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(jax.eval_shape(lambda: _params("scan_layers")), tx, policy)
    step = zj.make_train_step(_loss(policy, "scan_layers", keep_gathered, prefetch), tx, policy, gather="manual")
    x = jax.ShapeDtypeStruct((16, D), jnp.float32, sharding=policy.batch_sharding())
    return step, state, {"x": x}


def test_a_budget_picks_the_largest_k_whose_compiled_peak_fits() -> None:
    factory = f"{__name__}:budget_factory"
    base = compile_candidate(resolve(factory), make_mesh(N), 3, {}, 0, 1)
    budget = base.peak + 1.5 * BLOCK_BYTES
    rows = search_candidates(factory, {}, 3, budget, DEPTH, (1, 0))
    choice = KeepGatheredChoice(budget, N, DEPTH, tuple(rows), 0.0)
    chosen = choice.chosen
    assert chosen is not None and chosen.peak <= budget and 1 <= chosen.keep_gathered < DEPTH
    more = {(c.keep_gathered, c.prefetch): c for c in rows}[chosen.keep_gathered + 1, chosen.prefetch]
    assert more.peak > budget  # the next k was compiled and does not fit
    assert all(c.keep_gathered <= chosen.keep_gathered for c in rows if c.peak <= budget)
    assert f"keep_gathered={chosen.keep_gathered}, prefetch={chosen.prefetch}: compiled peak" in str(choice)
    short = KeepGatheredChoice(base.peak / 2, N, DEPTH, tuple(rows), 0.0)
    with pytest.raises(ValueError, match="no keep_gathered / prefetch pair fits .* over\\). A budget of"):
        short.check()


def test_the_cli_flag_needs_compile(capsys) -> None:
    assert cli.main(["plan", "--params", "7e9", "--device-memory", "80GB", "--keep-gathered"]) == 2
    assert "--keep-gathered compiles the reference transformer's stage-3 step" in capsys.readouterr().err


def test_a_budget_on_a_tpu_slice_is_judged_by_the_tpu_compiler() -> None:
    """topology=: each candidate compiled for v5p:2x2x2's devices with the TPU compiler, here, and judged on the
    HBM its buffer assignment allocates; an ample budget keeps every block (2 compiles: k = 0 and k = depth)."""
    factory = f"{__name__}:budget_factory"
    rows = search_candidates(factory, {}, 3, 2**30, DEPTH, (1,), "v5p:2x2x2")
    choice = KeepGatheredChoice(2**30, N, DEPTH, tuple(rows), 0.0, "v5p:2x2x2")
    assert choice.keep_gathered == DEPTH and {c.keep_gathered for c in rows} == {0, DEPTH}
    kept, none = ({c.keep_gathered: c for c in rows}[k] for k in (DEPTH, 0))
    # No backward re-gather: half the gathers (on TPU this toy's small leaves travel in one gather a block).
    assert kept.all_gathers == none.all_gathers // 2 == DEPTH
    # The HBM the TPU compiler allocates for the step (this toy's buffer assignment packs its 4 kept blocks in
    # about as much as none: 0.4% less with the schedule's options), not XLA:CPU's figure.
    on_tpu = compile_candidate(resolve(factory), zj.topology_mesh("v5p:2x2x2"), 3, {}, DEPTH, 1)
    on_cpu = compile_candidate(resolve(factory), make_mesh(N), 3, {}, DEPTH, 1)
    assert kept.peak == on_tpu.peak != on_cpu.peak and none.peak > 0
    assert str(choice).startswith("zj.choose_keep_gathered: v5p:2x2x2, 4 blocks")
    with pytest.raises(ValueError, match="choose_keep_gathered: topology v5p:2x2x2 has 8 devices, but num_devices=4"):
        zj.choose_keep_gathered("1GiB", num_devices=4, topology="v5p:2x2x2")
