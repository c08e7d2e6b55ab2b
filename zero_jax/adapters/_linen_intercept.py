"""How ``from_linen(..., layers=...)`` runs a matched block inside a manual-gather step: the
``nn.intercept_methods`` hook that turns the block's call into one call of the step's
:class:`~zero_jax._layerwise.LayerChain`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn

from zero_jax._base.tree import PyTree
from zero_jax._layerwise.blocks import LayerChain, batched_by_vmap
from zero_jax.adapters._blocks import split_arrays
from zero_jax.adapters._common import per_device

__all__ = ["UNDER_NN_VMAP", "Interceptor"]


class Interceptor:
    """``nn.intercept_methods`` hook: a matched block's ``__call__`` becomes
    ``chain.call(i, ...)``, the block run functionally on its whole
    parameters (an unbound clone's ``apply``) with its other collections, RNG
    keys and the call's array arguments passed through the chain, static
    arguments closed over, and updated mutable collections written back.

    A block wrapped in a Flax lifted transform (``nn.remat(Block)``,
    ``nn.jit(Block)``, ``@nn.remat`` on its ``__call__``) is intercepted inside
    the transform: its partitioned parameters went through it as ``Sharded``
    pytrees (piece and gradient slot: JAX values), and the chain runs block i
    on the pieces as the transform handed them. Submodules the block uses but
    does not own (a module passed to it, shared by several blocks) run with
    their whole parameters as constants of the block's call: their gradient
    is each call's contribution, summed."""

    def __init__(self, chain: LayerChain, index: Mapping[tuple[str, ...], int], collection: str, where: str) -> None:
        self.chain, self.index, self.collection, self.where = chain, index, collection, where
        self.running = False  # inside a block's functional apply: its submodules run as written

    def __call__(self, next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
        module = context.module
        i = None if self.running or context.method_name != "__call__" else self.index.get(tuple(module.path))
        if i is None or module.is_initializing():
            return next_fun(*args, **kwargs)
        scope = module.scope
        arrays, rebuild = split_arrays(args, kwargs)
        if any(batched_by_vmap(a) for a in arrays):
            raise ValueError(UNDER_NN_VMAP.format(where=self.where, block="/".join(module.path)))
        # The blocks' parameters as this call sees them: the step's pieces, or inside a lifted transform
        # (nn.remat, nn.jit around the block or around the loop) the same pieces as that transform passed them in.
        self.chain.see({**self._visible(scope), i: scope.variables()[self.collection]})
        state = {c: v for c, v in scope.variables().items() if c != self.collection}
        mutable = [c for c in state if scope.is_mutable_collection(c)]
        keys = {n: scope.make_rng(n) for n in sorted(getattr(scope, "rngs", {})) if n != "params"}
        borrowed = _borrowed(module, scope)
        clone = module.clone(parent=None)

        def layer_fn(p: PyTree, arrays: list[Any], state: PyTree, keys: PyTree) -> Any:
            call_args, call_kwargs = rebuild(arrays)
            variables = {self.collection: p, **state}
            for name, theirs in borrowed.items():  # closed over: the chain differentiates them as constants
                for c, tree in theirs.items():
                    variables[c] = {**variables.get(c, {}), name: tree}
            self.running = True
            try:
                out = clone.apply(variables, *call_args, rngs=keys, mutable=mutable or False, **call_kwargs)
            finally:
                self.running = False
            return per_device(out) if mutable else (per_device(out), {})

        out, updates = self.chain.call(i, layer_fn, arrays, state, keys)
        for collection, tree in updates.items():
            for name, value in tree.items():
                if name not in borrowed:
                    scope.put_variable(collection, name, value)
        return out

    def _visible(self, scope: Any) -> dict[int, PyTree]:
        """The blocks whose parameters the innermost lifted transform around this call holds (its root scope:
        the whole model without one), as that transform passed them in: the next blocks' prefetch reads them,
        not the enclosing trace's values, which a transform caching its trace (nn.jit) must not close over."""
        root = scope.root
        base, tree = tuple(root.path), root.variables().get(self.collection)
        found = {i: _subtree(tree, keys[len(base):]) for keys, i in self.index.items() if keys[: len(base)] == base}
        return {i: params for i, params in found.items() if params is not None}


def _subtree(tree: Any, keys: tuple[str, ...]) -> Any:
    """The node of a nested variables dict at ``keys``, or None."""
    for k in keys:
        if not isinstance(tree, Mapping) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _borrowed(module: nn.Module, scope: Any) -> dict[str, Any]:
    """The variables of the submodules ``module`` holds in a field but does not own (bound elsewhere: a module
    passed to it, shared by several blocks), by the field's name (where its unbound clone looks them up)."""
    mine = tuple(scope.path)
    out: dict[str, Any] = {}
    for field, child in vars(module).items():
        if isinstance(child, nn.Module) and child.scope is not None and tuple(child.path)[: len(mine)] != mine:
            out[field] = dict(child.variables)
    return out


UNDER_NN_VMAP = (
    "{where}: the layers= block '{block}' is called inside nn.vmap (or jax.vmap): its inputs are batched, and its "
    "per-block gathers and gradient reduce-scatters must see the whole per-device batch. Put the vmap inside the "
    "block (vmap the block's body, e.g. nn.vmap(Body, variable_axes={{'params': None}}, split_rngs={{'params': "
    "False}}) called in Block.__call__), or leave '{block}' out of layers= (a pattern or list naming the other "
    "blocks): it is then gathered whole with the rest of the model."
)
