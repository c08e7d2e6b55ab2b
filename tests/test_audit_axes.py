"""The audit on a mesh with model axes (issue 16): each compiled collective
attributed to the exact mesh axes it spans, bytes per axis and kind, and the
two ZeRO+TP violations (a weight gathered across the model axis, a
gradient-sized all-reduce over data), on small programs built by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax import measure as _measure
from zero_jax._audit import communication as _comm_audit
from zero_jax._audit import model_axes as _model_axes
from zero_jax._audit import report as _report
from zero_jax._audit import violations as _violations
from zero_jax._layout.leaf import leaf_layout

ROWS, COLS = 64, 32  # the global operand of the hand-built programs


def _mesh(shape, model_type=AxisType.Explicit):
    return jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Explicit, model_type))


def _every_collective(mesh):
    """psum / all_gather / psum_scatter / ppermute over data, over model and over both."""

    def body(x):
        outs = [
            jax.lax.psum(x, "data"),
            jax.lax.psum(x, "model"),
            jax.lax.psum(x, ("data", "model")),
            jax.lax.all_gather(x, "data", tiled=True),
            jax.lax.all_gather(x, "model", tiled=True),
            jax.lax.psum_scatter(x, "data", tiled=True),
            jax.lax.psum_scatter(x, ("data", "model"), tiled=True),
            jax.lax.ppermute(x, "model", [(0, 1), (1, 0)]),
        ]
        return sum(jnp.sum(o) for o in outs)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "model"), out_specs=P(), check_vma=False))
    x = jax.device_put(jnp.ones((ROWS, COLS)), NamedSharding(mesh, P("data", "model")))
    return _measure.collectives(step, x)


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_each_collective_is_attributed_to_the_axes_its_groups_span(shape):
    mesh = _mesh(shape)
    n, m = shape
    local = ROWS * COLS * 4 // (n * m)  # bytes of one device's f32 block
    ring = lambda k: (k - 1) / k  # noqa: E731
    colls = [c for c in _every_collective(mesh) if c.shape]  # the scalar sum's all-reduces aside
    got = sorted((c.kind, c.axes(mesh), c.bytes, c.total_ring_bytes) for c in colls)
    expected = sorted([
        ("all-reduce", ("data",), local, 2 * ring(n) * local),
        ("all-reduce", ("model",), local, 2 * ring(m) * local),
        ("all-reduce", ("data", "model"), local, 2 * ring(n * m) * local),
        ("all-gather", ("data",), local * n, ring(n) * local * n),
        ("all-gather", ("model",), local * m, ring(m) * local * m),
        ("reduce-scatter", ("data",), local, ring(n) * local),
        ("reduce-scatter", ("data", "model"), local, ring(n * m) * local),
        ("collective-permute", ("model",), local, float(local)),  # its pairs differ along model only
    ])  # fmt: skip
    assert got == expected
    per_kind = _measure.ring_bytes_per_axis_kind(colls, mesh)
    assert per_kind == {
        "data": {
            "all-reduce": 2 * ring(n) * local,
            "all-gather": ring(n) * local * n,
            "reduce-scatter": ring(n) * local,
        },
        "model": {"all-reduce": 2 * ring(m) * local, "all-gather": ring(m) * local * m, "collective-permute": local},
        "data+model": {"all-reduce": 2 * ring(n * m) * local, "reduce-scatter": ring(n * m) * local},
    }
    assert _measure.ring_bytes_per_axis(colls, mesh) == {k: sum(v.values()) for k, v in per_kind.items()}
    if shape == (4, 2):  # by hand: 1 KiB blocks
        assert _measure.ring_bytes_per_axis(colls, mesh) == {"data": 5376.0, "model": 3072.0, "data+model": 2688.0}


@pytest.mark.parametrize(
    ("groups", "axes", "size"),
    [
        ("replica_groups={{0,2,4,6},{1,3,5,7}}", ("data",), 4),
        ("replica_groups=[4,2]<=[8]", ("model",), 2),
        ("replica_groups=[2,4]<=[4,2]T(1,0)", ("data",), 4),
        ("replica_groups=mesh['data'=4,'model'=2]{'model'}", ("model",), 2),
        ("replica_groups=mesh['data'=4,'model'=2]{'data'}", ("data",), 4),
        ("replica_groups=mesh['data'=4,'model'=2]{'data','model'}", ("data", "model"), 8),
        ("replica_groups={}", ("data", "model"), 8),  # every device
    ],
)
def test_every_replica_group_spelling_names_its_axes(groups, axes, size):
    line = (
        f'  %ar = f32[16,16]{{1,0}} all-reduce(%p), channel_id=1, {groups}, to_apply=%add, metadata={{op_name="psum"}}'
    )
    (c,) = _measure.parse_collectives(f"ENTRY %main {{\n{line}\n}}", 8)
    assert (c.axes(_mesh((4, 2))), c.group_size, c.op_name) == (axes, size, "psum")


# -- the two ZeRO+TP violations, on hand-built programs ----------------------------------------------------------


def _weight(policy):
    """A (64, 32) weight, ZeRO'd over data on dim 0 and column-parallel over model."""
    lay = leaf_layout((ROWS, COLS), jnp.float32, policy.num_shards)
    return _violations.ParamInfo("w", lay, np.dtype(np.float32), False, False, (1, 2))


