"""The pieces a manual step hands its loss: :class:`Sharded` nodes, ``gather``,
which makes them whole just before use, and the checks that a loss touches
them only through the library's gathers.

Inside a step built with ``make_train_step(..., gather="manual")`` the loss
function receives each partitioned parameter as a :class:`Sharded` node, not
an array: in stage 3 it holds this device's piece, in stage 2 the whole
parameter plus a slot that receives its reduce-scattered gradient. ``gather``
turns such nodes into ordinary arrays; in stages 0–1 the parameters are
ordinary arrays already and ``gather`` is the identity, so one model runs
under every stage.

A ``jax.tree.map`` over the parameters reaches the pieces anyway, and the
result is silently wrong, so the step traces the loss once more (abstractly)
and names every other use (:func:`check_only_gathered`). ``scan_layers``
(``.scan``) and ``apply_layers`` (``.blocks``) build on these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from zero_jax._base.jaxpr import direct_uses
from zero_jax._base.tree import PyTree, path_str
from zero_jax._comm import collectives as coll
from zero_jax._layerwise.schedule import schedule_for
from zero_jax._layerwise.scope import active_policy
from zero_jax._layout.leaf import LeafLayout, is_layout
from zero_jax._layout.trees import leaf_values
from zero_jax._policy.memory import to_device
from zero_jax._policy.policy import ZeroPolicy

PIECE_AS_ARRAY = (
    "a partitioned parameter of shape {shape}{path} was used as an array: inside make_train_step(..., "
    "gather='manual') run blocks with zj.apply_layers(block_fn, blocks, x, policy) (or zj.scan_layers for "
    "stacked ones) and call zj.gather(params_subtree, policy) for the rest, to get whole parameters just before "
    "use. A block function that closes over params[...] gets this piece instead of the parameter: pass the "
    "parameter in the block's own parameters, or gather it before the call."
)


@jax.tree_util.register_pytree_node_class
class Sharded:
    """A partitioned parameter as a ``gather="manual"`` loss function sees it.

    ``arrays[0]`` is the source: this device's (padded) piece in stage 3, the
    whole parameter in stage 2. ``arrays[1]``, absent for frozen parameters,
    is a zero piece (in the reduce dtype) whose gradient is the parameter's
    reduce-scattered gradient. Use ``zj.gather(node, policy)`` to get the
    parameter. ``policy`` is the step's policy and ``path`` the parameter's
    key path, for errors (both static). ``context`` (static, hashable) is
    what else the trace of code using the piece depends on: it is part of the
    node's structure, so a transform that caches its trace by its arguments'
    structure (Flax's ``nn.jit`` around a model's call) traces again when it
    changes (the Linen adapter puts its layer-wise options there:
    :meth:`with_context`).
    """

    def __init__(
        self, arrays: tuple[jax.Array, ...], layout: LeafLayout, policy: ZeroPolicy, path: str = "", context: Any = ()
    ) -> None:
        self.arrays = tuple(arrays)
        self.layout = layout
        self.policy = policy
        self.path = path
        self.context = context

    def tree_flatten(self) -> tuple[tuple[jax.Array, ...], tuple[LeafLayout, ZeroPolicy, str, Any]]:
        return self.arrays, (self.layout, self.policy, self.path, self.context)

    @classmethod
    def tree_unflatten(cls, aux: tuple[LeafLayout, ZeroPolicy, str, Any], arrays: Any) -> Sharded:
        return cls(tuple(arrays), *aux)

    def with_context(self, context: Any) -> Sharded:
        """The same piece with another ``context`` (hashable)."""
        return Sharded(self.arrays, self.layout, self.policy, self.path, context)

    @property
    def stage(self) -> int:
        """The ZeRO stage of the step that made this piece."""
        return self.policy.stage

    @property
    def gathers(self) -> bool:
        """Whether using it all-gathers (a stage-3 piece) or not (stage 2:
        the whole parameter with a gradient slot)."""
        return self.policy.partitions_params

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's logical shape (what ``gather`` returns)."""
        return self.layout.shape

    @property
    def dtype(self) -> Any:
        return self.layout.dtype

    def __jax_array__(self) -> jax.Array:
        raise TypeError(PIECE_AS_ARRAY.format(shape=self.layout.shape, path=f" ('{self.path}')" if self.path else ""))

    def __repr__(self) -> str:
        where = f"'{self.path}', " if self.path else ""
        return f"Sharded({where}shape={self.layout.shape}, stage={self.stage})"

    def _not_an_array(self, *args: Any, **kwargs: Any) -> Any:
        return self.__jax_array__()

    # Arithmetic, indexing and array methods on a piece are always a mistake:
    # say what to do instead of Python's "unsupported operand".
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _not_an_array
    __truediv__ = __rtruediv__ = __matmul__ = __rmatmul__ = __pow__ = _not_an_array
    __neg__ = __getitem__ = __array__ = astype = reshape = _not_an_array

    def fetch(self, axis: Any) -> jax.Array:
        """The whole, unpadded parameter (all-gather in stage 3)."""
        source = to_device(self.arrays[0])  # offload_params: the host piece comes in just before use
        if len(self.arrays) == 1:  # frozen: forward only
            return coll.fetch(source, self.layout, axis, gather=self.gathers)
        slot = self.arrays[1]
        how = schedule_for(self.policy).grad_reduction_outside
        return coll.fetch_with_grad_slot(source, slot, self.layout, axis, gather=self.gathers, how=how)


