"""ZeRO++'s hpZ (``ZeroPolicy(secondary_axis=...)``) on (node, chip) meshes of
(2, 4) and (4, 2): training matches plain optax; bytes across and within the
nodes equal ``zj.comm_bytes_per_axis(..., secondary=S)`` (no backward
re-gather crosses the nodes); the secondary pieces cost Ψ/S of device memory;
int8 wires; gather="all"; errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh, reference_run, relative_update_error

import zero_jax as zj

D, DEPTH = 64, 4
PSI = DEPTH * 2 * D * 2 * D  # parameters of the stack of blocks below
F32 = 4
# Tolerances: fp32 training on CPU, 2 Adam steps; the hierarchical reduction sums in another order.
FP32_ATOL = 2e-5


def _mesh(nodes: int, chips: int) -> jax.sharding.Mesh:
    return make_mesh(8, ("node", "chip"), (nodes, chips))


def _block(p: dict, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def _params(stacked: bool) -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = jax.random.normal(k1, (DEPTH, D, 2 * D)) / 8
    w2 = jax.random.normal(k2, (DEPTH, 2 * D, D)) / 8
    if stacked:
        return {"layers": {"w1": w1, "w2": w2}}
    return {"blocks": [{"w1": w1[i], "w2": w2[i]} for i in range(DEPTH)]}


BATCH = {"x": jax.random.normal(jax.random.key(1), (16, D)), "y": jax.random.normal(jax.random.key(2), (16, D))}


def _loss(kind: str, policy: zj.ZeroPolicy | None):
    def loss_fn(params: dict, batch: dict) -> jax.Array:
        if kind == "scan":
            x = zj.scan_layers(_block, params["layers"], batch["x"], policy)
        elif kind == "apply":
            x = zj.apply_layers(_block, params["blocks"], batch["x"], policy)
        else:  # gather="all": whole parameters, a plain loop
            x = batch["x"]
            for p in params["blocks"]:
                x = _block(p, x)
        return jnp.mean((x - batch["y"]) ** 2)

    return loss_fn


def _optax_reference(kind: str, steps: int = 2) -> dict:
    return reference_run(optax.adam(1e-2), _params(kind == "scan"), [BATCH] * steps, _loss(kind, None))[0]


def _train(kind: str, policy: zj.ZeroPolicy, steps: int = 2):
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(_params(kind == "scan"), tx, policy)
    gather = "all" if kind == "all" else "manual"
    step = zj.make_train_step(_loss(kind, policy), tx, policy, gather=gather)
    for _ in range(steps):
        state, _ = step(state, BATCH)
    return state, step


def _policy(nodes: int, chips: int, kind: str, **kw) -> zj.ZeroPolicy:
    stacked = "layers" if kind == "scan" else ()
    return zj.ZeroPolicy(3, _mesh(nodes, chips), ("node", "chip"), min_shard_size=0, stacked=stacked, **kw)


def _max_error(a: dict, b: dict) -> float:
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# Every primitive on both mesh shapes would be 6 trainings: each primitive once, each shape twice.
CASES = [("scan", 2, 4), ("apply", 2, 4), ("apply", 4, 2), ("all", 4, 2)]


@pytest.mark.parametrize(("kind", "nodes", "chips"), CASES)
def test_hpz_trains_like_optax_and_crosses_the_nodes_twice(kind: str, nodes: int, chips: int) -> None:
    policy = _policy(nodes, chips, kind, secondary_axis="chip")
    assert policy.axis == ("chip", "node")  # the secondary axis leads the primary partition
    state, step = _train(kind, policy)
    assert _max_error(zj.full_params(state), _optax_reference(kind)) < FP32_ATOL
    report = zj.audit(step, state, BATCH)
    assert report.ok, report.violations
    measured = report.comm_per_axis_kind
    theory = zj.comm_bytes_per_axis(PSI, 8, 3, secondary=chips, dtype_bytes=F32)
    # Across the nodes: one gather (forward) and one reduce-scatter, no backward re-gather.
    assert set(measured["node"]) == {"all-gather", "reduce-scatter"}
    across = sum(measured["node"].values())
    within = sum(measured["chip"].values())
    if kind == "all":
        # gather="all" remats the gathered weights except what its matmuls save (one of the two here),
        # so it re-gathers 1 of the 2 weights within the node: the within bytes are the audit's theory's.
        assert across == pytest.approx(theory["across"], rel=0.02)
        assert measured["node"]["all-gather"] == pytest.approx(PSI * F32 / chips * (nodes - 1) / nodes, rel=1e-9)
    else:
        assert across == pytest.approx(theory["across"], rel=0.02)
        assert within == pytest.approx(theory["within"], rel=0.02)
    # The audit's own theory for hpZ (less the re-gathers a remat skips, which it names).
    assert report.comm.measured == pytest.approx(report.comm.accounted, rel=0.02)


def test_without_hpz_the_backward_regather_crosses_the_nodes() -> None:
    """The same mesh and axes without secondary_axis: one collective over both axes, 3 passes (the baseline)."""
    state, step = _train("apply", _policy(2, 4, "apply"))
    measured = zj.audit(step, state, BATCH).comm_per_axis_kind
    assert "node" not in measured and "chip" not in measured
    assert measured["node+chip"]["all-gather"] == pytest.approx(2 * PSI * F32 * 7 / 8, rel=1e-9)


def test_hpz_secondary_pieces_cost_psi_over_s_of_device_memory() -> None:
    """Compiled temp with hpZ minus without: the secondary pieces, Ψ/S (within 25%; XLA:CPU's buffer reuse)."""
    temps = []
    for kw in ({}, {"secondary_axis": "chip"}):
        policy = _policy(2, 4, "scan", **kw)
        state, step = _train("scan", policy, steps=0)
        temps.append(zj.audit(step, state, BATCH).memory["temp"])
    secondary = PSI * F32 / 4
    assert zj.model_state_bytes(PSI, 8, 3, param_bytes=F32, secondary=4).params - PSI * F32 / 8 == secondary
    assert temps[1] - temps[0] == pytest.approx(secondary, rel=0.25)


def test_hpz_with_int8_weights_gathers_the_same_weights_as_without() -> None:
    """qwZ: the secondary pieces keep the primary pieces' int8 blocks, so forward and backward see the weights a
    single int8 gather gives: training matches int8 without hpZ up to the reduction's summation order."""
    quant = {"quantize_weights": "int8", "quant_block": 64}
    plain, _ = _train("scan", _policy(2, 4, "scan", **quant))
    state, _ = _train("scan", _policy(2, 4, "scan", secondary_axis="chip", **quant))
    assert _max_error(zj.full_params(state), zj.full_params(plain)) < FP32_ATOL


def test_hpz_with_int8_weights_and_gradients_sends_int8_blocks_across_and_within() -> None:
    """qwZ + qgZ: int8 blocks on both sides, bytes = the formula; qgZ's two-step reduction quantizes twice,
    so training stays as close to optax as int8 without hpZ (within 1.5x its error)."""
    quant = {"quantize_weights": "int8", "quantize_grads": "int8", "quant_block": 64}
    plain, _ = _train("apply", _policy(2, 4, "apply", **quant))
    state, step = _train("apply", _policy(2, 4, "apply", secondary_axis="chip", **quant))
    reference = _optax_reference("apply")
    assert _max_error(zj.full_params(state), reference) < 1.5 * _max_error(zj.full_params(plain), reference)
    report = zj.audit(step, state, BATCH)
    assert report.ok, report.violations
    measured = report.comm_per_axis_kind
    assert set(measured["node"]) == {"all-gather", "all-to-all"}  # int8 blocks (all-to-all: qgZ's reduction)
    theory = zj.comm_bytes_per_axis(PSI, 8, 3, secondary=4, dtype_bytes=F32, **quant)
    assert sum(measured["node"].values()) == pytest.approx(theory["across"], rel=0.02)
    assert sum(measured["chip"].values()) == pytest.approx(theory["within"], rel=0.02)


def test_hpz_checkpoint_restores_into_a_plain_stage_3_layout(tmp_path) -> None:
    """The state holds only the primary pieces (in the secondary-major order): saved, it restores into the same
    mesh's plain stage 3 whole-value equal."""
    policy = _policy(2, 4, "apply", secondary_axis="chip")
    state, _ = _train("apply", policy, steps=1)
    zj.save(tmp_path / "ckpt", state)
    plain = _policy(2, 4, "apply")
    restored = zj.restore(tmp_path / "ckpt", policy=plain, tx=zj.shard_optimizer(optax.adam(1e-2), plain))
    for got, saved in zip(
        jax.tree.leaves(zj.full_params(restored)), jax.tree.leaves(zj.full_params(state)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"secondary_axis": "model"}, "must be one of the partition axes"),
        ({"secondary_axis": "chip", "stage": 2}, "stage 2 gathers no"),
        ({"secondary_axis": "chip", "axis": "chip"}, "needs axis to name several mesh axes"),
    ],
)
def test_hpz_bad_arguments_name_the_fix(kw: dict, message: str) -> None:
    args = {"stage": 3, "axis": ("node", "chip"), **kw}
    with pytest.raises(ValueError, match=message):
        zj.ZeroPolicy(args.pop("stage"), _mesh(2, 4), args.pop("axis"), **args)


