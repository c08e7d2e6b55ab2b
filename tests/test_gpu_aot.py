"""Compiling for NVIDIA GPU hosts on this machine (issue 39, items 1, 2 and 6): ``zj.topology_mesh("h100:1x8")``,
``zj.gpu_slice``, ``zj.plan(topology=...)``, ``python -m zero_jax plan --topology ... --compile`` and ``zj.audit`` on
the GPU program, with the real GPU compiler (the CUDA plugin, ``pip install -e ".[gpu]"``: never skipped) and no GPU.

The names and bad inputs need no compile (loading the plugin's topology: about 1 s); the reference transformer's
compiles (2 layers, dim 128, bf16 compute, on h100:1x8, N = 8: 15-35 s each on 2 loaded cores) are marked slow.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import one_line

import zero_jax as zj
from zero_jax._audit.hlo import compile_with_dump
from zero_jax._base.units import fmt_bytes
from zero_jax._cli import cli
from zero_jax._plan.plan import reference_step
from zero_jax._plan.topology import (
    CUDA_NOT_STARTED,
    CUDA_PLUGINS,
    GPU_SPECS,
    INSTALL_CUDA_PLUGIN,
    gpu_name,
    is_gpu_name,
)

GiB = 2**30
TINY = dict(vocab=256, dim=128, depth=2, heads=4, seq=64, compute_dtype="bfloat16")  # Φ = 469,504
#: device_memory_size of XLA's H100 SXM spec (xla/backends/gpu/target_config/specs/h100_sxm.txtpb).
H100_BYTES = 84942979072
#: jax 0.12.1's GPU compiler (jax-cuda13-plugin 0.12.1) runs some collectives synchronously where 0.10.2's
#: (jax-cuda12-plugin) runs every one async: each version's facts are asserted on its own toolchain.
NEW_PLUGIN = zj.measure.compiler_version("gpu")[1] >= (0, 12)
ROOT = Path(__file__).resolve().parent.parent


# -- names and bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "canonical"), [("h100:1x8", "h100:1x8"), ("H100:2x8", "h100:2x8"), ("b200:01x8", "b200:1x8")]
)
def test_gpu_names_are_kind_hosts_by_gpus(name: str, canonical: str) -> None:
    assert is_gpu_name(name) and gpu_name(name) == canonical
    assert not is_gpu_name("v5p:2x2x2") and not is_gpu_name("TPU v5 lite:4x4") and not is_gpu_name("v5p-8")


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("h800:1x8", ("no GPU named 'h800' is known", "h100, h200, b200, a100", "'h100:1x8'")),
        ("h100:3x7x9", ("'3x7x9' is not HOSTSxGPUS", "KIND:HOSTSxGPUS", "'h100:1x8'")),
        ("h100:8", ("'8' is not HOSTSxGPUS",)),
        ("a100:0x8", ("'0x8' is not HOSTSxGPUS", "two positive sizes")),
    ],
)
def test_a_bad_gpu_name_is_one_error_naming_the_form(name: str, words: tuple) -> None:
    for fn in (zj.gpu_slice, zj.topology_mesh, zj.device_slice):
        with pytest.raises(ValueError) as e:
            fn(name)
        one_line(str(e.value), f"topology {name!r}", *words)


def test_a_gpu_name_where_a_tpu_one_is_required_and_the_reverse_are_one_error_each() -> None:
    with pytest.raises(ValueError) as e:
        zj.tpu_slice("h100:1x8")
    one_line(str(e.value), "tpu_slice: 'h100:1x8' names GPU hosts, not a TPU slice", "zj.gpu_slice('h100:1x8')")
    with pytest.raises(ValueError) as e:
        zj.gpu_slice("v5p:2x2x2")
    one_line(str(e.value), "gpu_slice: 'v5p:2x2x2' is not a GPU host name", "'h100:1x8'", "zj.tpu_slice('v5p:2x2x2')")


def test_without_the_cuda_plugin_the_error_names_the_pip_line(monkeypatch, capsys) -> None:
    for plugin in CUDA_PLUGINS:  # what an environment without them finds
        monkeypatch.setitem(sys.modules, f"jax_plugins.{plugin}", None)
    v = importlib.metadata.version("jaxlib")
    cuda = "12" if v.startswith(("0.10.", "0.11.")) else "13"  # the registries serve jax 0.12.1's for CUDA 13 only
    assert INSTALL_CUDA_PLUGIN.startswith(f'pip install "jax-cuda{cuda}-plugin=={v}" "jax-cuda{cuda}-pjrt=={v}" ')
    for fn in (zj.gpu_slice, zj.topology_mesh, lambda name: zj.plan(topology=name)):
        with pytest.raises(ImportError) as e:
            fn("h100:1x8")
        one_line(str(e.value), "needs the CUDA plugin", INSTALL_CUDA_PLUGIN, '".[gpu]"')
    assert cli.main(["plan", "--topology", "h100:1x8", "--params", "1B"]) == 2
    one_line(capsys.readouterr().err, "python -m zero_jax plan: error:", INSTALL_CUDA_PLUGIN)


@pytest.mark.slow
def test_without_jax_platforms_gpu_hosts_load_unless_jax_started_first() -> None:
    """On a machine without CUDA the plugin registers only if its CUDA version check is skipped before JAX
    starts its backends: zero_jax skips it (``deviceless_environment``) when it gets there first, and says what
    to set when it does not."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    first = textwrap.dedent("""
        import zero_jax as zj
        print(zj.gpu_slice("h100:1x8").num_devices)
        import jax
        print(jax.devices()[0].platform)
        """)
    late = textwrap.dedent("""
        import jax
        jax.devices()
        import zero_jax as zj
        try:
            zj.gpu_slice("h100:1x8")
        except RuntimeError as e:
            print(e)
        """)
    for code, said in ((first, ["8", "cpu"]), (late, [CUDA_NOT_STARTED])):
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == said, run.stdout


# -- the hosts ------------------------------------------------------------------------------------------------


def test_gpu_slice_counts_hosts_devices_and_memory_from_xlas_spec() -> None:
    h100 = zj.gpu_slice("h100:2x8")
    assert (h100.platform, h100.num_hosts, h100.num_devices, h100.num_chips) == ("gpu", 2, 16, 16)
    assert (h100.device_kind, h100.hbm_per_device) == ("NVIDIA H100 80GB HBM3", H100_BYTES)
    assert str(h100) == (
        "h100:2x8: 2 hosts x 8 GPUs = 16 devices (NVIDIA H100 80GB HBM3), 79.11 GiB (84.9 GB) memory per GPU"
    )
    kinds = {k: zj.gpu_slice(f"{k}:1x8") for k in GPU_SPECS}
    assert {k: s.device_kind for k, s in kinds.items()} == {
        "h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200 141GB HBM3e", "b200": "NVIDIA B200",
        "a100": "NVIDIA A100-SXM4-80GB",
    }  # fmt: skip
    assert {k: s.hbm_per_device for k, s in kinds.items()} == {
        "h100": H100_BYTES, "h200": 151397597184, "b200": 191514411008, "a100": 85100068864,
    }  # fmt: skip
    assert zj.device_slice("h100:2x8") == h100 and isinstance(h100, zj.TpuSlice)  # TpuSlice: DeviceSlice's old name


def test_topology_mesh_spans_the_gpus_host_by_host_and_leaves_jax_devices_on_the_cpu() -> None:
    mesh = zj.topology_mesh("h100:2x4")
    assert dict(mesh.shape) == {"data": 8} and {d.platform for d in mesh.devices.flat} == {"gpu"}
    assert [d.process_index for d in mesh.devices.flat] == [0, 0, 0, 0, 1, 1, 1, 1]
    hybrid = zj.topology_mesh("h100:2x4", ("node", "gpu"), (2, 4))
    assert [{d.process_index for d in row} for row in hybrid.devices] == [{0}, {1}]
    assert jax.devices()[0].platform == "cpu" and jax.device_count() == 8
    with pytest.raises(ValueError) as e:  # a mesh shape that does not match the hosts' devices
        zj.topology_mesh("h100:2x8", ("node", "gpu"), (2, 4))
    one_line(str(e.value), "shape (2, 4) holds 8 devices, but h100:2x8 has 16", "e.g. (2, 8)")


# -- compiled for 1 x 8 H100 ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_plan() -> zj.Plan:
    return zj.plan(topology="h100:1x8", stages=[1, 3], factory_kwargs=TINY, grads=False)


@pytest.mark.slow
def test_plan_for_gpu_hosts_judges_fit_on_each_gpus_buffer_assignment(gpu_plan: zj.Plan) -> None:
    p = gpu_plan
    assert p.topology is not None and (p.topology.platform, p.num_devices) == ("gpu", 8)
    assert p.device_bytes == H100_BYTES  # the GPU's memory in XLA's spec, by default
    assert sorted(p.hbm) == [1, 3] and p.needs == p.hbm  # fit is judged on the GPU buffer assignment
    for r in p.reports:  # the assignment allocates what memory_analysis() counts, within 1%
        assert abs(p.hbm[r.stage] / r.memory["peak"] - 1) < 0.01, (r.stage, p.hbm[r.stage], r.memory["peak"])
    # The memory claim: stage 3 partitions the parameters, so each GPU holds 1/8 of them (within the
    # padding of the leaves it cuts) and allocates less than stage 1 in all. Measured (jax-cuda12-plugin 0.10.2):
    # stage 1 3.38 MiB, stage 3 2.59 MiB.
    params = {r.stage: r.state_bytes["params"] for r in p.reports}
    assert 1 / 8 < params[3] / params[1] < 1 / 8 * 1.05, params
    assert p.hbm[3] < 0.85 * p.hbm[1], p.hbm
    assert p.fits == {1: True, 3: True} and p.recommended == 1
    assert "h100:1x8: 1 host x 8 GPUs = 8 devices (NVIDIA H100 80GB HBM3)" in str(p)


@pytest.mark.slow
def test_plan_for_gpu_hosts_that_do_not_fit_says_by_how_much(gpu_plan: zj.Plan) -> None:
    tight = zj.Plan(gpu_plan.reports, 8, 2 * 2**20, 0, 0.0, 1, gpu_plan.topology, gpu_plan.hbm)
    with pytest.raises(ValueError) as e:
        tight.check()
    over = gpu_plan.hbm[3] - 2 * 2**20
    one_line(str(e.value), "no planned stage fits 2.00 MiB per device on h100:1x8", "the smallest, stage 3",
              f"({fmt_bytes(over)} over)")  # fmt: skip


@pytest.mark.slow
def test_the_audit_reads_the_gpu_program() -> None:
    step, state, batch = reference_step(3, zj.topology_mesh("h100:1x8"), **TINY)
    r = zj.audit(step, state, batch, grads=False)
    assert r.compiled is not None and r.compiled.backend == "gpu (NVIDIA H100 80GB HBM3)"
    # NCCL's collectives after XLA:GPU's combiner, none decomposed; with jax-cuda12-plugin 0.10.2 every one an
    # async start/done pair, with jax-cuda13-plugin 0.12.1 some synchronous (measured: 15 of 24 all-gathers and
    # 10 of 13 reduce-scatters async).
    kinds = {k.kind: k for k in r.compiled.kinds}
    assert set(kinds) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert all(k.decomposed == 0 and k.async_executions > 0 for k in kinds.values())
    assert all(k.async_executions == k.executions for k in kinds.values()) != NEW_PLUGIN, kinds
    # The scan's loops carry XLA's own trip counts (its collective pipeliner peels iterations out of them): read
    # so, the compiled program sends what the post-SPMD one does (measured: 2.28 MiB both, 0.971x theory).
    assert abs(r.compiled.ring_bytes / r.compiled.post_spmd - 1) < 0.01, (r.compiled.ring_bytes, r.compiled.post_spmd)
    assert abs(r.comm.ratio - 1) < 0.05
    # Overlap, read off the GPU schedule: compute between start and done (measured: 15 of 17 layer gathers, 90%
    # of their bytes on 0.10.2; 9 of 17, 49% of their bytes on 0.12.1; every layer reduction on both).
    assert r.overlap is not None and r.overlap.reduction_fraction == 1.0, r.overlap
    assert (0.3 < r.overlap.gather_bytes_fraction < 0.7) if NEW_PLUGIN else r.overlap.gather_bytes_fraction > 0.8
    # Memory: the GPU buffer assignment and XLA's live peak, one layer whole at a time.
    assert abs(r.memory["allocated"] / r.memory["peak"] - 1) < 0.01 and r.memory["live_peak"] < r.memory["allocated"]
    assert r.layers is not None and r.layers.max_alive == 1
    r.check()


# -- the step-time estimate (issue 39, item 3) ---------------------------------------------------------------


def test_the_estimate_is_for_gpu_programs_only() -> None:
    step, state, batch = reference_step(1, jax.make_mesh((8,), ("data",)), **TINY)  # CPU devices: no compile
    with pytest.raises(ValueError) as e:
        zj.measure.step_estimate(step, state, batch)
    one_line(str(e.value), "cpu programs get no estimate", "optimal_seconds", "not a step time",
             "zj.topology_mesh('h100:1x8')")  # fmt: skip


@pytest.mark.slow
def test_the_audit_estimates_the_step_from_the_gpu_schedule_loops_times_their_runs(gpu_plan: zj.Plan) -> None:
    """The plan's own compiles (scanned stage 1 and layer-wise stage 3): no compile of its own."""
    est = {r.stage: r.estimate for r in gpu_plan.reports}
    three, one = est[3], est[1]
    assert three is not None and one is not None
    # Layer-wise stage 3 gathers inside its loops: each body is scheduled, timed, and counted its runs per step
    # (XLA's known_trip_count; the collective pipeliner peels iterations into the entry).
    assert three.complete and three.loops and all(lp.micros and lp.runs >= 1 for lp in three.loops), three.loops
    looped = sum(lp.runs * lp.micros for lp in three.loops) / 1e6
    assert three.seconds == pytest.approx(three.entry_seconds + looped, rel=1e-9) and looped > 0
    # What is exposed is a part of the step, split by kind (measured: all-gather, reduce-scatter, all-reduce).
    assert 0 < three.exposed_seconds < three.seconds
    assert three.exposed_seconds == pytest.approx(sum(three.exposed_by_kind.values()))
    # Scanned stage 1 has no collective in its loops: jax-cuda12-plugin 0.10.2's scheduler leaves them out, and the
    # estimate says so; 0.12.1's schedules them, each with an async fusion it times by a fixed default latency,
    # which the estimate leaves out and names (measured: 2 loops, 15 ms of such waits).
    if NEW_PLUGIN:
        assert one.complete and one.unmodelled_seconds > 0 and "left out:" in str(one)
    else:
        assert not one.complete and len(one.untimed) == 2 and one.seconds == pytest.approx(one.entry_seconds)
        assert "lower bound: 2 loop bodies untimed" in str(one) and one.unmodelled_seconds == 0
    # MFU: model FLOPs over the estimate at the H100's dense bf16 peak.
    shape = {k: v for k, v in TINY.items() if k != "compute_dtype"}
    flops = zj.models.model_flops(zj.models.TransformerConfig(**shape), 8 * TINY["seq"])
    m = three.with_flops(flops, devices=8)
    assert m.peak_flops == 989e12 and m.mfu == pytest.approx(flops / (three.seconds * 989e12 * 8))
    text = "\n".join(m.lines())
    assert "step time (estimate, XLA:GPU latency-hiding schedule)" in text and "MFU (estimate)" in text
    assert zj.measure.ESTIMATE_LEAVES_OUT in text


