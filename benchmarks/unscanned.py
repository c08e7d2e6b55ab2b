"""Layer-wise ZeRO-2/3 on an unscanned transformer (a Python loop over blocks) against depth.

Run: ``python benchmarks/unscanned.py`` (8 simulated CPU devices in one process; a few minutes on
2 cores; ``--quick`` for depths 4 and 8 with fewer steps). It prints one table, the issue's
must-show checks as PASS/FAIL lines with their numbers and the prefetch schedule, and writes them
with the command and the machine to ``benchmarks/results/unscanned.txt``, the raw numbers to
``unscanned.json`` and a plot (peak memory against depth, one line per variant) to ``unscanned.png``.
``--fragmentation`` prints only zj.audit's fragmentation line (allocated against XLA's live peak, ZeRO-R's
M_D) for every variant at depths 4 and 8 (or ``--depths``), into ``results/unscanned_fragmentation.txt``.

The model is the reference transformer of ``zero_jax.models`` (vocab 256, dim 256, 4 heads, seq 64,
MLP 1024, fp32) written as users write one: ``params["blocks"]`` is a Python list of per-block
dicts and the loss runs ``for p in params["blocks"]: x = block(p, x)``. Adam, global batch 16 over
N = 8 devices. Variants:

* ``DP``, ``ZeRO-1``, ``ZeRO-2``, ``ZeRO-3/all``: zero_jax stages 0-3 with the default
  ``gather="all"`` and the plain loop (no remat: the user's model as written).
* ``ZeRO-1/lw``, ``ZeRO-2/lw``, ``ZeRO-3/lw0``, ``ZeRO-3/lw1``: ``gather="manual"`` with the same blocks run by
  ``make_loss_fn(cfg, policy, prefetch=k)``, which runs ``params["blocks"]`` with
  ``zj.apply_layers(block, params["blocks"], x, policy, prefetch=k)`` (stage 2: each block's
  gradient reduce-scattered as the backward pass produces it; stage 3 also gathers each block just
  before use, forward and backward, prefetching k blocks ahead); embeddings and head by
  ``zj.gather``, the head inside ``jax.checkpoint``.
* ``scan/pf1``, ``scan/pf0``: the scanned reference model (``make_loss_fn(cfg, policy,
  prefetch=k)``, ``zj.scan_layers`` over stacked layers), stage 3, for comparison.

Measured per variant and depth: compiled peak (argument + output + temp - alias of
``memory_analysis()``) and temp; communication of the program right after SPMD partitioning
(ring bytes per device per step, ``zero_jax.measure``); compiled collective counts and, for the
layer-wise variants, all-gathers and reduce-scatters per block weight (ops named
``zj_block<i>_gather`` / ``zj_block<i>_reduce`` in the HLO metadata); step time (median over
``--steps`` rounds after a warm-up, the variants of one depth taking turns).
"""

from __future__ import annotations

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

# Every compilation of the process dumps the HLO this benchmark reads.
common.setup(devices=8, hlo_dump=True)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure  # noqa: E402
from zero_jax.models import (  # noqa: E402
    TransformerConfig,
    block,
    init_params,
    make_loss_fn,
    synthetic_batch,
    unstack_params,
)

PyTree = Any
N = 8
DEPTHS = (4, 8, 16)
QUICK_DEPTHS = (4, 8)
MODEL = {"vocab": 256, "dim": 256, "heads": 4, "seq": 64, "mlp": 1024}
GLOBAL_BATCH = 16
LEARNING_RATE = 1e-3
MiB = 2**20
# variant -> (stage, kind, prefetch); kind: "all" (plain loop, gather="all"), "lw" (apply_layers), "scan"
VARIANTS: dict[str, tuple[int, str, int]] = {  # stage, model kind, prefetch
    "DP": (0, "all", 0),
    "ZeRO-1": (1, "all", 0),
    "ZeRO-2": (2, "all", 0),
    "ZeRO-1/lw": (1, "lw", 0),
    "ZeRO-2/lw": (2, "lw", 0),
    "ZeRO-1/acc2": (1, "all", 0),
    "ZeRO-2/lw/acc2": (2, "lw", 0),
    "ZeRO-3/all": (3, "all", 0),
    "ZeRO-3/lw0": (3, "lw", 0),
    "ZeRO-3/lw1": (3, "lw", 1),
    "linen/lw1": (3, "linen", 1),
    "nnx/lw1": (3, "nnx", 1),
    "scan/pf0": (3, "scan", 0),
    "scan/pf1": (3, "scan", 1),
}
ACCUM = {"ZeRO-1/acc2": 2, "ZeRO-2/lw/acc2": 2}  # microbatches; stage 1's default accumulates whole gradients
BLOCK_WEIGHTS = ("attn_qkv", "attn_out", "mlp_in", "mlp_out")  # the matrices of a block


