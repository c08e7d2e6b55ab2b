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
  stage's theory.

``report.check()`` raises :class:`AuditError` listing every violation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax import _measure
from zero_jax._partition import (
    DEFAULT_MIN_SHARD_SIZE,
    REASON_NO_DIMENSION,
    LeafLayout,
    is_layout,
    leaf_layout,
    shard_shape,
)
from zero_jax._planner import model_state_bytes
from zero_jax._policy import ZeroPolicy
from zero_jax._tree import PyTree, key_name, path_str

#: The state categories of a report, in ZeRO's order, and the ``TrainState``
#: fields that fall in each: the fp32 master copy (mixed precision) is
#: optimizer state in ZeRO's accounting (the K = 12 of the paper); any other
#: array field (the step counter, a loss scale) is "other".
CATEGORIES = ("params", "grads", "optimizer", "other")
_FIELD_CATEGORY = {"params": "params", "opt_state": "optimizer", "master": "optimizer", "grads": "grads"}
_HLO_DTYPE = {
    "float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16",
    "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
}  # fmt: skip

#: Violation kinds ``check()`` reports.
GRADIENT_ALL_REDUCE = "gradient-sized all-reduce"
REPLICATED_LEAF = "partitionable leaf replicated"
COMM_OVER_THEORY = "communication over theory"
REDUCE_IN_ACCUM_LOOP = "collective inside the accumulation loop"



@dataclasses.dataclass(frozen=True)
class LeafBytes:
    """One state leaf: its whole (stored, global) bytes and the most any one
    device holds of it."""

    category: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    per_device: int
    memory_kind: str = "device"  # "pinned_host": offloaded (counted in host_bytes, not state_bytes)

    @property
    def replicated(self) -> bool:
        """Whole on some device."""
        return self.per_device >= self.nbytes


@dataclasses.dataclass(frozen=True)
class Communication:
    """Bytes one device sends per step (ring-counted), measured and in theory.

    Attributes:
      measured: every collective of the partitioned program, times its loops'
        trip counts.
      theory: the stage's accounting on this model: gradients reduce-scattered
        and (stages 1–2) updated parameters all-gathered on the padded
        partitioned leaves, or (stage 3) gathered twice per microbatch; leaves
        kept whole all-reduced (two passes); all in the dtypes the step moves.
      accounted: ``theory`` less the backward re-gathers the program does not
        need (stage 3: leaves whose gradient does not use their value, like an
        embedding table or a first layer's weight, are gathered once).
      skipped_regathers: which gathered shapes ran fewer times than the
        theory's two per microbatch, and the leaves of that shape.
    """

    measured: float
    theory: float
    accounted: float
    skipped_regathers: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        """measured / theory (at most 1 + tolerance passes ``check()``)."""
        return self.measured / self.theory if self.theory else (1.0 if not self.measured else math.inf)

    @property
    def accounted_ratio(self) -> float:
        return self.measured / self.accounted if self.accounted else (1.0 if not self.measured else math.inf)


@dataclasses.dataclass(frozen=True)
class Violation:
    """One broken promise: its kind, what it is about (a leaf path or an HLO
    instruction), and a sentence saying what is wrong and what to do."""

    kind: str
    subject: str
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


