"""zj.audit's ZeRO-R figures (issue 28): fragmentation (allocation beside XLA's live peak, and the
buffers alive there) and communication buffers (collectives per block, the largest buffer, the
``check(max_buffer_bytes=...)`` bound).

Each figure is compared with the compile's own XLA dump, read here with the test's own patterns: the
same step compiled once more with ``xla_dump_to``. The step: two ``zj.apply_layers`` blocks (dim 128)
at stage 3 on 8 devices, on XLA:CPU (packed within a few percent of its live peak) and on the TPU
compiler for v5p:2x2x2, deviceless (libtpu 0.0.42.1 allocated 4.4x its live peak here). Each compile
takes 2-4 s.
"""

from __future__ import annotations

import functools
import glob
import math
import os
import re
from pathlib import Path

# Two processes (the suite's xdist workers) may load libtpu at once; a deviceless compile needs no chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from _models import reduced_by_psum_scatter  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure  # noqa: E402
from zero_jax._audit import report as _report  # noqa: E402
from zero_jax._base.units import fmt_bytes  # noqa: E402


@pytest.fixture(autouse=True)
def _reduced_by_psum_scatter():
    """The per-block facts here are of layer gradients reduced by ``psum_scatter``; with the seam's TPU
    ring the program has its N - 1 ppermute steps per weight instead."""
    with reduced_by_psum_scatter():
        yield

DIM, DEPTH = 128, 2
WHOLE_WEIGHT = DIM * 2 * DIM * 4  # bytes of w1 (and w2) gathered whole
PEAK_TOTAL = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+) bytes")
PEAK_LINE = re.compile(r"^\s+([^\s{]+)(\{[\d,]*\}): (\d+) bytes \(cumulative", re.M)
DEFAULT_SPACE = re.compile(r"Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)")


def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]


@functools.cache
def built(backend: str) -> tuple:
    """The step on abstract inputs: nothing is allocated."""
    if backend == "cpu":
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    else:
        mesh = zj.topology_mesh("v5p:2x2x2")
    policy = zj.ZeroPolicy(3, mesh)
    f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    params = {"blocks": [{"w1": f32((DIM, 2 * DIM)), "b": f32((2 * DIM,)), "w2": f32((2 * DIM, DIM))}] * DEPTH}
    loss = lambda p, b: jnp.mean(zj.apply_layers(block, p["blocks"], b["x"], policy, prefetch=1) ** 2)  # noqa: E731
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    step = zj.make_train_step(loss, tx, policy, gather="manual")
    batch = {"x": jax.ShapeDtypeStruct((16, DIM), jnp.float32, sharding=policy.batch_sharding())}
    return step, zj.init_state(params, tx, policy), batch


@functools.cache
def audited(backend: str) -> zj.AuditReport:
    return zj.audit(*built(backend), grads=False)


def dumped(backend: str, tmp_path: Path) -> tuple[int, int, list[tuple[str, int]]]:
    """The same compile's dump read here: the allocated device memory, the live peak and the buffers
    alive at the peak (name, bytes)."""
    step, state, batch = built(backend)
    step.lower(state, batch).compile(compiler_options=dict(measure.FAST_COMPILE, xla_dump_to=str(tmp_path)))
    newest = lambda pattern: max(glob.glob(str(tmp_path / pattern)), key=os.path.getmtime)  # noqa: E731
    usage, ranges = Path(newest("*memory-usage-report*")).read_text(), Path(newest("*live-range.txt")).read_text()
    peak = int(PEAK_TOTAL.search(ranges).group(1).replace(" ", ""))
    section = ranges[ranges.index("(peak):") : ranges.index("Stack trace breakdown")]
    buffers = [(name, int(nbytes)) for name, _, nbytes in PEAK_LINE.findall(section)]
    return int(DEFAULT_SPACE.search(usage).group(1)), peak, buffers


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_memory_reports_the_live_peak_beside_the_allocation_as_the_dump_has_them(backend: str, tmp_path) -> None:
    report = audited(backend)
    allocated, peak, buffers = dumped(backend, tmp_path)
    m, frag = report.memory, report.fragmentation
    assert (m["allocated"], m["live_peak"]) == (allocated, peak)
    assert m["fragmentation"] == pytest.approx(allocated / peak) == frag.ratio
    assert (frag.allocated, frag.live_peak) == (allocated, peak)
    # The largest buffers alive at the peak, largest first (ties in any order).
    shown = [(b.name, b.bytes) for b in frag.buffers]
    assert [b for _, b in shown] == sorted((b for _, b in buffers), reverse=True)[: _report.PEAK_BUFFERS_SHOWN]
    assert set(shown) <= set(buffers) and frag.at


