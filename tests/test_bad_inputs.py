"""Issue 13's sweep: wrong inputs a real user plausibly makes, over the public API only.

One row per wrong input: (id, a callable doing the wrong thing, the exception type it must raise, the
words its message must contain — what is wrong, which leaf, and the fix). Nothing crashes, nothing is
silently accepted, nothing is vague. ``python tests/test_bad_inputs.py`` prints what each row gets today.

A row whose ``error`` is None is a plausible input that must simply work (it trains or builds).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import child_env, make_mesh, mlp_batch, mlp_loss, mlp_params, run_as_main, working_directory
from jax.sharding import PartitionSpec as PS

if __name__ == "__main__":  # the probe below: 8 simulated devices, as conftest.py gives
    jax.config.update("jax_num_cpu_devices", 8)

import zero_jax as zj  # noqa: E402

# --- the few objects the rows share (made on first use; most rows compile nothing) ----------------------


@functools.cache
def mesh(n: int = 8) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@functools.cache
def mesh2d() -> jax.sharding.Mesh:
    return jax.make_mesh((2, 4), ("replica", "data"))


def params() -> dict[str, jax.Array]:
    return {"w": jnp.ones((16, 8)), "b": jnp.zeros((8,))}


def loss_fn(p: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)


def per_example_aux_loss(p: dict[str, jax.Array], b: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
    errors = jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2, axis=1)
    return jnp.mean(errors), {"errors": errors}


def batch(n: int = 16, m: int | None = None) -> dict[str, jax.Array]:
    return {"x": jnp.ones((n, 16)), "y": jnp.ones((n if m is None else m, 8))}


@functools.cache
def policy(stage: int = 2) -> zj.ZeroPolicy:
    return zj.ZeroPolicy(stage, mesh(), min_shard_size=64)


@functools.cache
def tx(stage: int = 2, opt: str = "adam") -> zj.ShardedTransformation:
    return zj.shard_optimizer({"adam": optax.adam, "sgd": optax.sgd}[opt](1e-2), policy(stage))


def state(stage: int = 2, opt: str = "adam") -> zj.TrainState:
    return zj.init_state(params(), tx(stage, opt), policy(stage))


@functools.cache
def step(stage: int = 2, **kw: Any) -> zj.TrainStep:
    return zj.make_train_step(loss_fn, tx(stage), policy(stage), **kw)


def consumed(stage: int = 2) -> zj.TrainState:
    """A state a train step has already consumed (donated)."""
    s = state(stage)
    step(stage)(s, batch())
    return s


def manual_step(body: Callable[[Any], jax.Array], stage: int = 3) -> Callable[[], Any]:
    """Run one gather='manual' step whose loss is ``body(params)``."""
    return lambda: zj.make_train_step(lambda p, b: body(p), tx(stage), policy(stage), gather="manual")(
        state(stage), batch()
    )


def cli(*argv: str) -> None:
    """``python -m zero_jax ARGV`` in this process; a non-zero exit raises SystemExit."""
    try:
        run_as_main("zero_jax", argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise


PLAN = ("plan", "--params", "7e9", "--devices", "8", "--device-memory", "80GB")
ROOT = Path(__file__).resolve().parent.parent


def cli_process(*argv: str) -> None:
    """``python -m zero_jax ARGV`` in a child process (audit sets up its own devices); non-zero exit raises."""
    run = subprocess.run([sys.executable, "-m", "zero_jax", *argv], capture_output=True, text=True, env=child_env(),
                         timeout=300, check=False)  # fmt: skip
    if run.returncode:
        raise SystemExit(f"exit {run.returncode}\n{run.stdout}\n{run.stderr}")


def saved_checkpoint(directory: Path, opt: str = "adam") -> Path:
    zj.save(directory, state(2, opt), step=1)
    return directory


def call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Callable[[], Any]:
    return lambda: fn(*args, **kw)


class HFLikeModel:
    """What transformers' FlaxPreTrainedModel looks like to from_linen: .module and .params, not a Module."""

    def __init__(self) -> None:
        import flax.linen as nn

        self.module = nn.Dense(4)
        self.params = self.module.init(jax.random.key(0), jnp.ones((1, 4)))["params"]


FlaxPreTrainedModel = type("FlaxPreTrainedModel", (HFLikeModel,), {})


class Row(NamedTuple):
    id: str
    wrong: Callable[..., Any]  # takes tmp_path if it names a parameter, else nothing
    error: type[BaseException] | None  # None: a plausible input that must simply work
    words: tuple[str, ...]


def row(id: str, wrong: Callable[..., Any], error: type[BaseException] | None, *words: str, marks: Any = ()) -> Any:
    return pytest.param(Row(id, wrong, error, words), id=id, marks=marks)


P = zj.ZeroPolicy
S = zj.shard_optimizer
I = zj.init_state  # noqa: E741
M = zj.make_train_step
ADAM = optax.adam(1e-2)

