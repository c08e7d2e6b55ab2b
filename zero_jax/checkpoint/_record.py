"""What a checkpoint records, and where: leaf names, step directories, the
JSON metadata and the layout-independent checksums.

Nothing here talks to orbax (its path library, etils, is imported where a
path is made); :mod:`._orbax` writes and reads what this module names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from zero_jax._base.tree import PyTree, key_name
from zero_jax._layout.leaf import LeafLayout, is_layout
from zero_jax._step.state import TrainState
from zero_jax._version import __version__

if TYPE_CHECKING:
    from etils import epath

FORMAT = "zero_jax.checkpoint"
FORMAT_VERSION = 1
STATE_ITEM = "state"  # the orbax item holding the arrays
META_ITEM = "zero_jax"  # the orbax item holding the JSON record
TMP_MARKER = ".orbax-checkpoint-tmp"  # in the name of a step directory orbax has not committed
VERSION = __version__

# -- names ------------------------------------------------------------------------------------------------


def escape(name: str) -> str:
    """A key name safe as one level of a checkpoint path (no ``/``)."""
    return name.replace("%", "%25").replace("/", "%2F")


def key_json(key: Any) -> list[Any]:
    """One key-path entry as JSON, so a parameter tree can be rebuilt."""
    if isinstance(key, jax.tree_util.DictKey):
        return ["dict", key.key if isinstance(key.key, (str, int)) else str(key.key)]
    if isinstance(key, jax.tree_util.SequenceKey):
        return ["index", key.idx]
    return ["other", key_name(key)]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One array of a train state: its checkpoint name, logical shape, dtype."""

    name: str  # "params/layers/attn_qkv", "opt_state/0/mu/w", "step"
    shape: tuple[int, ...]  # logical (unpadded)
    stored_shape: tuple[int, ...]  # as it lives between steps under its policy
    dtype: np.dtype
    sharding: Any = None

    @property
    def section(self) -> str:
        """``"params"``, ``"opt_state"``, ``"master"``, ``"loss_scale"``, ``"model_state"`` or ``"step"``."""
        return self.name.partition("/")[0]

    @property
    def rest(self) -> str:
        """The name within its section (``"layers/attn_qkv"``)."""
        return self.name.partition("/")[2]


NOT_A_STATE = "zero_jax checkpoint: {section} does not match its layouts; is this a zero_jax state?"


def state_entries(state: TrainState) -> list[Entry]:
    """Every array of ``state`` (concrete or abstract), in ``jax.tree.leaves`` order."""
    out: list[Entry] = []

    def add(section: str, tree: PyTree, layouts: Sequence[LeafLayout] | None) -> None:
        pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
        if layouts is not None and len(layouts) != len(pairs):
            raise ValueError(NOT_A_STATE.format(section=section))
        for i, (path, x) in enumerate(pairs):
            name = "/".join([section, *(escape(key_name(k)) for k in path)])
            stored = tuple(int(d) for d in x.shape)
            shape = layouts[i].shape if layouts is not None else stored
            out.append(Entry(name, shape, stored, np.dtype(x.dtype), getattr(x, "sharding", None)))

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


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}`` (the tree orbax writes)."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, last = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


def lookup(tree: dict[str, Any], name: str) -> Any:
    """The inverse of :func:`nest` for one name."""
    node = tree
    for k in name.split("/"):
        node = node[k]
    return node


def leaf_text(shape: Sequence[int], dtype: Any) -> str:
    """``"(12, 100) float32"``: how a message shows a leaf."""
    return f"{tuple(shape)} {np.dtype(dtype).name}"


# -- directories and steps ----------------------------------------------------------------------------------

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def absolute(path: str | os.PathLike[str]) -> str:
    """``path`` made absolute against the current directory *now* (``~`` expanded);
    URLs such as ``gs://bucket/run`` are kept as given."""
    text = os.fsdecode(os.fspath(path))
    return text if _SCHEME.match(text) else os.path.abspath(os.path.expanduser(text))


def resolve(directory: str | os.PathLike[str]) -> epath.Path:
    """A checkpoint directory as orbax's path type, absolute (orbax refuses relative ones)."""
    from etils import epath  # noqa: PLC0415 - orbax's path library (local disks and cloud buckets), optional

    return epath.Path(absolute(directory))


