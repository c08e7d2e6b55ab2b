"""Will it fit, and which stage? ZeRO's formulas, a stage chooser, and a fit
check that compiles the real step for a simulated mesh of the target size.

The formulas are the ZeRO paper's (Rajbhandari et al. 2020, Figure 1 and
Section 7), per device, with Ψ parameters on N data-parallel devices and K
bytes of optimizer state per parameter:

====== =============================== ===============================
stage  model-state bytes               communication per step (ring)
====== =============================== ===============================
0 (DP) (2 + 2 + K)Ψ                    2·(N−1)/N·2Ψ  (all-reduce)
1      (2 + 2)Ψ + KΨ/N                 2·(N−1)/N·2Ψ  (RS + AG)
2      2Ψ + (2 + K)Ψ/N                 2·(N−1)/N·2Ψ  (RS + AG)
3      (2 + 2 + K)Ψ/N                  3·(N−1)/N·2Ψ  (AG, AG, RS)
====== =============================== ===============================

(with the default 2-byte parameters and gradients and K = 12: fp32 master,
Adam's m and v). Sizes written as strings are decimal for ``KB``/``MB``/
``GB``/``TB`` (the paper's GB is 10⁹ bytes) and binary for ``KiB``/``MiB``/
``GiB``/``TiB``; bandwidths may be written in bytes (``300GB/s``) or bits
(``200Gb/s``).

:func:`plan` answers with the compiled program instead of the formula: it
lowers and compiles a step on abstract inputs (``jax.ShapeDtypeStruct``;
nothing is allocated) for a mesh of ``num_devices`` simulated CPU devices in a
child process, and audits it (:func:`zero_jax.audit`).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from zero_jax._audit import AuditReport

# -- parsing sizes, rates, durations and counts -------------------------------------------------------------

_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_SIZE = re.compile(r"^\s*(?P<num>[+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[A-Za-z]*)\s*$")
_UNITS_HELP = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{what}: expected a number, got {value!r} ({type(value).__name__}).")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{what}: expected a finite number, got {value!r}.")
    return x


def parse_bytes(value: Any, what: str = "size", *, rate: bool = False) -> float:
    """Bytes from a number or a string such as ``"80GB"``, ``"80 GiB"``,
    ``"1.5e9"``; with ``rate=True`` (bandwidths) also ``"300GB/s"`` and bits,
    ``"200Gb/s"``.

    >>> parse_bytes("80GB"), parse_bytes("1KiB"), parse_bytes("200Gb/s", rate=True)
    (80000000000.0, 1024.0, 25000000000.0)
    """
    if not isinstance(value, str):
        return _number(value, what)
    text = re.sub(r"\s*(/\s*s|ps)$", "", value.strip()) if rate else value.strip()
    m = _SIZE.match(text)
    unit = m.group("unit") if m else ""
    bits = rate and unit.endswith("b")
    prefix = unit[:-1] if unit.endswith("B") or bits else unit
    scale = _SI.get(prefix.lower(), _IEC.get(prefix.lower())) if prefix == unit[:-1] or not unit else None
    if m is None or scale is None:
        example = "'300GB/s' or '200Gb/s'" if rate else "'80GB' or '16GiB'"
        raise ValueError(
            f"{what}: cannot read {value!r} as {'a bandwidth' if rate else 'a size in bytes'}. Write a number "
            f"with one of the units {_UNITS_HELP}{' (b for bits), per second' if rate else ''}, e.g. {example}."
        )
    return float(m.group("num")) * scale / (8 if bits else 1)


def parse_seconds(value: Any, what: str = "time") -> float:
    """Seconds from a number or ``"10s"``, ``"250ms"``, ``"2min"``, ``"1h"``.

    >>> parse_seconds("250ms")
    0.25
    """
    if not isinstance(value, str):
        return _number(value, what)
    m = re.match(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(s|ms|us|µs|min|h|)\s*$", value)
    if not m:
        raise ValueError(f"{what}: cannot read {value!r} as a duration; write e.g. '10s', '250ms' or '2min'.")
    scale = {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "min": 60, "h": 3600}[m.group(2)]
    return float(m.group(1)) * scale


def parse_count(value: Any, what: str = "num_params") -> float:
    """A count from a number or ``"7e9"``, ``"7B"``, ``"350M"``, ``"1.5T"``.

    >>> parse_count("7B"), parse_count("350M")
    (7000000000.0, 350000000.0)
    """
    if not isinstance(value, str):
        return _number(value, what)
    m = re.match(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBtT]?)\s*$", value)
    if not m:
        raise ValueError(f"{what}: cannot read {value!r} as a count; write e.g. 7e9, '7B' or '350M'.")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]


def _check_params(num_params: Any, where: str) -> float:
    psi = parse_count(num_params, f"{where}: num_params")
    if psi <= 0:
        raise ValueError(f"{where}: num_params must be positive, got {num_params!r}.")
    return psi


def _check_devices(num_devices: Any, where: str) -> int:
    integral = isinstance(num_devices, numbers.Integral) or (
        isinstance(num_devices, float) and num_devices.is_integer()
    )
    if isinstance(num_devices, bool) or not integral:
        raise TypeError(f"{where}: num_devices must be a positive integer, got {num_devices!r}.")
    if num_devices < 1:
        raise ValueError(
            f"{where}: num_devices must be a positive integer (the data-parallel size), got {num_devices}."
        )
    return int(num_devices)


def _check_stage(stage: Any, where: str) -> int:
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage <= 3:
        raise ValueError(
            f"{where}: stage must be 0, 1, 2 or 3, got {stage!r} (0 is plain data parallelism; 1 partitions "
            "optimizer state, 2 also gradients, 3 also parameters)."
        )
    return int(stage)


def _check_nonneg(value: Any, what: str) -> float:
    x = _number(value, what)
    if x < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}.")
    return x


# -- the formulas --------------------------------------------------------------------------------------


class ModelStateBytes(NamedTuple):
    """Model-state bytes on one device, by category (``total`` sums them).

    With offload the categories count device memory only.
    """

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    replicas: int = 1,
    optimizer_over_replicas: bool = False,
    offload_optimizer: float = 0.0,
    offload_params: bool = False,
) -> ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state on one device.

    Stage 1 divides the optimizer state by N, stage 2 also the gradients,
    stage 3 also the parameters. The defaults are the paper's mixed-precision
    Adam: 2-byte parameters and gradients, K = 12 (fp32 master, m, v).
    ``offload_optimizer`` (a fraction) and ``offload_params`` (stage 3) leave
    that share out (it lives in host memory), as ``ZeroPolicy``'s arguments of
    the same names do; the host bytes are the difference to the figures
    without offload. The chunk an update streams through the device is not
    counted.

    On a hybrid mesh ``num_devices`` is N, the size of the partition axis,
    and ``replicas`` R, the size of the replica axis: HSDP
    (``ZeroPolicy(..., replica_axis=...)``) holds the same bytes as ZeRO at N
    (replicas add no memory); with ``optimizer_over_replicas`` the optimizer
    state and the reduced gradients are divided by R·N instead.

    The paper's Figure 1 (Ψ = 7.5B, N = 64):

    >>> import zero_jax as zj
    >>> [round(zj.model_state_bytes(7.5e9, 64, s).total / 1e9, 1) for s in range(4)]
    [120.0, 31.4, 16.6, 1.9]
    >>> round(zj.model_state_bytes(7.5e9, 8, 3, replicas=8, optimizer_over_replicas=True).total / 1e9, 1)
    3.5

    Half the optimizer state offloaded (1B parameters, N = 8, stage 3): on the
    device, and in host memory:

    >>> half = zj.model_state_bytes(1e9, 8, 3, offload_optimizer=0.5)
    >>> half.optimizer / 1e9, (zj.model_state_bytes(1e9, 8, 3).total - half.total) / 1e9
    (0.75, 0.75)
    """
    psi = _check_params(num_params, "model_state_bytes")
    n = _check_devices(num_devices, "model_state_bytes")
    stage = _check_stage(stage, "model_state_bytes")
    p = _check_nonneg(param_bytes, "model_state_bytes: param_bytes")
    g = _check_nonneg(grad_bytes, "model_state_bytes: grad_bytes")
    k = _check_nonneg(optimizer_bytes, "model_state_bytes: optimizer_bytes")
    r = _check_devices(replicas, "model_state_bytes: replicas")
    finer = n * r if optimizer_over_replicas else n  # the optimizer's cut
    f = float(offload_optimizer)
    if not 0.0 <= f <= 1.0:
        raise ValueError(
            f"model_state_bytes: offload_optimizer must be a fraction in [0, 1], got {offload_optimizer!r}."
        )
    if offload_params and stage < 3:
        raise ValueError(f"model_state_bytes: offload_params needs stage 3 (got stage {stage}).")
    params = p * psi / (n if stage >= 3 else 1)
    optimizer = k * psi / (finer if stage >= 1 else 1)
    return ModelStateBytes(
        params=0.0 if offload_params else params,
        grads=g * psi / (finer if stage >= 2 else 1),
        optimizer=optimizer * (1 - f),
    )


