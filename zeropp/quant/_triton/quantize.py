"""Triton quantize: a flat float tensor into the chunked packed layout, optionally in the qgZ swizzled order.

The grid is ``(tiles per pack, nodes, ranks_per_node)``: program ``(t, m, j)`` writes tile ``t`` of pack
``j * nodes + m``, which holds input slice ``m * ranks_per_node + j`` (``format.swizzle_source``); without a
swizzle ``nodes`` is 1 and pack ``j`` holds slice ``j``. The reordering is index arithmetic on the loads, with
no copy of the input and no division.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import BlockFormat
from .common import (
    TILE_ELEMENTS,
    LaunchShape,
    code_words,
    element_ptrs,
    encode_words,
    is_aligned,
    launch,
    launch_shape,
    quantize_rows,
    row_counts,
    scale_ptrs,
)
from .rotation import butterfly


@triton.jit(do_not_specialize=["seed"])  # a seed of 1 must not become a constant
def _quantize_kernel(
    x_ptr,
    out_ptr,
    numel,
    chunk_numel,
    ranks_per_node,
    blocks_per_pack,
    pack_bytes,
    seed,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr,
    SEEDED: tl.constexpr,
    ROTATION: tl.constexpr = 0,
    LOG_ROTATION: tl.constexpr = 0,
):
    """Quantize ``BLOCKS`` blocks of one pack per program.

    ``x_ptr``: ``numel`` elements of any float dtype; elements past a slice's end or past ``numel`` read as 0.
    ``out_ptr``: uint8 packs of ``pack_bytes`` bytes, ``blocks_per_pack`` blocks each. ``SEEDED``: stochastic
    rounding for ``seed``, element ``i`` of ``x`` taking the noise of index ``i``. ``ROTATION`` (0: none): the
    blocks of ``ROTATION`` elements of the loaded tile (the slice's zero padding included) go through the Hadamard
    butterfly before they are quantized; with ``SEEDED`` too, element ``e`` of slice ``s`` takes the noise of index
    ``s * width + e``, ``width`` the slice rounded up to whole rotation blocks (its index in the rotated slices
    that the unfused composition quantizes).
    """
    WORDS: tl.constexpr = BLOCK_SIZE * BITS // 32
    first_block = tl.program_id(0) * BLOCKS
    m = tl.program_id(1)
    j = tl.program_id(2)
    pack = j * tl.num_programs(1) + m
    source = (m * ranks_per_node + j).to(tl.int64)
    slice_start = source * chunk_numel
    tile_start = slice_start + first_block.to(tl.int64) * BLOCK_SIZE
    # Elements of this tile present in x: the slice may be short (the last one) or empty.
    available = tl.minimum(slice_start + chunk_numel, numel) - tile_start
    full = (first_block + BLOCKS <= blocks_per_pack) & (available >= BLOCKS * BLOCK_SIZE)
    x = element_ptrs(x_ptr, tile_start, BLOCKS, BLOCK_SIZE)
    if full:
        v = tl.load(x).to(tl.float32)
    else:
        count = row_counts(available, BLOCKS, BLOCK_SIZE)
        v = tl.load(x, mask=tl.arange(0, BLOCK_SIZE)[None, :] < count[:, None], other=0.0).to(tl.float32)
    noise_start = tile_start
    if ROTATION:
        v = butterfly(v, BLOCKS, BLOCK_SIZE, ROTATION, LOG_ROTATION, False)
        rotation_blocks = (chunk_numel - 1) // ROTATION + 1  # chunk_numel >= 1; no int32 overflow
        noise_start = source * rotation_blocks * ROTATION + first_block.to(tl.int64) * BLOCK_SIZE
    codes, scale = quantize_rows(v, seed, noise_start, BITS, SEEDED)
    words = encode_words(codes, BITS)
    pack_offset = pack.to(tl.int64) * pack_bytes
    word_ptrs = code_words(out_ptr, pack_offset, first_block, BLOCKS, WORDS)
    scales = scale_ptrs(out_ptr, pack_offset, blocks_per_pack, first_block, BLOCKS, WORDS * 4)
    if full:
        tl.store(word_ptrs, words)
        tl.store(scales, scale)
    else:
        rows = first_block + tl.arange(0, BLOCKS) < blocks_per_pack
        tl.store(word_ptrs, words, mask=rows[:, None])
        tl.store(scales, scale, mask=rows)


def quantize_shape(fmt: BlockFormat, aligned: bool, seeded: bool, rotation: int) -> LaunchShape:
    """The quantize tile (``launch_shape``): half as many elements when the rotation and stochastic rounding are
    both fused, whose butterfly and noise keep more values live (8192 elements spilled on sm_90)."""
    elements = TILE_ELEMENTS["quantize"] // (2 if seeded and rotation else 1)
    return launch_shape("quantize", fmt.block_size, aligned, elements)


def quantize_chunks(
    x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor, seed: int | None = None,
    rotation: int = 0,
) -> None:
    """Pack flat ``x`` as ``chunks`` slices of ``ceil(numel / chunks)`` elements into the uint8 ``out``.

    ``out`` holds ``chunks`` packs of ``fmt.packed_bytes(chunk_numel)`` bytes; with ``nodes > 1`` pack ``p``
    holds slice ``swizzle_source(p, nodes, chunks // nodes)``; with a ``seed``, rounded stochastically. Same
    result as ``reference.quantize_chunks``. ``rotation``: the rotation fused, each loaded tile's blocks of
    ``rotation`` elements, padding included, through the butterfly before they are quantized (and with a ``seed``,
    rounded stochastically with the noise of their index in the rotated slices); same result as
    ``rotation.swizzle_quantize_rotated``'s composition.
    """
    numel = x.numel()
    if numel == 0:
        return
    slice_numel = triton.cdiv(numel, chunks)
    blocks_per_pack = fmt.num_blocks(slice_numel)
    shape = quantize_shape(fmt, is_aligned(x, slice_numel), seed is not None, rotation)
    grid = (triton.cdiv(blocks_per_pack, shape.blocks_per_program), nodes, chunks // nodes)
    rotated = {"ROTATION": rotation, "LOG_ROTATION": rotation.bit_length() - 1} if rotation else {}
    launch(_quantize_kernel, grid, shape, fmt, x.device, x, out, numel, slice_numel, chunks // nodes,
           blocks_per_pack, fmt.packed_bytes(slice_numel), 0 if seed is None else seed, SEEDED=seed is not None,
           **rotated)


def quantize_chunks_rotated(x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, size: int,
                            out: torch.Tensor, seed: int | None = None) -> None:
    """``quantize_chunks`` with the rotation of ``size`` fused (rounded stochastically with a ``seed``)."""
    quantize_chunks(x, fmt, chunks, nodes, out, seed, rotation=size)
