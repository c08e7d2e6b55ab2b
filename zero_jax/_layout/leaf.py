"""Pure partition rules: one leaf's shape and dtype -> where it is cut.

Every rule here is a pure function of a leaf's *logical* shape and dtype (and
of whether it is a stacked-layer leaf), so the same rule gives a parameter,
its gradient and every optimizer-state leaf that mirrors it the same layout:
elementwise optimizer math then never moves data between devices.

A leaf that cannot be cut evenly is padded on its cut dimension up to the
next multiple of the number of shards. Padding lives only in the *stored*
form (between steps, where ``jit`` and ``device_put`` insist on even shards);
everything a user or an optax transformation sees has the logical shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

#: Leaves with fewer elements than this stay replicated by default: gathering
#: them costs a collective's latency for almost no memory (DeepSpeed's
#: ``param_persistence_threshold`` makes the same trade). Override it with
#: ``ZeroPolicy(..., min_shard_size=...)``; 0 partitions every float leaf
#: that has a dimension to cut.
DEFAULT_MIN_SHARD_SIZE = 1024

#: Why a leaf stays whole on every device.
REASON_NOT_FLOAT = "not a floating-point leaf"
REASON_BELOW_THRESHOLD = "below min_shard_size"
REASON_NO_DIMENSION = "no dimension to cut (scalar, or only a stacked layer axis)"
REASON_ALL_MODEL_SHARDED = "every dimension is model-sharded (param_specs): none is free for the data axis"
REASON_WHOLE_MATRIX = (
    "the optimizer multiplies it by itself (Muon's Newton-Schulz, Shampoo): whole_matrices keeps it whole, "
    "its update computed on every device"
)
REASON_FEW_MATRICES = (
    "a stack of fewer matrices than devices (matrix_stacks): kept whole, its update computed on every device "
    "(cutting the stack would pad it with empty matrices, sent and stored)"
)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one leaf is cut across the data axis.

    Attributes:
      shape: the logical (user-visible, unpadded) shape.
      dtype: the leaf's dtype.
      dim: the dimension cut across the data axis, or ``None`` when the leaf
        stays whole on every device (then ``reason`` says why).
      padded_size: the size of ``dim`` once padded to a multiple of the number
        of shards (equal to ``shape[dim]`` when it already divides).
      reason: why the leaf is replicated; empty when it is partitioned.
      model: the model-parallel layout the user declared (``param_specs``):
        one entry per dimension (``None`` or mesh axes), or ``()``. ``dim``
        is never one of its sharded dimensions.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    dim: int | None
    padded_size: int = 0
    reason: str = ""
    model: tuple[Any, ...] = ()

    @property
    def partitioned(self) -> bool:
        return self.dim is not None

    @property
    def padding(self) -> int:
        return 0 if self.dim is None else self.padded_size - self.shape[self.dim]

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the stored (padded) global array."""
        if self.dim is None:
            return self.shape
        s = list(self.shape)
        s[self.dim] = self.padded_size
        return tuple(s)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored global array (padding included)."""
        return math.prod(self.stored_shape) * np.dtype(self.dtype).itemsize

    @property
    def model_axes(self) -> tuple[str, ...]:
        """The mesh axes the model layout shards this leaf over."""
        return tuple(a for e in self.model for a in ((e,) if isinstance(e, str) else (e or ())))

    def spec(self, axes: tuple[str, ...]) -> PartitionSpec:
        """The ``PartitionSpec`` of the stored array over the ZeRO mesh
        ``axes`` only: what a ``shard_map`` manual over those axes takes."""
        if self.dim is None or not axes:
            return PartitionSpec()
        entries: list[Any] = [None] * self.dim
        entries.append(axes if len(axes) > 1 else axes[0])  # pyright: ignore[reportGeneralTypeIssues] - axes is not empty here
        return PartitionSpec(*entries)

    def sharding_spec(self, axes: tuple[str, ...]) -> PartitionSpec:
        """The whole ``PartitionSpec`` of the stored array: the model layout
        plus the cut over ZeRO ``axes`` (``()``: the model layout alone)."""
        entries: list[Any] = list(self.model) or [None] * len(self.shape)
        if self.dim is not None and axes:
            entries[self.dim] = axes if len(axes) > 1 else axes[0]  # pyright: ignore[reportGeneralTypeIssues] - axes is not empty here
        # No trailing Nones: the compiler reports specs without them, and an
        # equal-but-differently-spelled spec would make jit compile twice.
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class ReplicatedLeaf:
    """A leaf that stays whole on every device, and why."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    reason: str


def shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    """A leaf's shape and dtype (an array, a ``ShapeDtypeStruct``, or a Python / NumPy scalar)."""
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        leaf = np.asarray(leaf)
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def leaf_layout(
    shape: tuple[int, ...],
    dtype: Any,
    num_shards: int,
    *,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    skip_leading: bool = False,
    model: tuple[Any, ...] = (),
    whole: bool = False,
    stack: bool = False,
) -> LeafLayout:
    """The layout of one leaf cut into ``num_shards`` pieces.

    The rule: non-float leaves (except the 8-bit integer codes of a quantized
    weight: :func:`is_codes`) and leaves below ``min_shard_size`` elements
    stay whole. Otherwise cut the largest dimension that divides
    ``num_shards``; if none does, cut the dimension whose padding wastes the
    least (ties go to the larger dimension). ``skip_leading`` excludes
    dimension 0 (the layer axis of stacked layers, which ``scan_layers``
    iterates over and must never be cut), and ``model`` (one entry per
    dimension, see ``_policy.model_specs``) the dimensions the model already shards.
    ``whole`` keeps a float leaf whole (:data:`REASON_WHOLE_MATRIX`): an
    optimizer that multiplies the matrix by itself would otherwise all-reduce
    matrix-sized products every step. ``stack`` (with ``whole``): the leaf is
    a stack of such matrices on dimension 0, cut there (padded with empty
    matrices to a multiple of ``num_shards``) so each device holds whole
    matrices; with fewer matrices than shards, or under ``skip_leading``, it
    stays whole.

    >>> leaf_layout((16, 32, 32), "float32", 8, whole=True, stack=True).dim
    0
    >>> leaf_layout((2, 32, 32), "float32", 8, whole=True, stack=True).reason == REASON_FEW_MATRICES
    True

    >>> leaf_layout((10, 640), "float32", 8).dim
    1
    >>> lay = leaf_layout((10, 6), "float32", 4, min_shard_size=0)
    >>> lay.dim, lay.stored_shape
    (0, (12, 6))
    """
    shape = tuple(int(d) for d in shape)
    dtype = np.dtype(dtype)
    model = tuple(model)
    if not is_float(dtype) and not is_codes(dtype):
        return LeafLayout(shape, dtype, None, reason=REASON_NOT_FLOAT, model=model)
    if math.prod(shape) < min_shard_size:
        return LeafLayout(shape, dtype, None, reason=REASON_BELOW_THRESHOLD, model=model)
    if whole or stack:
        return matrix_layout(shape, dtype, num_shards, stack=stack and not skip_leading, model=model)
    candidates = [d for d in range(len(shape)) if not (skip_leading and d == 0)]
    candidates = [d for d in candidates if shape[d] > 0]
    if not candidates:
        return LeafLayout(shape, dtype, None, reason=REASON_NO_DIMENSION, model=model)
    free = [d for d in candidates if not model or model[d] is None]
    if not free:
        return LeafLayout(shape, dtype, None, reason=REASON_ALL_MODEL_SHARDED, model=model)
    candidates = free

    def padded(d: int) -> int:
        return -(-shape[d] // num_shards) * num_shards

    def wasted(d: int) -> int:  # padding elements the whole leaf gains
        return (padded(d) - shape[d]) * (math.prod(shape) // shape[d])

    # Least padding first (0 for a dividing dimension), then the larger
    # dimension (smaller shards of the other dims), then the earlier one.
    best = min(candidates, key=lambda d: (wasted(d), -shape[d], d))
    return LeafLayout(shape, dtype, best, padded(best), model=model)


def matrix_layout(
    shape: tuple[int, ...], dtype: np.dtype, num_shards: int, *, stack: bool, model: tuple[Any, ...]
) -> LeafLayout:
    """A leaf an optimizer multiplies by itself: whole, or (a stack of at
    least ``num_shards`` matrices on a dimension 0 the model does not shard)
    cut on the stack, padded to a multiple of ``num_shards``."""
    if stack and len(shape) >= 3 and shape[0] >= num_shards and not (model and model[0] is not None):
        return LeafLayout(shape, dtype, 0, -(-shape[0] // num_shards) * num_shards, model=model)
    reason = REASON_FEW_MATRICES if stack and len(shape) >= 3 and shape[0] < num_shards else REASON_WHOLE_MATRIX
    return LeafLayout(shape, dtype, None, reason=reason, model=model)


def pad(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Logical array -> stored (padded) array; zeros fill the padding."""
    if layout.padding == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[layout.dim] = (0, layout.padding)  # type: ignore[index]
    return jnp.pad(x, widths)


def unpad(x: jax.Array, layout: LeafLayout) -> jax.Array:
    """Stored (padded) array -> logical array."""
    if layout.padding == 0:
        return x
    return jax.lax.slice_in_dim(x, 0, layout.shape[layout.dim], axis=layout.dim)  # type: ignore[index]


def shard_shape(layout: LeafLayout, num_shards: int) -> tuple[int, ...]:
    """The shape of one device's piece of the stored array."""
    if layout.dim is None:
        return layout.shape
    s = list(layout.shape)
    s[layout.dim] = layout.padded_size // num_shards
    return tuple(s)


def piece_elements(layout: LeafLayout, num_shards: int, mesh_shape: Any, stacked: bool) -> int:
    """Elements of one device's piece of one layer of a partitioned leaf: what
    one of its collectives moves (its model shard only, one layer of a stacked
    leaf).

    >>> lay = leaf_layout((4, 64, 30), "float32", 8, min_shard_size=0, skip_leading=True, model=(None, None, "m"))
    >>> piece_elements(lay, 8, {"data": 8, "m": 2}, stacked=True)
    120
    """
    shape = shard_shape(layout, num_shards)[1 if stacked else 0 :]
    return math.prod(shape) // math.prod(mesh_shape[a] for a in layout.model_axes)


def is_float(x: Any) -> bool:
    """Whether a leaf is trained: a floating or complex dtype (of an array, a
    ``ShapeDtypeStruct``, a :class:`LeafLayout`, or a dtype itself). Any other
    leaf (an int counter, a bool mask, an RNG key) passes every step untouched:
    never differentiated, cut or communicated.

    >>> import numpy as np
    >>> is_float(np.zeros(2, np.float16)), is_float("complex64"), is_float(np.int32), is_float(3)
    (True, True, False, False)
    """
    dtype = getattr(x, "dtype", x if isinstance(x, (np.dtype, type, str)) else None)
    try:
        return dtype is not None and bool(jnp.issubdtype(np.dtype(dtype), jnp.inexact))
    except TypeError:  # not a dtype (a string that names none)
        return False


def is_codes(x: Any) -> bool:
    """Whether a leaf holds the integer codes of a quantized weight: an 8-bit (or narrower) integer dtype
    (``int8``, ``uint8``). Such a leaf is never trained, but it is cut like a float leaf, so stage 3 partitions
    a quantized base (QLoRA: codes beside float scales) instead of keeping it whole on every device. Wider
    integers (``int32`` counters, indices) stay whole, untouched.

    >>> import numpy as np
    >>> is_codes(np.zeros(2, np.int8)), is_codes("uint8"), is_codes(np.int32), is_codes(np.float32), is_codes(bool)
    (True, True, False, False, False)
    """
    dtype = getattr(x, "dtype", x if isinstance(x, (np.dtype, type, str)) else None)
    try:
        dtype = np.dtype(dtype) if dtype is not None else None
    except TypeError:  # not a dtype (a string that names none)
        return False
    return dtype is not None and bool(np.issubdtype(dtype, np.integer)) and dtype.itemsize == 1


def is_real_float(x: Any) -> bool:
    """Whether a leaf takes a precision policy's dtypes: a real floating dtype
    (complex leaves keep their own)."""
    return is_float(x) and bool(jnp.issubdtype(getattr(x, "dtype", x), jnp.floating))


def is_layout(x: Any) -> bool:
    """Whether ``x`` is a :class:`LeafLayout` (the ``is_leaf`` of layout trees)."""
    return isinstance(x, LeafLayout)