class AuditError(AssertionError):
    """Raised by :meth:`AuditReport.check`; ``violations`` lists them all."""

    def __init__(self, violations: tuple[Violation, ...], header: str) -> None:
        self.violations = violations
        lines = [f"{header}: {len(violations)} violation(s)"] + [f"  - {v}" for v in violations]
        super().__init__("\n".join(lines))


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """What a compiled step holds and sends, beside its stage's contract.

    Attributes:
      stage, num_devices: the policy's stage and N (the data-parallel size).
      num_params: Φ, the float parameter elements (logical, unpadded).
      state_bytes: category -> the most bytes one device holds in device
        memory (``"grads"`` is missing when gradients were not measured).
      host_bytes: category -> bytes per device kept in ``pinned_host``
        memory (offloaded leaves; empty without offload).
      state_bytes_min: category -> the least (devices should be balanced).
      formula: category -> :func:`zero_jax.model_state_bytes` for this Φ, N,
        stage and the run's bytes per parameter (``bytes_per_param``).
      bytes_per_param: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` as
        this run stores them (optimizer: all float optimizer-state leaves and a
        master copy, per parameter).
      leaves: every state leaf with its whole and per-device bytes.
      replicated: the float leaves kept whole on a device in a category the
        stage partitions (small ones are expected: see ``min_shard_size``).
      memory: ``compiled.memory_analysis()`` per device: argument, output,
        temp, alias, and ``peak`` = argument + output + temp − alias.
      collectives: the partitioned program's collectives (kind, dtype, shape,
        bytes, trips), and ``loops``: instruction name -> trip counts of the
        loops around it, outermost first.
      comm: :class:`Communication`, measured beside the theory.
      comm_per_axis: measured ring bytes per device per step by the mesh
        axes each collective spans (``"data"``; on a hybrid mesh also
        ``"replica"`` and ``"replica+data"``): what crosses the slow axis.
      violations: what ``check()`` raises about.
      abstract: measured on ``ShapeDtypeStruct`` inputs (bytes from shardings).
    """

    stage: int
    num_devices: int
    num_params: int
    state_bytes: Mapping[str, int]
    state_bytes_min: Mapping[str, int]
    formula: Mapping[str, float]
    bytes_per_param: Mapping[str, float]
    leaves: tuple[LeafBytes, ...]
    replicated: tuple[LeafBytes, ...]
    memory: Mapping[str, int]
    collectives: tuple[_measure.Collective, ...]
    loops: Mapping[str, tuple[int, ...]]
    comm: Communication
    comm_per_axis: Mapping[str, float]
    violations: tuple[Violation, ...]
    min_shard_size: int
    tolerance: float
    accum_mode: str | None = None
    accum_steps: int = 1
    abstract: bool = False
    host_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def check(self) -> AuditReport:
        """Raise :class:`AuditError` listing every violation; return ``self``
        when there is none."""
        if self.violations:
            raise AuditError(self.violations, f"zj.audit: stage {self.stage} at N = {self.num_devices}")
        return self

    def collective_summary(self) -> list[dict[str, Any]]:
        """Rows of (kind, dtype, in loop, executions per step, ring bytes)."""
        rows: dict[tuple[str, str, bool], dict[str, Any]] = {}
        for c in self.collectives:
            key = (c.kind, c.dtype, bool(self.loops.get(c.name)))
            row = rows.setdefault(
                key, {"kind": c.kind, "dtype": c.dtype, "in_loop": key[2], "count": 0, "bytes": 0, "ring_bytes": 0.0}
            )
            row["count"] += c.trips
            row["bytes"] += c.bytes * c.trips
            row["ring_bytes"] += c.total_ring_bytes
        return sorted(rows.values(), key=lambda r: (r["kind"], r["dtype"], r["in_loop"]))

    def __str__(self) -> str:
        lines = [
            f"zj.audit: stage {self.stage}, N = {self.num_devices}, Φ = {self.num_params:,} parameters"
            + (" (abstract inputs: bytes from shardings)" if self.abstract else ""),
            "state bytes per device (max over devices / ZeRO formula at "
            + ", ".join(f"{k}={v:g}" for k, v in self.bytes_per_param.items())
            + " B per parameter):",
        ]
        for cat in CATEGORIES:
            if cat in self.state_bytes:
                f = self.formula.get(cat)
                ratio = f" / {fmt_bytes(f)} = {self.state_bytes[cat] / f:.4f}" if f else ""
                lines.append(f"  {cat:<10} {fmt_bytes(self.state_bytes[cat]):>12}{ratio}")
        if self.host_bytes:
            lines.append(
                "offloaded to pinned_host per device: "
                + ", ".join(f"{cat} {fmt_bytes(b)}" for cat, b in self.host_bytes.items())
            )
        kept = sum(leaf.per_device for leaf in self.replicated)
        lines.append(f"leaves kept whole in partitioned categories: {len(self.replicated)} ({fmt_bytes(kept)})")
        m = self.memory
        lines.append(
            "compiled memory per device: "
            + ", ".join(f"{k} {fmt_bytes(m[k])}" for k in ("argument", "output", "temp", "alias", "peak"))
        )
        lines.append("collectives (post-SPMD, per step):")
        for r in self.collective_summary():
            lines.append(
                f"  {r['kind']:<19}{r['dtype']:<5} {'in loop' if r['in_loop'] else '       '} "
                f"x{r['count']:<5} {fmt_bytes(r['bytes']):>11}  ring {fmt_bytes(r['ring_bytes'])}"
            )
        c = self.comm
        lines.append(
            f"communication: {fmt_bytes(c.measured)} per device per step; theory {fmt_bytes(c.theory)} "
            f"(measured/theory {c.ratio:.4f}); accounted {fmt_bytes(c.accounted)} ({c.accounted_ratio:.4f})"
        )
        lines.extend(f"  skipped re-gather: {s}" for s in c.skipped_regathers)
        if len(self.comm_per_axis) > 1:
            lines.append(
                "  by mesh axes: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(self.comm_per_axis.items()))
            )
        if self.violations:
            lines.append(f"VIOLATIONS ({len(self.violations)}):")
            lines.extend(f"  - {v}" for v in self.violations)
        else:
            lines.append("check: passed (no gradient-sized all-reduce, no partitionable leaf replicated, "
                         f"communication within {self.tolerance:.0%} of theory)")  # fmt: skip
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


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
    return _FIELD_CATEGORY.get(key_name(path[0]), "other") if path else "other"


