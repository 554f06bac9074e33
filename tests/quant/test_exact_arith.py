"""The exact arithmetic of the spec and of the Triton kernels, proved case by case.

The kernels replace the reference's IEEE division, rounding and conversions with cheaper sequences that must give
the same bits: ``div_fast`` (one multiply and two FMAs from a correctly rounded reciprocal), ``scale_fast``
(``absmax / qmax`` the same way), the quantizing FMA (``quantize_fast``, and ``quantize_exact`` for every scale),
``encode_words`` and ``decode_words``. Each helper runs here inside a small Triton kernel (on the GPU, or under
Triton's interpreter, whose ``tl.fma`` rounds once like the hardware's) on millions of values, and is compared with
an independent computation on the CPU (IEEE float32 torch, float64 where it is exact, exact rationals): random
operands over the whole range, exact rounding ties and their neighbours one ulp away, the ends of the range,
divisors whose mantissa is all ones or a power of two, and every code of every position of a word. The reference's
own emulations of single roundings (``reference.fma_``, ``reference.reciprocal``) are checked the same way.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl

from conftest import exact_triton
from rationals import round_to_float32, round_to_float32_precision
from zeropp.quant import reference
from zeropp.quant._triton import common
from zeropp.quant.format import BlockFormat

TILE = 1 << 16  # elements per program: the interpreter's cost is per operation, so large tiles are cheap
FAST_MIN = common.FAST_MIN.value
FAST_MAX = common.FAST_MAX.value


@triton.jit
def _div_kernel(x_ptr, d_ptr, y_ptr, out_ptr, TILE: tl.constexpr):
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    tl.store(out_ptr + i, common.div_fast(tl.load(x_ptr + i), tl.load(d_ptr + i), tl.load(y_ptr + i)))


@triton.jit
def _scale_kernel(a_ptr, out_ptr, QMAX: tl.constexpr, TILE: tl.constexpr):
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    tl.store(out_ptr + i, common.scale_fast(tl.load(a_ptr + i), QMAX))


@triton.jit
def _quantize_kernel(v_ptr, s_ptr, out_ptr, BITS: tl.constexpr, EXACT: tl.constexpr, ROWS: tl.constexpr,
                     COLS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = r[:, None] * COLS + tl.arange(0, COLS)[None, :]
    if EXACT:
        tl.store(out_ptr + i, common.quantize_exact(tl.load(v_ptr + i), tl.load(s_ptr + r), BITS))
    else:
        tl.store(out_ptr + i, common.quantize_fast(tl.load(v_ptr + i), tl.load(s_ptr + r), BITS))


@triton.jit
def _fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr, TILE: tl.constexpr):
    i = tl.program_id(0) * TILE + tl.arange(0, TILE)
    tl.store(out_ptr + i, tl.fma(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i)))


@triton.jit
def _encode_kernel(bits_ptr, out_ptr, BITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    words = common.encode_words(tl.load(bits_ptr + r[:, None] * COLS + tl.arange(0, COLS)[None, :]), BITS)
    W: tl.constexpr = COLS * BITS // 32
    tl.store(out_ptr + r[:, None] * W + tl.arange(0, W)[None, :], words)


@triton.jit
def _decode_kernel(words_ptr, out_ptr, zero, BITS: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    codes = common.decode_words(tl.load(words_ptr + r[:, None] * W + tl.arange(0, W)[None, :]), zero, BITS)
    C: tl.constexpr = W * 32 // BITS
    tl.store(out_ptr + r[:, None] * C + tl.arange(0, C)[None, :], codes)


@pytest.fixture
def fma_device(kernel_device: str) -> str:
    """Where the kernels whose arithmetic rests on ``tl.fma`` rounding once run (``conftest.exact_triton``)."""
    return exact_triton(kernel_device)


def _on(device: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.contiguous().to(device) for t in tensors]


def _floats(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _random_in(lo: float, hi: float, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` float32 values log-uniform in ``[lo, hi]`` with random mantissas and random signs."""
    exponent = torch.rand(n, generator=gen, dtype=torch.float64) * (torch.tensor(hi).log2() - torch.tensor(lo).log2())
    values = (torch.tensor(lo).log2() + exponent).exp2().float()
    sign = torch.randint(0, 2, (n,), generator=gen) * 2 - 1
    return values * sign


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(d) / d  # IEEE float32 division on the CPU: correctly rounded


