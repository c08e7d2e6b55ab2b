"""Which parts of a manual step's loss touch parameter pieces.

Inside ``make_train_step(..., gather="manual")`` a partitioned leaf reaches
the loss as a piece (stage 3) and a gradient slot; only the library's
gathers may read them. A ``jax.tree.map`` over the parameters reaches the
pieces anyway, and the result is silently wrong, so the step traces the loss
once more (abstractly) and names every other use.

Floor 4: imports the jaxpr walk and the state helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from zero_jax._jaxpr import direct_uses
from zero_jax._partition import is_layout
from zero_jax._state import leaf_values
from zero_jax._tree import PyTree, path_str

PIECES_USED_DIRECTLY = (
    "make_train_step(..., gather='manual'): loss_fn used the partitioned parameter{s} {leaves} directly instead "
    "of through zj.gather, zj.apply_layer(s) or zj.scan_layers. Inside a manual step a partitioned leaf is "
    "this device's piece (stage 3) and a gradient slot, not the parameter, so the result would be silently "
    "wrong (a jax.tree.map or jax.tree.leaves over params reaches the pieces: a weight-decay term is the usual "
    "culprit). Gather what you use first (w = zj.gather(params['w'], policy)), run blocks with "
    "zj.apply_layers, or train with gather='all'."
)

#: Where the library's own code touches pieces: the gathers and their ties run
#: under these name scopes (``_layerwise``, ``scan_layers``), and the custom
#: VJPs of ``fetch_with_grad_slot``, ``scan_layers`` and ``apply_layer(s)`` are
#: functions named ``zero_jax_*``.
OWN_SCOPES = ("zj_block", "zero_jax")
OWN_PIECE_USERS = frozenset({"all_gather", "pcast", "pvary", "device_put"})


def _own_use(eqn: Any) -> bool:
    if eqn.primitive.name in OWN_PIECE_USERS:
        return True
    # Transformations wrap scope names ("vmap(zj_block0_gather)", "jvp(...)").
    if any(scope in str(eqn.source_info.name_stack) for scope in OWN_SCOPES):
        return True
    if eqn.primitive.name != "custom_vjp_call":
        return False
    # The custom VJP's function name, as its traced program records it ("zero_jax_block at <file>:<line>").
    info = getattr(getattr(eqn.params.get("call_jaxpr"), "jaxpr", None), "debug_info", None)
    return str(getattr(info, "func_src_info", "")).startswith("zero_jax_")


def check_only_gathered(
    loss: Callable[[PyTree, PyTree], Any], params: PyTree, diff: PyTree, layouts: PyTree, *, slots: bool
) -> None:
    """``loss(params, diff)`` may touch a partitioned leaf's piece (and, with
    ``slots``, its gradient slot in ``diff``) only through the library's
    gathers: traced once more, abstractly, every other use is named in one
    error (leaf and operation)."""
    paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]]
    layout_leaves = jax.tree.leaves(layouts, is_leaf=is_layout)
    diff_leaves = leaf_values(diff, layouts)
    present = [(path, lay) for path, lay, d in zip(paths, layout_leaves, diff_leaves, strict=True) if d is not None]
    names = paths + [path for path, _ in present]
    watched_flags = [lay.dim is not None for lay in layout_leaves] + [
        slots and lay.dim is not None for _, lay in present
    ]
    closed = jax.make_jaxpr(loss)(params, diff)
    watched = {v: i for i, (v, w) in enumerate(zip(closed.jaxpr.invars, watched_flags, strict=True)) if w}
    bad = direct_uses(closed.jaxpr, watched, _own_use)
    if bad:
        leaves = sorted({f"'{names[i]}' (in {', '.join(sorted(ops))})" for i, ops in bad.items()})
        raise TypeError(PIECES_USED_DIRECTLY.format(s="s" if len(leaves) > 1 else "", leaves=", ".join(leaves)))
