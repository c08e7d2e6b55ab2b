"""Fingerprints of the programs zero_jax compiles, to prove a change left them bitwise alone.

Prints one line per configuration: a hash of the lowered StableHLO and of the compiled HLO
with source locations removed (file paths and line numbers differ between checkouts, nothing
else may). The configurations cover every stage x (fp32, bf16 compute) x (gather="all",
gather="manual" with scan_layers), and then apply_layers (prefetch 0 / 1, stages 2-3), the
reference transformer, tensor parallelism (param_specs, with and without P_a), sequence
parallelism (batch_spec), hybrid meshes (replica_axis, optimizer_over_replicas), the int8
wires (qwZ / qgZ), offload (optimizer and parameters), gradient accumulation (local and
partitioned), float16 loss scaling, a stateful loss and a Flax Linen model through
``layers="auto"``. It uses the public API only, so it runs under any checkout. Run it under
two checkouts and diff:

    PYTHONPATH=/path/to/old python tools/hlo_fingerprint.py > old.txt
    PYTHONPATH=$PWD python tools/hlo_fingerprint.py > new.txt && diff old.txt new.txt

``--only SUBSTRING`` runs the configurations whose name contains it.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.models import TransformerConfig, init_params, make_loss_fn, megatron_specs, synthetic_batch  # noqa: E402

LOCATION = re.compile(r"^\d+ ")  # the compiled text's tables of files, functions and stack frames
METADATA = re.compile(r", metadata=\{[^}]*\}")
BF16 = zj.Precision(compute_dtype=jnp.bfloat16)
FP16 = zj.Precision(compute_dtype=jnp.float16, loss_scale=zj.DynamicLossScale())


def _block(layer: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ layer["w"] + layer["b"])


def _loss(params: dict, batch: dict) -> jax.Array:
    x, _ = jax.lax.scan(lambda h, layer: (_block(layer, h), None), batch["x"], params["layers"])
    return jnp.mean((x @ params["head"] - batch["y"]) ** 2)


def _manual_loss(policy: zj.ZeroPolicy, prefetch: int = 1) -> Callable[..., jax.Array]:
    def loss(params: dict, batch: dict) -> jax.Array:
        x = zj.scan_layers(_block, params["layers"], batch["x"], policy, prefetch=prefetch)
        return jnp.mean((x @ zj.gather(params["head"], policy) - batch["y"]) ** 2)

    return loss


def _blocks_loss(policy: zj.ZeroPolicy, prefetch: int) -> Callable[..., jax.Array]:
    def loss(params: dict, batch: dict) -> jax.Array:
        x = zj.apply_layers(_block, params["blocks"], batch["x"], policy, prefetch=prefetch)
        return jnp.mean((x @ zj.gather(params["head"], policy) - batch["y"]) ** 2)

    return loss


def _stateful_loss(params: dict, model_state: dict, batch: dict) -> tuple[jax.Array, dict]:
    new = {"mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], 0)}
    return _loss(params, batch), new


def _params(rng: np.random.Generator) -> dict:
    return {
        "layers": {"w": jnp.asarray(rng.normal(size=(4, 64, 64)) / 8, jnp.float32), "b": jnp.zeros((4, 64))},
        "head": jnp.asarray(rng.normal(size=(64, 1)) / 8, jnp.float32),
    }


def _unstacked(params: dict) -> dict:
    blocks = [{"w": params["layers"]["w"][i], "b": params["layers"]["b"][i]} for i in range(4)]
    return {"blocks": blocks, "head": params["head"]}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fingerprint(step: Any, state: Any, batch: Any) -> tuple[str, str]:
    lowered = step.lower(state, batch)
    compiled = METADATA.sub("", lowered.compile().as_text())
    compiled = "\n".join(line for line in compiled.splitlines() if not LOCATION.match(line))
    return _digest(lowered.as_text()), _digest(compiled)


Config = tuple[str, Callable[[], tuple[Any, Any, Any]]]


def _train(policy: zj.ZeroPolicy, params: Any, loss: Any, batch: Any, *, model_state: Any = None,
           tx: Any = None, **step_options: Any) -> tuple[Any, Any, Any]:  # fmt: skip
    tx = zj.shard_optimizer(tx or optax.adamw(1e-3), policy)
    state = zj.init_state(params, tx, policy, model_state=model_state)
    return zj.make_train_step(loss, tx, policy, **step_options), state, batch


def configurations() -> Iterator[Config]:
    mesh = jax.make_mesh((8,), ("data",))
    tp_mesh = jax.make_mesh((4, 2), ("data", "model"))
    hybrid = jax.make_mesh((2, 4), ("replica", "data"))
    params = _params(np.random.default_rng(0))
    batch = {"x": jnp.ones((32, 64)), "y": jnp.ones((32, 1))}
    for stage in range(4):
        for precision in (None, BF16):
            for manual in (False, True):

                def build(stage=stage, precision=precision, manual=manual) -> tuple[Any, Any, Any]:
                    policy = zj.ZeroPolicy(stage, mesh, stacked="layers", precision=precision)
                    return _train(policy, params, _manual_loss(policy) if manual else _loss, batch,
                                  gather="manual" if manual else "all", accum_steps=2 if stage == 2 else 1)  # fmt: skip

                yield f"stage{stage} bf16={precision is not None} manual={manual}", build
    for stage in (2, 3):
        for prefetch in (0, 1):
            for precision in (None, BF16):

                def build(stage=stage, prefetch=prefetch, precision=precision) -> tuple[Any, Any, Any]:
                    policy = zj.ZeroPolicy(stage, mesh, precision=precision)
                    return _train(policy, _unstacked(params), _blocks_loss(policy, prefetch), batch, gather="manual")

                yield f"apply_layers stage{stage} prefetch={prefetch} bf16={precision is not None}", build
    for prefetch in (0, 1):

        def build(prefetch=prefetch) -> tuple[Any, Any, Any]:
            policy = zj.ZeroPolicy(3, mesh, stacked="layers")
            return _train(policy, params, _manual_loss(policy, prefetch), batch, gather="manual")

        yield f"scan_layers stage3 prefetch={prefetch}", build
    cfg = TransformerConfig(vocab=64, dim=32, depth=2, heads=2, seq=16)
    ref_params = init_params(cfg, jax.random.key(0))
    ref_batch = synthetic_batch(cfg, 16, jax.random.key(1))
    for stage in (1, 3):

        def build(stage=stage) -> tuple[Any, Any, Any]:
            policy = zj.ZeroPolicy(stage, mesh, stacked="layers", precision=BF16)
            return _train(policy, ref_params, make_loss_fn(cfg, policy), ref_batch, gather="manual")

        yield f"transformer stage{stage} bf16", build
    for stage, activations in ((1, False), (3, False), (3, True)):

        def build(stage=stage, activations=activations) -> tuple[Any, Any, Any]:
            policy = zj.ZeroPolicy(stage, tp_mesh, stacked="layers", param_specs=megatron_specs(),
                                   partition_activations=activations)  # fmt: skip
            return _train(policy, ref_params, make_loss_fn(cfg, policy), ref_batch, gather="manual")

        yield f"tensor parallel stage{stage} P_a={activations}", build

    def sequence_parallel() -> tuple[Any, Any, Any]:
        policy = zj.ZeroPolicy(3, tp_mesh, stacked="layers", batch_spec=P(None, "model"))
        sp_batch = {"x": batch["x"], "y": jnp.ones((32, 2))}  # every batch leaf's dimension 1 splits over "model"
        return _train(policy, params, _manual_loss(policy), sp_batch, gather="manual")

    yield "sequence parallel stage3", sequence_parallel
    for over in (False, True):

        def build(over=over) -> tuple[Any, Any, Any]:
            policy = zj.ZeroPolicy(3, hybrid, axis="data", replica_axis="replica", stacked="layers",
                                   optimizer_over_replicas=over)  # fmt: skip
            return _train(policy, params, _manual_loss(policy), batch, gather="manual")

        yield f"hybrid stage3 optimizer_over_replicas={over}", build
    for stage, weights, grads in ((2, None, "int8"), (3, "int8", None), (3, "int8", "int8")):

        def build(stage=stage, weights=weights, grads=grads) -> tuple[Any, Any, Any]:
            policy = zj.ZeroPolicy(stage, mesh, stacked="layers", quantize_weights=weights, quantize_grads=grads,
                                   quant_block=32)  # fmt: skip
            return _train(policy, params, _manual_loss(policy), batch, gather="manual")

        yield f"int8 stage{stage} weights={weights} grads={grads}", build
    for stage, opt, prm in ((1, True, False), (3, 0.5, True)):

        def build(stage=stage, opt=opt, prm=prm) -> tuple[Any, Any, Any]:
            policy = zj.ZeroPolicy(stage, mesh, stacked="layers", offload_optimizer=opt, offload_params=prm)
            return _train(policy, params, _manual_loss(policy), batch, gather="manual")

        yield f"offload stage{stage} optimizer={opt} params={prm}", build
    for stage, mode in ((1, "local"), (3, "local"), (3, "partitioned")):

        def build(stage=stage, mode=mode) -> tuple[Any, Any, Any]:
            policy = zj.ZeroPolicy(stage, mesh, stacked="layers")
            return _train(policy, params, _manual_loss(policy), batch, gather="manual", accum_steps=2,
                          accum_mode=mode)  # fmt: skip

        yield f"accumulation stage{stage} {mode}", build

    def loss_scale() -> tuple[Any, Any, Any]:
        policy = zj.ZeroPolicy(3, mesh, stacked="layers", precision=FP16)
        return _train(policy, params, _manual_loss(policy), batch, gather="manual", clip_norm=1.0)

    yield "fp16 loss scale stage3 clip", loss_scale

    def stateful() -> tuple[Any, Any, Any]:
        policy = zj.ZeroPolicy(2, mesh, stacked="layers")
        return _train(policy, params, _stateful_loss, batch, model_state={"mean": jnp.zeros(64)}, stateful=True)

    yield "stateful stage2", stateful
    for stage in (2, 3):

        def linen(stage=stage) -> tuple[Any, Any, Any]:
            import flax.linen as nn  # noqa: PLC0415 - the Linen configuration only

            class Block(nn.Module):
                @nn.compact
                def __call__(self, x: jax.Array) -> jax.Array:
                    return jnp.tanh(nn.Dense(64)(x))

            class Model(nn.Module):
                @nn.compact
                def __call__(self, x: jax.Array) -> jax.Array:
                    for i in range(4):
                        x = Block(name=f"block_{i}")(x)
                    return nn.Dense(1, name="head")(x)

            model = Model()
            variables = model.init(jax.random.key(0), batch["x"])

            def loss(v: Any, b: dict) -> jax.Array:
                return jnp.mean((model.apply(v, b["x"]) - b["y"]) ** 2)

            adapted = zj.adapters.from_linen(model, variables, loss, layers="auto")
            policy = adapted.policy(stage=stage, mesh=mesh)
            tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
            return adapted.make_train_step(tx, policy), adapted.init_state(tx, policy), batch

        yield f"linen layers=auto stage{stage}", linen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the configurations whose name contains this")
    args = parser.parse_args(argv)
    print("configuration | lowered | compiled")
    for name, build in configurations():
        if args.only in name:
            print(name, "|", *fingerprint(*build()))


if __name__ == "__main__":
    main()
