"""zj.audit on a quantized wire (issue 17, ZeRO++'s qwZ / qgZ): the wire dtype and bytes per
collective kind, a theory that scales with the int8 blocks, check() on correct quantized steps
(stage 3 qwZ / qgZ / both, stage 1-2 qgZ, the reference transformer's scan, tensor parallelism),
check() flagging a step asked to be int8 that runs in float32, and the layer schedule.

The blocks model: 2 blocks of a (64, 64) weight (4,096 elements, pieces of 512 = 2 blocks of 256
on 8 devices) and a (64,) bias kept whole (min_shard_size 1,000: all-reduced, never quantized).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_mesh
from jax.sharding import AxisType

import zero_jax as zj
from zero_jax import measure as _measure
from zero_jax._audit import communication as _comm_audit
from zero_jax._audit import model_axes as _model_axes
from zero_jax._audit import report as _report
from zero_jax._audit import violations as _violations
from zero_jax._theory.wire import wire_bytes
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, megatron_specs

D, DEPTH, MIN = 64, 2, 1000
W = D * D  # one block's weight
RING = 7 / 8
INT8_PASS = 7 * wire_bytes(W // 8, 256)  # one int8 pass of a weight: 7 x (512 + 2 x 4) = 3,640 B
F32_PASS = RING * W * 4  # the same pass in float32: 14,336 B
BIAS_ALL_REDUCE = 2 * RING * D * 4  # a whole bias's gradient all-reduce: 448 B


def _block(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _params():
    rng = np.random.default_rng(0)
    return {
        "blocks": [
            {"w": jnp.asarray(rng.normal(size=(D, D)) / np.sqrt(D), jnp.float32), "b": jnp.zeros(D, jnp.float32)}
            for _ in range(DEPTH)
        ]
    }


def _policy(stage, weights=None, grads=None):
    return zj.ZeroPolicy(stage, make_mesh(8), min_shard_size=MIN, quantize_weights=weights, quantize_grads=grads)


def _layerwise(policy):
    return lambda params, batch: jnp.mean(zj.apply_layers(_block, params["blocks"], batch["x"], policy) ** 2)


def _gather_up_front(policy):
    def loss_fn(params, batch):
        x = batch["x"]
        for p in [zj.gather(b, policy) for b in params["blocks"]]:  # XLA hoists these: both blocks whole at once
            x = _block(p, x)
        return jnp.mean(x**2)

    return loss_fn


def _run_audit(policy, judge=None, loss=_layerwise, **kw):
    """Audit a manual step built under ``policy``, judged by ``judge`` (default: the same policy)."""
    loss_fn = loss(policy)

    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    batch = {"x": jnp.asarray(np.random.default_rng(1).normal(size=(16, D)), jnp.float32)}
    return zj.audit(step, zj.init_state(_params(), tx, policy), batch, policy=judge, grads=False, **kw)


@pytest.fixture(scope="module")
def both():
    return _run_audit(_policy(3, "int8", "int8"))


@pytest.fixture(scope="module")
def plain_asked_int8():
    """The unquantized step's program judged against the policy that asks for int8 both ways."""
    return _run_audit(_policy(3), judge=_policy(3, "int8", "int8"))


