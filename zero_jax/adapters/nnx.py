"""Flax NNX models under ZeRO: ``from_nnx`` and the layer-wise ``scan_layers``.

The model is split once with ``nnx.split(model, trainable, ...)``: the
trainable variables (``nnx.Param`` by default) become ``params``, a nested
dict of arrays keyed by attribute path (``layers/lin/kernel``); everything
else (``nnx.BatchStat``, RNG keys and counts, any other ``nnx.Variable``) is
``non_trainable``. ``loss_fn(params, batch)`` merges a fresh model from both
(``nnx.merge``) and calls ``loss(model, batch)``.

Non-trainable state is a constant of the step: every device holds it whole,
the optimizer never sees it, and training does not change it. A loss that
*updates* it (batch norm in training mode, ``nnx.Dropout`` drawing from the
model's RNG streams) would have those updates silently lost, so by default
that is an error naming the variable; ``state_updates="discard"`` says the
loss of the updates is intended (e.g. statistics you recompute after
training; note a discarded RNG count replays the same dropout mask every
step).

Layer-wise ZeRO-3: stacked layers (made with ``nnx.vmap`` over a layer axis)
are declared with ``stacked=`` so the policy never cuts that axis. Running
the stack with :func:`scan_layers` instead of ``nnx.scan`` lets a
``make_train_step(..., gather="manual")`` step gather one layer at a time
(``zj.scan_layers``); elsewhere (``gather="all"``, evaluation) it is a plain
scan, so one model runs everywhere.

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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
from flax import nnx

from zero_jax._policy import PyTree, path_str
from zero_jax.adapters._common import (
    Adapted,
    check_stacked,
    describe,
    explain_unscanned_pieces,
    gather_unstacked,
    is_sharded,
    normalize_prefixes,
    params_of,
    scan_stacked,
)

__all__ = ["from_nnx", "scan_layers"]

_WHERE = "zj.adapters.from_nnx"
_DEPTH_FIX = (
    "Build the whole stack with one nnx.vmap over the layer axis (e.g. nnx.split_rngs(splits=depth) + "
    "nnx.vmap(make_layer, in_axes=0)), and keep unstacked modules out of the stacked= subtree."
)
_StateUpdates = Literal["error", "discard"]
# The update mode of the adapted loss being traced (read by scan_layers).
_MODES: list[str] = []


def _is_value_key(k: Any) -> bool:
    return isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value"


def _strip(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A State leaf path (``.../kernel/.value``) as its pure-dict path."""
    return path[:-1] if path and _is_value_key(path[-1]) else path