def comm_bytes(num_params: float, num_devices: int, stage: int, *, dtype_bytes: float = 2) -> float:
    """Bytes one device sends per step, counted as a ring moves them.

    Each pass of a tensor of Ψ·``dtype_bytes`` bytes moves (N−1)/N of it per
    device. Stages 0–2 make two passes (an all-reduce, or a reduce-scatter
    plus an all-gather), stage 3 three (gather for the forward, again for the
    backward, reduce-scatter the gradients): 1.5× data parallelism.

    >>> import zero_jax as zj
    >>> zj.comm_bytes(1e9, 8, 0) / 1e9, zj.comm_bytes(1e9, 8, 3) / 1e9
    (3.5, 5.25)
    """
    psi = _check_params(num_params, "comm_bytes")
    n = _check_devices(num_devices, "comm_bytes")
    stage = _check_stage(stage, "comm_bytes")
    b = _check_nonneg(dtype_bytes, "comm_bytes: dtype_bytes")
    return (3 if stage == 3 else 2) * psi * b * (n - 1) / n


def comm_bytes_per_axis(
    num_params: float, num_devices: int, stage: int, *, replicas: int = 1, dtype_bytes: float = 2
) -> dict[str, float]:
    """Bytes one device sends per step on a hybrid mesh, by axis (ring-counted).

    ``"shard"``: within the partition axis (N devices, the fast one) -- the
    same as :func:`comm_bytes` at N. ``"replica"``: across the replica axis
    (R, the slow one): only the 1/N gradient piece crosses it, 2·Ψ/N·(R−1)/R,
    whether it is all-reduced (HSDP) or reduce-scattered and gathered back
    (``optimizer_over_replicas``). An all-reduce or all-gather spanning both
    axes (stage 0; stages 1–2 gathering an optimizer cut over both) moves
    exactly the sum of the two, since (RN−1)/(RN) = (N−1)/N + (R−1)/(RN).

    >>> import zero_jax as zj
    >>> {k: v / 1e9 for k, v in zj.comm_bytes_per_axis(1e9, 4, 3, replicas=2).items()}
    {'shard': 4.5, 'replica': 0.5}
    """
    psi = _check_params(num_params, "comm_bytes_per_axis")
    n = _check_devices(num_devices, "comm_bytes_per_axis")
    r = _check_devices(replicas, "comm_bytes_per_axis: replicas")
    b = _check_nonneg(dtype_bytes, "comm_bytes_per_axis: dtype_bytes")
    return {"shard": comm_bytes(psi, n, stage, dtype_bytes=b), "replica": 2 * psi / n * b * (r - 1) / r}