ROWS = [
    # -- ZeroPolicy ------------------------------------------------------------------------------------
    row("policy-stage-4", call(P, 4, mesh()), ValueError, "stage must be 0, 1, 2 or 3", "got 4"),
    row("policy-stage-negative", call(P, -1, mesh()), ValueError, "stage must be 0, 1, 2 or 3", "got -1"),
    row("policy-stage-str", call(P, "2", mesh()), ValueError, "stage must be 0, 1, 2 or 3", "'2'"),
    row("policy-stage-bool", call(P, True, mesh()), ValueError, "stage must be 0, 1, 2 or 3", "True"),
    row("policy-stage-float", call(P, 1.5, mesh()), ValueError, "stage must be 0, 1, 2 or 3", "1.5"),
    row("policy-mesh-none", call(P, 2, None), TypeError, "mesh must be a jax.sharding.Mesh", "jax.make_mesh"),
    row("policy-mesh-devices", call(P, 2, jax.devices()), TypeError, "mesh must be a jax.sharding.Mesh", "list"),
    row("policy-mesh-swapped", call(P, mesh(), 2), ValueError, "stage must be 0, 1, 2 or 3", "Mesh"),
    row("policy-axis-unknown", call(P, 2, mesh(), "batch"), ValueError, "'batch' is not an axis", "('data',)"),
    row("policy-axis-empty", call(P, 2, mesh(), ()), ValueError, "is not an axis of the mesh", "('data',)"),
    row("policy-axis-twice", call(P, 2, mesh(), ("data", "data")), ValueError, "names an axis twice"),
    row(
        "policy-replica-axis-missing",
        call(P, 2, mesh(), replica_axis="replica"),
        ValueError,
        "replica_axis 'replica'",
        "jax.make_mesh((R, N), ('replica', 'data'))",
    ),
    row(
        "policy-replica-is-data",
        call(P, 2, mesh2d(), "data", replica_axis="data"),
        ValueError,
        "both a partition axis",
        "replica axis",
    ),
    row(
        "policy-over-replicas-no-replica-axis",
        call(P, 2, mesh(), optimizer_over_replicas=True),
        ValueError,
        "optimizer_over_replicas=True",
        "pass replica_axis=",
    ),
    row(
        "policy-over-replicas-stage-0",
        call(P, 0, mesh2d(), replica_axis="replica", optimizer_over_replicas=True),
        ValueError,
        "needs stage >= 1",
    ),
    row(
        "policy-min-shard-negative",
        call(P, 2, mesh(), min_shard_size=-1),
        ValueError,
        "min_shard_size must be >= 0",
        "-1",
    ),
    row("policy-min-shard-str", call(P, 2, mesh(), min_shard_size="1k"), TypeError, "min_shard_size", "'1k'"),
    row(
        "policy-precision-str",
        call(P, 2, mesh(), precision="bf16"),
        TypeError,
        "precision must be a zj.Precision",
        "str",
    ),
    row(
        "policy-precision-dtype",
        call(P, 2, mesh(), precision=jnp.bfloat16),
        TypeError,
        "precision must be a zj.Precision",
    ),
    row(
        "precision-bf16-loss-scale",
        call(zj.Precision, compute_dtype=jnp.bfloat16, loss_scale=zj.DynamicLossScale()),
        ValueError,
        "loss_scale is for float16 compute only",
        "bfloat16",
        "Drop loss_scale",
    ),
    row(
        "precision-fp16-without-loss-scale",
        call(zj.Precision, compute_dtype=jnp.float16),
        ValueError,
        "float16",
        "DynamicLossScale",
    ),
    row("precision-int-param-dtype", call(zj.Precision, param_dtype=jnp.int32), ValueError, "param_dtype", "int32"),
    row(
        "policy-stacked-matches-nothing",
        call(I, params(), S(ADAM, P(3, mesh(), stacked="layers")), P(3, mesh(), stacked="layers")),
        ValueError,
        "prefix 'layers' matches no parameter",
        "['b', 'w']",
    ),
    row("policy-stacked-not-str", call(P, 3, mesh(), stacked=5), TypeError, "stacked", "5"),
    row(
        "policy-offload-fraction-too-big",
        call(P, 2, mesh(), offload_optimizer=1.5),
        ValueError,
        "offload_optimizer",
        "1.5",
    ),
    row(
        "policy-offload-str",
        call(P, 2, mesh(), offload_optimizer="yes"),
        TypeError,
        "offload_optimizer must be a bool or a fraction in [0, 1]",
        "str",
    ),
    row(
        "policy-offload-params-stage-2",
        call(P, 2, mesh(), offload_params=True),
        ValueError,
        "offload_params",
        "stage 3",
    ),
    # -- shard_optimizer -------------------------------------------------------------------------------
    row("shard-optimizer-str", call(S, "adam", policy()), TypeError, "optax", "str"),
    row(
        "shard-optimizer-factory-not-called",
        call(S, optax.adam, policy()),
        TypeError,
        "expected an optax.GradientTransformation, got function",
        "optax.adamw(1e-3)",
    ),
    row("shard-optimizer-no-policy", call(S, ADAM, None), TypeError, "policy", "ZeroPolicy"),
    row("shard-optimizer-mesh-as-policy", call(S, ADAM, mesh()), TypeError, "policy", "ZeroPolicy"),
    row("shard-optimizer-twice", call(S, S(ADAM, policy()), policy()), TypeError, "already sharded"),
    row(
        "trainable-mask-missing-leaf",
        lambda: I(params(), S(ADAM, policy(), trainable={"w": True}), policy()),
        ValueError,
        "the mask's tree does not match the parameters",
        "'b'",
        "one bool per parameter leaf",
    ),
    row(
        "trainable-mask-extra-leaf",
        lambda: I(params(), S(ADAM, policy(), trainable={"w": True, "b": True, "c": False}), policy()),
        ValueError,
        "trainable",
        "'c'",
    ),
    row(
        "trainable-mask-a-name",
        lambda: I(params(), S(ADAM, policy(), trainable="w"), policy()),
        ValueError,
        "the mask's tree does not match the parameters",
        "one bool per parameter leaf",
    ),
    row(
        "trainable-fn-wrong-tree",
        lambda: I(params(), S(ADAM, policy(), trainable=lambda p: {"w": True}), policy()),
        ValueError,
        "the mask's tree does not match the parameters",
        "PyTreeDef({'w': *})",
    ),
    # -- init_state ------------------------------------------------------------------------------------
    row("init-unwrapped-optax", call(I, params(), ADAM, policy()), TypeError, "pass zj.shard_optimizer(tx, policy)"),
    row(
        "init-tx-of-another-policy",
        call(I, params(), tx(1), policy(2)),
        ValueError,
        "sharded for ZeroPolicy(stage=1",
        "Wrap it with zj.shard_optimizer(tx, policy)",
    ),
    row(
        "init-string-leaf",
        call(I, {**params(), "name": "mlp"}, tx(), policy()),
        TypeError,
        "init_state",
        "'name'",
        "str",
    ),
    row(
        "init-list-with-a-string",
        call(I, {**params(), "v": [jnp.ones(3), "a"]}, tx(), policy()),
        TypeError,
        "init_state",
        "'v/1'",
        "str",
    ),
    row(
        "init-object-leaf",
        call(I, {**params(), "fn": object()}, tx(), policy()),
        TypeError,
        "init_state",
        "'fn'",
        "object",
    ),
    row(
        "init-two-bad-leaves-named-at-once",
        call(I, {**params(), "name": "mlp", "tag": "v1"}, tx(), policy()),
        TypeError,
        "'name'",
        "'tag'",
    ),
    row(
        "init-none-leaf-is-an-empty-subtree",
        lambda: step()(I({**params(), "extra": None}, tx(), policy()), batch()),
        None,
    ),
    row("init-python-float-converted-or-named", lambda: _converted_or_named({**params(), "lr": 0.1}, "'lr'"), None),
    row("init-int-leaf-trains-untouched", lambda: _int_leaf_untouched(), None),
    row(
        "init-factory-with-args",
        call(I, lambda key: params(), tx(), policy()),
        TypeError,
        "init_state",
        "zero-argument",
    ),
    row("init-policy-not-a-policy", call(I, params(), tx(), "stage2"), TypeError, "policy must be a"),
    row(
        "init-model-state-str",
        call(I, params(), tx(), policy(), model_state={"mode": "train"}),
        TypeError,
        "model_state",
        "'mode'",
    ),
    # -- make_train_step -------------------------------------------------------------------------------
    row(
        "step-gather-unknown",
        call(M, loss_fn, tx(), policy(), gather="layers"),
        ValueError,
        "gather must be 'all'",
        "'manual'",
        "'layers'",
    ),
    row(
        "step-accum-0",
        call(M, loss_fn, tx(), policy(), accum_steps=0),
        ValueError,
        "accum_steps must be an int >= 1",
        "got 0",
    ),
    row(
        "step-accum-negative",
        call(M, loss_fn, tx(), policy(), accum_steps=-2),
        ValueError,
        "accum_steps must be an int >= 1",
        "-2",
    ),
    row(
        "step-accum-float",
        call(M, loss_fn, tx(), policy(), accum_steps=2.0),
        ValueError,
        "accum_steps must be an int >= 1",
        "2.0",
    ),
    row(
        "step-accum-mode-unknown",
        call(M, loss_fn, tx(), policy(), accum_mode="global"),
        ValueError,
        "accum_mode must be 'local'",
        "'partitioned'",
        "'global'",
    ),
    row(
        "step-clip-negative",
        call(M, loss_fn, tx(), policy(), clip_norm=-1.0),
        ValueError,
        "clip_norm must be a positive number or None",
        "-1.0",
    ),
    row("step-clip-zero", call(M, loss_fn, tx(), policy(), clip_norm=0), ValueError, "clip_norm must be a positive"),
    row(
        "step-clip-nan",
        call(M, loss_fn, tx(), policy(), clip_norm=float("nan")),
        ValueError,
        "clip_norm must be a positive",
        "nan",
    ),
    row(
        "step-clip-str",
        call(M, loss_fn, tx(), policy(), clip_norm="1.0"),
        ValueError,
        "clip_norm must be a positive",
        "'1.0'",
    ),
    row("step-loss-not-callable", call(M, "mse", tx(), policy()), TypeError, "loss_fn must be callable", "str"),
    row("step-unwrapped-optax", call(M, loss_fn, ADAM, policy()), TypeError, "pass zj.shard_optimizer(tx, policy)"),
    row(
        "step-stateful-str",
        call(M, loss_fn, tx(), policy(), stateful="yes"),
        TypeError,
        "stateful must be True or False",
    ),
    row(
        "step-loss-not-scalar",
        lambda: M(lambda p, b: b["x"] @ p["w"], tx(), policy())(state(), batch()),
        TypeError,
        "must return a float scalar",
        "shape (2, 8)",
        "jnp.mean",
    ),
    row(
        "step-manual-forgot-to-gather",
        manual_step(lambda p: loss_fn(p, batch())),
        TypeError,
        "a partitioned parameter of shape (16, 8) ('w') was used as an array",
        "zj.gather(params_subtree, policy)",
    ),
    row(
        "step-manual-weight-decay-on-pieces",
        manual_step(
            lambda p: loss_fn(zj.gather(p, policy(3)), batch()) + sum(jnp.sum(x**2) for x in jax.tree.leaves(p))
        ),
        TypeError,
        "used the partitioned parameter",
        "'w' (in integer_pow)",
        "silently wrong",
        "zj.gather(params['w'], policy)",
    ),
    row(
        "layers-outside-a-step",
        lambda: zj.apply_layers(lambda p, x: x @ p["w"], [params()], jnp.ones((2, 16)), policy(3)),
        RuntimeError,
        "zj.apply_layers was called outside a train step",
        "policy=None",
    ),
    row(
        "layer-outside-a-step",
        lambda: zj.apply_layer(lambda p, x: x @ p["w"], params(), jnp.ones((2, 16)), policy=policy(3)),
        RuntimeError,
        "zj.apply_layer was called outside a train step",
    ),
    row(
        "layers-not-a-list",
        lambda: zj.apply_layers(lambda p, x: x, params(), jnp.ones((2, 16)), None),
        TypeError,
        "layers_params must be a list",
        "zj.scan_layers",
    ),
    row(
        "layers-prefetch-negative",
        manual_step(
            lambda p: jnp.mean(
                zj.apply_layers(lambda q, x: x @ q["w"] + q["b"], [p], batch()["x"], policy(3), prefetch=-1)
            )
        ),
        ValueError,
        "prefetch must be an int from 0 to the number of blocks (1)",
        "-1",
    ),
    row(
        "layers-prefetch-too-far",
        manual_step(
            lambda p: jnp.mean(
                zj.apply_layers(lambda q, x: x @ q["w"] + q["b"], [p], batch()["x"], policy(3), prefetch=2)
            )
        ),
        ValueError,
        "prefetch must be an int from 0 to the number of blocks (1)",
        "2",
    ),
    row(
        "layers-one-block",
        manual_step(
            lambda p: jnp.mean(zj.apply_layers(lambda q, x: x @ q["w"] + q["b"], [p], batch()["x"], policy(3)))
        ),
        None,
    ),
    row(
        "step-loss-int",
        lambda: M(lambda p, b: jnp.int32(1), tx(), policy())(state(), batch()),
        TypeError,
        "float scalar",
        "int32",
    ),
    row(
        "step-loss-triple",
        lambda: M(lambda p, b: (loss_fn(p, b), 1.0, 2.0), tx(), policy())(state(), batch()),
        TypeError,
        "(loss, aux)",
    ),
    row(
        "step-stateful-returns-loss-only",
        lambda: M(lambda p, ms, b: loss_fn(p, b), tx(), policy(), stateful=True)(
            zj.init_state(params(), tx(), policy(), model_state={"n": jnp.zeros(())}), batch()
        ),
        TypeError,
        "stateful",
        "new_model_state",
    ),
    # -- calling the step ------------------------------------------------------------------------------
    row(
        "call-batch-not-divisible",
        lambda: step()(state(), batch(12)),
        ValueError,
        "batch leaf 'x' has shape (12, 16)",
        "divide by the 8 devices",
        "multiple of 8",
    ),
    row(
        "call-batch-two-leaves-not-divisible",
        lambda: step()(state(), batch(12)),
        ValueError,
        "'x'",
        "(12, 16)",
        "'y'",
        "(12, 8)",
    ),
    # A scalar in the batch (a temperature, a step count) is handed to every device whole.
    row("call-batch-scalar-leaf", lambda: _scalar_batch_trains(), None),
    row(
        "call-accum-not-dividing",
        lambda: step(accum_steps=3)(state(), batch()),
        ValueError,
        "accum_steps=3",
        "multiple of 24",
    ),
    row(
        "call-batch-leaves-disagree",
        lambda: step()(state(), batch(16, 8)),
        ValueError,
        "'x'",
        "(16, 16)",
        "'y'",
        "(8, 8)",
    ),
    row("call-params-not-state", lambda: step()(params(), batch()), TypeError, "TrainState", "zj.init_state"),
    row(
        "call-state-of-another-policy",
        lambda: step(3)(state(1), batch()),
        ValueError,
        "laid out for ZeroPolicy(stage=1",
        "this step is for ZeroPolicy(stage=3",
    ),
    row(
        "call-opt-state-of-another-optimizer",
        lambda: step()(state(2, "sgd"), batch()),
        ValueError,
        "made by another optimizer",
        "using the same tx",
    ),
    row(
        "call-params-changed-shape",
        lambda: step()(state().replace(params={"w": jnp.ones((16, 9)), "b": jnp.zeros(8)}), batch()),
        ValueError,
        "parameter tree changed",
        "'w'",
        "(16, 9)",
    ),
    row("call-donated-state", lambda: step()(consumed(), batch()), ValueError, "donated", "keep the state it returns"),
    # -- issue 29: the batch as users pass it ----------------------------------------------------------
    row("call-batch-a-list", lambda: _list_batch_trains(), None),
    row(
        "call-batch-a-list-to-a-dict-loss",
        lambda: step()(state(), [batch()["x"], batch()["y"]]),
        TypeError,
        "list indices must be integers",
        "raised inside loss_fn(params, batch)",
        "a list of 2 leaves ('0' (2, 16) float32, '1' (2, 8) float32)",
    ),
    row(
        "call-batch-holds-a-string",
        lambda: step()(state(), {**batch(), "name": "abc"}),
        TypeError,
        "batch leaf 'name' is a str",
        "close over them in loss_fn",
    ),
    row("call-batch-holds-a-typed-key", lambda: _key_batch_trains(), None),
    row(
        "call-batch-holds-a-raw-prng-key",
        lambda: step()(state(), {**batch(), "key": jax.random.PRNGKey(0)}),
        ValueError,
        "'key' (2,)",
        "looks like a raw jax.random.PRNGKey",
        "jax.random.key(seed)",
    ),
    row("call-batch-committed-to-one-device", lambda: _one_device_batch_trains(), None),
    row("init-params-sharded-on-another-mesh", lambda: _params_on_another_mesh_train(), None),
    # -- issue 43: the last two vague cases --------------------------------------------------------------
    row(
        "call-batch-nested-python-lists",
        lambda: step()(state(), {k: np.asarray(v).tolist() for k, v in batch().items()}),
        TypeError,
        "batch leaf 'x' is a nested list of 256 numbers (np.asarray gives shape (16, 16))",
        "batch leaf 'y' is a nested list of 128 numbers",
        "must be an array",
        "jnp.asarray(...) or np.asarray(...)",
    ),
    row("init-params-on-devices-4-7", lambda: _params_on_devices_4_to_7_train(set_mesh=False), None),
    row("init-params-on-devices-4-7-under-set-mesh", lambda: _params_on_devices_4_to_7_train(set_mesh=True), None),
    # -- issue 29: numbers as NumPy gives them ------------------------------------------------------------
    row("step-accum-numpy-int", lambda: step(accum_steps=np.int64(2))(state(), batch()), None),
    row("step-clip-numpy-float", lambda: M(loss_fn, tx(), policy(), clip_norm=np.float32(1.0))(state(), batch()), None),
    row(
        "step-accum-numpy-float",
        call(M, loss_fn, tx(), policy(), accum_steps=np.float64(2.0)),
        ValueError,
        "accum_steps must be an int >= 1",
        "2.0",
    ),
    row(
        "layers-prefetch-numpy-int",
        manual_step(
            lambda p: jnp.mean(
                zj.apply_layers(lambda q, x: x @ q["w"] + q["b"], [p], batch()["x"], policy(3), prefetch=np.int64(1))
            )
        ),
        None,
    ),
    # -- issue 29: blocks, specs, precision, aux ----------------------------------------------------------
    row(
        "step-block-closes-over-a-piece",
        lambda: _closure_over_a_piece(),
        TypeError,
        "a partitioned parameter of shape (8, 8) ('v') was used as an array",
        "closes over params[...]",
    ),
    row(
        "spec-tree-lacks-a-leaf",
        lambda: P(3, tp_mesh(), param_specs={"w": PS(None, "model")}).layouts(params()),
        ValueError,
        "2 parameter leaves, 1 specs: no spec for b",
    ),
    row(
        "spec-tree-adds-a-leaf",
        lambda: P(3, tp_mesh(), param_specs={"w": PS(None, "model"), "b": None, "bais": None}).layouts(params()),
        ValueError,
        "no parameter for bais",
    ),
    row(
        "spec-tuples-not-partition-specs",
        lambda: P(3, tp_mesh(), param_specs={"w": (None, "model"), "b": ("model",)}).layouts(params()),
        ValueError,
        "'w': (None, 'model') is a tuple, not a jax.sharding.PartitionSpec; write P(None, 'model')",
        "'b': ('model',) is a tuple",
    ),
    row(
        "init-bf16-params-without-precision",
        lambda: _as_error(lambda: I(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params()), tx(), policy())),
        UserWarning,
        "2 float parameter leaf(s) are not float32",
        "'w' (16, 8) bfloat16",
        "precision=zj.Precision(param_dtype=jnp.bfloat16)",
        "zj.Precision(compute_dtype=jnp.bfloat16)",
    ),
    row(
        "step-aux-per-example-averaged",
        lambda: _as_error(lambda: M(per_example_aux_loss, tx(), policy())(state(), batch())),
        UserWarning,
        "aux leaf 'errors' (2,) has as many rows as each device's batch (2)",
        "aux_reduce={'errors': 'gather'}",
    ),
    row("step-aux-reduce-gather", lambda: _aux_gathered(), None),
    row(
        "step-aux-reduce-unknown",
        call(M, per_example_aux_loss, tx(), policy(), aux_reduce={"errors": "concat"}),
        ValueError,
        "aux_reduce must be None, one of ('mean', 'sum', 'max', 'min', 'gather')",
        "'errors' is 'concat'",
    ),
    row(
        "step-aux-reduce-names-no-aux-key",
        lambda: M(per_example_aux_loss, tx(), policy(), aux_reduce={"eror": "gather"})(state(), batch()),
        ValueError,
        "['eror'] at aux are not keys of the aux loss_fn returns",
        "['errors']",
    ),
    row("step-tensor-parallel-model-state-stage-3", lambda: _tp_model_state_trains(), None, marks=pytest.mark.slow),
    row("audit-pa-activation-shaped-like-a-weight", lambda: _audit_pa_passes(), None, marks=pytest.mark.slow),
    # -- gather / scan_layers / full_params ------------------------------------------------------------
    row(
        "gather-outside-step", call(zj.gather, params(), policy(3)), RuntimeError, "outside a train step", "policy=None"
    ),
    row(
        "gather-policy-not-a-policy",
        call(zj.gather, params(), "stage3"),
        TypeError,
        "policy must be a ZeroPolicy or None",
    ),
    row(
        "gather-another-policy",
        manual_step(lambda p: jnp.sum(zj.gather(p, policy(2))["w"])),
        ValueError,
        "called with ZeroPolicy(stage=2",
        "the step runs ZeroPolicy(stage=3",
    ),
    row(
        "gather-computed-array",
        manual_step(lambda p: jnp.sum(zj.gather({"w": jnp.ones((64, 8))}, policy(3))["w"])),
        ValueError,
        "'w'",
        "not a piece of the policy's parameters",
    ),
    row(
        "scan-outside-step",
        call(zj.scan_layers, lambda lp, x: x, {"w": jnp.ones((2, 64))}, 0.0, policy(3)),
        RuntimeError,
        "outside a train step",
        "policy=None",
    ),
    row(
        "scan-another-policy",
        manual_step(lambda p: zj.scan_layers(lambda lp, x: x + jnp.sum(lp), {"w": p["w"]}, jnp.zeros(()), policy(2))),
        ValueError,
        "zj.scan_layers: called with ZeroPolicy(stage=2",
        "the step runs ZeroPolicy(stage=3",
    ),
    row(
        "scan-depth-mismatch",
        call(zj.scan_layers, lambda lp, x: x, {"a": jnp.ones((3, 4)), "b": jnp.ones((2, 4))}, 0.0, None),
        ValueError,
        "disagree on the layer count",
        "a: 3",
        "b: 2",
    ),
    row("scan-no-leaves", call(zj.scan_layers, lambda lp, x: x, {}, 0.0, None), ValueError, "has no leaves"),
    row(
        "scan-prefetch-negative",
        call(zj.scan_layers, lambda lp, x: x, {"a": jnp.ones((3, 4))}, 0.0, None, prefetch=-1),
        ValueError,
        "prefetch must be an int from 0 to the depth (3)",
        "-1",
    ),
    row("full-params-of-params", call(zj.full_params, params()), TypeError, "expected a zero_jax TrainState", "dict"),
    row("full-params-of-none", call(zj.full_params, None), TypeError, "expected a zero_jax TrainState", "NoneType"),
    row("full-params-of-donated", lambda: zj.full_params(consumed()), ValueError, "donated"),
    # -- checkpoints -----------------------------------------------------------------------------------
    row(
        "restore-missing-dir",
        lambda tmp_path: zj.restore(tmp_path / "none", policy=policy(), tx=tx()),
        FileNotFoundError,
        "there is no checkpoint directory",
        "none",
        "save one first with zj.save(",
    ),
    row(
        "restore-from-file",
        lambda tmp_path: zj.restore(_touch(tmp_path / "f.txt"), policy=policy(), tx=tx()),
        NotADirectoryError,
        "is a file",
        "the directory zj.save wrote into",
    ),
    row(
        "restore-policy-not-a-policy",
        lambda tmp_path: zj.restore(saved_checkpoint(tmp_path), policy=mesh(), tx=tx()),
        TypeError,
        "policy must be a zj.ZeroPolicy",
    ),
    row(
        "save-same-step-twice",
        lambda tmp_path: zj.save(saved_checkpoint(tmp_path), state(), step=1),
        FileExistsError,
        "step 1 already exists",
        "Save under another step",
    ),
    row(
        "restore-adam-checkpoint-with-sgd",
        lambda tmp_path: zj.restore(saved_checkpoint(tmp_path), policy=policy(), tx=tx(2, "sgd")),
        ValueError,
        "leaf",
        "optimizer_state=",
        "reinit",
    ),
    row(
        "restore-adam-checkpoint-with-sgd-reinit",
        lambda tmp_path: zj.restore(
            saved_checkpoint(tmp_path), policy=policy(), tx=tx(2, "sgd"), optimizer_state="reinit"
        ),
        None,
    ),
    row("save-relative-path", lambda tmp_path: _in(tmp_path, lambda: zj.save("ckpt", state(), step=1)), None),
    row(
        "restore-relative-path",
        lambda tmp_path: _in(
            tmp_path, lambda: zj.restore(saved_checkpoint(tmp_path / "ckpt").name, policy=policy(), tx=tx())
        ),
        None,
    ),
    row("manager-relative-path", lambda tmp_path: _in(tmp_path, lambda: _manager_save("ckpt")), None),
    row(
        "export-load-relative-path",
        lambda tmp_path: _in(
            tmp_path, lambda: (zj.export_params("m.safetensors", state()), zj.load_params("m.safetensors", policy()))
        ),
        None,
    ),
    row("save-donated-state", lambda tmp_path: zj.save(tmp_path, consumed(), step=1), ValueError, "donated"),
    row(
        "manager-keep-zero",
        lambda tmp_path: zj.CheckpointManager(tmp_path, max_to_keep=0),
        ValueError,
        "max_to_keep must be >= 1 or None",
    ),
    row("save-params-not-state", lambda tmp_path: zj.save(tmp_path, params(), step=1), TypeError, "TrainState"),
    row(
        "load-params-missing-file",
        lambda tmp_path: zj.load_params(tmp_path / "m.safetensors", policy()),
        FileNotFoundError,
        "m.safetensors",
    ),
    # -- the command line ------------------------------------------------------------------------------
    row(
        "cli-bandwidth-without-unit",
        call(cli, *PLAN, "--bandwidth", "300", "--compute-time", "10s"),
        SystemExit,
        "--bandwidth",
        "GB/s",
    ),
    row(
        "cli-device-memory-without-unit",
        call(cli, "plan", "--params", "7e9", "--devices", "8", "--device-memory", "80"),
        SystemExit,
        "--device-memory",
        "GB",
    ),
    row(
        "cli-params-not-a-number",
        call(cli, "plan", "--params", "seven", "--devices", "8", "--device-memory", "80GB"),
        SystemExit,
        "--params: cannot read 'seven' as a count",
        "7e9",
    ),
    row(
        "cli-bandwidth-without-compute-time",
        call(cli, *PLAN, "--bandwidth", "300GB/s"),
        SystemExit,
        "--bandwidth and --compute-time go together",
    ),
    row(
        "cli-device-memory-missing",
        call(cli, "plan", "--params", "7e9"),
        SystemExit,
        "pass --device-memory (e.g. 80GB or 16GiB), or --topology NAME",
    ),
    row("cli-replicas-0", call(cli, *PLAN, "--replicas", "0"), SystemExit, "--replicas", "0"),
    row("cli-replicas-negative", call(cli, *PLAN, "--replicas", "-2"), SystemExit, "--replicas", "-2"),
    row(
        "cli-plot-unwritable",
        lambda tmp_path: cli(*PLAN, "--plot", str(tmp_path / "no" / "such" / "m.png")),
        SystemExit,
        "--plot",
        "m.png",
    ),
    row("cli-audit-devices-0", call(cli_process, "audit", "--devices", "0"), SystemExit, "--devices", "0"),
    row("cli-audit-bad-heads", call(cli_process, "audit", "--heads", "5"), SystemExit, "heads=5", "pick heads"),
    row("cli-unknown-command", call(cli, "train"), SystemExit, "invalid choice: 'train'"),
    row(
        "cli-quant-block-without-quantize",
        call(cli, *PLAN, "--quant-block", "128"),
        SystemExit,
        "--quant-block sets the block of the int8 wire formats, but none is asked for",
        "--quantize-grads int8",
    ),
    row("cli-demo-stage-4", call(cli, "demo", "--stages", "4"), SystemExit, "--stages: invalid choice: 4"),
    # -- formulas and helpers --------------------------------------------------------------------------
    row("bytes-negative-params", call(zj.model_state_bytes, -1, 8, 2), ValueError, "num_params must be positive", "-1"),
    row(
        "bytes-zero-devices",
        call(zj.model_state_bytes, 7e9, 0, 2),
        ValueError,
        "num_devices must be a positive",
        "got 0",
    ),
    row("bytes-stage-5", call(zj.model_state_bytes, 7e9, 8, 5), ValueError, "stage must be 0, 1, 2 or 3"),
    row(
        "shard-batch-not-divisible",
        call(zj.shard_batch, batch(12), policy()),
        ValueError,
        "batch leaf 'x'",
        "12 local rows",
        "multiple of 8",
    ),
    row("offload-plan-of-params", call(zj.offload_plan, params()), TypeError, "TrainState"),
    row("launch-zero-processes", call(zj.launch, print, processes=0), ValueError, "processes must be an int >= 1"),
    row(
        "launch-lambda",
        call(zj.launch, lambda: 1, processes=2),
        TypeError,
        "cannot be found by a new process",
        "top level of an importable module",
    ),
    row("audit-donated-state", lambda: zj.audit(step(), consumed(), batch()), ValueError, "donated"),
    row("audit-on-one-device", lambda: _audit_one_device(), None),
    # -- adapters --------------------------------------------------------------------------------------
    row(
        "nnx-not-a-module",
        call(lambda: zj.adapters.from_nnx({"w": jnp.ones(3)}, loss_fn)),
        TypeError,
        "nnx.Module",
        "dict",
    ),
    row(
        "linen-not-a-module",
        call(lambda: zj.adapters.from_linen(lambda x: x, {"params": {}}, loss_fn)),
        TypeError,
        "flax.linen.Module",
        "function",
    ),
    row(
        "equinox-not-a-module",
        call(lambda: zj.adapters.from_equinox("model", loss_fn)),
        TypeError,
        "from_equinox",
        "str",
    ),
    row("linen-variables-without-params", lambda: _linen(variables={"w": jnp.ones((4, 4))}), ValueError, "'params'"),
    # A Hugging Face Flax model (.module + .params) is taken as it is: variables default to {"params": .params}.
    row("linen-hf-model-object", lambda: zj.adapters.from_linen(FlaxPreTrainedModel(), None, loss_fn), None),
    row("nnx-loss-not-callable", lambda: _nnx(loss="mse"), TypeError, "loss must be callable"),
]


