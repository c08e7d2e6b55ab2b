"""What the benchmarks share, over the public API only (``zero_jax``, ``zero_jax.measure``): the
process set-up, compiling a program once and reading it, taking turns to time steps, the GSPMD
recipe, and the record every result file starts with.

A benchmark imports this module first and calls :func:`setup` before anything touches a device::

    import _common as common  # noqa: I001

    common.setup(devices=8, hlo_dump=True)

    import argparse  # noqa: E402
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import zero_jax as zj
from zero_jax import measure

PyTree = Any
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")

# -- the process ------------------------------------------------------------------------------------


def setup(devices: int | None = 8, *, hlo_dump: bool = False) -> None:
    """Set the process up; call it before anything touches a device.

    ``devices``: that many simulated CPU devices (``None``: the installed backend as it is).
    ``hlo_dump``: every compilation of the process dumps its HLO right after SPMD partitioning,
    and XLA's live-range report, into one temporary folder removed at exit (what
    :func:`compile_once` reads). The flags are set for the whole process (not as per-call compiler
    options) so that ``lower(...).compile()`` and the jit-dispatched call compile with the same
    options: the step then reuses the executable instead of compiling a second time. XLA reads
    ``XLA_FLAGS`` when its backend starts, the moment by which ``jax_num_cpu_devices`` must be set
    too (jax raises if it is later), so the flags are set first.
    """
    if hlo_dump:
        folder = tempfile.mkdtemp(prefix="zero-jax-hlo-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={folder} --xla_dump_hlo_pass_re=spmd-partitioning"
        )
    if devices is not None:
        jax.config.update("jax_num_cpu_devices", devices)
        jax.config.update("jax_platforms", "cpu")


# -- compiling and reading a program ------------------------------------------------------------------

NO_DUMP = "no HLO dump folder in XLA_FLAGS: call _common.setup(..., hlo_dump=True) before anything touches a device"


class Compiled(NamedTuple):
    """One compilation: the executable, its HLO right after SPMD partitioning (what
    ``measure.parse_collectives`` reads) and XLA's live peak, the bytes of the values alive at once
    at the busiest point of the schedule (``HloLiveRange``), before the heap packs them into buffers."""

    executable: Any
    spmd_hlo: str
    live_peak: int


def compile_once(lowerable: Any, *args: Any) -> Compiled:
    """Compile ``lowerable(*args)`` with the process's options and read what this compilation dumped
    (then delete it); needs :func:`setup` with ``hlo_dump=True``. Without the dump,
    ``measure.compile_with_hlo`` gives the executable and the post-SPMD HLO through per-call options."""
    found = re.findall(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
    if not found:
        raise RuntimeError(NO_DUMP)
    pattern = os.path.join(found[-1], "*after_spmd-partitioning*")
    ranges = os.path.join(found[-1], measure.LIVE_RANGE_GLOB)
    before = set(glob.glob(pattern)) | set(glob.glob(ranges))
    executable = lowerable.lower(*args).compile()
    new = sorted(set(glob.glob(pattern)) - before)
    new_ranges = sorted(set(glob.glob(ranges)) - before)
    if not new or not new_ranges:
        raise RuntimeError("XLA wrote no post-SPMD-partitioning or live-range dump")
    with open(new[-1]) as f:
        hlo = f.read()
    with open(new_ranges[-1]) as f:
        peak = measure.live_peak(f.read())
    if peak is None:
        raise RuntimeError(f"no peak-usage line in {new_ranges[-1]}")
    for path in new + new_ranges:
        os.remove(path)
    return Compiled(executable, hlo, peak.bytes)


def memory(compiled: Any) -> dict[str, int]:
    """``measure.memory`` (device argument, output, temp, alias and peak = argument + output + temp -
    alias) and the host figures of ``memory_analysis()`` alike (``host_peak``; 0 on XLA:CPU)."""
    out = measure.memory(compiled)
    m = compiled.memory_analysis()
    host = {k: int(getattr(m, f"host_{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias")}
    out |= {f"host_{k}": v for k, v in host.items()}
    out["host_peak"] = host["argument"] + host["output"] + host["temp"] - host["alias"]
    return out


def kind_counts(colls: Iterable[measure.Collective]) -> dict[str, int]:
    """How many collectives of each kind run per step (loop trip counts included)."""
    return {k: int(v["count"]) for k, v in measure.summarize(colls).items()}


def offload_chunks(abstract: zj.TrainState) -> dict[str, int]:
    """The chunks the streamed update moves the offloaded state in, with their bytes per device: one
    per parameter whose master copy or optimizer moments live in host memory (keyed by the
    parameter's path). Adam updates each parameter from its own leaves only, so a parameter's
    offloaded master, ``mu`` and ``nu`` are one chunk and no two parameters share one."""
    per: dict[str, int] = {}
    for leaf in zj.offload_plan(abstract).leaves:
        if leaf.host and not leaf.path.startswith("params/"):
            key = re.sub(r"^(master/|opt_state/.*?/(mu|nu)/)", "", leaf.path)
            per[key] = per.get(key, 0) + leaf.nbytes
    return per


# -- taking turns ---------------------------------------------------------------------------------------


def stepper(train_step: Callable[[PyTree, PyTree], tuple[PyTree, dict[str, Any]]], state: PyTree,
            batch: PyTree) -> Callable[[], jax.Array]:  # fmt: skip
    """A zero-argument step: each call trains one step from the state the last call left (the step
    donates it) and returns the loss. Dropping the function drops the state."""
    holder = {"state": state}

    def step() -> jax.Array:
        holder["state"], metrics = train_step(holder["state"], batch)
        return metrics["loss"]

    return step


def time_round_robin(runs: Sequence[Any], rounds: int, warmup: int = 0) -> None:
    """Warm each run up (``warmup`` untimed steps), then one step of each per round, so load from
    elsewhere hits all of them alike. A run has ``step()`` (one training step, returning its loss),
    ``times`` (each timed step's seconds are appended) and ``final_loss`` (the last timed step's loss)."""
    for r in runs:
        for _ in range(warmup):
            jax.block_until_ready(r.step())
    for _ in range(rounds):
        for r in runs:
            t0 = time.perf_counter()
            loss = jax.block_until_ready(r.step())
            r.times.append(time.perf_counter() - t0)
            r.final_loss = float(loss)


# -- the GSPMD recipe -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The GSPMD recipe's step: ``jitted(params, opt_state, batch) -> (params, opt_state, metrics)``,
    the state donated; called as ``recipe((params, opt_state), batch)`` like a zero_jax step."""

    jitted: Any
    opt_sharding: PyTree
    batch_sharding: NamedSharding

    def __call__(self, state: tuple[PyTree, PyTree], batch: PyTree) -> tuple[tuple[PyTree, PyTree], Any]:
        params, opt_state, metrics = self.jitted(*state, batch)
        return (params, opt_state), metrics


def gspmd_recipe(loss_fn: Callable[[PyTree, PyTree], jax.Array], tx: optax.GradientTransformation, mesh: Mesh,
                 params: PyTree, param_sharding: PyTree, opt_leaf_sharding: PyTree,
                 grad_sharding: PyTree | None = None) -> Recipe:  # fmt: skip
    """What users write by hand today: plain ``tx`` inside ``jax.jit``, whose ``in_shardings`` and
    ``out_shardings`` place the parameters (``param_sharding``) and the optimizer state (the leaves
    that mirror a parameter as ``opt_leaf_sharding``, the rest replicated), the batch sharded on
    "data", and ``jit`` choosing the collectives; ``grad_sharding``: a sharding constraint on the
    gradients. ``params``: the parameters, or their shapes."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_sharding = optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, abstract_opt, opt_leaf_sharding, transform_non_params=lambda _: replicated
    )
    batch_sharding = NamedSharding(mesh, PartitionSpec("data"))

    def step(p: PyTree, o: PyTree, b: PyTree) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
        loss, grads = jax.value_and_grad(loss_fn)(p, b)
        if grad_sharding is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_sharding)
        updates, o = tx.update(grads, o, p)
        # The library's step reports the global gradient norm too: same work on both sides.
        return optax.apply_updates(p, updates), o, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    jitted = jax.jit(
        step,
        in_shardings=(param_sharding, opt_sharding, batch_sharding),
        out_shardings=(param_sharding, opt_sharding, replicated),
        donate_argnums=(0, 1),
    )
    return Recipe(jitted, opt_sharding, batch_sharding)


# -- the record -------------------------------------------------------------------------------------------


def command() -> str:
    """The command that made this result, the script named from the repository root."""
    return shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT), *sys.argv[1:]])


def library_source() -> str:
    """Where zero_jax was imported from, and its commit when that is a git work tree."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(zj.__file__)))

    def git(*cmd: str) -> str:  # --no-optional-locks: reading never rewrites the index
        done = subprocess.run(["git", "--no-optional-locks", "-C", root, *cmd], capture_output=True, text=True,
                              check=True)  # fmt: skip
        return done.stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "zero_jax")
    except (OSError, subprocess.CalledProcessError):
        return root
    return f"{root} at {commit}" + (" with uncommitted changes in zero_jax/" if dirty else "")


