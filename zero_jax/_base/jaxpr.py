"""The one data-dependence walk over a traced program.

Two questions in the library are the same question about a jaxpr: which of
a function's inputs can each output read? ``frozen_leaves`` asks it of an
optimizer's update (a parameter whose gradient nothing reads, and whose
update is a constant, is frozen); the offload planner asks it of the update
too (optimizer-state leaves that one output mixes must stream to the device
in one chunk). Both call :func:`output_dependencies`. A third asks which
inputs a program multiplies by themselves (:func:`self_multiplied`: Muon's
Newton-Schulz iteration, a Gram matrix), walking inside loops as well.

The answer is conservative: it may say an output reads an input it does not
(which can only make fewer leaves frozen, or merge chunks), never the
reverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Jaxpr, Literal

from zero_jax._base.tree import PyTree

#: Parameters of an equation that hold a program it calls once, with the
#: equation's own inputs and outputs (``jit``, ``custom_jvp``/``custom_vjp``
#: calls, ``remat``, ``shard_map``): walked inside.
CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")

#: Primitives whose inner program runs repeatedly (a loop carry feeds its next
#: iteration): never walked inside; each output reads every input.
LOOPS = frozenset({"scan", "while"})


def _union(masks: Sequence[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def called(eqn: Any) -> Jaxpr | None:
    """The program ``eqn`` calls once on its own inputs, if any."""
    if eqn.primitive.name in LOOPS:
        return None
    for name in CALL_PARAMS:
        inner = eqn.params.get(name)
        inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's program
        if isinstance(inner, Jaxpr) and len(inner.invars) == len(eqn.invars):
            if len(inner.outvars) == len(eqn.outvars):
                return inner
    return None


def dependencies(jaxpr: Jaxpr, in_masks: Sequence[int]) -> list[int]:
    """For each output of ``jaxpr``, the union of the masks of the inputs it
    reads (``in_masks[i]`` is input ``i``'s bitmask; a literal or a constant
    reads nothing).

    Calls (see :data:`CALL_PARAMS`) are walked inside; any other equation --
    a loop, a ``cond`` -- makes each of its outputs read all of its inputs.
    """
    env: dict[Any, int] = dict(zip(jaxpr.invars, in_masks, strict=True))

    def read(v: Any) -> int:
        return 0 if isinstance(v, Literal) else env.get(v, 0)

    for eqn in jaxpr.eqns:
        masks = [read(v) for v in eqn.invars]
        inner = called(eqn)
        outs = dependencies(inner, masks) if inner is not None else [_union(masks)] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs, strict=True):
            env[v] = m
    return [read(v) for v in jaxpr.outvars]


def abstract(x: Any) -> jax.ShapeDtypeStruct:
    """A device-space stand-in for ``x`` (ops on host-space, offloaded, values
    do not trace): its shape and dtype only."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)


def output_dependencies(fn: Callable[..., Any], *args: PyTree) -> list[int]:
    """Which inputs each output of ``fn(*args)`` reads.

    ``args`` are pytrees of arrays (or anything with ``shape`` and ``dtype``);
    ``fn`` is traced on abstract stand-ins, so nothing runs. Returns one int
    per leaf of ``fn``'s output (flattened), whose bit ``i`` is set when that
    output may read leaf ``i`` of ``args`` (flattened together, in
    ``jax.tree.leaves(args)`` order).

    >>> import jax.numpy as jnp
    >>> output_dependencies(lambda a, b: (a * 2, a + b, jnp.ones(3)), jnp.zeros(3), jnp.zeros(3))
    [1, 3, 0]
    """
    closed = jax.make_jaxpr(fn)(*jax.tree.map(abstract, args))
    return dependencies(closed.jaxpr, [1 << i for i in range(len(closed.jaxpr.invars))])


def live_equations(jaxpr: Jaxpr) -> list[Any]:
    """The equations whose results reach an output (or that have effects):
    a traced program keeps dead code (values computed only for their shape)."""
    live = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, Literal))
    return kept[::-1]


