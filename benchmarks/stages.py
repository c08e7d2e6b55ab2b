"""ZeRO stages 0-3 against their formulas, their communication theory and a GSPMD recipe.

Run: ``python benchmarks/stages.py`` (8 simulated CPU devices in one process; about 2 minutes
on 2 cores). It prints one table and writes it, with the command and the machine, to
``benchmarks/results/stages.txt``, the numbers to ``stages.json`` and a plot to ``stages.png``.

The model is a 4-layer tanh MLP, 32 -> 1003 -> 1501 -> 1499 -> 10 (3.8M float32 parameters, Adam),
on a global batch of 64 rows. No hidden width divides 2, 4 or 8, so every large leaf is stored
padded; the biases of 1003 and 10 elements fall below ``min_shard_size=1024`` and stay whole on
every device (0.03% of the parameters). For every N in {2, 4, 8} devices and every stage:

* **State bytes per device.** Parameters and Adam state are summed over each device's
  ``addressable_shards`` of the live ``TrainState``; gradients over ``step.grads(state, batch)``,
  the mean gradient in the form the policy holds it. They are divided by the formula with
  padding (a partitioned category holds ``P/N + R`` bytes, where P is the padded bytes of the
  partitioned leaves and R the bytes of the leaves kept whole; a whole category holds the
  logical bytes; Adam holds two such copies plus its int32 step count) and by the pure ZeRO
  formula (4Φ, 4Φ, 8Φ bytes, each /N when partitioned). ``max/min`` compares devices.
* **Communication.** The collectives of the program right after SPMD partitioning (where the
  program states what it sends, before XLA:CPU rewrites or merges anything), each counted as a
  ring moves it, per device per step. The theory is 2Ψ(N-1)/N for stages 0-2 and 3Ψ(N-1)/N for
  stage 3, Ψ the logical parameter bytes. The ``accounted`` expectation counts what the theory
  rounds away: padding, leaves kept whole (all-reduced, never gathered), and the first layer's
  weight, which stage 3 does not re-gather in the backward pass because its gradient needs only
  the input data and the incoming cotangent.
* **Step time.** Every configuration of one N is compiled and warmed up (2 steps), then the
  configurations take turns, one step each, for 10 rounds; the median of each is reported.
  Taking turns makes the ratios robust to other work on the machine.
* **The GSPMD recipe**, what users write by hand today: plain ``optax.adam`` inside ``jax.jit``,
  parameters and optimizer state placed by ``NamedSharding``s given as ``in_shardings`` and
  ``out_shardings``, the batch sharded on "data", and ``jit`` choosing the collectives (stage 2
  adds a sharding constraint on the gradients). ``jit`` rejects shardings of dimensions that do
  not divide N, so the recipe pads its leaves by hand to the same layouts the library uses
  (``zj.leaf_layout``): both hold the same state, and only the step differs. Without padding the
  recipe could shard only dimensions that divide N; the notes give what that leaves per device.
"""

from __future__ import annotations

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

common.setup(devices=8)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax import measure  # noqa: E402

PyTree = Any

DIMS = (32, 1003, 1501, 1499, 10)  # widths of the MLP: none of the hidden ones divides 2, 4 or 8
BATCH = 64  # global rows, divisible by every N
MIN_SHARD_SIZE = 1024
LEARNING_RATE = 1e-3
FIRST_WEIGHT = "w1"  # its gradient is x^T @ dh: the backward pass never needs the weight itself
MB = 1e6


# -- the model ------------------------------------------------------------------------------------


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    params: dict[str, jax.Array] = {}
    for i, (fan_in, fan_out) in enumerate(zip(DIMS[:-1], DIMS[1:], strict=True), start=1):
        params[f"w{i}"] = jnp.asarray(rng.normal(size=(fan_in, fan_out)) / np.sqrt(fan_in), jnp.float32)
        params[f"b{i}"] = jnp.zeros((fan_out,), jnp.float32)
    return params


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = batch["x"]
    layers = len(DIMS) - 1
    for i in range(1, layers + 1):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers:
            h = jnp.tanh(h)
    return jnp.mean((h - batch["y"]) ** 2)


