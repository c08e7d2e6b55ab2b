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

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from zero_jax._base import jaxpr as _jaxpr
from zero_jax._base.tree import PyTree, path_str
from zero_jax._layout.leaf import LeafLayout, is_float, is_layout, pad
from zero_jax._layout.trees import TreeLayouts
from zero_jax._policy.placement import place, store, to_logical
from zero_jax._policy.policy import ZeroPolicy


@jax.tree_util.register_pytree_with_keys_class
class ShardedOptState:
    """The state of a :func:`shard_optimizer` transformation.

    Attributes:
      inner_state: the wrapped optimizer's state, in stored form (partitioned
        leaves padded and placed per the policy). Non-float parameters have
        no entry in it (they are empty ``optax.MaskedNode``\\ s to the wrapped
        optimizer).
      policy: the policy it was made for (static).
      param_layouts: layouts of the parameter tree it was made for (static).
      layouts: layouts of ``inner_state``'s leaves (static).
    """

    def __init__(self, inner_state: PyTree, policy: ZeroPolicy, param_layouts: TreeLayouts, layouts: TreeLayouts):
        self.inner_state = inner_state
        self.policy = policy
        self.param_layouts = param_layouts
        self.layouts = layouts

    @property
    def params(self) -> TreeLayouts:
        """Deprecated alias of :attr:`param_layouts` (it never held parameters)."""
        return self.param_layouts

    def tree_flatten_with_keys(self) -> tuple[Any, Any]:
        return ((jax.tree_util.GetAttrKey("inner_state"), self.inner_state),), (
            self.policy,
            self.param_layouts,
            self.layouts,
        )

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> ShardedOptState:
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        return f"ShardedOptState(inner_state={self.inner_state!r}, policy={self.policy!r})"


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedParts:
    """What a :func:`shard_optimizer` transformation is made of.

    Attributes:
      inner: the wrapped optax transformation (with ``trainable=``, the
        ``optax.multi_transform`` that routes frozen leaves to
        ``optax.set_to_zero``).
      policy: the policy its state is partitioned for.
    """

    inner: optax.GradientTransformation
    policy: ZeroPolicy


class _Carrying:
    """``init`` or ``update`` of a sharded transformation: the function, and
    the :class:`ShardedParts` it closes over, readable by :func:`sharded_parts`.

    The parts travel with the functions themselves, the leaves of the
    transformation's pytree, so whatever rebuilds the ``NamedTuple``
    (``jax.tree.map(lambda f: f, tx)``, ``tree_unflatten(tree_flatten(tx))``)
    keeps them.
    """

    def __init__(self, fn: Callable[..., Any], parts: ShardedParts) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.parts = parts

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def sharded_parts(tx: Any) -> ShardedParts | None:
    """The :class:`ShardedParts` of a :func:`shard_optimizer` transformation
    (also after ``jax.tree.map`` or ``tree_unflatten`` rebuilt it, or when
    only its ``init`` / ``update`` were kept in another ``NamedTuple``);
    ``None`` for anything else.

    >>> import jax, optax, zero_jax as zj
    >>> from zero_jax._step.optimizer import sharded_parts
    >>> policy = zj.ZeroPolicy(stage=1, mesh=jax.make_mesh((jax.device_count(),), ("data",)))
    >>> tx = jax.tree.map(lambda f: f, zj.shard_optimizer(optax.sgd(0.1), policy))
    >>> sharded_parts(tx).policy == policy, sharded_parts(optax.sgd(0.1))
    (True, None)
    """
    for fn in (getattr(tx, "init", None), getattr(tx, "update", None)):
        if isinstance(fn, _Carrying):
            return fn.parts
    return None


class ShardedTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation whose state is partitioned per ``policy``.

    Made by :func:`shard_optimizer`: a plain ``(init, update)`` pair, like
    every optax wrapper, that keeps the wrapped transformation in the
    functions' closures. ``inner`` and ``policy`` read them back (see
    :func:`sharded_parts`).
    """

    @property
    def inner(self) -> optax.GradientTransformation:
        """The wrapped optax transformation."""
        return _parts(self).inner

    @property
    def policy(self) -> ZeroPolicy:
        """The policy this transformation's state is partitioned for."""
        return _parts(self).policy


def _parts(tx: Any) -> ShardedParts:
    parts = sharded_parts(tx)
    if parts is None:
        raise TypeError(NOT_SHARDED.format(kind=type(tx.init).__name__))
    return parts


#: A ``ShardedTransformation`` whose functions are not the ones shard_optimizer made.
NOT_SHARDED = (
    "ShardedTransformation: its init is a {kind}, not the function zj.shard_optimizer made, so it carries no "
    "inner transformation or policy. Build it with zj.shard_optimizer(optax_tx, policy)."
)


