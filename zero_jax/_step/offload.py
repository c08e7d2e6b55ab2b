"""Offload: optimizer state, master weights and stage-3 parameters in host memory.

ZeRO-Offload keeps the float32 optimizer state in host memory and streams it
through the device for the update; ZeRO-Infinity does the same with the
partitioned parameters. In JAX "where an array lives" is the *memory kind* of
its sharding (``"device"`` or ``"pinned_host"``), so offload is three things:

1. placement: :func:`offload_plan` picks the leaves that live in ``pinned_host``
   between steps (all of them, or a fraction of the bytes, largest leaves
   first), and :func:`with_host` gives their shardings that memory kind
   (the memory kinds themselves, the options and ``to_device`` live in
   ``_policy.memory``);
2. streaming: :func:`streamed` runs the optimizer update chunk by chunk. A
   chunk is a set of offloaded leaves that the update mixes (Adam's ``mu``,
   ``nu`` and master copy of one parameter), found by a data-dependence walk
   over the traced update, so it holds for any optax transformation; one
   that mixes all leaves (a global-norm clip inside ``tx``) is one chunk.
   Chunk k is moved to the device only after chunk k-1 has been written back
   (an ``optimization_barrier`` orders the transfers), so the device holds
   one chunk of offloaded state at a time;
3. parameters (stage 3): each piece is moved to the device just before it is
   gathered; inside ``scan_layers`` that is one layer at a time.

What XLA:CPU does with this (measured, jax 0.10.2): CPU devices expose the
``pinned_host`` memory kind, arrays live there and jit accepts and returns
them; but in-jit ``device_put`` between memory kinds lowers to nothing on CPU
(only TPU and GPU emit the transfer), the compiled program reads the host
buffers in place, ``optimization_barrier`` is expanded away, and
``memory_analysis()`` reports every argument as device bytes
(``host_*_size_in_bytes`` are 0). So on CPU the placement is real and
measurable per memory kind; the chunked transfers only take effect on
backends that run XLA's host-offload passes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._base import jaxpr as _jaxpr
from zero_jax._base.tree import PyTree, path_str
from zero_jax._layout.leaf import is_layout, is_real_float
from zero_jax._policy.memory import DEVICE, HOST, is_host, to_device

# -- which leaves live in host memory ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OffloadedLeaf:
    """One state leaf and where it lives between steps."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int  # per device
    host: bool


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """Where each optimizer-state, master and parameter leaf lives between steps.

    Attributes:
      leaves: every float leaf of ``opt_state``, ``master`` and ``params``
        (paths as ``opt_state/...``), with per-device bytes.
      opt_state, master, params: per-leaf ``True`` (host) / ``False`` flags in
        the flattening order of those fields.
    """

    leaves: tuple[OffloadedLeaf, ...]
    opt_state: tuple[bool, ...]
    master: tuple[bool, ...]
    params: tuple[bool, ...]

    @property
    def host_bytes(self) -> int:
        """Per-device bytes that live in ``pinned_host``."""
        return sum(leaf.nbytes for leaf in self.leaves if leaf.host)

    @property
    def device_bytes(self) -> int:
        """Per-device bytes of these leaves that stay in device memory."""
        return sum(leaf.nbytes for leaf in self.leaves if not leaf.host)


def _per_device_bytes(lay: Any, partitioned: bool, num_shards: int) -> int:
    if partitioned and lay.dim is not None:
        return lay.nbytes // num_shards
    return int(np.prod(lay.shape, dtype=np.int64)) * np.dtype(lay.dtype).itemsize


NOT_A_STATE = (
    "zj.offload_plan: expects a TrainState (what zj.init_state returns, abstract or not), got {kind}. "
    "Build the state first: zj.offload_plan(zj.init_state(params, tx, policy))."
)


