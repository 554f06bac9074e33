"""Shared pieces of the Triton kernels: the launch heuristic, block addressing and the block arithmetic.

Every kernel walks the *global block order* of a chunked buffer: block ``g`` is block ``b = g % blocks_per_pack``
of pack ``p = g // blocks_per_pack``. A program handles ``BLOCKS`` consecutive global blocks as one 2-D tile of
``[BLOCKS, block_size]`` elements, loaded and stored contiguously; int4 code bytes are ``[BLOCKS, block_size // 2]``
tiles, matched with the even and odd elements that ``tl.split`` / ``tl.join`` take out of and put back into the
element tile. Small packs waste no lanes, and the codes a program writes are contiguous except where its tile
crosses a pack boundary. Offsets are int64 throughout, so buffers above 2**31 bytes work. Element masks are only
applied in tiles that need them (``load_rows``, ``store_rows``), so the common full tiles vectorize.

The arithmetic mirrors ``zeropp.quant.reference`` operation for operation (float32, IEEE division, round half to
even); the launchers pass ``enable_fp_fusion=False`` so that ``code * scale`` and the following addition are
never contracted into one FMA, which would round differently from the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

TILE_ELEMENTS: dict[str, int] = {
    "quantize": 4096,
    "dequantize": 4096,
    "reduce_requantize": 4096,
    "reduce_dequantize": 4096,
}
"""Elements per program for each op (at least one block). The one knob to tune on a GPU."""


@dataclass(frozen=True)
class LaunchShape:
    """How an op is launched for one block size: blocks per program (a power of two) and warps per program."""

    blocks_per_program: int
    num_warps: int


def launch_shape(op: str, block_size: int) -> LaunchShape:
    """The tile of ``op`` for ``block_size``: ``TILE_ELEMENTS[op]`` elements (or one block if larger)."""
    elements = max(block_size, TILE_ELEMENTS[op])
    return LaunchShape(elements // block_size, 4 if elements <= 4096 else 8)


def grid(num_blocks: int, shape: LaunchShape) -> tuple[int]:
    """One program per ``shape.blocks_per_program`` blocks; callers never launch for ``num_blocks == 0``."""
    return (triton.cdiv(num_blocks, shape.blocks_per_program),)


@triton.jit
def tile_blocks(
    blocks_per_pack, pack_bytes, BLOCKS: tl.constexpr, BLOCK_CODE_BYTES: tl.constexpr, ONE_PACK: tl.constexpr
):
    """This program's global blocks ``g`` and, per block, its pack ``p``, its index ``b`` in the pack and the
    byte offsets of its codes and of its float32 scale in a buffer of whole packs. All int64 of shape [BLOCKS].

    ``ONE_PACK`` (every block in pack 0) skips the division and lets the compiler see that the offsets are
    multiples of the block size, so it can vectorize the loads and stores.
    """
    g = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    if ONE_PACK:
        p = tl.zeros_like(g)
        b = g
    else:
        p = g // blocks_per_pack
        b = g - p * blocks_per_pack
    pack = p * pack_bytes
    code_offset = pack + b * BLOCK_CODE_BYTES
    scale_offset = pack + blocks_per_pack * BLOCK_CODE_BYTES + b * 4
    return g, p, b, code_offset, scale_offset


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
