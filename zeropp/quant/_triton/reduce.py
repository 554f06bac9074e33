"""Triton fused reductions of qgZ: dequantize-sum-requantize (after hop 1) and dequantize-sum-divide (at the end).

Both read ``groups`` runs of packs and sum them as the spec says: ``acc = 0``, then ``acc = fma(code_i, scale_i,
acc)`` for group ``i = 0 .. groups - 1`` (float32, one rounding per group, no clamp). ``groups`` is a compile-time
constant so the loop is unrolled and every group's loads can be in flight at once. The sum needs no fast path of
its own; the requantization takes ``common.quantize_rows``'s, and the division by an integer world size
``div_fast`` when every scale of the tile is in the fast range.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..format import BlockFormat, exact_reciprocal
from .common import (
    TILE_ELEMENTS,
    LaunchShape,
    code_words,
    decode_words,
    div_fast,
    element_ptrs,
    encode_words,
    fast_rows,
    is_aligned,
    launch,
    launch_shape,
    multiprocessors,
    opaque_zero,
    quantize_rows,
    row_counts,
    scale_ptrs,
    to_output,
)
from .rotation import butterfly

PIPELINE_STAGES = 3
"""Tiles in flight per program of the persistent reduce-requantize (``tl.range``'s ``num_stages``)."""
STAGE_CODE_BYTES = 16384
"""Code bytes, over all groups, of one reduce-requantize tile at most (``requantize_shape``)."""
SM_CODE_BYTES = 32768
"""Tile code bytes over the reduce-requantize programs per multiprocessor: ``SM_CODE_BYTES // tile bytes``
programs (at least one) per SM. The three above were chosen by a sweep on an H100 (bench/RESULTS.md): int4, d = 2
at 8192 elements x 4 programs per SM, d = 4 at 8192 x 2 and d = 8 at 4096 x 2 were the fastest."""
MAX_TILE_ROWS = 128
"""Blocks per reduce-requantize tile at most: each thread holds per-row values (scale, reciprocal, mask) of every
row, and the pipelined loop spilled with 256 (block 16, d = 8, triton 3.6 on an H100)."""
SHARED_BYTES = 160 * 1024
"""Shared memory the pipeline's buffers may take per program (an A100 allows 163 KiB, an H100 227 KiB): fewer stages
where a tile is too large for ``PIPELINE_STAGES``."""

DIVIDE_BY_MULTIPLY = 0
"""``reduce_dequantize`` divides by multiplying with the divisor's exact reciprocal (a power of two)."""
DIVIDE_FAST = 1
"""... by ``common.div_fast`` (an integer divisor up to ``2**16``; exact when every scale allows the fast path)."""
DIVIDE_EXACT = 2
"""... by IEEE division of every element (any other divisor)."""


@triton.jit
def _scales_fit(buf_ptr, blocks_per_pack, pack_bytes, first_block, rows, full, GROUPS: tl.constexpr,
                BLOCKS: tl.constexpr, WORDS: tl.constexpr):
    """Whether every group's scales of the tile are 0 or in ``[FAST_MIN, FAST_MAX]``, so that every non-zero sum
    and quotient is a normal float and ``div_fast`` divides exactly. One program-wide check."""
    ok = tl.full((BLOCKS,), 1, tl.int32)
    for i in tl.static_range(GROUPS):
        ptrs = scale_ptrs(buf_ptr, i * pack_bytes, blocks_per_pack, first_block, BLOCKS, WORDS * 4)
        if full:
            scale = tl.load(ptrs)
        else:
            scale = tl.load(ptrs, mask=rows, other=0.0)
        ok = ok & fast_rows(scale)
    return tl.min(ok, axis=0) == 1


@triton.jit
def _sum_groups(buf_ptr, pack_offset, group_bytes, blocks_per_pack, first_block, rows, full, GROUPS: tl.constexpr,
                BLOCKS: tl.constexpr, WORDS: tl.constexpr, BITS: tl.constexpr):
    """Float32 [BLOCKS, BLOCK_SIZE]: ``acc = 0``, then ``acc = fma(code_i, scale_i, acc)`` for each group ``i``."""
    BLOCK_SIZE: tl.constexpr = WORDS * 32 // BITS
    acc = tl.zeros((BLOCKS, BLOCK_SIZE), tl.float32)
    for i in tl.static_range(GROUPS):
        offset = pack_offset + i * group_bytes
        word_ptrs = code_words(buf_ptr, offset, first_block, BLOCKS, WORDS)
        scales = scale_ptrs(buf_ptr, offset, blocks_per_pack, first_block, BLOCKS, WORDS * 4)
        if full:
            words = tl.load(word_ptrs)
            scale = tl.load(scales)
        else:
            words = tl.load(word_ptrs, mask=rows[:, None], other=0)
            scale = tl.load(scales, mask=rows, other=0.0)
        acc = tl.fma(decode_words(words, opaque_zero(blocks_per_pack), BITS), scale[:, None], acc)
    return acc


@triton.jit(do_not_specialize=["seed"])  # a seed of 1 must not become a constant
def _reduce_requantize_kernel(
    buf_ptr,
    out_ptr,
    blocks_per_pack,
    pack_bytes,
    group_bytes,
    tiles_per_pack,
    tiles,
    out_blocks_per_pack,
    out_pack_bytes,
    chunk_numel,
    seed,
    GROUPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
    OUT_BLOCK_SIZE: tl.constexpr,
    OUT_BITS: tl.constexpr,
    STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
    SEEDED: tl.constexpr,
):
    """Sum and requantize tiles ``p, p + P, p + 2P, ...`` of the ``tiles`` tiles of ``out`` in program ``p`` of
    ``P``; tile ``t`` is the ``BLOCKS`` input blocks from block ``(t % tiles_per_pack) * BLOCKS`` of pack
    ``t // tiles_per_pack``, the same elements as ``BLOCKS * BLOCK_SIZE // OUT_BLOCK_SIZE`` output blocks.

    ``buf_ptr``: ``GROUPS`` runs of ``group_bytes`` bytes, each ``chunks`` packs of ``pack_bytes`` bytes;
    ``out_ptr``: ``chunks`` packs of ``out_pack_bytes`` bytes in the output format (``OUT_BITS``,
    ``OUT_BLOCK_SIZE``); output element ``e`` is the sum of element ``e`` of every run, 0 past the input blocks.
    Whole blocks are summed, padding included, as in the reference. ``SEEDED``: stochastic rounding for ``seed``,
    element ``e`` of pack ``m`` taking the noise of index ``m * chunk_numel + e``. The loop keeps ``STAGES`` tiles
    in flight (``tl.range``'s software pipelining): the next tiles' codes and scales load while this one is summed
    and requantized. Every load and store is masked by the tile's rows, even on full tiles: a load under a branch
    would not be pipelined.
    """
    WORDS: tl.constexpr = BLOCK_SIZE * BITS // 32
    OUT_WORDS: tl.constexpr = OUT_BLOCK_SIZE * OUT_BITS // 32
    OUT_BLOCKS: tl.constexpr = BLOCKS * BLOCK_SIZE // OUT_BLOCK_SIZE
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
        pack = tile // tiles_per_pack
        first_block = (tile - pack * tiles_per_pack) * BLOCKS
        pack_offset = pack.to(tl.int64) * pack_bytes
        rows = first_block + tl.arange(0, BLOCKS) < blocks_per_pack
        acc = _sum_groups(buf_ptr, pack_offset, group_bytes, blocks_per_pack, first_block, rows, False, GROUPS,
                          BLOCKS, WORDS, BITS)
        if OUT_BLOCK_SIZE != BLOCK_SIZE:
            acc = tl.reshape(acc, [OUT_BLOCKS, OUT_BLOCK_SIZE])
        out_first = first_block * BLOCK_SIZE // OUT_BLOCK_SIZE
        first_index = pack.to(tl.int64) * chunk_numel + first_block.to(tl.int64) * BLOCK_SIZE
        codes, scale = quantize_rows(acc, seed, first_index, OUT_BITS, SEEDED)
        words = encode_words(codes, OUT_BITS)
        out_offset = pack.to(tl.int64) * out_pack_bytes
        out_rows = out_first + tl.arange(0, OUT_BLOCKS) < out_blocks_per_pack
        word_ptrs = code_words(out_ptr, out_offset, out_first, OUT_BLOCKS, OUT_WORDS)
        tl.store(word_ptrs, words, mask=out_rows[:, None])
        tl.store(scale_ptrs(out_ptr, out_offset, out_blocks_per_pack, out_first, OUT_BLOCKS, OUT_WORDS * 4), scale,
                 mask=out_rows)


@triton.jit
def _reduce_dequantize_kernel(
    buf_ptr,
    out_ptr,
    out_numel,
    blocks_per_pack,
    pack_bytes,
    divisor,
    reciprocal,
    GROUPS: tl.constexpr,
    DIVIDE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr,
    ROTATION: tl.constexpr = 0,
    LOG_ROTATION: tl.constexpr = 0,
):
    """Sum ``BLOCKS`` blocks over ``GROUPS`` packs, divide by ``divisor`` (float32) and store per program.

    ``buf_ptr``: ``GROUPS`` packs of ``blocks_per_pack`` blocks in ``pack_bytes`` bytes; ``out_ptr``: the first
    ``out_numel`` values. ``reciprocal`` is ``1 / divisor`` correctly rounded (float32); ``DIVIDE`` says how
    to divide (``DIVIDE_BY_MULTIPLY``, ``DIVIDE_FAST``, ``DIVIDE_EXACT``). ``ROTATION`` (0: none): the sums'
    blocks of ``ROTATION`` elements go through the inverse butterfly (times ``1 / ROTATION``) before the division,
    which is then never ``DIVIDE_FAST`` (its exactness check reads the scales, not the unrotated values).
    """
    WORDS: tl.constexpr = BLOCK_SIZE * BITS // 32
    first_block = tl.program_id(0) * BLOCKS
    out_start = first_block.to(tl.int64) * BLOCK_SIZE
    available = out_numel - out_start
    full = available >= BLOCKS * BLOCK_SIZE
    rows = first_block + tl.arange(0, BLOCKS) < blocks_per_pack
    acc = _sum_groups(buf_ptr, 0, pack_bytes, blocks_per_pack, first_block, rows, full, GROUPS, BLOCKS, WORDS,
                      BITS)
    if ROTATION:
        acc = butterfly(acc, BLOCKS, BLOCK_SIZE, ROTATION, LOG_ROTATION, True)
    if DIVIDE == 0:
        v = acc * reciprocal
    elif DIVIDE == 1:
        if _scales_fit(buf_ptr, blocks_per_pack, pack_bytes, first_block, rows, full, GROUPS, BLOCKS, WORDS):
            v = div_fast(acc, divisor, reciprocal)
        else:
            v = tl.math.div_rn(acc, tl.full(acc.shape, divisor, tl.float32))
    else:
        v = tl.math.div_rn(acc, tl.full(acc.shape, divisor, tl.float32))
    y = to_output(v, out_ptr, INTERPRET)
    out = element_ptrs(out_ptr, out_start, BLOCKS, BLOCK_SIZE)
    if full:
        tl.store(out, y)
    else:
        count = row_counts(available, BLOCKS, BLOCK_SIZE)
        tl.store(out, y, mask=tl.arange(0, BLOCK_SIZE)[None, :] < count[:, None])


def requantize_shape(fmt: BlockFormat, groups: int, out_fmt: BlockFormat | None = None,
                     seeded: bool = False) -> LaunchShape:
    """The reduce-requantize tile for ``groups`` runs of ``fmt`` requantized in ``out_fmt`` (default ``fmt``), in
    input blocks: the largest power-of-two number of elements whose codes over all groups fit ``STAGE_CODE_BYTES``
    (at most ``TILE_ELEMENTS`` and ``MAX_TILE_ROWS`` blocks of either format; half as many ``seeded``, whose
    noise keeps more values live: 8192 elements spilled on sm_90), at least a block of each."""
    out_fmt = fmt if out_fmt is None else out_fmt
    unit = max(fmt.block_size, out_fmt.block_size)
    fitting = STAGE_CODE_BYTES * 8 // (groups * fmt.bits)
    elements = min(TILE_ELEMENTS["reduce_requantize"], 1 << max(fitting.bit_length() - 1, 0),
                   MAX_TILE_ROWS * min(fmt.block_size, out_fmt.block_size)) // (2 if seeded else 1)
    shape = launch_shape("reduce_requantize", unit, elements=elements)
    return LaunchShape(shape.blocks_per_program * unit // fmt.block_size, shape.num_warps)


def reduce_requantize(
    buf: torch.Tensor,
    fmt: BlockFormat,
    groups: int,
    chunks: int,
    chunk_numel: int,
    out: torch.Tensor,
    out_fmt: BlockFormat | None = None,
    seed: int | None = None,
) -> None:
    """Sum ``groups`` runs of ``chunks`` packs pack-wise in float32 and pack the ``chunks`` sums into ``out`` in
    ``out_fmt`` (default ``fmt``), rounded stochastically with a ``seed``.

    ``buf``: uint8, ``groups * chunks`` packs of ``chunk_numel`` elements; pack ``m`` of ``out`` is the sum of
    packs ``i * chunks + m``. Same result as ``reference.reduce_requantize``. A persistent grid: ``SM_CODE_BYTES``
    of tile codes per multiprocessor, each program looping over its tiles.
    """
    if chunk_numel == 0:
        return
    out_fmt = fmt if out_fmt is None else out_fmt
    blocks_per_pack = fmt.num_blocks(chunk_numel)
    pack_bytes = fmt.packed_bytes(chunk_numel)
    out_blocks = out_fmt.num_blocks(chunk_numel)
    shape = requantize_shape(fmt, groups, out_fmt, seed is not None)
    # tiles cover the output blocks (past the input's, the sums are 0)
    tile_elements = shape.blocks_per_program * fmt.block_size
    tiles_per_pack = triton.cdiv(out_blocks * out_fmt.block_size, tile_elements)
    tiles = chunks * tiles_per_pack
    tile_code_bytes = groups * shape.blocks_per_program * fmt.block_size * fmt.bits // 8
    programs = multiprocessors(buf.device) * max(1, SM_CODE_BYTES // tile_code_bytes)
    # the pipeline buffers STAGES - 1 tiles of codes and scales in shared memory (a swept tile can be too big)
    tile_bytes = tile_code_bytes + groups * shape.blocks_per_program * 4
    stages = max(1, min(PIPELINE_STAGES, 1 + SHARED_BYTES // tile_bytes))
    launch(
        _reduce_requantize_kernel,
        (min(tiles, programs),),
        shape,
        fmt,
        buf.device,
        buf,
        out,
        blocks_per_pack,
        pack_bytes,
        chunks * pack_bytes,
        tiles_per_pack,
        tiles,
        out_blocks,
        out_fmt.packed_bytes(chunk_numel),
        chunk_numel,
        0 if seed is None else seed,
        GROUPS=groups,
        STAGES=stages,
        OUT_BLOCK_SIZE=out_fmt.block_size,
        OUT_BITS=out_fmt.bits,
        SEEDED=seed is not None,
    )


def divide_mode(divisor: float) -> tuple[int, float]:
    """How ``reduce_dequantize`` divides by ``divisor``, and the correctly rounded float32 ``1 / divisor``."""
    d = np.float32(divisor)
    reciprocal = float(np.float32(1.0) / d)
    if float(d) == divisor and exact_reciprocal(divisor) is not None:
        return DIVIDE_BY_MULTIPLY, reciprocal
    if float(d) == divisor and divisor.is_integer() and 1 <= divisor <= 2**16:
        return DIVIDE_FAST, reciprocal
    return DIVIDE_EXACT, reciprocal


def reduce_dequantize(
    buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, out: torch.Tensor, divisor: float,
    rotation: int = 0,
) -> None:
    """Sum ``groups`` packs of ``chunk_numel`` elements in float32, divide by ``divisor`` and write the first
    ``out.numel()`` values into flat ``out`` in its dtype. Same result as ``reference.reduce_dequantize``.
    ``rotation``: the inverse rotation fused, each tile's sums through the inverse butterfly of ``rotation``, then
    divided (by the exact reciprocal of a power of two, else by IEEE division: the fast division's exactness check
    reads the scales, not the unrotated values) and stored; same result as ``rotation.reduce_dequantize_rotated``'s
    composition."""
    out_numel = out.numel()
    if out_numel == 0:
        return
    blocks = fmt.num_blocks(out_numel)
    shape = launch_shape("reduce_dequantize", fmt.block_size, is_aligned(out))
    mode, reciprocal = divide_mode(divisor)
    rotated = {}
    if rotation:
        mode = DIVIDE_EXACT if mode == DIVIDE_FAST else mode
        rotated = {"ROTATION": rotation, "LOG_ROTATION": rotation.bit_length() - 1}
    launch(_reduce_dequantize_kernel, (triton.cdiv(blocks, shape.blocks_per_program),), shape, fmt, buf.device,
           buf, out, out_numel, fmt.num_blocks(chunk_numel), fmt.packed_bytes(chunk_numel), divisor, reciprocal,
           GROUPS=groups, DIVIDE=mode, **rotated)


def reduce_dequantize_rotated(buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, size: int,
                              out: torch.Tensor, divisor: float) -> None:
    """``reduce_dequantize`` with the inverse rotation of ``size`` fused."""
    reduce_dequantize(buf, fmt, groups, chunk_numel, out, divisor, rotation=size)