def _gather_program(mesh, nested):
    """A data-only shard_map (model axis Auto) gathering a P("data", "model")
    weight over data: straight (XLA gathers it across model first) or in a
    shard_map nested over model (each device keeps its model shard)."""

    def gather(w):
        if not nested:
            return jax.lax.all_gather(w, "data", tiled=True)
        over_data = lambda v: jax.lax.all_gather(v, "data", tiled=True)  # noqa: E731
        return jax.shard_map(over_data, in_specs=P(None, "model"), out_specs=P(None, "model"), axis_names={"model"})(w)

    def body(w, x):
        return jax.lax.psum(jnp.sum((x @ gather(w)) ** 2), "data")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(), axis_names={"data"}))
    w = jax.device_put(jnp.ones((ROWS, COLS)), NamedSharding(mesh, P("data", "model")))
    x = jax.device_put(jnp.ones((16, ROWS)), NamedSharding(mesh, P("data")))
    return _measure.collectives(step, w, x)


def test_a_weight_gathered_across_the_model_axis_is_flagged():
    mesh = _mesh((4, 2), AxisType.Auto)
    policy = zj.ZeroPolicy(stage=3, mesh=mesh, axis="data")
    assert policy.model_axes == ("model",) and policy.model_parallel == 2
    colls = _gather_program(mesh, nested=False)
    per_axis = _measure.ring_bytes_per_axis([c for c in colls if c.shape], mesh)
    # The data piece (16, 32) is gathered whole over model, then the whole weight over data: 2x the theory.
    assert per_axis == {"model": 0.5 * 16 * COLS * 4, "data": 0.75 * ROWS * COLS * 4}
    (v,) = _model_axes.model_gather_violations(colls, [_weight(policy)], policy)
    assert v.kind == _report.MODEL_AXIS_GATHER
    # jax 0.12 names the partitioner's gather for the shard_map whose operand it gathers, 0.10.2 for its collective
    op = "op all_gather" if _measure.compiler_version("cpu")[1] < (0, 12) else "op shard_map"
    for part in ("all-gather", op, "f32[16,32]", "2.00 KiB", "runs over mesh axes ('model',)", "'w'",
                 "shard_map nested over the leaf's model axes"):  # fmt: skip
        assert part in v.message, (part, v.message)


def test_a_weight_gathered_in_a_shard_map_nested_over_model_passes():
    mesh = _mesh((4, 2), AxisType.Auto)
    policy = zj.ZeroPolicy(stage=3, mesh=mesh, axis="data")
    colls = _gather_program(mesh, nested=True)
    per_axis = _measure.ring_bytes_per_axis([c for c in colls if c.shape], mesh)
    assert per_axis == {"data": 0.75 * ROWS * COLS // 2 * 4}  # the local model shard (64, 16) only: the theory / M
    assert _model_axes.model_gather_violations(colls, [_weight(policy)], policy) == []


def test_a_gradient_sized_all_reduce_over_data_is_flagged_not_the_models_own():
    mesh = _mesh((4, 2), AxisType.Auto)

    def body(g, a):
        g = jax.lax.psum(g, "data")  # the gradient's model shard all-reduced over data: what stage 1 must not do
        over_model = lambda v: jax.lax.psum(v, "model")  # noqa: E731
        a = jax.shard_map(over_model, in_specs=P("model"), out_specs=P(), axis_names={"model"})(a)  # the model's own
        return jnp.sum(g) + jnp.sum(a)

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"}, check_vma=False)
    )
    g = jax.device_put(jnp.ones((ROWS, COLS)), NamedSharding(mesh, P(None, "model")))
    a = jax.device_put(jnp.ones((4 * 2 * 64, COLS)), NamedSharding(mesh, P("data")))
    colls = tuple(_measure.collectives(step, g, a))
    assert sorted((c.shape, c.axes(mesh)) for c in colls if c.shape) == [((64, 16), ("data",)), ((64, 32), ("model",))]
    policy = zj.ZeroPolicy(stage=1, mesh=mesh, axis="data")
    (v,) = _violations.all_reduce_violations(colls, {}, [_weight(policy)], 1024, policy)
    assert v.kind == _report.GRADIENT_ALL_REDUCE
    for part in ("op psum", "f32[64,16]", "4.00 KiB", "over data", "the shape of w", ">= 1024 elements"):
        assert part in v.message, (part, v.message)
    # Stage 0 all-reduces by design; the communication theory counts only ZeRO's side.
    assert _violations.all_reduce_violations(colls, {}, [_weight(policy)], 1024, policy.replace(stage=0)) == []
    comm = _comm_audit.communication(colls, [_weight(policy)], policy, None, None, 1)
    assert comm.measured == 2 * 0.75 * 64 * 16 * 4  # the model axis's 8 KiB all-reduce is not ZeRO's
    # stage 1 on the weight's model shard (64, 16): reduce-scatter + all-gather, (N-1)/N each
    assert comm.theory == 2 * 0.75 * 64 * 16 * 4


