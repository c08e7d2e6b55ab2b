"""What every adapter shares: the :class:`Adapted` result, the stacked-subtree
checks, manual-gather support and the layer scan over a model's stacked state.

Nothing here imports Flax or Equinox.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zero_jax._base.tree import PyTree, key_names, path_str, split_prefix, under, under_any
from zero_jax._comm.collectives import to_varying
from zero_jax._layerwise.pieces import Sharded, gather
from zero_jax._layerwise.scan import scan_layers
from zero_jax._layerwise.scope import current_scope
from zero_jax._layout.leaf import is_float
from zero_jax._policy.policy import ZeroPolicy
from zero_jax._step.optimizer import frozen_leaves, shard_optimizer, sharded_parts
from zero_jax._step.state import TrainState, full_params, init_state
from zero_jax._step.train import make_train_step
from zero_jax.adapters._axis_names import specs_for_mesh
from zero_jax.adapters._blocks import Blocks, describe_group, group_pattern, repeated_groups
from zero_jax.adapters._scope import adapter_scope, count_scan, current


class Adapted(NamedTuple):
    """A model from another library, ready for ``zj.init_state`` and
    ``zj.make_train_step`` unchanged.

    Attributes:
      params: the trainable arrays (a pytree; its key paths are the model's
        attribute / collection paths, e.g. ``layers/mlp/kernel``).
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``): rebuilds
        the model from ``params`` and the non-trainable state and calls the
        user's loss on it; when ``stateful``, ``loss_fn(params, model_state,
        batch) -> (out, new_model_state)`` for ``make_train_step(...,
        stateful=True)``. Works with ``gather="all"``, and with
        ``gather="manual"`` when the model runs its stack with the adapter's
        ``scan_layers`` (Linen: ``ScanLayers``).
      stacked: the key-path prefixes of stacked (scanned) layers, checked to
        share one leading layer axis: pass them to ``ZeroPolicy(stacked=...)``
        (or build the policy with :meth:`policy`) so that axis is never cut.
      non_trainable: what the model holds besides ``params`` (NNX variables that
        are not ``nnx.Param``, Linen collections other than ``"params"``,
        Equinox leaves the filter leaves out). The part of it that training
        updates is ``model_state``; the rest is a constant of ``loss_fn``.
      to_model: ``to_model(state_or_params)`` -> the library's own model object
        (an NNX module, a Linen variables dict, an Equinox module, or
        ``(module, eqx.nn.State)``) from a ``TrainState`` (through
        ``zj.full_params``, with the state's *updated* model state) or from a
        params pytree (with the initial model state).
      model_state: the initial non-trainable state that the loss updates
        (NNX batch statistics and RNG counts, Linen ``mutable=``
        collections, an ``eqx.nn.State``): pass it to
        ``zj.init_state(..., model_state=...)``. ``None`` when there is none.
      stateful: whether ``loss_fn`` has the stateful signature (pass it to
        ``make_train_step(..., stateful=...)``).
      layers: the blocks ``layers=`` matched (a :class:`~zero_jax.adapters._blocks.Blocks`:
        ``paths``, ``count``, ``bytes_per_layer``; ``print`` it for a summary), each
        run block-wise (gathered just before its call, in both passes) by a
        ``gather="manual"`` step; ``None`` without ``layers=``.
      param_specs: the model-parallel layout the model declares, one
        ``PartitionSpec`` per leaf of ``params`` (Linen ``nn.with_partitioning``
        / ``nn.with_logical_partitioning`` with ``logical_axis_rules=``, NNX
        ``out_sharding`` metadata; ``P()`` for a leaf that declares none), for
        ``zj.ZeroPolicy(3, mesh, param_specs=adapted.param_specs)`` on a mesh
        with those axes. ``None`` when the model declares nothing (always for
        Equinox, which has no layout metadata: pass ``param_specs=`` to the
        policy yourself).

      frozen: ``True`` for each leaf of ``params`` the adapter's ``trainable=`` filter left out (the frozen base
        of ``from_nnx(model, loss, trainable=nnx.LoRAParam)``), in the structure of ``params``; ``None`` when
        every leaf trains. Frozen leaves are partitioned like parameters (stage 3: 1/N per device, gathered on
        use) and get no gradient, no optimizer state and no gradient communication: :meth:`init_state` and
        :meth:`make_train_step` route them to ``optax.set_to_zero`` (:meth:`optimizer`; on the plain path pass
        ``tx = adapted.optimizer(tx)`` to ``zj.init_state`` and ``zj.make_train_step``).

    With ``layers`` set, :meth:`make_train_step` builds a ``gather="manual"``
    step unless told otherwise: an explicit ``gather="all"`` wins (the step
    hands whole parameters and every block runs as a plain call, as without
    ``layers=``), which is how to compare the two.

    :meth:`init_state` and :meth:`make_train_step` pass ``model_state`` and
    ``stateful`` through, so one training loop serves every model.

    A model that declares its tensor-parallel layout once (here Linen logical
    names; ``nn.with_partitioning`` mesh names or NNX ``out_sharding`` need no
    rules) trains ZeRO over ``data`` and that layout over ``model``::

        adapted = zj.adapters.from_linen(module, variables, loss,
                                         logical_axis_rules=[("mlp", "model"), ("embed", None)])
        adapted.param_specs  # {'Dense_0': {'kernel': P(None, 'model'), 'bias': P('model')}, ...}
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        policy = zj.ZeroPolicy(3, mesh, param_specs=adapted.param_specs)
    """

    params: PyTree
    loss_fn: Callable[[PyTree, PyTree], Any]
    stacked: tuple[str, ...]
    non_trainable: PyTree
    to_model: Callable[[Any], Any]
    model_state: PyTree = None
    stateful: bool = False
    layers: Blocks | None = None
    param_specs: PyTree = None
    frozen: PyTree = None

    def optimizer(self, tx: Any) -> Any:
        """``tx`` (a ``zj.shard_optimizer`` transformation) with the :attr:`frozen` leaves routed to
        ``optax.set_to_zero`` (``shard_optimizer(..., trainable=)``), unless it freezes them already; ``tx``
        itself when nothing is frozen."""
        if self.frozen is None:
            return tx
        parts = sharded_parts(tx)
        if parts is None:
            raise TypeError(NOT_SHARDED_TX.format(kind=type(tx).__name__))
        already = frozen_leaves(parts.inner, self.params)
        flags = zip(jax.tree.leaves(self.frozen), jax.tree.leaves(already), strict=True)
        if all(done for frozen, done in flags if frozen):
            return tx
        trainable = jax.tree.map(lambda frozen: not frozen, self.frozen)
        return shard_optimizer(parts.inner, parts.policy, trainable=trainable)

    def init_state(self, tx: Any, policy: ZeroPolicy) -> TrainState:
        """``zj.init_state(self.params, self.optimizer(tx), policy, model_state=self.model_state)``."""
        return init_state(self.params, self.optimizer(tx), policy, model_state=self.model_state)

    def make_train_step(self, tx: Any, policy: ZeroPolicy, **kwargs: Any) -> Any:
        """``zj.make_train_step(self.loss_fn, self.optimizer(tx), policy, stateful=self.stateful, **kwargs)``,
        with ``gather="manual"`` by default when :attr:`layers` is set (an explicit ``gather=`` wins)."""
        if self.layers is not None:
            kwargs.setdefault("gather", "manual")
        return make_train_step(self.loss_fn, self.optimizer(tx), policy, stateful=self.stateful, **kwargs)

    def policy(self, stage: int, mesh: jax.sharding.Mesh, axis: str | Sequence[str] = "data", **kwargs: Any):
        """``zj.ZeroPolicy(stage, mesh, axis, stacked=self.stacked, param_specs=..., **kwargs)``.

        ``param_specs`` defaults to :attr:`param_specs` placed on ``mesh``: a data-parallel name
        (``"fsdp"``, ``"data"``, ``"dp"``, ...) or a ZeRO axis is dropped (ZeRO partitions over its own axis), a
        tensor-parallel name (``"tp"``, ``"model"``, ...) is the mesh's model axis (none on a data-only mesh),
        a model axis stays (``zero_jax.adapters._specs.specs_for_mesh``); another name is an error naming the
        leaf and the fix. An explicit ``param_specs=`` (``None`` included) wins."""
        stacked = kwargs.pop("stacked", ())
        extra = (stacked,) if isinstance(stacked, str) else tuple(stacked)
        policy = ZeroPolicy(stage, mesh, axis, stacked=self.stacked + extra, **kwargs)
        if "param_specs" in kwargs or self.param_specs is None:
            return policy
        zero_axes = policy.axes + policy.replica_axes
        specs = specs_for_mesh(self.param_specs, zero_axes, policy.model_axes, "adapted.policy")
        if not policy.model_axes:  # a data-only mesh: nothing is model-sharded
            return policy
        return ZeroPolicy(stage, mesh, axis, stacked=self.stacked + extra, param_specs=specs, **kwargs)


NOT_SHARDED_TX = (
    "adapted: the model has frozen parameters (adapted.frozen), so tx must be a zj.shard_optimizer(...) "
    "transformation, whose frozen leaves the adapter routes to optax.set_to_zero; got {kind}. Pass "
    "zj.shard_optimizer(tx, policy)."
)


def params_of(state_or_params: Any) -> PyTree:
    """Ordinary parameters from a TrainState (gathered, unpadded) or as given."""
    return full_params(state_or_params) if isinstance(state_or_params, TrainState) else state_or_params


def model_state_of(state_or_params: Any, model_state: Any, initial: Any) -> Any:
    """The model state ``to_model`` uses: given explicitly, a TrainState's, or the initial one."""
    if model_state is not None:
        return model_state
    if isinstance(state_or_params, TrainState) and state_or_params.model_state is not None:
        return state_or_params.model_state
    return initial


