"""Muon (``optax.contrib.muon``) under ZeRO on XLA:CPU, N = 8 simulated devices: today's form (each
matrix cut across its rows like any leaf) against ``ZeroPolicy(**zj.matrix_leaves(tx, params))``
(stacks of matrices cut on the stack axis, each device owning whole matrices; single matrices kept
whole). Per model and stage 1-3: communication against the theory, the audit's violations, optimizer-state
bytes per device (max / min / mean), parameters after 3 steps against plain optax, and the CPU step time.

    python benchmarks/muon.py        # a few minutes on 2 cores; writes benchmarks/results/muon.{txt,json}

Models: a two-matrix MLP (64x256, 256x64: two single matrices, kept whole), the reference transformer
scanned (its layer matrices are stacks of 8; Muon batched over the layer axis) and unscanned
(``unstack_params``: every matrix a separate leaf, kept whole). Byte counts are exact (read off the
compiled program); step times are XLA:CPU's on 2 shared cores with simulated devices, where a
collective is a memory copy: they show the compute each form does, not an interconnect's cost.
"""

import _common as common  # noqa: I001

common.setup(devices=8)

import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch, unstack_params  # noqa: E402

LR, STEPS, TIMED = 1e-2, 3, 5
CFG = TransformerConfig(vocab=256, dim=128, depth=8, heads=4, seq=32)


def batched_muon() -> optax.GradientTransformation:
    """Muon on every matrix; a 3-D leaf under ``layers`` is a stack of matrices (Muon batched over it)."""

    def one(path: tuple, x: jax.Array) -> Any:
        matrix = x.ndim == (3 if jax.tree_util.keystr(path[:1]) == "['layers']" else 2)
        return optax.contrib.MuonDimensionNumbers(x.ndim - 2, x.ndim - 1) if matrix else None

    return optax.contrib.muon(LR, muon_weight_dimension_numbers=lambda t: jax.tree_util.tree_map_with_path(one, t))


def mlp() -> tuple[Any, Any, list[Any], optax.GradientTransformation]:
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(64, 256)) / 8, jnp.float32), "b1": jnp.zeros((256,)),
              "w2": jnp.asarray(rng.normal(size=(256, 64)) / 16, jnp.float32)}  # fmt: skip

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] - b["y"]) ** 2)

    batches = [{"x": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32),
                "y": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32)} for _ in range(STEPS)]  # fmt: skip
    return params, loss_fn, batches, optax.contrib.muon(LR)


def transformer(scanned: bool) -> tuple[Any, Any, list[Any], optax.GradientTransformation]:
    params = init_params(CFG, jax.random.key(0))
    batches = [synthetic_batch(CFG, 32, jax.random.key(s)) for s in range(STEPS)]
    if scanned:
        return params, make_loss_fn(CFG), batches, batched_muon()
    return unstack_params(params), make_loss_fn(CFG), batches, optax.contrib.muon(LR)


def reference(params: Any, loss_fn: Any, batches: list[Any], opt: optax.GradientTransformation) -> Any:
    state = opt.init(params)

    @jax.jit
    def step(p: Any, s: Any, b: Any) -> Any:
        u, s = opt.update(jax.grad(loss_fn)(p, b), s, p)
        return optax.apply_updates(p, u), s

    for b in batches:
        params, state = step(params, state, b)
    return params


def rel_error(final: Any, ref: Any, start: Any) -> float:
    worst = 0.0
    for f, r, s in zip(jax.tree.leaves(final), jax.tree.leaves(ref), jax.tree.leaves(start), strict=True):
        f, r, s = (np.asarray(x, np.float64) for x in (f, r, s))
        worst = max(worst, float(np.linalg.norm((f - r).ravel()) / max(np.linalg.norm((r - s).ravel()), 1e-30)))
    return worst


