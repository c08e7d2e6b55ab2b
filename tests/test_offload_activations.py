"""ZeRO-R's P_a+cpu (``offload_activations=True``): the block inputs the layer-wise primitives keep for
their backward recompute wait in host memory. Bitwise the same training (stages 2-3, accumulation, P_a
on a (data, model) mesh, ``zj.scan_layers``, ``zj.apply_layers``, the adapters' ``layers=``); the moves
in the traced program on XLA:CPU (whose lowering drops them) and as ``annotate_device_placement`` calls
in a TPU program; the TPU compiler puts the saved inputs in host memory and the device temp drops; the
argument's errors.
"""

from __future__ import annotations

import os
import re

# Two processes (the suite's xdist workers) may load libtpu at once; a deviceless compile needs no chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax._base.units import fmt_bytes  # noqa: E402
from zero_jax._policy import memory as _memory  # noqa: E402

L, B, H = 3, 2, 32  # B: rows per data shard
#: A device_put whose result lives in host memory, as a traced program prints it.
TO_HOST = re.compile(r"f32<host>\[[^\]]*\]\S* = device_put")


def _mesh(model: int = 1) -> jax.sharding.Mesh:
    if model == 1:
        return jax.make_mesh((8,), ("data",))
    return jax.make_mesh((8 // model, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _block(p: dict, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(x @ p["up"]) @ p["down"]


def _params(kind: str) -> dict:
    k = jax.random.split(jax.random.key(0), 2)
    stacked = {"up": jax.random.normal(k[0], (L, H, 2 * H)) / np.sqrt(H),
               "down": jax.random.normal(k[1], (L, 2 * H, H)) / np.sqrt(2 * H)}  # fmt: skip
    if kind == "scan":
        return {"layers": stacked}
    return {"layers": [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(L)]}


def _setup(kind: str, stage: int, offload: bool, *, call: bool = False, accum: int = 1, model: int = 1,
           state_offload: bool = False):  # fmt: skip
    """(state, step, batches): ``offload`` as the policy's default, or (``call``) as the call's keyword;
    ``state_offload``: the optimizer state and the parameters in host memory too (both runs)."""
    mesh = _mesh(model)
    specs = None
    if model > 1:
        layer = {"up": P(None, "model"), "down": P("model", None)}
        specs = {"layers": {k: P(None, *v) for k, v in layer.items()}} if kind == "scan" else {"layers": [layer] * L}
    policy = zj.ZeroPolicy(stage, mesh, min_shard_size=0, stacked="layers" if kind == "scan" else (),
                           param_specs=specs, partition_activations=model > 1,
                           offload_activations=offload and not call, offload_optimizer=state_offload,
                           offload_params=state_offload)  # fmt: skip
    keyword = {"offload_activations": offload} if call else {}

    def loss_fn(p: dict, batch: dict) -> jax.Array:
        run = zj.scan_layers if kind == "scan" else zj.apply_layers
        return jnp.mean(run(_block, p["layers"], batch["x"], policy, **keyword) ** 2)

    tx = zj.shard_optimizer(optax.adam(1e-2), policy)
    step = zj.make_train_step(loss_fn, tx, policy, gather="manual", accum_steps=accum)
    rows = mesh.shape["data"] * B * accum
    batches = [{"x": jax.random.normal(k, (rows, 8, H))} for k in jax.random.split(jax.random.key(3), 2)]
    return zj.init_state(_params(kind), tx, policy), step, batches


def _train(kind: str, stage: int, offload: bool, hold: int | None = None, **kw) -> tuple[list[np.ndarray], str]:
    """The parameters after 2 steps, and the first step's traced program; ``hold``: the schedule's
    ``hold_host_copies`` (TPU's) tried on XLA:CPU."""
    switches = {} if hold is None else {"hold_host_copies": hold}
    with zj.measure.trying_schedule(**switches):
        state, step, batches = _setup(kind, stage, offload, **kw)
        traced = str(step.jitted.trace(state, batches[0]).jaxpr)
        for b in batches:
            state, _ = step(state, b)
    if offload and hold:  # a block's output waits for the host copies of the inputs of the block `hold` before
        assert traced.count("optimization_barrier") == L - hold, traced.count("optimization_barrier")
    return [np.asarray(x) for x in jax.tree.leaves(zj.full_params(state))], traced


CASES = {
    "scan-stage3": dict(kind="scan", stage=3),
    "scan-stage2-accum2": dict(kind="scan", stage=2, accum=2),
    "apply-stage3-keyword-accum2": dict(kind="apply", stage=3, call=True, accum=2),
    "apply-stage3-hold_host_copies": dict(kind="apply", stage=3, hold=1),
    "scan-stage3-P_a": dict(kind="scan", stage=3, model=2),
    # Stages 0-1 run blocks under a checkpoint whose saved inputs wait in host memory (a custom VJP).
    "scan-stage1": dict(kind="scan", stage=1),
    "apply-stage0-keyword": dict(kind="apply", stage=0, call=True),
    "apply-stage3-offload_params-offload_optimizer": dict(kind="apply", stage=3, state_offload=True),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest) -> tuple[str, tuple, tuple]:
    kw = CASES[request.param]
    return request.param, _train(offload=False, **kw), _train(offload=True, **kw)


def test_training_is_bitwise_unchanged(pair) -> None:
    name, (without, _), (with_offload, _) = pair
    for a, b in zip(without, with_offload, strict=True):
        np.testing.assert_array_equal(a, b)
    start = jax.tree.leaves(_params(CASES[name]["kind"]))
    assert all(not np.array_equal(a, s) for a, s in zip(without, start, strict=True)), "the steps changed nothing"


def test_the_saved_inputs_move_to_host_and_back(pair) -> None:
    """XLA:CPU's lowering drops in-jit moves between memory kinds, so the traced program is where they
    show: each saved input's device_put to host memory, then one back to the device before the recompute;
    none without the option."""
    name, (_, plain), (_, traced) = pair
    activation = re.compile(rf"f32<host>\[(\d+,)?{B},8,{H}\]\S* = device_put")  # offload_params moves weights
    assert not activation.search(plain)
    moves = activation if CASES[name].get("state_offload") else TO_HOST
    to_host = [m.group(0) for m in moves.finditer(traced)]
    back = re.findall(r"\n\s*\S+:f32\[[^\]]*\]\S* = device_put\[\s*copy_semantics", traced)
    kw = CASES[name]
    # (B, 8, H) per data shard: with P_a the piece's cut over "model" is the compiler's, inside this type.
    assert to_host and all(re.search(rf"\[(\d+,)?{B},8,{H}\]", s) for s in to_host), to_host
    assert back, "no device_put back to the device"
    if kw["kind"] == "apply":  # one block's input each, in the forward pass
        assert len(to_host) == L


@pytest.fixture(scope="module")
def nnx_pair() -> tuple:
    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.lin = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + jnp.tanh(self.lin(x))

    class Net(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(0)
            self.blocks = nnx.List([Block(rngs) for _ in range(L)])
            self.head = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def loss(model: Net, batch: dict) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    k = jax.random.split(jax.random.key(1), 2)
    batches = [{"x": jax.random.normal(k[0], (16, 16)), "y": jax.random.normal(k[1], (16, 4))}] * 2
    out = []
    for offload in (False, True):
        adapted = zj.adapters.from_nnx(Net(), loss, layers="blocks/*")
        policy = adapted.policy(3, _mesh(), min_shard_size=0, offload_activations=offload)
        tx = zj.shard_optimizer(optax.adam(1e-2), policy)
        state, step = adapted.init_state(tx, policy), adapted.make_train_step(tx, policy)
        traced = str(step.jitted.trace(state, batches[0]).jaxpr)
        for b in batches:
            state, _ = step(state, b)
        out.append(([np.asarray(x) for x in jax.tree.leaves(zj.full_params(state))], traced))
    return out


def test_the_adapters_layers_follow_the_policy(nnx_pair) -> None:
    (without, plain), (with_offload, traced) = nnx_pair
    for a, b in zip(without, with_offload, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not TO_HOST.search(plain) and len(TO_HOST.findall(traced)) == L


# -- the TPU compiler (deviceless) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tpu_pair() -> dict:
    """A depth-8, dim-64 stage-3 scan step on v5p:2x2x2 (8 chips), lowered and compiled without and with
    (depth 8: the saved inputs outweigh one layer's temporaries, so their leaving shows in the temp)."""
    depth, dim, seq, rows = 8, 64, 64, 8  # rows per chip
    mesh = zj.topology_mesh("v5p:2x2x2")
    out = {}
    for offload in (False, True):
        policy = zj.ZeroPolicy(3, mesh, stacked="layers", min_shard_size=0, offload_activations=offload)

        def loss_fn(p: dict, batch: dict, policy=policy) -> jax.Array:
            return jnp.mean(zj.scan_layers(_block, p["layers"], batch["x"], policy) ** 2)

        params = {"layers": {"up": jax.ShapeDtypeStruct((depth, dim, 2 * dim), jnp.float32),
                             "down": jax.ShapeDtypeStruct((depth, 2 * dim, dim), jnp.float32)}}  # fmt: skip
        tx = zj.shard_optimizer(optax.sgd(0.1), policy)
        step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
        x = jax.ShapeDtypeStruct((rows * 8, seq, dim), jnp.float32, sharding=policy.batch_sharding())
        state = zj.init_state(params, tx, policy)
        lowered = step.lower(state, {"x": x})
        out[offload] = (lowered.as_text(), lowered.compile(compiler_options=step.compiler_options).memory_analysis())
        if offload:  # the planner reads the same figure from its own compile
            out["plan"] = zj.plan(step, state, {"x": x}, topology="v5p:2x2x2", grads=False)
    # Per chip: each layer's f32 input.
    out["saved"] = zj.activation_checkpoint_bytes(rows, seq, dim, depth, element_bytes=4, offload_activations=True)
    return out


def test_tpu_program_keeps_the_saved_inputs_in_host_memory(tpu_pair) -> None:
    (plain, m_off), (lowered, m_on) = tpu_pair[False], tpu_pair[True]
    host = '_xla_buffer_placement = "pinned_host"'
    assert host not in plain and host in lowered and "@annotate_device_placement" in lowered
    saved = tpu_pair["saved"].host
    assert saved == 8 * 8 * 64 * 64 * 4 and tpu_pair["saved"].host_link == 2 * saved and tpu_pair["saved"].device == 0
    assert m_off.host_temp_size_in_bytes == 0
    # libtpu 0.0.42.1 keeps this loop's stacked inputs twice (measured: 2 MiB of host temp for 1 MiB; once
    # for the reference transformer, benchmarks/results/offload_activations.txt); on the device they were
    # twice too: the temp drops by more than their size. libtpu 0.0.52's device temp drops by 0.72 of it
    # (4.06 -> 3.31 MB with the seam's ring reductions; 3.85 -> 3.03 MB, 0.78, with psum_scatter; measured
    # 2026-12-07): its buffer assignment had packed part of them already.
    assert saved <= m_on.host_temp_size_in_bytes <= 2 * saved, (m_on.host_temp_size_in_bytes, saved)
    drop = m_off.temp_size_in_bytes - m_on.temp_size_in_bytes
    old_libtpu = zj.measure.compiler_version("tpu")[1] < (0, 0, 46)
    assert drop >= (saved if old_libtpu else 0.7 * saved), (m_off.temp_size_in_bytes, m_on.temp_size_in_bytes, saved)


def test_on_tpu_each_blocks_output_waits_for_the_host_copy_of_the_inputs_before() -> None:
    # The TPU schedule's hold_host_copies (zero_jax/_layerwise/schedule.py): block i + 1's output waits for
    # block i's inputs to reach host memory, in the forward pass only; XLA:CPU's schedule holds nothing.
    mesh = zj.topology_mesh("v5p:2x2x2")
    policy = zj.ZeroPolicy(3, mesh, min_shard_size=0, offload_activations=True)

    def loss_fn(p: dict, batch: dict) -> jax.Array:
        return jnp.mean(zj.apply_layers(_block, p["layers"], batch["x"], policy) ** 2)

    tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    state = zj.init_state(jax.eval_shape(lambda: _params("apply")), tx, policy)
    x = jax.ShapeDtypeStruct((8 * B, 8, H), jnp.float32, sharding=policy.batch_sharding())
    assert step.lower(state, {"x": x}).as_text().count("stablehlo.optimization_barrier") == L - 1


# -- the argument -------------------------------------------------------------------------------------------


def test_errors_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    mesh = _mesh()
    with pytest.raises(TypeError, match="offload_activations must be True or False, got 'yes'"):
        zj.ZeroPolicy(3, mesh, offload_activations="yes")
    monkeypatch.setattr(_memory, "memory_kinds", lambda device: frozenset({"device"}))
    zj.ZeroPolicy(3, mesh)  # nothing asked of host memory: fine
    with pytest.raises(
        ValueError,
        match=r"2 problems(.|\n)*must be True or False(.|\n)*'pinned_host' memory kind, but the "
        r"'cpu' backend's devices have \['device'\]\. Drop offload_activations",
    ):
        zj.ZeroPolicy(1, mesh, offload_activations=True, partition_activations="no")


def test_the_call_keyword_is_checked() -> None:
    for stage, value, error, words in ((3, "yes", TypeError, "zj.scan_layers: offload_activations must be True, "
                                        "False or None"), (1, True, ValueError, "Pass remat=True")):  # fmt: skip
        policy = zj.ZeroPolicy(stage, _mesh(), min_shard_size=0, stacked="layers")

        def loss_fn(p: dict, batch: dict, policy=policy, value=value, remat=stage > 1) -> jax.Array:
            # Stage 1 runs layers under a plain checkpoint: offloading its inputs needs the remat.
            x = zj.scan_layers(_block, p["layers"], batch["x"], policy, offload_activations=value, remat=remat)
            return jnp.mean(x)

        tx = zj.shard_optimizer(optax.sgd(0.1), policy)
        step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
        with pytest.raises(error, match=words):
            step.lower(zj.init_state(_params("scan"), tx, policy), {"x": jnp.ones((8 * B, 8, H))})


def test_the_planner_reports_the_host_bytes_and_the_link(tpu_pair) -> None:
    plan, host = tpu_pair["plan"], tpu_pair[True][1].host_temp_size_in_bytes
    assert plan.host_activations == {3: host}
    words = f"stage 3: {fmt_bytes(host)} per device in host memory while the step runs (offload_activations), "
    assert words + f"{fmt_bytes(2 * host)} over the host link per step" in str(plan)


def test_the_formula() -> None:
    kept = zj.activation_checkpoint_bytes(2, 1024, 512, 16, partition_activations=2)
    assert kept == (16 * 2 * 1024 * 512 * 2 / 2, 0.0, 0.0)
    moved = zj.activation_checkpoint_bytes(2, 1024, 512, 16, partition_activations=2, offload_activations=True)
    assert moved == (0.0, kept.device, 2 * kept.device)
    with pytest.raises(TypeError, match="offload_activations must be True or False"):
        zj.activation_checkpoint_bytes(1, 1, 1, 1, offload_activations="yes")
