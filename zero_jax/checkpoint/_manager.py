"""Saving: :class:`CheckpointManager` (keep the last K steps, save in the
background, and, when asked, save at the step boundary after a SIGTERM) and
:func:`save` (one step, committed before it returns).

Saves are atomic: orbax writes a step into a temporary sibling directory and
renames it when every item is complete, so a process killed mid-save leaves
the previous steps restorable (the partial directory is ignored, and removed
by the next save). A save that *fails* (a full disk, a write error) removes
its partial directory itself, and the directory it created when it held
nothing else, before raising one error: the next restore finds exactly the
steps that were there before.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from typing import Any

import jax
import numpy as np

from zero_jax._base.tree import PyTree, check_live
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._step.optimizer import ShardedTransformation
from zero_jax._step.state import TrainState
from zero_jax.checkpoint._orbax import (
    discard_partial,
    error_text,
    hold_quiet,
    missing_root,
    open_writer,
    quiet,
    release_quiet,
    settle,
    write,
)
from zero_jax.checkpoint._preemption import PreemptionNotice
from zero_jax.checkpoint._record import build_metadata, checksums, committed_steps, resolve, state_entries
from zero_jax.checkpoint._restore import restore

NOT_A_TRAIN_STATE = (
    "{where}: expected a zero_jax TrainState, got {got}. Save the state that zj.init_state / train_step returned."
)
PRNG_KEY_LEAVES = (
    "{where}: {count} leaf/leaves of the state are typed PRNG key arrays, which a checkpoint cannot hold: leaf "
    "'{first}' is a typed PRNG key array (all: {names}). Keep keys out of the model state (or store "
    "jax.random.key_data(key) in it)."
)
LEAVES_NOT_LAYOUTS = "{where}: the state's leaves do not match its layouts; is this a zero_jax state?"
BAD_MAX_TO_KEEP = "CheckpointManager: max_to_keep must be >= 1 or None, got {got!r}."
BAD_STEP = (
    "{where}: step must be a non-negative int (the training step the checkpoint is named by), got {got}. Pass "
    "step=int(state.step), or leave step out to use state.step."
)
STEP_EXISTS = "{where}: step {step} already exists in {directory}. Save under another step, or delete {path} first."
NOT_OPTED_IN = (
    "CheckpointManager.save_if_preempted: this manager does not watch for preemption. Open it with "
    "zj.CheckpointManager(directory, save_on_preemption=True)."
)
SAVE_FAILED = (
    "{where}: checkpoint step {step} could not be written to {directory} ({error}). Nothing of it was kept: the "
    "directory holds the steps it held before ({present}). Check the disk (space, permissions) and save again."
)


def _prepare(state: Any, step: int | None, where: str) -> tuple[int, dict[str, jax.Array], dict[str, Any]]:
    """Check ``state`` and name its arrays: (step, checkpoint name -> array, the JSON record)."""
    if not isinstance(state, TrainState):
        raise TypeError(NOT_A_TRAIN_STATE.format(where=where, got=type(state).__name__))
    check_live(state, where=where)
    step = int(jax.device_get(state.step)) if step is None else _checked_step(step, where)
    entries = state_entries(state)
    arrays = jax.tree.leaves(state)
    if len(arrays) != len(entries):
        raise ValueError(LEAVES_NOT_LAYOUTS.format(where=where))
    keys = [e.name for e, x in zip(entries, arrays, strict=True) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]  # pyright: ignore[reportPrivateImportUsage] - public at runtime, not re-exported in the stubs
    if keys:
        raise TypeError(PRNG_KEY_LEAVES.format(where=where, count=len(keys), first=keys[0], names=", ".join(keys)))
    meta = build_metadata(state, entries, step, checksums(arrays, [e.shape for e in entries]))
    return step, {e.name: x for e, x in zip(entries, arrays, strict=True)}, meta


def _checked_step(step: Any, where: str) -> int:
    """``step`` as an int: an integer >= 0 (numpy integers and 0-d int arrays too), not a bool."""
    value = step
    if isinstance(step, (jax.Array, np.ndarray)) and step.shape == () and np.issubdtype(step.dtype, np.integer):
        value = int(step)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(BAD_STEP.format(where=where, got=f"{type(step).__name__} {step!r}"))
    return int(value)


class _Writer:
    """One directory's orbax writer: one save in flight at a time, and a failed
    save cleaned up and raised as one error (see the module docstring).

    ``max_to_keep`` is applied here, after each save commits, to the steps the
    directory holds (not orbax's own in-memory list of the steps this writer
    saved): two managers saving into one directory in turn keep the newest
    ``max_to_keep`` steps of the directory, whoever wrote them."""

    def __init__(self, directory: Any, *, max_to_keep: int | None, async_save: bool) -> None:
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self.manager: Any = None
        self.created: Any = None  # the outermost directory this writer's first save created
        self.pending: int | None = None  # the step of a save still being written (holds the log filter)

    def commit(self, step: int, flat: dict[str, jax.Array], meta: dict[str, Any], *, where: str) -> None:
        """Write ``step`` (returns early when asynchronous)."""
        self.finish(where)  # one save in flight at a time (as orbax); raises a failed earlier one
        if step in committed_steps(self.directory):
            path = self.directory / str(step)
            raise FileExistsError(STEP_EXISTS.format(where=where, step=step, directory=self.directory, path=path))
        hold_quiet()
        self.pending = step
        try:
            if self.manager is None:
                self.created = missing_root(self.directory)
                self.manager = open_writer(self.directory, max_to_keep=None, async_save=self.async_save)
            write(self.manager, step, flat, meta)
        except Exception as e:
            self._failed(e, where)
        if not self.async_save:
            self.finish(where)

    def finish(self, where: str) -> None:
        """Wait for the save in flight (if any); on failure clean up and raise."""
        if self.pending is None:
            return
        try:
            with quiet():
                self.manager.wait_until_finished()
        except Exception as e:
            self._failed(e, where)
        self.pending = None
        release_quiet()
        self._prune()

    def _prune(self) -> None:
        """Delete the oldest committed steps of the directory beyond ``max_to_keep`` (process 0 deletes)."""
        if self.max_to_keep is None or jax.process_index() != 0:
            return
        present = committed_steps(self.directory)
        for step in present[: max(len(present) - self.max_to_keep, 0)]:
            (self.directory / str(step)).rmtree()

    def close(self, where: str) -> None:
        """Finish, then release orbax's threads (also when finishing raised)."""
        try:
            self.finish(where)
        finally:
            if self.manager is not None:
                with quiet():
                    self.manager.close()
                self.manager = None

    def _failed(self, error: Exception, where: str) -> None:
        """Remove what the failed save of ``self.pending`` left, drop the orbax manager, raise one error."""
        step, manager = self.pending, self.manager
        self.pending, self.manager = None, None
        try:
            with quiet():
                if manager is not None:
                    with contextlib.suppress(Exception):  # the save's own error is the one to report
                        manager.close()
                settle()
                discard_partial(self.directory, step, created=self.created)  # type: ignore[arg-type]
        finally:
            release_quiet()
        present = committed_steps(self.directory)
        text = error_text(error)
        message = SAVE_FAILED.format(where=where, step=step, directory=self.directory, error=text, present=present)
        raise (OSError if isinstance(error, OSError) else RuntimeError)(message) from error


