"""``zj.audit``: proof from the compiled program that a step keeps its stage's contract.

The two failures users report against ZeRO implementations are silent: a
"ZeRO-1" whose optimizer state is replicated after all, and gradients
all-reduced whole (or once per microbatch) when they should be
reduce-scattered once. Both are visible in the program XLA actually runs, so
the audit reads them there:

* bytes: what each device holds of the state (parameters, gradients,
  optimizer state, other), measured on the arrays (or, for abstract inputs,
  on their shardings), and ``compiled.memory_analysis()``;
* communication: every collective of the program right after SPMD
  partitioning, with the trip counts of the loops around it, beside the
  stage's theory (:mod:`zero_jax._audit.violations`);
* the per-layer schedule (``report.layers``, stages 2–3): for each block
  (``zj.apply_layer(s)``, named ``zj_block<i>_*`` in the compiled program),
  scan (``zj.scan_layers``) or repeated block of the parameter tree, the
  all-gathers and reduce-scatters per step, and the most whole layers alive
  at once in the compiled (scheduled) program; a stage-3 manual step holding
  more than ``prefetch + 1`` fails the check;
* the backend's own program (``report.compiled``, ``report.overlap``): every
  collective of the compiled program however the backend spells it
  (:mod:`zero_jax._audit.compiled`: on TPU async continuation fusions, and
  reduce-scatters decomposed into all-reduce + dynamic-slice, which move twice
  the bytes), per kind beside the post-SPMD figure; and for each layer
  gather and reduction whether compute is scheduled between its start and its
  done (:func:`zero_jax._audit.schedule.layer_overlap`). Reported, not
  judged: ``check()`` judges the step's own collectives.
* fragmentation (``report.memory["allocated"]``, ``["live_peak"]``,
  ``["fragmentation"]``, ``report.fragmentation``): the device memory the
  buffer assignment allocates beside XLA's live peak (the values alive at once
  at the busiest point, ``HloLiveRange``), both read from the compile's dump;
  the text names the largest buffers alive at the peak when allocation
  exceeds it by more than 10% (:mod:`zero_jax._audit.memory`). Reported, not
  judged;
* communication buffers (``report.buffers``, ZeRO's constant-size buffers):
  per layer-wise block the collectives it runs per step by kind, in the
  post-SPMD program and as compiled ops, and the largest single buffer of the
  step (:mod:`zero_jax._audit.buffers`); ``report.check(max_buffer_bytes=...)``
  flags each buffer over the bound.

A step built on a TPU topology's devices
(``jax.experimental.topologies.get_topology_desc("v5p:2x2x2",
platform="tpu").devices`` in a ``Mesh``, abstract state from
``zj.init_state`` on ``ShapeDtypeStruct``s) is compiled by libtpu without a
TPU and audited the same way; ``compiler_options=`` passes libtpu's options
(async all-gathers: see :func:`audit`).

On a mesh with model axes (every axis that is neither the data nor the
replica axis: tensor, sequence, expert parallelism; M the product of their
sizes) the contract is per model shard (:mod:`zero_jax._audit.model_axes`): bytes
against the ZeRO formula for each leaf's model shard (the formula / M when
every leaf is cut M ways), ZeRO's collectives (those spanning a data or
replica axis) against the theory for those bytes, communication reported by
the exact mesh axes each collective spans and by kind, a collective over
model axes only counted as the model's own; a weight gathered whole across a
model axis fails the check, as does a gradient-sized all-reduce over data.

On a quantized wire (``ZeroPolicy(quantize_weights="int8",
quantize_grads="int8")``, ZeRO++'s qwZ / qgZ) the report gives the wire dtype
and bytes per collective kind (``report.wire_bytes()``: int8 values and their
float32 scales apart; ``report.wire_roles``), the theory counts each quantized
pass at its int8 blocks and scales (:mod:`zero_jax._audit.communication`), and a
collective the policy asks to be int8 that runs in a float dtype (a weight's
all-gather, a gradient's reduce-scatter / all-to-all / all-reduce over data)
fails the check: the bytes on the wire are proven, not assumed.

``report.check()`` raises :class:`AuditError` listing every violation. The
report types live in :mod:`zero_jax._audit.report`.

Example (stage 2 on 8 simulated devices):

>>> import jax, jax.numpy as jnp, optax, zero_jax as zj
>>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
>>> policy = zj.ZeroPolicy(stage=2, mesh=mesh)
>>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
>>> state = zj.init_state({"w": jnp.zeros((256, 64)), "b": jnp.zeros(64)}, tx, policy)
>>> step = zj.make_train_step(lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2), tx, policy)
>>> report = zj.audit(step, state, jnp.ones((16, 256))).check()
>>> report.state_bytes["grads"], report.state_bytes["optimizer"]  # w cut 8 ways, b kept whole
(8448, 16900)
>>> round(report.comm.ratio, 3)
1.0
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from zero_jax._audit import hlo
from zero_jax._audit.buffers import comm_buffers
from zero_jax._audit.communication import comm_violation, communication, formula_inputs, wire_roles, wire_violations
from zero_jax._audit.compiled import CompiledProgram, read_compiled
from zero_jax._audit.estimate import StepEstimate, estimate_from_schedule
from zero_jax._audit.hlo import Collective
from zero_jax._audit.memory import LivePeak
from zero_jax._audit.memory import memory as memory_figures
from zero_jax._audit.model_axes import model_gather_violations, split_of
from zero_jax._audit.report import (
    CATEGORIES,
    FIELD_CATEGORY,
    PEAK_BUFFERS_SHOWN,
    AuditReport,
    CompiledComm,
    CompiledKind,
    Fragmentation,
    LeafBytes,
    ParamInfo,
    PeakBuffer,
    Violation,
)
from zero_jax._audit.schedule import layer_overlap, layer_schedule
from zero_jax._audit.violations import (
    accum_violations,
    all_reduce_violations,
    layer_violations,
    partitioned_categories,
    replicated_violations,
    stacked_paths,
    whole_paths,
)
from zero_jax._base.tree import PyTree, check_live, key_name, path_str, under_any
from zero_jax._base.units import is_whole_number
from zero_jax._layerwise.schedule import read_only_options, schedule_for
from zero_jax._layout.leaf import DEFAULT_MIN_SHARD_SIZE, is_codes, is_float, is_layout
from zero_jax._policy.placement import place_batch
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._step.optimizer import frozen_leaves
from zero_jax._step.train import StepFacts, TrainStep
from zero_jax._theory.formulas import comm_bytes, model_state_bytes

NO_POLICY = (
    "audit: cannot tell the step's ZeroPolicy: pass policy=... (a zj.ZeroPolicy) for a step that is "
    "not made by zj.make_train_step; got {kind}."
)
NOT_JITTED = (
    "audit: train_step must be jax.jit-wrapped (have .lower), got {kind}. "
    "Pass the step from zj.make_train_step or wrap your step with jax.jit."
)

Totals = dict[str, dict[Any, int]]  # category -> device -> bytes

# -- measuring -------------------------------------------------------------------------------------------------


def _is_abstract(leaf: Any) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def _device_bytes(leaf: Any) -> dict[Any, int]:
    """Bytes each device holds of one leaf (measured shards, or the shard
    shape of an abstract leaf's sharding)."""
    if hasattr(leaf, "addressable_shards"):
        out: dict[Any, int] = {}
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
        return out
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return {None: math.prod(shape) * dtype.itemsize}
    piece = math.prod(sharding.shard_shape(shape)) * dtype.itemsize
    return dict.fromkeys(sharding.device_set, piece)


def _category(path: tuple[Any, ...]) -> str:
    return FIELD_CATEGORY.get(key_name(path[0]), "other") if path else "other"


def _field(state: Any, name: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(name)
    return getattr(state, name, None)


def _leaves(tree: PyTree, category: str | None, model: tuple[str, ...] = ()) -> tuple[list[LeafBytes], Totals]:
    leaves: list[LeafBytes] = []
    totals: Totals = {c: {} for c in CATEGORIES}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            continue
        cat = category or _category(path)
        per = _device_bytes(leaf)
        kind = getattr(getattr(leaf, "sharding", None), "memory_kind", None) or "device"
        if kind == "device":  # offloaded leaves are host bytes: see AuditReport.host_bytes
            for d, b in per.items():
                totals[cat][d] = totals[cat].get(d, 0) + b
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        name = path_str(path) if category is None else f"{category}/{path_str(path)}"
        cuts = split_of(getattr(leaf, "sharding", None), len(leaf.shape), model)
        split = math.prod(cuts)
        leaves.append(
            LeafBytes(
                cat,
                name,
                tuple(leaf.shape),
                str(np.dtype(leaf.dtype)),
                nbytes,
                max(per.values()),
                kind,
                split,
                tuple(c > 1 for c in cuts),
            )  # fmt: skip
        )
    return leaves, totals


def measure_grads(train_step: Any, state: Any, batch: Any, abstract: bool, options: dict[str, Any]) -> PyTree:
    """The gradient as the step holds it: the arrays ``train_step.grads``
    returns, or for abstract inputs its compiled output shardings."""
    if hlo.on_cpu((state, batch)):  # only the outputs' shardings and bytes are read
        options = {**options, **read_only_options(jax.devices("cpu"))}
    # The batch enters as the step's own call takes it (a batch placed on an Explicit mesh would otherwise
    # carry that mesh into this outer program, which jax 0.12 then fails to lower).
    shardings = train_step.policy.batch_sharding(batch)
    batch = place_batch(batch, shardings)
    outer = jax.jit(train_step.grads, in_shardings=(None, shardings))
    compiled = outer.lower(state, batch).compile(compiler_options=options)
    return compiled.out_info if abstract else compiled(state, batch)


def _state_leaves(
    train_step: Any, state: Any, batch: Any, grads: Any, abstract: bool, options: dict[str, Any], model: tuple[str, ...]
) -> tuple[list[LeafBytes], Totals]:
    """Every state leaf (and gradient leaf, unless ``grads`` is ``False``) with
    its bytes; ``totals`` has no ``"grads"`` when gradients were not measured."""
    leaves, totals = _leaves(state, None, model)
    if grads is None and isinstance(train_step, TrainStep):
        grads = measure_grads(train_step, state, batch, abstract, options)
    if grads is not None and grads is not False:
        g_leaves, g_totals = _leaves(grads, "grads", model)
        leaves += g_leaves
        totals["grads"] = g_totals["grads"]
    else:
        del totals["grads"]
    return leaves, totals


def _frozen(tx: Any, layout_tree: PyTree, count: int) -> list[bool]:
    """Which parameters the step's optimizer never changes (no gradient, no
    reduction): ``zj.frozen_leaves`` of the optax transformation; none if unknown."""
    if tx is None:
        return [False] * count
    logical = jax.tree.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype), layout_tree, is_leaf=is_layout)
    try:
        flags = [bool(f) for f in jax.tree.leaves(frozen_leaves(tx, logical))]
    except Exception:  # an optimizer the analysis cannot trace: assume nothing is frozen
        return [False] * count
    return flags if len(flags) == count else [False] * count


