"""Layer-wise ZeRO-3 (``zj.scan_layers``) against depth: memory, communication, schedule and time.

Run: ``python benchmarks/layerwise.py`` (8 simulated CPU devices in one process; a few minutes on
2 cores). It prints one table, the targets and notes, and writes them with the command and the
machine to ``benchmarks/results/layerwise.txt``, the raw numbers to ``layerwise.json`` and a plot
(peak memory against depth, one line per variant) to ``layerwise.png``.

The model is the reference transformer (``zero_jax.models``: vocab 256, dim 256, 4 heads, seq 64,
MLP 1024, fp32) with depth L in {2, 4, 8, 12, 16}, trained with Adam on a global batch of 16
sequences (2 per device) over a mesh of N = 8 devices. The embeddings are a small share of the
parameters (under 1% at L = 12), so the per-layer schedule dominates what is measured. Variants:

* ``DP``: plain data parallelism, zero_jax stage 0 (``gather="manual"``: in stage 0 ``scan_layers``
  is a plain ``lax.scan`` with ``jax.checkpoint`` per layer, the same forward/backward as GSPMD's).
* ``GSPMD-3``: the GSPMD recipe's ZeRO-3, what users write by hand today: plain ``optax.adam``
  inside ``jax.jit`` whose ``in_shardings``/``out_shardings`` place every parameter and Adam leaf
  sharded over "data" on a dimension that divides 8 (never the layer axis of stacked leaves; a leaf
  with no such dimension stays replicated), the batch sharded on "data", the model run with
  ``make_loss_fn(cfg)`` (``lax.scan`` over layers, ``jax.checkpoint`` per layer) and ``jit``
  choosing the collectives. The state is donated.
* ``ZeRO-1``, ``ZeRO-2``, ``ZeRO-3``: zero_jax stages 1-3 with ``gather="manual"``, the model run
  with ``make_loss_fn(cfg, policy)`` and ``ZeroPolicy(..., stacked="layers")``.

Measured for each variant and depth:

* **Peak per device**: ``compiled.memory_analysis()``, argument + output + temp - alias (the CPU
  backend's ``peak_memory_in_bytes`` leaves out temp), and temp on its own.
* **Communication**: the collectives of the program right after SPMD partitioning (dtypes still
  the logical ones), each counted as a ring moves it, per device per step, multiplied by the trip
  count of the loop it sits in (``zero_jax.measure``). The theory is 2Ψ(N-1)/N for DP and stages 1-2 and
  3Ψ(N-1)/N for ZeRO-3 (Ψ = parameter bytes, padded). The ``accounted`` expectation for stage 3
  counts what the theory rounds away: leaves kept whole (all-reduced: 2 passes instead of 3) and
  leaves whose backward pass does not need the value, which are gathered once (the embedding
  tables, whose lookup's gradient is a scatter-add of the cotangent, and each block's last bias).
* **Compiled collectives**: all-gather / reduce-scatter / all-reduce counts in
  ``compiled.as_text()`` (after every XLA pass; loops multiplied by trip counts). For stage 3 each
  collective is attributed to ``scan_layers`` or not through the HLO's stack frames, so the count
  per stacked leaf and layer can be checked: 2 all-gathers (forward, backward re-gather) and 1
  reduce-scatter.
* **Step time**: ``state, metrics = step(state, batch)`` (state donated; the GSPMD recipe's
  ``jitted(params, opt_state, batch)``), reusing the executable measured above. After one warm-up
  step, the variants of one depth take turns, one step each, for ``--steps`` rounds; the median is
  reported. Taking turns makes the ratios robust to other work on the machine.
"""

from __future__ import annotations

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

# Every compilation of the process dumps the HLO this benchmark reads.
common.setup(devices=8, hlo_dump=True)

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch  # noqa: E402

PyTree = Any

N = 8
DEPTHS = (2, 4, 8, 12, 16)
HEADLINE_DEPTH = 12  # the depth at which the peak ratios are judged
FLAT_FROM, FLAT_TO = 4, 16  # the depth interval over which stage 3's peak must stay flat
MODEL = {"vocab": 256, "dim": 256, "heads": 4, "seq": 64}
GLOBAL_BATCH = 16
LEARNING_RATE = 1e-3
STACKED = "layers"
# Leaves the backward pass never needs the value of, so a ZeRO-3 step gathers them once instead of
# twice: the embedding lookup's gradient is a scatter-add of the cotangent (the table is not read),
# and a block's last bias is added after everything the block's VJP saves (the recompute of the
# block in the backward pass does not reach it, so XLA drops its re-gather as dead code).
GATHERED_ONCE = ("embed/tokens", "embed/positions", "layers/mlp_out_bias")
VARIANTS = ("DP", "GSPMD-3", "ZeRO-1", "ZeRO-2", "ZeRO-3")
STAGE = {"DP": 0, "GSPMD-3": 3, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}
MiB = 2**20


