"""ZeRO-R's constant-size buffers (issue 28, C_B): ``ZeroPolicy(bucket_bytes=...)``.

The step: ``zj.apply_layers`` over blocks of two 128 KiB weights (dim 128) at stage 3 on 8 devices.
On the TPU compiler (v5p:2x2x2, deviceless, libtpu 0.0.42.1; each block gathered in place) the combiner
merges the gradient reductions of every block into one all-reduce that grows with depth (one weight of
each block and block 0's other: 512 KiB at depth 3); told a 128 KiB bound it sends each alone. XLA:CPU
combines nothing, so there the bound adds no option and changes no bit. Each compile takes 2-5 s.
"""

from __future__ import annotations

import functools
import os

# Two processes (the suite's xdist workers) may load libtpu at once; a deviceless compile needs no chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from _models import reduced_by_psum_scatter  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax._audit import report as _report  # noqa: E402
from zero_jax._cli import cli  # noqa: E402


@pytest.fixture(autouse=True)
def _reduced_by_psum_scatter():
    """The combiner facts here are of layer gradients reduced by ``psum_scatter`` (libtpu combines their
    all-reduces); the seam's TPU reduction, a ring of ppermutes, is combined by no combiner."""
    with reduced_by_psum_scatter():
        yield

DIM, DEPTH = 128, 3
WEIGHT = DIM * 2 * DIM * 4  # bytes of w1 (and of w2): 128 KiB
COMBINER = "xla_jf_crs_combiner_threshold_in_bytes"


def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]


def params(abstract: bool) -> dict:
    keys = iter(jax.random.split(jax.random.key(0), 2 * DEPTH))

    def make(*shape: int) -> jax.Array | jax.ShapeDtypeStruct:
        if abstract:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        return jnp.zeros(shape) if len(shape) == 1 else jax.random.normal(next(keys), shape) / np.sqrt(shape[0])

    return {"blocks": [{"w1": make(DIM, 2 * DIM), "b": make(2 * DIM), "w2": make(2 * DIM, DIM)} for _ in range(DEPTH)]}


def built(backend: str, bucket: int | str | None, options: dict | None = None, abstract: bool = True) -> tuple:
    """The step, its state (abstract: nothing is allocated) and a batch."""
    if backend == "cpu":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    else:
        mesh = zj.topology_mesh("v5p:2x2x2")
    policy = zj.ZeroPolicy(3, mesh, bucket_bytes=bucket)
    loss = lambda p, b: jnp.mean(zj.apply_layers(block, p["blocks"], b["x"], policy, prefetch=1) ** 2)  # noqa: E731
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(loss, tx, policy, gather="manual", compiler_options=options)
    if abstract:
        batch = {"x": jax.ShapeDtypeStruct((16, DIM), jnp.float32, sharding=policy.batch_sharding())}
    else:
        batch = {"x": jax.random.normal(jax.random.key(1), (16, DIM), jnp.float32)}
    return step, zj.init_state(params(abstract), tx, policy), batch


@functools.cache
def audited(backend: str, bucket: int | str | None, forced: bool = False) -> zj.AuditReport:
    """``forced``: the user's compiler options put the combiner's default threshold (120 MiB) back."""
    options = {COMBINER: str(120 * 2**20)} if forced else None
    return zj.audit(*built(backend, bucket, options), grads=False)


def test_on_cpu_the_bound_changes_no_bit_and_no_byte_on_the_wire() -> None:
    finals = []
    for bucket in (None, "64KiB"):
        step, state, batch = built("cpu", bucket, abstract=False)
        assert not any("combine" in k for k in step.compiler_options or {})  # XLA:CPU combines nothing
        for _ in range(2):
            state, _ = step(state, batch)
        finals.append([np.asarray(x).view(np.uint32) for x in jax.tree.leaves(state.params)])
    assert all(np.array_equal(a, b) for a, b in zip(*finals, strict=True))
    free, bounded = audited("cpu", None), audited("cpu", "64KiB")
    assert bounded.comm.measured == free.comm.measured and bounded.comm.theory == free.comm.theory
    # Each collective is one weight (128 KiB), larger than the bound: it goes alone, and that is no violation.
    assert bounded.buffers.largest().bytes == WEIGHT and bounded.ok and bounded.check() is bounded
    assert "bounded by bucket_bytes = 64.00 KiB: none combined over it; " in str(bounded)
    assert "single tensor(s) larger than the bound go alone" in str(bounded)


def test_a_state_made_without_the_bound_trains_in_a_step_with_it_bitwise() -> None:
    # bucket_bytes and offload_activations change what a step does, not how its state is laid out.
    step, state, batch = built("cpu", "64KiB", abstract=False)
    plain_step, plain_state, _ = built("cpu", None, abstract=False)
    assert plain_state.policy != state.policy and state.policy.lays_out_like(plain_state.policy)
    assert plain_state.policy.replace(offload_activations=True).lays_out_like(plain_state.policy)
    assert not plain_state.policy.replace(stage=2).lays_out_like(plain_state.policy)
    moved, _ = step(plain_state, batch)
    ours, _ = step(state, batch)
    assert moved.policy == step.policy and moved.opt_state.policy == step.policy
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(ours), strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    back, _ = plain_step(moved, batch)  # and back into a step without the bound
    assert back.policy == plain_state.policy


