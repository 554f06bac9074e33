"""Optimizer-step benchmark: one Adam(W) step on fp32 master shards against this machine's memory bandwidth.

    python bench/optimizer.py                                  # 2^24, 2^25, 2^26 elements; 1 and 2 threads
    python bench/optimizer.py --sizes 2^24 --threads 2 --reps 9 --csv optimizer.csv

For every size and thread count (``torch.set_num_threads``; the native library and DeepSpeed's op run on the same
OpenMP runtime, torch's), in one run:

* **bandwidth rows.** ``axpy``: ``a.add_(c, alpha=s)`` in torch, 12 bytes per element (a read and written, c
  read). It is the reference bandwidth ("vs axpy"): the same access pattern as an optimizer step, whose state is
  read and written in place, so every byte counted is a byte moved. ``triad``: STREAM's ``a = b + s * c``
  (``torch.add(b, c, alpha=s, out=a)``, 12 bytes counted), and ``copy_``: torch's copy of 28 bytes per element
  (14 read, 14 written); both write to memory they do not read, which an ordinary store first reads into the
  cache (write-allocate), so they move 16 and 42 bytes per element for the 12 and 28 counted: shown for
  reference, not the wall.
* **step rows**, all AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01) on one tensor of the size:
  ``single-tensor`` (``torch.optim.adam.adam(..., foreach=False, fused=False)``, the engine's step before: "vs
  before" is its time over the row's), ``foreach``, ``torch fused`` (``fused=True``), ``torch fused + copy_``
  (then ``out.copy_(param)`` into bf16), ``native`` (``zeropp.optim.native.adam_step``), ``native + bf16 out``
  (the same with the bf16 copy written in the same pass), and ``DeepSpeedCPUAdam`` (adamw_mode, where ``deepspeed``
  is importable; its op is JIT-built with the system compiler on first use).

Byte model: an Adam step moves 28 bytes per element (param, exp_avg, exp_avg_sq read and written, grad read:
7 x 4); with the bf16 copy 30 (2 more written). GB/s = bytes / median time; "vs axpy" = GB/s over axpy's GB/s at
the same size and threads. Times: ``--warmup`` untimed runs, then the median of ``--reps`` timed runs (host
clock); min and max are shown as the spread. The machine may be shared: the load average before and after is
printed, and runs should be repeated.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
from torch.optim.adam import adam as torch_adam

from zeropp.bench.report import progress, rows_table, write_csv
from zeropp.optim import native

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.01
FORMATS = {"ms": ".2f", "min ms": ".2f", "max ms": ".2f", "GB/s": ".1f", "vs axpy": ".2f", "vs before": ".2f"}
COLUMNS = ["elements", "threads", "row", "bytes/elem", "ms", "min ms", "max ms", "GB/s", "vs axpy", "vs before"]


def parse_size(text: str) -> int:
    """``2^24``, ``1<<24`` or ``16777216``."""
    t = text.strip()
    if "^" in t:
        base, exp = t.split("^")
        return int(base) ** int(exp)
    if "<<" in t:
        base, shift = t.split("<<")
        return int(base) << int(shift)
    return int(t)


def timed(fn: Callable[[], object], warmup: int, reps: int) -> tuple[float, float, float]:
    """(median, min, max) seconds of ``fn()`` over ``reps`` runs after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def load_deepspeed() -> tuple[type | None, str]:
    """DeepSpeedCPUAdam with its op built, or ``(None, why not)``."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # deepspeed absent or broken: the row says why
        return None, f"deepspeed not importable: {type(e).__name__}: {e}"
    try:
        p = torch.nn.Parameter(torch.zeros(16))
        p.grad = torch.zeros(16)
        DeepSpeedCPUAdam([p], lr=LR).step()
    except Exception as e:
        return None, f"DeepSpeedCPUAdam's op did not build: {type(e).__name__}: {str(e)[:200]}"
    return DeepSpeedCPUAdam, ""


def bandwidth_rows(n: int, warmup: int, reps: int) -> list[tuple[str, int, tuple[float, float, float]]]:
    """(row, bytes per element, times) of axpy, triad and a 28-byte copy_ over n elements."""
    a, b, c = (torch.rand(n) for _ in range(3))
    rows = [("axpy a += s*c", 12, timed(lambda: a.add_(c, alpha=1e-9), warmup, reps)),
            ("triad a = b + s*c", 12, timed(lambda: torch.add(b, c, alpha=0.5, out=a), warmup, reps))]
    del a, b, c
    src, dst = torch.rand(7 * n // 2), torch.empty(7 * n // 2)
    rows.append(("copy_ (28 B/elem)", 28, timed(lambda: dst.copy_(src), warmup, reps)))
    return rows


def step_rows(n: int, warmup: int, reps: int, deepspeed: type | None, ds_note: str
              ) -> list[tuple[str, int, tuple[float, float, float] | str]]:
    """(row, bytes per element, times or a note) of each AdamW step on n elements."""
    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(n, generator=gen), 1e-3 * torch.randn(n, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    steps = [torch.zeros((), dtype=torch.float32)]
    count = [0]

    def torch_step(**kind: bool) -> Callable[[], None]:
        def run() -> None:
            torch_adam([param], [grad], [exp_avg], [exp_avg_sq], [], steps, decoupled_weight_decay=True,
                       amsgrad=False, beta1=BETA1, beta2=BETA2, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS,
                       maximize=False, **kind)
        return run

    def fused_and_copy() -> None:
        torch_step(fused=True)()
        out.copy_(param)

    def native_step(with_out: bool) -> Callable[[], None]:
        def run() -> None:
            count[0] += 1
            native.adam_step(param, grad, exp_avg, exp_avg_sq, step=count[0], lr=LR, beta1=BETA1, beta2=BETA2,
                             eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=True, out=out if with_out else None)
        return run

    rows: list[tuple[str, int, tuple[float, float, float] | str]] = [
        ("single-tensor (before)", 28, timed(torch_step(foreach=False, fused=False), warmup, reps)),
        ("foreach", 28, timed(torch_step(foreach=True, fused=False), warmup, reps)),
        ("torch fused", 28, timed(torch_step(fused=True), warmup, reps)),
        ("torch fused + copy_ bf16", 30, timed(fused_and_copy, warmup, reps)),
    ]
    if native.available():
        rows += [("native", 28, timed(native_step(False), warmup, reps)),
                 ("native + bf16 out", 30, timed(native_step(True), warmup, reps))]
    else:
        rows.append(("native", 28, f"unavailable: {native.unavailable_reason()}"))
    if deepspeed is not None:
        p = torch.nn.Parameter(param)
        p.grad = grad
        opt = deepspeed([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
        rows.append(("DeepSpeedCPUAdam", 28, timed(opt.step, warmup, reps)))
        del opt, p
    else:
        rows.append(("DeepSpeedCPUAdam", 28, ds_note))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=parse_size, default=[2**24, 2**25, 2**26], help="fp32 elements")
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeedCPUAdam")
    p.add_argument("--csv", help="also write the rows as CSV here ('-': standard output)")
    args = p.parse_args(argv)

    deepspeed, ds_note = (None, "skipped (--no-deepspeed)") if args.no_deepspeed else load_deepspeed()
    load_before = os.getloadavg()
    progress(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
             f"(CPU capability {torch.backends.cpu.get_cpu_capability()}), native: "
             f"{native.library().arithmetic if native.available() else native.unavailable_reason()}; "
             f"load average {load_before[0]:.2f}")
    threads_before = torch.get_num_threads()
    rows = []
    try:
        for n in args.sizes:
            for threads in args.threads:
                torch.set_num_threads(threads)
                progress(f"2^{n.bit_length() - 1} elements, {threads} thread(s)")
                measured = bandwidth_rows(n, args.warmup, args.reps)
                measured += step_rows(n, args.warmup, args.reps, deepspeed, ds_note)
                axpy_gbs = 12 * n / measured[0][2][0] / 1e9
                before_s = next(t[0] for name, _, t in measured if name.startswith("single-tensor"))
                for name, nbytes, result in measured:
                    row = {"elements": f"2^{n.bit_length() - 1}", "threads": threads, "row": name,
                           "bytes/elem": nbytes}
                    if isinstance(result, str):
                        row["ms"] = result
                    else:
                        median, low, high = result
                        gbs = nbytes * n / median / 1e9
                        row.update({"ms": 1e3 * median, "min ms": 1e3 * low, "max ms": 1e3 * high, "GB/s": gbs,
                                    "vs axpy": gbs / axpy_gbs})
                        if name not in ("axpy a += s*c", "triad a = b + s*c", "copy_ (28 B/elem)"):
                            row["vs before"] = before_s / median
                    rows.append(row)
    finally:
        torch.set_num_threads(threads_before)
    load_after = os.getloadavg()
    print(rows_table(rows, COLUMNS, FORMATS))
    print(f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after; median of {args.reps} runs after "
          f"{args.warmup} warm-up runs")
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
