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
(only its stored shapes do), so leaves are matched by key path.

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
next save. :class:`CheckpointManager` keeps the last ``max_to_keep`` steps and
saves asynchronously (the call returns once the arrays are copied off the
devices; training goes on while they are written).

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

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._optimizer import ShardedTransformation
from zero_jax._partition import LeafLayout, is_layout
from zero_jax._policy import ZeroPolicy
from zero_jax._precision import LossScaleState
from zero_jax._train import TrainState, init_state
from zero_jax._tree import PyTree, key_name

if TYPE_CHECKING:
    from etils import epath

__all__ = [
    "CheckpointManager",
    "export_params",
    "load_params",
    "restore",
    "save",
    "steps",
]

FORMAT = "zero_jax.checkpoint"
FORMAT_VERSION = 1
_STATE_ITEM = "state"
_META_ITEM = "zero_jax"
_TMP_MARKER = ".orbax-checkpoint-tmp"
_SECTIONS = ("step", "params", "opt_state", "master", "loss_scale", "model_state")



def _version() -> str:
    from zero_jax import __version__

    return __version__


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # an optional extra: the core needs no orbax (nor Python 3.11)
        raise ImportError(
            "zero_jax checkpoints need orbax-checkpoint (Python >= 3.11) and safetensors: "
            "pip install 'zero_jax[checkpoint]'."
        ) from e
    return ocp


# -- names ---------------------------------------------------------------------------


def _escape(name: str) -> str:
    """A key name safe as one level of a checkpoint path (no ``/``)."""
    return name.replace("%", "%25").replace("/", "%2F")


