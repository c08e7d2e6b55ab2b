"""``keep_gathered``: the last blocks of the forward pass keep their gathered
parameters for the backward pass (selective unsharding).

The last blocks of the forward pass are the first of the backward, so a block
kept whole from its forward to its backward costs one block of memory and saves
one all-gather, with no wait (FSDP2's ``reshard_after_forward=False`` per module,
DeepSpeed's ``stage3_param_persistence_threshold``). ``keep_gathered`` is an int
k (the last k blocks) or a byte budget (``"2GiB"``: the most trailing blocks
whose gathered bytes fit). :func:`kept_count` reads it for ``zj.scan_layers``,
``zj.apply_layer(s)`` and the adapters' ``layers=``; only stage 3 gathers, so
only stage 3 keeps anything.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from zero_jax._base.tree import PyTree
from zero_jax._base.units import SIZE_NEEDS_UNIT, is_whole_number, parse_size_argument
from zero_jax._layerwise.pieces import Sharded

#: The name scope of a kept block's forward all-gathers: the audit (``report.layers``) reads which blocks
#: are kept from it, rather than taking a re-gather the compiler merged away for a kept block.
KEPT_SCOPE = "zj_kept"

BAD_KEEP_GATHERED = (
    "{where}: keep_gathered must be an int from 0 to the number of blocks ({count}) or a byte budget such as "
    "'2GiB', got {got!r}. keep_gathered=k keeps the last k blocks' gathered parameters from the forward pass for "
    "the backward (k fewer re-gathers, k blocks more memory); 0 gathers every block again."
)
BAD_KEEP_BUDGET = (
    "{where}: cannot read keep_gathered={got!r} as a byte budget ({why}). Write the budget with a unit, e.g. "
    "keep_gathered='2GiB', or pass an int k: the number of trailing blocks to keep."
)


def keep_problem(value: Any, count: int, where: str) -> str | None:
    """What is wrong with ``keep_gathered=value`` for ``count`` blocks (None: nothing).

    >>> keep_problem(2, 4, "zj.apply_layers") is None, keep_problem("2GiB", 4, "zj.apply_layers") is None
    (True, True)
    >>> keep_problem(5, 4, "zj.apply_layers").split(":")[0]
    'zj.apply_layers'
    """
    if isinstance(value, str):
        try:
            if parse_size_argument(value, "keep_gathered") < 0:
                return BAD_KEEP_BUDGET.format(where=where, got=value, why="it is negative")
        except ValueError as e:
            unitless = str(e) == SIZE_NEEDS_UNIT.format(what="keep_gathered", value=value)
            return BAD_KEEP_BUDGET.format(where=where, got=value, why="no unit" if unitless else "not a size")
        return None
    if not is_whole_number(value) or not 0 <= value <= count:
        return BAD_KEEP_GATHERED.format(where=where, count=count, got=value)
    return None


def check_keep(value: Any, count: int, where: str) -> None:
    """Raise :func:`keep_problem`'s message, if any (``ValueError``)."""
    problem = keep_problem(value, count, where)
    if problem is not None:
        raise ValueError(problem)


def kept_count(value: Any, block_bytes: Sequence[int], where: str) -> int:
    """How many trailing blocks ``keep_gathered=value`` keeps, for blocks of
    ``block_bytes`` gathered bytes each (in call order): k itself, or for a
    byte budget the most trailing blocks whose bytes together fit it.

    >>> kept_count(2, [10, 10, 10], "zj.apply_layers"), kept_count("25B", [10, 10, 10], "zj.apply_layers")
    (2, 2)
    """
    check_keep(value, len(block_bytes), where)
    if not isinstance(value, str):
        return int(value)
    budget, total, k = parse_size_argument(value, "keep_gathered"), 0, 0
    for nbytes in reversed(block_bytes):
        if total + nbytes > budget:
            break
        total, k = total + nbytes, k + 1
    return k


def gathered_bytes(params: PyTree, *, stacked: bool = False) -> int:
    """The bytes one block's stage-3 all-gathers make whole: each gathered
    piece's stored (padded) shape in the piece's dtype; one layer of stacked
    pieces with ``stacked``."""
    total = 0
    for x in jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, Sharded)):
        if isinstance(x, Sharded) and x.gathers:
            shape = x.layout.stored_shape[1:] if stacked else x.layout.stored_shape
            total += math.prod(shape) * np.dtype(x.arrays[0].dtype).itemsize
    return total
