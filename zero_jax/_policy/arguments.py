"""The checks of ``ZeroPolicy``'s arguments: every problem collected, then one
error (``ZeroPolicy.__post_init__`` raises it). The stage and wire checks are
the formulas' own (:mod:`zero_jax._theory.checks`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from jax.sharding import Mesh

from zero_jax._base.problems import Problem
from zero_jax._base.units import UNITS_HELP, is_real_number, is_whole_number, parse_bytes
from zero_jax._layout.leaf import LeafLayout, piece_elements
from zero_jax._policy.batch import batch_spec_problem
from zero_jax._policy.memory import activation_offload_problems, offload_problems
from zero_jax._policy.precision import Precision
from zero_jax._theory.checks import BAD_STAGE, is_stage, wire_problems
from zero_jax._theory.wire import DEFAULT_BLOCK

WHERE = "ZeroPolicy"
BAD_MESH = (
    "ZeroPolicy: mesh must be a jax.sharding.Mesh, got {kind}. "
    "Make one with jax.make_mesh((jax.device_count(),), ('data',))."
)
BAD_AXIS = (
    "ZeroPolicy: axis {axis!r} is not an axis of the mesh, whose axes are {names}. "
    "Pass axis= one of those names (or a tuple of them)."
)
BAD_REPLICA_AXIS = (
    "ZeroPolicy: replica_axis {replica_axis!r} is not a set of axes of the mesh, whose axes are {names}. Pass the "
    "mesh axis that holds the replicas (e.g. 'replica'), or build the mesh with it: "
    "jax.make_mesh((R, N), ('replica', 'data'))."
)
AXIS_TWICE = (
    "ZeroPolicy: {both} is both a partition axis (axis={axis!r}) and a replica axis "
    "(replica_axis={replica_axis!r}); an axis either partitions state or replicates it."
)
OVER_REPLICAS_STAGE_0 = (
    "ZeroPolicy: optimizer_over_replicas=True needs stage >= 1: stage 0 partitions no optimizer state. "
    "Use stage=1 or higher, or drop optimizer_over_replicas."
)
OVER_REPLICAS_WITHOUT_REPLICAS = (
    "ZeroPolicy: optimizer_over_replicas=True partitions the optimizer state across replica_axis as "
    "well; pass replica_axis=... (the mesh axis holding the replicas)."
)
SECONDARY_NOT_IN_AXIS = (
    "ZeroPolicy: secondary_axis={secondary!r} must be one of the partition axes axis={axis!r}, the fast one "
    "(the chips of one node): e.g. mesh = jax.make_mesh((nodes, chips), ('node', 'chip')) and "
    "ZeroPolicy(stage=3, mesh=mesh, axis=('node', 'chip'), secondary_axis='chip')."
)
SECONDARY_ONE_AXIS = (
    "ZeroPolicy: secondary_axis={secondary!r} needs axis to name several mesh axes (got axis={axis!r}): hpZ keeps "
    "a secondary partition over the fast axis inside the primary partition over all of them. Partition over "
    "both, axis=('node', {secondary!r}), or drop secondary_axis."
)
SECONDARY_STAGE = (
    "ZeroPolicy: secondary_axis (ZeRO++'s hpZ) acts on stage 3's parameter gathers; stage {stage} gathers no "
    "parameters in the step. Use stage=3, or drop secondary_axis."
)
SECONDARY_WITH = (
    "ZeroPolicy: secondary_axis does not combine with {what} (not built). Drop one of them; for a slow link "
    "between replicas, replica_axis with stage 3 (HSDP) keeps every parameter gather inside a replica."
)
BAD_WHOLE = (
    "ZeroPolicy: {field} must be key paths or prefixes ('w1', 'layers/attn') or a tuple of them "
    "(ZeroPolicy(..., **zj.matrix_leaves(tx, params)) gives them), got {value!r}."
)
BAD_STACKED = "ZeroPolicy: stacked must be a key-path prefix ('layers', 'decoder/blocks') or a tuple of them, got {!r}."
BAD_PARTITION_ACTIVATIONS = "ZeroPolicy: partition_activations must be True or False, got {!r}."
PARTITION_ACTIVATIONS_WITHOUT_MODEL = (
    "ZeroPolicy: partition_activations=True cuts the layer inputs saved for the backward pass over the model "
    "axes of a tensor- or sequence-parallel layout, but param_specs is None{why}. Pass param_specs=... (the "
    "model's layout over a mesh axis other than the ZeRO and replica axes), or drop partition_activations."
)
PARTITION_ACTIVATIONS_STAGE = (
    "ZeroPolicy: partition_activations=True acts in the layer-wise schedule of stages 2-3 (zj.scan_layers, "
    "zj.apply_layer(s) keep each layer's input for its backward recompute there); stage {stage} runs layers under "
    "a plain jax.checkpoint. Use stage=2 or 3, or drop partition_activations."
)
BAD_BUCKET_BYTES = (
    "ZeroPolicy: bucket_bytes must be a positive whole number of bytes or a size such as '4MiB', got {value!r}{why}. "
    "Pass e.g. bucket_bytes=4 * 2**20 or bucket_bytes='4MiB' (None leaves the backend's combiner unbounded)."
)
QUANT_BLOCK_TOO_LARGE = (
    "ZeroPolicy: quant_block={block} is larger than every piece it would quantize: the largest, '{path}', "
    "is {elements} elements per device and layer. Pass quant_block <= {elements} (a power of two such as "
    "{suggest} keeps blocks aligned)."
)


def _names(value: Any) -> tuple[Any, ...]:
    if value is None:  # an axis or prefix argument: one name, a sequence of them, or a wrong value alone
        return ()
    return (value,) if isinstance(value, str) or not isinstance(value, Iterable) else tuple(value)


def argument_problems(
    stage: Any,
    mesh: Any,
    axis: Any,
    replica_axis: Any,
    optimizer_over_replicas: Any,
    min_shard_size: Any,
    stacked: Any,
    precision: Any,
    whole_matrices: Any = (),
    matrix_stacks: Any = (),
    param_specs: Any = None,
    partition_activations: Any = False,
    batch_spec: Any = None,
    quantize_weights: Any = None,
    quantize_grads: Any = None,
    quant_block: Any = DEFAULT_BLOCK,
    offload_optimizer: Any = False,
    offload_params: Any = False,
    offload_activations: Any = False,
    bucket_bytes: Any = None,
    secondary_axis: Any = None,
) -> list[Problem]:
    """Every problem with ``ZeroPolicy``'s arguments, each with its exception type."""
    problems: list[Problem] = []
    stage_ok = is_stage(stage)
    if not stage_ok:
        problems.append((ValueError, BAD_STAGE.format(where=WHERE, stage=stage)))
    if not isinstance(mesh, Mesh):
        problems.append((TypeError, BAD_MESH.format(kind=type(mesh).__name__)))
    else:
        names = tuple(mesh.axis_names)
        axes, replicas = _names(axis), _names(replica_axis)
        if not axes or any(a not in names for a in axes):
            problems.append((ValueError, BAD_AXIS.format(axis=axis, names=names)))
        elif len(set(axes)) != len(axes):
            problems.append((ValueError, f"ZeroPolicy: axis {axis!r} names an axis twice; name each axis once."))
        if any(a not in names for a in replicas) or len(set(replicas)) != len(replicas):
            problems.append((ValueError, BAD_REPLICA_AXIS.format(replica_axis=replica_axis, names=names)))
        both = sorted(set(replicas) & set(axes))
        if both:
            problems.append((ValueError, AXIS_TWICE.format(both=both, axis=axis, replica_axis=replica_axis)))
        if optimizer_over_replicas and not replicas:
            problems.append((ValueError, OVER_REPLICAS_WITHOUT_REPLICAS))
    if optimizer_over_replicas and stage_ok and int(stage) == 0:
        problems.append((ValueError, OVER_REPLICAS_STAGE_0))
    if precision is not None and not isinstance(precision, Precision):
        problems.append((TypeError, f"ZeroPolicy: precision must be a zj.Precision, got {type(precision).__name__}."))
    if not is_whole_number(min_shard_size):
        problems.append((TypeError, f"ZeroPolicy: min_shard_size must be an int (elements), got {min_shard_size!r}."))
    elif min_shard_size < 0:
        problems.append((ValueError, f"ZeroPolicy: min_shard_size must be >= 0, got {min_shard_size}."))
    if not isinstance(stacked, str) and not all(isinstance(p, str) for p in _names(stacked)):
        problems.append((TypeError, BAD_STACKED.format(stacked)))
    for field, value in (("whole_matrices", whole_matrices), ("matrix_stacks", matrix_stacks)):
        if not isinstance(value, str) and not all(isinstance(p, str) for p in _names(value)):
            problems.append((TypeError, BAD_WHOLE.format(field=field, value=value)))
    problems.extend(_activation_problems(mesh, axis, replica_axis, param_specs, partition_activations))
    spec_problem = batch_spec_problem(batch_spec, mesh, _names(axis) + _names(replica_axis))
    if spec_problem:
        problems.append((ValueError, spec_problem))
    if isinstance(partition_activations, (bool, np.bool_)) and partition_activations and stage_ok and int(stage) < 2:
        problems.append((ValueError, PARTITION_ACTIVATIONS_STAGE.format(stage=stage)))
    known_stage = int(stage) if stage_ok else None
    problems.extend(wire_problems(known_stage, quantize_weights, quantize_grads, quant_block, WHERE))
    problems.extend(offload_problems(offload_optimizer, offload_params, known_stage, mesh))
    problems.extend(activation_offload_problems(offload_activations, known_stage, mesh))
    problems.extend(bucket_problems(bucket_bytes))
    problems.extend(secondary_problems(secondary_axis, stage, axis, replica_axis, optimizer_over_replicas, param_specs))
    if isinstance(precision, Precision) and not precision.compute_copy:
        others = {"optimizer_over_replicas": optimizer_over_replicas, "quantize_weights": quantize_weights,
                  "secondary_axis": secondary_axis, "offload_optimizer": offload_optimizer,
                  "offload_params": offload_params}  # fmt: skip
        given = [f"{k}={v!r}" for k, v in others.items() if v not in (None, False, 0, 0.0)]
        if (stage_ok and int(stage) != 3) or given:
            problems.append((ValueError, NO_COMPUTE_COPY.format(stage=stage, given=", ".join(given) or "none")))
    return problems