def stateful_signature(fn: Callable[..., Any], where: str) -> Callable[..., Any]:
    """``fn(params, model_state, batch)``, with a clear error when a step made
    without ``stateful=True`` calls it as ``loss_fn(params, batch)``."""

    def loss_fn(params: PyTree, *rest: Any) -> Any:
        if len(rest) != 2:
            raise TypeError(
                f"{where}: this adapted model has model state (adapted.stateful is True), so its loss_fn is "
                "loss_fn(params, model_state, batch) and must be trained by a stateful step: use "
                "adapted.init_state(tx, policy) and adapted.make_train_step(tx, policy), or pass "
                "model_state=adapted.model_state to zj.init_state and stateful=True to zj.make_train_step."
            )
        return fn(params, *rest)

    return loss_fn


def normalize_prefixes(stacked: str | Sequence[str], where: str) -> tuple[str, ...]:
    prefixes = (stacked,) if isinstance(stacked, str) else tuple(stacked)
    bad = [p for p in prefixes if not isinstance(p, str) or not split_prefix(p)]
    if bad:
        shown = ", ".join(repr(p) for p in bad)
        raise TypeError(f"{where}: stacked must be key-path prefixes like 'layers' or 'decoder/blocks', got {shown}.")
    return tuple("/".join(split_prefix(p)) for p in prefixes)