def config(depth: int) -> TransformerConfig:
    return TransformerConfig(depth=depth, **MODEL)


# -- the unscanned model, as users write it ----------------------------------------------------------


def unscanned_params(cfg: TransformerConfig) -> PyTree:
    """The reference parameters with ``layers`` unstacked into ``blocks``, a list of per-block dicts."""
    return unstack_params(init_params(cfg, jax.random.key(0)))


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """The reference model's layer norm (the same arithmetic as its blocks')."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def head_loss(params: PyTree, x: jax.Array, tokens: jax.Array) -> jax.Array:
    """Final norm, the head inside ``jax.checkpoint`` and the mean next-token cross-entropy of
    ``tokens`` (batch, seq + 1), as the reference model computes them (whole parameters)."""
    norm = params["final_norm"]
    x = layer_norm(x, norm["scale"], norm["bias"])
    logits = jax.checkpoint(lambda h, head: h @ head)(x, params["head"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def plain_loss(cfg: TransformerConfig) -> Callable:
    """gather="all": whole parameters, a plain Python loop over the blocks."""

    def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
        tokens = batch["tokens"]
        x = params["embed"]["tokens"][tokens[:, :-1]] + params["embed"]["positions"][: cfg.seq]
        for p in params["blocks"]:
            x = block(p, x, heads=cfg.heads)
        return head_loss(params, x, tokens)

    return loss_fn


def block_shapes(cfg: TransformerConfig) -> PyTree:
    return jax.eval_shape(lambda: unscanned_params(cfg))


class LinenBlock(nn.Module):
    """One reference block as a Linen module (the same math as ``zero_jax.models``)."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shapes = block_shapes(self.cfg)["blocks"][0]
        p = {k: self.param(k, lambda _, s=s: jnp.zeros(s.shape, s.dtype)) for k, s in shapes.items()}
        return block(p, x, heads=self.cfg.heads)


class LinenTower(nn.Module):
    """The transformer as Linen users write it: submodules h_0 … h_{L-1} called in a Python loop."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        shapes = block_shapes(self.cfg)
        zeros = lambda name: lambda _: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[name])  # noqa: E731
        embed = self.param("embed", zeros("embed"))
        x = embed["tokens"][tokens[:, :-1]] + embed["positions"][: self.cfg.seq]
        for i in range(self.cfg.depth):
            x = LinenBlock(self.cfg, name=f"h_{i}")(x)
        return head_loss({n: self.param(n, zeros(n)) for n in ("final_norm", "head")}, x, tokens)


def linen_adapted(cfg: TransformerConfig, prefetch: int) -> Any:
    params = unscanned_params(cfg)
    blocks = params.pop("blocks")
    variables = {"params": {**params, **{f"h_{i}": b for i, b in enumerate(blocks)}}}
    tower = LinenTower(cfg)
    return zj.adapters.from_linen(tower, variables, lambda v, b: tower.apply(v, b["tokens"]), layers="auto",
                                  prefetch=prefetch)  # fmt: skip


class NnxBlock(nnx.Module):
    def __init__(self, cfg: TransformerConfig, p: PyTree) -> None:
        self.cfg = cfg
        self.p = nnx.Dict({k: nnx.Param(v) for k, v in p.items()})

    def __call__(self, x: jax.Array) -> jax.Array:
        return block({k: v[...] for k, v in self.p.items()}, x, heads=self.cfg.heads)


class NnxTower(nnx.Module):
    """The transformer as NNX users write it: an nnx.List of blocks called in a Python loop."""

    def __init__(self, cfg: TransformerConfig) -> None:
        params = unscanned_params(cfg)
        self.cfg = cfg
        self.tokens, self.positions = nnx.Param(params["embed"]["tokens"]), nnx.Param(params["embed"]["positions"])
        self.norm_scale = nnx.Param(params["final_norm"]["scale"])
        self.norm_bias = nnx.Param(params["final_norm"]["bias"])
        self.head = nnx.Param(params["head"])
        self.blocks = nnx.List([NnxBlock(cfg, b) for b in params["blocks"]])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens[...][tokens[:, :-1]] + self.positions[...][: self.cfg.seq]
        for blk in self.blocks:
            x = blk(x)
        rest = {"final_norm": {"scale": self.norm_scale[...], "bias": self.norm_bias[...]}, "head": self.head[...]}
        return head_loss(rest, x, tokens)


def nnx_adapted(cfg: TransformerConfig, prefetch: int) -> Any:
    return zj.adapters.from_nnx(NnxTower(cfg), lambda m, b: m(b["tokens"]), layers="auto", prefetch=prefetch)


# -- sizes -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    depth: int
    psi: int  # all parameter bytes as stored (padded)
    per_block: int  # one block's parameter bytes
    carry: int  # one block's saved input per device


def sizes_for(depth: int, mesh: jax.sharding.Mesh) -> Sizes:
    cfg = config(depth)
    layouts = zj.ZeroPolicy(3, mesh).layouts(jax.eval_shape(lambda: unscanned_params(cfg)))
    is_lay = lambda x: isinstance(x, zj.LeafLayout)  # noqa: E731
    psi = sum(lay.nbytes for lay in jax.tree.leaves(layouts, is_leaf=is_lay))
    per_block = sum(lay.nbytes for lay in jax.tree.leaves(layouts["blocks"][0], is_leaf=is_lay))
    return Sizes(depth, psi, per_block, GLOBAL_BATCH // N * cfg.seq * cfg.dim * 4)


# -- compiling and reading the program -------------------------------------------------------------


_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = (\S+?)(?:\{[^}]*\})? ([\w\-]+)\(.*?op_name=\"([^\"]*)\"", re.M)


def entry_ops(text: str) -> list[tuple[str, str, str]]:
    """(shape, opcode, op_name) of the entry computation's instructions, in schedule order."""
    entry = text[text.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}\n")]
    return [(m.group(1), m.group(2), m.group(3)) for m in _OP.finditer(entry)]


