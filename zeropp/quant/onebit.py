"""1-bit (sign and scale) compression of 1-bit Adam's momentum: the format and its torch implementation.

A row of ``n`` fp32 values (``n`` a multiple of the block size ``B``, ``B`` a multiple of 8) is sent as

* ``n / 8`` bytes of signs: bit ``j`` of byte ``i`` is element ``8 i + j``, 1 where the value is ``>= 0`` (so 0 is
  sent as ``+scale``, as DeepSpeed's ``compressed_allreduce`` does), 0 where it is negative;
* then ``n / B`` float32 scales, one per block of ``B`` consecutive elements, as their bytes: the block's root mean
  square ``||x_b||_2 / sqrt(B)`` (DeepSpeed's scale, which it takes per whole tensor).

The decoded value of element ``i`` of block ``b`` is ``scale_b`` or ``-scale_b``: ``n / 8 + 4 n / B`` bytes instead
of ``4 n`` in fp32 (1/25.6 of them at ``B = 128``, 1/31.5 at ``B = 2048``). Several rows (one per destination rank)
are compressed in one call, each with its own blocks. Pure tensor ops (any device), the only implementation (no
Triton or native kernel); no torch.distributed.
"""

from __future__ import annotations

import torch

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


def onebit_packed_bytes(numel: int, block_size: int) -> int:
    """Bytes of one compressed row of ``numel`` elements: ``numel / 8`` of signs and ``4 * numel / block_size`` of
    scales."""
    _check_row(numel, block_size)
    return numel // 8 + 4 * (numel // block_size)


def onebit_compress(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """The rows of ``x`` (float32, shape ``(rows, n)``) compressed: a uint8 tensor of shape ``(rows,
    onebit_packed_bytes(n, block_size))`` (signs, then scales; see the module docstring)."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"onebit_compress takes a 2-D float32 tensor (rows, n), got {x.dtype} of shape "
                         f"{tuple(x.shape)}")
    rows, n = x.shape
    _check_row(n, block_size)
    scales = x.view(rows, n // block_size, block_size).square().mean(dim=2).sqrt_()
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=x.device)
    signs = (x >= 0).view(rows, n // 8, 8).to(torch.uint8).mul_(weights).sum(dim=2, dtype=torch.uint8)
    return torch.cat([signs, scales.view(torch.uint8).view(rows, -1)], dim=1)


def onebit_decompress(packed: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    """The float32 values ``(rows, numel)`` of ``packed`` (``onebit_compress``'s rows of ``numel`` elements):
    ``+scale`` or ``-scale`` of each element's block."""
    nbytes = onebit_packed_bytes(numel, block_size)
    if packed.dim() != 2 or packed.dtype != torch.uint8 or packed.shape[1] != nbytes:
        raise ValueError(f"onebit_decompress takes uint8 rows of {nbytes} bytes ({numel} elements, block "
                         f"{block_size}), got {packed.dtype} of shape {tuple(packed.shape)}")
    rows = packed.shape[0]
    signs, scale_bytes = packed[:, : numel // 8], packed[:, numel // 8 :]
    scales = scale_bytes.contiguous().view(torch.float32).view(rows, numel // block_size, 1)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = signs.unsqueeze(2).bitwise_right_shift(shifts).bitwise_and_(1)  # (rows, n / 8, 8)
    sign = bits.view(rows, numel // block_size, block_size).to(torch.float32).mul_(2).sub_(1)
    return sign.mul_(scales).view(rows, numel)


def _check_row(numel: int, block_size: int) -> None:
    if block_size < 8 or block_size % 8 or numel % block_size:
        raise ValueError(f"a 1-bit row of {numel} elements in blocks of {block_size}: the block size must be a "
                         "multiple of 8 and divide the row")