def efficiency(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    compute_time: float | str,
    bandwidth: float | str,
    dtype_bytes: float = 2,
) -> float:
    """The fraction of a step spent computing when communication does not
    overlap compute: ``t_compute / (t_compute + comm_bytes / bandwidth)``.

    ``compute_time`` is seconds per step (``"10s"`` works); ``bandwidth`` is
    bytes per second and per device (``"300GB/s"``, ``"200Gb/s"``).

    >>> import zero_jax as zj
    >>> round(zj.efficiency(7e9, 64, 3, compute_time="10s", bandwidth="10GB/s"), 3)
    0.707
    """
    t_compute = parse_seconds(compute_time, "efficiency: compute_time")
    bw = parse_bytes(bandwidth, "efficiency: bandwidth", rate=True)
    if t_compute <= 0 or bw <= 0:
        raise ValueError(
            f"efficiency: compute_time and bandwidth must be positive, got {compute_time!r}, {bandwidth!r}."
        )
    t_comm = comm_bytes(num_params, num_devices, stage, dtype_bytes=dtype_bytes) / bw
    return t_compute / (t_compute + t_comm)


def required_bandwidth(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    compute_time: float | str,
    target: float = 0.9,
    dtype_bytes: float = 2,
) -> float:
    """Bytes per second and device needed for :func:`efficiency` to reach
    ``target``: ``comm_bytes / (t_compute · (1/target − 1))``.

    >>> import zero_jax as zj
    >>> zj.required_bandwidth(1e9, 8, 0, compute_time=1.0, target=0.5) / 1e9  # comm (3.5 GB) in 1 s
    3.5
    """
    t_compute = parse_seconds(compute_time, "required_bandwidth: compute_time")
    if t_compute <= 0:
        raise ValueError(f"required_bandwidth: compute_time must be positive, got {compute_time!r}.")
    if not 0 < target < 1:
        raise ValueError(f"required_bandwidth: target efficiency must be in (0, 1), got {target!r}.")
    return comm_bytes(num_params, num_devices, stage, dtype_bytes=dtype_bytes) / (t_compute * (1 / target - 1))


# -- choosing a stage ----------------------------------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB" if abs(x) >= 1e8 else f"{x / 1e6:.1f} MB"


@dataclasses.dataclass(frozen=True)
class StageChoice:
    """The answer of :func:`choose_stage`.

    Attributes:
      stage: the lowest stage whose model states plus activations fit, or
        ``None`` when none does.
      state: :class:`ModelStateBytes` per device for stages 0–3.
      fits: whether each stage fits.
      min_devices: the fewest data-parallel devices with which stage 3 fits
        (``None`` when the activations alone exceed the device).
      max_activation_bytes: the most activation memory stage 3 leaves room for
        on ``num_devices`` devices (negative when its model states alone do
        not fit).
      offload_stage: the lowest stage that fits with the optimizer state
        (the K bytes per parameter) offloaded to host memory, ZeRO-Offload
        style; ``None`` when even that does not fit.
      reason: one sentence: why this stage, or what would make one fit.
      offload_fraction: for ``offload_stage``, the smallest share of the
        optimizer state to offload (``ZeroPolicy(offload_optimizer=...)``,
        rounded up to a hundredth) for it to fit.
      offload_params: when even a fully offloaded optimizer does not fit,
        whether stage 3 fits with the parameters offloaded too
        (``offload_params=True``, ZeRO-Infinity style).
    """

    stage: int | None
    state: tuple[ModelStateBytes, ...]
    fits: tuple[bool, ...]
    num_params: float
    num_devices: int
    device_bytes: float
    activation_bytes: float
    min_devices: int | None
    max_activation_bytes: float
    offload_stage: int | None
    reason: str
    offload_fraction: float | None = None
    offload_params: bool = False

    def total(self, stage: int) -> float:
        """Model states plus activations on one device for ``stage``."""
        return self.state[_check_stage(stage, "StageChoice.total")].total + self.activation_bytes


