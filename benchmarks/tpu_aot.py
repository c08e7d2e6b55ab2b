"""zero_jax on the production TPU compiler, compiled here without a TPU (deviceless, ahead of time).

Run: ``python benchmarks/tpu_aot.py`` (libtpu installed: ``pip install -e ".[test]"``; every step is
compiled for a TPU slice with ``zj.topology_mesh`` and judged with ``zj.audit``; nothing runs, so no TPU
is needed). Sections (``--only NAME`` runs one; ``--quick`` shrinks every model for a smoke run):

* ``stages``: the reference transformer at a 1B and an 8B class (bf16 compute, fp32 master, AdamW) on
  v5p and v5e slices: per stage (0-2, 3 with ``gather="all"``, 3 layer-wise with ``scan_layers`` and,
  for 1B, with ``apply_layers`` over a Python list of blocks) the allocated HBM (the buffer
  assignment's total: the TPU compiler's own figure), argument + output + temp - alias, the communication
  of the post-SPMD program against the theory, the compiled program's bytes, and whether it fits the
  chip (a step libtpu refuses for HBM counts as not fitting);
* ``depth``: layer-wise stage 3 against depth on v5p-8 at dim 1024, scanned (depth 4 to 32) and unscanned (4, 16):
  growth of the allocated HBM and of XLA's live peak against the allowance (the added layers'
  partitioned state + their saved block inputs), and stage 3 / stage 1 at depth 16;
* ``gspmd``: a GSPMD FSDP recipe that cuts each leaf on its *largest* dimension (plain ``jax.jit``, parameters,
  gradients and Adam state sharded over data so) beside zero_jax's layer-wise stage 3. Not MaxText's recipe, which
  cuts every weight on its embed dimension and runs the gathers and reductions as the partitioner's windowed-einsum
  rings: MaxText's own program is compiled beside zero_jax by ``benchmarks/maxtext.py``;
* ``overlap``: the fraction of layer all-gathers with compute between start and done, prefetch 0 and 1;
  and the schedule's compiler tricks switched off one by one (``zj.measure.trying_schedule``);
* ``largest``: the largest model whose model states plus activations fit one v5p chip per stage at
  N = 64 and 256, from ``zj.model_state_bytes`` and the activation bytes measured on the 1B compile.

Writes ``benchmarks/results/tpu_aot.txt`` (the tables, the command, the machine), ``tpu_aot.json`` and
``tpu_aot.png``. The sections' results are cached in ``tpu_aot.json`` as they finish, so an interrupted
run resumes (``--fresh`` starts over). Each row records the libtpu it was compiled with (rows without one:
0.0.42.1); a row of another libtpu than the installed one is measured again (``--cached-only``: kept and
marked ``*``). The claims on several libtpu versions side by side: ``benchmarks/tpu_versions.py``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, unstack_params  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GiB, MiB = 2**30, 2**20
BF16 = zj.Precision(compute_dtype=jnp.bfloat16)

#: The model classes (the reference transformer: 12 dim^2 per layer, MLP 4 x dim).
MODELS = {
    "1B": dict(vocab=32000, dim=2048, depth=16, heads=16, seq=2048),
    "8B": dict(vocab=32000, dim=4096, depth=40, heads=32, seq=2048),
}
QUICK = {
    "1B": dict(vocab=512, dim=256, depth=4, heads=4, seq=128),
    "8B": dict(vocab=512, dim=512, depth=4, heads=4, seq=128),
}
#: (label, topology): slices of 8 chips and one of 64+ per chip generation.
STAGE_SLICES = [("v5p 8 chips", "v5p:2x2x2"), ("v5p 64 chips", "v5p:4x4x4"), ("v5e 8 chips", "v5e:2x4"),
                ("v5e 256 chips", "v5e:16x16")]  # fmt: skip
VARIANTS = ["0", "1", "2", "3/all", "3/scan", "3/apply"]
DEPTHS_SCAN = [4, 8, 16, 32]
DEPTHS_APPLY = [4, 16]
#: ``comm_bytes_per_axis``'s keys as the mesh names them here.
AXIS_OF_THEORY = {"shard": "data"}


# -- building steps on abstract inputs ------------------------------------------------------------------------


def build(mesh: Any, variant: str, cfg: TransformerConfig, *, prefetch: int = 1, precision: Any = BF16,
          batch_per_device: int = 1, one_hot_labels: bool = False,
          **policy_options: Any) -> tuple[Any, Any, Any]:  # fmt: skip
    """(step, abstract state, abstract batch) of one variant: stage 0-3 with gather="all", "3/scan" layer-wise
    over stacked layers, "3/apply" layer-wise over a Python list of blocks (``policy_options``: more
    ``ZeroPolicy`` arguments)."""
    stage = int(variant[0])
    unscanned = variant.endswith("apply")
    make = (lambda: unstack_params(init_params(cfg, jax.random.key(0)))) if unscanned else (
        lambda: init_params(cfg, jax.random.key(0)))  # fmt: skip
    params = jax.eval_shape(make)
    policy = zj.ZeroPolicy(stage, mesh, stacked=() if unscanned else "layers", precision=precision, **policy_options)
    manual = variant in ("3/scan", "3/apply")
    loss = make_loss_fn(cfg, policy if manual else None, prefetch=prefetch, one_hot_labels=one_hot_labels)
    tx = zj.shard_optimizer(optax.adamw(1e-4), policy)
    step = zj.make_train_step(loss, tx, policy, gather="manual" if manual else "all")
    tokens = jax.ShapeDtypeStruct((batch_per_device * mesh.size, cfg.seq + 1), jnp.int32,
                                  sharding=policy.batch_sharding())  # fmt: skip
    return step, zj.init_state(params, tx, policy), {"tokens": tokens}


OOM_WORDS = ("Ran out of memory", "exceeds available HBM", "RESOURCE_EXHAUSTED")


def measure(step: Any, state: Any, batch: Any, *, hbm: float, prefetch: int = 1) -> dict[str, Any]:
    """One compile, audited: memory, communication, compiled program, overlap, layers alive; or the
    compiler's refusal."""
    t = time.perf_counter()
    try:
        r = zj.audit(step, state, batch, grads=False, prefetch=prefetch)
    except Exception as e:  # libtpu refuses a program that cannot fit HBM
        text = str(e)
        if not any(w in text for w in OOM_WORDS):
            raise
        return {"fits": False, "refused": text.splitlines()[0][:300], "compile_s": round(time.perf_counter() - t, 1)}
    allocated = r.memory.get("allocated", r.memory["peak"])
    out = {
        "compile_s": round(time.perf_counter() - t, 1),
        "allocated_GiB": allocated / GiB, "peak_est_GiB": r.memory["peak"] / GiB, "temp_GiB": r.memory["temp"] / GiB,
        "live_peak_GiB": r.memory["live_peak"] / GiB if r.memory.get("live_peak") else None,
        "fits": allocated <= hbm, "hbm_GiB": hbm / GiB,
        "comm_MiB": r.comm.measured / MiB, "theory_MiB": r.comm.theory / MiB,
        "comm_over_theory": r.comm.measured / r.comm.theory if r.comm.theory else None,
        "comm_over_accounted": r.comm.accounted_ratio, "skipped_regathers": list(r.comm.skipped_regathers),
        "compiled_MiB": r.compiled.ring_bytes / MiB if r.compiled else None,
        "decomposed_reduce_scatters": list(r.compiled.decomposed_reduce_scatters) if r.compiled else None,
        "gather_overlap": r.overlap.gather_fraction if r.overlap else None,
        "gather_overlap_bytes": r.overlap.gather_bytes_fraction if r.overlap else None,
        "exposed": r.overlap.exposed if r.overlap else None,
        "layers_alive": r.layers.max_alive if r.layers else None,
        "violations": [v.kind for v in r.violations],
        "unroll_layers": zj.measure.schedule_for(step.policy).unroll_layers,
        "num_params": r.num_params,
        "state_GiB": sum(r.state_bytes.values()) / GiB,
    }  # fmt: skip
    return out


