"""Triton fused reductions of qgZ: dequantize-sum-requantize (after hop 1) and dequantize-sum-divide (at the end).

Both read ``groups`` runs of packs and sum them in float32 in the reference's order: ``acc = 0``, then
``acc += code * scale`` for group ``i = 0 .. groups - 1``. ``groups`` is a compile-time constant so the loop is
unrolled and every group's loads can be in flight at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import BlockFormat
from .common import (
    decode_int8,
    launch,
    scale_pointers,
    scaled,
    store_int4_blocks,
    store_int8_blocks,
    store_rows,
    tile_blocks,
    unpack_int4,
)


@triton.jit
def _sum_int8_blocks(
    buf_ptr, code_offset, scale_offset, group_bytes, row_mask, GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """Float32 [R, block_size]: the sum over groups ``i`` of the int8 blocks at offsets ``+ i * group_bytes``."""
    cols = tl.arange(0, BLOCK_SIZE)[None, :]
    acc = tl.zeros((code_offset.shape[0], BLOCK_SIZE), tl.float32)
    for i in tl.static_range(GROUPS):
        scale = tl.load(scale_pointers(buf_ptr, scale_offset + i * group_bytes), mask=row_mask, other=0.0)
        byte = tl.load(buf_ptr + (code_offset + i * group_bytes)[:, None] + cols, mask=row_mask[:, None], other=0)
        acc += scaled(decode_int8(byte), scale[:, None])
    return acc


@triton.jit
def _sum_int4_blocks(
    buf_ptr, code_offset, scale_offset, group_bytes, row_mask, GROUPS: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """Float32 (even, odd) elements [R, block_size // 2] of the sum over groups ``i`` of the int4 blocks at
    offsets ``+ i * group_bytes``."""
    cols = tl.arange(0, BLOCK_SIZE // 2)[None, :]
    even = tl.zeros((code_offset.shape[0], BLOCK_SIZE // 2), tl.float32)
    odd = tl.zeros((code_offset.shape[0], BLOCK_SIZE // 2), tl.float32)
    for i in tl.static_range(GROUPS):
        scale = tl.load(scale_pointers(buf_ptr, scale_offset + i * group_bytes), mask=row_mask, other=0.0)
        byte = tl.load(buf_ptr + (code_offset + i * group_bytes)[:, None] + cols, mask=row_mask[:, None], other=0)
        lo, hi = unpack_int4(byte)
        even += scaled(lo, scale[:, None])
        odd += scaled(hi, scale[:, None])
    return even, odd


@triton.jit
def _reduce_requantize_kernel(
    buf_ptr,
    out_ptr,
    num_blocks,
    blocks_per_pack,
    pack_bytes,
    group_bytes,
    GROUPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
    ONE_PACK: tl.constexpr,
):
    """Sum and requantize ``BLOCKS`` blocks (global block order of ``out``) per program.

    ``buf_ptr``: ``GROUPS`` runs of ``group_bytes`` bytes, each the same packs as ``out_ptr``; output block ``g``
    is the sum of block ``g`` of every run. Whole blocks are summed, padding included, as in the reference.
    """
    g, _, _, code_offset, scale_offset = tile_blocks(
        blocks_per_pack, pack_bytes, BLOCKS, BLOCK_SIZE * BITS // 8, ONE_PACK
    )
    row_mask = g < num_blocks
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    if BITS == 8:
        acc = _sum_int8_blocks(buf_ptr, code_offset, scale_offset, group_bytes, row_mask, GROUPS, BLOCK_SIZE)
        store_int8_blocks(out_ptr, code_offset, scale_offset, row_mask, acc, QMAX)
    else:
        even, odd = _sum_int4_blocks(buf_ptr, code_offset, scale_offset, group_bytes, row_mask, GROUPS, BLOCK_SIZE)
        store_int4_blocks(out_ptr, code_offset, scale_offset, row_mask, even, odd, QMAX)


@triton.jit
def _reduce_dequantize_kernel(
    buf_ptr,
    out_ptr,
    out_numel,
    num_blocks,
    blocks_per_pack,
    pack_bytes,
    divisor,
    GROUPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """Sum ``BLOCKS`` blocks over ``GROUPS`` packs, divide by ``divisor`` (float32) and store per program.

    ``buf_ptr``: ``GROUPS`` packs of ``blocks_per_pack`` blocks in ``pack_bytes`` bytes; ``out_ptr``: the first
    ``out_numel`` values, which lie in the first ``num_blocks`` blocks.
    """
    # Every block is in the first pack of its group.
    g, _, _, code_offset, scale_offset = tile_blocks(
        blocks_per_pack, pack_bytes, BLOCKS, BLOCK_SIZE * BITS // 8, True
    )
    row_mask = g < num_blocks
    start = g * BLOCK_SIZE
    if BITS == 8:
        acc = _sum_int8_blocks(buf_ptr, code_offset, scale_offset, pack_bytes, row_mask, GROUPS, BLOCK_SIZE)
    else:
        even, odd = _sum_int4_blocks(buf_ptr, code_offset, scale_offset, pack_bytes, row_mask, GROUPS, BLOCK_SIZE)
        acc = tl.reshape(tl.join(even, odd), [BLOCKS, BLOCK_SIZE])
    store_rows(out_ptr, start, out_numel - start, tl.math.div_rn(acc, tl.full(acc.shape, divisor, tl.float32)))


def reduce_requantize(
    buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Sum ``groups`` runs of ``chunks`` packs pack-wise in float32 and pack the ``chunks`` sums into ``out``.

    ``buf``: uint8, ``groups * chunks`` packs of ``chunk_numel`` elements; pack ``m`` of ``out`` is the sum of
    packs ``i * chunks + m``. Same result as ``reference.reduce_requantize``.
    """
    if chunk_numel == 0:
        return
    blocks_per_pack = fmt.num_blocks(chunk_numel)
    num_blocks = chunks * blocks_per_pack
    pack_bytes = fmt.packed_bytes(chunk_numel)
    launch(
        _reduce_requantize_kernel,
        "reduce_requantize",
        fmt,
        num_blocks,
        buf,
        out,
        num_blocks,
        blocks_per_pack,
        pack_bytes,
        chunks * pack_bytes,
        GROUPS=groups,
        ONE_PACK=chunks == 1,
    )


def reduce_dequantize(
    buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, out: torch.Tensor, divisor: float
) -> None:
    """Sum ``groups`` packs of ``chunk_numel`` elements in float32, divide by ``divisor`` and write the first
    ``out.numel()`` values into flat ``out`` in its dtype. Same result as ``reference.reduce_dequantize``."""
    out_numel = out.numel()
    if out_numel == 0:
        return
    num_blocks = fmt.num_blocks(out_numel)
    launch(
        _reduce_dequantize_kernel,
        "reduce_dequantize",
        fmt,
        num_blocks,
        buf,
        out,
        out_numel,
        num_blocks,
        fmt.num_blocks(chunk_numel),
        fmt.packed_bytes(chunk_numel),
        divisor,
        GROUPS=groups,
    )