def _param_infos(facts: StepFacts, state: Any) -> list[ParamInfo]:
    """The float parameters with their layouts: the state's own record, else the policy's rule."""
    policy = facts.policy
    params = _field(state, "params")
    record = _field(state, "layouts")
    layout_tree = record.tree() if hasattr(record, "tree") else policy.layouts(params)
    layout_pairs = jax.tree_util.tree_flatten_with_path(layout_tree, is_leaf=is_layout)[0]
    param_leaves = jax.tree.leaves(params)
    if len(param_leaves) != len(layout_pairs):
        raise ValueError("audit: the state's params do not match its layouts; build the state with zj.init_state.")
    frozen, model = _frozen(facts.tx, layout_tree, len(layout_pairs)), policy.model_axes
    return [
        ParamInfo(
            path_str(p),
            lay,
            np.dtype(leaf.dtype),
            fz,
            under_any(p, policy.stacked_prefixes),
            split_of(getattr(leaf, "sharding", None), len(lay.shape), model),
            policy.comm.cast,
        )  # fmt: skip
        for (p, lay), leaf, fz in zip(layout_pairs, param_leaves, frozen, strict=True)
        if is_float(lay.dtype) or is_codes(lay.dtype)
    ]


def _frozen_bytes(leaves: list[LeafBytes], params: list[ParamInfo]) -> int:
    """Bytes per device of the frozen parameters (each leaf's most on a device, summed)."""
    frozen = {f"params/{p.path}" for p in params if p.frozen}
    return sum(leaf.per_device for leaf in leaves if leaf.category == "params" and leaf.path in frozen)


