"""Several processes, one program: process-local batches and start-up checks.

On a TPU pod or a multi-node GPU cluster every host runs the same script as
its own process (JAX's multi-controller runtime, ``jax.distributed``) and
drives only its local devices. Two things then need care, and live here:

* the data: each process loads its own slice of the global batch;
  :func:`shard_batch` turns those slices into one global ``jax.Array``;
* agreement: processes that disagree on the policy, the mesh or their batch
  slice would otherwise meet in a collective that never completes (a hang,
  not an error). :func:`check_same_on_all_processes` compares a fingerprint
  through the coordinator's key-value store -- no collective, so a mismatch
  is an error on every process, and a process that never arrives is a
  timeout that names it. :func:`exchange` is that agreement's one primitive
  (``zj.restore(..., fallback=True)`` uses it to agree on the step restored).

With one process everything here is a cheap local check.

The key-value store is ``jax._src.distributed.global_state.client``: JAX has
no public API for it (``jax.distributed`` exposes only ``initialize``,
``shutdown`` and ``is_initialized``; ``jax.experimental.multihost_utils``
offers collectives, which are what a mismatch would hang in). It is the one
private JAX name the library reads, here only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import jax
import numpy as np
from jax._src import distributed  # the coordinator's key-value store; see the module docstring

from zero_jax._base.tree import PyTree, path_str
from zero_jax._policy.policy import ZeroPolicy

#: How long a process waits for the others to publish a fingerprint.
DEFAULT_TIMEOUT_S = 120

#: ``shard_batch``: leaves with no leading (batch) dimension.
SCALAR_BATCH_LEAVES = "shard_batch: {leaves}; every leaf needs a leading batch dimension."
#: ``shard_batch``: leaves whose local rows do not split over this process's devices.
UNEVEN_LOCAL_ROWS = (
    "shard_batch: {leaves} on process {me}, which do not split over its {k} batch shards (axes {axes}). "
    "Use a local batch that is a multiple of {k}."
)
#: ``shard_batch``: processes passed slices of different shapes.
SLICES_DIFFER = (
    "shard_batch: the processes' batch slices differ: {differences}. Every process must pass the same number "
    "of rows (global batch / process count) with the same trailing shape and dtype."
)

_calls = itertools.count()  # every process calls the checks in the same order


def _client() -> Any:
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            "zero_jax: jax.process_count() > 1 but jax.distributed is not initialized in this process; "
            "call jax.distributed.initialize() before creating arrays."
        )
    return client


def exchange(tag: str, text: str, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[int, str]:
    """Publish this process's ``text`` and read every process's, in process
    order, through the coordinator's key-value store (no collective). Calls
    are matched by order: every process must make them at the same points."""
    me, call, client = jax.process_index(), next(_calls), _client()
    client.key_value_set(f"zero_jax/{tag}/{call}/{me}", text)
    seen = {}
    for p in range(jax.process_count()):
        try:
            seen[p] = client.blocking_key_value_get(f"zero_jax/{tag}/{call}/{p}", int(timeout_s * 1000))
        except Exception as e:  # the runtime raises its own error type on timeout
            raise TimeoutError(
                f"{what}: process {p} did not reach this point within {timeout_s:.0f} s (process {me} did). "
                "Every process must run the same program: check that it did not fail or take another branch."
            ) from e
    return seen


def check_same_on_all_processes(what: str, value: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Raise the same ``ValueError`` on every process unless all processes
    pass an equal ``value`` (anything ``json``-serializable via ``repr``).

    Every process must call it at the same point of its program (calls are
    matched by order). A process that does not arrive within ``timeout_s``
    makes the others raise a ``TimeoutError`` naming it.
    """
    if jax.process_count() == 1:
        return
    text = json.dumps(value if isinstance(value, (str, int, float, list, dict)) else repr(value))
    seen = exchange("check", text, what, timeout_s)
    if len(set(seen.values())) > 1:
        listing = "\n".join(f"  process {p}: {json.loads(v)}" for p, v in seen.items())
        raise ValueError(
            f"{what}: the processes disagree:\n{listing}\nEvery process must build the same mesh and "
            "policy (same stage, axes, mesh shape and devices) and pass batch slices of the same shape."
        )


