"""The layer-wise schedule's compiler tricks: the one seam where zero_jax
steers a backend's scheduler, and why.

``scan_layers`` and ``apply_layer(s)`` (``_layerwise.scan`` / ``.blocks``) say
*what* each block gathers, recomputes and reduces, and when; a compiler is free
to reorder anything that data dependencies allow. On XLA:CPU (jax 0.10.2,
8 simulated devices) it does, in ways that undo ZeRO-3's memory saving. Each
trick below prevents one of them; :class:`Schedule` switches each on or off
per backend (:func:`schedule_for`), and every primitive reads its switches
from here.

``tie_gathers``
    XLA hoists every forward all-gather of an unrolled program to its start
    and merges (CSE) a backward re-gather into the forward gather of the same
    piece, so every block stays whole for the whole step. A gather's operand
    is therefore tied by data (:func:`tie`) to a value that exists only when
    the gather is due: the block's input (forward; for a prefetch, the input of
    the block that issues it) or its output's cotangent (backward). A block's
    input is every leaf of its arguments (:func:`inputs_anchor`): anchored on
    the first alone, a decoder block whose first argument is the token
    embedding (there at the program's start, beside the encoder output) had
    its gathers hoisted before the whole encoder. The tie
    ors the piece's bits with an integer zero made from that value, which
    changes no bit (NaN, infinities, ``-0.0`` and subnormals included) and
    which the compiler cannot fold (``a - a`` is zero only for finite ``a``).
``tie_recompute``
    A prefetched block is whole while the block after it still runs its
    backward pass; untied, XLA recomputes the two side by side, holding both
    blocks' activations. A block's recompute inputs (or, when they are the
    same on every device and cannot be tied, its weights) wait for its
    output's cotangent.
``tie_backward_order``
    The cotangent a block hands to the block before it waits for the block's
    reduce-scattered gradient, so one block's whole gradient is freed before
    the next block's backward pass runs.
``leafwise_prefetch``
    The backward pass re-gathers the next block leaf by leaf: the first
    ``head_start`` of its bytes (:data:`HEAD_START`; ``loop_head_start`` in
    ``scan_layers``' loop; the leaves it uses first, :func:`use_order`) when
    this block's backward starts, each later leaf after as many bytes of this
    block's gradients are reduce-scattered (:func:`paired_anchors`); all at
    once, the two blocks' whole leaves overlap by a whole block.
``unfusable_cut``
    With P_a (``partition_activations``) a block keeps its input cut over the
    model axes; as a plain slice, XLA fused the slice into its only consumer,
    in the backward pass, keeping the whole input alive through the forward
    pass. The cut is made by a reduce-scatter of the bits instead
    (:func:`slice_unfusable`), which no consumer can absorb.

``prefetch_across_trips``
    ``scan_layers`` issues the gather of layer i + prefetch in loop trip i and
    carries it to the next trip. Off on TPU: each layer is gathered in place,
    one layer a trip, whatever ``prefetch`` says, and the TPU compiler
    overlaps the gather with the ops that consume it (continuation fusion;
    with libtpu's loop-fusion option and a layer's small leaves joined,
    ``together_bytes``, every layer gather of the reference transformer,
    dim 1024, depth 8, v5p-8). Carried, every gather overlaps too and the
    step allocates less (0.587 GiB against 0.683 there, the 1B class 2.51
    against 2.53 GiB), but with ``offload_activations`` the loop keeps its
    saved inputs' device buffers: P_a+cpu's device temp falls by 0.5 MB
    instead of 1.8 MB for 1 MB of inputs moved (``tests/test_offload_activations.py``'s
    depth-8 step). Before the loop-fusion option the carried gathers were
    sunk to the end of the trip and overlapped nothing.
``prefetch_blocks``
    ``apply_layer(s)`` (and the adapters' ``layers=``) issue block i +
    ``prefetch``'s gather when block i starts, and in the backward pass
    block i hands block i - 1 its re-gathered parameters. Off on TPU, as
    ``prefetch_across_trips`` is: each block is gathered in place whatever
    ``prefetch`` says, and the TPU compiler overlaps each gather with the ops
    that consume it. Prefetched, every layer gather of the reference
    transformer overlapped too, and the step allocated more (the 1B class
    unscanned on v5p-8: 2.86 GiB against 2.65 in place, stage 3 / stage 1
    0.51 against 0.48; dim 512, depth 4: 0.426 against 0.364 GiB; GPT-2
    small through ``layers="auto"``: 1318 against 1312 MiB, 0.80 of the
    gathers overlapped in both). A block of two matmuls leaves its first
    forward gather nothing to overlap in place (``tests/test_audit_tpu.py``:
    12 of 16 gathers, against 16 prefetched).
``unroll_layers``
    ``scan_layers`` with ``prefetch`` > 0 and no carried prefetch unrolls its
    loops by up to this many layers (:meth:`Schedule.layers_per_trip`: a
    divisor of the depth that leaves at least two trips, so that no loop is
    inlined and no layer is left over outside it; not with
    ``offload_activations``, whose saved inputs the loop writes to host
    memory; ``prefetch=0`` keeps one layer a trip), each layer's gathers
    issued while the layer before it in the trip computes. It paid on TPU
    while the gathers that feed elementwise ops stayed synchronous (a trip's
    first gather then had no matmul before it); with the loop-fusion option
    it costs HBM for no overlap: unrolled by 4, the 1B class on v5p-8
    allocates 2.74 GiB against 2.53 one layer a trip, every layer gather
    overlapped in both (dim 1024: 0.975 of them against 1.0, 0.692 against
    0.683 GiB). 1 on both measured backends; a trial for the next one
    (``zj.measure.trying_schedule(unroll_layers=4)``).
``together_bytes``
    A layer's partitioned leaves of at most this many bytes (its norm scales
    and biases) travel in one all-gather and one reduce-scatter per dtype
    (:meth:`Schedule.together`, ``_comm.collectives.gather_together``: FSDP's
    flat parameter, for the small leaves only), the matrices alone. Apart,
    each is a latency-bound gather feeding elementwise ops, which the TPU
    compiler keeps synchronous; joined, with libtpu's loop-fusion option
    (:data:`TPU_ASYNC_ALL_GATHER`), it overlaps them as it overlaps the
    matrices' (the reference transformer, dim 1024, depth 8, v5p-8: every
    layer gather overlapped, against 0.53 of them with the vectors apart;
    the option costs HBM: 0.683 GiB allocated against 0.658 one layer a trip
    without it, +4%, and +0.3% at the 1B class, 2.53 against 2.52 GiB).
    64 KiB takes every vector up to 16K float32 elements and no matrix of
    a model of dim 128 or more: a joined matrix would lose the matmul its
    gather is fused into. At dim 256 the joined vectors (4.6 KB) still go
    as one synchronous all-reduce (libtpu's choice for the smallest
    gathers). Off on XLA:CPU (0): one collective per leaf, as the CPU
    audits count them.
``hold_host_copies``
    P_a+cpu in ``apply_layer(s)`` (unrolled blocks): each block's saved
    inputs are copied to host memory as the block is called, and the output
    of the block called next waits for that copy (:meth:`Schedule.hold`, an
    optimization barrier in the forward pass only). Unheld, the TPU compiler
    finishes each copy only when the backward pass needs it, so the inputs
    stay in HBM through the forward pass and some never leave (the reference
    transformer, depth 16, vocab 32000: 38% reach host memory, the live peak
    unchanged); held one block later, all of them leave and the live peak
    falls by 96% of their bytes (the allocation by 9%: the buffer assignment
    packs around them; at vocab 512, depth 4, the allocation falls by 11%
    held and 38% unheld, the live peak by 38% in both;
    ``benchmarks/results/offload_activations_apply*.txt``, each block
    gathered in place; prefetched, held: 90% and 22%).
    Off on XLA:CPU, whose lowering drops the moves. ``scan_layers`` needs
    nothing: its loop writes each trip's input into a host buffer.
``keep_gathered_all``
    Stage 3 with ``gather="all"`` (``make_train_step``): the parameters
    gathered for the forward pass are kept for the backward pass
    (``keep_gathered=True``: 2Ψ of traffic) unless the step says otherwise,
    instead of a ``jax.checkpoint`` over the whole loss that gathers them
    again in the backward pass (3Ψ). On XLA:GPU (jax-cuda12-plugin 0.10.2,
    8 H100 compiled deviceless) the re-gathering program peaks *above*
    stage 1: the rematerialised forward pass of the whole model holds the
    saved matmul outputs of every layer and the attention scores of the
    layer it recomputes beside the whole re-gathered parameters; kept, it
    peaks below stage 1 and sends a third less
    (``benchmarks/gpu_aot.py``'s ``3/all`` rows, ``benchmarks/results/gpu_aot.txt``).
    Off on XLA:CPU and TPU, where the re-gather is what keeps stage 3
    below stage 1.
``grad_reduction``
    How the layer-wise backward reduce-scatters each layer's gradient
    (``_comm.collectives.scatter_sum``). libtpu (0.0.42.1 and 0.0.52) runs
    an explicit ``psum_scatter`` on v5p as an all-reduce of the whole
    gradient + a dynamic-slice: two passes of the bytes, synchronous under
    every option set tried. On TPU it is a ring of ``ppermute`` steps
    (``"ring"``: N - 1 steps of 1/N of the gradient, each adding what it
    receives), which libtpu keeps as async collective-permutes overlapped
    with the backward pass's matmuls: one pass, and (v5p:2x2x2, the reference
    transformer, stage 3 layer-wise) the step's compiled bytes 1.02x the
    theory against 1.31x at the 1B class scanned, 99% of the reductions'
    bytes overlapped against none, in the same HBM (libtpu 0.0.42.1); at
    dim 256, depth 4, 1.01x against 1.32x, 98% overlapped, on both
    versions, the allocation 4-5% more scanned (0.0.52 unscanned: 1% less,
    the live peak 18% less). Both
    ways round (``"bidirectional_ring"``) overlaps as well and allocates
    more; one ``all_to_all`` and a sum (``"all_to_all"``) is one pass too but
    synchronous. ``psum_scatter`` on XLA:CPU (every collective synchronous
    there) and on GPU, where the rings lose: at the 1B class scanned on
    1 x 8 H100 XLA:GPU's schedule estimates the step at 66 ms with the ring
    against 39 ms with NCCL's reduce-scatter (at dim 1024: 19 and 26 ms one
    and both ways round against 12; ``benchmarks/gpu_schedule.py``,
    ``results/gpu_schedule_1b.txt``, ``gpu_schedule.txt``). ``zj.head_cross_entropy`` reduces
    each vocabulary chunk's gradient (layer-sized, inside its chunk loop,
    the reduction of chunk c - 1 beside chunk c's matmuls) by
    ``grad_reduction_head``, else as a layer's: on libtpu 0.0.46.3 (v5p, the
    llama 1B class on 8 chips, ``benchmarks/maxtext.py``, its
    ``results/maxtext.txt``) one ``all_to_all`` and a sum, asynchronous with
    :data:`TPU_ASYNC_ALL_TO_ALL`: the step's bytes 100% overlapped, against
    99.4% by the ring (two of each chunk's seven steps had no compute beside
    them) and 94% by ``psum_scatter`` (synchronous); on 0.0.52 100% against
    95.5% by the ring. The leaves a layer-wise
    step gathers outside the layers (``zj.gather``: the embedding, the head)
    keep ``psum_scatter``: by the ring too, the 1B class on v5p-8 sent 0.975x
    the theory instead of 1.02x but allocated 12% more HBM
    (``results/grad_reduction_outside_layers.json``). On libtpu 0.0.46.3
    the ring was measured beside MaxText (``benchmarks/maxtext.py``,
    ``results/maxtext.txt``).
    ``benchmarks/grad_reduction.py`` re-measures it
    (``benchmarks/results/grad_reduction.txt``).
``major_axis_collectives``
    ``scan_layers`` and ``zj.gather`` gather and reduce-scatter a piece cut
    along a dimension other than its first along a new leading dimension
    (``_comm.collectives.Axes.major``: the same values and bytes). XLA:GPU
    runs an all-gather or reduce-scatter along its operand's major dimension;
    along another, it lays the operand out again, and for a slice of a stacked
    piece in a loop it copies the whole stack into the new layout before the
    loop (in the buffer assignment: the reference transformer's ``attn_qkv``
    and ``mlp_in`` stacks, cut along their output columns, transposed whole).
    On against off, layer-wise stage 3 scanned on 1 x 8 H100: 14.75 against
    15.60 GiB a GPU at the 8B class, 2.57 against 2.66 at the 1B class.
``compiler_options``
    Options the step compiles with: on TPU, libtpu's async all-gather
    (:data:`TPU_ASYNC_ALL_GATHER`); with libtpu's defaults every gather is
    synchronous and nothing overlaps, and on a 64-chip v5p slice every gather
    runs as an all-reduce unless preferred as one (the 1B class, scanned
    stage 3, one layer a trip: 1.95x theory on the wire, nothing overlapped,
    1.21 GiB; with the options 1.31x, 31% of the layer gathers and 75% of
    their bytes overlapped, 1.06 GiB). With ``ZeroPolicy(bucket_bytes=...)``,
    also the bound for the backend's collective combiner
    (:data:`BUCKET_OPTIONS`, :func:`bucket_options`): the TPU compiler (v5p)
    merges the gradient all-reduces of several blocks into one buffer that grows
    with depth (its threshold is 120 MiB by default); told the bound, it
    closes a buffer before it passes it. XLA:CPU combines nothing (each
    collective of the post-SPMD program runs alone): it needs no option.
    ``benchmarks/buckets.py`` re-measures it (``benchmarks/results/buckets.txt``).

Each was measured on XLA:CPU (jax 0.10.2, 8 simulated devices) with the
reference transformer at depths 4 to 16: ``benchmarks/unscanned.py``
(apply_layers) and ``benchmarks/layerwise.py`` (scan_layers) re-measure
compiled peak, gathers and layers alive with prefetch 0 and 1
(``benchmarks/results/unscanned.txt``, ``layerwise.txt``); and on the TPU
compiler (libtpu 0.0.42.1, deviceless v5p and v5e slices), where the ties and
the leaf-by-leaf prefetch are needed as on XLA:CPU (untied, it merges the
re-gathers and hoists the gathers alike): ``benchmarks/tpu_aot.py``
(``benchmarks/results/tpu_aot.txt``). Backends that were not measured take
XLA:CPU's schedule.

The switches and options are kept per compiler version (:data:`MEASURED`: an
entry per backend and version, :func:`entry_for` the running one's or the
nearest older, :func:`accepted_options` probing each option set once per
device set so that a refused set is left out, never the reason a step fails).
The TPU entries for libtpu 0.0.46.3 and 0.0.52 were measured at the 1B class on
v5p-8 (``benchmarks/tpu_versions.py``, ``benchmarks/results/tpu_versions.txt``:
with SparseCore all-gather offload every layer gather's bytes overlapped, with
libtpu's defaults none); the other switches there are 0.0.42.1's, not yet
measured on and off on the newer versions. Under SparseCore offload the
device order of the mesh decides (libtpu 0.0.52, ``tests/test_audit_tpu.py``):
on v5p:2x2x2 the layer gathers overlap over ``jax.make_mesh``'s ring order and
stay synchronous over the topology's own order; on v5p:4x4x4 the other way
round. jaxlib 0.12.1's XLA:CPU entry differs from 0.10.2's only in its
read-only options.

The GPU entry (jax-cuda12-plugin 0.10.2; XLA:GPU compiled here without a
GPU for 1 x 8 H100, ``zj.topology_mesh``) was measured trick by trick, each
switched alone on layer-wise stage 3 of the reference transformer, scanned
and unscanned, for the buffer assignment, XLA's live peak, the layer
gathers overlapped and the step time XLA:GPU's own schedule estimates
(``benchmarks/gpu_schedule.py``: ``results/gpu_schedule.txt`` at dim 1024,
``gpu_schedule_1b.txt`` at the 1B class, ``gpu_schedule_8b.txt`` at the 8B
class). Every XLA:CPU trick is kept: scanned, none moves memory by more than
6% and switching off the carried prefetch loses overlap (dim 1024: 44% of
the layer gathers' bytes against 94%); unscanned, the ties, the leaf-by-leaf
prefetch and the block prefetch each keep the 1B step's allocation lowest (each one off allocates
more, though the estimated step is a few percent shorter: a memory-for-time
trade the entry does not take). ``unroll_layers`` and ``together_bytes``
stay as XLA:CPU's: gathering each layer in place two layers a trip shortens
the 1B step by 6% but allocates 15% more, past half of stage 1 (a trial,
``zj.measure.trying_schedule(prefetch_across_trips=False,
unroll_layers=2)``). Its own switches: ``keep_gathered_all``
(``benchmarks/gpu_aot.py``); ``loop_head_start`` 1.0: in ``scan_layers``'
loop the backward re-gathers the whole next layer as this layer's backward
starts, so the gathers run while this layer recomputes and the reductions
after them (paired with the reductions, half the next layer's gathers came
after this layer's last matmul with nothing to hide them: at the 8B class
229 ms estimated and 32 ms of it exposed, against 209 and 12 ms, for 1%
more memory; at the 1B class 45 against 39 ms in the same memory); and
``major_axis_collectives`` (the 8B class: 14.75 GiB against 15.60, the step
4% longer; the 1B class: 2.57 against 2.66 GiB). The estimates are the
schedule's own timeline (``zero_jax._audit.estimate``), not XLA's loop
statistics, which plugin 0.10.2 computes on another instruction order.
jax-cuda13-plugin 0.12.1 takes this entry as the nearest, unmeasured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Jaxpr, Literal

from zero_jax._base.jaxpr import called, live_equations
from zero_jax._base.scoped import Scoped
from zero_jax._base.toolchain import compiler_version, parse_version, version_text
from zero_jax._base.tree import PyTree
from zero_jax._comm.collectives import Axes, can_move_together, varying_axes
from zero_jax._layout.leaf import LeafLayout, is_real_float

#: The share of the next layer's bytes that the backward re-gather issues as
#: soon as the layer's backward starts (the leaves that layer uses first);
#: each later leaf waits for one of this layer's gradients (paired_anchors).
#: Half is as cheap in peak as none and issues every leaf before this layer's
#: attention backward, so the gathers have compute to hide behind.
HEAD_START = 0.5


class Schedule(NamedTuple):
    """Which of the tricks in this module's docstring a backend gets."""

    backend: str
    tie_gathers: bool = True
    tie_recompute: bool = True
    tie_backward_order: bool = True
    leafwise_prefetch: bool = True
    #: With ``leafwise_prefetch``: the share of the next layer's bytes re-gathered as its backward starts.
    head_start: float = HEAD_START
    #: The same in ``scan_layers``' loop (``None``: ``head_start``).
    loop_head_start: float | None = None
    #: ``scan_layers`` and ``zj.gather`` gather and reduce-scatter each piece along a new leading dimension
    #: (``_comm.collectives.Axes.major``).
    major_axis_collectives: bool = False
    unfusable_cut: bool = True
    prefetch_across_trips: bool = True
    prefetch_blocks: bool = True
    unroll_layers: int = 1
    #: Stage 3 with gather="all": keep the parameters gathered for the forward pass for the backward (the
    #: default of ``make_train_step(keep_gathered=...)``).
    keep_gathered_all: bool = False
    #: P_a+cpu in ``apply_layer(s)``: the output of the block ``hold_host_copies`` calls after block i waits
    #: for block i's saved inputs to reach host memory (0: nothing waits).
    hold_host_copies: int = 0
    #: Options a zero_jax step compiles with on this backend (``make_train_step`` passes them to ``jax.jit``).
    compiler_options: tuple[tuple[str, str], ...] = ()
    #: A layer's partitioned leaves of at most this many bytes (whole, as stored) move together: one all-gather
    #: and one reduce-scatter per dtype for all of them (0: each leaf its own).
    together_bytes: int = 0
    #: How the layer-wise backward reduce-scatters each layer's gradient: one of
    #: ``_comm.collectives.REDUCE_SCATTERS`` (``"ring"``: a ring of ``ppermute`` steps).
    grad_reduction: str = "psum_scatter"
    #: The same for the leaves a layer-wise step gathers outside the layers (``zj.gather``: the embedding, head).
    grad_reduction_outside: str = "psum_scatter"
    #: The same for each vocabulary chunk of ``zj.head_cross_entropy``'s head (``None``: as ``grad_reduction``).
    grad_reduction_head: str | None = None
    #: The compiler (and its version) this entry was measured on, e.g. ``"libtpu 0.0.42.1"``.
    compiler: str = ""
    #: Option sets tried in turn when the compiler refuses ``compiler_options`` on a device kind (probed once:
    #: :func:`accepted_options`); the last resort is none.
    fallback_options: tuple[tuple[tuple[str, str], ...], ...] = ()
    #: Options for a program compiled only to be read (the audit's gradient program, ``partitioned_hlo``).
    read_only_options: tuple[tuple[str, Any], ...] = ()
    #: Filled in by :func:`schedule_for`: the compiler running here, and what it refused of this entry.
    running: str = ""
    refused: tuple[str, ...] = ()

    @property
    def version(self) -> tuple[int, ...]:
        """The compiler version this entry was measured on, as a tuple (``()`` without one).

        >>> Schedule("tpu", compiler="libtpu 0.0.46.3").version
        (0, 0, 46, 3)
        """
        return parse_version(self.compiler.split()[-1]) if self.compiler else ()

    @property
    def nearest(self) -> bool:
        """Whether this entry was measured on another compiler version than the one running (the nearest)."""
        return bool(self.running) and self.running != self.compiler

    def describe(self) -> str:
        """One line: which entry of the seam's table a step was built with, and why.

        >>> Schedule("tpu", compiler="libtpu 0.0.46.3", running="libtpu 0.0.52").describe()
        'schedule seam: the tpu entry measured on libtpu 0.0.46.3 (running libtpu 0.0.52: the nearest entry)'
        """
        line = f"schedule seam: the {self.backend} entry measured on {self.compiler or 'no compiler version'}"
        if self.nearest:
            line += f" (running {self.running}: the nearest entry)"
        if self.refused:
            line += "; refused by the compiler and left out: " + "; ".join(self.refused)
        return line

    def due(self, piece: Any, anchor: Any) -> Any:
        """``piece`` for a gather, computed only once ``anchor`` exists (``tie_gathers``).
        Integer leaves are tied too: hpZ's int8 secondary pieces, whose backward
        re-gather XLA would otherwise merge with the forward's (the same
        collective of the same operand), keeping every layer's gathered codes
        alive from the forward pass to the backward."""
        return tie(piece, anchor, integers=True) if self.tie_gathers else piece

    def recompute_after(self, inputs: PyTree, cotangent: Any) -> tuple[PyTree, bool]:
        """A block's recompute inputs, waiting for its output's cotangent
        (``tie_recompute``) where their type allows; also whether any was tied."""
        return tie_keeping_types(inputs, cotangent) if self.tie_recompute else (inputs, False)

    def after_reduction(self, cotangent: PyTree, reduced: Any) -> PyTree:
        """The cotangent handed to the block before, once this block's
        gradient is reduced (``tie_backward_order``)."""
        return tie(cotangent, reduced) if self.tie_backward_order else cotangent

    def layers_per_trip(self, depth: int) -> int:
        """How many layers one trip of a ``depth``-layer loop runs (``unroll_layers``): the largest divisor
        of ``depth`` up to ``unroll_layers`` that leaves two trips or more.

        >>> Schedule("tpu", unroll_layers=4).layers_per_trip(16), Schedule("tpu", unroll_layers=4).layers_per_trip(6)
        (4, 3)
        >>> Schedule("tpu", unroll_layers=4).layers_per_trip(5), Schedule("tpu", unroll_layers=4).layers_per_trip(2)
        (1, 1)
        """
        fits = [k for k in range(2, self.unroll_layers + 1) if depth % k == 0 and depth // k >= 2]
        return max(fits, default=1)

    def together(self, layouts: Sequence[LeafLayout | None], axis: Any) -> tuple[tuple[int, ...], ...]:
        """The leaves of one layer (their layouts; ``None``: not gathered) that
        move together (``together_bytes``): groups of indices, one per dtype,
        of two leaves or more.

        >>> import numpy as np
        >>> vector, matrix = (LeafLayout(shape, np.dtype("float32"), 0, shape[0]) for shape in ((64,), (64, 64)))
        >>> Schedule("tpu", together_bytes=1024).together([vector, matrix, None, vector], "data")
        ((0, 3),)
        """
        groups: dict[Any, list[int]] = {}
        for i, lay in enumerate(layouts):
            if lay is not None and lay.nbytes <= self.together_bytes and can_move_together(lay, axis):
                groups.setdefault(lay.dtype, []).append(i)
        return tuple(tuple(g) for g in groups.values() if len(g) >= 2)

    def collective_axes(self, axes: Axes) -> Axes:
        """The axes the collectives of ``scan_layers``' loop and of
        ``zj.gather`` run over (``major_axis_collectives``)."""
        return axes._replace(major=True) if self.major_axis_collectives else axes

    def hold(self, value: PyTree, copies: PyTree) -> PyTree:
        """``value``, available only once ``copies`` exist (``hold_host_copies``:
        the host copies of an earlier block's saved inputs)."""
        return _after(value, copies)

    def prefetch_anchors(self, needed: list[int], sizes: list[int], produced: list[int], grads: list[Any],
                         freed: list[int], layouts: list[Any], start: Any, fallback: Any,
                         together: Sequence[Sequence[int]] = (), looped: bool = False) -> list[Any]:  # fmt: skip
        """What each leaf of the next block's backward re-gather waits for:
        :func:`paired_anchors` (``leafwise_prefetch``; ``looped``: in
        ``scan_layers``' loop), else ``start`` for all. Leaves gathered
        together (``together``) wait for what the one of them needed first
        waits for: one gather cannot start before its last operand."""
        if not self.leafwise_prefetch:
            return [start] * len(sizes)
        head = self.loop_head_start if looped and self.loop_head_start is not None else self.head_start
        anchors = paired_anchors(needed, sizes, produced, grads, freed, layouts, start, fallback, head)
        first = {i: k for k, i in reversed(list(enumerate(needed)))}
        for group in together:
            earliest = anchors[min(group, key=lambda i: first.get(i, len(needed)))]
            for i in group:
                anchors[i] = earliest
        return anchors


#: libtpu's continuation fusion for all-gathers (async gathers overlapped with the matmuls that
#: consume them); off by default in libtpu 0.0.42.1, where every gather is synchronous. Fusing them into
#: loop fusions too (``..._fuse_kloop_fusions``) overlaps the gathers whose consumers are elementwise (norm
#: scales, biases: a layer's joined small leaves, ``together_bytes``), which otherwise stay synchronous.
#: The last option keeps the gathers gathers on slices of 64+ chips, where libtpu otherwise runs every one
#: as a synchronous all-reduce (twice the bytes, nothing overlapped); it changes nothing on 8 chips.
#: Figures: ``benchmarks/results/tpu_aot.txt``.
TPU_ASYNC_ALL_GATHER = (
    ("xla_tpu_enable_async_collective_fusion", "true"),
    ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "true"),
    ("xla_tpu_enable_async_collective_fusion_multiple_steps", "true"),
    ("xla_tpu_enable_async_collective_fusion_fuse_kloop_fusions", "true"),
    ("xla_tpu_overlap_compute_collective_tc", "true"),
    ("xla_enable_async_all_gather", "true"),
    ("xla_tpu_prefer_async_allgather_to_allreduce", "true"),
)

