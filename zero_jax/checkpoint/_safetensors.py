"""The parameters as one safetensors file: a streamed export, and a load
that reads each device's piece straight from the (memory-mapped) file.

safetensors is an optional extra, imported where it is used (the export
writes the format itself and needs no library).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._base.tree import PyTree, check_live, key_name
from zero_jax._layout.leaf import LeafLayout, is_layout
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._step.state import TrainState
from zero_jax.checkpoint._record import VERSION, absolute, key_json, tree_from_metadata

#: numpy dtype name -> safetensors dtype code.
ST_DTYPES = {
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
NP_DTYPES = {v: k for k, v in ST_DTYPES.items()}

#: Rows of a leaf's leading axis are streamed in blocks of at most this many bytes
#: (at least one row: one layer of a stacked leaf).
EXPORT_BLOCK_BYTES = 16 * 2**20


def tensor_name(path: Sequence[Any]) -> str:
    """A parameter's tensor name: its key path joined with dots (``layers.attn_qkv``)."""
    return ".".join(key_name(k) for k in path) or "params"


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


# -- export ----------------------------------------------------------------------------------------------------


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
    replicated = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())  # pyright: ignore[reportAttributeAccessIssue] - a placed leaf has a NamedSharding
    piece = _slice_fn(bounds, replicated)(x)
    return np.asarray(piece.addressable_data(0))


@functools.lru_cache(maxsize=256)
def _slice_fn(bounds: tuple[tuple[int, int], ...], sharding: Any) -> Any:
    index = tuple(slice(lo, hi) for lo, hi in bounds)
    return jax.jit(lambda v: v[index], out_shardings=sharding)


class _Tensor(NamedTuple):
    """One tensor of the file: its name, the array holding it, its layout and file dtype."""

    name: str
    array: jax.Array
    layout: LeafLayout
    dtype: np.dtype


BAD_FORMAT = "export_params: format must be 'safetensors', got {got!r}."
NOT_A_STATE = "export_params: expected a zero_jax TrainState, got {got}."
BAD_TENSORS = (
    "export_params: {count} parameter(s) cannot be written: {first}. All:\n{lines}\n"
    "Rename parameters whose key paths join to the same dotted name; cast others to a dtype safetensors holds "
    "(dtype=, or in the model)."
)


def _export_plan(state: TrainState, dtype: Any) -> tuple[list[_Tensor], bytes]:
    """The tensors to write, in order, and the file's header (length-prefixed, 8-byte aligned)."""
    source = state.master if state.master is not None else state.params
    pairs = jax.tree_util.tree_flatten_with_path(source)[0]
    header: dict[str, Any] = {}
    plan, keys, bad = [], {}, []
    offset = 0
    for (p, x), lay in zip(pairs, state.layouts.layouts, strict=True):
        name = tensor_name(p)
        out_dtype = _np_dtype(x.dtype)
        if jnp.issubdtype(out_dtype, jnp.floating):
            out_dtype = _np_dtype(dtype if dtype is not None else state.policy.precision.param_dtype)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        if name in header:
            bad.append(f"two parameters would both be named {name!r}")
            continue
        if out_dtype.name not in ST_DTYPES:
            bad.append(f"parameter {name!r} {tuple(lay.shape)}: safetensors cannot hold dtype {out_dtype}")
        nbytes = math.prod(lay.shape) * out_dtype.itemsize
        entry = {"dtype": ST_DTYPES.get(out_dtype.name), "shape": list(lay.shape)}
        header[name] = {**entry, "data_offsets": [offset, offset + nbytes]}
        plan.append(_Tensor(name, x, lay, out_dtype))
        keys[name] = [key_json(k) for k in p]
        offset += nbytes
    if bad:
        lines = "\n".join(f"  {b}" for b in bad)
        raise ValueError(BAD_TENSORS.format(count=len(bad), first=bad[0], lines=lines))
    header["__metadata__"] = {
        "format": "zero_jax",
        "zero_jax_version": VERSION,
        "step": str(int(jax.device_get(state.step))),
        "paths": json.dumps(keys),
    }
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return plan, len(blob).to_bytes(8, "little") + blob


