"""Collective benchmark: exact vs quantized all-gather and reduce-scatter over a sweep of message sizes.

Run under torchrun (NCCL on GPU, gloo on CPU), e.g. 4 ranks as 2 emulated nodes of 2 on one CPU machine::

    torchrun --nproc-per-node 4 -m zeropp.bench.collectives --ranks-per-node 2 --dtype bf16 --bits 8 4 \
        --min-bytes 64K --max-bytes 16M --csv out.csv --plot out.png

Columns (one row per operation, mode and size; nccl-tests conventions):

* ``size``: bytes of the uncompressed message in ``--dtype``: the gathered output for all-gather, the full input
  for reduce-scatter; ``count`` is its number of elements;
* ``time``: microseconds per call, the slowest rank's mean over ``--iters`` calls after ``--warmup``;
* ``algbw`` = size / time; ``busbw`` = algbw * (P - 1) / P (the nccl-tests factor for both operations), so exact
  and quantized rows compare at equal *useful* bytes;
* ``wire``: bytes this rank sent per call (codes + scales for quantized modes; ``zeropp.comm.stats``), and
  ``inter``: the part of it that crossed nodes;
* ``bf16eq``: count * 2 bytes / time, the bandwidth a bf16 collective would need to match this time.

Bandwidths are in GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from zeropp import comm
from zeropp.bench.report import write_csv
from zeropp.quant import DEFAULT_BLOCK_SIZE, backend_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPS = ("all_gather", "reduce_scatter")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """``"64K"`` -> 65536; suffixes K, M, G are powers of 1024."""
    t = text.strip().upper().rstrip("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count like 4096, 64K or 16M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


@dataclass
class Row:
    op: str
    mode: str
    size: int
    count: int
    time_us: float
    algbw: float
    busbw: float
    wire: int
    inter: int
    bf16eq: float


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    op: str, bits: int | None, size: int, dtype: torch.dtype, topo: comm.Topology, device: torch.device,
    iters: int, warmup: int, block_size: int,
) -> Row:
    """Time one (op, bits, size) point on every rank; returns the row (same on every rank)."""
    world = topo.world_size
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = max(world, size // itemsize // world * world)  # a multiple of P elements
    if op == "all_gather":
        shard = torch.randn(count // world, device=device).to(dtype)
        out = torch.empty(count, dtype=dtype, device=device)

        def call() -> None:
            comm.all_gather(shard, bits, topology=topo, out=out, block_size=block_size)
    else:
        full = torch.randn(count, device=device).to(dtype)
        out = torch.empty(count // world, dtype=dtype, device=device)

        def call() -> None:
            comm.reduce_scatter(full, bits, topology=topo, out=out, block_size=block_size)

    for _ in range(warmup):
        call()
    _sync(device)
    dist.barrier(group=topo.group)
    comm.reset_stats()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=topo.group)
    t = float(elapsed)
    st = comm.stats()[op]
    calls = max(1, st["calls"])
    nbytes = count * itemsize
    algbw = nbytes / t / 1e9
    return Row(
        op=op,
        mode="exact" if bits is None else f"int{bits}",
        size=nbytes,
        count=count,
        time_us=t * 1e6,
        algbw=algbw,
        busbw=algbw * (world - 1) / world,
        wire=(st["sent_intra"] + st["sent_inter"]) // calls,
        inter=st["sent_inter"] // calls,
        bf16eq=count * 2 / t / 1e9,
    )


HEADER = (
    f"{'op':>14} {'mode':>6} {'size(B)':>12} {'count':>11} {'time(us)':>11} {'algbw':>8} {'busbw':>8} "
    f"{'wire(B)':>12} {'inter(B)':>12} {'bf16eq':>8}"
)


def format_row(r: Row) -> str:
    return (
        f"{r.op:>14} {r.mode:>6} {r.size:>12} {r.count:>11} {r.time_us:>11.1f} {r.algbw:>8.3f} {r.busbw:>8.3f} "
        f"{r.wire:>12} {r.inter:>12} {r.bf16eq:>8.3f}"
    )


def plot(rows: list[Row], path: str, title: str) -> None:
    """Bus bandwidth (solid) and bf16-equivalent bandwidth (dashed) against size, one line per op and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, OPS):
        for mode in sorted({r.mode for r in rows}):
            pts = [r for r in rows if r.op == op and r.mode == mode]
            if not pts:
                continue
            line = ax.plot([r.size for r in pts], [r.busbw for r in pts], marker="o", label=f"{mode} busbw")[0]
            ax.plot([r.size for r in pts], [r.bf16eq for r in pts], ls="--", color=line.get_color(),
                    label=f"{mode} bf16-equivalent")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes, uncompressed)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m zeropp.bench.collectives",
        description="Exact vs quantized all-gather / reduce-scatter bandwidth (run under torchrun).",
    )
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--bits", nargs="+", type=int, choices=(8, 4), default=[8, 4],
                   help="quantized modes to run besides exact (default: 8 4)")
    p.add_argument("--no-exact", action="store_true", help="skip the exact (unquantized) rows")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("64K"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("16M"))
    p.add_argument("--factor", type=int, default=4, help="size step (default 4)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per (emulated) node; default $ZEROPP_RANKS_PER_NODE or $LOCAL_WORLD_SIZE")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="torch.distributed backend (auto: nccl with a GPU per rank on the host, else gloo on CPU)")
    p.add_argument("--csv", help="write the rows to this CSV file (rank 0)")
    p.add_argument("--plot", help="write a PNG of bandwidth vs size to this file (rank 0; needs matplotlib)")
    args = p.parse_args(argv)
    if args.factor < 2:
        p.error("--factor must be at least 2")
    if args.min_bytes > args.max_bytes:
        p.error("--min-bytes must not exceed --max-bytes")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib: pip install matplotlib")
    return args