def committed_steps(directory: epath.Path) -> list[int]:
    """The step directories orbax has committed, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and re.fullmatch(r"\d+", p.name))


def partial_saves(directory: str | os.PathLike[str] | epath.Path) -> list[str]:
    """The names of the uncommitted (partial) step directories in ``directory``.

    >>> import tempfile, zero_jax as zj
    >>> zj.checkpoint.partial_saves(tempfile.mkdtemp())
    []
    """
    path = resolve(directory)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if TMP_MARKER in p.name)


def steps(directory: str | os.PathLike[str]) -> list[int]:
    """The committed checkpoint steps in ``directory`` (partial saves are not steps).

    >>> import tempfile, zero_jax as zj
    >>> zj.checkpoint.steps(tempfile.mkdtemp())
    []
    """
    return committed_steps(resolve(directory))


NO_DIRECTORY = (
    "{where}: there is no checkpoint directory {directory}. Check the path, or save one first with "
    "zj.save({directory_repr}, state, step=...)."
)
NOT_A_DIRECTORY = "{where}: {directory} is a file; pass the directory zj.save wrote into."
NO_CHECKPOINT = (
    "{where}: {directory} holds no checkpoint (no committed step directory).{partial} "
    "Pass the directory zj.save wrote into."
)
PARTIAL_SAVES = (
    " It holds {count} partial save(s) that never committed ({names}): a save was interrupted before any step "
    "completed."
)
NO_STEP = (
    "{where}: checkpoint step {step} not found in {directory}; steps present: {present}. "
    "Pass one of those as step= (or step=None for the latest)."
)


def pick_step(directory: epath.Path, step: int | None, where: str) -> int:
    """``step`` if ``directory`` holds it (``None``: the latest), else a ``FileNotFoundError`` saying what is there."""
    if not directory.exists():
        raise FileNotFoundError(NO_DIRECTORY.format(where=where, directory=directory, directory_repr=str(directory)))
    if not directory.is_dir():
        raise NotADirectoryError(NOT_A_DIRECTORY.format(where=where, directory=directory))
    present = committed_steps(directory)
    if not present:
        partial = partial_saves(directory)
        extra = PARTIAL_SAVES.format(count=len(partial), names=", ".join(partial)) if partial else ""
        raise FileNotFoundError(NO_CHECKPOINT.format(where=where, directory=directory, partial=extra))
    if step is None:
        return present[-1]
    if int(step) not in present:
        raise FileNotFoundError(NO_STEP.format(where=where, step=step, directory=directory, present=present))
    return int(step)


# -- the JSON record ----------------------------------------------------------------------------------------


def _tree_record(tree: PyTree, is_leaf: Any = None) -> list[dict[str, Any]]:
    """Each leaf's key path, shape and dtype, enough to rebuild a tree of dicts and lists."""
    return [
        {"path": [key_json(k) for k in path], "shape": list(x.shape), "dtype": np.dtype(x.dtype).name}
        for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    ]


def build_metadata(state: TrainState, entries: list[Entry], step: int, sums: list[list[int]]) -> dict[str, Any]:
    """The ``zero_jax`` item of a checkpoint step: the state's logical layout and its checksums."""
    policy = state.policy
    prec = policy.precision
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "zero_jax_version": VERSION,
        "step": step,
        "stage": policy.stage,
        "num_shards": policy.num_shards,
        "num_processes": jax.process_count(),
        "axes": list(policy.axes),
        "mesh_shape": {str(k): int(v) for k, v in policy.mesh.shape.items()},
        "min_shard_size": policy.min_shard_size,
        "stacked": list(policy.stacked),
        "precision": {
            "param_dtype": np.dtype(prec.param_dtype).name,  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
            "compute_dtype": None if prec.compute_dtype is None else np.dtype(prec.compute_dtype).name,  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
            "loss_scale": prec.loss_scale is not None,  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        },
        "params": _tree_record(state.layouts.tree(), is_leaf=is_layout),
        # The model state's tree (None: the state has none), to rebuild it without a template.
        "model_state": None if state.model_state is None else _tree_record(state.model_state),
        "leaves": {
            e.name: {"shape": list(e.shape), "stored_shape": list(e.stored_shape), "dtype": e.dtype.name, "checksum": s}
            for e, s in zip(entries, sums, strict=True)
        },
    }