def optimizer() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


def config(depth: int) -> TransformerConfig:
    return TransformerConfig(depth=depth, **MODEL)


def path_name(path: Any) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


# -- sizes and formulas -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Byte counts of one depth's parameters under the N = 8 layouts (padding included)."""

    depth: int
    psi: int  # Ψ: all parameter bytes as stored (partitioned leaves padded)
    partitioned: int  # P: bytes of the partitioned leaves
    replicated: int  # R: bytes of the leaves kept whole on every device
    gathered_once: int  # bytes of the partitioned leaves a stage-3 step gathers once (GATHERED_ONCE)
    embeddings: int  # the token and position tables
    per_layer: int  # one layer of the stacked subtree
    carry: int  # one layer's saved input activation per device: local batch x seq x dim x 4 bytes
    layouts: dict[str, zj.LeafLayout]

    @property
    def ring(self) -> float:
        return (N - 1) / N

    def comm_theory(self, stage: int) -> float:
        return (3 if stage == 3 else 2) * self.psi * self.ring

    def comm_accounted(self) -> float:
        """Stage 3's expectation: leaves kept whole are all-reduced (2 passes), leaves in
        GATHERED_ONCE pass twice (gather, reduce-scatter), every other partitioned leaf three times."""
        return (3 * self.partitioned - self.gathered_once + 2 * self.replicated) * self.ring


def sizes_for(depth: int, mesh: Mesh) -> Sizes:
    cfg = config(depth)
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    layouts = zj.ZeroPolicy(3, mesh, stacked=STACKED).layouts(abstract)
    flat = {path_name(p): lay for p, lay in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=_is_layout)[0]}
    part = sum(lay.nbytes for lay in flat.values() if lay.partitioned)
    repl = sum(lay.nbytes for lay in flat.values() if not lay.partitioned)
    once = sum(flat[k].nbytes for k in GATHERED_ONCE if flat[k].partitioned)
    layer = sum(lay.nbytes for k, lay in flat.items() if k.startswith(STACKED + "/")) // depth
    return Sizes(
        depth=depth,
        psi=part + repl,
        partitioned=part,
        replicated=repl,
        gathered_once=once,
        embeddings=flat["embed/tokens"].nbytes + flat["embed/positions"].nbytes,
        per_layer=layer,
        carry=GLOBAL_BATCH // N * cfg.seq * cfg.dim * 4,
        layouts=flat,
    )


def _is_layout(x: Any) -> bool:
    return isinstance(x, zj.LeafLayout)


# -- reading the compiled program -------------------------------------------------------------------


def _section(hlo: str, name: str) -> str:
    m = re.search(rf"^{name}\n(.*?)(?:\n\s*\n|\Z)", hlo, re.S | re.M)
    return m.group(1) if m else ""


def from_scan_layers(hlo: str) -> set[str]:
    """Names of the collectives that ``zj.scan_layers`` emitted, read from the HLO's stack frames.

    Each instruction's metadata names a stack frame; frames chain to their callers (the printed
    ``parent_frame_id`` is one more than the parent's id). A collective belongs to the layer loop
    when a frame of ``_zero_scan`` / ``scan_layers`` lies between it and the train step. This is
    what tells the stacked ``attn_out`` (256, 256) apart from the token table and the head, which
    have the same shape.
    """
    functions = dict(re.findall(r'^(\d+) "(.*)"$', _section(hlo, "FunctionNames"), re.M))
    locations = dict(
        re.findall(r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+)", _section(hlo, "FileLocations"), re.M)
    )
    frames = {
        int(a): (b, int(c))
        for a, b, c in re.findall(
            r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", _section(hlo, "StackFrames"), re.M
        )
    }
    out = set()
    for m in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?stack_frame_id=(\d+)", hlo, re.M):
        frame, seen = int(m.group(2)), 0
        while frame in frames and seen < 16:
            loc, parent = frames[frame]
            fn = functions.get(locations.get(loc, ""), "")
            if fn.startswith("TrainStep"):
                break
            if fn.startswith("_zero_scan") or fn == "scan_layers":
                out.add(m.group(1))
                break
            frame, seen = parent - 1, seen + 1
    return out