def test_stage_3_gather_all_keeps_the_forwards_gathered_parameters_on_gpu_only() -> None:
    """The schedule seam's gpu entry (keep_gathered_all): re-gathering in the backward pass peaks above stage 1
    on XLA:GPU (benchmarks/results/gpu_aot.txt), so make_train_step's default keeps them there, and only there."""
    loss = zj.models.make_loss_fn(zj.models.TransformerConfig())

    def kept(mesh: jax.sharding.Mesh, stage: int = 3, **kw: object) -> bool:
        policy = zj.ZeroPolicy(stage, mesh)
        return zj.make_train_step(loss, zj.shard_optimizer(optax.adamw(1e-3), policy), policy, **kw).keep_gathered

    gpus, cpus = zj.topology_mesh("h100:1x8"), jax.make_mesh((8,), ("data",))
    assert kept(gpus) and not kept(cpus) and not kept(gpus, keep_gathered=False)
    assert not kept(gpus, stage=1) and not kept(gpus, gather="manual")
    assert zj.measure.schedule_for(zj.ZeroPolicy(3, gpus)).describe().startswith(
        "schedule seam: the gpu entry measured on jax-cuda12-plugin 0.10.2")


def test_the_estimate_reads_the_schedules_own_timeline_not_xlas_loop_statistics() -> None:
    """jax-cuda12-plugin 0.10.2 writes a loop body's scheduler statistics as if no compute hid its collectives:
    an all-gather in a ``lax.scan`` body under a matmul five times its latency counts as wholly exposed there,
    though the compiled body runs the matmul between its start and done (0.12.1's statistics, and 0.10.2's for
    the entry computation, agree with the timeline). The estimate reads the timeline the program runs."""
    mesh = zj.topology_mesh("h100:1x8")
    rows, gathered = jax.sharding.NamedSharding(mesh, jax.P()), jax.sharding.NamedSharding(mesh, jax.P(None, "data"))

    def layers(x: jax.Array, w: jax.Array) -> jax.Array:
        def body(carry: tuple[jax.Array, jax.Array], piece: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
            h, whole = carry  # this trip's matmul beside the gather of the next trip's matrix
            return (jnp.tanh(h @ whole), jax.lax.all_gather(piece, "data", tiled=True)), None

        (h, _), _ = jax.lax.scan(body, (x, jax.lax.all_gather(w[0], "data", tiled=True)), w)
        return h.sum()

    step = jax.jit(jax.shard_map(layers, mesh=mesh, in_specs=(jax.P(), jax.P(None, "data")), out_specs=jax.P(),
                                 check_vma=False))  # fmt: skip
    x = jax.ShapeDtypeStruct((16384, 4096), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((4, 4096, 4096), jnp.bfloat16, sharding=gathered)  # 32 MiB a gathered matrix
    est = zj.measure.step_estimate(step, x, w)
    (loop,) = est.loops
    assert loop.runs == 4 and loop.micros is not None and est.complete
    # Exposed: the entry's first gather alone (measured: 128 µs on both plugins; each trip's matmul 700 µs).
    assert 50e-6 < est.exposed_seconds == est.exposed_by_kind["all-gather"] < 200e-6, est.exposed_by_kind
    schedule = compile_with_dump(step.lower(x, w), schedule=True).schedule
    assert schedule is not None
    waste = [float(w) for w in re.findall(r"all_gather_wasted_cycles:\s*([\d.e+-]+)", schedule)]
    # XLA's own statistics, per computation: the entry's gather exposed on both plugins; the body's too (about its
    # whole latency, in every trip) on 0.10.2 alone, which 0.12.1 leaves out (nothing wasted there).
    assert len(waste) == (1 if NEW_PLUGIN else 2) and min(waste) > 100, waste


def test_on_gpu_stacked_pieces_gather_along_a_leading_axis_so_no_stack_is_laid_out_again() -> None:
    """XLA:GPU gathers along an operand's major dimension: a stacked piece cut along its columns and gathered
    along them in ``scan_layers``' loop was copied whole into a transposed layout before the loop (measured at
    the 8B class: 0.85 GiB more per GPU, ``benchmarks/results/gpu_aot.txt``). The gpu entry gathers and reduces
    such pieces along a new leading axis (``major_axis_collectives``): the same bytes on the wire, and at least
    those stacks' bytes less memory per GPU (measured: 1.8 MB less, twice those stacks: their gradients too)."""
    mesh = zj.topology_mesh("h100:1x8")
    assert zj.measure.schedule_for(zj.ZeroPolicy(3, mesh)).major_axis_collectives
    reports, states = {}, {}
    for major in (True, False):
        with zj.measure.trying_schedule(major_axis_collectives=major):
            step, states[major], batch = reference_step(3, mesh, vocab=512, dim=256, depth=4, heads=4, seq=128)
            reports[major] = zj.audit(step, states[major], batch, grads=False)
    columns = [x for x in jax.tree.leaves(states[True].params["layers"])
               if x.ndim == 3 and tuple(x.sharding.spec)[2:3] not in ((), (None,))]  # fmt: skip
    column_bytes = sum(x.size * x.dtype.itemsize for x in columns) / mesh.size
    assert len(columns) == 2 and column_bytes > 0  # attn_qkv and mlp_in: cut along their output columns
    saved = reports[False].memory["allocated"] - reports[True].memory["allocated"]
    assert saved >= column_bytes, (saved, column_bytes)
    assert reports[True].comm.measured == reports[False].comm.measured
    # The audit reads gathers along the new axis as the layer's: the same layers whole at once (at most 1 +
    # loop_head_start: the backward re-gathers the whole next layer as this one's starts), every gather's bytes.
    alive = {m: reports[m].layers.max_alive for m in (True, False)}  # pyright: ignore[reportOptionalMemberAccess]
    assert alive[True] == alive[False] <= 2, alive
    rows = {m: reports[m].overlap.row("layer all-gather") for m in (True, False)}  # pyright: ignore[reportOptionalMemberAccess]
    # (measured: 76 layer gathers, 25.2 MB a step, against 68 and 18.9 MB read as the layer's without: 8
    # gathers of one column-cut leaf's size, 4 layers x 2 passes, go uncounted there)
    assert rows[True] and rows[False] and rows[True].executions >= rows[False].executions > 0, rows
    assert rows[True].bytes >= rows[False].bytes, rows
    reports[True].check()
