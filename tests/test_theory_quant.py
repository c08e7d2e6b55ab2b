"""ZeRO++'s wire formats in the formulas and the planner: ``comm_bytes(..., quantize_weights=, quantize_grads=,
quant_block=)`` against hand numbers, its errors (the same kinds ZeroPolicy raises), and ``plan``'s flags."""

from __future__ import annotations

import pytest
from _models import make_mesh

import zero_jax as zj
from zero_jax._cli import cli as cli
from zero_jax._plan import plan as _plan
from zero_jax._theory.checks import quantization_at
from zero_jax._theory.wire import SCALE_BYTES, WireFormat, wire_bytes

PSI, N = 1e9, 8
RING = (N - 1) / N
#: int8 + one float32 scale per block of 256: bytes per element on the wire.
RATE = 1 + 4 / 256
BOTH = {"quantize_weights": "int8", "quantize_grads": "int8"}
PLAN = ["plan", "--params", "7e9", "--devices", "8", "--device-memory", "80GB"]


def test_comm_bytes_swaps_dtype_bytes_for_int8_plus_scales_in_the_quantized_passes() -> None:
    assert RATE == 1.015625 == wire_bytes(256, 256) / 256 == 1 + SCALE_BYTES / 256  # the one home's per-element rate
    # Stage 3: two weight gathers (qwZ) + one gradient reduction (qgZ), bf16 = 2 bytes otherwise.
    assert zj.comm_bytes(PSI, N, 3, **BOTH) == pytest.approx(3 * RATE * PSI * RING, rel=1e-15)  # 2.666 GB
    assert zj.comm_bytes(PSI, N, 3, quantize_weights="int8") == pytest.approx((2 * RATE + 2) * PSI * RING, rel=1e-15)
    assert zj.comm_bytes(PSI, N, 3, quantize_grads="int8") == pytest.approx((2 * 2 + RATE) * PSI * RING, rel=1e-15)
    # Stages 1-2: the reduction is quantized, the gather of updated parameters stays exact.
    for stage in (1, 2):
        assert zj.comm_bytes(PSI, N, stage, quantize_grads="int8") == pytest.approx((2 + RATE) * PSI * RING, rel=1e-15)
    # The issue: stage 3 with both on moves less than plain data parallelism's 2Ψ (two bf16 passes).
    assert zj.comm_bytes(PSI, N, 3, **BOTH) / zj.comm_bytes(PSI, N, 0) == pytest.approx(3 * RATE / 4)  # 0.76
    # Against an fp32 run every quantized pass is RATE / 4 = 0.254 of its bytes (the issue's <= 0.30).
    assert zj.comm_bytes(PSI, N, 3, dtype_bytes=4, **BOTH) / zj.comm_bytes(PSI, N, 3, dtype_bytes=4) == RATE / 4
    # Smaller blocks carry more scales: 1 + 4/64; tensor parallelism divides by M; one device sends nothing.
    assert zj.comm_bytes(PSI, N, 3, quant_block=64, **BOTH) == pytest.approx(3 * 1.0625 * PSI * RING, rel=1e-15)
    assert zj.comm_bytes(PSI, N, 3, model_parallel=2, **BOTH) == pytest.approx(3 * RATE * PSI / 2 * RING, rel=1e-15)
    assert zj.comm_bytes(PSI, 1, 3, **BOTH) == 0.0


def test_quantization_off_is_exactly_the_plain_formula() -> None:
    for stage in range(4):
        for m in (1, 2, 4):
            plain = (3 if stage == 3 else 2) * PSI / m * 2 * (N - 1) / N  # the formula before the wire formats
            off = dict(quantize_weights=None, quantize_grads=None, quant_block=64, model_parallel=m)
            assert zj.comm_bytes(PSI, N, stage, model_parallel=m) == plain == zj.comm_bytes(PSI, N, stage, **off)


def test_per_axis_efficiency_and_bandwidth_take_the_same_keywords() -> None:
    per_axis = zj.comm_bytes_per_axis(PSI, N, 3, replicas=4, model_parallel=2, **BOTH)
    # Within the partition axis: comm_bytes quantized; across the replicas: unquantized, as ZeroPolicy sends it.
    assert per_axis == {
        "shard": zj.comm_bytes(PSI, N, 3, model_parallel=2, **BOTH),
        "replica": zj.comm_bytes_per_axis(PSI, N, 3, replicas=4, model_parallel=2)["replica"],
        "model": 0.0,
    }
    assert per_axis["replica"] == 2 * PSI / 2 / N * 2 * 3 / 4
    quantized = zj.comm_bytes(PSI, N, 1, quantize_grads="int8")
    # Half the step communicating: the bandwidth is the quantized bytes in 1 s, and at it the efficiency is 0.5.
    assert zj.required_bandwidth(PSI, N, 1, compute_time=1.0, target=0.5, quantize_grads="int8") == quantized
    assert zj.efficiency(PSI, N, 1, compute_time=1.0, bandwidth=quantized, quantize_grads="int8") == 0.5
    assert zj.efficiency(PSI, N, 1, compute_time=1.0, bandwidth=quantized) < 0.5  # unquantized moves more


BAD = [
    (dict(quantize_weights="int8"), 0, ValueError, r"quantize_weights='int8' .* only stage 3 .* Use stage=3"),
    (dict(quantize_weights="int8"), 2, ValueError, r"stage 2 keeps parameters whole"),
    (dict(quantize_grads="int8"), 0, ValueError, r"quantize_grads='int8' .* stage 0 all-reduces.* stage=1 or higher"),
    (dict(quantize_grads="int4"), 3, ValueError, r"quantize_grads='int4' is not a wire format; .* \('int8',\)"),
    (dict(quantize_weights="fp8"), 3, ValueError, r"quantize_weights='fp8' is not a wire format"),
    (dict(quant_block=0), 3, ValueError, r"quant_block must be a positive int .* got 0"),
    (dict(quant_block=2.5), 3, TypeError, r"quant_block must be a positive int .* got 2.5"),
    (dict(quant_block=True), 1, TypeError, r"got True"),
]


