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
import logging
import threading
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
        import orbax.checkpoint as orbax_checkpoint
    except ImportError as e:  # an optional extra: the core needs no orbax (nor Python 3.11)
        raise ImportError(NO_ORBAX) from e
    return orbax_checkpoint


def error_text(e: BaseException) -> str:
    """``"ValueError: <first line>"``: an orbax or tensorstore error in one line of a zero_jax message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


# -- orbax's log records ---------------------------------------------------------------------------------------


class _QuietOrbax(logging.Filter):
    """Drops absl records logged from orbax's (or tensorstore's) code while held.

    Held by a count, not per thread: orbax logs from its own threads. Records
    from any other code pass, so the user's own absl logging is untouched.
    """

    def __init__(self) -> None:
        super().__init__("zero_jax.checkpoint")
        self._lock = threading.Lock()
        self._holders = 0

    def filter(self, record: logging.LogRecord) -> bool:
        path = record.pathname.replace("\\", "/")
        return not ("/orbax/" in path or "/tensorstore/" in path)

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                logging.getLogger("absl").addFilter(self)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                logging.getLogger("absl").removeFilter(self)


_QUIET = _QuietOrbax()


def hold_quiet() -> None:
    """Start dropping orbax's log records (pair with :func:`release_quiet`)."""
    _QUIET.hold()


def release_quiet() -> None:
    _QUIET.release()


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


def discard_partial(directory: epath.Path, step: int, *, created: bool) -> None:
    """Remove what a failed save of ``step`` left in ``directory``: its uncommitted
    step directory, and ``directory`` itself when the save created it and it is
    now empty. Process 0 removes (the directory is shared); others only wait."""
    if jax.process_index() == 0 and directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(f"{step}.") and TMP_MARKER in p.name:
                p.rmtree()
        if created and not any(directory.iterdir()):
            directory.rmdir()


# -- reading ---------------------------------------------------------------------------------------------------


def read(directory: epath.Path, step: int, passes: list[dict[str, jax.ShapeDtypeStruct]]) -> list[dict[str, Any]]:
    """Read each pass's leaves (checkpoint name -> target shape, dtype and sharding) of ``step``.

    Each leaf is read straight into its target sharding and global shape:
    orbax reads the region each device needs, cutting off the saving run's
    padding and adding zeros where the target's is larger (``strict=False``).
    Errors from orbax and tensorstore propagate as they are.
    """
    o = ocp()
    options = o.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    out = []
    with quiet():
        manager = o.CheckpointManager(
            directory, options=options, item_handlers={STATE_ITEM: o.PyTreeCheckpointHandler()}
        )
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
                tree = manager.restore(step, args=o.args.Composite(**{STATE_ITEM: state_args}))[STATE_ITEM]
                out.append({n: lookup(tree, n) for n in wanted})
        finally:
            manager.close()
    return out
