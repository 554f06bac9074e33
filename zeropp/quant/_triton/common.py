"""Shared pieces of the Triton kernels: the launch heuristic, block addressing and the block arithmetic.

Every kernel walks the *global block order* of a chunked buffer: block ``g`` is block ``b = g % blocks_per_pack``
of pack ``p = g // blocks_per_pack``. A program handles ``BLOCKS`` consecutive global blocks as one 2-D tile of
``[BLOCKS, block_size]`` elements, loaded and stored contiguously; int4 code bytes are ``[BLOCKS, block_size // 2]``
tiles, matched with the even and odd elements that ``tl.split`` / ``tl.join`` take out of and put back into the
element tile. Small packs waste no lanes, and the codes a program writes are contiguous except where its tile
crosses a pack boundary. Offsets are int64 throughout, so buffers above 2**31 bytes work. Element masks are only
applied in tiles that need them (``load_rows``, ``store_rows``), so the common full tiles vectorize.

The arithmetic mirrors ``zeropp.quant.reference`` operation for operation (float32, IEEE division, round half to
even); ``launch`` passes ``enable_fp_fusion=False`` so that ``code * scale`` and the following addition are
never contracted into one FMA, which would round differently from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl

from ..format import BlockFormat

TILE_ELEMENTS: dict[str, int] = {
    "quantize": 4096,
    "dequantize": 4096,
    "reduce_requantize": 4096,
    "reduce_dequantize": 4096,
}
"""Elements per program for each op (at least one block), as far as ``MAX_ROWS_PER_THREAD`` allows. The knob to
tune on a GPU."""

MAX_ROWS_PER_THREAD = 16
"""At most this many of a program's blocks (tile rows) per thread, counted where the elements are not vectorized
(one element per thread per row: odd sizes, misaligned tensors). Every thread that holds part of a row holds that
row's indices, offsets, mask and scale, and for a block of at least ``32 * num_warps`` elements that is every thread
of the program: 32 rows per thread (block 128, 4096 elements) spilled registers once the tile crosses packs, 256
(block 16) spilled in every multi-pack kernel. With 16 the worst kernel compiled for sm_90 (``tests/quant/
test_triton_compile.py``) uses about 200 of its 255 registers and none spills."""


@dataclass(frozen=True)
class LaunchShape:
    """How an op is launched for one block size: blocks per program (a power of two) and warps per program."""

    blocks_per_program: int
    num_warps: int


def launch_shape(op: str, block_size: int) -> LaunchShape:
    """The tile of ``op`` for ``block_size``: ``TILE_ELEMENTS[op]`` elements (or one block if larger), 4 warps (8
    past 4096 elements), and no more blocks than keeps ``MAX_ROWS_PER_THREAD``.

    A row of ``block_size`` elements, one per thread, spans ``min(block_size, threads)`` threads, so each thread
    holds ``blocks * min(block_size, threads) / threads`` rows. With the defaults (4096, 16, 4 warps) blocks of 16,
    32, 64 and 128 elements get 2048-element tiles (128, 64, 32 and 16 blocks), larger blocks 4096 elements.
    """
    elements = max(block_size, TILE_ELEMENTS[op])
    num_warps = 4 if elements <= 4096 else 8
    threads = 32 * num_warps
    max_blocks = max(1, MAX_ROWS_PER_THREAD * threads // min(block_size, threads))
    blocks = min(elements // block_size, max_blocks)
    assert blocks & (blocks - 1) == 0 and blocks < 2**15, "BLOCKS must be a power of two below 2**15 (divmod_from)"
    return LaunchShape(blocks, num_warps)


def launch(kernel: Any, op: str, fmt: BlockFormat, num_blocks: int, *args: Any, **constexprs: Any) -> None:
    """Launch ``kernel(*args, **constexprs)`` over ``num_blocks`` blocks (> 0) with ``op``'s tile: one program per
    ``BLOCKS`` blocks, plus the constexprs every kernel takes (``BLOCK_SIZE``, ``BITS``, ``BLOCKS``), its warps,
    and ``enable_fp_fusion=False``: no FMA contraction, so ``code * scale + acc`` rounds as in the reference."""
    shape = launch_shape(op, fmt.block_size)
    kernel[(triton.cdiv(num_blocks, shape.blocks_per_program),)](
        *args,
        BLOCK_SIZE=fmt.block_size,
        BITS=fmt.bits,
        BLOCKS=shape.blocks_per_program,
        num_warps=shape.num_warps,
        enable_fp_fusion=False,
        **constexprs,
    )


@triton.jit
def divmod_from(start, r, divisor, R_MAX: tl.constexpr):
    """``((start + r) // divisor - start // divisor, (start + r) % divisor)`` for int32 ``r`` in ``[0, R_MAX]``
    (``R_MAX < 2**15``) and int64 scalars ``start >= 0``, ``divisor >= 1``: int32 and int64 tensors shaped as ``r``.

    Per-row values are held by every thread that holds part of the row (all of them when a block spans the
    program's threads), so per-row int64 division is repeated in every thread and is what made the kernels spill.
    Here the only division is on scalars: past the first multiple of ``divisor`` after ``start`` (``first`` rows
    away), ``n // step`` with ``n < R_MAX`` and ``step = min(divisor, R_MAX + 1)`` is one multiply and shift by
    ``ceil(2**32 / step)``, exact because ``n * step < 2**32``; it is 0 when ``divisor > R_MAX``, the usual case.
    """
    divisor = tl.cast(divisor, tl.int64)  # an int32 argument, or the constant 1 when Triton specializes it
    base = start // divisor
    rem0 = start - base * divisor
    first = tl.minimum(divisor - rem0, R_MAX + 1).to(tl.int32)
    step = tl.minimum(divisor, R_MAX + 1)
    magic = 4294967295 // step + 1  # ceil(2**32 / step), at most 2**32
    after = r >= first
    n = tl.maximum(r - first, 0)
    k = ((n.to(tl.int64) * magic) >> 32).to(tl.int32)  # n // step
    q = tl.where(after, k + 1, 0)
    rem = tl.where(after, (n - k * step.to(tl.int32)).to(tl.int64), rem0 + r)
    return q, rem


@triton.jit
def tile_packs(blocks_per_pack, BLOCKS: tl.constexpr, ONE_PACK: tl.constexpr):
    """This program's global blocks ``g`` (int64 [BLOCKS]) as pack ``p0 + q`` and index ``b`` in the pack: the
    tile's first pack ``p0`` (an int64 scalar), ``q`` (int32 [BLOCKS]) and ``b`` (int64 [BLOCKS]); see
    ``divmod_from``. ``ONE_PACK`` (every block in pack 0) skips even that and lets the compiler see that offsets
    are multiples of the block size, so it can vectorize the loads and stores.
    """
    g0 = tl.program_id(0).to(tl.int64) * BLOCKS
    r = tl.arange(0, BLOCKS)
    g = g0 + r
    if ONE_PACK:
        p0 = g0 * 0
        q = r * 0
        b = g
    else:
        p0 = g0 // blocks_per_pack
        q, b = divmod_from(g0, r, blocks_per_pack, BLOCKS)
    return g, p0, q, b


@triton.jit
def tile_blocks(
    blocks_per_pack, pack_bytes, BLOCKS: tl.constexpr, BLOCK_CODE_BYTES: tl.constexpr, ONE_PACK: tl.constexpr
):
    """This program's global blocks ``g`` and, per block, its pack ``p``, its index ``b`` in the pack and the
    byte offsets of its codes and of its float32 scale in a buffer of whole packs. All int64 of shape [BLOCKS].
    See ``tile_packs`` for how ``p`` and ``b`` are found without per-row int64 division.
    """
    g, p0, q, b = tile_packs(blocks_per_pack, BLOCKS, ONE_PACK)
    p = p0 + q
    pack = p * pack_bytes
    code_offset = pack + b * BLOCK_CODE_BYTES
    scale_offset = pack + blocks_per_pack * BLOCK_CODE_BYTES + b * 4
    return g, p, b, code_offset, scale_offset


@triton.jit
def swizzled_sources(p, blocks_per_pack, nodes, ranks_per_node, BLOCKS: tl.constexpr, ONE_PACK: tl.constexpr):
    """Per block of ``tile_blocks``' pack ``p``: the input slice it holds, ``(p % nodes) * ranks_per_node +
    p // nodes`` (``format.swizzle_source``), found as ``tile_packs`` finds ``p``: int64 division on scalars only."""
    if ONE_PACK:
        source = p
    else:
        p0 = (tl.program_id(0).to(tl.int64) * BLOCKS) // blocks_per_pack  # the same scalar as in tile_packs
        q = (p - p0).to(tl.int32)  # in [0, BLOCKS]
        wrap, m = divmod_from(p0, q, nodes, BLOCKS)
        source = m * ranks_per_node + (p0 // nodes + wrap)
    return source


@triton.jit
def scale_pointers(buf_ptr, scale_offset):
    """Float32 pointers to the scales at byte offsets ``scale_offset`` of the uint8 buffer ``buf_ptr``."""
    return (buf_ptr + scale_offset).to(tl.pointer_type(tl.float32))


@triton.jit
def round_half_even(v):
    """``v`` rounded to the nearest integer, ties to even, still float32; exact for ``|v| < 2**22``.

    Adding 1.5 * 2**23 leaves no fraction bits, so the float32 addition itself rounds (half to even under the
    default rounding mode); unlike ``rint`` this behaves the same in the interpreter and on the GPU.
    """
    return (v + 12582912.0) - 12582912.0


@triton.jit
def absmax_bits(v):
    """Per row of float32 ``v`` [R, C]: the bits (int32) of the largest ``|v|``, a NaN if the row has one.

    ``tl.max`` on floats skips NaN; on the bit patterns of non-negative floats integer order is float order and
    every NaN sorts above +Inf, so one integer max gives the absmax and propagates NaN.
    """
    return tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def block_scale(amax_bits, QMAX: tl.constexpr):
    """Float32 scales ``absmax / qmax`` [R] from ``absmax_bits``; NaN stays NaN, Inf stays Inf."""
    return tl.math.div_rn(amax_bits.to(tl.float32, bitcast=True), tl.full(amax_bits.shape, QMAX, tl.float32))


@triton.jit
def quantize_values(v, scale, QMAX: tl.constexpr):
    """Int32 codes of float32 ``v`` [R, C] with per-row ``scale`` [R]: ``clamp(rne(v / scale), -qmax, qmax)``,
    0 in rows whose scale is not finite; a zero scale divides by 1 (its values are 0 or too small to round up)."""
    finite = scale < float("inf")  # False for NaN too
    divisor = tl.where(finite & (scale > 0), scale, 1.0)
    # Clamping before rounding gives the same integers (qmax is an integer) and keeps |v| small enough for
    # round_half_even.
    q = tl.math.div_rn(v, divisor[:, None])
    q = round_half_even(tl.minimum(tl.maximum(q, -QMAX), QMAX))
    return tl.where(finite[:, None], q, 0.0).to(tl.int32)


@triton.jit
def scaled(code, scale):
    """Float32 ``code * scale`` (int32 codes), clamped to the finite float32 range as in the reference: the
    product can round past it when a block's absmax is within an ulp of it. NaN stays NaN."""
    return tl.clamp(
        code.to(tl.float32) * scale, -3.4028234663852886e38, 3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL
    )


@triton.jit
def pack_int4(lo, hi):
    """Bytes (uint8) holding int32 codes ``lo`` in the low nibble and ``hi`` in the high one, two's complement."""
    return ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8)


@triton.jit
def unpack_int4(byte):
    """Signed int32 codes (low nibble, high nibble) of uint8 ``byte``."""
    b = byte.to(tl.int32)
    return ((b & 0xF) ^ 8) - 8, (((b >> 4) & 0xF) ^ 8) - 8


@triton.jit
def decode_int8(byte):
    """Signed int32 codes of uint8 ``byte``."""
    return byte.to(tl.int8, bitcast=True).to(tl.int32)


@triton.jit
def to_output(v, out_ptr):
    """Float32 ``v`` converted, rounding to nearest even, to the element type of ``out_ptr``.

    bfloat16 is rounded by hand: Triton's interpreter truncates ``.to(tl.bfloat16)``, and on the GPU these few
    integer operations cost nothing in a memory-bound kernel; NaN stays (quiet) NaN, overflow becomes Inf.
    """
    if out_ptr.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        half = tl.where(v != v, (bits >> 16) | 0x40, rounded)
        return half.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(out_ptr.dtype.element_ty)


@triton.jit
def load_rows(x_ptr, start, count, WIDTH: tl.constexpr):
    """Float32 [R, WIDTH]: row ``r`` holds the ``count[r]`` elements from ``x_ptr + start[r]``, then zeros.

    A tile whose rows are all whole needs no element mask, which is what lets the load be vectorized.
    """
    cols = tl.arange(0, WIDTH)[None, :]
    ptrs = x_ptr + start[:, None] + cols
    count = tl.minimum(tl.maximum(count, 0), WIDTH).to(tl.int32)  # one register per row, not two
    if tl.min(count, axis=0) >= WIDTH:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=cols < count[:, None], other=0.0)
    return v.to(tl.float32)


@triton.jit
def store_rows(out_ptr, start, count, v):
    """Store the first ``count[r]`` values of each row ``r`` of float32 ``v`` at ``out_ptr + start[r]``, in the
    element type of ``out_ptr``; unmasked (vectorizable) when every row is whole."""
    cols = tl.arange(0, v.shape[1])[None, :]
    ptrs = out_ptr + start[:, None] + cols
    count = tl.minimum(tl.maximum(count, 0), v.shape[1]).to(tl.int32)  # one register per row, not two
    y = to_output(v, out_ptr)
    if tl.min(count, axis=0) >= v.shape[1]:
        tl.store(ptrs, y)
    else:
        tl.store(ptrs, y, mask=cols < count[:, None])


@triton.jit
def store_int8_blocks(buf_ptr, code_offset, scale_offset, row_mask, v, QMAX: tl.constexpr):
    """Quantize float32 rows ``v`` [R, block_size] to int8 and store codes and scales at the given offsets."""
    scale = block_scale(absmax_bits(v), QMAX)
    q = quantize_values(v, scale, QMAX)
    cols = tl.arange(0, v.shape[1])
    tl.store(buf_ptr + code_offset[:, None] + cols[None, :], (q & 0xFF).to(tl.uint8), mask=row_mask[:, None])
    tl.store(scale_pointers(buf_ptr, scale_offset), scale, mask=row_mask)


@triton.jit
def store_int4_blocks(buf_ptr, code_offset, scale_offset, row_mask, even, odd, QMAX: tl.constexpr):
    """Quantize float32 rows, given as their ``even`` and ``odd`` elements [R, block_size // 2], to int4 and store
    codes (element 2k low nibble, 2k+1 high nibble of byte k) and scales at the given offsets."""
    scale = block_scale(tl.maximum(absmax_bits(even), absmax_bits(odd)), QMAX)
    byte = pack_int4(quantize_values(even, scale, QMAX), quantize_values(odd, scale, QMAX))
    cols = tl.arange(0, even.shape[1])
    tl.store(buf_ptr + code_offset[:, None] + cols[None, :], byte, mask=row_mask[:, None])
    tl.store(scale_pointers(buf_ptr, scale_offset), scale, mask=row_mask)
