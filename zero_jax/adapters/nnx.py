"""Flax NNX models under ZeRO: ``from_nnx`` and the layer-wise ``scan_layers``.

The model is split once with ``nnx.split(model, trainable, ...)``: the trainable variables (``nnx.Param`` by
default) become ``params``, a nested dict of arrays keyed by attribute path (``layers/lin/kernel``); everything else
(``nnx.BatchStat``, RNG keys and counts, any other ``nnx.Variable``) is ``non_trainable``. ``loss_fn(params,
batch)`` merges a fresh model from both (``nnx.merge``) and calls ``loss(model, batch)``.

A ``trainable=`` filter that leaves some ``nnx.Param`` out (``trainable=nnx.LoRAParam``: LoRA the NNX way) leaves
a *frozen base*: those float parameters are in ``params`` too, marked ``adapted.frozen``, so a policy partitions
them like any parameter (stage 3: 1/N per device, gathered on use) while they get no gradient, no optimizer state
and no gradient communication (``adapted.init_state`` / ``adapted.make_train_step`` route them to
``optax.set_to_zero``: :meth:`~zero_jax.adapters.Adapted.optimizer`). Other non-trainable state is never trained
and never partitioned: every device holds it whole. A loss that *updates* it
(batch norm in training mode updating its running statistics, ``nnx.Dropout`` advancing the model's RNG counts) has
its updates carried from step to step (``state_updates="carry"``, the default): the non-trainable arrays (every one
but RNG keys, which NNX never changes) are the adapter's ``model_state``, held in ``TrainState.model_state``, and
``loss_fn`` has the stateful signature (``adapted.stateful``). Each device updates them from its own slice of the
batch and the step averages float values over the devices (data-parallel batch norm, as PyTorch DDP; RNG counts
agree). A variable the loss leaves alone keeps its value bitwise. ``state_updates="discard"`` drops the updates on
purpose (the model's state is then a constant; a discarded RNG count replays the same dropout mask every step) and
``"error"`` raises naming the variable the loss updated.

Layer-wise ZeRO-3: stacked layers (made with ``nnx.vmap`` over a layer axis) are declared with ``stacked=`` so the
policy never cuts that axis. Running the stack with :func:`scan_layers` instead of ``nnx.scan`` lets a
``make_train_step(..., gather="manual")`` step gather one layer at a time (``zj.scan_layers``); elsewhere
(``gather="all"``, evaluation) it is a plain scan, so one model runs everywhere. Unscanned blocks (an ``nnx.List``
of modules called in a Python loop) are named with ``layers=``: in a manual step (the default of
``adapted.make_train_step`` then) each is swapped, in the rebuilt model, for a stand-in whose call runs the block
through ``zj.apply_layer``'s chain (gathered just before use, in both passes); the model is not rewritten.

>>> import jax, jax.numpy as jnp, optax, zero_jax as zj
>>> from flax import nnx
>>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
>>> def loss(model, batch):
...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
>>> adapted = zj.adapters.from_nnx(model, loss)
>>> jax.tree.map(jnp.shape, adapted.params)
{'bias': (2,), 'kernel': (4, 2)}
>>> policy = adapted.policy(stage=3, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
>>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
>>> state = zj.init_state(adapted.params, tx, policy)
>>> step = zj.make_train_step(adapted.loss_fn, tx, policy)
>>> state, metrics = step(state, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
>>> trained = adapted.to_model(state)  # an nnx.Linear again
>>> type(trained).__name__, trained(jnp.ones((1, 4))).shape
('Linear', (1, 2))

With batch norm in training mode the running statistics are model state:

>>> model = nnx.Sequential(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
>>> adapted = zj.adapters.from_nnx(model, loss)
>>> adapted.stateful, jax.tree.map(jnp.shape, adapted.model_state)
(True, {'layers': {1: {'mean': (2,), 'var': (2,)}}})
>>> state = adapted.init_state(tx, policy)  # zj.init_state(..., model_state=adapted.model_state)
>>> step = adapted.make_train_step(tx, policy)  # zj.make_train_step(..., stateful=True)
>>> state, metrics = step(state, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
>>> adapted.to_model(state).layers[1].mean[...].shape  # the updated statistics
(2,)
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import jax
import numpy as np
from flax import nnx

from zero_jax._base.tree import PyTree, key_names, path_str
from zero_jax._layerwise.blocks import LayerChain
from zero_jax._layerwise.pieces import gather
from zero_jax._layout.leaf import is_codes, is_float
from zero_jax.adapters._blocks import (
    Blocks,
    block_params,
    check_layer_options,
    find_blocks,
    gather_outside,
    repeated_groups,
    split_arrays,
)
from zero_jax.adapters._common import (
    Adapted,
    active_policy,
    check_declared_blocks,
    check_not_unscanned,
    check_stacked,
    describe,
    explain_unscanned_pieces,
    gather_unstacked,
    is_sharded,
    model_state_of,
    normalize_prefixes,
    params_of,
    scan_stacked,
    stateful_signature,
)
from zero_jax.adapters._scope import adapter_scope, current
from zero_jax.adapters._specs import check_rules, nnx_specs

__all__ = ["from_nnx", "scan_layers"]

_WHERE = "zj.adapters.from_nnx"
_DEPTH_FIX = (
    "Build the whole stack with one nnx.vmap over the layer axis (e.g. nnx.split_rngs(splits=depth) + "
    "nnx.vmap(make_layer, in_axes=0)), and keep unstacked modules out of the stacked= subtree."
)
_StateUpdates = Literal["carry", "discard", "error"]


def _is_value_key(k: Any) -> bool:
    return isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value"


def _strip(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A State leaf path (``.../kernel/.value``) as its pure-dict path."""
    return path[:-1] if path and _is_value_key(path[-1]) else path