def choose_stage(
    num_params: float,
    num_devices: int,
    device_bytes: float | str,
    activation_bytes: float | str = 0,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
) -> StageChoice:
    """The lowest ZeRO stage whose model states plus activations fit a device.

    Lower is cheaper: stages 0–2 communicate 2Ψ per step and stage 3 3Ψ
    (:func:`comm_bytes`), and each stage adds work. ``activation_bytes`` is
    per device (it depends on the per-device batch, not on N). When nothing
    fits, ``reason`` says what would: the fewest devices for stage 3,
    offloading the optimizer state, or the activation memory stage 3 leaves.

    >>> import zero_jax as zj
    >>> zj.choose_stage(7.5e9, 64, "80GB", "10GB").stage  # stage 0 needs 120 + 10 GB
    1
    >>> choice = zj.choose_stage(7.5e9, 8, "16GB", "4GB")
    >>> choice.stage, choice.min_devices, choice.offload_stage, choice.offload_fraction
    (None, 10, 3, 0.27)
    >>> print(choice.reason)  # doctest: +NORMALIZE_WHITESPACE
    no stage fits 16.0 GB per device: stage 3 needs 15.0 GB of model state + 4.0 GB of activations.
    It would fit on >= 10 devices with stage 3, with the optimizer state offloaded to the host
    (stage 3: 3.8 GB + activations; offload_optimizer=0.27 suffices), or with activations <= 1.0 GB
    (activation checkpointing, a smaller per-device batch).
    """
    where = "choose_stage"
    psi = _check_params(num_params, where)
    n = _check_devices(num_devices, where)
    mem = parse_bytes(device_bytes, f"{where}: device_bytes")
    act = parse_bytes(activation_bytes, f"{where}: activation_bytes")
    if mem <= 0:
        raise ValueError(f"{where}: device_bytes must be positive, got {device_bytes!r}.")
    if act < 0:
        raise ValueError(f"{where}: activation_bytes must be >= 0, got {activation_bytes!r}.")
    per = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    state = tuple(model_state_bytes(psi, n, s, **per) for s in range(4))
    fits = tuple(s.total + act <= mem for s in state)
    stage = next((s for s in range(4) if fits[s]), None)
    per_param = param_bytes + grad_bytes + optimizer_bytes
    room = mem - act
    min_devices = max(1, math.ceil(per_param * psi / room - 1e-9)) if room > 0 and per_param > 0 else None
    max_act = mem - state[3].total
    offload = [s.params + s.grads for s in state]
    offload_stage = next((s for s in range(4) if offload[s] + act <= mem), None)
    offload_fraction = None
    if offload_stage is not None:
        over = state[offload_stage].total + act - mem
        opt = state[offload_stage].optimizer
        offload_fraction = min(1.0, math.ceil(100 * over / opt - 1e-9) / 100) if opt > 0 and over > 0 else 0.0
    infinity = offload_stage is None and state[3].grads + act <= mem
    if stage is not None:
        cheaper = ""
        if stage:
            needs = ", ".join(_gb(state[s].total + act) for s in range(stage))
            cheaper = f"; stage 0 needs {needs}" if stage == 1 else f"; stages 0-{stage - 1} need {needs}"
        comm = "the same communication as data parallelism (2Ψ per step)" if stage < 3 else "1.5x DP's communication"
        with_act = f" + {_gb(act)} of activations" if act else ""
        reason = (
            f"stage {stage} fits: {_gb(state[stage].total)} of model state{with_act} <= "
            f"{_gb(mem)} per device{cheaper}. It is the lowest stage that fits, with {comm}."
        )
    else:
        options = []
        if min_devices is not None:
            options.append(f"on >= {min_devices} devices with stage 3")
        if offload_stage is not None:
            options.append(
                f"with the optimizer state offloaded to the host (stage {offload_stage}: "
                f"{_gb(offload[offload_stage])} + activations; offload_optimizer={offload_fraction:g} suffices)"
            )
        elif infinity:
            options.append(
                f"with optimizer state and parameters offloaded to the host (stage 3, offload_optimizer=True, "
                f"offload_params=True: {_gb(state[3].grads)} of gradients + activations)"
            )
        if max_act > 0:
            options.append(f"with activations <= {_gb(max_act)} (activation checkpointing, a smaller per-device batch)")
        reason = (
            f"no stage fits {_gb(mem)} per device: stage 3 needs {_gb(state[3].total)} of model state + "
            f"{_gb(act)} of activations. "
            + ("The activations alone exceed the device. " if act >= mem else "")
            + (f"It would fit {', '.join(options[:-1])}{', or ' if len(options) > 1 else ''}{options[-1]}." if options
               else "No number of devices makes room: reduce the activations first.")
        )  # fmt: skip
    return StageChoice(
        stage, state, fits, psi, n, mem, act, min_devices, max_act, offload_stage, reason, offload_fraction, infinity
    )


