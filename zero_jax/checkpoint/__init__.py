"""Checkpoints: sharded save and restore across device counts and stages, and
a streamed safetensors export of the parameters.

A checkpoint is an orbax-checkpoint step directory holding two items:

* ``state``: every array of the :class:`~zero_jax.TrainState` *as stored*
  (partitioned leaves padded to a multiple of the saving N), written by
  orbax/tensorstore: each device's shard is written by its own process, in
  parallel, and a replicated leaf is written once;
* ``zero_jax``: a small JSON record: the logical (unpadded) shape of every
  leaf, the stage, N, the dtypes, the parameter tree's key paths, the
  zero_jax version, and two 32-bit checksums per leaf over its logical
  region (layout-independent, so any target can verify them: orbax itself
  does not notice a flipped bit in the array data).

:func:`restore` takes the *target* policy. It builds the target state's
abstract layout with ``zj.init_state(abstract_params, tx, policy)`` and reads
each leaf straight into its target sharding and stored shape: orbax reads
exactly the region each device needs, cutting the saving N's padding off and
adding the target N's as zeros (``ArrayRestoreArgs(strict=False)``), so a
change of device count, of stage, or both, costs one call and never gathers a
leaf whole on one device. The optax state tree does not depend on the stage
(only its stored shapes do), so leaves are matched by key path; a checkpoint
of another optimizer is an error unless ``optimizer_state="reinit"`` asks for
a fresh optimizer state.

Mixed precision across a restore: the target's ``params`` are read from the
checkpoint's ``params`` when the dtypes agree, otherwise from its float32
``master`` (when it has one); a target ``master`` is read from the
checkpoint's ``master`` or, when the checkpoint has none, built from its
``params``; a checkpoint's ``master`` that the target does not use is dropped.
A float16 loss scale is restored when both sides have one, starts afresh when
only the target has one, and is dropped otherwise.

Saves are atomic: orbax writes a step into a temporary directory and renames
it when every item is complete, so a process killed mid-save leaves the
previous steps restorable; the partial directory is ignored and removed by the
next save. A save that fails removes what it wrote before raising.
:class:`CheckpointManager` keeps the last ``max_to_keep`` steps and saves
asynchronously (the call returns once the arrays are copied off the devices;
training goes on while they are written). Directories and files may
be given relative to the current directory; orbax's own log output is kept
off the terminal (its errors reach you once, as zero_jax's exception).
``CheckpointManager(..., save_on_preemption=True)`` saves at the step
boundary after a SIGTERM, the same step on every process
(:meth:`CheckpointManager.save_if_preempted`). A corrupt step is a
:class:`CorruptCheckpointError`; ``restore(..., fallback=True)`` restores the
newest step before it that reads and verifies.

Modules: ``_record`` (leaf names, step directories, the JSON record and the
checksums), ``_orbax`` (orbax underneath: writer, reader, quiet logs, failed-save
cleanup), ``_restore``, ``_preemption`` (the SIGTERM notice, and the step every
process saves at), ``_manager`` (``CheckpointManager`` and ``save``),
``_safetensors`` (``export_params`` and ``load_params``).

Example:

>>> import tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
>>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
>>> policy = zj.ZeroPolicy(stage=3, mesh=mesh)
>>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
>>> state = zj.init_state({"w": jnp.ones((1000, 3))}, tx, policy)
>>> directory = tempfile.mkdtemp()
>>> zj.save(directory, state, step=0)
>>> small = zj.ZeroPolicy(stage=1, mesh=jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]))
>>> back = zj.restore(directory, policy=small, tx=zj.shard_optimizer(optax.adam(1e-3), small))
>>> back.params["w"].shape, back.opt_state.inner_state[0].mu["w"].sharding.spec
((1000, 3), P('data',))
"""

from zero_jax.checkpoint._manager import CheckpointManager, save
from zero_jax.checkpoint._record import FORMAT, FORMAT_VERSION, CorruptCheckpointError, partial_saves, steps
from zero_jax.checkpoint._restore import restore
from zero_jax.checkpoint._safetensors import EXPORT_BLOCK_BYTES, export_params, load_params

__all__ = [
    "EXPORT_BLOCK_BYTES",
    "FORMAT",
    "FORMAT_VERSION",
    "CheckpointManager",
    "CorruptCheckpointError",
    "export_params",
    "load_params",
    "partial_saves",
    "restore",
    "save",
    "steps",
]