def block_collectives(text: str, depth: int, shapes: dict[str, str]) -> dict[str, dict[str, float]]:
    """All-gathers and reduce-scatters per block weight in the compiled program (from the ops named
    zj_block<i>_gather / zj_block<i>_reduce), averaged over the blocks."""
    ops = entry_ops(text)
    out = {}
    for name, (whole, piece) in shapes.items():
        ag = rs = 0
        for i in range(depth):
            tag = re.compile(rf"zj_block{i}_(gather|reduce)\b|zj_block{i}_(gather|reduce)\)")
            for shape, opcode, op_name in ops:
                m = tag.search(op_name)
                if not m:
                    continue
                if opcode.startswith("all-gather") and shape == whole and "gather" in m.group(0):
                    ag += 1
                if opcode.startswith("reduce-scatter") and shape == piece and "reduce" in m.group(0):
                    rs += 1
        out[name] = {"all_gather_per_block": ag / depth, "reduce_scatter_per_block": rs / depth}
    return out


def weight_shapes(cfg: TransformerConfig, mesh: jax.sharding.Mesh) -> dict[str, tuple[str, str]]:
    """HLO shape strings of each block weight whole (what the all-gather makes) and as a piece."""
    lay = zj.ZeroPolicy(3, mesh).layouts(jax.eval_shape(lambda: unscanned_params(cfg)))["blocks"][0]
    out = {}
    for name in BLOCK_WEIGHTS:
        whole = list(lay[name].stored_shape)
        piece = list(whole)
        piece[lay[name].dim] //= N
        out[name] = (f"f32[{','.join(map(str, whole))}]", f"f32[{','.join(map(str, piece))}]")
    return out


def schedule(text: str, depth: int) -> list[dict[str, int]]:
    """Per forward block i: position (in the scheduled entry computation) of block i+1's first
    gather op and of block i's first and last compute op (backward ops, under transpose, left out)."""
    ops = [(k, op_name) for k, (_, _, op_name) in enumerate(entry_ops(text)) if "transpose(" not in op_name]
    rows = []
    for i in range(depth - 1):
        g = [k for k, n in ops if re.search(rf"zj_block{i + 1}_gather\b", n)]
        c = [k for k, n in ops if re.search(rf"zj_block{i}_compute\b", n)]
        if g and c:
            rows.append({"block": i, "next_gather_first": g[0], "compute_first": c[0], "compute_last": c[-1]})
    return rows