NO_COMPUTE_COPY = (
    "ZeroPolicy: Precision(compute_copy=False) casts stage 3's parameter pieces before their all-gather, so it "
    "needs stage=3 (got {stage}) with the pieces gathered as they are stored (got {given}; it does not combine "
    "with optimizer_over_replicas, quantize_weights, secondary_axis or offload): use stage=3 without those, or "
    "keep the compute copy (compute_copy=True)."
)


def secondary_problems(
    secondary: Any, stage: Any, axis: Any, replica_axis: Any, over_replicas: Any, param_specs: Any
) -> list[Problem]:
    """The problems with ``ZeroPolicy(secondary_axis=...)`` (hpZ), if any."""
    if secondary is None:
        return []
    axes = _names(axis)
    if not isinstance(secondary, str) or secondary not in axes:
        return [(ValueError, SECONDARY_NOT_IN_AXIS.format(secondary=secondary, axis=axis))]
    problems: list[Problem] = []
    if len(axes) < 2:
        problems.append((ValueError, SECONDARY_ONE_AXIS.format(secondary=secondary, axis=axis)))
    if is_stage(stage) and int(stage) != 3:
        problems.append((ValueError, SECONDARY_STAGE.format(stage=stage)))
    others = [what for what, given in (("replica_axis", replica_axis), ("optimizer_over_replicas", over_replicas),
                                       ("param_specs (tensor parallelism)", param_specs)) if given]  # fmt: skip
    if others:
        problems.append((ValueError, SECONDARY_WITH.format(what=" or ".join(others))))
    return problems


