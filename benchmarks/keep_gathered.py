"""keep_gathered (issue 26, selective unsharding): the last k blocks keep their gathered parameters from the
forward pass for the backward, k re-gathers saved for k blocks of memory.

Run: ``python benchmarks/keep_gathered.py`` (about 5-10 minutes on 2 loaded cores). The reference transformer
(``zero_jax.models``: vocab 64, dim 64, heads 2, seq 32, depth 16, f32, Adam), stage 3 ``gather="manual"``,
prefetch 1, on 8 simulated CPU devices, scanned (``zj.scan_layers``) and unscanned (``zj.apply_layers`` over
``unstack_params``), with ``keep_gathered`` = 0, 1, 2, 4 and a byte budget of 2.5 blocks; each compiled step
read by ``zj.audit``: layer all-gathers per step, bytes one device sends, the compiled peak, the kept blocks,
the violations; the parameters and optimizer state after 2 steps against k = 0 (bitwise). Then
``zj.choose_keep_gathered`` for the scanned model with a device budget of the k = 0 peak + 2.5 blocks: the
pair it picks and its compiled peak. Writes ``benchmarks/results/keep_gathered.{txt,json}``.
"""

from __future__ import annotations

import _common as common  # noqa: I001

common.setup(devices=8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch, unstack_params  # noqa: E402

N = 8
MODEL = dict(vocab=64, dim=64, heads=2, seq=32, depth=16)
KS = (0, 1, 2, 4, 16)  # 16: every block kept, which measures what one block's re-gather is
BUDGET_BLOCKS = 2.5  # the byte-budget form: two blocks fit, three do not
CFG = TransformerConfig(**MODEL)


def run(layers: str, keep: int | str) -> dict:
    """One variant: its audit's figures and its parameters and optimizer state after 2 steps."""
    policy = zj.ZeroPolicy(3, jax.make_mesh((N,), ("data",)), stacked="layers" if layers == "scan_layers" else ())
    params = init_params(CFG, jax.random.key(0))
    params = params if layers == "scan_layers" else unstack_params(params)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(make_loss_fn(CFG, policy, keep_gathered=keep), tx, policy, gather="manual")
    batches = [synthetic_batch(CFG, 16, jax.random.key(10 + s)) for s in range(2)]
    report = zj.audit(step, state, batches[0], grads=False)
    for batch in batches:
        state, _ = step(state, batch)
    trained = [np.asarray(x) for x in jax.tree.leaves((zj.full_params(state), state.opt_state))]
    blocks = report.layers.blocks
    return {
        "layers": layers,
        "keep_gathered": keep,
        "kept": report.layers.kept,
        "all_gathers": sum(b.forward + b.backward for b in blocks),
        "backward": sum(b.backward for b in blocks),
        "comm": report.comm.measured,
        "peak": int(report.memory["peak"]),
        "block_bytes": report.layers.layer_bytes,
        "alive": report.layers.max_alive,
        "violations": [v.kind for v in report.violations],
        "trained": trained,
    }


def judged(row: dict, base: dict, full: dict) -> dict:
    """The row against k = 0: the drops, and whether each is k blocks' re-gathers. A block's re-gather is
    measured (k = 0 against every block kept, per block) and beside the formula (zj.keep_gathered_trade: its
    gathered bytes, (N-1)/N of them); the audit's sums of ring bytes are floats: equal to a byte."""
    k, block = row["kept"], base["block_bytes"]
    per_gathers = (base["all_gathers"] - full["all_gathers"]) / CFG.depth
    per_bytes = (base["comm"] - full["comm"]) / CFG.depth
    trade = zj.keep_gathered_trade(block, N, depth=CFG.depth, ks=[k])[0]
    saved, spent = base["comm"] - row["comm"], row["peak"] - base["peak"]
    same = all(np.array_equal(a, b) for a, b in zip(row.pop("trained"), base["trained"], strict=True))
    return row | {
        "gathers_dropped": base["all_gathers"] - row["all_gathers"],
        "gathers_exact": base["all_gathers"] - row["all_gathers"] == k * per_gathers,
        "comm_saved": saved,
        "comm_saved_measured_regathers": k * per_bytes,
        "comm_exact": abs(saved - k * per_bytes) <= 1,
        "comm_saved_formula": trade.comm_saved,
        "peak_rise": spent,
        "peak_rise_bound": 1.1 * trade.memory_spent,
        "peak_within": spent <= 1.1 * trade.memory_spent,
        "bitwise": same,
    }


def text_row(r: dict) -> str:
    mib = lambda b: f"{b / 2**20:.3f}"  # noqa: E731
    return (f"{r['layers']:<13} {r['keep_gathered']!s:>12} {r['kept']:>4} {r['all_gathers']:>7} "
            f"{r['gathers_dropped']:>7} {'yes' if r['gathers_exact'] else 'NO':>5} {mib(r['comm']):>9} "
            f"{mib(r['comm_saved']):>9} {mib(r['comm_saved_measured_regathers']):>9} "
            f"{'yes' if r['comm_exact'] else 'NO':>5} {mib(r['comm_saved_formula']):>9} "
            f"{mib(r['peak']):>9} {mib(r['peak_rise']):>9} {mib(r['peak_rise_bound']):>9} "
            f"{'yes' if r['peak_within'] else 'NO':>5} {r['alive']:>5} {'yes' if r['bitwise'] else 'NO':>7} "
            f"{','.join(r['violations']) or '-'}")  # fmt: skip


def main() -> None:
    record = common.Record()
    head = (f"{'layers':<13} {'keep':>12} {'kept':>4} {'gathers':>7} {'dropped':>7} {'=k·g':>5} {'comm MiB':>9} "
            f"{'saved':>9} {'k·regath':>9} {'exact':>5} {'formula':>9} {'peak MiB':>9} {'rise':>9} "
            f"{'<=1.1k·B':>9} {'ok':>5} {'alive':>5} {'bitwise':>7} violations")  # fmt: skip
    print(head, flush=True)
    rows, table = [], [head]
    for layers in ("scan_layers", "apply_layers"):
        base, full = run(layers, 0), run(layers, CFG.depth)
        budget = f"{BUDGET_BLOCKS * base['block_bytes'] / 1024:.3f}KiB"
        done = {0: base, CFG.depth: full}
        for keep in (*KS, budget):
            again = done.get(keep) if isinstance(keep, int) else None
            row = judged(dict(again, trained=list(again["trained"])) if again else run(layers, keep), base, full)
            rows.append(row)
            table.append(text_row(row))
            print(table[-1], flush=True)
        base.pop("trained")
    scan0 = next(r for r in rows if r["layers"] == "scan_layers" and r["keep_gathered"] == 0)
    device_budget = scan0["peak"] + BUDGET_BLOCKS * scan0["block_bytes"]
    # The same model and batch, built by the planner's reference step in a child process (abstract state).
    choice = zj.choose_keep_gathered(device_budget, num_devices=N, factory_kwargs=MODEL | {"global_batch": 16})
    print(choice, flush=True)
    ok = all(r["gathers_exact"] and r["comm_exact"] and r["peak_within"] and r["bitwise"] and not r["violations"]
             for r in rows)  # fmt: skip
    text = "\n".join([
        record.header(
            "keep_gathered: the last k blocks keep their gathered parameters for the backward pass (issue 26)",
            f"model: reference transformer {MODEL}, f32, Adam 1e-3, stage 3 gather='manual', prefetch 1, N = {N}, "
            "batch 16, XLA:CPU; zj.audit of each compiled step (grads=False)",
        ),
        "columns: keep (k, or a byte budget of 2.5 blocks), kept (the audit's count), layer all-gathers per step, "
        "dropped vs k = 0 (= k x one block's re-gathers, measured as (k=0 - k=16) / 16?), MiB one device sends per "
        "step, saved vs k = 0, k x one block's re-gather bytes (measured so), equal to a byte?, the formula "
        "(zj.keep_gathered_trade: k x (N-1)/N x the block's gathered bytes; above the measured re-gathers where XLA "
        "already drops the re-gather of a leaf the backward does not read, a block's last bias), the compiled peak "
        "(argument + output + temp - alias), its rise vs k = 0 and the bound 1.1 x k x block bytes, whole "
        "layers alive at once (the audit's walk), parameters and Adam state after 2 steps bitwise equal to k = 0",
        "",
        *table,
        "",
        f"every row as claimed: {'yes' if ok else 'NO'}",
        "",
        f"zj.choose_keep_gathered (the same model and batch 16, scanned, from the planner's reference step in a "
        f"child process) for a device budget of the scanned k = 0 peak + {BUDGET_BLOCKS} blocks:",
        str(choice),
    ])  # fmt: skip
    data = {"meta": record.meta(), "model": MODEL, "rows": rows, "all_as_claimed": ok,
            "choice": {"device_bytes": choice.device_bytes, "keep_gathered": choice.keep_gathered,
                       "prefetch": choice.prefetch, "peak": None if choice.chosen is None else choice.chosen.peak,
                       "candidates": [vars(c) for c in choice.candidates]}}  # fmt: skip
    common.write_results("keep_gathered", text, data)
    print(f"wrote {common.RESULTS}/keep_gathered.txt and .json")


if __name__ == "__main__":
    main()