def _key_json(key: Any) -> list[Any]:
    """One key-path entry as JSON, so a parameter tree can be rebuilt."""
    if isinstance(key, jax.tree_util.DictKey):
        return ["dict", key.key if isinstance(key.key, (str, int)) else str(key.key)]
    if isinstance(key, jax.tree_util.SequenceKey):
        return ["index", key.idx]
    return ["other", key_name(key)]


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One array of a train state: its checkpoint name, logical shape, dtype."""

    name: str  # "params/layers/attn_qkv", "opt_state/0/mu/w", "step"
    shape: tuple[int, ...]  # logical (unpadded)
    stored_shape: tuple[int, ...]  # as it lives between steps under its policy
    dtype: np.dtype
    sharding: Any = None


def _entries(state: TrainState) -> list[_Entry]:
    """Every array of ``state`` (concrete or abstract), in ``jax.tree.leaves`` order."""
    out: list[_Entry] = []

    def add(section: str, tree: PyTree, layouts: Sequence[LeafLayout] | None) -> None:
        pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
        if layouts is not None and len(layouts) != len(pairs):
            raise ValueError(f"zero_jax checkpoint: {section} does not match its layouts; is this a zero_jax state?")
        for i, (path, x) in enumerate(pairs):
            name = "/".join([section, *(_escape(key_name(k)) for k in path)])
            stored = tuple(int(d) for d in x.shape)
            shape = layouts[i].shape if layouts is not None else stored
            out.append(_Entry(name, shape, stored, np.dtype(x.dtype), getattr(x, "sharding", None)))

    add("step", state.step, None)
    out[-1] = dataclasses.replace(out[-1], name="step")
    add("params", state.params, state.layouts.layouts)
    add("opt_state", state.opt_state.inner_state, state.opt_state.layouts.layouts)
    if state.master is not None:
        add("master", state.master, state.layouts.layouts)
    if state.loss_scale is not None:
        add("loss_scale", state.loss_scale, None)
    if state.model_state is not None:
        add("model_state", state.model_state, None)
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (the tree orbax writes)."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, last = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


# -- directories and steps -------------------------------------------------------------


def _path(directory: str | os.PathLike[str]) -> epath.Path:
    from etils import epath  # orbax's path library (local disks and cloud buckets)

    return epath.Path(os.fspath(directory))


def _committed_steps(directory: epath.Path) -> list[int]:
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and re.fullmatch(r"\d+", p.name))


def _partial_saves(directory: epath.Path) -> list[str]:
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if _TMP_MARKER in p.name)


def steps(directory: str | os.PathLike[str]) -> list[int]:
    """The committed checkpoint steps in ``directory`` (partial saves are not steps).

    >>> import tempfile, zero_jax as zj
    >>> zj.checkpoint.steps(tempfile.mkdtemp())
    []
    """
    return _committed_steps(_path(directory))


def _pick_step(directory: epath.Path, step: int | None, where: str) -> int:
    if not directory.exists():
        raise FileNotFoundError(
            f"{where}: there is no checkpoint directory {directory}. Check the path, or save one first with "
            f"zj.save({str(directory)!r}, state, step=...)."
        )
    if not directory.is_dir():
        raise NotADirectoryError(f"{where}: {directory} is a file; pass the directory zj.save wrote into.")
    present = _committed_steps(directory)
    if not present:
        partial = _partial_saves(directory)
        extra = (
            f" It holds {len(partial)} partial save(s) that never committed ({', '.join(partial)}): "
            "a save was interrupted before any step completed."
            if partial
            else ""
        )
        raise FileNotFoundError(
            f"{where}: {directory} holds no checkpoint (no committed step directory).{extra} "
            "Pass the directory zj.save wrote into."
        )
    if step is None:
        return present[-1]
    if int(step) not in present:
        raise FileNotFoundError(
            f"{where}: checkpoint step {step} not found in {directory}; steps present: {present}. "
            "Pass one of those as step= (or step=None for the latest)."
        )
    return int(step)


# -- the manager -----------------------------------------------------------------------


class CheckpointManager:
    """Saves and restores :class:`~zero_jax.TrainState` checkpoints in one directory.

    Args:
      directory: where the step directories go (created on the first save).
      max_to_keep: keep the last this many steps (``None``: keep all).
      async_save: ``save`` returns once the arrays are copied off the
        devices and writes them in the background (call :meth:`wait`, or
        :meth:`close`, before relying on the files). The state may be donated
        to the next train step as soon as ``save`` returns.

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
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, max_to_keep: int | None = 3, async_save: bool = True
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"CheckpointManager: max_to_keep must be >= 1 or None, got {max_to_keep}.")
        self.directory = _path(directory)
        self.max_to_keep = max_to_keep
        self.async_save = async_save
        self._manager: Any = None

    def _orbax(self) -> Any:
        if self._manager is None:
            ocp = _ocp()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                enable_async_checkpointing=self.async_save,
                cleanup_tmp_directories=True,
                create=True,
            )
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=options,
                item_handlers={
                    _STATE_ITEM: ocp.PyTreeCheckpointHandler(),
                    _META_ITEM: ocp.JsonCheckpointHandler(),
                },
            )
        return self._manager

    def save(self, state: TrainState, *, step: int | None = None) -> None:
        """Save ``state`` as ``step`` (default: ``state.step``).

        Each process writes the shards its devices hold; the step appears
        in :meth:`all_steps` only once it is complete (atomic rename).
        """
        if not isinstance(state, TrainState):
            raise TypeError(
                f"zj.save: expected a zero_jax TrainState, got {type(state).__name__}. "
                "Save the state that zj.init_state / train_step returned."
            )
        if step is None:
            step = int(jax.device_get(state.step))
        step = int(step)
        entries = _entries(state)
        arrays = jax.tree.leaves(state)
        for e, x in zip(entries, arrays, strict=False):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                raise TypeError(
                    f"zj.save: leaf '{e.name}' is a typed PRNG key array, which a checkpoint cannot hold. Keep "
                    "keys out of the model state (or store jax.random.key_data(key) in it)."
                )
        if len(arrays) != len(entries):
            raise ValueError("zj.save: the state's leaves do not match its layouts; is this a zero_jax state?")
        tree = _nest({e.name: x for e, x in zip(entries, arrays, strict=True)})
        meta = _metadata(state, entries, step, _checksums(arrays, [e.shape for e in entries]))
        ocp = _ocp()
        manager = self._orbax()
        if step in manager.all_steps():
            raise FileExistsError(
                f"zj.save: step {step} already exists in {self.directory}. Save under another step, or delete "
                f"{self.directory / str(step)} first."
            )
        manager.save(
            step,
            args=ocp.args.Composite(**{_STATE_ITEM: ocp.args.PyTreeSave(tree), _META_ITEM: ocp.args.JsonSave(meta)}),
        )

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def all_steps(self) -> list[int]:
        """The committed steps, oldest first."""
        self.wait()
        return _committed_steps(self.directory)

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
        model_state: PyTree = None,
    ) -> TrainState:
        """:func:`restore` from this manager's directory (waits for pending saves)."""
        self.wait()
        return restore(self.directory, policy=policy, tx=tx, step=step, like=like, model_state=model_state)

    def close(self) -> None:
        """Wait for pending saves and release the manager's threads."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._manager.close()
            self._manager = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _metadata(state: TrainState, entries: list[_Entry], step: int, sums: list[list[int]]) -> dict[str, Any]:
    policy = state.policy
    prec = policy.precision
    param_paths = jax.tree_util.tree_flatten_with_path(state.layouts.tree(), is_leaf=is_layout)[0]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zero_jax_version": _version(),
        "step": step,
        "stage": policy.stage,
        "num_shards": policy.num_shards,
        "num_processes": jax.process_count(),
        "axes": list(policy.axes),
        "mesh_shape": {str(k): int(v) for k, v in policy.mesh.shape.items()},
        "min_shard_size": policy.min_shard_size,
        "stacked": ["/".join(p) for p in policy.stacked],
        "precision": {
            "param_dtype": np.dtype(prec.param_dtype).name,
            "compute_dtype": None if prec.compute_dtype is None else np.dtype(prec.compute_dtype).name,
            "loss_scale": prec.loss_scale is not None,
        },
        "params": [
            {"path": [_key_json(k) for k in path], "shape": list(lay.shape), "dtype": np.dtype(lay.dtype).name}
            for path, lay in param_paths
        ],
        # The model state's tree (None: the state has none), to rebuild it without a template.
        "model_state": None
        if state.model_state is None
        else [
            {"path": [_key_json(k) for k in path], "shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
            for path, x in jax.tree_util.tree_flatten_with_path(state.model_state)[0]
        ],
        "leaves": {
            e.name: {
                "shape": list(e.shape),
                "stored_shape": list(e.stored_shape),
                "dtype": e.dtype.name,
                "checksum": s,
            }
            for e, s in zip(entries, sums, strict=True)
        },
    }


_CHECKSUM_CHUNK = 1 << 22  # elements per host pass (32 MiB of uint64 temporaries)


def _leaf_sums(x: jax.Array, shape: tuple[int, ...]) -> np.ndarray:
    """This process's part of two sums over the bit patterns of ``x``'s logical region."""
    total = np.zeros(2, np.uint64)
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        local = []
        for d, sl in enumerate(shard.index):
            lo, hi, _ = sl.indices(x.shape[d])
            local.append(slice(0, max(0, min(hi, shape[d]) - lo)))
        if any(s.stop == 0 for s in local):
            continue
        block = np.asarray(shard.data)[tuple(local)]
        width = block.dtype.itemsize
        bits = (
            np.ascontiguousarray(block).reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width])
        )
        for i in range(0, bits.size, _CHECKSUM_CHUNK):
            c = bits[i : i + _CHECKSUM_CHUNK].astype(np.uint64)
            total += np.array([c.sum(dtype=np.uint64), (c * c).sum(dtype=np.uint64)], np.uint64)  # wraps mod 2**64
    return total


def _checksums(arrays: list[jax.Array], shapes: list[tuple[int, ...]]) -> list[list[int]]:
    """Two 32-bit sums per leaf over its logical (unpadded) region: of its bit
    patterns and of their squares. They do not depend on the layout (N, stage,
    padding, process count), so a restore under any policy can check them.
    Computed on the host from each process's shards (no compilation; on CPU
    devices the shards are read in place)."""
    sums = np.stack([_leaf_sums(x, tuple(s)) for x, s in zip(arrays, shapes, strict=True)]) if arrays else None
    if sums is None:
        return []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sums = np.asarray(multihost_utils.process_allgather(sums.view(np.uint32))).view(np.uint64).sum(axis=0)
    return [[int(a) % 2**32, int(b) % 2**32] for a, b in sums]


# -- save / restore ----------------------------------------------------------------------


def save(
    directory: str | os.PathLike[str],
    state: TrainState,
    *,
    step: int | None = None,
    max_to_keep: int | None = None,
) -> None:
    """Save ``state`` as checkpoint ``step`` (default ``state.step``) in ``directory``; returns once committed.

    Every process must call it (each writes its devices' shards). With
    ``max_to_keep`` only the newest that many steps are kept. For saves that
    overlap training use :class:`CheckpointManager` (``async_save=True``).
    """
    with CheckpointManager(directory, max_to_keep=max_to_keep, async_save=False) as manager:
        manager.save(state, step=step)


def _read_metadata(directory: epath.Path, step: int, where: str) -> dict[str, Any]:
    meta_file = directory / str(step) / _META_ITEM / "metadata"
    if not (directory / str(step) / _META_ITEM).exists():
        raise ValueError(
            f"{where}: {directory / str(step)} is not a zero_jax checkpoint (it has no '{_META_ITEM}' item). "
            "Restore checkpoints written by zj.save / zj.CheckpointManager."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{where}: the metadata of checkpoint step {step} in {directory} is unreadable ({meta_file}: "
            f"{type(e).__name__}: {e}); the file is truncated or corrupted. Steps present: "
            f"{_committed_steps(directory)}; restore another with step=."
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "leaves" not in meta:
        raise ValueError(
            f"{where}: {meta_file} is not zero_jax checkpoint metadata (corrupted?). Steps present: "
            f"{_committed_steps(directory)}; restore another with step=."
        )
    return meta


def _params_from_metadata(meta: dict[str, Any], where: str, section: str = "params") -> PyTree:
    """The checkpoint's parameter (or model state) tree as ``ShapeDtypeStruct``s (dicts and lists only)."""
    entries = [
        ([tuple(k) for k in e["path"]], jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"])))
        for e in meta[section]
    ]
    for path, _ in entries:
        if any(kind not in ("dict", "index") for kind, _ in path):
            fix = (
                "pass like= (the parameters, abstract or concrete, or a TrainState)"
                if section == "params"
                else "pass model_state= (the model state, abstract or concrete, e.g. adapted.model_state) or "
                "like= (a TrainState that has one)"
            )
            raise ValueError(
                f"{where}: the checkpoint's {section.replace('_', ' ')} tree has nodes other than dicts and lists "
                f"({'/'.join(str(k) for _, k in path)}); {fix} so the tree can be rebuilt."
            )

    def build(group: list[tuple[list[tuple[str, Any]], Any]]) -> Any:
        if len(group) == 1 and not group[0][0]:
            return group[0][1]
        children: dict[Any, list[Any]] = {}
        kinds = set()
        for path, spec in group:
            kinds.add(path[0][0])
            children.setdefault(path[0][1], []).append((path[1:], spec))
        if kinds == {"index"}:
            return [build(children[i]) for i in sorted(children)]
        return {k: build(v) for k, v in children.items()}

    return build(entries) if entries else {}


def _abstract_params(like: Any, meta: dict[str, Any], where: str) -> PyTree:
    if like is None:
        return _params_from_metadata(meta, where)
    if isinstance(like, TrainState):
        return jax.tree.map(
            lambda lay: jax.ShapeDtypeStruct(lay.shape, lay.dtype), like.layouts.tree(), is_leaf=is_layout
        )
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), getattr(x, "dtype", np.asarray(x).dtype)), like
    )


