"""The torch reference's fast path (pieces of ``PIECE_NUMEL`` elements, in-place work buffers) gives exactly the
bits of the plain whole-tensor formulas, whatever the piece size.

``oracle_*`` below are the formulas written the simple way (one full-size tensor per step), as the reference was
before it worked piece by piece (the reciprocal of the scales is the reference's, proved exact in
``test_exact_arith.py``; the fused multiply-add is written independently). Codes and scales must agree byte for
byte; values bit for bit, except that a NaN only has to be a NaN (torch encodes a float32 NaN rounded to bfloat16
differently in its vectorized and scalar conversion loops).
"""

import itertools

import pytest
import torch

from zeropp.quant import BlockFormat, reference
from zeropp.quant.format import swizzle_source

FLOAT32_MAX = torch.finfo(torch.float32).max


def oracle_quantize_blocks(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    qmax = fmt.qmax
    scales = blocks.abs().amax(dim=1) / qmax
    finite = torch.isfinite(scales)
    r = reference.reciprocal(torch.where(finite & (scales > 0), scales, torch.ones_like(scales)))
    q = torch.round(blocks.double() * r[:, None]).clamp_(-qmax, qmax)
    q = torch.where(finite[:, None], q, torch.zeros_like(q)).to(torch.int16)
    if fmt.bits == 4:
        q = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)
    return (q & 0xFF).to(torch.uint8), scales