def stacked_schedule(hlo: str, sizes: Sizes) -> dict[str, dict[str, Any]]:
    """Per group of stacked leaves sharing a shape: all-gathers and reduce-scatters per layer and
    leaf that ``scan_layers`` left in the compiled program (trip counts included)."""
    colls = measure.parse_collectives(hlo, N)
    ours = from_scan_layers(hlo)
    counts: collections.Counter[tuple[str, tuple[int, ...]]] = collections.Counter()
    for c in colls:
        if c.name in ours:
            counts[(c.kind, c.shape)] += c.trips
    groups: dict[tuple[int, ...], list[str]] = collections.defaultdict(list)
    pieces: dict[tuple[int, ...], tuple[int, ...]] = {}
    for name, lay in sizes.layouts.items():
        if name.startswith(STACKED + "/") and lay.partitioned:
            whole = lay.stored_shape[1:]  # one layer, padded: what the all-gather produces
            piece = list(whole)
            piece[lay.dim - 1] //= N  # type: ignore[operator]
            groups[whole].append(name.split("/", 1)[1])
            pieces[whole] = tuple(piece)
    out = {}
    for whole, names in groups.items():
        per = len(names) * sizes.depth
        out[",".join(names)] = {
            "shape": list(whole),
            "all_gather_per_layer": counts[("all-gather", whole)] / per,
            "reduce_scatter_per_layer": counts[("reduce-scatter", pieces[whole])] / per,
        }
    return out


# -- the variants ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One (variant, depth) cell: its measurements and a ``step`` that takes one training step."""

    variant: str
    depth: int
    step: Callable[[], Any]
    memory: dict[str, int]
    spmd: list[measure.Collective]
    compiled: list[measure.Collective]
    schedule: dict[str, dict[str, Any]] | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    final_loss: float = float("nan")


def zero_run(variant: str, depth: int, mesh: Mesh, sizes: Sizes) -> Run:
    cfg = config(depth)
    policy = zj.ZeroPolicy(STAGE[variant], mesh, stacked=STACKED)
    tx = zj.shard_optimizer(optimizer(), policy)
    # A zero-argument function: the state is created in pieces inside jit, never whole.
    state = zj.init_state(lambda: init_params(cfg, jax.random.key(0)), tx, policy)
    batch = jax.device_put(synthetic_batch(cfg, GLOBAL_BATCH, jax.random.key(1)), policy.batch_sharding())
    train_step = zj.make_train_step(make_loss_fn(cfg, policy), tx, policy, gather="manual")
    compiled, spmd_hlo, _ = common.compile_once(train_step, state, batch)
    final_hlo = compiled.as_text()
    return Run(
        variant,
        depth,
        common.stepper(train_step, state, batch),
        measure.memory(compiled),
        measure.parse_collectives(spmd_hlo, N),
        measure.parse_collectives(final_hlo, N),
        stacked_schedule(final_hlo, sizes) if STAGE[variant] == 3 else None,
    )


def zero3_peak(depth: int, mesh: Mesh, prefetch: int) -> dict[str, int]:
    """Compile-only memory of ZeRO-3 with another ``prefetch`` (the table's ZeRO-3 uses the default 1)."""
    cfg = config(depth)
    policy = zj.ZeroPolicy(3, mesh, stacked=STACKED)
    tx = zj.shard_optimizer(optimizer(), policy)
    state = zj.init_state(lambda: init_params(cfg, jax.random.key(0)), tx, policy)
    batch = jax.device_put(synthetic_batch(cfg, GLOBAL_BATCH, jax.random.key(1)), policy.batch_sharding())
    train_step = zj.make_train_step(make_loss_fn(cfg, policy, prefetch=prefetch), tx, policy, gather="manual")
    return measure.memory(train_step.lower(state, batch).compile())


def gspmd_spec(path: Any, leaf: Any) -> PartitionSpec:
    """The recipe's rule: the largest dimension that divides N, never a stacked leaf's layer axis."""
    stacked = path_name(path).startswith(STACKED + "/")
    dims = [d for d in range(len(leaf.shape)) if not (stacked and d == 0) and leaf.shape[d] % N == 0]
    if not dims:
        return PartitionSpec()
    best = max(dims, key=lambda d: (leaf.shape[d], -d))
    return PartitionSpec(*([None] * best), "data")


def gspmd_run(depth: int, mesh: Mesh) -> Run:
    """The hand-written recipe: NamedShardings in and out, ``jit`` decides the collectives."""
    cfg = config(depth)
    mesh = Mesh(mesh.devices, ("data",), axis_types=(AxisType.Auto,))  # what the hand-written recipe uses
    tx = optimizer()
    loss_fn = make_loss_fn(cfg)  # policy None: lax.scan over layers, jax.checkpoint per layer

    def make() -> PyTree:
        return init_params(cfg, jax.random.key(0))

    abstract = jax.eval_shape(make)
    param_sh = jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, gspmd_spec(p, x)), abstract)
    # Adam's mu and nu mirror the parameters; everything else (the step count) is replicated.
    recipe = common.gspmd_recipe(loss_fn, tx, mesh, abstract, param_sh, param_sh)
    params = jax.jit(make, out_shardings=param_sh)()
    opt_state = jax.jit(tx.init, out_shardings=recipe.opt_sharding)(params)
    batch = jax.device_put(synthetic_batch(cfg, GLOBAL_BATCH, jax.random.key(1)), recipe.batch_sharding)
    compiled, spmd_hlo, _ = common.compile_once(recipe.jitted, params, opt_state, batch)
    return Run(
        "GSPMD-3",
        depth,
        common.stepper(recipe, (params, opt_state), batch),
        measure.memory(compiled),
        measure.parse_collectives(spmd_hlo, N),
        measure.parse_collectives(compiled.as_text(), N),
    )


