"""Step time of the engine at world size 1 against plain single-process training of the same model and batch.

    python bench/engine_overhead.py                                   # mini and small, fp32 and bf16, 1 thread
    python bench/engine_overhead.py --presets mini --dtypes fp32 --steps 30 --profile engine-stage3

Every variant trains its own copy of the GPT preset on the same random-byte batch (``--micro`` x ``--seq``), one
forward + backward + AdamW step per iteration:

* ``plain foreach=False`` / ``plain foreach``: ``torch.optim.AdamW`` with ``foreach=False`` (the single-tensor
  loop the engine's ``PartitionedOptimizer`` mirrors) and with the default (foreach, multi-tensor);
  in bf16 the model's parameters are bf16 (``model.bfloat16()``, AdamW on the bf16 parameters: no fp32 master,
  the cheapest possible loop) and ``plain autocast`` adds the usual torch mixed precision (fp32 parameters,
  ``torch.autocast("cpu", torch.bfloat16)``, foreach AdamW);
* ``engine stage S``: ``zeropp.initialize`` in a gloo process group of one rank, stages 1, 2 and 3 (bf16: the
  engine's mixed precision, fp32 master and gradient shards).

The variants' steps are interleaved (one step of each in turn), so a load change on a shared machine hits them
alike; the median step time after ``--warmup`` steps is reported — process CPU time (``time.process_time``: with
one thread it hardly depends on what else the machine runs) and wall time — with the CPU-time ratio to ``plain
foreach=False`` (the engine's goal: at most 1.10). ``--profile NAME`` prints a cProfile of that variant's steps.

Most of stage 3's extra time at world size 1 is page faults: ``Unit.free`` releases each unit's storage, glibc
returns such multi-MB blocks to the kernel, and the next gather touches fresh pages. ``MALLOC_MMAP_THRESHOLD_=
33554432 MALLOC_TRIM_THRESHOLD_=17179869184`` in the environment keeps them in the process (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zeropp  # noqa: E402
from zeropp.models import GPT, GPTConfig  # noqa: E402

LR = 1e-4


def plain(cfg: GPTConfig, dtype: str, *, foreach: bool | None, autocast: bool = False) -> Callable[..., None]:
    model = GPT(cfg, seed=0)
    if dtype == "bf16" and not autocast:
        model = model.bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        ctx = torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def engine(cfg: GPTConfig, dtype: str, stage: int, micro: int) -> Callable[..., None]:
    config = {"train_micro_batch_size_per_gpu": micro, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    eng, _, _, _ = zeropp.initialize(model=GPT(cfg, seed=0), config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _, loss = eng(x, y)
        eng.backward(loss)
        eng.step()

    return step


def run(preset: str, dtype: str, args: argparse.Namespace) -> list[tuple[str, float, float]]:
    cfg = GPTConfig.preset(preset)
    variants: dict[str, Callable[..., None]] = {
        "plain foreach=False": plain(cfg, dtype, foreach=False),
        "plain foreach": plain(cfg, dtype, foreach=None),
    }
    if dtype == "bf16":
        variants["plain autocast"] = plain(cfg, dtype, foreach=None, autocast=True)
    for stage in args.stages:
        variants[f"engine stage {stage}"] = engine(cfg, dtype, stage, args.micro)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro, args.seq + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times: dict[str, list[float]] = {name: [] for name in variants}  # process CPU seconds per step
    walls: dict[str, list[float]] = {name: [] for name in variants}
    profiler = cProfile.Profile() if args.profile else None
    for i in range(args.warmup + args.steps):
        for name, step in variants.items():
            prof = profiler if (profiler is not None and name == args.profile and i >= args.warmup) else None
            c0, t0 = time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            step(x, y)
            if prof is not None:
                prof.disable()
            if i >= args.warmup:
                times[name].append(time.process_time() - c0)
                walls[name].append(time.perf_counter() - t0)
    if profiler is not None:
        s = io.StringIO()
        pstats.Stats(profiler, stream=s).sort_stats("cumulative").print_stats(40)
        print(f"cProfile of {args.profile!r}, {preset} {dtype}, {args.steps} steps:\n{s.getvalue()}")
    base = statistics.median(times["plain foreach=False"])
    return [(name, statistics.median(t), statistics.median(t) / base, statistics.median(walls[name]))
            for name, t in times.items()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["mini", "small"])
    parser.add_argument("--dtypes", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", help="variant name to cProfile, e.g. 'engine stage 3'")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    print(f"torch {torch.__version__}, {args.threads} thread(s), micro-batch {args.micro} x seq {args.seq}, "
          f"median of {args.steps} steps after {args.warmup} warm-up steps (variants interleaved)")
    print(f"| {'preset':6s} | {'dtype':5s} | {'variant':20s} | {'CPU ms/step':>11s} | {'vs plain foreach=False':>22s} "
          f"| {'wall ms/step':>12s} |")
    print(f"|{'-' * 8}|{'-' * 7}|{'-' * 22}|{'-' * 13}|{'-' * 24}|{'-' * 14}|")
    for preset in args.presets:
        for dtype in args.dtypes:
            for name, t, ratio, wall in run(preset, dtype, args):
                print(f"| {preset:6s} | {dtype:5s} | {name:20s} | {t * 1e3:11.1f} | {ratio:22.3f} | {wall * 1e3:12.1f} |",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
