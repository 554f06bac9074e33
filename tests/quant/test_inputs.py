"""Inputs that fuzzing found the quantization ops mishandling: tensors that require grad, meta tensors, packed
buffers at misaligned offsets, negative shapes. Each is quantized as the detached values would be (checked against
numpy) or refused with an error naming the bad value.
"""

import numpy as np
import pytest
import torch

import zeropp.quant as zq
from zeropp.quant import BlockFormat


def np_scales(x: np.ndarray, bits: int, block: int) -> np.ndarray:
    """The float32 scale of each block (absmax / qmax), computed in numpy from the zero-padded blocks."""
    nb = -(-x.size // block)
    padded = np.zeros(nb * block, dtype=np.float32)
    padded[: x.size] = x.ravel()
    return (np.abs(padded.reshape(nb, block)).max(axis=1) / np.float32(2 ** (bits - 1) - 1)).astype(np.float32)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_requires_grad_uses_the_detached_values(quant_backend, bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(5, 77, generator=g).to(quant_backend).requires_grad_()
    y = x * 3  # a non-leaf with history
    for t in (x, y):
        q = zq.quantize(t, bits=bits, block_size=64)
        assert np.array_equal(q.scales.cpu().numpy(), np_scales(t.detach().cpu().numpy(), bits, 64))
        assert torch.equal(q.buffer, zq.quantize(t.detach(), bits=bits, block_size=64).buffer)
        assert not q.buffer.requires_grad
        back = zq.dequantize(q)
        assert back.grad_fn is None and not back.requires_grad
        err = (back.detach().cpu().double() - t.detach().cpu().double()).abs().view(-1)
        assert torch.all(err <= q.scales.cpu().double().repeat_interleave(64)[: t.numel()] / 2 * (1 + 1e-6))


def test_dequantize_into_out_that_requires_grad(quant_backend):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, generator=g).to(quant_backend)
    q = zq.quantize(x)
    out = torch.zeros(300, device=quant_backend, requires_grad=True)
    with pytest.raises(ValueError, match=r"out requires grad.*torch\.no_grad\(\)"):
        zq.dequantize(q, out=out)
    assert torch.count_nonzero(out.detach()) == 0
    with torch.no_grad():
        zq.dequantize(q, out=out)
    assert torch.equal(out.detach(), zq.dequantize(q))


def test_meta_tensors_are_refused_naming_the_device(quant_backend):
    fmt = BlockFormat(8, 64)
    meta_x = torch.empty(1000, device="meta")
    with pytest.raises(ValueError, match="x is on the meta device"):
        zq.quantize(meta_x)
    with pytest.raises(ValueError, match="x is on the meta device"):
        zq.quantize_chunks(meta_x, fmt, 4)
    meta_buf = torch.empty(fmt.packed_bytes(1000), dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="buf is on the meta device"):
        zq.dequantize_chunks(meta_buf, fmt, 1, 1000, torch.empty(1000, device=quant_backend))
    with pytest.raises(ValueError, match="buffer is on the meta device"):
        zq.QuantizedTensor.from_packed(meta_buf, (1000,), torch.float32, 8, 64)
    buf = zq.quantize(torch.randn(1000).to(quant_backend), block_size=64).buffer
    with pytest.raises(ValueError, match="out is on the meta device"):
        zq.dequantize_chunks(buf, fmt, 1, 1000, torch.empty(1000, device="meta"))


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_from_packed_at_a_misaligned_offset_is_refused_with_the_rule(offset):
    g = torch.Generator().manual_seed(offset)
    x = torch.randn(300, generator=g)
    q = zq.quantize(x, block_size=64)
    storage = torch.zeros(q.nbytes + 8, dtype=torch.uint8)
    storage[offset : offset + q.nbytes] = q.buffer
    with pytest.raises(ValueError, match=rf"starts at byte {offset} .*multiple of 4 bytes.*clone\(\)"):
        zq.QuantizedTensor.from_packed(storage[offset : offset + q.nbytes], x.shape, x.dtype, 8, 64)
    # the documented fix: an aligned copy reads the same scales (numpy) and flags a non-finite block
    aligned = zq.QuantizedTensor.from_packed(storage[offset : offset + q.nbytes].clone(), x.shape, x.dtype, 8, 64)
    assert np.array_equal(aligned.scales.numpy(), np_scales(x.numpy(), 8, 64))
    assert not aligned.has_nonfinite()
    x[100] = float("nan")
    storage[offset : offset + q.nbytes] = zq.quantize(x, block_size=64).buffer
    assert zq.QuantizedTensor.from_packed(storage[offset:][: q.nbytes].clone(), x.shape, x.dtype, 8, 64).has_nonfinite()


def test_from_packed_at_an_aligned_offset_is_a_view():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(200, generator=g)
    q = zq.quantize(x, block_size=32)
    storage = torch.zeros(q.nbytes + 4, dtype=torch.uint8)
    storage[4:] = q.buffer
    view = zq.QuantizedTensor.from_packed(storage[4:], x.shape, x.dtype, 8, 32)
    assert view.buffer.data_ptr() == storage[4:].data_ptr()
    assert np.array_equal(view.scales.numpy(), np_scales(x.numpy(), 8, 32))
    assert torch.equal(view.dequantize(), zq.dequantize(q))


@pytest.mark.parametrize("shape", [(-1,), (3, -1), (-2, -3), (2, 0, -4)])
def test_from_packed_rejects_negative_shapes(shape):
    with pytest.raises(ValueError, match=r"shape=.*non-negative integer"):
        zq.QuantizedTensor.from_packed(torch.zeros(0, dtype=torch.uint8), shape, torch.float32, 8, 128)


def test_from_packed_accepts_empty_and_int_shapes():
    q = zq.QuantizedTensor.from_packed(torch.zeros(0, dtype=torch.uint8), (3, 0), torch.float32, 8, 128)
    assert zq.dequantize(q).shape == (3, 0)
    x = torch.randn(40, generator=torch.Generator().manual_seed(1))
    q = zq.QuantizedTensor.from_packed(zq.quantize(x, block_size=16).buffer, 40, torch.float32, 8, 16)
    assert q.shape == (40,) and np.array_equal(q.scales.numpy(), np_scales(x.numpy(), 8, 16))


def test_weight_delta_ops_refuse_mismatched_inputs_naming_them():
    """``quantize_delta`` and ``dequantize_add_chunks`` (the weight deltas' ops) refuse, naming the bad value, what
    they cannot compute exactly: operands of two dtypes or lengths, and an ``out`` longer than the packs or needing
    grad."""
    fmt = BlockFormat(4, 64)
    a, b = torch.randn(100), torch.randn(100)
    with pytest.raises(TypeError, match="torch.bfloat16"):
        zq.quantize_delta(a, b.bfloat16(), fmt)
    with pytest.raises(ValueError, match="99 on"):
        zq.quantize_delta(a, b[:99], fmt)
    pack = zq.quantize_delta(a.view(10, 10), b, fmt)  # any shape, read flattened: the float32 difference's pack
    assert torch.equal(pack, zq.quantize_chunks(a - b, fmt))
    with pytest.raises(ValueError, match="101 elements"):
        zq.dequantize_add_chunks(pack, fmt, 1, 100, torch.zeros(101))
    with pytest.raises(ValueError, match="requires grad"):
        zq.dequantize_add_chunks(pack, fmt, 1, 100, torch.zeros(100, requires_grad=True))
