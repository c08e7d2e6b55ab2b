"""The one data-dependence walk over a traced program.

Two questions in the library are the same question about a jaxpr: which of
a function's inputs can each output read? ``frozen_leaves`` asks it of an
optimizer's update (a parameter whose gradient nothing reads, and whose
update is a constant, is frozen); the offload planner asks it of the update
too (optimizer-state leaves that one output mixes must stream to the device
in one chunk). Both call :func:`output_dependencies`. A third asks which
inputs a program multiplies by themselves (Muon's
Newton-Schulz iteration, a Gram matrix) and whether each is a stack of
matrices multiplied one by one (:func:`matrix_products`), walking inside loops.

The answer is conservative: it may say an output reads an input it does not
(which can only make fewer leaves frozen, or merge chunks), never the
reverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

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


#: Where an input's leading axis went in a value computed from it (:func:`matrix_products`):
#: an axis index, ``UNIFORM`` (reduced over: the value is the same for every
#: position along it, like a norm), or ``LOST`` (not followed through some operation).
UNIFORM = -1
LOST = -2

#: Primitives that work element by element on operands of the output's shape.
ELEMENTWISE = frozenset(
    "abs add and atan2 ceil clamp convert_element_type copy copy_p cos div eq erf exp exp2 expm1 floor ge gt "
    "integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter not or pow reduce_precision rem "
    "round rsqrt select_n sign sin sqrt square stop_gradient sub tan tanh xor".split()
)
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"})

Axes = dict[int, int]  # input index -> where its leading axis is (or UNIFORM / LOST)


def _merge(*maps: Axes) -> Axes:
    out: Axes = {}
    for m in maps:
        for i, a in m.items():
            b = out.get(i, a)
            out[i] = a if b == UNIFORM else b if a == UNIFORM else a if a == b else LOST
    return out


def _moved(m: Axes, where: Callable[[int], int]) -> Axes:
    return {i: a if a < 0 else where(a) for i, a in m.items()}


def _reshaped(a: int, old: tuple[int, ...], new: tuple[int, ...]) -> int:
    for b in range(len(new)):
        if new[b] == old[a] and math.prod(new[:b]) == math.prod(old[:a]):
            return b
    return LOST


def _dot_axes(eqn: Any, lhs: Axes, rhs: Axes, mixed: set[int]) -> Axes:
    """Where each input's axis lands in a ``dot_general``'s output; an input
    both operands read whose axis is not one batch dimension of both is mixed."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    nl, nr = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
    lfree = [d for d in range(nl) if d not in lc and d not in lb]
    rfree = [d for d in range(nr) if d not in rc and d not in rb]

    def place(a: int, batch: Any, contract: Any, free: list[int], offset: int) -> int:
        if a < 0:
            return a
        if a in batch:
            return list(batch).index(a)
        return UNIFORM if a in contract else len(batch) + offset + free.index(a)

    out_l = {i: place(a, lb, lc, lfree, 0) for i, a in lhs.items()}
    out_r = {i: place(a, rb, rc, rfree, len(lfree)) for i, a in rhs.items()}
    for i in set(lhs) & set(rhs):
        both_batch = lhs[i] >= 0 and lhs[i] in lb and rhs[i] >= 0 and rhs[i] in rb and out_l[i] == out_r[i]
        if not both_batch and not (lhs[i] == UNIFORM or rhs[i] == UNIFORM):
            mixed.add(i)
    return _merge(out_l, out_r)


def scan_counts(eqn: Any) -> tuple[int, int] | None:
    """A ``scan`` equation's numbers of constants and carried values (its
    other inputs are the scanned ones), or None where its parameters say
    neither: jax <= 0.11 names them (``num_consts``, ``num_carry``), jax 0.12
    groups its inputs (``ft_in``: constants, carry, scanned)."""
    params = eqn.params
    if "num_consts" in params and "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    groups = params.get("ft_in")  # a jax FlatTree: unpacked as jax's own scan rules unpack it
    try:
        consts, carry, scanned = (list(g) for g in groups.update(list(range(len(eqn.invars)))).unpack())
    except (AttributeError, TypeError, ValueError, AssertionError):
        return None
    return (len(consts), len(carry)) if len(consts) + len(carry) + len(scanned) == len(eqn.invars) else None


def _loop_axes(eqn: Any, ins: list[Axes], mixed: set[int], multiplied: set[int], sizes: Sequence[int]) -> list[Axes]:
    """A ``scan``'s outputs: its body walked with the carry followed to a fixed point."""
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)  # a ClosedJaxpr up to jax 0.11, a Jaxpr in 0.12
    nc, nk = scan_counts(eqn) or (0, 0)
    xs = [_moved(m, lambda a: a - 1 if a > 0 else LOST) for m in ins[nc + nk :]]
    carry = list(ins[nc : nc + nk])
    outs: list[Axes] = []
    for _ in range(4):
        outs = _walk(body, ins[:nc] + carry + xs, mixed, multiplied, sizes)
        merged = [_merge(c, o) for c, o in zip(carry, outs[:nk], strict=True)]
        if merged == carry:
            break
        carry = merged
    return outs[:nk] + [_moved(m, lambda a: a + 1) for m in outs[nk:]]