class CorruptCheckpointError(ValueError):
    """A committed checkpoint step whose files cannot be read or do not match the
    checksums recorded when it was saved (truncated, damaged or changed since).

    A ``ValueError``, so code that caught those keeps working;
    ``zj.restore(..., fallback=True)`` catches it to restore the step before.

    >>> import zero_jax as zj
    >>> issubclass(zj.checkpoint.CorruptCheckpointError, ValueError)
    True
    """


#: How a corruption message names the way out.
RESTORE_ANOTHER = (
    "Steps present: {present}; restore another with step=, or pass fallback=True to restore the newest one before "
    "it that reads and verifies."
)

NOT_ZERO_JAX = (
    "{where}: {path} is not a zero_jax checkpoint (it has no '{item}' item). "
    "Restore checkpoints written by zj.save / zj.CheckpointManager."
)
UNREADABLE_METADATA = (
    "{where}: the metadata of checkpoint step {step} in {directory} is unreadable ({file}: {error}); the file is "
    "truncated or corrupted. " + RESTORE_ANOTHER
)
NOT_METADATA = "{where}: {file} is not zero_jax checkpoint metadata (corrupted?). " + RESTORE_ANOTHER


def read_metadata(directory: epath.Path, step: int, where: str) -> dict[str, Any]:
    """The JSON record of ``step``, checked to be one."""
    item = directory / str(step) / META_ITEM
    meta_file = item / "metadata"
    if not item.exists():
        raise ValueError(NOT_ZERO_JAX.format(where=where, path=directory / str(step), item=META_ITEM))
    present = committed_steps(directory)
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
        raise CorruptCheckpointError(
            UNREADABLE_METADATA.format(
                where=where, step=step, directory=directory, file=meta_file, error=error, present=present
            )
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "leaves" not in meta:
        raise CorruptCheckpointError(NOT_METADATA.format(where=where, file=meta_file, present=present))
    return meta


NOT_DICTS_AND_LISTS = (
    "{where}: the checkpoint's {what} tree has nodes other than dicts and lists ({paths}); {fix} so the tree can be "
    "rebuilt."
)
PARAMS_TEMPLATE = "pass like= (the parameters, abstract or concrete, or a TrainState)"
MODEL_STATE_TEMPLATE = (
    "pass model_state= (the model state, abstract or concrete, e.g. adapted.model_state) or like= (a TrainState "
    "that has one)"
)


def tree_from_metadata(meta: dict[str, Any], where: str, section: str = "params") -> PyTree:
    """The recorded parameter (or model state) tree as ``ShapeDtypeStruct``s (dicts and lists only)."""
    entries = [
        ([tuple(k) for k in e["path"]], jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"])))
        for e in meta[section]
    ]
    others = [
        "/".join(str(k) for _, k in path)
        for path, _ in entries
        if any(kind not in ("dict", "index") for kind, _ in path)
    ]
    if others:
        fix = PARAMS_TEMPLATE if section == "params" else MODEL_STATE_TEMPLATE
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        raise ValueError(NOT_DICTS_AND_LISTS.format(where=where, what=section.replace("_", " "), paths=shown, fix=fix))

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


# -- checksums ----------------------------------------------------------------------------------------------

_CHECKSUM_CHUNK = 1 << 22  # elements per host pass (32 MiB of uint64 temporaries)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


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
        bits = np.ascontiguousarray(block).reshape(-1).view(_UINT[block.dtype.itemsize])
        for i in range(0, bits.size, _CHECKSUM_CHUNK):
            c = bits[i : i + _CHECKSUM_CHUNK].astype(np.uint64)
            total += np.array([c.sum(dtype=np.uint64), (c * c).sum(dtype=np.uint64)], np.uint64)  # wraps mod 2**64
    return total


def checksums(arrays: list[jax.Array], shapes: list[tuple[int, ...]]) -> list[list[int]]:
    """Two 32-bit sums per leaf over its logical (unpadded) region: of its bit
    patterns and of their squares. They do not depend on the layout (N, stage,
    padding, process count), so a restore under any policy can check them.
    Computed on the host from each process's shards (no compilation; on CPU
    devices the shards are read in place)."""
    if not arrays:
        return []
    sums = np.stack([_leaf_sums(x, tuple(s)) for x, s in zip(arrays, shapes, strict=True)])
    if jax.process_count() > 1:
        sums = np.asarray(multihost_utils.process_allgather(sums.view(np.uint32))).view(np.uint64).sum(axis=0)
    return [[int(a) % 2**32, int(b) % 2**32] for a, b in sums]
