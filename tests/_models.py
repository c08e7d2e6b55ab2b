"""Small models and the unsharded reference the tests compare against."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

import zero_jax as zj
from zero_jax._layerwise import schedule as zj_schedule


def make_mesh(n: int, names: tuple[str, ...] = ("data",), shape: tuple[int, ...] | None = None) -> jax.sharding.Mesh:
    """A mesh over the first ``n`` of the 8 simulated devices."""
    devices = np.asarray(jax.devices()[:n]).reshape(shape or (n,))
    return jax.sharding.Mesh(devices, names)


@contextlib.contextmanager
def reduced_by_psum_scatter() -> Iterator[None]:
    """The schedule seam's TPU entries with the layer gradients reduced by ``psum_scatter``, for tests whose
    facts are that collective's (libtpu's all-reduce + dynamic-slice, its combiner): the seam's own TPU
    reduction is a ring of ppermutes (``grad_reduction``, tests/test_grad_reduction.py)."""
    pinned = {"tpu": tuple(e._replace(grad_reduction="psum_scatter") for e in zj_schedule.MEASURED["tpu"])}
    with mock.patch.dict(zj_schedule.MEASURED, pinned):
        yield


IN, HIDDEN, OUT = 12, 100, 6  # 100 and 6 do not divide 8: exercises padding


def mlp_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN), jnp.float32),
        "b1": jnp.asarray(rng.normal(size=(HIDDEN,)) * 0.1, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN), jnp.float32),
        "b2": jnp.zeros((OUT,), jnp.float32),  # below min_shard_size: stays whole
        "scale": jnp.ones((), jnp.float32),
    }


def mlp_loss(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    pred = (h @ params["w2"] + params["b2"]) * params["scale"]
    return jnp.mean((pred - batch["y"]) ** 2)


def mlp_batch(n: int = 16, seed: int = 1) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.normal(size=(n, IN)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(n, OUT)), jnp.float32),
    }


def reference_run(
    tx: optax.GradientTransformation, params: Any, batches: list[Any], loss_fn=mlp_loss
) -> tuple[Any, list[float]]:
    """Plain optax on one device: the numbers every stage must reproduce."""
    state = tx.init(params)

    @jax.jit
    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, losses


def train_steps(
    policy: Any, params: Any, loss_fn: Any, batches: list[Any], *, gather: str = "manual", trainable: Any = None
) -> tuple[Any, Any, list[float]]:
    """zero_jax's step with Adam (1e-2, as :func:`reference_run`'s callers), one step a batch: (state, step, losses)."""
    tx = zj.shard_optimizer(optax.adam(1e-2), policy, trainable=trainable)
    state = zj.init_state(params, tx, policy)
    step = zj.make_train_step(loss_fn, tx, policy, gather=gather)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, step, losses


def assert_trains_like(state: Any, losses: list[float], reference: tuple[Any, list[float]], start: Any,
                       rtol: float) -> None:  # fmt: skip
    """Each leaf's update within ``rtol`` (relative L2) of the reference run's, the losses within 1e-6."""
    errors = relative_update_error(zj.full_params(state), reference[0], start)
    assert max(errors.values()) <= rtol, errors
    np.testing.assert_allclose(losses, reference[1], rtol=1e-6)


def assert_trains_frozen_like(state: Any, losses: list[float], params: dict[str, Any], batches: list[Any],
                              loss_fn: Any, trainable: dict[str, bool], rtol: float) -> None:  # fmt: skip
    """Against plain optax with the ``False`` leaves of ``trainable`` frozen (``set_to_zero``): those unchanged,
    bit for bit; the others' updates within ``rtol``; the losses within 1e-6."""
    tx = optax.multi_transform({True: optax.adam(1e-2), False: optax.set_to_zero()}, trainable)
    want, want_losses = reference_run(tx, params, batches, loss_fn)
    got = zj.full_params(state)
    for name, trains in trainable.items():
        if trains:
            assert relative_update_error(got[name], want[name], params[name])[""] <= rtol, name
        else:
            np.testing.assert_array_equal(got[name], params[name])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)


def relative_update_error(final: Any, reference: Any, start: Any) -> dict[str, float]:
    """Per leaf: |final - reference| / |reference - start| (relative L2 of the update), in float64 on the host
    (numpy: no program compiled per leaf's shape and sharding, as jax.numpy's eager ops would)."""
    out = {}
    for (path, f), r, s in zip(
        jax.tree_util.tree_flatten_with_path(final)[0], jax.tree.leaves(reference), jax.tree.leaves(start), strict=True
    ):
        f, r, s = (np.asarray(x, dtype=np.float64) for x in (f, r, s))
        denom = float(np.linalg.norm((r - s).ravel()))
        out[jax.tree_util.keystr(path)] = float(np.linalg.norm((f - r).ravel())) / max(denom, 1e-30)
    return out