@pytest.mark.parametrize(("wire", "stage", "kind", "match"), BAD)
def test_bad_wire_arguments_are_refused_as_zero_policy_refuses_them(wire, stage, kind, match) -> None:
    with pytest.raises(kind, match=match) as e:
        zj.comm_bytes(PSI, N, stage, **wire)
    assert str(e.value).startswith("comm_bytes: ")  # the formula that refused it
    with pytest.raises(kind):  # the same kind of error as the policy's
        zj.ZeroPolicy(stage, make_mesh(N), **wire)
    for call in (  # every formula that takes the keywords passes them on
        lambda: zj.comm_bytes_per_axis(PSI, N, stage, replicas=2, **wire),
        lambda: zj.efficiency(PSI, N, stage, compute_time=1.0, bandwidth=1e9, **wire),
        lambda: zj.required_bandwidth(PSI, N, stage, compute_time=1.0, **wire),
    ):
        with pytest.raises(kind, match=match):
            call()


def test_every_bad_wire_argument_is_named_in_one_error() -> None:
    with pytest.raises(ValueError, match="4 problems") as e:
        zj.comm_bytes(PSI, N, 0, quantize_weights="fp8", quantize_grads="int8", quant_block=-1)
    for text in ("'fp8' is not a wire format", "quantize_weights='fp8' quantizes", "stage 0 all-reduces", "got -1"):
        assert text in str(e.value), text


def test_quantization_at_keeps_each_format_where_the_stage_has_it() -> None:
    assert [quantization_at(s, "int8", "int8") for s in range(4)] == [
        {"quantize_weights": None, "quantize_grads": None},
        {"quantize_weights": None, "quantize_grads": "int8"},
        {"quantize_weights": None, "quantize_grads": "int8"},
        {"quantize_weights": "int8", "quantize_grads": "int8"},
    ]


def test_plan_cli_shows_the_quantized_communication_beside_the_unquantized(capsys) -> None:
    argv = [*PLAN, "--quantize-weights", "int8", "--quantize-grads", "int8", "--quant-block", "128"]
    assert cli.main([*argv, "--bandwidth", "25GB/s", "--compute-time", "2s", "--replicas", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    rate = 1 + 4 / 128
    assert "comm/step ┃ unquantized" in out
    stage3 = zj.comm_bytes(7e9, 8, 3, quant_block=128, **BOTH)
    assert stage3 == pytest.approx(3 * rate * 7e9 * RING) and f"{stage3 / 1e9:.1f} GB │ 36.8 GB" in out  # 18.9 GB
    stage1 = zj.comm_bytes(7e9, 8, 1, quant_block=128, quantize_grads="int8")
    assert f"{stage1 / 1e9:.1f} GB │ 24.5 GB" in out  # 18.5 GB, stage 0 stays 24.5 GB │ 24.5 GB
    assert "24.5 GB │ 24.5 GB" in out
    assert "qwZ int8 at stage 3 + qgZ int8 at stages 1-3" in out and "per 128 elements = 1.031 bytes" in out
    # The bandwidth for 90% at the recommended stage 1: its quantized bytes in 2 s / 9.
    assert f"at stage 1: {stage1 / (2 / 9) / 1e9:.1f} GB/s per device" in out
    assert "quantize within N only" in out  # the hybrid table's replica column stays unquantized
    assert f"{stage3 / 1e9:.1f} GB │ 1.8 GB" in out  # stage 3: 18.9 GB within N, 2 * 7e9/8 * 2 B * 1/2 across R
    assert cli.main(PLAN) == 0
    assert "unquantized" not in capsys.readouterr().out  # without the flags: today's table


def test_plan_cli_refuses_unknown_formats_and_blocks(capsys) -> None:
    for flags, words in (
        (["--quantize-weights", "int4"], ("--quantize-weights: invalid choice: 'int4'", "int8")),
        (["--quant-block", "0"], ("--quant-block: must be a positive integer (>= 1), got 0",)),
    ):
        with pytest.raises(SystemExit) as exit_:
            cli.main([*PLAN, *flags])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err


def test_plan_compile_passes_the_wire_formats_to_each_stage_policy(monkeypatch, capsys) -> None:
    calls = []
    monkeypatch.setattr(cli, "_compiled_table", lambda *a: calls.append(a))  # compiling itself: test_cli
    argv = [*PLAN, "--compile", "--depth", "1", "--dim", "32", "--vocab", "64", "--heads", "2", "--seq", "16"]
    assert cli.main([*argv, "--quantize-weights", "int8", "--quant-block", "64"]) == 0
    model = calls[0][3]
    assert (model["quantize_weights"], model["quantize_grads"], model["quant_block"]) == ("int8", None, 64)
    kwargs = {k: model[k] for k in ("vocab", "dim", "depth", "heads", "seq")}
    mesh = make_mesh(N)
    for stage, wire in (
        (0, WireFormat(block=64)),
        (2, WireFormat(None, "int8", 64)),
        (3, WireFormat("int8", "int8", 64)),
    ):
        step, _, _ = _plan.reference_step(
            stage, mesh, quantize_weights="int8", quantize_grads="int8", quant_block=64, **kwargs
        )
        assert step.policy.wire == wire, stage  # reference_step applies each format where the stage has it
    assert _plan.reference_step(3, mesh, **kwargs)[0].policy.wire == WireFormat()  # off by default