# -- report ------------------------------------------------------------------------------------------


def build_rows(runs: list[Run], sizes: dict[int, Sizes]) -> list[dict[str, Any]]:
    rows = []
    for r in runs:
        s = sizes[r.depth]
        stage = STAGE[r.variant]
        comm = measure.ring_bytes(r.spmd)
        row: dict[str, Any] = {
            "variant": r.variant,
            "depth": r.depth,
            "stage": stage,
            "memory_bytes": r.memory,
            "comm_bytes": comm,
            "comm_theory_bytes": s.comm_theory(stage),
            "comm_by_kind": measure.summarize(r.spmd),
            "compiled_counts": common.kind_counts(r.compiled),
            "compiled_comm_bytes": measure.ring_bytes(r.compiled),
            "step_ms_median": 1e3 * statistics.median(r.times),
            "step_ms_all": [1e3 * t for t in r.times],
            "final_loss": r.final_loss,
        }
        if r.variant == "ZeRO-3":
            row["comm_accounted_bytes"] = s.comm_accounted()
            row["stacked_schedule"] = r.schedule
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'variant':<8} {'L':>2} | {'peak':>7} {'temp':>7} | {'comm':>7} {'/theory':>7} {'/acct':>6} | "
        f"{'AG':>4} {'RS':>4} {'AR':>4} {'A2A':>4} | {'step ms':>7} {'/DP':>5} {'/GSPMD':>6}"
    )
    units = f"{'':>11}| {'MiB per device':<15} | {'MiB/device/step':<22} | {'compiled HLO':<19} |"
    lines = [units, head, "-" * len(head)]
    for depth in sorted({r["depth"] for r in rows}):
        for v in VARIANTS:
            r = common.cell(rows, v, depth)
            m = r["memory_bytes"]
            cc = r["compiled_counts"]
            acct = f"{r['comm_bytes'] / r['comm_accounted_bytes']:6.3f}" if "comm_accounted_bytes" in r else f"{'':>6}"
            dp = common.cell(rows, "DP", depth)["step_ms_median"]
            gs = common.cell(rows, "GSPMD-3", depth)["step_ms_median"]
            vs_g = f"{r['step_ms_median'] / gs:6.2f}" if v == "ZeRO-3" else f"{'':>6}"
            lines.append(
                f"{v:<8} {depth:>2} | {m['peak'] / MiB:7.1f} {m['temp'] / MiB:7.1f} | {r['comm_bytes'] / MiB:7.2f} "
                f"{r['comm_bytes'] / r['comm_theory_bytes']:7.3f} {acct} | {cc.get('all-gather', 0):>4} "
                f"{cc.get('reduce-scatter', 0):>4} {cc.get('all-reduce', 0):>4} {cc.get('all-to-all', 0):>4} | "
                f"{r['step_ms_median']:7.1f} "
                f"{r['step_ms_median'] / dp:5.2f} {vs_g}"
            )
        lines.append("")
    return "\n".join(lines[:-1])


