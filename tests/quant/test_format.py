"""The quantization spec checked against independent computations (numpy float32 / float64, hand-made layouts).

Tests taking the ``quant_backend`` fixture run once per backend, through the public ops: the torch reference, the
Triton kernels (the interpreter on a CPU-only machine) and the native CPU library.
"""

import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from rationals import fma_float32

import zeropp.quant as zq
from zeropp.quant import BlockFormat

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def np_quantize(x: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent numpy implementation of the spec for normal scales: integer codes (one per element) and scales.
    ``r = 1 / scale`` by float32 division, the product ``x * r`` exact in float64, rounded half to even."""
    qmax = 2 ** (bits - 1) - 1
    nb = -(-x.size // block)
    padded = np.zeros(nb * block, dtype=np.float32)
    padded[: x.size] = x.astype(np.float32).ravel()
    blocks = padded.reshape(nb, block)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        absmax = np.abs(blocks).max(axis=1) if nb else np.zeros(0, np.float32)
        scales = (absmax / np.float32(qmax)).astype(np.float32)
        ok = np.isfinite(scales) & (scales > 0)
        r = np.float32(1) / np.where(ok, scales, np.float32(1))
        q = np.rint(blocks.astype(np.float64) * r.astype(np.float64)[:, None])
    q = np.clip(q, -qmax, qmax)
    q[~np.isfinite(scales)] = 0
    return q.astype(np.int64), scales


def unpack_codes(q: zq.QuantizedTensor) -> np.ndarray:
    """Integer codes, one per (padded) element, decoded byte by byte in plain Python-style numpy."""
    raw = q.data.view(torch.uint8).numpy().astype(np.int64)
    if q.bits == 8:
        return np.where(raw >= 128, raw - 256, raw)
    if q.bits == 2:  # element 4k + i in bits 2i, 2i + 1 of byte k
        fields = np.stack([(raw >> (2 * i)) & 3 for i in range(4)], axis=1).ravel()
        return np.where(fields >= 2, fields - 4, fields)
    lo, hi = raw & 0xF, raw >> 4
    lo, hi = np.where(lo >= 8, lo - 16, lo), np.where(hi >= 8, hi - 16, hi)
    return np.stack([lo, hi], axis=1).ravel()


CODES_CASES = [(bits, dtype, numel, block) for bits in (8, 4) for dtype in DTYPES
               for numel, block in [(1, 16), (255, 64), (4096, 256), (5003, 2048), (1000, 16)]]
CODES_CASES += [(2, torch.bfloat16, 255, 64), (2, torch.float32, 1000, 16)]


@pytest.mark.parametrize("bits,dtype,numel,block", CODES_CASES)
def test_codes_and_scales_match_numpy(quant_backend, bits, dtype, numel, block):
    g = torch.Generator().manual_seed(numel * 7 + bits)
    x = (torch.randn(numel, generator=g) * 3).to(dtype)
    q = zq.quantize(x.to(quant_backend), bits=bits, block_size=block)
    codes, scales = np_quantize(x.float().numpy(), bits, block)
    assert np.array_equal(q.scales.cpu().numpy(), scales)
    assert np.array_equal(unpack_codes(q.__class__(q.buffer.cpu(), q.shape, q.dtype, q.fmt)), codes.ravel())


@pytest.mark.parametrize("bits,dtype", [(b, d) for b in (8, 4) for d in DTYPES] + [(2, torch.float16)])
def test_round_trip_error_bound_and_dtype(quant_backend, bits, dtype):
    g = torch.Generator().manual_seed(11 + bits)
    x = (torch.randn(3, 37, 29, generator=g) * torch.logspace(-3, 3, 29)).to(dtype)
    q = zq.quantize(x.to(quant_backend), bits=bits, block_size=64)
    y = zq.dequantize(q).cpu()
    assert y.shape == x.shape and y.dtype == dtype
    err = (y.double() - x.double()).abs().view(-1)
    per_elem_scale = q.scales.cpu().double().repeat_interleave(64)[: x.numel()]
    out_rounding = x.double().abs().view(-1) * torch.finfo(dtype).eps  # the cast of the result to ``dtype``
    assert torch.all(err <= per_elem_scale / 2 * (1 + 1e-6) + out_rounding)


@settings(max_examples=300, deadline=None)
@given(
    x=hnp.arrays(
        np.float32,
        st.integers(0, 700),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False),
    ),
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([16, 32, 128]),
)
def test_round_trip_property(x, bits, block):
    """The spec's bound for every element (torch reference, fp32): ``|x - x'| <= scale / 2 + |x| 2^-24`` (the
    rounding of ``x * r``, whose ``r`` is within 2^-24 of ``1 / scale``) ``+ |x'| 2^-24`` (the rounding of ``code *
    scale``) for normal scales; for subnormal ones the scale itself is off by up to 2^-150, so a code clamped to
    qmax may miss by ``qmax * 2^-150`` more."""
    t = torch.from_numpy(x)
    with mock.patch.dict(os.environ, {"ZEROPP_QUANT_BACKEND": "torch"}):
        q = zq.quantize(t, bits=bits, block_size=block)
        y = zq.dequantize(q).double()
    scale = q.scales.double().repeat_interleave(block)[: t.numel()]
    x64 = t.double()
    bound = scale / 2 + (x64.abs() + y.abs()) * 2.0**-24
    bound = torch.where(scale < 2.0**-126, bound + (q.fmt.qmax + 1) * 2.0**-150, bound)
    assert torch.all((y - x64).abs() <= bound)
    assert not q.has_nonfinite()


def test_int4_nibble_order():
    """Element 2k in the low nibble, element 2k+1 in the high nibble, two's complement."""
    x = torch.zeros(16)
    x[0], x[1], x[2], x[3] = 7.0, -7.0, -1.0, 3.0  # absmax 7 -> scale 1, codes equal the values
    q = zq.quantize(x, bits=4, block_size=16)
    assert q.scales.tolist() == [1.0]
    assert q.data[:2].tolist() == [0x7 | (0x9 << 4), 0xF | (0x3 << 4)]


