"""Memory kinds: where an array lives (device or pinned host memory), the
offload options a policy is built with (state between steps, activation
checkpoints within one), and the in-step move to the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from zero_jax._base.problems import Problem

#: The memory kind offloaded state lives in.
HOST = "pinned_host"
DEVICE = "device"

OFFLOAD_FRACTION_RANGE = (
    "ZeroPolicy: offload_optimizer={value!r} is outside [0, 1]. Pass True (all optimizer state in host memory), "
    "False, or the fraction of the optimizer-state bytes to offload, e.g. 0.5."
)
OFFLOAD_PARAMS_STAGE = (
    "ZeroPolicy: offload_params=True needs stage=3 (got stage={stage}): only stage 3 partitions the parameters, "
    "and only partitioned parameters are offloaded (stages 0-2 need the whole parameters on every device for "
    "each step). Use stage=3, or offload_optimizer instead."
)
BAD_OFFLOAD_OPTIMIZER = "ZeroPolicy: offload_optimizer must be a bool or a fraction in [0, 1], got {kind}."
NO_HOST_MEMORY = (
    "ZeroPolicy: offload needs the {host!r} memory kind, but the {platform!r} backend's devices have {kinds}. "
    "Run without offload_optimizer / offload_params on this backend (or use a higher stage or more devices to "
    "save memory)."
)


def memory_kinds(device: Any) -> frozenset[str]:
    """The memory kinds a device can hold arrays in (the capability probe)."""
    try:
        return frozenset(m.kind for m in device.addressable_memories())
    except Exception:  # a backend without the memories API has no host memory kinds
        return frozenset()


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """A policy's validated offload options.

    Attributes:
      fraction: the share of the optimizer-state (and master) bytes that
        lives in host memory, 0.0 to 1.0.
      params: whether the partitioned parameters live in host memory.
    """

    fraction: float = 0.0
    params: bool = False

    def __iter__(self) -> Iterator[Any]:  # ``fraction, params = policy.offload``
        return iter((self.fraction, self.params))


def offload_problems(offload_optimizer: Any, offload_params: Any, stage: int | None, mesh: Any) -> list[Problem]:
    """Every problem with ``ZeroPolicy``'s offload arguments (``stage``: None
    when not known to be valid, so not compared), each with its exception type."""
    problems: list[Problem] = []
    fraction = 0.0
    if isinstance(offload_optimizer, (bool, np.bool_)):
        fraction = 1.0 if offload_optimizer else 0.0
    elif isinstance(offload_optimizer, (int, float, np.integer, np.floating)):
        fraction = float(offload_optimizer)
        if not 0.0 <= fraction <= 1.0:  # also rejects NaN
            problems.append((ValueError, OFFLOAD_FRACTION_RANGE.format(value=offload_optimizer)))
    else:
        problems.append((TypeError, BAD_OFFLOAD_OPTIMIZER.format(kind=type(offload_optimizer).__name__)))
    if not isinstance(offload_params, (bool, np.bool_)):
        problems.append((TypeError, f"ZeroPolicy: offload_params must be True or False, got {offload_params!r}."))
    elif offload_params and stage is not None and stage < 3:
        problems.append((ValueError, OFFLOAD_PARAMS_STAGE.format(stage=stage)))
    if fraction > 0 or offload_params is True:
        problems.extend(_host_memory_problems(mesh, NO_HOST_MEMORY))
    return problems


def _host_memory_problems(mesh: Any, message: str) -> list[Problem]:
    """The missing ``pinned_host`` memory kind on ``mesh``'s devices, as a problem worded by ``message``."""
    if not hasattr(mesh, "devices"):
        return []
    device = mesh.devices.flat[0]
    kinds = memory_kinds(device)
    if HOST in kinds:
        return []
    kinds_text = sorted(kinds) or "no memory kinds"
    return [(ValueError, message.format(host=HOST, platform=device.platform, kinds=kinds_text))]


BAD_OFFLOAD_ACTIVATIONS = "ZeroPolicy: offload_activations must be True or False, got {!r}."
NO_HOST_MEMORY_ACTIVATIONS = (
    "ZeroPolicy: offload_activations=True keeps the saved layer inputs in the {host!r} memory kind, but the "
    "{platform!r} backend's devices have {kinds}. Drop offload_activations on this backend (partition_activations "
    "with a model axis, or a smaller batch per device, also saves activation memory)."
)


def activation_offload_problems(offload_activations: Any, stage: int | None, mesh: Any) -> list[Problem]:
    """Every problem with ``ZeroPolicy(offload_activations=...)`` (P_a+cpu)."""
    if not isinstance(offload_activations, (bool, np.bool_)):
        return [(TypeError, BAD_OFFLOAD_ACTIVATIONS.format(offload_activations))]
    if not offload_activations:
        return []
    return _host_memory_problems(mesh, NO_HOST_MEMORY_ACTIVATIONS)


def offload_options(offload_optimizer: bool | float, offload_params: bool) -> OffloadOptions:
    """The validated options (see :func:`offload_problems`): ``True`` is the fraction 1.0."""
    if isinstance(offload_optimizer, (bool, np.bool_)):
        offload_optimizer = 1.0 if offload_optimizer else 0.0
    return OffloadOptions(float(offload_optimizer), bool(offload_params))


def is_host(x: Any) -> bool:
    """Inside a step: whether a traced array lives in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def to_device(x: jax.Array) -> jax.Array:
    """Inside a step: move a host-resident array (an offloaded parameter piece,
    or under ``scan_layers`` one layer's slice of it) to device memory; any
    other array passes through untouched."""
    if is_host(x):
        return jax.device_put(x, jax.memory.Space.Device)
    return x
