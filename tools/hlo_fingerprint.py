"""Fingerprints of the programs zero_jax compiles, to prove a change left them bitwise alone.

Prints, for stages 0-3 x (fp32, bf16 compute) x (gather="all", gather="manual" with
scan_layers), a hash of the lowered StableHLO and of the compiled HLO with source locations
removed (the file paths and line numbers differ between checkouts, nothing else may). Run it
under two checkouts and diff:

    PYTHONPATH=/path/to/old python tools/hlo_fingerprint.py > old.txt
    PYTHONPATH=$PWD python tools/hlo_fingerprint.py > new.txt && diff old.txt new.txt
"""

from __future__ import annotations

import hashlib
import re

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402

LOCATION = re.compile(r"^\d+ ")  # the compiled text's tables of files, functions and stack frames
METADATA = re.compile(r", metadata=\{[^}]*\}")


def _block(layer: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ layer["w"] + layer["b"])


def _loss(params: dict, batch: dict) -> jax.Array:
    x, _ = jax.lax.scan(lambda h, layer: (_block(layer, h), None), batch["x"], params["layers"])
    return jnp.mean((x @ params["head"] - batch["y"]) ** 2)


def _manual_loss(policy: zj.ZeroPolicy):
    def loss(params: dict, batch: dict) -> jax.Array:
        x = zj.scan_layers(_block, params["layers"], batch["x"], policy)
        return jnp.mean((x @ zj.gather(params["head"], policy) - batch["y"]) ** 2)

    return loss


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def main() -> None:
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    params = {
        "layers": {"w": jnp.asarray(rng.normal(size=(4, 64, 64)) / 8, jnp.float32), "b": jnp.zeros((4, 64))},
        "head": jnp.asarray(rng.normal(size=(64, 1)) / 8, jnp.float32),
    }
    batch = {"x": jnp.ones((32, 64)), "y": jnp.ones((32, 1))}
    print("stage bf16 manual lowered compiled")
    for stage in range(4):
        for precision in (None, zj.Precision(compute_dtype=jnp.bfloat16)):
            for manual in (False, True):
                policy = zj.ZeroPolicy(stage, mesh, stacked="layers", precision=precision)
                tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
                state = zj.init_state(params, tx, policy)
                loss = _manual_loss(policy) if manual else _loss
                step = zj.make_train_step(loss, tx, policy, gather="manual" if manual else "all",
                                          accum_steps=2 if stage == 2 else 1)  # fmt: skip
                lowered = step.lower(state, batch)
                compiled = METADATA.sub("", lowered.compile().as_text())
                compiled = "\n".join(line for line in compiled.splitlines() if not LOCATION.match(line))
                print(stage, precision is not None, manual, _digest(lowered.as_text()), _digest(compiled))


if __name__ == "__main__":
    main()