# -- the runs --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    variant: str
    depth: int
    step: Callable[[], Any]
    memory: dict[str, int]
    comm: float
    counts: dict[str, int]
    per_block: dict[str, dict[str, float]] | None
    sched: list[dict[str, int]] | None
    alive: float | None
    live_peak: int
    times: list[float] = dataclasses.field(default_factory=list)
    final_loss: float = float("nan")


def build(variant: str, depth: int, mesh: jax.sharding.Mesh) -> tuple[Callable, Any, Any]:
    """A variant's train step, its state and a batch."""
    stage, kind, prefetch = VARIANTS[variant]
    cfg = config(depth)
    policy = zj.ZeroPolicy(stage, mesh, stacked="layers") if kind == "scan" else zj.ZeroPolicy(stage, mesh)
    tx = zj.shard_optimizer(optax.adam(LEARNING_RATE), policy)
    if kind == "scan":
        state = zj.init_state(lambda: init_params(cfg, jax.random.key(0)), tx, policy)
        step_fn = zj.make_train_step(make_loss_fn(cfg, policy, prefetch=prefetch), tx, policy, gather="manual")
    elif kind in ("linen", "nnx"):
        adapted = (linen_adapted if kind == "linen" else nnx_adapted)(cfg, prefetch)
        state, step_fn = adapted.init_state(tx, policy), adapted.make_train_step(tx, policy)  # gather="manual"
    else:
        state = zj.init_state(lambda: unscanned_params(cfg), tx, policy)
        loss = plain_loss(cfg) if kind == "all" else make_loss_fn(cfg, policy, prefetch=prefetch)
        step_fn = zj.make_train_step(loss, tx, policy, gather="all" if kind == "all" else "manual",
                                     accum_steps=ACCUM.get(variant, 1))  # fmt: skip
    batch = jax.device_put(synthetic_batch(cfg, GLOBAL_BATCH, jax.random.key(1)), policy.batch_sharding())
    return step_fn, state, batch


def make_run(variant: str, depth: int, mesh: jax.sharding.Mesh) -> Run:
    stage, kind, prefetch = VARIANTS[variant]
    cfg = config(depth)
    step_fn, state, batch = build(variant, depth, mesh)
    compiled, spmd, live_peak = common.compile_once(step_fn, state, batch)
    text = compiled.as_text()
    counts = common.kind_counts(measure.parse_collectives(text, N))
    lw = kind in ("lw", "linen", "nnx")
    # Whole layers alive at once, from the compiled schedule (zj.audit's walk), for the layer-wise stage-3 runs.
    alive = zj.audit(step_fn, state, batch).layers.max_alive if stage == 3 and kind != "all" else None
    return Run(
        variant,
        depth,
        common.stepper(step_fn, state, batch),
        measure.memory(compiled),
        measure.ring_bytes(measure.parse_collectives(spmd, N)),
        counts,
        block_collectives(text, depth, weight_shapes(cfg, mesh)) if lw and variant not in ACCUM else None,
        schedule(text, depth) if lw and stage == 3 and prefetch else None,
        alive,
        live_peak,
    )


# -- report ------------------------------------------------------------------------------------------


def row_of(r: Run) -> dict[str, Any]:
    return {
        "variant": r.variant,
        "depth": r.depth,
        "memory_bytes": r.memory,
        "comm_bytes": r.comm,
        "compiled_counts": r.counts,
        "per_block_weight": r.per_block,
        "schedule": r.sched,
        "layers_alive": r.alive,
        "live_peak_bytes": r.live_peak,
        "step_ms_median": 1e3 * statistics.median(r.times),
        "step_ms_all": [1e3 * t for t in r.times],
        "final_loss": r.final_loss,
    }