#: libtpu's asynchronous all-to-all: ``zj.embedding_lookup``'s exchanges of rows and table pieces and, with
#: ``grad_reduction_head="all_to_all"``, ``zj.head_cross_entropy``'s chunk reductions overlap the compute beside
#: them (synchronous by default). Figures: ``benchmarks/results/maxtext.txt``.
TPU_ASYNC_ALL_TO_ALL = (("xla_tpu_enable_async_all_to_all", "true"),)

#: The XLA options that bound one combined collective's bytes, per backend (``bucket_bytes``). TPU (libtpu
#: 0.0.42.1, v5p): ``xla_jf_crs_combiner_threshold_in_bytes`` bounds the combined all-reduce (a v5p
#: reduce-scatter is decomposed into one); the all-gather, reduce-scatter and all-reduce-fusion thresholds
#: changed nothing in the measured steps, which combine none of those, and are set so that the bound holds
#: where they would. GPU (jax-cuda12-plugin 0.10.2, 1 x 8 H100 deviceless; ``benchmarks/buckets.py``): XLA's three
#: combiner thresholds keep the combined all-gathers under the bound but not the reduce-scatters: the unscanned
#: reference transformer (dim 256) at depth 8 reduces 16 gradients of two blocks in one 5.6 MiB reduce-scatter with
#: any bound from 1 to 64 MiB (the audit names each buffer over it); scanned, nothing exceeds 4 MiB.
BUCKET_OPTIONS: dict[str, tuple[str, ...]] = {
    "tpu": (
        "xla_jf_crs_combiner_threshold_in_bytes",
        "xla_tpu_arf_combiner_threshold_in_bytes",
        "xla_tpu_ars_combiner_threshold_in_bytes",
        "xla_tpu_agf_combiner_threshold_in_bytes",
    ),
    "gpu": (
        "xla_gpu_all_reduce_combine_threshold_bytes",
        "xla_gpu_reduce_scatter_combine_threshold_bytes",
        "xla_gpu_all_gather_combine_threshold_bytes",
    ),
}


