"""DeepSpeed 0.19.8's quantizer op (``op_builder.QuantizerBuilder().load()``) as plain torch: its function names,
arguments and wire format, on any device and dtype, with nothing to build.

This module IS the spec: every function below is the reference, vectorized torch, read from DeepSpeed's sources
``csrc/quantization/{pt_binding.cpp, quantize.cu, dequantize.cu, swizzled_quantize.cu, quant_reduce.cu}`` and
``csrc/includes/{quantization_utils.h, dequantization_utils.h, quantization.h}``. ``quantizer.CUDAQuantizer``
(the ``partition_parameters.CUDAQuantizer`` stand-in) runs on it; tests/deepspeed/test_quantizer_cuda.py compares
it with the CUDA op on a GPU.

Format (symmetric, the only type DeepSpeed's ZeRO asks for; ``Asymmetric`` raises ``NotImplementedError``)
----------------------------------------------------------------------------------------------------------
* Groups: a tensor of ``N`` elements (flattened, row-major) and ``groups`` = ``G`` are ``G`` consecutive groups of
  ``E = N / G`` elements: element ``i`` is in group ``i // E``. The kernels need ``N % G == 0`` and ``E % 8 == 0``
  (they move 8 fp16 values per 16-byte chunk; a chunk crossing a group boundary takes its first element's group)
  and ``E <= 16384`` (quantize's launcher has no case above). The reference needs ``N % G == 0`` (and ``E`` even
  for int4), nothing else.
* Codes, ``b`` bits (8 or 4): per group ``m = max |x|`` (of the fp16 values: exact), then in float32
  ``s = 2**b / (2 * m)`` (``s = 1`` when ``m == 0``), ``q = clamp(round_half_even(x * s), -2**(b-1), 2**(b-1) - 1)``.
  The step is ``m / 2**(b-1)`` (int8: ``m / 128``, not ``m / 127``): ``+m`` maps to 128 and clamps to 127, ``-m``
  to -128.
* Scale tensor: float32, shape ``(G, 1)``, holding the INVERSE of ``s``: ``1 / s`` (``= m / 2**(b-1)`` up to float
  rounding; 1.0 for an all-zero group). Dequantize multiplies: ``x' = float(q) * scale``, rounded once to the
  output dtype (round to nearest even).
* Codes tensor: int8, the input's shape; int4 packs two codes per byte, the last dimension halved, the FIRST of a
  pair in the HIGH nibble: ``byte = (q[2k] & 0xF) << 4 | (q[2k+1] & 0xF)`` (``PackedInt4 {high: 4; low: 4}`` with
  ``PackedInt4{q[2k+1], q[2k]}``; the nibbles are signed).
* Round trip: ``|x' - x| <= scale / 2``, except the positive values clamped (``x * s > 2**(b-1) - 1/2``), within
  ``scale``; plus the output dtype's rounding of ``x'``.
* Float details: DeepSpeed builds its ops with ``--use_fast_math``, so the kernel's two float divisions
  (``256 / (2 m)``, then ``1 / s``) are approximate (a few ulp); here they are IEEE. Scales agree within a few ulp and
  codes agree except where ``x * s`` lies within that error of a rounding tie. Dequantize of given codes and scales
  is exact float arithmetic in both: bit for bit.

Input dtype: the kernels read fp16 only (``CUDAQuantizer.quantize`` casts to fp16 first: bf16 above 65504 becomes
inf). The reference computes the same formula on the input's own values in float32: bit for bit the kernel's for
fp16 inputs, and without the fp16 detour for bf16 and fp32 (the wire format is unchanged: int8 codes, float32
``1 / s``).

qgZ's kernels (``runtime.comm.coalesced_collectives.all_to_all_quant_reduce``; zeropp's patches bypass them)
-----------------------------------------------------------------------------------------------------------
* ``swizzle_quant(x, G, b, Symmetric, pipeline, nodes, devices_per_node)``: ``quantize`` with ``G`` groups, then
  the groups permuted for the all-to-all: with ``P = nodes * devices_per_node`` partitions of ``G / P`` groups,
  each split in ``pipeline`` slices of ``C = G / P / pipeline`` groups, input group ``(node, device, slice, c)``
  (partition ``node * devices_per_node + device``) goes to output group ``(slice, device, node, c)``. Codes are
  returned flat (``N * b / 8`` bytes), scales ``(G, 1)`` in the same order.
* ``quantized_reduction(codes, scales, in_groups, out_groups, b, Symmetric, devices_per_node)``: the codes hold
  ``devices_per_node`` equal tensors back to back, each with ``in_groups / devices_per_node`` groups (their scales
  back to back alike). Every value is dequantized to fp16 (``x' = fp16(float(q) * scale)``), the tensors are
  SUMMED in fp16 in order (each addition rounded to fp16; no division), and the sum is quantized with
  ``out_groups`` groups (as ``quantize``, absmax of the fp16 sums). Returns codes with the last dimension divided by
  ``devices_per_node`` and scales ``(out_groups, 1)``. DeepSpeed's caller then sums the nodes' dequantized results
  and divides by the number of nodes: its qgZ returns ``sum / nodes``, ``devices_per_node`` times the mean.
* ``dequantize(codes, scales, G, b, Symmetric)`` returns fp16, ``dequantize_fp32`` float32, the same values
  before the output rounding. Where ``N % G != 0`` (DeepSpeed's gather of a padded partition cut to the
  parameter's size) the kernel's ``E = N // G`` misplaces groups; the reference uses ``E = ceil(N / G)``, the
  layout of those gathers (equal to the kernel's wherever the kernel is right).
"""

