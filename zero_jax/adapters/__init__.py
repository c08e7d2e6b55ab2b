"""Bring a model from Flax NNX, Flax Linen or Equinox to ZeRO without rewriting it.

Each adapter takes the model as its library makes it and a loss written
against that model, and returns an :class:`Adapted`: ``params`` (the
trainable arrays) and ``loss_fn(params, batch)`` for ``zj.init_state`` and
``zj.make_train_step`` unchanged, ``stacked`` for the policy, the
``non_trainable`` state it holds constant, and ``to_model(state)`` back to
the library's object::

    adapted = zj.adapters.from_nnx(model, loss)                      # loss(model, batch)
    adapted = zj.adapters.from_linen(module, variables, loss)        # loss(variables, batch)
    adapted = zj.adapters.from_linen(hf_model, loss)                 # a Hugging Face Flax model
    adapted = zj.adapters.from_equinox(model, loss)                  # loss(model, batch)

    policy = adapted.policy(stage=3, mesh=mesh)      # = ZeroPolicy(..., stacked=adapted.stacked)
    tx = zj.shard_optimizer(optax.adamw(1e-3), policy)
    state = adapted.init_state(tx, policy)           # = zj.init_state(adapted.params, tx, policy,
                                                     #       model_state=adapted.model_state)
    step = adapted.make_train_step(tx, policy)       # = zj.make_train_step(adapted.loss_fn, tx, policy,
                                                     #       stateful=adapted.stateful)
    model = adapted.to_model(state)

Non-trainable state the loss updates (batch-norm statistics, RNG counts, an
``eqx.nn.State``) is ``adapted.model_state``, carried from step to step in
``TrainState.model_state``: NNX by default (``state_updates="carry"``), Linen
for the collections named in ``mutable=``, Equinox for the ``state=`` passed.
Without any, ``adapted.stateful`` is False and the plain
``zj.init_state(adapted.params, ...)`` / ``zj.make_train_step(adapted.loss_fn,
...)`` path is the same thing.

Unscanned models (a Python loop over blocks: ``h_0 … h_N``, a list of
blocks) train block by block with ``layers=``: ``from_linen(module, variables,
loss, layers="auto")`` (every group of numbered blocks: both stacks of an
encoder–decoder), a key-path pattern such as ``"transformer/h/*"``, a list of
patterns, or the block's class. Each matched block is gathered just before its call,
in both passes, by a ``gather="manual"`` step (``adapted.make_train_step``'s
default then); ``adapted.layers`` says what was found.

Flax and Equinox are imported only when their adapter is used
(``pip install 'zero_jax[adapters]'``). Layer-by-layer ZeRO-3
(``gather="manual"``) for stacked layers: ``zero_jax.adapters.nnx.scan_layers``,
``zero_jax.adapters.linen.ScanLayers`` and ``zero_jax.adapters.equinox.scan_layers``,
drop-ins for ``nnx.scan``, ``nn.scan`` and a ``lax.scan`` over an Equinox stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zero_jax.adapters._common import Adapted

if TYPE_CHECKING:  # pragma: no cover
    from zero_jax.adapters.equinox import from_equinox
    from zero_jax.adapters.linen import from_linen
    from zero_jax.adapters.nnx import from_nnx

__all__ = ["Adapted", "equinox", "from_equinox", "from_linen", "from_nnx", "linen", "nnx"]  # pyright: ignore[reportUnsupportedDunderAll] - nnx, linen, equinox load lazily (__getattr__)

_LAZY = {"from_nnx": "nnx", "from_linen": "linen", "from_equinox": "equinox"}
_PACKAGES = {"nnx": "flax", "linen": "flax", "equinox": "equinox"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name, name if name in _PACKAGES else None)
    if module is None:
        raise AttributeError(f"module 'zero_jax.adapters' has no attribute {name!r}")
    try:
        mod = importlib.import_module(f"zero_jax.adapters.{module}")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == _PACKAGES[module]:
            raise ModuleNotFoundError(
                f"zero_jax.adapters.{name} needs {_PACKAGES[module]}: pip install 'zero_jax[adapters]'",
                name=e.name,
            ) from e
        raise
    return getattr(mod, name) if name in _LAZY else mod


def __dir__() -> list[str]:
    return sorted(__all__)
