"""ZeRO++'s hpZ (``ZeroPolicy(secondary_axis=...)``) on XLA:CPU, N = 8 simulated devices as
(nodes, chips) = (2, 4) and (4, 2): bytes across and within the nodes per device per step against
``zj.comm_bytes_per_axis(..., secondary=S)``, the device memory the secondary pieces add against Ψ/S,
and parity with plain optax, for ``scan_layers`` and ``apply_layers``, f32 and int8 wires (qwZ + qgZ).

    python benchmarks/hpz.py        # about 2 minutes on 2 cores; writes benchmarks/results/hpz.{txt,json}

XLA:CPU's byte counts are exact (read off the compiled program); its times are not an interconnect's,
so none are reported.
"""

import _common as common  # noqa: I001

common.setup(devices=8)

from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402

DIM, DEPTH, BATCH_ROWS = 128, 16, 16
PSI = DEPTH * 2 * DIM * 4 * DIM  # two weights of dim x 4 dim per block
INT8 = {"quantize_weights": "int8", "quantize_grads": "int8", "quant_block": 64}


def block(p: dict, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["w1"]) @ p["w2"]


def params(stacked: bool) -> dict:
    k1, k2 = jax.random.split(jax.random.key(0))
    w1 = jax.random.normal(k1, (DEPTH, DIM, 4 * DIM)) / 16
    w2 = jax.random.normal(k2, (DEPTH, 4 * DIM, DIM)) / 16
    if stacked:
        return {"layers": {"w1": w1, "w2": w2}}
    return {"blocks": [{"w1": w1[i], "w2": w2[i]} for i in range(DEPTH)]}


BATCH = {
    "x": jax.random.normal(jax.random.key(1), (BATCH_ROWS, DIM)),
    "y": jax.random.normal(jax.random.key(2), (BATCH_ROWS, DIM)),
}


def loss(kind: str, policy: zj.ZeroPolicy | None) -> Any:
    def loss_fn(p: dict, batch: dict) -> jax.Array:
        if kind == "scan":
            x = zj.scan_layers(block, p["layers"], batch["x"], policy)
        else:
            x = zj.apply_layers(block, p["blocks"], batch["x"], policy)
        return jnp.mean((x - batch["y"]) ** 2)

    return loss_fn


def reference(kind: str, steps: int = 2) -> dict:
    tx, p = optax.adam(1e-3), params(kind == "scan")
    opt = tx.init(p)
    for _ in range(steps):
        g = jax.grad(loss(kind, None))(p, BATCH)
        u, opt = tx.update(g, opt, p)
        p = optax.apply_updates(p, u)
    return p


def row(kind: str, nodes: int, chips: int, hpz: bool, wire: dict, ref: dict) -> dict:
    mesh = jax.make_mesh((nodes, chips), ("node", "chip"))
    extra = {"secondary_axis": "chip"} if hpz else {}
    stacked = "layers" if kind == "scan" else ()
    policy = zj.ZeroPolicy(3, mesh, ("node", "chip"), min_shard_size=0, stacked=stacked, **extra, **wire)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state(params(kind == "scan"), tx, policy)
    step = zj.make_train_step(loss(kind, policy), tx, policy, gather="manual")
    report = zj.audit(step, state, BATCH)
    for _ in range(2):
        state, _ = step(state, BATCH)
    err = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(zj.full_params(state)), jax.tree.leaves(ref), strict=True)
    )
    kinds = report.comm_per_axis_kind
    if hpz:
        across, within = sum(kinds["node"].values()), sum(kinds["chip"].values())
        theory = zj.comm_bytes_per_axis(PSI, 8, 3, secondary=chips, dtype_bytes=4, **wire)
    else:
        across, within = None, None
        theory = {}
    return {
        "layers": kind, "mesh": f"{nodes}x{chips}", "hpz": hpz, "wire": "int8" if wire else "f32",
        "across": across, "across_theory": theory.get("across"), "within": within,
        "within_theory": theory.get("within"), "both_axes": sum(kinds.get("node+chip", {}).values()),
        "node_kinds": sorted(kinds.get("node", {})), "temp": report.memory["temp"], "ok": report.ok,
        "comm_over_accounted": report.comm.measured / report.comm.accounted, "max_abs_error_vs_optax": err,
    }  # fmt: skip