def machine() -> str:
    return f"{platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Record:
    """How a result was made: the command, the date, the versions, where zero_jax came from, the
    machine and its load average before and after. Make one when the run starts."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.load_before = os.getloadavg()[0]

    def wall_s(self) -> float:
        return time.perf_counter() - self.started

    def header(self, title: str, *lines: str, versions: str = "") -> str:
        """``title``, the record, then ``lines`` (devices, model, timing) and the wall time so far;
        ``versions``: more packages for the versions line."""
        return "\n".join([
            title,
            f"command: {command()}",
            f"date: {utc_now()}",
            f"jax {jax.__version__}, optax {optax.__version__}, numpy {np.__version__}, zero_jax {zj.__version__}"
            + (f", {versions}" if versions else ""),
            f"zero_jax from {library_source()}",
            f"machine: {machine()}, load average before {self.load_before:.2f}, after {os.getloadavg()[0]:.2f}",
            *lines,
            f"wall time: {self.wall_s():.0f} s",
        ])  # fmt: skip

    def meta(self) -> dict[str, Any]:
        """The record as the JSON files' ``meta``."""
        return {
            "command": command(),
            "date": utc_now(),
            "jax": jax.__version__,
            "optax": optax.__version__,
            "numpy": np.__version__,
            "zero_jax_version": zj.__version__,
            "zero_jax": library_source(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": self.load_before,
            "load_average_after": os.getloadavg()[0],
            "wall_s": self.wall_s(),
        }


def write_results(name: str, text: str, data: Any = None, out: str = RESULTS) -> None:
    """``text`` to ``<out>/<name>.txt`` and ``data``, when given, as JSON to ``<out>/<name>.json``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.txt"), "w") as f:
        f.write(text + "\n")
    if data is not None:
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(data, f, indent=1, default=str)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (figures go to files only)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def save_figure(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def cell(rows: Iterable[dict[str, Any]], variant: str, depth: int) -> dict[str, Any]:
    """The row of one variant at one depth."""
    return next(r for r in rows if r["variant"] == variant and r["depth"] == depth)
