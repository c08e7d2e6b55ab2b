"""What ``zj.audit`` returns: the report, its parts and the violations it can name.

:class:`AuditReport` holds what a compiled step keeps on each device and
sends per step, beside its stage's contract; :class:`Violation` is one broken
promise and :class:`AuditError` lists them all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from zero_jax._audit.estimate import StepEstimate
from zero_jax._audit.hlo import Collective
from zero_jax._base.units import fmt_bytes, is_real_number
from zero_jax._layout.leaf import LeafLayout
from zero_jax._theory.wire import WireFormat

#: The state categories of a report, in ZeRO's order, and the ``TrainState``
#: fields that fall in each: the fp32 master copy (mixed precision) is
#: optimizer state in ZeRO's accounting (the K = 12 of the paper); any other
#: array field (the step counter, a loss scale) is "other".
CATEGORIES = ("params", "grads", "optimizer", "other")
FIELD_CATEGORY = {"params": "params", "opt_state": "optimizer", "master": "optimizer", "grads": "grads"}

#: Violation kinds ``check()`` reports.
GRADIENT_ALL_REDUCE = "gradient-sized all-reduce"
REPLICATED_LEAF = "partitionable leaf replicated"
COMM_OVER_THEORY = "communication over theory"
REDUCE_IN_ACCUM_LOOP = "collective inside the accumulation loop"
LAYERS_ALIVE = "more whole layers alive than prefetch + 1"
MODEL_AXIS_GATHER = "weight gathered across a model axis"
WIDE_WIRE = "collective asked to be int8 runs wider"
BUFFER_OVER_BOUND = "communication buffer over the bound"

#: Allocation more than this fraction over XLA's live peak is reported as fragmentation (ZeRO's M_D).
FRAGMENTATION_SLACK = 0.10
#: How many of the buffers alive at the live peak the report names.
PEAK_BUFFERS_SHOWN = 5
#: How many member shapes of a combined collective the report writes out.
SHAPES_SHOWN = 4
#: The programs a :class:`CommBuffer` is read from.
POST_SPMD, COMPILED = "post-SPMD", "compiled"
OUTSIDE_BLOCKS = "outside blocks"

BUFFER_MESSAGE = (
    "{program} {kind} '{name}' (op {op_name}{block}, x{trips} per step) moves one buffer of {nbytes} ({shapes}), "
    "over {what} = {bound}: a communication buffer must not grow with the model (ZeRO's constant-size "
    "buffers). {fix}"
)
#: What :data:`BUFFER_MESSAGE` advises, for a bound passed to ``check`` and for the policy's own.
BUFFER_FIX = {
    "max_buffer_bytes": "Build the policy with ZeroPolicy(..., bucket_bytes=...) (the backend's combiner is then told "
    "the bound), or split the block's collectives into buckets of at most the bound.",
    "bucket_bytes": "The backend combined collectives past the bound it was given (ZeroPolicy(bucket_bytes=...)): "
    "this backend's combiner options (zero_jax/_layerwise/schedule.py, BUCKET_OPTIONS) do not bound this kind.",
}
BAD_BOUND = "check: max_buffer_bytes must be a positive number of bytes (or None), got {bound!r}."
NO_BUFFERS = (
    "check(max_buffer_bytes=...): this report has no communication buffers read (report.buffers is None); "
    "audit the step with zj.audit to judge its buffers."
)


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
    model_split: int = 1  # how many ways its sharding cuts it over model axes
    model_dims: tuple[bool, ...] = ()  # per dimension: cut over a model axis

    @property
    def replicated(self) -> bool:
        """Whole on some device (with model axes: its whole model shard)."""
        return self.per_device * self.model_split >= self.nbytes


@dataclasses.dataclass(frozen=True)
class Communication:
    """Bytes one device sends per step (ring-counted), measured and in theory.

    Attributes:
      measured: every collective of the partitioned program, times its loops'
        trip counts; with model axes, those spanning a data or replica axis
        (ZeRO's side: a collective over model axes only is the model's own).
      theory: the stage's accounting on this model, for each leaf's model
        shard (its bytes / how many ways model axes cut it): gradients reduce-scattered
        and (stages 1–2) updated parameters all-gathered on the padded
        partitioned leaves, or (stage 3) gathered twice per microbatch; leaves
        kept whole all-reduced (two passes); all in the dtypes the step moves.
      accounted: ``theory`` less the backward re-gathers the program does not
        need (stage 3: leaves whose gradient does not use their value, like an
        embedding table or a first layer's weight, are gathered once).
      skipped_regathers: which gathered shapes ran fewer times than the
        theory's two per microbatch, and the leaves of that shape.
      formula: the planner's model-level :func:`zero_jax.comm_bytes` at this
        Φ per model shard, N, stage, mean bytes per parameter and wire format
        (no padding, no leaves kept whole): reported beside, not judged.

    On a quantized wire (``ZeroPolicy(quantize_weights=, quantize_grads=)``)
    the theory counts each quantized pass of a leaf at its int8 blocks and
    float32 scales: ``(N - 1) / N · N · wire_bytes(piece, quant_block)``.
    """

    measured: float
    theory: float
    accounted: float
    skipped_regathers: tuple[str, ...] = ()
    formula: float = 0.0

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
class BlockSchedule:
    """What the compiled step gathers and reduces for one block, or for every
    layer of a scan (``layers`` > 1; counts are totals over them), per step.

    Attributes:
      name: ``"block 3"`` (a ``zj.apply_layer(s)`` block, named in the HLO by
        its ``zj_block3_*`` scopes), ``"scan layers/*"`` (``zj.scan_layers``
        over a stacked prefix) or ``"blocks/*"`` (repeated blocks of the
        parameter tree gathered some other way, e.g. ``zj.gather``).
      layers: how many layers the counts are over.
      weights: partitioned leaves per layer.
      forward, backward: all-gather executions per step (backward: the
        re-gathers of the backward pass).
      reduce_scatters: gradient reduce-scatter executions per step.
      bytes: one layer's gathered (whole) bytes.
      kept: layers that keep their gathered parameters from the forward pass
        for the backward (``keep_gathered``: named so in the program), which
        gather once per step, not twice.
    """

    name: str
    layers: int
    weights: int
    forward: int
    backward: int
    reduce_scatters: int
    bytes: int
    kept: int = 0

    @property
    def gathers_per_weight(self) -> float:
        """All-gathers per weight per layer per step (ZeRO-3: 2, forward + backward)."""
        return (self.forward + self.backward) / max(self.layers * self.weights, 1)

    @property
    def reduces_per_weight(self) -> float:
        """Reduce-scatters per weight per layer per step (1 when reduced once)."""
        return self.reduce_scatters / max(self.layers * self.weights, 1)


@dataclasses.dataclass(frozen=True)
class LayerSchedule:
    """The per-layer schedule of a step, read from the compiled program.

    Attributes:
      blocks: one :class:`BlockSchedule` per block (or scan).
      layer_bytes: the largest block's gathered bytes.
      max_alive: the largest number of whole layers alive at once, from a walk
        of the compiled program's schedule (see
        :func:`zero_jax._audit.schedule.layers_alive`): each block's gathered buffers
        from the all-gather to their last use; a whole layer is one block's
        gather (forward or backward copy), or a layer's worth of unnamed
        layer-shaped gathered elements (a scan's queue included).
      where: the instruction at which ``max_alive`` is reached.
      prefetch: the prefetch it is judged against (``zj.audit(prefetch=)``).
      judged: whether ``check()`` holds a stage-3 manual step to ``prefetch +
        1`` layers: for blocks (``zj.apply_layer(s)``, the adapters, or
        blocks gathered with ``zj.gather``), not for a program whose only
        layers are ``zj.scan_layers`` scans: at prefetch >= 1 the scan's
        backward prefetch queue is gathered before its loop and XLA hoists it
        to the program's start (3 layers alive at prefetch 1), a known cost
        reported here until the scan ties that gather to its loop's input.
    """

    blocks: tuple[BlockSchedule, ...]
    layer_bytes: int
    max_alive: int
    where: str
    prefetch: int
    judged: bool = True

    @property
    def kept(self) -> int:
        """Layers kept gathered from the forward pass to the backward (``keep_gathered``)."""
        return sum(b.kept for b in self.blocks)

    @property
    def limit(self) -> int:
        """The whole layers a stage-3 manual step may hold at once: ``prefetch + 1``, plus the kept layers."""
        return self.prefetch + 1 + self.kept

    def lines(self) -> list[str]:
        """The report's text for the schedule."""
        kept = f" + {self.kept} kept" if self.kept else ""
        if not any(b.forward + b.backward for b in self.blocks):
            out = ["layer schedule: no layer all-gathers (the parameters are whole)"]
        else:
            out = [f"layer schedule: at most {self.max_alive} whole layer(s) alive at once (prefetch {self.prefetch}"
                   f"{kept}: limit {self.limit}{'' if self.judged else ', scans: reported, not judged'}; layer "
                   f"{fmt_bytes(self.layer_bytes)}; at {self.where or '-'})"]  # fmt: skip
        out += [
            f"  {b.name:<16} x{b.layers:<3} {b.weights} weight(s): all-gathers {b.forward} forward + {b.backward} "
            f"backward ({b.gathers_per_weight:g} per weight), gradient reductions {b.reduce_scatters} "
            f"({b.reduces_per_weight:g} per weight), {fmt_bytes(b.bytes)} per layer"
            + (
                f"; {'kept gathered' if b.layers == 1 else f'{b.kept} kept gathered'} (no backward re-gather)"
                if b.kept
                else ""
            )  # fmt: skip
            for b in self.blocks
        ]
        return out


@dataclasses.dataclass(frozen=True)
class CompiledKind:
    """One collective kind in the compiled program (what the backend runs), per step.

    Attributes:
      kind: what the collectives do (a decomposed reduce-scatter counts as a
        reduce-scatter).
      ops: compiled instructions doing it (a combined op's members count once).
      executions: members x trips, as the post-SPMD counts go.
      bytes: the whole tensors moved (a gather's result, a reduce-scatter's
        input), x trips.
      ring_bytes: what one device sends, as a ring moves it (a collective done
        as all-reduce: two passes of the whole tensor).
      dtypes: the wire dtypes.
      async_executions: executions with a start and a done (not synchronous).
      decomposed: executions the backend does as all-reduce (a reduce-scatter
        as all-reduce + dynamic-slice, a small all-gather as an all-reduce of
        a zero-filled piece).
    """

    kind: str
    ops: int
    executions: int
    bytes: int
    ring_bytes: float
    dtypes: tuple[str, ...]
    async_executions: int
    decomposed: int


@dataclasses.dataclass(frozen=True)
class CompiledComm:
    """What the compiled program sends per device per step, beside the
    post-SPMD program the audit judges.

    The step's own collectives are those right after SPMD partitioning (its
    logical kinds and dtypes); the backend may then rewrite them. Measured on
    libtpu 0.0.42.1: on v5p every reduce-scatter becomes an all-reduce of the
    whole operand + a dynamic-slice (twice the ring bytes), on v5e those that
    scatter a minor dimension; an f32 gather feeding a matmul is narrowed to
    bf16. ``check()`` judges the post-SPMD program, so a correct step passes
    whatever the backend does with it, and a wrong one (a gradient
    all-reduced whole, a leaf left replicated) fails on every backend.

    Attributes:
      backend: the platform and device kind (``"tpu (TPU v5)"``, ``"cpu"``).
      kinds: one :class:`CompiledKind` per kind.
      post_spmd: ring bytes of the post-SPMD program (every collective).
      theory: the stage's theory (``report.comm.theory``).
    """

    backend: str
    kinds: tuple[CompiledKind, ...]
    post_spmd: float
    theory: float

    @property
    def ring_bytes(self) -> float:
        return float(sum(k.ring_bytes for k in self.kinds))

    def kind(self, name: str) -> CompiledKind | None:
        return next((k for k in self.kinds if k.kind == name), None)

    @property
    def decomposed_reduce_scatters(self) -> tuple[int, int]:
        """(done as all-reduce, all) reduce-scatter executions."""
        rs = self.kind("reduce-scatter")
        return (rs.decomposed, rs.executions) if rs is not None else (0, 0)

    def lines(self, post_kinds: Mapping[str, tuple[float, tuple[str, ...]]] | None = None) -> list[str]:
        """The report's text (``post_kinds``: kind -> post-SPMD ring bytes and dtypes, for the notes)."""
        out = [f"compiled program ({self.backend}; what the backend runs, per device per step):"]
        for k in self.kinds:
            note = f"  ({k.decomposed} of {k.executions} done as all-reduce: 2 passes)" if k.decomposed else ""
            out.append(
                f"  {k.kind:<19}{'/'.join(k.dtypes):<9} {k.ops:>4} ops x{k.executions:<5} {fmt_bytes(k.bytes):>11}  "
                f"ring {fmt_bytes(k.ring_bytes)}" + (f", {k.async_executions} async" if k.async_executions else "")
                + note
            )  # fmt: skip
        done, total = self.decomposed_reduce_scatters
        ratio = f" ({self.ring_bytes / self.theory:.4f}x theory)" if self.theory else ""
        out.append(
            f"  ring {fmt_bytes(self.ring_bytes)} compiled{ratio} against {fmt_bytes(self.post_spmd)} post-SPMD"
            + (f"; reduce-scatters decomposed into all-reduce: {done} of {total}" if total else "")
        )
        for k in self.kinds:
            post, dtypes = (post_kinds or {}).get(k.kind, (0.0, ()))
            delta = k.ring_bytes - post
            if post_kinds is not None and abs(delta) > 1e-3 * max(post, 1.0):
                why = []
                if k.decomposed:
                    why.append(f"{k.decomposed} done as all-reduce")
                if dtypes and tuple(dtypes) != k.dtypes:
                    why.append(f"{'/'.join(dtypes)} -> {'/'.join(k.dtypes)} on the wire")
                out.append(f"    {k.kind}: {'+' if delta > 0 else '-'}{fmt_bytes(abs(delta))} against post-SPMD"
                           + (f" ({', '.join(why)})" if why else ""))  # fmt: skip
        if done:
            out.append("  check() judges the post-SPMD program (the step's own collectives), not the backend's rewrite")
        return out


class OverlapRow(NamedTuple):
    """Collectives of one role in the compiled schedule (executions per step)."""

    role: str  # "layer all-gather", "layer reduction" or "other"
    ops: int
    executions: int
    async_executions: int
    overlapped: int  # with compute between start and done (or fused into its continuation steps)
    bytes: int = 0  # of the whole tensors, per step (a gather's result, a reduction's input)
    overlapped_bytes: int = 0

    @property
    def exposed(self) -> int:
        return self.executions - self.overlapped


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Overlap of communication with compute, read off the compiled schedule
    (:func:`zero_jax._audit.schedule.layer_overlap`): a collective is
    overlapped when compute is scheduled between its start and its done; a
    synchronous one is exposed by definition (XLA:CPU runs every collective
    so: its fraction is 0)."""

    rows: tuple[OverlapRow, ...]

    def row(self, role: str) -> OverlapRow | None:
        return next((r for r in self.rows if r.role == role), None)

    @property
    def gather_fraction(self) -> float:
        """Layer all-gather executions overlapped with compute / all of them (0 when none)."""
        r = self.row("layer all-gather")
        return r.overlapped / r.executions if r is not None and r.executions else 0.0

    @property
    def gather_bytes_fraction(self) -> float:
        """The same by bytes: a layer's small leaves (norm scales, biases) are gathered by
        latency-bound collectives the backend keeps synchronous, and weigh by what they carry."""
        r = self.row("layer all-gather")
        return r.overlapped_bytes / r.bytes if r is not None and r.bytes else 0.0

    @property
    def reduction_fraction(self) -> float:
        r = self.row("layer reduction")
        return r.overlapped / r.executions if r is not None and r.executions else 0.0

    @property
    def exposed(self) -> int:
        """Collective executions per step with no compute in flight beside them."""
        return sum(r.exposed for r in self.rows)

    def lines(self) -> list[str]:
        out = [
            f"overlap (compiled schedule): layer all-gathers {self.gather_fraction:.0%} overlapped with compute "
            f"({self.gather_bytes_fraction:.0%} of their bytes), layer reductions {self.reduction_fraction:.0%}; "
            f"{self.exposed} collective execution(s) exposed per step",
            f"  {'':<18}{'ops':>5}{'executions':>12}{'async':>7}{'overlapped':>12}{'exposed':>9}",
        ]
        out += [
            f"  {r.role:<18}{r.ops:>5}{r.executions:>12}{r.async_executions:>7}{r.overlapped:>12}{r.exposed:>9}"
            for r in self.rows
        ]
        if not any(r.async_executions for r in self.rows):
            out.append("  every collective is synchronous in this program (no start/done pair): exposed by definition")
        return out


@dataclasses.dataclass(frozen=True)
class PeakBuffer:
    """One buffer alive at XLA's live peak: the instruction that defines it
    (and the tuple index), its bytes and the JAX op that made it."""

    name: str
    index: str
    bytes: int
    op_name: str = ""


@dataclasses.dataclass(frozen=True)
class Fragmentation:
    """Device memory the compiled step allocates beside XLA's live peak
    (ZeRO's M_D: XLA plans memory statically, so fragmentation is the gap
    between what its heap packs and what is alive at once).

    Attributes:
      allocated: the buffer assignment's total in device memory (the
        memory-usage report's default space: HBM on TPU), else argument +
        output + temp − alias.
      live_peak: the bytes of the values alive at once at the busiest point of
        the schedule (``HloLiveRange``, arguments still in use included),
        before the heap packs them into buffers.
      at, at_op_name: the instruction scheduled at the peak and its JAX op.
      buffers: the largest buffers alive at the peak (at most
        :data:`PEAK_BUFFERS_SHOWN`), largest first.
    """

    allocated: int
    live_peak: int
    at: str
    at_op_name: str
    buffers: tuple[PeakBuffer, ...]

    @property
    def ratio(self) -> float:
        """allocated / live peak (1.0: packed without a gap)."""
        return self.allocated / self.live_peak if self.live_peak else math.inf

    @property
    def fragmented(self) -> bool:
        """Allocation exceeds the live peak by more than :data:`FRAGMENTATION_SLACK`."""
        return self.ratio > 1 + FRAGMENTATION_SLACK

    def lines(self) -> list[str]:
        """The report's text: the ratio, and where the peak is when fragmented."""
        head = (f"allocated {fmt_bytes(self.allocated)} / XLA's live peak {fmt_bytes(self.live_peak)} (values alive "
                f"at once, before heap packing) = {self.ratio:.3f}")  # fmt: skip
        if not self.fragmented:
            return [f"memory: {head} (within {FRAGMENTATION_SLACK:.0%}: no fragmentation)"]
        at = f"{self.at} ({self.at_op_name})" if self.at_op_name else self.at
        out = [
            f"fragmentation: {head}: allocation exceeds the live peak by {self.ratio - 1:.0%} "
            f"({fmt_bytes(self.allocated - self.live_peak)} the heap cannot reuse); the peak is at {at or '-'}; "
            "largest buffers alive there:"
        ]
        out += [f"  {fmt_bytes(b.bytes):>11}  {b.name}{b.index if b.index != '{}' else ''}"
                + (f"  ({b.op_name})" if b.op_name else "") for b in self.buffers]  # fmt: skip
        return out


@dataclasses.dataclass(frozen=True)
class CommBuffer:
    """One communication buffer of the step: a collective of the post-SPMD
    program, or one op of the compiled program (the members of a combined op
    together: one buffer).

    Attributes:
      program: :data:`POST_SPMD` or :data:`COMPILED`.
      kind: what it does (a combined op of several kinds: theirs joined by ``+``).
      name: the instruction; op_name: the JAX op that made it (one member's).
      bytes: the buffer: a gather's result, a reduce-scatter's input, the
        others' operand; summed over a combined op's members.
      shapes: its members' ``dtype[dims]``.
      block: ``"block 3"`` (its ``zj_block3_*`` scope), ``"loop x8"`` (unnamed,
        in loops run 8 times per step: a scan's layers) or :data:`OUTSIDE_BLOCKS`.
      trips: executions per step.
    """

    program: str
    kind: str
    name: str
    bytes: int
    shapes: tuple[str, ...]
    op_name: str
    block: str
    trips: int

    @property
    def shape_text(self) -> str:
        """Its members' shapes, the first few of a large combined op."""
        more = len(self.shapes) - SHAPES_SHOWN
        return ", ".join(self.shapes[:SHAPES_SHOWN]) + (f", and {more} more" if more > 0 else "")


@dataclasses.dataclass(frozen=True)
class BlockComm:
    """The collectives of one layer-wise block per step.

    Attributes:
      name: ``"block 3"``, ``"loop x8"`` (collectives named by no block,
        inside loops of 8 trips per step: a ``zj.scan_layers`` scan's layers,
        counted over all of them) or :data:`OUTSIDE_BLOCKS`.
      post_spmd: kind -> executions per step in the post-SPMD program (one
        per array: what the step asks for).
      compiled: kind -> compiled ops executed per step (a combined op's
        members once: the launches the backend makes); empty when the
        compiled program was not read.
      largest: the block's largest single buffer (either program).
    """

    name: str
    post_spmd: Mapping[str, int]
    compiled: Mapping[str, int]
    largest: int


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Communication buffers of a step (ZeRO's C_B, constant-size buffers):
    collectives per block and every buffer, read off the post-SPMD program and
    the compiled one. ``check(max_buffer_bytes=...)`` flags each buffer over
    the bound (:meth:`over`)."""

    blocks: tuple[BlockComm, ...]
    buffers: tuple[CommBuffer, ...]  # largest first
    #: The policy's ``bucket_bytes`` (None: unbounded): no buffer but a single tensor's may exceed it.
    bound: int | None = None

    def largest(self, program: str = POST_SPMD) -> CommBuffer | None:
        """The step's largest single buffer in ``program`` (None: no collective)."""
        return next((b for b in self.buffers if b.program == program), None)

    def over(self, bound: float, *, single_alone: bool = False, what: str = "max_buffer_bytes") -> list[Violation]:
        """One violation per buffer (either program) over ``bound`` bytes;
        with ``single_alone``, not a buffer of one tensor (which no bucket
        can split: ``bucket_bytes`` lets it go alone)."""
        return [
            Violation(
                BUFFER_OVER_BOUND,
                f"{b.program}:{b.name}",
                BUFFER_MESSAGE.format(
                    program=b.program,
                    kind=b.kind,
                    name=b.name,
                    op_name=b.op_name or "-",
                    trips=b.trips,
                    block="" if b.block == OUTSIDE_BLOCKS else f", {b.block}",
                    nbytes=fmt_bytes(b.bytes),
                    shapes=b.shape_text,
                    bound=fmt_bytes(bound),
                    what=what,
                    fix=BUFFER_FIX[what],
                ),
            )  # fmt: skip
            for b in self.buffers
            if b.bytes > bound and not (single_alone and len(b.shapes) == 1)
        ]

    def bound_lines(self) -> list[str]:
        """The bound (``bucket_bytes``) and how the buffers stand against it."""
        if self.bound is None:
            return []
        alone = [b for b in self.buffers if b.bytes > self.bound and len(b.shapes) == 1]
        over = len([b for b in self.buffers if b.bytes > self.bound]) - len(alone)
        return [f"communication buffers bounded by bucket_bytes = {fmt_bytes(self.bound)}: "
                + (f"{over} combined buffer(s) over it" if over else "none combined over it")
                + (f"; {len(alone)} single tensor(s) larger than the bound go alone" if alone else "")]  # fmt: skip

    def lines(self) -> list[str]:
        """The report's text: the bound, the largest buffers and the collectives per block."""
        out = self.bound_lines()
        for program in (POST_SPMD, COMPILED):
            b = self.largest(program)
            if b is not None:
                out.append(f"largest communication buffer ({program}): {fmt_bytes(b.bytes)}, {b.kind} '{b.name}' "
                           f"({b.shape_text}; {b.block}; op {b.op_name or '-'})")  # fmt: skip
        if self.blocks:
            out.append("collectives per block per step (post-SPMD executions; compiled ops launched):")
        for blk in self.blocks:
            post = ", ".join(f"{k} {n}" for k, n in sorted(blk.post_spmd.items())) or "-"
            comp = ", ".join(f"{k} {n}" for k, n in sorted(blk.compiled.items())) or "-"
            out.append(f"  {blk.name:<16} post-SPMD: {post}; compiled: {comp}; largest {fmt_bytes(blk.largest)}")
        return out


#: The report's line about matrices an optimizer multiplies that stay whole (``ZeroPolicy(whole_matrices=)``).
WHOLE_MATRICES_NOTE = (
    "matrices kept whole for the optimizer (single matrices, or stacks of fewer than N={n}): {count}, their "
    "gradients all-reduced, their optimizer state whole on every device and their update computed on each: {leaves}"
)


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
      frozen_bytes: of ``state_bytes["params"]``, the bytes per device of
        frozen parameters (a LoRA base: no gradient, no optimizer state, no
        gradient communication; stage 3 partitions them like the rest), the
        sum over those leaves of the most any device holds.
      formula: category -> :func:`zero_jax.model_state_bytes` for this Φ, N,
        stage and the run's bytes per parameter (``bytes_per_param``); with
        model axes, for one model shard: each leaf counts its elements / how
        many ways model axes cut it (the formula / M when all leaves are cut
        M ways).
      bytes_per_param: ``param_bytes``, ``grad_bytes``, ``optimizer_bytes`` as
        this run stores them (optimizer: all float optimizer-state leaves and a
        master copy, per parameter).
      leaves: every state leaf with its whole and per-device bytes.
      replicated: the float leaves kept whole on a device in a category the
        stage partitions (small ones are expected: see ``min_shard_size``).
      whole_matrices: the parameters kept whole because the optimizer
        multiplies them by themselves (``ZeroPolicy(whole_matrices=)``: a
        single matrix, or a stack of fewer matrices than devices).
      memory: ``compiled.memory_analysis()`` per device: argument, output,
        temp, alias, and ``peak`` = argument + output + temp − alias; where
        the compile's dump reports them, ``allocated`` (the buffer
        assignment's device-memory total: HBM on TPU), ``live_peak`` (XLA's
        live peak: bytes of the values alive at once at the busiest point,
        ``HloLiveRange``) and ``fragmentation`` = allocated (else ``peak``) /
        ``live_peak``.
      fragmentation: the same figures with where the peak is and the largest
        buffers alive there (:class:`Fragmentation`); the text says when
        allocation exceeds the live peak by more than 10%.
      buffers: the communication buffers (:class:`Buffers`): collectives per
        layer-wise block per step (post-SPMD executions and compiled ops by
        kind) and every buffer, the largest of the step first, and the
        policy's ``bucket_bytes`` (``buffers.bound``: each combined buffer
        over it is a violation); ``check(max_buffer_bytes=...)`` flags each
        one over another bound.
      collectives: the partitioned program's collectives (kind, dtype, shape,
        bytes, trips), and ``loops``: instruction name -> trip counts of the
        loops around it, outermost first.
      comm: :class:`Communication`, measured beside the theory.
      comm_per_axis: measured ring bytes per device per step by the mesh
        axes each collective spans (``"data"``; on a hybrid mesh also
        ``"replica"`` and ``"replica+data"``; on a ``("data", "model")`` mesh
        ``"data"``, ``"model"``, ``"data+model"``): what crosses the slow axis.
      comm_per_axis_kind: the same, by collective kind (axes -> kind -> bytes).
      model_axes, model_parallel: the mesh axes in no ZeRO role and M, the
        product of their sizes (``()`` and 1 on a data-only mesh).
      params_per_model_shard: Φ of one model shard, the Φ the formula and
        the theory are for: each leaf's elements / how many ways model axes
        cut it (Φ / M when every leaf is cut M ways, Φ on a data-only mesh).
      violations: what ``check()`` raises about.
      layers: the per-layer schedule (:class:`LayerSchedule`) when the step
        runs blocks (``zj.apply_layer(s)``, ``zj.scan_layers``, or repeated
        blocks of the parameter tree) in stages 2–3; else None.
      abstract: measured on ``ShapeDtypeStruct`` inputs (bytes from shardings).
      wire: the policy's wire format (``policy.wire``: what qwZ / qgZ quantize).
      wire_roles: per collective (aligned with ``collectives``): ``"int8
        values"``, ``"float32 scales"`` (the scales beside them) or ``""``.
      compiled: what the compiled program (the backend's, after its own
        rewrites) sends per kind, beside the post-SPMD figure
        (:class:`CompiledComm`).
      overlap: layer gathers and reductions overlapped with compute in the
        compiled schedule (:class:`Overlap`).
      estimate: on GPU, the step time XLA:GPU's latency-hiding schedule
        estimates (:class:`zero_jax._audit.estimate.StepEstimate`; its
        ``with_flops(model_flops)`` gives MFU); None on other backends.
      schedule: which entry of the schedule seam the step was built with (the
        running compiler's own or the nearest) and what the compiler refused
        of its options (``Schedule.describe``).
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
    memory: Mapping[str, float]
    collectives: tuple[Collective, ...]
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
    layers: LayerSchedule | None = None
    comm_per_axis_kind: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
    model_axes: tuple[str, ...] = ()
    model_parallel: int = 1
    params_per_model_shard: float = 0.0
    wire: WireFormat = WireFormat()
    wire_roles: tuple[str, ...] = ()
    compiled: CompiledComm | None = None
    overlap: Overlap | None = None
    fragmentation: Fragmentation | None = None
    buffers: Buffers | None = None
    schedule: str = ""
    estimate: StepEstimate | None = None
    whole_matrices: tuple[str, ...] = ()
    frozen_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def check(self, *, max_buffer_bytes: float | None = None) -> AuditReport:
        """Raise :class:`AuditError` listing every violation; return ``self``
        when there is none.

        ``max_buffer_bytes``: a bound on any single communication buffer
        (:attr:`buffers`, post-SPMD and compiled): each buffer over it is a
        violation naming the collective, a single tensor's included. A policy
        with ``bucket_bytes`` is judged by that bound without being asked
        (in :attr:`violations`; a single tensor larger than it goes alone)."""
        violations = self.violations
        if max_buffer_bytes is not None:
            if not is_real_number(max_buffer_bytes) or not max_buffer_bytes > 0:
                raise ValueError(BAD_BOUND.format(bound=max_buffer_bytes))
            if self.buffers is None:
                raise ValueError(NO_BUFFERS)
            named = {v.subject for v in violations}
            violations += tuple(v for v in self.buffers.over(max_buffer_bytes) if v.subject not in named)
        if violations:
            raise AuditError(violations, f"zj.audit: stage {self.stage} at N = {self.num_devices}")
        return self

    def _roles(self) -> tuple[str, ...]:
        return self.wire_roles if len(self.wire_roles) == len(self.collectives) else ("",) * len(self.collectives)

    def collective_summary(self) -> list[dict[str, Any]]:
        """Rows of (kind, dtype, role on the wire, in loop, executions per
        step, bytes, ring bytes); ``role`` is ``"int8 values"``, ``"float32
        scales"`` or ``""`` (see ``wire_roles``)."""
        rows: dict[tuple[str, str, str, bool], dict[str, Any]] = {}
        for c, role in zip(self.collectives, self._roles(), strict=True):
            key = (c.kind, c.dtype, role, bool(self.loops.get(c.name)))
            row = rows.setdefault(key, {
                "kind": c.kind, "dtype": c.dtype, "role": role, "in_loop": key[3], "count": 0, "bytes": 0,
                "ring_bytes": 0.0,
            })  # fmt: skip
            row["count"] += c.trips
            row["bytes"] += c.bytes * c.trips
            row["ring_bytes"] += c.total_ring_bytes
        return sorted(rows.values(), key=lambda r: (r["kind"], r["dtype"], r["role"], r["in_loop"]))

    def wire_bytes(self) -> dict[str, dict[str, float]]:
        """Ring bytes one device sends per step, by collective kind and wire
        dtype: ``{"all-gather": {"s8": ..., "f32 scales": ...}, "reduce-scatter":
        {"f32": ...}}`` (a scale collective's key is its dtype + ``" scales"``)."""
        out: dict[str, dict[str, float]] = {}
        for c, role in zip(self.collectives, self._roles(), strict=True):
            key = f"{c.dtype} scales" if role == "float32 scales" else c.dtype
            kinds = out.setdefault(c.kind, {})
            kinds[key] = kinds.get(key, 0.0) + c.total_ring_bytes
        return out

    def wire_lines(self) -> list[str]:
        """The report's text for the wire: bytes per collective kind and dtype,
        and what the policy asks to quantize."""
        w = self.wire
        asked = [a for a in (w.weights and f"weights {w.weights} (qwZ)", w.grads and f"grads {w.grads} (qgZ)") if a]
        head = "wire (ring bytes per device per step, by kind and dtype"
        lines = [head + (f"; quantized: {', '.join(asked)}, blocks of {w.block}):" if asked else "):")]
        for kind, dtypes in sorted(self.wire_bytes().items()):
            parts = sorted(dtypes.items(), key=lambda kv: (kv[0].endswith("scales"), kv[0]))
            lines.append(f"  {kind:<19}" + ", ".join(f"{dt}: {fmt_bytes(b)}" for dt, b in parts))
        return lines

    def __str__(self) -> str:
        lines = [
            f"zj.audit: stage {self.stage}, N = {self.num_devices}"
            + (f", M = {self.model_parallel} (model axes {'+'.join(self.model_axes)})" if self.model_axes else "")
            + f", Φ = {self.num_params:,} parameters"
            + (self._per_shard() if self.model_axes else "")
            + (" (abstract inputs: bytes from shardings)" if self.abstract else ""),
            "state bytes per device (max over devices / ZeRO formula"
            + (" per model shard" if self.model_axes else "")
            + " at "
            + ", ".join(f"{k}={v:g}" for k, v in self.bytes_per_param.items())
            + " B per parameter):",
        ]
        for cat in CATEGORIES:
            if cat in self.state_bytes:
                f = self.formula.get(cat)
                ratio = f" / {fmt_bytes(f)} = {self.state_bytes[cat] / f:.4f}" if f else ""
                lines.append(f"  {cat:<10} {fmt_bytes(self.state_bytes[cat]):>12}{ratio}")
                if cat == "params" and self.frozen_bytes:
                    frozen = fmt_bytes(self.frozen_bytes)
                    lines.append(f"    of which frozen (no gradient, no optimizer state) {frozen}")
        if self.host_bytes:
            lines.append(
                "offloaded to pinned_host per device: "
                + ", ".join(f"{cat} {fmt_bytes(b)}" for cat, b in self.host_bytes.items())
            )
        kept = sum(leaf.per_device for leaf in self.replicated)
        lines.append(f"leaves kept whole in partitioned categories: {len(self.replicated)} ({fmt_bytes(kept)})")
        if self.whole_matrices:
            lines.append(WHOLE_MATRICES_NOTE.format(count=len(self.whole_matrices), n=self.num_devices,
                                                    leaves=", ".join(self.whole_matrices)))  # fmt: skip
        m = self.memory
        lines.append(
            "compiled memory per device: "
            + ", ".join(f"{k} {fmt_bytes(m[k])}" for k in ("argument", "output", "temp", "alias", "peak"))
        )
        lines.extend(self.fragmentation.lines() if self.fragmentation is not None else [])
        lines.append("collectives (post-SPMD, per step):")
        for r in self.collective_summary():
            lines.append(
                f"  {r['kind']:<19}{r['dtype']:<5} {'in loop' if r['in_loop'] else '       '} "
                f"x{r['count']:<5} {fmt_bytes(r['bytes']):>11}  ring {fmt_bytes(r['ring_bytes'])}"
                + (f"  ({r['role']})" if r["role"] else "")
            )
        lines.extend(self.wire_lines())
        lines.extend(self.comm_lines())
        lines.extend(self.compiled.lines(self.post_spmd_by_kind()) if self.compiled is not None else [])
        lines.extend(self.layers.lines() if self.layers is not None else [])
        lines.extend(self.overlap.lines() if self.overlap is not None else [])
        lines.extend(self.buffers.lines() if self.buffers is not None else [])
        lines.extend([self.schedule] if self.schedule else [])
        lines.extend(self.estimate.lines() if self.estimate is not None else [])
        if self.violations:
            lines.append(f"VIOLATIONS ({len(self.violations)}):")
            lines.extend(f"  - {v}" for v in self.violations)
        else:
            lines.append("check: passed (no gradient-sized all-reduce, no partitionable leaf replicated, "
                         + ("no weight gathered across a model axis, " if self.model_axes else "")
                         + ("no collective asked to be int8 running wider, " if self.wire != WireFormat() else "")
                         + f"communication within {self.tolerance:.0%} of theory)")  # fmt: skip
        return "\n".join(lines)

    def post_spmd_by_kind(self) -> dict[str, tuple[float, tuple[str, ...]]]:
        """Kind -> ring bytes per device per step and dtypes of the post-SPMD
        collectives (what :attr:`compiled` is compared with)."""
        out: dict[str, tuple[float, tuple[str, ...]]] = {}
        for c in self.collectives:
            ring, dtypes = out.get(c.kind, (0.0, ()))
            out[c.kind] = (ring + c.total_ring_bytes, tuple(sorted({*dtypes, c.dtype})))
        return out

    def _per_shard(self) -> str:
        shard = self.params_per_model_shard
        return f" ({shard:,.0f} per model shard: Φ / {self.num_params / shard:.3g})" if shard else ""

    def comm_lines(self) -> list[str]:
        """The report's text for communication: measured beside the theory,
        and (with model axes, or on a hybrid mesh) by the mesh axes."""
        c, model = self.comm, set(self.model_axes)
        over = " over the data axes" if model else ""
        lines = [
            f"communication: {fmt_bytes(c.measured)} per device per step{over}; theory {fmt_bytes(c.theory)}"
            + (f" (ZeRO formula per model shard, M = {self.model_parallel})" if model else "")
            + f" (measured/theory {c.ratio:.4f}); accounted {fmt_bytes(c.accounted)} ({c.accounted_ratio:.4f})"
            + (f"; formula {fmt_bytes(c.formula)}" if c.formula else "")
        ]
        lines.extend(f"  skipped re-gather: {s}" for s in c.skipped_regathers)
        if not model:
            if len(self.comm_per_axis) > 1:
                by_axes = sorted(self.comm_per_axis.items())
                lines.append("  by mesh axes: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in by_axes))
            return lines
        lines.append("  by mesh axes (ring bytes per device per step, by kind):")
        for key, kinds in sorted(self.comm_per_axis_kind.items()):
            total = sum(kinds.values())
            model_only = key != "none" and set(key.split("+")) <= model
            note = "the model's own layout" if model_only else "ZeRO's side"
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in sorted(kinds.items()))
            lines.append(f"    {key:<14}{fmt_bytes(total):>12}  ({parts}; {note})")
        return lines


class ParamInfo(NamedTuple):
    """One float parameter as the audit judges it."""

    path: str
    layout: LeafLayout
    dtype: np.dtype
    frozen: bool  # the optimizer never changes it: no gradient is reduced
    stacked: bool  # under one of the policy's ``stacked`` prefixes (a leading layer axis)
    split: tuple[int, ...] = ()  # how many ways each dimension is cut over model axes (() or all 1: none)
    cast: np.dtype | None = None  # the dtype its pieces are cast to before a gather (Precision(compute_copy=False))

    @property
    def model_split(self) -> int:
        """How many model shards the leaf is cut into (1: whole on every model shard)."""
        return math.prod(self.split)

    @property
    def wire_dtype(self) -> np.dtype:
        """The dtype it moves in: ``cast`` when set (the compute dtype of a
        stage 3 without compute copy), else the dtype it is stored in."""
        return self.cast if self.cast is not None else self.dtype