def tp_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _as_error(fn: Callable[[], Any]) -> Any:
    """``fn()`` with warnings raised as errors (as under pytest): a row's warning is its message."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


def _scalar_batch_trains() -> None:
    """A float scalar in the batch reaches every device whole: the loss scaled by it is the scaled loss."""
    scaled = M(lambda p, b: loss_fn(p, b) * b["t"], tx(), policy())
    _, plain = step()(state(), batch())
    _, metrics = scaled(state(), {**batch(), "t": jnp.float32(3.0)})
    np.testing.assert_allclose(float(metrics["loss"]), 3 * float(plain["loss"]), rtol=1e-6)


def _list_batch_trains() -> None:
    listed = M(lambda p, b: loss_fn(p, {"x": b[0], "y": b[1]}), tx(), policy())
    _, got = listed(state(), [batch()["x"], batch()["y"]])
    _, want = step()(state(), batch())
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)


def _key_batch_trains() -> None:
    """A typed RNG key in the batch is the same key on every device, with accumulation too."""
    noisy = lambda p, b: loss_fn(p, b) + 0.0 * jax.random.normal(b["key"], ())  # noqa: E731
    for k in (1, 2):
        s, metrics = M(noisy, tx(), policy(), accum_steps=k)(state(), {**batch(), "key": jax.random.key(0)})
        assert np.isfinite(float(metrics["loss"])) and int(s.step) == 1


def _one_device_batch_trains() -> None:
    one = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[3]), batch())
    _, got = step()(state(), one)
    _, want = step()(state(), batch())
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)


def _params_on_another_mesh_train() -> None:
    other = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    placed = {"w": jax.device_put(params()["w"], jax.NamedSharding(other, PS("x"))), "b": params()["b"]}
    s = I(placed, tx(3), policy(3))
    np.testing.assert_array_equal(np.asarray(zj.full_params(s)["w"]), np.asarray(params()["w"]))
    step(3)(s, batch())


def _params_on_devices_4_to_7_train(*, set_mesh: bool) -> None:
    """Parameters sharded over devices 4-7 (axis 'x', Explicit: jax.make_mesh's default), given to init_state
    on the 8-device policy, with that mesh still set (jax.set_mesh) or not: re-placed per the policy, they
    train as the same parameters made anywhere else do."""
    other = jax.make_mesh((4,), ("x",), devices=jax.devices()[4:])
    cuts = {"w": PS(None, "x"), "b": PS("x")}
    placed = {k: jax.device_put(v, jax.NamedSharding(other, cuts[k])) for k, v in params().items()}
    with jax.set_mesh(other) if set_mesh else contextlib.nullcontext():
        s = I(placed, tx(3), policy(3))
    assert s.params["w"].sharding.mesh == policy(3).auto_mesh, s.params["w"].sharding
    for k, v in zj.full_params(s).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(params()[k]))
    _, got = step(3)(s, batch())
    _, want = step(3)(state(3), batch())
    assert float(got["loss"]) == float(want["loss"])


def _closure_over_a_piece() -> None:
    pol = zj.ZeroPolicy(3, mesh(), min_shard_size=0)
    t = zj.shard_optimizer(ADAM, pol)

    def loss(p, b):  # the block uses p["v"] from the closure, not through its own parameters
        return jnp.mean(zj.apply_layers(lambda q, x: (x @ q["w"]) @ p["v"], [{"w": p["w"]}], b["x"], pol))

    zj.make_train_step(loss, t, pol, gather="manual")(I({"w": jnp.ones((16, 8)), "v": jnp.ones((8, 8))}, t, pol),
                                                      batch())  # fmt: skip


def _aux_gathered() -> None:
    _, metrics = M(per_example_aux_loss, tx(), policy(), aux_reduce={"errors": "gather"})(state(), batch())
    assert metrics["aux"]["errors"].shape == (16,)


def _tp_model_state_trains() -> None:
    pol = zj.ZeroPolicy(3, tp_mesh(), param_specs={"w": PS(None, "model"), "b": PS("model")}, min_shard_size=0)
    t = zj.shard_optimizer(ADAM, pol)

    def stateful(p, ms, b):
        return loss_fn(p, b), {"mean": 0.9 * ms["mean"] + 0.1 * jnp.mean(b["x"], 0)}

    s = I(params(), t, pol, model_state={"mean": jnp.zeros(16)})
    s, _ = zj.make_train_step(stateful, t, pol, stateful=True)(s, batch())
    np.testing.assert_allclose(np.asarray(s.model_state["mean"]), 0.1, rtol=1e-6)


def _audit_pa_passes() -> None:
    """TP + P_a: per-device activations (4, 64) have the shape of the stacked bias 'layers/b' (4, 64); the
    model-axis gathers of activations are not weights gathered across the model axis."""
    layers = {"up": jnp.ones((4, 64, 128)) / 8, "down": jnp.ones((4, 128, 64)) / 11, "b": jnp.zeros((4, 64))}
    specs = {"layers": {"up": PS(None, None, "model"), "down": PS(None, "model", None), "b": PS(None, "model")}}
    pol = zj.ZeroPolicy(3, tp_mesh(), param_specs=specs, min_shard_size=0, stacked="layers",
                        partition_activations=True)  # fmt: skip

    def loss(p, b):
        block = lambda q, x: x + jnp.tanh(x @ q["up"]) @ q["down"] + q["b"]  # noqa: E731
        return jnp.mean(zj.scan_layers(block, p["layers"], b["x"], pol) ** 2)

    t = zj.shard_optimizer(ADAM, pol)
    zj.audit(zj.make_train_step(loss, t, pol, gather="manual"), I({"layers": layers}, t, pol),
             {"x": jnp.ones((16, 64))}).check()  # fmt: skip


def _converted_or_named(tree: Any, leaf: str) -> None:
    """A Python scalar leaf is converted by init_state (and trains), or refused there naming the leaf."""
    try:
        s = I(tree, tx(), policy())
    except (TypeError, ValueError) as e:
        if "init_state" in str(e) and leaf in str(e):
            return
        raise
    step()(s, batch())


def _int_leaf_untouched() -> None:
    """An int32 leaf among the parameters trains in stage 3 and stays bitwise unchanged."""
    counts = jnp.arange(8, dtype=jnp.int32)
    s, _ = step(3)(I({**params(), "counts": counts}, tx(3), policy(3)), batch())
    got = zj.full_params(s)["counts"]
    if got.dtype != jnp.int32 or not np.array_equal(got, counts):
        raise AssertionError(f"the int32 leaf changed: {got}")


def _audit_one_device() -> None:
    one = zj.ZeroPolicy(2, mesh(1))
    t = zj.shard_optimizer(ADAM, one)
    zj.audit(zj.make_train_step(loss_fn, t, one), zj.init_state(params(), t, one), batch(8))


def _in(directory: Path, fn: Callable[[], Any]) -> Any:
    with working_directory(directory):
        return fn()


def _manager_save(directory: str) -> None:
    with zj.CheckpointManager(directory, async_save=False) as manager:
        manager.save(state(), step=1)


def _touch(path: Path) -> Path:
    path.write_text("not a checkpoint")
    return path


def _linen(variables: Any) -> Any:
    import flax.linen as nn

    return zj.adapters.from_linen(nn.Dense(4), variables, loss_fn)


def _nnx(loss: Any) -> Any:
    from flax import nnx

    return zj.adapters.from_nnx(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), loss)


def run(r: Row, tmp_path: Path) -> tuple[BaseException | None, str]:
    """What the wrong input does: the exception (None if none) and its message plus anything printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            r.wrong(tmp_path) if r.wrong.__code__.co_varnames[:1] == ("tmp_path",) else r.wrong()
        except BaseException as e:  # noqa: BLE001 - the sweep records whatever comes out
            notes = "\n".join(getattr(e, "__notes__", ()))  # what the library added to an error from user code
            return e, f"{e}\n{notes}\n{printed.getvalue()}"
    return None, printed.getvalue()


@pytest.mark.parametrize("case", ROWS)
def test_wrong_input_gets_a_clear_error(case: Row, tmp_path: Path) -> None:
    error, message = run(case, tmp_path)
    if case.error is None:
        assert error is None, f"{case.id}: must work, raised {type(error).__name__}: {message[:1500]}"
        return
    assert "Traceback (most recent call last)" not in message, f"{case.id}: a traceback, not a message:\n{message}"
    assert error is not None, f"{case.id}: accepted silently (no error); printed: {message[:500]!r}"
    assert isinstance(error, case.error), (
        f"{case.id}: {type(error).__name__} instead of {case.error.__name__}: {message[:800]}"
    )
    missing = [w for w in case.words if w not in message]
    assert not missing, f"{case.id}: the message lacks {missing}:\n{message[:1500]}"


def test_the_sweep_covers_every_category() -> None:
    prefixes = {c.values[0].id.split("-")[0] for c in ROWS}
    assert {"policy", "shard", "trainable", "init", "step", "call", "gather", "scan", "full", "restore", "save",
            "cli", "linen", "nnx", "equinox"} <= prefixes  # fmt: skip
    assert len(ROWS) >= 80 and len({c.values[0].id for c in ROWS}) == len(ROWS)


# -- one test each: the errors the sweep's rows build on ----------------------------------------------------------


def _small_policy(stage: int = 2, n: int = 8) -> zj.ZeroPolicy:
    return zj.ZeroPolicy(stage, make_mesh(n), min_shard_size=64)


@pytest.mark.parametrize("stage", [-1, 4, 1.5, True, "2"])
def test_stage_outside_0_to_3(stage) -> None:
    with pytest.raises(ValueError, match=r"stage must be 0, 1, 2 or 3, got"):
        zj.ZeroPolicy(stage, make_mesh(8))


def test_axis_the_mesh_lacks() -> None:
    with pytest.raises(ValueError, match=r"axis 'batch' is not an axis of the mesh, whose axes are \('data',\)"):
        zj.ZeroPolicy(1, make_mesh(8), axis="batch")


def test_batch_not_divisible_by_the_data_axis() -> None:
    policy = _small_policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    with pytest.raises(
        ValueError, match=r"batch leaf 'x' has shape \(12, 12\).*divide by the 8 devices.*multiple of 8"
    ):
        step(state, mlp_batch(n=12))


def test_loss_that_is_not_a_scalar() -> None:
    policy = _small_policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(lambda p, b: (b["x"] @ p["w1"]) ** 2, tx, policy)
    with pytest.raises(TypeError, match=r"must return a float scalar.*shape \(2, 100\).*jnp.mean"):
        step(state, mlp_batch())


def test_state_of_another_policy() -> None:
    a, b = _small_policy(1), _small_policy(3)
    state = zj.init_state(mlp_params(), zj.shard_optimizer(optax.adam(1e-2), a), a)
    tx_b = zj.shard_optimizer(optax.adam(1e-2), b)
    step = zj.make_train_step(mlp_loss, tx_b, b)
    with pytest.raises(ValueError, match=r"laid out for ZeroPolicy\(stage=1.*this step is for ZeroPolicy\(stage=3"):
        step(state, mlp_batch())


def test_optimizer_state_of_another_parameter_tree() -> None:
    policy = _small_policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    other = dict(mlp_params(), w1=jnp.zeros((12, 200)))
    foreign = zj.init_state(other, tx, policy).opt_state
    step = zj.make_train_step(mlp_loss, tx, policy)
    with pytest.raises(ValueError, match=r"optimizer state belongs to another policy or another parameter tree"):
        step(state.replace(opt_state=foreign), mlp_batch())


def test_optimizer_state_of_another_optimizer() -> None:
    policy = _small_policy()
    state = zj.init_state(mlp_params(), zj.shard_optimizer(optax.sgd(0.1), policy), policy)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    with pytest.raises(ValueError, match=r"made by another optimizer"):
        step(state, mlp_batch())


def test_parameter_tree_changed_shape_between_init_and_step() -> None:
    policy = _small_policy()
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = zj.init_state(mlp_params(), tx, policy)
    step = zj.make_train_step(mlp_loss, tx, policy)
    grown = dict(state.params, w2=jnp.zeros((100, 7)))
    with pytest.raises(ValueError, match=r"parameter tree changed.*leaf 'w2' has shape \(100, 7\).*\(100, 6\)"):
        step(state.replace(params=grown), mlp_batch())
    fewer = {k: v for k, v in state.params.items() if k != "b2"}
    with pytest.raises(ValueError, match=r"different tree structure"):
        step(state.replace(params=fewer), mlp_batch())


def test_unwrapped_or_mismatched_optimizer() -> None:
    policy = _small_policy()
    with pytest.raises(TypeError, match=r"wrapped for the policy: pass zj.shard_optimizer\(tx, policy\)"):
        zj.init_state(mlp_params(), optax.adam(1e-2), policy)
    with pytest.raises(ValueError, match=r"sharded for ZeroPolicy\(stage=1"):
        zj.make_train_step(mlp_loss, zj.shard_optimizer(optax.adam(1e-2), _small_policy(1)), policy)
    with pytest.raises(TypeError, match=r"already sharded"):
        zj.shard_optimizer(zj.shard_optimizer(optax.adam(1e-2), policy), policy)


def test_stacked_prefix_that_matches_nothing() -> None:
    policy = zj.ZeroPolicy(3, make_mesh(8), stacked="layers")
    with pytest.raises(ValueError, match=r"prefix 'layers' matches no parameter.*\['b1', 'b2', 'scale', 'w1', 'w2'\]"):
        policy.layouts(mlp_params())


def test_device_count() -> None:
    # Not a skip: the suite needs its 8 devices, and says so when it lacks them.
    assert jax.device_count() == 8


if __name__ == "__main__":  # python tests/test_bad_inputs.py: what each row gets today
    import tempfile

    for case in ROWS:
        r = case.values[0]
        with tempfile.TemporaryDirectory() as d:
            e, msg = run(r, Path(d))
        ok = (e is None) if r.error is None else (isinstance(e, r.error) and all(w in msg for w in r.words))
        mark = "ok  " if ok else "FAIL"
        print(f"{mark} {r.id:40} {type(e).__name__ if e else 'no error':20} {' '.join(msg.split())[:300]}")
    os._exit(0)