def _field(state: Any, name: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(name)
    return getattr(state, name, None)


def _leaves(tree: PyTree, category: str | None) -> tuple[list[LeafBytes], dict[str, dict[Any, int]]]:
    leaves, totals = [], {c: {} for c in CATEGORIES}
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
        leaves.append(
            LeafBytes(cat, name, tuple(leaf.shape), str(np.dtype(leaf.dtype)), nbytes, max(per.values()), kind)
        )
    return leaves, totals


def _measure_grads(train_step: Any, state: Any, batch: Any, abstract: bool, options: dict[str, Any]) -> PyTree:
    """The gradient as the step holds it: the arrays ``train_step.grads``
    returns, or for abstract inputs its compiled output shardings."""
    compiled = jax.jit(train_step.grads).lower(state, batch).compile(compiler_options=options)
    return compiled.out_info if abstract else compiled(state, batch)


def _frozen(train_step: Any, layout_tree: PyTree, count: int) -> list[bool]:
    """Which parameters the step's optimizer never changes (no gradient, no
    reduction): ``zj.frozen_leaves`` of ``train_step.tx``; none if unknown."""
    tx = getattr(getattr(train_step, "tx", None), "inner", None)
    if tx is None:
        return [False] * count
    from zero_jax._optimizer import frozen_leaves

    logical = jax.tree.map(lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype), layout_tree, is_leaf=is_layout)
    try:
        flags = [bool(f) for f in jax.tree.leaves(frozen_leaves(tx, logical))]
    except Exception:  # an optimizer the analysis cannot trace: assume nothing is frozen
        return [False] * count
    return flags if len(flags) == count else [False] * count


def _float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.inexact))


def _stacked(policy: ZeroPolicy, path: str) -> bool:
    names = tuple(path.split("/"))
    return any(names[i : i + len(p)] == p for p in policy.stacked for i in range(len(names) - len(p) + 1) if len(p) > 0)


# -- the audit --------------------------------------------------------------------------------------------------