def test_a_qwz_qgz_step_reports_its_int8_wire_and_passes(both, plain_asked_int8):
    both.check()
    wire, plain = both.wire_bytes(), plain_asked_int8.wire_bytes()
    # 2 blocks: each weight gathered forward and again backward (int8 + scales), reduced once by all-to-all.
    assert wire["all-gather"] == {"s8": 4 * RING * 8 * 2 * 256, "f32 scales": 4 * RING * 8 * 2 * 4}
    assert wire["all-to-all"] == {"s8": 2 * RING * 8 * 2 * 256, "f32 scales": 2 * RING * 8 * 2 * 4}
    assert "reduce-scatter" not in wire and plain["all-gather"] == {"f32": 4 * F32_PASS}
    gather_ratio = sum(wire["all-gather"].values()) / plain["all-gather"]["f32"]
    reduce_ratio = sum(wire["all-to-all"].values()) / plain["reduce-scatter"]["f32"]
    assert gather_ratio == reduce_ratio == pytest.approx(0.2539, abs=1e-4)  # (1 + 4/256) / 4
    # The theory scales with the int8 blocks: 4 + 2 int8 passes of a weight, 2 whole biases all-reduced.
    assert both.comm.theory == pytest.approx(6 * INT8_PASS + DEPTH * BIAS_ALL_REDUCE, rel=1e-12)
    assert 1 <= both.comm.ratio <= 1.001 and both.comm.measured < 0.3 * plain_asked_int8.comm.measured
    formula = zj.comm_bytes(DEPTH * (W + D), 8, 3, dtype_bytes=4, quantize_weights="int8", quantize_grads="int8")
    assert both.comm.formula == pytest.approx(formula, rel=1e-12)
    rows = {(r["kind"], r["dtype"], r["role"]): r["count"] for r in both.collective_summary()}
    assert rows[("all-gather", "s8", "int8 values")] == rows[("all-gather", "f32", "float32 scales")] == 4
    assert rows[("all-to-all", "s8", "int8 values")] == rows[("all-to-all", "f32", "float32 scales")] == 2
    text = str(both)
    assert "quantized: weights int8 (qwZ), grads int8 (qgZ), blocks of 256):" in text
    assert "  all-gather         s8: 14.00 KiB, f32 scales: 224 B" in text
    assert "  all-to-all         s8: 7.00 KiB, f32 scales: 112 B" in text
    assert "(int8 values)" in text and "no collective asked to be int8 running wider" in text


def test_the_layer_schedule_counts_int8_gathers_and_all_to_all_reductions(both):
    layers = both.layers
    assert [b.name for b in layers.blocks] == ["block 0", "block 1"]
    for b in layers.blocks:  # the weight (the bias is whole): gathered twice, reduced once; scales uncounted
        assert (b.weights, b.forward, b.backward, b.reduce_scatters) == (1, 1, 1, 1)
        assert b.bytes == W * 4  # the dequantized whole weight, not its int8 blocks
    assert layers.max_alive == 2 and layers.judged  # prefetch 1 + 1, the int8 gathers followed into float32


def test_int8_gathers_hoisted_to_the_start_are_still_whole_layers_alive():
    report = _run_audit(_policy(3, "int8"), loss=_gather_up_front, prefetch=0)
    (group,) = report.layers.blocks
    assert (group.name, group.weights, group.forward, group.backward) == ("blocks/*", 1, 2, 0)
    assert report.layers.max_alive == DEPTH
    with pytest.raises(_report.AuditError) as err:
        report.check()
    assert [v.kind for v in err.value.violations] == [_report.LAYERS_ALIVE]


def test_check_flags_each_collective_asked_to_be_int8_that_runs_in_float32(plain_asked_int8):
    report = plain_asked_int8
    with pytest.raises(_report.AuditError) as err:
        report.check()
    wide = [v for v in err.value.violations if v.kind == _report.WIDE_WIRE]
    shapes = sorted(c.shape for c in report.collectives if c.name in {v.subject for v in wide})
    assert shapes == [(8, 64)] * 2 + [(64, 64)] * 4  # 2 reduce-scatters, 4 all-gathers; no scalar, no bias
    gather = next(v for v in wide if "all-gather" in v.message)
    expected = "expected s8[8,2,256] plus float32[8,2] scales (4.06 KiB per execution"
    for part in ("f32[64,64]", "16.00 KiB", "over data", "'blocks/0/w', 'blocks/1/w'", "quantize_weights='int8'",
                 expected, "zj.make_train_step"):  # fmt: skip
        assert part in gather.message, (part, gather.message)
    reduce = next(v for v in wide if "reduce-scatter" in v.message)
    assert "f32[8,64]" in reduce.message and "quantize_grads='int8'" in reduce.message
    (over,) = [v for v in err.value.violations if v.kind == _report.COMM_OVER_THEORY]
    assert report.comm.ratio == pytest.approx((6 * F32_PASS + 2 * BIAS_ALL_REDUCE) / report.comm.theory, rel=1e-3)
    assert report.comm.ratio > 3.5


