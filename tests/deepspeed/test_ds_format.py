"""``zeropp.deepspeed.ds_format`` (DeepSpeed's quantizer op as torch) and ``quantizer.CUDAQuantizer``, one process.

The reference is checked against an independent re-derivation of the spec in numpy float64 (every float32
operation of the kernels computed exactly in float64 and rounded once to float32: exact for one product or
quotient of float32 values), on fresh random inputs: codes and scales bit for bit, dequantized values bit for bit,
and within half a step of the input. tests/deepspeed/test_quantizer_cuda.py compares it with DeepSpeed's CUDA op.
"""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest
import torch

from zeropp.deepspeed import ds_format as f
from zeropp.deepspeed.quantizer import CUDAQuantizer, group_count

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _inputs(numel: int, groups: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values, each group with its own magnitude (1e-3 .. 1e3 for fp16's range, wider otherwise), one group
    all zero, one element exactly at a group's absmax with a negative sign."""
    g = torch.Generator().manual_seed(seed)
    span = 3 if dtype == torch.float16 else 6
    scale = 10 ** (torch.rand(groups, 1, generator=g) * 2 * span - span)
    x = (torch.randn(groups, numel // groups, generator=g) * scale)
    x[groups // 2] = 0
    return x.reshape(-1).to(dtype)


def _spec_quantize(x: torch.Tensor, groups: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The spec in float64: int codes (unpacked) and float32 stored scales ``1 / s``."""
    v = x.double().numpy().reshape(groups, -1)
    m = np.abs(v).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        s = np.where(m == 0, np.float32(1), (2.0**bits / (2 * m)).astype(np.float32))
    stored = (1.0 / s.astype(np.float64)).astype(np.float32)
    prod = (v * s.astype(np.float64)).astype(np.float32).astype(np.float64)
    top = 2 ** (bits - 1)
    codes = np.clip(np.rint(prod), -top, top - 1).astype(np.int64)
    return codes.reshape(-1), stored.reshape(-1)


def _unpack(packed: torch.Tensor, bits: int) -> np.ndarray:
    b = packed.numpy().astype(np.int64).reshape(-1) & 0xFF
    if bits == 8:
        return np.where(b > 127, b - 256, b)
    hi, lo = b >> 4, b & 0xF
    sign = lambda n: np.where(n > 7, n - 16, n)  # noqa: E731
    return np.stack([sign(hi), sign(lo)], axis=1).reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,groups", [(64, 8), (7 * 39 * 2, 7), (16384 * 2, 2), (2, 1)])
def test_quantize_dequantize_match_the_spec(dtype: torch.dtype, bits: int, numel: int, groups: int) -> None:
    x = _inputs(numel, groups, dtype, seed=numel * bits + groups)
    codes, scales = f.quantize(x, groups, bits, f.Symmetric)
    assert codes.dtype == torch.int8 and codes.shape == (numel * bits // 8,)
    assert scales.dtype == torch.float32 and scales.shape == (groups, 1)
    want_codes, want_scales = _spec_quantize(x, groups, bits)
    np.testing.assert_array_equal(_unpack(codes, bits), want_codes)
    np.testing.assert_array_equal(scales.numpy().reshape(-1), want_scales)

    per = numel // groups
    step = np.repeat(want_scales.astype(np.float64), per)
    exact = (want_codes * step).astype(np.float32)
    for out_dtype, got in ((torch.float16, f.dequantize(codes, scales, groups, bits, f.Symmetric)),
                           (torch.float32, f.dequantize_fp32(codes, scales, groups, bits, f.Symmetric)),
                           (dtype, f.dequantize_to(codes, scales, groups, bits, dtype))):
        assert got.dtype == out_dtype and got.shape == x.shape
        assert torch.equal(got, torch.from_numpy(exact).to(out_dtype))
    # The round trip: half a step, a whole one where the code clamped at 2**(bits-1) - 1.
    err = np.abs(exact.astype(np.float64) - x.double().numpy())
    clamped = want_codes == 2 ** (bits - 1) - 1
    assert np.all(err <= np.where(clamped, step, step / 2) * (1 + 2**-20) + np.abs(x.double().numpy()) * 2**-23)


def test_int4_packs_the_first_code_in_the_high_nibble() -> None:
    x = torch.tensor([7.0, -8.0, -1.0, 3.0], dtype=torch.float16)  # m = 8, s = 1: codes 7, -8, -1, 3
    codes, scales = f.quantize(x, 1, 4, f.Symmetric)
    assert codes.view(torch.uint8).tolist() == [0x78, 0xF3] and scales.tolist() == [[1.0]]


def test_swizzle_quant_orders_groups_slice_device_node() -> None:
    nodes, devices, pipeline, c = 2, 3, 2, 2
    groups, per = nodes * devices * pipeline * c, 16
    x = _inputs(groups * per, groups, torch.float16, seed=5)
    plain, plain_scales = f.quantize(x, groups, 4, f.Symmetric)
    codes, scales = f.swizzle_quant(x, groups, 4, f.Symmetric, pipeline, nodes, devices)
    assert codes.shape == (groups * per // 2,) and scales.shape == (groups, 1)
    rows, srows = plain.view(groups, -1), plain_scales.view(-1)
    out = 0
    for sl in range(pipeline):
        for d in range(devices):
            for n in range(nodes):
                for k in range(c):
                    src = ((n * devices + d) * pipeline + sl) * c + k
                    assert torch.equal(codes.view(groups, -1)[out], rows[src]) and scales[out, 0] == srows[src]
                    out += 1


def test_quantized_reduction_sums_in_fp16_and_requantizes() -> None:
    devices, in_groups, out_groups, per, bits = 3, 6, 4, 16, 4
    x = _inputs(in_groups * per, in_groups, torch.float16, seed=11)
    codes, scales = f.quantize(x, in_groups, bits, f.Symmetric)
    got, got_scales = f.quantized_reduction(codes, scales, in_groups, out_groups, bits, f.Symmetric, devices)
    assert got.shape == (codes.numel() // devices,) and got_scales.shape == (out_groups, 1)
    # Spec: each tensor's values to fp16, summed in fp16 in order (numpy's float16 additions round once).
    values = (_unpack(codes, bits) * np.repeat(scales.numpy().reshape(-1).astype(np.float64), per)).astype(
        np.float32).astype(np.float16).reshape(devices, -1)
    total = np.zeros(values.shape[1], dtype=np.float16)
    for j in range(devices):
        total = total + values[j]
    want_codes, want_scales = _spec_quantize(torch.from_numpy(total), out_groups, bits)
    np.testing.assert_array_equal(_unpack(got, bits), want_codes)
    np.testing.assert_array_equal(got_scales.numpy().reshape(-1), want_scales)


def test_dequantize_of_a_padded_gather_cut_to_size() -> None:
    """DeepSpeed's one-weight gather: 4 partitions of 40 (4 groups each), cut to 157 elements: group i // 10."""
    x = _inputs(160, 16, torch.float32, seed=3)
    codes, scales = f.quantize(x, 16, 8, f.Symmetric)
    full = f.dequantize_fp32(codes, scales, 16, 8, f.Symmetric)
    assert torch.equal(f.dequantize_fp32(codes[:157], scales, 16, 8, f.Symmetric), full[:157])


def test_errors_name_the_problem() -> None:
    x = torch.ones(12)
    with pytest.raises(ValueError, match="12 elements do not split into 5 groups"):
        f.quantize(x, 5, 8, f.Symmetric)
    with pytest.raises(ValueError, match="not 3-bit"):
        f.quantize(x, 1, 3, f.Symmetric)
    with pytest.raises(NotImplementedError, match="only Symmetric"):
        f.quantize(x, 1, 8, f.Asymmetric)
    with pytest.raises(ValueError, match="group 1 holds a non-finite value"):
        f.quantize(torch.tensor([1.0, 2.0, float("inf"), 0.0]), 2, 8, f.Symmetric)
    with pytest.raises(ValueError, match="int4 packs pairs"):
        f.quantize(torch.ones(6), 2, 4, f.Symmetric)
    with pytest.raises(ValueError, match="3 scales for 2 groups"):
        f.dequantize(torch.zeros(8, dtype=torch.int8), torch.ones(3), 2, 8, f.Symmetric)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [5, 63, 3969, 15813, 10007, 100042, 24000])
def test_cuda_quantizer_round_trip_any_size(dtype: torch.dtype, numel: int) -> None:
    """The stand-in: any size, codes of the input's shape, each value back within its group's bound, in its own
    dtype (bf16 beyond fp16's range too)."""
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * (1e5 if dtype == torch.bfloat16 else 1.0)).to(dtype)
    q = CUDAQuantizer()
    codes, scales = q.quantize(x)
    groups = group_count(numel, CUDAQuantizer.target_group_size)
    assert codes.shape == x.shape and codes.dtype == torch.int8 and scales.shape == (groups,)
    assert numel // groups <= CUDAQuantizer.target_group_size or numel // groups >= 8
    back = q.dequantize(codes, scales, dtype=dtype)
    assert back.dtype == dtype and q.dequantize(codes, scales).dtype == torch.float16
    step = scales.double().repeat_interleave(numel // groups)
    err = (back.double() - x.double()).abs()
    assert bool((err <= step * (1 + 2**-20) + x.double().abs() * 2**-7).all())


def _deepspeed_installed() -> bool:
    try:
        metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _deepspeed_installed(), reason="deepspeed is not installed")
def test_group_count_is_deepspeeds_for_the_sizes_it_accepts() -> None:
    """DeepSpeed's ``CUDAQuantizer.quantize`` group search (run with its op replaced by a recorder) and ours agree
    on every multiple of 8 up to 40000 and a few large ones: same codes and scales shapes on the wire."""
    from deepspeed.runtime.zero import partition_parameters

    class Recorder:
        Symmetric = f.Symmetric

        @staticmethod
        def quantize(param: torch.Tensor, groups: int, bits: int, kind: int) -> int:
            return groups

    ds = object.__new__(partition_parameters.CUDAQuantizer)
    ds.quantizer_cuda_module = Recorder
    ds.group_size_cache = {}
    sizes = list(range(8, 40001, 8)) + [8 * 50021, 2**20, 4096 * 11008 // 8]
    for n in sizes:
        assert ds.quantize(torch.empty(n, dtype=torch.float16)) == group_count(n, 8000), n