def make_batch(seed: int = 1) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(BATCH, DIMS[0])), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(BATCH, DIMS[-1])), jnp.float32),
    }


def optimizer() -> optax.GradientTransformation:
    return optax.adam(LEARNING_RATE)


# -- formulas -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Byte counts of the parameter tree under one N's layouts."""

    logical: int  # Ψ = 4Φ: the parameters as the user holds them
    partitioned_padded: int  # P: partitioned leaves, stored padded to a multiple of N
    replicated: int  # R: leaves kept whole on every device
    opt_extra: int  # optimizer leaves that mirror no parameter (Adam's int32 step count)
    first_weight_padded: int  # the padded bytes of the first layer's weight

    def per_device(self, partitioned: bool, n: int) -> int:
        """One copy of a parameter-shaped category on one device."""
        return self.partitioned_padded // n + self.replicated if partitioned else self.logical


def sizes_for(policy: zj.ZeroPolicy, params: PyTree) -> Sizes:
    layouts = policy.layouts(params)
    flat = jax.tree_util.tree_flatten_with_path(layouts, is_leaf=lambda x: isinstance(x, zj.LeafLayout))[0]
    opt_abstract = jax.eval_shape(optimizer().init, params)
    return Sizes(
        logical=sum(x.nbytes for x in jax.tree.leaves(params)),
        partitioned_padded=sum(lay.nbytes for _, lay in flat if lay.partitioned),
        replicated=sum(lay.nbytes for _, lay in flat if not lay.partitioned),
        opt_extra=sum(
            math.prod(x.shape) * x.dtype.itemsize
            for x in jax.tree.leaves(opt_abstract)
            if not jnp.issubdtype(x.dtype, jnp.floating)
        ),
        first_weight_padded=layouts[FIRST_WEIGHT].nbytes,
    )


def formula(stage: int, n: int, s: Sizes) -> dict[str, int]:
    """Per-device bytes with padding and the leaves kept whole."""
    return {
        "params": s.per_device(stage >= 3, n),
        "grads": s.per_device(stage >= 2, n),
        "opt": 2 * s.per_device(stage >= 1, n) + s.opt_extra,
    }


def pure_formula(stage: int, n: int, s: Sizes) -> dict[str, float]:
    """The paper's 4Φ / 4Φ / 8Φ (fp32 + Adam), each /N once partitioned."""
    return {
        "params": s.logical / (n if stage >= 3 else 1),
        "grads": s.logical / (n if stage >= 2 else 1),
        "opt": 2 * s.logical / (n if stage >= 1 else 1),
    }


def comm_theory(stage: int, n: int, s: Sizes) -> float:
    return (3 if stage == 3 else 2) * s.logical * (n - 1) / n


def comm_accounted(stage: int, n: int, s: Sizes) -> float:
    """The theory with padding, whole leaves and the first layer's single gather counted."""
    ring = (n - 1) / n
    if stage == 0:
        return 2 * s.logical * ring
    whole = 2 * s.replicated * ring  # all-reduced gradients of the leaves kept whole
    if stage in (1, 2):
        return whole + 2 * s.partitioned_padded * ring  # reduce-scatter + all-gather
    return whole + (3 * s.partitioned_padded - s.first_weight_padded) * ring


# -- measuring one compiled program -------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    """One (N, implementation, stage) cell: its measurements and a ``step`` that takes one step."""

    n: int
    impl: str  # "zero" or "gspmd"
    stage: int
    step: Callable[[], Any]
    measured: dict[str, int]  # per-device bytes, max over devices; "grads" absent for GSPMD
    balance: float  # max/min over devices of the resident state
    colls: list[measure.Collective]
    peak: int
    times: list[float] = dataclasses.field(default_factory=list)
    final_loss: float = float("nan")

    @property
    def comm(self) -> float:
        return measure.ring_bytes(self.colls)

    @property
    def largest_all_reduce(self) -> int:
        return max((c.bytes for c in self.colls if c.kind == "all-reduce"), default=0)

    @property
    def step_s(self) -> float:
        return statistics.median(self.times)