def test_int2_field_order():
    """Element 4k + i in bits 2i and 2i + 1 of byte k (element 4k lowest), two's complement: -1 is 0b11."""
    x = torch.zeros(16)
    x[0], x[1], x[2], x[3], x[5], x[6] = 2.0, -2.0, 0.0, 2.0, -2.0, 0.9  # absmax 2 -> scale 2, codes x / 2 rounded
    q = zq.quantize(x, bits=2, block_size=16)
    assert q.scales.tolist() == [2.0]
    assert q.data[:3].tolist() == [0b01_00_11_01, 0b00_00_11_00, 0]


def test_round_half_to_even():
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5] + [0.0] * 9)  # absmax 127 -> scale 1
    q = zq.quantize(x, bits=8, block_size=16)
    assert q.data[:7].tolist() == [127, 0, 2, 2, 0, -2, -2]


def test_zero_block_has_zero_scale_and_codes(quant_backend):
    x = torch.randn(64 * 3)
    x[64:128] = 0
    q = zq.quantize(x.to(quant_backend), bits=4, block_size=64)
    assert q.scales[1].item() == 0.0 and torch.isfinite(q.scales).all()
    assert torch.all(q.data.cpu()[32:64] == 0)
    assert torch.equal(zq.dequantize(q).cpu()[64:128], torch.zeros(64))


@pytest.mark.parametrize("bad,expected", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "inf")])
def test_nonfinite_block_detected_from_scales(quant_backend, bad, expected):
    x = torch.randn(64 * 4, dtype=torch.float16)
    x[130] = bad
    q = zq.quantize(x.to(quant_backend), bits=8, block_size=64)
    s = q.scales.cpu()
    assert q.has_nonfinite()
    assert (torch.isnan(s[2]) if expected == "nan" else torch.isposinf(s[2])).item()
    assert torch.isfinite(s[[0, 1, 3]]).all()
    assert torch.all(q.data.cpu()[128:192] == 0)
    y = zq.dequantize(q).cpu()
    assert torch.allclose(y[:128].float(), x[:128].float(), rtol=0, atol=s[:2].max().item())


def test_nan_wins_over_inf_in_a_block():
    x = torch.ones(32)
    x[3], x[4] = float("inf"), float("nan")
    assert torch.isnan(zq.quantize(x, block_size=32).scales).all()