def run(model: str, form: str, stage: int, made: Any, ref: Any) -> dict[str, Any]:
    params, loss_fn, batches, opt = made
    found = zj.matrix_leaves(opt, params) if form == "whole" else {}
    policy = zj.ZeroPolicy(stage, jax.make_mesh((8,), ("data",)), **found)
    tx = zj.shard_optimizer(opt, policy)
    with warnings.catch_warnings():  # today's form warns that it cuts multiplied matrices: that is the point
        warnings.simplefilter("ignore", UserWarning)
        state = zj.init_state(params, tx, policy)
        step = zj.make_train_step(loss_fn, tx, policy)
        report = zj.audit(step, state, batches[0])
        for b in batches:
            state, _ = step(state, b)
        err = rel_error(zj.full_params(state), ref, params)
        run_ = common.stepper(step, state, batches[0])
        times = []
        for i in range(TIMED + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(run_())
            if i:
                times.append(time.perf_counter() - t0)
    opt_bytes = [report.state_bytes["optimizer"], report.state_bytes_min["optimizer"]]
    kinds = [v.kind for v in report.violations]
    return {
        "model": model, "form": form, "stage": stage,
        "comm_MiB": report.comm.measured / 2**20, "theory_MiB": report.comm.theory / 2**20,
        "ratio": report.comm.ratio, "grad_all_reduces": kinds.count("gradient-sized all-reduce"),
        "violations": len(kinds), "check": not kinds,
        "opt_max_KiB": opt_bytes[0] / 1024, "opt_min_KiB": opt_bytes[1] / 1024,
        "params_KiB": report.state_bytes["params"] / 1024,
        "stacks": len(found.get("matrix_stacks", ())), "whole": len(found.get("whole_matrices", ())),
        "rel_err": err, "step_ms": 1e3 * statistics.median(times),
    }  # fmt: skip


def main() -> None:
    record = common.Record()
    rows = []
    for model, make in (("mlp", mlp), ("transformer-scanned", lambda: transformer(True)),
                        ("transformer-unscanned", lambda: transformer(False))):  # fmt: skip
        made = make()
        ref = reference(*made)
        for stage in (1, 2, 3):
            for form in ("cut", "whole"):
                row = run(model, form, stage, made, ref)
                rows.append(row)
                print(row, flush=True)
    head = (f"{'model':22} {'form':5} {'st':>2} {'sent MiB':>9} {'theory':>8} {'ratio':>6} {'AR':>3} {'check':>5} "
            f"{'opt KiB max/min':>16} {'params KiB':>10} {'rel err':>8} {'CPU ms':>7}")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['model']:22} {r['form']:5} {r['stage']:>2} {r['comm_MiB']:9.3f} {r['theory_MiB']:8.3f} "
            f"{r['ratio']:6.3f} {r['grad_all_reduces']:>3} {'pass' if r['check'] else 'FAIL':>5} "
            f"{r['opt_max_KiB']:8.1f}/{r['opt_min_KiB']:<7.1f} {r['params_KiB']:10.1f} {r['rel_err']:8.1e} "
            f"{r['step_ms']:7.1f}"
        )
    text = record.header(
        "Muon under ZeRO: today's cut form against ZeroPolicy(**zj.matrix_leaves(tx, params)), N = 8",
        "devices: 8 simulated CPU devices (XLA:CPU); byte counts exact, read off the compiled program",
        f"models: MLP 64x256 + 256x64; reference transformer {CFG} scanned (Muon batched over the layer axis) "
        "and unscanned (unstack_params, optax.contrib.muon's own split)",
        f"optimizer: optax.contrib.muon({LR}); {STEPS} steps against plain optax (rel err: worst leaf's relative "
        f"L2 of the accumulated update); CPU ms: median of {TIMED} steps",
        "AR: gradient-sized all-reduces the audit names; check: zj.audit(...).check(); opt KiB: optimizer-state "
        "bytes per device, most / least loaded device",
        "CPU step times are XLA:CPU's on 2 shared cores, where a collective is a memory copy: they show the compute "
        "each form does (the whole form computes single matrices' updates on every device), not an interconnect's "
        "cost. No GPU-compiler estimate in this run.",
    )
    common.write_results("muon", text + "\n\n" + "\n".join(lines), {"meta": record.meta(), "rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
