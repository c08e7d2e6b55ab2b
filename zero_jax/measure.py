"""Measure any compiled JAX program: what it holds on each device and what it
sends, read from the program itself. ``zj.audit`` judges a zero_jax step with
these; they work on any ``jax.jit`` function too (a GSPMD baseline, a plain
data-parallel step).

* :func:`resident_bytes` / :func:`resident_bytes_by_kind`: bytes each device
  holds for a pytree of arrays (per memory kind).
* :func:`memory`: ``compiled.memory_analysis()`` with the peak estimate
  argument + output + temp − alias (XLA:CPU's ``peak_memory_in_bytes`` omits temp).
* :func:`collectives`: every collective of the program right after SPMD
  partitioning (where dtypes are still the logical ones), with its per-device
  ring traffic, multiplied by the trip count of the loop it sits in;
  :func:`ring_bytes`, :func:`ring_bytes_per_axis` and :func:`summarize` add
  them up.
* :func:`compile_with_hlo`: one compile that also returns the post-SPMD HLO;
  :func:`compile_with_dump` also the allocated device memory and XLA's live
  peak.
* :func:`live_peak` / :func:`live_peak_from_dump`: XLA's live peak
  (:class:`LivePeak`: the bytes of the values alive at once at the busiest
  point of the schedule, ``HloLiveRange``, and the buffers alive there) from
  the ``*live-range.txt`` report of an ``xla_dump_to`` folder; beside the
  allocated memory it shows fragmentation (``zj.audit``'s
  ``report.fragmentation``); :func:`hbm_bytes_from_dump`: the device memory
  the buffer assignment allocates, from the same folder (a program compiled
  elsewhere, e.g. a peer's own tool run with ``XLA_FLAGS=--xla_dump_to=DIR``,
  is read like a zero_jax step).
* :func:`layers_alive` / :func:`scheduled_computations`: the schedule of a
  compiled program.
* :func:`read_compiled`: the compiled program's collectives however the
  backend spells them (:class:`CompiledCollective`: TPU's async pairs and
  continuation fusions, a reduce-scatter done as all-reduce + dynamic-slice),
  each with the compute scheduled while it is in flight.
* :func:`trying_schedule`: build and trace steps with some of the layer-wise
  schedule's compiler tricks switched (``zero_jax._layerwise.schedule``), to
  measure what each buys; :func:`schedule_for`: the switches a policy's steps
  get on its backend and compiler version.
* :func:`step_estimate`: a step's time as XLA:GPU's latency-hiding scheduler
  estimates it, compiled for GPU hosts here without a GPU (:class:`StepEstimate`:
  makespan with each loop body times its runs per step, exposed communication,
  MFU from the model FLOPs given); :func:`estimate_from_schedule` reads a dumped
  ``*.schedule.txt`` (``zero_jax.models.model_flops``: the reference
  transformer's model FLOPs per step). An *estimate*: see :data:`ESTIMATE_LEAVES_OUT`. TPU programs
  get none.
* :func:`compiler_version`: which compiler (package and version) compiles for
  a backend here; :func:`parse_version`: a version string as a tuple;
  :func:`read_only_options`: the options a program compiled only to be read
  (its HLO, its memory) is built with here, each one the compiler accepts.

>>> import jax, jax.numpy as jnp
>>> from zero_jax import measure
>>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
>>> f = jax.jit(lambda x: jnp.sum(x), in_shardings=jax.NamedSharding(mesh, jax.P("data")))
>>> [c.kind for c in measure.collectives(f, jnp.ones(jax.device_count() * 4))]
['all-reduce']
"""

from zero_jax._audit.compiled import CompiledCollective, read_compiled, scheduled_computations
from zero_jax._audit.estimate import LEAVES_OUT as ESTIMATE_LEAVES_OUT
from zero_jax._audit.estimate import PEAK_BF16, LoopTime, StepEstimate, estimate_from_schedule, step_estimate
from zero_jax._audit.hlo import (
    FAST_COMPILE,
    Collective,
    collectives,
    compile_with_dump,
    compile_with_hlo,
    loop_nesting,
    parse_collectives,
    partitioned_hlo,
    ring_bytes,
    ring_bytes_per_axis,
    ring_bytes_per_axis_kind,
    summarize,
)
from zero_jax._audit.memory import (
    LIVE_RANGE_GLOB,
    LivePeak,
    hbm_bytes_from_dump,
    live_peak,
    live_peak_from_dump,
    memory,
    resident_bytes,
    resident_bytes_by_kind,
)
from zero_jax._audit.schedule import layers_alive
from zero_jax._base.toolchain import compiler_version, parse_version
from zero_jax._layerwise.schedule import read_only_options, schedule_for
from zero_jax._layerwise.schedule import trying as trying_schedule

__all__ = [
    "ESTIMATE_LEAVES_OUT",
    "FAST_COMPILE",
    "PEAK_BF16",
    "LoopTime",
    "StepEstimate",
    "estimate_from_schedule",
    "step_estimate",
    "LIVE_RANGE_GLOB",
    "Collective",
    "CompiledCollective",
    "LivePeak",
    "collectives",
    "compile_with_dump",
    "compile_with_hlo",
    "compiler_version",
    "hbm_bytes_from_dump",
    "layers_alive",
    "live_peak",
    "live_peak_from_dump",
    "loop_nesting",
    "memory",
    "parse_collectives",
    "parse_version",
    "partitioned_hlo",
    "read_compiled",
    "read_only_options",
    "resident_bytes",
    "resident_bytes_by_kind",
    "ring_bytes",
    "ring_bytes_per_axis",
    "ring_bytes_per_axis_kind",
    "schedule_for",
    "scheduled_computations",
    "summarize",
    "trying_schedule",
]
