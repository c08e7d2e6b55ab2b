"""zero_jax on the GPU compiler, compiled here without a GPU: memory, communication and the step time XLA:GPU's
own latency-hiding schedule estimates, for 8 H100 on one host.

Run: ``JAX_PLATFORMS=cpu python benchmarks/gpu_aot.py`` (the CUDA plugin installed: ``pip install -e ".[gpu]"``;
every step is compiled for ``zj.topology_mesh("h100:1x8")`` and read with ``zj.audit``, whose ``report.estimate``
is the scheduler's estimate; nothing runs, so no GPU is needed). Rows are cached in ``gpu_aot.json`` as they
finish, so an interrupted run resumes (``--fresh`` starts over; ``--quick`` shrinks the model for a smoke run,
written to a temporary folder).

* ``stages``: the reference transformer at the 1B class (dim 2048, depth 16, 16 heads, seq 2048, vocab 32000; bf16
  compute, fp32 master, AdamW, one sequence per GPU), scanned (``zj.scan_layers``) and unscanned
  (``zj.apply_layers`` over a list of blocks): per stage (0-2, 3 ``gather="all"``, 3 layer-wise) the memory per GPU
  (the buffer assignment's total), the post-SPMD communication against the theory, the estimated step time, the
  communication it leaves exposed and the MFU it implies (model FLOPs ``zero_jax.models.model_flops`` over the
  estimate x 989 TFLOP/s bf16 dense), and the share of layer all-gather bytes with a matmul between start and done;
* ``depth``: layer-wise stage 3 at depth 4, 8, 16 (scanned) and 4, 16 (unscanned): growth of the memory per GPU
  against the allowance (the added layers' partitioned state + one saved block input each, seq x dim bf16), and
  stage 3 / stage 1 at depth 16;
* ``hpz``: ZeRO++'s hpZ across 2 hosts (``h100:2x8`` as a (node, gpu) = (2, 8) mesh, ``secondary_axis="gpu"``)
  against plain layer-wise stage 3 over both axes, the 1B class scanned: bytes per GPU per step by mesh axis (across
  the hosts: ``node``), memory, estimated step (XLA's default InfiniBand model between the hosts);
* ``gspmd``: the GSPMD FSDP recipe as MaxText writes it, on the same host and model: plain ``jax.jit``, every weight
  cut over ``data`` on its embed (model-width) dimension, Adam state alike, the batch over ``data``, fp32 master
  cast to bf16 in the loss, the activations constrained to ``P("data", None, None)`` after every block, each block
  rematerialised (``jax.checkpoint``, MaxText's default ``remat_policy="full"``), the blocks scanned: memory,
  communication, estimated step time from the same estimator in the same run.

The estimates are XLA's cost model (see ``zj.measure.ESTIMATE_LEAVES_OUT``): a scanned step's loop bodies are timed
from their own schedules, each times its runs per step; a body the scheduler does not dump (no async collective in
it: scanned stages 0-2, whose gradient reduction follows the loop) leaves the estimate a lower bound, marked ``>=``.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common as common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tpu_aot import build  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, block, init_params, make_loss_fn, model_flops, unstack_params  # noqa: E402

GiB, MiB = 2**30, 2**20
TOPOLOGY = "h100:1x8"
MODEL = dict(vocab=32000, dim=2048, depth=16, heads=16, seq=2048)
QUICK = dict(vocab=512, dim=256, depth=4, heads=4, seq=128)
#: gather="all" at stage 3 keeps the forward's gathered parameters on XLA:GPU (the schedule seam's
#: ``keep_gathered_all``); "3/all-regather" is the step without it (``keep_gathered=False``).
#: "3/lw-fp32": layer-wise with fp32 master parameters only (``Precision(compute_copy=False)``: each piece cast to bf16
#: as it is gathered), the state the GSPMD recipe keeps (12 bytes a parameter against 14).
#: "3/lw-int8": layer-wise with ZeRO++'s int8 wires (qwZ + qgZ: int8 weight gathers, int8 gradient reductions).
VARIANTS = ["1", "3/lw", "3/lw-fp32", "3/lw-int8", "3/all", "0", "2", "3/all-regather"]
DEPTHS = {"scan": [4, 8, 16], "apply": [4, 16]}
#: Beyond the 1B class on one host: the rows compiled where time allows (scanned only), keyed by a prefix.
MORE = {
    "1B h100:2x8": ("h100:2x8", MODEL, ["1", "3/lw", "3/lw-fp32", "3/all", "gspmd"]),
    "8B h100:1x8": ("h100:1x8", dict(vocab=32000, dim=4096, depth=32, heads=32, seq=2048),
                    ["1", "3/lw", "3/lw-fp32", "3/all", "gspmd"]),
    "1B h200:1x8": ("h200:1x8", MODEL, ["1", "3/lw", "3/lw-fp32", "gspmd"]),
}  # fmt: skip


#: hpZ across hosts: the target, and the (node, gpu) mesh shape it is cut into.
HPZ = ("h100:2x8", (2, 8))


def config(quick: bool, **over: Any) -> TransformerConfig:
    return TransformerConfig(**(QUICK if quick else MODEL) | over)


def _row_of_estimate(est: Any, cfg: TransformerConfig, n: int) -> dict[str, Any]:
    est = est.with_flops(model_flops(cfg, n * cfg.seq), devices=n)
    return {
        "step_ms": est.seconds * 1e3, "complete": est.complete, "exposed_ms": est.exposed_seconds * 1e3,
        "exposed_by_kind_ms": {k: v * 1e3 for k, v in est.exposed_by_kind.items()}, "mfu": est.mfu,
        "loops": [(lp.body, lp.runs, lp.micros) for lp in est.loops], "model_flops": est.model_flops,
    }  # fmt: skip


def zero_row(layout: str, variant: str, cfg: TransformerConfig, mesh: Any) -> dict[str, Any]:
    """One zero_jax step compiled for the GPUs and audited (the estimate is the audit's)."""
    if variant.startswith("3/lw"):
        copy = variant != "3/lw-fp32"
        int8 = {"quantize_weights": "int8", "quantize_grads": "int8"} if variant == "3/lw-int8" else {}
        precision = zj.Precision(compute_dtype=jnp.bfloat16, compute_copy=copy)
        step, state, batch = build(mesh, "3/scan" if layout == "scan" else "3/apply", cfg, precision=precision, **int8)
    else:
        step, state, batch = all_step(mesh, int(variant[0]), cfg, layout, None if variant[1:] != "/all-regather" else
                                      False)  # fmt: skip
    t = time.perf_counter()
    r = zj.audit(step, state, batch, grads=False, fast_compile=False)
    row = {
        "compile_s": round(time.perf_counter() - t, 1),
        "allocated_GiB": r.memory.get("allocated", r.memory["peak"]) / GiB,
        "live_peak_GiB": r.memory["live_peak"] / GiB if r.memory.get("live_peak") else None,
        "state_GiB": sum(r.state_bytes.values()) / GiB,
        "comm_MiB": r.comm.measured / MiB, "theory_MiB": r.comm.theory / MiB,
        "comm_over_theory": r.comm.measured / r.comm.theory if r.comm.theory else None,
        "compiled_MiB": r.compiled.ring_bytes / MiB if r.compiled else None,
        "gather_overlap_bytes": r.overlap.gather_bytes_fraction if r.overlap else None,
        "layers_alive": r.layers.max_alive if r.layers else None,
        "violations": [v.kind for v in r.violations],
    }  # fmt: skip
    if r.estimate is not None:
        row |= _row_of_estimate(r.estimate, cfg, mesh.size)
    if variant == "3/lw-int8":  # the wire as XLA:GPU compiled it: do the gathers still move int8?
        text = step.lower(state, batch).compile().as_text()
        row["wire_MiB"] = {k: {d: b / MiB for d, b in v.items()} for k, v in r.wire_bytes().items()}
        starts = re.findall(r"= \(*(\w+)\[[^\n]*? all-gather-start\(", text)  # each start's first array's dtype
        row["compiled_gathers"] = {dt: starts.count(dt) for dt in sorted(set(starts))}
    return row


def hpz_row(cfg: TransformerConfig, hpz: bool) -> dict[str, Any]:
    """Layer-wise stage 3 (scanned) over a (node, gpu) mesh of :data:`HPZ`'s target, with hpZ (the secondary
    pieces within each host, ``secondary_axis="gpu"``) or without: bytes per axis, memory, estimate."""
    mesh = zj.topology_mesh(HPZ[0], axes=("node", "gpu"), shape=HPZ[1])
    step, state, batch = build(mesh, "3/scan", cfg, axis=("node", "gpu"), **({"secondary_axis": "gpu"} if hpz else {}))
    t = time.perf_counter()
    r = zj.audit(step, state, batch, grads=False, fast_compile=False)
    row = {
        "compile_s": round(time.perf_counter() - t, 1),
        "allocated_GiB": r.memory.get("allocated", r.memory["peak"]) / GiB,
        "per_axis_MiB": {k: sum(v.values()) / MiB for k, v in r.comm_per_axis_kind.items()},
        "comm_MiB": r.comm.measured / MiB, "violations": [v.kind for v in r.violations],
    }  # fmt: skip
    return row | (_row_of_estimate(r.estimate, cfg, mesh.size) if r.estimate is not None else {})


def int8_lines(rows: dict[str, dict[str, Any]], quick: bool) -> list[str]:
    """What the int8 wires (qwZ + qgZ) move once XLA:GPU has compiled the step."""
    out = []
    for layout in ("scan", "apply"):
        r = rows.get(key("stages", layout, "3/lw-int8", config(quick).depth))
        if not r or "error" in r or "wire_MiB" not in r:
            continue
        wire = "; ".join(f"{kind} " + ", ".join(f"{d} {b:.0f}" for d, b in sorted(v.items()) if b >= 0.5)
                         for kind, v in sorted(r["wire_MiB"].items()) if any(b >= 0.5 for b in v.values()))
        gathers = ", ".join(f"{dt} {n}" for dt, n in r["compiled_gathers"].items() if n)
        out.append(f"  {layout}: MiB per GPU per step by kind and wire dtype (post-SPMD): {wire}; all-gather starts "
                   f"in the compiled program by dtype: {gathers}")  # fmt: skip
    return out


def hpz_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for hpz in (False, True):
        r = rows.get(key("hpz", "scan", "hpZ" if hpz else "plain", MODEL["depth"]))
        if not r or "error" in r:
            continue
        axes = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["per_axis_MiB"].items()) if v >= 0.5)
        name = "hpZ, secondary_axis='gpu'" if hpz else "plain stage 3"
        out.append(f"  {name:<28} {r['allocated_GiB']:.2f} GiB/GPU, MiB per GPU per step by axes: {axes}; "
                   f"estimated step {r['step_ms']:.1f} ms, exposed {r['exposed_ms']:.1f}")  # fmt: skip
    return out


