"""The block-quantized formats and the byte layout of their packed buffers.

A tensor is flattened and cut into blocks of ``block_size`` consecutive elements; the last block is padded
with zeros. Each block is stored as ``block_size`` signed integer codes and one float32 scale:

    scale = absmax(block) / qmax        (qmax = 127 for int8, 7 for int4, 1 for int2; float32, correctly rounded)
    r     = 1 / scale                   (rounded to float32's 24 significant bits, with no exponent limit)
    code  = clamp(round_half_even(x * r), -qmax, qmax)     (the product exact: ONE rounding, to an integer)
    x'    = code * scale

``x * r`` is within a float32 ulp of ``x / scale``, so the codes are those of a division up to rare ties; taking
the product exactly lets a kernel compute ``code`` with one fused multiply-add. ``|x * r| <= qmax * (1 + 2**-22)``
for every normal scale, so the clamp only acts when the scale is subnormal. An all-zero block has scale 0 and
codes 0. A block holding a NaN has a NaN scale, a block holding an Inf (and no NaN) an Inf scale; the codes of
such a block are 0, so ``has_nonfinite`` needs to read the scales only. Such a block dequantizes to NaN throughout
(0 * Inf), so after a quantized reduction an Inf shows as NaN: overflow checks treat both alike. Dequantized
values are clamped to the finite float32 range (``code * scale`` can round past it when a block's absmax is within
an ulp of it).

Stochastic rounding (an optional integer ``seed`` in ``[0, 2**32)``, so that runs reproduce): the scale is the same;
each element of index ``i`` (what the op defines: its index in the flat input for a quantize) takes the noise

    lo, hi = i mod 2**32, i // 2**32
    h      = fmix32(lo * 0x9E3779B1 + fmix32(fmix32(hi) ^ seed))      (uint32 arithmetic, mod 2**32)
    u      = (h >> 9) * 2**-23                                         (23 bits, in [0, 1))
    p      = x * r rounded to float32 (once, to nearest even)
    code   = sign(p) * min(floor(|p| + u), qmax)                      (0 for a block whose scale is 0, NaN or Inf)

with ``fmix32`` MurmurHash3's finalizer (``h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >>
16``). ``floor(|p| + u)`` is the floor of the exact sum: ``floor(|p|)``, plus 1 where the fraction ``|p| -
floor(|p|)`` (exact in float32) is at least ``1 - u`` (exact too), so every backend computes it with float32
operations and integer hashing alone. It is unbiased: over the noise, ``E[code] = p`` up to ``2**-23`` (the
grid of ``u``), and ``p`` is within ``2**-24`` relative of ``x / scale``; each code is one of the two nearest to
``p`` (so ``|x - x'| < scale``, up to those roundings), the upper one with probability about ``|p| -
floor(|p|)``. Rounding the magnitude
keeps the sign exact (``floor(p + u)`` of a negative ``p`` would need ``p - floor(p)``, which is not exact in
float32). Distinct elements have independent-looking noise; give each rank and each step its own seed, or their
rounding errors repeat.

Sums of packs (the fused reductions of qgZ): the packs' blocks are summed element by element in float32 as
``acc = 0``, then ``acc = fma(code_i, scale_i, acc)`` for each pack ``i`` in order: each ``code * scale`` is added
exactly and the sum rounded once, with no clamp (a sum past the float32 range is Inf, a NaN or Inf scale makes
it NaN). The fused reduce-requantize may write its sums in another format than it reads (``out_fmt``: bits and
block size, e.g. int8 inside a node and int4 or int2 across nodes): element ``e`` of an output pack is the sum
of element ``e`` of the input packs where ``e`` lies inside their blocks (padding included), else 0, quantized
in the output's blocks; its noise index, when rounded stochastically, is ``m * chunk_numel + e`` for pack ``m``.

Codes: int8 codes are one two's-complement byte each. int4 codes are packed two per byte: element ``2k`` of a
block in the low nibble and element ``2k + 1`` in the high nibble, each nibble a 4-bit two's-complement number.
int2 codes (-1, 0, 1: a ternary code in 2 bits) are packed four per byte as int4 does with nibbles: element
``4k + i`` of a block in bits ``[2i, 2i + 2)`` of byte ``k`` (element ``4k`` in the lowest two bits), each a 2-bit
two's-complement number (``0b11`` is -1; ``0b10``, -2, never occurs). In every width, code ``i`` of a block lies in
bits ``[i * bits, (i + 1) * bits)`` of the block's codes read as one little-endian integer.

Packed layout (the wire format): a run of ``numel`` elements is stored as ONE contiguous uint8 buffer

    [ codes: num_blocks * block_size * bits / 8 bytes | scales: num_blocks * 4 bytes (float32, native order) ]

with no header: the layout follows from ``numel``, ``bits`` and ``block_size``. Both parts are multiples of
4 bytes, so packs can be concatenated and each one's scales stay float32-aligned.

Chunked layout: the collectives move several packs in one buffer. A flat tensor of ``numel`` elements is cut
into ``chunks`` slices of ``chunk_numel = ceil(numel / chunks)`` elements (the last one may be short or empty;
its missing elements count as zeros), and each slice is packed on its own, so blocks never straddle two slices
and each slice's pack is contiguous: ``chunks * packed_bytes(chunk_numel)`` bytes in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (8, 4, 2)
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 8192
DEFAULT_BLOCK_SIZE = 128
"""Default block size for int8, int4 and int2; chosen in ``bench/accuracy.py`` (see bench/RESULTS.md)."""

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_BYTES = 4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockFormat:
    """A symmetric block-quantization format: ``bits`` per code, one float32 scale per ``block_size`` elements."""

    bits: int = 8
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits!r} is not supported; use one of {SUPPORTED_BITS}")
        bs = self.block_size
        if (
            isinstance(bs, bool)
            or not isinstance(bs, int)
            or bs < MIN_BLOCK_SIZE
            or bs > MAX_BLOCK_SIZE
            or bs & (bs - 1)
        ):
            raise ValueError(
                f"block_size={bs!r} is not supported; use a power of two between {MIN_BLOCK_SIZE} and "
                f"{MAX_BLOCK_SIZE} (default {DEFAULT_BLOCK_SIZE})"
            )

    @property
    def qmax(self) -> int:
        """Largest code magnitude: 127 for int8, 7 for int4, 1 for int2 (the range is symmetric, -qmax..qmax)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def block_code_bytes(self) -> int:
        """Bytes of codes in one block."""
        return self.block_size * self.bits // 8

    def num_blocks(self, numel: int) -> int:
        """Blocks needed for ``numel`` elements (the last one padded)."""
        return ceil_div(numel, self.block_size)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes part of a pack of ``numel`` elements."""
        return self.num_blocks(numel) * self.block_code_bytes

    def packed_bytes(self, numel: int) -> int:
        """Bytes of one pack (codes then scales) of ``numel`` elements."""
        return self.num_blocks(numel) * (self.block_code_bytes + SCALE_BYTES)

    def chunked_bytes(self, numel: int, chunks: int) -> int:
        """Bytes of the chunked layout of ``numel`` elements cut into ``chunks`` packs."""
        return chunks * self.packed_bytes(ceil_div(numel, chunks))

    def compression_ratio(self, numel: int, dtype: torch.dtype = torch.bfloat16) -> float:
        """Bytes of ``numel`` elements of ``dtype`` divided by the bytes of their pack (scales included)."""
        packed = self.packed_bytes(numel)
        return numel * dtype.itemsize / packed if packed else 1.0


def exact_reciprocal(divisor: float) -> float | None:
    """``1 / divisor`` when multiplying by it is the same as dividing by ``divisor`` (a float32 value): for a power
    of two whose reciprocal is a normal float32, the quotient is the same real number, rounded once. ``None``
    otherwise. How the backends' fused final reduce divides by the world size."""
    mantissa, exponent = math.frexp(divisor)
    return 2.0 ** (1 - exponent) if mantissa == 0.5 and -126 <= 1 - exponent <= 127 else None