def pick_backend(choice: str) -> tuple[str, torch.device]:
    """The torch.distributed backend and this rank's device for ``--backend choice``: NCCL on GPU ``LOCAL_RANK``
    needs a GPU per local rank (``auto`` takes it only then), gloo runs on CPU tensors."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "nccl" and local_world > gpus:
        raise SystemExit(f"--backend nccl needs one GPU per rank: {local_world} ranks on this host but {gpus} "
                         "GPUs; use --backend gloo (CPU tensors) or fewer ranks per host")
    if choice == "nccl" or (choice == "auto" and 0 < local_world <= gpus):
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    """Run the sweep on this rank; returns the process exit status (0)."""
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun, e.g.: torchrun --nproc-per-node 4 -m zeropp.bench.collectives "
              "--ranks-per-node 2", file=sys.stderr)
        raise SystemExit(2)
    backend, device = pick_backend(args.backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        topo = comm.Topology(ranks_per_node=args.ranks_per_node)
        dtype = DTYPES[args.dtype]
        modes: list[int | None] = ([] if args.no_exact else [None]) + list(args.bits)
        rank0 = dist.get_rank() == 0
        quant = backend_name(torch.empty(0, device=device))
        title = (f"{topo.world_size} ranks, {topo.num_nodes} nodes x {topo.ranks_per_node}, {backend}/"
                 f"{device.type}, {args.dtype}, block {args.block_size}, quant backend {quant}")
        if rank0:
            print(f"# zeropp collectives: {title}, iters {args.iters}, warmup {args.warmup}")
            print("# algbw/busbw/bf16eq in GB/s; wire = bytes sent per rank per call, inter = cross-node part")
            print("#" + HEADER[1:])
        rows = []
        for op in args.ops:
            for size in sizes(args.min_bytes, args.max_bytes, args.factor):
                for bits in modes:
                    row = measure(op, bits, size, dtype, topo, device, args.iters, args.warmup, args.block_size)
                    rows.append(row)
                    if rank0:
                        print(format_row(row), flush=True)
        if rank0 and args.csv:
            write_csv([asdict(r) for r in rows], args.csv)
        if rank0 and args.plot:
            plot(rows, args.plot, title)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
