"""Communication buffers (ZeRO's C_B, constant-size buffers): which collectives
each layer-wise block runs per step, and how large each single buffer is, read
off the post-SPMD program (what the step asks for, one collective per array)
and the compiled one (what the backend launches: a combined op is one buffer).

A collective belongs to the block whose scope names it in its op_name
(``zj.apply_layer(s)``: ``zj_block<i>_gather`` for its all-gathers,
``zj_block<i>_reduce`` for its gradient reductions; a reduce-scatter the TPU
backend decomposes borrows the op_name of its operand, the block's backward:
``zj_block<i>_compute``). A collective named by no block that runs inside a
loop is counted under the loop's trips per step (``"loop x8"``: a
``zj.scan_layers`` scan's layers, all of them together); the rest are
outside blocks (the embedding, the head, the update's gathers; a scan that
prefetches gathers its first layers before its loop: ``"loop x3"`` at depth 4).

Measured (``benchmarks/buckets.py``, ``benchmarks/results/buckets_measured.txt``;
jax 0.10.2, libtpu 0.0.42.1): XLA:CPU runs each collective of the post-SPMD
program as one op, so the largest buffer is one weight gathered whole at any
depth; the TPU compiler (v5p) combines gradient reductions of every block into
one all-reduce whose buffer grows with depth.

>>> from zero_jax._audit.hlo import parse_collectives
>>> text = chr(10).join(["ENTRY %main (p: f32[8,256]) -> f32[64,256] {", "  %p = f32[8,256]{1,0} parameter(0)",
...     '  ROOT %g = f32[64,256]{1,0} all-gather(%p), metadata={op_name="jit(step)/zj_block3_gather/ag"}', "}"])
>>> found = comm_buffers(tuple(parse_collectives(text, 8)), None)
>>> found.blocks[0], found.largest().bytes
(BlockComm(name='block 3', post_spmd={'all-gather': 1}, compiled={}, largest=65536), 65536)
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from zero_jax._audit.compiled import CompiledCollective, CompiledProgram
from zero_jax._audit.hlo import Collective
from zero_jax._audit.report import COMPILED, OUTSIDE_BLOCKS, POST_SPMD, BlockComm, Buffers, CommBuffer

#: The scopes ``zj.apply_layer(s)`` names a block's ops by (``_layerwise/blocks.py``); the last one names it.
BLOCK_SCOPE = re.compile(r"zj_block(\d+)_(gather|reduce|compute)")


def block_of(op_name: str, trips: int) -> str:
    """The block a collective belongs to (see the module docstring): its last
    gather or reduce scope, else its last compute scope, else its loop.

    >>> block_of("transpose(jvp(zj_block2_compute))/zj_block1_gather/all_gather", 1)  # block 1's prefetch
    'block 1'
    >>> block_of("jit(step)/while/body/all_gather", 8), block_of("jit(step)/psum", 1)
    ('loop x8', 'outside blocks')
    """
    found = list(BLOCK_SCOPE.finditer(op_name))
    own = [m for m in found if m.group(2) != "compute"] or found
    if own:
        return f"block {own[-1].group(1)}"
    return f"loop x{trips}" if trips > 1 else OUTSIDE_BLOCKS


def _post_spmd(colls: Iterable[Collective]) -> list[CommBuffer]:
    """One buffer per post-SPMD collective (a tuple-shaped one: its arrays together)."""
    members: dict[str, list[Collective]] = {}
    for c in colls:
        members.setdefault(c.name, []).append(c)
    return [
        CommBuffer(
            POST_SPMD,
            "+".join(sorted({c.kind for c in group})),
            name,
            sum(c.bytes for c in group),
            tuple(f"{c.dtype}[{','.join(map(str, c.shape))}]" for c in group),
            group[0].op_name,
            block_of(group[0].op_name, group[0].trips),
            group[0].trips,
        )  # fmt: skip
        for name, group in members.items()
    ]


def _compiled(colls: Iterable[CompiledCollective]) -> tuple[list[CommBuffer], dict[str, dict[str, int]]]:
    """One buffer per compiled op (a combined op's members together), and per
    block: kind -> ops executed per step (an op counts once in each block it serves)."""
    ops: dict[tuple[str, str], list[CompiledCollective]] = {}
    for c in colls:
        ops.setdefault((c.computation, c.name), []).append(c)
    out, per_block = [], {}
    for (_, name), group in ops.items():
        blocks = sorted({block_of(c.op_name, c.trips) for c in group})
        out.append(CommBuffer(
            COMPILED, "+".join(sorted({c.kind for c in group})), name, sum(c.bytes for c in group),
            tuple(f"{c.dtype}[{','.join(map(str, c.shape))}]" for c in group), group[0].op_name, " + ".join(blocks),
            group[0].trips,
        ))  # fmt: skip
        for blk, kind in {(block_of(c.op_name, c.trips), c.kind) for c in group}:
            kinds = per_block.setdefault(blk, {})
            kinds[kind] = kinds.get(kind, 0) + group[0].trips
    return out, per_block


def _order(name: str) -> tuple[int, int, str]:
    """Blocks by index, then loops, then the rest."""
    m = re.fullmatch(r"block (\d+)", name)
    return (0, int(m.group(1)), "") if m else (1 if name.startswith("loop") else 2, 0, name)


def comm_buffers(colls: tuple[Collective, ...], program: CompiledProgram | None, bound: int | None = None) -> Buffers:
    """The step's communication buffers (:class:`zero_jax._audit.report.Buffers`)
    from its post-SPMD collectives and (where read) its compiled program,
    judged by ``bound`` (the policy's ``bucket_bytes``) where given."""
    post = _post_spmd(colls)
    compiled, compiled_kinds = _compiled(program.collectives if program is not None else ())
    post_kinds: dict[str, dict[str, int]] = {}
    for c in colls:
        kinds = post_kinds.setdefault(block_of(c.op_name, c.trips), {})
        kinds[c.kind] = kinds.get(c.kind, 0) + c.trips
    largest: dict[str, int] = {}
    for b in post + compiled:
        for blk in b.block.split(" + "):
            largest[blk] = max(largest.get(blk, 0), b.bytes)
    blocks = tuple(
        BlockComm(name, post_kinds.get(name, {}), compiled_kinds.get(name, {}), largest.get(name, 0))
        for name in sorted({*post_kinds, *compiled_kinds}, key=_order)
    )
    return Buffers(blocks, tuple(sorted(post + compiled, key=lambda b: (-b.bytes, b.program, b.name))), bound)
