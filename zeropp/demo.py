"""``python -m zeropp.demo``: what qwZ's block quantization does to the weights of a GPT-2-sized model.

Builds the model locally from a seed (no downloads), quantizes every weight tensor on its own (blocks never
straddle two tensors) in each format asked for, dequantizes it, and prints one row per format: the relative L2
error over all weights, the largest absolute error, the bytes sent instead of bf16 (scales and padding
included), the time taken and the backend that ran. Errors are measured against the weights as given to the
quantizer, in float64, with the dequantized values in float32.

    python -m zeropp.demo                                  # GPT-2 small (124M), int8 and int4
    python -m zeropp.demo --preset tiny --bits 4 --block-size 64 128

The backend follows ``zeropp.quant``: Triton on CUDA tensors, the torch reference on CPU tensors (the Triton
interpreter if ``TRITON_INTERPRET=1``, which is far too slow for this model), ``ZEROPP_QUANT_BACKEND`` to force one.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TextIO

import torch

from zeropp import quant
from zeropp.models import GPT, PRESETS, GPTConfig
from zeropp.quant.format import DEFAULT_BLOCK_SIZE, SUPPORTED_BITS

DEMO_BLOCK_SIZES = tuple(sorted({64, DEFAULT_BLOCK_SIZE, 2048}))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BF16_BYTES = 2


@dataclass(frozen=True)
class FormatResult:
    """What one format did to all the weights."""

    bits: int
    block_size: int
    tensors: int
    numel: int
    rel_l2: float  # ||w - w'|| / ||w|| over all weights
    max_abs: float  # max |w - w'|
    packed_bytes: int  # codes + scales of every tensor's pack
    seconds: float  # quantize + dequantize, all tensors (error measurement not included)
    backend: str

    @property
    def bf16_bytes(self) -> int:
        return self.numel * BF16_BYTES

    @property
    def ratio(self) -> float:
        """Compression ratio versus bf16, scales and padding included."""
        return self.bf16_bytes / self.packed_bytes


class Progress:
    """A one-line progress bar on a terminal; silent when ``stream`` is not one (logs, CI, tests)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = sys.stderr if stream is None else stream
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done, self.start, self.last = 0, time.perf_counter(), 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * round(frac * self.width)
            self.stream.write(f"\r{self.label} [{bar:<{self.width}}] {frac:4.0%} {now - self.start:5.1f}s")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (len(self.label) + self.width + 20) + "\r")
            self.stream.flush()


def weight_tensors(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """Every parameter once (a tied weight is one tensor), detached, in ``dtype``."""
    return [(name, p.detach().to(dtype)) for name, p in model.named_parameters()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def squared_norm(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """Sum of the squares of all the weights, in float64."""
    return sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for _, t in tensors)


def evaluate(
    tensors: list[tuple[str, torch.Tensor]],
    bits: int,
    block_size: int,
    progress: bool = True,
    ref_sq: torch.Tensor | None = None,
) -> FormatResult:
    """Quantize and dequantize each tensor on its own in one format; measure the error in float64.

    ``ref_sq`` is ``squared_norm(tensors)`` when the caller has it already.
    """
    total = sum(t.numel() for _, t in tensors)
    device = tensors[0][1].device
    bar = Progress(total, f"int{bits} block {block_size:>4}") if progress else None
    err_sq = torch.zeros((), dtype=torch.float64, device=device)
    ref_sq = squared_norm(tensors) if ref_sq is None else ref_sq
    max_abs = torch.zeros((), dtype=torch.float32, device=device)
    packed = 0
    seconds = 0.0
    for _, w in tensors:
        _sync(device)
        t0 = time.perf_counter()
        q = quant.quantize(w, bits=bits, block_size=block_size)
        w_hat = quant.dequantize(q, dtype=torch.float32)
        _sync(device)
        seconds += time.perf_counter() - t0
        packed += q.nbytes
        diff = w.to(torch.float32) - w_hat
        err_sq += torch.linalg.vector_norm(diff, dtype=torch.float64) ** 2
        max_abs = torch.maximum(max_abs, diff.abs().max())
        if bar:
            bar.update(w.numel())
    if bar:
        bar.close()
    rel = (err_sq.sqrt() / ref_sq.sqrt()).item() if ref_sq.item() > 0 else 0.0
    return FormatResult(
        bits=bits,
        block_size=block_size,
        tensors=len(tensors),
        numel=total,
        rel_l2=rel,
        max_abs=max_abs.item(),
        packed_bytes=packed,
        seconds=seconds,
        backend=quant.backend_name(tensors[0][1]),
    )


def run(
    preset: str = "gpt2",
    bits: tuple[int, ...] = (8, 4),
    block_sizes: tuple[int, ...] = DEMO_BLOCK_SIZES,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    progress: bool = True,
) -> tuple[GPT, list[FormatResult]]:
    """Build ``preset`` from ``seed`` and evaluate every (bits, block size) pair on its weights."""
    model = GPT(GPTConfig.preset(preset), seed=seed)
    tensors = [(n, t.to(device)) for n, t in weight_tensors(model, dtype)]
    ref_sq = squared_norm(tensors)
    results = [evaluate(tensors, b, bs, progress, ref_sq) for b in bits for bs in block_sizes]
    return model, results


def format_table(results: list[FormatResult]) -> str:
    head = ("format", "block", "rel L2 err", "max abs err", "bytes", "bf16 bytes", "ratio", "time s", "backend")
    rows = [
        (
            f"int{r.bits}",
            str(r.block_size),
            f"{r.rel_l2:.3e}",
            f"{r.max_abs:.3e}",
            f"{r.packed_bytes:,}",
            f"{r.bf16_bytes:,}",
            f"{r.ratio:.3f}x",
            f"{r.seconds:.2f}",
            r.backend,
        )
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeropp.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2", choices=sorted(PRESETS), help="model (default: gpt2, 124M)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4], choices=SUPPORTED_BITS)
    parser.add_argument(
        "--block-size",
        type=int,
        nargs="+",
        default=list(DEMO_BLOCK_SIZES),
        help=f"one or more block sizes (default: {' '.join(map(str, DEMO_BLOCK_SIZES))}; the library's is "
        f"{DEFAULT_BLOCK_SIZE})",
    )
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weights' dtype (default bf16)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for bs in args.block_size:
        try:
            quant.BlockFormat(args.bits[0], bs)
        except ValueError as e:
            parser.error(str(e))

    probe = torch.empty(0, device=args.device)
    if probe.device.type == "cpu" and quant.backend_name(probe) == "triton":
        print(
            "warning: TRITON_INTERPRET=1 sends CPU tensors to the Triton interpreter, which is far too slow for a "
            "whole model; set ZEROPP_QUANT_BACKEND=torch for the torch reference",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    model, results = run(
        args.preset, tuple(args.bits), tuple(args.block_size), DTYPES[args.dtype], args.device, args.seed
    )
    cfg = model.config
    print(
        f"zeropp demo: {args.preset} ({model.num_params():,} parameters in {results[0].tensors} tensors; "
        f"{cfg.n_layer} layers, d={cfg.n_embd}, vocab {cfg.vocab_size}), {args.dtype} weights on {args.device}, "
        f"seed {args.seed}"
    )
    print("each tensor quantized on its own; error vs the weights in float64; bytes include scales and padding")
    print()
    print(format_table(results))
    print()
    print(f"total {time.perf_counter() - t0:.1f}s (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