def _is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


NOT_A_PIECE = (
    "{where}: {leaves} of the policy's parameters. Pass the parameters loss_fn received (or a "
    "subtree of them), not arrays computed from them."
)
OTHER_POLICY = (
    "{where}: {leaves} pieces of another policy than the step's ({policy!r}). Pass the parameters this step's "
    "loss_fn received."
)


def check_parameter_pieces(tree: PyTree, policy: ZeroPolicy, where: str) -> None:
    """Every leaf the policy would partition must be one of the step's
    pieces; all that are not are named in one error. (With ``param_specs`` a
    leaf's layout depends on its place in the parameter tree, which a subtree
    does not tell: only pieces of another policy are caught then.)"""
    if not policy.partitions_grads:
        return
    foreign, computed = [], []
    judge_plain = policy.param_specs is None
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_sharded)[0]:
        if _is_sharded(leaf):
            if leaf.policy != policy:
                foreign.append(f"'{path_str(path)}'")
        elif judge_plain and policy.leaf_layout(leaf, stacked=False).partitioned:
            computed.append(f"'{path_str(path)}' (shape {tuple(getattr(leaf, 'shape', ()))})")
    if foreign:
        leaves = f"leaf {foreign[0]} is" if len(foreign) == 1 else f"leaves {', '.join(foreign)} are"
        raise ValueError(OTHER_POLICY.format(where=where, leaves=leaves, policy=policy))
    if computed:
        one = len(computed) == 1
        leaves = f"leaf {computed[0]} is not a piece" if one else f"leaves {', '.join(computed)} are not pieces"
        raise ValueError(NOT_A_PIECE.format(where=where, leaves=leaves))


def gather(tree: PyTree, policy: ZeroPolicy | None) -> PyTree:
    """Whole parameters for use, from the pieces a manual-gather step hands
    ``loss_fn``. In the backward pass each gradient is reduce-scattered (the
    transpose of the all-gather). Stages 0–1: the identity. ``policy=None``:
    the identity anywhere (to run the same model on ordinary parameters).

    For the blocks of a model use ``zj.apply_layers`` (or ``zj.scan_layers``)
    instead: XLA moves standalone gathers to the start of the program, so a
    Python loop of ``gather`` calls holds every block whole for the whole step
    (``zj.audit(...).check()`` flags that); the block primitives tie each
    gather to the block's input.

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh, min_shard_size=0)
    >>> def loss_fn(params, batch):
    ...     w = zj.gather(params["w"], policy)  # whole only for this use
    ...     return jnp.mean((batch["x"] @ w) ** 2)
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> state = zj.init_state({"w": jnp.ones((4, 8))}, tx, policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    >>> state, metrics = step(state, {"x": jnp.ones((jax.device_count(), 4))})
    >>> float(metrics["loss"])
    16.0
    """
    policy = active_policy(policy, "zj.gather")
    if policy is None:
        return tree
    check_parameter_pieces(tree, policy, "zj.gather")
    axes = schedule_for(policy).collective_axes(policy.comm)
    return jax.tree.map(lambda x: x.fetch(axes) if _is_sharded(x) else x, tree, is_leaf=_is_sharded)


