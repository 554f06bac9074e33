"""Triton dequantize: packs of the chunked layout straight into a flat output of any float dtype, or added into it
(``ADD``: ``dequantize_add_chunks``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import BlockFormat
from .common import (
    all_fast,
    code_words,
    decode_words,
    element_ptrs,
    is_aligned,
    launch,
    launch_shape,
    opaque_zero,
    row_counts,
    scale_ptrs,
    scaled_exact,
    scaled_fast,
    to_output,
)


@triton.jit
def _dequantize_kernel(
    buf_ptr,
    out_ptr,
    out_numel,
    chunk_numel,
    blocks_per_pack,
    pack_bytes,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr,
    ADD: tl.constexpr = False,
):
    """Dequantize ``BLOCKS`` blocks of pack ``program_id(1)`` per program.

    ``buf_ptr``: uint8 packs of ``pack_bytes`` bytes, each holding ``chunk_numel`` elements. ``out_ptr``: the
    first ``out_numel`` elements of the concatenated slices; the padding of each pack's last block is dropped.
    With ``ADD`` the float32 values are added to ``out``'s, widened to float32, and the sum is what is rounded to
    ``out``'s dtype (the products clamped to the finite float32 range for every dtype).
    """
    WORDS: tl.constexpr = BLOCK_SIZE * BITS // 32
    first_block = tl.program_id(0) * BLOCKS
    pack = tl.program_id(1).to(tl.int64)
    in_slice = first_block.to(tl.int64) * BLOCK_SIZE
    out_start = pack * chunk_numel + in_slice
    # Elements of this tile to write: up to the end of the slice and of out.
    available = tl.minimum(chunk_numel - in_slice, out_numel - out_start)
    full = available >= BLOCKS * BLOCK_SIZE
    pack_offset = pack * pack_bytes
    word_ptrs = code_words(buf_ptr, pack_offset, first_block, BLOCKS, WORDS)
    scales = scale_ptrs(buf_ptr, pack_offset, blocks_per_pack, first_block, BLOCKS, WORDS * 4)
    if full:
        words = tl.load(word_ptrs)
        scale = tl.load(scales)
    else:
        rows = first_block + tl.arange(0, BLOCKS) < blocks_per_pack
        words = tl.load(word_ptrs, mask=rows[:, None], other=0)
        scale = tl.load(scales, mask=rows, other=0.0)
    codes = decode_words(words, opaque_zero(blocks_per_pack), BITS)
    # Only float32 output can tell a product clamped to the float32 range from an overflow to Inf: in bfloat16 and
    # float16 both round to Inf.
    # A sum can tell them apart in every dtype.
    if out_ptr.dtype.element_ty == tl.float32 or ADD:
        if all_fast(scale):
            v = scaled_fast(codes, scale[:, None])
        else:
            v = scaled_exact(codes, scale[:, None])
    else:
        v = scaled_fast(codes, scale[:, None])
    out = element_ptrs(out_ptr, out_start, BLOCKS, BLOCK_SIZE)
    if full:
        if ADD:
            tl.store(out, to_output(v + tl.load(out).to(tl.float32), out_ptr, INTERPRET))
        else:
            tl.store(out, to_output(v, out_ptr, INTERPRET))
    else:
        count = row_counts(available, BLOCKS, BLOCK_SIZE)
        mask = tl.arange(0, BLOCK_SIZE)[None, :] < count[:, None]
        if ADD:
            total = v + tl.load(out, mask=mask, other=0.0).to(tl.float32)
            tl.store(out, to_output(total, out_ptr, INTERPRET), mask=mask)
        else:
            tl.store(out, to_output(v, out_ptr, INTERPRET), mask=mask)


def dequantize_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Dequantize ``chunks`` packs of ``chunk_numel`` elements each into the first elements of flat ``out``.

    ``buf`` is the uint8 chunked layout; ``out`` (any float dtype, at most ``chunks * chunk_numel`` elements)
    receives the values in its own dtype. Same result as ``reference.dequantize_chunks``.
    """
    _launch_dequantize(buf, fmt, chunks, chunk_numel, out, add=False)


def dequantize_add_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Add ``chunks`` packs of ``chunk_numel`` elements each into the first elements of flat ``out`` in place. Same
    result as ``reference.dequantize_add_chunks``."""
    _launch_dequantize(buf, fmt, chunks, chunk_numel, out, add=True)


def _launch_dequantize(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor, *, add: bool
) -> None:
    out_numel = out.numel()
    if out_numel == 0:
        return
    blocks_per_pack = fmt.num_blocks(chunk_numel)
    shape = launch_shape("dequantize", fmt.block_size, is_aligned(out, chunk_numel))
    # Only the packs that hold output elements.
    grid = (triton.cdiv(blocks_per_pack, shape.blocks_per_program), triton.cdiv(out_numel, chunk_numel))
    launch(
        _dequantize_kernel,
        grid,
        shape,
        fmt,
        buf.device,
        buf,
        out,
        out_numel,
        chunk_numel,
        blocks_per_pack,
        fmt.packed_bytes(chunk_numel),
        ADD=add,
    )