def per_device(tree: PyTree, devices: list[Any]) -> dict[Any, int]:
    got = measure.resident_bytes(tree)
    return {d: got.get(d, 0) for d in devices}


def measured_config(impl: str, stage: int, mesh: Mesh, res: dict[str, dict[Any, int]], step: Callable[[], Any],
                    lowered: Any) -> Config:  # fmt: skip
    """The cell of one step: ``res`` its per-device state bytes, ``lowered`` its program, compiled
    once for the collectives right after SPMD partitioning and the memory analysis."""
    devices = list(mesh.devices.flat)
    totals = [sum(res[k][d] for k in res) for d in devices]
    compiled, hlo = measure.compile_with_hlo(lowered)
    # Group sizes come from the program; N (not jax.device_count()) is only the fallback.
    colls = measure.parse_collectives(hlo, mesh.size)
    return Config(
        mesh.size, impl, stage, step, {k: max(v.values()) for k, v in res.items()}, max(totals) / min(totals),
        colls, measure.memory(compiled)["peak"],
    )  # fmt: skip


def zero_config(stage: int, mesh: Mesh, params: PyTree, batch: PyTree) -> Config:
    devices = list(mesh.devices.flat)
    policy = zj.ZeroPolicy(stage, mesh, axis="data", min_shard_size=MIN_SHARD_SIZE)
    tx = zj.shard_optimizer(optimizer(), policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(loss_fn, tx, policy)
    batch = jax.device_put(batch, policy.batch_sharding())
    res = {
        "params": per_device(state.params, devices),
        "grads": per_device(step.grads(state, batch), devices),
        "opt": per_device(state.opt_state, devices),
    }
    lowered = step.jitted.lower(state, batch)
    return measured_config("zero", stage, mesh, res, common.stepper(step, state, batch), lowered)


def gspmd_config(stage: int, mesh: Mesh, params: PyTree, batch: PyTree) -> Config:
    """The hand-written recipe: NamedShardings in, ``jit`` decides the collectives."""
    n = mesh.size
    devices = list(mesh.devices.flat)
    mesh = Mesh(mesh.devices, ("data",), axis_types=(AxisType.Auto,))  # sharding constraints need Auto
    layouts = {k: zj.leaf_layout(v.shape, v.dtype, n, min_shard_size=MIN_SHARD_SIZE) for k, v in params.items()}

    def sharding(lay: zj.LeafLayout, cut: bool) -> NamedSharding:
        return NamedSharding(mesh, lay.spec(("data",)) if cut and lay.partitioned else PartitionSpec())

    def pad(x: jax.Array, lay: zj.LeafLayout) -> jax.Array:
        if not lay.padding:
            return x
        widths = [(0, 0)] * x.ndim
        widths[lay.dim] = (0, lay.padding)  # type: ignore[index]
        return jnp.pad(x, widths)

    def unpad(p: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {k: jax.lax.slice(v, (0,) * v.ndim, layouts[k].shape) for k, v in p.items()}

    tx = optimizer()
    param_sh = {k: sharding(lay, stage >= 3) for k, lay in layouts.items()}
    grad_sh = {k: sharding(lay, True) for k, lay in layouts.items()}
    opt_leaf_sh = {k: sharding(lay, stage >= 1) for k, lay in layouts.items()}
    # Through a host copy: device_put of an array already on a mesh device reuses its buffer (even
    # with may_alias=False, jax 0.10.2 on CPU), and donating the recipe's state would then delete
    # the caller's parameters.
    stored = jax.device_put({k: np.array(pad(v, layouts[k])) for k, v in params.items()}, param_sh)
    recipe = common.gspmd_recipe(lambda p, b: loss_fn(unpad(p), b), tx, mesh, stored, param_sh, opt_leaf_sh,
                                 grad_sh if stage >= 2 else None)  # fmt: skip
    opt_state = jax.jit(tx.init, out_shardings=recipe.opt_sharding)(stored)
    batch = jax.device_put(batch, recipe.batch_sharding)
    res = {"params": per_device(stored, devices), "opt": per_device(opt_state, devices)}
    lowered = recipe.jitted.lower(stored, opt_state, batch)
    return measured_config("gspmd", stage, mesh, res, common.stepper(recipe, (stored, opt_state), batch), lowered)


def time_collectives(mesh: Mesh, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Median ms of one all-reduce vs reduce-scatter + all-gather of ``nbytes`` per device: the
    same ring bytes, so a difference is the runtime's, not the algorithm's."""
    n = mesh.size
    cols = -(-nbytes // 4 // n) * n
    x = jax.device_put(jnp.ones((n, cols), jnp.float32), NamedSharding(mesh, PartitionSpec("data")))

    def all_reduce(v: jax.Array) -> jax.Array:
        return jax.lax.psum(v, "data")

    def rs_ag(v: jax.Array) -> jax.Array:
        piece = jax.lax.psum_scatter(v, "data", scatter_dimension=1, tiled=True)
        return jax.lax.all_gather(piece, "data", axis=1, tiled=True)

    out = {}
    for name, f in (("all-reduce", all_reduce), ("reduce-scatter+all-gather", rs_ag)):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")))
        jax.block_until_ready(g(x))
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(g(x))
            ts.append(time.perf_counter() - t0)
        out[name] = 1e3 * statistics.median(ts)
    return out


def naive_gspmd_params(params: PyTree, n: int) -> int:
    """Per-device parameter bytes of a stage-3 recipe that shards only dimensions dividing N (no padding)."""
    total = 0
    for x in jax.tree.leaves(params):
        divides = x.size >= MIN_SHARD_SIZE and any(d % n == 0 for d in x.shape)
        total += x.nbytes // n if divides else x.nbytes
    return total


# -- report ---------------------------------------------------------------------------------------


def build_rows(configs: list[Config], sizes: dict[int, Sizes]) -> list[dict[str, Any]]:
    by_key = {(c.n, c.impl, c.stage): c for c in configs}
    rows = []
    for c in configs:
        s = sizes[c.n]
        row: dict[str, Any] = {
            "N": c.n,
            "impl": c.impl,
            "stage": c.stage,
            "bytes_per_device": c.measured,
            "device_max_over_min": c.balance,
            "comm_bytes": c.comm,
            "comm_theory_bytes": comm_theory(c.stage, c.n, s),
            "comm_accounted_bytes": comm_accounted(c.stage, c.n, s),
            "comm_by_kind": measure.summarize(c.colls),
            "largest_all_reduce_bytes": c.largest_all_reduce,
            "compiled_peak_bytes": c.peak,
            "step_ms_median": 1e3 * c.step_s,
            "step_ms_all": [1e3 * t for t in c.times],
            "step_vs_zero_stage0": c.step_s / by_key[(c.n, "zero", 0)].step_s,
            "final_loss": c.final_loss,
        }
        if c.impl == "zero":
            f, pure = formula(c.stage, c.n, s), pure_formula(c.stage, c.n, s)
            row["formula_bytes"] = f
            row["pure_formula_bytes"] = pure
            row["ratio_to_formula"] = {k: c.measured[k] / f[k] for k in f}
            row["ratio_to_pure_formula"] = {k: c.measured[k] / pure[k] for k in pure}
            row["total_ratio_to_formula"] = sum(c.measured.values()) / sum(f.values())
            row["total_ratio_to_pure_formula"] = sum(c.measured.values()) / sum(pure.values())
            row["step_vs_gspmd"] = c.step_s / by_key[(c.n, "gspmd", c.stage)].step_s
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'N':>2} {'impl':<5} {'st':>2} | {'params':>7} {'grads':>7} {'opt':>7} {'/form':>6} {'/pure':>6} "
        f"{'max/min':>7} | {'comm':>7} {'AR/AG/RS':>16} {'/theory':>7} {'/acct':>6} {'max AR B':>9} | {'peak':>7} | "
        f"{'step ms':>7} {'/ZeRO-0':>7} {'/GSPMD':>6}"
    )
    units = f"{'':>13}| {'MB per device, max over devices':<46}| {'MB per device per step':<52}| {'MB':>7} |"
    lines = [units, head, "-" * len(head)]
    last_n = None
    for r in rows:
        if last_n is not None and r["N"] != last_n:
            lines.append("")
        last_n = r["N"]
        b = r["bytes_per_device"]
        zero = r["impl"] == "zero"
        grads = f"{b['grads'] / MB:7.2f}" if zero else f"{'-':>7}"
        form = f"{r['total_ratio_to_formula']:6.3f}" if zero else f"{'-':>6}"
        pure = f"{r['total_ratio_to_pure_formula']:6.3f}" if zero else f"{'-':>6}"
        vs_g = f"{r['step_vs_gspmd']:6.2f}" if zero else f"{'-':>6}"
        kinds = "/".join(
            f"{r['comm_by_kind'].get(k, {}).get('ring_bytes', 0.0) / MB:.1f}"
            for k in ("all-reduce", "all-gather", "reduce-scatter")
        )
        lines.append(
            f"{r['N']:>2} {r['impl']:<5} {r['stage']:>2} | {b['params'] / MB:7.2f} {grads} {b['opt'] / MB:7.2f} "
            f"{form} {pure} {r['device_max_over_min']:7.3f} | {r['comm_bytes'] / MB:7.2f} {kinds:>16} "
            f"{r['comm_bytes'] / r['comm_theory_bytes']:7.3f} {r['comm_bytes'] / r['comm_accounted_bytes']:6.3f} "
            f"{r['largest_all_reduce_bytes']:9d} | {r['compiled_peak_bytes'] / MB:7.1f} | "
            f"{r['step_ms_median']:7.1f} {r['step_vs_zero_stage0']:7.2f} {vs_g}"
        )
    return "\n".join(lines)


def format_targets(rows: list[dict[str, Any]], sizes: dict[int, Sizes], params: PyTree) -> str:
    zero = [r for r in rows if r["impl"] == "zero"]
    cat = [v for r in zero for v in r["ratio_to_formula"].values()]
    pure = [v for r in zero for v in r["ratio_to_pure_formula"].values()]
    bal = [r["device_max_over_min"] for r in zero]
    comm = [r["comm_bytes"] / r["comm_theory_bytes"] for r in zero]
    acct = [r["comm_bytes"] / r["comm_accounted_bytes"] for r in zero]
    s8 = sizes[max(sizes)]
    biggest_grad = max(x.nbytes for x in jax.tree.leaves(params))
    ar = max(r["largest_all_reduce_bytes"] for r in zero if r["stage"] >= 1)

    def met(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    def span(xs: list[float]) -> str:
        return f"{min(xs):.4f}..{max(xs):.4f}"

    out = [
        "Targets (ZeRO rows):",
        f"  state bytes / formula (with padding), per category, all stages and N: {span(cat)} "
        f"-> {met(all(abs(v - 1) <= 0.01 for v in cat))} (1.00 +- 0.01)",
        f"  state bytes / pure ZeRO formula (everything /N, no padding): {span(pure)}",
        f"  devices balanced, max/min: {span(bal)} -> {met(max(bal) <= 1.0 + 1e-9)}",
        f"  comm / theory (2Psi or 3Psi, x(N-1)/N): {span(comm)} -> {met(all(abs(v - 1) <= 0.02 for v in comm))}"
        f" (1.00 +- 0.02); / accounted: {span(acct)}",
        f"  largest all-reduce in stages 1-3: {ar} B (largest gradient {biggest_grad} B) -> "
        f"{met(ar <= s8.replicated)} (no gradient-sized all-reduce; the leaves kept whole are "
        f"{s8.replicated} B)",
    ]
    out.append("  step time (median), ZeRO stage 1 and 2 vs stage 0, stage 3 vs GSPMD stage 3:")
    for n in sorted(sizes):
        r = {x["stage"]: x for x in zero if x["N"] == n}
        out.append(
            f"    N={n}: stage1/stage0 {r[1]['step_vs_zero_stage0']:.2f}, stage2/stage0 "
            f"{r[2]['step_vs_zero_stage0']:.2f}, stage3/GSPMD-3 {r[3]['step_vs_gspmd']:.2f}"
        )
    return "\n".join(out)


def format_notes(
    rows: list[dict[str, Any]], sizes: dict[int, Sizes], params: PyTree, coll_ms: dict[int, dict[str, float]]
) -> str:
    s = sizes[max(sizes)]
    n8 = max(sizes)
    losses = [r["final_loss"] for r in rows]
    spread = (max(losses) - min(losses)) / abs(statistics.median(losses))
    w1 = next(x for k, x in params.items() if k == FIRST_WEIGHT)
    naive = naive_gspmd_params(params, n8)
    zero3 = next(r for r in rows if r["N"] == n8 and r["impl"] == "zero" and r["stage"] == 3)
    phi = s.logical // 4
    peak = {(r["N"], r["stage"]): r["compiled_peak_bytes"] for r in rows if r["impl"] == "zero"}
    return "\n".join(
        [
            "Notes:",
            f"  Phi = {phi} parameters ({s.logical / MB:.2f} MB fp32); kept whole (< {MIN_SHARD_SIZE} elements): "
            f"{s.replicated} B = {100 * s.replicated / s.logical:.3f}% of Psi.",
            "  /form: measured / (P/N + R for a partitioned category, logical bytes for a whole one; Adam holds "
            "two copies + its int32 count); /pure: measured / (4Phi, 4Phi, 8Phi, each /N once partitioned).",
            f"  /acct: comm / the theory with padding, whole leaves (all-reduced, 2 passes) and the first weight "
            f"{tuple(w1.shape)} ({100 * w1.nbytes / s.logical:.2f}% of Psi) gathered once in stage 3: its gradient "
            "x^T dh does not use it, so the backward pass does not re-gather it (the theory's 3Psi assumes it does).",
            "  comm is counted on the post-SPMD program; XLA:CPU may later merge stage 3's backward re-gathers into "
            "the forward ones (DESIGN.md), which changes memory, not what the program asks to send.",
            "  GSPMD rows hold the same padded layouts as ZeRO (the recipe pads by hand: jit rejects shardings of "
            f"indivisible dims). Unpadded, a stage-3 recipe could shard only dims dividing N: at N={n8} it would "
            f"keep {naive / MB:.2f} MB of parameters per device vs {zero3['bytes_per_device']['params'] / MB:.2f} MB "
            "for ZeRO-3.",
            "  peak: compiled.memory_analysis() per device, argument + output + temp - alias. ZeRO-2 vs ZeRO-1 peak: "
            + ", ".join(f"N={n}: {peak[(n, 2)] / MB:.1f} vs {peak[(n, 1)] / MB:.1f} MB" for n in sorted(sizes))
            + " (the partitioned gradient does not lower the compiled peak of this step).",
            f"  loss after the same steps, relative spread over all rows: {spread:.1e} (same math everywhere).",
            "  XLA:CPU runtime, Psi bytes per device, median ms (all-reduce vs reduce-scatter + all-gather, the same "
            "ring bytes): "
            + "; ".join(
                f"N={n}: {m['all-reduce']:.1f} vs {m['reduce-scatter+all-gather']:.1f}"
                for n, m in sorted(coll_ms.items())
            ),
        ]
    )


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = common.pyplot()
    ns = sorted({r["N"] for r in rows})
    stages = [0, 1, 2, 3]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, n in enumerate(ns):
        z = {r["stage"]: r for r in rows if r["N"] == n and r["impl"] == "zero"}
        state = [sum(z[s]["bytes_per_device"].values()) / MB for s in stages]
        axes[0].plot(stages, state, "o-", color=f"C{i}", label=f"N={n} state")
        peak = [z[s]["compiled_peak_bytes"] / MB for s in stages]
        axes[0].plot(stages, peak, "s--", color=f"C{i}", alpha=0.6, label=f"N={n} compiled peak")
    axes[0].set(title="ZeRO per device: params+grads+Adam, compiled peak", xlabel="stage", ylabel="MB", xticks=stages)
    axes[0].legend(fontsize=7)
    width = 0.12
    for i, n in enumerate(ns):
        for j, impl in enumerate(("zero", "gspmd")):
            r = {x["stage"]: x for x in rows if x["N"] == n and x["impl"] == impl}
            xs = [s + (2 * i + j - len(ns)) * width for s in stages]
            axes[1].bar(xs, [r[s]["comm_bytes"] / r[s]["comm_theory_bytes"] for s in stages], width,
                        label=f"{impl} N={n}", color=f"C{i}", alpha=1.0 if impl == "zero" else 0.45)  # fmt: skip
            axes[2].bar(xs, [r[s]["step_ms_median"] for s in stages], width, color=f"C{i}",
                        alpha=1.0 if impl == "zero" else 0.45, label=f"{impl} N={n}")  # fmt: skip
    axes[1].axhline(1.0, color="k", lw=0.8)
    axes[1].set(title="communication / theory (post-SPMD HLO)", xlabel="stage", xticks=stages)
    axes[2].set(title="step time, median (solid ZeRO, pale GSPMD)", xlabel="stage", ylabel="ms", xticks=stages)
    axes[1].set_ylim(0, 2.0)
    axes[1].legend(fontsize=7, ncol=3, loc="upper left")
    common.save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[2, 4, 8], help="device counts (each <= 8)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    ap.add_argument("--out", default=common.RESULTS)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    record = common.Record()
    params = init_params()
    batch = make_batch()
    configs: list[Config] = []
    sizes: dict[int, Sizes] = {}
    coll_ms: dict[int, dict[str, float]] = {}
    for n in args.ns:
        mesh = Mesh(np.asarray(jax.devices()[:n]), ("data",))
        sizes[n] = sizes_for(zj.ZeroPolicy(0, mesh, min_shard_size=MIN_SHARD_SIZE), params)
        group = [zero_config(s, mesh, params, batch) for s in range(4)]
        group += [gspmd_config(s, mesh, params, batch) for s in range(4)]
        common.time_round_robin(group, args.steps, args.warmup)
        for c in group:
            c.final_loss = float(c.step())  # the loss after every timed step (a step returns the one before it)
            c.step = lambda: None  # drop the state: the next N's configurations need the memory
        configs += group
        coll_ms[n] = time_collectives(mesh, sizes[n].logical)
        print(f"N={n} done ({record.wall_s():.0f} s)", file=sys.stderr)

    rows = build_rows(configs, sizes)
    header = record.header(
        "ZeRO stages vs formula, theory and the GSPMD recipe (benchmarks/stages.py)",
        f"devices: {jax.device_count()} simulated {jax.devices()[0].platform} devices; mesh over the first N",
        f"model: MLP {' -> '.join(map(str, DIMS))}, fp32, optax.adam({LEARNING_RATE}), global batch {BATCH}, "
        f"min_shard_size {MIN_SHARD_SIZE}; step time: median of {args.steps} (after {args.warmup} warm-up), "
        "configurations of one N taking turns",
    )
    text = "\n\n".join(
        [header, format_table(rows), format_targets(rows, sizes, params), format_notes(rows, sizes, params, coll_ms)]
    )
    print(text)
    meta = record.meta() | {
        "model_dims": DIMS,
        "batch": BATCH,
        "min_shard_size": MIN_SHARD_SIZE,
        "sizes": {n: dataclasses.asdict(s) for n, s in sizes.items()},
        "collective_ms_psi_bytes": coll_ms,
    }
    common.write_results("stages", text, {"meta": meta, "rows": rows}, args.out)
    if not args.no_plot:
        plot(rows, os.path.join(args.out, "stages.png"))


if __name__ == "__main__":
    main()