def all_step(mesh: Any, stage: int, cfg: TransformerConfig, layout: str, keep_gathered: bool | None = None
             ) -> tuple[Any, Any, Any]:  # fmt: skip
    """A gather="all" step over the stacked layers ("scan") or a list of blocks ("apply"); ``keep_gathered``:
    ``make_train_step``'s (None: the schedule seam's choice)."""
    make = (lambda: init_params(cfg, jax.random.key(0))) if layout == "scan" else (
        lambda: unstack_params(init_params(cfg, jax.random.key(0))))  # fmt: skip
    params = jax.eval_shape(make)
    policy = zj.ZeroPolicy(stage, mesh, stacked="layers" if layout == "scan" else (),
                           precision=zj.Precision(compute_dtype=jnp.bfloat16))  # fmt: skip
    tx = zj.shard_optimizer(optax.adamw(1e-4), policy)
    keep = {} if keep_gathered is None or stage != 3 else {"keep_gathered": keep_gathered}
    step = zj.make_train_step(make_loss_fn(cfg), tx, policy, gather="all", **keep)
    tokens = jax.ShapeDtypeStruct((mesh.size, cfg.seq + 1), jnp.int32, sharding=policy.batch_sharding())
    return step, zj.init_state(params, tx, policy), {"tokens": tokens}


