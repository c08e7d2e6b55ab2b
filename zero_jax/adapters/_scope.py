"""The adapters' own trace-time state, in their own ``ContextVar`` (the core's
one, ``zero_jax._layerwise.scope``, carries only what the layer-wise
primitives read).

>>> with adapter_scope(state_updates="discard"):
...     count_scan()
...     current().state_updates, current().scans
('discard', 1)
>>> current().scans
0
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class AdapterScope:
    """What an adapted loss being traced runs under.

    Attributes:
      state_updates: the NNX adapter's mode for model-state updates (``None``
        outside an NNX loss).
      scans: how many times the adapters' ``scan_layers`` ran in this scope.
    """

    state_updates: str | None = None
    scans: int = 0


_EMPTY = AdapterScope()
_SCOPE: contextvars.ContextVar[AdapterScope | None] = contextvars.ContextVar("zero_jax_adapter_scope", default=None)


def current() -> AdapterScope:
    """The :class:`AdapterScope` of the trace in progress (empty outside one)."""
    return _SCOPE.get() or _EMPTY


@contextlib.contextmanager
def adapter_scope(**changes: Any) -> Iterator[None]:
    """Run a block with the current scope's fields replaced (``scans``
    restarts at 0 unless given)."""
    token = _SCOPE.set(dataclasses.replace(current(), **{"scans": 0, **changes}))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def count_scan() -> None:
    """Record one run of an adapter's ``scan_layers`` in the current scope."""
    _SCOPE.set(dataclasses.replace(current(), scans=current().scans + 1))
