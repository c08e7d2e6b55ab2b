"""``zj.launch``: run a function in P local processes, the way a pod runs it.

Each process is a fresh Python with its own simulated CPU devices, joined by
``jax.distributed.initialize`` through a coordinator on 127.0.0.1 (a free
port): the multi-controller runtime JAX uses on TPU pods and GPU clusters,
on one machine. It is for tests and local runs; on a real cluster the same
training script runs unchanged after ``jax.distributed.initialize()`` (see
the README).
"""

from __future__ import annotations

import importlib
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax


def _importable_name(fn: Callable[..., Any]) -> tuple[str, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "__main__":  # `python -m package.module` re-imports fine under its real name
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else None
    if not module or "<" in qualname:
        raise TypeError(
            f"zj.launch: {fn!r} cannot be found by a new process. Pass a function defined at the top level "
            "of an importable module (not a lambda, a closure or a function of a script run by path)."
        )
    return module, qualname


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"zj.launch: processes must be an int >= 1, got {processes!r}.")
    if isinstance(local_devices, bool) or not isinstance(local_devices, int) or local_devices < 1:
        raise ValueError(f"zj.launch: local_devices must be an int >= 1, got {local_devices!r}.")
    module, qualname = _importable_name(fn)
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="zero_jax_launch_") as tmp:
        work = Path(tmp)
        (work / "job.pkl").write_bytes(
            pickle.dumps(
                {"module": module, "qualname": qualname, "args": args, "sys_path": [p for p in sys.path if p]}
            )
        )
        child_env = dict(os.environ)
        child_env.pop("XLA_FLAGS", None)  # each process sizes its own CPU backend
        child_env["JAX_PLATFORMS"] = "cpu"
        child_env.update(env or {})
        procs = []
        for pid in range(processes):
            entry = "import sys; from zero_jax._launch import child_main; child_main(sys.argv[1:])"
            cmd = [sys.executable, "-c", entry, str(work), str(pid), str(processes), str(port), str(local_devices)]
            with open(work / f"{pid}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env))
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
            log = (work / f"{failed}.log").read_text()[-6000:]
            timed_out = procs[failed].returncode in (-9, None) and time.monotonic() > deadline
            raise RuntimeError(
                f"zj.launch: process {failed} of {processes} "
                + (f"ran past {timeout_s:.0f} s" if timed_out else f"failed (exit code {procs[failed].returncode})")
                + f"; its output:\n{log}"
            )
        return [pickle.loads((work / f"{pid}.out").read_bytes()) for pid in range(processes)]


def child_main(argv: Sequence[str]) -> None:
    """What each launched process runs: join the pod, call the function, write its result."""
    work, pid, count, port, local = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3], int(argv[4])
    job = pickle.loads((work / "job.pkl").read_bytes())
    for p in reversed(job["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    jax.config.update("jax_num_cpu_devices", local)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=pid, initialization_timeout=120
    )
    fn: Any = importlib.import_module(job["module"])
    for part in job["qualname"].split("."):
        fn = getattr(fn, part)
    result = fn(*job["args"])
    (work / f"{pid}.out").write_bytes(pickle.dumps(result))
    jax.distributed.shutdown()