class _Rebuild:
    """Turns a pure dict of (possibly Sharded) values back into an ``nnx.State`` of fresh Variables, so a merged
    model never aliases the template's."""

    def __init__(self, state: nnx.State) -> None:
        pairs, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.paths = [jax.tree_util.keystr(_strip(p)) for p, _ in pairs]
        self.leaves = [x for _, x in pairs]

    def with_values(self, values: dict[str, Any]) -> nnx.State:
        """The template's values, those named in ``values`` (by key string) replaced."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [values.get(p, x) for p, x in zip(self.paths, self.leaves, strict=True)]
        )

    def __call__(self, pure: PyTree | None = None, extra: dict[str, Any] | None = None) -> nnx.State:
        """The template with the values of ``pure`` (and ``extra``: values by key string, a block's borrowed
        parameters)."""
        if pure is None:
            return jax.tree_util.tree_unflatten(self.treedef, self.leaves)
        pairs = jax.tree_util.tree_flatten_with_path(pure, is_leaf=is_sharded)[0]
        flat = {jax.tree_util.keystr(p): x for p, x in pairs} | (extra or {})
        if set(flat) != set(self.paths):
            missing, unexpected = sorted(set(self.paths) - set(flat)), sorted(set(flat) - set(self.paths))
            raise ValueError(
                f"{_WHERE}: the parameters do not match the model: missing {missing}, unexpected {unexpected}. "
                "Pass the params of this adapter (or a TrainState made from them)."
            )
        return jax.tree_util.tree_unflatten(self.treedef, [flat[p] for p in self.paths])


def _snapshot(model: nnx.Module) -> dict[str, tuple[Any, Any]]:
    """Every variable of ``model`` by path: (its Variable type, its value)."""
    out = {}
    for path, var in jax.tree_util.tree_flatten_with_path(
        nnx.state(model), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]:
        out[path_str(path)] = (type(var).__name__, var.get_value())
    return out


def _check_unchanged(
    before: dict[str, tuple[Any, Any]], model: nnx.Module, where: str, carried: frozenset[str] = frozenset()
) -> None:
    after = _snapshot(model)
    updated = []
    for path, (kind, value) in before.items():
        if path in carried:
            continue
        new = after.get(path, (kind, value))[1]
        # Compare the arrays, not their containers: NNX may re-wrap a partitioned
        # (Sharded) value in a new node holding the same pieces.
        old_leaves, new_leaves = jax.tree.leaves(value), jax.tree.leaves(new)
        if len(old_leaves) != len(new_leaves) or any(a is not b for a, b in zip(old_leaves, new_leaves, strict=True)):
            updated.append(f"{kind} '{path}' ({describe(value)})")
    if updated:
        raise ValueError(_UPDATED.format(where=where, updated=", ".join(updated)) + _SCAN_NOTE.get(where, ""))


_UPDATED = (
    "{where}: the loss updated {updated}, but a zero_jax step keeps only the trainable parameters: the update "
    "would be lost every step. Make the forward pass leave it alone (e.g. nnx.BatchNorm(use_running_average=True), "
    "deterministic dropout, or RNG keys passed in the batch), or pass state_updates='discard' to from_nnx to drop "
    "such updates on purpose."
)
_NOT_FLOAT = (
    "{where}: {leaves}. Only floating-point arrays can be trained: wrap them in another nnx.Variable type (not "
    "nnx.Param) or narrow the trainable= filter."
)


_NOTHING_TRAINABLE = (
    "{where}: trainable={filter!r} matches no variable of the model (its variables are {kinds}). Name a Variable "
    "type the model holds: nnx.Param for the whole model, nnx.LoRAParam for LoRA (after wrapping its layers with "
    "nnx.LoRA / nnx.LoRALinear, or qwix's LoRA provider)."
)


def _frozen_base(path: Any, x: Any) -> bool:
    """An ``nnx.Param`` holding floats or the 8-bit integer codes of a quantized weight (QLoRA's base): the
    filter that adds the frozen base to what ``trainable=`` selects."""
    del path
    return isinstance(x, nnx.Param) and (is_float(x.get_value()) or is_codes(x.get_value()))


def _frozen_mask(param_state: nnx.State, params: PyTree, trained: set[tuple[Any, ...]]) -> PyTree | None:
    """``True`` for each leaf of ``params`` the ``trainable=`` filter left out (the frozen base), in its structure;
    None when every leaf trains."""
    flags = {tuple(str(k) for k in keys): keys not in trained for keys, _ in nnx.to_flat_state(param_state)}
    if not any(flags.values()):
        return None
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree.unflatten(treedef, [flags[key_names(p)] for p, _ in pairs])


def _trained_only(params: PyTree, frozen: PyTree) -> PyTree:
    """``params`` without its frozen leaves (those may be integer codes)."""
    return jax.tree.map(lambda x, f: None if f else x, params, frozen)


def _check_trainable_floats(params: PyTree) -> None:
    """Every trainable variable is a float array; all that are not, named in one error."""
    bad = [
        f"trainable variable '{path_str(path)}' is {describe(leaf)}, not a float array"
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        if not hasattr(leaf, "shape") or not is_float(leaf)
    ]
    if bad:
        raise ValueError(_NOT_FLOAT.format(where=_WHERE, leaves="; ".join(bad)))


_SCAN_NOTE = {
    "zj.adapters.nnx.scan_layers": " (Updates made inside zj.adapters.nnx.scan_layers cannot be carried out of the "
    "layer scan; state_updates='carry' keeps only updates made outside it.)"
}


def _carried(x: Any) -> bool:
    """A non-trainable value carried as model state: an array, but not an RNG key (NNX never changes keys)."""
    return isinstance(x, (jax.Array, np.ndarray)) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # pyright: ignore[reportPrivateImportUsage] - public at runtime, not re-exported in the stubs


def _carried_pairs(rest: nnx.State) -> list[tuple[tuple[Any, ...], Any]]:
    """The (pure-dict key path, value) of every non-trainable value carried as model state."""
    return [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(rest))[0] if _carried(x)]


def _nest(pairs: list[tuple[tuple[Any, ...], Any]]) -> dict[Any, Any]:
    """Pure-dict (key path, value) pairs -> the nested dict."""
    out: dict[Any, Any] = {}
    for path, x in pairs:
        node = out
        keys = [k.key for k in path]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = x
    return out


def _flat(pure: PyTree) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(pure)[0]}


def _check_inputs(model: Any, loss: Any, state_updates: Any) -> None:
    if not isinstance(model, nnx.Module):
        hint = ""
        mod = type(model).__module__
        if mod.startswith("flax.linen") or hasattr(model, "init_with_output"):
            hint = " It is a Flax Linen module: use zj.adapters.from_linen(module, variables, loss)."
        elif mod.startswith("equinox") or "equinox" in str(type(type(model))):
            hint = " It is an Equinox module: use zj.adapters.from_equinox(model, loss)."
        elif hasattr(model, "params") and hasattr(getattr(model, "module", None), "init_with_output"):
            hint = (
                " It looks like a Hugging Face Flax model (a Linen module and its params): use "
                "zj.adapters.from_linen(model, loss)."
            )
        raise TypeError(f"{_WHERE}: model must be a flax.nnx.Module, got {type(model).__name__}.{hint}")
    if not callable(loss):
        raise TypeError(f"{_WHERE}: loss must be callable as loss(model, batch), got {type(loss).__name__}.")
    if state_updates not in ("carry", "discard", "error"):
        raise ValueError(f"{_WHERE}: state_updates must be 'carry', 'discard' or 'error', got {state_updates!r}.")


def _get(parent: Any, key: Any) -> Any:
    return parent[key] if isinstance(key, int) else getattr(parent, key)


def _put(parent: Any, key: Any, value: Any) -> None:
    parent.__setitem__(key, value) if isinstance(key, int) else setattr(parent, key, value)


def _node(model: Any, keys: tuple[Any, ...]) -> Any:
    for k in keys:
        model = _get(model, k)
    return model


class _BlockSpec(NamedTuple):
    """How block i is rebuilt inside its call: its graph, its trainable state's template, and the key strings
    (in that state) of the parameters it borrows: used by other blocks too, or owned outside the blocks."""

    graphdef: Any
    rebuild: _Rebuild
    borrowed: tuple[str, ...]


_BORROWED_PIECE = (
    "{where}: the layers= block '{block}' uses parameters it shares with other code ({leaves}), and they are "
    "still partitioned when it runs (they lie in a stacked= subtree). Keep a shared module out of the stacked= "
    "subtrees (hold it in the model beside the blocks)."
)


def _variables(module: nnx.Module, trainable: Any) -> dict[str, nnx.Variable]:
    """The trainable Variables of ``module`` by the key string of its state (``['lin']['kernel']``)."""
    pairs = jax.tree_util.tree_flatten_with_path(
        nnx.state(module, trainable), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    return {jax.tree_util.keystr(_strip(p)): v for p, v in pairs}


def _owners(model: nnx.Module) -> dict[int, str]:
    """id(Variable) -> its path in the model's parameters (``blocks/0/shared/kernel``): NNX keeps a Variable
    reached by several paths once, at the first path it meets."""
    return {id(n): "/".join(map(str, p)) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Variable)}


def _without(tree: PyTree, prefix: str, paths: frozenset[str]) -> PyTree:
    """A pure dict without the leaves at ``paths`` (full paths; ``prefix`` is the path of ``tree``)."""
    if not isinstance(tree, dict):
        return tree
    return {k: _without(v, f"{prefix}/{k}", paths) for k, v in tree.items() if f"{prefix}/{k}" not in paths}


class _Routed:
    """Stands in for block ``index`` while a manual step traces the loss: its call runs through the chain, the
    block's non-trainable state passed in and its update written back into the block. Parameters the block
    borrows (a module shared by several blocks) are read whole from the model and closed over: the chain
    differentiates them as constants of the call, so their gradient is the sum over the calls. A lifted
    transform around the block's call (``nnx.remat(f)(block, x)``, ``nnx.jit``) passes the stand-in through
    as static data (a leafless pytree), so the block runs through the chain inside the transform too."""

    def __init__(self, block: nnx.Module, index: int, chain: LayerChain, spec: _BlockSpec, lw: _Layerwise) -> None:
        self.block, self.index, self.chain, self.spec, self.lw = block, index, chain, spec, lw

    def __getattr__(self, name: str) -> Any:
        return getattr(self.block, name)

    def _borrowed(self) -> dict[str, Any]:
        live = _variables(self.block, self.lw.trainable)
        values = {k: live[k].get_value() for k in self.spec.borrowed}
        pieces = [k for k, x in values.items() if is_sharded(x)]
        if pieces:
            raise ValueError(_BORROWED_PIECE.format(where=_WHERE, block=self.lw.blocks_paths[self.index],
                                                    leaves=", ".join(pieces)))  # fmt: skip
        return values

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphdef, rebuild, _ = self.spec
        not_trainable = self.lw.not_trainable
        rest, rest_def = jax.tree.flatten(nnx.state(self.block, not_trainable))
        arrays, rebuild_args = split_arrays(args, kwargs)
        carried = [k for k, x in enumerate(rest) if _carried(x)]
        borrowed = self._borrowed()

        def layer_fn(p: PyTree, state: list[Any], *xs: Any) -> Any:
            a, kw = rebuild_args(list(xs))
            block = nnx.merge(graphdef, rebuild(p, borrowed), jax.tree.unflatten(rest_def, state))
            out = block(*a, **kw)
            new = jax.tree.leaves(nnx.state(block, not_trainable))
            return out, [new[k] for k in carried]

        out, new = self.chain.call(self.index, layer_fn, rest, *arrays)
        if carried:
            for k, v in zip(carried, new, strict=True):
                rest[k] = v
            nnx.update(self.block, jax.tree.unflatten(rest_def, rest))
        return out


# A leafless pytree holding itself as static data: NNX's attribute checks (it sits in the model's nnx.List
# while the loss runs) and a transform wrapped around the block's call (nnx.remat(f)(block, x)) hand the
# same stand-in through, so the block still runs through the chain.
jax.tree_util.register_pytree_node(_Routed, lambda r: ((), r), lambda r, _: r)


class _Layerwise:
    """The blocks ``layers=`` matched and how a manual step runs them: one :class:`LayerChain` per trace of the
    loss, each block's call routed through it (:class:`_Routed`), everything else gathered on use.

    A parameter several blocks use (one module held by the model and by every block) is not any block's: it is
    gathered whole once for the step with the rest of the model (NNX files it under the first block when the
    blocks come first in its attribute order; it is cut out of that block's pieces), and each block borrows it."""

    def __init__(self, model: nnx.Module, params: PyTree, layers: Any, prefixes: tuple[str, ...], prefetch: Any,
                 trainable: Any, keep_gathered: Any = 0) -> None:  # fmt: skip
        self.prefixes, self.prefetch, self.keep_gathered = prefixes, prefetch, keep_gathered
        self.trainable, self.not_trainable = trainable, nnx.Not(trainable)
        modules = {"/".join(map(str, p)): tuple(p) for p, n in nnx.iter_graph(model) if p and isinstance(n, nnx.Module)}
        self.undeclared = repeated_groups(params) if layers is None and not prefixes else []
        self.blocks: Blocks | None = None
        self.hoisted: frozenset[str] = frozenset()
        self.blocks_paths: tuple[str, ...] = ()
        if layers is None:
            check_layer_options(None, prefixes, prefetch, _WHERE, keep_gathered)
            return
        classes = {name: type(_node(model, keys)) for name, keys in modules.items()}
        self.blocks = find_blocks(params, layers, where=_WHERE, classes=classes)
        check_layer_options(self.blocks, prefixes, prefetch, _WHERE, keep_gathered)
        self.blocks_paths = self.blocks.paths
        self.keys = [modules[p] for p in self.blocks.paths]  # every subtree with parameters is a module's
        self.specs, self.hoisted = _block_specs(model, self.keys, self.blocks.paths, trainable)
        if self.hoisted:  # a block's size is what it owns alone
            self.blocks = self.blocks._replace(bytes_per_layer=max(_bytes(params, p, self.hoisted)
                                                                   for p in self.blocks.paths))  # fmt: skip

    def prepare(self, params: PyTree) -> tuple[PyTree, Callable[[nnx.Module], Any]]:
        """The params to merge the model from, and the context to run the loss on it in."""
        policy = active_policy()
        if self.blocks is None or policy is None:
            check_declared_blocks(params, self.undeclared, _WHERE)
            return gather_unstacked(params, self.prefixes, _WHERE), lambda m: contextlib.nullcontext()
        own = [_without(t, p, self.hoisted) for t, p in zip(block_params(params, self.blocks), self.blocks.paths,
                                                             strict=True)]  # fmt: skip
        chain = LayerChain(policy, own, self.prefetch, keep_gathered=self.keep_gathered)
        outside = gather_outside(params, self.blocks, _WHERE)
        if self.hoisted:
            outside = jax.tree_util.tree_map_with_path(
                lambda path, x: gather(x, policy) if is_sharded(x) and path_str(path) in self.hoisted else x,
                outside,
                is_leaf=is_sharded,
            )
        return outside, lambda m: self._route(m, chain)

    @contextlib.contextmanager
    def _route(self, m: nnx.Module, chain: LayerChain) -> Iterator[None]:
        placed = []
        for i, (keys, spec) in enumerate(zip(self.keys, self.specs, strict=True)):
            parent = _node(m, keys[:-1])
            placed.append((parent, keys[-1], _get(parent, keys[-1])))
            _put(parent, keys[-1], _Routed(placed[-1][2], i, chain, spec, self))
        try:
            yield
        finally:
            for parent, key, block in placed:
                _put(parent, key, block)


def _block_specs(
    model: nnx.Module, keys: list[tuple[Any, ...]], paths: tuple[str, ...], trainable: Any
) -> tuple[list[_BlockSpec], frozenset[str]]:
    """Each block's :class:`_BlockSpec`, and the parameter paths inside blocks that several blocks use."""
    owner = _owners(model)
    per_block = [_variables(_node(model, k), trainable) for k in keys]
    users = Counter(i for vs in per_block for i in {id(v) for v in vs.values()})
    hoisted = frozenset(
        owner[id(v)]
        for vs in per_block
        for v in vs.values()
        if users[id(v)] > 1 and any(_under(owner[id(v)], p) for p in paths)
    )
    specs = []
    for k, path, vs in zip(keys, paths, per_block, strict=True):
        block_def, block_state, _ = nnx.split(_node(model, k), trainable, ...)
        borrowed = tuple(rel for rel, v in vs.items() if users[id(v)] > 1 or not _under(owner[id(v)], path))
        specs.append(_BlockSpec(block_def, _Rebuild(block_state), borrowed))
    return specs, hoisted


def _under(path: str, block: str) -> bool:
    return path.startswith(f"{block}/")


def _bytes(params: PyTree, path: str, hoisted: frozenset[str]) -> int:
    """Parameter bytes of the block at ``path`` without the leaves at ``hoisted``."""
    return sum(
        int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
        for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if _under(full := path_str(p), path) and full not in hoisted
    )


def from_nnx(
    model: nnx.Module,
    loss: Callable[[nnx.Module, PyTree], Any],
    *,
    trainable: Any = nnx.Param,
    stacked: str | tuple[str, ...] = (),
    state_updates: _StateUpdates = "carry",
    layers: Any = None,
    prefetch: int = 1,
    logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
    keep_gathered: int | str = 0,
) -> Adapted:
    """Adapt a Flax NNX model: ``loss(model, batch) -> loss`` (or ``(loss, aux)``) becomes ``loss_fn(params,
    batch)`` for ``zj.make_train_step``.

    Args:
      model: an ``nnx.Module`` (not modified).
      loss: the mean loss of ``model`` over the batch it is given.
      trainable: an NNX filter (default ``nnx.Param``) selecting the trained variables; all others are held constant
        (see the module docstring).
      stacked: key-path prefixes (``"layers"``, ``"decoder/blocks"``) of subtrees made with ``nnx.vmap``; every
        variable under one must share the leading layer axis. Pass ``adapted.stacked`` to the policy (or use
        ``adapted.policy(...)``).
      state_updates: ``"carry"`` (default): the non-trainable arrays (all but RNG keys) are ``adapted.model_state``
        and updates to them are carried from step to step (``adapted.stateful`` is True when the model has any;
        train with ``adapted.init_state`` / ``adapted.make_train_step`` or pass ``model_state=`` / ``stateful=True``
        yourself). ``"discard"`` drops updates (the state is a constant of the loss); ``"error"`` raises when the
        loss updates a variable.

      layers: the unscanned blocks to run block-wise: ``"auto"``, a key-path pattern (``"blocks/*"``) or the block
        class; reported as ``adapted.layers``. Their state (batch statistics) goes through each call and back. A
        module several blocks call (one ``nnx.Linear`` held by the model and by every block) is no block's: it is
        gathered whole once for the step and its gradient is the sum over the calls. ``@nnx.remat`` on
        ``Block.__call__`` works, and so do ``nnx.remat`` / ``nnx.jit`` around the call (``nnx.remat(lambda b, x:
        b(x))(block, x)``).
      prefetch: how many blocks ahead a stage-3 manual step gathers (0 to the number of blocks).
        On TPU each block is gathered in place whatever it says (``zj.apply_layers``).
      logical_axis_rules: ``(logical, mesh_axis)`` pairs for the variables' ``out_sharding`` names (besides their
        ``sharding_rules``); without any rules the names are mesh axes. The layout is ``adapted.param_specs``.
      keep_gathered: with ``layers=``, stage 3: the last k blocks keep their gathered parameters from the forward
        pass for the backward (k fewer all-gathers, k blocks more memory), or a byte budget (``"2GiB"``): the most
        trailing blocks whose gathered bytes fit (``zj.apply_layers``'s ``keep_gathered``).

    Returns:
      An :class:`~zero_jax.adapters.Adapted`; ``to_model`` returns a new ``nnx.Module`` with the state's updated
      model state (use ``nnx.update(model, nnx.state(new))`` to write the trained values into the original object).
    """
    _check_inputs(model, loss, state_updates)
    prefixes = normalize_prefixes(stacked, _WHERE)
    trained = {keys for keys, _ in nnx.to_flat_state(nnx.state(model, trainable))}
    if not trained:
        kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(nnx.state(model))})
        raise ValueError(_NOTHING_TRAINABLE.format(where=_WHERE, filter=trainable, kinds=kinds))
    trainable = nnx.Any(trainable, _frozen_base)  # from here on: what params holds, the frozen base included
    graphdef, param_state, rest = nnx.split(model, trainable, ...)
    params = nnx.to_pure_dict(param_state)
    frozen = _frozen_mask(param_state, params, trained)
    _check_trainable_floats(params if frozen is None else _trained_only(params, frozen))
    specs = nnx_specs(param_state, params, check_rules(logical_axis_rules, _WHERE), prefixes, _WHERE)
    check_not_unscanned(params, prefixes, _WHERE)
    check_stacked(params, nnx.to_pure_dict(rest), prefixes, _WHERE, _DEPTH_FIX)
    lw = _Layerwise(model, params, layers, prefixes, prefetch, trainable, keep_gathered)
    rebuild_params, rebuild_rest = _Rebuild(param_state), _Rebuild(rest)
    carried_pairs = _carried_pairs(rest) if state_updates == "carry" else []
    model_state = _nest(carried_pairs) if carried_pairs else None
    carried_keys = [jax.tree_util.keystr(p) for p, _ in carried_pairs]
    carried_paths = frozenset(path_str(p) for p, _ in carried_pairs)
    not_trainable = nnx.Not(trainable)

    def run(m: nnx.Module, params: PyTree, batch: PyTree, route: Any) -> Any:
        with adapter_scope(state_updates=state_updates), route(m):
            with explain_unscanned_pieces(params, prefixes, _WHERE, "zj.adapters.nnx.scan_layers"):
                return loss(m, batch)

    def plain_loss_fn(params: PyTree, batch: PyTree) -> Any:
        params, route = lw.prepare(params)
        m = nnx.merge(graphdef, rebuild_params(params), rebuild_rest())
        before = _snapshot(m)
        out = run(m, params, batch, route)
        if state_updates == "error":
            _check_unchanged(before, m, _WHERE)
        return out

    def stateful_loss_fn(params: PyTree, model_state: PyTree, batch: PyTree) -> Any:
        params, route = lw.prepare(params)
        m = nnx.merge(graphdef, rebuild_params(params), rebuild_rest.with_values(_flat(model_state)))
        before = _snapshot(m)
        out = run(m, params, batch, route)
        _check_unchanged(before, m, _WHERE, carried_paths)  # keys and other constants
        after = _flat(nnx.to_pure_dict(nnx.state(m, not_trainable)))
        new = _nest([(p, after[k]) for (p, _), k in zip(carried_pairs, carried_keys, strict=True)])
        return out, new

    def to_model(state_or_params: Any, model_state: PyTree = None) -> nnx.Module:
        ms = model_state_of(state_or_params, model_state, adapted_state)
        rest_state = rebuild_rest() if ms is None else rebuild_rest.with_values(_flat(ms))
        return nnx.merge(graphdef, rebuild_params(params_of(state_or_params)), rest_state)

    adapted_state = model_state
    stateful = model_state is not None
    return Adapted(
        params,
        stateful_signature(stateful_loss_fn, _WHERE) if stateful else plain_loss_fn,
        prefixes,
        rest,
        to_model,
        model_state,
        stateful,
        layers=lw.blocks,
        param_specs=specs,
        frozen=frozen,
    )