def audit(
    train_step: Any,
    state: Any,
    batch: PyTree,
    *,
    policy: ZeroPolicy | None = None,
    grads: Any = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    tolerance: float = 0.02,
    accum_mode: str | None = None,
    accum_steps: int | None = None,
    reduce_dtype: Any = None,
    fast_compile: bool = True,
) -> AuditReport:
    """Compile ``train_step(state, batch)`` and report what it holds and sends.

    Args:
      train_step: a :func:`zero_jax.make_train_step` step, or any
        ``jax.jit``-wrapped ``step(state, batch)`` (then pass ``policy``).
      state: the state, concrete arrays or ``jax.ShapeDtypeStruct``s with
        shardings (``zj.init_state`` on abstract parameters makes those; then
        nothing is allocated and bytes are read from the shardings). Its
        fields are sorted into categories by name: ``params``; ``opt_state``
        and ``master`` (optimizer, as ZeRO counts them); anything else
        "other".
      batch: the global batch (arrays or ``ShapeDtypeStruct``s).
      policy: defaults to ``train_step.policy`` (or ``state.policy``).
      grads: ``None`` measures ``train_step.grads(state, batch)`` when the step
        has it; ``False`` skips gradients; or pass the gradient tree.
      min_shard_size: the size (elements) from which the audit calls a float
        leaf partitionable. By default the library's default threshold, so a
        policy built with a larger ``min_shard_size`` that keeps such leaves
        whole *fails* the check; pass the policy's own value to accept it.
        It also bounds the all-reduce check: in stages 1–3 an all-reduce of at
        least this many elements (or of the smallest partitioned leaf, if
        smaller) is a gradient-sized all-reduce. (An optimizer that reduces
        statistics across a parameter, like Adafactor's factored moments, may
        all-reduce vectors that large and be flagged.)
      tolerance: communication may exceed the theory by this fraction.
      accum_mode, accum_steps: gradient accumulation; default
        ``getattr(train_step, "accum_mode", None)`` and ``"accum_steps"``
        (1). With ``"local"`` gradients must be reduced once per step, so a
        gradient reduction inside a loop of ``accum_steps`` trips (the
        outermost loop around it) is a violation; in other modes the theory
        counts one reduction per microbatch.
      reduce_dtype: the dtype gradients are reduced in; default the policy's
        ``precision.reduce_dtype``, else each parameter's dtype.
      fast_compile: compile with LLVM optimisation off
        (``xla_backend_optimization_level=0``): the same HLO, buffer
        assignment and ``memory_analysis()``, about 3x faster on CPU.

    Returns:
      An :class:`AuditReport`; ``report.check()`` raises on violations.

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
    policy = policy if policy is not None else getattr(train_step, "policy", None) or _field(state, "policy")
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(
            "audit: cannot tell the step's ZeroPolicy: pass policy=... (a zj.ZeroPolicy) for a step that is "
            f"not made by zj.make_train_step; got {type(policy).__name__}."
        )
    if not hasattr(train_step, "lower"):
        raise TypeError(
            f"audit: train_step must be jax.jit-wrapped (have .lower), got {type(train_step).__name__}. "
            "Pass the step from zj.make_train_step or wrap your step with jax.jit."
        )
    if not 0 <= tolerance < 1:
        raise ValueError(f"audit: tolerance must be in [0, 1), got {tolerance!r}.")
    n, stage = policy.num_shards, policy.stage
    policy.check_batch(batch, where="audit")
    accum_mode = accum_mode if accum_mode is not None else getattr(train_step, "accum_mode", None)
    steps = accum_steps if accum_steps is not None else getattr(train_step, "accum_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"audit: accum_steps must be a positive integer, got {steps!r}.")

    abstract = any(_is_abstract(x) for x in jax.tree.leaves(state))
    options = dict(_measure.FAST_COMPILE) if fast_compile else {}
    compiled, hlo = _measure.compile_with_hlo(train_step.lower(state, batch), options)
    memory = _measure.memory(compiled)
    del compiled
    colls = tuple(_measure.parse_collectives(hlo, policy.mesh.size))
    loops = _measure.loop_nesting(hlo)

    leaves, totals = _leaves(state, None)
    if grads is None and hasattr(train_step, "grads"):
        grads = _measure_grads(train_step, state, batch, abstract, options)
    if grads is not None and grads is not False:
        g_leaves, g_totals = _leaves(grads, "grads")
        leaves += g_leaves
        totals["grads"] = g_totals["grads"]
    else:
        del totals["grads"]
    grads_measured = "grads" in totals

    # The parameters' layouts: the state's own record, else the policy's rule.
    params = _field(state, "params")
    record = _field(state, "layouts")
    layout_tree = record.tree() if hasattr(record, "tree") else policy.layouts(params)
    layout_pairs = jax.tree_util.tree_flatten_with_path(layout_tree, is_leaf=is_layout)[0]
    param_leaves = jax.tree.leaves(params)
    if len(param_leaves) != len(layout_pairs):
        raise ValueError("audit: the state's params do not match its layouts; build the state with zj.init_state.")
    frozen = _frozen(train_step, layout_tree, len(layout_pairs))
    float_params = [
        (path_str(p), lay, np.dtype(leaf.dtype), fz)
        for (p, lay), leaf, fz in zip(layout_pairs, param_leaves, frozen, strict=True)
        if _float(lay.dtype)
    ]
    phi = sum(math.prod(lay.shape) for _, lay, _, _ in float_params)

    if reduce_dtype is None:
        reduce_dtype = getattr(getattr(policy, "precision", None), "reduce_dtype", None)
    comm = _communication(colls, float_params, policy, reduce_dtype, accum_mode, steps)

    # Bytes per parameter as this run stores them, and the paper's formula for them.
    opt_float = sum(leaf.nbytes for leaf in leaves if leaf.category == "optimizer" and _float(leaf.dtype))
    stored_phi = sum(
        math.prod(lay.stored_shape if (policy.partitions_opt_state and lay.partitioned) else lay.shape)
        for _, lay, _, _ in float_params
    )
    per_param = {
        "param_bytes": sum(math.prod(lay.shape) * d.itemsize for _, lay, d, _ in float_params) / max(phi, 1),
        "grad_bytes": _grad_bytes(leaves, float_params) if grads_measured else math.nan,
        "optimizer_bytes": opt_float / max(stored_phi, 1),
    }
    if not grads_measured:
        del per_param["grad_bytes"]
    formula = {}
    if phi:
        f = model_state_bytes(
            phi, n, stage,
            param_bytes=per_param["param_bytes"],
            grad_bytes=per_param.get("grad_bytes", 0.0),
            optimizer_bytes=per_param["optimizer_bytes"],
            replicas=policy.num_replicas,
            optimizer_over_replicas=policy.optimizer_over_replicas,
        )  # fmt: skip
        formula = {"params": f.params, "optimizer": f.optimizer} | ({"grads": f.grads} if grads_measured else {})

    partitioned_cats = {"optimizer"} if stage >= 1 else set()
    partitioned_cats |= {"grads"} if stage >= 2 else set()
    partitioned_cats |= {"params"} if stage >= 3 else set()
    replicated = tuple(
        leaf for leaf in leaves if leaf.category in partitioned_cats and _float(leaf.dtype) and leaf.replicated
    )

    violations: list[Violation] = []
    violations += _replicated_violations(leaves, partitioned_cats, policy, min_shard_size, n, stage)
    violations += _all_reduce_violations(colls, loops, float_params, min_shard_size, policy)
    if comm.measured > comm.theory * (1 + tolerance):
        violations.append(
            Violation(
                COMM_OVER_THEORY,
                "communication",
                f"the step sends {fmt_bytes(comm.measured)} per device per step, {comm.ratio:.3f}x the stage-{stage} "
                f"theory of {fmt_bytes(comm.theory)} (tolerance {tolerance:.0%}). See report.collective_summary() for "
                "what moves; gradients reduced once per microbatch or whole-gradient all-reduces are the usual cause.",
            )
        )
    if accum_mode == "local" and steps > 1:
        violations += _accum_violations(colls, loops, steps)

    measured_cats = [c for c in CATEGORIES if c in totals and (totals[c] or c != "other")]
    return AuditReport(
        stage=stage,
        num_devices=n,
        num_params=phi,
        state_bytes={c: max(totals[c].values(), default=0) for c in measured_cats},
        host_bytes={
            c: b
            for c in CATEGORIES
            if (b := sum(x.per_device for x in leaves if x.category == c and x.memory_kind != "device"))
        },
        state_bytes_min={c: min(totals[c].values(), default=0) for c in measured_cats},
        formula=formula,
        bytes_per_param=per_param,
        leaves=tuple(leaves),
        replicated=replicated,
        memory=memory,
        collectives=colls,
        loops=loops,
        comm=comm,
        comm_per_axis=_measure.ring_bytes_per_axis(colls, policy.mesh),
        violations=tuple(violations),
        min_shard_size=min_shard_size,
        tolerance=tolerance,
        accum_mode=accum_mode,
        accum_steps=steps,
        abstract=abstract,
    )


def _grad_bytes(leaves: list[LeafBytes], float_params: list[tuple[str, LeafLayout, np.dtype, bool]]) -> float:
    g = [leaf for leaf in leaves if leaf.category == "grads" and _float(leaf.dtype)]
    phi = sum(math.prod(lay.shape) for _, lay, _, _ in float_params)
    if len(g) != len(float_params):
        return sum(leaf.nbytes for leaf in g) / max(phi, 1)
    return (
        sum(
            math.prod(lay.shape) * np.dtype(leaf.dtype).itemsize
            for leaf, (_, lay, _, _) in zip(g, float_params, strict=True)
        )
        / phi
    )


def _hlo_dtype(dtype: np.dtype) -> str:
    return _HLO_DTYPE.get(str(dtype), str(dtype))


def _communication(
    colls: tuple[_measure.Collective, ...],
    float_params: list[tuple[str, LeafLayout, np.dtype, bool]],
    policy: ZeroPolicy,
    reduce_dtype: Any,
    accum_mode: str | None,
    steps: int,
) -> Communication:
    """The stage's theory on this model, and the re-gathers stage 3 skips.

    Per step: gradients are reduced once, or once per microbatch unless
    ``accum_mode == "local"``; stage 3 gathers every parameter twice per
    microbatch (forward, backward), or once per step when accumulating
    locally; stages 1-2 all-gather the updated parameters once. Leaves kept
    whole are all-reduced (two passes); frozen leaves are not reduced.
    """
    stage, n, r = policy.stage, policy.num_shards, policy.num_replicas
    ring = (n - 1) / n
    ring_all = (n * r - 1) / (n * r)  # an all-reduce / all-gather spanning replicas and partitions
    ring_replica = (r - 1) / r
    local = steps > 1 and accum_mode == "local"
    reduces = steps if steps > 1 and not local else 1
    gathers = 1 if stage < 3 else (1 if local else 2 * steps)
    theory = 0.0
    units: dict[tuple[str, tuple[int, ...]], list[tuple[str, int]]] = {}
    gathered: dict[tuple[str, tuple[int, ...]], int] = {}
    for c in colls:
        if c.kind == "all-gather":
            gathered[(c.dtype, c.shape)] = gathered.get((c.dtype, c.shape), 0) + c.trips
    for path, lay, dtype, frozen in float_params:
        rb = np.dtype(reduce_dtype if reduce_dtype is not None else dtype).itemsize
        if stage == 0 or not lay.partitioned:
            theory += 0 if frozen else 2 * ring_all * math.prod(lay.shape) * rb * reduces
            continue
        stored = math.prod(lay.stored_shape)
        theory += 0 if frozen else ring * stored * rb * reduces  # reduce-scatter of the gradient
        if r > 1 and not frozen:
            # The 1/N piece crosses the replicas once per step: all-reduced (HSDP),
            # or reduce-scattered (optimizer over replicas; gathered back below).
            theory += (1 if policy.optimizer_over_replicas else 2) * ring_replica * stored / n * rb
        if policy.optimizer_over_replicas and stage < 3:
            theory += ring_all * stored * dtype.itemsize  # all-gather of the update over both axes
        else:
            theory += ring * stored * dtype.itemsize * gathers  # all-gather(s) of the parameter
            if policy.optimizer_over_replicas:
                theory += ring_replica * stored / n * dtype.itemsize  # update pieces -> parameter pieces
        if stage == 3:
            # One gather unit per use: the whole leaf, or one layer of a stacked leaf
            # when the program gathers layer-sized pieces (``scan_layers``).
            per_layer = (_hlo_dtype(dtype), lay.stored_shape[1:])
            if _stacked(policy, path) and gathered.get(per_layer, 0) >= lay.shape[0]:
                units.setdefault(per_layer, []).append((path, lay.shape[0]))
            else:
                units.setdefault((_hlo_dtype(dtype), lay.stored_shape), []).append((path, 1))
    skipped_bytes, notes = 0.0, []
    for (dt, shape), members in sorted(units.items()):
        expected = gathers * sum(m for _, m in members)
        ran = gathered.get((dt, shape), 0)
        if 0 < ran < expected:
            unit_bytes = math.prod(shape) * _measure._DTYPE_BYTES.get(dt, 4)
            skipped_bytes += (expected - ran) * unit_bytes * ring
            names = ", ".join(p for p, _ in members)
            notes.append(f"{dt}[{','.join(map(str, shape))}] gathered {ran}x, theory {expected}x ({names})")
    measured = _measure.ring_bytes(colls)
    return Communication(measured, theory, theory - skipped_bytes, tuple(notes))


def _replicated_violations(
    leaves: list[LeafBytes], cats: set[str], policy: ZeroPolicy, min_shard_size: int, n: int, stage: int
) -> list[Violation]:
    if n <= 1:
        return []
    out = []
    what = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
    for leaf in leaves:
        if leaf.category not in cats or not _float(leaf.dtype) or leaf.per_device * n <= leaf.nbytes:
            continue
        size = math.prod(leaf.shape)
        lay = leaf_layout(
            leaf.shape, leaf.dtype, n, min_shard_size=min_shard_size, skip_leading=_stacked(policy, leaf.path)
        )
        if not lay.partitioned:  # small, or nothing to cut but a stacked layer axis
            if lay.reason == REASON_NO_DIMENSION or size < min_shard_size:
                continue
        how = "whole" if leaf.replicated else f"{leaf.per_device / leaf.nbytes:.0%}"
        out.append(
            Violation(
                REPLICATED_LEAF,
                leaf.path,
                f"'{leaf.path}' ({leaf.dtype}{list(leaf.shape)}, {size:,} elements, {fmt_bytes(leaf.nbytes)}) is "
                f"held {how} on a device ({fmt_bytes(leaf.per_device)}), but stage {stage} partitions "
                f"{what[leaf.category]} and the leaf has >= {min_shard_size} elements. The policy keeps it whole "
                f"(its min_shard_size is {policy.min_shard_size}): lower ZeroPolicy(min_shard_size=...) or fix the "
                "sharding; pass audit(..., min_shard_size=...) if keeping it whole is intended.",
            )
        )
    return out


def _all_reduce_violations(
    colls: tuple[_measure.Collective, ...],
    loops: Mapping[str, tuple[int, ...]],
    float_params: list[tuple[str, LeafLayout, np.dtype, bool]],
    min_shard_size: int,
    policy: ZeroPolicy,
) -> list[Violation]:
    stage = policy.stage
    if stage == 0:
        return []
    sizes = [math.prod(lay.shape) for _, lay, _, _ in float_params if lay.partitioned]
    threshold = max(1, min([min_shard_size, *sizes]))
    # HSDP all-reduces each gradient's 1/N piece across the replica axes: expected.
    pieces = {shard_shape(lay, policy.num_shards) for _, lay, _, _ in float_params if lay.partitioned}
    replica_axes = set(policy.replica_axes)
    out = []
    for c in colls:
        if c.kind != "all-reduce" or math.prod(c.shape) < threshold:
            continue
        if replica_axes and set(c.axes(policy.mesh)) <= replica_axes and c.shape in pieces:
            continue
        match = [
            p
            for p, lay, _, _ in float_params
            if c.shape in (lay.shape, lay.stored_shape, lay.shape[1:], lay.stored_shape[1:])
        ]
        where = f" inside loops of {'x'.join(map(str, loops[c.name]))} trips" if loops.get(c.name) else ""
        shape = f"{c.dtype}[{','.join(map(str, c.shape))}]"
        out.append(
            Violation(
                GRADIENT_ALL_REDUCE,
                c.name,
                f"all-reduce '{c.name}' of {shape} ({fmt_bytes(c.bytes)}, x{c.trips}{where}) in stage {stage}"
                + (f", the shape of {', '.join(match)}" if match else "")
                + f": a gradient-sized all-reduce (>= {threshold} elements). Stages 1-3 reduce-scatter "
                "gradients; only leaves kept whole (below min_shard_size) may be all-reduced.",
            )
        )
    return out


def _accum_violations(
    colls: tuple[_measure.Collective, ...], loops: Mapping[str, tuple[int, ...]], steps: int
) -> list[Violation]:
    out = []
    for c in colls:
        nest = loops.get(c.name, ())
        if c.kind in ("all-reduce", "reduce-scatter") and c.shape != () and nest and nest[0] == steps:
            shape = f"{c.dtype}[{','.join(map(str, c.shape))}]"
            out.append(
                Violation(
                    REDUCE_IN_ACCUM_LOOP,
                    c.name,
                    f"{c.kind} '{c.name}' of {shape} runs inside the {steps}-trip accumulation loop ({c.trips}x per "
                    "step), but accum_mode='local' promises one gradient reduction per step: accumulate locally "
                    "and reduce after the loop.",
                )
            )
    return out


# -- the command line: python -m zero_jax audit -----------------------------------------------------------------


def add_audit_arguments(p: Any) -> None:
    """The ``audit`` subcommand's options (for ``zero_jax.__main__``)."""
    from zero_jax.models.transformer import add_model_arguments  # the models import zero_jax

    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))
    add_model_arguments(p)
    p.add_argument("--gather", choices=("manual", "all"), default="manual", help="layer-wise (manual) or whole")
    p.add_argument("--accum-steps", type=int, default=1)
    p.add_argument("--accum-mode", choices=("local", "partitioned"), default=None)
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="HSDP: a (replica, data) = (R, devices / R) mesh, state partitioned within data (default 1: flat)",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="print every stage's full report")