#: ``check_tree``: leaves whose shapes fit neither form of the parameters.
WRONG_SHAPES = "{what}: {leaves}.\n{fix}"


def check_tree(tree: PyTree, expected: TreeLayouts, what: str, fix: str) -> None:
    """Raise one ValueError naming every leaf of ``tree`` whose structure or
    shape matches neither the logical nor the stored form of ``expected``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if treedef != expected.treedef:
        raise ValueError(
            f"{what} has a different tree structure from the parameters it was made for.\n"
            f"  got:      {treedef}\n  expected: {expected.treedef}\n{fix}"
        )
    bad = [
        f"leaf '{path_str(path)}' has shape {tuple(getattr(leaf, 'shape', ()))}, but the parameter was "
        f"{lay.shape} (stored as {lay.stored_shape})"
        for (path, leaf), lay in zip(pairs, expected.layouts, strict=True)
        if tuple(getattr(leaf, "shape", ())) not in (lay.shape, lay.stored_shape)
    ]
    if bad:
        raise ValueError(WRONG_SHAPES.format(what=what, leaves="; ".join(bad), fix=fix))


# -- non-float leaves: never seen by the wrapped optimizer ----------------------------------


def _float_flags(leaves: Any) -> list[bool]:
    return [is_float(x.dtype) for x in leaves]


def hide_non_float(tree: PyTree, keep: list[bool], *, is_leaf: Callable[[Any], bool] | None = None) -> PyTree:
    """``tree`` with each leaf where ``keep`` is False replaced by an empty
    ``optax.MaskedNode`` (optax's own way of hiding a leaf from a
    transformation: no state, no update). ``tree`` itself when nothing is hidden."""
    if all(keep):
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
    return jax.tree_util.tree_unflatten(
        treedef, [x if k else optax.MaskedNode() for x, k in zip(leaves, keep, strict=True)]
    )


def _trainable_labels(trainable: Any) -> Any:
    """optax.multi_transform labels ("train" / "frozen") from a trainable mask
    (a tree of bools, or a function of the parameters that returns one)."""

    def labels(params: PyTree) -> PyTree:
        mask = trainable(params) if callable(trainable) else trainable
        hidden = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731 - a non-float leaf the optimizer never sees
        mask_def = jax.tree.structure(mask, is_leaf=hidden)
        params_def = jax.tree.structure(params, is_leaf=hidden)
        if mask_def != params_def:
            raise ValueError(
                "shard_optimizer(trainable=...): the mask's tree does not match the parameters.\n"
                f"  mask:       {mask_def}\n  parameters: {params_def}\n"
                "Give one bool per parameter leaf, in the parameters' structure (or a function of the parameters)."
            )
        return jax.tree.map(
            lambda p, t: p if hidden(p) else ("train" if bool(t) else "frozen"), params, mask, is_leaf=hidden
        )

    return labels


def frozen_leaves(tx: optax.GradientTransformation, params: PyTree) -> PyTree:
    """Which parameters ``tx`` never changes: ``True`` for every non-float
    leaf, and where the update is a constant (``optax.set_to_zero``, a
    ``multi_transform`` label routed to it) *and* no update or state reads
    that parameter's gradient.

    Read off the traced update (:func:`zero_jax._base.jaxpr.output_dependencies`),
    so it holds for any composition of transformations. Such leaves get no
    gradient, no gradient communication and (with ``set_to_zero``) no
    optimizer state.

    >>> import jax, optax, zero_jax as zj
    >>> params = {"w": jax.ShapeDtypeStruct((4,), "float32"), "b": jax.ShapeDtypeStruct((4,), "float32")}
    >>> tx = optax.multi_transform({"a": optax.adam(1e-3), "f": optax.set_to_zero()}, {"w": "a", "b": "f"})
    >>> zj.frozen_leaves(tx, params)
    {'b': True, 'w': False}
    """
    leaves, treedef = jax.tree.flatten(params)
    keep = _float_flags(leaves)
    shown = hide_non_float(params, keep)
    state = jax.eval_shape(tx.init, jax.tree.map(_jaxpr.abstract, shown))
    deps = _jaxpr.output_dependencies(lambda g, s, p: tx.update(g, s, p)[0:2], shown, state, shown)
    num_grads = sum(keep)
    read = 0
    for m in deps:
        read |= m
    floats = iter([deps[i] == 0 and not (read >> i) & 1 for i in range(num_grads)])
    return jax.tree.unflatten(treedef, [next(floats) if k else True for k in keep])


def matrix_leaves(tx: optax.GradientTransformation, params: PyTree) -> dict[str, tuple[str, ...]]:
    """The parameters whose update multiplies the matrix by itself (Muon's
    Newton-Schulz iteration, Shampoo's and SOAP's Gram matrices), as
    ``ZeroPolicy`` arguments: ``whole_matrices`` (every such leaf: never cut
    across a matrix) and ``matrix_stacks`` (those that are stacks of matrices
    on dimension 0, each multiplied alone: cut along the stack). Use them as
    ``ZeroPolicy(stage, mesh, **zj.matrix_leaves(tx, params))``.

    Read off the traced update (:func:`zero_jax._base.jaxpr.matrix_products`),
    not the optimizer's name, so it holds for any composition
    (``optax.contrib.muon``'s own split, ``multi_transform``, chains). It is
    conservative: a transformation that scales every leaf by one global value
    (``clip_by_global_norm`` before Muon) may also name a leaf of the same
    size as a multiplied matrix, and a stack whose leading axis the walk
    cannot follow is reported as a single matrix (kept whole).

    >>> import jax, optax, zero_jax as zj
    >>> params = {"w": jax.ShapeDtypeStruct((64, 32), "float32"), "b": jax.ShapeDtypeStruct((32,), "float32")}
    >>> zj.matrix_leaves(optax.contrib.muon(1e-2), params)
    {'whole_matrices': ('w',), 'matrix_stacks': ()}
    """
    parts = sharded_parts(tx)
    tx = parts.inner if parts is not None else _checked(tx, None, needs_policy=False)
    pairs, _ = jax.tree_util.tree_flatten_with_path(params)
    keep = _float_flags([x for _, x in pairs])
    shown = hide_non_float(params, keep)
    state = jax.eval_shape(tx.init, jax.tree.map(_jaxpr.abstract, shown))
    found = _jaxpr.matrix_products(lambda g, s, p: tx.update(g, s, p)[0], shown, state, shown)
    multiplied, stacked = iter(found.multiplied), iter(found.stacked)
    flags = [(next(multiplied), next(stacked)) if k else (False, False) for k in keep]
    paths = [path_str(p) for p, _ in pairs]
    return {
        "whole_matrices": tuple(path for path, (m, _) in zip(paths, flags, strict=True) if m),
        "matrix_stacks": tuple(path for path, (_, k) in zip(paths, flags, strict=True) if k),
    }


#: ``shard_optimizer``'s init: the optimizer multiplies leaves the policy cuts.
MATRIX_LEAVES_CUT = (
    "shard_optimizer: the optimizer multiplies {leaves} by itself (Muon's Newton-Schulz, a Gram matrix), but "
    "{policy} cuts them, so the compiler all-reduces matrix-sized products inside every step (2-4x the "
    "communication of the stage's theory). Cut them only between whole matrices: ZeroPolicy(..., "
    "**zj.matrix_leaves(tx, params)) (stacks of matrices cut on the stack axis, single matrices kept whole)."
)


def warn_cut_matrices(
    tx: optax.GradientTransformation, params: PyTree, layouts: TreeLayouts, policy: ZeroPolicy
) -> None:
    """Warn (:data:`MATRIX_LEAVES_CUT`) about every leaf ``tx`` multiplies by
    itself whose optimizer state ``policy`` cuts."""
    if not policy.partitions_opt_state:
        return
    found = matrix_leaves(tx, params)
    stacks = set(found["matrix_stacks"])
    pairs = jax.tree_util.tree_flatten_with_path(layouts.tree(), is_leaf=is_layout)[0]
    cut = {path_str(p) for p, lay in pairs if lay.dim is not None and not (lay.dim == 0 and path_str(p) in stacks)}
    bad = [path for path in found["whole_matrices"] if path in cut]
    if bad:
        warnings.warn(MATRIX_LEAVES_CUT.format(leaves=", ".join(repr(b) for b in bad), policy=policy), stacklevel=4)


# -- the transformation --------------------------------------------------------------------


def _checked(tx: Any, policy: Any, *, needs_policy: bool = True) -> optax.GradientTransformation:
    """The plain optax transformation to wrap, or an error saying what to pass
    (``needs_policy=False``: only the transformation is checked)."""
    parts = sharded_parts(tx)
    if parts is not None:
        raise TypeError(
            "shard_optimizer: this transformation is already sharded (for "
            f"{parts.policy!r}); wrap the plain optax transformation once."
        )
    if hasattr(tx, "gradient_transformation"):  # optax.MultiSteps and friends
        tx = tx.gradient_transformation()
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"shard_optimizer: expected an optax.GradientTransformation, got {type(tx).__name__}. "
            "Pass an optax optimizer such as optax.adamw(1e-3)."
        )
    if needs_policy and not isinstance(policy, ZeroPolicy):
        raise TypeError(f"shard_optimizer: policy must be a ZeroPolicy, got {type(policy).__name__}.")
    return tx


#: Appended to every error about an optimizer state that does not fit.
STATE_FIX = (
    "This optimizer state belongs to another parameter tree or policy: create it with "
    "zj.init_state(params, tx, policy) for these parameters (or zj.restore(..., policy=...))."
)


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

    Non-float parameter leaves (int counters, bool masks) are hidden from the
    wrapped optimizer: they get no state, and their update is zeros of their
    own dtype whatever their gradient (an int array or ``float0``), so
    ``optax.apply_updates`` leaves them bitwise unchanged.

    The result is a plain ``(init, update)`` pair: ``jax.tree.map`` and
    ``tree_unflatten`` rebuild it intact (:func:`sharded_parts` reads what it
    wraps).

    Example:

    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> policy = zj.ZeroPolicy(stage=1, mesh=mesh)
    >>> tx = zj.shard_optimizer(optax.adam(1e-3), policy)
    >>> state = jax.jit(tx.init)({"w": jnp.zeros((1024, 8))})
    >>> state.inner_state[0].mu["w"].sharding.spec
    P('data',)
    """
    tx = _checked(tx, policy)
    if trainable is not None:
        tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, _trainable_labels(trainable))
    partitioned = policy.partitions_opt_state
    axes = policy.state_axes  # the optimizer's view: state, gradients and parameters cut alike

    def init(params: PyTree) -> ShardedOptState:
        record = TreeLayouts.of(policy.layouts(params))
        warn_cut_matrices(tx, params, record, policy)
        with policy.program_mesh():
            inner = tx.init(hide_non_float(params, _float_flags(record.layouts)))
            layouts = policy.state_layouts(inner, params)
            return ShardedOptState(
                store(inner, layouts, policy, partitioned, axes=axes), policy, record, TreeLayouts.of(layouts)
            )

    def update(
        updates: PyTree, state: ShardedOptState, params: PyTree | None = None, **extra_args: Any
    ) -> tuple[PyTree, ShardedOptState]:
        _check_state(state, policy)
        check_tree(updates, state.param_layouts, "shard_optimizer.update: the gradient tree", STATE_FIX)
        keep = _float_flags(state.param_layouts.layouts)
        param_layouts = hide_non_float(state.param_layouts.tree(), keep, is_leaf=is_layout)
        with policy.program_mesh():
            state_layouts = state.layouts.tree()
            inner_state = to_logical(state.inner_state, state_layouts, policy, partitioned, axes=axes)
            grads = to_logical(hide_non_float(updates, keep), param_layouts, policy, partitioned, axes=axes)
            if params is not None:
                check_tree(params, state.param_layouts, "shard_optimizer.update: the parameter tree", STATE_FIX)
                params = to_logical(hide_non_float(params, keep), param_layouts, policy, partitioned, axes=axes)
            new_updates, new_inner = tx.update(grads, inner_state, params, **extra_args)  # type: ignore[call-arg]
            new_inner = store(new_inner, state_layouts, policy, partitioned, axes=axes)
            back = _updates_back(new_updates, updates, state.param_layouts.layouts, keep, policy, axes)
            return back, ShardedOptState(new_inner, policy, state.param_layouts, state.layouts)

    parts = ShardedParts(tx, policy)
    return ShardedTransformation(_Carrying(init, parts), _Carrying(update, parts))