def _grad_bytes(leaves: list[LeafBytes], params: list[ParamInfo]) -> float:
    g = [leaf for leaf in leaves if leaf.category == "grads" and is_float(leaf.dtype)]
    phi = sum(math.prod(p.layout.shape) for p in params)
    if len(g) != len(params):
        return sum(leaf.nbytes for leaf in g) / max(phi, 1)
    return (
        sum(math.prod(p.layout.shape) * np.dtype(leaf.dtype).itemsize for leaf, p in zip(g, params, strict=True)) / phi
    )


def _bytes_per_param(
    leaves: list[LeafBytes], params: list[ParamInfo], policy: ZeroPolicy, grads_measured: bool
) -> dict[str, float]:
    """``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` as this run stores them."""
    phi = sum(math.prod(p.layout.shape) for p in params)
    opt_float = sum(leaf.nbytes for leaf in leaves if leaf.category == "optimizer" and is_float(leaf.dtype))
    cut = policy.partitions_opt_state
    stored_phi = sum(
        math.prod(p.layout.stored_shape if (cut and p.layout.partitioned) else p.layout.shape) for p in params
    )
    per_param = {"param_bytes": sum(math.prod(p.layout.shape) * p.dtype.itemsize for p in params) / max(phi, 1)}
    if grads_measured:
        per_param["grad_bytes"] = _grad_bytes(leaves, params)
    per_param["optimizer_bytes"] = opt_float / max(stored_phi, 1)
    return per_param