@pytest.mark.parametrize(
    ("stage", "weights", "grads"), [(1, None, "int8"), (2, None, "int8"), (3, "int8", None), (3, None, "int8")]
)
def test_check_passes_each_quantized_variant_within_tolerance(stage, weights, grads):
    report = _run_audit(_policy(stage, weights, grads)).check()
    wire = report.wire_bytes()
    gather = {"s8", "f32 scales"} if weights else {"f32"}
    assert set(wire["all-gather"]) == gather  # stages 1-2 gather the update whole: never quantized
    assert ("all-to-all" in wire) == bool(grads) and ("reduce-scatter" in wire) == (not grads)
    passes = (4 if stage == 3 else 2) + 2  # gathers (stage 3: twice per block; stages 1-2: the update) + reductions
    quantized = 4 * bool(weights) + 2 * bool(grads)
    theory = quantized * INT8_PASS + (passes - quantized) * F32_PASS + DEPTH * BIAS_ALL_REDUCE
    assert report.comm.theory == pytest.approx(theory, rel=1e-12) and 1 <= report.comm.ratio <= 1.001


def _scanned(policy):
    return lambda params, batch: jnp.mean(zj.scan_layers(_block, params["layers"], batch["x"], policy) ** 2)


def test_a_scan_layers_step_with_both_int8_passes_and_gathers_per_layer():
    policy, depth = _policy(3, "int8", "int8").replace(stacked="layers"), 4
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    step = zj.make_train_step(_scanned(policy), tx, policy, gather="manual")
    blocks = _params()["blocks"] * 2
    params = {"layers": {k: jnp.stack([b[k] for b in blocks]) for k in ("w", "b")}}
    batch = {"x": jnp.ones((16, D), jnp.float32)}
    report = zj.audit(step, zj.init_state(params, tx, policy), batch, grads=False).check()
    (scan,) = report.layers.blocks
    assert (scan.name, scan.layers, scan.weights, scan.forward, scan.backward, scan.reduce_scatters) == (
        "scan layers/*", depth, 1, depth, depth, depth)  # fmt: skip
    assert report.layers.max_alive == 2 and scan.bytes == W * 4  # prefetch 1 + 1, as without quantization
    # Each layer's piece is quantized on its own (2 blocks per layer), as the blocks model's.
    assert report.comm.theory == pytest.approx(3 * depth * INT8_PASS + 2 * RING * depth * D * 4, rel=1e-12)
    assert 1 <= report.comm.ratio <= 1.001
    float_weights = [c for c, r in zip(report.collectives, report.wire_roles, strict=True)
                     if c.kind in ("all-gather", "reduce-scatter") and not r]  # fmt: skip
    assert float_weights == []  # every weight gather and gradient reduction is int8


def test_the_reference_transformer_with_tensor_parallelism_and_both_int8_passes():
    cfg = TransformerConfig(vocab=32, dim=32, depth=2, heads=2, seq=8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    policy = zj.ZeroPolicy(3, mesh, stacked="layers", param_specs=megatron_specs(), min_shard_size=0,
                           quantize_weights="int8", quantize_grads="int8")  # fmt: skip
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    # Abstract inputs (bytes from the shardings): nothing to initialise, one compile.
    state = zj.init_state(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), tx, policy)
    batch = {"tokens": jax.ShapeDtypeStruct((8, cfg.seq + 1), jnp.int32, sharding=policy.batch_sharding())}
    report = zj.audit(step, state, batch, grads=False).check()
    assert report.abstract and report.model_parallel == 2 and report.comm.accounted_ratio == pytest.approx(1, abs=0.001)
    data = report.comm_per_axis_kind["data"]
    assert set(data) == {"all-gather", "all-to-all", "all-reduce"}  # ZeRO's side: int8 gathers and reductions
    values = [c for c, r in zip(report.collectives, report.wire_roles, strict=True) if r == "int8 values"]
    assert values and all(c.axes(mesh) == ("data",) and c.shape[0] == 4 for c in values)


# -- pure functions -----------------------------------------------------------------------------------------------


