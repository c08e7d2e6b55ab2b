"""Fresh Python processes with their own simulated CPU devices: the one home
of the child-process runner (``zj.plan`` compiles in one; ``zj.launch`` runs P).

A job is a function named by its import path (``"module:qualname"``) and
picklable arguments. The child restores the parent's ``sys.path``, sizes its
CPU backend to ``devices`` before anything touches JAX, calls the function
and pickles its result (or its error) back.

>>> run_child("math:hypot", 3.0, 4.0, devices=1, where="example")
5.0
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

#: The child's entry point: ``python -c CHILD_ENTRY job.pkl out.pkl devices``.
CHILD_ENTRY = "import sys; from zero_jax._processes.child import child_main; child_main(sys.argv[1:])"
NOT_IMPORTABLE = (
    "{where}: {fn!r} cannot be found by a new process. Pass a function defined at the top level of an "
    "importable module (not a lambda, a closure or a function of a script run by path), or its path as "
    "'module:function'."
)
CHILD_FAILED = "{where}: the child process failed (exit code {code}); its output:\n{log}"
_ERRORS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError}


def importable_path(fn: Callable[..., Any] | str, where: str) -> str:
    """``"module:qualname"`` for a top-level function (a path passes as is)."""
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(f"{where}: a function path is 'module:function', got {fn!r}.")
        return fn
    if not callable(fn):
        raise TypeError(f"{where}: expected a function or a 'module:function' path, got {type(fn).__name__}.")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module == "__main__":  # `python -m package.module` re-imports fine under its real name
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        module = spec.name if spec is not None else None
    if not module or "<" in qualname:
        raise TypeError(NOT_IMPORTABLE.format(where=where, fn=fn))
    return f"{module}:{qualname}"


def resolve(path: str) -> Any:
    """The object a ``"module:qualname"`` path names."""
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: this one, on the CPU backend, without a
    forced device count (the child sizes its own), plus ``extra``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(extra or {})
    return env


def start_child(
    target: str,
    args: Sequence[Any],
    *,
    devices: int,
    workdir: str | Path,
    name: str = "child",
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start one child running ``target(*args)`` on ``devices`` CPU devices.

    It reads ``workdir/name.job``, writes its output to ``workdir/name.log``
    and its result to ``workdir/name.out`` (read it with :func:`child_result`).
    """
    work = Path(workdir)
    job = {"target": target, "args": tuple(args), "sys_path": [p for p in sys.path if p]}
    (work / f"{name}.job").write_bytes(pickle.dumps(job))
    cmd = [sys.executable, "-c", CHILD_ENTRY, str(work / f"{name}.job"), str(work / f"{name}.out"), str(devices)]
    with open(work / f"{name}.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(env))


def child_log(workdir: str | Path, name: str = "child", tail: int = 6000) -> str:
    """The last ``tail`` characters a child printed."""
    path = Path(workdir) / f"{name}.log"
    return path.read_text()[-tail:] if path.exists() else ""


def child_result(workdir: str | Path, name: str, *, where: str, returncode: int | None = None) -> Any:
    """What a finished child returned; its error re-raised here (``ValueError``
    and ``TypeError`` keep their type, anything else is a ``RuntimeError``)."""
    out = Path(workdir) / f"{name}.out"
    if not out.exists():
        raise RuntimeError(CHILD_FAILED.format(where=where, code=returncode, log=child_log(workdir, name)))
    record = pickle.loads(out.read_bytes())
    if "error" in record:
        kind, message = record["error"]
        raise _ERRORS.get(kind, RuntimeError)(f"{where}: {message}")
    return record["result"]


def run_child(
    target: Callable[..., Any] | str,
    *args: Any,
    devices: int,
    where: str,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Run ``target(*args)`` in one fresh process with ``devices`` simulated
    CPU devices and return its (picklable) result.

    Raises ``TimeoutError`` past ``timeout`` seconds (the child is killed),
    the child's ``ValueError``/``TypeError`` as such, anything else as
    ``RuntimeError`` with its output.
    """
    path = importable_path(target, where)
    with tempfile.TemporaryDirectory(prefix="zero_jax_child_") as work:
        proc = start_child(path, args, devices=devices, workdir=work, env=env)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            proc.kill()
            proc.wait()
            raise TimeoutError(f"{where}: the child process ran past timeout={timeout:g} s.") from e
        return child_result(work, "child", where=where, returncode=proc.returncode)


def child_main(argv: Sequence[str]) -> None:
    """The child's side: size the CPU backend, run the job, pickle the result."""
    job_path, out_path, devices = Path(argv[0]), Path(argv[1]), int(argv[2])
    job = pickle.loads(job_path.read_bytes())
    for p in reversed(job["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    jax.config.update("jax_num_cpu_devices", devices)  # before anything starts a backend
    jax.config.update("jax_platforms", "cpu")
    try:
        record: dict[str, Any] = {"result": resolve(job["target"])(*job["args"])}
    except Exception as e:  # reported to the parent, which raises it
        traceback.print_exc()
        record = {"error": (type(e).__name__, str(e))}
    out_path.write_bytes(pickle.dumps(record))
    if "error" in record:
        sys.exit(1)
