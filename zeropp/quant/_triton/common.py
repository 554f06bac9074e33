"""Shared pieces of the Triton kernels: launch shapes, tile addressing and the block arithmetic.

**Grid.** A kernel runs on a 2-D grid: ``program_id(1)`` is a pack of the chunked layout and ``program_id(0)`` a
tile of ``BLOCKS`` consecutive blocks of that pack (the last tile of a pack may be short). No program ever spans
two packs, so no index is divided at run time; the swizzled quantize uses a 3-D grid (see ``quantize.py``). The
fused reduce-requantize is the exception: a persistent grid of a few programs per multiprocessor, each looping
over tiles with the next tiles' loads in flight (one division per tile; see ``reduce.py``). Offsets are int64 per
pack and int32 inside a tile, so buffers past 2**31 bytes work.

**Codes as words.** The code bytes of a block are read and written as int32 words (a block's codes are a
multiple of 4 bytes and every pack starts 4-byte aligned, ``format.py``): 4 int8 codes or 8 int4 codes per
word or 16 int2 codes, code ``i`` of a word in bits ``[i * BITS, (i + 1) * BITS)`` (the spec's byte order on a
little-endian machine, and the "element 2k low nibble" and "element 4k lowest two bits" rules, are exactly that). A word's codes are taken apart and put
together with shifts, masks and float tricks on whole words (``decode_words``, ``encode_words``), never byte by
byte.

**Exact fast arithmetic.** The torch reference (the spec) computes in float64 where that is exact. The kernels
get the same bits with fewer instructions, on a *fast path* that a program takes when every block of its tile
has a scale in the normal range (``FAST_MIN``..``FAST_MAX``, or 0), and otherwise on the *exact path*, which
handles every scale (subnormal, infinite, NaN) as the reference does. The fast path:

* the code ``rne(x * r)`` (``r = 1 / scale`` correctly rounded once per block, the product exact) as ONE FMA,
  ``x * r + (1.5 * 2**23 + 2**(bits - 1))``: the FMA rounds the exact product once, to an integer, and the
  sum's low mantissa bits are the offset code (``|x * r| <= qmax * (1 + 2**-22)``, so no clamp is needed and
  no float-to-int conversion);
* ``absmax / qmax`` as ``q0 = a * y``, ``e = fma(-q0, qmax, a)``, ``q = fma(e, y, q0)`` with the constant
  ``y = 1 / qmax``: the correctly rounded quotient (Markstein's theorem) while nothing over- or underflows, which
  the range guarantees (``div_fast``, also used by the fused reduce-dequantize for integer divisors);
* a code back to float by placing its bits into the mantissa of a float of known exponent and subtracting that
  float (exact), instead of an int-to-float conversion (a quarter-rate instruction);
* the fused reductions accumulate ``acc = fma(code, scale, acc)``, which is the spec (one rounding per group).

``tests/quant/test_exact_arith.py`` checks these identities against the reference on millions of cases.
``enable_fp_fusion=False`` in every launch: only the FMAs written here are fused, the compiler contracts nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..format import BlockFormat

TILE_ELEMENTS: dict[str, int] = {
    "quantize": 8192,
    "dequantize": 8192,
    "reduce_requantize": 8192,
    "reduce_dequantize": 8192,
}
"""Elements per program of each op on aligned data (at least one block): 64 per thread at 4 warps, enough to
amortise a tile's fixed work (addressing, the per-block scale and reciprocal, the fast-path check)."""

NUM_WARPS = 4

MAX_ROWS_PER_THREAD = 16
"""Unaligned data (an odd ``chunk_numel`` or a float tensor not 16-byte aligned) is not vectorized: one element
per thread per row, so every thread holds a value of every row of the tile, and per-row values (scale,
reciprocal, offsets) multiply. Tiles are then cut to at most this many rows per thread, which keeps every
specialization free of register spills (``tests/quant/test_triton_compile.py``)."""