def embedding_lookup(table: Any, ids: jax.Array, policy: ZeroPolicy | None) -> jax.Array:
    """``table[ids]``: the rows of a (rows, width) table (a token embedding)
    for integer ``ids``, from the piece a manual-gather step hands
    ``loss_fn``, without gathering the table.

    ``zj.gather(table, policy)[ids]`` holds the whole table on every device
    and, in the backward pass, its whole gradient, then reduce-scatters it:
    at a 128k vocabulary and width 4096 that is 2 x 1 GiB of bf16 per device
    and about 2 GiB sent per step. In stage 3 this instead all-gathers the
    batch's ids (integers), looks each up in this device's slice of every
    row's width and hands each device its own ids' rows by one
    ``all_to_all``: about the batch's activations sent each way, not the
    table (the table's piece moves once more, its own size, when the policy
    cuts it by rows); the gradient arrives summed into this device's piece.
    Stages 0-2, ``policy=None`` and tables it cannot index so (kept whole,
    model-sharded, hpZ, int8 gathers, a mesh with axes left to the compiler):
    ``zj.gather(table, policy)[ids]``, the same values. Ids lie in
    [-rows, rows): negative ones count from the end, as in ``table[ids]``
    (one out of range is clamped to the nearest row, which also gets its
    gradient; ``table[ids]``'s autodiff drops it).

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=3, mesh=mesh, min_shard_size=0)
    >>> def loss_fn(params, batch):
    ...     x = zj.embedding_lookup(params["embed"], batch["ids"], policy)  # (batch, width), the table stays cut
    ...     return jnp.mean(x ** 2)
    >>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
    >>> state = zj.init_state({"embed": jnp.ones((64, 8))}, tx, policy)
    >>> step = zj.make_train_step(loss_fn, tx, policy, gather="manual")
    >>> ids = jnp.arange(jax.device_count()) % 64
    >>> state, metrics = step(state, {"ids": ids})
    >>> float(metrics["loss"])
    1.0
    """
    policy = active_policy(policy, "zj.embedding_lookup")
    if policy is None or not _is_sharded(table):
        return gather(table, policy)[ids]
    check_parameter_pieces(table, policy, "zj.embedding_lookup")
    if not table.gathers or coll.why_not_from_pieces(table.layout, policy.comm):
        return gather(table, policy)[ids]
    source, *slot = table.arrays  # a frozen table has no gradient slot
    return coll.look_up_rows(to_device(source), slot[0] if slot else None, ids, table.layout, policy.comm)


PIECES_USED_DIRECTLY = (
    "make_train_step(..., gather='manual'): loss_fn used the partitioned parameter{s} {leaves} directly instead "
    "of through zj.gather, zj.apply_layer(s) or zj.scan_layers. Inside a manual step a partitioned leaf is "
    "this device's piece (stage 3) and a gradient slot, not the parameter, so the result would be silently "
    "wrong (a jax.tree.map or jax.tree.leaves over params reaches the pieces: a weight-decay term is the usual "
    "culprit). Gather what you use first (w = zj.gather(params['w'], policy)), run blocks with "
    "zj.apply_layers, or train with gather='all'."
)


#: Where the library's own code touches pieces: the gathers and their ties run
#: under these name scopes (``blocks``, ``scan``), and the custom
#: VJPs of ``fetch_with_grad_slot``, ``scan_layers`` and ``apply_layer(s)`` are
#: functions named ``zero_jax_*``.
OWN_SCOPES = ("zj_block", "zero_jax")


OWN_PIECE_USERS = frozenset({"all_gather", "pcast", "pvary", "device_put"})


def _own_use(eqn: Any) -> bool:
    if eqn.primitive.name in OWN_PIECE_USERS:
        return True
    # Transformations wrap scope names ("vmap(zj_block0_gather)", "jvp(...)").
    if any(scope in str(eqn.source_info.name_stack) for scope in OWN_SCOPES):
        return True
    if eqn.primitive.name != "custom_vjp_call":
        return False
    # The custom VJP's function name, as its traced program records it ("zero_jax_block at <file>:<line>").
    info = getattr(getattr(eqn.params.get("call_jaxpr"), "jaxpr", None), "debug_info", None)
    return str(getattr(info, "func_src_info", "")).startswith("zero_jax_")


def check_only_gathered(
    loss: Callable[[PyTree, PyTree], Any], params: PyTree, diff: PyTree, layouts: PyTree, *, slots: bool
) -> None:
    """``loss(params, diff)`` may touch a partitioned leaf's piece (and, with
    ``slots``, its gradient slot in ``diff``) only through the library's
    gathers: traced once more, abstractly, every other use is named in one
    error (leaf and operation)."""
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]]
    layout_leaves = jax.tree.leaves(layouts, is_leaf=is_layout)
    diff_leaves = leaf_values(diff, layouts)
    present = [(path, lay) for path, lay, d in zip(paths, layout_leaves, diff_leaves, strict=True) if d is not None]
    names = paths + [path for path, _ in present]
    watched_flags = [lay.dim is not None for lay in layout_leaves] + [
        slots and lay.dim is not None for _, lay in present
    ]
    closed = jax.make_jaxpr(loss)(params, diff)
    watched = {v: i for i, (v, w) in enumerate(zip(closed.jaxpr.invars, watched_flags, strict=True)) if w}
    bad = direct_uses(closed.jaxpr, watched, _own_use)
    if bad:
        leaves = sorted({f"'{names[i]}' (in {', '.join(sorted(ops))})" for i, ops in bad.items()})
        raise TypeError(PIECES_USED_DIRECTLY.format(s="s" if len(leaves) > 1 else "", leaves=", ".join(leaves)))