# -- plan: compile for a simulated mesh of the target size ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`plan` found: one :class:`~zero_jax.AuditReport` per stage
    compiled, and what planning cost.

    Attributes:
      reports: the audits (bytes from the abstract state's shardings,
        ``memory_analysis()``, collectives) of each stage's compiled step.
      num_devices: the simulated mesh size.
      device_bytes: the memory per device to fit (``None``: not checked).
      max_rss_bytes: the peak resident memory of the process that compiled
        (a child process, unless a step was passed in): far below the
        model's size, since nothing was allocated.
      seconds: wall time of planning.
    """

    reports: tuple[AuditReport, ...]
    num_devices: int
    device_bytes: float | None
    max_rss_bytes: int
    seconds: float

    @property
    def peaks(self) -> dict[int, int]:
        """stage -> the compiled step's peak bytes per device."""
        return {r.stage: r.memory["peak"] for r in self.reports}

    @property
    def fits(self) -> dict[int, bool | None]:
        return {s: None if self.device_bytes is None else p <= self.device_bytes for s, p in self.peaks.items()}

    @property
    def recommended(self) -> int | None:
        """The lowest planned stage whose compiled peak fits ``device_bytes``."""
        return next((s for s, ok in sorted(self.fits.items()) if ok), None)

    def __str__(self) -> str:
        from zero_jax._audit import fmt_bytes

        lines = [
            f"zj.plan: N = {self.num_devices}"
            + (f", {_gb(self.device_bytes)} per device" if self.device_bytes is not None else "")
            + f"; compiled in {self.seconds:.1f} s, peak RSS {fmt_bytes(self.max_rss_bytes)}",
            f"{'stage':>5} {'params':>11} {'grads':>11} {'optimizer':>11} {'temp':>11} {'peak':>11} {'fits':>5} "
            f"{'comm/step':>11} {'/theory':>7}",
        ]
        for r in self.reports:
            b = r.state_bytes
            fit = self.fits[r.stage]
            lines.append(
                f"{r.stage:>5} {fmt_bytes(b['params']):>11} {fmt_bytes(b['grads']) if 'grads' in b else '-':>11} "
                f"{fmt_bytes(b['optimizer']):>11} {fmt_bytes(r.memory['temp']):>11} {fmt_bytes(r.memory['peak']):>11} "
                f"{'-' if fit is None else 'yes' if fit else 'no':>5} {fmt_bytes(r.comm.measured):>11} "
                f"{r.comm.ratio:>7.3f}"
            )
        if self.device_bytes is not None:
            rec = self.recommended
            lines.append(f"recommended: stage {rec}" if rec is not None else "recommended: none fits")
        return "\n".join(lines)


def reference_step(
    stage: int,
    mesh: Any,
    *,
    vocab: int = 256,
    dim: int = 128,
    depth: int = 4,
    heads: int = 4,
    seq: int = 64,
    mlp: int | None = None,
    batch_per_device: int = 1,
    global_batch: int | None = None,
    compute_dtype: str | None = None,
    gather: str = "manual",
    min_shard_size: int | None = None,
    accum_steps: int = 1,
    learning_rate: float = 1e-3,
) -> tuple[Any, Any, Any]:
    """The default :func:`plan` factory: the reference transformer
    (``zero_jax.models``) with AdamW, stacked layers run layer-wise
    (``gather="manual"``), on abstract inputs: ``(step, abstract_state,
    abstract_batch)``. ``compute_dtype="bfloat16"`` plans mixed precision."""
    import jax
    import jax.numpy as jnp
    import optax

    import zero_jax as zj
    from zero_jax.models import TransformerConfig, init_params, make_loss_fn

    n = mesh.size
    batch = global_batch if global_batch is not None else batch_per_device * n * accum_steps
    if batch % (n * accum_steps):
        raise ValueError(
            f"plan: the global batch of {batch} cannot be split over {n} devices"
            + (f" x {accum_steps} microbatches" if accum_steps > 1 else "")
            + f"; use a multiple of {n * accum_steps}."
        )
    cfg = TransformerConfig(vocab=vocab, dim=dim, depth=depth, heads=heads, seq=seq, mlp=mlp)
    extra: dict[str, Any] = {} if min_shard_size is None else {"min_shard_size": min_shard_size}
    if compute_dtype is not None:
        extra["precision"] = zj.Precision(compute_dtype=jnp.dtype(compute_dtype))
    policy = zj.ZeroPolicy(stage, mesh, stacked="layers", **extra)
    tx = zj.shard_optimizer(optax.adamw(learning_rate), policy)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    state = zj.init_state(params, tx, policy)
    model_policy = policy if gather == "manual" else None
    step = zj.make_train_step(make_loss_fn(cfg, model_policy), tx, policy, gather=gather, accum_steps=accum_steps)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=policy.batch_sharding())
    return step, state, {"tokens": tokens}


def _factory_path(factory: Any) -> str:
    if factory is None:
        return "zero_jax._planner:reference_step"
    if isinstance(factory, str):
        if ":" not in factory:
            raise ValueError(f"plan: a factory path is 'module:function', got {factory!r}.")
        return factory
    if not callable(factory):
        raise TypeError(
            f"plan: the factory must be callable or a 'module:function' path, got {type(factory).__name__}."
        )
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise ValueError(
            f"plan: the factory {factory!r} cannot be imported by the planning process (it is defined in "
            "__main__ or locally). Define it at the top level of an importable module, or pass its path as "
            "'module:function'."
        )
    return f"{module}:{name}"