def format_table(rows: list[dict[str, Any]], sizes: dict[int, Sizes]) -> str:
    head = (
        f"{'variant':<14} {'L':>2} | {'peak':>7} {'temp':>7} | {'comm':>7} {'/2Psi':>6} | {'AG':>4} {'RS':>4} "
        f"{'AR':>4} | {'AG/w':>5} {'RS/w':>5} | {'step ms':>7} {'/DP':>5}"
    )
    units = f"{'':>17}| {'MiB per device':<15} | {'MiB/dev/step':<14} | {'compiled':<14} | {'per block w':<11} |"
    lines = [units, head, "-" * len(head)]
    for d in sorted(sizes):
        two_psi = 2 * sizes[d].psi * (N - 1) / N
        dp = common.cell(rows, "DP", d)["step_ms_median"]
        for v in VARIANTS:
            r = common.cell(rows, v, d)
            m, cc, pb = r["memory_bytes"], r["compiled_counts"], r["per_block_weight"]
            agw = f"{min(g['all_gather_per_block'] for g in pb.values()):5.2f}" if pb else f"{'':>5}"
            rsw = f"{min(g['reduce_scatter_per_block'] for g in pb.values()):5.2f}" if pb else f"{'':>5}"
            lines.append(
                f"{v:<14} {d:>2} | {m['peak'] / MiB:7.1f} {m['temp'] / MiB:7.1f} | {r['comm_bytes'] / MiB:7.2f} "
                f"{r['comm_bytes'] / two_psi:6.3f} | {cc.get('all-gather', 0):>4} {cc.get('reduce-scatter', 0):>4} "
                f"{cc.get('all-reduce', 0):>4} | {agw} {rsw} | {r['step_ms_median']:7.1f} "
                f"{r['step_ms_median'] / dp:5.2f}"
            )
        lines.append("")
    return "\n".join(lines[:-1])


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def format_checks(rows: list[dict[str, Any]], sizes: dict[int, Sizes]) -> tuple[str, dict[str, Any]]:
    lo, hi = min(sizes), max(sizes)
    s = sizes[hi]
    peak = lambda v, d: common.cell(rows, v, d)["memory_bytes"]["peak"]  # noqa: E731
    temp = lambda v, d: common.cell(rows, v, d)["memory_bytes"]["temp"]  # noqa: E731
    out, res = ["Must-show checks (N = 8):"], {}

    added = hi - lo
    allow = added * (4 * s.per_block / N + s.carry) * 1.3
    for v in ("ZeRO-3/lw1", "ZeRO-3/lw0"):
        grow = peak(v, hi) - peak(v, lo)
        res[f"flat_{v}"] = {"growth": grow, "allowance": allow, "pass": grow <= allow}
        out.append(
            f"  {verdict(grow <= allow)} {v} peak flat in depth: L={lo} -> {hi} +{grow / MiB:.2f} MiB <= "
            f"{added} blocks x (4 x {s.per_block / MiB:.3f} MiB/{N} param+grad+Adam pieces + carry "
            f"{s.carry / MiB:.3f} MiB) x 1.3 = {allow / MiB:.2f} MiB ({grow / allow:.2f} of it)"
        )
    p3, p1 = peak("ZeRO-3/lw1", hi), peak("ZeRO-1", hi)
    res["stage3_vs_stage1"] = {"ratio": p3 / p1, "pass": p3 <= 0.5 * p1}
    out.append(
        f"  {verdict(p3 <= 0.5 * p1)} L={hi}: ZeRO-3/lw1 peak {p3 / MiB:.1f} MiB = {p3 / p1:.3f} x ZeRO-1's "
        f"{p1 / MiB:.1f} MiB (<= 0.5); ZeRO-3/all: {peak('ZeRO-3/all', hi) / p1:.3f} x"
    )
    need = 0.8 * s.psi * (N - 1) / N
    # Stage 2 against stage 1 running the same code: the layer-wise pair (both remat each block), and the
    # plain pair (neither does).
    for v, base in (("ZeRO-2/lw", "ZeRO-1/lw"), ("ZeRO-2", "ZeRO-1")):
        saved = peak(base, hi) - peak(v, hi)
        res[f"stage2_{v}"] = {"saved": saved, "required": need, "pass": saved >= need}
        out.append(
            f"  {verdict(saved >= need)} L={hi}: {v} peak {peak(v, hi) / MiB:.1f} MiB below {base}'s by "
            f"{saved / MiB:.2f} MiB >= 0.8 x Psi x (N-1)/N = {need / MiB:.2f} MiB (temp {temp(v, hi) / MiB:.1f} vs "
            f"{temp(base, hi) / MiB:.1f} MiB)"
        )
    a1, a2 = peak("ZeRO-1/acc2", hi), peak("ZeRO-2/lw/acc2", hi)
    res["stage2_accumulating"] = {"saved": a1 - a2, "required": need, "pass": a1 - a2 >= need}
    out.append(
        f"  {verdict(a1 - a2 >= need)} L={hi}, 2 microbatches (stage 1's default accumulates whole gradients): "
        f"ZeRO-2/lw/acc2 peak {a2 / MiB:.1f} MiB below ZeRO-1/acc2's {a1 / MiB:.1f} MiB by {(a1 - a2) / MiB:.2f} MiB "
        f">= {need / MiB:.2f} MiB"
    )
    for v in ("linen/lw1", "nnx/lw1"):
        grow = peak(v, hi) - peak(v, lo)
        res[f"flat_{v}"] = {"growth": grow, "allowance": allow, "pass": grow <= allow}
        out.append(
            f"  {verdict(grow <= allow)} {v} (adapter, layers='auto', the model unchanged) peak flat in depth: "
            f"L={lo} -> {hi} +{grow / MiB:.2f} MiB <= {allow / MiB:.2f} MiB; at L={hi} {peak(v, hi) / MiB:.1f} MiB "
            f"vs ZeRO-3/lw1 {peak('ZeRO-3/lw1', hi) / MiB:.1f} MiB"
        )
    for a, b in (("ZeRO-3/lw1", "ZeRO-3/lw0"), ("scan/pf1", "scan/pf0")):
        alive = {
            d: (common.cell(rows, a, d)["layers_alive"], common.cell(rows, b, d)["layers_alive"]) for d in sorted(sizes)
        }
        ok = all(x - y <= 1 and x <= 2 for x, y in alive.values())
        res[f"prefetch_alive_{a}"] = {"layers_alive": alive, "pass": ok}
        out.append(
            f"  {verdict(ok)} prefetch=1 over prefetch=0 ({a} - {b}), whole layers alive at once in the compiled "
            "schedule (zj.audit): " + ", ".join(f"L={d}: {x:g} vs {y:g}" for d, (x, y) in alive.items())
        )
    for a, b in (("ZeRO-3/lw1", "ZeRO-3/lw0"), ("scan/pf1", "scan/pf0")):
        costs = {d: (peak(a, d) - peak(b, d)) / sizes[d].per_block for d in sorted(sizes)}
        ok = all(c <= 1.0 for c in costs.values())
        res[f"prefetch_{a}"] = {"layers": costs, "pass": ok}
        out.append(
            f"  {verdict(ok)} prefetch=1 over prefetch=0 ({a} - {b}), compiled peak (memory_analysis: XLA's "
            f"allocation, packing included) <= 1 whole layer ({s.per_block / MiB:.3f} MiB): "
            + ", ".join(f"L={d}: {c:.2f}" for d, c in costs.items())
        )
        live = {d: (common.cell(rows, a, d)["live_peak_bytes"] - common.cell(rows, b, d)["live_peak_bytes"])
                / sizes[d].per_block for d in sorted(sizes)}  # fmt: skip
        ok = all(c <= 1.0 for c in live.values())
        res[f"prefetch_live_{a}"] = {"layers": live, "pass": ok}
        out.append(
            f"  {verdict(ok)} prefetch=1 over prefetch=0 ({a} - {b}), XLA's live peak (HloLiveRange: bytes alive "
            f"at once, before heap packing) <= 1 whole layer: " + ", ".join(f"L={d}: {c:.2f}" for d, c in live.items())
        )
    for d in sorted(sizes):
        pb = common.cell(rows, "ZeRO-3/lw1", d)["per_block_weight"]
        ok = all(g["all_gather_per_block"] == 2 and g["reduce_scatter_per_block"] == 1 for g in pb.values())
        res.setdefault("per_block_collectives", {})[d] = {"weights": pb, "pass": ok}
        out.append(
            f"  {verdict(ok)} L={d}: compiled HLO, ZeRO-3/lw1, per block weight (AG/RS, expect 2/1): "
            + "; ".join(
                f"{k} {g['all_gather_per_block']:.2f}/{g['reduce_scatter_per_block']:.2f}" for k, g in pb.items()
            )
        )
    for d in sorted(sizes):
        lw, al = (common.cell(rows, v, d) for v in ("ZeRO-3/lw1", "ZeRO-3/all"))
        ratio = lw["step_ms_median"] / al["step_ms_median"]
        best = min(lw["step_ms_all"]) / min(al["step_ms_all"])
        res.setdefault("step_time", {})[d] = {"ratio": ratio, "ratio_min": best, "pass": ratio <= 1.35}
        out.append(
            f"  {verdict(ratio <= 1.35)} L={d}: step ZeRO-3/lw1 {lw['step_ms_median']:.1f} ms / ZeRO-3/all "
            f"{al['step_ms_median']:.1f} ms = {ratio:.2f} <= 1.35 (fastest steps: {best:.2f})"
        )
    return "\n".join(out), res


