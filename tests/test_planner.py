"""The planner: ZeRO's formulas, choose_stage, efficiency, plan() on abstract inputs, the `plan` CLI."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params

import zero_jax as zj
from zero_jax._base.units import fmt_bytes, parse_bandwidth, parse_bytes, parse_count, parse_seconds
from zero_jax._cli import cli as cli

GB = 1e9


# -- formulas --------------------------------------------------------------------------------------------------


def test_formulas_reproduce_the_zero_paper_figure_1() -> None:
    # Ψ = 7.5B, N_d = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    totals = [zj.model_state_bytes(7.5e9, 64, s).total / GB for s in range(4)]
    assert totals == pytest.approx([120.0, 31.40625, 16.640625, 1.875], rel=1e-12)
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    # The categories: (2 + 2 + K)Ψ, each /N once partitioned.
    assert zj.model_state_bytes(7.5e9, 64, 1) == pytest.approx((15e9, 15e9, 12 * 7.5e9 / 64))
    assert zj.model_state_bytes(7.5e9, 64, 2) == pytest.approx((15e9, 2 * 7.5e9 / 64, 12 * 7.5e9 / 64))
    # fp32 Adam, the core's default run: 4 + 4 + 8 bytes.
    fp32 = zj.model_state_bytes(1e6, 8, 3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert fp32 == pytest.approx((5e5, 5e5, 1e6))


def test_comm_bytes_is_two_or_three_ring_passes() -> None:
    # Ψ = 1e9 bf16 parameters (2 GB) on 8 devices: each pass moves 7/8 of 2 GB.
    for stage in (0, 1, 2):
        assert zj.comm_bytes(1e9, 8, stage) == pytest.approx(2 * 2e9 * 7 / 8)
    assert zj.comm_bytes(1e9, 8, 3) == pytest.approx(3 * 2e9 * 7 / 8)
    assert zj.comm_bytes(1e9, 8, 3) / zj.comm_bytes(1e9, 8, 0) == pytest.approx(1.5)
    assert zj.comm_bytes(1e9, 1, 3) == 0.0
    assert zj.comm_bytes(1e9, 64, 0, dtype_bytes=4) == pytest.approx(2 * 4e9 * 63 / 64)


def test_choose_stage_picks_the_lowest_stage_that_fits() -> None:
    # Figure 1's model on 64 devices: 120 / 31.4 / 16.6 / 1.9 GB of model states.
    assert zj.choose_stage(7.5e9, 64, "200GB").stage == 0
    assert zj.choose_stage(7.5e9, 64, "80GB", "10GB").stage == 1
    assert zj.choose_stage(7.5e9, 64, "20GB").stage == 2
    assert zj.choose_stage(7.5e9, 64, "10GB").stage == 3
    choice = zj.choose_stage(7.5e9, 64, "80GB", "10GB")
    assert choice.fits == (False, True, True, True)
    assert choice.total(1) == pytest.approx(41.40625e9)
    assert "stage 1 fits" in choice.reason and "130.0 GB" in choice.reason


def test_choose_stage_says_what_would_make_it_fit() -> None:
    # 7.5B on 8 x 16 GB with 4 GB of activations: stage 3 needs 120/8 = 15 GB + 4 GB.
    choice = zj.choose_stage(7.5e9, 8, "16GB", "4GB")
    assert choice.stage is None and choice.fits == (False,) * 4
    assert choice.min_devices == 10  # 120 GB / (16 - 4) GB
    assert zj.choose_stage(7.5e9, 10, "16GB", "4GB").stage == 3
    assert zj.choose_stage(7.5e9, 9, "16GB", "4GB").stage is None
    assert choice.offload_stage == 3  # (2 + 2) x 7.5e9 / 8 = 3.75 GB + 4 GB on the device
    assert choice.max_activation_bytes == pytest.approx(1e9)
    for words in ("10 devices", "offloaded", "activations <= 1.0 GB"):
        assert words in choice.reason, choice.reason
    hopeless = zj.choose_stage(1e9, 8, "10GB", "20GB")
    assert hopeless.stage is None and hopeless.min_devices is None
    assert "activations alone" in hopeless.reason


def test_efficiency_and_the_bandwidth_it_needs() -> None:
    # 7B bf16 at N = 64, stage 3: 3 x 14 GB x 63/64 = 41.34 GB per step; at 10 GB/s that is 4.13 s.
    comm = 3 * 14e9 * 63 / 64
    eff = zj.efficiency(7e9, 64, 3, compute_time="10s", bandwidth="10GB/s")
    assert eff == pytest.approx(10 / (10 + comm / 10e9))
    assert zj.efficiency(7e9, 64, 3, compute_time=10.0, bandwidth="80Gb/s") == pytest.approx(eff)  # bits
    assert zj.required_bandwidth(7e9, 64, 3, compute_time="10s", target=eff) == pytest.approx(10e9)
    assert zj.required_bandwidth(1e9, 8, 0, compute_time="1s", target=0.5) == pytest.approx(3.5e9)


def test_sizes_rates_durations_and_counts_parse() -> None:
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("80 GiB") == 80 * 2**30
    assert parse_bytes("1.5e9") == 1.5e9 and parse_bytes(512) == 512.0
    assert parse_bytes("300GB/s", rate=True) == 300e9
    assert parse_bytes("200Gb/s", rate=True) == 25e9
    assert parse_seconds("250ms") == 0.25 and parse_seconds("2min") == 120
    assert parse_count("7B") == 7e9 and parse_count("350M") == 350e6 and parse_count("7e9") == 7e9


# -- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: zj.model_state_bytes(0, 8, 1), "num_params must be positive, got 0"),
        (lambda: zj.model_state_bytes(-7e9, 8, 1), "num_params must be positive"),
        (lambda: zj.comm_bytes(7e9, 0, 1), "num_devices must be a positive integer"),
        (lambda: zj.choose_stage(7e9, -8, "80GB"), "num_devices must be a positive integer"),
        (lambda: zj.model_state_bytes(7e9, 8, 4), "stage must be 0, 1, 2 or 3, got 4"),
        (lambda: zj.comm_bytes(7e9, 8, -1), "stage must be 0, 1, 2 or 3, got -1"),
        (lambda: zj.choose_stage(7e9, 8, "80XB"), "cannot read '80XB' as a size in bytes"),
        (lambda: zj.choose_stage(7e9, 8, "80GB", "lots"), "cannot read 'lots'"),
        (lambda: zj.choose_stage(7e9, 8, "80Gb"), "cannot read '80Gb'"),  # bits are for bandwidths
        (lambda: zj.efficiency(7e9, 8, 3, compute_time="10s", bandwidth="fast"), "cannot read 'fast' as a bandwidth"),
        (lambda: zj.efficiency(7e9, 8, 3, compute_time="10 parsecs", bandwidth=1e9), "as a duration"),
        (lambda: zj.required_bandwidth(7e9, 8, 3, compute_time=1, target=1.0), "target efficiency must be in"),
        (lambda: zj.choose_stage(7e9, 8, 0), "device_bytes must be positive"),
    ],
)
def test_bad_input_is_refused_with_the_bad_value_named(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("bad", [2.5, True, "8"])
def test_a_non_integer_device_count_is_a_type_error(bad) -> None:
    with pytest.raises(TypeError, match="num_devices must be a positive integer"):
        zj.model_state_bytes(7e9, bad, 1)


def test_plan_refuses_a_device_count_the_batch_cannot_be_split_over() -> None:
    with pytest.raises(ValueError, match="global batch of 8 cannot be split over 3 devices; use a multiple of 3"):
        zj.plan(num_devices=3, factory_kwargs={"global_batch": 8})
    with pytest.raises(ValueError, match="num_devices must be a positive integer"):
        zj.plan(num_devices=0)
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 5"):
        zj.plan(num_devices=8, stages=[5])
    with pytest.raises(ValueError, match="cannot read '80XB'"):
        zj.plan(num_devices=8, device_bytes="80XB")
    with pytest.raises(ValueError, match="cannot be imported by the planning process"):
        zj.plan(lambda stage, mesh: None, num_devices=8)


# -- plan: compiling on abstract inputs -------------------------------------------------------------------------


def test_plan_reports_a_1b_model_at_n64_without_allocating_it() -> None:
    model = {"vocab": 32000, "dim": 2048, "depth": 20, "heads": 16, "seq": 512}
    start = time.perf_counter()
    result = zj.plan(num_devices=64, device_bytes="80GB", stages=[3], factory_kwargs=model, grads=False)
    seconds = time.perf_counter() - start
    (report,) = result.reports
    phi = report.num_params
    assert phi == 1_139_126_272 and report.num_devices == 64 and report.abstract
    # fp32 parameters alone are 4.6 GB, model states 18 GB; the compiling process stayed far below.
    assert result.max_rss_bytes < 0.25 * 4 * phi, result.max_rss_bytes
    assert seconds < 60, seconds
    f = zj.model_state_bytes(phi, 64, 3, param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert report.state_bytes["params"] == pytest.approx(f.params, rel=0.01)
    assert report.state_bytes["optimizer"] == pytest.approx(f.optimizer, rel=0.01)
    m = report.memory
    assert m["peak"] == m["argument"] + m["output"] + m["temp"] - m["alias"] > report.state_bytes["params"]
    assert result.fits == {3: True} and result.recommended == 3
    assert report.comm.measured == pytest.approx(zj.comm_bytes(phi, 64, 3, dtype_bytes=4), rel=0.02)
    report.check()


def test_plan_of_a_built_step_on_abstract_inputs_matches_the_live_arrays() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_params())
    abstract_state = zj.init_state(abstract_params, tx, policy)
    abstract_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=policy.batch_sharding()), mlp_batch()
    )
    result = zj.plan(step, abstract_state, abstract_batch, device_bytes="1MB")
    live = zj.audit(step, zj.init_state(mlp_params(), tx, policy), mlp_batch())
    (planned,) = result.reports
    assert planned.abstract and not live.abstract
    assert dict(planned.state_bytes) == dict(live.state_bytes)
    assert planned.memory == live.memory
    assert planned.comm == live.comm
    assert result.fits == {3: True}
    # on CPU nothing changes: no TPU HBM figure, fit judged on the peak
    assert result.hbm == {} and result.out_of_memory == {} and result.needs == result.peaks
    assert result.verdict().startswith("stage 3 is the lowest planned stage that fits") and result.check() is result
    short = dataclasses.replace(result, device_bytes=result.peaks[3] - 1000)
    with pytest.raises(ValueError, match=r"no planned stage fits .* stage 3, needs .* \(1000 B over\)\. Try "):
        short.check()
    with pytest.raises(ValueError, match="spans 8 devices, not num_devices=64"):
        zj.plan(step, abstract_state, abstract_batch, num_devices=64)


# -- the command line --------------------------------------------------------------------------------------------


def test_plan_cli_prints_the_table_the_recommendation_and_writes_the_chart(tmp_path, capsys) -> None:
    png = tmp_path / "memory.png"
    argv = ["plan", "--params", "7.5e9", "--devices", "64", "--device-memory", "80GB", "--activations", "10GB"]
    argv += ["--bandwidth", "300GB/s", "--compute-time", "10s", "--plot", str(png)]
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    for text in ("120.0 GB", "41.4 GB", "26.6 GB", "11.9 GB", "Recommendation: stage 1", "29.5 GB", "44.3 GB"):
        assert text in out, (text, out)
    assert "Bandwidth for 90% efficiency at stage 1" in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_cli_reports_hybrid_meshes_per_axis(capsys) -> None:
    argv = ["plan", "--params", "7e9", "--devices", "8", "--replicas", "4", "--device-memory", "80GB"]
    assert cli.main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "R = 4 replicas x N = 8 partitions (32 devices)" in out
    hsdp3 = zj.model_state_bytes(7e9, 8, 3)  # HSDP holds ZeRO at N
    hpz3 = zj.model_state_bytes(7e9, 8, 3, replicas=4, optimizer_over_replicas=True)
    assert f"{hsdp3.total / 1e9:.1f} GB" in out and f"{hpz3.total / 1e9:.1f} GB" in out  # 14.0 GB, 4.8 GB
    # Across the replicas only the 1/N piece moves: 2 * 7e9/8 * 2 B * 3/4 = 2.6 GB per step, every stage.
    assert zj.comm_bytes_per_axis(7e9, 8, 3, replicas=4)["replica"] == pytest.approx(2.625e9)
    assert "2.6 GB" in out


def test_plan_cli_reports_bad_input_and_exits_2(capsys) -> None:
    assert cli.main(["plan", "--params", "7e9", "--device-memory", "80XB"]) == 2
    assert "cannot read '80XB' as a size in bytes" in capsys.readouterr().err
    assert cli.main(["plan", "--params", "-1", "--device-memory", "80GB"]) == 2
    assert "num_params" in capsys.readouterr().err
    assert cli.main(["plan", "--params", "7e9", "--device-memory", "80GB", "--bandwidth", "1GB/s"]) == 2
    assert "--compute-time" in capsys.readouterr().err


def test_no_stage_fits_is_said_plainly(capsys) -> None:
    assert (
        cli.main(["plan", "--params", "7.5e9", "--devices", "8", "--device-memory", "16GB", "--activations", "4GB"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "no stage fits" in out and "10 devices" in out
    assert math.isclose(zj.model_state_bytes(7.5e9, 8, 3).total, 15e9)


def test_a_bandwidth_needs_a_unit_and_sizes_print_one_way() -> None:
    with pytest.raises(ValueError, match=r"'300' has no unit.*KB, MB, GB.*KiB.*'300GB/s' or '200Gb/s'"):
        parse_bandwidth("300", "--bandwidth")
    assert parse_bandwidth("300GB/s") == 300e9 and parse_bandwidth(1e9) == 1e9  # a number is bytes per second
    assert fmt_bytes(1536) == "1.50 KiB" and fmt_bytes(120e9, decimal=True) == "120.0 GB"
    assert fmt_bytes(5 * 2**40) == "5.00 TiB" and fmt_bytes(12) == "12 B"