def chunk_numel(numel: int, chunks: int) -> int:
    """Elements per slice when ``numel`` elements are cut into ``chunks`` slices (the last may be short)."""
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be at least 1")
    return ceil_div(numel, chunks)


def swizzle_source(position: int, nodes: int, ranks_per_node: int) -> int:
    """The slice (final owner) whose pack sits at ``position`` of the qgZ send buffer.

    The send buffer holds ``nodes * ranks_per_node`` packs grouped by destination local rank ``j``: position
    ``j * nodes + m`` holds the slice owned by rank ``m * ranks_per_node + j`` (node ``m``, local index ``j``),
    so the intra-node all-to-all sends local peer ``j`` one contiguous run of ``nodes`` packs.
    """
    j, m = divmod(position, nodes)
    return m * ranks_per_node + j


def check_has_data(t: torch.Tensor, name: str) -> None:
    """Reject a tensor with no data to read or write (on the ``meta`` device): quantization needs the values."""
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device, which holds shapes but no values, so it cannot be quantized or "
            "dequantized; materialize it first (e.g. torch.empty_like(t, device='cpu') and fill it, or "
            "module.to_empty(device=...))"
        )


def check_float_tensor(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    check_has_data(x, name)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {x.dtype}; block quantization takes floating point tensors "
            f"({', '.join(str(d) for d in FLOAT_DTYPES)}). Convert it with .float() first."
        )


def check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype={dtype} is not a supported output dtype; use one of {FLOAT_DTYPES}")