def format_schedule(rows: list[dict[str, Any]], sizes: dict[int, Sizes]) -> tuple[str, bool]:
    d = max(sizes)
    sched = common.cell(rows, "ZeRO-3/lw1", d)["schedule"] or []
    before = sum(r["next_gather_first"] < r["compute_first"] for r in sched)
    during = sum(r["next_gather_first"] < r["compute_last"] for r in sched)
    ok = bool(sched) and during == len(sched)
    out = [
        f"Schedule, ZeRO-3/lw1 at L={d} (positions in the scheduled entry computation of compiled.as_text(); "
        "forward ops only):",
        f"  {verdict(ok)} block i+1's first zj_block<i+1>_gather op precedes block i's last zj_block<i>_compute "
        f"op for {during}/{len(sched)} blocks; precedes block i's first compute op for {before}/{len(sched)}",
    ]
    for r in sched[:4] + sched[-2:]:
        out.append(
            f"    block {r['block']:>2}: zj_block{r['block'] + 1}_gather first at {r['next_gather_first']:>5}; "
            f"zj_block{r['block']}_compute {r['compute_first']:>5} .. {r['compute_last']:>5}"
        )
    return "\n".join(out), ok


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = common.pyplot()
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, v in enumerate(VARIANTS):
        style = "--" if v.startswith("scan") else "-"
        axes[0].plot(depths, [common.cell(rows, v, d)["memory_bytes"]["peak"] / MiB for d in depths], "o" + style,
                     color=f"C{i}", label=v)  # fmt: skip
        axes[1].plot(
            depths, [common.cell(rows, v, d)["step_ms_median"] for d in depths], "o" + style, color=f"C{i}", label=v
        )
    axes[0].set(title=f"compiled peak per device (N={N}, unscanned, Adam fp32)", xlabel="depth", ylabel="MiB")
    axes[1].set(title="step time, median", xlabel="depth", ylabel="ms")
    for ax in axes:
        ax.set_xticks(depths)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    common.save_figure(fig, path)


