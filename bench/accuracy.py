"""Accuracy of the block formats against block size, on Gaussian and heavy-tailed data.

    python bench/accuracy.py                 # 2^22 float32 elements per distribution, CPU reference
    python bench/accuracy.py --numel 16777216 --csv accuracy.csv

For each distribution (standard Gaussian; Student-t with 3 degrees of freedom, whose rare large values are what
real gradients and trained weights look like), each of int8 and int4 and each block size, the float32 input is
quantized with ``zeropp.quant`` and dequantized to float32, and compared with the input in float64:

* rel L2   = ||x' - x|| / ||x||
* max abs  = max |x' - x|
* bits/el  = bits on the wire per element, scales (and padding) included; ratio = 16 / bits/el, versus bf16
* score    = log2(rel L2) + bits/el: the trade-off in one number. One more bit per element halves the error of a
             uniform quantizer, so a scale overhead of s bits per element is worth paying only if it cuts the
             error by more than a factor 2^s. Lower is better; the block size minimising it is the best buy.
* vs div   = fraction of codes that differ from ``round_half_even(x / scale)`` in float32 division, the spec before
             the codes became ``rne(x * r)`` of the exact product with ``r = 1 / scale`` (one FMA on a GPU).

The recommendation at the end takes, for each bit width, the block size with the lowest score averaged over the
two distributions.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

from zeropp.bench.report import format_cell, markdown_table, write_csv

BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048)


def make_data(dist: str, numel: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if dist == "gaussian":
        x = rng.standard_normal(numel)
    elif dist == "student-t3":
        x = rng.standard_t(3, numel)
    else:
        raise ValueError(dist)
    return torch.from_numpy(x.astype(np.float32))


def codes_of(q) -> torch.Tensor:
    """The integer codes of a ``QuantizedTensor`` (one per element, padding included) as int16."""
    c = q.data.view(torch.int8)
    if q.bits == 8:
        return c.to(torch.int16)
    return torch.stack([(c << 4) >> 4, c >> 4], dim=1).reshape(-1).to(torch.int16)


def division_codes(x: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """``clamp(round_half_even(x / scale))`` per block in float32 division: the codes of the old spec."""
    qmax = (1 << (bits - 1)) - 1
    padded = torch.zeros(scales.numel() * block_size, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x.reshape(-1)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (padded.view(-1, block_size) / divisor[:, None]).round().clamp(-qmax, qmax)
    return q.reshape(-1).to(torch.int16)


def measure(x: torch.Tensor, bits: int, block_size: int) -> dict:
    from zeropp import quant

    t0 = time.perf_counter()
    q = quant.quantize(x, bits=bits, block_size=block_size)
    x_hat = quant.dequantize(q, dtype=torch.float32)
    if x.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ref = x.double()
    err = x_hat.double() - ref
    rel = (torch.linalg.vector_norm(err) / torch.linalg.vector_norm(ref)).item()
    bits_per_el = 8 * q.nbytes / x.numel()
    differ = (codes_of(q) != division_codes(x, q.scales, bits, block_size))[: x.numel()]
    return {
        "bits": bits,
        "block_size": block_size,
        "rel_l2": rel,
        "max_abs": err.abs().max().item(),
        "bits_per_el": bits_per_el,
        "ratio_vs_bf16": 16 / bits_per_el,
        "score": math.log2(rel) + bits_per_el,
        "vs_div": differ.double().mean().item(),
        "seconds": seconds,
        "backend": quant.backend_name(x),
    }


COLUMNS = {  # key: (header, format)
    "dist": ("data", None),
    "format": ("format", None),
    "block_size": ("block", None),
    "rel_l2": ("rel L2", ".4e"),
    "max_abs": ("max abs", ".4e"),
    "bits_per_el": ("bits/el", ".3f"),
    "ratio_vs_bf16": ("ratio vs bf16", lambda v: f"{v:.3f}x"),
    "score": ("score", ".3f"),
    "vs_div": ("vs div", ".2e"),
}


def table(rows: list[dict]) -> str:
    body = [[format_cell({**r, "format": f"int{r['bits']}"}[key], spec) for key, (_, spec) in COLUMNS.items()]
            for r in rows]
    return markdown_table([head for head, _ in COLUMNS.values()], body)


def recommend(rows: list[dict], default: int) -> list[str]:
    lines = []
    for bits in sorted({r["bits"] for r in rows}, reverse=True):
        mean = {}
        for bs in sorted({r["block_size"] for r in rows}):
            scores = [r["score"] for r in rows if r["bits"] == bits and r["block_size"] == bs]
            mean[bs] = sum(scores) / len(scores)
        best = min(mean, key=mean.get)
        near = [bs for bs, s in mean.items() if s - mean[best] <= 0.05]
        lines.append(
            f"int{bits}: lowest mean score at block {best} ({mean[best]:.3f}); within 0.05 bit of it: "
            f"{', '.join(map(str, near))}; the default {default} scores {mean.get(default, float('nan')):.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 22, help="elements per distribution (default 2^22)")
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    p.add_argument("--dists", nargs="+", default=["gaussian", "student-t3"], choices=["gaussian", "student-t3"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", metavar="PATH", help="also write the rows as CSV ('-' for stdout)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        # The Triton interpreter would take hours here; the reference defines the numbers anyway.
        os.environ.setdefault("ZEROPP_QUANT_BACKEND", "torch")
    from zeropp.quant.format import DEFAULT_BLOCK_SIZE

    t0 = time.perf_counter()
    rows = []
    for dist in args.dists:
        x = make_data(dist, args.numel, args.seed).to(args.device)
        for bits in args.bits:
            for bs in args.block_sizes:
                rows.append({"dist": dist, "numel": args.numel, **measure(x, bits, bs)})
    backend = rows[0]["backend"]
    print(
        f"block-format accuracy: {args.numel:,} float32 elements per distribution (seed {args.seed}), "
        f"error in float64, backend {backend} on {args.device}\n"
    )
    print(table(rows))
    print()
    for line in recommend(rows, DEFAULT_BLOCK_SIZE):
        print(line)
    print(f"\n({time.perf_counter() - t0:.1f}s)")
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
