"""The wire formats of ZeRO++ (qwZ, qgZ) as numbers: how a piece is cut into
blocks and how many bytes it sends. The quantization itself is
:mod:`zero_jax._comm.quantized`; the formulas and the audit count with these.

>>> wire_bytes(1024, 256), num_blocks(1000, 256), block_size(100, 256)
(1040, 4, 100)
"""

from __future__ import annotations

from typing import NamedTuple

#: The wire formats ``ZeroPolicy(quantize_weights=, quantize_grads=)`` accept.
FORMATS = ("int8",)


#: ``ZeroPolicy(quant_block=...)``'s default: elements per float32 scale
#: (DeepSpeed's ZeRO++ uses blocks of this order; 4 scale bytes per 256
#: values add 1.6% to the int8 bytes).
DEFAULT_BLOCK = 256


SCALE_BYTES = 4


class WireFormat(NamedTuple):
    """How partitioned weights and gradients travel between devices.

    ``weights``: the stage-3 all-gathers of partitioned parameters (qwZ);
    ``grads``: the gradient reduce-scatters (qgZ); ``None`` sends the leaf's
    own dtype. ``block``: elements per float32 scale.
    """

    weights: str | None = None
    grads: str | None = None
    block: int = DEFAULT_BLOCK


def block_size(elements: int, block: int) -> int:
    """The block a piece of ``elements`` values is cut into: ``block``, or
    the whole piece when it is smaller (one scale, no padding sent)."""
    return max(1, min(block, elements))


def num_blocks(elements: int, block: int) -> int:
    """How many blocks (and scales) a piece of ``elements`` values takes."""
    return -(-elements // block_size(elements, block))


def wire_bytes(elements: int, block: int) -> int:
    """Bytes one quantized piece of ``elements`` values sends: one int8 per
    value of every block (the last padded) plus a float32 scale per block.

    >>> wire_bytes(1024, 256), wire_bytes(1000, 256), wire_bytes(100, 256)
    (1040, 1040, 104)
    """
    blocks = num_blocks(elements, block)
    return blocks * block_size(elements, block) + blocks * SCALE_BYTES
