"""Equinox models under ZeRO: ``from_equinox`` and the layer-wise ``scan_layers``.

The model is split once with ``eqx.partition(model, trainable)``: the leaves the filter selects
(``eqx.is_inexact_array`` by default: every float array) are ``params``, an Equinox module with an empty placeholder
where the other leaves were (``None`` would read as a frozen gradient); everything else (integer arrays, float
arrays the filter leaves out, and non-array leaves: activation functions, Python numbers, strings) is
``non_trainable``, held constant by ``loss_fn``. ``loss_fn(params, batch)`` rebuilds the model with ``eqx.combine``
and calls ``loss(model, batch)``. Equinox never updates a model in place, so nothing can be lost silently.

Stateful layers (``eqx.nn.BatchNorm``, made with ``eqx.nn.make_with_state``) keep their state in an
``eqx.nn.State``: pass it as ``from_equinox(model, loss, state=state)`` with ``loss(model, state, batch) -> (out,
new_state)`` (the usual Equinox way of threading it). It becomes the adapter's ``model_state``
(``TrainState.model_state``): each device updates it from its slice of the batch and the step averages float values
over the devices (data-parallel batch norm; integer and bool values, such as the ``"ema"`` mode's first-step flag,
must agree and are taken as their maximum); ``to_model(train_state)`` returns ``(model, state)``. Every
``BatchNorm`` mode works, the default one included.

A filter that marks a leaf trainable which is not a float array is an error naming the leaf (gradients and optimizer
state exist only for float arrays).

Layer-wise ZeRO-3: layers stacked with ``eqx.filter_vmap`` over a layer axis are declared with ``stacked=``; running
them with :func:`scan_layers` lets a ``make_train_step(..., gather="manual")`` step gather one layer at a time.
Unscanned blocks (a list of layers called in a loop) are named with ``layers=``: a manual step (then the default)
swaps each for a stand-in that runs it through ``zj.apply_layer``'s chain, once on the whole batch under vmap.

>>> import jax, jax.numpy as jnp, optax, zero_jax as zj
>>> import equinox as eqx
>>> model = eqx.nn.Linear(4, 2, key=jax.random.key(0))
>>> def loss(model, batch):
...     return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)
>>> adapted = zj.adapters.from_equinox(model, loss)
>>> policy = adapted.policy(stage=1, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
>>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
>>> state = zj.init_state(adapted.params, tx, policy)
>>> step = zj.make_train_step(adapted.loss_fn, tx, policy)
>>> state, metrics = step(state, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
>>> type(adapted.to_model(state)).__name__
'Linear'

With an ``eqx.nn.State``:

>>> class Net(eqx.Module):
...     lin: eqx.nn.Linear
...     bn: eqx.nn.BatchNorm
...     def __init__(self, key):
...         self.lin = eqx.nn.Linear(4, 2, key=key)
...         self.bn = eqx.nn.BatchNorm(2, axis_name="batch", mode="batch")
...     def __call__(self, x, state):
...         return self.bn(self.lin(x), state)
>>> net, bn_state = eqx.nn.make_with_state(Net)(jax.random.key(0))
>>> def bn_loss(model, state, batch):
...     run = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
...     pred, state = run(batch["x"], state)
...     return jnp.mean((pred - batch["y"]) ** 2), state
>>> adapted = zj.adapters.from_equinox(net, bn_loss, state=bn_state)
>>> state = adapted.init_state(tx, policy)  # zj.init_state(..., model_state=adapted.model_state)
>>> step = adapted.make_train_step(tx, policy)  # zj.make_train_step(..., stateful=True)
>>> state, metrics = step(state, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
>>> trained, trained_state = adapted.to_model(state)  # with the updated batch statistics
>>> type(trained_state).__name__
'State'
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from zero_jax._base.tree import PyTree, path_str
from zero_jax._layerwise.blocks import LayerChain, batched_by_vmap
from zero_jax._layout.leaf import is_float
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

__all__ = ["from_equinox", "scan_layers"]

_WHERE = "zj.adapters.from_equinox"
_DEPTH_FIX = (
    "Build the whole stack with one eqx.filter_vmap(make_layer)(jax.random.split(key, depth)), and keep "
    "unstacked modules out of the stacked= subtree."
)


class _Hole:
    """Marks, in ``params``, a model leaf that is not trained. It has no children, so it is no leaf; unlike
    ``eqx.partition``'s ``None`` it is not mistaken for a frozen gradient (zero_jax's ``None``)."""

    def __repr__(self) -> str:
        return "<non-trainable>"


_HOLE = _Hole()
jax.tree_util.register_pytree_node(_Hole, lambda _: ((), None), lambda *_: _HOLE)


def _is_hole(x: Any) -> bool:
    return x is _HOLE or is_sharded(x)


def _combine(params: Any, static: Any) -> Any:
    """``eqx.combine`` for ``params`` with holes (and partitioned pieces)."""
    return jax.tree.map(lambda p, s: s if p is _HOLE else p, params, static, is_leaf=_is_hole)


def _in_step_like(old: Any, new: Any) -> Any:
    """``new`` typed like the carried value ``old`` it replaces. Inside the step's ``shard_map`` every traced value
    carries the device mesh in its type, but a constant the model writes (``eqx.nn.BatchNorm``'s
    ``jnp.array(False)`` "first time" flag in its default ``"ema"`` mode) does not, and ``State.set`` refuses the
    difference. The constant is made a traced value of the same shape, dtype and value; anything that really differs
    is left for ``State.set`` to report."""
    new = jnp.asarray(new)
    want, got = jax.eval_shape(lambda: old), jax.eval_shape(lambda: new)
    if want != got and (want.shape, want.dtype) == (got.shape, got.dtype):
        return jnp.where(True, new, old)
    return new


class _CarriedState(eqx.nn.State):
    """The ``eqx.nn.State`` the loss sees inside a train step: ``set`` accepts constants for traced values
    (:func:`_in_step_like`). ``substate`` and ``update`` keep the type, so stateful layers nested in a submodule
    work alike; the loss's returned state becomes a plain ``eqx.nn.State`` again."""

    def set(self, item: Any, value: Any) -> eqx.nn.State:
        old = self.get(item)
        if jax.tree.structure(old) == jax.tree.structure(value):  # else State.set names the difference
            value = jax.tree.map(_in_step_like, old, value)
        return _as_state(super().set(item, value), _CarriedState)

    def substate(self, pytree: Any) -> eqx.nn.State:
        return _as_state(super().substate(pytree), _CarriedState)

    def update(self, substate: eqx.nn.State) -> eqx.nn.State:
        return _as_state(super().update(_as_state(substate, eqx.nn.State)), _CarriedState)