class _Rebuild:
    """Turns a pure dict of (possibly Sharded) values back into an ``nnx.State``
    of fresh Variables, so a merged model never aliases the template's."""

    def __init__(self, state: nnx.State) -> None:
        pairs, self.treedef = jax.tree_util.tree_flatten_with_path(state)
        self.paths = [jax.tree_util.keystr(_strip(p)) for p, _ in pairs]
        self.leaves = [x for _, x in pairs]

    def __call__(self, pure: PyTree | None = None) -> nnx.State:
        if pure is None:
            return jax.tree_util.tree_unflatten(self.treedef, self.leaves)
        pairs = jax.tree_util.tree_flatten_with_path(pure, is_leaf=is_sharded)[0]
        flat = {jax.tree_util.keystr(p): x for p, x in pairs}
        if set(flat) != set(self.paths):
            missing, extra = sorted(set(self.paths) - set(flat)), sorted(set(flat) - set(self.paths))
            raise ValueError(
                f"{_WHERE}: the parameters do not match the model: missing {missing}, unexpected {extra}. "
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


def _check_unchanged(before: dict[str, tuple[Any, Any]], model: nnx.Module, where: str) -> None:
    after = _snapshot(model)
    for path, (kind, value) in before.items():
        new = after.get(path, (kind, value))[1]
        # Compare the arrays, not their containers: NNX may re-wrap a partitioned
        # (Sharded) value in a new node holding the same pieces.
        old_leaves, new_leaves = jax.tree.leaves(value), jax.tree.leaves(new)
        if len(old_leaves) != len(new_leaves) or any(a is not b for a, b in zip(old_leaves, new_leaves, strict=True)):
            raise ValueError(
                f"{where}: the loss updated {kind} '{path}' ({describe(value)}), but a zero_jax step keeps "
                "only the trainable parameters: the update would be lost every step. Make the forward pass "
                "leave it alone (e.g. nnx.BatchNorm(use_running_average=True), deterministic dropout, or "
                "RNG keys passed in the batch), or pass state_updates='discard' to from_nnx to drop such "
                "updates on purpose."
            )


def from_nnx(
    model: nnx.Module,
    loss: Callable[[nnx.Module, PyTree], Any],
    *,
    trainable: Any = nnx.Param,
    stacked: str | tuple[str, ...] = (),
    state_updates: _StateUpdates = "error",
) -> Adapted:
    """Adapt a Flax NNX model: ``loss(model, batch) -> loss`` (or ``(loss, aux)``)
    becomes ``loss_fn(params, batch)`` for ``zj.make_train_step``.

    Args:
      model: an ``nnx.Module`` (not modified).
      loss: the mean loss of ``model`` over the batch it is given.
      trainable: an NNX filter (default ``nnx.Param``) selecting the trained
        variables; all others are held constant (see the module docstring).
      stacked: key-path prefixes (``"layers"``, ``"decoder/blocks"``) of
        subtrees made with ``nnx.vmap``; every variable under one must share
        the leading layer axis. Pass ``adapted.stacked`` to the policy (or use
        ``adapted.policy(...)``).
      state_updates: ``"error"`` (default) raises when the loss updates a
        variable; ``"discard"`` drops such updates.

    Returns:
      An :class:`~zero_jax.adapters.Adapted`; ``to_model`` returns a new
      ``nnx.Module`` (use ``nnx.update(model, nnx.state(new))`` to write the
      trained values into the original object).
    """
    if not isinstance(model, nnx.Module):
        hint = ""
        mod = type(model).__module__
        if mod.startswith("flax.linen") or hasattr(model, "init_with_output"):
            hint = " It is a Flax Linen module: use zj.adapters.from_linen(module, variables, loss)."
        elif mod.startswith("equinox") or "equinox" in str(type(type(model))):
            hint = " It is an Equinox module: use zj.adapters.from_equinox(model, loss)."
        raise TypeError(f"{_WHERE}: model must be a flax.nnx.Module, got {type(model).__name__}.{hint}")
    if not callable(loss):
        raise TypeError(f"{_WHERE}: loss must be callable as loss(model, batch), got {type(loss).__name__}.")
    if state_updates not in ("error", "discard"):
        raise ValueError(f"{_WHERE}: state_updates must be 'error' or 'discard', got {state_updates!r}.")
    prefixes = normalize_prefixes(stacked, _WHERE)
    graphdef, param_state, rest = nnx.split(model, trainable, ...)
    params = nnx.to_pure_dict(param_state)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not hasattr(leaf, "shape") or not jax.numpy.issubdtype(leaf.dtype, jax.numpy.inexact):
            raise ValueError(
                f"{_WHERE}: trainable variable '{path_str(path)}' is {describe(leaf)}, not a float array. "
                "Only floating-point arrays can be trained: wrap it in another nnx.Variable type (not "
                "nnx.Param) or narrow the trainable= filter."
            )
    check_stacked(params, nnx.to_pure_dict(rest), prefixes, _WHERE, _DEPTH_FIX)
    rebuild_params, rebuild_rest = _Rebuild(param_state), _Rebuild(rest)

    def loss_fn(params: PyTree, batch: PyTree) -> Any:
        params = gather_unstacked(params, prefixes, _WHERE)
        m = nnx.merge(graphdef, rebuild_params(params), rebuild_rest())
        before = _snapshot(m)
        _MODES.append(state_updates)
        try:
            with explain_unscanned_pieces(params, prefixes, _WHERE, "zj.adapters.nnx.scan_layers"):
                out = loss(m, batch)
        finally:
            _MODES.pop()
        if state_updates == "error":
            _check_unchanged(before, m, _WHERE)
        return out

    def to_model(state_or_params: Any) -> nnx.Module:
        return nnx.merge(graphdef, rebuild_params(params_of(state_or_params)), rebuild_rest())

    return Adapted(params, loss_fn, prefixes, rest, to_model)


def scan_layers(
    fn: Callable[[nnx.Module, Any], Any],
    layers: nnx.Module,
    carry: Any,
    *,
    prefetch: int = 1,
    remat: bool = True,
) -> Any:
    """``carry = fn(layer, carry)`` for each layer of ``layers``, an NNX module
    whose variables are stacked on a leading layer axis (``nnx.vmap``): the
    drop-in for ``nnx.scan(fn, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)``.

    Inside a ``make_train_step(..., gather="manual")`` step on a model adapted
    with ``stacked=`` naming this subtree, each layer's parameters are
    gathered just before use and dropped after (``zj.scan_layers``: ZeRO-3
    never holds more than a layer or two). Anywhere else it is a
    per-layer-checkpointed ``lax.scan``.

    ``fn`` must not update the layer's variables (there is nowhere to keep the
    update): that raises unless the model was adapted with
    ``state_updates="discard"``.

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
    discard = bool(_MODES) and _MODES[-1] == "discard"

    def layer_fn(p: nnx.State, r: nnx.State | None, c: Any) -> Any:
        layer = nnx.merge(graphdef, p, r if r is not None else rest)
        before = None if discard else _snapshot(layer)
        out = fn(layer, c)
        if before is not None:
            _check_unchanged(before, layer, "zj.adapters.nnx.scan_layers")
        return out

    return scan_stacked(layer_fn, params, rest if rest_vars else {}, carry, prefetch=prefetch, remat=remat)
