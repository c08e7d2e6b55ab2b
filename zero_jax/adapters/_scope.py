"""The adapters' own trace-time state, a :class:`~zero_jax._base.scoped.Scoped`
value of their own (the core's, ``zero_jax._layerwise.scope``, carries only
what the layer-wise primitives read).

>>> with adapter_scope(state_updates="discard"):
...     count_scan()
...     current().state_updates, current().scans
('discard', 1)
>>> current().scans
0
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from zero_jax._base.scoped import Scoped


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


_SCOPE: Scoped[AdapterScope] = Scoped("zero_jax_adapter_scope", AdapterScope())


def current() -> AdapterScope:
    """The :class:`AdapterScope` of the trace in progress (empty outside one)."""
    return _SCOPE.current()


def adapter_scope(**changes: Any) -> contextlib.AbstractContextManager[AdapterScope]:
    """Run a block with the current scope's fields replaced (``scans``
    restarts at 0 unless given)."""
    return _SCOPE.replaced(**{"scans": 0, **changes})


def count_scan() -> None:
    """Record one run of an adapter's ``scan_layers`` in the current scope."""
    _SCOPE.update(scans=current().scans + 1)
