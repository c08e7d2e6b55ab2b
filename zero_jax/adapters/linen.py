"""Flax Linen models under ZeRO: ``from_linen(module, variables, loss)``.

Linen keeps a model's numbers outside the module, in the variables dict that
``module.init`` returns. The ``"params"`` collection (or the collections named
by ``trainable=``) becomes ``params``; every other collection
(``"batch_stats"``, ``"cache"``, ``"intermediates"``, ...) is
``non_trainable``: a constant of the step, whole on every device, never
trained. ``loss(variables, batch)`` receives the whole variables dict, so it
calls ``module.apply(variables, ...)`` as usual; Linen itself refuses to
update a collection unless ``apply`` is given ``mutable=``, and a loss that
asks for updates gets them back and drops them by its own hand — nothing is
lost silently.

Stacks made with ``nn.scan`` (``variable_axes={"params": 0}``) are declared
with ``stacked=`` (the scanned submodule's name): the policy then never cuts
the layer axis, and stage 3 trains them with ``gather="all"`` (the step
gathers the parameters inside ``jax.checkpoint``; the backward pass gathers
again). Layer-by-layer gathering (``gather="manual"``) needs the model to
call ``zj.scan_layers`` itself, which ``nn.scan`` cannot: it is not
supported for Linen models (use the NNX or Equinox adapter for that).

>>> import jax, jax.numpy as jnp, optax, zero_jax as zj
>>> import flax.linen as nn
>>> module = nn.Dense(2)
>>> variables = module.init(jax.random.key(0), jnp.ones((1, 4)))
>>> def loss(variables, batch):
...     return jnp.mean((module.apply(variables, batch["x"]) - batch["y"]) ** 2)
>>> adapted = zj.adapters.from_linen(module, variables, loss)
>>> policy = adapted.policy(stage=2, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
>>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
>>> state = zj.init_state(adapted.params, tx, policy)
>>> step = zj.make_train_step(adapted.loss_fn, tx, policy)
>>> state, metrics = step(state, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
>>> sorted(adapted.to_model(state))  # the variables dict again
['params']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from zero_jax._policy import PyTree, path_str
from zero_jax.adapters._common import Adapted, check_stacked, describe, is_sharded, normalize_prefixes, params_of

__all__ = ["from_linen"]

_WHERE = "zj.adapters.from_linen"
_DEPTH_FIX = (
    "Make the stack with one nn.scan(..., variable_axes={'params': 0}, length=depth) and keep "
    "unstacked submodules out of the stacked= subtree."
)
_INIT_HINT = "variables = module.init(jax.random.key(0), example_input)"


def from_linen(
    module: nn.Module,
    variables: Mapping[str, Any] | None = None,
    loss: Callable[[Mapping[str, Any], PyTree], Any] | None = None,
    *,
    trainable: str | Sequence[str] = "params",
    stacked: str | Sequence[str] = (),
) -> Adapted:
    """Adapt a Flax Linen module: ``loss(variables, batch) -> loss`` (or
    ``(loss, aux)``) becomes ``loss_fn(params, batch)`` for
    ``zj.make_train_step``.

    Args:
      module: the ``flax.linen.Module``.
      variables: its variables dict, as ``module.init(...)`` returns it.
      loss: the mean loss over the batch it is given, of the whole variables
        dict (trained ``params`` plus the constant other collections).
      trainable: the collection(s) to train (default ``"params"``).
      stacked: key-path prefixes inside the trained collection (``"layers"``,
        ``"decoder/ScanBlock_0"``) of stacks made with ``nn.scan``.

    Returns:
      An :class:`~zero_jax.adapters.Adapted`; ``params`` is the trained
      collection (``{"params": ...}`` is unwrapped when it is the only one);
      ``to_model`` returns the variables dict.
    """
    if not isinstance(module, nn.Module):
        from flax import nnx  # Linen's package: installed

        hint = ""
        if isinstance(module, nnx.Module):
            hint = " It looks like a Flax NNX module: use zj.adapters.from_nnx(model, loss)."
        raise TypeError(f"{_WHERE}: module must be a flax.linen.Module, got {type(module).__name__}.{hint}")
    if variables is None or callable(variables) and not isinstance(variables, Mapping):
        raise TypeError(
            f"{_WHERE}: the {type(module).__name__} module was passed without its variables. A Linen module "
            f"holds no parameters itself: create them with {_INIT_HINT} and call "
            "from_linen(module, variables, loss)."
        )
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"{_WHERE}: variables must be the dict module.init returns ({{'params': ...}}), got "
            f"{type(variables).__name__}."
        )
    if loss is None or not callable(loss):
        raise TypeError(f"{_WHERE}: loss must be callable as loss(variables, batch), got {type(loss).__name__}.")
    collections = (trainable,) if isinstance(trainable, str) else tuple(trainable)
    missing = [c for c in collections if c not in variables]
    if missing:
        found = sorted(variables)
        looks_like_params = bool(found) and all(isinstance(variables[k], Mapping) for k in found)
        hint = (
            f" These look like the contents of the 'params' collection: pass {{'params': params}}, or the whole "
            f"dict from {_INIT_HINT}."
            if looks_like_params and "params" in collections
            else f" Create them with {_INIT_HINT}."
        )
        raise ValueError(
            f"{_WHERE}: the variables of {type(module).__name__} have no {missing[0]!r} collection (they have "
            f"{found}).{hint}"
        )
    trained = {c: variables[c] for c in collections}
    rest = {c: v for c, v in variables.items() if c not in collections}
    for path, leaf in jax.tree_util.tree_flatten_with_path(trained)[0]:
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise ValueError(
                f"{_WHERE}: trainable variable '{path_str(path)}' is {describe(leaf)}, not a float array. "
                "Keep non-float state in another collection (self.variable('state', ...)), not in 'params'."
            )
    unwrap = len(collections) == 1
    params = trained[collections[0]] if unwrap else trained
    prefixes = normalize_prefixes(stacked, _WHERE)
    # Only the trained collection is checked: nn.scan may broadcast other collections (variable_broadcast).
    check_stacked(params, {}, prefixes, _WHERE, _DEPTH_FIX)

    def as_variables(params: PyTree) -> dict[str, Any]:
        return {**rest, **({collections[0]: params} if unwrap else dict(params))}

    def loss_fn(params: PyTree, batch: PyTree) -> Any:
        sharded = [path_str(p) for p, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_sharded)[0]
                   if is_sharded(x)]  # fmt: skip
        if sharded:
            raise ValueError(
                f"{_WHERE}: the step hands partitioned parameters (e.g. '{sharded[0]}') to the loss: "
                "make_train_step(..., gather='manual') needs a model that gathers its own layers with "
                "zj.scan_layers, which nn.scan cannot do. Use gather='all' (stage 3 then gathers the parameters "
                "inside jax.checkpoint), or the NNX / Equinox adapter for layer-by-layer ZeRO-3."
            )
        return loss(as_variables(params), batch)

    def to_model(state_or_params: Any) -> dict[str, Any]:
        return as_variables(params_of(state_or_params))

    return Adapted(params, loss_fn, prefixes, rest, to_model)