def is_sharded(x: Any) -> bool:
    return isinstance(x, Sharded)


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.shape) if hasattr(leaf, "shape") else ()


_NO_MATCH = (
    "stacked prefix {prefix!r} matches no trainable parameter; top-level entries are {tops}. Pass the path of "
    "the subtree whose leaves carry the leading layer axis."
)
_DEPTHS = (
    "the stacked layers under {prefix!r} disagree on depth: most leaves have {common} layers (e.g. {example}), "
    "but {odd}. Every leaf of a stack needs the same leading layer axis."
)
UNSCANNED_STACK = (
    "stacked={prefix!r} names unscanned blocks: {first} … {last} ({count} sibling subtrees of identical structure, "
    "not one stack with a leading layer axis: their leading sizes are hidden sizes, not a layer count). Drop "
    "{prefix!r} from stacked= and pass layers={pattern!r} (or layers='auto') to gather them block by block."
)


def _stack_problem(prefix: str, param_leaves: list[Any], other_leaves: list[Any]) -> tuple[str, bool] | None:
    """What is wrong with one stacked prefix (and whether it is a depth problem), or None."""
    names = split_prefix(prefix)
    mine = [(p, x) for p, x in param_leaves if under(p, names)]
    if not mine:
        tops = sorted({path_str(p[:1]) for p, _ in param_leaves})
        return _NO_MATCH.format(prefix=prefix, tops=tops), False
    mine += [(p, x) for p, x in other_leaves if under(p, names) and hasattr(x, "shape")]
    depths: dict[int | None, list[str]] = {}
    for p, x in mine:
        shape = _shape(x)
        depths.setdefault(shape[0] if shape else None, []).append(f"'{path_str(p)}' {shape}")
    consistent = len(depths) == 1 and None not in depths
    # Unscanned blocks: a depth disagreement, or list entries (0, 1, ...) whose hidden sizes happen to agree.
    unscanned = _unscanned_under(names, mine, numbered_only=consistent)
    if unscanned is not None:
        return unscanned, False
    if consistent:
        return None
    (common, _), *_ = sorted(depths.items(), key=lambda kv: -len(kv[1]))
    odd = [f"{leaf} (depth {d})" for d, leaves in depths.items() if d != common for leaf in leaves]
    return _DEPTHS.format(prefix=prefix, common=common, example=depths[common][0], odd=", ".join(odd)), True