def _check_state(state: Any, policy: ZeroPolicy) -> None:
    if not isinstance(state, ShardedOptState):
        raise TypeError(
            f"shard_optimizer.update: expected the ShardedOptState made by this "
            f"transformation's init, got {type(state).__name__}. {STATE_FIX}"
        )
    if state.policy != policy:
        raise ValueError(
            f"shard_optimizer.update: this optimizer state was made for {state.policy!r}, "
            f"but this optimizer is sharded for {policy!r}. {STATE_FIX}"
        )


def _updates_back(
    new_updates: PyTree,
    grads: PyTree,
    layouts: tuple[LeafLayout, ...],
    keep: list[bool],
    policy: ZeroPolicy,
    axes: tuple[str, ...],
) -> PyTree:
    """The wrapped optimizer's updates in the form each gradient came in
    (padded where the gradient was), zeros for the non-float leaves it never saw."""
    partitioned = policy.partitions_opt_state
    fresh = iter(jax.tree.leaves(new_updates))
    leaves, treedef = jax.tree.flatten(grads)
    out = []
    for g, lay, k in zip(leaves, layouts, keep, strict=True):
        if not k:  # in the parameter's dtype: apply_updates leaves it bitwise unchanged
            out.append(place(jnp.zeros(jnp.shape(g), lay.dtype), policy, lay, False, axes))
            continue
        u = next(fresh)
        stored = tuple(g.shape) == lay.stored_shape and lay.padding > 0
        out.append(place(pad(u, lay) if stored else u, policy, lay, partitioned and lay.dim is not None, axes))
    return jax.tree.unflatten(treedef, out)