def run_audit_command(args: Any) -> int:
    """``python -m zero_jax audit``: audit the reference transformer's step for
    each stage on this process's devices and print the reports. Exit status 1
    when a check fails."""
    import optax
    from rich.table import Table

    import zero_jax as zj
    from zero_jax._planner import _STAGE_NAMES, _console
    from zero_jax.models import TransformerConfig, init_params, make_loss_fn, synthetic_batch

    console = _console()
    devices = jax.devices()
    n = len(devices)
    replicas = args.replicas
    if replicas < 1 or n % replicas:
        raise SystemExit(f"audit: --replicas {replicas} must be >= 1 and divide the {n} devices.")
    if replicas > 1:
        mesh = jax.make_mesh((replicas, n // replicas), ("replica", "data"))
        hybrid: dict[str, Any] = {"replica_axis": "replica"}
    else:
        mesh, hybrid = jax.make_mesh((n,), ("data",)), {}
    cfg = TransformerConfig(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq)
    # Jitted: one compilation each instead of one per eager op.
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    batch = jax.jit(synthetic_batch, static_argnums=(0, 1))(cfg, args.batch_per_device * n, jax.random.key(1))
    precision = zj.Precision(compute_dtype=jnp.bfloat16) if args.bf16 else zj.Precision()
    table = Table(
        title=f"zj.audit: reference transformer, Φ = {cfg.num_params():,}, "
        + (f"HSDP R = {replicas} x N = {n // replicas}" if replicas > 1 else f"N = {n}")
        + f" {devices[0].platform} devices, "
        f"AdamW, {'bf16 compute / fp32 master' if args.bf16 else 'fp32'}, gather={args.gather!r}",
        caption="bytes per device (max over devices), measured on the live arrays / ZeRO formula for the run's bytes "
        "per parameter; comm: post-SPMD collectives, ring bytes per device per step / the stage's theory",
    )
    for col in ("stage", "params", "grads", "optimizer", "/formula", "peak", "comm/step", "/theory", "/accounted",
                "max all-reduce", *(("across replica",) if replicas > 1 else ()), "check"):  # fmt: skip
        table.add_column(col, justify="left" if col == "stage" else "right")
    failed, reports = 0, []
    for stage in args.stages:
        policy = zj.ZeroPolicy(stage, mesh, "data", **hybrid, stacked="layers", precision=precision)
        tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
        state = zj.init_state(params, tx, policy)
        loss_fn = make_loss_fn(cfg, policy if args.gather == "manual" else None)
        step = zj.make_train_step(
            loss_fn, tx, policy, gather=args.gather, accum_steps=args.accum_steps, accum_mode=args.accum_mode
        )
        r = audit(step, state, batch)
        reports.append(r)
        failed += not r.ok
        b = r.state_bytes
        worst = max(b[c] / r.formula[c] for c in r.formula if r.formula[c])
        biggest = max((c.bytes for c in r.collectives if c.kind == "all-reduce"), default=0)
        table.add_row(
            f"{stage} {_STAGE_NAMES[stage]}", fmt_bytes(b["params"]), fmt_bytes(b.get("grads", 0)),
            fmt_bytes(b["optimizer"]), f"{worst:.3f}", fmt_bytes(r.memory["peak"]), fmt_bytes(r.comm.measured),
            f"{r.comm.ratio:.3f}", f"{r.comm.accounted_ratio:.3f}", fmt_bytes(biggest),
            *((fmt_bytes(r.comm_per_axis.get("replica", 0.0)),) if replicas > 1 else ()),
            "[green]passed[/green]" if r.ok else f"[red]{len(r.violations)} violation(s)[/red]",
        )  # fmt: skip
    console.print(table)
    for r in reports:
        if args.verbose or not r.ok:
            console.print(str(r), markup=False)
            console.print()
    console.print(
        "All checks passed: no gradient-sized all-reduce in stages 1-3, no partitionable leaf replicated, "
        "communication within 2% of theory."
        if not failed
        else f"[red]{failed} stage(s) failed the check.[/red]"
    )
    return 1 if failed else 0