def test_padding_never_leaks(quant_backend):
    """The last block's padding is stored as zero codes and never appears in the output."""
    x = torch.full((70,), 5.0)
    q = zq.quantize(x.to(quant_backend), bits=4, block_size=64)
    codes = unpack_codes(zq.QuantizedTensor(q.buffer.cpu(), q.shape, q.dtype, q.fmt))
    assert codes.size == 128 and np.all(codes[70:] == 0) and np.all(codes[:70] == 7)
    y = zq.dequantize(q)
    assert y.shape == (70,) and torch.equal(y.cpu(), x)


def test_empty_tensor(quant_backend):
    x = torch.empty(0, 5, dtype=torch.bfloat16, device=quant_backend)
    q = zq.quantize(x, bits=4)
    assert q.nbytes == 0 and q.scales.numel() == 0 and not q.has_nonfinite()
    y = zq.dequantize(q)
    assert y.shape == (0, 5) and y.dtype == torch.bfloat16


def test_packed_layout_and_from_packed():
    x = torch.randn(1000)
    q = zq.quantize(x, bits=4, block_size=128)
    blocks = 8  # ceil(1000 / 128)
    assert q.nbytes == blocks * 64 + blocks * 4
    assert q.data.data_ptr() == q.buffer.data_ptr()
    assert q.scales.data_ptr() == q.buffer.data_ptr() + blocks * 64
    wire = q.packed().clone()
    r = zq.QuantizedTensor.from_packed(wire, (10, 100), torch.float32, bits=4, block_size=128)
    assert torch.equal(zq.dequantize(r).view(-1), zq.dequantize(q))
    with pytest.raises(ValueError, match="needs 544"):
        zq.QuantizedTensor.from_packed(wire[:-4], (1000,), torch.float32, bits=4, block_size=128)


def test_compression_ratio():
    fmt = BlockFormat(bits=4, block_size=256)
    assert fmt.packed_bytes(1 << 20) == (1 << 20) // 2 + 4 * (1 << 12)
    assert fmt.compression_ratio(1 << 20) == pytest.approx(2 * (1 << 20) / ((1 << 19) + (1 << 14)))


def test_dequantize_into_view_of_larger_buffer(quant_backend):
    x = torch.randn(300, dtype=torch.bfloat16, device=quant_backend)
    q = zq.quantize(x, bits=8, block_size=64)
    big = torch.full((1000,), -3.0, dtype=torch.float32, device=quant_backend)
    res = zq.dequantize(q, out=big[100:400])
    assert res.data_ptr() == big[100:].data_ptr()
    assert torch.all(big[:100] == -3) and torch.all(big[400:] == -3)
    assert torch.equal(big[100:400], zq.dequantize(q, dtype=torch.float32))


def test_quantize_accepts_non_contiguous():
    x = torch.randn(64, 48).t()
    assert torch.equal(zq.dequantize(zq.quantize(x)), zq.dequantize(zq.quantize(x.contiguous())))


def test_bad_input_errors():
    with pytest.raises(TypeError, match="int64.*floating point"):
        zq.quantize(torch.arange(10))
    with pytest.raises(ValueError, match="bits=3"):
        zq.quantize(torch.randn(10), bits=3)
    for bs in (100, 8, 16384, True):
        with pytest.raises(ValueError, match="power of two"):
            zq.quantize(torch.randn(10), block_size=bs)
    q = zq.quantize(torch.randn(10))
    with pytest.raises(ValueError, match="has 11 elements but 10"):
        zq.dequantize(q, out=torch.empty(11))
    with pytest.raises(ValueError, match="contiguous"):
        zq.dequantize(q, out=torch.empty(10, 2)[:, 0])
    with pytest.raises(TypeError, match="output dtype"):
        zq.dequantize(q, dtype=torch.int32)
    with pytest.raises(ValueError, match="disagrees"):
        zq.dequantize(q, dtype=torch.float16, out=torch.empty(10))
    with pytest.raises(ValueError, match="multiple of 4"):
        buf = torch.empty(zq.BlockFormat().packed_bytes(10) + 1, dtype=torch.uint8)[1:]
        zq.dequantize_chunks(buf, zq.BlockFormat(), 1, 10, torch.empty(10))
    with pytest.raises(ValueError, match="ZEROPP_QUANT_BACKEND"):
        with mock.patch.dict(os.environ, {"ZEROPP_QUANT_BACKEND": "cuda"}):
            zq.quantize(torch.randn(4))


# --- the chunked layout and the qgZ steps ---------------------------------------------------------------------