class CheckpointManager:
    """Saves and restores :class:`~zero_jax.TrainState` checkpoints in one directory.

    Args:
      directory: where the step directories go (created on the first save);
        a relative path is resolved against the current directory now.
      max_to_keep: keep the last this many steps (``None``: keep all).
      async_save: ``save`` returns once the arrays are copied off the
        devices and writes them in the background (call :meth:`wait`, or
        :meth:`close`, before relying on the files; a background failure is
        raised there, or by the next ``save``). The state may be donated to
        the next train step as soon as ``save`` returns.

      save_on_preemption: watch for the scheduler's SIGTERM while the
        manager is open: :meth:`save_if_preempted`, called once per step,
        saves at the step boundary after it (the same step on every
        process) and returns ``True``, the loop's cue to stop. Opt-in: it
        installs a SIGTERM handler (one process; the previous one is put
        back on :meth:`close`), process-wide state a library should not
        take unasked; under ``jax.distributed`` it uses JAX's own notifier
        instead (see ``zero_jax/checkpoint/_preemption.py``).

    Use it as a context manager (``with zj.CheckpointManager(d) as mgr:``) or
    call :meth:`close`. Partial saves left by a killed process are removed
    when the manager opens the directory.

    >>> import tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> policy = zj.ZeroPolicy(stage=2, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> state = zj.init_state({"w": jnp.ones((64, 32))}, tx, policy)
    >>> with zj.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mgr:
    ...     for step in range(3):
    ...         mgr.save(state, step=step)
    ...     mgr.wait()
    ...     mgr.all_steps()
    [1, 2]

    Saving on preemption: a SIGTERM (here sent to itself) is acted on at the
    next step boundary, and the step is committed before the loop stops.

    >>> import os, signal
    >>> with zj.CheckpointManager(tempfile.mkdtemp(), save_on_preemption=True) as mgr:
    ...     for step in range(100):
    ...         state = state.replace(step=state.step + 1)  # a train step
    ...         if step == 4:
    ...             os.kill(os.getpid(), signal.SIGTERM)  # what the scheduler sends
    ...         if mgr.save_if_preempted(state):
    ...             break
    ...     mgr.all_steps()
    [5]
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        save_on_preemption: bool = False,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, numbers.Integral) or max_to_keep < 1):
            raise ValueError(BAD_MAX_TO_KEEP.format(got=max_to_keep))
        self.directory = resolve(directory)
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self._writer = _Writer(self.directory, max_to_keep=max_to_keep, async_save=async_save)
        self._notice = PreemptionNotice() if save_on_preemption else None

    def save(self, state: TrainState, *, step: int | None = None) -> None:
        """Save ``state`` as ``step`` (default: ``state.step``).

        Each process writes the shards its devices hold; the step appears
        in :meth:`all_steps` only once it is complete (atomic rename). A
        state consumed by a train step (donated) is refused with a
        ``ValueError``.
        """
        where = "CheckpointManager.save"
        self._writer.commit(*_prepare(state, step, where), where=where)

    def save_if_preempted(self, state: TrainState, *, step: int | None = None) -> bool:
        """Call once per training step, on every process: ``True`` once ``state`` is
        saved (and committed) because the run is being preempted; ``False`` otherwise.

        After a SIGTERM (on any process) the step boundary where every
        process stands at the same step saves ``state`` as ``step``
        (default ``state.step``), waits for it, including any asynchronous
        save still in flight, and returns ``True``: leave the loop and
        exit before the scheduler's SIGKILL. A step already saved is not
        saved again. Otherwise it costs a flag check (one process) or a
        local query of JAX's preemption service (several), no device
        sync.
        """
        where = "CheckpointManager.save_if_preempted"
        if self._notice is None:
            raise ValueError(NOT_OPTED_IN)
        if not self._notice.reached():
            return False
        prepared = _prepare(state, step, where)
        self._writer.finish(where)
        if prepared[0] not in committed_steps(self.directory):
            self._writer.commit(*prepared, where=where)
        self._writer.finish(where)
        return True

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed (raises if one failed)."""
        self._writer.finish("CheckpointManager.wait")

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first."""
        self.wait()
        return committed_steps(self.directory)

    def latest_step(self) -> int | None:
        present = self.all_steps()
        return present[-1] if present else None

    def restore(
        self,
        *,
        policy: ZeroPolicy,
        tx: ShardedTransformation,
        step: int | None = None,
        like: PyTree | TrainState | None = None,
        verify: bool = True,
        model_state: PyTree = None,
        optimizer_state: str = "restore",
        fallback: bool = False,
    ) -> TrainState:
        """:func:`~zero_jax.restore` from this manager's directory (waits for pending saves)."""
        self.wait()
        return restore(
            self.directory,
            policy=policy,
            tx=tx,
            step=step,
            like=like,
            verify=verify,
            model_state=model_state,
            optimizer_state=optimizer_state,
            fallback=fallback,
        )

    def close(self) -> None:
        """Wait for pending saves and release the manager's threads (raises if a save failed);
        put back the SIGTERM handler that was there before ``save_on_preemption``."""
        try:
            self._writer.close("CheckpointManager.close")
        finally:
            if self._notice is not None:
                self._notice.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    step: int | None = None,
    max_to_keep: int | None = None,
) -> None:
    """Save ``state`` as checkpoint ``step`` (default ``state.step``) in ``directory``; returns once committed.

    Every process must call it (each writes its devices' shards). A relative
    ``directory`` is resolved against the current directory now. With
    ``max_to_keep`` only the newest that many steps are kept. For saves that
    overlap training use :class:`CheckpointManager` (``async_save=True``).
    A state consumed by a train step (donated) is refused with a
    ``ValueError``: save the state the step returned.
    """
    where = "zj.save"
    prepared = _prepare(state, step, where)
    writer = _Writer(resolve(directory), max_to_keep=max_to_keep, async_save=False)
    try:
        writer.commit(*prepared, where=where)
    finally:
        writer.close(where)