#: Every measured row by its key, persisted as it is measured (``<stem>_rows.json``): a compile of the TPU
#: program takes minutes to tens of minutes here, so an interrupted run resumes row by row.
ROWS: dict[str, Any] = {}
ROWS_FILE: list[Path] = []


RENDER_ONLY: list[bool] = []
#: ``--model`` / ``--slice`` / ``--variant``: the stages section compiles only these (a 1B compile takes
#: minutes to an hour here); rows measured before are kept in the tables.
STAGE_FILTER: dict[str, list[str]] = {}


#: Switches only ``apply_layers``' program reads: a row of another variant is not measured again for them.
BLOCKS_ONLY = ("prefetch_blocks",)
#: What a schedule says about itself, not what it switches: the compiler its entry was measured on, the
#: options tried when the preferred ones are refused, the read-only options, the compiler running and its
#: refusals (``benchmarks/tpu_versions.py`` keys rows by libtpu version instead).
ABOUT_THE_ENTRY = ("compiler", "fallback_options", "read_only_options", "running", "refused")
#: Switches added after rows were measured, at the value every earlier row had: left out of the fingerprint while
#: they keep it (their program is the same), so adding a switch does not mark every row measured before it.
ADDED_LATER = {"grad_reduction_outside": "psum_scatter"}


@functools.cache
def tpu_schedule(name: str) -> str:
    """A fingerprint of the schedule zero_jax compiles with on TPU (``zj.measure.schedule_for``, no trial), of
    the switches that touch the program of a row named ``name`` (its key or variant; ``BLOCKS_ONLY`` for an
    ``apply_layers`` row): a row measured under another one is measured again, or (not measured again) marked
    ``*`` in the tables."""
    blocks = "3/apply" in name
    policy = zj.ZeroPolicy(3, zj.topology_mesh("v5p:2x2x2"))
    with zj.measure.trying_schedule():
        schedule = zj.measure.schedule_for(policy)
    fields = [f for f in schedule._fields if (blocks or f not in BLOCKS_ONLY) and f not in ABOUT_THE_ENTRY
              and not (f in ADDED_LATER and getattr(schedule, f) == ADDED_LATER[f])]  # fmt: skip
    text = f"Schedule({', '.join(f'{f}={getattr(schedule, f)!r}' for f in fields)})"  # the NamedTuple's repr
    return hashlib.sha1(text.encode()).hexdigest()[:10]


#: The libtpu the rows measured before rows named theirs were measured with (the results' header said so).
FIRST_LIBTPU = "0.0.42.1"