def met(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def schedule_ok(sched: dict[str, dict[str, Any]]) -> bool:
    """Every stacked weight matrix (attn_qkv, attn_out, mlp_in, mlp_out): 2 all-gathers (forward and
    backward re-gather) and 1 reduce-scatter per layer in the compiled program."""
    return all(
        g["all_gather_per_layer"] == 2 and g["reduce_scatter_per_layer"] == 1
        for g in sched.values()
        if len(g["shape"]) == 2
    )


def format_targets(rows: list[dict[str, Any]], sizes: dict[int, Sizes]) -> tuple[str, dict[str, Any]]:
    depths = sorted(sizes)
    out = ["Targets (N = 8):"]
    verdicts: dict[str, Any] = {}

    # 1. Stage 3's peak grows only by the added layers' 1/N share of state plus their saved carry.
    if FLAT_FROM in sizes and FLAT_TO in sizes:
        s = sizes[FLAT_TO]
        added = FLAT_TO - FLAT_FROM
        allowance = added * (s.per_layer / N * 3 + s.carry)
        delta = (
            common.cell(rows, "ZeRO-3", FLAT_TO)["memory_bytes"]["peak"]
            - common.cell(rows, "ZeRO-3", FLAT_FROM)["memory_bytes"]["peak"]
        )
        ok = delta <= allowance
        hi, lo = (common.cell(rows, "ZeRO-3", d)["memory_bytes"] for d in (FLAT_TO, FLAT_FROM))
        d_arg = hi["argument"] - lo["argument"]
        d_temp = hi["temp"] - lo["temp"]
        grad_piece = s.per_layer / N  # ZeRO-3 keeps each layer's gradient too, partitioned
        rest = d_temp / added - grad_piece - s.carry
        verdicts["stage3_flat"] = {
            "delta_bytes": delta,
            "allowance_bytes": allowance,
            "met": ok,
            "delta_argument_bytes": d_arg,
            "delta_temp_bytes": d_temp,
            "allowance_with_gradient_piece_bytes": allowance + added * grad_piece,
        }
        out.append(
            f"  1. ZeRO-3 peak flat in depth, L={FLAT_FROM} -> {FLAT_TO}: +{delta / MiB:.2f} MiB vs allowance "
            f"{allowance / MiB:.2f} MiB = {added} layers x ({s.per_layer / MiB:.3f} MiB/{N} x (1 param + 2 Adam) + "
            f"carry {s.carry / MiB:.3f} MiB) -> {met(ok)} (delta/allowance {delta / allowance:.3f})"
        )
        out.append(
            f"     split: argument +{d_arg / MiB:.2f} MiB (= 3 x {added} x layer/{N}: "
            f"{3 * added * grad_piece / MiB:.2f}), temp +{d_temp / MiB:.2f} MiB = {d_temp / added / MiB:.3f} MiB per "
            f"layer: its gradient piece (layer/{N} = {grad_piece / MiB:.3f}, not in the allowance) + carry "
            f"{s.carry / MiB:.3f} + {rest / MiB:.3f} other. With the gradient piece the allowance is "
            f"{(allowance + added * grad_piece) / MiB:.2f} MiB -> {met(delta <= allowance + added * grad_piece)}"
        )

    # 2. At the headline depth, stage 3 against DP and the GSPMD recipe.
    if HEADLINE_DEPTH in sizes:
        z3, dp, gs = (common.cell(rows, v, HEADLINE_DEPTH)["memory_bytes"]["peak"] for v in ("ZeRO-3", "DP", "GSPMD-3"))
        ok_dp, ok_gs = z3 <= 0.20 * dp, z3 <= 0.7 * gs
        verdicts["stage3_vs_dp_peak"] = {"ratio": z3 / dp, "met": ok_dp}
        verdicts["stage3_vs_gspmd_peak"] = {"ratio": z3 / gs, "met": ok_gs}
        out.append(
            f"  2. L={HEADLINE_DEPTH}: ZeRO-3 peak {z3 / MiB:.1f} MiB = {z3 / dp:.3f} x DP ({dp / MiB:.1f} MiB) -> "
            f"{met(ok_dp)} (<= 0.20); = {z3 / gs:.3f} x GSPMD-3 ({gs / MiB:.1f} MiB) -> {met(ok_gs)} (<= 0.7)"
        )
        s = sizes[HEADLINE_DEPTH]
        # What any ZeRO-3 step of this design must hold: params + Adam pieces (argument), the gradient
        # pieces, one gathered layer and that layer's whole gradient before it is reduce-scattered.
        floor = 4 * s.psi / N + 2 * s.per_layer
        verdicts["stage3_floor_bytes"] = floor
        out.append(
            f"     floor for any layer-wise ZeRO-3 here: 3Psi/N state + Psi/N gradient pieces + one whole layer + its "
            f"whole gradient = {floor / MiB:.1f} MiB = {floor / gs:.2f} x GSPMD-3"
        )

    # 3. Stage 2 never holds the whole-model gradient: its temp is below stage 1's by Ψ(N-1)/N.
    out.append("  3. ZeRO-2 temp below ZeRO-1 temp by >= gradient bytes x (N-1)/N (the whole gradient is never held):")
    s2 = []
    for d in depths:
        s = sizes[d]
        t1 = common.cell(rows, "ZeRO-1", d)["memory_bytes"]["temp"]
        t2 = common.cell(rows, "ZeRO-2", d)["memory_bytes"]["temp"]
        need = s.psi * s.ring
        short = need - (t1 - t2)
        ok = t1 - t2 >= need
        # A direct bound too: a temp smaller than Psi cannot hold the whole-model gradient.
        below = t2 < s.psi
        s2.append({"depth": d, "difference_bytes": t1 - t2, "required_bytes": need, "met": ok, "temp_below_psi": below})
        out.append(
            f"     L={d:>2}: {t1 / MiB:6.1f} - {t2 / MiB:5.1f} = {(t1 - t2) / MiB:6.2f} MiB vs required "
            f"{need / MiB:6.2f} MiB -> {met(ok)}"
            + ("" if ok else f" (short by {short / MiB:.2f} MiB = {short / s.per_layer:.2f} x one layer's gradient)")
            + f"; ZeRO-2 temp {'<' if below else '>='} Psi {s.psi / MiB:.1f} MiB"
        )
    verdicts["stage2_temp"] = s2

    # 4. Stage 3 communication on the post-SPMD program.
    ratios = [common.cell(rows, "ZeRO-3", d)["comm_bytes"] / sizes[d].comm_theory(3) for d in depths]
    accts = [common.cell(rows, "ZeRO-3", d)["comm_bytes"] / sizes[d].comm_accounted() for d in depths]
    ok = all(abs(x - 1) <= 0.02 for x in ratios)
    verdicts["stage3_comm"] = {"ratio_theory": ratios, "ratio_accounted": accts, "met": ok}
    out.append(
        "  4. ZeRO-3 comm (post-SPMD) / 3Psi(N-1)/N: "
        + ", ".join(f"L={d}: {x:.4f}" for d, x in zip(depths, ratios, strict=True))
        + f" -> {met(ok)} (1 +- 0.02); / accounted: "
        + ", ".join(f"{x:.4f}" for x in accts)
    )

    # 5. The compiled program keeps the backward re-gather: per stacked leaf and layer 2 AG + 1 RS.
    out.append(
        "  5. compiled HLO (after all XLA passes), ZeRO-3, collectives from scan_layers per stacked leaf and "
        "layer (AG/RS):"
    )
    by_depth = {}
    for d in depths:
        sched = common.cell(rows, "ZeRO-3", d)["stacked_schedule"]
        parts = [
            f"{names} {g['all_gather_per_layer']:.2f}/{g['reduce_scatter_per_layer']:.2f}" for names, g in sched.items()
        ]
        ok = schedule_ok(sched)
        by_depth[d] = ok
        out.append(f"     L={d:>2}: " + "; ".join(parts) + f" -> {met(ok)}")
    verdicts["stage3_compiled_regather"] = by_depth
    out.append(
        "     every stacked weight matrix 2.00/1.00: " + ", ".join(f"L={d} {met(ok)}" for d, ok in by_depth.items())
    )

    # 6. Step time.
    out.append(
        "  6. step time, ZeRO-3 / DP (<= 1.2) and ZeRO-3 / GSPMD-3 (<= 0.7), medians (ratios of the fastest steps, "
        "which load from elsewhere inflates least, in brackets):"
    )
    st = []
    for d in depths:
        z3, dp, gs = (common.cell(rows, v, d)["step_ms_median"] for v in ("ZeRO-3", "DP", "GSPMD-3"))
        z3m, dpm, gsm = (min(common.cell(rows, v, d)["step_ms_all"]) for v in ("ZeRO-3", "DP", "GSPMD-3"))
        ok_dp, ok_gs = z3 <= 1.2 * dp, z3 <= 0.7 * gs
        st.append(
            {
                "depth": d,
                "vs_dp": z3 / dp,
                "vs_gspmd": z3 / gs,
                "vs_dp_min": z3m / dpm,
                "vs_gspmd_min": z3m / gsm,
                "met_dp": ok_dp,
                "met_gspmd": ok_gs,
            }
        )
        out.append(
            f"     L={d:>2}: {z3:7.1f} ms / DP {dp:7.1f} = {z3 / dp:.2f} [{z3m / dpm:.2f}] -> {met(ok_dp)}; "
            f"/ GSPMD-3 {gs:7.1f} = {z3 / gs:.2f} [{z3m / gsm:.2f}] -> {met(ok_gs)}"
        )
    verdicts["step_time"] = st
    return "\n".join(out), verdicts


def format_notes(rows: list[dict[str, Any]], sizes: dict[int, Sizes], prefetch0: dict[str, int] | None) -> str:
    depths = sorted(sizes)
    d12 = HEADLINE_DEPTH if HEADLINE_DEPTH in sizes else max(sizes)
    s = sizes[d12]
    losses = [r["final_loss"] for r in rows if r["depth"] == d12]
    spread = (max(losses) - min(losses)) / abs(statistics.median(losses))
    repl = [k for k, lay in s.layouts.items() if not lay.partitioned]
    z3 = common.cell(rows, "ZeRO-3", d12)["memory_bytes"]
    out = [
        "Notes:",
        f"  Psi (fp32, padded) at L={d12}: {s.psi / MiB:.2f} MiB; one layer {s.per_layer / MiB:.3f} MiB; "
        f"embeddings (tokens + positions) {s.embeddings / MiB:.3f} MiB = {100 * s.embeddings / s.psi:.2f}% of Psi; "
        f"kept whole (< {zj.DEFAULT_MIN_SHARD_SIZE} elements): {', '.join(repl)} ({s.replicated} B).",
        "  peak = argument + output + temp - alias of compiled.memory_analysis(), per device. DP is zero_jax "
        "stage 0 (gather='manual': scan_layers is a plain lax.scan with jax.checkpoint per layer).",
        "  /acct (ZeRO-3): comm / (3P - gathered-once + 2R)(N-1)/N: leaves kept whole are all-reduced (2 passes); "
        f"{', '.join(GATHERED_ONCE)} are gathered once, not re-gathered (their backward pass needs no value).",
        "  AG/RS/AR/A2A: all-gather, reduce-scatter, all-reduce, all-to-all counts in compiled.as_text() with loop "
        "trip counts. ZeRO-3's schedule check attributes collectives to scan_layers through the HLO's stack "
        "frames; leaves sharing a shape are one group (counts per leaf and layer). The block's last bias "
        "(mlp_out_bias) has 1 all-gather per layer: the backward pass does not need it (see /acct). Outside the "
        "layer loop XLA:CPU merges the head's backward re-gather into its forward gather (CSE), so the head stays "
        "gathered from forward to backward.",
    ]
    small = min(depths)
    if not schedule_ok(common.cell(rows, "ZeRO-3", small)["stacked_schedule"]):
        r = common.cell(rows, "ZeRO-3", small)
        spmd_ag = int(r["comm_by_kind"].get("all-gather", {}).get("count", 0))
        t_next = [common.cell(rows, "ZeRO-3", d)["memory_bytes"]["temp"] for d in depths if d > small][:1]
        out.append(
            f"  ZeRO-3 at L={small}: {spmd_ag} all-gathers after SPMD partitioning, "
            f"{r['compiled_counts'].get('all-gather', 0)} compiled. With depth = prefetch + 1 the layer loops run "
            "once; XLA:CPU inlines them and CSE merges each backward re-gather into the forward gather (DESIGN.md), "
            f"so every layer stays gathered from forward to backward (temp {r['memory_bytes']['temp'] / MiB:.1f} MiB"
            + (f", vs {t_next[0] / MiB:.1f} MiB at the next depth" if t_next else "")
            + ")."
        )
    if FLAT_FROM in sizes and FLAT_TO in sizes:
        span = FLAT_TO - FLAT_FROM

        def per_layer(variant: str, kind: str) -> float:
            hi, lo = (common.cell(rows, variant, d)["compiled_counts"].get(kind, 0) for d in (FLAT_TO, FLAT_FROM))
            return (hi - lo) / span

        def temp_slope(variant: str) -> float:
            hi, lo = (common.cell(rows, variant, d)["memory_bytes"]["temp"] for d in (FLAT_TO, FLAT_FROM))
            return (hi - lo) / span / MiB

        g = common.cell(rows, "GSPMD-3", d12)
        out.append(
            f"  GSPMD-3 is layer-wise too: jit partitions the scan body, so each layer is gathered inside the loop "
            f"(compiled, per added layer: {per_layer('GSPMD-3', 'all-gather'):.0f} all-gathers, "
            f"{per_layer('GSPMD-3', 'all-to-all'):.0f} all-to-alls, {per_layer('GSPMD-3', 'all-reduce'):.0f} "
            f"all-reduces; ZeRO-3: {per_layer('ZeRO-3', 'all-gather'):.0f} all-gathers, "
            f"{per_layer('ZeRO-3', 'reduce-scatter'):.0f} reduce-scatters). Its temp grows "
            f"{temp_slope('GSPMD-3'):.3f} MiB per layer (ZeRO-3: {temp_slope('ZeRO-3'):.3f}). What it pays is "
            f"communication: each layer's full gradient is all-reduced and sliced (no reduce-scatter on CPU, "
            f"DESIGN.md), {g['comm_bytes'] / g['comm_theory_bytes']:.2f} x 3Psi(N-1)/N at L={d12}.",
        )
    short = {
        d: sizes[d].psi * sizes[d].ring
        - (
            common.cell(rows, "ZeRO-1", d)["memory_bytes"]["temp"]
            - common.cell(rows, "ZeRO-2", d)["memory_bytes"]["temp"]
        )
        for d in depths
    }
    if any(v > 0 for v in short.values()):
        out.append(
            "  ZeRO-2 vs ZeRO-1 temp falls short of Psi(N-1)/N by "
            + ", ".join(f"{v / MiB:.2f} MiB at L={d}" for d, v in short.items() if v > 0)
            + f": less than one layer's gradient ({s.per_layer / MiB:.2f} MiB), which ZeRO-2 materialises whole just "
            "before reduce-scattering it, and not growing with depth, so no whole-model gradient is kept. The two "
            "peaks fall at different points of the step, so their difference is not exactly the gradient."
        )
    if prefetch0 is not None:
        out.append(
            f"  ZeRO-3 with prefetch=0 (make_loss_fn(cfg, policy, prefetch=0)) at L={d12}, compile only: peak "
            f"{prefetch0['peak'] / MiB:.1f} MiB, temp {prefetch0['temp'] / MiB:.1f} MiB (prefetch=1: "
            f"{z3['peak'] / MiB:.1f}, {z3['temp'] / MiB:.1f}): the prefetched layer costs "
            f"{(z3['peak'] - prefetch0['peak']) / s.per_layer:.2f} layers."
        )
    out += [
        "  step time: step(state, batch) with donation, one warm-up step, the variants of one depth taking turns; "
        "on a shared 2-core machine the medians are noisy (see the load average above).",
        f"  loss after the same steps at L={d12}, relative spread over variants: {spread:.1e} (same math everywhere).",
    ]
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = common.pyplot()
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"DP": "o-", "GSPMD-3": "s-", "ZeRO-1": "^--", "ZeRO-2": "v--", "ZeRO-3": "D-"}
    for i, v in enumerate(VARIANTS):
        peak = [common.cell(rows, v, d)["memory_bytes"]["peak"] / MiB for d in depths]
        axes[0].plot(depths, peak, styles[v], color=f"C{i}", label=v)
        # GSPMD-3 and ZeRO-3 nearly overlap: print the last value of every line.
        axes[0].annotate(
            f"{peak[-1]:.1f}",
            (depths[-1], peak[-1]),
            textcoords="offset points",
            xytext=(6, -8 if v == "GSPMD-3" else 4),
            color=f"C{i}",
            fontsize=8,
        )
        ms = [common.cell(rows, v, d)["step_ms_median"] for d in depths]
        axes[1].plot(depths, ms, styles[v], color=f"C{i}", label=v)
    axes[0].set(title=f"compiled peak per device (N={N}, Adam fp32)", xlabel="depth L", ylabel="MiB", xticks=depths)
    axes[1].set(title="step time, median", xlabel="depth L", ylabel="ms", xticks=depths)
    axes[0].set_xlim(depths[0] - 0.5, depths[-1] + 2)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