def bucket_options(backend: str, bucket_bytes: int | None) -> tuple[tuple[str, str], ...]:
    """The compiler options that keep every combined collective of ``backend``
    within ``bucket_bytes`` (none without a bound, or on a backend that
    combines nothing, like XLA:CPU).

    >>> bucket_options("tpu", 2**20)[0], bucket_options("cpu", 2**20)
    (('xla_jf_crs_combiner_threshold_in_bytes', '1048576'), ())
    """
    if bucket_bytes is None:
        return ()
    return tuple((name, str(int(bucket_bytes))) for name in BUCKET_OPTIONS.get(backend, ()))


#: libtpu's SparseCore all-gather offload: the gathers run asynchronously on the chip's SparseCores beside the
#: TensorCores' compute. libtpu 0.0.46.3 and 0.0.52 refuse continuation fusion for all-gathers on every chip but
#: v5e (``FAILED_PRECONDITION: Continuation fusion for AllGather is enabled on platform viperfish ... not
#: supported/recommended on platforms other than ...``: v5p, v4, v6e); they accept this set on each (MaxText's v5p
#: flags offload all-gathers so). Figures: ``benchmarks/results/tpu_aot.txt`` (the libtpu column).
TPU_SPARSECORE_ALL_GATHER = (
    ("xla_tpu_enable_sparse_core_collective_offload_all_gather", "true"),
    ("xla_tpu_enable_async_collective_fusion_fuse_all_gather", "false"),
    ("xla_enable_async_all_gather", "true"),
    ("xla_tpu_prefer_async_allgather_to_allreduce", "true"),
)