@contextlib.contextmanager
def working_directory(path: Any) -> Iterator[None]:
    """``contextlib.chdir`` for Python 3.10 too: run the body in ``path``, then come back."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(*paths: str, optimized: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a test's child process: this one's, with the repository (then ``paths``) first on
    PYTHONPATH and, as XLA flags, only conftest.py's fast-compile ones (a child sets up its own devices: no
    device-count flag or ``JAX_NUM_CPU_DEVICES`` a caller set reaches it); ``extra`` set on top.

    ``optimized``: no XLA flags, for a child whose time goes into running steps, not compiling them (the
    README's demo trains 80 steps of an 865k-parameter model: 90 s so against 114 s unoptimised)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([REPO, *paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["XLA_FLAGS"] = "" if optimized else os.environ["ZERO_JAX_TEST_XLA_FLAGS"]
    env.pop("JAX_NUM_CPU_DEVICES", None)
    return env


def run_as_main(package: str, argv: Sequence[str]) -> None:
    """``python -m package ARGV`` in this process; a ``SystemExit`` comes out as the command raises it.

    The package's ``__main__`` runs afresh even if a test imported it before (runpy would warn)."""
    main = f"{package}.__main__"
    saved_argv, saved_main = sys.argv, sys.modules.pop(main, None)
    sys.argv = [f"python -m {package}", *argv]
    try:
        runpy.run_module(package, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = saved_argv
        if saved_main is not None:
            sys.modules[main] = saved_main


def train_adapted(adapted: Any, stage: int, batches: list[Any], *, precision: Any = None, **step_kw: Any):
    """Train an adapted model with Adam on 8 devices (min_shard_size 0): (state, step, losses)."""
    policy = adapted.policy(stage, make_mesh(8), min_shard_size=0, precision=precision)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    state = adapted.init_state(tx, policy)
    step = adapted.make_train_step(tx, policy, **step_kw)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state, step, losses


def compile_adapted(adapted: Any, batch: Any, **step_kw: Any) -> Any:
    """An adapted model's stage-3 step (Adam, 8 devices, min_shard_size 0), compiled."""
    policy = adapted.policy(3, make_mesh(8), min_shard_size=0)
    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    return adapted.make_train_step(tx, policy, **step_kw).lower(adapted.init_state(tx, policy), batch).compile()


# -- a T5-shaped encoder–decoder (Linen), as Hugging Face's FlaxT5 writes it -------------------------------
#
# transformers is not a test dependency (and its FlaxT5 calls jnp.clip(a_max=...), which jax 0.10.2 refuses:
# it needs a shim), so this is FlaxT5ForConditionalGeneration's shape written out: a shared embedding passed
# to both stacks, blocks defined in setup() as a list named "0", "1", ..., block 0 of each stack holding the
# relative-attention bias and handing the position bias to the blocks after it, a decoder with cross
# attention, RMS norms and ReLU feed-forwards without biases, HF's initialisers, tied output embedding.


def _t5_buckets(relative: jax.Array, bidirectional: bool, num_buckets: int, max_distance: int = 128) -> jax.Array:
    buckets = jnp.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative > 0) * num_buckets
        relative = jnp.abs(relative)
    else:
        relative = -jnp.minimum(relative, 0)
    exact = num_buckets // 2
    large = exact + (jnp.log(jnp.maximum(relative, 1) / exact) / np.log(max_distance / exact) * (num_buckets - exact))
    large = jnp.minimum(large.astype(jnp.int32), num_buckets - 1)
    return buckets + jnp.where(relative < exact, relative, large)


class T5Norm(nn.Module):
    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        return weight * x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + self.eps)


class T5Attention(nn.Module):
    d: int
    heads: int
    d_kv: int
    causal: bool = False
    has_bias: bool = False
    buckets: int = 8

    @nn.compact
    def __call__(self, x, kv=None, mask=None, position_bias=None):
        init = nn.initializers.normal
        inner = self.heads * self.d_kv
        q = nn.Dense(inner, use_bias=False, kernel_init=init((self.d * self.d_kv) ** -0.5), name="q")(x)
        src = x if kv is None else kv
        k = nn.Dense(inner, use_bias=False, kernel_init=init(self.d**-0.5), name="k")(src)
        v = nn.Dense(inner, use_bias=False, kernel_init=init(self.d**-0.5), name="v")(src)
        split = lambda t: t.reshape(*t.shape[:2], self.heads, self.d_kv)  # noqa: E731
        scores = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k))  # T5: no 1/sqrt(d_kv)
        if position_bias is None:
            qlen, klen = x.shape[1], src.shape[1]
            if self.has_bias:
                rel = jnp.arange(klen)[None, :] - jnp.arange(qlen)[:, None]
                table = nn.Embed(self.buckets, self.heads, embedding_init=init(self.d**-0.5),
                                 name="relative_attention_bias")  # fmt: skip
                position_bias = table(_t5_buckets(rel, not self.causal, self.buckets)).transpose(2, 0, 1)[None]
            else:
                position_bias = jnp.zeros((1, self.heads, qlen, klen), x.dtype)
            if mask is not None:
                position_bias = position_bias + jnp.where(mask, 0.0, -1e9)
        weights = jax.nn.softmax(scores + position_bias, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, split(v)).reshape(*x.shape[:2], inner)
        return nn.Dense(self.d, use_bias=False, kernel_init=init(inner**-0.5), name="o")(out), position_bias