# -- main ------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling")
    ap.add_argument("--out", default=common.RESULTS)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    record = common.Record()
    mesh = jax.make_mesh((N,), ("data",))
    sizes: dict[int, Sizes] = {}
    runs: list[Run] = []
    for depth in args.depths:
        sizes[depth] = sizes_for(depth, mesh)
        group = [gspmd_run(depth, mesh) if v == "GSPMD-3" else zero_run(v, depth, mesh, sizes[depth]) for v in VARIANTS]
        common.time_round_robin(group, args.steps, args.warmup)
        for r in group:
            r.step = lambda: None  # drop the state: the next depth needs the memory
        runs += group
        print(f"L={depth} done ({record.wall_s():.0f} s)", file=sys.stderr)

    prefetch0 = zero3_peak(HEADLINE_DEPTH, mesh, 0) if HEADLINE_DEPTH in sizes else None
    rows = build_rows(runs, sizes)
    targets, verdicts = format_targets(rows, sizes)
    header = record.header(
        "Layer-wise ZeRO-3 against depth (benchmarks/layerwise.py)",
        f"devices: {jax.device_count()} simulated {jax.devices()[0].platform} devices, mesh ('data',) = {N}",
        f"model: transformer {MODEL}, mlp 4 x dim, fp32, optax.adam({LEARNING_RATE}), global batch "
        f"{GLOBAL_BATCH} ({GLOBAL_BATCH // N} per device); step time: median of {args.steps} "
        f"(after {args.warmup} warm-up), variants of one depth taking turns",
    )
    text = "\n\n".join([header, format_table(rows), targets, format_notes(rows, sizes, prefetch0)])
    print(text)
    meta = record.meta() | {
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "n": N,
        "sizes": {
            d: {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name != "layouts"}
            for d, s in sizes.items()
        },
    }
    data = {"meta": meta, "rows": rows, "targets": verdicts, "zero3_prefetch0": prefetch0}
    common.write_results("layerwise", text, data, args.out)
    if not args.no_plot:
        plot(rows, os.path.join(args.out, "layerwise.png"))


if __name__ == "__main__":
    main()
