"""The preemption notice: has the scheduler asked this run to stop, and at
which step do all processes stop together?

A cloud scheduler reclaims a machine by sending SIGTERM, then SIGKILL after a
grace period (30 s on GKE and SLURM's default, 30 s to a few minutes
elsewhere). A run that saves at the next step boundary and exits within that
period loses nothing. :class:`PreemptionNotice` answers "stop here?" once per
step:

* **one process** (``jax.distributed`` not initialized): a SIGTERM handler
  that only records the signal; the step boundary that follows is the one.
  A second SIGTERM, while the first is still being acted on, gets the
  handler that was there before (by default: the process ends), so a
  scheduler that insists is obeyed.
* **several processes** (``jax.distributed`` initialized): JAX already
  catches SIGTERM there (``jax.distributed.initialize`` starts its
  preemption notifier, which replaces the default action: a process under
  ``jax.distributed`` does *not* die of SIGTERM). The notice is
  ``jax.experimental.multihost_utils.reached_preemption_sync_point``: the
  coordinator collects the step every process has reached when any of them
  is signalled and names the next one; every process sees ``True`` at that
  same step, so they save the same step together (a process that saved
  alone would leave a checkpoint no restore can read).

Opt-in, and why: a signal handler is process-wide state. A library that
installed one on import or by default would override the application's own
(a framework's graceful shutdown, a job runner's, ``jax.distributed``'s
notifier above), and ``signal.signal`` only works from the main thread. So
the handler exists only while a ``CheckpointManager(...,
save_on_preemption=True)`` is open, and the previous one is put back when it
closes.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils

NOT_MAIN_THREAD = (
    "CheckpointManager(save_on_preemption=True): Python installs signal handlers only from the main thread, and "
    "this is thread {thread!r}. Open the manager in the main thread (the loop may run anywhere)."
)
NO_PREEMPTION_SERVICE = (
    "CheckpointManager(save_on_preemption=True): several processes agree on the step to save through JAX's "
    "preemption service, which is off (jax_enable_preemption_service=False). Set "
    "jax.config.update('jax_enable_preemption_service', True) before jax.distributed.initialize()."
)


class PreemptionNotice:
    """Whether the run should save and stop at this step boundary (see the module docstring).

    >>> import os, signal
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> notice = PreemptionNotice()
    >>> notice.reached(), notice.signalled
    (False, False)
    >>> os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal, while the notice is open
    >>> notice.reached(), notice.signalled
    (True, True)
    >>> notice.close()
    >>> signal.getsignal(signal.SIGTERM) == before
    True
    """

    def __init__(self) -> None:
        self.signalled = False  # this process received SIGTERM (one process only; JAX's notifier otherwise)
        self.calls = 0  # step boundaries seen: the same count on every process
        self.distributed = jax.distributed.is_initialized()
        self._previous: Any = None
        self._installed = False
        if self.distributed:
            if not jax.config.jax_enable_preemption_service:  # pyright: ignore[reportAttributeAccessIssue] - a config flag, read at runtime
                raise ValueError(NO_PREEMPTION_SERVICE)
            return
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(NOT_MAIN_THREAD.format(thread=threading.current_thread().name))
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signalled:  # a second SIGTERM: hand it to whoever had it before
            self.close()
            signal.raise_signal(signum)
            return
        self.signalled = True

    def reached(self) -> bool:
        """Call once per step boundary, on every process: ``True`` at the step to save and stop at."""
        self.calls += 1
        if self.distributed:
            return bool(multihost_utils.reached_preemption_sync_point(self.calls))
        return self.signalled

    def close(self) -> None:
        """Put back the SIGTERM handler that was there before (unless someone replaced ours since)."""
        if self._installed:
            self._installed = False
            if signal.getsignal(signal.SIGTERM) == self._handle:
                signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