def test_fragmentation_on_the_tpu_compiler_is_large_and_the_text_names_the_buffers_at_the_peak() -> None:
    report = audited("tpu")
    frag = report.fragmentation
    assert frag.fragmented and frag.ratio > 2  # libtpu 0.0.42.1: 4.4x
    text = str(report)
    assert f"= {frag.ratio:.3f}: allocation exceeds the live peak by {frag.ratio - 1:.0%}" in text
    assert f"the peak is at {frag.at}" in text
    largest = frag.buffers[0]
    assert any(largest.name in line and fmt_bytes(largest.bytes) in line for line in text.splitlines())


def test_fragmentation_on_cpu_is_small_and_the_text_says_so() -> None:
    report = audited("cpu")
    frag = report.fragmentation
    assert not frag.fragmented and 1.0 <= frag.ratio <= 1 + _report.FRAGMENTATION_SLACK
    assert f"= {frag.ratio:.3f} (within 10%: no fragmentation)" in str(report)
    assert "fragmentation:" not in str(report)


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_collectives_per_block_from_the_post_spmd_program(backend: str) -> None:
    report = audited(backend)
    weights = {b.name: b.weights for b in report.layers.blocks}  # w1 and w2 (b is kept whole: 256 elements)
    blocks = {b.name: b for b in report.buffers.blocks}
    for i in range(DEPTH):
        blk = blocks[f"block {i}"]
        n = weights[f"block {i}"]
        assert blk.post_spmd == {"all-gather": 2 * n, "reduce-scatter": n}  # gathered twice, reduced once
        assert blk.compiled["all-gather"] == 2 * n
        assert blk.largest >= WHOLE_WEIGHT
    largest = report.buffers.largest()
    assert (largest.kind, largest.bytes, largest.program) == ("all-gather", WHOLE_WEIGHT, _report.POST_SPMD)
    assert largest.block.startswith("block ")
    assert "largest communication buffer (post-SPMD): 128.00 KiB, all-gather" in str(report)


def test_the_tpu_compiler_combines_gradient_reductions_of_two_blocks_into_one_larger_buffer() -> None:
    buffers = audited("tpu").buffers
    compiled = buffers.largest(_report.COMPILED)
    # v5p (each block gathered in place): block 1's second reduce-scatter deferred and done with both of block
    # 0's as one combined all-reduce of three whole gradients.
    assert (compiled.kind, compiled.bytes, len(compiled.shapes)) == ("reduce-scatter", 3 * WHOLE_WEIGHT, 3)
    assert compiled.block == "block 0 + block 1"
    assert [b.compiled["reduce-scatter"] for b in buffers.blocks if b.name.startswith("block ")] == [1, 2]
    assert compiled.bytes > buffers.largest().bytes


def test_check_flags_each_buffer_over_the_bound_naming_the_collective() -> None:
    report = audited("cpu")
    largest = report.buffers.largest().bytes
    assert report.check(max_buffer_bytes=largest) is report
    with pytest.raises(zj.AuditError) as e:
        report.check(max_buffer_bytes=largest - 1)
    over = [b for b in report.buffers.buffers if b.bytes > largest - 1]
    found = e.value.violations
    assert len(found) == len(over) >= 2 * DEPTH  # each block's w1 and w2 gathers, in both programs
    assert {v.kind for v in found} == {_report.BUFFER_OVER_BOUND}
    for v, b in zip(found, over, strict=True):
        assert b.name in v.message and b.kind in v.message and b.op_name in v.message
        assert "128.00 KiB" in v.message and "over max_buffer_bytes" in v.message
    assert not report.violations  # the bound is the caller's: the report itself is unchanged


@pytest.mark.parametrize("bound", [0, -1, True, "1MiB", math.nan])
def test_a_bad_bound_is_one_error(bound: object) -> None:
    with pytest.raises(ValueError, match="max_buffer_bytes must be a positive number"):
        audited("cpu").check(max_buffer_bytes=bound)


def test_live_peak_is_read_from_any_compile_with_its_dump() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    f = jax.jit(lambda x: jnp.sum(jnp.sin(x) @ x.T), in_shardings=jax.NamedSharding(mesh, jax.P("data")))
    compiled = measure.compile_with_dump(f.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32)))
    peak = compiled.live_peak
    assert isinstance(peak, measure.LivePeak) and peak.bytes >= max(b for _, _, b in peak.buffers) > 0
    assert peak.bytes == sum(b for _, _, b in peak.buffers)  # the listed buffers are all that is alive there
