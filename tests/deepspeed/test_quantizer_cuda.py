"""DeepSpeed's real quantizer op (``op_builder.QuantizerBuilder().load()``, JIT-built with nvcc) against
``zeropp.deepspeed.ds_format`` on a GPU. Run it alone (the build takes minutes the first time):

    DS_ACCELERATOR=cuda .venv/bin/python -m pytest -q tests/deepspeed/test_quantizer_cuda.py

Skipped without CUDA, nvcc or DeepSpeed. fp16 inputs (what the kernels read), sizes within the kernels' limits
(groups of a multiple of 8 elements, at most 16384). DeepSpeed builds with ``--use_fast_math``: the kernel's
divisions ``256 / (2 m)`` and ``1 / s`` are approximate, so scales are compared within 4 ulp and codes bit for bit
except at most one step where the reference's ``x * s`` lies within ``1e-4`` of a rounding tie. Everything that
takes codes and scales as given (``dequantize``, the fp16 sums of ``quantized_reduction``) is compared bit for bit
by feeding both sides the kernel's codes and scales.
"""

from __future__ import annotations

import os
import shutil
from importlib import metadata

import pytest
import torch

from zeropp.deepspeed import ds_format as f


def _missing() -> str | None:
    try:
        metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return "deepspeed is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "no nvcc on PATH and no CUDA_HOME: DeepSpeed's QuantizerBuilder cannot build its op"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture(scope="module")
def op():
    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    from deepspeed.ops.op_builder import QuantizerBuilder

    return QuantizerBuilder().load()


def _inputs(numel: int, groups: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = 10 ** (torch.rand(groups, 1, generator=g) * 6 - 3)
    x = torch.randn(groups, numel // groups, generator=g) * scale
    x[groups // 2] = 0
    return x.reshape(-1).half().cuda()


def _unpacked(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return f._unpack(codes.reshape(-1).cpu(), bits)


def _assert_scales_close(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.reshape(-1).cpu().double(), want.reshape(-1).cpu().double()
    assert bool(((got - want).abs() <= want.abs() * 4 * 2**-23).all()), (got, want)


def _assert_codes_close(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, scales: torch.Tensor,
                        bits: int) -> None:
    """Equal, or one step apart where ``x * s`` is within 1e-4 of a tie (``s = 1 / scale``)."""
    got, want = _unpacked(got, bits), _unpacked(want, bits)
    per = x.numel() // scales.numel()
    prod = x.cpu().float() * (1.0 / scales.reshape(-1).cpu()).repeat_interleave(per)
    near_tie = ((prod - prod.floor()) - 0.5).abs() < 1e-4
    diff = (got - want).abs()
    assert bool((diff <= 1).all()) and bool((near_tie | (diff == 0)).all()), int((diff > 0).sum())


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel,groups", [(64, 8), (8000 * 3, 3), (16384 * 2, 2), (4096 * 33, 33 * 8)])
def test_quantize_and_dequantize_match_the_kernels(op, bits: int, numel: int, groups: int) -> None:
    x = _inputs(numel, groups, seed=numel + bits)
    got_codes, got_scales = op.quantize(x, groups, bits, op.Symmetric)
    want_codes, want_scales = f.quantize(x, groups, bits, f.Symmetric)
    assert got_codes.shape == want_codes.shape and got_scales.shape == want_scales.shape
    _assert_scales_close(got_scales, want_scales)
    _assert_codes_close(got_codes, want_codes, x, want_scales, bits)
    for kernel, ours in ((op.dequantize, f.dequantize), (op.dequantize_fp32, f.dequantize_fp32)):
        got = kernel(got_codes, got_scales, groups, bits, op.Symmetric)
        want = ours(got_codes.cpu(), got_scales.cpu(), groups, bits, f.Symmetric)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


def test_cuda_quantizer_class_matches(op) -> None:
    """DeepSpeed's ``CUDAQuantizer`` (its group search, its fp16 cast) and the stand-in on fp16 weights."""
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer as DeepSpeeds

    from zeropp.deepspeed.quantizer import CUDAQuantizer

    x = _inputs(4096 * 6, 6, seed=1)
    got_codes, got_scales = DeepSpeeds().quantize(x)
    want_codes, want_scales = CUDAQuantizer().quantize(x)
    assert got_scales.numel() == want_scales.numel()
    _assert_scales_close(got_scales, want_scales)
    _assert_codes_close(got_codes, want_codes.cuda(), x, want_scales, 8)
    assert torch.equal(DeepSpeeds().dequantize(got_codes, got_scales).cpu(),
                       CUDAQuantizer().dequantize(got_codes.cpu(), got_scales.cpu()))


@pytest.mark.parametrize("nodes,devices", [(2, 4), (1, 8), (3, 2)])
def test_swizzle_quant_matches_the_kernel(op, nodes: int, devices: int) -> None:
    groups = nodes * devices * 4
    x = _inputs(groups * 256, groups, seed=nodes * devices)
    got_codes, got_scales = op.swizzle_quant(x, groups, 4, op.Symmetric, 1, nodes, devices)
    want_codes, want_scales = f.swizzle_quant(x, groups, 4, f.Symmetric, 1, nodes, devices)
    _assert_scales_close(got_scales, want_scales)
    swizzled_x = x.view(nodes, devices, 1, 4, -1).permute(2, 1, 0, 3, 4).reshape(-1)
    _assert_codes_close(got_codes, want_codes, swizzled_x, want_scales, 4)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_quantized_reduction_matches_the_kernel(op, devices: int) -> None:
    """Fed the same (kernel-made) codes and scales: the fp16 sums are exact arithmetic, so the requantized output
    differs only by the fast-math division."""
    in_groups, out_groups = devices * 8, 8
    x = _inputs(in_groups * 512, in_groups, seed=devices)
    codes, scales = op.quantize(x, in_groups, 4, op.Symmetric)
    got_codes, got_scales = op.quantized_reduction(codes, scales, in_groups, out_groups, 4, op.Symmetric, devices)
    want_codes, want_scales = f.quantized_reduction(codes.cpu(), scales.cpu(), in_groups, out_groups, 4,
                                                    f.Symmetric, devices)
    _assert_scales_close(got_scales, want_scales)
    total = torch.zeros(x.numel() // devices, dtype=torch.float16)
    parts = f.dequantize(codes.cpu(), scales.cpu(), in_groups, 4, f.Symmetric).view(devices, -1)
    for j in range(devices):
        total = (total.float() + parts[j].float()).half()
    _assert_codes_close(got_codes, want_codes, total, want_scales, 4)