def _unscanned_under(names: tuple[str, ...], leaves: list[Any], *, numbered_only: bool) -> str | None:
    """The message for a ``stacked=`` prefix whose children are unscanned blocks, or None."""
    n = len(names)
    tree: dict[str, Any] = {}
    for p, x in leaves:
        node = tree
        *parents, last = key_names(p)[n:] or ("",)
        for k in parents:
            node = node.setdefault(k, {})
        node[last] = x
    groups = [g for g in repeated_groups(tree) if len(g[0]) == 1 and (g[0][0].isdigit() or not numbered_only)]
    if not groups:
        return None
    g = groups[0]
    prefix = "/".join(names)
    pattern = f"{prefix}/{group_pattern(g)}"
    first, last = f"{prefix}/{g[0][0]}", f"{prefix}/{g[-1][0]}"
    return UNSCANNED_STACK.format(prefix=prefix, first=first, last=last, count=len(g), pattern=pattern)


def check_not_unscanned(params: PyTree, prefixes: tuple[str, ...], where: str) -> None:
    """A ``stacked=`` prefix over list items (no layer axis, whatever their sizes) is an error naming ``layers=``."""
    pairs = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded)[0]
    for prefix in prefixes:
        names = split_prefix(prefix)
        keys = {p[len(names)] for p, _ in pairs if len(p) > len(names) and under(p, names)}
        index = sorted(i for i in (getattr(k, "key", getattr(k, "idx", None)) for k in keys) if type(i) is int)
        if len(index) >= 2 and len(index) == len(keys):
            first, last, pattern = f"{prefix}/{index[0]}", f"{prefix}/{index[-1]}", f"{prefix}/*"
            text = UNSCANNED_STACK.format(prefix=prefix, first=first, last=last, count=len(index), pattern=pattern)
            raise ValueError(f"{where}: {text}")


def check_stacked(
    params: PyTree, others: PyTree, prefixes: tuple[str, ...], where: str, fix: str, is_leaf: Any = None
) -> None:
    """Every array under a stacked prefix (trainable or not) must carry the
    same leading layer axis; a prefix must match a trainable leaf. Every
    prefix's problem is named in one error."""
    param_leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_leaf)[0]
    other_leaves = jax.tree_util.tree_flatten_with_path(others, is_leaf=is_leaf)[0]
    problems = [q for q in (_stack_problem(p, param_leaves, other_leaves) for p in prefixes) if q is not None]
    if problems:
        depth = any(is_depth for _, is_depth in problems)
        raise ValueError(f"{where}: " + " ".join(text for text, _ in problems) + (f" {fix}" if depth else ""))