def scan_layers(
    fn: Callable[[nnx.Module, Any], Any],
    layers: nnx.Module,
    carry: Any,
    *,
    prefetch: int = 1,
    remat: bool = True,
) -> Any:
    """``carry = fn(layer, carry)`` for each layer of ``layers``, an NNX module whose variables are stacked on a
    leading layer axis (``nnx.vmap``): the drop-in for ``nnx.scan(fn, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)``.

    Inside a ``make_train_step(..., gather="manual")`` step on a model adapted with ``stacked=`` naming this
    subtree, each layer's parameters are gathered just before use and dropped after (``zj.scan_layers``: ZeRO-3
    never holds more than a layer or two). Anywhere else it is a per-layer-checkpointed ``lax.scan``.

    ``fn`` must not update the layer's variables (the layer scan has nowhere to keep the update, even with
    ``state_updates="carry"``): that raises unless the model was adapted with ``state_updates="discard"``.

    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from zero_jax.adapters import nnx as zj_nnx
    >>> make = nnx.vmap(lambda rngs: nnx.Linear(4, 4, rngs=rngs), in_axes=0)
    >>> layers = make(nnx.Rngs(0).split(3))  # 3 layers: kernel (3, 4, 4)
    >>> zj_nnx.scan_layers(lambda layer, x: layer(x), layers, jnp.ones((2, 4))).shape
    (2, 4)
    """
    if not isinstance(layers, nnx.Module):
        raise TypeError(f"zj.adapters.nnx.scan_layers: layers must be an nnx.Module, got {type(layers).__name__}.")
    graphdef, params, rest = nnx.split(layers, nnx.Param, ...)
    rest_vars = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
    discard = current().state_updates == "discard"

    def layer_fn(p: nnx.State, r: nnx.State | None, c: Any) -> Any:
        layer = nnx.merge(graphdef, p, r if r is not None else rest)
        before = None if discard else _snapshot(layer)
        out = fn(layer, c)
        if before is not None:
            _check_unchanged(before, layer, "zj.adapters.nnx.scan_layers")
        return out

    return scan_stacked(layer_fn, params, rest if rest_vars else {}, carry, prefetch=prefetch, remat=remat)
