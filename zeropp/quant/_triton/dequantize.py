"""Triton dequantize: packs of the chunked layout straight into a flat output of any float dtype."""

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
    store_rows,
    tile_blocks,
    unpack_int4,
)


@triton.jit
def _dequantize_kernel(
    buf_ptr,
    out_ptr,
    out_numel,
    chunk_numel,
    num_blocks,
    blocks_per_pack,
    pack_bytes,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
    ONE_PACK: tl.constexpr,
):
    """Dequantize ``BLOCKS`` blocks (global block order) per program.

    ``buf_ptr``: uint8 packs of ``pack_bytes`` bytes, each holding ``chunk_numel`` elements. ``out_ptr``: the
    first ``out_numel`` elements of the concatenated slices; the padding of each pack's last block is dropped.
    """
    g, p, b, code_offset, scale_offset = tile_blocks(
        blocks_per_pack, pack_bytes, BLOCKS, BLOCK_SIZE * BITS // 8, ONE_PACK
    )
    row_mask = g < num_blocks
    in_slice = b * BLOCK_SIZE
    start = p * chunk_numel + in_slice
    scale = tl.load(scale_pointers(buf_ptr, scale_offset), mask=row_mask, other=0.0)[:, None]
    code_cols = tl.arange(0, BLOCK_SIZE * BITS // 8)[None, :]
    byte = tl.load(buf_ptr + code_offset[:, None] + code_cols, mask=row_mask[:, None], other=0)
    if BITS == 8:
        v = scaled(decode_int8(byte), scale)
    else:
        lo, hi = unpack_int4(byte)
        v = tl.reshape(tl.join(scaled(lo, scale), scaled(hi, scale)), [BLOCKS, BLOCK_SIZE])
    # The padding of a pack's last block, and anything past out_numel, is not written.
    store_rows(out_ptr, start, tl.minimum(chunk_numel - in_slice, out_numel - start), v)


def dequantize_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Dequantize ``chunks`` packs of ``chunk_numel`` elements each into the first elements of flat ``out``.

    ``buf`` is the uint8 chunked layout; ``out`` (any float dtype, at most ``chunks * chunk_numel`` elements)
    receives the values in its own dtype. Same result as ``reference.dequantize_chunks``.
    """
    out_numel = out.numel()
    if out_numel == 0:
        return
    blocks_per_pack = fmt.num_blocks(chunk_numel)
    # Only the blocks up to the one holding the last output element.
    last_pack, last_in_slice = divmod(out_numel - 1, chunk_numel)
    num_blocks = last_pack * blocks_per_pack + last_in_slice // fmt.block_size + 1
    launch(
        _dequantize_kernel,
        "dequantize",
        fmt,
        num_blocks,
        buf,
        out,
        out_numel,
        chunk_numel,
        num_blocks,
        blocks_per_pack,
        fmt.packed_bytes(chunk_numel),
        ONE_PACK=num_blocks <= blocks_per_pack,
    )