#: The embed (model-width) dimension of each leaf of the reference model, as MaxText's logical axes cut it.
EMBED_DIM = {
    "tokens": 1, "positions": 1, "norm1_scale": 1, "norm1_bias": 1, "attn_qkv": 1, "attn_out": 2, "norm2_scale": 1,
    "norm2_bias": 1, "mlp_in": 1, "mlp_in_bias": None, "mlp_out": 2, "mlp_out_bias": 1, "scale": 0, "bias": 0,
    "head": 0,
}  # fmt: skip


def gspmd_step(mesh: Any, cfg: TransformerConfig) -> tuple[Any, Any, Any]:
    """The GSPMD FSDP recipe as MaxText writes it (see the module docstring), on the same GPUs with the mesh
    axis Auto: the partitioner places what the constraints leave open."""
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))

    def spec(path: Any, leaf: Any) -> P:
        dim = EMBED_DIM[jax.tree_util.keystr(path[-1:]).strip("[]'")]
        return P() if dim is None else P(*[("data" if k == dim else None) for k in range(leaf.ndim)])

    shard = jax.tree.map(lambda s: NamedSharding(mesh, s), jax.tree_util.tree_map_with_path(spec, params))
    tx = optax.adamw(1e-4)
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_shard = optax.tree_utils.tree_map_params(tx, lambda _, s: s, opt_shapes, shard,
                                                 transform_non_params=lambda _: NamedSharding(mesh, P()))  # fmt: skip
    acts, whole = NamedSharding(mesh, P("data", None, None)), NamedSharding(mesh, P())

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        table = jax.lax.with_sharding_constraint(p["embed"]["tokens"], whole)  # FSDP gathers the table
        x = table[inputs] + p["embed"]["positions"][: cfg.seq]
        x = jax.lax.with_sharding_constraint(x, acts)

        def body(h: jax.Array, layer: Any) -> tuple[jax.Array, None]:
            h = jax.checkpoint(lambda a, w: block(w, a, heads=cfg.heads))(h, layer)
            return jax.lax.with_sharding_constraint(h, acts), None

        x, _ = jax.lax.scan(body, x, p["layers"])
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        x = (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["final_norm"]["scale"] + p["final_norm"]["bias"]
        logits = (x @ p["head"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def step(p: Any, o: Any, tokens: jax.Array) -> Any:
        lval, g = jax.value_and_grad(loss)(p, tokens)
        g = jax.lax.with_sharding_constraint(g, shard)
        updates, o = tx.update(g, o, p)
        return optax.apply_updates(p, updates), o, lval

    batch = NamedSharding(mesh, P("data"))
    jitted = jax.jit(step, in_shardings=(shard, opt_shard, batch), out_shardings=(shard, opt_shard, NamedSharding(
        mesh, P())), donate_argnums=(0, 1))  # fmt: skip
    abstract = lambda t, s: jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), t, s)  # noqa: E731
    tokens = jax.ShapeDtypeStruct((mesh.size, cfg.seq + 1), jnp.int32, sharding=batch)
    return jitted, (abstract(params, shard), abstract(opt_shapes, opt_shard)), tokens


def gspmd_row(cfg: TransformerConfig, mesh: Any) -> dict[str, Any]:
    jitted, (p, o), tokens = gspmd_step(mesh, cfg)
    t = time.perf_counter()
    done = zj.measure.compile_with_dump(jitted.lower(p, o, tokens), schedule=True)
    colls = zj.measure.parse_collectives(done.spmd_hlo, mesh.size)
    mem = zj.measure.memory(done.executable)
    est = zj.measure.estimate_from_schedule(done.schedule or "", device_kind=mesh.devices.flat[0].device_kind)
    return {
        "compile_s": round(time.perf_counter() - t, 1),
        "allocated_GiB": (done.allocated or mem["peak"]) / GiB,
        "live_peak_GiB": done.live_peak.bytes / GiB if done.live_peak else None,
        "comm_MiB": zj.measure.ring_bytes(colls) / MiB,
    } | _row_of_estimate(est, cfg, mesh.size)  # fmt: skip


# -- the run --------------------------------------------------------------------------------------------------


def plan(quick: bool) -> list[tuple[str, str, str, int, str]]:
    """(section, layout, variant, depth, target) in the order they are compiled: the most telling first
    (target "": the 1B class on h100:1x8; else a key of :data:`MORE`)."""
    deep = config(quick).depth
    out = [("stages", "scan", v, deep, "") for v in VARIANTS] + [("gspmd", "scan", "gspmd", deep, "")]
    out += [("stages", "apply", v, deep, "") for v in VARIANTS]
    out += [("depth", layout, "3/lw", d, "") for layout, ds in DEPTHS.items() for d in ds if d != deep]
    if not quick:
        out += [("gspmd" if v == "gspmd" else "stages", "scan", v, model["depth"], target)
                for target, (_, model, vs) in MORE.items() for v in vs]  # fmt: skip
        out += [("hpz", "scan", v, deep, "") for v in ("plain", "hpZ")]
    return out


def key(section: str, layout: str, variant: str, depth: int, target: str = "") -> str:
    prefix = f"{target} " if target else ""
    if section in ("gspmd", "hpz"):
        return prefix + f"{section} {layout} {variant if section == 'hpz' else ''} depth {depth}".replace("  ", " ")
    return prefix + f"{layout} {variant} depth {depth}"


def fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(rows: dict[str, dict[str, Any]], cfg: TransformerConfig, target: str = "",
          layouts: tuple[str, ...] = ("scan", "apply"), variants: tuple[str, ...] = (*VARIANTS, "gspmd")
          ) -> list[str]:  # fmt: skip
    deep = cfg.depth
    out = [f"{'layout':<7}{'variant':<15}{'GiB/GPU':>9}{'comm MiB':>10}{'/theory':>8}{'est. ms':>10}{'exposed':>9}"
           f"{'MFU':>7}{'AG overlap':>11}{'compile s':>10}"]  # fmt: skip
    theory = {layout: (rows.get(key("stages", layout, "3/lw", deep, target)) or {}).get("theory_MiB")
              for layout in layouts}  # fmt: skip
    for layout in layouts:
        for v in variants:
            k = key("gspmd" if v == "gspmd" else "stages", layout, v, deep, target)
            r = rows.get(k)
            if r is None:
                out.append(f"{layout:<7}{v:<15}  (not measured)")
                continue
            if "error" in r:
                out.append(f"{layout:<7}{v:<15}  error: {r['error'][:90]}")
                continue
            ratio = r.get("comm_over_theory") or (r["comm_MiB"] / theory[layout] if theory.get(layout) else None)
            lb = "" if r.get("complete", True) else ">="
            if r.get("step_ms"):  # MFU per GPU: one sequence each
                r["mfu"] = model_flops(cfg, cfg.seq) / (r["step_ms"] / 1e3 * 989e12)
            out.append(
                f"{layout:<7}{v:<15}{r['allocated_GiB']:>9.2f}{r['comm_MiB']:>10.0f}{fmt(ratio, '.3f'):>8}"
                f"{lb + fmt(r.get('step_ms'), '.2f'):>10}{fmt(r.get('exposed_ms'), '.2f'):>9}"
                f"{(lb + fmt(r.get('mfu'), '.1%')) if r.get('complete', True) else '-':>7}"
                f"{fmt(r.get('gather_overlap_bytes'), '.0%'):>11}{r['compile_s']:>10.0f}"
            )  # fmt: skip
    return out


def more_tables(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The tables of :data:`MORE`'s targets measured so far."""
    out = []
    for target, (topology, model, variants) in MORE.items():
        cfg = TransformerConfig(**model)
        if any(k.startswith(target + " ") for k in rows):
            out += ["", f"{target}: {zj.gpu_slice(topology)}; vocab {cfg.vocab}, dim {cfg.dim}, depth {cfg.depth}, "
                    f"heads {cfg.heads}, seq {cfg.seq}, {cfg.num_params() / 1e9:.2f}B parameters (scanned only)",
                    *table(rows, cfg, target, ("scan",), tuple(variants))]  # fmt: skip
    return out


def depth_lines(rows: dict[str, dict[str, Any]], quick: bool) -> list[str]:
    out = []
    deep = config(quick).depth
    for layout, ds in DEPTHS.items():
        series = [(d, rows.get(key("depth" if d != deep else "stages", layout, "3/lw", d))) for d in ds]
        series = [(d, r) for d, r in series if r and "error" not in r]
        if len(series) < 2:
            continue
        (d0, first) = series[0]
        cfg = config(quick)
        for d, last in series[1:]:
            carry = cfg.seq * cfg.dim * 2 / GiB  # one saved block input per GPU (one sequence, bf16)
            allowance = last["state_GiB"] - first["state_GiB"] + (d - d0) * carry
            growth = last["allocated_GiB"] - first["allocated_GiB"]
            out.append(f"  {layout} layer-wise stage 3, depth {d0} -> {d}: {first['allocated_GiB']:.3f} -> "
                       f"{last['allocated_GiB']:.3f} GiB, growth {growth:.3f} GiB against the allowance "
                       f"{allowance:.3f} GiB = {growth / allowance:.2f}x "
                       f"({'within' if growth <= 1.3 * allowance else 'OVER'} 1.3x)")  # fmt: skip
        one, three, alls = (rows.get(key("stages", layout, v, deep)) for v in ("1", "3/lw", "3/all"))
        if one and three and "error" not in one and "error" not in three:
            ratio = three["allocated_GiB"] / one["allocated_GiB"]
            out.append(f"  {layout} depth {deep}: stage 3 layer-wise / stage 1 = {three['allocated_GiB']:.3f} / "
                       f"{one['allocated_GiB']:.3f} GiB = {ratio:.2f} ({'within' if ratio <= 0.5 else 'OVER'} 0.5)")
        if one and alls and "error" not in one and "error" not in alls:
            out.append(f"  {layout} depth {deep}: stage 3 gather=\"all\" / stage 1 = {alls['allocated_GiB']:.3f} / "
                       f"{one['allocated_GiB']:.3f} GiB = {alls['allocated_GiB'] / one['allocated_GiB']:.2f}")
    return out


def recipe_lines(rows: dict[str, dict[str, Any]], quick: bool) -> list[str]:
    """Layer-wise stage 3 (with the bf16 compute copy, and with fp32 master parameters only) over the GSPMD
    recipe on the same GPUs, from the same estimator: memory and estimated step; the exposed share of the step."""
    out = []
    targets = [("", TOPOLOGY, config(quick).depth)] + ([] if quick else [(t, topo, model["depth"])
                                                                      for t, (topo, model, _) in MORE.items()])
    for target, topology, deep in targets:
        recipe = rows.get(key("gspmd", "scan", "gspmd", deep, target))
        if not recipe or "error" in recipe:
            continue
        for v in ("3/lw", "3/lw-fp32"):
            r = rows.get(key("stages", "scan", v, deep, target))
            if not r or "error" in r or not r.get("step_ms"):
                continue
            out.append(f"  {target or topology} scanned {v} / recipe: memory {r['allocated_GiB']:.2f} / "
                       f"{recipe['allocated_GiB']:.2f} GiB = {r['allocated_GiB'] / recipe['allocated_GiB']:.3f}x, "
                       f"estimated step {r['step_ms']:.1f} / {recipe['step_ms']:.1f} ms = "
                       f"{r['step_ms'] / recipe['step_ms']:.3f}x; exposed {r['exposed_ms'] / r['step_ms']:.0%} of "
                       f"the step (recipe {recipe['exposed_ms'] / recipe['step_ms']:.0%})")  # fmt: skip
    return out


def versions() -> str:
    names = ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "nvidia-cuda-nvcc-cu12")
    found = []
    for n in names:
        try:
            found.append(f"{n} {importlib.metadata.version(n)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def render(rows: dict[str, Any], record: common.Record, quick: bool, out: str) -> None:
    cfg = config(quick)
    gpus = zj.gpu_slice(TOPOLOGY)
    text = record.header(
        "zero_jax on XLA:GPU, compiled here without a GPU (benchmarks/gpu_aot.py)",
        f"target: {gpus}",
        f"model: the reference transformer, vocab {cfg.vocab}, dim {cfg.dim}, depth {cfg.depth}, heads {cfg.heads}, "
        f"seq {cfg.seq}, {cfg.num_params() / 1e9:.2f}B parameters; bf16 compute, fp32 master, AdamW; one sequence "
        "per GPU; model FLOPs/step = zero_jax.models.model_flops; MFU against 989 TFLOP/s bf16 dense per H100",
        "GiB/GPU: the GPU buffer assignment's total; comm: post-SPMD ring bytes per GPU per step (the GSPMD row: "
        "over zero_jax's stage-3 theory); est. ms, exposed: the step time and the communication left exposed by "
        "XLA:GPU's latency-hiding schedule, loop bodies times their runs per step (>=: a loop body unscheduled, a "
        "lower bound); AG overlap: layer all-gather bytes with a matmul between start and done",
        "ESTIMATES: " + zj.measure.ESTIMATE_LEAVES_OUT,
        "",
        *table(rows, cfg),
        *more_tables(rows),
        "",
        "depth (layer-wise stage 3):",
        *depth_lines(rows, quick),
        "",
        "against the GSPMD recipe (scanned, same GPUs, same estimator):",
        *recipe_lines(rows, quick),
        "",
        "int8 wires (3/lw-int8) after XLA:GPU's passes:",
        *int8_lines(rows, quick),
        "",
        f"hpZ across 2 hosts ({HPZ[0]} as (node, gpu) = {HPZ[1]}; the 1B class, scanned, layer-wise stage 3):",
        *hpz_lines(rows),
        versions=versions(),
    )
    common.write_results("gpu_aot", text, {"meta": record.meta(), "rows": rows}, out=out)
    print(text, flush=True)
    plot(rows, quick, os.path.join(out, "gpu_aot.png"))


def plot(rows: dict[str, Any], quick: bool, path: str) -> None:
    plt = common.pyplot()
    deep = config(quick).depth
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for layout, marker in (("scan", "o"), ("apply", "s")):
        names = [*VARIANTS, "gspmd"]
        got = [(v, rows.get(key("gspmd" if v == "gspmd" else "stages", layout, v, deep))) for v in names]
        got = [(v, r) for v, r in got if r and "error" not in r]
        ax.plot([v for v, _ in got], [r["allocated_GiB"] for _, r in got], marker, label=layout)
        bx.plot([v for v, _ in got], [r.get("step_ms") or 0 for _, r in got], marker, label=layout)
    ax.set_ylabel("GiB per GPU (buffer assignment)")
    bx.set_ylabel("estimated step (ms, XLA:GPU schedule)")
    for a in (ax, bx):
        a.legend()
        a.set_title(f"1 x 8 H100, depth {deep}")
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model, written to a temporary folder")
    ap.add_argument("--fresh", action="store_true", help="forget the cached rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or (tempfile.mkdtemp(prefix="gpu_aot_") if args.quick else common.RESULTS)
    cache = Path(out) / "gpu_aot.json"
    rows: dict[str, Any] = {} if args.fresh or not cache.exists() else json.loads(cache.read_text())["rows"]
    record = common.Record()
    for section, layout, variant, depth, target in plan(args.quick):
        k = key(section, layout, variant, depth, target)
        if k in rows and "error" not in rows[k]:
            continue
        print(f"-- {k}", flush=True)
        topology, model, _ = MORE.get(target, (TOPOLOGY, None, None))
        mesh = zj.topology_mesh(topology)
        cfg = config(args.quick, depth=depth) if model is None else TransformerConfig(**model)
        try:
            rows[k] = (gspmd_row(cfg, mesh) if section == "gspmd" else hpz_row(cfg, variant == "hpZ")
                       if section == "hpz" else zero_row(layout, variant, cfg, mesh))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a row that fails is recorded and the run goes on
            traceback.print_exc()
            rows[k] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        print(json.dumps(rows[k], default=str)[:600], flush=True)
        render(rows, record, args.quick, out)
    render(rows, record, args.quick, out)


if __name__ == "__main__":
    sys.exit(main())
