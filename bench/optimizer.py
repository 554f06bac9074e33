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
the same size and threads (from medians; "vs axpy (min)" from the fastest runs); "vs before" = the single-tensor
step's median time over the row's. Times (host clock): ``--reps`` rounds after ``--warmup`` untimed ones, each
round timing every row once in turn, so that load from other jobs on a shared machine falls on all rows alike;
the median, min and max are shown. The load average before and after is printed: repeat runs and compare.
The native rows, torch's fused step and the copy are also a pytest-benchmark suite with saved baselines to compare
against (``bench/test_bench_optimizer.py``).
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

from zeropp.bench.report import parse_size, progress, rows_table, write_csv
from zeropp.optim import native

LR, BETA1, BETA2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.01
FORMATS = {"ms": ".2f", "min ms": ".2f", "max ms": ".2f", "GB/s": ".1f", "vs axpy": ".2f", "vs axpy (min)": ".2f",
           "vs before": ".2f"}
COLUMNS = ["elements", "threads", "row", "bytes/elem", "ms", "min ms", "max ms", "GB/s", "vs axpy", "vs axpy (min)",
           "vs before"]


def interleaved(fns: dict[str, Callable[[], object]], warmup: int, reps: int) -> dict[str, list[float]]:
    """Seconds of each ``fns[name]()`` over ``reps`` rounds, each round running every function once in turn (so
    that load from other jobs falls on all rows alike), after ``warmup`` untimed rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(warmup + reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


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


BANDWIDTH_ROWS = {"axpy a += s*c": 12, "triad a = b + s*c": 12, "copy_ (28 B/elem)": 28}
STEP_ROWS = {"single-tensor (before)": 28, "foreach": 28, "torch fused": 28, "torch fused + copy_ bf16": 30,
             "native": 28, "native + bf16 out": 30, "DeepSpeedCPUAdam": 28}


def rows_for(n: int, deepspeed: type | None) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """The functions to time over n elements, by row name (see the module docstring), and notes for rows that
    cannot run here."""
    a, b, c = (torch.rand(n) for _ in range(3))
    src, dst = torch.rand(7 * n // 2), torch.empty(7 * n // 2)
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

    fns: dict[str, Callable[[], object]] = {
        "axpy a += s*c": lambda: a.add_(c, alpha=1e-9),
        "triad a = b + s*c": lambda: torch.add(b, c, alpha=0.5, out=a),
        "copy_ (28 B/elem)": lambda: dst.copy_(src),
        "single-tensor (before)": torch_step(foreach=False, fused=False),
        "foreach": torch_step(foreach=True, fused=False),
        "torch fused": torch_step(fused=True),
        "torch fused + copy_ bf16": fused_and_copy,
    }
    notes = {}
    if native.available():
        fns["native"] = native_step(False)
        fns["native + bf16 out"] = native_step(True)
    else:
        notes["native"] = f"unavailable: {native.unavailable_reason()}"
    if deepspeed is not None:
        p = torch.nn.Parameter(param)  # the same storage: DeepSpeed steps param with its own state
        p.grad = grad
        fns["DeepSpeedCPUAdam"] = deepspeed([p], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WEIGHT_DECAY,
                                            adamw_mode=True).step
    return fns, notes


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
                fns, notes = rows_for(n, deepspeed)
                if deepspeed is None:
                    notes["DeepSpeedCPUAdam"] = ds_note
                times = {name: sorted(t) for name, t in interleaved(fns, args.warmup, args.reps).items()}
                del fns
                axpy = times["axpy a += s*c"]
                before = times["single-tensor (before)"]
                for name, nbytes in {**BANDWIDTH_ROWS, **STEP_ROWS}.items():
                    row = {"elements": f"2^{n.bit_length() - 1}", "threads": threads, "row": name,
                           "bytes/elem": nbytes}
                    if name in notes:
                        row["ms"] = notes[name]
                    elif name in times:
                        t = times[name]
                        median = t[len(t) // 2]
                        row.update({"ms": 1e3 * median, "min ms": 1e3 * t[0], "max ms": 1e3 * t[-1],
                                    "GB/s": nbytes * n / median / 1e9,
                                    "vs axpy": nbytes / 12 * axpy[len(axpy) // 2] / median,
                                    "vs axpy (min)": nbytes / 12 * axpy[0] / t[0]})
                        if name in STEP_ROWS:
                            row["vs before"] = before[len(before) // 2] / median
                    rows.append(row)
    finally:
        torch.set_num_threads(threads_before)
    load_after = os.getloadavg()
    print(rows_table(rows, COLUMNS, FORMATS))
    print(f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after; median of {args.reps} interleaved "
          f"rounds after {args.warmup} warm-up rounds")
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