def test_wire_roles_pair_int8_values_with_their_scales():
    policy = _policy(3, "int8")
    colls = [
        _measure.Collective("all-gather", "s8", (8, 2, 256), 4096, 8, group=(0, 1)),
        _measure.Collective("all-gather", "f32", (8, 2), 64, 8, group=(0, 1)),
        _measure.Collective("all-gather", "f32", (8, 3), 96, 8, group=(0, 1)),  # no int8 partner: plain
        _measure.Collective("all-reduce", "f32", (), 4, 8),
    ]
    assert _comm_audit.wire_roles(colls, policy) == ("int8 values", "float32 scales", "", "")
    assert _comm_audit.wire_roles(colls, _policy(3)) == ("", "", "", "")


def test_int8_weight_blocks_gathered_across_the_model_axis_are_flagged():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    policy = zj.ZeroPolicy(3, mesh, quantize_weights="int8")
    over_both = _measure.Collective("all-gather", "s8", (8, 2, 256), 4096, 8, name="both", group=tuple(range(8)))
    over_data = _measure.Collective("all-gather", "s8", (4, 2, 256), 2048, 4, name="data", group=(0, 2, 4, 6))
    assert over_both.axes(mesh) == ("data", "model") and over_data.axes(mesh) == ("data",)
    (v,) = _model_axes.model_gather_violations([over_both, over_data], [], policy)
    assert (v.kind, v.subject) == (_report.MODEL_AXIS_GATHER, "both") and "int8 weight blocks" in v.message


def test_an_int8_reduction_inside_a_local_accumulation_loop_is_flagged():
    colls = (
        _measure.Collective("all-to-all", "s8", (8, 2, 256), 4096, 8, trips=4, name="a2a"),
        _measure.Collective("all-to-all", "f32", (8, 2), 64, 8, trips=4, name="scales"),
        _measure.Collective("all-gather", "s8", (8, 2, 256), 4096, 8, trips=4, name="gather"),
    )
    loops = {"a2a": (4,), "scales": (4,), "gather": (4,)}
    (v,) = _violations.accum_violations(colls, loops, 4, _policy(3, "int8", "int8"))
    assert (v.kind, v.subject) == (_report.REDUCE_IN_ACCUM_LOOP, "a2a") and "s8[8,2,256]" in v.message


def test_layers_alive_follows_an_int8_gather_into_its_dequantized_copy():
    lines = [
        "ENTRY %main (p: s8[1,2,256], s: f32[1,2], x: f32[2,64]) -> f32[2,64] {",
        "  %p = s8[1,2,256] parameter(0)", "  %s = f32[1,2] parameter(1)", "  %x = f32[2,64] parameter(2)",
        "  %g0 = s8[8,2,256] all-gather(%p)", "  %w0 = f32[64,64] fusion(%g0, %s)",  # dequantize layer 0
        "  %g1 = s8[8,2,256] all-gather(%p)", "  %w1 = f32[64,64] fusion(%g1, %s)",  # prefetch layer 1
        "  %y0 = f32[2,64] dot(%x, %w0)", "  ROOT %y1 = f32[2,64] dot(%y0, %w1)", "}",
    ]  # fmt: skip
    alive = _measure.layers_alive("\n".join(lines), lambda ins: "elements", 8 * 2 * 256)
    assert alive.layers == 2  # w0 is alive until y0 although g0 died at its dequantize
    small = [line.replace("f32[64,64] fusion", "f32[2,8] fusion") for line in lines]  # a small read: not a copy
    assert _measure.layers_alive("\n".join(small), lambda ins: "elements", 8 * 2 * 256).layers == 1


def test_the_planned_formula_with_both_int8_moves_less_than_data_parallelism():
    comm_bytes = zj.comm_bytes  # the planner's formula, which the report shows beside its theory
    dp = comm_bytes(1e9, 8, 0)
    both = comm_bytes(1e9, 8, 3, quantize_weights="int8", quantize_grads="int8")
    assert both == pytest.approx(3 * RING * 1e9 * (1 + 4 / 256)) and both / dp == pytest.approx(0.7617, abs=1e-4)
    assert comm_bytes(1e9, 8, 1, quantize_grads="int8") == pytest.approx(RING * 1e9 * (2 + 1 + 4 / 256))