def _slice_packs(x: torch.Tensor, fmt: BlockFormat, chunks: int) -> list[torch.Tensor]:
    """Each slice quantized on its own with the single-tensor API, zero-padded to the common slice size."""
    s = -(-x.numel() // chunks)
    padded = torch.zeros(chunks * s, dtype=x.dtype)
    padded[: x.numel()] = x
    return [zq.quantize(padded[i * s : (i + 1) * s], fmt.bits, fmt.block_size).packed() for i in range(chunks)]


@pytest.mark.parametrize("numel", [0, 1, 999, 4096, 10007])
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_quantize_chunks_equals_per_slice_packs(quant_backend, numel, chunks):
    fmt = BlockFormat(bits=4, block_size=64)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel + chunks))
    buf = zq.quantize_chunks(x.to(quant_backend), fmt, chunks)
    expected = torch.cat(_slice_packs(x, fmt, chunks))
    assert buf.numel() == fmt.chunked_bytes(numel, chunks) == expected.numel()
    assert torch.equal(buf.cpu(), expected)


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 4), (4, 2), (1, 4), (3, 1)])
def test_swizzle_order(quant_backend, nodes, per_node):
    """Pack j * nodes + m holds the slice of the rank with local index j on node m."""
    fmt = BlockFormat(bits=8, block_size=16)
    world = nodes * per_node
    x = torch.randn(world * 40 - 3, generator=torch.Generator().manual_seed(world))
    packs = _slice_packs(x, fmt, world)
    buf = zq.swizzle_quantize(x.to(quant_backend), fmt, nodes, per_node).cpu()
    pos = 0
    for j in range(per_node):  # destination local index
        for m in range(nodes):  # destination node
            owner = m * per_node + j
            assert zq.swizzle_source(j * nodes + m, nodes, per_node) == owner
            assert torch.equal(buf[pos : pos + packs[owner].numel()], packs[owner])
            pos += packs[owner].numel()


