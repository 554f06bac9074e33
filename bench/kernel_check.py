"""Bit-for-bit checks of the kernels against the torch reference, for ``bench/kernels.py --check``.

**Per row.** Each benchmark row names the output tensor its kernel writes and an ``expected`` function: the torch
reference (``zeropp.quant.reference``, the specification) applied on the CPU to copies of the row's own inputs,
the very tensors that are timed. ``compare`` then wants the same bytes for packs (codes and float32 scales) and the
same values for floats (NaN where NaN) and says where they first differ.

**Past 2^31 elements.** ``far_checks`` runs the ops on tensors of just over 2^31 elements (and packed buffers over
2^31 bytes), where a 32-bit offset would wrap, and compares windows of whole blocks: at the start of each pack, at
its end, and around element ``far`` (default 2^31) of the input or output. Blocks are independent, so the reference
applied to a window's blocks alone gives the window's exact expected bytes: no full-size reference is needed.
On the device that takes about 12 GiB at fp16 (``far_memory``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zeropp import quant
from zeropp.quant import BlockFormat, reference, rotation

FAR_NUMEL = (1 << 31) + (1 << 22)
"""Elements of the input of ``far_checks`` on a GPU: past 2^31, divisible by 4 packs of whole 2048-blocks."""


@dataclass(frozen=True)
class PackLayout:
    """How to read a chunked buffer: ``packs`` packs of ``pack_numel`` elements in ``fmt``."""

    fmt: BlockFormat
    packs: int
    pack_numel: int


def same_floats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal values, or NaN in both (a bool tensor)."""
    return (a == b) | (a.isnan() & b.isnan())


def _first_difference(mask: torch.Tensor) -> tuple[int, int]:
    """``(count, first index)`` of the False entries of the flat ``mask``."""
    bad = (~mask).reshape(-1)
    count = int(bad.sum())
    return count, int(bad.to(torch.uint8).argmax()) if count else -1  # argmax: the first of the maxima


def compare(got: torch.Tensor, want: torch.Tensor, layout: PackLayout | None = None) -> str | None:
    """``None`` when ``got`` equals ``want`` bit for bit (values: NaN where NaN), else what differs and where first.

    ``want`` may live on another device (it is moved to ``got``'s). With ``layout`` the bytes are packs, and codes
    and scales are told apart."""
    want = want.to(got.device)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if got.dtype != torch.uint8:
        count, first = _first_difference(same_floats(got, want))
        if not count:
            return None
        return (f"{count:,} of {got.numel():,} values differ, first at element {first:,}: "
                f"got {got.reshape(-1)[first].item()!r}, want {want.reshape(-1)[first].item()!r}")
    if layout is None:
        count, first = _first_difference(got == want)
        return f"{count:,} of {got.numel():,} bytes differ, first at byte {first:,}" if count else None
    fmt = layout.fmt
    split = fmt.code_bytes(layout.pack_numel)
    g, w = got.view(layout.packs, -1), want.view(layout.packs, -1)
    notes = []
    for part, sl, unit in (("codes", slice(0, split), fmt.block_code_bytes), ("scales", slice(split, None), 4)):
        mask = g[:, sl] == w[:, sl]
        count, first = _first_difference(mask)
        if count:
            width = mask.shape[1]
            pack, block = first // width, (first % width) // unit
            notes.append(f"{part}: {count:,} of {mask.numel():,} bytes differ, first in pack {pack} block {block:,}")
    return "; ".join(notes) or None


