"""The audit's communication: the stage's theory on this model, on a plain or quantized wire.

:func:`communication` is what a step of this policy sends on this model
(padding, leaves kept whole, frozen leaves, accumulation and the re-gathers
stage 3's backward pass skips), beside what the compiled program sends;
:func:`comm_violation` flags a step above it.

On a quantized wire (ZeRO++'s qwZ and qgZ): with
``ZeroPolicy(quantize_weights="int8")`` each stage-3 all-gather of a
partitioned weight travels as ``all-gather s8[N, nb, block]`` plus
``all-gather f32[N, nb]`` (one float32 scale per block); with
``quantize_grads="int8"`` each gradient reduce-scatter of stages 1-3 becomes
``all-to-all s8[N, nb, block]`` plus ``all-to-all f32[N, nb]``. Here ``nb``
is ``num_blocks(piece, block)`` for the leaf's *piece*: its padded stored
elements on one model shard / N (one layer of it for a scan's per-layer
gathers). So one pass of a quantized leaf moves ``(N - 1) / N · N ·
wire_bytes(piece, block)`` ring bytes per device (:func:`pass_bytes`), not
``(N - 1) / N · stored · itemsize``. This module is the one home of that
figure, of the roles of a program's collectives (:func:`wire_roles`: int8
values, float32 scales, or plain), of the check that a collective asked to be
int8 did not run wider (:func:`wire_violations`).

>>> quantized_shape(3000, 8, 256)  # a piece of 3,000 elements: 12 blocks, sent by 8 devices
(8, 12, 256)
>>> pass_bytes(3000, 8, 256)  # (N - 1) x wire_bytes: 7 x (12 x 256 + 12 x 4)
21840.0
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from zero_jax._audit.hlo import DTYPE_BYTES, Collective, ring_bytes
from zero_jax._audit.model_axes import is_model_only, local_shape
from zero_jax._audit.report import COMM_OVER_THEORY, WIDE_WIRE, Communication, ParamInfo, Violation
from zero_jax._base.units import fmt_bytes
from zero_jax._layout.leaf import is_real_float, piece_elements
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._theory.wire import block_size, num_blocks, wire_bytes

#: What each collective of a program is on the wire (``AuditReport.wire_roles``).
VALUES, SCALES, PLAIN = "int8 values", "float32 scales", ""
QUANTIZED_KINDS = ("all-gather", "all-to-all")
_GRAD_KINDS = ("reduce-scatter", "all-to-all", "all-reduce")
WIDE_WIRE_MESSAGE = (
    "{kind} '{name}' (op {op_name}) of {shape} ({nbytes}, x{trips}) over {axes} moves {what} the size of {leaves} "
    "in {dtype}, but the policy asks for {fmt} on the wire ({option}={fmt!r}, quant_block={block}): expected "
    "{expected} plus float32[{scales}] scales ({wire} per execution instead of {nbytes}). Build the step with "
    "zj.make_train_step under this policy (ZeRO's gathers and reductions, zj.gather, zj.apply_layer(s) and "
    "zj.scan_layers, quantize); a collective of your own on a partitioned {noun} bypasses the wire format. If the "
    "step is the library's, XLA moved the dequantizing cast before the collective (jax issue 23543): keep "
    "{option}=None until that is fixed, and report it."
)
_HLO_DTYPE = {
    "float64": "f64", "float32": "f32", "bfloat16": "bf16", "float16": "f16",
    "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
}  # fmt: skip
COMM_MESSAGE = (
    "the step sends {measured} per device per step, {ratio:.3f}x the stage-{stage} theory of {theory} (tolerance "
    "{tolerance:.0%}). See report.collective_summary() for what moves; gradients reduced once per microbatch or "
    "whole-gradient all-reduces are the usual cause."
)


def _hlo_dtype(dtype: np.dtype) -> str:
    return _HLO_DTYPE.get(str(dtype), str(dtype))


def is_float_dtype(hlo_dtype: str) -> bool:
    """An HLO floating-point dtype (``f32``, ``bf16``, ``f8e4m3fn``, ...)."""
    return hlo_dtype.startswith(("f", "bf"))


def quantized_shape(piece: int, n: int, block: int) -> tuple[int, int, int]:
    """The shape of a quantized piece's collective in post-SPMD HLO: ``(N, nb,
    block)``, or ``(N, 1, piece)`` for a piece smaller than a block."""
    return (n, num_blocks(piece, block), block_size(piece, block))


def pass_bytes(piece: int, n: int, block: int) -> float:
    """Ring bytes one device sends for one quantized pass (gather or reduction)
    of a leaf whose piece has ``piece`` elements: ``(N - 1) / N`` of the N
    pieces' int8 blocks and scales."""
    return (n - 1) / n * n * wire_bytes(piece, block)