#: What XLA:CPU compiles a program only to be read with (the audit's gradient program, ``partitioned_hlo``: the
#: executable is thrown away or its outputs read for shardings and bytes): LLVM optimisation off and, where
#: jaxlib still has them (0.10.2; 0.12.1 has no such option), the older loop emitters: about half the compile
#: time; the partitioned HLO is the same text, the outputs' layouts the same, their values equal to float32
#: rounding.
CPU_READ_ONLY = (("xla_backend_optimization_level", 0), ("xla_cpu_use_fusion_emitters", False))

#: The schedule of each backend, one entry per compiler version it was measured on (see the module docstring):
#: :func:`schedule_for` takes the entry of the running version, else the nearest older one (the oldest when the
#: running one is older than all), and says so (:meth:`Schedule.describe`, printed by ``zj.audit``). Backends
#: without an entry take XLA:CPU's.
_TPU = Schedule("tpu", prefetch_across_trips=False, prefetch_blocks=False, hold_host_copies=1,
                compiler_options=TPU_ASYNC_ALL_GATHER, together_bytes=2**16, grad_reduction="ring")  # fmt: skip
MEASURED: dict[str, tuple[Schedule, ...]] = {
    "cpu": (
        Schedule("cpu", compiler="jaxlib 0.10.2", read_only_options=CPU_READ_ONLY),
        Schedule("cpu", compiler="jaxlib 0.12.1", read_only_options=CPU_READ_ONLY[:1]),
    ),
    "gpu": (
        Schedule("gpu", compiler="jax-cuda12-plugin 0.10.2", keep_gathered_all=True, loop_head_start=1.0,
                 major_axis_collectives=True, read_only_options=CPU_READ_ONLY),
    ),
    "tpu": (
        _TPU._replace(compiler="libtpu 0.0.42.1"),
        _TPU._replace(compiler="libtpu 0.0.46.3", grad_reduction_head="all_to_all",
                      fallback_options=(TPU_SPARSECORE_ALL_GATHER + TPU_ASYNC_ALL_TO_ALL, TPU_SPARSECORE_ALL_GATHER)),
        _TPU._replace(compiler="libtpu 0.0.52", grad_reduction_head="all_to_all",
                      fallback_options=(TPU_SPARSECORE_ALL_GATHER + TPU_ASYNC_ALL_TO_ALL, TPU_SPARSECORE_ALL_GATHER)),
    ),
}