def test_dequantize_chunks_trims_padding(quant_backend):
    fmt = BlockFormat(bits=8, block_size=32)
    shards = [torch.randn(50, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    buf = torch.cat([zq.quantize(s, 8, 32).packed() for s in shards]).to(quant_backend)
    out = torch.empty(190, dtype=torch.bfloat16, device=quant_backend)  # the last shard's 10 elements dropped
    zq.dequantize_chunks(buf, fmt, 4, 50, out)
    expected = torch.cat([zq.dequantize(zq.quantize(s, 8, 32)) for s in shards])[:190].bfloat16()
    assert torch.equal(out.cpu(), expected)


def _fused_sums(packs: list[torch.Tensor], fmt: BlockFormat, chunks: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 sums over ``packs`` (chunked layouts of ``chunks`` packs of ``s`` elements): ``fma(code, scale, acc)``
    group by group from 0, each rounded once (exact rationals); and the same sums with every product rounded to
    float32 before it is added (the old, twice-rounded order)."""
    fused, twice = [0.0] * (chunks * s), torch.zeros(chunks * s)
    for p in packs:
        for m, pack in enumerate(p.view(chunks, -1)):
            single = zq.QuantizedTensor(pack.clone(), torch.Size([s]), torch.float32, fmt)
            codes = unpack_codes(single)[:s]
            scales = single.scales.repeat_interleave(fmt.block_size)[:s]
            for i, (c, sc) in enumerate(zip(codes.tolist(), scales.tolist())):
                fused[m * s + i] = fma_float32(c, sc, fused[m * s + i])
            twice[m * s : (m + 1) * s] += torch.from_numpy(codes).float() * scales
    return torch.tensor(fused, dtype=torch.float32), twice


def test_fused_reductions_sum_codes_with_one_rounding(quant_backend):
    """``reduce_requantize`` packs, and ``reduce_dequantize`` (divisor 1) returns, the sums of ``code * scale``
    accumulated by fused multiply-adds, bit for bit (checked to differ from the twice-rounded sums)."""
    fmt = BlockFormat(bits=4, block_size=64)
    groups, chunks, s = 3, 2, 200
    parts = [torch.randn(chunks * s, generator=torch.Generator().manual_seed(i)) * 10.0**i for i in range(groups)]
    packs = [zq.quantize_chunks(p, fmt, chunks) for p in parts]
    fused, twice = _fused_sums(packs, fmt, chunks, s)
    assert (fused != twice).sum() > 10, "no element where one rounding matters: the inputs are stale"
    out = zq.reduce_requantize(torch.cat(packs).to(quant_backend), fmt, groups, chunks, s).cpu()
    assert torch.equal(out, zq.quantize_chunks(fused, fmt, chunks))
    runs = torch.cat([p.view(chunks, -1)[1] for p in packs]).to(quant_backend)  # pack 1 of every group
    sums = torch.empty(s, device=quant_backend)
    zq.reduce_dequantize(runs, fmt, groups, s, sums, divisor=1)
    assert torch.equal(sums.cpu(), fused[s:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_dequantize_is_mean(quant_backend, dtype):
    fmt = BlockFormat(bits=8, block_size=64)
    groups, s = 4, 333
    parts = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i in range(groups)]
    buf = torch.cat([zq.quantize(p, 8, 64).packed() for p in parts]).to(quant_backend)
    out = torch.empty(s - 5, dtype=dtype, device=quant_backend)
    zq.reduce_dequantize(buf, fmt, groups, s, out, divisor=8)
    ref = sum(zq.dequantize(zq.quantize(p, 8, 64)).double() for p in parts)[: s - 5] / 8
    assert torch.allclose(out.cpu().double(), ref, rtol=torch.finfo(dtype).eps, atol=1e-7)


def _block_absmax(v: torch.Tensor, world: int, s: int, block: int) -> torch.Tensor:
    """Per element of float64 ``v``: the absmax of its quantization block (blocks restart at each slice)."""
    k = -(-s // block)
    rows = torch.zeros(world, k * block, dtype=torch.float64)
    rows[:, :s] = torch.nn.functional.pad(v.abs(), (0, world * s - v.numel())).view(world, s)
    amax = rows.view(world, k, block).amax(dim=2).repeat_interleave(block, dim=1)[:, :s]
    return amax.reshape(-1)[: v.numel()]


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (2, 4), (4, 1), (1, 4)])
@pytest.mark.parametrize("bits", [8, 4])
def test_two_hop_pipeline_gives_each_rank_its_slice_of_the_mean(nodes, per_node, bits, monkeypatch):
    """qgZ simulated in one process (the all-to-alls done by slicing): rank r ends with slice r of the mean,
    within the error bound of its two quantizations, derived from the actual block absmaxes.

    On the torch reference, the spec: test_kernels.py holds every backend's swizzled quantize, reduce-requantize
    and final reduce bit-exact to it (through the interpreted Triton kernels, one case took ~14 s)."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")
    fmt = BlockFormat(bits=bits, block_size=64)
    world = nodes * per_node
    numel = 1000 * world + 17
    s = -(-numel // world)
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    pack = fmt.packed_bytes(s)
    sent = [zq.swizzle_quantize(g, fmt, nodes, per_node).view(per_node, nodes * pack) for g in grads]
    hop2_send = {}
    for m in range(nodes):
        for j in range(per_node):  # rank (m, j) receives run j from each local peer i
            recv = torch.cat([sent[m * per_node + i][j] for i in range(per_node)])
            hop2_send[m, j] = zq.reduce_requantize(recv, fmt, per_node, nodes, s).view(nodes, pack)

    g64 = [g.double() for g in grads]
    half = 1 / (2 * fmt.qmax)
    hop1 = [_block_absmax(g, world, s, 64) * half for g in g64]  # |error| of each rank's first quantization
    bound = sum(hop1)
    for m in range(nodes):
        node = range(m * per_node, (m + 1) * per_node)
        partial = sum(g64[i] for i in node)  # the node's true partial sum; its quantized one errs by sum(hop1)
        slack = _block_absmax(sum(hop1[i] for i in node), world, s, 64)
        bound = bound + (_block_absmax(partial, world, s, 64) + slack) * half
    bound = bound / world * (1 + 1e-5) + 1e-6
    true_mean = sum(g64) / world
    for m in range(nodes):
        for j in range(per_node):
            r = m * per_node + j
            recv = torch.cat([hop2_send[a, j][m] for a in range(nodes)])
            out = torch.empty(min(s, numel - r * s))
            zq.reduce_dequantize(recv, fmt, nodes, s, out, divisor=world)
            sl = slice(r * s, r * s + out.numel())
            err = (out.double() - true_mean[sl]).abs()
            assert torch.all(err <= bound[sl])
            assert err.norm() / true_mean[sl].norm() < (0.02 if bits == 8 else 0.3)
