"""The arguments of ZeRO's formulas, checked: counts, stages, byte sizes and
the ZeRO++ wire formats (as ``ZeroPolicy`` checks them), with the error
messages that name the bad value and the fix.

``ZeroPolicy``'s own checks (:mod:`zero_jax._policy.arguments`) share the
stage and wire checks from here.
"""

from __future__ import annotations

import numbers
from typing import Any

from zero_jax._base.problems import Problem, raise_problems
from zero_jax._base.units import number, parse_count
from zero_jax._theory.wire import FORMATS, wire_bytes

#: What a count is, said when it is bad.
TP_ROLE = (
    " (the tensor-parallel size M: the product of the model axes' sizes, policy.model_parallel; "
    "1 without tensor parallelism)"
)
COUNT_ROLES = {"num_devices": " (the data-parallel size N)", "model_parallel": TP_ROLE, "tensor_parallel": TP_ROLE}
BAD_STAGE = (
    "{where}: stage must be 0, 1, 2 or 3, got {stage!r} (0 is plain data parallelism; 1 partitions "
    "optimizer state, 2 also gradients, 3 also parameters)."
)
BAD_WIRE_FORMAT = (
    "{where}: {name}={value!r} is not a wire format; the formats are {formats} (or None: unquantized). "
    "int4 and fp8 are not built."
)
WEIGHTS_NEED_STAGE_3 = (
    "{where}: quantize_weights={value!r} quantizes the all-gathers of partitioned parameters, which only stage 3 "
    "has (stage {stage} keeps parameters whole). Use stage=3, or drop quantize_weights."
)
GRADS_NEED_STAGE_1 = (
    "{where}: quantize_grads={value!r} quantizes the gradient reduce-scatter of stages 1-3; stage 0 all-reduces "
    "whole gradients. Use stage=1 or higher, or drop quantize_grads."
)
BAD_QUANT_BLOCK = "{where}: quant_block must be a positive int (elements per float32 scale, e.g. 256), got {value!r}."


def check_params(num_params: Any, where: str) -> float:
    """Ψ from a number or ``"7B"``; positive."""
    psi = parse_count(num_params, f"{where}: num_params")
    if psi <= 0:
        raise ValueError(f"{where}: num_params must be positive, got {num_params!r}.")
    return psi


def check_devices(num_devices: Any, where: str, what: str = "num_devices") -> int:
    """A positive integer count of devices (an integral float passes)."""
    integral = isinstance(num_devices, numbers.Integral) or (
        isinstance(num_devices, float) and num_devices.is_integer()
    )
    role = COUNT_ROLES.get(what, "")
    if isinstance(num_devices, bool) or not integral:
        raise TypeError(f"{where}: {what} must be a positive integer{role}, got {num_devices!r}.")
    if num_devices < 1:
        raise ValueError(f"{where}: {what} must be a positive integer{role}, got {num_devices}.")
    return int(num_devices)


def is_stage(stage: Any) -> bool:
    """Whether ``stage`` is a ZeRO stage: an integer (not a bool) from 0 to 3."""
    return not isinstance(stage, bool) and isinstance(stage, numbers.Integral) and 0 <= stage <= 3  # pyright: ignore[reportOperatorIssue] - an Integral compares with an int


def check_stage(stage: Any, where: str) -> int:
    """A ZeRO stage, 0 to 3."""
    if not is_stage(stage):
        raise ValueError(BAD_STAGE.format(where=where, stage=stage))
    return int(stage)


def check_nonneg(value: Any, what: str) -> float:
    """A finite number >= 0."""
    x = number(value, what)
    if x < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}.")
    return x


def wire_problems(stage: int | None, weights: Any, grads: Any, block: Any, where: str) -> list[Problem]:
    """Every problem with the ZeRO++ wire arguments, each with its exception
    type (``stage`` None: not known to be valid, so not compared)."""
    problems: list[Problem] = []
    for name, value in (("quantize_weights", weights), ("quantize_grads", grads)):
        if value is not None and value not in FORMATS:
            problems.append((ValueError, BAD_WIRE_FORMAT.format(where=where, name=name, value=value, formats=FORMATS)))
    if weights is not None and stage is not None and stage < 3:
        problems.append((ValueError, WEIGHTS_NEED_STAGE_3.format(where=where, value=weights, stage=stage)))
    if grads is not None and stage == 0:
        problems.append((ValueError, GRADS_NEED_STAGE_1.format(where=where, value=grads)))
    integral = isinstance(block, numbers.Integral) and not isinstance(block, bool)
    if not integral or block <= 0:
        problems.append((ValueError if integral else TypeError, BAD_QUANT_BLOCK.format(where=where, value=block)))
    return problems


def wire_rates(stage: int, weights: Any, grads: Any, block: Any, where: str) -> tuple[float | None, float | None]:
    """Bytes per element on the wire of ``stage``'s weight gathers and of its
    gradient reduction (``None``: unquantized, ``dtype_bytes``), after
    checking the wire arguments as ``ZeroPolicy`` does (one error naming
    every bad one). A model-level Ψ uses the per-element rate of a whole
    block, ``wire_bytes(block, block) / block`` = 1 + 4/block."""
    raise_problems(wire_problems(stage, weights, grads, block, where), where)
    rate = wire_bytes(block, block) / block
    return (rate if weights is not None else None), (rate if grads is not None else None)


def quantization_at(stage: int, weights: str | None, grads: str | None) -> dict[str, str | None]:
    """The wire formats of ``weights`` / ``grads`` that apply at ``stage`` (qwZ at stage 3, qgZ at 1–3), as
    :func:`~zero_jax.comm_bytes`' and ``ZeroPolicy``'s keywords: what a table or plan of every stage passes to each.

    >>> quantization_at(1, "int8", "int8")
    {'quantize_weights': None, 'quantize_grads': 'int8'}
    """
    stage = check_stage(stage, "quantization_at")
    return {"quantize_weights": weights if stage == 3 else None, "quantize_grads": grads if stage else None}