def _abstract_model_state(like: Any, model_state: Any, meta: dict[str, Any], where: str) -> PyTree:
    """The target's model state as ``ShapeDtypeStruct``s: from ``model_state=``, a
    ``like`` TrainState's, or the checkpoint's own tree; ``None`` when neither
    the checkpoint nor the caller has one."""
    saved = meta.get("model_state")
    if model_state is None and isinstance(like, TrainState):
        model_state = like.model_state
    if model_state is None:
        return None if saved is None else _params_from_metadata(meta, where, "model_state")
    if saved is None:
        raise ValueError(
            f"{where}: a model state was asked for (model_state= or like=), but the checkpoint has none: it was "
            "saved from a state without model_state. Restore without it, and start the model state afresh with "
            "state.replace(model_state=...) only if that is what you mean."
        )
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(tuple(np.shape(x)), getattr(x, "dtype", np.asarray(x).dtype)), model_state
    )


def _check_model(target: list[_Entry], meta: dict[str, Any], where: str) -> None:
    """Raise naming the first parameter the checkpoint lacks or has another shape of."""
    saved = {name: leaf for name, leaf in meta["leaves"].items() if name.startswith("params/")}
    wanted = [e for e in target if e.name.startswith("params/")]
    for e in wanted:
        if e.name not in saved:
            raise ValueError(
                f"{where}: the checkpoint is of another model: it has no parameter '{e.name[len('params/') :]}'. "
                f"Its parameters are {sorted(n[len('params/') :] for n in saved)[:12]}"
                f"{' ...' if len(saved) > 12 else ''}."
            )
        if tuple(saved[e.name]["shape"]) != e.shape:
            raise ValueError(
                f"{where}: the checkpoint is of another model: parameter '{e.name[len('params/') :]}' has shape "
                f"{tuple(saved[e.name]['shape'])} in the checkpoint but {e.shape} in the model being restored."
            )
    extra = sorted(set(saved) - {e.name for e in wanted})
    if extra:
        raise ValueError(
            f"{where}: the checkpoint is of another model: it has parameter '{extra[0][len('params/') :]}' "
            f"(shape {tuple(saved[extra[0]]['shape'])}) that the model being restored lacks."
        )