def _eqn_axes(eqn: Any, ins: list[Axes], mixed: set[int], multiplied: set[int], sizes: Sequence[int]) -> list[Axes]:
    """Where each tracked input's axis is in each output of one equation."""
    name, n_out = eqn.primitive.name, len(eqn.outvars)
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    out_shape = tuple(getattr(eqn.outvars[0].aval, "shape", ())) if eqn.outvars else ()  # jax 0.12: calls with none
    if name == "dot_general":
        # An input a side reads only through a reduction (a global norm's scale) is not multiplied there.
        common = {i for i in set(ins[0]) & set(ins[1]) if ins[0][i] != UNIFORM and ins[1][i] != UNIFORM}
        counts = {math.prod(s) for s in shapes}
        multiplied.update(i for i in common if sizes[i] in counts)
        return [_dot_axes(eqn, ins[0], ins[1], mixed)]
    inner = called(eqn)
    if inner is not None:
        return _walk(inner, ins, mixed, multiplied, sizes)
    if name == "scan" and scan_counts(eqn) is not None:
        return _loop_axes(eqn, ins, mixed, multiplied, sizes)
    if name in ELEMENTWISE:  # operands of the output's rank (size-1 dimensions broadcast) or scalars
        same = lambda s: len(s) == len(out_shape) or not s  # noqa: E731
        kept = (m if same(s) else _moved(m, lambda a: LOST) for m, s in zip(ins, shapes, strict=True))
        return [_merge(*kept)] * n_out
    if name == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        return [_moved(ins[0], lambda a: dims[a])]
    if name == "transpose":
        perm = list(eqn.params["permutation"])
        return [_moved(ins[0], perm.index)]
    if name == "reshape":
        return [_moved(ins[0], lambda a: _reshaped(a, shapes[0], out_shape))]
    if name == "squeeze":
        dims = eqn.params["dimensions"]
        return [_moved(ins[0], lambda a: LOST if a in dims else a - sum(d < a for d in dims))]
    if name in REDUCTIONS:
        axes = eqn.params["axes"]
        return [_moved(ins[0], lambda a: UNIFORM if a in axes else a - sum(d < a for d in axes))] * n_out
    if name == "slice":
        keep = lambda a: a if eqn.params["limit_indices"][a] - eqn.params["start_indices"][a] == shapes[0][a] else LOST  # noqa: E731
        return [_moved(ins[0], keep)]
    for program in _sub_programs(eqn):  # a while loop, a cond: followed no further
        _walk(program, [_moved(_merge(*ins), lambda a: LOST)] * len(program.invars), mixed, multiplied, sizes)
    return [_moved(_merge(*ins), lambda a: LOST)] * n_out


def _walk(
    jaxpr: Jaxpr, in_axes: Sequence[Axes], mixed: set[int], multiplied: set[int], sizes: Sequence[int]
) -> list[Axes]:
    """Where each input's leading axis is in each output of ``jaxpr`` (recording products in ``mixed`` and
    ``multiplied``)."""
    env: dict[Any, Axes] = dict(zip(jaxpr.invars, in_axes, strict=True))

    def read(v: Any) -> Axes:
        return {} if isinstance(v, Literal) else env.get(v, {})

    for eqn in jaxpr.eqns:
        outs = _eqn_axes(eqn, [read(v) for v in eqn.invars], mixed, multiplied, sizes)
        for v, m in zip(eqn.outvars, outs, strict=True):
            env[v] = m
    return [read(v) for v in jaxpr.outvars]


class MatrixProducts(NamedTuple):
    """What :func:`matrix_products` found, per input (flattened).

    Attributes:
      multiplied: a ``dot_general`` multiplies the input by itself (both
        operands read it, one has its size): Newton-Schulz, a Gram matrix.
      stacked: it is multiplied, and in every such product its leading axis
        is one batch dimension of both operands: a stack of matrices,
        each multiplied alone (Muon over a scanned model's layer axis).
    """

    multiplied: list[bool]
    stacked: list[bool]


def matrix_products(fn: Callable[..., Any], *args: PyTree) -> MatrixProducts:
    """Which leaves of ``args`` (flattened together) ``fn`` multiplies by
    themselves, and which of those are stacks of matrices on their leading
    axis; traced on abstract stand-ins.

    Each input's leading axis is followed through the program (elementwise
    operations, broadcasts, transposes, reshapes that keep it, reductions,
    calls and ``scan`` bodies); where it cannot be followed it is lost, and a
    lost axis in a product is taken as mixed (conservative: a stack may be
    reported as a matrix, never the reverse).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda a, b, c: (a @ a.T @ a, jax.vmap(lambda x: x @ x.T)(b), c * 2.0)
    >>> matrix_products(f, jnp.zeros((3, 4)), jnp.zeros((5, 3, 4)), jnp.zeros((3, 4)))
    MatrixProducts(multiplied=[True, True, False], stacked=[False, True, False])
    """
    closed = jax.make_jaxpr(fn)(*jax.tree.map(abstract, args))
    invars = closed.jaxpr.invars
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in invars]  # jax 0.12 types avals as AbstractValue
    sizes = [math.prod(shape) for shape in shapes]
    start = [{i: 0} if shape else {} for i, shape in enumerate(shapes)]
    mixed: set[int] = set()
    multiplied: set[int] = set()
    _walk(closed.jaxpr, start, mixed, multiplied, sizes)
    flags = [i in multiplied for i in range(len(invars))]
    return MatrixProducts(flags, [f and i not in mixed for i, f in enumerate(flags)])
