"""Triton quantize: a flat float tensor into the chunked packed layout, optionally in the qgZ swizzled order.

Pack ``p`` of the output holds input slice ``swizzle_source(p, nodes, chunks // nodes)`` (``p`` itself when
``nodes == 1``); the reordering is index arithmetic on the loads, with no copy of the input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import BlockFormat
from .common import (
    launch,
    load_rows,
    store_int4_blocks,
    store_int8_blocks,
    swizzled_sources,
    tile_blocks,
)


@triton.jit
def _quantize_kernel(
    x_ptr,
    out_ptr,
    numel,
    chunk_numel,
    nodes,
    ranks_per_node,
    num_blocks,
    blocks_per_pack,
    pack_bytes,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
    ONE_PACK: tl.constexpr,
):
    """Quantize ``BLOCKS`` blocks of the output (global block order) per program.

    ``x_ptr``: ``numel`` elements of any float dtype; elements past a slice's end or past ``numel`` read as 0.
    ``out_ptr``: uint8, ``num_blocks // blocks_per_pack`` packs of ``pack_bytes`` bytes.
    """
    g, p, b, code_offset, scale_offset = tile_blocks(
        blocks_per_pack, pack_bytes, BLOCKS, BLOCK_SIZE * BITS // 8, ONE_PACK
    )
    row_mask = g < num_blocks
    source = swizzled_sources(p, blocks_per_pack, nodes, ranks_per_node, BLOCKS, ONE_PACK)
    # Index of each block's first element in its slice and in x; its elements must be inside both.
    in_slice = b * BLOCK_SIZE
    start = source * chunk_numel + in_slice
    # Rows with fewer than BLOCK_SIZE elements (or none) are zero-padded.
    v = load_rows(x_ptr, start, tl.minimum(chunk_numel - in_slice, numel - start), BLOCK_SIZE)
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    if BITS == 8:
        store_int8_blocks(out_ptr, code_offset, scale_offset, row_mask, v, QMAX)
    else:
        even, odd = tl.split(tl.reshape(v, [BLOCKS, BLOCK_SIZE // 2, 2]))
        store_int4_blocks(out_ptr, code_offset, scale_offset, row_mask, even, odd, QMAX)


def quantize_chunks(x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor) -> None:
    """Pack flat ``x`` as ``chunks`` slices of ``ceil(numel / chunks)`` elements into the uint8 ``out``.

    ``out`` holds ``chunks`` packs of ``fmt.packed_bytes(chunk_numel)`` bytes; with ``nodes > 1`` pack ``p``
    holds slice ``swizzle_source(p, nodes, chunks // nodes)``. Same result as ``reference.quantize_chunks``.
    """
    numel = x.numel()
    if numel == 0:
        return
    slice_numel = triton.cdiv(numel, chunks)
    blocks_per_pack = fmt.num_blocks(slice_numel)
    num_blocks = chunks * blocks_per_pack
    launch(
        _quantize_kernel,
        "quantize",
        fmt,
        num_blocks,
        x,
        out,
        numel,
        slice_numel,
        nodes,
        chunks // nodes,
        num_blocks,
        blocks_per_pack,
        fmt.packed_bytes(slice_numel),
        ONE_PACK=chunks == 1,
    )