FAST_MIN = tl.constexpr(2.0**-80)
"""Smallest non-zero block scale (or absmax) of the fast path. Below it ``absmax / qmax``'s residual or a sum of
products could underflow, or ``1 / scale`` overflow, and the exact path runs instead."""

FAST_MAX = tl.constexpr(2.0**100)
"""Largest block scale of the fast path (``code * scale`` and sums of 8 such stay far from overflow)."""

ROUNDER = tl.constexpr(1.5 * 2**23)
"""Adding it to ``|q| < 2**22`` in one float32 rounding rounds ``q`` to an integer (half to even), held in the low
mantissa bits of the sum."""

CODE_BITS = tl.constexpr(0x4B400000)
"""The float32 bits of ``ROUNDER``."""


def _int32(value: int) -> int:
    """``value`` modulo 2**32 as a signed int32 (so that Triton keeps a constant int32)."""
    value %= 1 << 32
    return value - (1 << 32) if value >= 1 << 31 else value


def _word_sum(per_code: int, bits: int) -> int:
    """``sum_i per_code * 2**(i * bits)`` over the codes of a word, as an int32."""
    return _int32(sum(per_code << (i * bits) for i in range(32 // bits)))


# What ``encode_words`` subtracts from a word built from code bits, and every code's sign bit, per code width.
WORD_OFFSET_8 = tl.constexpr(_word_sum(0x4B400000, 8))
WORD_OFFSET_4 = tl.constexpr(_word_sum(0x4B400000, 4))
WORD_OFFSET_2 = tl.constexpr(_word_sum(0x4B400000, 2))
WORD_SIGNS_8 = tl.constexpr(_word_sum(128, 8))
WORD_SIGNS_4 = tl.constexpr(_word_sum(8, 4))
WORD_SIGNS_2 = tl.constexpr(_word_sum(2, 2))


@dataclass(frozen=True)
class LaunchShape:
    """How an op is launched for one block size: blocks per program (a power of two) and warps per program."""

    blocks_per_program: int
    num_warps: int


_overrides: dict[str, tuple[int, int]] = {}


@contextlib.contextmanager
def tile_override(op: str, elements: int, num_warps: int) -> Iterator[None]:
    """Launch ``op`` with ``elements`` per program (a power of two; at least one block is always taken) and
    ``num_warps`` inside the ``with``, for tile sweeps (``bench/kernels.py --sweep``). Not thread-safe."""
    if op not in TILE_ELEMENTS:
        raise ValueError(f"op={op!r} is not one of {sorted(TILE_ELEMENTS)}")
    if elements < 1 or elements & (elements - 1) or num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"elements={elements} and num_warps={num_warps} must be powers of two")
    previous = _overrides.get(op)
    _overrides[op] = (elements, num_warps)
    try:
        yield
    finally:
        if previous is None:
            del _overrides[op]
        else:
            _overrides[op] = previous


def launch_shape(op: str, block_size: int, aligned: bool = True, elements: int | None = None) -> LaunchShape:
    """The tile of ``op`` for ``block_size``: ``elements`` (default ``TILE_ELEMENTS[op]``) elements, or one block
    if larger, at ``NUM_WARPS`` warps (a ``tile_override`` replaces both); on unaligned data no more blocks than
    keeps ``MAX_ROWS_PER_THREAD``."""
    elements, num_warps = _overrides.get(op, (elements or TILE_ELEMENTS[op], NUM_WARPS))
    blocks = max(1, elements // block_size)
    if not aligned:
        threads = 32 * num_warps
        blocks = min(blocks, max(1, MAX_ROWS_PER_THREAD * threads // min(block_size, threads)))
    return LaunchShape(blocks, num_warps)


@functools.lru_cache(maxsize=None)
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors a persistent grid is sized for: the GPU's own count; 132 (an H100, what
    ``aot.py`` compiles for) for meta tensors; 1 under the interpreter, so that programs loop over several tiles."""
    if device.type == "cuda":
        return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return 132 if device.type == "meta" else 1


def is_aligned(t: torch.Tensor, *counts: int) -> bool:
    """Whether Triton will see ``t``'s pointer 16-byte aligned and every element count divisible by 16: what lets
    it vectorize a tile's loads and stores (and what ``launch_shape`` calls aligned)."""
    return t.data_ptr() % 16 == 0 and all(c % 16 == 0 for c in counts)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel: Any, grid: tuple[int, ...], shape: LaunchShape, fmt: BlockFormat, device: torch.device,
           *args: Any, **constexprs: Any) -> None:
    """Launch ``kernel[grid](*args, **constexprs)`` on ``device`` with ``shape``'s tile, the constexprs every
    kernel takes (``BLOCK_SIZE``, ``BITS``, ``BLOCKS``, ``INTERPRET``) and ``enable_fp_fusion=False``.

    Triton launches on the current CUDA device, so the launch is made under ``device``: a rank that never called
    ``torch.cuda.set_device`` would otherwise run the kernel on device 0 with pointers into another device."""
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        kernel[grid](
            *args,
            BLOCK_SIZE=fmt.block_size,
            BITS=fmt.bits,
            BLOCKS=shape.blocks_per_program,
            INTERPRET=interpreting(),
            num_warps=shape.num_warps,
            enable_fp_fusion=False,
            **constexprs,
        )


# ---------------------------------------------------------------------------------------------------------------
# Addressing


@triton.jit
def code_words(buf_ptr, pack_offset, first_block, BLOCKS: tl.constexpr, WORDS: tl.constexpr):
    """Int32 pointers [BLOCKS, WORDS] to the code words of blocks ``first_block + r`` of the pack at byte
    ``pack_offset`` (int64) of ``buf_ptr``; ``WORDS`` words per block."""
    base = (buf_ptr + pack_offset).to(tl.pointer_type(tl.int32)) + first_block * WORDS
    return base + (tl.arange(0, BLOCKS) * WORDS)[:, None] + tl.arange(0, WORDS)[None, :]


@triton.jit
def scale_ptrs(buf_ptr, pack_offset, blocks_per_pack, first_block, BLOCKS: tl.constexpr, CODE_BYTES: tl.constexpr):
    """Float32 pointers [BLOCKS] to the scales of blocks ``first_block + r`` of the pack at byte ``pack_offset``."""
    scales = pack_offset + tl.cast(blocks_per_pack, tl.int64) * CODE_BYTES  # an int32, or 1 when specialized
    return (buf_ptr + scales).to(tl.pointer_type(tl.float32)) + first_block + tl.arange(0, BLOCKS)


@triton.jit
def element_ptrs(x_ptr, offset, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Pointers [BLOCKS, BLOCK_SIZE] to ``BLOCKS * BLOCK_SIZE`` consecutive elements from ``x_ptr + offset``."""
    return (x_ptr + offset) + (tl.arange(0, BLOCKS) * BLOCK_SIZE)[:, None] + tl.arange(0, BLOCK_SIZE)[None, :]


@triton.jit
def row_counts(available, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Int32 [BLOCKS]: how many of a row's ``BLOCK_SIZE`` elements lie in the first ``available`` (int64) elements
    of the tile, between 0 and ``BLOCK_SIZE``."""
    left = available - (tl.arange(0, BLOCKS) * BLOCK_SIZE).to(tl.int64)
    return tl.minimum(tl.maximum(left, 0), BLOCK_SIZE).to(tl.int32)


# ---------------------------------------------------------------------------------------------------------------
# Block arithmetic


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def absmax(v):
    """Per row of float32 ``v`` [R, C]: the largest ``|v|``, NaN if the row holds one (``tl.max`` skips NaN)."""
    return tl.reduce(tl.abs(v), 1, _nan_max)


@triton.jit
def fast_rows(scale):
    """Int32 [R], 1 where ``scale`` (any float32, NaN included) is 0 or within ``[FAST_MIN, FAST_MAX]``."""
    fine = (scale == 0.0) | ((scale >= FAST_MIN) & (scale <= FAST_MAX))
    return fine.to(tl.int32)


@triton.jit
def all_fast(scale):
    """Whether every scale of the tile (float32 [R]) allows the fast path: one program-wide check."""
    return tl.min(fast_rows(scale), axis=0) == 1


@triton.jit
def div_fast(x, d, y):
    """``x / d`` correctly rounded (float32), from ``y``, the correctly rounded ``1 / d``: one multiply and two
    FMAs. Exact for ``d`` and the quotient in the normal range (Markstein); the fast path guarantees it."""
    q = x * y
    return tl.fma(tl.fma(-q, d, x), y, q)


@triton.jit
def scale_fast(amax, QMAX: tl.constexpr):
    """``amax / qmax`` correctly rounded for ``amax`` 0 or in the fast range (``div_fast`` by a constant)."""
    return div_fast(amax, QMAX * 1.0, 1.0 / QMAX)


@triton.jit
def scale_exact(amax, QMAX: tl.constexpr):
    """``amax / qmax`` by IEEE division: NaN stays NaN, Inf stays Inf."""
    return tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))


@triton.jit
def quantize_fast(v, scale, BITS: tl.constexpr):
    """The code bits [R, C] of float32 ``v`` with per-row ``scale`` on the fast path (see ``quantize_rows``).

    One FMA per element: ``v * r + (ROUNDER + 2**(BITS - 1))`` with ``r = 1 / scale`` correctly rounded once per
    row. The FMA rounds the exact product once, to an integer (the sum has no fraction bits; half to even, as the
    constant is even), so its low mantissa bits are the offset code ``rne(v * r) + 2**(BITS - 1)``; with the
    scale in the fast range ``|v * r| <= qmax * (1 + 2**-22)`` needs no clamp. A zero scale uses ``r = 1`` (its
    values are 0).
    """
    d = tl.where(scale > 0.0, scale, 1.0)
    r = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    return tl.fma(v, r[:, None], ROUNDER + (1 << (BITS - 1))).to(tl.int32, bitcast=True)


@triton.jit
def _rescaled_reciprocal(scale):
    """Per row of float32 ``scale`` [R]: whether it is usable (positive and finite), the power of two ``k`` to
    scale the row's values by and the reciprocal ``r`` of ``scale * k`` (float32), so that ``(v * k) * r`` is the
    spec's ``v * r``. ``k`` is ``2**64`` below ``FAST_MIN`` (``1 / scale`` would overflow), ``2**-64`` above
    ``FAST_MAX`` (an int2 scale is the absmax itself, whose reciprocal would be subnormal, short of 24 bits:
    ``v * 2**-64`` is exact unless ``|v| < 2**-62``, whose code is 0 either way), else 1."""
    usable = (scale < float("inf")) & (scale > 0.0)  # False for NaN too
    k = tl.where(scale < FAST_MIN, 18446744073709551616.0, tl.where(scale > FAST_MAX, 5.421010862427522e-20, 1.0))
    d = tl.where(usable, scale * k, 1.0)
    r = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    return usable, k, r


@triton.jit
def _fmix32(h):
    """MurmurHash3's 32-bit finalizer on uint32 ``h``."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def noise_thresholds(seed, first_index, offsets):
    """Float32 ``1 - u`` of the stochastic rounding, for ``seed`` (an integer in ``[0, 2**32)``), of the elements
    at index ``first_index + offsets`` (int64 scalar plus int32 offsets in ``[0, 2**31)``): ``u = (h >> 9) *
    2**-23``, ``h = fmix32(lo * 0x9E3779B1 + fmix32(fmix32(hi) ^ seed))`` on uint32 (``reference.noise_hash``).

    The indices of a tile span fewer than 2**32 values, so ``hi`` is the first index's or the next: the two keys
    are computed once per tile, and an element whose ``lo`` wrapped past 2**32 takes the second. ``1 - u`` is
    ``2 - (1 + u)``, the float ``1 + u`` being the bits ``0x3F800000 | (h >> 9)``: exact, and no conversion."""
    seed32 = seed.to(tl.uint32)
    first_lo = (first_index & 0xFFFFFFFF).to(tl.uint32)
    first_hi = (first_index >> 32).to(tl.uint32)
    key = _fmix32(_fmix32(first_hi) ^ seed32)
    next_key = _fmix32(_fmix32(first_hi + 1) ^ seed32)
    lo = first_lo + offsets.to(tl.uint32)
    h = _fmix32(lo * 0x9E3779B1 + tl.where(lo < first_lo, next_key, key))
    return 2.0 - ((h >> 9) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def quantize_stochastic(v, scale, thresholds, BITS: tl.constexpr):
    """The code bits [R, C] (as ``quantize_rows``) of float32 ``v`` with per-row ``scale``, rounded stochastically
    (``format.py``): ``p = v * r`` rounded to float32 once, code ``sign(p) * min(floor(|p|) + (frac >= 1 - u),
    qmax)`` with ``frac = |p| - floor(|p|)`` (exact) and ``thresholds`` the ``1 - u``; 0 where the scale is 0 or
    not finite. Exact for every scale, so there is no fast path.

    ``floor(|p|)`` without a conversion instruction: ``y = |p| + ROUNDER`` rounds ``|p| <= qmax * (1 + 2**-22)``
    to the nearest integer ``n`` (``y``'s low bits), and the floor is ``n`` or, where ``n > |p|``, ``n - 1``."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    usable, k, r = _rescaled_reciprocal(scale)
    p = (v * k[:, None]) * r[:, None]
    a = tl.abs(p)
    y = a + ROUNDER
    n = y - ROUNDER
    above = n > a
    whole = tl.where(above, n - 1.0, n)
    up = (a - whole) >= thresholds
    magnitude = y.to(tl.int32, bitcast=True) - CODE_BITS - above.to(tl.int32) + up.to(tl.int32)
    c = tl.minimum(magnitude, QMAX)
    c = tl.where(p < 0.0, -c, c)
    c = tl.where(usable[:, None], c, 0)
    return c + (CODE_BITS + (1 << (BITS - 1)))


@triton.jit
def quantize_exact(v, scale, BITS: tl.constexpr):
    """The code bits [R, C] of float32 ``v`` with per-row ``scale`` for any scale, as the reference computes them:
    ``clamp(rne(v * r), -qmax, qmax)``, code 0 in rows whose scale is 0 or not finite.

    ``r = 1 / scale`` rounded to float32 precision overflows for scales below ``2**-128``, so a row whose scale
    is below ``FAST_MIN`` is scaled by ``2**64`` first (``v * 2**64`` and ``1 / (scale * 2**64)`` are exact
    rescalings, and the FMA's product is the same). The clamp matters for subnormal scales only, whose rounding
    error can exceed an ulp.
    """
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    OFFSET: tl.constexpr = ROUNDER + (1 << (BITS - 1))
    usable, k, r = _rescaled_reciprocal(scale)
    q = tl.fma(v * k[:, None], r[:, None], OFFSET)
    q = tl.minimum(tl.maximum(q, OFFSET - QMAX), OFFSET + QMAX)
    return tl.where(usable[:, None], q, OFFSET).to(tl.int32, bitcast=True)


@triton.jit
def quantize_rows(v, seed, first_index, BITS: tl.constexpr, SEEDED: tl.constexpr):
    """Float32 rows ``v`` [R, C] (whole blocks) to code bits and scales: int32 [R, C] holding ``CODE_BITS +
    2**(BITS - 1) + code`` (what ``encode_words`` packs), and float32 scales [R]. The fast path if every row of
    the tile allows it, else the exact path; with ``SEEDED``, stochastic rounding for ``seed``, the element at
    row ``i``, column ``j`` taking the noise of index ``first_index + i * C + j`` (int64)."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    amax = absmax(v)
    if SEEDED:
        scale = scale_exact(amax, QMAX)
        offsets = (tl.arange(0, v.shape[0]) * v.shape[1])[:, None] + tl.arange(0, v.shape[1])[None, :]
        codes = quantize_stochastic(v, scale, noise_thresholds(seed, first_index, offsets), BITS)
    elif all_fast(amax):
        scale = scale_fast(amax, QMAX)
        codes = quantize_fast(v, scale, BITS)
    else:
        scale = scale_exact(amax, QMAX)
        codes = quantize_exact(v, scale, BITS)
    return codes, scale


@triton.jit
def encode_words(codes, BITS: tl.constexpr):
    """Int32 words [R, C * BITS // 32] from code bits [R, C] (``quantize_rows``: ``CODE_BITS + code``): code
    ``i`` of a word in bits ``[i * BITS, (i + 1) * BITS)``, two's complement.

    Each code's bits are ``CODE_BITS + 2**(BITS - 1) + code`` with the offset code ``u`` in ``[1, 2**BITS)``,
    so ``sum_i bits_i * 2**(i * BITS)`` (mod 2**32, Horner's rule: one shift-and-add per code) is
    ``sum_i u_i * 2**(i * BITS)`` plus a constant; subtracting it and flipping every code's sign bit gives the
    packed two's-complement word. The codes of a word are taken apart with ``tl.split``, which stays inside a
    thread when the word's codes do (wherever the layout holds 8 consecutive elements per thread, as vectorized
    16-bit loads and ``decode_words`` do).
    """
    R: tl.constexpr = codes.shape[0]
    PER_WORD: tl.constexpr = 32 // BITS
    if BITS == 2:
        # pairs of neighbours joined level by level: 2 codes of 2 bits, then 4 of 2, 8, 16 (shifts by the width)
        pairs = codes
        for level in tl.static_range(4):
            low, high = tl.split(tl.reshape(pairs, [R, pairs.shape[1] // 2, 2]))
            pairs = low + (high << (BITS << level))
        return (pairs - WORD_OFFSET_2) ^ WORD_SIGNS_2
    elif BITS == 8:
        # [R, W, a, c] holds code 2a + c of each word
        even, odd = tl.split(tl.reshape(codes, [R, codes.shape[1] // PER_WORD, 2, 2]))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        return ((((c3 << 8) + c2 << 8) + c1 << 8) + c0 - WORD_OFFSET_8) ^ WORD_SIGNS_8
    else:
        # [R, W, a, b, c] holds code 4a + 2b + c of each word
        even, odd = tl.split(tl.reshape(codes, [R, codes.shape[1] // PER_WORD, 2, 2, 2]))
        e0, e1 = tl.split(even)
        o0, o1 = tl.split(odd)
        n0, n4 = tl.split(e0)
        n2, n6 = tl.split(e1)
        n1, n5 = tl.split(o0)
        n3, n7 = tl.split(o1)
        high = (((n7 << 4) + n6 << 4) + n5 << 4) + n4
        return (((((high << 4) + n3 << 4) + n2 << 4) + n1 << 4) + n0 - WORD_OFFSET_4) ^ WORD_SIGNS_4


@triton.jit
def _code_at(words, zero, POSITION: tl.constexpr, BITS: tl.constexpr):
    """Float32 value of code ``POSITION`` of int32 ``words`` (an exact small integer); ``zero`` as in
    ``decode_words``.

    The code is moved into the low mantissa bits of a float whose exponent makes one mantissa unit worth 1: with
    its sign bit flipped (``u = code + 2**(BITS - 1)``, unsigned) the float is ``2**E + u``, and subtracting
    ``2**E + 2**(BITS - 1)`` leaves the code. Codes in the low half-word are masked in place (``E`` shrinks by
    ``BITS`` per position so that the unit stays 1), those of the high half after a shift by 16.
    """
    HALF: tl.constexpr = 16 // BITS
    PLACE: tl.constexpr = (POSITION % HALF) * BITS
    SIGN: tl.constexpr = 1 << (BITS - 1)
    MAGIC: tl.constexpr = ((23 - PLACE + 127) << 23) | (SIGN << PLACE)
    BIAS: tl.constexpr = 2.0 ** (23 - PLACE) + SIGN
    if POSITION >= HALF:
        words = words >> 16
    # ``(words & mask) ^ MAGIC`` is one LOP3 instruction only if one of its two constants is in a register
    mask = zero + (((1 << BITS) - 1) << PLACE)
    f = ((words & mask) ^ MAGIC).to(tl.float32, bitcast=True)
    return f - BIAS


@triton.jit
def decode_words(words, zero, BITS: tl.constexpr):
    """Float32 codes [R, W * 32 // BITS] of int32 words [R, W] (exact small integers), put back in element
    order with ``tl.join`` (new dimensions inside the thread), so each thread holds whole words' codes.

    ``zero`` is an int32 scalar that is 0 when the kernel runs but that the compiler cannot fold (see
    ``opaque_zero``): constants added to it stay in registers, which halves the instructions per code.
    """
    R: tl.constexpr = words.shape[0]
    C: tl.constexpr = words.shape[1] * 32 // BITS
    if BITS == 2:
        # the first join picks the top bit of a code's position in its word, the last one the lowest
        a0 = tl.join(_code_at(words, zero, 0, 2), _code_at(words, zero, 8, 2))
        a1 = tl.join(_code_at(words, zero, 1, 2), _code_at(words, zero, 9, 2))
        a2 = tl.join(_code_at(words, zero, 2, 2), _code_at(words, zero, 10, 2))
        a3 = tl.join(_code_at(words, zero, 3, 2), _code_at(words, zero, 11, 2))
        a4 = tl.join(_code_at(words, zero, 4, 2), _code_at(words, zero, 12, 2))
        a5 = tl.join(_code_at(words, zero, 5, 2), _code_at(words, zero, 13, 2))
        a6 = tl.join(_code_at(words, zero, 6, 2), _code_at(words, zero, 14, 2))
        a7 = tl.join(_code_at(words, zero, 7, 2), _code_at(words, zero, 15, 2))
        even = tl.join(tl.join(a0, a4), tl.join(a2, a6))
        odd = tl.join(tl.join(a1, a5), tl.join(a3, a7))
    elif BITS == 8:
        even = tl.join(_code_at(words, zero, 0, 8), _code_at(words, zero, 2, 8))
        odd = tl.join(_code_at(words, zero, 1, 8), _code_at(words, zero, 3, 8))
    else:
        even = tl.join(tl.join(_code_at(words, zero, 0, 4), _code_at(words, zero, 4, 4)),
                       tl.join(_code_at(words, zero, 2, 4), _code_at(words, zero, 6, 4)))
        odd = tl.join(tl.join(_code_at(words, zero, 1, 4), _code_at(words, zero, 5, 4)),
                      tl.join(_code_at(words, zero, 3, 4), _code_at(words, zero, 7, 4)))
    return tl.reshape(tl.join(even, odd), [R, C])


@triton.jit
def opaque_zero(count):
    """0 for a non-negative int32 kernel argument ``count``, computed so that the compiler cannot know it."""
    return count >> 31


@triton.jit
def scaled_fast(code, scale):
    """Float32 ``code * scale`` on the fast path (no clamp needed)."""
    return code * scale


@triton.jit
def scaled_exact(code, scale):
    """Float32 ``code * scale`` clamped to the finite float32 range as in the reference (the product can round
    past it when a block's absmax is within an ulp of it). NaN stays NaN."""
    return tl.clamp(code * scale, -3.4028234663852886e38, 3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def to_output(v, out_ptr, INTERPRET: tl.constexpr):
    """Float32 ``v`` converted, rounding to nearest even, to the element type of ``out_ptr``.

    On the GPU the conversion instruction rounds correctly. Triton's interpreter truncates ``.to(tl.bfloat16)``,
    so there bfloat16 is rounded by hand (NaN stays NaN, overflow becomes Inf).
    """
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        half = tl.where(v != v, (bits >> 16) | 0x40, rounded)
        return half.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(out_ptr.dtype.element_ty)