jax.tree_util.register_pytree_node_class(_CarriedState)


def _as_state(state: Any, cls: type) -> Any:
    """``state`` (an ``eqx.nn.State`` of either kind) as a ``cls``, same keys and values."""
    if not isinstance(state, eqx.nn.State) or type(state) is cls:
        return state
    values, keys = state.tree_flatten()
    return cls.tree_unflatten(keys, values)


def _states_as(tree: Any, cls: type) -> Any:
    """Every ``eqx.nn.State`` in ``tree`` as a ``cls`` (leaves untouched, so the step still sees which values the
    loss returned unchanged)."""
    is_state = lambda x: isinstance(x, eqx.nn.State)  # noqa: E731
    return jax.tree.map(lambda x: _as_state(x, cls), tree, is_leaf=is_state)


def _is_float_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray)) and is_float(x)


_NOT_FLOAT = (
    "{where}: {leaves}; only float arrays get gradients and optimizer state. Fix: {fixes}exclude {them} from "
    "trainable= (the default eqx.is_inexact_array selects exactly the float arrays)."
)
_NOT_ARRAY_STATE = (
    "{where}: {leaves}; the state carried between steps must be a pytree of arrays (an eqx.nn.State from "
    "eqx.nn.make_with_state is)."
)


def _check_trainable(params: Any) -> None:
    """Every leaf the filter selected is a float array; all that are not, named in one error."""
    bad, numbers = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not _is_float_array(leaf):
            name = path_str(path)
            bad.append(f"leaf '{name}' is marked trainable but is {describe(leaf)}, not a floating-point array")
            if isinstance(leaf, (float, int, complex)) and not isinstance(leaf, bool):
                numbers.append(f"'{name}' as jnp.asarray({leaf!r}, jnp.float32)")
    if bad:
        verb = "it should" if len(numbers) == 1 else "they should"
        fixes = f"store {', '.join(numbers)} if {verb} learn, or " if numbers else ""
        them = "it" if len(bad) == 1 else "them"
        raise ValueError(_NOT_FLOAT.format(where=_WHERE, leaves="; ".join(bad), fixes=fixes, them=them))


