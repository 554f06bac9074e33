"""Triton block Hadamard rotation: the spec of ``zeropp.quant.rotation`` bit for bit.

A program rotates ``BLOCKS`` consecutive blocks of ``SIZE`` elements, held as a ``[BLOCKS, SIZE]`` float32 tile
(a bfloat16 or float16 input is widened as it is loaded, exactly). Stage
``h`` of the butterfly views the tile as ``[BLOCKS * SIZE / (2h), 2, h]`` (the pairs ``(j, j + h)`` on the middle
axis), splits it into the halves ``a`` and ``b`` and joins ``a + b`` and ``a - b`` back in place: only float32
additions, in the spec's stage order (``tl.static_range`` unrolls the stages), launched with
``enable_fp_fusion=False`` so the inverse's multiplication by ``1 / SIZE`` is never fused. ``butterfly`` is the
stage loop on any ``[ROWS, COLS]`` tile, which the quantize and final-reduce kernels apply to their tiles for qgZ's
fused rotation (``quantize.quantize_chunks_rotated``, ``reduce.reduce_dequantize_rotated``).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096
"""Elements per program (``BLOCKS * SIZE``)."""

NUM_WARPS = 4


@triton.jit
def butterfly(v, ROWS: tl.constexpr, COLS: tl.constexpr, SIZE: tl.constexpr, LOG_SIZE: tl.constexpr,
              INVERSE: tl.constexpr):
    """Float32 tile ``v`` of ``[ROWS, COLS]`` (``COLS`` a multiple of ``SIZE``), read row after row as blocks of
    ``SIZE`` consecutive elements, each through the butterfly (times ``1 / SIZE`` if ``INVERSE``); the same shape
    back. The quantize and final-reduce kernels call it on their ``[BLOCKS, BLOCK_SIZE]`` tiles (the fused rotation)."""
    for stage in tl.static_range(LOG_SIZE):
        pairs = tl.permute(tl.reshape(v, (ROWS * COLS // (2 << stage), 2, 1 << stage)), (0, 2, 1))
        a, b = tl.split(pairs)
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, COLS))
    if INVERSE:
        v = v * (1.0 / SIZE)
    return v


@triton.jit
def _hadamard_kernel(x_ptr, out_ptr, numel, total, SIZE: tl.constexpr, LOG_SIZE: tl.constexpr,
                     BLOCKS: tl.constexpr, INVERSE: tl.constexpr):
    """``out_ptr[0:total]`` (``total`` a multiple of ``SIZE``) = the blocks of ``x_ptr[0:numel]``, zero-padded,
    through the butterfly (times ``1 / SIZE`` if ``INVERSE``); program ``program_id(0)`` does ``BLOCKS`` blocks."""
    start = tl.program_id(0).to(tl.int64) * (BLOCKS * SIZE)
    offsets = start + tl.arange(0, BLOCKS)[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
    v = tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0).to(tl.float32)
    v = butterfly(v, BLOCKS, SIZE, SIZE, LOG_SIZE, INVERSE)
    tl.store(out_ptr + offsets, v, mask=offsets < total)


def hadamard(x: torch.Tensor, size: int, inverse: bool, out: torch.Tensor) -> None:
    """As ``rotation.hadamard``: flat ``x`` (float32, bfloat16 or float16, widened exactly in the kernel) and float32
    ``out``, on the same device."""
    blocks = max(1, TILE_ELEMENTS // size)
    total = out.numel()
    grid = (triton.cdiv(total, blocks * size),)
    guard = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with guard:
        _hadamard_kernel[grid](x, out, x.numel(), total, SIZE=size, LOG_SIZE=size.bit_length() - 1, BLOCKS=blocks,
                               INVERSE=inverse, num_warps=NUM_WARPS, enable_fp_fusion=False)