def _source(e: _Entry, meta: dict[str, Any], where: str) -> str | None:
    """The checkpoint leaf that target entry ``e`` is read from (``None``: start afresh)."""
    leaves = meta["leaves"]
    section, _, rest = e.name.partition("/")
    has_master = any(n.startswith("master/") for n in leaves)
    if section == "params":
        own = leaves.get(e.name)
        if own is not None and np.dtype(own["dtype"]) != e.dtype and has_master:
            return "master/" + rest
        return e.name
    if section == "master":
        return e.name if has_master else "params/" + rest
    if section == "loss_scale":
        return e.name if e.name in leaves else None
    if e.name not in leaves:
        if section == "opt_state":
            saved = sorted(n for n in leaves if n.startswith("opt_state/"))
            raise ValueError(
                f"{where}: the checkpoint's optimizer state has no leaf '{e.name}': it was saved with another "
                f"optimizer (or another model). Its optimizer-state leaves are {saved[:12]}"
                f"{' ...' if len(saved) > 12 else ''}. Pass the tx the checkpoint was trained with."
            )
        if section == "model_state":
            saved = sorted(n for n in leaves if n.startswith("model_state/"))
            raise ValueError(
                f"{where}: the checkpoint's model state has no leaf '{e.name}': the model state passed in is of "
                f"another model. Its model-state leaves are {saved[:12]}{' ...' if len(saved) > 12 else ''}."
            )
        raise ValueError(f"{where}: the checkpoint has no leaf '{e.name}'.")
    return e.name