def _stream(f: Any, plan: list[_Tensor]) -> None:
    """Write each tensor's rows block by block (``f`` is ``None`` on processes that do not write)."""
    multi = jax.process_count() > 1
    for t in plan:
        x, lay = t.array, t.layout
        # Block bounds from the global sharding: every process must cut the same blocks.
        index_map = x.sharding.devices_indices_map(tuple(x.shape)) if lay.dim == 0 else {}
        cuts = sorted({idx[0].indices(x.shape[0])[0] for idx in index_map.values()})
        for rows in _blocks(lay.shape, t.dtype.itemsize, cuts):
            block = _global_block(x, lay.shape, rows) if multi else _host_block(x, lay.shape, rows)
            if f is not None:
                block = np.ascontiguousarray(block.astype(t.dtype, copy=False))
                f.write(block.reshape(-1).view(np.uint8).data)
            del block


def export_params(
    path: str | os.PathLike[str],
    state: TrainState,
    *,
    format: str = "safetensors",
    dtype: Any = None,
) -> str:
    """Write the full, unpadded parameters of ``state`` to one safetensors file; returns its absolute path.

    The values are the float32 master copy when there is one (else
    ``state.params``), cast to ``dtype`` (default: the policy's
    ``param_dtype``; non-float leaves keep theirs). Tensors are named by key
    path joined with dots (``layers.attn_qkv``) and keep their logical shapes.
    A relative ``path`` is resolved against the current directory now.

    The file is streamed: the header is written from the layouts, then each
    leaf's rows, at most ``EXPORT_BLOCK_BYTES`` (or one layer of a stacked
    leaf) at a time, assembled on the host from the devices' shards; the
    whole model never sits in one buffer. It is written beside ``path`` and
    renamed into place once complete (a failed export leaves no file). Every
    process must call it; process 0 writes. The result loads with
    ``safetensors.numpy.load_file`` alone.

    >>> import os, tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> from safetensors.numpy import load_file
    >>> policy = zj.ZeroPolicy(stage=3, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    >>> state = zj.init_state({"dense": {"w": jnp.ones((100, 30))}}, tx, policy)
    >>> file = zj.export_params(os.path.join(tempfile.mkdtemp(), "model.safetensors"), state)
    >>> {k: v.shape for k, v in load_file(file).items()}
    {'dense.w': (100, 30)}
    >>> zj.load_params(file, policy)["dense"]["w"].shape  # logical, for zj.init_state
    (100, 30)
    >>> zj.load_params(file, policy, stored=True)["dense"]["w"].shape  # as state.params: the padded (104, 30)
    (104, 30)
    """
    if format != "safetensors":
        raise ValueError(BAD_FORMAT.format(got=format))
    if not isinstance(state, TrainState):
        raise TypeError(NOT_A_STATE.format(got=type(state).__name__))
    check_live(state, where="zj.export_params")
    plan, head = _export_plan(state, dtype)
    target = absolute(path)
    tmp = f"{target}.tmp-{os.getpid()}"
    f = open(tmp, "wb") if jax.process_index() == 0 else None  # noqa: SIM115 - closed in finally
    try:
        if f is not None:
            f.write(head)
        _stream(f, plan)
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


# -- load ------------------------------------------------------------------------------------------------------


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


NO_FILE = "{where}: no file {file}. Write one with zj.export_params(path, state)."
NOT_SAFETENSORS = "{where}: {file} is not a readable safetensors file (truncated or corrupted?): {error}"
LIKE_MISMATCH = (
    "{where}: {count} parameter(s) of like= do not match {file}: {first}. All:\n{lines}\n"
    "Pass like= the parameters of the model the file was exported from (or no like= to use the file's own tree)."
)
UNKNOWN_DTYPE = "{where}: tensor(s) {names} in {file} have a dtype numpy cannot hold."
UNREADABLE_TENSOR = "{where}: tensor {name!r} of {file} could not be read (truncated?): {error}"