def offload_plan(state: Any) -> OffloadPlan:
    """Which leaves of a (possibly abstract) ``TrainState`` live in host memory.

    Candidates for ``offload_optimizer`` are the float leaves of the
    optimizer state and of the master copy; ``fraction`` of their per-device
    bytes is offloaded, whole leaves, largest first (ties in tree order), so
    at least that share goes. Integer leaves (step counters) stay on the
    device: every chunk of the update reads them. With ``offload_params``
    every partitioned parameter lives on the host (leaves kept whole, below
    ``min_shard_size``, stay on the device).

    >>> import jax, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=2, mesh=mesh, offload_optimizer=0.5)
    >>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    >>> params = {"w": jax.ShapeDtypeStruct((4096, 512), "float32"), "b": jax.ShapeDtypeStruct((512,), "float32")}
    >>> state = zj.init_state(params, tx, policy)  # abstract: nothing allocated
    >>> [leaf.path for leaf in zj.offload_plan(state).leaves if leaf.host]  # Adam's mu and nu of w
    ['opt_state/0/mu/w', 'opt_state/0/nu/w']
    >>> state.opt_state.inner_state[0].mu["w"].sharding.memory_kind
    'pinned_host'
    """
    if not all(hasattr(state, field) for field in ("policy", "opt_state", "layouts", "master")):
        raise TypeError(NOT_A_STATE.format(kind=type(state).__name__))
    policy = state.policy
    n = policy.num_shards
    opt_pairs = jax.tree_util.tree_flatten_with_path(state.opt_state.layouts.tree(), is_leaf=is_layout)[0]
    param_pairs = jax.tree_util.tree_flatten_with_path(state.layouts.tree(), is_leaf=is_layout)[0]
    master_pairs = param_pairs if state.master is not None else []
    cands = []  # (bytes, order, field, index)
    for field, pairs in (("opt_state", opt_pairs), ("master", master_pairs)):
        for i, (_, lay) in enumerate(pairs):
            if is_real_float(lay):
                cands.append((_per_device_bytes(lay, policy.partitions_opt_state, n), len(cands), field, i))
    target = policy.offload_optimizer * sum(c[0] for c in cands)
    chosen: set[tuple[str, int]] = set()
    taken = 0
    for nbytes, _, field, i in sorted(cands, key=lambda c: (-c[0], c[1])):
        if policy.offload_optimizer <= 0 or taken >= target:
            break
        chosen.add((field, i))
        taken += nbytes
    params_host = tuple(policy.offload_params and is_real_float(lay) and lay.partitioned for _, lay in param_pairs)
    leaves = []
    for field, pairs, partitioned in (
        ("opt_state", opt_pairs, policy.partitions_opt_state),
        ("master", master_pairs, policy.partitions_opt_state),
        ("params", param_pairs, policy.partitions_params),
    ):
        for i, (path, lay) in enumerate(pairs):
            if not is_real_float(lay):
                continue
            host = params_host[i] if field == "params" else (field, i) in chosen
            nbytes = _per_device_bytes(lay, partitioned, n)
            if field == "params":
                nbytes = nbytes * np.dtype(policy.precision.compute_dtype).itemsize // np.dtype(lay.dtype).itemsize
            leaves.append(OffloadedLeaf(f"{field}/{path_str(path)}", lay.shape, np.dtype(lay.dtype), nbytes, host))
    return OffloadPlan(
        leaves=tuple(leaves),
        opt_state=tuple(("opt_state", i) in chosen for i in range(len(opt_pairs))),
        master=tuple(("master", i) in chosen for i in range(len(master_pairs))),
        params=params_host,
    )


def with_host(shardings: PyTree, flags: Sequence[bool]) -> PyTree:
    """``shardings`` (one field of a state's shardings, in flattening order)
    with the leaves flagged by an :class:`OffloadPlan` moved to ``pinned_host``."""
    leaves, treedef = jax.tree.flatten(shardings)
    return jax.tree.unflatten(
        treedef, [s.with_memory_kind(HOST) if h else s for s, h in zip(leaves, flags, strict=True)]
    )


# -- streaming the update ------------------------------------------------------------------