class T5Block(nn.Module):
    d: int
    heads: int
    d_kv: int
    d_ff: int
    causal: bool = False
    has_bias: bool = False

    @nn.compact
    def __call__(self, x, position_bias=None, encoded=None, cross_bias=None):
        init = nn.initializers.normal
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))[None, None] if self.causal else None
        attn = T5Attention(self.d, self.heads, self.d_kv, self.causal, self.has_bias, name="SelfAttention")
        h, position_bias = attn(T5Norm(name="ln_attn")(x), mask=mask, position_bias=position_bias)
        x = x + h
        if encoded is not None:
            cross = T5Attention(self.d, self.heads, self.d_kv, name="EncDecAttention")
            h, cross_bias = cross(T5Norm(name="ln_cross")(x), kv=encoded, position_bias=cross_bias)
            x = x + h
        h = nn.Dense(self.d_ff, use_bias=False, kernel_init=init(self.d**-0.5), name="wi")(T5Norm(name="ln_ff")(x))
        x = x + nn.Dense(self.d, use_bias=False, kernel_init=init(self.d_ff**-0.5), name="wo")(jax.nn.relu(h))
        return x, position_bias, cross_bias


class T5Blocks(nn.Module):
    """HF's FlaxT5BlockCollection: the blocks as a setup() list named "0", "1", ..."""

    depth: int
    d: int
    heads: int
    d_kv: int
    d_ff: int
    causal: bool = False

    def setup(self) -> None:
        self.blocks = [
            T5Block(self.d, self.heads, self.d_kv, self.d_ff, self.causal, has_bias=i == 0, name=str(i))
            for i in range(self.depth)
        ]

    def __call__(self, x: jax.Array, encoded: jax.Array | None = None) -> jax.Array:
        bias, cross = None, None
        for block in self.blocks:
            x, bias, cross = block(x, bias, encoded, cross)
        return x


class T5Stack(nn.Module):
    embed: nn.Module
    depth: int
    d: int
    heads: int
    d_kv: int
    d_ff: int
    causal: bool = False

    def setup(self) -> None:
        self.block = T5Blocks(self.depth, self.d, self.heads, self.d_kv, self.d_ff, self.causal)
        self.final_layer_norm = T5Norm()

    def __call__(self, ids: jax.Array, encoded: jax.Array | None = None) -> jax.Array:
        return self.final_layer_norm(self.block(self.embed(ids), encoded))


class T5(nn.Module):
    """``T5(depth=4)``: params ``shared``, ``encoder/block/0 … 3``, ``encoder/final_layer_norm``, the same for
    ``decoder``; block 0 of each stack also holds ``SelfAttention/relative_attention_bias``."""

    depth: int = 4
    vocab: int = 64
    d: int = 32
    heads: int = 4
    d_kv: int = 8
    d_ff: int = 64

    def setup(self) -> None:
        self.shared = nn.Embed(self.vocab, self.d, embedding_init=nn.initializers.normal(1.0))
        dims = (self.depth, self.d, self.heads, self.d_kv, self.d_ff)
        self.encoder = T5Stack(self.shared, *dims)
        self.decoder = T5Stack(self.shared, *dims, causal=True)

    def __call__(self, ids: jax.Array, decoder_ids: jax.Array) -> jax.Array:
        out = self.decoder(decoder_ids, self.encoder(ids)) * self.d**-0.5
        return self.shared.attend(out)


def t5_batches(n: int = 2, rows: int = 16, length: int = 8, vocab: int = 64, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {k: jnp.asarray(rng.integers(0, vocab, (rows, length)), jnp.int32) for k in ("ids", "dec", "labels")}
        for _ in range(n)
    ]


def t5_loss(model: T5):
    """``loss(variables, batch)``: mean token cross-entropy of ``model``."""

    def loss(variables: Any, batch: dict) -> jax.Array:
        logp = jax.nn.log_softmax(model.apply(variables, batch["ids"], batch["dec"]))
        return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))

    return loss


def t5(depth: int = 4, seed: int = 0, **kw: Any) -> tuple[T5, dict]:
    """A T5-shaped model and its variables."""
    model = T5(depth, **kw)
    ids = jnp.zeros((2, 8), jnp.int32)
    return model, model.init(jax.random.key(seed), ids, ids)


def one_line(text: str, *words: str) -> str:
    """An error's text: one line, no traceback, holding each of ``words``."""
    line = text.strip()
    assert "Traceback" not in line and len(line.splitlines()) == 1, line
    for w in words:
        assert w in line, (w, line)
    return line