def restore(
    directory: str | os.PathLike[str],
    *,
    policy: ZeroPolicy,
    tx: ShardedTransformation,
    step: int | None = None,
    like: PyTree | TrainState | None = None,
    verify: bool = True,
    model_state: PyTree = None,
) -> TrainState:
    """Restore checkpoint ``step`` (default: the latest) of ``directory`` laid out for ``policy``.

    ``policy`` may have another device count, another stage, or both, than
    the saving run: each leaf is read straight into its target sharding and
    stored shape (the saving N's padding dropped, the target N's added as
    zeros), never gathered whole on one device. ``tx`` is the optimizer
    sharded for ``policy`` (``zj.shard_optimizer(optax_tx, policy)``): it
    rebuilds the optax state's tree, whose leaves are matched by key path.

    ``like`` (optional): the parameters (arrays or ``jax.ShapeDtypeStruct``)
    or a TrainState of the model being restored. Its tree is used for the
    result and checked against the checkpoint (an error names the first
    mismatched leaf and both shapes). Without it the parameter tree is
    rebuilt from the checkpoint (nested dicts and lists).

    The model state (``state.model_state``: batch statistics and the like)
    is restored, replicated, when the checkpoint has one. Its tree comes from
    ``model_state=`` (a template: arrays or ``jax.ShapeDtypeStruct``s, e.g.
    ``adapted.model_state``), from ``like`` when that is a TrainState with
    one, or else is rebuilt from the checkpoint (nested dicts and lists; other
    trees, such as an ``eqx.nn.State``, need the template).

    ``verify`` (default) checks every leaf read in its saved dtype against
    checksums recorded at save time (one pass over the restored state).

    Raises ``FileNotFoundError`` for a missing or empty directory or a step
    that does not exist (listing the steps that do), ``ValueError`` for a
    checkpoint of another model or optimizer, or an unreadable
    (truncated, corrupted) file.
    """
    where = "zj.restore"
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(f"{where}: policy must be a zj.ZeroPolicy (the target layout), got {type(policy).__name__}.")
    if not isinstance(tx, ShardedTransformation):
        raise TypeError(
            f"{where}: tx must be the optimizer sharded for the target policy, zj.shard_optimizer(optax_tx, policy); "
            f"got {type(tx).__name__}."
        )
    path = _path(directory)
    step = _pick_step(path, step, where)
    meta = _read_metadata(path, step, where)
    abstract_params = _abstract_params(like, meta, where)
    abstract_model_state = _abstract_model_state(like, model_state, meta, where)
    try:
        abstract = init_state(abstract_params, tx, policy, model_state=abstract_model_state)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{where}: cannot build the target state from the checkpoint's parameters with this tx and policy "
            f"({e}). Is tx the optimizer of this model?"
        ) from e
    target = _entries(abstract)
    _check_model(target, meta, where)

    # Each target leaf reads one checkpoint leaf; a checkpoint leaf read by two
    # targets (params -> params and master) goes in a second pass.
    sources = [_source(e, meta, where) for e in target]
    for e, src in zip(target, sources, strict=True):
        if src is not None and tuple(meta["leaves"][src]["shape"]) != e.shape:
            raise ValueError(
                f"{where}: the checkpoint is of another model or optimizer: leaf '{src}' has shape "
                f"{tuple(meta['leaves'][src]['shape'])} in the checkpoint but {e.shape} in the state being restored."
            )
    passes: list[dict[str, int]] = []
    for i, src in enumerate(sources):
        if src is None:
            continue
        for p in passes:
            if src not in p:
                p[src] = i
                break
        else:
            passes.append({src: i})

    ocp = _ocp()
    restored: list[Any] = [None] * len(target)
    manager = ocp.CheckpointManager(
        path,
        options=ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False),
        item_handlers={_STATE_ITEM: ocp.PyTreeCheckpointHandler()},
    )
    try:
        for p in passes:
            item = _nest({src: jax.ShapeDtypeStruct(target[i].stored_shape, target[i].dtype) for src, i in p.items()})
            args = _nest(
                {
                    src: ocp.ArrayRestoreArgs(
                        sharding=target[i].sharding,
                        global_shape=target[i].stored_shape,
                        dtype=target[i].dtype,
                        strict=False,
                    )
                    for src, i in p.items()
                }
            )
            try:
                out = manager.restore(
                    step,
                    args=ocp.args.Composite(
                        **{_STATE_ITEM: ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)}
                    ),
                )[_STATE_ITEM]
            except Exception as e:  # orbax / tensorstore raise many kinds
                raise ValueError(
                    f"{where}: checkpoint step {step} in {path} could not be read: a file is missing, truncated or "
                    f"corrupted ({type(e).__name__}: {_first_line(e)}). Steps present: {_committed_steps(path)}; "
                    "restore another with step=."
                ) from e
            for src, i in p.items():
                node = out
                for k in src.split("/"):
                    node = node[k]
                restored[i] = node
    finally:
        manager.close()

    # Fresh values for what the checkpoint lacks (a float16 loss scale).
    if any(r is None for r in restored):
        fresh = jax.tree.leaves(LossScaleState.create(policy.precision.loss_scale))  # type: ignore[arg-type]
        names = [e.name for e in target if e.name.startswith("loss_scale/")]
        by_name = dict(zip(names, fresh, strict=True))
        for i, e in enumerate(target):
            if restored[i] is None:
                restored[i] = jax.device_put(by_name[e.name], e.sharding)

    restored = _zero_overlapping_padding(restored, target, sources, meta)
    if verify:
        _verify(restored, target, sources, meta, f"{where}: checkpoint step {step} in {path}", _committed_steps(path))
    return jax.tree.unflatten(jax.tree.structure(abstract), restored)


