"""An encoder-decoder under ``layers="auto"`` (issue 29): the stage-3 layer-wise peak of a T5-shaped Linen model
against depth, beside stage 1.

Run: ``python benchmarks/t5_layers.py`` (8 simulated CPU devices; ``--depths 4 16`` by default; the depth-16
compile takes several minutes on 2 cores). The model is tests/_models.py's T5 (the shape of Hugging Face's
FlaxT5ForConditionalGeneration: two stacks, block 0 of each with the relative-attention bias; transformers is
not needed). Figures: ``compiled.memory_analysis()`` per device, argument + output + temp - alias. The allowance
for the added depth is each added block's partitioned model state (parameter, gradient, Adam's two moments: 4 x
block / N, fp32) and its saved input (rows / N x length x d, fp32). Writes ``benchmarks/results/t5_layers.txt``.
"""

from __future__ import annotations

import _common as common  # noqa: I001  (first: the process is set up before anything touches a device)

common.setup(devices=8)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402

sys.path.insert(0, os.path.join(common.ROOT, "tests"))
from _models import make_mesh, t5, t5_batches, t5_loss  # noqa: E402

DIMS = dict(vocab=128, d=64, heads=4, d_kv=16, d_ff=256)
ROWS, LENGTH, N = 16, 16, 8
MIB = 2**20


def peak(depth: int, stage: int, gather: str) -> tuple[int, tuple[str, ...]]:
    """The compiled peak of one step and the blocks "auto" found."""
    model, variables = t5(depth, **DIMS)
    adapted = zj.adapters.from_linen(model, variables, t5_loss(model), layers="auto")
    batch = t5_batches(1, rows=ROWS, length=LENGTH, vocab=DIMS["vocab"])[0]
    policy = adapted.policy(stage, make_mesh(N), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = adapted.make_train_step(tx, policy, gather=gather)
    return common.memory(step.lower(adapted.init_state(tx, policy), batch).compile())["peak"], adapted.layers.paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs=2, default=[4, 16])
    ap.add_argument("--out", default=common.RESULTS)
    args = ap.parse_args()
    record = common.Record()
    lo, hi = args.depths
    _, variables = t5(hi, **DIMS)
    blocks = {s: sum(x.nbytes for x in jax.tree.leaves(variables["params"][s]["block"]["1"])) for s in ("encoder",
              "decoder")}  # fmt: skip
    p_lo, paths_lo = peak(lo, 3, "manual")
    p_hi, paths_hi = peak(hi, 3, "manual")
    p_one, _ = peak(hi, 1, "all")
    carry = ROWS // N * LENGTH * DIMS["d"] * 4
    allowance = (hi - lo) * sum(4 * b / N + carry for b in blocks.values())
    growth = p_hi - p_lo
    lines = [
        f"blocks found by layers='auto': {len(paths_lo)} at depth {lo}, {len(paths_hi)} at depth {hi} "
        f"(every block of both stacks: {len(paths_hi) == 2 * hi})",
        f"stage-3 layer-wise peak: depth {lo} {p_lo / MIB:.3f} MiB, depth {hi} {p_hi / MIB:.3f} MiB",
        f"growth {growth / MIB:.3f} MiB against the allowance {allowance / MIB:.3f} MiB ({2 * (hi - lo)} blocks x "
        f"(4 x block / {N} + saved input {carry / 1024:.0f} KiB); block bytes {blocks}) = {growth / allowance:.3f}x "
        f"({'within' if growth <= 1.3 * allowance else 'OVER'} 1.3x)",
        f"depth {hi}: stage 3 layer-wise / stage 1 = {p_hi / MIB:.3f} / {p_one / MIB:.3f} MiB = {p_hi / p_one:.3f} "
        f"({'within' if p_hi <= 0.5 * p_one else 'OVER'} 0.5)",
    ]
    text = record.header(
        "T5-shaped encoder-decoder, layers='auto': stage-3 layer-wise peak against depth (benchmarks/t5_layers.py)",
        f"model: tests/_models.py t5 {DIMS}, batch {ROWS} x {LENGTH}, fp32, optax.adam, N = {N}",
    )
    text += "\n" + "\n".join(lines)
    print(text)
    common.write_results("t5_layers", text, out=args.out)


if __name__ == "__main__":
    main()