def stale(row: dict[str, Any], variant: str) -> bool:
    """Whether a row of ``variant`` was measured under an older TPU schedule than today's (:func:`tpu_schedule`)
    or with another libtpu than the one installed (each row records its own)."""
    other = row.get("libtpu", FIRST_LIBTPU) != _libtpu_version()
    return "compile_s" in row and (other or row.get("schedule") != tpu_schedule(variant))


def cached(key: str, compute: Any, refresh: bool = True) -> dict[str, Any]:
    """``compute()`` (called at once, so a closure over loop variables is safe), or its row from the cache
    when measured under today's schedule or not to be refreshed (``refresh``; ``--cached-only``: rows not
    measured yet are marked missing and left out of the tables, stale rows kept)."""
    if key not in ROWS and RENDER_ONLY:
        return {"missing": True}
    if key not in ROWS or (stale(ROWS[key], key) and refresh and not RENDER_ONLY):
        ROWS[key] = compute() | {"schedule": tpu_schedule(key), "libtpu": _libtpu_version()}
        if ROWS_FILE:
            ROWS_FILE[0].write_text(json.dumps(ROWS, indent=1, default=str))
    return dict(ROWS[key])


def config(name: str, quick: bool, **over: Any) -> TransformerConfig:
    return TransformerConfig(**{**(QUICK if quick else MODELS)[name], **over})


# -- sections -----------------------------------------------------------------------------------------------------


def stages(quick: bool, log: Any) -> list[dict[str, Any]]:
    rows = []
    for model in ("1B", "8B"):
        for label, topology in STAGE_SLICES:
            tpu = zj.tpu_slice(topology)
            mesh = zj.topology_mesh(topology)
            variants = VARIANTS if model == "1B" else ["0", "1", "2", "3/scan"]
            if model == "8B" and tpu.num_chips < 64:
                continue  # an 8B model at N = 8: stages 1-2 hold 2x the parameters on one chip; shown at 64+
            if topology.startswith("v5e") and model == "1B":
                variants = ["1", "3/scan", "3/apply"] if tpu.num_chips <= 8 else ["1", "3/scan"]
            for variant in variants:
                if variant == "3/apply" and tpu.num_chips > 8:
                    continue  # the unrolled program: shown on the 8-chip slices (its compile grows with depth)
                cfg = config(model, quick)
                key = f"stages {model} {topology} {variant}"
                asked = all(v in STAGE_FILTER.get(k, [v]) for k, v in
                            (("model", model), ("slice", topology), ("variant", variant)))  # fmt: skip
                if key not in ROWS and not asked:
                    continue  # not asked for this run, and not measured before
                log(f"stages {model} {label} {variant}")
                row = {"model": model, "slice": label, "topology": topology, "variant": variant,
                       "params": cfg.num_params(), "chips": tpu.num_chips}  # fmt: skip
                row |= cached(key, lambda: measure(*build(mesh, variant, cfg), hbm=tpu.hbm_per_device),  # noqa: B023
                              refresh=asked)  # a row measured under an older schedule stays, marked, unless asked
                rows.append(row)
                log("  " + json.dumps({k: row[k] for k in ("allocated_GiB", "fits", "comm_over_theory")
                                       if k in row}))  # fmt: skip
    return rows


def depth(quick: bool, log: Any) -> list[dict[str, Any]]:
    rows = []
    topology = "v5p:2x2x2"
    mesh, tpu = zj.topology_mesh(topology), zj.tpu_slice(topology)
    # The unrolled program (apply_layers) compiles in minutes at depth 16 (the scanned one at any depth).
    series = {"3/scan": (1024, DEPTHS_SCAN), "1": (1024, [16, 32]), "3/apply": (1024, DEPTHS_APPLY)}
    for variant, (dim, ds) in series.items():
        for d in ds if not quick else ds[:2]:
            cfg = TransformerConfig(depth=d, vocab=32000, dim=dim, heads=16, seq=1024) if not quick else (
                TransformerConfig(depth=d, vocab=512, dim=256, heads=4, seq=64))  # fmt: skip
            log(f"depth {variant} dim={cfg.dim} L={d}")
            row = {"variant": variant, "depth": d, "params": cfg.num_params(), "dim": cfg.dim}
            row |= cached(f"depth {variant} {cfg.dim} {d}{' quick' if quick else ''}",
                          lambda: measure(*build(mesh, variant, cfg), hbm=tpu.hbm_per_device),  # noqa: B023
                          refresh=variant in STAGE_FILTER.get("variant", [variant]))
            rows.append(row)
            log("  " + json.dumps({k: row.get(k) for k in ("allocated_GiB", "state_GiB", "layers_alive")}))
    return rows


