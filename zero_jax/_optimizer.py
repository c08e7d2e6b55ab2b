"""shard_optimizer: any optax transformation, its state partitioned per a policy.

The inner optax transformation always sees *logical* arrays: the shapes the
user's parameters have. The wrapper unpads what is stored padded, tells the
compiler how the logical arrays are partitioned, runs the inner ``update``
in the global view, and pads the results back. Elementwise math therefore
stays on each device's piece; anything that reduces across a parameter
(``clip_by_global_norm``, Adafactor's row and column means, LAMB's trust
ratio) reduces across pieces with a small all-reduce that the compiler
inserts, and gives exactly the unsharded answer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from zero_jax._partition import LeafLayout, is_layout, pad, unpad
from zero_jax._policy import ZeroPolicy
from zero_jax._tree import PyTree, path_str


class TreeLayouts(NamedTuple):
    """A hashable record of a pytree's leaf layouts (usable as static aux data)."""

    treedef: Any
    layouts: tuple[LeafLayout, ...]

    @classmethod
    def of(cls, layout_tree: PyTree) -> TreeLayouts:
        leaves, treedef = jax.tree_util.tree_flatten(layout_tree, is_leaf=is_layout)
        return cls(treedef, tuple(leaves))

    def tree(self) -> PyTree:
        return jax.tree_util.tree_unflatten(self.treedef, list(self.layouts))


@jax.tree_util.register_pytree_with_keys_class
class ShardedOptState:
    """The state of a :func:`shard_optimizer` transformation.

    Attributes:
      inner_state: the wrapped optimizer's state, in stored form (partitioned
        leaves padded and placed per the policy).
      policy: the policy it was made for (static).
      params: layouts of the parameter tree it was made for (static).
      layouts: layouts of ``inner_state``'s leaves (static).
    """

    def __init__(self, inner_state: PyTree, policy: ZeroPolicy, params: TreeLayouts, layouts: TreeLayouts):
        self.inner_state = inner_state
        self.policy = policy
        self.params = params
        self.layouts = layouts

    def tree_flatten_with_keys(self) -> tuple[Any, Any]:
        return ((jax.tree_util.GetAttrKey("inner_state"), self.inner_state),), (
            self.policy,
            self.params,
            self.layouts,
        )

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> ShardedOptState:
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        return f"ShardedOptState(inner_state={self.inner_state!r}, policy={self.policy!r})"


class ShardedTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation whose state is partitioned per ``policy``.

    Made by :func:`shard_optimizer`; ``inner`` is the wrapped transformation.
    """

    inner: optax.GradientTransformation
    policy: ZeroPolicy


def _constrain(
    x: jax.Array, policy: ZeroPolicy, layout: LeafLayout, partitioned: bool, axes: tuple[str, ...] | None
) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, policy.named_sharding(layout, partitioned, axes))


def store(
    tree: PyTree, layouts: PyTree, policy: ZeroPolicy, partitioned: bool, *, axes: tuple[str, ...] | None = None
) -> PyTree:
    """Logical (or already stored) arrays -> stored form: padded if
    partitioned (over ``axes``: the parameters' axes by default), and placed."""

    def one(x: jax.Array, lay: LeafLayout) -> jax.Array:
        if not partitioned or lay.dim is None:
            return _constrain(x, policy, lay, False, axes)
        if tuple(x.shape) == lay.shape:
            x = pad(x, lay)
        return _constrain(x, policy, lay, True, axes)

    return jax.tree.map(one, tree, layouts)


def to_logical(
    tree: PyTree, layouts: PyTree, policy: ZeroPolicy, partitioned: bool, *, axes: tuple[str, ...] | None = None
) -> PyTree:
    """Stored (or already logical) arrays -> logical arrays, still partitioned.

    Inside ``jit`` the compiler keeps the unpadded array on the same devices
    (the cut lines of the padded and unpadded arrays coincide), so this moves
    no data.
    """

    def one(x: jax.Array, lay: LeafLayout) -> jax.Array:
        if tuple(x.shape) == lay.stored_shape and lay.padding:
            x = unpad(x, lay)
        return _constrain(x, policy, lay, partitioned and lay.dim is not None, axes)

    return jax.tree.map(one, tree, layouts)


def check_tree(tree: PyTree, expected: TreeLayouts, what: str, fix: str) -> None:
    """Raise a ValueError naming the first leaf of ``tree`` whose structure or
    shape matches neither the logical nor the stored form of ``expected``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if treedef != expected.treedef:
        raise ValueError(
            f"{what} has a different tree structure from the parameters it was made for.\n"
            f"  got:      {treedef}\n  expected: {expected.treedef}\n{fix}"
        )
    for (path, leaf), lay in zip(pairs, expected.layouts, strict=True):
        shape = tuple(getattr(leaf, "shape", ()))
        if shape not in (lay.shape, lay.stored_shape):
            raise ValueError(
                f"{what}: leaf '{path_str(path)}' has shape {shape}, but the parameter was "
                f"{lay.shape} (stored as {lay.stored_shape}).\n{fix}"
            )


def _trainable_labels(trainable: Any) -> Any:
    """optax.multi_transform labels ("train" / "frozen") from a trainable mask."""

    def labels(params: PyTree) -> PyTree:
        mask = trainable(params) if callable(trainable) else trainable
        mask_def = jax.tree.structure(mask)
        params_def = jax.tree.structure(params)
        if mask_def != params_def:
            raise ValueError(
                "shard_optimizer(trainable=...): the mask's tree does not match the parameters.\n"
                f"  mask:       {mask_def}\n  parameters: {params_def}\n"
                "Give one bool per parameter leaf, in the parameters' structure (or a function of the parameters)."
            )
        return jax.tree.map(lambda t: "train" if bool(t) else "frozen", mask)

    return labels


def frozen_leaves(tx: optax.GradientTransformation, params: PyTree) -> PyTree:
    """Which parameters ``tx`` never changes: ``True`` where the update is a
    constant (``optax.set_to_zero``, a ``multi_transform`` label routed to it)
    *and* no update or state reads that parameter's gradient.

    Read off the traced update (a data-dependence walk over its jaxpr), so it
    holds for any composition of transformations. Such leaves get no gradient,
    no gradient communication and (with ``set_to_zero``) no optimizer state.

    >>> import jax, optax, zero_jax as zj
    >>> params = {"w": jax.ShapeDtypeStruct((4,), "float32"), "b": jax.ShapeDtypeStruct((4,), "float32")}
    >>> tx = optax.multi_transform({"a": optax.adam(1e-3), "f": optax.set_to_zero()}, {"w": "a", "b": "f"})
    >>> zj.frozen_leaves(tx, params)
    {'b': True, 'w': False}
    """
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    state = jax.eval_shape(tx.init, abstract)
    closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p)[0:2])(abstract, state, abstract)
    jaxpr = closed.jaxpr
    num_grads = len(jax.tree.leaves(abstract))
    num_updates = num_grads
    depends: dict[Any, int] = {v: (1 << i) if i < num_grads else 0 for i, v in enumerate(jaxpr.invars)}

    def mask_of(v: Any) -> int:
        return 0 if hasattr(v, "val") else depends.get(v, 0)  # literals depend on nothing

    for eqn in jaxpr.eqns:
        m = 0
        for v in eqn.invars:
            m |= mask_of(v)
        for v in eqn.outvars:
            depends[v] = m
    out_masks = [mask_of(v) for v in jaxpr.outvars]
    read = 0
    for m in out_masks:
        read |= m
    frozen = [out_masks[i] == 0 and not (read >> i) & 1 for i in range(num_updates)]
    return jax.tree.unflatten(jax.tree.structure(abstract), frozen)


def shard_optimizer(
    tx: optax.GradientTransformation | Any, policy: ZeroPolicy, *, trainable: Any = None
) -> ShardedTransformation:
    """Wrap any optax transformation so its state is partitioned per ``policy``.

    ``init(params)`` takes the logical parameters (arrays or tracers; under
    ``jax.jit`` or ``jax.eval_shape`` nothing is materialised whole) and
    returns a :class:`ShardedOptState`. ``update(grads, state, params)``
    takes gradients and parameters in logical or stored form, leaf by leaf,
    and returns updates in the form the gradients came in. Call ``update``
    inside ``jax.jit`` (``make_train_step`` does).

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=1, mesh=mesh)
    >>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    >>> state = jax.jit(tx.init)({"w": jnp.zeros((1024, 8))})
    >>> state.inner_state[0].mu["w"].sharding.spec
    P('data',)
    """
    if isinstance(tx, ShardedTransformation):
        raise TypeError(
            "shard_optimizer: this transformation is already sharded (for "
            f"{tx.policy!r}); wrap the plain optax transformation once."
        )
    if hasattr(tx, "gradient_transformation"):  # optax.MultiSteps and friends
        tx = tx.gradient_transformation()
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"shard_optimizer: expected an optax.GradientTransformation, got {type(tx).__name__}. "
            "Pass an optax optimizer such as optax.adamw(1e-3)."
        )
    if not isinstance(policy, ZeroPolicy):
        raise TypeError(f"shard_optimizer: policy must be a ZeroPolicy, got {type(policy).__name__}.")
    if trainable is not None:
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, _trainable_labels(trainable))
    partitioned = policy.partitions_opt_state
    axes = policy.state_axes  # the optimizer's view: state, gradients and parameters cut alike
    fix = (
        "This optimizer state belongs to another parameter tree or policy: create it with "
        "zj.init_state(params, tx, policy) for these parameters (or zj.restore(..., policy=...))."
    )

    def init(params: PyTree) -> ShardedOptState:
        param_layouts = policy.layouts(params)
        inner = tx.init(params)
        layouts = policy.state_layouts(inner, params)
        return ShardedOptState(
            store(inner, layouts, policy, partitioned, axes=axes),
            policy,
            TreeLayouts.of(param_layouts),
            TreeLayouts.of(layouts),
        )

    def update(
        updates: PyTree, state: ShardedOptState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, ShardedOptState]:
        if not isinstance(state, ShardedOptState):
            raise TypeError(
                f"shard_optimizer.update: expected the ShardedOptState made by this "
                f"transformation's init, got {type(state).__name__}. {fix}"
            )
        if state.policy != policy:
            raise ValueError(
                f"shard_optimizer.update: this optimizer state was made for {state.policy!r}, "
                f"but this optimizer is sharded for {policy!r}. {fix}"
            )
        check_tree(updates, state.params, "shard_optimizer.update: the gradient tree", fix)
        param_layouts = state.params.tree()
        state_layouts = state.layouts.tree()
        inner_state = to_logical(state.inner_state, state_layouts, policy, partitioned, axes=axes)
        grads = to_logical(updates, param_layouts, policy, partitioned, axes=axes)
        if params is not None:
            check_tree(params, state.params, "shard_optimizer.update: the parameter tree", fix)
            params = to_logical(params, param_layouts, policy, partitioned, axes=axes)
        new_updates, new_inner = tx.update(grads, inner_state, params, **extra_args)  # type: ignore[call-arg]
        new_inner = store(new_inner, state_layouts, policy, partitioned, axes=axes)

        # Hand the updates back in the form each gradient came in.
        def back(u: jax.Array, g: jax.Array, lay: LeafLayout) -> jax.Array:
            stored = tuple(g.shape) == lay.stored_shape and lay.padding > 0
            part = partitioned and lay.dim is not None
            return _constrain(pad(u, lay) if stored else u, policy, lay, part, axes)

        new_updates = jax.tree.map(back, new_updates, updates, param_layouts)
        return new_updates, ShardedOptState(new_inner, policy, state.params, state.layouts)

    wrapped = ShardedTransformation(init, update)
    wrapped.inner = tx
    wrapped.policy = policy
    return wrapped