def test_model_shards_from_shardings():
    mesh = _mesh((2, 4))
    split = _model_axes.split_of(NamedSharding(mesh, P(("data", "model"), None)), 2, ("model",))
    assert split == (4, 1)
    assert _model_axes.split_of(NamedSharding(mesh, P()), 3, ("model",)) == (1, 1, 1)
    assert _model_axes.split_of(None, 2, ("model",)) == (1, 1)
    assert _model_axes.local_shape((8, 64, 32), (1, 4, 1)) == (8, 16, 32)
    assert _model_axes.local_shape((64, 32), (1, 4, 1)) == (16, 32)  # one layer of a stacked leaf
    policy = zj.ZeroPolicy(stage=3, mesh=_mesh((4, 2)), axis="data")
    assert _model_axes.weight_shapes(_weight(policy), 4) == {(64, 32), (16, 32)}
    leaf = _report.LeafBytes("optimizer", "opt_state/mu/w", (64, 32), "float32", 8192, 4096, model_split=2)
    assert leaf.replicated  # whole on its model shard: replicated over data


# -- a real data-only step: nothing changes at M = 1 ----------------------------------------------------------


@pytest.fixture(scope="module")
def data_only_report():
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    policy = zj.ZeroPolicy(stage=3, mesh=mesh)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state({"w": jnp.zeros((256, 64)), "b": jnp.zeros(64)}, tx, policy)
    step = zj.make_train_step(lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, policy)
    return zj.audit(step, state, jnp.ones((16, 256))).check()


def test_data_only_step_reports_as_before(data_only_report):
    r = data_only_report
    assert r.model_axes == () and r.model_parallel == 1
    assert set(r.comm_per_axis_kind) == {"data"} and set(r.comm_per_axis) == {"data"}
    assert r.comm.measured == _measure.ring_bytes(r.collectives) == sum(r.comm_per_axis_kind["data"].values())
    # theory by hand: w (256, 64) reduce-scattered and gathered twice, b (64) kept whole and all-reduced
    assert r.comm.theory == pytest.approx(7 / 8 * 4 * (3 * 256 * 64 + 2 * 64), rel=1e-12)
    f = zj.model_state_bytes(256 * 64 + 64, 8, 3, **r.bytes_per_param)
    assert r.formula == {"params": f.params, "grads": f.grads, "optimizer": f.optimizer}
    text = str(r)
    assert "M =" not in text and "by mesh axes" not in text and "model" not in text
    assert "check: passed" in text


def test_report_text_with_a_model_axis(data_only_report):
    r = dataclasses.replace(
        data_only_report, model_axes=("model",), model_parallel=2, params_per_model_shard=16448 / 2,
        comm_per_axis_kind={"data": {"all-gather": 3072.0, "reduce-scatter": 1536.0}, "model": {"all-reduce": 2048.0}},
    )  # fmt: skip
    text = str(r)
    assert "N = 8, M = 2 (model axes model), Φ = 16,448 parameters (8,224 per model shard: Φ / 2)" in text
    assert "ZeRO formula per model shard" in text
    assert "over the data axes" in text and "(ZeRO formula per model shard, M = 2)" in text
    assert "    data              4.50 KiB  (all-gather 3.00 KiB, reduce-scatter 1.50 KiB; ZeRO's side)" in text
    assert "    model             2.00 KiB  (all-reduce 2.00 KiB; the model's own layout)" in text
    assert "no weight gathered across a model axis" in text


def test_a_step_on_a_data_model_mesh_without_model_specs_keeps_every_leaf_whole_per_model_shard():
    """No leaf is model-sharded: Φ per model shard is Φ, the data axis moves
    the N = 4 theory and the model axis nothing (the batch is replicated over it)."""
    mesh = _mesh((4, 2), AxisType.Auto)
    policy = zj.ZeroPolicy(stage=3, mesh=mesh)
    tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    state = zj.init_state({"w": jnp.zeros((256, 64)), "b": jnp.zeros(64)}, tx, policy)
    step = zj.make_train_step(lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, policy)
    r = zj.audit(step, state, jnp.ones((16, 256))).check()
    assert (r.model_axes, r.model_parallel, r.params_per_model_shard) == (("model",), 2, 256 * 64 + 64)
    assert set(r.comm_per_axis) == {"data"}
    assert r.comm.theory == pytest.approx(3 / 4 * 4 * (3 * 256 * 64 + 2 * 64), rel=1e-12)
    f = zj.model_state_bytes(256 * 64 + 64, 4, 3, **r.bytes_per_param)
    assert r.formula == {"params": f.params, "grads": f.grads, "optimizer": f.optimizer}
    assert "M = 2 (model axes model)" in str(r) and "no weight gathered across a model axis" in str(r)
