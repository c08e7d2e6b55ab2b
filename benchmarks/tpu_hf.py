"""A Hugging Face Flax GPT-2 through ``zj.adapters.from_linen(..., layers="auto")`` on the TPU compiler,
compiled here without a TPU (deviceless v5p:2x2x2, N = 8 chips): the model as a new user writes it (its
blocks a Python loop over ``transformer/h/<i>``), stage 1, stage 3 with ``gather="all"`` and stage 3
layer-wise, bf16 compute, fp32 master, AdamW; each compile audited (allocated HBM, communication against
the theory, whole layers alive, gathers overlapped with compute).

    python benchmarks/tpu_hf.py                       # GPT-2 small: dim 768, 12 layers, vocab 50257, seq 1024
    python benchmarks/tpu_hf.py --dim 128 --depth 4 --vocab 512 --seq 64 --name tpu_hf_quick

libtpu must be installed (the test extra), and a transformers with Flax models (``pip install
"transformers<4.52"``: 4.51.3 measured; transformers 5 has none); random weights from the config, nothing
downloaded.
Writes ``benchmarks/results/<name>.{txt,json}``.
"""

import _common as common  # noqa: I001

common.setup(devices=8)

import argparse  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402

TOPOLOGY = "v5p:2x2x2"
VARIANTS = ((1, "all"), (3, "all"), (3, "manual"))


def gpt2(dim: int, depth: int, vocab: int, seq: int) -> tuple[Any, Any]:
    """A FlaxGPT2LMHeadModel from its config (random weights) and the next-token loss over its variables."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config  # noqa: PLC0415  (an optional dependency)

    cfg = GPT2Config(n_layer=depth, n_embd=dim, n_head=max(1, dim // 64), vocab_size=vocab, n_positions=seq)
    hf = FlaxGPT2LMHeadModel(cfg, seed=0, dtype=jnp.float32)

    def loss(variables: Any, batch: dict) -> jax.Array:
        ids = batch["tokens"][:, :-1]
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        logits = hf.module.apply(variables, ids, jnp.ones_like(ids), positions, deterministic=True).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    return hf, loss


def row(adapted: Any, stage: int, gather: str, seq: int) -> dict[str, Any]:
    mesh, tpu = zj.topology_mesh(TOPOLOGY, ("data",)), zj.tpu_slice(TOPOLOGY)
    policy = adapted.policy(stage, mesh, precision=zj.Precision(compute_dtype=jnp.bfloat16))
    tx = zj.shard_optimizer(optax.adamw(1e-4), policy)
    state = zj.init_state(jax.eval_shape(lambda: adapted.params), tx, policy)
    step = adapted.make_train_step(tx, policy, gather=gather)
    batch = {"tokens": jax.ShapeDtypeStruct((mesh.size, seq + 1), jnp.int32, sharding=policy.batch_sharding())}
    started = time.perf_counter()
    r = zj.audit(step, state, batch, grads=False)
    allocated = r.memory.get("allocated", r.memory["peak"])
    return {
        "stage": stage, "gather": gather, "allocated_MiB": allocated / 2**20, "fits": allocated <= tpu.hbm_per_device,
        "comm_MiB": r.comm.measured / 2**20, "comm_over_theory": r.comm.measured / r.comm.theory,
        "comm_over_accounted": r.comm.accounted_ratio, "skipped_regathers": list(r.comm.skipped_regathers),
        "compiled_over_theory": r.compiled.ring_bytes / r.comm.theory if r.compiled else None,
        "layers_alive": r.layers.max_alive if r.layers else None,
        "gather_overlap": r.overlap.gather_fraction if r.overlap else None, "check_ok": r.ok,
        "violations": [v.kind for v in r.violations], "num_params": r.num_params,
        "compile_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--name", default="tpu_hf")
    args = parser.parse_args()
    record = common.Record()
    hf, loss = gpt2(args.dim, args.depth, args.vocab, args.seq)
    adapted = zj.adapters.from_linen(hf, loss=loss, layers="auto")
    head = (f"{'stage':<6}{'gather':<8}{'HBM MiB':>9}{'fits':>6}{'comm/th':>9}{'/accounted':>11}{'chip/th':>9}"
            f"{'alive':>6}{'overlap':>8}{'check':>7}{'compile s':>10}")  # fmt: skip
    lines = [
        f"Hugging Face FlaxGPT2LMHeadModel (dim {args.dim}, {args.depth} layers, vocab {args.vocab}, seq "
        f"{args.seq}, one sequence per chip) through zj.adapters.from_linen(..., layers='auto'): "
        f"{adapted.layers.count} blocks found ({adapted.layers.paths[0]} ...). {TOPOLOGY} (8 chips), deviceless "
        "TPU compile, bf16 compute, fp32 master, AdamW. HBM: the buffer assignment's allocation; comm/th: "
        "post-SPMD bytes / the stage's theory; /accounted: less the backward re-gathers the program skips (named "
        "by the audit); chip/th: what the compiled TPU program sends / theory; alive: whole layers at once; "
        "overlap: layer gathers with compute between start and done.",
        "",
        head,
    ]
    print("\n".join(lines), flush=True)
    rows = []
    for stage, gather in VARIANTS:
        r = row(adapted, stage, gather, args.seq)
        rows.append(r)
        chip = "-" if r["compiled_over_theory"] is None else f"{r['compiled_over_theory']:.3f}"
        lines.append(f"{stage:<6}{gather:<8}{r['allocated_MiB']:>9.1f}{'yes' if r['fits'] else 'no':>6}"
                     f"{r['comm_over_theory']:>9.3f}{r['comm_over_accounted']:>11.3f}{chip:>9}"
                     f"{r['layers_alive'] if r['layers_alive'] is not None else '-':>6}"
                     f"{r['gather_overlap'] or 0:>8.2f}{'ok' if r['check_ok'] else 'FLAGS':>7}{r['compile_s']:>10.0f}")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"parameters: {rows[0]['num_params']:,}; violations: "
        f"{sorted({v for r in rows for v in r['violations']}) or '-'}",
    ]
    written = record.header("A Hugging Face Flax GPT-2 on the TPU compiler (issue 25)", "\n".join(lines))
    common.write_results(args.name, written, {"meta": record.meta(), "rows": rows, "args": vars(args)})
    print(f"wrote benchmarks/results/{args.name}.{{txt,json}}")


if __name__ == "__main__":
    main()