def fragmentation(depths: tuple[int, ...], out_dir: str | None) -> None:
    """Issue 28's M_D on every variant: zj.audit's fragmentation line (allocated against XLA's live peak)."""
    record = common.Record()
    mesh = jax.make_mesh((N,), ("data",))
    lines, rows = [], []
    for d in depths:
        for v in VARIANTS:
            f = zj.audit(*build(v, d, mesh), grads=False).fragmentation
            assert f is not None, "the audit read no live-range dump"
            rows.append({"variant": v, "depth": d, "allocated": f.allocated, "live_peak": f.live_peak,
                         "ratio": f.ratio, "fragmented": f.fragmented})  # fmt: skip
            lines += [f"{v:<15} L={d:<3} {f.lines()[0]}", *f.lines()[1:]]
        print(f"L={d} done ({record.wall_s():.0f} s)", file=sys.stderr)
    header = record.header(
        "The audit's fragmentation line on benchmarks/unscanned.py's variants (ZeRO-R's M_D)",
        f"devices: {jax.device_count()} simulated {jax.devices()[0].platform} devices, mesh ('data',) = {N}",
        f"model: transformer {MODEL}, fp32, a Python list of blocks, global batch {GLOBAL_BATCH}; "
        "zj.audit(step, state, batch).fragmentation per variant",
    )
    worst = max(rows, key=lambda r: r["ratio"])
    summary = (f"largest allocated / live peak: {worst['ratio']:.3f} ({worst['variant']}, L={worst['depth']}); "
               f"{sum(r['fragmented'] for r in rows)} of {len(rows)} compiles over the audit's 10% slack")  # fmt: skip
    text = "\n\n".join([header, "\n".join(lines), summary])
    print(text)
    if out_dir:
        common.write_results("unscanned_fragmentation", text, {"meta": record.meta(), "rows": rows}, out_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--fragmentation", action="store_true",
        help="only the audit's fragmentation line per variant (results/unscanned_fragmentation.txt)",
    )  # fmt: skip
    ap.add_argument("--depths", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed rounds (default 3, --quick 2)")
    ap.add_argument("--quick", action="store_true", help=f"depths {QUICK_DEPTHS}, 2 rounds, no files unless --out")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    depths = args.depths or (QUICK_DEPTHS if args.quick else DEPTHS)
    steps = args.steps or (2 if args.quick else 3)
    out_dir = args.out or (None if args.quick else common.RESULTS)
    if args.fragmentation:
        fragmentation(tuple(args.depths or QUICK_DEPTHS), args.out or common.RESULTS)
        return

    record = common.Record()
    mesh = jax.make_mesh((N,), ("data",))
    sizes, rows = {}, []
    for d in depths:
        sizes[d] = sizes_for(d, mesh)
        group = [make_run(v, d, mesh) for v in VARIANTS]
        common.time_round_robin(group, steps, 1)
        rows += [row_of(r) for r in group]
        del group
        print(f"L={d} done ({record.wall_s():.0f} s)", file=sys.stderr)

    checks, results = format_checks(rows, sizes)
    sched_text, sched_ok = format_schedule(rows, sizes)
    results["schedule_prefetch1"] = sched_ok
    s = sizes[max(sizes)]
    header = record.header(
        "Layer-wise ZeRO on an unscanned transformer (benchmarks/unscanned.py)",
        f"devices: {jax.device_count()} simulated {jax.devices()[0].platform} devices, mesh ('data',) = {N}",
        f"model: transformer {MODEL}, fp32, a Python list of blocks, optax.adam({LEARNING_RATE}), global batch "
        f"{GLOBAL_BATCH}; one block {s.per_block / MiB:.3f} MiB, Psi {s.psi / MiB:.2f} MiB at L={max(sizes)}; "
        f"step time: median of {steps} rounds after 1 warm-up, variants taking turns",
    )
    temp1, temp2, temp1lw, temp2lw = (
        common.cell(rows, v, max(sizes))["memory_bytes"]["temp"] for v in ("ZeRO-1", "ZeRO-2", "ZeRO-1/lw", "ZeRO-2/lw")
    )
    notes = "\n".join([
        "Notes:",
        "  peak = argument + output + temp - alias (memory_analysis, per device); comm: post-SPMD ring bytes per "
        "device per step (/2Psi: over 2 Psi (N-1)/N, DP's all-reduce; ZeRO-3 theory is 1.5); AG/RS/AR: compiled "
        "collective counts; AG/w, RS/w: the fewest all-gathers / reduce-scatters per block weight (attn_qkv, "
        "attn_out, mlp_in, mlp_out) among the ops named zj_block<i>_gather / zj_block<i>_reduce.",
        "  DP, ZeRO-1, ZeRO-2, ZeRO-3/all run the plain loop without remat (gather='all'); the layer-wise "
        "variants recompute each block in the backward pass (the price of gather-and-discard).",
        f"  Stage 2 vs stage 1 at L={max(sizes)}: layer-wise (the same apply_layers code, every block "
        f"rematerialised) temp {temp2lw / MiB:.2f} vs {temp1lw / MiB:.2f} MiB: stage 1 keeps each block's whole "
        "gradient until its reduce-scatter after the backward pass, stage 2 reduce-scatters it inside the block's "
        "backward pass, tied before the block below runs. Plain loop (gather='all', no remat): "
        f"{temp2 / MiB:.2f} vs {temp1 / MiB:.2f} MiB: both reduce-scatter each gradient leaf as autodiff makes it "
        "and XLA:CPU frees each whole stage-1 gradient right after, so that pair holds the same bytes. With 2 "
        "microbatches stage 1 (its default, local accumulation) sums whole float32 gradients, stage 2 pieces (the "
        "acc2 rows; their extra reduce-scatter per microbatch is the documented price of partitioned "
        "accumulation).",
        "  Prefetch: the whole layers alive at once come from the compiled schedule (zj.audit's walk of the "
        "scheduled HLO, from each block's all-gather to its last use): prefetch=1 holds one more whole layer in "
        "the forward pass. In the backward pass the next layer's re-gather goes leaf by leaf: the half it uses "
        "first when this layer's backward starts, each later leaf once as many bytes of this layer's gradients "
        "are reduce-scattered (paired_anchors in zero_jax/_layerwise/scan.py), so the two layers' whole leaves "
        "stay about one layer. scan_layers writes its outputs into one in-place buffer (stacking them and "
        "concatenating the last layers' was one more copy of all of them) and ties each backward recompute to its "
        "cotangent. memory_analysis's figure is XLA's allocation, packed; HloLiveRange's live peak is the values "
        "alive at once before packing.",
    ])  # fmt: skip
    text = "\n\n".join([header, format_table(rows, sizes), checks, sched_text, notes])
    print(text)
    if out_dir:
        meta = record.meta() | {"model": MODEL, "sizes": {d: dataclasses.asdict(v) for d, v in sizes.items()}}
        common.write_results("unscanned", text, {"meta": meta, "rows": rows, "checks": results}, out_dir)
        plot(rows, os.path.join(out_dir, "unscanned.png"))


if __name__ == "__main__":
    main()