class Reference:
    """The torch reference on CPU copies of device tensors. With ``memo`` each input is copied to the CPU once (it
    must then stay unchanged while this object is used: one object per benchmark configuration)."""

    def __init__(self, memo: bool = True) -> None:
        self.memo = memo
        self._copies: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def cpu(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        if not self.memo:
            return t.cpu()
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in self._copies:
            self._copies[key] = (t, t.cpu())  # keeps t alive, so the address is not reused while the copy is kept
        return self._copies[key][1]

    def quantize(self, x: torch.Tensor, fmt: BlockFormat, chunks: int = 1, nodes: int = 1,
                 seed: int | None = None) -> torch.Tensor:
        x = self.cpu(x).reshape(-1)
        out = torch.empty(fmt.chunked_bytes(x.numel(), chunks), dtype=torch.uint8)
        reference.quantize_chunks(x, fmt, chunks, nodes, out, seed)
        return out

    def dequantize(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, numel: int,
                   dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        reference.dequantize_chunks(self.cpu(buf), fmt, chunks, chunk_numel, out)
        return out

    def dequantize_add(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                       start: torch.Tensor) -> torch.Tensor:
        out = self.cpu(start).clone()
        reference.dequantize_add_chunks(self.cpu(buf), fmt, chunks, chunk_numel, out)
        return out

    def reduce_requantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int,
                          out_fmt: BlockFormat | None = None, seed: int | None = None) -> torch.Tensor:
        out = torch.empty(chunks * (out_fmt or fmt).packed_bytes(chunk_numel), dtype=torch.uint8)
        reference.reduce_requantize(self.cpu(buf), fmt, groups, chunks, chunk_numel, out, out_fmt, seed)
        return out

    def reduce_dequantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, numel: int,
                          dtype: torch.dtype, divisor: float) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        reference.reduce_dequantize(self.cpu(buf), fmt, groups, chunk_numel, out, float(divisor))
        return out

    def swizzle_quantize_rotated(self, x: torch.Tensor, fmt: BlockFormat, nodes: int, ranks_per_node: int,
                                 size: int, seed: int | None = None) -> torch.Tensor:
        """The spec of the fused rotated quantize: each slice zero-padded to whole rotation blocks, rotated
        (``rotation.hadamard``), then packed (``reference.quantize_chunks``; rounded stochastically with a
        ``seed``, each rotated value with the noise of its index among the rotated slices)."""
        x = self.cpu(x).reshape(-1)
        chunks = nodes * ranks_per_node
        plain = quant.chunk_numel(x.numel(), chunks)
        padded = torch.zeros(chunks * plain, dtype=torch.float32)
        padded[: x.numel()] = x
        rows = torch.zeros(chunks, rotation.rotated_numel(plain, size))
        rows[:, :plain] = padded.view(chunks, plain)
        rotated = torch.empty(rows.numel())
        rotation.hadamard(rows.view(-1), size, False, rotated)
        return self.quantize(rotated, fmt, chunks, nodes, seed)

    def reduce_dequantize_rotated(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int,
                                  numel: int, dtype: torch.dtype, divisor: float, size: int) -> torch.Tensor:
        """The spec of the fused rotated final reduce: the fused sum (divisor 1) of the padded slices, the inverse
        rotation, the float32 division, the conversion, the padding dropped."""
        width = rotation.rotated_numel(chunk_numel, size)
        summed = self.reduce_dequantize(buf, fmt, groups, width, width, torch.float32, 1.0)
        values = torch.empty(width)
        rotation.hadamard(summed, size, True, values)
        values = values[:numel]
        if divisor != 1.0:
            values = values / torch.tensor(float(divisor), dtype=torch.float32)
        return values.to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# Past 2^31


def pack_window(buf: torch.Tensor, fmt: BlockFormat, pack_numel: int, pack: int, first: int, last: int) -> torch.Tensor:
    """Blocks ``first:last`` of pack ``pack`` of a chunked buffer as a pack of their own (codes, then scales), on
    ``buf``'s device."""
    base = pack * fmt.packed_bytes(pack_numel)
    scales = base + fmt.code_bytes(pack_numel)
    return torch.cat([buf[base + first * fmt.block_code_bytes: base + last * fmt.block_code_bytes],
                      buf[scales + 4 * first: scales + 4 * last]])


