"""The wider qgZ formats of ``format.py``: int2 codes, a reduce-requantize into another format (one per hop) and
stochastic rounding from a seed.

The torch reference is checked against re-derivations of the rules in float64, exact rationals and Python integers;
every kernel implementation (``test_kernels.kernels``: Triton, the native CPU builds, the native CUDA kernels where
they have the path) against the reference bit for bit on fresh random inputs. Cases stay few and small: the Triton
interpreter costs about a CPU-second per few thousand elements.
"""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from test_kernels import (  # noqa: F401 (fixtures)
    DTYPES,
    Kernels,
    assert_same_floats,
    assert_same_packs,
    check_quantize,
    gen,
    kernels,
    native_kernels,
    random_packs,
    random_values,
    special_blocks,
)

import zeropp.quant as zq
from zeropp.quant import BlockFormat, native_cuda, reference
from zeropp.quant._triton.common import noise_thresholds

WORD = 2**32 - 1


def py_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & WORD
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & WORD
    return h ^ (h >> 16)


def py_noise(seed: int, index: int) -> Fraction:
    """``u`` of element ``index`` for ``seed``, in Python integers (``format.py``)."""
    key = py_fmix32(py_fmix32(index >> 32) ^ seed)
    h = py_fmix32(((index & WORD) * 0x9E3779B1 + key) & WORD)
    return Fraction(h >> 9, 2**23)


def reciprocal24(scale: np.ndarray) -> np.ndarray:
    """Float64 ``1 / scale`` rounded to 24 significant bits, no exponent limit (float32 ``scale``, positive)."""
    m, e = np.frexp(1.0 / scale.astype(np.float64))
    return np.ldexp(np.rint(np.ldexp(m, 24)), e - 24)


def unpack(raw: np.ndarray, bits: int) -> np.ndarray:
    """Signed codes, one per element, of code bytes: code ``i`` in bits ``[i * bits, (i + 1) * bits)`` of the bytes
    read as one little-endian integer."""
    per_byte = 8 // bits
    fields = (raw.astype(np.int64)[:, None] >> (bits * np.arange(per_byte))) & ((1 << bits) - 1)
    return np.where(fields >= 1 << (bits - 1), fields - (1 << bits), fields).ravel()


