"""``zj.launch``: run a function in P local processes, the way a pod runs it.

Each process is a fresh Python with its own simulated CPU devices, joined by
``jax.distributed.initialize`` through a coordinator on 127.0.0.1 (a free
port): the multi-controller runtime JAX uses on TPU pods and GPU clusters,
on one machine. It is for tests and local runs; on a real cluster the same
training script runs unchanged after ``jax.distributed.initialize()`` (see
the README). The processes are started by ``child``, the one home of the
child-process runner.
"""

from __future__ import annotations

import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from zero_jax._base.units import is_whole_number
from zero_jax._processes.child import child_log, child_result, importable_path, resolve, start_child

_WHERE = "zj.launch"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_member(target: str, args: tuple[Any, ...], pid: int, processes: int, port: int) -> Any:
    """What each launched process runs (inside ``child``): join the pod, call
    the function, leave the pod."""
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=pid, initialization_timeout=120
    )
    result = resolve(target)(*args)
    jax.distributed.shutdown()
    return result


def launch(
    fn: Callable[..., Any],
    *args: Any,
    processes: int = 2,
    local_devices: int = 4,
    timeout_s: float = 300,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``processes`` new processes joined by ``jax.distributed``.

    Each process gets ``local_devices`` simulated CPU devices, so together
    they see ``processes x local_devices`` devices (``jax.devices()``),
    of which each addresses its own. Only the loopback address is used.

    Args:
      fn: a top-level function of an importable module; it runs after
        ``jax.distributed.initialize`` and before anything else touches
        JAX in that process. Its return value must pickle (return NumPy
        arrays or numbers, not ``jax.Array``\\ s).
      args: pickled to every process.
      processes, local_devices: the simulated pod.
      timeout_s: a process still running after this long is killed, and
        so are the others.
      env: extra environment variables for the processes (e.g.
        ``{"XLA_FLAGS": "--xla_backend_optimization_level=0"}`` to compile
        faster in tests).

    Returns:
      ``fn``'s return value in each process, in process order.

    Raises:
      RuntimeError: a process failed; the message carries its error output.
        The others are stopped rather than left waiting in a collective.
    """
    if not is_whole_number(processes) or processes < 1:
        raise ValueError(f"zj.launch: processes must be an int >= 1, got {processes!r}.")
    if not is_whole_number(local_devices) or local_devices < 1:
        raise ValueError(f"zj.launch: local_devices must be an int >= 1, got {local_devices!r}.")
    target = importable_path(fn, _WHERE)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="zero_jax_launch_") as work:
        procs = [
            start_child(
                "zero_jax._processes.launch:run_member",
                (target, tuple(args), pid, processes, port),
                devices=local_devices,
                workdir=work,
                name=str(pid),
                env=env,
            )
            for pid in range(processes)
        ]
        deadline = time.monotonic() + timeout_s
        failed: int | None = None
        try:
            while any(p.poll() is None for p in procs):
                failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                if failed is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failed is None:
            failed = next((i for i, p in enumerate(procs) if p.returncode != 0), None)
        if failed is not None:
            timed_out = procs[failed].returncode in (-9, None) and time.monotonic() > deadline
            raise RuntimeError(
                f"{_WHERE}: process {failed} of {processes} "
                + (f"ran past {timeout_s:.0f} s" if timed_out else f"failed (exit code {procs[failed].returncode})")
                + f"; its output:\n{child_log(work, str(failed))}"
            )
        return [child_result(work, str(pid), where=_WHERE, returncode=0) for pid in range(processes)]
