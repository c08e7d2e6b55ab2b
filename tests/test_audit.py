"""zj.audit: state bytes and communication of the compiled step against the stage's contract."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax._audit import report as _report
from zero_jax._cli import cli as cli
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

# The reference transformer, deep enough that its stacked per-layer vectors
# (16, 64) reach min_shard_size and are partitioned: only final_norm (2 x 64)
# stays whole, so the paper's formula (everything / N) holds within 1%.
CFG = TransformerConfig(vocab=64, dim=64, depth=16, heads=2, seq=16)
PHI = CFG.num_params()  # 804,992
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}


# (N, stage): every stage on 8 devices, and the formulas' N on 2 in stage 3 (everything divided by N: the
# optimizer state too, what stage 1 divides; stage 1 itself is the N = 8 case).
CASES = [(8, stage) for stage in range(4)] + [(2, 3)]


@pytest.fixture(scope="module")
def reference_reports() -> Callable[[int, int], zj.AuditReport]:
    """``reference_reports(n, stage)``: the case's audit, made when a test first asks for it (a tier that runs
    one case compiles one)."""
    params = init_params(CFG, jax.random.key(0))

    @functools.cache
    def report(n: int, stage: int) -> zj.AuditReport:
        batch = synthetic_batch(CFG, 2 * n, jax.random.key(1))
        policy = zj.ZeroPolicy(stage, make_mesh(n), stacked="layers")
        tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
        step = zj.make_train_step(make_loss_fn(CFG, policy), tx, policy, gather="manual")
        return zj.audit(step, zj.init_state(params, tx, policy), batch)

    return report


@pytest.mark.slow
@pytest.mark.parametrize(("n", "stage"), CASES)
def test_reference_model_bytes_and_communication_match_the_formulas(reference_reports, n: int, stage: int) -> None:
    report = reference_reports(n, stage)
    assert report.num_params == PHI and report.num_devices == n
    formula = zj.model_state_bytes(PHI, n, stage, **FP32_ADAM)
    for category, expected in zip(("params", "grads", "optimizer"), formula, strict=True):
        assert report.state_bytes[category] == pytest.approx(expected, rel=0.01), category
        assert report.state_bytes_min[category] == report.state_bytes[category]  # balanced
    assert report.bytes_per_param == pytest.approx({"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8}, rel=1e-3)
    assert report.comm.measured == pytest.approx(zj.comm_bytes(PHI, n, stage, dtype_bytes=4), rel=0.02)
    # The exact accounting (padding, leaves kept whole, re-gathers the backward skips) to 0.1%.
    assert report.comm.accounted_ratio == pytest.approx(1.0, abs=1e-3)
    m = report.memory
    assert m["peak"] == m["argument"] + m["output"] + m["temp"] - m["alias"] > 0
    report.check()
    kinds = {c.kind for c in report.collectives if c.shape != ()}
    assert kinds == ({"all-reduce"} if stage == 0 else {"all-reduce", "reduce-scatter", "all-gather"})
    if stage >= 1:  # only final_norm's two 64-vectors are all-reduced
        assert max(c.bytes for c in report.collectives if c.kind == "all-reduce") == 64 * 4


@pytest.mark.slow
def test_stage_3_explains_the_re_gathers_the_backward_pass_skips(reference_reports) -> None:
    report = reference_reports(8, 3)
    assert report.comm.ratio < 1.0  # the embeddings' backward needs no re-gather
    skipped = " ".join(report.comm.skipped_regathers)
    assert "embed/tokens" in skipped and "embed/positions" in skipped
    layer_gathers = [c for c in report.collectives if c.kind == "all-gather" and report.loops.get(c.name)]
    assert layer_gathers and all(report.loops[c.name] == (15,) for c in layer_gathers)  # inside the 16-layer scans
    assert "skipped re-gather" in str(report) and "check: passed" in str(report)


# -- deliberately broken steps ----------------------------------------------------------------------------------


def test_check_names_a_full_gradient_all_reduce_under_stage_2() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8), min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(mlp_params(), tx, policy)

    @jax.jit
    def bad_step(state: zj.TrainState, batch: dict[str, jax.Array]) -> tuple[zj.TrainState, jax.Array]:
        def local(params, b):  # the data-parallel way: all-reduce the whole gradient
            grads = jax.grad(mlp_loss)(jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params), b)
            return jax.tree.map(lambda g: jax.lax.psum(g, "data") / 8, grads)

        grads = jax.shard_map(local, mesh=policy.auto_mesh, in_specs=(P(), P("data")), out_specs=P())(
            state.params, batch
        )
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state), jnp.zeros(())

    report = zj.audit(bad_step, state, mlp_batch(), policy=policy)
    assert "grads" not in report.state_bytes  # a plain jitted step has no .grads
    with pytest.raises(zj.AuditError) as err:
        report.check()
    # The whole-gradient all-reduces (and the all-gathers GSPMD adds to feed them to the
    # partitioned optimizer, which put communication over the theory).
    violations = [v for v in err.value.violations if v.kind == _report.GRADIENT_ALL_REDUCE]
    assert {v.kind for v in err.value.violations} <= {_report.GRADIENT_ALL_REDUCE, _report.COMM_OVER_THEORY}
    message = "\n".join(v.message for v in violations)
    for text in ("f32[12,100]", "the shape of w1", "f32[100,6]", "w2", "f32[100]", "b1", "in stage 2"):
        assert text in message, message
    assert all(f"all-reduce '{v.subject}'" in v.message for v in violations)  # the HLO instruction
    assert "b2" not in message  # (6,) is kept whole by the policy: its all-reduce is allowed


def test_check_names_a_large_leaf_a_policy_leaves_replicated() -> None:
    # min_shard_size=10**9 keeps everything whole: a "ZeRO-3" that partitions nothing.
    policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=10**9)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    report = zj.audit(step, zj.init_state(mlp_params(), tx, policy), mlp_batch())
    with pytest.raises(zj.AuditError) as err:
        report.check()
    replicated = {v.subject for v in err.value.violations if v.kind == _report.REPLICATED_LEAF}
    # w1 (12, 100) has 1200 >= 1024 elements (the default threshold); w2 (600) and b1 (100) are below it.
    assert replicated == {
        "params/w1", "grads/w1", "opt_state/inner_state/0/mu/w1", "opt_state/inner_state/0/nu/w1"
    }  # fmt: skip
    assert any(v.kind == _report.GRADIENT_ALL_REDUCE and "w1" in v.message for v in err.value.violations)
    assert "held whole on a device" in str(err.value) and "min_shard_size is 1000000000" in str(err.value)
    assert {r.path for r in report.replicated} >= replicated
    # Keeping leaves whole on purpose: judge with the policy's own threshold.
    zj.audit(step, zj.init_state(mlp_params(), tx, policy), mlp_batch(), min_shard_size=10**9, grads=False).check()


def test_local_accumulation_must_not_reduce_inside_the_accumulation_loop() -> None:
    policy = zj.ZeroPolicy(1, make_mesh(8), min_shard_size=64)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    batch = mlp_batch(n=32)
    local = zj.make_train_step(mlp_loss, tx, policy, accum_steps=4, accum_mode="local")
    report = zj.audit(local, zj.init_state(mlp_params(), tx, policy), batch, grads=False)
    assert report.accum_mode == "local" and report.accum_steps == 4
    report.check()  # one reduction per step, after the loop
    assert not any(report.loops.get(c.name) for c in report.collectives if c.kind == "reduce-scatter")

    per_microbatch = zj.make_train_step(mlp_loss, tx, policy, accum_steps=4, accum_mode="partitioned")
    state = zj.init_state(mlp_params(), tx, policy)
    honest = zj.audit(per_microbatch, state, batch, grads=False)
    honest.check()  # the theory counts its 4 reductions per step
    assert honest.comm.measured > 1.5 * report.comm.measured
    # The same program, claimed to accumulate locally: every reduction in the loop is named.
    claimed = zj.audit(per_microbatch, state, batch, grads=False, accum_mode="local")
    with pytest.raises(zj.AuditError, match="inside the 4-trip accumulation loop") as err:
        claimed.check()
    assert {v.kind for v in err.value.violations} >= {_report.REDUCE_IN_ACCUM_LOOP, _report.COMM_OVER_THEORY}
    assert any("reduce-scatter" in v.message and "f32[" in v.message for v in err.value.violations)


def test_mixed_precision_is_counted_in_the_runs_dtypes() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8), min_shard_size=64, precision=zj.Precision(compute_dtype=jnp.bfloat16))
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    report = zj.audit(step, zj.init_state(mlp_params(), tx, policy), mlp_batch()).check()
    # ZeRO's 2 + 2 + 12: bf16 compute copy and gradients; fp32 master + Adam's m and v (optimizer).
    assert report.bytes_per_param == pytest.approx({"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}, rel=0.01)
    assert {c.dtype for c in report.collectives if c.kind in ("reduce-scatter", "all-gather")} == {"bf16"}
    assert report.comm.ratio == pytest.approx(1.0, abs=0.02)


# -- bad input ---------------------------------------------------------------------------------------------------


def test_audit_refuses_what_it_cannot_judge() -> None:
    policy = zj.ZeroPolicy(2, make_mesh(8), min_shard_size=64)
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    with pytest.raises(ValueError, match="leading \\(batch\\) dimension must divide by the 8 devices"):
        zj.audit(step, state, mlp_batch(n=12))
    with pytest.raises(TypeError, match="pass policy="):
        zj.audit(jax.jit(lambda s, b: s), {"params": state.params}, mlp_batch())
    with pytest.raises(TypeError, match="must be jax.jit-wrapped"):
        zj.audit(lambda s, b: s, state, mlp_batch())
    with pytest.raises(ValueError, match="accum_steps must be a positive integer"):
        zj.audit(step, state, mlp_batch(), accum_steps=0)


@pytest.mark.slow
def test_audit_cli_prints_every_stage(capsys) -> None:
    argv = ["audit", "--stages", "3", "--depth", "2", "--dim", "64", "--vocab", "64", "--seq", "16"]
    assert cli.main([*argv, "--heads", "2", "--batch-per-device", "1", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "3 P_os+g+p" in out and "All checks passed" in out and "passed" in out
    assert out.count("zj.audit: stage 3") == 1 and "compiled memory per device" in out and "skipped re-gather" in out


@pytest.mark.slow
def test_audit_cli_on_an_hsdp_mesh_reports_the_replica_axis(capsys) -> None:
    argv = ["audit", "--stages", "2", "--depth", "2", "--dim", "64", "--vocab", "64", "--seq", "16", "--heads", "2"]
    assert cli.main([*argv, "--batch-per-device", "1", "--replicas", "2", "--verbose"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "HSDP R = 2 x N = 4" in out and "All checks passed" in out
    assert "by mesh axes:" in out and "replica " in out  # the report's per-axis line


def test_stacked_means_a_prefix_from_the_root_as_in_the_policy() -> None:
    # stacked=("layers",) names the root subtree "layers" only: "head/layers" is an ordinary 1-D leaf,
    # which the partition rule cuts, so keeping it whole is a violation (it was once read as stacked).
    params = {"layers": {"w": jnp.ones((4, 64))}, "head": {"layers": jnp.ones((4096,))}}
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers", min_shard_size=10**9)  # keeps everything whole
    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    loss = lambda p, b: jnp.mean(b @ p["layers"]["w"].T) + jnp.mean(p["head"]["layers"] ** 2)  # noqa: E731
    step = zj.make_train_step(loss, tx, policy)
    report = zj.audit(step, zj.init_state(params, tx, policy), jnp.ones((16, 64)), min_shard_size=0, grads=False)
    replicated = {v.subject for v in report.violations if v.kind == _report.REPLICATED_LEAF}
    assert replicated == {"params/layers/w", "params/head/layers"}, replicated


AUDIT_UNDER_PERSISTENT_CACHE = """
import jax, optax, sys
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
sys.path.insert(0, sys.argv[2])
from _models import make_mesh, mlp_batch, mlp_loss, mlp_params
import zero_jax as zj
policy = zj.ZeroPolicy(3, make_mesh(8), min_shard_size=64)
tx = zj.shard_optimizer(optax.adam(1e-2), policy)
step = zj.make_train_step(mlp_loss, tx, policy)
state = zj.init_state(mlp_params(), tx, policy)
state, _ = step(state, mlp_batch())  # compiled and written to the persistent cache
zj.audit(step, state, mlp_batch())
report = zj.audit(step, state, mlp_batch())  # the same program: a cache hit would compile (and dump) nothing
print("GATHERS", sum(c.kind == "all-gather" for c in report.collectives))
"""


def test_audit_compiles_for_itself_under_jax_persistent_compilation_cache(tmp_path) -> None:
    # A user with jax_compilation_cache_dir set audits a step twice: the second audit still reads the
    # partitioned program (a cache hit would skip the compile and its dump).
    script = tmp_path / "audit_cached.py"
    script.write_text(AUDIT_UNDER_PERSISTENT_CACHE)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "cache"), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "cache").iterdir()), "the step was not written to the persistent cache"
    gathers = int(done.stdout.split("GATHERS")[-1])
    assert gathers >= 2  # stage 3 gathers w1 and w2 for the forward pass