def _resolve(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _max_rss(usage: Any) -> int:
    """This process's peak resident memory.

    On Linux, read the high-water mark of the current address space
    (``VmHWM``): ``ru_maxrss`` survives ``exec``, so in a freshly started
    child it still reports the parent's size at ``fork`` time.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(usage.ru_maxrss) * (1 if sys.platform == "darwin" else 1024)


def plan(
    target: Any = None,
    abstract_state: Any = None,
    abstract_batch: Any = None,
    *,
    num_devices: int | None = None,
    device_bytes: float | str | None = None,
    stages: Sequence[int] = (0, 1, 2, 3),
    factory_kwargs: dict[str, Any] | None = None,
    grads: bool = True,
    timeout: float = 600.0,
) -> Plan:
    """Will the step fit on ``num_devices`` devices of ``device_bytes``?
    Compile it for a simulated mesh of that size and read the compiled program.

    Nothing is allocated: the step is lowered on ``jax.ShapeDtypeStruct``
    inputs and compiled, and each stage's compiled step is audited
    (:func:`zero_jax.audit`: state bytes from the shardings,
    ``memory_analysis()``, collectives). A laptop can check a 7B model's
    ZeRO-3 step on 64 devices before renting them.

    Args:
      target: what to compile; one of

        * ``None``: the reference transformer (:func:`reference_step`; size it
          with ``factory_kwargs``, e.g. ``dict(vocab=32000, dim=4096,
          depth=32, heads=32, seq=2048)``);
        * a factory ``factory(stage, mesh, **factory_kwargs) -> (step,
          abstract_state, abstract_batch)``, or its path ``"module:function"``:
          run for each of ``stages`` in a child process that has
          ``num_devices`` simulated CPU devices (this process already has its
          own); the factory must be importable there;
        * a built step (``zj.make_train_step``) with ``abstract_state`` and
          ``abstract_batch``: compiled here, on this process's devices.
      num_devices: the data-parallel size to plan for (with a step: its
        policy's, by default).
      device_bytes: memory per device (``"80GB"``) to check the compiled peak
        against; ``None`` reports without judging.
      stages: the stages to compile (factories only).
      factory_kwargs: keyword arguments for the factory (picklable).
      grads: also compile the gradient function to measure gradient bytes.
      timeout: seconds the child process may take.

    Example (compiles the 865k-parameter reference model's stage-3 step for 64
    simulated devices in a child process):

    >>> import zero_jax as zj
    >>> p = zj.plan(num_devices=64, device_bytes="80GB", stages=[3], grads=False)
    >>> p.recommended, p.reports[0].num_devices
    (3, 64)
    """
    started = time.perf_counter()
    mem = None if device_bytes is None else parse_bytes(device_bytes, "plan: device_bytes")
    if mem is not None and mem <= 0:
        raise ValueError(f"plan: device_bytes must be positive, got {device_bytes!r}.")
    if hasattr(target, "lower"):  # a built step: compile here
        from zero_jax._audit import audit

        if abstract_state is None or abstract_batch is None:
            raise TypeError("plan: with a built step, pass abstract_state and abstract_batch too.")
        n = target.policy.num_shards if hasattr(target, "policy") else None
        if num_devices is not None and n is not None and _check_devices(num_devices, "plan") != n:
            raise ValueError(
                f"plan: the step's policy spans {n} devices, not num_devices={num_devices}. To plan for another "
                "size, pass a factory (or its 'module:function' path), which runs on a simulated mesh of that size."
            )
        report = audit(target, abstract_state, abstract_batch, grads=None if grads else False)
        rss = _max_rss(__import__("resource").getrusage(__import__("resource").RUSAGE_SELF))
        return Plan((report,), report.num_devices, mem, rss, time.perf_counter() - started)
    if abstract_state is not None or abstract_batch is not None:
        raise TypeError("plan: abstract_state and abstract_batch go with a built step, not with a factory.")
    if num_devices is None:
        raise TypeError("plan: pass num_devices=..., the data-parallel size to plan for.")
    n = _check_devices(num_devices, "plan")
    stages = [_check_stage(s, "plan") for s in stages]
    if not stages:
        raise ValueError("plan: stages is empty; pass some of 0, 1, 2, 3.")
    kwargs = dict(factory_kwargs or {})
    path = _factory_path(target)
    if path == "zero_jax._planner:reference_step":  # fail fast, without starting a process
        k = kwargs.get("accum_steps", 1)
        gb = kwargs.get("global_batch")
        if gb is not None and gb % (n * k):
            raise ValueError(
                f"plan: the global batch of {gb} cannot be split over {n} devices"
                + (f" x {k} microbatches" if k > 1 else "")
                + f"; use a multiple of {n * k}."
            )
    payload = {"factory": path, "kwargs": kwargs, "stages": stages, "grads": grads, "sys_path": list(sys.path)}
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in.pkl"), os.path.join(d, "out.pkl")
        with open(src, "wb") as f:
            pickle.dump(payload, f)
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
        code = (
            "import jax; "
            f"jax.config.update('jax_num_cpu_devices', {n}); jax.config.update('jax_platforms', 'cpu'); "
            "from zero_jax._planner import _worker; _worker()"
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, src, dst], env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"plan: compiling for N = {n} took longer than timeout={timeout} s.") from e
        if not os.path.exists(dst):
            raise RuntimeError(f"plan: the planning process failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(dst, "rb") as f:
            out = pickle.load(f)
    if out.get("error"):
        kind, message = out["error"]
        exc = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
        raise exc(f"plan (N = {n} simulated devices, {path}): {message}")
    return Plan(tuple(out["reports"]), n, mem, out["max_rss"], time.perf_counter() - started)


def _worker() -> None:
    """The child process of :func:`plan` (JAX already sized to N CPU devices)."""
    import resource

    src, dst = sys.argv[1], sys.argv[2]
    with open(src, "rb") as f:
        payload = pickle.load(f)
    for p in reversed(payload["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    out: dict[str, Any] = {"error": None, "reports": [], "max_rss": 0}
    try:
        import jax

        from zero_jax._audit import audit

        factory = _resolve(payload["factory"])
        mesh = jax.make_mesh((jax.device_count(),), ("data",))
        for stage in payload["stages"]:
            step, state, batch = factory(stage, mesh, **payload["kwargs"])
            out["reports"].append(audit(step, state, batch, grads=None if payload["grads"] else False))
            del step, state, batch
    except Exception as e:  # reported to the parent, which raises it
        out["error"] = (type(e).__name__, f"{e}")
    out["max_rss"] = _max_rss(resource.getrusage(resource.RUSAGE_SELF))
    with open(dst, "wb") as f:
        pickle.dump(out, f)


# -- the command line: python -m zero_jax plan ------------------------------------------------------------------

_STAGE_NAMES = ("DP", "P_os", "P_os+g", "P_os+g+p")


def _si(x: float) -> str:
    """Decimal bytes, as the paper and ``--device-memory 80GB`` write them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 150, highlight=False)


def add_plan_arguments(p: Any) -> None:
    """The ``plan`` subcommand's options (for ``zero_jax.__main__``)."""
    from zero_jax.models.transformer import add_model_arguments  # the models import zero_jax

    p.add_argument("--params", help="number of parameters, e.g. 7e9 or 7B (default: the --compile model's)")
    p.add_argument("--devices", type=int, default=8, help="data-parallel devices N (default 8)")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="hybrid mesh: R replicas of N-device partitions (HSDP, R*N devices); adds per-axis figures",
    )
    p.add_argument("--device-memory", required=True, help="memory per device, e.g. 80GB or 16GiB")
    p.add_argument("--activations", default="0", help="activation memory per device, e.g. 10GB (default 0)")
    p.add_argument("--bandwidth", help="bandwidth per device, e.g. 300GB/s or 200Gb/s (with --compute-time)")
    p.add_argument("--compute-time", help="compute time per step, e.g. 10s or 250ms (with --bandwidth)")
    p.add_argument("--target-efficiency", type=float, default=0.9, help="efficiency to size bandwidth for (0.9)")
    p.add_argument("--param-bytes", type=float, default=2, help="bytes per parameter (2: bf16 compute copy)")
    p.add_argument("--grad-bytes", type=float, default=2, help="bytes per gradient element (2)")
    p.add_argument("--optimizer-bytes", type=float, default=12, help="optimizer bytes per parameter, K (12: Adam)")
    p.add_argument("--plot", help="write the stacked-bar chart of model states per stage to this file (matplotlib)")
    c = p.add_argument_group("compile: check the reference transformer's compiled step (simulated devices)")
    c.add_argument("--compile", action="store_true", help="also compile each stage's step for N simulated devices")
    add_model_arguments(c, vocab=32000, dim=2048, depth=20, heads=16, seq=512, batch_per_device=1)
    c.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=range(4))


