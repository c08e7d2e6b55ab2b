"""The trace scope: the house's one ``ContextVar`` (what the loss being traced
runs under), read by the layer-wise primitives to find the step's policy.
(The adapters keep their own trace state in ``zero_jax.adapters._scope``.)"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from zero_jax._base.scoped import Scoped
from zero_jax._policy.policy import ZeroPolicy


@dataclasses.dataclass(frozen=True)
class TraceScope:
    """What the loss function being traced runs under: the house's one piece
    of trace-time context (one ``ContextVar``, so nested and concurrent
    traces in other threads each see their own).

    Attributes:
      policy: the manual-gather step's policy; None outside such a step.
      pieces: False when the step hands ``loss_fn`` whole parameters even in
        stages 2–3 (local accumulation gathers once per step), so ``gather``
        and ``scan_layers`` pass them through.
    """

    policy: ZeroPolicy | None = None
    pieces: bool = True


_SCOPE: Scoped[TraceScope] = Scoped("zero_jax_trace_scope", TraceScope())


def current_scope() -> TraceScope:
    """The :class:`TraceScope` of the trace in progress (empty outside one)."""
    return _SCOPE.current()


def trace_scope(**changes: Any) -> contextlib.AbstractContextManager[TraceScope]:
    """Run a block with the current :class:`TraceScope`'s fields replaced."""
    return _SCOPE.replaced(**changes)


@contextlib.contextmanager
def manual_gather_scope(policy: ZeroPolicy, *, pieces: bool = True) -> Iterator[None]:
    """Marks the tracing of a manual-gather loss function (set by the step).

    ``pieces=False``: the step hands ``loss_fn`` whole parameters even in
    stages 2–3 (local gradient accumulation gathers once per step), so
    ``gather`` and ``scan_layers`` pass them through.
    """
    with trace_scope(policy=policy, pieces=pieces):
        yield


def active_policy(policy: ZeroPolicy | None, where: str) -> ZeroPolicy | None:
    """The policy whose pieces to gather, or None when there is nothing to gather."""
    if policy is None:
        return None
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(f"{where}: policy must be a ZeroPolicy or None, got {type(policy).__name__}.")
    scope = current_scope()
    if scope.policy is None:
        raise RuntimeError(
            f"{where} was called outside a train step. It gathers parameter pieces inside "
            "make_train_step(loss_fn, tx, policy, gather='manual'); to run the model on ordinary "
            f"parameters (evaluation, zj.full_params(state)), pass policy=None to {where}."
        )
    if scope.policy != policy:
        raise ValueError(f"{where}: called with {policy!r}, but the step runs {scope.policy!r}.")
    return policy if scope.pieces else None