def _check_state(state: Any) -> None:
    """Every leaf of ``state=`` is an array; all that are not, named in one error."""
    bad = [
        f"state leaf '{path_str(path)}' is {describe(leaf)}, not an array"
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
        if not isinstance(leaf, (jax.Array, np.ndarray))
    ]
    if bad:
        raise ValueError(_NOT_ARRAY_STATE.format(where=_WHERE, leaves="; ".join(bad)))


NO_ARRAYS = (
    "{where}: model must be an Equinox module (or a pytree of them) holding the arrays to train, got {kind} "
    "with no arrays in it. Pass the model itself, e.g. from_equinox(eqx.nn.MLP(..., key=key), loss)."
)


def _modules(tree: Any, prefix: tuple[Any, ...] = ()) -> dict[str, tuple[tuple[Any, ...], Any]]:
    """Every ``eqx.Module`` inside ``tree`` (not ``tree`` itself) by path name: its key path and the module."""
    out = {}
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree and isinstance(x, eqx.Module))
    for path, node in pairs[0]:
        if isinstance(node, eqx.Module):
            out[path_str(prefix + path)] = (prefix + path, node)
            out.update(_modules(node, prefix + path))
    return out


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The node of ``tree`` at a key path."""
    for k in path:
        tree = getattr(tree, k.name) if hasattr(k, "name") else tree[getattr(k, "idx", getattr(k, "key", None))]
    return tree


def _call_block(chain: LayerChain, index: int, static: Any, *args: Any, **kwargs: Any) -> Any:
    """Block ``index`` called through the chain: its arrays (inputs, state, keys) are the chain's args."""
    arrays, rebuild = split_arrays(args, kwargs)

    def layer_fn(p: Any, *xs: Any) -> Any:
        a, kw = rebuild(list(xs))
        return _combine(p, static)(*a, **kw)

    return _chained(chain, index, static, layer_fn, arrays)


def _chained(chain: LayerChain, index: int, static: Any, layer_fn: Callable[..., Any], arrays: list[Any]) -> Any:
    """``chain.call(index, layer_fn, *arrays)``, or under ``jax.vmap`` one call on the whole batch."""
    if not any(map(batched_by_vmap, arrays)):
        return chain.call(index, layer_fn, *arrays)
    axis = next(
        (m.axis_name for m in [static, *(n for _, n in _modules(static).values())] if hasattr(m, "axis_name")), None
    )
    block, block_def = jax.tree.flatten(chain.layers[index], is_leaf=is_sharded)
    shapes = [(x.shape, (x.arrays[0] if is_sharded(x) else x).dtype) for x in block]
    flags: list[Any] = []

    @jax.custom_batching.custom_vmap
    def call(*a: Any) -> Any:  # the unbatched meaning, traced for its shapes only
        return layer_fn(jax.tree.unflatten(block_def, [jnp.zeros(s, d) for s, d in shapes]), *a)

    @call.def_vmap
    def rule(axis_size: int, inbatched_by_vmap: list[bool], *a: Any) -> tuple[Any, Any]:
        in_axes = [0 if b else None for b in inbatched_by_vmap]

        def on_batch(p: Any, *xs: Any) -> Any:
            run = functools.partial(layer_fn, p)

            def probe(*x: Any) -> Any:  # which outputs vary over the batch (batch statistics do not)
                flags[:] = [jax.tree.map(batched_by_vmap, out := run(*x))]
                return out

            jax.eval_shape(jax.vmap(probe, in_axes=in_axes, axis_name=axis), *xs)
            out_axes = jax.tree.map(lambda b: 0 if b else None, flags[0])
            return jax.vmap(run, in_axes=in_axes, out_axes=out_axes, axis_name=axis)(*xs)

        return chain.call(index, on_batch, *a), flags[0]

    return call(*arrays)


class _Routed(eqx.Module):
    """Stands in for a matched block while a manual step traces the loss."""

    call: Callable[..., Any] = eqx.field(static=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)


