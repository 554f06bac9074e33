"""Quantized differences: the packs the weight-delta tier (``zeropp.engine.weight_deltas``) sends with ``exchange``.

``pack_delta(target, reference)`` block-quantizes ``target - reference`` (both flat, any float dtype, the
difference taken in float32; for one dtype ``zeropp.quant.quantize_delta``, fused) into one pack
(``zeropp.quant.format``: codes then float32 scales, ``fmt.packed_bytes(n)`` bytes). ``add_delta(pack, into)``
dequantizes a pack to float32, adds ``into`` (upcast to float32) and writes the sum back into ``into``, rounded once
to its dtype: one fused pass (``zeropp.quant.dequantize_add_chunks``), no temporary. The same pack added to the same
values gives the same bits on every rank (the same kernels on the same device type): a sender that adds its own pack
to its copy of the reference holds exactly what the receivers hold.
"""

from __future__ import annotations

import torch

from ..quant import BlockFormat, dequantize_add_chunks, quantize_chunks, quantize_delta


def pack_delta(target: torch.Tensor, reference: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The pack (uint8, ``fmt.packed_bytes(n)`` bytes) of ``target - reference`` in float32 (``n`` elements each,
    flat, on one device)."""
    if target.numel() != reference.numel():
        raise ValueError(f"target has {target.numel()} elements but reference has {reference.numel()}")
    if target.dtype == reference.dtype:
        return quantize_delta(target, reference, fmt)  # fused where the native CPU library runs
    delta = target.reshape(-1).to(torch.float32) - reference.reshape(-1).to(torch.float32)
    return quantize_chunks(delta, fmt)


def add_delta(pack: torch.Tensor, into: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``into = dtype(D(pack) + float32(into))``, in place (``into`` flat contiguous, the pack's element count);
    returns ``into``."""
    dequantize_add_chunks(pack, fmt, 1, into.numel(), into.view(-1))
    return into