def direct_uses(jaxpr: Jaxpr, watched: dict[Any, int], allowed: Callable[[Any], bool]) -> dict[int, set[str]]:
    """Which equations consume the watched inputs other than through ``allowed`` ones.

    ``watched`` maps input variables of ``jaxpr`` to an index. An equation
    reading a watched variable is fine when ``allowed(eqn)``; a call (see
    :data:`CALL_PARAMS`) is walked inside with its inputs renamed; any other
    equation is a use, recorded by primitive name under the variable's index.

    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda a, b: jax.jit(lambda x: x * 2)(a) + jnp.sin(b))(1.0, 2.0)
    >>> v = closed.jaxpr.invars
    >>> direct_uses(closed.jaxpr, {v[0]: 0, v[1]: 1}, lambda eqn: eqn.primitive.name == "sin")
    {0: {'mul'}}
    """
    found: dict[int, set[str]] = {}
    for eqn in live_equations(jaxpr):
        hits = [(i, watched[v]) for i, v in enumerate(eqn.invars) if not isinstance(v, Literal) and v in watched]
        if not hits or allowed(eqn):
            continue
        inner = called(eqn)
        if inner is not None:
            for index, names in direct_uses(inner, {inner.invars[i]: k for i, k in hits}, allowed).items():
                found.setdefault(index, set()).update(names)
            continue
        for _, k in hits:
            found.setdefault(k, set()).add(eqn.primitive.name)
    return found


def _sub_programs(eqn: Any) -> list[Jaxpr]:
    """Every program an equation holds in its parameters (loop bodies and
    conditions, ``cond`` branches, called programs)."""
    found: list[Jaxpr] = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if isinstance(inner, Jaxpr):
                found.append(inner)
    return found


def self_products(jaxpr: Jaxpr, in_masks: Sequence[int], sizes: Sequence[int]) -> int:
    """The mask of inputs ``i`` that some ``dot_general`` multiplies by itself:
    both operands read input ``i`` and one of them has ``sizes[i]`` elements
    (the input's size: a product of the matrix, not of a scalar derived from
    it). Calls are walked with their inputs' masks; a loop, ``cond`` or other
    equation holding programs is walked with every inner input reading all of
    the equation's inputs (conservative, like :func:`dependencies`).
    """
    env: dict[Any, int] = dict(zip(jaxpr.invars, in_masks, strict=True))
    found = 0

    def read(v: Any) -> int:
        return 0 if isinstance(v, Literal) else env.get(v, 0)

    for eqn in jaxpr.eqns:
        masks = [read(v) for v in eqn.invars]
        if eqn.primitive.name == "dot_general":
            common = masks[0] & masks[1]
            counts = {math.prod(getattr(v.aval, "shape", ())) for v in eqn.invars}
            found |= sum(1 << i for i, size in enumerate(sizes) if common >> i & 1 and size in counts)
        inner = called(eqn)
        if inner is not None:
            found |= self_products(inner, masks, sizes)
            outs = dependencies(inner, masks)
        else:
            for program in _sub_programs(eqn):
                found |= self_products(program, [_union(masks)] * len(program.invars), sizes)
            outs = [_union(masks)] * len(eqn.outvars)
        for v, m in zip(eqn.outvars, outs, strict=True):
            env[v] = m
    return found


def self_multiplied(fn: Callable[..., Any], *args: PyTree) -> list[bool]:
    """For each leaf of ``args`` (flattened together), whether ``fn`` multiplies
    it by itself (see :func:`self_products`); traced on abstract stand-ins.

    >>> import jax.numpy as jnp
    >>> self_multiplied(lambda a, b: (a @ a.T @ a, b * 2.0), jnp.zeros((3, 4)), jnp.zeros((3, 4)))
    [True, False]
    """
    closed = jax.make_jaxpr(fn)(*jax.tree.map(abstract, args))
    sizes = [math.prod(v.aval.shape) for v in closed.jaxpr.invars]
    mask = self_products(closed.jaxpr, [1 << i for i in range(len(sizes))], sizes)
    return [bool(mask >> i & 1) for i in range(len(sizes))]