def run_div(x: torch.Tensor, d: torch.Tensor, device: str) -> torch.Tensor:
    n = x.numel()
    assert n % TILE == 0
    xs, ds, ys = _on(device, x, d, _reciprocal(d))
    out = torch.empty_like(xs)
    _div_kernel[(n // TILE,)](xs, ds, ys, out, TILE=TILE)
    return out.cpu()


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, e = actual.view(torch.int32), expected.view(torch.int32)
    bad = (a != e).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {a.numel()} differ, first at {bad[:5].tolist()}"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(20261124)


def test_div_fast_random_quotients(fma_device, gen):
    """Random divisors over the whole fast range and dividends giving quotients up to 2**10 in magnitude (codes
    live below 128): 4M cases, every quotient bit-identical to IEEE division."""
    n = 1 << 22
    d = _random_in(FAST_MIN, FAST_MAX, n, gen).abs()
    q = _random_in(2.0**-30, 2.0**10, n, gen)
    x = (q.double() * d.double()).float()
    assert_bits_equal(run_div(x, d, fma_device), x / d, "x / d")


def test_div_fast_ties_and_neighbours(fma_device, gen):
    """Dividends that make ``x / d`` an exact half-integer (where rounding the quotient twice could go wrong) and
    their float32 neighbours one ulp below and above, for divisors with random, all-ones and power-of-two
    mantissas at both ends of the fast range."""
    n = 1 << 18
    k = torch.randint(-128, 128, (n,), generator=gen).float() + 0.5
    mantissa = torch.randint(0, 1 << 23, (n,), generator=gen)
    mantissa[: n // 8] = (1 << 23) - 1  # all ones
    mantissa[n // 8 : n // 4] = 0  # powers of two
    # exponents from the ends and the middle of the fast range, so that the divisor is a small integer times a
    # power of two and k * d stays exact for some of them
    exponent = torch.randint(-80, 100, (n,), generator=gen)
    exponent[: n // 16] = -80
    exponent[n // 16 : n // 8] = 99
    d = torch.ldexp(1.0 + mantissa.double() / 2**23, exponent.double()).float()
    d[n // 4 : n // 2] = torch.randint(1, 1 << 12, (n // 4,), generator=gen).float()  # exact ties need small d
    x = (k.double() * d.double()).float()
    below, above = torch.nextafter(x, torch.full_like(x, -float("inf"))), torch.nextafter(x, torch.full_like(x, float("inf")))
    for name, xs in (("tie", x), ("below", below), ("above", above)):
        assert_bits_equal(run_div(xs, d, fma_device), xs / d, f"{name}: x / d")
    exact = (x.double() / d.double()) == k.double()
    assert exact.float().mean() > 0.25, "too few exact ties: the case generator is stale"


@pytest.mark.parametrize("qmax", [127, 7])
def test_scale_fast(qmax, fma_device, gen):
    """``absmax / qmax`` over the fast range, its ends, and 0."""
    n = 1 << 20
    a = _random_in(FAST_MIN, FAST_MAX, n, gen).abs()
    a[:4] = torch.tensor([0.0, FAST_MIN, FAST_MAX, 1.0])
    a[4 : 4 + 256] = torch.arange(256) * qmax * 2.0**-10  # exact multiples: quotients exactly representable
    (a_dev,) = _on(fma_device, a)
    out = torch.empty_like(a_dev)
    _scale_kernel[(n // TILE,)](a_dev, out, QMAX=qmax, TILE=TILE)
    assert_bits_equal(out.cpu(), a / torch.tensor(float(qmax)), f"absmax / {qmax}")


def _spec_codes(v: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """``rne(v * r)`` for normal scales, ``r = 1 / scale`` in IEEE float32 division, the product exact in float64
    (24 + 24 bits); a zero scale gives code 0."""
    r = torch.where(scale > 0, torch.ones_like(scale) / torch.where(scale > 0, scale, 1.0), 1.0)
    return (v.double() * r.double()[:, None]).round().clamp(-qmax, qmax).to(torch.int32)


def _run_quantize(v: torch.Tensor, scale: torch.Tensor, bits: int, exact: bool, device: str) -> torch.Tensor:
    rows, cols = v.shape
    v_dev, s_dev = _on(device, v, scale)
    out = torch.empty(rows, cols, dtype=torch.int32, device=device)
    _quantize_kernel[(rows // 64,)](v_dev, s_dev, out, BITS=bits, EXACT=exact, ROWS=64, COLS=cols)
    return out.cpu() - (common.CODE_BITS.value + (1 << (bits - 1)))


def _near_ties(scale: torch.Tensor, cols: int, qmax: int, gen: torch.Generator) -> torch.Tensor:
    """Per row of ``scale``: values whose exact ``v * r`` is near ``k + 0.5`` (the float32 nearest to ``(k + 0.5) /
    r`` and its neighbours one ulp away: one rounding of the product to float32 before rounding to an integer would
    turn some into exact ties) and random quotients, in random order."""
    rows = scale.numel()
    r = torch.ones_like(scale) / scale
    k = torch.randint(-qmax, qmax, (rows, cols), generator=gen).double() + 0.5
    v = (k / r.double()[:, None]).float()
    step = torch.randint(-1, 2, (rows, cols), generator=gen)
    v = torch.where(step < 0, torch.nextafter(v, v - 1), torch.where(step > 0, torch.nextafter(v, v + 1), v))
    random = ((torch.rand(rows, cols, generator=gen) * 2 - 1) * qmax * scale[:, None]).float()
    return torch.where(torch.rand(rows, cols, generator=gen) < 0.5, v, random).clamp(-qmax * scale[:, None],
                                                                                     qmax * scale[:, None])


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_rounds_the_exact_product_once(bits, exact, fma_device, gen):
    """``quantize_fast`` and ``quantize_exact`` give ``rne(v * r)`` of the exact product over the fast range, for
    exact ties ``k + 0.5`` (power-of-two scales: half to even), values within an ulp of a tie, random quotients and
    zero-scale rows; the count of rows where rounding the product to float32 first would differ is checked too."""
    qmax = (1 << (bits - 1)) - 1
    rows, cols = 1 << 10, 256
    scale = _random_in(FAST_MIN, FAST_MAX / 2, rows, gen).abs()
    scale[8:64] = torch.exp2(torch.randint(-70, 90, (56,), generator=gen).float())  # exact ties k + 0.5
    v = _near_ties(scale, cols, qmax, gen)
    scale[:8] = 0.0
    v[:8] = 0.0
    expected = _spec_codes(v, scale, qmax)
    assert torch.equal(_run_quantize(v, scale, bits, exact, fma_device), expected)
    r = torch.ones_like(scale[8:]) / scale[8:]
    twice = (v[8:] * r[:, None]).round().to(torch.int32)  # the product rounded to float32, then to an integer
    assert (twice != expected[8:]).sum() > 10, "no case where one rounding matters: the generator is stale"


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_exact_every_scale(bits, fma_device, gen):
    """``quantize_exact`` for scales from the smallest subnormal to the largest, 0, Inf and NaN, against exact
    rationals: ``r`` is ``1 / scale`` rounded to 24 bits without exponent limit, codes ``clamp(rne(v * r))``, 0
    in rows whose scale is 0 or not finite. The reference's ``reciprocal`` is checked on the same scales. (Int2's
    scale is the absmax itself: up to the largest float, whose reciprocal is below the normal range.)"""
    qmax = (1 << (bits - 1)) - 1
    rows, cols = 256, 32
    absmax = _random_in(2.0**-149, 3.0e38, rows, gen).abs()
    absmax[:16] = torch.tensor([2.0**-149, 2.0**-148, 3 * 2.0**-149, 2.0**-140, 2.0**-127, 2.0**-126, 2.0**-81,
                                2.0**-80, 2.0**100, 2.0**101, 3.0e38, torch.finfo(torch.float32).max, 0.0,
                                float("inf"), float("nan"), 1.0])
    scale = absmax / torch.tensor(float(qmax))
    v = (torch.rand(rows, cols, generator=gen) * 2 - 1) * absmax[:, None]
    v[:, 0] = absmax  # every row holds its absmax, as quantize_rows's input does
    v[:, 1] = -absmax
    v = v.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    actual = _run_quantize(v, scale, bits, True, fma_device)
    usable = torch.isfinite(scale) & (scale > 0)
    assert (usable & (scale < 2.0**-126)).sum() >= 10 and (~usable).sum() >= 3  # subnormal, zero, Inf, NaN scales
    recips = [round_to_float32_precision(1 / Fraction(float(s))) if ok else Fraction(1)
              for s, ok in zip(scale.tolist(), usable.tolist())]
    expected = torch.tensor([[max(-qmax, min(qmax, round(Fraction(x) * rec))) if ok else 0 for x in row]
                             for row, rec, ok in zip(v.tolist(), recips, usable.tolist())], dtype=torch.int32)
    assert torch.equal(actual, expected)
    assert reference.reciprocal(torch.where(usable, scale, 1.0)).tolist() == [float(x) for x in recips]


def _reference_fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``reference.fma_`` on rows of 16, a scratch piece at a time."""
    out = c.clone()
    scratch = reference._Scratch(BlockFormat(8, 16), a.shape[0], torch.device("cpu"))
    for first, end in scratch.pieces(a.shape[0]):
        reference.fma_(out[first:end], a[first:end], b[first:end], scratch)
    return out


def _fma_cases(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n // 16`` rows of 16: codes (integers up to 127), one scale per row, addends. A third are random over a
    wide range; a third make ``code * scale`` land within a float32 ulp of the addend's rounding midpoint (where
    rounding the sum to float64 and then to float32 goes wrong); a third make the sum cancel or become subnormal."""
    rows = n // 16
    codes = torch.randint(-127, 128, (rows, 16), generator=gen).float()
    scale = _random_in(2.0**-100, 2.0**100, rows, gen).abs()
    acc = _random_in(2.0**-100, 2.0**100, rows * 16, gen).view(rows, 16)
    third = rows // 3
    # near midpoints: acc in [1, 2) and code * scale about half an ulp of it, plus a tiny odd remainder
    acc[:third] = 1.0 + torch.randint(0, 1 << 23, (third, 16), generator=gen).float() * 2.0**-23
    scale[:third] = (2.0**-24 + torch.randint(1, 1 << 10, (third,), generator=gen).double() * 2.0**-60).float()
    codes[:third] = torch.randint(0, 2, (third, 16), generator=gen).float() * 2 - 1
    # cancellation and subnormal sums
    acc[third : 2 * third] = -(codes[third : 2 * third] * scale[third : 2 * third, None])
    acc[third : 2 * third] += _random_in(2.0**-149, 2.0**-120, third * 16, gen).view(third, 16)
    scale[third : third + third // 2] = _random_in(2.0**-149, 2.0**-126, third // 2, gen).abs()
    return codes, scale, acc


def test_reference_fma_matches_the_hardware_fma(fma_device, gen):
    """``reference.fma_`` (float64 rounded to odd) against ``tl.fma`` (the GPU's FFMA, or the interpreter's C
    ``fmaf``) on a million cases, and against exact rationals on a few thousand: bit for bit."""
    n = 1 << 20
    codes, scale, acc = _fma_cases(n, gen)
    expected = _reference_fma(codes, scale, acc)
    a, b, c = _on(fma_device, codes, scale[:, None].expand(-1, 16), acc)
    out = torch.empty_like(c)
    _fma_kernel[(n // TILE,)](a, b, c, out, TILE=TILE)
    assert_bits_equal(out.cpu(), expected, "fma(code, scale, acc)")
    plain = (codes.double() * scale.double()[:, None] + acc.double()).float()  # one rounding too many
    assert (plain.view(torch.int32) != expected.view(torch.int32)).sum() > 100, "no double-rounding case: stale"

    picks = torch.randint(0, codes.shape[0], (300,), generator=gen)
    for row in picks.tolist():
        for j in range(16):
            exact = Fraction(codes[row, j].item()) * Fraction(scale[row].item()) + Fraction(acc[row, j].item())
            assert expected[row, j].item() == round_to_float32(exact), (row, j)


def test_reference_fma_special_values():
    """NaN and Inf propagate, signed zeros follow IEEE (``-0 + -0`` is -0, ``x + -x`` is +0), as ``tl.fma``."""
    inf, nan = float("inf"), float("nan")
    codes = torch.tensor([[0.0, 1.0, -1.0, 0.0, 3.0, -2.0, 0.0, 1.0] * 2])
    scale = torch.tensor([inf])
    acc = torch.tensor([[0.0, 1.0, 1.0, -0.0, nan, 5.0, -0.0, -inf] * 2])
    out = _reference_fma(codes, scale, acc)
    assert out[0, 0].isnan() and out[0, 1] == inf and out[0, 2] == -inf and out[0, 4].isnan()
    out = _reference_fma(torch.tensor([[-1.0, 1.0, 0.0, -2.0] * 4]), torch.tensor([2.0]),
                         torch.tensor([[2.0, -2.0, -0.0, 4.0] * 4]))
    assert out[0, :4].tolist() == [0.0, 0.0, -0.0, 0.0]
    assert [torch.copysign(torch.tensor(1.0), x).item() for x in out[0, :4]] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_encode_and_decode_words(bits, kernel_device, gen):
    """Every code at every position of a word: packed as the reference packs bytes and nibbles (two's
    complement, code ``i`` in bits ``[i * bits, (i + 1) * bits)``), and decoded back to the same integers."""
    qmax = (1 << (bits - 1)) - 1
    per_word = 32 // bits
    rows, cols = 1 << 8, 256
    codes = torch.randint(-qmax, qmax + 1, (rows, cols), generator=gen, dtype=torch.int32)
    codes[0] = torch.arange(cols) % (2 * qmax + 1) - qmax  # every code at every position
    code_bits = common.CODE_BITS.value + (1 << (bits - 1)) + codes
    (bits_dev,) = _on(kernel_device, code_bits)
    words = torch.empty(rows, cols // per_word, dtype=torch.int32, device=kernel_device)
    _encode_kernel[(rows // 64,)](bits_dev, words, BITS=bits, ROWS=64, COLS=cols)

    as_bytes = codes.to(torch.int8)
    if bits == 4:  # element 2k in the low nibble of byte k, 2k + 1 in the high one
        as_bytes = (as_bytes[:, 0::2] & 0xF) | (as_bytes[:, 1::2] << 4)
    if bits == 2:  # element 4k + i in bits 2i, 2i + 1 of byte k
        as_bytes = sum((as_bytes[:, i::4] & 3) << (2 * i) for i in range(4)).to(torch.int8)
    expected_words = as_bytes.contiguous().view(torch.int32)  # little-endian bytes, as the spec lays them out
    assert torch.equal(words.cpu(), expected_words)

    # every word value's low half and high half pattern, plus the encoded ones
    all_words = torch.cat([words.cpu().reshape(-1), torch.randint(-(2**31), 2**31, (rows * cols // per_word,),
                                                                   generator=gen, dtype=torch.int64).to(torch.int32)])
    all_words = all_words[: (all_words.numel() // (64 * 8)) * 64 * 8].reshape(-1, 8)
    (w_dev,) = _on(kernel_device, all_words)
    decoded = torch.empty(all_words.shape[0], 8 * per_word, dtype=torch.float32, device=kernel_device)
    _decode_kernel[(all_words.shape[0] // 64,)](w_dev, decoded, 0, BITS=bits, ROWS=64, W=8)
    raw = all_words.view(torch.int8).to(torch.int32).reshape(all_words.shape[0], -1)  # bytes, sign-extended
    if bits == 4:
        low, high = (raw << 28) >> 28, raw >> 4
        raw = torch.stack([low, high], dim=-1).reshape(raw.shape[0], -1)
    if bits == 2:
        raw = torch.stack([(raw << (30 - 2 * i)) >> 30 for i in range(4)], dim=-1).reshape(raw.shape[0], -1)
    assert torch.equal(decoded.cpu(), raw.float())
