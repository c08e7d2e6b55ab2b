"""Flax Linen models under ZeRO: ``from_linen(module, variables, loss)``.

Linen keeps a model's numbers outside the module, in the variables dict that
``module.init`` returns. The ``"params"`` collection (or the collections named
by ``trainable=``) becomes ``params``; every other collection
(``"batch_stats"``, ``"cache"``, ``"intermediates"``, ...) is
``non_trainable``: whole on every device, never trained.
``loss(variables, batch)`` receives the whole variables dict, so it calls
``module.apply(variables, ...)`` as usual; Linen itself refuses to update a
collection unless ``apply`` is given ``mutable=``.

Collections the loss updates (``"batch_stats"`` of ``nn.BatchNorm`` in
training mode) are named with ``from_linen(..., mutable=["batch_stats"])``:
they become the adapter's ``model_state`` (``TrainState.model_state``,
updated every step: each device from its slice of the batch, float values
averaged over the devices), and the loss returns what
``module.apply(variables, x, mutable=[...])`` gave back besides its output:
``loss(variables, batch) -> (out, updates)`` with ``out`` the loss (or
``(loss, aux)``) and ``updates`` the dict of updated collections. Without
``mutable=`` the other collections are constants of the step.

Stacked layers are declared with ``stacked=`` (the stack's name), so the
policy never cuts the layer axis. Stacks made with ``nn.scan``
(``variable_axes={"params": 0}``) train under every stage with
``gather="all"`` (stage 3 gathers the parameters inside ``jax.checkpoint``;
the backward pass gathers again). For layer-by-layer ZeRO-3
(``gather="manual"``) build the stack with :class:`ScanLayers` instead, a
drop-in for that ``nn.scan`` that runs ``zj.scan_layers``: inside the step
each layer is gathered just before use. (``nn.scan`` itself cannot: it
slices the parameters it is given, and the pieces of a partitioned parameter
are not layers.)

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

Batch norm in training mode: ``mutable=`` names the collections the loss updates.

>>> bn = nn.Sequential([nn.Dense(2), nn.BatchNorm(use_running_average=False)])
>>> variables = bn.init(jax.random.key(0), jnp.ones((1, 4)))
>>> def bn_loss(variables, batch):
...     pred, updates = bn.apply(variables, batch["x"], mutable=["batch_stats"])
...     return jnp.mean((pred - batch["y"]) ** 2), updates
>>> adapted = zj.adapters.from_linen(bn, variables, bn_loss, mutable="batch_stats")
>>> state = adapted.init_state(tx, policy)  # zj.init_state(..., model_state=adapted.model_state)
>>> step = adapted.make_train_step(tx, policy)  # zj.make_train_step(..., stateful=True)
>>> state, metrics = step(state, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
>>> sorted(adapted.to_model(state))  # with the updated batch statistics
['batch_stats', 'params']

An unscanned model, as people write one (a Python loop over blocks), trained
block by block: ``layers="auto"`` finds ``Dense_0 … Dense_2`` and the step
gathers each just before its call, in both passes.

>>> class Deep(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         for _ in range(3):
...             x = jnp.tanh(nn.Dense(4)(x))
...         return x
>>> deep = Deep()
>>> variables = deep.init(jax.random.key(0), jnp.ones((1, 4)))
>>> def deep_loss(variables, batch):
...     return jnp.mean((deep.apply(variables, batch["x"]) - batch["y"]) ** 2)
>>> adapted = zj.adapters.from_linen(deep, variables, deep_loss, layers="auto")
>>> print(adapted.layers)
3 blocks at Dense_0 … Dense_2, 80 B each
>>> policy = adapted.policy(stage=3, mesh=policy.mesh, min_shard_size=0)
>>> tx = zj.shard_optimizer(optax.sgd(0.1), policy)
>>> step = adapted.make_train_step(tx, policy)  # gather="manual"
>>> state, metrics = step(adapted.init_state(tx, policy), {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 4))})
>>> bool(metrics["finite"])
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from flax.core import unfreeze

from zero_jax._base.tree import PyTree, split_prefix, under_any
from zero_jax._layerwise.blocks import LayerChain
from zero_jax.adapters._blocks import (
    Blocks,
    block_params,
    check_layer_options,
    classes_by_auto_name,
    find_blocks,
    gather_outside,
    instances_in,
    repeated_groups,
    subtree_paths,
)
from zero_jax.adapters._common import (
    Adapted,
    active_policy,
    carried_updates,
    check_declared_blocks,
    check_stacked,
    check_trainable_floats,
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
from zero_jax.adapters._linen_intercept import Interceptor
from zero_jax.adapters._specs import linen_layout

__all__ = ["ScanLayers", "from_linen"]

_WHERE = "zj.adapters.from_linen"
_DEPTH_FIX = (
    "Make the stack with one ScanLayers(block, length=depth) (or nn.scan(..., variable_axes={'params': 0}, "
    "length=depth)) and keep "
    "unstacked submodules out of the stacked= subtree."
)
_INIT_HINT = "variables = module.init(jax.random.key(0), example_input)"


_NO_PRETRAINED_PARAMS = (
    "{where}: {name} looks like a Hugging Face Flax model (its .module is a Linen {module}), but its .params "
    "cannot be read ({error}). Pass the parameters yourself: from_linen(model.module, {{'params': params}}, loss)."
)


def _pretrained_parts(obj: Any, variables: Any, loss: Any) -> tuple[Any, Any, Any]:
    """A Hugging Face Flax model (``FlaxPreTrainedModel``: ``.module``, a Linen
    module, and ``.params``), recognised by those two attributes (transformers
    is not imported): ``(obj.module, {"params": obj.params}, loss)``, the loss
    allowed in the place of the variables. ``.params`` that already holds
    collections (``{"params": ..., "batch_stats": ...}``, as some models keep
    them) is the variables dict itself. Anything else is returned as given."""
    module = getattr(obj, "module", None) if not isinstance(obj, nn.Module) else None
    if not isinstance(module, nn.Module):
        return obj, variables, loss
    if loss is None and callable(variables) and not isinstance(variables, Mapping):
        variables, loss = None, variables
    if variables is None:
        try:
            params = obj.params  # transformers raises when the model was made with _do_init=False
            problem = None if isinstance(params, Mapping) else f"it is {describe(params)}, not a dict"
        except Exception as e:
            params, problem = None, f"{type(e).__name__}: {e}"
        if problem is not None:
            name, kind = type(obj).__name__, type(module).__name__
            raise TypeError(_NO_PRETRAINED_PARAMS.format(where=_WHERE, name=name, module=kind, error=problem))
        has_collections = isinstance(params.get("params"), Mapping)  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
        variables = unfreeze(params) if has_collections else {"params": unfreeze(params)}  # pyright: ignore[reportArgumentType] - variables are set once the module is initialised
    return module, variables, loss


def _check_inputs(module: Any, variables: Any, loss: Any) -> None:
    if not isinstance(module, nn.Module):
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


def _check_collections(
    module: nn.Module, variables: Mapping[str, Any], collections: tuple[str, ...], mutables: tuple[str, ...]
) -> None:
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
    for c in mutables:
        if c in collections:
            raise ValueError(f"{_WHERE}: collection {c!r} is both trainable and mutable=; it can be only one.")
        if c not in variables:
            raise ValueError(
                f"{_WHERE}: mutable collection {c!r} is not in the variables of {type(module).__name__} (they have "
                f"{sorted(variables)}). Name collections that module.init created."
            )


def from_linen(
    module: nn.Module,
    variables: Mapping[str, Any] | None = None,
    loss: Callable[[Mapping[str, Any], PyTree], Any] | None = None,
    *,
    trainable: str | Sequence[str] = "params",
    stacked: str | Sequence[str] = (),
    mutable: str | Sequence[str] = (),
    layers: Any = None,
    prefetch: int = 1,
    logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
    keep_gathered: int | str = 0,
) -> Adapted:
    """Adapt a Flax Linen module: ``loss(variables, batch) -> loss`` (or
    ``(loss, aux)``) becomes ``loss_fn(params, batch)`` for
    ``zj.make_train_step``.

    Args:
      module: the ``flax.linen.Module``, or a Hugging Face Flax model (a
        ``FlaxPreTrainedModel``: its ``.module`` is the Linen module and its
        ``.params`` the variables, so ``from_linen(hf_model, loss)`` works;
        write the trained ones back with
        ``hf_model.params = adapted.to_model(state)["params"]``).
      variables: its variables dict, as ``module.init(...)`` returns it
        (default for a Hugging Face model: ``{"params": hf_model.params}``).
      loss: the mean loss over the batch it is given, of the whole variables
        dict (trained ``params`` plus the constant other collections).
      trainable: the collection(s) to train (default ``"params"``).
      stacked: key-path prefixes inside the trained collection (``"layers"``,
        ``"decoder/ScanBlock_0"``) of stacks made with ``nn.scan`` or
        :class:`ScanLayers` (the name given to it).
      mutable: the collections the loss updates (``"batch_stats"``): they are
        ``adapted.model_state``, carried from step to step, and the loss
        returns ``(out, updates)``, ``updates`` being the updated collections
        ``module.apply(..., mutable=...)`` returned. Train with
        ``adapted.init_state`` / ``adapted.make_train_step`` (or pass
        ``model_state=`` / ``stateful=True`` yourself).
      layers: the model's unscanned blocks, to gather one at a time (ZeRO-3
        that never holds the whole model, for the model as written: a Python
        loop over ``self.h[i]`` or ``h_0 … h_N``): ``"auto"`` (every group
        of sibling submodules named ``<name><number>``, at least two, sharing
        one structure, a member with extra leaves such as T5's first block
        with its position bias included: each stack of an encoder–decoder;
        numbered siblings that differ otherwise are left whole, with a
        warning), a key-path pattern with ``*`` (``"transformer/h/*"``,
        ``"layers_*"``), a list of patterns (``["encoder/block/*",
        "decoder/block/*"]``) or a module class (tuple of classes). Blocks
        inside ``nn.remat`` / ``nn.jit`` (or ``@nn.remat`` on ``__call__``)
        and blocks calling a module they are given (shared by several
        blocks) train too; ``nn.vmap`` around a block is refused with what
        to do. Inside a ``gather="manual"`` step (the default of
        ``adapted.make_train_step`` then) each call of a matched block is
        intercepted (``nn.intercept_methods``) and run by
        ``zj.apply_layer``'s per-block primitive; everything else (embeddings,
        final norm, head) is gathered when the loss starts. Found blocks:
        ``adapted.layers``. Outside such a step the blocks run as written.
      prefetch: with ``layers=``: how many blocks ahead to gather (0 to the number of blocks).
        On TPU each block is gathered in place whatever it says (``zj.apply_layers``).
      logical_axis_rules: ``(logical, mesh_axis)`` pairs, as ``nn.logical_to_mesh_axes`` takes them, for
        the names in ``nn.with_(logical_)partitioning`` boxes: read into ``adapted.param_specs``.
      keep_gathered: with ``layers=``, stage 3: the last k blocks keep their gathered parameters from the forward
        pass for the backward (k fewer all-gathers, k blocks more memory), or a byte budget (``"2GiB"``): the most
        trailing blocks whose gathered bytes fit (``zj.apply_layers``'s ``keep_gathered``).

    Returns:
      An :class:`~zero_jax.adapters.Adapted`; ``params`` is the trained collection (``{"params": ...}`` is
      unwrapped when it is the only one; ``nn.Partitioned`` boxes unboxed); ``to_model`` returns the variables
      dict (boxed as given, with a TrainState's updated ``mutable`` collections).
    """
    module, variables, loss = _pretrained_parts(module, variables, loss)
    _check_inputs(module, variables, loss)
    collections = (trainable,) if isinstance(trainable, str) else tuple(trainable)
    mutables = (mutable,) if isinstance(mutable, str) else tuple(mutable)
    _check_collections(module, variables, collections, mutables)  # pyright: ignore[reportArgumentType] - variables are set once the module is initialised
    trained = {c: variables[c] for c in collections}  # pyright: ignore[reportOptionalSubscript] - set here: a check above pyright cannot follow
    rest = {c: v for c, v in variables.items() if c not in collections}  # pyright: ignore[reportOptionalMemberAccess] - set here: a check above pyright cannot follow
    check_trainable_floats(trained, _WHERE)
    unwrap = len(collections) == 1
    prefixes = normalize_prefixes(stacked, _WHERE)
    boxed = trained[collections[0]] if unwrap else trained
    params, specs, outward = linen_layout(boxed, logical_axis_rules, prefixes, _WHERE)  # outward: for to_model
    # Only the trained collection is checked: nn.scan may broadcast other collections (variable_broadcast).
    check_stacked(params, {}, prefixes, _WHERE, _DEPTH_FIX)
    blocks = _find_layers(module, variables, params, layers, (prefetch, keep_gathered), unwrap, prefixes, boxed)  # pyright: ignore[reportArgumentType] - variables are set once the module is initialised
    undeclared = repeated_groups(params) if blocks is None and not prefixes else []
    run = _Runner(blocks, (prefetch, keep_gathered), collections[0], prefixes, undeclared)

    def as_variables(params: PyTree) -> dict[str, Any]:
        return {**rest, **({collections[0]: params} if unwrap else dict(params))}

    def loss_fn(params: PyTree, batch: PyTree) -> Any:
        return run(params, lambda p: loss(as_variables(p), batch))  # pyright: ignore[reportOptionalCall] - set here: a check above pyright cannot follow

    if not mutables:

        def to_model(state_or_params: Any) -> dict[str, Any]:
            return as_variables(outward(params_of(state_or_params)))

        return Adapted(params, loss_fn, prefixes, rest, to_model, layers=blocks, param_specs=specs)

    return _stateful(params, run, loss, as_variables, outward, mutables, variables, prefixes, rest, blocks, specs)  # pyright: ignore[reportArgumentType] - variables are set once the module is initialised


def _stateful(
    params: PyTree, run: Any, loss: Any, as_variables: Any, outward: Any, mutables: tuple[str, ...],
    variables: Mapping[str, Any], prefixes: tuple[str, ...], rest: Any, blocks: Blocks | None, specs: PyTree,
) -> Adapted:  # fmt: skip
    """``from_linen``'s result with ``mutable=`` collections: the stateful loss and ``to_model``."""
    initial = {c: unfreeze(variables[c]) for c in mutables}

    def stateful_loss_fn(params: PyTree, model_state: PyTree, batch: PyTree) -> Any:
        result = run(params, lambda p: loss({**as_variables(p), **model_state}, batch))
        return carried_updates(result, mutables, model_state, _WHERE, unfreeze)

    def to_stateful_model(state_or_params: Any, model_state: PyTree = None) -> dict[str, Any]:
        ms = model_state_of(state_or_params, model_state, initial)
        return {**as_variables(outward(params_of(state_or_params))), **ms}

    checked_fn = stateful_signature(stateful_loss_fn, _WHERE)
    return Adapted(params, checked_fn, prefixes, rest, to_stateful_model, initial, True, blocks, specs)


class _Pieces:
    """A partitioned stacked parameter on its way through ``module.apply``: an
    opaque leaf (Linen flattens parameters to check their shapes; the pieces
    inside have other shapes) that reports the parameter's logical shape."""

    def __init__(self, node: Any) -> None:
        self.node = node
        self.shape = node.shape
        self.dtype = node.dtype


def _box(params: PyTree, prefixes: tuple[str, ...]) -> PyTree:
    def one(path: tuple[Any, ...], x: Any) -> Any:
        return _Pieces(x) if is_sharded(x) and under_any(path, map(split_prefix, prefixes)) else x

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_sharded)


_LAYERS_COLLECTIONS = (
    "{where}: layers= needs one trainable collection (the blocks are found in it), got trainable={collections}. "
    "Train one collection, or drop layers=."
)


def _block_classes(module: nn.Module, variables: Mapping[str, Any], params: PyTree, layers: Any) -> dict[str, type]:
    """Key path -> class of the submodules a class ``layers=`` can match:
    those ``setup`` defines (read from the bound module) and compact ones by
    Linen's automatic names (``Block_3`` is a ``Block``)."""
    wanted = layers if isinstance(layers, tuple) else (layers,)
    if not all(isinstance(c, type) for c in wanted):
        return {}
    holding = set(subtree_paths(params))  # a submodule elsewhere holds no block (a shared embedding passed in)
    found: dict[str, type] = {}
    pending = [module.bind(variables)]
    while pending:
        parent = pending.pop()
        getattr(parent, "__zero_jax_setup__", None)  # runs a Linen module's lazy setup()
        for child in instances_in(vars(parent).values(), nn.Module):
            if child.scope is not None and child.path[:-1] == parent.path and "/".join(child.path) in holding:
                found["/".join(child.path)] = type(child)
                pending.append(child)
    return {**classes_by_auto_name(params, wanted), **found}


def _find_layers(
    module: nn.Module, variables: Mapping[str, Any], params: PyTree, layers: Any, options: tuple[Any, Any],
    unwrap: bool, prefixes: tuple[str, ...], created: PyTree,
) -> Blocks | None:  # fmt: skip
    """``layers=`` resolved to the blocks of ``params`` (None without it), every problem named; in call order,
    read from ``created`` (the collection as ``init`` made it: submodules in the order they were called).
    ``options``: ``(prefetch, keep_gathered)``."""
    if layers is None:
        check_layer_options(None, prefixes, options[0], _WHERE, options[1])
        return None
    if not unwrap:
        raise ValueError(_LAYERS_COLLECTIONS.format(where=_WHERE, collections=sorted(params)))
    classes = _block_classes(module, variables, params, layers)
    blocks = find_blocks(params, layers, where=_WHERE, classes=classes, order=created)
    check_layer_options(blocks, prefixes, options[0], _WHERE, options[1])
    return blocks


class _Runner:
    """How the adapted loss runs the user's: pieces outside the blocks (and
    stacks) gathered, block pieces boxed for ``module.apply``, and each call
    of a block intercepted into one :class:`~zero_jax._layerwise.blocks.LayerChain`
    per trace; a plain call outside a manual step."""

    def __init__(
        self, blocks: Blocks | None, options: tuple[int, Any], collection: str, prefixes: tuple[str, ...],
        undeclared: list[Any],
    ) -> None:  # fmt: skip
        (self.prefetch, self.keep_gathered), self.blocks, self.collection = options, blocks, collection
        self.prefixes, self.undeclared = prefixes, undeclared

    def __call__(self, params: PyTree, run: Callable[[PyTree], Any]) -> Any:
        check_declared_blocks(params, self.undeclared, _WHERE)
        policy = active_policy()
        pieces = any(is_sharded(x) for x in jax.tree.leaves(params, is_leaf=is_sharded))
        if self.blocks is None or policy is None or not pieces:
            params = gather_unstacked(params, self.prefixes, _WHERE)
            with explain_unscanned_pieces(params, self.prefixes, _WHERE, "zj.adapters.linen.ScanLayers"):
                return run(_box(params, self.prefixes))
        params = gather_outside(params, self.blocks, _WHERE, keep=self.prefixes)
        # The trace of a block depends on these options besides the policy: in the pieces' structure, a transform
        # caching its trace by it (nn.jit around the model's loop) traces again when they change.
        options = (_WHERE, self.prefetch, self.keep_gathered, self.blocks.paths)
        params = jax.tree.map(lambda x: x.with_context(options) if is_sharded(x) else x, params, is_leaf=is_sharded)
        chain = LayerChain(policy, block_params(params, self.blocks), self.prefetch, keep_gathered=self.keep_gathered,
                           pinned=True)  # fmt: skip
        index = {tuple(split_prefix(p)): i for i, p in enumerate(self.blocks.paths)}
        with (
            nn.intercept_methods(Interceptor(chain, index, self.collection, _WHERE)),
            explain_unscanned_pieces(params, self.prefixes, _WHERE, "zj.adapters.linen.ScanLayers"),
        ):
            # Block leaves stay Sharded pytrees (JAX values), so a lifted transform around a block passes them.
            return run(_box(params, self.prefixes))


class ScanLayers(nn.Module):
    """``length`` copies of ``block`` (a Linen module mapping ``x -> x``, with
    parameters only), stacked on a leading layer axis and run with
    ``zj.scan_layers``: the drop-in for ``nn.scan(Block, variable_axes={"params":
    0}, split_rngs={"params": True}, length=length)`` that lets a
    ``gather="manual"`` step gather one layer at a time. Its parameters live
    under ``<name>/stack``; declare ``stacked="<name>"`` in ``from_linen``.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from zero_jax.adapters import linen as zj_linen
    >>> stack = zj_linen.ScanLayers(nn.Dense(4), length=3)
    >>> variables = stack.init(jax.random.key(0), jnp.ones((2, 4)))
    >>> variables["params"]["stack"]["kernel"].shape
    (3, 4, 4)
    >>> stack.apply(variables, jnp.ones((2, 4))).shape
    (2, 4)
    """

    block: nn.Module
    length: int
    prefetch: int = 1
    remat: bool = True

    @nn.compact
    def __call__(self, x: Any) -> Any:
        block = self.block.clone(parent=None)

        def init(rng: jax.Array) -> PyTree:
            keys = jax.random.split(rng, self.length)
            return jax.vmap(lambda k: block.init(k, x)["params"])(keys)

        stacked = self.param("stack", init)
        stacked = jax.tree.map(lambda v: v.node if isinstance(v, _Pieces) else v, stacked)
        return scan_stacked(
            lambda p, _, c: block.apply({"params": p}, c), stacked, {}, x, prefetch=self.prefetch, remat=self.remat
        )
