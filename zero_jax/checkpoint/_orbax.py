"""orbax-checkpoint underneath: one writer per directory, one reader per
restore, its log records kept off the user's terminal, and no half-written
step left behind by a failed save.

orbax is an optional extra (it needs Python >= 3.11), imported where it is
first used. Every call into it runs inside :func:`quiet`: orbax reports a
failure twice, once as an exception (which zero_jax turns into one message
saying what to do) and once as absl ``ERROR`` records with tracebacks from its
background threads; the second copy is dropped while a zero_jax checkpoint
call (or an unfinished asynchronous save) is in flight.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax

from zero_jax.checkpoint._record import META_ITEM, STATE_ITEM, TMP_MARKER, lookup, nest

if TYPE_CHECKING:
    from etils import epath

NO_ORBAX = (
    "zero_jax checkpoints need orbax-checkpoint (Python >= 3.11) and safetensors: pip install 'zero_jax[checkpoint]'."
)


def ocp() -> Any:
    """The ``orbax.checkpoint`` module, or an ``ImportError`` saying how to install it."""
    try:
        import orbax.checkpoint as orbax_checkpoint  # noqa: PLC0415 - optional (the checkpoint extra)
    except ImportError as e:  # an optional extra: the core needs no orbax (nor Python 3.11)
        raise ImportError(NO_ORBAX) from e
    return orbax_checkpoint


def error_text(e: BaseException) -> str:
    """``"ValueError: <first line>"``: an orbax or tensorstore error in one line of a zero_jax message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# -- orbax's log records ---------------------------------------------------------------------------------------


def _closed_loop_noise(unraisable: Any) -> bool:
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class _QuietOrbax(logging.Filter):
    """While held: drops absl records logged from orbax's (or tensorstore's)
    code, and the "Event loop is closed" unraisable exceptions of a failed
    orbax call (orbax closes its event loop when one operation fails; the
    completion callbacks of the others then raise into the closed loop).

    Held by a count, not per thread: orbax logs from its own threads. Records
    from any other code, and any other unraisable exception, pass on.
    """

    def __init__(self) -> None:
        super().__init__("zero_jax.checkpoint")
        self._lock = threading.Lock()
        self._holders = 0
        self._previous_hook: Any = None

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace("\\", "/")
        return not ("/orbax/" in path or "/tensorstore/" in path)

    def _hook(self, unraisable: Any) -> None:
        previous = self._previous_hook or sys.__unraisablehook__
        if not _closed_loop_noise(unraisable):
            previous(unraisable)

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                logging.getLogger("absl").addFilter(self)
                self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._hook
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                logging.getLogger("absl").removeFilter(self)
                if sys.unraisablehook == self._hook:  # unless someone replaced it since
                    sys.unraisablehook = self._previous_hook
                self._previous_hook = None


_QUIET = _QuietOrbax()


def hold_quiet() -> None:
    """Start dropping orbax's log records (pair with :func:`release_quiet`)."""
    _QUIET.hold()


def release_quiet() -> None:
    _QUIET.release()


#: After a failed orbax call, how long the operations it left in flight get to land (quietly).
SETTLE_SECONDS = 0.5


def settle() -> None:
    """Let the tensorstore operations a failed orbax call left in flight finish
    while the quiet hold is still on (call it holding :func:`quiet`)."""
    time.sleep(SETTLE_SECONDS)
    gc.collect()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Drop orbax's absl log records for the duration (nested holds are counted)."""
    _QUIET.hold()
    try:
        yield
    finally:
        _QUIET.release()


# -- writing ---------------------------------------------------------------------------------------------------


def open_writer(directory: epath.Path, *, max_to_keep: int | None, async_save: bool) -> Any:
    """An orbax ``CheckpointManager`` writing zero_jax steps (a state item and a JSON item) into ``directory``."""
    o = ocp()
    options = o.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True,
    )
    with quiet():
        return o.CheckpointManager(
            directory,
            options=options,
            item_handlers={STATE_ITEM: o.PyTreeCheckpointHandler(), META_ITEM: o.JsonCheckpointHandler()},
        )


def write(manager: Any, step: int, flat: dict[str, jax.Array], meta: dict[str, Any]) -> None:
    """Start writing ``flat`` (checkpoint name -> array) and ``meta`` as ``step`` (async managers return early)."""
    o = ocp()
    args = o.args.Composite(**{STATE_ITEM: o.args.PyTreeSave(nest(flat)), META_ITEM: o.args.JsonSave(meta)})
    with quiet():
        manager.save(step, args=args)


def missing_root(directory: epath.Path) -> epath.Path | None:
    """The outermost of ``directory`` and its parents that does not exist yet (``None``: it exists)."""
    root = None
    path = directory
    while not path.exists():
        root = path
        if path.parent == path:
            break
        path = path.parent
    return root


def discard_partial(directory: epath.Path, step: int, *, created: epath.Path | None) -> None:
    """Remove what a failed save of ``step`` left in ``directory``: its uncommitted
    step directory, and the directories the save created (``created`` and those
    under it down to ``directory``) that are now empty. Process 0 removes (the
    directory is shared)."""
    if jax.process_index() != 0 or not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith(f"{step}.") and TMP_MARKER in p.name:
            p.rmtree()
    path = directory
    while created is not None and path.is_dir() and not any(path.iterdir()):
        path.rmdir()
        if path == created:
            break
        path = path.parent


# -- reading ---------------------------------------------------------------------------------------------------


def read(directory: epath.Path, step: int, passes: list[dict[str, jax.ShapeDtypeStruct]]) -> list[dict[str, Any]]:
    """Read each pass's leaves (checkpoint name -> target shape, dtype and sharding) of ``step``.

    Each leaf is read straight into its target sharding and global shape:
    orbax reads the region each device needs, cutting off the saving run's
    padding and adding zeros where the target's is larger (``strict=False``).
    Errors from orbax and tensorstore propagate as they are.
    """
    o = ocp()
    out = []
    with quiet():
        # The item's handler itself, not a CheckpointManager: orbax's restore ends in a barrier of all
        # processes, which a process whose read failed would skip while the others wait there. zero_jax's
        # restore agrees on the verdict through the coordinator instead (``_restore``).
        handler = o.PyTreeCheckpointHandler()
        try:
            for wanted in passes:
                item = nest({n: jax.ShapeDtypeStruct(s.shape, s.dtype) for n, s in wanted.items()})
                restore_args = nest(
                    {
                        n: o.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype, strict=False)
                        for n, s in wanted.items()
                    }
                )
                state_args = o.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
                tree = handler.restore(directory / str(step) / STATE_ITEM, args=state_args)
                out.append({n: lookup(tree, n) for n in wanted})
        except Exception:
            settle()
            raise
        finally:
            handler.close()
    return out
