"""ZeroPolicy: which of parameters, gradients and optimizer state a stage cuts, over which mesh axes.

A policy is a frozen dataclass whose fields are its constructor's arguments, normalised (an axis name
becomes a tuple of names, ``precision=None`` the default :class:`Precision`, ``offload_optimizer=True``
the fraction 1.0) and checked together in ``__post_init__``: every problem is named in one error. The
code that uses a group of options reads it as one value: :attr:`ZeroPolicy.wire` (ZeRO++'s formats),
:attr:`ZeroPolicy.offload` (what lives in host memory), :attr:`ZeroPolicy.model` (the model's own layout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from zero_jax._base.problems import raise_problems
from zero_jax._base.tree import KeyPath, PyTree, path_str, split_prefix, under, under_any
from zero_jax._comm.collectives import Axes
from zero_jax._layout.leaf import DEFAULT_MIN_SHARD_SIZE, LeafLayout, ReplicatedLeaf, is_float, is_layout, shape_dtype
from zero_jax._layout.leaf import leaf_layout as layout_of
from zero_jax._policy.arguments import WHERE, argument_problems, bucket_size, check_quant_block
from zero_jax._policy.batch import batch_leaf_specs, batch_partition_spec, is_replicated_leaf
from zero_jax._policy.batch import check_batch as check_batch_leaves
from zero_jax._policy.memory import OffloadOptions, offload_options
from zero_jax._policy.model_specs import model_entries, spec_key
from zero_jax._policy.precision import Precision
from zero_jax._theory.wire import DEFAULT_BLOCK, WireFormat

#: ``setattr`` / ``delattr`` on a policy.
FROZEN = (
    "ZeroPolicy is immutable: cannot {what} {name!r}. A policy is hashed as static pytree metadata of every "
    "state and compiled step made with it, so changing it in place would silently mismatch them. Build a new "
    "policy instead: policy.replace({name}=...) (or zj.ZeroPolicy(...))."
)
NOT_ARGUMENTS = "ZeroPolicy.replace: {unknown} are not ZeroPolicy arguments; the arguments are {names}."
STACKED_MATCHES_NOTHING = (
    "ZeroPolicy({field}=...): the prefix{s} {which} matches no parameter. Top-level entries are {entries}; "
    "pass one of those."
)


class ModelParallel(NamedTuple):
    """The model's own layout over the mesh axes ZeRO does not use: its
    ``param_specs``, ``partition_activations`` (ZeRO-R's P_a) and
    ``batch_spec`` (sequence parallelism), as the policy was given them."""

    param_specs: Any = None
    partition_activations: bool = False
    batch_spec: PartitionSpec | None = None


def _names(value: Any) -> tuple[str, ...]:
    """An axis argument (one name, several, or None) as a tuple of names."""
    return (value,) if isinstance(value, str) else tuple(value or ())


def _secondary_first(axes: tuple[str, ...], secondary: str | None) -> tuple[str, ...]:
    """hpZ's partition order: the secondary (fast) axis leads, so the pieces
    across the other axes of one position along it are contiguous, and
    gathering them gives that position's secondary piece."""
    return axes if secondary is None else (secondary, *(a for a in axes if a != secondary))


def _prefixes(value: Any) -> tuple[str, ...]:
    """A ``stacked=`` argument as a tuple of "a/b" prefixes (a valid argument itself)."""
    return tuple("/".join(split_prefix(p)) for p in _names(value))


def _mesh_key(mesh: Mesh) -> tuple[Any, ...]:
    """A mesh as the layout sees it: axis names, shape and device ids (Auto and Explicit alike)."""
    return tuple(mesh.axis_names), tuple(mesh.devices.shape), tuple(int(d.id) for d in mesh.devices.flat)


#: How a field enters the policy's key (its equality and hash); the rest enter as they are.
_KEYS: dict[str, Callable[[Any], Any]] = {
    "mesh": _mesh_key,
    "param_specs": spec_key,
    "precision": lambda p: p if p is not None else Precision(),  # the default, asked for or not: one layout
}


#: The options that change what a step does but not how its state is laid out (see
#: :meth:`ZeroPolicy.lays_out_like`): saved block inputs in host memory, the bound on one collective's buffer.
STEP_ONLY_OPTIONS = frozenset({"offload_activations", "bucket_bytes"})


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class ZeroPolicy:
    """A ZeRO stage as a sharding policy over the data axis of a mesh.

    ====== ===================== ============= ==============
    stage  optimizer state       gradients     parameters
    ====== ===================== ============= ==============
    0      whole on every device whole         whole
    1      partitioned           whole         whole
    2      partitioned           partitioned   whole
    3      partitioned           partitioned   partitioned
    ====== ===================== ============= ==============

    Args:
      stage: 0 (plain data parallelism) to 3.
      mesh: any ``jax.sharding.Mesh`` (Auto or Explicit axes).
      axis: the mesh axis (or a tuple of axes) state is partitioned across;
        the batch is split along it. On a multi-host mesh this is the fast
        axis (within a host / ICI slice).
      replica_axis: mesh axes (usually the slow, across-hosts one) that also
        split the batch but hold replicas of the partitioned state: hybrid
        sharded data parallelism (HSDP, FSDP's ``HYBRID_SHARD``). Gradients
        are reduce-scattered within ``axis`` and then only the 1/N piece is
        all-reduced across ``replica_axis``. Mesh axes named in neither hold
        replicas of everything and see the same batch slice.
      optimizer_over_replicas: with ``replica_axis``: partition the optimizer
        state (and the float32 master copy and the reduced gradients) over
        ``axis`` *and* ``replica_axis`` (R·N pieces), while parameters stay
        partitioned within ``axis`` only (ZeRO++'s hpZ / MiCS trade): the
        1/N gradient piece is reduce-scattered across ``replica_axis``
        instead of all-reduced, and the updated 1/(R·N) pieces are
        all-gathered across it -- the same bytes across the slow axis as
        HSDP, with the optimizer state R times smaller.
      min_shard_size: float leaves with fewer elements stay whole on every
        device (``policy.replicated_leaves(tree)`` lists them and their bytes).
      stacked: key-path prefixes (``"layers"``, ``"decoder/blocks"``, or a
        tuple of them) of subtrees whose leaves carry a leading layer axis for
        ``scan_layers``; that axis is never partitioned.
      whole_matrices: key-path prefixes (or full paths) of float leaves the
        optimizer multiplies by themselves (Muon's Newton-Schulz), never cut
        across a matrix: ``ZeroPolicy(..., **zj.matrix_leaves(tx, params))``
        fills this and ``matrix_stacks`` from the traced update. A single
        matrix stays whole on every device: its gradient is all-reduced (2
        passes, the bytes of a reduce-scatter plus a gather) and every device
        computes its update, with no collective inside the optimizer; the cost
        is its optimizer state (and at stage 3 its parameters) held whole on
        every device and its update computed N times.
      matrix_stacks: those of ``whole_matrices`` that are stacks of matrices
        on dimension 0, each multiplied alone (a scanned model's layer axis):
        cut on that axis, so each device owns whole matrices and runs their
        update alone; gradients are reduce-scattered and updated parameters
        gathered along it (ZeRO's bytes). A stack of K >= N matrices is
        padded to a multiple of N (``(K' - K) / K`` more bytes for it); one of
        fewer than N matrices, or under ``stacked`` (whose layer axis is never
        cut), stays whole like a single matrix.
      precision: a :class:`Precision` (mixed precision, loss scaling); by
        default everything computes and reduces in the parameters' float32.
      offload_optimizer: keep optimizer state (and the float32 master copy)
        in ``pinned_host`` memory between steps; the update streams it to the
        device chunk by chunk. ``True`` offloads all of it, a fraction in
        [0, 1] that share of its bytes, largest leaves first.
      offload_params: stage 3 only: keep the partitioned parameters in
        ``pinned_host`` memory too; each is brought to the device just before
        it is gathered (per layer inside ``scan_layers``).
      param_specs: the model's own (tensor / sequence / expert parallel)
        layout: a pytree of ``PartitionSpec`` mirroring the parameters (``None``
        or ``P()`` for a leaf the model does not shard), or a callable
        ``(key_path, leaf) -> PartitionSpec``, naming only mesh axes outside
        ``axis`` and ``replica_axis``. ZeRO then cuts each leaf over ``axis``
        on a dimension the model leaves free, and the step stays manual over
        the ZeRO axes only: the model axes are the compiler's, so the loss is
        plain ``jnp`` (constrain activations with
        ``jax.lax.with_sharding_constraint(x, P(..., "model"))``).
      partition_activations: ZeRO-R's P_a, stages 2-3 with ``param_specs``:
        each layer input ``scan_layers`` and ``apply_layer(s)`` keep for the
        backward recompute is cut over the model axes (on its last dimension
        that divides by their size; other leaves stay whole) and all-gathered
        just before the recompute. Values are bitwise unchanged; the saved
        inputs take 1/M of the memory for one all-gather per layer. Meant for
        layer inputs replicated over the model axes (Megatron-style tensor
        parallelism); a no-op when every model axis has size 1.
      offload_activations: ZeRO-R's P_a+cpu, any stage: the default of
        ``scan_layers`` / ``apply_layer(s)``'s ``offload_activations`` (and
        so of the adapters' ``layers=`` blocks): each saved layer input (the
        partitioned piece with ``partition_activations``) is moved to
        ``pinned_host`` memory after its layer's forward pass and back just
        before its recompute. Values are bitwise unchanged; the saved inputs
        leave device memory for 2x their bytes over the host link per step.
      batch_spec: sequence parallelism: how the batch leaves' dimensions after
        the first split over model axes, e.g. ``P(None, "seq")`` for
        (batch, seq, ...) leaves; dimension 0 always splits over the batch
        axes. The loss sees whole sequences, the compiler keeps them split.
      quantize_weights: ZeRO++'s qwZ, stage 3: ``"int8"`` sends each
        partitioned weight's all-gather (forward and backward re-gather) as
        int8 blocks plus a float32 scale per block, dequantized to the
        compute dtype after the gather. The master copy, the optimizer and
        the gradients are untouched: quantization exists only on the wire.
      quantize_grads: ZeRO++'s qgZ, stages 1-3: ``"int8"`` sends each
        gradient reduce-scatter as an all-to-all of int8 blocks + scales,
        dequantized and summed in float32 on the receiver. Leaves kept whole
        (all-reduced) and the replica-axis reduction stay unquantized.
      quant_block: elements per float32 scale (a piece smaller than it is
        one block).
      bucket_bytes: ZeRO-R's constant-size buffers (C_B): no communication
        buffer of the step is larger than this many bytes (an int, or a size
        such as ``"4MiB"``), however deep the model; a single tensor larger
        than the bound goes alone, in a buffer of its own size. The step's
        collectives are one per leaf already; what could grow with the model
        is the backend combining several into one buffer, so the bound is
        given to the backend's combiner (``_layerwise/schedule.py``: on TPU
        and GPU; XLA:CPU combines nothing). ``None``: the backend's default.
        Values and bytes on the wire are unchanged; ``zj.audit``'s
        ``report.check()`` then flags a buffer over the bound.

    Example:

    >>> import jax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh)
    >>> params = {"w": jax.ShapeDtypeStruct((4096, 512), "float32")}
    >>> policy.param_sharding(params)["w"].spec
    P('data',)

    Communication buffers of at most 4 MiB (ZeRO-R's constant-size buffers):

    >>> zj.ZeroPolicy(stage=3, mesh=mesh, bucket_bytes="4MiB").bucket_bytes
    4194304

    Hybrid (2 replicas x 4-way partitions, e.g. 2 hosts of 4 chips):

    >>> mesh2 = jax.make_mesh((2, jax.device_count() // 2), ("replica", "data"))
    >>> hsdp = zj.ZeroPolicy(stage=3, mesh=mesh2, axis="data", replica_axis="replica")
    >>> hsdp.param_sharding(params)["w"].spec, hsdp.batch_sharding().spec
    (P('data',), P(('replica', 'data'),))
    >>> hpz = zj.ZeroPolicy(stage=3, mesh=mesh2, axis="data", replica_axis="replica", optimizer_over_replicas=True)
    >>> hpz.opt_state_sharding(params)["w"].spec
    P(('data', 'replica'),)

    Tensor parallelism (4-way ZeRO x 2-way model, Megatron's column-parallel weight):

    >>> from jax.sharding import PartitionSpec as P
    >>> mesh3 = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
    >>> tp = zj.ZeroPolicy(stage=3, mesh=mesh3, param_specs={"w": P(None, "model")})
    >>> tp.param_sharding(params)["w"].spec, tp.model_parallel
    (P('data', 'model'), 2)
    """

    stage: int
    mesh: Mesh
    axis: str | Sequence[str] = "data"
    _: dataclasses.KW_ONLY
    replica_axis: str | Sequence[str] | None = None
    optimizer_over_replicas: bool = False
    secondary_axis: str | None = None
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE
    stacked: str | Sequence[str] = ()
    whole_matrices: str | Sequence[str] = ()
    matrix_stacks: str | Sequence[str] = ()
    precision: Precision | None = None
    offload_optimizer: bool | float = False
    offload_params: bool = False
    param_specs: PyTree | Callable[[KeyPath, Any], PartitionSpec] | None = None
    partition_activations: bool = False
    offload_activations: bool = False
    batch_spec: PartitionSpec | None = None
    quantize_weights: str | None = None
    quantize_grads: str | None = None
    quant_block: int = DEFAULT_BLOCK
    bucket_bytes: int | str | None = None
    #: The mesh with every axis Auto: what the step runs on (sharding constraints inside the step are
    #: rejected on Explicit axes, and jit accepts arrays placed on either).
    auto_mesh: Mesh = dataclasses.field(init=False, repr=False, compare=False)
    #: Whether ``precision=`` was given (``init_state`` warns when it casts other float dtypes to the default's
    #: float32 without being asked); kept through :meth:`replace`, no part of the policy's identity.
    precision_chosen: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        raise_problems(argument_problems(**self.arguments), WHERE)
        offload = offload_options(self.offload_optimizer, self.offload_params)
        normalised = {
            "stage": int(self.stage),
            "axis": _secondary_first(_names(self.axis), self.secondary_axis),
            "replica_axis": _names(self.replica_axis),
            "optimizer_over_replicas": bool(self.optimizer_over_replicas),
            "min_shard_size": int(self.min_shard_size),
            "stacked": _prefixes(self.stacked),
            "whole_matrices": _prefixes(self.whole_matrices),
            "matrix_stacks": _prefixes(self.matrix_stacks),
            "precision": self.precision if self.precision is not None else Precision(),
            "offload_optimizer": offload.fraction,
            "offload_params": offload.params,
            "partition_activations": bool(self.partition_activations),
            "offload_activations": bool(self.offload_activations),
            "quant_block": int(self.quant_block),
            "bucket_bytes": bucket_size(self.bucket_bytes),
        }
        names = self.mesh.axis_names
        normalised["precision_chosen"] = self.precision is not None
        normalised["auto_mesh"] = Mesh(self.mesh.devices, names, axis_types=(AxisType.Auto,) * len(names))
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # the dataclass is frozen: the one place fields are set

    # -- a value: frozen, replaced whole ------------------------------------------------

    @property
    def arguments(self) -> dict[str, Any]:
        """The constructor's arguments (normalised): what :meth:`replace` starts from."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        chosen = getattr(self, "precision_chosen", True)  # unset while __post_init__ checks the raw arguments
        return {**given, "precision": given["precision"] if chosen else None}

    def replace(self, **changes: Any) -> ZeroPolicy:
        """A new policy: this one's arguments with ``changes``.

        >>> import jax, zero_jax as zj
        >>> p3 = zj.ZeroPolicy(stage=3, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
        >>> p3.replace(stage=1).stage, p3.stage
        (1, 3)
        """
        unknown = sorted(set(changes) - set(self.arguments))
        if unknown:
            raise TypeError(NOT_ARGUMENTS.format(unknown=unknown, names=list(self.arguments)))
        return dataclasses.replace(self, **{"precision": self.arguments["precision"], **changes})

    @property
    def key(self) -> tuple[Any, ...]:
        """A hashable fingerprint: two policies with equal keys are the same policy."""
        return tuple(_KEYS.get(name, lambda v: v)(value) for name, value in self.arguments.items())

    def lays_out_like(self, other: object) -> bool:
        """Whether a state made for ``other`` is laid out for this policy: the
        same policy but for options that only change what a step does with it
        (:data:`STEP_ONLY_OPTIONS`), so a state made without them trains in a
        step with them.

        >>> import jax, zero_jax as zj
        >>> p3 = zj.ZeroPolicy(stage=3, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
        >>> p3.replace(bucket_bytes="4MiB").lays_out_like(p3), p3.replace(stage=2).lays_out_like(p3)
        (True, False)
        """
        return isinstance(other, ZeroPolicy) and other.layout_key == self.layout_key

    @property
    def layout_key(self) -> tuple[Any, ...]:
        """:attr:`key` without :data:`STEP_ONLY_OPTIONS`: equal for policies that lay state out alike."""
        return tuple(k for name, k in zip(self.arguments, self.key, strict=True) if name not in STEP_ONLY_OPTIONS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZeroPolicy) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        shown = [f"stage={self.stage}", f"axis={self.axis_name!r}", f"N={self.num_shards}",
                 f"mesh={dict(self.mesh.shape)}"]  # fmt: skip
        defaults = {f.name: f.default for f in dataclasses.fields(ZeroPolicy) if f.init}
        for name in self.arguments:
            value = getattr(self, name)
            if name in ("stage", "mesh", "axis") or value == _normalised_default(name, defaults[name]):
                continue
            shown.append(f"{name}=..., M={self.model_parallel}" if name == "param_specs" else f"{name}={value!r}")
        return f"ZeroPolicy({', '.join(shown)})"

    # -- grouped values -------------------------------------------------------------

    @property
    def axes(self) -> tuple[str, ...]:
        """The partition axes (``axis``, always a tuple)."""
        return self.axis  # pyright: ignore[reportReturnType] - __post_init__ normalizes the axes to a tuple

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The replica axes (``replica_axis``, always a tuple; empty without)."""
        return self.replica_axis  # pyright: ignore[reportReturnType] - __post_init__ normalizes the axes to a tuple

    @property
    def stacked_prefixes(self) -> tuple[tuple[str, ...], ...]:
        """The ``stacked`` prefixes as tuples of key names."""
        return tuple(split_prefix(p) for p in self.stacked)

    @property
    def wire(self) -> WireFormat:
        """How weights and gradients travel (ZeRO++ qwZ / qgZ); the default sends the leaves' own dtypes."""
        return WireFormat(self.quantize_weights, self.quantize_grads, self.quant_block)

    @property
    def offload(self) -> OffloadOptions:
        """What lives in host memory between steps."""
        return OffloadOptions(self.offload_optimizer, self.offload_params)

    @property
    def offloads(self) -> bool:
        """Whether anything (optimizer state, master copy or parameters) lives in host memory."""
        return bool(self.offload_optimizer or self.offload_params)

    @property
    def model(self) -> ModelParallel:
        """The model's own layout (tensor / sequence parallelism, P_a)."""
        return ModelParallel(self.param_specs, self.partition_activations, self.batch_spec)

    # -- identity -----------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        """N: how many pieces a partitioned leaf is cut into."""
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def num_replicas(self) -> int:
        """R: how many replicas of the partitioned state (1 without ``replica_axis``)."""
        return math.prod(self.mesh.shape[a] for a in self.replica_axes)

    @property
    def state_axes(self) -> tuple[str, ...]:
        """The axes the optimizer state (and master copy, reduced gradients)
        is partitioned over: ``axis``, plus ``replica_axis`` with
        ``optimizer_over_replicas`` (partition-major, so one device's
        optimizer piece lies inside its parameter piece)."""
        return self.axes + self.replica_axes if self.optimizer_over_replicas else self.axes

    @property
    def num_state_shards(self) -> int:
        """How many pieces the optimizer state is cut into (N, or R·N)."""
        return math.prod(self.mesh.shape[a] for a in self.state_axes)

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The mesh axes in no ZeRO role (neither ``axis`` nor ``replica_axis``):
        what ``param_specs`` may shard over (tensor, sequence, expert axes)."""
        return tuple(a for a in self.mesh.axis_names if a not in self.axes + self.replica_axes)

    @property
    def model_parallel(self) -> int:
        """M: how many devices share one data-parallel replica's model shards
        (the product of the model axes' sizes; 1 on a data-only mesh)."""
        return math.prod(self.mesh.shape[a] for a in self.model_axes)

    @property
    def manual_axes(self) -> frozenset[str]:
        """The axes the step's ``shard_map`` runs manual over: every mesh axis,
        or with ``param_specs`` / ``batch_spec`` the batch axes only (the
        model axes stay the compiler's)."""
        if self.param_specs is None and self.batch_spec is None:
            return frozenset(self.mesh.axis_names)
        return frozenset(self.batch_axes)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: ``replica_axis`` then ``axis``."""
        return self.replica_axes + self.axes

    @property
    def num_batch_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def axis_name(self) -> str | tuple[str, ...]:
        """The partition axis name to pass to ``jax.lax`` collectives."""
        return self.axes[0] if len(self.axes) == 1 else self.axes

    @property
    def comm(self) -> Axes:
        """The axes the step's collectives run over (a ``_collectives.Axes``)."""
        cast = self.precision.gather_cast  # pyright: ignore[reportOptionalMemberAccess] - set in __post_init__
        return Axes(self.axes, self.replica_axes, self.optimizer_over_replicas, self.wire, self.secondary_axis, cast)

    @property
    def num_secondary_shards(self) -> int:
        """hpZ: S, how many devices share one secondary partition (the
        ``secondary_axis``'s size); 0 without hpZ."""
        return self.mesh.shape[self.secondary_axis] if self.secondary_axis else 0

    # -- which state a stage partitions ---------------------------------------------

    @property
    def partitions_params(self) -> bool:
        return self.stage >= 3

    @property
    def partitions_grads(self) -> bool:
        return self.stage >= 2

    @property
    def partitions_opt_state(self) -> bool:
        return self.stage >= 1

    # -- layouts -------------------------------------------------------------------

    def is_stacked(self, path: KeyPath | str) -> bool:
        """Whether ``path`` lies under one of the ``stacked`` prefixes (its leading axis is a layer axis)."""
        return under_any(path, self.stacked_prefixes)

    @property
    def whole_prefixes(self) -> tuple[tuple[str, ...], ...]:
        """The ``whole_matrices`` prefixes as tuples of key names."""
        return tuple(split_prefix(p) for p in self.whole_matrices)

    def is_whole(self, path: KeyPath | str) -> bool:
        """Whether ``path`` lies under one of the ``whole_matrices`` prefixes."""
        return under_any(path, self.whole_prefixes)

    def is_matrix_stack(self, path: KeyPath | str) -> bool:
        """Whether ``path`` lies under one of the ``matrix_stacks`` prefixes."""
        return under_any(path, tuple(split_prefix(p) for p in self.matrix_stacks))

    def leaf_layout(
        self, leaf: Any, *, stacked: bool, model: tuple[Any, ...] = (), whole: bool = False, stack: bool = False
    ) -> LeafLayout:
        shape, dtype = shape_dtype(leaf)
        # Pad to a multiple of the optimizer's piece count: with
        # optimizer_over_replicas it is a multiple of the parameters' N too,
        # so both cuts share one stored shape.
        return layout_of(
            shape,
            dtype,
            self.num_state_shards,
            min_shard_size=self.min_shard_size,
            skip_leading=stacked,
            model=model,
            whole=whole,
            stack=stack,
        )

    def layouts(self, params: PyTree) -> PyTree:
        """The partition layout of every parameter leaf (a mirrored pytree of
        :class:`LeafLayout`), whatever the stage: the stage decides which
        state *uses* the layout.

        Raises ``ValueError`` when a ``stacked`` prefix matches no leaf.
        """
        pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
        fields = (
            ("stacked", self.stacked_prefixes),
            ("whole_matrices", self.whole_prefixes),
            ("matrix_stacks", tuple(split_prefix(p) for p in self.matrix_stacks)),
        )
        for field, prefixes in fields:
            unmatched = [prefix for prefix in prefixes if not any(under(p, prefix) for p, _ in pairs)]
            if unmatched:
                raise ValueError(
                    STACKED_MATCHES_NOTHING.format(
                        field=field,
                        which=", ".join(repr("/".join(prefix)) for prefix in unmatched),
                        s="" if len(unmatched) == 1 else "es",
                        entries=sorted({path_str(p[:1]) for p, _ in pairs}),
                    )
                )
        models = model_entries(
            self.param_specs, params, self.mesh, self.axes + self.replica_axes, lambda leaf: shape_dtype(leaf)[0]
        )
        stacked = [self.is_stacked(p) for p, _ in pairs]
        whole = [self.is_whole(p) for p, _ in pairs]
        stacks = [self.is_matrix_stack(p) for p, _ in pairs]
        layouts = [
            self.leaf_layout(x, stacked=s, model=m, whole=w, stack=k)
            for (_, x), s, m, w, k in zip(pairs, stacked, models, whole, stacks, strict=True)
        ]
        if self.wire != WireFormat():
            paths = [path_str(p) for p, _ in pairs]
            check_quant_block(paths, layouts, stacked, self.num_shards, self.mesh.shape, self.wire.block)
        return jax.tree_util.tree_unflatten(treedef, layouts)

    def state_layouts(self, state: PyTree, params: PyTree | None = None) -> PyTree:
        """Layouts for an optimizer state tree.

        A state leaf that mirrors a parameter (its key path ends with the
        parameter's key path and it has the parameter's shape, like Adam's
        ``mu['w']``) takes that parameter's layout, so elementwise optimizer
        math stays on-device; any other leaf (Adafactor's row statistics,
        counters, injected hyperparameters) gets the rule on its own.
        """
        by_path: dict[KeyPath, tuple[tuple[int, ...], LeafLayout]] = {}
        if params is not None:
            for p, lay in jax.tree_util.tree_flatten_with_path(self.layouts(params), is_leaf=is_layout)[0]:
                by_path[tuple(p)] = (lay.shape, lay)
        pairs, treedef = jax.tree_util.tree_flatten_with_path(state)
        out = []
        for path, leaf in pairs:
            shape, dtype = shape_dtype(leaf)
            hits = (by_path.get(tuple(path[start:])) for start in range(len(path) + 1))
            hit = next((h for h in hits if h is not None and h[0] == shape), None)
            mirrors = hit is not None and is_float(dtype)
            out.append(dataclasses.replace(hit[1], dtype=dtype) if mirrors else self.leaf_layout(leaf, stacked=False))  # pyright: ignore[reportOptionalSubscript] - set here: a check above pyright cannot follow
        return jax.tree_util.tree_unflatten(treedef, out)

    # -- shardings -----------------------------------------------------------------

    def named_sharding(
        self, layout: LeafLayout, partitioned: bool, axes: tuple[str, ...] | None = None
    ) -> NamedSharding:
        """The sharding of one stored leaf cut over ``axes`` (default: the
        parameters' partition axes; ``self.state_axes`` for optimizer state)."""
        # Mesh axes of size 1 cut nothing; leaving them out keeps the spec in the
        # form the compiler reports back, so a step's output state has exactly
        # its input's shardings (no second compilation).
        axes = tuple(a for a in (self.axes if axes is None else axes) if self.mesh.shape[a] > 1)
        return NamedSharding(self.auto_mesh, layout.sharding_spec(axes if partitioned else ()))

    def shardings(self, layouts: PyTree, partitioned: bool, axes: tuple[str, ...] | None = None) -> PyTree:
        """``named_sharding`` of every layout of a tree."""
        return jax.tree.map(lambda lay: self.named_sharding(lay, partitioned, axes), layouts, is_leaf=is_layout)

    def param_sharding(self, params: PyTree) -> PyTree:
        """``NamedSharding`` of each stored parameter (partitioned in stage 3).

        A partitioned leaf is stored padded to ``LeafLayout.stored_shape``.
        """
        return self.shardings(self.layouts(params), self.partitions_params)

    def grad_sharding(self, params: PyTree) -> PyTree:
        """``NamedSharding`` of each gradient as the step holds it
        (partitioned in stages 2 and 3; over ``state_axes``, like the
        optimizer state that consumes it)."""
        return self.shardings(self.layouts(params), self.partitions_grads, self.state_axes)

    def opt_state_sharding(self, opt_state: PyTree, params: PyTree | None = None) -> PyTree:
        """``NamedSharding`` of each stored optimizer-state leaf (partitioned
        from stage 1). Pass ``params`` so mirrored leaves take their
        parameter's layout (needed for ``stacked`` subtrees)."""
        return self.shardings(self.state_layouts(opt_state, params), self.partitions_opt_state, self.state_axes)

    def batch_sharding(self, batch: PyTree = None) -> Any:
        """Every batch leaf is split along its leading dimension over
        ``replica_axis`` and ``axis`` (and its other dimensions as
        ``batch_spec`` says): one ``NamedSharding`` for them all; given a
        ``batch``, one per leaf, a scalar leaf (a typed RNG key, a step
        count) replicated."""
        rows = NamedSharding(self.auto_mesh, batch_partition_spec(self.batch_axes, self.batch_spec))
        if batch is None:
            return rows
        return jax.tree.map(lambda x: self.replicated() if is_replicated_leaf(x) else rows, batch)

    def batch_manual_spec(self, batch: PyTree = None) -> Any:
        """The batch's spec over the step's manual (batch) axes only: what its
        ``shard_map`` takes (per leaf given a ``batch``: ``P()`` for scalars)."""
        rows = batch_partition_spec(self.batch_axes, None)
        return rows if batch is None else batch_leaf_specs(batch, rows)

    def check_batch(self, batch: PyTree, *, where: str, microbatches: int = 1) -> None:
        """Raise a ValueError naming every batch leaf whose leading (batch)
        dimension does not split over the data axis (and ``microbatches``),
        or whose ``batch_spec`` dimensions do not split over their axes."""
        check_batch_leaves(batch, where=where, n=self.num_batch_shards, axes=self.batch_axes,
                           microbatches=microbatches, batch_spec=self.batch_spec, mesh=self.mesh)  # fmt: skip

    def program_mesh(self) -> AbstractContextManager[Any]:
        """The mesh context zero_jax's programs are traced and run in:
        :attr:`auto_mesh`, this policy's mesh with every axis Auto.

        Under ``jax.set_mesh(mesh)`` of a mesh with ``AxisType.Explicit`` axes
        a sharding constraint is an assert and ``shard_map`` wants its mesh to
        be the context's; under another mesh's ``set_mesh`` (other devices)
        ``jit`` refuses the policy's shardings. So every entry point enters
        this around its programs: outside a trace it sets the policy's Auto
        mesh (``jax.set_mesh``, the concrete mesh too), inside one (``jax.jit``
        of a user's own, which ``jax.set_mesh`` refuses) the abstract mesh
        (``jax.sharding.use_abstract_mesh``). With no mesh in context, the
        Auto mesh already, or inside a ``shard_map`` (manual axes: a nested
        call) nothing changes, so the programs are those of an Auto mesh.
        """
        current = jax.sharding.get_abstract_mesh()
        target = self.auto_mesh.abstract_mesh
        if current.empty or current == target or AxisType.Manual in current.axis_types:
            return contextlib.nullcontext()
        try:
            return jax.set_mesh(self.auto_mesh)  # set on construction, restored on exit
        except ValueError:  # inside a trace: jax.set_mesh is refused there
            return jax.sharding.use_abstract_mesh(target)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.auto_mesh, PartitionSpec())

    def replicated_leaves(self, tree: PyTree) -> list[ReplicatedLeaf]:
        """The leaves of ``tree`` (a parameter tree) that this policy's
        partitioned state keeps whole on every device, with their bytes.

        >>> import jax, numpy as np, zero_jax as zj
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> pol = zj.ZeroPolicy(stage=3, mesh=mesh)
        >>> [r.path for r in pol.replicated_leaves({"b": np.zeros(16), "w": np.zeros((64, 64))})]
        ['b']
        """
        pairs = jax.tree_util.tree_flatten_with_path(self.layouts(tree), is_leaf=is_layout)[0]
        return [
            ReplicatedLeaf(path_str(p), lay.shape, lay.dtype, lay.nbytes, lay.reason)
            for p, lay in pairs
            if not lay.partitioned
        ]

    # -- what a stage does in the step (added by the step owner) --

    @property
    def optimizer_sees_slice(self) -> bool:
        """The optimizer updates a slice of parameters that are stored whole
        over its axes (stages 1-2; stage 3 with ``optimizer_over_replicas``,
        whose optimizer is cut R times finer than the parameters): the step
        slices the parameters for it and all-gathers the updated pieces."""
        return self.stage in (1, 2) or (self.stage == 3 and self.optimizer_over_replicas)

    @property
    def default_accum_mode(self) -> str:
        """``make_train_step``'s accumulation mode when none is given:
        partitioned where gradients are (memory is the point), else local."""
        return "partitioned" if self.partitions_grads else "local"


def _normalised_default(name: str, default: Any) -> Any:
    """A field's default as ``__post_init__`` normalises it (what :meth:`ZeroPolicy.__repr__` leaves out)."""
    return {"axis": _names, "replica_axis": _names, "stacked": _prefixes, "whole_matrices": _prefixes,
            "matrix_stacks": _prefixes,
            "precision": lambda p: p if p is not None else Precision(), "offload_optimizer": float}.get(
        name, lambda v: v)(default)  # fmt: skip


def _refuse(what: str) -> Callable[..., None]:
    def refuse(self: ZeroPolicy, name: str, *value: Any) -> None:
        raise AttributeError(FROZEN.format(what=what, name=name))

    return refuse


# The dataclass is frozen; the error says how to change a policy instead.
ZeroPolicy.__setattr__ = _refuse("set")  # type: ignore[method-assign,assignment]
ZeroPolicy.__delattr__ = _refuse("delete")  # type: ignore[method-assign,assignment]
