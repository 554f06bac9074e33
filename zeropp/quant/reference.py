"""Plain torch implementation of every quantization op: the specification the Triton kernels are tested against.

It runs on any device and is the CPU backend. Inputs are assumed validated by ``zeropp.quant.ops``; layouts are
described in ``zeropp.quant.format``. Arithmetic is float32 throughout, in the order the kernels use, so integer
codes agree bit for bit.
"""

from __future__ import annotations

import torch

from .format import BlockFormat, swizzle_source

FLOAT32_MAX = torch.finfo(torch.float32).max


def quantize_blocks(blocks: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize float32 ``blocks`` of shape ``(num_blocks, block_size)``.

    Returns ``(codes, scales)``: uint8 codes of shape ``(num_blocks, block_code_bytes)`` and float32 scales of
    shape ``(num_blocks,)``.
    """
    qmax = fmt.qmax
    scales = blocks.abs().amax(dim=1) / qmax
    finite = torch.isfinite(scales)
    divisor = torch.where(finite & (scales > 0), scales, torch.ones_like(scales))
    q = torch.round(blocks / divisor[:, None]).clamp_(-qmax, qmax)
    q = torch.where(finite[:, None], q, torch.zeros_like(q)).to(torch.int16)
    if fmt.bits == 4:
        q = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)
    codes = (q & 0xFF).to(torch.uint8)
    return codes, scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Float32 values of shape ``(num_blocks, block_size)`` from uint8 ``codes`` and float32 ``scales``.

    ``code * scale``, clamped to the finite float32 range (NaN stays NaN: a block with a non-finite scale comes
    out all NaN).
    """
    c = codes.to(torch.int16)
    if fmt.bits == 8:
        q = (c ^ 0x80) - 0x80
    else:
        lo = ((c & 0xF) ^ 8) - 8
        hi = (((c >> 4) & 0xF) ^ 8) - 8
        q = torch.stack((lo, hi), dim=2).view(c.shape[0], fmt.block_size)
    # code * scale can round past the float32 range when the block's absmax is within an ulp of it
    return torch.clamp(q.to(torch.float32) * scales[:, None], -FLOAT32_MAX, FLOAT32_MAX)


def _split_pack(packs: torch.Tensor, fmt: BlockFormat, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(rows * blocks, block_code_bytes)`` and scales ``(rows * blocks,)`` of ``(rows, pack_bytes)`` packs."""
    rows = packs.shape[0]
    split = blocks * fmt.block_code_bytes
    codes = packs[:, :split].reshape(rows * blocks, fmt.block_code_bytes)
    scales = packs[:, split:].contiguous().view(torch.float32).reshape(rows * blocks)
    return codes, scales


def _dequantize_packs(packs: torch.Tensor, fmt: BlockFormat, blocks: int) -> torch.Tensor:
    """Float32 ``(rows, blocks * block_size)`` values of ``(rows, pack_bytes)`` packs."""
    codes, scales = _split_pack(packs, fmt, blocks)
    return dequantize_blocks(codes, scales, fmt).view(packs.shape[0], blocks * fmt.block_size)


def _write_packs(rows: torch.Tensor, fmt: BlockFormat, out: torch.Tensor) -> None:
    """Quantize float32 ``rows`` of shape ``(r, blocks * block_size)`` into ``r`` packs in the uint8 ``out``."""
    r, width = rows.shape
    blocks = width // fmt.block_size
    codes, scales = quantize_blocks(rows.reshape(r * blocks, fmt.block_size), fmt)
    packs = out.view(r, -1)
    split = blocks * fmt.block_code_bytes
    packs[:, :split] = codes.view(r, split)
    packs[:, split:] = scales.view(r, blocks).view(torch.uint8)


def quantize_chunks(x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor) -> None:
    """Pack flat ``x`` as ``chunks`` slices into ``out``, slices reordered by the qgZ swizzle when ``nodes > 1``."""
    numel = x.numel()
    if numel == 0:
        return
    slice_numel = -(-numel // chunks)
    blocks = fmt.num_blocks(slice_numel)
    rows = torch.zeros(chunks, blocks * fmt.block_size, dtype=torch.float32, device=x.device)
    full = numel // slice_numel
    rows[:full, :slice_numel] = x[: full * slice_numel].view(full, slice_numel)
    rest = numel - full * slice_numel
    if rest:
        rows[full, :rest] = x[full * slice_numel :]
    if nodes > 1:
        ranks_per_node = chunks // nodes
        order = [swizzle_source(p, nodes, ranks_per_node) for p in range(chunks)]
        rows = rows[torch.tensor(order, device=x.device)]
    _write_packs(rows, fmt, out)


def dequantize_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Dequantize ``chunks`` packs of ``chunk_numel`` elements each into the first elements of flat ``out``."""
    if out.numel() == 0:
        return
    blocks = fmt.num_blocks(chunk_numel)
    values = _dequantize_packs(buf.view(chunks, -1), fmt, blocks)[:, :chunk_numel]
    out.copy_(values.reshape(-1)[: out.numel()])


def _sum_groups(buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int) -> torch.Tensor:
    """Float32 ``(chunks, blocks * block_size)``: chunk ``m`` is the sum over ``i`` of pack ``i * chunks + m``."""
    blocks = fmt.num_blocks(chunk_numel)
    packs = buf.view(groups, chunks, -1)
    acc = torch.zeros(chunks, blocks * fmt.block_size, dtype=torch.float32, device=buf.device)
    for i in range(groups):
        acc += _dequantize_packs(packs[i], fmt, blocks)
    return acc


def reduce_requantize(
    buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Sum ``groups`` runs of ``chunks`` packs pack-wise in float32 and pack the ``chunks`` sums into ``out``."""
    if chunk_numel == 0:
        return
    _write_packs(_sum_groups(buf, fmt, groups, chunks, chunk_numel), fmt, out)


def reduce_dequantize(
    buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, out: torch.Tensor, divisor: float
) -> None:
    """Sum ``groups`` packs in float32, divide by ``divisor`` and write the first ``out.numel()`` values."""
    if out.numel() == 0:
        return
    acc = _sum_groups(buf, fmt, groups, 1, chunk_numel)[0, : out.numel()]
    # A tensor divisor, not a Python scalar: on CUDA torch turns division by a scalar into a reciprocal multiply.
    out.copy_(acc / torch.tensor(divisor, dtype=torch.float32, device=acc.device))