def policy_fingerprint(policy: ZeroPolicy) -> str:
    """A short text every process derives alike from an equal policy."""
    key = repr(policy.key)
    return f"{policy!r} [{hashlib.sha256(key.encode()).hexdigest()[:12]}]"


def shard_batch(local_batch: PyTree, policy: ZeroPolicy) -> PyTree:
    """This process's slice of the global batch -> the global batch.

    Every process passes its own rows (the same number on each): the result
    is one global ``jax.Array`` per leaf, of leading size ``local rows x
    processes``, split over the policy's batch axes, with this process's rows
    on its own devices (``jax.make_array_from_process_local_data``). With one
    process it is ``jax.device_put(local_batch, policy.batch_sharding())``.

    Raises a ``ValueError`` (on every process) when the processes' slices
    differ in shape or dtype, naming the leaf and the process, or when a
    slice does not split over this process's devices.

    Example (one process, 8 simulated devices):

    >>> import jax, numpy as np, zero_jax as zj
    >>> policy = zj.ZeroPolicy(stage=1, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> batch = zj.shard_batch({"x": np.ones((16, 3), np.float32)}, policy)
    >>> batch["x"].shape, batch["x"].sharding.spec
    ((16, 3), P('data',))
    """
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(f"shard_batch: policy must be a zj.ZeroPolicy, got {type(policy).__name__}.")
    sharding = policy.batch_sharding()
    pairs, treedef = jax.tree_util.tree_flatten_with_path(local_batch)
    shapes = [[path_str(p), list(np.shape(x)), str(np.dtype(getattr(x, "dtype", np.float32)))] for p, x in pairs]
    scalars = [f"batch leaf '{path}' is a scalar" for path, shape, _ in shapes if not shape]
    if scalars:
        raise ValueError(SCALAR_BATCH_LEAVES.format(leaves=", ".join(scalars)))
    count = jax.process_count()
    if count > 1:
        _check_local_shapes(shapes)
    # The rows this process's devices hold: its share of the batch axes.
    index_map = sharding.addressable_devices_indices_map((policy.num_batch_shards,))
    local_shards = len({idx[0].start for idx in index_map.values()})
    uneven = [f"batch leaf '{path}' has {shape[0]} local rows" for path, shape, _ in shapes if shape[0] % local_shards]
    if uneven:
        raise ValueError(
            UNEVEN_LOCAL_ROWS.format(
                leaves=", ".join(uneven), me=jax.process_index(), k=local_shards, axes=policy.batch_axes
            )
        )
    out = []
    for (_, leaf), (_, shape, _) in zip(pairs, shapes, strict=True):
        global_shape = (shape[0] * count, *shape[1:])
        if count == 1:
            out.append(jax.device_put(leaf, sharding))
        else:
            out.append(jax.make_array_from_process_local_data(sharding, np.asarray(leaf), global_shape))
    return jax.tree_util.tree_unflatten(treedef, out)


def _check_local_shapes(shapes: list[list[Any]]) -> None:
    """Compare every process's batch-slice shapes; name every difference."""
    me = jax.process_index()
    theirs = exchange("batch", json.dumps(shapes), "shard_batch", DEFAULT_TIMEOUT_S)
    differences = [
        f"process {me} has {_describe(mine)}, process {p} has {_describe(yours)}"
        for p, text in theirs.items()
        for mine, yours in itertools.zip_longest(shapes, json.loads(text), fillvalue=None)
        if mine != yours
    ]
    if differences:
        raise ValueError(SLICES_DIFFER.format(differences="; ".join(differences)))


def _describe(entry: list[Any] | None) -> str:
    if entry is None:
        return "no such leaf"
    path, shape, dtype = entry
    return f"leaf '{path}' of shape {tuple(shape)} ({dtype})"