def entry_for(backend: str, running: tuple[int, ...]) -> Schedule:
    """The entry of :data:`MEASURED` for ``backend`` (XLA:CPU's without one) and the running compiler version:
    the same version, else the nearest older one, else the oldest.

    >>> entry_for("tpu", (0, 0, 52)).compiler, entry_for("tpu", (0, 0, 50, 1)).compiler
    ('libtpu 0.0.52', 'libtpu 0.0.46.3')
    >>> entry_for("tpu", (0, 0, 30)).compiler, entry_for("gpu", (0, 12, 1)).compiler
    ('libtpu 0.0.42.1', 'jax-cuda12-plugin 0.10.2')
    >>> entry_for("rocm", (0, 12, 1)).compiler
    'jaxlib 0.12.1'
    """
    entries = sorted(MEASURED.get(backend) or MEASURED["cpu"], key=lambda e: e.version)
    older = [e for e in entries if e.version <= running]
    return older[-1] if older else entries[0]


@functools.lru_cache(maxsize=64)
def _refusal(devices: tuple[Any, ...], options: tuple[tuple[str, Any], ...]) -> str | None:
    """The first line of the compiler's refusal of ``options`` for a small program that all-gathers over
    ``devices`` (one all-gather: what the TPU options steer), or None when it compiles."""
    mesh = jax.sharding.Mesh(np.array(devices), ("probe",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("probe"))
    probe = jax.ShapeDtypeStruct((8 * len(devices), 128), jnp.float32, sharding=sharded)
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with jax.set_mesh(mesh):  # the probe's own mesh, whatever mesh the caller set
        lowered = jax.jit(lambda x: x * 2, out_shardings=whole).lower(probe)
    try:
        lowered.compile(compiler_options=dict(options))
    except Exception as e:  # any refusal: the option set is not for this compiler and chip
        return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return None


def accepted_options(
    devices: Sequence[Any], candidates: Sequence[tuple[tuple[str, Any], ...]]
) -> tuple[tuple[tuple[str, Any], ...], tuple[str, ...]]:
    """The first option set of ``candidates`` the compiler accepts for ``devices`` (probed once per device
    set and option set), else none; and the refusals met on the way (what the audit reports)."""
    refused = []
    for options in candidates:
        if not options:
            return options, tuple(refused)
        why = _refusal(tuple(devices), tuple(options))
        if why is None:
            return options, tuple(refused)
        (first, _), *rest = options
        more = f" and {len(rest)} more" if rest else ""
        refused.append(f"{first}{more}: {why[:160]}")
    return (), tuple(refused)


def read_only_options(devices: Sequence[Any]) -> dict[str, Any]:
    """The options of the running compiler's entry for a program compiled only to be read, each one the
    compiler accepts (probed once: an option a newer jaxlib dropped is left out, never the reason a compile
    fails)."""
    backend = str(devices[0].platform)
    entry = entry_for(backend, compiler_version(backend)[1])
    options = entry.read_only_options
    return {name: value for name, value in options if _refusal(tuple(devices), ((name, value),)) is None}


@dataclasses.dataclass(frozen=True)
class Trial:
    """Switches tried over the measured schedule (:func:`trying`); none by default."""

    changes: tuple[tuple[str, Any], ...] = ()


_TRIAL: Scoped[Trial] = Scoped("zero_jax_schedule_trial", Trial())
NOT_A_SWITCH = "trying: {names} are not schedule switches; the switches are {known}."


def schedule_for(policy: Any) -> Schedule:
    """The schedule for the backend of ``policy``'s devices and the compiler
    running here (:func:`entry_for`): the first of its option sets the compiler
    accepts for those devices (:func:`accepted_options`), the combiner bounds of
    ``policy.bucket_bytes`` added, with the switches of an enclosing :func:`trying`."""
    devices = tuple(policy.mesh.devices.flat)
    backend = str(devices[0].platform)
    package, version = compiler_version(backend)
    measured = entry_for(backend, version)
    changes = dict(_TRIAL.current().changes)  # a trial's compiler options replace the measured ones
    if "compiler_options" in changes:
        options, refused = changes.pop("compiler_options"), ()
    else:
        options, refused = accepted_options(devices, (measured.compiler_options, *measured.fallback_options))
    running = f"{package} {version_text(version) if version else '(version unknown)'}"
    return measured._replace(backend=backend, compiler_options=options + bucket_options(backend, policy.bucket_bytes),
                             running=running, refused=refused, **changes)  # fmt: skip


def trying(**switches: Any) -> contextlib.AbstractContextManager[Trial]:
    """Build and trace steps inside the block with some of the schedule's
    switches changed: the way to measure what each trick buys (a step's
    ``compiler_options`` are fixed when ``make_train_step`` runs, the rest
    when it is traced). ``zero_jax.measure.trying_schedule`` is this.

    >>> import jax, zero_jax as zj
    >>> policy = zj.ZeroPolicy(3, jax.make_mesh((jax.device_count(),), ("data",)))
    >>> with trying(tie_gathers=False):
    ...     schedule_for(policy).tie_gathers
    False
    >>> schedule_for(policy).tie_gathers
    True
    """
    unknown = sorted((set(switches) - set(Schedule._fields)) | ({"backend"} & set(switches)))
    if unknown:
        raise TypeError(NOT_A_SWITCH.format(names=unknown, known=[f for f in Schedule._fields if f != "backend"]))
    if "compiler_options" in switches:
        switches["compiler_options"] = tuple(dict(switches["compiler_options"]).items())
    return _TRIAL.replaced(changes=tuple(switches.items()))


def slice_unfusable(a: jax.Array, axis_name: Any, dim: int) -> jax.Array:
    """This device's slice of ``a`` (the same on every device of
    ``axis_name``) along ``dim``, by a reduce-scatter of its bits with zeros
    from every device but the first (integer sums: exact for every value,
    ``-0.0`` and NaN included), which XLA cannot fuse into a consumer."""
    bits = jax.lax.bitcast_convert_type(a, _BITS[jnp.dtype(a.dtype).itemsize])
    mine = jnp.where(jax.lax.axis_index(axis_name) == 0, bits, jnp.zeros_like(bits))
    piece = jax.lax.psum_scatter(mine, axis_name, scatter_dimension=dim, tiled=True)
    return jax.lax.bitcast_convert_type(piece, a.dtype)


def _numeric_leaves(tree: Any) -> list[Any]:
    """The non-empty numeric (or bool) arrays of ``tree``, in order."""
    return [
        leaf
        for leaf in jax.tree.leaves(tree)
        if not isinstance(leaf, SymbolicZero)
        and hasattr(leaf, "dtype")
        and getattr(leaf, "size", 0)
        and (jnp.issubdtype(leaf.dtype, jnp.number) or leaf.dtype == jnp.bool_)
    ]


def _element(leaf: Any) -> jax.Array:
    return jax.lax.stop_gradient(jnp.ravel(leaf)[0]).astype(jnp.float32)


def _first_element(tree: Any) -> jax.Array | None:
    """One element of the first non-empty array in ``tree`` (as float32,
    gradient stopped), or None when there is none."""
    leaves = _numeric_leaves(tree)
    return _element(leaves[0]) if leaves else None


def inputs_anchor(args: Any) -> Any:
    """An anchor that exists only once every numeric leaf of a block's
    arguments does (the forward gathers' anchor, ``tie_gathers``): one element
    of each, summed as float32 (gradient stopped). With one such leaf (or
    none) it is ``args`` itself, so the program is the one anchored on it."""
    leaves = _numeric_leaves(args)
    if len(leaves) <= 1:
        return args
    return sum((_element(leaf) for leaf in leaves[1:]), _element(leaves[0]))


@jax.custom_vjp
def _after(value: PyTree, copies: PyTree) -> PyTree:
    """An optimization barrier over ``(value, copies)`` in the forward pass
    only: ``value``'s cotangent passes through untouched (a barrier's own
    transpose would hold the backward pass too), ``copies`` get none. Not a
    :func:`tie`: that reads an element of ``copies``, which in host memory
    the TPU compiler would first bring back."""
    return jax.lax.optimization_barrier((value, copies))[0]


def _after_fwd(value: PyTree, copies: PyTree) -> tuple[PyTree, None]:
    return _after(value, copies), None


def _after_bwd(_: None, cotangent: PyTree) -> tuple[PyTree, None]:
    return cotangent, None


_after.defvjp(_after_fwd, _after_bwd)

_BITS = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def tie(value: PyTree, anchor: Any, *, integers: bool = False) -> PyTree:
    """``value`` bitwise unchanged, but computed only once ``anchor`` exists.

    Each float leaf's bits are or-ed with ``z``, an integer that is 0 for
    every ``anchor``: ``z = int(a - a)`` for a finite element ``a`` of
    ``anchor`` (``a - a`` is exactly ``+0.0``), and 0 otherwise. Integer
    operations never round or flush, so no bit changes (NaN payloads,
    infinities, ``-0.0`` and subnormals included, which float arithmetic on
    XLA:CPU would flush to zero); unlike the ``x + 0 * a`` of a first
    prototype it never turns a value into NaN (an fp16 overflow step, a NaN
    input), and XLA cannot fold it (it does not assume floats are finite, so
    it cannot prove ``z`` is 0). Non-float leaves, and an anchor without
    elements, pass through; with ``integers`` integer leaves are or-ed with
    ``z`` too.

    >>> import jax, jax.numpy as jnp
    >>> x = jnp.array([1.0, -0.0, jnp.inf, jnp.nan, 1e-45])
    >>> y = tie(x, jnp.array([jnp.nan, 2.0]))
    >>> bool(jnp.all(jax.lax.bitcast_convert_type(y, jnp.uint32) == jax.lax.bitcast_convert_type(x, jnp.uint32)))
    True
    """
    return tie_keeping_types(value, anchor, keep_types=False, integers=integers)[0]


def tie_keeping_types(
    value: PyTree, anchor: Any, *, keep_types: bool = True, integers: bool = False
) -> tuple[PyTree, bool]:
    """:func:`tie` each float leaf of ``value`` whose type the tie keeps: one
    that varies over every ``shard_map`` axis the anchor varies over (tying a
    replicated value to a per-device one would make it per-device, changing
    its type under autodiff). Also says whether any leaf was tied."""
    a = _first_element(anchor)
    if a is None:
        return value, False
    zero = jnp.where(jnp.isfinite(a), a - a, jnp.zeros((), jnp.float32)).astype(jnp.int32)
    needs, tied = varying_axes(a), []

    def one(x: Any) -> Any:
        integer = integers and jnp.issubdtype(getattr(x, "dtype", None) or jnp.bool_, jnp.integer)
        if not is_real_float(x) and not integer:
            return x
        if keep_types and not needs <= varying_axes(x):
            return x
        tied.append(True)
        if integer:
            return x | zero.astype(x.dtype)
        bits = _BITS[jnp.dtype(x.dtype).itemsize]
        raw = jax.lax.bitcast_convert_type(x, bits)
        return jax.lax.bitcast_convert_type(raw | zero.astype(bits), x.dtype)

    return jax.tree.map(one, value), bool(tied)


def _uses(jaxpr: Jaxpr, names: dict[Any, int], prefix: tuple[int, ...], found: dict[int, list[Any]]) -> None:
    """Record in ``found`` each position (nested equation indices) where a ``names`` variable is read; a
    call (``_jaxpr.called``: a program run once on the equation's own inputs) is walked inside."""
    for i, eqn in enumerate(live_equations(jaxpr)):
        hits = [(j, names[v]) for j, v in enumerate(eqn.invars) if not isinstance(v, Literal) and v in names]
        inner = called(eqn)
        if hits and inner is not None:
            _uses(inner, {inner.invars[j]: k for j, k in hits}, (*prefix, i), found)
            continue
        for _, k in hits:
            found.setdefault(k, []).append((*prefix, i))


def use_order(
    fn: Callable[..., Any], params: PyTree, args: tuple[Any, ...], consts: Sequence[Any]
) -> tuple[list[int], list[int]]:
    """The block's parameter leaves (positions) in the order its forward
    first uses them, and in the order its backward produces their gradients
    (last uses reversed), from its program (calls walked inside)."""
    count = len(jax.tree.leaves(params))
    closed = jax.make_jaxpr(fn)(params, *args, *consts)
    found: dict[int, list[Any]] = {}
    _uses(closed.jaxpr, {v: k for k, v in enumerate(closed.jaxpr.invars[:count])}, (), found)
    needed = sorted(range(count), key=lambda k: min(found.get(k, [(len(closed.jaxpr.eqns),)])))
    produced = sorted(range(count), key=lambda k: max(found.get(k, [()])), reverse=True)
    return needed, produced


def paired_anchors(
    needed: list[int], sizes: list[int], produced: list[int], grads: list[Any], freed: list[int],
    layouts: list[Any], start: Any, fallback: Any, head_start: float = HEAD_START,
) -> list[Any]:  # fmt: skip
    """What each leaf of the next layer's backward re-gather waits for. In
    ``needed`` order (that layer's forward's; ``sizes[k]``: bytes of leaf k,
    0 if not gathered) the first ``head_start`` of the bytes wait for
    ``start`` (this layer's backward starting), each later leaf for the
    gradient (``grads[k]``, reduce-scattered, or None) after which this
    layer's leaves done with (``freed`` bytes, ``produced`` order) outweigh
    those fetched: the two layers' whole leaves stay under 1 + ``head_start``
    layers. A gradient cut over model axes is no anchor (reading one element
    of it made the SPMD partitioner all-gather it); else ``fallback``."""
    order = iter(produced)
    anchors, head, total = [fallback] * len(sizes), head_start * sum(sizes), 0
    done, anchor, early = 0, fallback, True
    for k in (k for k in needed if sizes[k]):
        total += sizes[k]
        early = early and total <= head
        while not early and done < total - head and (j := next(order, None)) is not None:
            done += freed[j]
            anchor = grads[j] if grads[j] is not None and not any(layouts[j].model) else anchor
        anchors[k] = start if early else anchor
    return anchors