def quantized_piece(p: Any, policy: ZeroPolicy, counts: Mapping[tuple[int, ...], int]) -> tuple[int, int]:
    """(piece elements, pieces per pass) of a partitioned parameter on a
    quantized wire: one layer's piece, once per layer, for a stacked leaf the
    program moves layer by layer (at least one int8 collective of that shape
    per layer in ``counts``, shape -> executions), else the whole piece once."""
    n, block, mesh = policy.num_shards, policy.wire.block, policy.mesh.shape
    if p.stacked and p.layout.dim:
        layer = piece_elements(p.layout, n, mesh, stacked=True)
        if counts.get(quantized_shape(layer, n, block), 0) >= p.layout.shape[0]:
            return layer, p.layout.shape[0]
    return piece_elements(p.layout, n, mesh, stacked=False), 1


def wire_shape(layout: Any, n: int, block: int) -> tuple[int, ...]:
    """The int8 ``(N, nb, block)`` shape one pass of a partitioned leaf (its
    layout on one model shard, or one layer's) moves in."""
    return quantized_shape(math.prod(layout.stored_shape) // n, n, block)


def wire_stored_by_shape(params: Iterable[Any], policy: ZeroPolicy) -> dict[tuple[int, ...], tuple[int, int]]:
    """Int8 collective shape -> (elements, bytes) of the stored (dequantized)
    piece it carries whole, on one model shard: each partitioned parameter's,
    and one layer's of a stacked one; the largest on a collision."""
    n, block, out = policy.num_shards, policy.wire.block, {}
    for p in params:
        lay = p.layout
        for per_layer in (False, True) if p.stacked and lay.dim else (False,) if lay.partitioned else ():
            piece = piece_elements(lay, n, policy.mesh.shape, stacked=per_layer)
            shape = quantized_shape(piece, n, block)
            out[shape] = max(out.get(shape, (0, 0)), (piece * n, piece * n * p.wire_dtype.itemsize))
    return out


def wire_roles(colls: Iterable[Collective], policy: ZeroPolicy) -> tuple[str, ...]:
    """Per collective: :data:`VALUES` (an int8 all-gather / all-to-all of
    ``(N, nb, quant_block)``), :data:`SCALES` (the float all-gather /
    all-to-all of ``(N, nb)`` beside such a value collective) or
    :data:`PLAIN`. All plain when the policy quantizes nothing."""
    colls = tuple(colls)
    wire = policy.wire
    if wire.weights is None and wire.grads is None:
        return (PLAIN,) * len(colls)

    def values(c: Collective) -> bool:
        return c.kind in QUANTIZED_KINDS and c.dtype in ("s8", "u8") and len(c.shape) == 3 and c.shape[2] <= wire.block

    heads = {(c.kind, c.group, c.shape[:2]) for c in colls if values(c)}
    return tuple(
        VALUES if values(c) else SCALES if is_float_dtype(c.dtype) and (c.kind, c.group, c.shape) in heads else PLAIN
        for c in colls
    )


def _sizes(params: Iterable[Any], n: int, mesh_shape: Any) -> dict[Any, list[tuple[str, int]]]:
    """Elements and shape -> (path, piece elements) of each partitioned float
    parameter a collective of that size would be moving whole: its logical or
    stored shape on one model shard, or one layer of either for a stacked leaf."""
    out: dict[Any, list[tuple[str, int]]] = {}
    for p in params:
        lay = p.layout
        if not lay.partitioned:
            continue
        split = tuple(p.split) or (1,) * len(lay.shape)
        whole = {local_shape(lay.shape, split), local_shape(lay.stored_shape, split)}
        layers = {s[1:] for s in whole} if p.stacked else set()
        for shape in whole | layers:
            piece = piece_elements(lay, n, mesh_shape, stacked=shape in layers and shape not in whole)
            for key in (shape, math.prod(shape)) if math.prod(shape) >= 2 else ():  # a scalar is never a weight
                out.setdefault(key, []).append((p.path, piece))
    return out


def wire_violations(
    colls: Iterable[Collective], roles: Iterable[str], params: Iterable[Any], policy: ZeroPolicy
) -> list[Violation]:
    """Collectives the policy asks to be int8 that run in a float dtype: with
    ``quantize_weights``, an all-gather over the data axes of a partitioned
    weight's size (in elements, whole or one layer, on one model shard);
    with ``quantize_grads``, a reduce-scatter, all-to-all or all-reduce over
    the data axes of a partitioned gradient's size. Scalars, the float32
    scale collectives and collectives over model or replica axes only (the
    replica-axis reduction is never quantized) are not violations."""
    wire, n = policy.wire, policy.num_shards
    shard, sizes, out = set(policy.axes), _sizes(params, policy.num_shards, policy.mesh.shape), []
    for c, role in zip(colls, roles, strict=True):
        option = "quantize_weights" if c.kind == "all-gather" else "quantize_grads" if c.kind in _GRAD_KINDS else ""
        fmt = wire.weights if option == "quantize_weights" else wire.grads if option else None
        # An all-reduce by its shape (leaves the policy keeps whole are all-reduced by design), the rest by size.
        key = (
            c.shape
            if c.kind == "all-reduce"
            else math.prod(c.shape) * (c.group_size if c.kind == "reduce-scatter" else 1)
        )
        if fmt is None or role or not c.shape or not is_float_dtype(c.dtype) or key not in sizes:
            continue
        axes = c.axes(policy.mesh)
        if not shard & set(axes):
            continue
        leaves, noun = list(dict.fromkeys(sizes[key])), "weight" if option == "quantize_weights" else "gradient"
        piece = leaves[0][1]
        expected = f"s8[{','.join(map(str, quantized_shape(piece, n, wire.block)))}]"
        message = WIDE_WIRE_MESSAGE.format(
            kind=c.kind, name=c.name, op_name=c.op_name or "-", shape=f"{c.dtype}[{','.join(map(str, c.shape))}]",
            nbytes=fmt_bytes(c.bytes), trips=c.trips, axes="+".join(axes), dtype=c.dtype, fmt=fmt, option=option,
            leaves=", ".join(f"'{q}'" for q, _ in leaves), what=f"a {noun}", noun=noun, block=wire.block,
            expected=expected, scales=f"{n},{num_blocks(piece, wire.block)}",
            wire=fmt_bytes(n * wire_bytes(piece, wire.block)),
        )  # fmt: skip
        out.append(Violation(WIDE_WIRE, c.name, message))
    return out


def formula_inputs(params: Iterable[Any]) -> tuple[float, float]:
    """Φ on one model shard and the mean bytes per parameter: what the
    model-level formula is evaluated at beside the audit's per-leaf theory."""
    params = list(params)
    phi = sum(math.prod(p.layout.shape) / p.model_split for p in params)
    nbytes = sum(math.prod(p.layout.shape) / p.model_split * p.wire_dtype.itemsize for p in params)
    return phi, nbytes / phi if phi else 0.0


def communication(
    colls: tuple[Collective, ...],
    params: list[ParamInfo],
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
    whole are all-reduced (two passes); frozen leaves are not reduced. On a
    quantized wire (``policy.wire``) a quantized pass costs its int8 blocks
    and float32 scales (:func:`zero_jax._audit.communication.pass_bytes`).
    """
    n, model, wire = policy.num_shards, set(policy.model_axes), policy.wire
    local = steps > 1 and accum_mode == "local"
    reduces = steps if steps > 1 and not local else 1
    gathers = 1 if not policy.partitions_params else (1 if local else 2 * steps)
    zero_side = tuple(c for c in colls if not is_model_only(c, policy, model))
    gathered: dict[tuple[str, tuple[int, ...]], int] = collections.Counter()
    quantized: dict[tuple[int, ...], int] = collections.Counter()  # int8 pieces moved, by shape
    for c in zero_side:
        if c.kind == "all-gather":
            gathered[(c.dtype, c.shape)] += c.trips
        if c.kind in ("all-gather", "all-to-all") and c.dtype == "s8":
            quantized[c.shape] += c.trips
    theory = 0.0
    units: dict[tuple[str, tuple[int, ...]], list[tuple[str, int, float]]] = {}
    for p in params:
        rb = np.dtype(reduce_dtype if reduce_dtype is not None else p.wire_dtype).itemsize
        # Stage 1 reduces whole gradients; layer by layer needs the gradient reduced as the backward makes it.
        layered = quantized if policy.partitions_grads else {}
        piece, layers = quantized_piece(p, policy, layered) if p.layout.partitioned else (0, 1)
        one = pass_bytes(piece, n, wire.block)  # one quantized pass of one piece, on one model shard
        theory += _leaf_theory(p, policy, rb, reduces, gathers, one * layers * p.model_split) / p.model_split
        if policy.partitions_params and p.layout.partitioned:
            # One gather unit per use: the whole leaf (its model shard), or one layer of a
            # stacked leaf when the program gathers layer-sized pieces (``scan_layers``).
            stored = local_shape(p.layout.stored_shape, p.split)
            unit, m = ((_hlo_dtype(p.wire_dtype), stored[1:]), p.layout.shape[0]) if p.stacked else (None, 1)
            if wire.weights is not None:
                unit, m = ("s8", quantized_shape(piece, n, wire.block)), layers
            elif unit is None or gathered[unit] < m:
                unit, m = (_hlo_dtype(p.wire_dtype), stored), 1
            units.setdefault(unit, []).append((p.path, m, one))
    skipped_bytes, notes = 0.0, []
    for (dt, shape), members in sorted(units.items()):
        expected = gathers * sum(m for _, m, _ in members)
        ran = gathered[(dt, shape)]
        if 0 < ran < expected:
            # A skipped re-gather is one pass; with hpZ one within the node, over its S devices.
            ring = (n - 1) / n if not policy.secondary_axis else 1 - 1 / policy.num_secondary_shards
            one = members[0][2] if dt == "s8" else math.prod(shape) * DTYPE_BYTES.get(dt, 4) * ring
            skipped_bytes += (expected - ran) * one
            names = ", ".join(path for path, _, _ in members)
            notes.append(f"{dt}[{','.join(map(str, shape))}] gathered {ran}x, theory {expected}x ({names})")
    return Communication(ring_bytes(zero_side), theory, theory - skipped_bytes, tuple(notes))


def _leaf_theory(p: ParamInfo, policy: ZeroPolicy, rb: int, reduces: int, gathers: int, wire_pass: float) -> float:
    """Ring bytes one device sends per step for one parameter (``rb``: bytes
    per reduced gradient element; ``wire_pass``: one quantized pass of it)."""
    n, r, wire = policy.num_shards, policy.num_replicas, policy.wire
    ring, ring_all, ring_replica = (n - 1) / n, (n * r - 1) / (n * r), (r - 1) / r
    lay, itemsize = p.layout, p.wire_dtype.itemsize
    # Gradients are reduce-scattered exactly when the optimizer state is partitioned (stages 1-3).
    if not policy.partitions_opt_state or not lay.partitioned:
        return 0 if p.frozen else 2 * ring_all * math.prod(lay.shape) * rb * reduces  # all-reduced whole
    stored = math.prod(lay.stored_shape)
    reduce_pass = wire_pass if wire.grads is not None else ring * stored * rb
    out = 0.0 if p.frozen else reduce_pass * reduces  # reduce-scatter (qgZ: all-to-all) of the gradient
    if r > 1 and not p.frozen:
        # The 1/N piece crosses the replicas once per step (never quantized): all-reduced (HSDP),
        # or reduce-scattered (optimizer over replicas; gathered back below).
        out += (1 if policy.optimizer_over_replicas else 2) * ring_replica * stored / n * rb
    if policy.optimizer_over_replicas and not policy.partitions_params:
        return out + ring_all * stored * itemsize  # all-gather of the update over both axes
    if p.frozen and not policy.partitions_params:
        return out  # stages 1-2 all-gather updated parameters only: a frozen one never changes
    # A quantized base's integer codes travel as they are, whatever the wire does to float weights.
    quantized = wire.weights is not None and policy.partitions_params and is_real_float(p.dtype)
    gather_pass = wire_pass if quantized else ring * stored * itemsize
    if policy.secondary_axis:
        # hpZ: the forward gather crosses every axis (in two steps, the same bytes as one); the backward
        # re-gathers only within the node, (S - 1) of its S secondary pieces: A = N/S primary pieces each.
        s = policy.num_secondary_shards
        within = gather_pass / (n - 1) * (s - 1) * (n // s) if quantized else (s - 1) / s * stored * itemsize
        forward = max(1, gathers // 2)
        return out + gather_pass * forward + within * (gathers - forward)
    out += gather_pass * gathers  # all-gather(s) of the parameter (stages 1-2: the update, never quantized)
    if policy.optimizer_over_replicas:
        out += ring_replica * stored / n * itemsize  # update pieces -> parameter pieces
    return out


def comm_violation(comm: Communication, stage: int, tolerance: float) -> list[Violation]:
    """Communication above the theory by more than ``tolerance``."""
    if comm.measured <= comm.theory * (1 + tolerance):
        return []
    message = COMM_MESSAGE.format(
        measured=fmt_bytes(comm.measured), ratio=comm.ratio, stage=stage, theory=fmt_bytes(comm.theory),
        tolerance=tolerance,
    )  # fmt: skip
    return [Violation(COMM_OVER_THEORY, "communication", message)]