def windows(pack_start: int, pack_numel: int, fmt: BlockFormat, far: int, blocks: int) -> list[tuple[int, int]]:
    """Block ranges of a pack whose elements start at ``pack_start`` (of the flat tensor it comes from or goes to):
    its first and its last ``blocks`` full blocks, and the ``blocks`` from the one holding element ``far`` when the
    pack holds it (all within the pack's full blocks)."""
    full = pack_numel // fmt.block_size
    blocks = max(1, min(blocks, full))
    out = {(0, blocks), (full - blocks, full)}
    if pack_start <= far < pack_start + full * fmt.block_size:
        b = min((far - pack_start) // fmt.block_size, full - blocks)
        out.add((b, b + blocks))
    return sorted(out)


def far_memory(numel: int, dtype: torch.dtype) -> int:
    """Device bytes that ``far_checks`` holds at most (input, output, two int8 buffers)."""
    return 2 * numel * dtype.itemsize + 2 * (numel + 4 * -(-numel // 128)) + (1 << 28)


def far_checks(numel: int, dtype: torch.dtype, block_size: int, device: torch.device, far: int = 1 << 31,
               window_numel: int = 1 << 16, seed: int = 31) -> list[tuple[str, str | None]]:
    """``(name, None or what differs)`` per op, run on the device at ``numel`` elements (default use: just past
    2^31) and compared in windows with the reference (see the module docstring)."""
    ref = Reference(memo=False)
    bs = block_size
    wb = max(1, window_numel // bs)
    fmt8, fmt4 = BlockFormat(8, bs), BlockFormat(4, bs)
    x = torch.empty(numel, dtype=dtype, device=device)
    x.normal_(generator=torch.Generator(device=device).manual_seed(seed))
    out = torch.empty(numel, dtype=dtype, device=device)
    results: list[tuple[str, str | None]] = []

    def run(name: str, body: Callable[[], list[str]]) -> None:
        try:
            problems = body()
        except Exception as e:  # noqa: BLE001 - a crash is a failed check, the others still run
            problems = [f"error: {type(e).__name__}: {str(e)[:200]}"]
        results.append((name, "; ".join(problems) or None))

    def quantized_windows(buf: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int) -> list[str]:
        cn = quant.chunk_numel(numel, chunks)
        problems = []
        for p in range(chunks):
            src = quant.swizzle_source(p, nodes, chunks // nodes)
            for first, last in windows(src * cn, cn, fmt, far, wb):
                lo = src * cn + first * bs
                want = ref.quantize(x[lo: src * cn + last * bs], fmt)
                diff = compare(pack_window(buf, fmt, cn, p, first, last), want, PackLayout(fmt, 1, (last - first) * bs))
                problems += [f"pack {p} blocks {first:,}-{last:,}: {diff}"] if diff else []
        return problems

    def dequantized_windows(buf: torch.Tensor, fmt: BlockFormat, chunks: int, values: torch.Tensor) -> list[str]:
        cn = quant.chunk_numel(numel, chunks)
        problems = []
        for k in range(chunks):
            for first, last in windows(k * cn, cn, fmt, far, wb):
                w = (last - first) * bs
                want = ref.dequantize(pack_window(buf, fmt, cn, k, first, last), fmt, 1, w, w, dtype)
                diff = compare(values[k * cn + first * bs: k * cn + last * bs], want)
                problems += [f"pack {k} blocks {first:,}-{last:,}: {diff}"] if diff else []
        return problems

    q1 = quant.quantize_chunks(x, fmt8, 1)
    run(f"quantize int8, 1 pack of {numel:,}", lambda: quantized_windows(q1, fmt8, 1, 1))

    def dequantize_one() -> list[str]:
        quant.dequantize_chunks(q1, fmt8, 1, numel, out)
        return dequantized_windows(q1, fmt8, 1, out)

    run(f"dequantize int8, 1 pack of {numel:,}", dequantize_one)

    def dequantize_view() -> list[str]:  # a small pack into a view of out that starts at the block of element `far`
        full = numel // bs
        first = min(far // bs, full - min(wb, full))
        last = min(first + wb, full)
        small = pack_window(q1, fmt8, numel, 0, first, last)
        w = (last - first) * bs
        view = out[first * bs: last * bs]
        view.fill_(float("nan"))
        quant.dequantize_chunks(small, fmt8, 1, w, view)
        diff = compare(view, ref.dequantize(small, fmt8, 1, w, w, dtype))
        return [f"blocks {first:,}-{last:,}: {diff}"] if diff else []

    run(f"dequantize into a view at element {far:,}", dequantize_view)
    del q1

    sw = quant.swizzle_quantize(x, fmt4, 2, 2)
    run("swizzle_quantize int4 2x2", lambda: quantized_windows(sw, fmt4, 4, 2))
    del sw

    g = quant.quantize_chunks(x, fmt8, 2)

    def gathered() -> list[str]:
        out.fill_(float("nan"))
        quant.dequantize_chunks(g, fmt8, 2, quant.chunk_numel(numel, 2), out)
        return dequantized_windows(g, fmt8, 2, out)

    run("dequantize gathered int8 x2", gathered)
    del g

    # 4 int8 packs: the buffer passes 2^31 bytes when numel does 2^31
    cn4 = quant.chunk_numel(numel, 4)
    q4 = quant.quantize_chunks(x, fmt8, 4)
    del x

    def reduce_windows(groups: int, chunks: int, got: Callable[[int, int], torch.Tensor],
                       want: Callable[[torch.Tensor, int], torch.Tensor]) -> list[str]:
        problems = []
        for first, last in windows(0, cn4, fmt8, far - 3 * cn4, wb):  # element `far` of x is in the last pack
            w = (last - first) * bs
            small = torch.cat([pack_window(q4, fmt8, cn4, i, first, last) for i in range(groups * chunks)])
            result = got(first, last)
            diff = compare(result, want(small, w), PackLayout(fmt8, chunks, w) if result.dtype == torch.uint8 else None)
            problems += [f"blocks {first:,}-{last:,}: {diff}"] if diff else []
        return problems

    def requantize() -> list[str]:
        rr = quant.reduce_requantize(q4, fmt8, 2, 2, cn4)
        return reduce_windows(2, 2, lambda a, b: torch.cat([pack_window(rr, fmt8, cn4, m, a, b) for m in range(2)]),
                              lambda small, w: ref.reduce_requantize(small, fmt8, 2, 2, w))

    run("reduce_requantize int8 d=2 x2", requantize)

    def final() -> list[str]:
        fout = out[:cn4]
        fout.fill_(float("nan"))
        quant.reduce_dequantize(q4, fmt8, 4, cn4, fout, divisor=4)
        return reduce_windows(4, 1, lambda a, b: fout[a * bs: b * bs],
                              lambda small, w: ref.reduce_dequantize(small, fmt8, 4, w, w, dtype, 4.0))

    run("reduce_dequantize int8 g=4", final)
    return results