class _Layerwise:
    """The blocks ``layers=`` matched; in a manual step one :class:`LayerChain` per trace, each block replaced
    (``eqx.tree_at``) by a :class:`_Routed` calling it through the chain, the rest gathered on use."""

    def __init__(
        self, model: Any, params: PyTree, layers: Any, prefixes: tuple[str, ...], prefetch: Any, keep_gathered: Any = 0
    ) -> None:
        self.prefixes, self.prefetch, self.keep_gathered = prefixes, prefetch, keep_gathered
        self.undeclared = repeated_groups(params) if layers is None and not prefixes else []
        self.blocks: Blocks | None = None
        if layers is None:
            check_layer_options(None, prefixes, prefetch, _WHERE, keep_gathered)
            return
        modules = _modules(model)
        classes = {name: type(node) for name, (_, node) in modules.items()}
        self.blocks = find_blocks(params, layers, where=_WHERE, classes=classes)
        check_layer_options(self.blocks, prefixes, prefetch, _WHERE, keep_gathered)
        if odd := [p for p in self.blocks.paths if p not in modules]:
            raise ValueError(NOT_MODULES.format(where=_WHERE, layers=layers, paths=odd))
        self.keys = [modules[p][0] for p in self.blocks.paths]

    def model(self, params: PyTree, static: Any) -> tuple[PyTree, Any]:
        """The params the loss sees (gathered where used whole) and the model to call it on."""
        policy = active_policy()
        if self.blocks is None or policy is None:
            check_declared_blocks(params, self.undeclared, _WHERE)
            params = gather_unstacked(params, self.prefixes, _WHERE)
            return params, _combine(params, static)
        chain = LayerChain(policy, block_params(params, self.blocks), self.prefetch, keep_gathered=self.keep_gathered)
        outside = gather_outside(params, self.blocks, _WHERE)
        routed = [_Routed(functools.partial(_call_block, chain, i, _at(static, k))) for i, k in enumerate(self.keys)]
        return outside, eqx.tree_at(lambda m: [_at(m, k) for k in self.keys], _combine(outside, static), routed)


NOT_MODULES = "{where}: layers={layers!r} matched {paths}, which are not Equinox modules; match whole blocks."


