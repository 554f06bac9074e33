"""Kernel benchmark: each quantization kernel against a device-to-device copy of the same bytes.

    python bench/kernels.py                          # GPU: 2^24, 2^26, 2^28 fp16 elements; CPU: 2^20 .. 2^24
    python bench/kernels.py --sizes 2^28 --block-size 2048 --csv kernels.csv
    python bench/kernels.py --kernels reduce         # only the rows whose name contains "reduce"

Rows (int4 unless the name says int8; sizes count input elements, output elements for dequantize):

* quantize / dequantize, int8 and int4, one pack;
* dequantize of an all-gathered W-pack buffer (qwZ: ``--world`` packs, one per rank) straight into the output;
* swizzled quantize (qgZ step 1: ``--nodes`` x ``--ranks-per-node`` packs in the two-hop order);
* fused dequantize-reduce-requantize of d = 2, 4, 8 runs of ``--nodes`` packs (qgZ step 3);
* fused final reduce-dequantize of ``--nodes`` packs, divided by the world size (qgZ step 5).

Each row is timed (warm-up, then the median of ``--reps`` runs; CUDA events on a GPU) together with a copy of
the same number of bytes in the same run. "bytes" counts what must move: inputs read once, outputs written
once. GB/s = bytes / time; floor/time = copy time / kernel time, i.e. the fraction of the copy ceiling reached
(1.0 = at the memory wall). When ``deepspeed`` is importable on a GPU, its corresponding kernels (QuantizerBuilder,
JIT-built) are timed on the same inputs and shown beside ours.

On a CPU the torch reference runs (``ZEROPP_QUANT_BACKEND=torch`` unless set): the numbers say how fast the
reference is on this machine, and nothing about the GPU kernels' targets.

A script rather than pytest-benchmark: the result that matters is the ratio to a copy measured in the same run
with CUDA events, printed as one table (or CSV); pytest-benchmark times with host clocks around each call and
reports per-test statistics, which fits neither.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from zeropp.bench.report import write_csv

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def parse_size(text: str) -> int:
    """``2^28``, ``1<<28``, ``268435456`` or ``256M`` / ``4K`` (binary)."""
    t = text.strip()
    if "^" in t:
        base, exp = t.split("^")
        return int(base) ** int(exp)
    if "<<" in t:
        a, b = t.split("<<")
        return int(a) << int(b)
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1].upper())
    return int(t[:-1]) * mult if mult else int(t)


def size_label(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"{n:,}"


@dataclass
class Case:
    name: str
    numel: int
    nbytes: int  # inputs read once + outputs written once
    fn: Callable[[], object]
    ds_fn: Callable[[], object] | None = None
    ds_note: str = ""


def ds_setup(wanted: bool, factory: Callable[[], Callable[[], object]], note: str = ""):
    """``(ds_fn, note)`` for a Case: ``factory()`` prepares DeepSpeed's inputs and returns the call to time.

    A DeepSpeed version whose kernels take other arguments must not stop the benchmark: its error becomes the note.
    """
    if not wanted:
        return None, ""
    try:
        return factory(), note
    except Exception as e:  # noqa: BLE001
        return None, f"error: {type(e).__name__}: {str(e)[:60]}"


class Timer:
    def __init__(self, device: torch.device, warmup: int, reps: int, stat: str = "median") -> None:
        self.device, self.warmup, self.reps = device, warmup, reps
        self.stat = statistics.median if stat == "median" else min
        self.mode = stat

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median (or least) seconds of ``fn()``. On a GPU ``warmup`` and ``reps`` are milliseconds of runs
        (``triton.testing.do_bench``), on a CPU counts of runs."""
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            # triton's do_bench clears the L2 cache before every run (a 256 MB write), times with CUDA events and
            # takes the median; warmup and rep are in milliseconds there
            from triton.testing import do_bench

            ms = do_bench(fn, warmup=self.warmup, rep=self.reps, return_mode=self.mode)
            return ms / 1e3
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return self.stat(times)


def load_deepspeed(device: torch.device):
    """DeepSpeed's quantizer extension, or ``(None, reason)``."""
    if device.type != "cuda":
        return None, "no GPU"
    try:
        import deepspeed  # noqa: F401
        from deepspeed.ops.op_builder import QuantizerBuilder
    except Exception as e:  # noqa: BLE001 - optional
        return None, f"deepspeed not importable ({type(e).__name__})"
    try:
        return QuantizerBuilder().load(), ""
    except Exception as e:  # noqa: BLE001
        return None, f"QuantizerBuilder failed to build/load: {e}"