def active_policy() -> ZeroPolicy | None:
    """The policy of the manual-gather step being traced, or None (outside a
    step, or a step that hands ``loss_fn`` whole parameters)."""
    return current_scope().policy


def per_device(tree: PyTree) -> PyTree:
    """A block's outputs as per-device values (varying over the step's axes) inside a manual step; as given
    outside one. A block may return a value that is the same on every device (T5's block 0 hands a constant
    zero cross-attention bias to the blocks after it); its cotangent comes back per device, and one given to
    the per-block primitive for an unused output is per-device zeros, which must match the output's type.
    The cast's transpose sums the per-device cotangents, as autodiff would for that value."""
    policy = active_policy()
    if policy is None:
        return tree

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact):
            return to_varying(x, policy.comm)
        return x

    return jax.tree.map(one, tree)


UNDECLARED_BLOCKS = (
    "{where}: under make_train_step(..., gather='manual') this model's parameters reach it as partitioned pieces, "
    "and its blocks are unscanned and undeclared: {groups}. Without layers= (or stacked=) the step would gather "
    "every parameter once and keep it whole through the backward pass (no memory saved over gather='all'). Pass "
    "layers='auto' (or layers={pattern!r}) to the adapter to gather them block by block, or train with "
    "gather='all'."
)


def check_declared_blocks(params: PyTree, groups: Sequence[tuple[tuple[str, ...], ...]], where: str) -> None:
    """A stage-3 manual step on a model with repeated unscanned blocks and
    neither ``layers=`` nor ``stacked=`` (``groups``: :func:`repeated_groups`
    of its parameters) would hold the whole model: say to pass ``layers=``."""
    policy = active_policy()
    if not groups or policy is None or not policy.partitions_params:
        return
    if not any(is_sharded(x) for x in jax.tree.leaves(params, is_leaf=is_sharded)):
        return
    shown = ", ".join(describe_group(g) for g in groups[:3])
    raise ValueError(UNDECLARED_BLOCKS.format(where=where, groups=shown, pattern=group_pattern(groups[0])))


def gather_unstacked(params: PyTree, prefixes: tuple[str, ...], where: str) -> PyTree:
    """Manual-gather steps: make every partitioned leaf outside the stacked
    subtrees whole (gathered once for the whole step); stacked leaves stay
    pieces for ``scan_layers``. Nothing to do for whole parameters."""
    if not any(is_sharded(x) for x in jax.tree.leaves(params, is_leaf=is_sharded)):
        return params
    policy = active_policy()
    if policy is None:  # pragma: no cover - Sharded nodes only exist inside a manual step
        raise RuntimeError(f"{where}: got partitioned parameters outside a train step.")

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if is_sharded(x) and not under_any(path, map(split_prefix, prefixes)):
            return gather(x, policy)
        return x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_sharded)


@contextlib.contextmanager
def explain_unscanned_pieces(params: PyTree, prefixes: tuple[str, ...], where: str, drop_in: str) -> Iterator[None]:
    """In a manual-gather step, stacked leaves reach the model as pieces that
    only the adapter's ``scan_layers`` can run; a model that runs its stack
    another way (``nnx.scan``, ``lax.scan``) fails deep inside that transform.
    Say why and what to do instead."""
    pieces = [
        path_str(p)
        for p, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded)[0]
        if is_sharded(x) and under_any(p, map(split_prefix, prefixes))
    ]
    with adapter_scope():
        try:
            yield
        except Exception as e:
            if pieces and not current().scans:
                raise TypeError(
                    f"{where}: under make_train_step(..., gather='manual') the stacked layers reach the model as "
                    f"partitioned pieces (e.g. '{pieces[0]}'), which only {drop_in} can run, and the model did not "
                    f"call it. Run the stack with {drop_in}(fn, self.layers, x) (a drop-in for the scan), or train "
                    f"with gather='all'. The error was: {type(e).__name__}: {e}"
                ) from e
            raise