def _verify(
    restored: list[Any], target: list[_Entry], sources: list[str | None], meta: dict[str, Any], what: str, present: Any
) -> None:
    """Compare each leaf read as saved (same dtype) with the checksum recorded at save time."""
    idx = [
        i
        for i, src in enumerate(sources)
        if src is not None
        and "checksum" in meta["leaves"][src]
        and np.dtype(meta["leaves"][src]["dtype"]) == target[i].dtype
    ]
    if not idx:
        return
    got = _checksums([restored[i] for i in idx], [target[i].shape for i in idx])
    for i, sums in zip(idx, got, strict=True):
        src = sources[i]
        if sums != meta["leaves"][src]["checksum"]:  # type: ignore[index]
            raise ValueError(
                f"{what} is corrupted: leaf '{src}' does not match the checksum recorded when it was saved "
                f"(a data file was changed or damaged). Steps present: {present}; restore another with step=."
            )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _zero_overlapping_padding(
    restored: list[Any], target: list[_Entry], sources: list[str | None], meta: dict[str, Any]
) -> list[Any]:
    """Zero the target padding that orbax filled from the checkpoint's padding.

    Where both the saving and the target layout pad the same dimension, the
    overlap of their padding is read from the file; the library keeps padding
    at zero, but a restore must not depend on it.
    """
    todo = []
    for i, (e, src) in enumerate(zip(target, sources, strict=True)):
        if src is None:
            continue
        saved = meta["leaves"][src]["stored_shape"]
        if any(min(s, t) > n for s, t, n in zip(saved, e.stored_shape, e.shape, strict=True)):
            todo.append(i)
    if not todo:
        return restored

    def mask(xs: list[jax.Array]) -> list[jax.Array]:
        out = []
        for x, i in zip(xs, todo, strict=True):
            keep = jnp.ones(x.shape, bool)
            for d, n in enumerate(target[i].shape):
                keep &= jax.lax.broadcasted_iota(jnp.int32, x.shape, d) < n
            out.append(jnp.where(keep, x, jnp.zeros((), x.dtype)))
        return out

    fixed = jax.jit(mask, out_shardings=[target[i].sharding for i in todo], donate_argnums=0)(
        [restored[i] for i in todo]
    )
    restored = list(restored)
    for i, x in zip(todo, fixed, strict=True):
        restored[i] = x
    return restored


# -- streamed safetensors export ----------------------------------------------------------

#: numpy dtype name -> safetensors dtype code.
_ST_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
_NP_DTYPES = {v: k for k, v in _ST_DTYPES.items()}

#: Rows of a leaf's leading axis are streamed in blocks of at most this many bytes
#: (at least one row: one layer of a stacked leaf).
EXPORT_BLOCK_BYTES = 16 * 2**20


