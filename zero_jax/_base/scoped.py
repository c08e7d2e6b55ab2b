"""A frozen value set for the duration of a ``with`` block: trace-time context
without module-level state. Each owner keeps one (the layer-wise trace scope,
the adapters' scope); nested and concurrent traces in other threads each see
their own, since the value lives in a ``ContextVar``.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Mode:
...     name: str = "plain"
>>> mode = Scoped("example_mode", Mode())
>>> with mode.replaced(name="fancy") as inside:
...     inside.name, mode.current().name
('fancy', 'fancy')
>>> mode.current().name
'plain'
>>> mode.update(name="leaked")  # outside every block: nothing to update
>>> mode.current().name
'plain'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Scoped(Generic[T]):
    """One frozen dataclass value per context: ``current()``, and
    ``replaced(**changes)`` for a block."""

    def __init__(self, name: str, empty: T) -> None:
        self.empty = empty
        self.var: contextvars.ContextVar[T | None] = contextvars.ContextVar(name, default=None)

    def current(self) -> T:
        """The value set by the innermost enclosing ``replaced`` (``empty`` outside one)."""
        value = self.var.get()
        return self.empty if value is None else value

    @contextlib.contextmanager
    def replaced(self, **changes: Any) -> Iterator[T]:
        """Run a block with the current value's fields replaced."""
        value = dataclasses.replace(self.current(), **changes)  # type: ignore[type-var]
        token = self.var.set(value)
        try:
            yield value
        finally:
            self.var.reset(token)

    def update(self, **changes: Any) -> None:
        """Replace fields of the current value until the enclosing block ends.

        Outside every block there is nothing to update: the call does nothing,
        so ``empty`` stays what ``current()`` returns there (a value set at the
        top level would outlive every block and leak into later traces).
        """
        if self.var.get() is None:
            return
        self.var.set(dataclasses.replace(self.current(), **changes))  # type: ignore[type-var]
