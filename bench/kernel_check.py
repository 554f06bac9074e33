"""Bit-for-bit check of the kernels on a device against the torch reference on the CPU (``bench/kernels.py --check``).

Every op of the kernel benchmark runs once on the device (the Triton kernels on CUDA) and once with
``zeropp.quant.reference`` on CPU copies of the same inputs; codes and scales must be the same bytes and values the
same floats (NaN where NaN). Then one check past 2**31 elements: a single pack of ``2**31 + 2**21`` elements is
quantized and dequantized on the device (int64 offsets inside the kernels), and windows at its start and past
element 2**31 are compared with the reference on those blocks alone (blocks are independent). That check needs
about 10 GiB of device memory; ``--no-big`` skips it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zeropp import quant
from zeropp.quant import BlockFormat, reference

BIG = (1 << 31) + (1 << 21)


def same_floats(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN at the same places."""
    a, b = a.cpu(), b.cpu()
    return a.shape == b.shape and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def op_checks(n: int, dtype: torch.dtype, block_size: int, world: int, nodes: int, rpn: int,
              device: torch.device) -> list[tuple[str, Callable[[], bool]]]:
    """``(name, check)`` per benchmark op at ``n`` elements; ``check()`` says whether device and reference agree."""
    gen = torch.Generator().manual_seed(n)
    x_cpu = (torch.randn(n, generator=gen) * 10.0 ** (torch.rand(n, generator=gen) * 6 - 3)).to(dtype)
    x = x_cpu.to(device)
    checks = []

    def packs(fmt: BlockFormat, chunks: int, nodes_: int = 1) -> Callable[[], bool]:
        def check() -> bool:
            expected = torch.empty(fmt.chunked_bytes(n, chunks), dtype=torch.uint8)
            reference.quantize_chunks(x_cpu, fmt, chunks, nodes_, expected)
            return torch.equal(quant.quantize_chunks(x, fmt, chunks, nodes=nodes_).cpu(), expected)
        return check

    def dequant(fmt: BlockFormat, chunks: int) -> Callable[[], bool]:
        def check() -> bool:
            cn = quant.chunk_numel(n, chunks)
            buf = torch.empty(fmt.chunked_bytes(n, chunks), dtype=torch.uint8)
            reference.quantize_chunks(x_cpu, fmt, chunks, 1, buf)
            expected = torch.empty(n, dtype=dtype)
            reference.dequantize_chunks(buf, fmt, chunks, cn, expected)
            out = torch.empty(n, dtype=dtype, device=device)
            return same_floats(quant.dequantize_chunks(buf.to(device), fmt, chunks, cn, out), expected)
        return check

    def reduce(fmt: BlockFormat, d: int) -> Callable[[], bool]:
        def check() -> bool:
            cn = quant.chunk_numel(n, d * nodes)
            buf = torch.empty(fmt.chunked_bytes(n, d * nodes), dtype=torch.uint8)
            reference.quantize_chunks(x_cpu, fmt, d * nodes, 1, buf)
            expected = torch.empty(nodes * fmt.packed_bytes(cn), dtype=torch.uint8)
            reference.reduce_requantize(buf, fmt, d, nodes, cn, expected)
            return torch.equal(quant.reduce_requantize(buf.to(device), fmt, d, nodes, cn).cpu(), expected)
        return check

    def final(fmt: BlockFormat) -> Callable[[], bool]:
        def check() -> bool:
            cn = quant.chunk_numel(n, nodes)
            buf = torch.empty(fmt.chunked_bytes(n, nodes), dtype=torch.uint8)
            reference.quantize_chunks(x_cpu, fmt, nodes, 1, buf)
            expected = torch.empty(cn, dtype=torch.float32)
            reference.reduce_dequantize(buf, fmt, nodes, cn, expected, float(nodes * rpn))
            out = torch.empty(cn, dtype=dtype, device=device)
            quant.reduce_dequantize(buf.to(device), fmt, nodes, cn, out, divisor=nodes * rpn)
            return same_floats(out, expected.to(dtype))
        return check

    for bits in (8, 4):
        fmt = BlockFormat(bits, block_size)
        checks += [(f"quantize int{bits}", packs(fmt, 1)), (f"dequantize int{bits}", dequant(fmt, 1))]
    fmt8, fmt4 = BlockFormat(8, block_size), BlockFormat(4, block_size)
    checks.append((f"dequantize gathered int8 x{world}", dequant(fmt8, world)))
    checks.append((f"swizzle_quantize int4 {nodes}x{rpn}", packs(fmt4, nodes * rpn, nodes)))
    checks += [(f"reduce_requantize int4 d={d}", reduce(fmt4, d)) for d in (2, 4, 8)]
    checks.append((f"reduce_dequantize int4 g={nodes}", final(fmt4)))
    return checks


def big_check(dtype: torch.dtype, block_size: int, device: torch.device) -> bool:
    """Quantize and dequantize one pack of ``BIG`` elements on the device; compare windows at the start and past
    element 2**31 with the reference applied to those blocks alone."""
    fmt = BlockFormat(8, block_size)
    x = torch.empty(BIG, dtype=dtype, device=device)
    x.normal_(generator=torch.Generator(device=device).manual_seed(31))
    buf = quant.quantize_chunks(x, fmt, 1)
    out = torch.empty(BIG, dtype=dtype, device=device)
    quant.dequantize_chunks(buf, fmt, 1, BIG, out)
    codes_end = fmt.code_bytes(BIG)
    ok = True
    for start in (0, (1 << 31) + block_size * 3):
        window = slice(start, start + (1 << 20))
        first, last = start // block_size, (start + (1 << 20)) // block_size
        x_cpu = x[window].cpu()
        expected = torch.empty(fmt.packed_bytes(1 << 20), dtype=torch.uint8)
        reference.quantize_chunks(x_cpu, fmt, 1, 1, expected)
        got_codes = buf[first * fmt.block_code_bytes: last * fmt.block_code_bytes].cpu()
        got_scales = buf[codes_end + 4 * first: codes_end + 4 * last].cpu()
        ok &= torch.equal(got_codes, expected[: fmt.code_bytes(1 << 20)])
        ok &= torch.equal(got_scales, expected[fmt.code_bytes(1 << 20):])
        values = torch.empty(1 << 20, dtype=dtype)
        reference.dequantize_chunks(expected, fmt, 1, 1 << 20, values)
        ok &= same_floats(out[window], values)
    return bool(ok)