def scan_stacked(
    layer_fn: Callable[[PyTree, PyTree, Any], Any],
    scanned: PyTree,
    indexed: PyTree,
    carry: Any,
    *,
    prefetch: int,
    remat: bool,
) -> Any:
    """``layer_fn(layer_scanned, layer_indexed, carry) -> carry`` over the
    leading axis of ``scanned`` with ``zj.scan_layers`` (pieces gathered
    layer by layer inside a manual-gather step; a plain scan otherwise).

    ``indexed`` is stacked state that is not differentiated (integers, RNG
    keys, batch statistics): it is closed over and sliced by a layer counter
    carried beside ``carry`` (a float, so the custom VJP of ``scan_layers``
    sees only float carries).
    """
    count_scan()
    policy = active_policy()
    if not jax.tree.leaves(indexed):
        return scan_layers(lambda p, c: layer_fn(p, None, c), scanned, carry, policy, prefetch=prefetch,
                                   remat=remat)  # fmt: skip

    def body(p: PyTree, c: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
        x, i = c
        layer = jax.tree.map(lambda a: a[i.astype(jnp.int32)], indexed)
        return layer_fn(p, layer, x), i + 1

    out, _ = scan_layers(body, scanned, (carry, jnp.zeros((), jnp.float32)), policy, prefetch=prefetch, remat=remat)
    return out


NOT_OUT_UPDATES = (
    "{where}: with mutable={mutables} the loss must return (out, updates), updates being the dict of updated "
    "collections that module.apply(variables, x, mutable=[...]) returns besides its output; got {got}."
)
EXTRA_COLLECTIONS = (
    "{where}: the loss returned updated {extra}, which {verb} not in mutable={mutables}: add {them} to mutable= "
    "to carry {them}, or leave {them} out of what the loss returns."
)


def carried_updates(
    result: Any, mutables: tuple[str, ...], model_state: PyTree, where: str, thaw: Callable[[Any], Any]
) -> tuple[Any, PyTree]:
    """A stateful loss's ``(out, updates)`` -> ``(out, new model state)``: every
    ``mutable=`` collection, updated or as it was (``thaw``: Flax's
    ``unfreeze``, for a FrozenDict of updates)."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping)):
        raise TypeError(NOT_OUT_UPDATES.format(where=where, mutables=list(mutables), got=type(result).__name__))
    out, updates = result
    extra = sorted(set(updates) - set(mutables))
    if extra:
        one = len(extra) == 1
        shown = ("collection " if one else "collections ") + ", ".join(repr(c) for c in extra)
        verb, them = ("is", "it") if one else ("are", "them")
        raise ValueError(
            EXTRA_COLLECTIONS.format(where=where, extra=shown, verb=verb, them=them, mutables=list(mutables))
        )
    return out, {c: thaw(updates[c]) if c in updates else model_state[c] for c in mutables}


NOT_FLOAT = (
    "{where}: {leaves}. Only floating-point arrays can be trained: keep non-float state in another collection "
    "(self.variable('state', ...)), not in 'params'."
)


def check_trainable_floats(trained: PyTree, where: str) -> None:
    """Every trained variable is a float array; all that are not, named in one error."""
    bad = [
        f"trainable variable '{path_str(path)}' is {describe(leaf)}, not a float array"
        for path, leaf in jax.tree_util.tree_flatten_with_path(trained)[0]
        if not hasattr(leaf, "dtype") or not is_float(leaf)
    ]
    if bad:
        raise ValueError(NOT_FLOAT.format(where=where, leaves="; ".join(bad)))


def describe(leaf: Any) -> str:
    """A leaf as an error message names it: shape and dtype, or its type."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"an array of shape {tuple(leaf.shape)} and dtype {jnp.dtype(leaf.dtype)}"
    text = repr(leaf)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(leaf).__name__} ({text})"