def build_cases(
    n: int, dtype: torch.dtype, block_size: int, world: int, nodes: int, rpn: int, device: torch.device, ds
) -> list[Case]:
    from zeropp import quant
    from zeropp.quant import BlockFormat

    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    item = x.element_size()
    out = torch.empty(n, dtype=dtype, device=device)
    cases: list[Case] = []
    sym = getattr(ds, "Symmetric", None) if ds is not None else None
    ds_ok = ds is not None and dtype == torch.float16  # its kernels take fp16 (and read any 16-bit as fp16)

    for bits in (8, 4):
        fmt = BlockFormat(bits, block_size)
        packed = fmt.packed_bytes(n)
        qbuf = torch.empty(packed, dtype=torch.uint8, device=device)
        quant.quantize_chunks(x, fmt, 1, out=qbuf)
        groups = n // block_size

        def ds_quant(bits=bits, groups=groups):
            return lambda: ds.quantize(x, groups, bits, sym)

        def ds_dequant(bits=bits, groups=groups):
            codes, params = ds.quantize(x, groups, bits, sym)
            return lambda: ds.dequantize(codes, params, groups, bits, sym)

        cases.append(
            Case(f"quantize int{bits}", n, n * item + packed,
                 lambda fmt=fmt, qbuf=qbuf: quant.quantize_chunks(x, fmt, 1, out=qbuf),
                 *ds_setup(ds_ok and n % block_size == 0, ds_quant))
        )
        cases.append(
            Case(f"dequantize int{bits}", n, packed + n * item,
                 lambda fmt=fmt, qbuf=qbuf: quant.dequantize_chunks(qbuf, fmt, 1, n, out),
                 *ds_setup(ds_ok and n % block_size == 0, ds_dequant))
        )

    # qwZ: the all-gathered buffer holds one int8 pack per rank; dequantize straight into the full weights.
    fmt8, fmt4 = BlockFormat(8, block_size), BlockFormat(4, block_size)
    chunk = quant.chunk_numel(n, world)
    gathered = quant.quantize_chunks(x, fmt8, world)

    def ds_gather():  # its qwZ path: dequantize into a temporary, then copy into the parameters
        c8, p8 = ds.quantize(x, n // block_size, 8, sym)
        return lambda: out.copy_(ds.dequantize(c8, p8, n // block_size, 8, sym).view(-1))

    cases.append(
        Case(f"dequantize gathered int8 x{world}", n, gathered.numel() + n * item,
             lambda: quant.dequantize_chunks(gathered, fmt8, world, chunk, out),
             *ds_setup(ds_ok and n % (world * block_size) == 0, ds_gather, "DS: dequantize + copy"))
    )

    # qgZ step 1: swizzled int4 quantize for nodes x ranks_per_node.
    sw_world = nodes * rpn
    sw_bytes = fmt4.chunked_bytes(n, sw_world)
    sw_out = torch.empty(sw_bytes, dtype=torch.uint8, device=device)

    def ds_swizzle():
        return lambda: ds.swizzle_quant(x, n // block_size, 4, sym, 1, nodes, rpn)

    cases.append(
        Case(f"swizzle_quantize int4 {nodes}x{rpn}", n, n * item + sw_bytes,
             lambda: quant.swizzle_quantize(x, fmt4, nodes, rpn, out=sw_out),
             *ds_setup(ds_ok and n % (sw_world * block_size) == 0, ds_swizzle))
    )

    # qgZ step 3: d runs of `nodes` packs in, `nodes` packs out.
    for d in (2, 4, 8):
        cn = quant.chunk_numel(n, d * nodes)
        rbuf = quant.quantize_chunks(x, fmt4, d * nodes)
        rout = torch.empty(nodes * fmt4.packed_bytes(cn), dtype=torch.uint8, device=device)

        def ds_reduce(d=d):
            c4, s4 = ds.swizzle_quant(x, n // block_size, 4, sym, 1, nodes, d)
            in_groups, out_groups = n // block_size, n // block_size // d
            try:  # newer DeepSpeed takes devices_per_node; older ones hard-code 16
                ds.quantized_reduction(c4, s4, in_groups, out_groups, 4, sym, d)
                return lambda: ds.quantized_reduction(c4, s4, in_groups, out_groups, 4, sym, d)
            except TypeError:
                return lambda: ds.quantized_reduction(c4, s4, in_groups, out_groups, 4, sym)

        cases.append(
            Case(f"reduce_requantize int4 d={d}", n, rbuf.numel() + rout.numel(),
                 lambda rbuf=rbuf, rout=rout, d=d, cn=cn: quant.reduce_requantize(rbuf, fmt4, d, nodes, cn, out=rout),
                 *ds_setup(ds_ok and n % (d * nodes * block_size) == 0, ds_reduce))
        )

    # qgZ step 5: `nodes` packs of one slice in, the mean slice out.
    fcn = quant.chunk_numel(n, nodes)
    fbuf = quant.quantize_chunks(x, fmt4, nodes)
    fout = torch.empty(fcn, dtype=dtype, device=device)

    def ds_final():  # its final step: dequantize, then sum over nodes and divide in torch
        c4, p4 = ds.quantize(x, n // block_size, 4, sym)
        return lambda: ds.dequantize(c4, p4, n // block_size, 4, sym).view(nodes, -1).sum(0).div_(sw_world)

    cases.append(
        Case(f"reduce_dequantize int4 g={nodes}", n, fbuf.numel() + fcn * item,
             lambda: quant.reduce_dequantize(fbuf, fmt4, nodes, fcn, fout, divisor=sw_world),
             *ds_setup(ds_ok and n % (nodes * block_size) == 0, ds_final, "DS: dequantize + torch sum"))
    )
    return cases


def run_size(args, n: int, device: torch.device, timer: Timer, ds) -> list[dict]:
    from zeropp import quant

    cases = build_cases(n, DTYPES[args.dtype], args.block_size, args.world, args.nodes, args.ranks_per_node, device, ds)
    if args.kernels:
        cases = [c for c in cases if any(k in c.name for k in args.kernels)]
    rows = []
    for c in cases:
        half = c.nbytes // 2
        src = torch.empty(half, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        src.fill_(1)
        t = timer(c.fn)
        t_copy = timer(lambda: dst.copy_(src))
        row = {
            "kernel": c.name,
            "numel": n,
            "size": size_label(n),
            "bytes": c.nbytes,
            "ms": t * 1e3,
            "GB/s": c.nbytes / t / 1e9,
            "elem/s": n / t,
            "copy ms": t_copy * 1e3,
            "copy GB/s": 2 * half / t_copy / 1e9,
            "floor/time": t_copy / t,
            "backend": quant.backend_name(src),
        }
        if c.ds_fn is None and c.ds_note:
            row["DS note"] = c.ds_note
        if c.ds_fn is not None:
            try:
                t_ds = timer(c.ds_fn)
                row.update({"DS ms": t_ds * 1e3, "DS GB/s": c.nbytes / t_ds / 1e9, "DS floor/time": t_copy / t_ds})
            except Exception as e:  # noqa: BLE001 - a DeepSpeed version mismatch must not stop the benchmark
                row["DS note"] = f"error: {type(e).__name__}: {str(e)[:60]}"
            if c.ds_note and "DS note" not in row:
                row["DS note"] = c.ds_note
        rows.append(row)
        del src, dst
        if args.progress:
            print(f"  {size_label(n):>6} {c.name}: {t * 1e3:.3f} ms", file=sys.stderr, flush=True)
    return rows


SWEEP = {"elements": (4096, 8192, 16384), "num_warps": (4, 8)}
"""Tile sizes (elements per program) and warps per program that ``--sweep`` times, every op alike."""

def sweep_size(args, n: int, device: torch.device, timer: Timer, ds) -> list[dict]:
    """The rows of ``run_size`` (without DeepSpeed) for every tile of ``SWEEP``, set for every op at once with
    ``tile_override``."""
    from zeropp.quant._triton.common import TILE_ELEMENTS, tile_override

    rows = []
    for elements in SWEEP["elements"]:
        for warps in SWEEP["num_warps"]:
            with contextlib.ExitStack() as stack:
                for op in TILE_ELEMENTS:
                    stack.enter_context(tile_override(op, elements, warps))
                rows += [{**r, "elements": elements, "warps": warps} for r in run_size(args, n, device, timer, None)]
    return rows


def print_table(rows: list[dict], with_ds: bool, sweep: bool = False) -> None:
    cols = ["kernel", "size", "bytes", "ms", "GB/s", "elem/s", "copy ms", "floor/time"]
    if sweep:
        cols[1:1] = ["elements", "warps"]
    if with_ds:
        cols += ["DS ms", "DS GB/s", "DS floor/time", "DS note"]

    def cell(r, k):
        v = r.get(k, "")
        if k == "bytes":
            return f"{v:,}"
        if k == "elem/s":
            return f"{v:.3g}"
        if isinstance(v, float):
            return f"{v:.3f}" if k.endswith("ms") or "floor" in k else f"{v:.4g}"
        return str(v)

    body = [[cell(r, k) for k in cols] for r in rows]
    widths = [max(len(k), *(len(b[i]) for b in body)) for i, k in enumerate(cols)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    print(fmt(cols))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        print(fmt(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", nargs="+", type=parse_size, help="elements per row (e.g. 2^28); default by device")
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPES), help="input/output dtype (default fp16)")
    p.add_argument("--block-size", type=int, default=None, help="default: zeropp's DEFAULT_BLOCK_SIZE")
    p.add_argument("--world", type=int, default=8, help="packs in the gathered qwZ buffer (default 8)")
    p.add_argument("--nodes", type=int, default=2, help="qgZ nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="qgZ ranks per node for the swizzle (default 8)")
    p.add_argument("--reps", type=int, default=None,
                   help="GPU: milliseconds of timed runs per row (do_bench, default 100); CPU: runs (default 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="GPU: milliseconds of warm-up (default 25); CPU: untimed runs first (default 1)")
    p.add_argument("--check", action="store_true",
                   help="first compare every op's result on the device with the reference on the CPU, bit for bit "
                        "(bench/kernel_check.py); exit 1 on any mismatch")
    p.add_argument("--check-size", type=parse_size, default=1 << 22, help="elements of the --check ops (2^22)")
    p.add_argument("--no-big", action="store_true", help="--check without the pack past 2^31 elements (~10 GiB)")
    p.add_argument("--sweep", action="store_true",
                   help="instead of the table: each op's rows at every tile size and warp count of SWEEP")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="statistic over the timed runs (min resists other load on a shared CPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--kernels", nargs="+", help="only rows whose name contains one of these")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], help="sets ZEROPP_QUANT_BACKEND")
    p.add_argument("--no-deepspeed", action="store_true", help="do not time DeepSpeed's kernels")
    p.add_argument("--csv", metavar="PATH", help="also write the rows as CSV ('-' for stdout)")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no per-row progress on stderr")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if args.backend:
        os.environ["ZEROPP_QUANT_BACKEND"] = args.backend
    elif not gpu:
        os.environ.setdefault("ZEROPP_QUANT_BACKEND", "torch")  # the interpreter would take hours
    from zeropp.quant.format import DEFAULT_BLOCK_SIZE

    args.block_size = args.block_size or DEFAULT_BLOCK_SIZE
    sizes = args.sizes or ([1 << 24, 1 << 26, 1 << 28] if gpu else [1 << 20, 1 << 22, 1 << 24])
    if args.threads:
        torch.set_num_threads(args.threads)
    timer = Timer(device, args.warmup if args.warmup is not None else (25 if gpu else 1),
                  args.reps if args.reps is not None else (100 if gpu else 5), args.stat)
    ds, ds_reason = (None, "--no-deepspeed") if args.no_deepspeed else load_deepspeed(device)

    if gpu:
        where = f"{torch.cuda.get_device_name(device)}"
    else:
        where = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
                f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}) -- torch " \
                "reference only, GPU kernels NOT measured"
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    print(f"zeropp kernel benchmark on {where}; {versions}")
    print(
        f"dtype {args.dtype}, block {args.block_size}, world {args.world}, nodes {args.nodes} x "
        f"{args.ranks_per_node}; {args.stat} of {timer.reps} after {timer.warmup} warm-up; "
        f"DeepSpeed: {'timed' if ds is not None else 'not timed (' + ds_reason + ')'}"
    )
    failed = []
    if args.check:
        import kernel_check

        checks = kernel_check.op_checks(args.check_size, DTYPES[args.dtype], args.block_size, args.world, args.nodes,
                                        args.ranks_per_node, device)
        if not args.no_big and gpu:
            checks.append((f"int8 pack of {kernel_check.BIG:,} elements (offsets past 2^31)",
                           lambda: kernel_check.big_check(DTYPES[args.dtype], args.block_size, device)))
        for name, check in checks:
            ok = check()
            failed += [] if ok else [name]
            print(f"check {'PASS' if ok else 'FAIL'}: {name} ({size_label(args.check_size)} elements)", flush=True)
    rows = []
    for n in sizes:
        rows += sweep_size(args, n, device, timer, ds) if args.sweep else run_size(args, n, device, timer, ds)
    print()
    print_table(rows, with_ds=ds is not None, sweep=args.sweep)
    if args.csv:
        write_csv(rows, args.csv)
    if failed:
        print(f"check FAILED for {len(failed)} op(s): {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