def bucket_problems(value: Any) -> list[Problem]:
    """The problem with ``ZeroPolicy(bucket_bytes=...)``, if any: a positive
    whole number of bytes, or a size string (``"4MiB"``, ``"1MB"``)."""
    if value is None:
        return []
    if not isinstance(value, str) and not is_real_number(value):
        return [(TypeError, BAD_BUCKET_BYTES.format(value=value, why=f" ({type(value).__name__})"))]
    try:
        size = parse_bytes(value, "ZeroPolicy: bucket_bytes")
    except ValueError:
        return [(ValueError, BAD_BUCKET_BYTES.format(value=value, why=f" (the units are {UNITS_HELP})"))]
    if not size >= 1 or size != int(size):
        why = " (not a whole number of bytes)" if size >= 1 else ""
        return [(ValueError, BAD_BUCKET_BYTES.format(value=value, why=why))]
    return []


def bucket_size(value: Any) -> int | None:
    """``bucket_bytes`` as a number of bytes (checked by :func:`bucket_problems`)."""
    return None if value is None else int(parse_bytes(value, "ZeroPolicy: bucket_bytes"))


def _activation_problems(mesh: Any, axis: Any, replica_axis: Any, param_specs: Any, partition: Any) -> list[Problem]:
    if not isinstance(partition, (bool, np.bool_)):
        return [(TypeError, BAD_PARTITION_ACTIVATIONS.format(partition))]
    if not partition or param_specs is not None:
        return []
    others = [] if not isinstance(mesh, Mesh) else [
        a for a in mesh.axis_names if a not in _names(axis) + _names(replica_axis)
    ]  # fmt: skip
    why = f" (the mesh's other axes {tuple(others)} hold replicas)" if others else " and the mesh has no model axis"
    return [(ValueError, PARTITION_ACTIVATIONS_WITHOUT_MODEL.format(why=why))]


def check_quant_block(
    paths: list[str], layouts: list[LeafLayout], stacked: list[bool], num_shards: int, mesh_shape: Any, block: int
) -> None:
    """Raise when ``block`` exceeds every piece the wire quantizes (one
    device's piece of one layer of each partitioned leaf): no piece could
    then be cut into blocks."""
    pieces = [
        (path, piece_elements(lay, num_shards, mesh_shape, s))
        for path, lay, s in zip(paths, layouts, stacked, strict=True)
        if lay.partitioned
    ]
    if not pieces:
        return
    path, elements = max(pieces, key=lambda item: item[1])
    if block > elements:
        suggest = 1 << (elements.bit_length() - 1)
        raise ValueError(QUANT_BLOCK_TOO_LARGE.format(block=block, path=path, elements=elements, suggest=suggest))
