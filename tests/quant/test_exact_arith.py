"""The exact fast arithmetic of the Triton kernels (``zeropp.quant._triton.common``), proved case by case.

The kernels' fast path replaces the reference's IEEE division, rounding and conversions with cheaper sequences
that must give the same bits: ``div_fast`` (one multiply and two FMAs from a correctly rounded reciprocal),
``scale_fast`` (``absmax / qmax`` the same way), the rounder constant, ``encode_words`` and ``decode_words``.
Each helper runs here inside a small Triton kernel (on the GPU, or under Triton's interpreter, whose ``tl.fma``
rounds once like the hardware's) on millions of values, and is compared with plain float32 torch on the CPU:
random operands over the whole fast range, exact rounding ties and their neighbours one ulp away, the ends of
the range, divisors whose mantissa is all ones or a power of two, and every code of every position of a word.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from zeropp.quant._triton import common

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
def _quantize_kernel(v_ptr, s_ptr, out_ptr, BITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = r[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + i, common.quantize_fast(tl.load(v_ptr + i), tl.load(s_ptr + r), BITS))


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


def test_div_fast_random_quotients(kernel_device, gen):
    """Random divisors over the whole fast range and dividends giving quotients up to 2**10 in magnitude (codes
    live below 128): 4M cases, every quotient bit-identical to IEEE division."""
    n = 1 << 22
    d = _random_in(FAST_MIN, FAST_MAX, n, gen).abs()
    q = _random_in(2.0**-30, 2.0**10, n, gen)
    x = (q.double() * d.double()).float()
    assert_bits_equal(run_div(x, d, kernel_device), x / d, "x / d")


def test_div_fast_ties_and_neighbours(kernel_device, gen):
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
        assert_bits_equal(run_div(xs, d, kernel_device), xs / d, f"{name}: x / d")
    exact = (x.double() / d.double()) == k.double()
    assert exact.float().mean() > 0.25, "too few exact ties: the case generator is stale"


@pytest.mark.parametrize("qmax", [127, 7])
def test_scale_fast(qmax, kernel_device, gen):
    """``absmax / qmax`` over the fast range, its ends, and 0."""
    n = 1 << 20
    a = _random_in(FAST_MIN, FAST_MAX, n, gen).abs()
    a[:4] = torch.tensor([0.0, FAST_MIN, FAST_MAX, 1.0])
    a[4 : 4 + 256] = torch.arange(256) * qmax * 2.0**-10  # exact multiples: quotients exactly representable
    (a_dev,) = _on(kernel_device, a)
    out = torch.empty_like(a_dev)
    _scale_kernel[(n // TILE,)](a_dev, out, QMAX=qmax, TILE=TILE)
    assert_bits_equal(out.cpu(), a / torch.tensor(float(qmax)), f"absmax / {qmax}")


def _reference_codes(v: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    d = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (v / d[:, None]).round().clamp(-qmax, qmax).to(torch.int32)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_fast_rounds_like_the_reference(bits, kernel_device, gen):
    """The code bits ``CODE_BITS + 2**(bits-1) + code`` for values whose quotients are random, exact ties
    ``k + 0.5`` (half to even) and one ulp off them, with zero-scale rows."""
    qmax = (1 << (bits - 1)) - 1
    rows, cols = 1 << 10, 256
    scale = _random_in(2.0**-87, 2.0**93, rows, gen).abs()
    scale[:8] = 0.0
    q = torch.rand(rows, cols, generator=gen) * (2 * qmax) - qmax
    ties = torch.randint(-qmax, qmax, (rows, cols), generator=gen).float() + 0.5
    q = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, q, ties)
    v = (q.double() * scale.double()[:, None]).float()
    step = torch.randint(-1, 2, (rows, cols), generator=gen)
    v = torch.where(step < 0, torch.nextafter(v, v - 1), torch.where(step > 0, torch.nextafter(v, v + 1), v))
    v[:8] = 0.0
    v_dev, s_dev = _on(kernel_device, v, scale)
    out = torch.empty(rows, cols, dtype=torch.int32, device=kernel_device)
    _quantize_kernel[(rows // 64,)](v_dev, s_dev, out, BITS=bits, ROWS=64, COLS=cols)
    expected = common.CODE_BITS.value + (1 << (bits - 1)) + _reference_codes(v, scale, qmax)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("bits", [8, 4])
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
    assert torch.equal(decoded.cpu(), raw.float())