def test_hpz_formulas_reject_what_they_cannot_count() -> None:
    with pytest.raises(ValueError, match="needs stage 3 and a size dividing"):
        zj.comm_bytes_per_axis(1e9, 8, 3, secondary=3)
    with pytest.raises(ValueError, match="needs stage 3"):
        zj.model_state_bytes(1e9, 8, 2, secondary=4)


def test_plan_compiles_hpz_and_shows_the_bytes_across_the_nodes() -> None:
    plan = zj.plan(num_devices=8, stages=[3], secondary=4, factory_kwargs={"dim": 64, "depth": 2, "seq": 16})
    (report,) = plan.reports
    kinds = report.comm_per_axis_kind
    assert set(kinds["node"]) == {"all-gather", "reduce-scatter"} and "chip" in kinds
    (line,) = plan.secondary_notes()
    assert "2 nodes x 4 chips" in line and "no backward re-gather crosses them" in line


def test_plan_cli_prints_hpz_by_the_formulas(capsys) -> None:
    from zero_jax._cli.cli import main

    assert main(["plan", "--params", "1e9", "--devices", "8", "--device-memory", "16GB", "--secondary-axis", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hpZ, stage 3 (2 nodes x 4 chips" in out
    assert "500.0 MB across the nodes (without hpZ 750.0 MB" in out and "4.5 GB within each" in out


def test_hpz_through_the_nnx_adapters_layers_trains_like_optax() -> None:
    """The adapters' layers= path (LayerChain, as apply_layers) under hpZ: the nodes are crossed by one gather
    and one reduction per step, and training matches plain optax."""
    from test_adapters_layers_nnx import Net, _batches
    from test_adapters_layers_nnx import loss as nnx_loss

    batches = _batches()
    adapted = zj.adapters.from_nnx(Net(), nnx_loss, layers="blocks/*")
    policy = adapted.policy(3, _mesh(2, 4), axis=("node", "chip"), secondary_axis="chip", min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state, step = adapted.init_state(tx, policy), adapted.make_train_step(tx, policy)
    for b in batches:
        state, _ = step(state, b)
    ref, _ = reference_run(optax.adam(1e-2), adapted.params, batches, lambda p, b: nnx_loss(adapted.to_model(p), b))
    assert max(relative_update_error(zj.full_params(state), ref, adapted.params).values()) <= 1e-5
    assert set(zj.audit(step, state, batches[0]).comm_per_axis_kind["node"]) == {"all-gather", "reduce-scatter"}
