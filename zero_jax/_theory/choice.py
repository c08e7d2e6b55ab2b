"""Which stage to run: the lowest whose model states plus activations fit a
device (:func:`choose_stage`), with the reason in words."""

from __future__ import annotations

import dataclasses
import math

from zero_jax._base.units import fmt_bytes, parse_bytes
from zero_jax._theory.checks import check_devices, check_params, check_stage
from zero_jax._theory.formulas import ModelStateBytes, model_state_bytes


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
      model_parallel: the tensor-parallel size M the figures are divided by.
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
    model_parallel: int = 1

    def total(self, stage: int) -> float:
        """Model states plus activations on one device for ``stage``."""
        return self.state[check_stage(stage, "StageChoice.total")].total + self.activation_bytes


def choose_stage(
    num_params: float,
    num_devices: int,
    device_bytes: float | str,
    activation_bytes: float | str = 0,
    *,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    optimizer_bytes: float = 12,
    model_parallel: int = 1,
) -> StageChoice:
    """The lowest ZeRO stage whose model states plus activations fit a device.

    Lower is cheaper: stages 0–2 communicate 2Ψ per step and stage 3 3Ψ
    (:func:`comm_bytes`), and each stage adds work. ``activation_bytes`` is
    per device (it depends on the per-device batch, not on N). When nothing
    fits, ``reason`` says what would: the fewest devices for stage 3,
    offloading the optimizer state, or the activation memory stage 3 leaves.
    With tensor parallelism over M devices (``model_parallel``) the model
    states are :func:`model_state_bytes` / M and ``min_devices`` counts the
    data-parallel devices N (N·M in all).

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
    >>> zj.choose_stage(7.5e9, 8, "16GB", "4GB", model_parallel=2).stage  # stage 3: 15.0 GB / 2 + 4 GB
    3
    """
    where = "choose_stage"
    psi = check_params(num_params, where)
    n = check_devices(num_devices, where)
    mem = parse_bytes(device_bytes, f"{where}: device_bytes")
    act = parse_bytes(activation_bytes, f"{where}: activation_bytes")
    if mem <= 0:
        raise ValueError(f"{where}: device_bytes must be positive, got {device_bytes!r}.")
    if act < 0:
        raise ValueError(f"{where}: activation_bytes must be >= 0, got {activation_bytes!r}.")
    m = check_devices(model_parallel, where, "model_parallel")
    per = dict(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    state = tuple(model_state_bytes(psi, n, s, model_parallel=m, **per) for s in range(4))  # pyright: ignore[reportArgumentType] - **per holds the byte sizes only
    fits = tuple(s.total + act <= mem for s in state)
    stage = next((s for s in range(4) if fits[s]), None)
    per_param = param_bytes + grad_bytes + optimizer_bytes
    room = mem - act
    min_devices = max(1, math.ceil(per_param * psi / m / room - 1e-9)) if room > 0 and per_param > 0 else None
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
        reason = _fit_reason(stage, state, act, mem)
    else:
        options = []
        if min_devices is not None:
            tp = f" (x {m} tensor-parallel)" if m > 1 else ""
            options.append(f"on >= {min_devices} {'data-parallel ' if m > 1 else ''}devices{tp} with stage 3")
        if offload_stage is not None:
            options.append(
                f"with the optimizer state offloaded to the host (stage {offload_stage}: "
                f"{_dec(offload[offload_stage])} + activations; offload_optimizer={offload_fraction:g} suffices)"
            )
        elif infinity:
            options.append(
                f"with optimizer state and parameters offloaded to the host (stage 3, offload_optimizer=True, "
                f"offload_params=True: {_dec(state[3].grads)} of gradients + activations)"
            )
        if max_act > 0:
            options.append(
                f"with activations <= {_dec(max_act)} (activation checkpointing, a smaller per-device batch)"
            )
        reason = _no_fit_reason(state[3].total, act, mem, options)
    return StageChoice(
        stage, state, fits, psi, n, mem, act, min_devices, max_act, offload_stage, reason, offload_fraction, infinity, m
    )


def _dec(x: float) -> str:
    return fmt_bytes(x, decimal=True)


def _fit_reason(stage: int, state: tuple[ModelStateBytes, ...], act: float, mem: float) -> str:
    """Why ``stage`` is the choice: what it needs, and what the cheaper stages needed."""
    cheaper = ""
    if stage:
        needs = ", ".join(_dec(state[s].total + act) for s in range(stage))
        cheaper = f"; stage 0 needs {needs}" if stage == 1 else f"; stages 0-{stage - 1} need {needs}"
    comm = "the same communication as data parallelism (2Ψ per step)" if stage < 3 else "1.5x DP's communication"
    with_act = f" + {_dec(act)} of activations" if act else ""
    return (
        f"stage {stage} fits: {_dec(state[stage].total)} of model state{with_act} <= "
        f"{_dec(mem)} per device{cheaper}. It is the lowest stage that fits, with {comm}."
    )


def _no_fit_reason(stage3: float, act: float, mem: float, options: list[str]) -> str:
    """Why nothing fits, and the ``options`` that would make it fit."""
    alone = "The activations alone exceed the device. " if act >= mem else ""
    if options:
        joined = ", ".join(options[:-1]) + (", or " if len(options) > 1 else "") + options[-1]
        fix = f"It would fit {joined}."
    else:
        fix = "No number of devices makes room: reduce the activations first."
    return (
        f"no stage fits {_dec(mem)} per device: stage 3 needs {_dec(stage3)} of model state + "
        f"{_dec(act)} of activations. {alone}{fix}"
    )