def run_plan_command(args: Any) -> int:
    """``python -m zero_jax plan``: the formula table, the recommendation,
    communication and efficiency; optionally the chart and the compiled check."""
    try:
        return _plan_command(args)
    except (ValueError, TypeError) as e:
        print(f"python -m zero_jax plan: error: {e}", file=sys.stderr)
        return 2


def _plan_command(args: Any) -> int:
    from rich.table import Table

    console = _console()
    model = dict(
        vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads, seq=args.seq,
        batch_per_device=args.batch_per_device, compute_dtype="bfloat16" if args.bf16 else None,
    )  # fmt: skip
    if args.params is None:
        if not args.compile:
            raise ValueError("pass --params (e.g. --params 7e9), or --compile to plan the reference transformer.")
        from zero_jax.models import TransformerConfig

        keys = ("vocab", "dim", "depth", "heads", "seq")
        num_params: float = TransformerConfig(**{k: model[k] for k in keys}).num_params()
    else:
        num_params = parse_count(args.params, "--params")
    if (args.bandwidth is None) != (args.compute_time is None):
        raise ValueError("--bandwidth and --compute-time go together (efficiency = t_compute / (t_compute + t_comm)).")
    per = dict(param_bytes=args.param_bytes, grad_bytes=args.grad_bytes, optimizer_bytes=args.optimizer_bytes)
    choice = choose_stage(num_params, args.devices, args.device_memory, args.activations, **per)
    n, act, mem = choice.num_devices, choice.activation_bytes, choice.device_bytes
    timing = args.bandwidth is not None
    table = Table(
        title=f"ZeRO model states per device: Ψ = {num_params / 1e9:.2f}B parameters, N = {n}, {_si(mem)} per device",
        caption=f"{args.param_bytes:g} + {args.grad_bytes:g} + {args.optimizer_bytes:g} bytes per parameter "
        f"(params + grads + optimizer); activations {_si(act)} per device; communication counted as a ring moves it",
    )
    cols = ("stage", "params", "grads", "optimizer", "total") + (("+ activations",) if act else ()) + ("fits",)
    for col in (*cols, "comm/step"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    if timing:
        table.add_column("t_comm", justify="right")
        table.add_column("efficiency", justify="right")
    for s in range(4):
        st = choice.state[s]
        row = [f"{s} {_STAGE_NAMES[s]}", _si(st.params), _si(st.grads), _si(st.optimizer), _si(st.total)]
        row += [_si(st.total + act)] if act else []
        row.append("[green]yes[/green]" if choice.fits[s] else "[red]no[/red]")
        comm = comm_bytes(num_params, n, s, dtype_bytes=args.grad_bytes)
        row.append(_si(comm))
        if timing:
            bw = parse_bytes(args.bandwidth, "--bandwidth", rate=True)
            row.append(f"{comm / bw:.2f} s")
            eff = efficiency(
                num_params, n, s, compute_time=args.compute_time, bandwidth=bw, dtype_bytes=args.grad_bytes
            )
            row.append(f"{eff:.1%}")
        table.add_row(*row, style="bold" if s == choice.stage else None)
    console.print(table)
    head = f"stage {choice.stage}" if choice.stage is not None else "no stage fits"
    console.print(f"[bold]Recommendation: {head}.[/bold] {choice.reason}")
    if timing and n > 1:
        s = choice.stage if choice.stage is not None else 3
        need = required_bandwidth(
            num_params, n, s, compute_time=args.compute_time, target=args.target_efficiency, dtype_bytes=args.grad_bytes
        )
        console.print(f"Bandwidth for {args.target_efficiency:.0%} efficiency at stage {s}: {_si(need)}/s per device.")
    if args.replicas > 1:
        _hybrid_table(console, num_params, n, args.replicas, per, args.grad_bytes)
    if args.plot:
        _plot(choice, args.plot)
        console.print(f"Chart written to {args.plot}")
    if args.compile:
        _compiled_table(console, n, mem, model, args.stages)
    return 0


def _hybrid_table(console: Any, num_params: float, n: int, r: int, per: dict[str, float], dtype_bytes: float) -> None:
    """Per-device model states and per-axis communication of the hybrid policies."""
    from rich.table import Table

    table = Table(
        title=f"Hybrid mesh: R = {r} replicas x N = {n} partitions ({r * n} devices)",
        caption="HSDP: ZeroPolicy(..., replica_axis=...); hpZ: also optimizer_over_replicas=True. Per step, per "
        "device, as a ring moves it: within the partition axis (fast), across the replica axis (slow).",
    )
    for col in ("stage", "HSDP per device", "hpZ per device", "comm within N", "comm across R"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for s in range(1, 4):
        hsdp = model_state_bytes(num_params, n, s, replicas=r, **per).total
        hpz = model_state_bytes(num_params, n, s, replicas=r, optimizer_over_replicas=True, **per).total
        comm = comm_bytes_per_axis(num_params, n, s, replicas=r, dtype_bytes=dtype_bytes)
        table.add_row(f"{s} {_STAGE_NAMES[s]}", _si(hsdp), _si(hpz), _si(comm["shard"]), _si(comm["replica"]))
    console.print(table)


def _plot(choice: StageChoice, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    labels = [f"{s}: {_STAGE_NAMES[s]}" for s in range(4)]
    bottom = [0.0] * 4
    parts = [("params", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868")]
    if choice.activation_bytes:
        parts.append(("activations", "#C8C8C8"))
    for name, color in parts:
        values = [
            (choice.activation_bytes if name == "activations" else getattr(choice.state[s], name)) / 1e9
            for s in range(4)
        ]
        ax.bar(labels, values, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.axhline(choice.device_bytes / 1e9, color="black", linestyle="--", linewidth=1)
    ax.text(3.45, choice.device_bytes / 1e9, f" {_si(choice.device_bytes)}", va="bottom", ha="right")
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("GB per device")
    ax.set_title(f"ZeRO model states: Ψ = {choice.num_params / 1e9:.2f}B, N = {choice.num_devices}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _compiled_table(console: Any, n: int, mem: float, model: dict[str, Any], stages: Sequence[int]) -> None:
    from rich.table import Table

    from zero_jax._audit import fmt_bytes

    console.print(f"Compiling the reference transformer for {n} simulated devices (nothing is allocated)...")
    result = plan(num_devices=n, device_bytes=mem, stages=stages, factory_kwargs=model)
    phi = result.reports[0].num_params
    table = Table(
        title=f"Compiled step (reference transformer, Φ = {phi:,}, AdamW, "
        f"{'bf16 compute / fp32 master' if model['compute_dtype'] else 'fp32'})",
        caption=f"compiled in {result.seconds:.1f} s; peak resident memory of the compiling process "
        f"{fmt_bytes(result.max_rss_bytes)}; peak = argument + output + temp - alias (memory_analysis)",
    )
    for col in ("stage", "params", "grads", "optimizer", "temp", "peak", "fits", "comm/step", "/theory", "check"):
        table.add_column(col, justify="left" if col == "stage" else "right")
    for r in result.reports:
        b, fit = r.state_bytes, result.fits[r.stage]
        table.add_row(
            f"{r.stage} {_STAGE_NAMES[r.stage]}", _si(b["params"]), _si(b.get("grads", 0)),
            _si(b["optimizer"]), _si(r.memory["temp"]), _si(r.memory["peak"]),
            "[green]yes[/green]" if fit else "[red]no[/red]", _si(r.comm.measured), f"{r.comm.ratio:.3f}",
            "[green]ok[/green]" if r.ok else f"[red]{len(r.violations)} violation(s)[/red]",
        )  # fmt: skip
    console.print(table)
    rec = result.recommended
    verdict = f"stage {rec} is the lowest that fits" if rec is not None else "no stage fits"
    console.print(f"[bold]Compiled: {verdict}.[/bold]")