def pack_parts(buf: torch.Tensor, fmt: BlockFormat, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes and float32 scales of one pack."""
    raw = buf.cpu().numpy()
    split = fmt.code_bytes(numel)
    return unpack(raw[:split], fmt.bits), raw[split:].view(np.float32)


def expected_codes(x: np.ndarray, fmt: BlockFormat, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of float32 ``x`` (whole blocks) by the spec: round half to even in float64, or the
    stochastic rule with exact rationals."""
    blocks = x.reshape(-1, fmt.block_size)
    with np.errstate(invalid="ignore", over="ignore"):
        scales = (np.abs(blocks).max(axis=1) / np.float32(fmt.qmax)).astype(np.float32)
    usable = np.isfinite(scales) & (scales > 0)
    r = reciprocal24(np.where(usable, scales, np.float32(1)))
    product = blocks.astype(np.float64) * r[:, None]  # exact: 24 x 24 significant bits
    if seed is None:
        codes = np.clip(np.rint(product), -fmt.qmax, fmt.qmax)
    else:
        p = np.where(usable[:, None], product, 0.0).astype(np.float32).ravel()  # rounded once
        magnitude = [min(math.floor(Fraction(abs(float(v))) + py_noise(seed, i)), fmt.qmax) for i, v in enumerate(p)]
        codes = (np.sign(p) * np.array(magnitude)).reshape(blocks.shape)
    codes[~usable] = 0
    return codes.astype(np.int64).ravel(), scales


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("bits,seed", [(2, None), (2, 7), (4, 2**32 - 1), (8, 123456789)])
def test_reference_against_the_rule(bits, seed):
    """The reference's codes and scales against the spec recomputed in float64 (round to nearest even) or exact
    rationals with the noise hashed in Python integers (stochastic): random blocks over many decades, and the
    special blocks (huge, subnormal, tie, NaN and Inf ones) -- for int2 the scale is the absmax itself, whose
    reciprocal lies below float32's normal range when the absmax does not."""
    fmt = BlockFormat(bits, 16)
    x = torch.cat([random_values(48, torch.float32, torch.Generator().manual_seed(bits)),
                   special_blocks(16, fmt.qmax)]).numpy()
    buf = torch.empty(fmt.packed_bytes(x.size), dtype=torch.uint8)
    reference.quantize_chunks(torch.from_numpy(x), fmt, 1, 1, buf, seed)
    codes, scales = pack_parts(buf, fmt, x.size)
    want_codes, want_scales = expected_codes(x, fmt, seed)
    assert np.array_equal(scales, want_scales, equal_nan=True)
    assert np.array_equal(codes, want_codes)
    if bits == 2:
        assert set(np.unique(codes)) <= {-1, 0, 1}


def test_noise_hash_every_implementation():
    """``1 - u`` in torch int64 (the reference) and in Triton's uint32 (a tiny kernel under the interpreter, or on
    the GPU: one key per run of indices, the next where the low word wraps) against Python integers, for runs of
    16 indices from 0, across 2**31, across 2**32 and past 2**40, and seeds up to 2**32 - 1."""
    for seed in (0, 1, 0x7FFFFFFF, 0x80000000, 2**32 - 1):
        for first in (0, 2**31 - 3, 2**32 - 5, 3 * 2**40 + 17):
            want = [float(1 - py_noise(seed, first + i)) for i in range(16)]
            assert reference.noise_thresholds(seed, first, 2, 8, torch.device("cpu")).view(-1).tolist() == want
            assert triton_thresholds(seed, first, 16).tolist() == want


def test_native_noise_thresholds(native_kernels):
    """The native library's ``1 - u`` (its AVX2 loop with scalar tails, or the portable one) against Python integers,
    for runs of 40 indices from 0, across 2**32 and 2**33 (the key changes inside the run) and past 2**40, seeds up
    to 2**32 - 1: no op of a testable size reaches indices past 2**32."""
    for seed in (0, 0x80000000, 2**32 - 1):
        for first in (0, 2**32 - 5, 2**33 - 37, 3 * 2**40 + 17):
            want = [float(1 - py_noise(seed, first + i)) for i in range(40)]
            assert native_kernels.ops.noise_thresholds(seed, first, 40).tolist() == want


@triton.jit(do_not_specialize=["seed"])
def _thresholds_kernel(out_ptr, first_ptr, seed, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, noise_thresholds(seed, tl.load(first_ptr), offsets))


def triton_thresholds(seed: int, first: int, n: int) -> torch.Tensor:
    """The kernels' first index is an int64 tensor value (a kernel argument of 2**31 or more would be a uint32)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(n, dtype=torch.float32, device=device)
    _thresholds_kernel[(1,)](out, torch.tensor([first], device=device), seed, N=n)
    return out.cpu()


@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_rounding_is_unbiased(bits, monkeypatch):
    """The mean of many draws of the dequantized values approaches ``x``, and round to nearest does not: the same
    blocks repeated 4096 times in one tensor (each copy's elements have their own noise indices), and 64 seeds.
    The draws are independent with variance at most ``scale**2 / 4``, so the mean of n lies within
    ``6 * scale / (2 * sqrt(n))`` but for a chance below 1e-8 per element; products round within ``2**-22`` of a
    code, added. The torch reference (the kernels match it bit for bit below)."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(64, generator=gen)
    copies = 4096
    draws = zq.dequantize(zq.quantize(x.repeat(copies), bits, 16, seed=99)).view(copies, -1).double()
    scale = zq.quantize(x, bits, 16).scales.double().repeat_interleave(16)
    slack = scale * 2.0**-20
    assert torch.all((draws.mean(0) - x.double()).abs() <= 3 * scale / math.sqrt(copies) + slack)
    nearest = zq.dequantize(zq.quantize(x, bits, 16)).double()
    assert (nearest - x.double()).abs().max() > (3 * scale / math.sqrt(copies)).max()
    seeds = torch.stack([zq.dequantize(zq.quantize(x, bits, 16, seed=s)).double() for s in range(64)])
    assert torch.all((seeds.mean(0) - x.double()).abs() <= 3 * scale / 8 + slack)
    assert len({tuple(row.tolist()) for row in seeds}) == 64  # every seed its own rounding


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_int2_error_bound_and_per_hop_bound(bits, monkeypatch):
    """Round to nearest: ``|x - x'| <= scale / 2`` (plus the product's rounding) for every width, int2's scale
    being the block's absmax; a reduce of int8 packs into ``bits`` keeps the sum within the same bound of its
    float64 value plus int8's own error per pack. The torch reference."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")
    gen = torch.Generator().manual_seed(bits)
    x = random_values(4 * 256, torch.float32, gen)
    q = zq.quantize(x, bits, 64)
    scale = q.scales.double().repeat_interleave(64)
    err = (zq.dequantize(q).double() - x.double()).abs()
    assert torch.all(err <= scale / 2 * (1 + 2.0**-20))
    f8, out_fmt = BlockFormat(8, 64), BlockFormat(bits, 64)
    buf = zq.quantize_chunks(x, f8, 4)
    out = zq.reduce_requantize(buf, f8, 2, 2, 256, out_fmt=out_fmt)
    total = torch.empty(512)
    zq.dequantize_chunks(out, out_fmt, 2, 256, total)
    in_scales = buf.view(4, -1)[:, f8.code_bytes(256):].contiguous().view(torch.float32).double()
    in_err = (in_scales / 2).repeat_interleave(64, 1).view(2, 2, 256).sum(0).reshape(-1)
    out_scales = out.view(2, -1)[:, out_fmt.code_bytes(256):].contiguous().view(torch.float32).double()
    exact = x.double().view(2, 2, 256).sum(0).reshape(-1)
    bound = out_scales.repeat_interleave(64, 1).reshape(-1) / 2 * (1 + 2.0**-20) + in_err * 1.01
    assert torch.all((total.double() - exact).abs() <= bound)


def check_requantize(kernels: Kernels, buf, fmt, groups, chunks, chunk_numel, out_fmt, seed):
    out_fmt = out_fmt or fmt
    expected = torch.empty(chunks * out_fmt.packed_bytes(chunk_numel), dtype=torch.uint8)
    reference.reduce_requantize(buf, fmt, groups, chunks, chunk_numel, expected, out_fmt, seed)
    actual = torch.full_like(expected, 0xAB, device=kernels.device)
    kernels.ops.reduce_requantize(buf.to(kernels.device), fmt, groups, chunks, chunk_numel, actual, out_fmt, seed)
    assert_same_packs(actual, expected, out_fmt, chunks, chunks * chunk_numel)
    return expected


def skip_native_cuda(kernels: Kernels) -> None:
    if kernels.ops.__class__ is native_cuda.Module:
        pytest.skip("the native CUDA kernels have no int2, per-hop or stochastic paths (they refuse them)")


@pytest.mark.parametrize("block_size,seed", [(16, None), (128, 2024)])
def test_int2_kernels(block_size, seed, kernels, gen):
    """Int2 through every op, rounded to nearest and stochastically: swizzled quantize with short and empty
    slices, dequantize into bfloat16, the fused reduce-requantize and the final reduce."""
    skip_native_cuda(kernels)
    fmt = BlockFormat(2, block_size)
    x = random_values(301, torch.bfloat16, gen)
    nbytes = fmt.chunked_bytes(x.numel(), 4)
    expected = torch.empty(nbytes, dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, 4, 2, expected, seed)
    actual = torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=kernels.device)
    kernels.ops.quantize_chunks(x.to(kernels.device), fmt, 4, 2, actual, seed)
    assert_same_packs(actual, expected, fmt, 4, x.numel())
    chunk = zq.chunk_numel(x.numel(), 4)
    ref = torch.empty(x.numel(), dtype=torch.bfloat16)
    reference.dequantize_chunks(expected, fmt, 4, chunk, ref)
    out = torch.full((x.numel(),), float("nan"), dtype=torch.bfloat16, device=kernels.device)
    kernels.ops.dequantize_chunks(expected.to(kernels.device), fmt, 4, chunk, out)
    assert_same_floats(out, ref)
    summed = check_requantize(kernels, expected, fmt, 2, 2, chunk, None, seed)
    ref32 = torch.empty(chunk - 3, dtype=torch.float32)
    reference.reduce_dequantize(summed, fmt, 2, chunk, ref32, 4.0)
    out = torch.full((chunk - 3,), float("nan"), dtype=torch.float16, device=kernels.device)
    kernels.ops.reduce_dequantize(summed.to(kernels.device), fmt, 2, chunk, out, 4.0)
    assert_same_floats(out, ref32.to(torch.float16))


# (input format, output format, seed): int8 inside the node then int4 or int2 across, block sizes either way
PER_HOP = [((8, 128), (4, 128), None), ((8, 64), (2, 16), 31337), ((4, 32), (8, 256), None), ((2, 16), (4, 2048), 7)]


@pytest.mark.parametrize("formats", PER_HOP, ids=lambda f: f"{f[0][0]}b{f[0][1]}-{f[1][0]}b{f[1][1]}-{f[2]}")
def test_per_hop_reduce_requantize(formats, kernels, gen):
    """The fused reduce into another format: three groups of two packs of a ragged 2500 elements (the output's
    last block runs past the input's, or stops short of it)."""
    skip_native_cuda(kernels)
    fmt, out_fmt, seed = BlockFormat(*formats[0]), BlockFormat(*formats[1]), formats[2]
    buf = random_packs(fmt, 3 * 2, 2500, gen)
    check_requantize(kernels, buf, fmt, 3, 2, 2500, out_fmt, seed)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_stochastic_quantize_kernels(bits, kernels, gen):
    """Seeded quantize from float16 into 3 packs, and the special blocks (huge, subnormal, NaN, Inf, ties) from
    float32 and through the seeded reduce-requantize (where the huge block's sum overflows)."""
    skip_native_cuda(kernels)
    fmt = BlockFormat(bits, 32)
    x = random_values(400, torch.float16, gen)
    nbytes = fmt.chunked_bytes(400, 3)
    expected = torch.empty(nbytes, dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, 3, 1, expected, 2**32 - 1)
    actual = torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=kernels.device)
    kernels.ops.quantize_chunks(x.to(kernels.device), fmt, 3, 1, actual, 2**32 - 1)
    assert_same_packs(actual, expected, fmt, 3, 400)
    special = special_blocks(32, fmt.qmax)
    packed = torch.empty(fmt.packed_bytes(special.numel()), dtype=torch.uint8)
    reference.quantize_chunks(special, fmt, 1, 1, packed, 5)
    actual = torch.full_like(packed, 0xAB, device=kernels.device)
    kernels.ops.quantize_chunks(special.to(kernels.device), fmt, 1, 1, actual, 5)
    assert_same_packs(actual, packed, fmt, 1, special.numel())
    check_requantize(kernels, torch.cat([packed, packed]), fmt, 2, 1, special.numel(), None, 6)


def test_native_stochastic_quantize_dtypes(native_kernels, gen):
    """The native seeded quantize (vectorized for int8 and int4) from bfloat16 and float32 into 3 packs, blocks of 16
    and of 2048 (a whole and a ragged block a pack), every width: test_stochastic_quantize_kernels covers float16
    and blocks of 32 on every implementation."""
    sizes = ((16, 100), (2048, 9000))
    for bits, dtype, (block_size, numel) in itertools.product((8, 4, 2), (torch.bfloat16, torch.float32), sizes):
        fmt = BlockFormat(bits, block_size)
        x = random_values(numel, dtype, gen)
        nbytes = fmt.chunked_bytes(numel, 3)
        expected = torch.empty(nbytes, dtype=torch.uint8)
        reference.quantize_chunks(x, fmt, 3, 1, expected, 2**32 - 2)
        actual = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
        native_kernels.ops.quantize_chunks(x, fmt, 3, 1, actual, 2**32 - 2)
        assert_same_packs(actual, expected, fmt, 3, numel)


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_native_int2_same_format_reductions(block_size, native_kernels, gen):
    """The native same-format int2 reductions (the vector kernels sum int2 in element order, a 16-element unit at a
    time below 64 elements a block, four units from 64 on) on fresh random packs whose codes are random bytes (every
    2-bit pattern at every position, -2 included, which the spec decodes though quantize never writes it) under the
    reference's scales, 10 blocks a pack, the last ragged: the reduce-requantize of 2, 3, 4 and 8 groups (the group
    counts the kernels specialize, and another) and the reduce-dequantize of 3 groups into every dtype, divided by a
    power of two (a multiplication) and by 3 (a division), into an output one element short of the pack."""
    fmt = BlockFormat(2, block_size)
    chunk_numel = 9 * block_size + 3
    code_bytes = fmt.code_bytes(chunk_numel)

    def packs(count: int) -> torch.Tensor:
        buf = random_packs(fmt, count, chunk_numel, gen)
        buf.view(count, -1)[:, :code_bytes] = torch.randint(0, 256, (count, code_bytes), generator=gen,
                                                            dtype=torch.uint8)
        return buf

    for groups, chunks in ((2, 3), (3, 1), (4, 2), (8, 1)):
        check_requantize(native_kernels, packs(groups * chunks), fmt, groups, chunks, chunk_numel, None, None)
    buf = packs(3)
    for dtype, divisor in itertools.product(DTYPES, (4.0, 3.0)):
        expected32 = torch.empty(chunk_numel - 1, dtype=torch.float32)
        reference.reduce_dequantize(buf, fmt, 3, chunk_numel, expected32, divisor)
        out = torch.full((chunk_numel - 1,), float("nan"), dtype=dtype)
        native_kernels.ops.reduce_dequantize(buf, fmt, 3, chunk_numel, out, divisor)
        assert_same_floats(out, expected32.to(dtype))


def test_public_ops_checks(monkeypatch):
    """The public ops validate the new arguments (on the torch reference), and the native CUDA kernels refuse what
    they lack, naming the Triton backend."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")
    x = torch.randn(100)
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(ValueError, match="seed="):
            zq.quantize_chunks(x, BlockFormat(4), seed=bad)
    fmt = BlockFormat(8, 16)
    buf = zq.quantize_chunks(x, fmt, 2)
    with pytest.raises(TypeError, match="out_fmt"):
        zq.reduce_requantize(buf, fmt, 2, 1, 50, out_fmt=4)
    out4 = BlockFormat(4, 32)
    with pytest.raises(ValueError, match="bytes"):
        zq.reduce_requantize(buf, fmt, 2, 1, 50, out=torch.empty(fmt.packed_bytes(50), dtype=torch.uint8),
                             out_fmt=out4)
    assert zq.reduce_requantize(buf, fmt, 2, 1, 50, out_fmt=out4).numel() == out4.packed_bytes(50)
    assert zq.swizzle_quantize(x, BlockFormat(2, 16), 2, 2, seed=3).numel() == BlockFormat(2, 16).chunked_bytes(100, 4)
    for args in ((BlockFormat(2),), (fmt, out4), (fmt, None, 1)):
        with pytest.raises(native_cuda.NativeCudaError, match="Triton"):
            native_cuda.check_supported(*args)
    native_cuda.check_supported(fmt, fmt)