def from_equinox(
    model: eqx.Module,
    loss: Callable[[eqx.Module, PyTree], Any],
    *,
    trainable: Any = eqx.is_inexact_array,
    stacked: str | Sequence[str] = (),
    state: Any = None,
    layers: Any = None,
    prefetch: int = 1,
    keep_gathered: int | str = 0,
) -> Adapted:
    """Adapt an Equinox model: ``loss(model, batch) -> loss`` (or ``(loss, aux)``) becomes ``loss_fn(params,
    batch)`` for ``zj.make_train_step``.

    Args:
      model: an ``eqx.Module`` (any pytree works).
      loss: the mean loss of ``model`` over the batch it is given.
      trainable: an Equinox filter: a function of a leaf, or a ``filter_spec`` pytree of bools / functions (as
        ``eqx.partition`` takes). Default: every floating-point array. Every selected leaf must be a float array.
      stacked: key-path prefixes (``"layers"``, ``"decoder/blocks"``) of subtrees made with ``eqx.filter_vmap``,
        sharing a leading layer axis.
      state: the model's ``eqx.nn.State`` (from ``eqx.nn.make_with_state``), or any pytree of arrays the loss
        updates. Then the loss is ``loss(model, state, batch) -> (out, new_state)`` and ``state`` is
        ``adapted.model_state``, carried from step to step: train with ``adapted.init_state`` /
        ``adapted.make_train_step`` (or pass ``model_state=`` / ``stateful=True`` yourself).
      layers: the unscanned blocks to run block-wise: ``"auto"``, a key-path pattern (``"blocks/*"``) or the block
        class; reported as ``adapted.layers``. An ``eqx.nn.State`` passed to a block goes through its call and back.
      prefetch: how many blocks ahead a stage-3 manual step gathers (0 to the number of blocks).
        On TPU each block is gathered in place whatever it says (``zj.apply_layers``).
      keep_gathered: with ``layers=``, stage 3: the last k blocks keep their gathered parameters from the forward
        pass for the backward (k fewer all-gathers, k blocks more memory), or a byte budget (``"2GiB"``): the most
        trailing blocks whose gathered bytes fit (``zj.apply_layers``'s ``keep_gathered``).

    Returns:
      An :class:`~zero_jax.adapters.Adapted`; ``to_model`` returns the model, or ``(model, state)`` with a
      ``state=`` (a TrainState's updated one). ``param_specs`` is None: Equinox declares no layout, so a
      model-parallel one goes to the policy directly (``zj.ZeroPolicy(..., param_specs=...)``).
    """
    if not callable(loss):
        sig = "loss(model, batch)" if state is None else "loss(model, state, batch)"
        raise TypeError(f"{_WHERE}: loss must be callable as {sig}, got {type(loss).__name__}.")
    if not jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        raise TypeError(NO_ARRAYS.format(where=_WHERE, kind=type(model).__name__))
    params, static = eqx.partition(model, trainable)
    _check_trainable(params)
    params = jax.tree.map(lambda x: _HOLE if x is None else jnp.asarray(x), params, is_leaf=lambda x: x is None)
    prefixes = normalize_prefixes(stacked, _WHERE)
    others = eqx.filter(static, eqx.is_array)
    check_not_unscanned(params, prefixes, _WHERE)
    check_stacked(params, others, prefixes, _WHERE, _DEPTH_FIX)
    lw = _Layerwise(model, params, layers, prefixes, prefetch, keep_gathered)

    def loss_fn(params: PyTree, batch: PyTree) -> Any:
        params, m = lw.model(params, static)
        with explain_unscanned_pieces(params, prefixes, _WHERE, "zj.adapters.equinox.scan_layers"):
            return loss(m, batch)

    def to_model(state_or_params: Any) -> Any:
        return _combine(params_of(state_or_params), static)

    if state is None:
        return Adapted(params, loss_fn, prefixes, static, to_model, layers=lw.blocks)
    _check_state(state)

    def stateful_loss_fn(params: PyTree, model_state: Any, batch: PyTree) -> Any:
        params, m = lw.model(params, static)
        with explain_unscanned_pieces(params, prefixes, _WHERE, "zj.adapters.equinox.scan_layers"):
            result = loss(m, _states_as(model_state, _CarriedState), batch)  # pyright: ignore[reportCallIssue] - the stateful loss takes (model, state, batch)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"{_WHERE}: with state= the loss must return (out, new_state), out being the loss (or "
                f"(loss, aux)); got {type(result).__name__}."
            )
        out, new_state = result
        return out, _states_as(new_state, eqx.nn.State)

    def to_stateful_model(state_or_params: Any, model_state: Any = None) -> tuple[Any, Any]:
        return to_model(state_or_params), model_state_of(state_or_params, model_state, state)

    return Adapted(
        params,
        stateful_signature(stateful_loss_fn, _WHERE),
        prefixes,
        static,
        to_stateful_model,
        state,
        True,
        layers=lw.blocks,
    )


def scan_layers(
    fn: Callable[[Any, Any], Any],
    layers: Any,
    carry: Any,
    *,
    prefetch: int = 1,
    remat: bool = True,
) -> Any:
    """``carry = fn(layer, carry)`` for each layer of ``layers``, an Equinox module whose arrays are stacked on a
    leading layer axis (``eqx.filter_vmap``): the drop-in for the usual ``lax.scan`` over ``eqx.partition(layers,
    eqx.is_array)``.

    Inside a ``make_train_step(..., gather="manual")`` step on a model adapted with ``stacked=`` naming this
    subtree, each layer's parameters are gathered just before use and dropped after (``zj.scan_layers``). Anywhere
    else it is a per-layer-checkpointed ``lax.scan``.

    >>> import jax, jax.numpy as jnp, equinox as eqx
    >>> from zero_jax.adapters import equinox as zj_eqx
    >>> layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(jax.random.split(jax.random.key(0), 3))
    >>> zj_eqx.scan_layers(lambda layer, x: jax.vmap(layer)(x), layers, jnp.ones((2, 4))).shape
    (2, 4)
    """
    scanned, rest = eqx.partition(layers, lambda x: is_sharded(x) or eqx.is_inexact_array(x), is_leaf=is_sharded)
    indexed, static = eqx.partition(rest, eqx.is_array, is_leaf=is_sharded)

    def layer_fn(p: Any, r: Any, c: Any) -> Any:
        return fn(eqx.combine(p, static) if r is None else eqx.combine(p, r, static), c)

    return scan_stacked(
        layer_fn, scanned, indexed if jax.tree.leaves(indexed) else {}, carry, prefetch=prefetch, remat=remat
    )