def test_the_tpu_combiner_is_told_the_bound_and_keeps_to_it() -> None:
    free, bounded = audited("tpu", None), audited("tpu", WEIGHT)
    combined = free.buffers.largest(_report.COMPILED)
    # Unbounded, v5p merges the gradient reductions of several blocks into one buffer that grows with depth.
    assert (combined.kind, combined.bytes, len(combined.shapes)) == ("reduce-scatter", (DEPTH + 1) * WEIGHT, DEPTH + 1)
    assert combined.block == " + ".join(f"block {i}" for i in range(DEPTH))
    with pytest.raises(zj.AuditError, match="over max_buffer_bytes = 128.00 KiB"):
        free.check(max_buffer_bytes=WEIGHT)
    step = built("tpu", WEIGHT)[0]
    assert step.compiler_options[COMBINER] == str(WEIGHT)
    assert bounded.buffers.bound == WEIGHT and bounded.ok
    assert all(b.bytes <= WEIGHT for b in bounded.buffers.buffers)
    assert bounded.check() is bounded and bounded.check(max_buffer_bytes=WEIGHT) is bounded
    blocks = [b for b in bounded.buffers.blocks if b.name.startswith("block ")]
    assert len(blocks) == DEPTH and all(b.compiled["reduce-scatter"] == 2 for b in blocks)  # one op per weight
    assert bounded.comm.measured == free.comm.measured  # the same bytes, in more buffers
    assert "communication buffers bounded by bucket_bytes = 128.00 KiB: none combined over it" in str(bounded)


def test_check_flags_a_buffer_over_the_policys_bound_without_being_asked() -> None:
    report = audited("tpu", WEIGHT, forced=True)  # the user's options win over the policy's
    over = [v for v in report.violations if v.kind == _report.BUFFER_OVER_BOUND]
    assert len(over) == 1 and not report.ok  # the one buffer of every block's reductions
    assert all("over bucket_bytes = 128.00 KiB" in v.message and "512.00 KiB" in v.message for v in over)
    with pytest.raises(zj.AuditError, match="over bucket_bytes"):
        report.check()
    assert "1 combined buffer(s) over it" in str(report)


@pytest.mark.parametrize(
    ("value", "kind"),
    [(0, ValueError), (-4, ValueError), (1.5, ValueError), ("4 parsecs", ValueError), (True, TypeError),
     ([4], TypeError)],
)  # fmt: skip
def test_a_bad_bucket_bytes_is_one_error_naming_the_fix(value: object, kind: type) -> None:
    mesh = jax.make_mesh((8,), ("data",))
    with pytest.raises(kind, match=r"bucket_bytes must be a positive whole number .* bucket_bytes='4MiB'"):
        zj.ZeroPolicy(3, mesh, bucket_bytes=value)
    with pytest.raises(ValueError, match="2 problems"):
        zj.ZeroPolicy(7, mesh, bucket_bytes=0)


def test_sizes_read_as_bytes() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    assert zj.ZeroPolicy(3, mesh, bucket_bytes="4MiB").bucket_bytes == 4 * 2**20
    assert zj.ZeroPolicy(3, mesh, bucket_bytes="1MB").bucket_bytes == 10**6
    assert zj.ZeroPolicy(3, mesh, bucket_bytes=np.int64(4096)).bucket_bytes == 4096
    assert zj.ZeroPolicy(3, mesh).bucket_bytes is None


def test_the_planner_reports_the_bound_and_the_largest_buffer() -> None:
    p = zj.plan(num_devices=8, stages=[3], grads=False, bucket_bytes="256KiB",
                factory_kwargs=dict(vocab=64, dim=64, depth=2, heads=2, seq=16))  # fmt: skip
    assert p.bucket_bytes == 256 * 2**10 and p.reports[0].buffers.bound == 256 * 2**10
    largest = p.largest_buffers[3]
    assert 0 < largest <= 256 * 2**10 and p.reports[0].ok
    assert f"bounded by bucket_bytes = 256.00 KiB: the largest per device, stage 3 {_report.fmt_bytes(largest)}" in str(
        p
    )
    with pytest.raises(TypeError, match="a built step already has its policy's bound"):
        zj.plan(built("cpu", None)[0], *built("cpu", None)[1:], bucket_bytes="1MiB")


def test_plan_bucket_bytes_on_the_command_line(capsys) -> None:
    assert (
        cli.main(["plan", "--params", "1.5e9", "--devices", "64", "--device-memory", "32GB", "--bucket-bytes", "4MiB"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    # The ZeRO paper's example: an fp32 buffer fused from a 1.5B model's gradients is 6 GB (5.59 GiB).
    assert "at most 4.00 MiB each per device (ZeroPolicy(..., bucket_bytes=4194304)" in out
    assert "grow with the model to 2.79 GiB (Ψ x --grad-bytes)" in out  # bf16 gradients: 3 GB
    assert cli.main(["plan", "--params", "1.5e9", "--device-memory", "32GB", "--bucket-bytes", "4"]) == 2
    assert "has no unit" in capsys.readouterr().err