def gspmd_step(mesh: Any, cfg: TransformerConfig, one_hot_labels: bool = False) -> tuple[Any, Any, Any]:
    """The GSPMD FSDP recipe: plain jax.jit of the same model and AdamW, every float leaf (parameters, Adam
    state) sharded over data on its largest dimension that divides N (never the layer axis), gradients
    constrained to the parameters' shardings, batch over data."""
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    n = mesh.size

    def spec(path: Any, leaf: Any) -> P:
        stacked = jax.tree_util.keystr(path).startswith("['layers']")
        dims = [d for d in range(1 if stacked else 0, leaf.ndim) if leaf.shape[d] % n == 0]
        if not dims:
            return P()
        d = max(dims, key=lambda k: leaf.shape[k])
        return P(*[("data" if k == d else None) for k in range(leaf.ndim)])

    specs = jax.tree_util.tree_map_with_path(spec, params)
    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    tx = optax.adamw(1e-4)
    loss = make_loss_fn(cfg, one_hot_labels=one_hot_labels)
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_specs = jax.tree.map(
        lambda a: NamedSharding(mesh, spec((), a) if a.ndim >= 1 and a.size >= n else P()), opt_shapes
    )

    def step(p: Any, o: Any, batch: Any) -> Any:
        pb = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        lval, g = jax.value_and_grad(lambda q: loss(q, batch))(pb)
        g = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: x.astype(jnp.float32), g), shard)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, lval

    jitted = jax.jit(step, in_shardings=(shard, opt_specs, NamedSharding(mesh, P("data"))),
                     out_shardings=(shard, opt_specs, NamedSharding(mesh, P())), donate_argnums=(0, 1),
                     compiler_options=_tpu_options())  # fmt: skip
    abstract = lambda t, s: jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), t, s)  # noqa: E731
    tokens = jax.ShapeDtypeStruct((mesh.size, cfg.seq + 1), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    batch = {"tokens": tokens}
    return jitted, (abstract(params, shard), abstract(opt_shapes, opt_specs)), batch


def _tpu_options() -> dict[str, str]:
    """The compiler options zero_jax's own TPU steps compile with (the same async all-gather for the recipe)."""
    mesh = zj.topology_mesh("v5p:2x2x2")
    step = zj.make_train_step(lambda p, b: jnp.sum(p["w"]), zj.shard_optimizer(optax.sgd(0.1), zj.ZeroPolicy(0, mesh)),
                              zj.ZeroPolicy(0, mesh))  # fmt: skip
    return dict(step.compiler_options or {})


#: The GSPMD comparison's models and slices: the 1B class (the stages table's) on 8 and 64 chips, and a small
#: model (dim 1024, depth 8) whose vocabulary-sized embedding and head are 40% of its parameters.
GSPMD_CASES = [("1B", "v5p:2x2x2"), ("1B", "v5p:4x4x4"), ("dim 1024 depth 8", "v5p:2x2x2")]
GSPMD_SMALL = dict(vocab=32000, dim=1024, depth=8, heads=16, seq=1024)


def gspmd(quick: bool, log: Any) -> list[dict[str, Any]]:
    rows = []
    for model, topology in GSPMD_CASES:
        mesh = zj.topology_mesh(topology, axis_types=(jax.sharding.AxisType.Auto,))  # plain jit: the compiler's axes
        tpu = zj.tpu_slice(topology)
        cfg = config(model, quick) if model in MODELS else TransformerConfig(
            **(GSPMD_SMALL if not quick else dict(vocab=512, dim=256, depth=4, heads=4, seq=64)))  # fmt: skip
        # The cross-entropy as optax's integer-label one picks the targets (take_along_axis: its backward is a
        # scatter), and with a one-hot mask (elementwise): the same bits, other buffers (make_loss_fn's docstring).
        for one_hot, labels in ((False, "take_along_axis"), (True, "one-hot")):
            log(f"gspmd {model} {topology}, {labels} labels")

            def recipe(one_hot: bool = one_hot, mesh: Any = mesh, cfg: TransformerConfig = cfg) -> dict[str, Any]:
                jitted, (p, o), batch = gspmd_step(mesh, cfg, one_hot)
                t = time.perf_counter()
                compiled, text, allocated, peak, _ = zj.measure.compile_with_dump(jitted.lower(p, o, batch))
                colls = zj.measure.parse_collectives(text, mesh.size)
                state = sum(a.size * a.dtype.itemsize / mesh.size for a in jax.tree.leaves((p, o)))
                return {"compile_s": round(time.perf_counter() - t, 1), "allocated_GiB": allocated / GiB,
                        "peak_est_GiB": zj.measure.memory(compiled)["peak"] / GiB,
                        "live_peak_GiB": peak.bytes / GiB if peak is not None and peak.bytes else None,
                        "comm_MiB": zj.measure.ring_bytes(colls) / MiB, "state_GiB": state / GiB,
                        "kinds": {k: v["count"] for k, v in zj.measure.summarize(colls).items()}}  # fmt: skip

            # The rows of the small model keep their keys of the runs before the 1B class joined the section.
            case = f"{cfg.dim} {cfg.depth}" + ("" if model not in MODELS else f" {topology}")
            suffix = " one-hot" if one_hot else ""
            head = {"model": model, "slice": topology, "chips": tpu.num_chips, "labels": labels}
            rec = head | {"variant": "GSPMD, largest dimension"} | cached(f"gspmd recipe {case}{suffix}", recipe)
            zero = head | {"variant": "zero_jax stage 3 scan_layers"} | cached(
                f"gspmd zero {case}{suffix}",
                lambda one_hot=one_hot, mesh=mesh, cfg=cfg, tpu=tpu: measure(
                    *build(mesh, "3/scan", cfg, one_hot_labels=one_hot), hbm=tpu.hbm_per_device))  # fmt: skip
            rec["theory_MiB"] = zero["theory_MiB"]
            rec["comm_over_theory"] = rec["comm_MiB"] / zero["theory_MiB"]
            log("  " + json.dumps({k: rec[k] for k in ("allocated_GiB", "comm_over_theory")}))
            rows += [rec, zero]
    return rows


def overlap(quick: bool, log: Any) -> list[dict[str, Any]]:
    topology = "v5p:2x2x2"
    mesh, tpu = zj.topology_mesh(topology), zj.tpu_slice(topology)
    # The unrolled program at dim 512, depth 4, for its compile time (see depth()).
    shapes = {"3/scan": dict(vocab=32000, dim=1024, depth=8, heads=16, seq=1024),
              "3/apply": dict(vocab=32000, dim=512, depth=4, heads=16, seq=1024)}  # fmt: skip
    trials = {  # name: (schedule switches, ZeroPolicy options)
        "measured schedule": ({}, {}),
        "ties off": ({"tie_gathers": False, "tie_recompute": False, "tie_backward_order": False}, {}),
        "backward prefetch all at once": ({"leafwise_prefetch": False}, {}),
        "libtpu default options": ({"compiler_options": {}}, {}),
        "scan prefetch carried across trips": ({"prefetch_across_trips": True}, {}),
        "scan unrolled by 4": ({"unroll_layers": 4}, {}),
        # apply_layers issuing block i + 1's gather when block i starts (off on TPU: each block in place).
        "blocks prefetched": ({"prefetch_blocks": True}, {}),
        # Each norm scale and bias its own gather (every leaf apart): the latency-bound gathers feeding
        # elementwise ops, which the TPU compiler keeps synchronous even with its loop-fusion option.
        "small leaves apart": ({"together_bytes": 0}, {}),
        # Norm scales and biases whole on every chip (their stacks are at most depth x 4 dim elements): no
        # gathers of theirs at all; their state is then replicated.
        "layer vectors whole": ({}, {"min_shard_size": 2**17}),
    }
    rows = []
    for variant in ("3/scan", "3/apply"):
        cfg = TransformerConfig(**(shapes[variant] if not quick else dict(vocab=512, dim=256, depth=4, heads=4,
                                                                              seq=64)))  # fmt: skip
        for prefetch in (0, 1):
            for name, (switches, options) in trials.items():
                if prefetch == 0 and name != "measured schedule":
                    continue
                # (apply_layers at dim 512: one vector a block is cut, the rest are under min_shard_size: none join)
                scan_only = ("backward prefetch all at once", "small leaves apart")
                if variant == "3/apply" and (name.startswith("scan") or "unrolled" in name or name in scan_only):
                    continue
                if variant == "3/scan" and name == "blocks prefetched":
                    continue
                log(f"overlap {variant} dim={cfg.dim} L={cfg.depth} prefetch={prefetch} {name}")

                def compute(variant: str = variant, prefetch: int = prefetch, switches: dict = switches,
                            options: dict = options, cfg: TransformerConfig = cfg) -> dict[str, Any]:  # fmt: skip
                    with zj.measure.trying_schedule(**switches):
                        return measure(*build(mesh, variant, cfg, prefetch=prefetch, **options),
                                       hbm=tpu.hbm_per_device, prefetch=prefetch)  # fmt: skip

                key = f"overlap {variant} {cfg.dim} {cfg.depth} {prefetch} {name}{' quick' if quick else ''}"
                row = cached(key, compute)
                rows.append({"variant": variant, "dim": cfg.dim, "depth": cfg.depth, "prefetch": prefetch,
                             "trial": name} | row)  # fmt: skip
                log("  " + json.dumps({k: row.get(k) for k in ("allocated_GiB", "gather_overlap", "layers_alive")}))
    return rows


def largest(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The largest Ψ whose model states plus activations fit one v5p chip, per stage, at N = 64 and 256:
    model_state_bytes (bf16 parameters and gradients, fp32 master + Adam) + the activations measured on the
    1B scanned stage-3 compile at 64 chips (allocated HBM less its state)."""
    hbm = zj.tpu_slice("v5p:4x4x4").hbm_per_device
    ref = next((r for r in results.get("stages", []) if r["variant"] == "3/scan" and r["model"] == "1B"
                and r["chips"] == 64 and "allocated_GiB" in r), None)  # fmt: skip
    if ref is None:
        return []  # no measured activations to add: no figure rather than the formula alone
    act = (ref["allocated_GiB"] - ref["state_GiB"]) * GiB
    rows = []
    for n in (64, 256):
        for stage in range(4):
            lo, hi = 1e6, 1e14
            for _ in range(80):  # bisection on the formula
                mid = math.sqrt(lo * hi)
                fits = zj.model_state_bytes(mid, n, stage).total + act <= hbm
                lo, hi = (mid, hi) if fits else (lo, mid)
            rows.append({"N": n, "stage": stage, "largest_params": lo, "activations_GiB": act / GiB})
    return rows


def claims(quick: bool, log: Any) -> list[dict[str, Any]]:
    """The README's "Measured" claims that do not need a large model, re-checked on v5p-8 at small sizes
    (fp32 like the CPU benchmarks): state bytes = formula per stage; post-SPMD and compiled communication
    against the theory; int8 ZeRO++ wires still int8 in the compiled TPU program; tensor parallelism and
    HSDP bytes per mesh axis against ``comm_bytes_per_axis``; ``check()`` per cell."""
    from zero_jax.models import megatron_specs  # noqa: PLC0415

    topology = "v5p:2x2x2"
    cfg = TransformerConfig(vocab=512, dim=256, depth=4, heads=4, seq=128)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    phi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    cells = [(f"stage {s}", zj.topology_mesh(topology), dict(stacked="layers"), s) for s in range(4)]
    cells += [("stage 3 int8 weights + grads", zj.topology_mesh(topology),
               dict(stacked="layers", quantize_weights="int8", quantize_grads="int8"), 3)]  # fmt: skip
    cells += [(f"stage {s} TP (data 4, model 2)", zj.topology_mesh(topology, ("data", "model"), (4, 2)),
               dict(stacked="layers", param_specs=megatron_specs()), s) for s in (1, 3)]  # fmt: skip
    cells += [(f"stage {s} HSDP (replica 2, data 4)", zj.topology_mesh(topology, ("replica", "data"), (2, 4)),
               dict(stacked="layers", replica_axis="replica"), s) for s in (1, 3)]  # fmt: skip
    rows = []
    for name, mesh, kw, stage in cells:
        log(f"claims {name}")
        policy = zj.ZeroPolicy(stage, mesh, "data", **kw)
        tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
        step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
        state = zj.init_state(params, tx, policy)
        tokens = jax.ShapeDtypeStruct((2 * policy.num_shards * policy.num_replicas, cfg.seq + 1), jnp.int32,
                                      sharding=policy.batch_sharding())  # fmt: skip
        t = time.perf_counter()
        r = zj.audit(step, state, {"tokens": tokens})
        try:
            r.check()
            violations: list[str] = []
        except zj.AuditError as err:
            violations = [v.kind for v in err.violations]
        kinds = r.compiled.kinds if r.compiled else ()
        row = {
            "cell": name, "stage": stage, "compile_s": round(time.perf_counter() - t, 1),
            "bytes_over_formula": {k: r.state_bytes[k] / r.formula[k] for k in r.formula if r.formula[k]},
            "comm_over_theory": r.comm.measured / r.comm.theory if r.comm.theory else None,
            "compiled_over_theory": r.compiled.ring_bytes / r.comm.theory if r.compiled and r.comm.theory else None,
            "compiled_kinds_dtypes": [f"{k.kind} {'/'.join(k.dtypes)}" for k in kinds],
            "comm_per_axis_MiB": {k: v / MiB for k, v in r.comm_per_axis.items()},
            "violations": violations,
        }  # fmt: skip
        if "HSDP" in name:
            theory = zj.comm_bytes_per_axis(phi, policy.num_shards, stage, replicas=policy.num_replicas,
                                            dtype_bytes=4)  # fmt: skip
            row["theory_per_axis_MiB"] = {AXIS_OF_THEORY.get(k, k): v / MiB for k, v in theory.items()}
        rows.append(row)
        log("  " + json.dumps({k: row[k] for k in ("bytes_over_formula", "comm_over_theory", "violations")}))
    return rows


SECTIONS = {"depth": depth, "gspmd": gspmd, "overlap": overlap, "claims": claims, "stages": stages}


# -- the record ---------------------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> list[str]:
    out = []
    if results.get("stages"):
        out += ["", "== per stage (bf16 compute, fp32 master, AdamW; allocated = the TPU buffer assignment's HBM)",
                f"{'model':<5} {'slice':<14} {'variant':<11} {'params':>8} {'alloc GiB':>10} {'est GiB':>8} "
                f"{'fits':>5} {'comm/th':>8} {'compiled/th':>11} {'overlap':>8} {'by bytes':>8} "
                f"{'compile s':>9}"]  # fmt: skip
        for r in results["stages"]:
            if "refused" in r:
                out.append(f"{r['model']:<5} {r['slice']:<14} {r['variant']:<11} {r['params'] / 1e9:>7.2f}B "
                           f"{'refused by libtpu (HBM)':>28}   {r['refused'][:60]}")  # fmt: skip
                continue
            ct = r["compiled_MiB"] / r["theory_MiB"] if r.get("compiled_MiB") and r["theory_MiB"] else float("nan")
            name = _variant(r)
            out.append(f"{r['model']:<5} {r['slice']:<14} {name:<11} {r['params'] / 1e9:>7.2f}B "
                       f"{r['allocated_GiB']:>10.2f} {r['peak_est_GiB']:>8.2f} {'yes' if r['fits'] else 'NO':>5} "
                       f"{r['comm_over_theory']:>8.3f} {ct:>11.3f} {r['gather_overlap'] or 0:>8.2f} "
                       f"{_fraction(r.get('gather_overlap_bytes')):>8} {r['compile_s']:>9.0f}")  # fmt: skip
    if results.get("depth"):
        out += ["", "== layer-wise stage 3 against depth (v5p 8 chips, seq 1024, batch 1 per chip, bf16 compute; "
                "live = XLA's live peak, alloc / live = fragmentation)",
                f"{'variant':<8} {'dim':>5} {'depth':>5} {'alloc GiB':>10} {'live GiB':>9} {'alloc/live':>10} "
                f"{'state GiB':>10} {'comm/th':>8}"]  # fmt: skip
        for r in results["depth"]:
            live = r.get("live_peak_GiB") or float("nan")
            out.append(f"{_variant(r):<8} {r['dim']:>5} {r['depth']:>5} {r['allocated_GiB']:>10.3f} {live:>9.3f} "
                       f"{r['allocated_GiB'] / live:>10.2f} {r['state_GiB']:>10.3f} "
                       f"{r['comm_over_theory']:>8.3f}")  # fmt: skip
        out += depth_verdicts(results["depth"])
    if results.get("gspmd"):
        out += ["", "== a GSPMD FSDP recipe cutting each leaf on its largest dimension (not MaxText's: see "
                "benchmarks/maxtext.py) against zero_jax layer-wise stage 3 (live = XLA's live peak; state = the "
                "arrays kept between steps: the recipe keeps fp32 parameters and Adam and casts a bf16 copy each step, "
                "zero_jax also keeps ZeRO's bf16 compute copy, 2 bytes/parameter/N)"]
        rows = results["gspmd"]
        for r in rows:
            live, state = r.get("live_peak_GiB"), r.get("state_GiB")
            out.append(f"{r['model']:<17} {r['slice']:<10} {r['variant']:<29} {r['labels']:<16} allocated "
                       f"{r['allocated_GiB']:.3f} GiB, live {'-' if live is None else f'{live:.3f}'} GiB, state "
                       f"{'-' if state is None else f'{state:.3f}'} GiB, comm {r['comm_MiB']:.1f} MiB = "
                       f"{r['comm_over_theory']:.3f} x theory")  # fmt: skip
        for rec, zero in zip(rows[::2], rows[1::2], strict=True):
            ratios = {k: zero[k] / rec[k] for k in ("allocated_GiB", "live_peak_GiB", "comm_MiB")
                      if zero.get(k) and rec.get(k)}  # fmt: skip
            out.append(f"  {rec['model']} {rec['slice']} {rec['labels']}: zero_jax / recipe: allocated "
                       f"{ratios.get('allocated_GiB', 0):.2f}x, "
                       f"live {ratios.get('live_peak_GiB', 0):.2f}x, comm {ratios.get('comm_MiB', 0):.2f}x "
                       f"({'each' if max(ratios.values()) <= 1 else 'NOT each'} <= 1)")  # fmt: skip
    if results.get("overlap"):
        out += ["", "== overlap and the schedule's tricks (v5p 8 chips; scan dim 1024 depth 8, apply dim 512 depth 4)",
                f"{'variant':<8} {'pf':>2} {'trial':<36} {'alloc GiB':>10} {'overlap':>8} {'by bytes':>8} {'alive':>6}"]
        for r in results["overlap"]:
            alloc = r.get("allocated_GiB", float("nan"))
            out.append(f"{_variant(r):<8} {r['prefetch']:>2} {r['trial']:<36} {alloc:>10.3f} "
                       f"{r.get('gather_overlap') or 0:>8.2f} {_fraction(r.get('gather_overlap_bytes')):>8} "
                       f"{r.get('layers_alive') or 0:>6}")  # fmt: skip
    if results.get("claims"):
        out += ["", "== the README's CPU claims re-checked (v5p 8 chips, reference transformer dim 256, depth 4, fp32)",
                f"{'cell':<34} {'bytes/formula':>14} {'comm/th':>8} {'compiled/th':>11}  compiled collectives; check()"]
        for r in results["claims"]:
            ratios = r["bytes_over_formula"].values()
            span = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
            comp = r["compiled_over_theory"]
            out.append(f"{r['cell']:<34} {span:>14} {r['comm_over_theory'] or 0:>8.3f} "
                       f"{comp if comp is not None else float('nan'):>11.3f}  {', '.join(r['compiled_kinds_dtypes'])}; "
                       f"{'passes' if not r['violations'] else 'flags ' + ', '.join(r['violations'])}")  # fmt: skip
            if "theory_per_axis_MiB" in r:
                theory = {AXIS_OF_THEORY.get(k, k): v for k, v in r["theory_per_axis_MiB"].items()}
                per = ", ".join(f"{k} {v:.2f}/{theory.get(k, 0):.2f}" for k, v in r["comm_per_axis_MiB"].items() if v)
                out.append(f"{'':<34} MiB per axis measured/theory: {per}")
    if any(_variant(r).endswith("*") for rows in results.values() if isinstance(rows, list) for r in rows
           if isinstance(r, dict) and "variant" in r):  # fmt: skip
        out += ["", "* measured under an older TPU schedule than zero_jax compiles with now (zj.measure.schedule_for): "
                "not measured again this time"]
    if results.get("largest"):
        out += ["", "== largest model that fits one v5p chip (95 GiB): model_state_bytes + measured activations"]
        for r in results["largest"]:
            out.append(f"N = {r['N']:>3} stage {r['stage']}: {r['largest_params'] / 1e9:>8.1f}B params "
                       f"(activations {r['activations_GiB']:.2f} GiB)")  # fmt: skip
    return out


def _variant(row: dict[str, Any]) -> str:
    """A row's variant, marked "*" where it was measured under an older TPU schedule (:func:`stale`)."""
    return row["variant"] + ("*" if stale(row, row["variant"]) else "")


def _fraction(value: float | None) -> str:
    """A fraction for a table, "-" where the row was measured before the column existed."""
    return "-" if value is None else f"{value:.2f}"


def depth_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Growth of the layer-wise stage-3 peak from the shallowest depth against the allowance (the added layers'
    partitioned state + their saved block inputs, seq x dim bf16 each per chip) and stage 3 / stage 1 at the
    deepest depth measured for both, per series."""
    out = []
    for variant in ("3/scan", "3/apply"):
        series = sorted((r for r in rows if r["variant"] == variant and "allocated_GiB" in r), key=lambda r: r["depth"])
        if len(series) < 2:
            continue
        first = series[0]
        for last in series[1:]:
            carry = 1024 * last["dim"] * 2 / GiB  # one saved block input per chip (seq 1024, batch 1, bf16)
            allowance = last["state_GiB"] - first["state_GiB"] + (last["depth"] - first["depth"]) * carry
            for key, name in (("allocated_GiB", "allocated"), ("live_peak_GiB", "live peak")):
                if last.get(key) is None or first.get(key) is None:
                    continue
                growth = last[key] - first[key]
                out.append(f"  {variant} dim {last['dim']} depth {first['depth']} -> {last['depth']}: {name} grows "
                           f"{growth:.3f} GiB against the allowance {allowance:.3f} GiB = {growth / allowance:.2f}x "
                           f"({'within' if growth <= 1.3 * allowance else 'OVER'} 1.3x)")  # fmt: skip
        one = next((r for r in rows if r["variant"] == "1" and r["dim"] == series[-1]["dim"]
                    and r["depth"] == series[-1]["depth"] and "allocated_GiB" in r), None)  # fmt: skip
        if one:
            ratio = series[-1]["allocated_GiB"] / one["allocated_GiB"]
            out.append(f"  {variant} dim {one['dim']} depth {one['depth']}: stage 3 / stage 1 allocated = "
                       f"{series[-1]['allocated_GiB']:.3f} / {one['allocated_GiB']:.3f} = {ratio:.2f} "
                       f"({'within' if ratio <= 0.5 else 'OVER'} 0.5)")  # fmt: skip
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = results.get("depth") or []
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant in ("3/scan", "3/apply"):
        pts = sorted((r["depth"], r["allocated_GiB"], r["state_GiB"]) for r in rows if r["variant"] == variant
                     and "allocated_GiB" in r)  # fmt: skip
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{variant}: allocated HBM")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", label=f"{variant}: model state")
    ax.set_xlabel("depth (layers)")
    ax.set_ylabel("GiB per chip")
    ax.set_title("layer-wise ZeRO-3 on the TPU compiler (v5p, 8 chips)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(SECTIONS), action="append",
                        help="compute these sections again (rows measured before are reused)")
    parser.add_argument("--quick", action="store_true", help="small models: a smoke run of every code path")
    parser.add_argument("--fresh", action="store_true", help="ignore the cached results")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--cached-only", action="store_true", help="compile nothing: tables of the rows measured")
    parser.add_argument("--model", action="append", choices=list(MODELS), help="stages: only these models")
    parser.add_argument("--slice", action="append", choices=[t for _, t in STAGE_SLICES], help="stages: only these")
    parser.add_argument("--variant", action="append", choices=VARIANTS,
                        help="stages: only these variants; depth: re-measure only these (older rows stay, marked)")
    args = parser.parse_args(argv)
    STAGE_FILTER.update({k: v for k, v in (("model", args.model), ("slice", args.slice), ("variant", args.variant))
                         if v})  # fmt: skip
    if args.cached_only:
        RENDER_ONLY.append(True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "tpu_aot_quick" if args.quick else "tpu_aot"
    cache = args.out / f"{stem}.json"
    results: dict[str, Any] = {} if args.fresh or not cache.exists() else json.loads(cache.read_text())
    ROWS_FILE.append(args.out / f"{stem}_rows.json")
    if ROWS_FILE[0].exists() and not args.fresh:
        ROWS.update(json.loads(ROWS_FILE[0].read_text()))
    log = lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)  # noqa: E731
    for name in args.only or list(SECTIONS):
        if name in results and not args.fresh and not args.cached_only and not args.only:
            log(f"{name}: cached")
            continue
        if args.cached_only and name in ("gspmd", "claims", "stages") and name in results:
            continue  # whole-section results (the recipe's row is not a cached row)
        try:
            rows = SECTIONS[name](args.quick, log)
            results[name] = [r for r in rows if not r.get("missing")]
        except Exception:
            traceback.print_exc()
            results[name + "_error"] = traceback.format_exc()[-2000:]
        cache.write_text(json.dumps(results, indent=1, default=str))
    results["largest"] = largest(results)
    cache.write_text(json.dumps(results, indent=1, default=str))
    header = [
        f"# {' '.join(shlex.quote(a) for a in ['python', 'benchmarks/tpu_aot.py', *(argv or sys.argv[1:])])}",
        f"# {datetime.datetime.now().isoformat(timespec='seconds')}; {platform.node()}; {os.cpu_count()} CPUs; "
        f"jax {jax.__version__}; libtpu {_libtpu_version()}; deviceless TPU compiles (JAX_PLATFORMS=cpu)",
    ]
    text = "\n".join(header + table(results)) + "\n"
    (args.out / f"{stem}.txt").write_text(text)
    print(text)
    plot(results, args.out / f"{stem}.png")


@functools.cache
def _libtpu_version() -> str:
    out = subprocess.run([sys.executable, "-m", "pip", "show", "libtpu"], capture_output=True, text=True).stdout
    return next((line.split()[-1] for line in out.splitlines() if line.startswith("Version")), "?")


if __name__ == "__main__":
    main()
