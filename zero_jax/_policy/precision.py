"""Mixed precision: which dtype each copy of the model lives in, and dynamic
loss scaling for float16.

With ``Precision(compute_dtype=jnp.bfloat16)`` the state follows ZeRO's
2 + 2 + 12 bytes per parameter: the bf16 compute copy (``TrainState.params``,
what stage 3 gathers), bf16 gradients (reduced in ``reduce_dtype``), and an
fp32 master copy (``TrainState.master``) beside the optimizer state, both
partitioned from stage 1. With ``compute_copy=False`` (stage 3) there is no
bf16 copy between steps: ``TrainState.params`` holds the fp32 master pieces,
each cast to bf16 just before its all-gather (FSDP2's way): 12 bytes per
parameter of state instead of 14, and the same bf16 bytes on the wire.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._base.tree import PyTree, path_str
from zero_jax._layout.leaf import is_real_float


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling for float16 compute.

    The loss is multiplied by ``scale`` before differentiation and the
    gradients divided by it after reduction. A step whose gradients overflow
    anywhere (on any device) is skipped everywhere — parameters and optimizer
    state unchanged — and the scale is multiplied by ``backoff`` (not below
    ``minimum``); after ``growth_interval`` finite steps in a row it is
    multiplied by ``growth``.
    """

    initial: float = 2.0**15
    growth_interval: int = 2000
    growth: float = 2.0
    backoff: float = 0.5
    minimum: float = 1.0

    def __post_init__(self) -> None:
        if not (self.initial > 0 and self.minimum > 0 and self.growth >= 1 and 0 < self.backoff < 1):
            raise ValueError(
                f"DynamicLossScale: need initial > 0, minimum > 0, growth >= 1 and 0 < backoff < 1; got {self}."
            )
        if self.growth_interval < 1:
            raise ValueError(f"DynamicLossScale: growth_interval must be >= 1, got {self.growth_interval}.")


class LossScaleState(NamedTuple):
    """The loss scale between steps (in ``TrainState.loss_scale``)."""

    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32: finite steps since the last change
    skipped: jax.Array  # int32: steps skipped so far

    @classmethod
    def create(cls, config: DynamicLossScale) -> LossScaleState:
        return cls(jnp.asarray(config.initial, jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def next(self, finite: jax.Array, config: DynamicLossScale) -> LossScaleState:
        grow = finite & (self.good_steps + 1 >= config.growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, self.scale * config.growth, self.scale),
            jnp.maximum(self.scale * config.backoff, config.minimum),
        ).astype(jnp.float32)
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0).astype(jnp.int32)
        return LossScaleState(scale, good, self.skipped + (~finite).astype(jnp.int32))