def text(r: dict, secondary_bytes: float | None) -> str:
    def mib(x: float | None) -> str:
        return "-" if x is None else f"{x / 2**20:.4f}"

    ratio = lambda a, b: "-" if a is None else f"{a / b:.4f}"  # noqa: E731
    extra = "-" if secondary_bytes is None else f"{secondary_bytes / 2**10:.1f} KiB"
    return (f"{r['layers']:<6} {r['mesh']:<5} {'hpZ' if r['hpz'] else 'plain':<6} {r['wire']:<5} "
            f"{mib(r['across']):>9} {ratio(r['across'], r['across_theory'] or 1):>7} {mib(r['within']):>9} "
            f"{ratio(r['within'], r['within_theory'] or 1):>7} {mib(r['both_axes']):>9} {extra:>12} "
            f"{r['max_abs_error_vs_optax']:>9.2e} {'yes' if r['ok'] else 'NO':>5}")  # fmt: skip


def main() -> None:
    record = common.Record()
    head = (f"{'layers':<6} {'mesh':<5} {'':<6} {'wire':<5} {'across':>9} {'/theory':>7} {'within':>9} "
            f"{'/theory':>7} {'both axes':>9} {'+temp':>12} {'max |err|':>9} {'check':>5}")  # fmt: skip
    lines = [
        f"hpZ on XLA:CPU, N = 8 as (nodes x chips), stage 3 layer-wise, {DEPTH} blocks of two {DIM}x{4 * DIM} f32 "
        f"weights (Ψ = {PSI}), Adam, batch {BATCH_ROWS}, 2 steps. Ring bytes per device per step (MiB) across the "
        "nodes ('node' axis) and within ('chip'), against zj.comm_bytes_per_axis(..., secondary=S); 'both axes': "
        "one collective spanning both (stage 3 without hpZ); '+temp': compiled temp with hpZ minus without "
        "(the secondary pieces; Ψ/S x 4 B in f32); max |err|: parameters after 2 steps against plain optax "
        "(int8: the wire's own error); check: zj.audit(...).ok.",
        "",
        head,
    ]
    print("\n".join(lines), flush=True)
    rows = []
    for kind in ("scan", "apply"):
        ref = reference(kind)
        for nodes, chips in ((2, 4), (4, 2)):
            for wire in ({}, INT8):
                plain = row(kind, nodes, chips, False, wire, ref)
                hpz = row(kind, nodes, chips, True, wire, ref)
                hpz["secondary_temp"] = hpz["temp"] - plain["temp"]
                hpz["secondary_theory"] = PSI * (4 if not wire else 1) / chips
                rows += [plain, hpz]
                lines += [text(plain, None), text(hpz, hpz["secondary_temp"])]
                print(lines[-2] + "\n" + lines[-1], flush=True)
    lines += [
        "",
        "Without hpZ every gather and reduction spans both axes (3 passes across the slow link); with hpZ the "
        "'node' axis carries one all-gather (forward) and one reduction per step. The secondary pieces' theory: "
        "f32 Ψ/S x 4 B; int8: Ψ/S x (1 + 4/64) B.",
        "",
    ]
    written = record.header("hpZ (ZeroPolicy(secondary_axis=...)), issue 26", "\n".join(lines))
    common.write_results("hpz", written, {"meta": record.meta(), "rows": rows, "psi": PSI})
    print("wrote benchmarks/results/hpz.{txt,json}")


if __name__ == "__main__":
    main()