def chunks(fn: Callable[..., Any], args: Sequence[Any], host: Sequence[bool]) -> list[list[int]]:
    """The chunks of ``fn``'s offloaded inputs: groups of input indices
    (among those with ``host[i]``) that some output of ``fn`` mixes.

    ``fn`` maps a flat list of arrays to a flat list of as many arrays
    (output i is the new value of input i). Inputs that stay on the device
    (a step counter, the gradients) link nothing: every chunk may read them.
    """
    deps = _jaxpr.output_dependencies(fn, list(args))
    host_mask = sum(1 << i for i, h in enumerate(host) if h)
    parent = list(range(len(args)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for m in deps:
        bits = [i for i in range(len(args)) if (m & host_mask) >> i & 1]
        for b in bits[1:]:
            parent[root(b)] = root(bits[0])
    groups: dict[int, list[int]] = {}
    for i, h in enumerate(host):
        if h:
            groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())


def streamed(
    fn: Callable[[list[jax.Array]], list[jax.Array]],
    args: Sequence[jax.Array],
    host_shardings: Sequence[Any],
) -> list[jax.Array]:
    """Run ``fn`` (flat inputs -> flat new values, output i replacing input i)
    inside ``jit`` with the inputs whose ``host_shardings[i]`` is not None
    living in host memory, one chunk at a time.

    For each chunk the chunk's inputs are moved to the device, ``fn`` is
    traced with every other offloaded input replaced by zeros (those outputs
    are dropped, and dead code is removed, so the chunk's program reads only
    its own state), and the chunk's outputs are written back to the host.
    Chunk k's transfer to the device waits, through an
    ``optimization_barrier``, for chunk k-1's write-back.
    """
    host = [s is not None for s in host_shardings]
    if not any(host):
        return list(fn(list(args)))
    groups = chunks(fn, args, host)
    deps = _jaxpr.output_dependencies(fn, list(args))
    host_mask = sum(1 << i for i, h in enumerate(host) if h)
    results: list[Any] = [None] * len(args)
    prev: tuple[jax.Array, ...] = ()
    for group in groups:
        members = set(group)
        incoming = {i: args[i] for i in group}
        if prev:  # this chunk comes in only once the previous one is written back
            incoming, _ = jax.lax.optimization_barrier((incoming, prev))
        call_args = []
        for i, x in enumerate(args):
            if not host[i]:
                call_args.append(x)
            elif i in members:
                call_args.append(jax.device_put(incoming[i], host_shardings[i].with_memory_kind(DEVICE)))
            else:
                call_args.append(jnp.zeros(x.shape, x.dtype))  # never read by this chunk's outputs
        outs = fn(call_args)
        written = []
        for j, y in enumerate(outs):
            if results[j] is not None:
                continue
            if deps[j] & host_mask == 0 or (deps[j] & host_mask) & sum(1 << i for i in group):
                if host[j]:
                    y = jax.device_put(y, host_shardings[j])
                    written.append(y)
                results[j] = y
        prev = tuple(written) or prev
    return results


def stream_update(
    update: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], master: PyTree, state: Any, shardings: Any
) -> Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]:
    """``update(master, opt_state) -> (new_master, new_opt_state)`` run by
    :func:`streamed`, with host placement read off the state's ``shardings``.

    The optimizer's view of the parameters is the master copy, or in stages 0
    and 3 without mixed precision the parameters themselves (host-resident
    under ``offload_params``); in stages 1-2 it is a slice of the whole
    parameters, which live on the device.
    """
    policy = state.policy
    if state.master is not None:
        master_shardings = jax.tree.leaves(shardings.master)
    elif policy.partitions_params or not policy.partitions_opt_state:  # stages 0 and 3
        master_shardings = jax.tree.leaves(shardings.params)
    else:
        master_shardings = [None] * len(jax.tree.leaves(master))
    host_shardings = [
        s if s is not None and s.memory_kind == HOST else None
        for s in master_shardings + jax.tree.leaves(shardings.opt_state)
    ]

    def run(master: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        leaves, treedef = jax.tree.flatten((master, opt_state))

        def flat(xs: list[jax.Array]) -> list[jax.Array]:
            out = update(*jax.tree.unflatten(treedef, xs))
            out_leaves, out_def = jax.tree.flatten(out)
            assert out_def == treedef, (out_def, treedef)
            return out_leaves

        return jax.tree.unflatten(treedef, streamed(flat, leaves, host_shardings))

    return run


def for_compute(new_master: PyTree, param_shardings: PyTree, compute_dtype: Any) -> PyTree:
    """The updated master leaves the compute copy is made from, in the memory
    it is made in: a host master leaf whose parameter lives on the device (or
    needs a cast) is read back to the device; one that *is* the stored
    parameter (same dtype, parameter offloaded) stays on the host."""

    def one(x: jax.Array, s: Any) -> jax.Array:
        same = not is_real_float(x) or x.dtype == jnp.dtype(compute_dtype)
        return x if (s.memory_kind == HOST and same) else to_device(x)

    return jax.tree.map(one, new_master, param_shardings)


def to_memory_kinds(state: Any, shardings: Any) -> Any:
    """Move each leaf of the new state computed on the device to the host
    when its sharding says ``pinned_host`` (leaves written back chunk by
    chunk are there already)."""

    def one(x: jax.Array, s: Any) -> jax.Array:
        return jax.device_put(x, s) if s.memory_kind == HOST and not is_host(x) else x

    return jax.tree.map(one, state, shardings)