def _float_dtype(value: Any, name: str) -> np.dtype | None:
    if value is None:
        return None
    dtype = np.dtype(value)
    if not is_real_float(dtype):
        raise ValueError(f"Precision: {name} must be a floating dtype (float32, bfloat16, float16), got {dtype}.")
    return dtype


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of a training run.

    Args:
      param_dtype: the master copy and the optimizer's view of the
        parameters (float32).
      compute_dtype: the copy the forward and backward passes use; ``None``
        means ``param_dtype`` (no separate master copy).
      reduce_dtype: the dtype gradients are reduced (all-reduce /
        reduce-scatter) in; ``None`` means ``compute_dtype``.
      loss_scale: a :class:`DynamicLossScale`; required with float16
        compute, refused otherwise (bfloat16 has float32's exponent range).
      compute_copy: keep the parameters in ``compute_dtype`` between steps
        (``True``, ZeRO's 2 + 2 + 12 bytes per parameter: a persistent
        compute copy beside the master). ``False`` (stage 3 only): keep only
        the master's pieces (``state.params`` in ``param_dtype``, no
        ``state.master``) and cast each piece to ``compute_dtype`` right
        before its all-gather, so the wire still carries ``compute_dtype``
        and the compute copy exists only while a layer is gathered. The
        same numbers bit for bit (the copy is the cast of the master either
        way), 2 bytes per parameter / N less state.

    >>> import jax.numpy as jnp, zero_jax as zj
    >>> zj.Precision(compute_dtype=jnp.bfloat16).reduce_dtype
    dtype(bfloat16)
    >>> zj.Precision(compute_dtype=jnp.bfloat16, compute_copy=False).stored_dtype  # state.params: the master
    dtype('float32')
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = None
    reduce_dtype: Any = None
    loss_scale: DynamicLossScale | None = None
    compute_copy: bool = True

    def __post_init__(self) -> None:
        param = _float_dtype(self.param_dtype, "param_dtype")
        compute = _float_dtype(self.compute_dtype, "compute_dtype") or param
        reduce = _float_dtype(self.reduce_dtype, "reduce_dtype") or compute
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "reduce_dtype", reduce)
        fp16 = compute == np.dtype(jnp.float16)
        if fp16 and self.loss_scale is None:
            raise ValueError(
                "Precision: float16 compute needs loss scaling (its range underflows small gradients): "
                "pass loss_scale=zj.DynamicLossScale()."
            )
        if self.loss_scale is not None and not fp16:
            raise ValueError(
                f"Precision: loss_scale is for float16 compute only; compute_dtype is {compute}, whose "
                "exponent range needs no scaling. Drop loss_scale."
            )
        if not isinstance(self.compute_copy, bool):
            raise TypeError(f"Precision: compute_copy must be True or False, got {self.compute_copy!r}.")
        if not self.compute_copy and compute == param:
            raise ValueError(
                f"Precision: compute_copy=False drops the compute copy kept beside the master, but compute_dtype is "
                f"param_dtype ({param}): there is none. Pass compute_dtype=jnp.bfloat16 (a float32 master cast "
                "before each gather), or drop compute_copy."
            )
        if self.loss_scale is not None and not isinstance(self.loss_scale, DynamicLossScale):
            raise TypeError(
                f"Precision: loss_scale must be a zj.DynamicLossScale, got {type(self.loss_scale).__name__}."
            )

    @property
    def mixed(self) -> bool:
        """Whether the forward and backward passes run in another dtype than the master's."""
        return self.compute_dtype != self.param_dtype

    @property
    def keeps_master(self) -> bool:
        """Whether ``TrainState.master`` exists: a master beside a compute copy."""
        return self.mixed and self.compute_copy

    @property
    def stored_dtype(self) -> np.dtype:
        """The dtype of ``TrainState.params`` between steps: the compute copy's,
        or without one (``compute_copy=False``) the master's."""
        return self.compute_dtype if self.compute_copy else self.param_dtype  # pyright: ignore[reportReturnType] - set in __post_init__

    @property
    def gather_cast(self) -> np.dtype | None:
        """The dtype a stage-3 piece is cast to before its all-gather, when
        the stored pieces are not in it (``compute_copy=False``); else ``None``."""
        return None if self.compute_copy or not self.mixed else self.compute_dtype  # pyright: ignore[reportReturnType] - set in __post_init__


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Cast the floating leaves of ``tree`` to ``dtype``; leave the rest."""
    return jax.tree.map(lambda x: x.astype(dtype) if is_real_float(x) else x, tree)


DEFAULT_CAST = (
    "init_state: {count} float parameter leaf(s) are not float32 ({listing}), and the policy was given no "
    "precision=, so they are trained as the default zj.Precision() does: a float32 copy of each ({grown}). To "
    "train them in their own dtype (no float32 copy, as plain optax on these parameters would), pass "
    "ZeroPolicy(..., precision=zj.Precision(param_dtype=jnp.{dtype})); for {dtype} compute over a float32 "
    "master copy and optimizer (ZeRO's mixed precision), precision=zj.Precision(compute_dtype=jnp.{dtype}); "
    "to keep the float32 copy, precision=zj.Precision(). Any precision= silences this warning."
)


def warn_default_cast(params: PyTree, precision: Precision, chosen: bool) -> None:
    """Warn, naming every leaf, when the default precision (not asked for)
    casts float leaves of another dtype (bf16 parameters, float64 under x64)
    to its float32: the memory and numerics change, and the user did not say."""
    if chosen:
        return
    pairs = [(path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]
    other = [(p, x) for p, x in pairs if is_real_float(x) and np.dtype(x.dtype) != precision.param_dtype]
    if not other:
        return
    listing = ", ".join(f"'{p}' {tuple(x.shape)} {np.dtype(x.dtype)}" for p, x in other[:8])
    listing += f", and {len(other) - 8} more" if len(other) > 8 else ""
    given = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for _, x in other)
    grown = sum(int(np.prod(x.shape)) * precision.param_dtype.itemsize for _, x in other)
    ratio = f"{grown / given:.3g}x the bytes given" if given else "no bytes given"
    dtype = np.dtype(other[0][1].dtype).name
    warnings.warn(
        DEFAULT_CAST.format(count=len(other), listing=listing, grown=ratio, dtype=dtype), UserWarning, stacklevel=3
    )