from __future__ import annotations

import enum

import torch

MAX_GROUP_ELEMENTS = 16384
"""Largest group quantize's CUDA launcher handles (the reference has no limit)."""


class QuantizationType(enum.IntEnum):
    """``quantize::Type`` (pybind ``QuantizationType``)."""

    Symmetric = 0
    Asymmetric = 1


Symmetric = QuantizationType.Symmetric
Asymmetric = QuantizationType.Asymmetric


def _check(num_bits: int, quant_type: int) -> None:
    if num_bits not in (4, 8):
        raise ValueError(f"DeepSpeed's quantizer has 8- and 4-bit codes, not {num_bits}-bit: pass 8 or 4")
    if quant_type != Symmetric:
        raise NotImplementedError(
            f"quantization type {quant_type!r}: only Symmetric (DeepSpeed's ZeRO uses nothing else) is provided; "
            "build DeepSpeed's QuantizerBuilder op for Asymmetric"
        )


def _group_scales(values: torch.Tensor, num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` float32 ``(G, E)`` -> (``s`` per group ``(G, 1)``, stored ``1 / s`` ``(G, 1)``), float32."""
    absmax = values.abs().amax(dim=1, keepdim=True)
    if not bool(torch.isfinite(absmax).all()):
        bad = int((~torch.isfinite(absmax)).nonzero()[0, 0])
        raise ValueError(f"group {bad} holds a non-finite value (inf or nan): its codes would be meaningless")
    levels = torch.tensor(float(1 << num_bits), dtype=torch.float32, device=values.device)
    s = torch.where(absmax == 0, torch.ones_like(absmax), levels / (2 * absmax))
    return s, 1.0 / s


def _codes(values: torch.Tensor, s: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Rounded, clamped codes (int16, ``values``' shape) of float32 ``values`` ``(G, E)`` with ``s`` ``(G, 1)``."""
    top = 1 << (num_bits - 1)
    return torch.round(values * s).clamp_(-top, top - 1).to(torch.int16)


def _pack(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int16 codes (flat) -> int8 bytes; int4: first of each pair in the high nibble."""
    if num_bits == 8:
        return codes.to(torch.int8)
    pairs = (codes & 0xF).view(-1, 2)
    return ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8).view(torch.int8)


def _unpack(data: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int8 bytes (flat) -> int16 codes, signed."""
    if num_bits == 8:
        return data.to(torch.int16)
    b = data.to(torch.int16)
    high = b >> 4
    low = ((b & 0xF) ^ 8) - 8
    return torch.stack((high, low), dim=1).reshape(-1)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    numel = x.numel()
    if groups < 1 or numel % groups:
        raise ValueError(
            f"{numel} elements do not split into {groups} groups: pass a group count dividing the size"
        )
    return x.reshape(groups, numel // groups).float()


def quantize(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: int) -> list[torch.Tensor]:
    """``quantize_kernel``: ``[codes, scales]`` — int8 codes of ``input_vals``' shape (int4: last dimension halved),
    float32 scales ``(groups, 1)`` holding ``1 / s``. Any float dtype (see the module docstring)."""
    _check(num_bits, quant_type)
    values = _grouped(input_vals, groups)
    if num_bits == 4 and values.shape[1] % 2:
        raise ValueError(f"int4 packs pairs within a group: {values.shape[1]} elements a group is odd")
    s, stored = _group_scales(values, num_bits)
    packed = _pack(_codes(values, s, num_bits).reshape(-1), num_bits)
    shape = list(input_vals.shape) or [1]
    shape[-1] //= 8 // num_bits
    return [packed.view(shape), stored]


def _dequantize(quantized: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, dtype: torch.dtype
                ) -> torch.Tensor:
    codes = _unpack(quantized.reshape(-1), num_bits)
    numel = codes.numel()
    scales = params.reshape(-1).float()
    if scales.numel() != groups:
        raise ValueError(f"{scales.numel()} scales for {groups} groups: pass one scale per group")
    per_group = -(-numel // groups)
    if groups * per_group - numel >= per_group:
        raise ValueError(f"{numel} elements cannot fill {groups} groups: pass the scales of these codes")
    index = torch.arange(numel, device=codes.device) // per_group
    out = (codes.float() * scales[index]).to(dtype)
    shape = list(quantized.shape) or [1]
    shape[-1] *= 8 // num_bits
    return out.view(shape)


def dequantize(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int, quant_type: int
               ) -> torch.Tensor:
    """``dequantize<__half>``: fp16 values ``float(q) * scale`` of the codes' shape (int4: last dimension doubled)."""
    _check(num_bits, quant_type)
    return _dequantize(quantized_data, params, groups, num_bits, torch.float16)


def dequantize_fp32(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
                    quant_type: int) -> torch.Tensor:
    """``dequantize<float>``: as ``dequantize``, float32."""
    _check(num_bits, quant_type)
    return _dequantize(quantized_data, params, groups, num_bits, torch.float32)


def dequantize_to(quantized_data: torch.Tensor, params: torch.Tensor, groups: int, num_bits: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Symmetric ``float(q) * scale`` rounded once into ``dtype`` (not a kernel: bf16 without the fp16 detour)."""
    _check(num_bits, Symmetric)
    return _dequantize(quantized_data, params, groups, num_bits, dtype)


def swizzle_quant(input_vals: torch.Tensor, groups: int, num_bits: int, quant_type: int, pipeline_size: int,
                  nodes: int, devices_per_node: int) -> list[torch.Tensor]:
    """``ds_swizzle_quant``: ``quantize`` with ``groups`` groups, groups permuted from (node, device, slice, c) to
    (slice, device, node, c); flat codes, scales ``(groups, 1)`` in the output order."""
    partitions = nodes * devices_per_node
    if groups % partitions or (groups // partitions) % pipeline_size:
        raise ValueError(
            f"{groups} groups do not split into {nodes} nodes x {devices_per_node} devices x {pipeline_size} "
            "slices: pass a group count that is a multiple of their product"
        )
    codes, scales = quantize(input_vals.reshape(-1), groups, num_bits, quant_type)
    c = groups // partitions // pipeline_size

    def swizzle(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(nodes, devices_per_node, pipeline_size, c, -1).permute(2, 1, 0, 3, 4).reshape(-1)

    return [swizzle(codes), swizzle(scales).view(groups, 1)]


def quantized_reduction(input_vals: torch.Tensor, input_scales: torch.Tensor, in_groups: int, out_groups: int,
                        num_bits: int, quant_type: int, devices_per_node: int) -> list[torch.Tensor]:
    """``quantized_reduction``: the ``devices_per_node`` tensors in ``input_vals`` dequantized to fp16, summed in
    fp16 in order, requantized with ``out_groups`` groups. Returns codes (last dimension / ``devices_per_node``)
    and scales ``(out_groups, 1)``."""
    _check(num_bits, quant_type)
    if input_vals.numel() % devices_per_node or in_groups % devices_per_node:
        raise ValueError(
            f"{input_vals.numel()} bytes and {in_groups} groups do not split into {devices_per_node} tensors"
        )
    tensors = input_vals.reshape(devices_per_node, -1)
    scales = input_scales.reshape(devices_per_node, -1)
    total = torch.zeros(tensors.shape[1] * (8 // num_bits), dtype=torch.float16, device=input_vals.device)
    for j in range(devices_per_node):
        part = _dequantize(tensors[j], scales[j], in_groups // devices_per_node, num_bits, torch.float16)
        total = (total.float() + part.float()).half()  # one fp16 rounding per addition (float32 is exact enough)
    codes, out_scales = quantize(total, out_groups, num_bits, quant_type)
    shape = list(input_vals.shape)
    shape[-1] //= devices_per_node
    return [codes.view(shape), out_scales]