def oracle_codes(codes: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    c = codes.to(torch.int16)
    if fmt.bits == 8:
        q = (c ^ 0x80) - 0x80
    else:
        lo = ((c & 0xF) ^ 8) - 8
        hi = (((c >> 4) & 0xF) ^ 8) - 8
        q = torch.stack((lo, hi), dim=2).view(c.shape[0], fmt.block_size)
    return q.to(torch.float32)


def oracle_fma(code: torch.Tensor, scale: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Float32 ``code * scale + acc`` rounded once: the float64 sum rounded to odd (``nextafter`` toward the exact
    sum when inexact and even), then to float32."""
    p = code.double() * scale.double()
    a = acc.double()
    total = p + a
    b = total - p
    err = (p - (total - b)) + (a - b)
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(total, float("inf")), torch.full_like(total, -float("inf")))
    return torch.where((err != 0) & ~err.isnan() & even, torch.nextafter(total, toward), total).float()


def oracle_pack_parts(packs: torch.Tensor, fmt: BlockFormat, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 codes ``(rows, blocks * block_size)`` and the per-element scales of each row's pack."""
    rows = packs.shape[0]
    split = blocks * fmt.block_code_bytes
    codes = oracle_codes(packs[:, :split].reshape(rows * blocks, fmt.block_code_bytes), fmt)
    scales = packs[:, split:].contiguous().view(torch.float32).reshape(rows * blocks)
    return codes.view(rows, -1), scales.repeat_interleave(fmt.block_size).view(rows, -1)


def oracle_dequantize_packs(packs: torch.Tensor, fmt: BlockFormat, blocks: int) -> torch.Tensor:
    codes, scales = oracle_pack_parts(packs, fmt, blocks)
    return torch.clamp(codes * scales, -FLOAT32_MAX, FLOAT32_MAX)


def oracle_write_packs(rows: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    r, width = rows.shape
    blocks = width // fmt.block_size
    codes, scales = oracle_quantize_blocks(rows.reshape(r * blocks, fmt.block_size), fmt)
    return torch.cat([codes.view(r, -1), scales.view(r, blocks).view(torch.uint8)], dim=1).view(-1)


def oracle_quantize_chunks(x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int) -> torch.Tensor:
    numel = x.numel()
    s = -(-numel // chunks)
    rows = torch.zeros(chunks, fmt.num_blocks(s) * fmt.block_size)
    padded = torch.zeros(chunks * s)
    padded[:numel] = x.float()
    rows[:, :s] = padded.view(chunks, s)
    order = [swizzle_source(p, nodes, chunks // nodes) for p in range(chunks)]
    return oracle_write_packs(rows[torch.tensor(order)], fmt)


def oracle_sum(buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int) -> torch.Tensor:
    blocks = fmt.num_blocks(chunk_numel)
    packs = buf.view(groups, chunks, -1)
    acc = torch.zeros(chunks, blocks * fmt.block_size)
    for i in range(groups):
        acc = oracle_fma(*oracle_pack_parts(packs[i], fmt, blocks), acc)
    return acc


def special_values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gaussian values over six decades, with NaN, Inf, zero, huge, subnormal and tie blocks sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 10.0 ** (torch.rand(numel, generator=g) * 6 - 3)
    specials = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, FLOAT32_MAX, -FLOAT32_MAX, 1e-45, 1e-38, 2.5]
    )
    where = torch.randint(0, numel, (max(1, numel // 300),), generator=g)
    x[where] = specials[torch.randint(0, len(specials), where.shape, generator=g)]
    for start in range(0, numel - 16, 16 * 37):
        kind = start // (16 * 37) % 4
        if kind == 0:
            x[start : start + 16] = 0.0
        elif kind == 1:
            x[start : start + 16] = FLOAT32_MAX
        elif kind == 2:  # exact ties x * r = k + 0.5
            x[start : start + 16] = torch.arange(-8, 8) + 0.5
            x[start] = 127.0
    return x.to(dtype)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.uint8:
        assert torch.equal(actual, expected)
        return
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[actual.dtype]
    if actual.dtype == torch.float32:
        assert torch.equal(actual.view(as_int), expected.view(as_int))  # NaN payloads included
    else:
        assert torch.equal(actual.view(as_int)[~nan], expected.view(as_int)[~nan])


def run_all(
    x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out_dtype: torch.dtype
) -> list[torch.Tensor]:
    """Every reference op on ``x``: the packs, their values, a reduce_requantize and a reduce_dequantize."""
    numel = x.numel()
    s = -(-numel // chunks)
    packs = torch.full((fmt.chunked_bytes(numel, chunks),), 0xAB, dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, chunks, nodes, packs)
    values = torch.full((numel,), 7.0, dtype=out_dtype)
    reference.dequantize_chunks(packs, fmt, chunks, s, values)
    groups = 2 if chunks % 2 == 0 else 1
    mid = torch.empty(chunks // groups * fmt.packed_bytes(s), dtype=torch.uint8)
    reference.reduce_requantize(packs, fmt, groups, chunks // groups, s, mid)
    final = torch.full((max(1, s - 5),), 7.0, dtype=out_dtype)
    reference.reduce_dequantize(packs, fmt, chunks, s, final, 3.0)
    return [packs, values, mid, final]


def oracle_all(
    x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out_dtype: torch.dtype
) -> list[torch.Tensor]:
    numel = x.numel()
    s = -(-numel // chunks)
    packs = oracle_quantize_chunks(x, fmt, chunks, nodes)
    values = oracle_dequantize_packs(packs.view(chunks, -1), fmt, fmt.num_blocks(s))[:, :s]
    values = values.reshape(-1)[:numel].contiguous().to(out_dtype)
    groups = 2 if chunks % 2 == 0 else 1
    mid = oracle_write_packs(oracle_sum(packs, fmt, groups, chunks // groups, s), fmt)
    total = oracle_sum(packs, fmt, chunks, 1, s)[0, : max(1, s - 5)]
    final = (total / torch.tensor(3.0)).to(out_dtype)
    return [packs, values, mid, final]


CASES = [
    # (bits, block_size, numel, chunks, nodes, dtype, out dtype)
    (8, 128, 700_001, 1, 1, torch.bfloat16, torch.bfloat16),  # several default-sized pieces, short last block
    (4, 128, 600_000, 2, 1, torch.float32, torch.float32),
    (8, 16, 100_003, 4, 2, torch.float16, torch.float32),
    (4, 16, 50_001, 8, 4, torch.bfloat16, torch.float16),
    (8, 2048, 300_000, 3, 1, torch.float32, torch.bfloat16),
    (4, 2048, 20_000, 4, 2, torch.float16, torch.bfloat16),
    (8, 64, 999, 8, 2, torch.float32, torch.float32),
    (4, 32, 1, 3, 1, torch.float32, torch.float32),
]


@pytest.mark.parametrize("bits,block,numel,chunks,nodes,dtype,out_dtype", CASES)
def test_reference_matches_whole_tensor_formulas(bits, block, numel, chunks, nodes, dtype, out_dtype):
    fmt = BlockFormat(bits, block)
    x = special_values(numel, dtype, seed=numel + bits + block)
    expected = oracle_all(x, fmt, chunks, nodes, out_dtype)
    for actual, want in zip(run_all(x, fmt, chunks, nodes, out_dtype), expected):
        assert_same_bits(actual, want)


@pytest.mark.parametrize("bits,block", list(itertools.product((8, 4), (16, 128))))
def test_piece_size_changes_no_bit(monkeypatch, bits, block):
    """One block per piece, a few blocks per piece (a short last piece) and the default all give the same bytes."""
    fmt = BlockFormat(bits, block)
    x = special_values(20_011, torch.bfloat16, seed=bits * block)
    expected = run_all(x, fmt, 4, 2, torch.float32)
    for piece in (1, 5 * block, 1 << 12):
        monkeypatch.setattr(reference, "PIECE_NUMEL", piece)
        for actual, want in zip(run_all(x, fmt, 4, 2, torch.float32), expected):
            assert_same_bits(actual, want)


def test_random_bytes_match_whole_tensor_formulas():
    """Arbitrary packs (any code byte, scales of any sign and size, NaN and Inf) dequantize and sum alike."""
    g = torch.Generator().manual_seed(5)
    for fmt in (BlockFormat(8, 128), BlockFormat(4, 16)):
        chunks, s = 4, 3001
        buf = torch.randint(0, 256, (chunks * fmt.packed_bytes(s),), dtype=torch.uint8, generator=g)
        values = torch.empty(chunks * s)
        reference.dequantize_chunks(buf, fmt, chunks, s, values)
        expected = oracle_dequantize_packs(buf.view(chunks, -1), fmt, fmt.num_blocks(s))[:, :s].reshape(-1)
        assert_same_bits(values, expected)
        mid = torch.empty(2 * fmt.packed_bytes(s), dtype=torch.uint8)
        reference.reduce_requantize(buf, fmt, 2, 2, s, mid)
        assert_same_bits(mid, oracle_write_packs(oracle_sum(buf, fmt, 2, 2, s), fmt))
        final = torch.empty(s, dtype=torch.float32)
        reference.reduce_dequantize(buf, fmt, chunks, s, final, 8.0)
        assert_same_bits(final, oracle_sum(buf, fmt, chunks, 1, s)[0, :s] / torch.tensor(8.0))


def test_sums_start_from_positive_zero():
    """``acc = 0`` then ``acc += ...``: packs that all hold -0.0 (code 0, negative scale) sum to +0.0."""
    fmt = BlockFormat(8, 16)
    buf = torch.zeros(3 * fmt.packed_bytes(40), dtype=torch.uint8)
    packs = buf.view(3, -1)
    split = fmt.code_bytes(40)
    packs[:, split:] = torch.full((3, fmt.num_blocks(40)), -1.0).view(torch.uint8)
    final = torch.empty(40)
    reference.reduce_dequantize(buf, fmt, 3, 40, final, 1.0)
    assert_same_bits(final, torch.zeros(40))
    values = torch.empty(3 * 40)
    reference.dequantize_chunks(buf, fmt, 3, 40, values)
    assert_same_bits(values, torch.full((120,), -0.0))