def _file_tree(
    info: dict[str, tuple[tuple[int, ...], str | None]], meta: dict[str, Any], like: Any, file: str, where: str
) -> tuple[list[str], Any]:
    """The tensor names in tree order and the treedef: from ``like`` (checked against the file) or the file."""
    if like is not None:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(like)
        order = [tensor_name(p) for p, _ in pairs]
        bad = []
        for (_, x), name in zip(pairs, order, strict=True):
            if name not in info:
                bad.append(f"{file} has no tensor {name!r}; it holds {sorted(info)[:12]}")
            elif tuple(np.shape(x)) != info[name][0]:
                bad.append(f"tensor {name!r} has shape {info[name][0]} in {file} but {tuple(np.shape(x))} in like=")
        if bad:
            lines = "\n".join(f"  {b}" for b in bad)
            raise ValueError(LIKE_MISMATCH.format(where=where, count=len(bad), file=file, first=bad[0], lines=lines))
        return order, treedef
    names = list(info)
    paths = json.loads(meta["paths"]) if "paths" in meta else {n: [["dict", k] for k in n.split(".")] for n in names}
    record = {
        "params": [{"path": paths[n], "shape": list(info[n][0]), "dtype": info[n][1] or "float32"} for n in names]
    }
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree_from_metadata(record, where))
    return [tensor_name(p) for p, _ in pairs], treedef


def load_params(
    path: str | os.PathLike[str],
    policy: ZeroPolicy,
    *,
    like: PyTree | None = None,
    dtype: Any = None,
    stored: bool = False,
) -> PyTree:
    """Read a safetensors file (as :func:`export_params` writes) laid out for ``policy``.

    Returns the parameters in their logical shapes, ready for
    ``zj.init_state(params, tx, policy)``: in stage 3 each partitioned leaf is
    cut per the policy; a leaf the policy stores padded (a ``(256,)`` bias on
    3 devices is stored ``(258,)``) cannot be cut unpadded (JAX refuses a
    dimension that does not divide), so it comes back whole on every device
    (over the ZeRO axes; model axes as the policy says) in its logical shape.
    In stages 0–2 every leaf is whole on every device. ``stored=True``
    returns the form ``state.params`` holds instead (padded pieces), to put
    into an existing state; it is not for ``init_state``, which takes logical
    parameters. Each device's piece is read from the
    (memory-mapped) file directly; no leaf is assembled whole on the host
    in stage 3. ``dtype`` casts float leaves (default: as in the file).
    ``like`` (the parameters, arrays or ``jax.ShapeDtypeStruct``) gives the
    tree; without it the tree recorded by ``export_params`` is used (or
    nested dicts split on dots for files from elsewhere). A relative
    ``path`` is resolved against the current directory now.
    """
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415 - optional (the checkpoint extra)

    where = "zj.load_params"
    file = absolute(path)
    if not os.path.isfile(file):
        raise FileNotFoundError(NO_FILE.format(where=where, file=file))
    try:
        handle = safe_open(file, framework="numpy")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(NOT_SAFETENSORS.format(where=where, file=file, error=e)) from e
    with handle as f:
        info = {n: (tuple(f.get_slice(n).get_shape()), NP_DTYPES.get(f.get_slice(n).get_dtype())) for n in f.keys()}
        order, treedef = _file_tree(info, f.metadata() or {}, like, file, where)
        unknown = [n for n in order if info[n][1] is None]
        if unknown:
            raise ValueError(UNKNOWN_DTYPE.format(where=where, names=", ".join(map(repr, unknown)), file=file))
        abstract = []
        for name in order:
            shape, file_dtype = info[name]
            want = np.dtype(file_dtype)
            if dtype is not None and jnp.issubdtype(want, jnp.floating):
                want = _np_dtype(dtype)
            abstract.append(jax.ShapeDtypeStruct(shape, want))
        layouts = jax.tree.leaves(policy.layouts(jax.tree.unflatten(treedef, abstract)), is_leaf=is_layout)
        out = []
        for name, spec, lay in zip(order, abstract, layouts, strict=True):
            part = policy.partitions_params and lay.dim is not None
            part = part and (stored or tuple(lay.stored_shape) == tuple(lay.shape))
            shape = lay.stored_shape if part else lay.shape
            reader = _piece_reader(f, name, shape, lay, spec.dtype)
            try:
                out.append(jax.make_array_from_callback(shape, policy.named_sharding(lay, part), reader))
            except SafetensorError as e:
                raise ValueError(UNREADABLE_TENSOR.format(where=where, name=name, file=file, error=e)) from e
    return jax.tree.unflatten(treedef, out)