def _formula(params: list[ParamInfo], policy: ZeroPolicy, per_param: Mapping[str, float]) -> dict[str, float]:
    """:func:`zero_jax.model_state_bytes` for this policy and bytes per
    parameter, on one model shard's Φ: each leaf's elements / how many ways
    model axes cut it (Φ / M when every leaf is cut M ways; Φ without model axes)."""
    phi = sum(math.prod(p.layout.shape) / p.model_split for p in params)
    if not phi:
        return {}
    f = model_state_bytes(
        phi, policy.num_shards, policy.stage,
        param_bytes=per_param["param_bytes"],
        grad_bytes=per_param.get("grad_bytes", 0.0),
        optimizer_bytes=per_param["optimizer_bytes"],
        replicas=policy.num_replicas,
        optimizer_over_replicas=policy.optimizer_over_replicas,
    )  # fmt: skip
    return {"params": f.params, "optimizer": f.optimizer} | ({"grads": f.grads} if "grad_bytes" in per_param else {})


# -- the audit --------------------------------------------------------------------------------------------------


def audit(
    train_step: Any,
    state: Any,
    batch: PyTree,
    *,
    grads: Any = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    tolerance: float = 0.02,
    prefetch: int | None = None,
    fast_compile: bool = True,
    policy: ZeroPolicy | None = None,
    accum_mode: str | None = None,
    accum_steps: int | None = None,
    reduce_dtype: Any = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> AuditReport:
    """Compile ``train_step(state, batch)`` and report what it holds and sends.

    A step made by :func:`zero_jax.make_train_step` says what it is (its
    policy, gather mode, accumulation, precision and optimizer:
    ``train_step.facts``); the last four arguments are for any other
    ``jax.jit`` step, or to judge a step by other facts than its own.

    Args:
      train_step: a :func:`zero_jax.make_train_step` step, or any
        ``jax.jit``-wrapped ``step(state, batch)`` (then pass ``policy``, or
        give the state a ``policy`` field).
      state: the state, concrete arrays or ``jax.ShapeDtypeStruct``s with
        shardings (``zj.init_state`` on abstract parameters makes those; then
        nothing is allocated and bytes are read from the shardings). Its
        fields are sorted into categories by name: ``params``; ``opt_state``
        and ``master`` (optimizer, as ZeRO counts them); anything else
        "other".
      batch: the global batch (arrays or ``ShapeDtypeStruct``s).
      grads: ``None`` measures ``train_step.grads(state, batch)`` for a
        zero_jax step; ``False`` skips gradients; or pass the gradient tree.
      min_shard_size: the size (elements) from which the audit calls a float
        leaf partitionable. By default the library's default threshold, so a
        policy built with a larger ``min_shard_size`` that keeps such leaves
        whole *fails* the check; pass the policy's own value to accept it.
        It also bounds the all-reduce check: in stages 1–3 an all-reduce over
        the data (or replica) axes of at least this many elements (or of the
        smallest partitioned leaf's model shard, if smaller) is a
        gradient-sized all-reduce; one over model axes only is the model's
        own. (An optimizer that reduces statistics across a parameter, like
        Adafactor's factored moments, may all-reduce vectors that large and
        be flagged.)
      tolerance: communication may exceed the theory by this fraction.
      prefetch: how many blocks ahead the step's ``zj.apply_layers`` /
        ``zj.scan_layers`` gather; a stage-3 ``gather="manual"`` step (not
        accumulating locally) may hold ``prefetch + 1`` whole layers at once
        (``report.layers``). ``None``: 1, the layer primitives' default; pass
        the step's own value if it prefetches more.
      fast_compile: compile with LLVM optimisation off
        (``xla_backend_optimization_level=0``): the same HLO, buffer
        assignment and ``memory_analysis()``, about 3x faster on CPU.
      policy: the policy to judge by (default: the step's, else
        ``state.policy``).
      accum_mode, accum_steps: gradient accumulation (default: the step's;
        none for a foreign step). With ``"local"`` gradients must be reduced
        once per step, so a gradient reduction inside a loop of
        ``accum_steps`` trips (the outermost loop around it) is a violation;
        in other modes the theory counts one reduction per microbatch.
      reduce_dtype: the dtype gradients are reduced in (default: the
        policy's ``precision.reduce_dtype``).
      compiler_options: passed to ``lowered.compile(...)`` (with
        ``fast_compile``'s), e.g. libtpu's async all-gather options
        ``{"xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
        "xla_enable_async_all_gather": "true"}``: the audit then reads the
        program those options make (``report.overlap``).

    Returns:
      An :class:`AuditReport`; ``report.check()`` raises on violations.
    See the module docstring for an example.
    """
    check_live(state, where="zj.audit")
    facts = step_facts(train_step, state, policy=policy, accum_mode=accum_mode, accum_steps=accum_steps)
    policy, accum_mode, steps = facts.policy, facts.accum_mode, facts.accum_steps
    if not 0 <= tolerance < 1:
        raise ValueError(f"audit: tolerance must be in [0, 1), got {tolerance!r}.")
    policy.check_batch(batch, where="audit")
    prefetch = _prefetch(prefetch)

    with policy.program_mesh():  # the step's own mesh context, whatever jax.set_mesh says
        abstract = any(_is_abstract(x) for x in jax.tree.leaves(state))
        options = (dict(hlo.FAST_COMPILE) if fast_compile else {}) | dict(compiler_options or {})
        memory, colls, loops, scheduled, peak, estimate = _program(train_step, state, batch, policy, options)
        program = read_compiled(scheduled, policy.mesh.size)
        fragmentation = _fragmentation(memory, peak, program)
        leaves, totals = _state_leaves(train_step, state, batch, grads, abstract, options, policy.model_axes)
        params = _param_infos(facts, state)
        phi = sum(math.prod(p.layout.shape) for p in params)
        if reduce_dtype is None:
            reduce_dtype = policy.precision.reduce_dtype  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        comm = communication(colls, params, policy, reduce_dtype, accum_mode, steps)
        comm, roles = dataclasses.replace(comm, formula=_comm_formula(params, policy)), wire_roles(colls, policy)
        per_param = _bytes_per_param(leaves, params, policy, "grads" in totals)

        cats = partitioned_categories(policy)
        violations = _program_violations(colls, loops, leaves, params, policy, min_shard_size, roles)
        violations += comm_violation(comm, policy.stage, tolerance)
        violations += accum_violations(colls, loops, steps, policy) if accum_mode == "local" and steps > 1 else []
        layers = layer_schedule(program, params, policy, prefetch)
        # gather="all" and local accumulation (one gather per step) hold the whole model by design.
        layerwise = facts.gather != "all" and not (accum_mode == "local" and steps > 1)
        violations += layer_violations(layers, policy, layerwise)
        buffers = comm_buffers(colls, program, policy.bucket_bytes)  # pyright: ignore[reportArgumentType] - ZeroPolicy normalizes bucket_bytes to an int
        if policy.bucket_bytes is not None:
            violations += buffers.over(policy.bucket_bytes, single_alone=True, what="bucket_bytes")  # pyright: ignore[reportArgumentType] - ZeroPolicy normalizes bucket_bytes to an int
        return AuditReport(
            stage=policy.stage, num_devices=policy.num_shards, num_params=phi, **_state_bytes(leaves, totals),
            formula=_formula(params, policy, per_param), bytes_per_param=per_param, leaves=tuple(leaves),
            replicated=tuple(x for x in leaves if x.category in cats and is_float(x.dtype) and x.replicated),
            memory=memory, collectives=colls, loops=loops, comm=comm,
            violations=tuple(violations), **_by_axes(colls, params, policy),
            min_shard_size=min_shard_size, tolerance=tolerance, accum_mode=accum_mode, accum_steps=steps,
            abstract=abstract, layers=layers, wire=policy.wire, wire_roles=roles,
            compiled=compiled_comm(program, colls, comm.theory, policy), overlap=layer_overlap(program, params, policy),
            fragmentation=fragmentation, buffers=buffers, schedule=schedule_for(policy).describe(),
            estimate=estimate, whole_matrices=tuple("/".join(p) for p in sorted(whole_paths(params))),
            frozen_bytes=_frozen_bytes(leaves, params),
        )  # fmt: skip


def compiled_comm(
    program: CompiledProgram, colls: tuple[Collective, ...], theory: float, policy: ZeroPolicy
) -> CompiledComm:
    """What the compiled program sends per kind (:class:`CompiledComm`),
    beside the post-SPMD collectives ``colls`` and the theory."""
    rows: dict[str, list[Any]] = {}
    for c in program.collectives:
        r = rows.setdefault(c.kind, [set(), 0, 0, 0.0, set(), 0, 0])
        r[0].add((c.computation, c.name))
        r[1] += c.trips
        r[2] += c.bytes * c.trips
        r[3] += c.total_ring_bytes
        r[4].add(c.dtype)
        r[5] += c.trips * c.is_async
        r[6] += c.trips * c.decomposed
    kinds = tuple(
        CompiledKind(kind, len(r[0]), r[1], r[2], r[3], tuple(sorted(r[4])), r[5], r[6])
        for kind, r in sorted(rows.items())
    )
    device = policy.mesh.devices.flat[0]
    kind = getattr(device, "device_kind", "")
    backend = device.platform + (f" ({kind})" if kind and kind.lower() != device.platform else "")
    return CompiledComm(backend, kinds, hlo.ring_bytes(colls), theory)


def _comm_formula(params: list[ParamInfo], policy: ZeroPolicy) -> float:
    """The planner's model-level communication for this Φ per model shard and
    wire format (reported beside the per-leaf theory, not judged)."""
    phi, dtype_bytes = formula_inputs(params)
    if not phi or policy.num_shards <= 1:
        return 0.0
    w = policy.wire
    return comm_bytes(
        phi, policy.num_shards, policy.stage, dtype_bytes=dtype_bytes,
        quantize_weights=w.weights, quantize_grads=w.grads, quant_block=w.block,
    )  # fmt: skip


def _by_axes(colls: tuple[Collective, ...], params: list[ParamInfo], policy: ZeroPolicy) -> dict[str, Any]:
    """The report's fields about mesh axes: communication per axis (and kind),
    the model axes, M and Φ per model shard."""
    return {
        "comm_per_axis": hlo.ring_bytes_per_axis(colls, policy.mesh),
        "comm_per_axis_kind": hlo.ring_bytes_per_axis_kind(colls, policy.mesh),
        "model_axes": policy.model_axes,
        "model_parallel": policy.model_parallel,
        "params_per_model_shard": sum(math.prod(p.layout.shape) / p.model_split for p in params),
    }


def _program_violations(
    colls: tuple[Collective, ...],
    loops: dict[str, tuple[int, ...]],
    leaves: list[LeafBytes],
    params: list[ParamInfo],
    policy: ZeroPolicy,
    min_shard_size: int,
    roles: tuple[str, ...],
) -> list[Violation]:
    """Leaves kept whole that the stage partitions, gradient-sized all-reduces
    over data, weights gathered across a model axis and collectives asked to
    be int8 that run wider (``roles``: each collective's role on the wire)."""
    whole = frozenset(whole_paths(params))
    violations = replicated_violations(leaves, policy, min_shard_size, stacked_paths(params), whole)
    violations += all_reduce_violations(colls, loops, params, min_shard_size, policy)
    violations += model_gather_violations(colls, params, policy)
    named = {v.subject for v in violations}  # a gradient-sized all-reduce is named once
    return violations + [v for v in wire_violations(colls, roles, params, policy) if v.subject not in named]


def _program(
    train_step: Any, state: Any, batch: Any, policy: ZeroPolicy, options: dict[str, Any]
) -> tuple[dict[str, float], tuple[Collective, ...], dict[str, tuple[int, ...]], str, LivePeak | None,
           StepEstimate | None]:  # fmt: skip
    """Compile once: ``memory_analysis()`` (and, where the compile's dump
    reports them, ``"allocated"``: the device memory the buffer assignment
    allocates, HBM on TPU; ``"live_peak"`` and ``"fragmentation"``, allocated
    / live peak), the post-SPMD collectives and their loop nesting, the
    compiled (scheduled) program's text, XLA's live peak and, on GPU, the
    step-time estimate of XLA:GPU's latency-hiding schedule."""
    device = policy.mesh.devices.flat[0]
    on_gpu = device.platform == "gpu"
    compiled, text, allocated, peak, sched = hlo.compile_with_dump(train_step.lower(state, batch), options,
                                                                   schedule=on_gpu)  # fmt: skip
    kind = getattr(device, "device_kind", "")
    estimate = estimate_from_schedule(sched, device_kind=kind) if sched is not None else None
    memory: dict[str, float] = dict(memory_figures(compiled))
    scheduled = compiled.as_text()
    host_temp = int(getattr(compiled.memory_analysis(), "host_temp_size_in_bytes", 0) or 0)
    if host_temp:  # what the program keeps in host memory while it runs (offload_activations, on TPU)
        memory["host_temp"] = host_temp
    if allocated is not None:
        memory["allocated"] = allocated
    if peak is not None and peak.bytes:
        memory["live_peak"] = peak.bytes
        memory["fragmentation"] = memory.get("allocated", memory["peak"]) / peak.bytes
    del compiled
    colls = tuple(hlo.parse_collectives(text, policy.mesh.size))
    return memory, colls, hlo.loop_nesting(text), scheduled, peak, estimate


def _fragmentation(
    memory: Mapping[str, float], peak: LivePeak | None, program: CompiledProgram
) -> Fragmentation | None:
    """Allocation beside the live peak, with the JAX ops that made the
    largest buffers alive there (read off the compiled program)."""
    if peak is None or not peak.bytes:
        return None
    # HLO metadata escapes quotes (state.params[\'blocks\']): shown as the key path reads.
    op_names = {ins.name: ins.op_name.replace("\\'", "'").replace('\\"', '"')
                for body in program.computations.values() for ins in body}  # fmt: skip
    buffers = tuple(PeakBuffer(name, index, nbytes, op_names.get(name, ""))
                    for name, index, nbytes in peak.buffers[:PEAK_BUFFERS_SHOWN])  # fmt: skip
    allocated = int(memory.get("allocated", memory["peak"]))
    return Fragmentation(allocated, peak.bytes, peak.at, op_names.get(peak.at, ""), buffers)


def _prefetch(prefetch: int | None) -> int:
    """The prefetch to judge a layer-wise step by (None: 1, the primitives' default)."""
    if prefetch is None:
        return 1
    if not is_whole_number(prefetch) or prefetch < 0:
        raise ValueError(f"audit: prefetch must be a non-negative int (or None for 1), got {prefetch!r}.")
    return prefetch


def _state_bytes(leaves: list[LeafBytes], totals: Totals) -> dict[str, dict[str, int]]:
    """The report's ``state_bytes`` (most on a device), ``state_bytes_min`` and ``host_bytes``."""
    measured = [c for c in CATEGORIES if c in totals and (totals[c] or c != "other")]
    host = {c: sum(x.per_device for x in leaves if x.category == c and x.memory_kind != "device") for c in CATEGORIES}
    return {
        "state_bytes": {c: max(totals[c].values(), default=0) for c in measured},
        "state_bytes_min": {c: min(totals[c].values(), default=0) for c in measured},
        "host_bytes": {c: b for c, b in host.items() if b},
    }


def step_facts(
    train_step: Any, state: Any, *, policy: ZeroPolicy | None = None, accum_mode: str | None = None,
    accum_steps: int | None = None,
) -> StepFacts:  # fmt: skip
    """What to judge ``train_step`` by: a :class:`TrainStep`'s own facts, or
    for any other jitted step the given ``policy`` (else ``state.policy``);
    each given argument overrides."""
    if not hasattr(train_step, "lower"):
        raise TypeError(NOT_JITTED.format(kind=type(train_step).__name__))
    facts = train_step.facts if isinstance(train_step, TrainStep) else None
    chosen = policy if policy is not None else facts.policy if facts is not None else _field(state, "policy")
    if not isinstance(chosen, ZeroPolicy):
        raise TypeError(NO_POLICY.format(kind=type(chosen).__name__))
    facts = (facts or StepFacts(chosen))._replace(policy=chosen)
    if accum_mode is not None:
        facts = facts._replace(accum_mode=accum_mode)
    steps = accum_steps if accum_steps is not None else facts.accum_steps
    if not is_whole_number(steps) or steps < 1:
        raise ValueError(f"audit: accum_steps must be a positive integer, got {steps!r}.")
    return facts._replace(accum_steps=steps)