def _tensor_name(path: Sequence[Any]) -> str:
    return ".".join(key_name(k) for k in path) or "params"


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def _blocks(shape: tuple[int, ...], itemsize: int, cuts: list[int]) -> Iterator[tuple[int, int]]:
    """Row ranges of the leading axis, at most EXPORT_BLOCK_BYTES (or one row) each,
    never straddling a shard boundary in ``cuts``."""
    if not shape:
        yield (0, 1)
        return
    row = math.prod(shape[1:]) * itemsize
    per = max(1, EXPORT_BLOCK_BYTES // max(row, 1))
    bounds = sorted({0, shape[0], *(c for c in cuts if 0 < c < shape[0])})
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        for a in range(lo, hi, per):
            yield (a, min(hi, a + per))


def _host_block(x: jax.Array, shape: tuple[int, ...], rows: tuple[int, int]) -> np.ndarray:
    """Rows ``rows`` of the logical leaf ``shape`` held (possibly padded) in ``x``, on the host.

    Assembled from this process's shards: only the block ever exists whole.
    """
    a, b = rows
    if not shape:
        return np.asarray(jax.device_get(x.addressable_shards[0].data)).reshape(())
    out = np.empty((b - a, *shape[1:]), dtype=x.dtype)
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        starts, stops = [], []
        for d, sl in enumerate(shard.index):
            lo, hi, _ = sl.indices(x.shape[d])
            lim = (a, b) if d == 0 else (0, shape[d])
            starts.append(max(lo, lim[0]))
            stops.append(min(hi, lim[1]))
        if any(s >= t for s, t in zip(starts, stops, strict=True)):
            continue
        first = [sl.indices(x.shape[d])[0] for d, sl in enumerate(shard.index)]
        src = tuple(slice(s - f, t - f) for s, t, f in zip(starts, stops, first, strict=True))
        dst = tuple(
            slice(s - (a if d == 0 else 0), t - (a if d == 0 else 0))
            for d, (s, t) in enumerate(zip(starts, stops, strict=True))
        )
        if shard.device.platform == "cpu":
            out[dst] = np.asarray(shard.data)[src]  # a view of the device buffer: no copy, no compile
        else:
            out[dst] = np.asarray(shard.data[src])  # only the block's rows cross to the host
    return out


def _global_block(x: jax.Array, shape: tuple[int, ...], rows: tuple[int, int]) -> np.ndarray:
    """Like :func:`_host_block` when other processes hold some shards: every
    process calls it, and gets the block replicated onto its devices."""
    a, b = rows
    bounds = ((a, b), *((0, n) for n in shape[1:])) if shape else ()
    replicated = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    piece = _slice_fn(bounds, replicated)(x)
    return np.asarray(piece.addressable_data(0))


@functools.lru_cache(maxsize=256)
def _slice_fn(bounds: tuple[tuple[int, int], ...], sharding: Any) -> Any:
    index = tuple(slice(lo, hi) for lo, hi in bounds)
    return jax.jit(lambda v: v[index], out_shardings=sharding)


def export_params(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    format: str = "safetensors",
    dtype: Any = None,
) -> str:
    """Write the full, unpadded parameters of ``state`` to one safetensors file.

    The values are the float32 master copy when there is one (else
    ``state.params``), cast to ``dtype`` (default: the policy's
    ``param_dtype``; non-float leaves keep theirs). Tensors are named by key
    path joined with dots (``layers.attn_qkv``) and keep their logical shapes.

    The file is streamed: the header is written from the layouts, then each
    leaf's rows, at most ``EXPORT_BLOCK_BYTES`` (or one layer of a stacked
    leaf) at a time, assembled on the host from the devices' shards; the
    whole model never sits in one buffer. It is written beside ``path`` and
    renamed into place once complete. Every process must call it; process 0
    writes. The result loads with ``safetensors.numpy.load_file`` alone.

    >>> import os, tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> from safetensors.numpy import load_file
    >>> policy = zj.ZeroPolicy(stage=3, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    >>> state = zj.init_state({"dense": {"w": jnp.ones((100, 30))}}, tx, policy)
    >>> file = zj.export_params(os.path.join(tempfile.mkdtemp(), "model.safetensors"), state)
    >>> {k: v.shape for k, v in load_file(file).items()}
    {'dense.w': (100, 30)}
    >>> zj.load_params(file, policy)["dense"]["w"].shape  # stage 3: pieces of the padded (104, 30)
    (104, 30)
    """
    if format != "safetensors":
        raise ValueError(f"export_params: format must be 'safetensors', got {format!r}.")
    if not isinstance(state, TrainState):
        raise TypeError(f"export_params: expected a zero_jax TrainState, got {type(state).__name__}.")
    policy = state.policy
    source = state.master if state.master is not None else state.params
    pairs = jax.tree_util.tree_flatten_with_path(source)[0]
    layouts = state.layouts.layouts
    header: dict[str, Any] = {}
    plan = []
    offset = 0
    for (p, x), lay in zip(pairs, layouts, strict=True):
        name = _tensor_name(p)
        if name in header:
            raise ValueError(f"export_params: two parameters would both be named {name!r}; rename one.")
        out_dtype = _np_dtype(x.dtype)
        if dtype is not None and jnp.issubdtype(out_dtype, jnp.floating):
            out_dtype = _np_dtype(dtype)
        elif dtype is None and jnp.issubdtype(out_dtype, jnp.floating):
            out_dtype = _np_dtype(policy.precision.param_dtype)
        if out_dtype.name not in _ST_DTYPES:
            raise ValueError(f"export_params: safetensors cannot hold dtype {out_dtype} (parameter {name!r}).")
        nbytes = math.prod(lay.shape) * out_dtype.itemsize
        header[name] = {
            "dtype": _ST_DTYPES[out_dtype.name],
            "shape": list(lay.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        plan.append((name, x, lay, out_dtype, [p_key for p_key in p]))
        offset += nbytes
    header["__metadata__"] = {
        "format": "zero_jax",
        "zero_jax_version": _version(),
        "step": str(int(jax.device_get(state.step))),
        "paths": json.dumps({name: [_key_json(k) for k in keys] for name, _, _, _, keys in plan}),
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    target = os.fspath(path)
    writer = jax.process_index() == 0
    tmp = f"{target}.tmp-{os.getpid()}"
    multi = jax.process_count() > 1
    f = open(tmp, "wb") if writer else None  # noqa: SIM115 - closed in finally
    try:
        if f is not None:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
        for _, x, lay, out_dtype, _ in plan:
            # Block bounds from the global sharding: every process must cut the same blocks.
            index_map = x.sharding.devices_indices_map(tuple(x.shape)) if lay.dim == 0 else {}
            cuts = sorted({idx[0].indices(x.shape[0])[0] for idx in index_map.values()})
            for rows in _blocks(lay.shape, out_dtype.itemsize, cuts):
                block = _global_block(x, lay.shape, rows) if multi else _host_block(x, lay.shape, rows)
                if f is not None:
                    block = np.ascontiguousarray(block.astype(out_dtype, copy=False))
                    f.write(block.reshape(-1).view(np.uint8).data)
                del block
        if f is not None:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            f = None
            os.replace(tmp, target)
    finally:
        if f is not None:
            f.close()
            os.unlink(tmp)
    return target


def _piece_reader(f: Any, name: str, shape: tuple[int, ...], lay: LeafLayout, dtype: np.dtype) -> Any:
    """``make_array_from_callback``'s callback: one device's piece of tensor ``name``
    (stored ``shape``), read from the file and zero-padded beyond the logical shape."""

    def piece(index: tuple[slice, ...]) -> np.ndarray:
        if not shape:
            return np.asarray(f.get_tensor(name)).astype(dtype)
        bounds = [sl.indices(n) for sl, n in zip(index, shape, strict=True)]
        block = np.zeros(tuple(hi - lo for lo, hi, _ in bounds), dtype)
        clipped = tuple(slice(lo, min(hi, n)) for (lo, hi, _), n in zip(bounds, lay.shape, strict=True))
        if all(s.start < s.stop for s in clipped):
            data = f.get_slice(name)[clipped]
            block[tuple(slice(0, s.stop - s.start) for s in clipped)] = np.asarray(data).astype(dtype)
        return block

    return piece


def load_params(
    path: str | os.PathLike[str],
    policy: ZeroPolicy,
    *,
    like: PyTree | None = None,
    dtype: Any = None,
) -> PyTree:
    """Read a safetensors file (as :func:`export_params` writes) laid out for ``policy``.

    Returns the parameters as ``state.params`` holds them under ``policy``:
    in stage 3 each partitioned leaf is cut and padded per the policy, in
    stages 0–2 whole on every device. Each device's piece is read from the
    (memory-mapped) file directly; no leaf is assembled whole on the host
    in stage 3. ``dtype`` casts float leaves (default: as in the file).
    ``like`` (the parameters, arrays or ``jax.ShapeDtypeStruct``) gives the
    tree; without it the tree recorded by ``export_params`` is used (or
    nested dicts split on dots for files from elsewhere).
    """
    from safetensors import SafetensorError, safe_open

    where = "zj.load_params"
    file = os.fspath(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{where}: no file {file}. Write one with zj.export_params(path, state).")
    try:
        handle = safe_open(file, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{where}: {file} is not a readable safetensors file (truncated or corrupted?): {e}") from e
    with handle as f:
        names = list(f.keys())
        info = {n: (tuple(f.get_slice(n).get_shape()), _NP_DTYPES.get(f.get_slice(n).get_dtype())) for n in names}
        meta = f.metadata() or {}
        if like is not None:
            pairs, treedef = jax.tree_util.tree_flatten_with_path(like)
            order = [_tensor_name(p) for p, _ in pairs]
            for (_, x), name in zip(pairs, order, strict=True):
                if name not in info:
                    raise ValueError(f"{where}: {file} has no tensor {name!r}; it holds {sorted(info)[:12]}.")
                if tuple(np.shape(x)) != info[name][0]:
                    raise ValueError(
                        f"{where}: tensor {name!r} has shape {info[name][0]} in {file} but {tuple(np.shape(x))} "
                        "in like=."
                    )
        else:
            order = names
            paths = (
                json.loads(meta["paths"])
                if "paths" in meta
                else {n: [["dict", k] for k in n.split(".")] for n in names}
            )
            fake = {
                "params": [
                    {"path": paths[n], "shape": list(info[n][0]), "dtype": info[n][1] or "float32"} for n in names
                ]
            }
            tree = _params_from_metadata(fake, where)
            pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
            order = [_tensor_name(p) for p, _ in pairs]
        abstract = []
        for name in order:
            shape, file_dtype = info[name]
            if file_dtype is None:
                raise ValueError(f"{where}: tensor {name!r} in {file} has a dtype numpy cannot hold.")
            want = np.dtype(file_dtype)
            if dtype is not None and jnp.issubdtype(want, jnp.floating):
                want = _np_dtype(dtype)
            abstract.append(jax.ShapeDtypeStruct(shape, want))
        abstract_tree = jax.tree.unflatten(treedef, abstract)
        layouts = jax.tree.leaves(policy.layouts(abstract_tree), is_leaf=is_layout)
        out = []
        for name, spec, lay in zip(order, abstract, layouts, strict=True):
            part = policy.partitions_params and lay.dim is not None
            shape = lay.stored_shape if part else lay.shape
            sharding = policy.named_sharding(lay, part)
            try:
                out.append(
                    jax.make_array_from_callback(shape, sharding, _piece_reader(f, name, shape, lay, spec.dtype))
                )
            except SafetensorError as e:
                raise ValueError(f"{where}: tensor {name!r} of {file} could not be read (truncated?): {e}") from e
    return jax.tree.unflatten(treedef, out)
