"""Kernel benchmark: each quantization kernel against a device-to-device copy of the same bytes.

    python bench/kernels.py                          # GPU: 2^26 and 2^28 fp16 elements; CPU: 2^20 .. 2^24
    python bench/kernels.py --sizes 2^28 --dtype fp16 bf16 --block-size 128 2048 --check --csv kernels.csv
    python bench/kernels.py --sweep --sizes 2^26     # each main row over tile sizes and warps per program
    python bench/kernels.py --kernels "quantize int4" "reduce_requantize int4 d=2"   # only these rows (exact names)

Rows (int4 unless the name says int8 or int2; sizes count input elements, output elements for dequantize), for
every size, dtype and block size asked for:

* quantize / dequantize, int8, int4 and int2, one pack; int4 and int2 rounded stochastically (``seeded``);
* dequantize of an all-gathered W-pack buffer (qwZ: ``--world`` packs, one per rank) straight into the output;
* dequantize-add, int8 and int4: one pack added into values of the row's dtype in place (the weight deltas'
  ``add_delta``; "bytes" counts the values read and written, so its copy moves as much);
* swizzled quantize (qgZ step 1: ``--nodes`` x ``--ranks-per-node`` packs in the two-hop order), int4 and int2;
* fused dequantize-reduce-requantize of d = 2, 4, 8 runs of ``--nodes`` packs (qgZ step 3), int4; int2 at d = 2;
  and the per-hop rows at d = 2: int8 packs requantized into int4 (``int8->int4``), rounded to nearest and
  stochastically, and into int2;
* fused final reduce-dequantize of ``--nodes`` packs, divided by the world size (qgZ step 5), int4 and int2.

**Timing.** On a GPU each row runs once (compilation), then ``triton.testing.do_bench`` times it: ``--warmup``
milliseconds of untimed runs, then ``--reps`` milliseconds of runs timed with CUDA events, the L2 cache cleared
(a 256 MB write) before each; the row shows the median (``ms``; 20% and 80% quantiles in the CSV). A copy of
the same number of bytes is timed the same way in the same run. On a CPU a host timer takes the median of
``--reps`` runs after ``--warmup`` runs. "bytes" counts what must move: inputs read once, outputs written once.
GB/s = bytes / time; floor/time = copy time / kernel time, the fraction of the copy ceiling reached (1.0 = at the
memory wall). When ``deepspeed`` is importable on a GPU, its corresponding kernels (QuantizerBuilder, JIT-built)
are timed on the same inputs and shown beside ours.

**Rotation rows.** ``hadamard_rotate s=32`` and ``hadamard_unrotate s=32`` time the block Hadamard rotation of
``zeropp.quant.rotation`` (32-element blocks), forward (the row's dtype in, float32 out: the Triton kernel widens
a bfloat16 or float16 input as it loads it, the native CPU library has torch widen it first, inside the timed call)
and inverse (float32 in and out). ``swizzle_quantize_rotated int4 NxR s=32`` and ``reduce_dequantize_rotated int4
g=N s=32`` time qgZ's first and last steps with the rotation fused (the row's dtype in, int4 packs out; int4 packs
in, the row's dtype out): beside ``swizzle_quantize int4`` and ``reduce_dequantize int4``, the difference is what
the fused rotation costs, against the two ``hadamard`` rows it replaces. ``swizzle_quantize_rotated int4 NxR s=32
seeded`` is step 1 with the rotation and stochastic rounding fused (``seed=SEED``): beside ``quantize int4
seeded``, what the rotation adds to a seeded quantize.

**--check.** Every row's output, on the inputs the row is timed on, is compared with the torch reference run on
CPU copies of those inputs: codes and scales the same bytes, values the same floats (``bench/kernel_check.py``).
The ``check`` column says PASS or FAIL (what differs is in the CSV's ``detail``). On a GPU the ops also run once
per dtype on a tensor just past 2^31 elements, compared in windows (``--far-numel``; ~12 GiB at fp16). Any
mismatch or error makes the exit status 1.

**--kernels** takes row names exactly as the table prints them (``row_names``: e.g. "dequantize int8",
"dequantize gathered int8 x8", "reduce_dequantize int4 g=2"; the numbers follow ``--world``, ``--nodes`` and
``--ranks-per-node``); an unknown name is an error that lists the valid ones.

**--sweep.** The main rows (``SWEEP_ROWS``, or ``--kernels``) at every tile of ``--tile-elements`` elements per
program and ``--tile-warps`` warps (``zeropp.quant._triton.common.tile_override`` of the row's op), plus the
launchers' default tile; with ``--check`` every tile's output is checked too. Table: op, bits, block, elements,
warps, time, floor/time, and the speed against the default tile.

On a CPU the native CPU library runs where it is built, else the torch reference (``--backend`` picks one; the
Triton interpreter would take hours): the numbers say how fast the CPU backends are on this machine, and nothing
about the GPU kernels' targets.

A script rather than pytest-benchmark: the result that matters is the ratio to a copy measured in the same run
with CUDA events, printed as one table (or CSV); pytest-benchmark times with host clocks around each call and
reports per-test statistics, which fits neither. On the CPU, where host clocks are what there is, the main rows are
also a pytest-benchmark suite with saved baselines to compare against (``bench/test_bench_kernels.py``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zeropp.bench.report import parse_size, progress, rows_table, write_csv

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_check import FAR_NUMEL, PackLayout, Reference, compare, far_checks, far_memory  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SWEEP_ROWS = ("quantize int8", "quantize int4", "dequantize int8", "dequantize int4", "swizzle_quantize",
              "reduce_requantize int4 d=2", "reduce_requantize int4 d=8", "reduce_dequantize")
"""The rows ``--sweep`` times (by name prefix) unless ``--kernels`` says otherwise."""
SEED = 20241127
"""The seed of the stochastically rounded (``seeded``) rows."""
SWEEP_ELEMENTS = (2048, 4096, 8192, 16384, 32768)
SWEEP_WARPS = (4, 8)
ROTATION_SIZE = 32
"""Elements per block of the rotation rows (SDP4Bit's)."""
FORMATS = {"bytes": "{:,}".format, "ms": ".4f", "copy ms": ".4f", "GB/s": ".4g", "elem/s": ".3g",
           "floor/time": ".3f", "vs default": ".3f", "DS ms": ".4f", "DS GB/s": ".4g", "DS floor/time": ".3f"}


def size_label(n: int) -> str:
    return f"2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"{n:,}"


@dataclass
class Case:
    name: str
    op: str  # the launcher's op, as tile_override names it ("rotation" for the rotation rows, which have none)
    bits: int  # 0 for the rotation rows (no codes)
    numel: int
    nbytes: int  # inputs read once + outputs written once
    fn: Callable[[], object]
    output: torch.Tensor  # what fn writes
    expected: Callable[[], torch.Tensor]  # the reference's output for the same inputs (on the CPU)
    layout: PackLayout | None = None  # set when the output is packs
    ds_fn: Callable[[], object] | None = None
    ds_note: str = ""
    groups: int = 1  # runs summed, for the reductions
    seeded: bool = False  # rounded stochastically
    start: torch.Tensor | None = None  # an in-place row's output before the run (the checked run starts from it)


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
    """``timer(fn)`` -> ``(statistic, 20% quantile, 80% quantile)`` seconds of ``fn()``.

    GPU: ``triton.testing.do_bench`` (``warmup`` and ``reps`` in milliseconds; L2 cleared before every run). CPU:
    ``warmup`` untimed runs, then ``reps`` runs timed with the host clock."""

    def __init__(self, device: torch.device, warmup: int, reps: int, stat: str = "median") -> None:
        self.device, self.warmup, self.reps, self.stat = device, warmup, reps, stat

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        if self.device.type == "cuda":
            from triton.testing import do_bench

            fn()  # compiles on a first call
            torch.cuda.synchronize(self.device)
            quantiles = [0.5 if self.stat == "median" else 0.0, 0.2, 0.8]
            try:
                ms = do_bench(fn, warmup=self.warmup, rep=self.reps, quantiles=quantiles, return_mode=self.stat)
            except TypeError:  # a triton without return_mode
                ms = do_bench(fn, warmup=self.warmup, rep=self.reps, quantiles=quantiles)
            return tuple(m / 1e3 for m in ms)
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(max(1, self.reps)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        times.sort()
        stat = times[(len(times) - 1) // 2] if self.stat == "median" else times[0]
        return stat, times[int(0.2 * (len(times) - 1))], times[int(0.8 * (len(times) - 1))]


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


def row_names(world: int, nodes: int, rpn: int) -> list[str]:
    """The names of the rows, in table order, for ``world`` gathered packs and ``nodes`` x ``rpn`` ranks (what
    ``--kernels`` accepts)."""
    return ["quantize int8", "dequantize int8", "quantize int4", "dequantize int4", "quantize int2", "dequantize int2",
            "quantize int4 seeded", "quantize int2 seeded", f"dequantize gathered int8 x{world}",
            "dequantize_add int8", "dequantize_add int4",
            f"hadamard_rotate s={ROTATION_SIZE}", f"hadamard_unrotate s={ROTATION_SIZE}",
            f"swizzle_quantize int4 {nodes}x{rpn}", f"swizzle_quantize int2 {nodes}x{rpn}",
            *(f"reduce_requantize int4 d={d}" for d in (2, 4, 8)),
            "reduce_requantize int2 d=2", "reduce_requantize int8->int4 d=2", "reduce_requantize int8->int4 d=2 seeded",
            "reduce_requantize int8->int2 d=2", f"reduce_dequantize int4 g={nodes}",
            f"reduce_dequantize int2 g={nodes}",
            f"swizzle_quantize_rotated int4 {nodes}x{rpn} s={ROTATION_SIZE}",
            f"swizzle_quantize_rotated int4 {nodes}x{rpn} s={ROTATION_SIZE} seeded",
            f"reduce_dequantize_rotated int4 g={nodes} s={ROTATION_SIZE}"]


def build_cases(n: int, dtype: torch.dtype, block_size: int, world: int, nodes: int, rpn: int, device: torch.device,
                ds, ref: Reference, keep: Callable[[str], bool] = lambda name: True) -> list[Case]:
    """The rows at ``n`` elements whose name ``keep`` accepts (only their inputs are made). Every row writes an
    output of its own, so a wrong result of one row never feeds another; inputs are made by the ops under test (any
    valid bytes would do) and stay unchanged."""
    from zeropp import quant
    from zeropp.quant import BlockFormat

    gen = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, generator=gen, device=device, dtype=torch.float32).to(dtype)
    item = x.element_size()
    sym = getattr(ds, "Symmetric", None) if ds is not None else None
    ds_ok = ds is not None and dtype == torch.float16  # its kernels take fp16 (and read any 16-bit as fp16)
    fmt8, fmt4, fmt2 = BlockFormat(8, block_size), BlockFormat(4, block_size), BlockFormat(2, block_size)
    rows: dict[str, Callable[[], Case]] = {}

    def quantize_row(fmt: BlockFormat, seed: int | None = None) -> Case:
        qout = torch.empty(fmt.packed_bytes(n), dtype=torch.uint8, device=device)
        groups = n // block_size

        def ds_quant():
            return lambda: ds.quantize(x, groups, fmt.bits, sym)

        return Case(f"quantize int{fmt.bits}" + (" seeded" if seed is not None else ""), "quantize", fmt.bits, n,
                    n * item + qout.numel(), lambda: quant.quantize_chunks(x, fmt, 1, out=qout, seed=seed), qout,
                    lambda: ref.quantize(x, fmt, seed=seed), PackLayout(fmt, 1, n),
                    *ds_setup(ds_ok and n % block_size == 0 and fmt.bits > 2 and seed is None, ds_quant))

    def dequantize_row(fmt: BlockFormat) -> Case:
        qin = quant.quantize_chunks(x, fmt, 1)
        out = torch.empty(n, dtype=dtype, device=device)
        groups = n // block_size

        def ds_dequant():
            codes, params = ds.quantize(x, groups, fmt.bits, sym)
            return lambda: ds.dequantize(codes, params, groups, fmt.bits, sym)

        return Case(f"dequantize int{fmt.bits}", "dequantize", fmt.bits, n, qin.numel() + n * item,
                    lambda: quant.dequantize_chunks(qin, fmt, 1, n, out), out,
                    lambda: ref.dequantize(qin, fmt, 1, n, n, dtype), None,
                    *ds_setup(ds_ok and n % block_size == 0 and fmt.bits > 2, ds_dequant))

    for fmt in (fmt8, fmt4, fmt2):
        rows[f"quantize int{fmt.bits}"] = lambda fmt=fmt: quantize_row(fmt)
        rows[f"dequantize int{fmt.bits}"] = lambda fmt=fmt: dequantize_row(fmt)
    rows["quantize int4 seeded"] = lambda: quantize_row(fmt4, SEED)
    rows["quantize int2 seeded"] = lambda: quantize_row(fmt2, SEED)

    def gathered_row() -> Case:
        """qwZ: the all-gathered buffer holds one int8 pack per rank; dequantize straight into the full weights."""
        chunk = quant.chunk_numel(n, world)
        gathered = quant.quantize_chunks(x, fmt8, world)
        gout = torch.empty(n, dtype=dtype, device=device)

        def ds_gather():  # its qwZ path: dequantize into a temporary, then copy into the parameters
            c8, p8 = ds.quantize(x, n // block_size, 8, sym)
            return lambda: gout.copy_(ds.dequantize(c8, p8, n // block_size, 8, sym).view(-1))

        return Case(f"dequantize gathered int8 x{world}", "dequantize", 8, n, gathered.numel() + n * item,
                    lambda: quant.dequantize_chunks(gathered, fmt8, world, chunk, gout), gout,
                    lambda: ref.dequantize(gathered, fmt8, world, chunk, n, dtype), None,
                    *ds_setup(ds_ok and n % (world * block_size) == 0, ds_gather, "DS: dequantize + copy"))

    rows[f"dequantize gathered int8 x{world}"] = gathered_row

    def dequantize_add_row(fmt: BlockFormat) -> Case:
        """The weight deltas' ``add_delta``: a pack added into values in place (each timed run adds it again)."""
        qin = quant.quantize_chunks(x, fmt, 1)
        start = torch.randn(n, generator=gen, device=device, dtype=torch.float32).to(dtype)
        out = start.clone()
        return Case(f"dequantize_add int{fmt.bits}", "dequantize", fmt.bits, n, qin.numel() + 2 * n * item,
                    lambda: quant.dequantize_add_chunks(qin, fmt, 1, n, out), out,
                    lambda: ref.dequantize_add(qin, fmt, 1, n, start), start=start)

    rows["dequantize_add int8"] = lambda: dequantize_add_row(fmt8)
    rows["dequantize_add int4"] = lambda: dequantize_add_row(fmt4)

    def rotation_row(inverse: bool) -> Case:
        """The Hadamard rotation of ROTATION_SIZE-element blocks (inverse: of float32 rotated values)."""
        from zeropp.quant import rotation

        src = x.float() if inverse else x
        rot_out = torch.empty(rotation.rotated_numel(n, ROTATION_SIZE), device=device)
        op = quant.hadamard_unrotate if inverse else quant.hadamard_rotate

        def expected() -> torch.Tensor:
            want = torch.empty(rot_out.numel())
            rotation.hadamard(src.cpu().float(), ROTATION_SIZE, inverse, want)
            return want

        name = f"hadamard_{'un' if inverse else ''}rotate s={ROTATION_SIZE}"
        return Case(name, "rotation", 0, n, n * src.element_size() + rot_out.numel() * 4,
                    lambda: op(src, ROTATION_SIZE, out=rot_out), rot_out, expected)

    for inverse in (False, True):
        rows[f"hadamard_{'un' if inverse else ''}rotate s={ROTATION_SIZE}"] = lambda inv=inverse: rotation_row(inv)

    sw_world = nodes * rpn

    def swizzle_row(fmt: BlockFormat) -> Case:
        """qgZ step 1: swizzled quantize for nodes x ranks_per_node."""
        sw_out = torch.empty(fmt.chunked_bytes(n, sw_world), dtype=torch.uint8, device=device)

        def ds_swizzle():
            return lambda: ds.swizzle_quant(x, n // block_size, 4, sym, 1, nodes, rpn)

        return Case(f"swizzle_quantize int{fmt.bits} {nodes}x{rpn}", "quantize", fmt.bits, n,
                    n * item + sw_out.numel(), lambda: quant.swizzle_quantize(x, fmt, nodes, rpn, out=sw_out), sw_out,
                    lambda: ref.quantize(x, fmt, sw_world, nodes),
                    PackLayout(fmt, sw_world, quant.chunk_numel(n, sw_world)),
                    *ds_setup(ds_ok and n % (sw_world * block_size) == 0 and fmt.bits == 4, ds_swizzle))

    for fmt in (fmt4, fmt2):
        rows[f"swizzle_quantize int{fmt.bits} {nodes}x{rpn}"] = lambda fmt=fmt: swizzle_row(fmt)

    def per_hop_row(fmt: BlockFormat, out_fmt: BlockFormat, d: int, seed: int | None) -> Case:
        """qgZ step 3 with a format per hop: d runs of `nodes` packs of fmt in, `nodes` packs of out_fmt out."""
        cn = quant.chunk_numel(n, d * nodes)
        rbuf = quant.quantize_chunks(x, fmt, d * nodes)
        rout = torch.empty(nodes * out_fmt.packed_bytes(cn), dtype=torch.uint8, device=device)
        name = f"int{fmt.bits}" if fmt == out_fmt else f"int{fmt.bits}->int{out_fmt.bits}"
        return Case(f"reduce_requantize {name} d={d}" + (" seeded" if seed is not None else ""), "reduce_requantize",
                    fmt.bits, n, rbuf.numel() + rout.numel(),
                    lambda: quant.reduce_requantize(rbuf, fmt, d, nodes, cn, out=rout, out_fmt=out_fmt, seed=seed),
                    rout, lambda: ref.reduce_requantize(rbuf, fmt, d, nodes, cn, out_fmt, seed),
                    PackLayout(out_fmt, nodes, cn), groups=d, seeded=seed is not None)

    rows["reduce_requantize int2 d=2"] = lambda: per_hop_row(fmt2, fmt2, 2, None)
    rows["reduce_requantize int8->int4 d=2"] = lambda: per_hop_row(fmt8, fmt4, 2, None)
    rows["reduce_requantize int8->int4 d=2 seeded"] = lambda: per_hop_row(fmt8, fmt4, 2, SEED)
    rows["reduce_requantize int8->int2 d=2"] = lambda: per_hop_row(fmt8, fmt2, 2, None)

    def reduce_row(d: int) -> Case:
        """qgZ step 3: d runs of `nodes` packs in, `nodes` packs out."""
        cn = quant.chunk_numel(n, d * nodes)
        rbuf = quant.quantize_chunks(x, fmt4, d * nodes)
        rout = torch.empty(nodes * fmt4.packed_bytes(cn), dtype=torch.uint8, device=device)

        def ds_reduce():
            c4, s4 = ds.swizzle_quant(x, n // block_size, 4, sym, 1, nodes, d)
            in_groups, out_groups = n // block_size, n // block_size // d
            try:  # newer DeepSpeed takes devices_per_node; older ones hard-code 16
                ds.quantized_reduction(c4, s4, in_groups, out_groups, 4, sym, d)
                return lambda: ds.quantized_reduction(c4, s4, in_groups, out_groups, 4, sym, d)
            except TypeError:
                return lambda: ds.quantized_reduction(c4, s4, in_groups, out_groups, 4, sym)

        return Case(f"reduce_requantize int4 d={d}", "reduce_requantize", 4, n, rbuf.numel() + rout.numel(),
                    lambda: quant.reduce_requantize(rbuf, fmt4, d, nodes, cn, out=rout), rout,
                    lambda: ref.reduce_requantize(rbuf, fmt4, d, nodes, cn), PackLayout(fmt4, nodes, cn),
                    *ds_setup(ds_ok and n % (d * nodes * block_size) == 0, ds_reduce), groups=d)

    for d in (2, 4, 8):
        rows[f"reduce_requantize int4 d={d}"] = lambda d=d: reduce_row(d)

    def final_row(fmt: BlockFormat) -> Case:
        """qgZ step 5: `nodes` packs of one slice in, the mean slice out."""
        fcn = quant.chunk_numel(n, nodes)
        fbuf = quant.quantize_chunks(x, fmt, nodes)
        fout = torch.empty(fcn, dtype=dtype, device=device)

        def ds_final():  # its final step: dequantize, then sum over nodes and divide in torch
            c4, p4 = ds.quantize(x, n // block_size, 4, sym)
            return lambda: ds.dequantize(c4, p4, n // block_size, 4, sym).view(nodes, -1).sum(0).div_(sw_world)

        return Case(f"reduce_dequantize int{fmt.bits} g={nodes}", "reduce_dequantize", fmt.bits, n,
                    fbuf.numel() + fcn * item,
                    lambda: quant.reduce_dequantize(fbuf, fmt, nodes, fcn, fout, divisor=sw_world), fout,
                    lambda: ref.reduce_dequantize(fbuf, fmt, nodes, fcn, fcn, dtype, sw_world), None,
                    *ds_setup(ds_ok and n % (nodes * block_size) == 0 and fmt.bits == 4, ds_final,
                              "DS: dequantize + torch sum"))

    for fmt in (fmt4, fmt2):
        rows[f"reduce_dequantize int{fmt.bits} g={nodes}"] = lambda fmt=fmt: final_row(fmt)

    def rotated_swizzle_row(seed: int | None = None) -> Case:
        """qgZ step 1 with the rotation fused: each slice rotated in ROTATION_SIZE blocks as it is quantized
        (rounded stochastically with a ``seed``)."""
        sw_out = torch.empty(fmt4.chunked_bytes(n, sw_world), dtype=torch.uint8, device=device)
        width = quant.rotated_numel(quant.chunk_numel(n, sw_world), ROTATION_SIZE)
        name = f"swizzle_quantize_rotated int4 {nodes}x{rpn} s={ROTATION_SIZE}"
        return Case(name + (" seeded" if seed is not None else ""), "quantize", 4, n, n * item + sw_out.numel(),
                    lambda: quant.swizzle_quantize_rotated(x, fmt4, nodes, rpn, ROTATION_SIZE, out=sw_out, seed=seed),
                    sw_out, lambda: ref.swizzle_quantize_rotated(x, fmt4, nodes, rpn, ROTATION_SIZE, seed),
                    PackLayout(fmt4, sw_world, width), seeded=seed is not None)

    def rotated_final_row() -> Case:
        """qgZ step 5 with the inverse rotation fused: `nodes` packs of rotated values in, the mean slice out."""
        fcn = quant.chunk_numel(n, nodes)
        fbuf = quant.quantize_chunks(quant.rotate_slices(x, nodes, ROTATION_SIZE), fmt4, nodes)  # any backend
        fout = torch.empty(fcn, dtype=dtype, device=device)
        return Case(f"reduce_dequantize_rotated int4 g={nodes} s={ROTATION_SIZE}", "reduce_dequantize", 4, n,
                    fbuf.numel() + fcn * item,
                    lambda: quant.reduce_dequantize_rotated(fbuf, fmt4, nodes, fcn, fout, ROTATION_SIZE,
                                                            divisor=sw_world), fout,
                    lambda: ref.reduce_dequantize_rotated(fbuf, fmt4, nodes, fcn, fcn, dtype, sw_world,
                                                          ROTATION_SIZE))

    rows[f"swizzle_quantize_rotated int4 {nodes}x{rpn} s={ROTATION_SIZE}"] = rotated_swizzle_row
    rows[f"swizzle_quantize_rotated int4 {nodes}x{rpn} s={ROTATION_SIZE} seeded"] = lambda: rotated_swizzle_row(SEED)
    rows[f"reduce_dequantize_rotated int4 g={nodes} s={ROTATION_SIZE}"] = rotated_final_row
    return [rows[name]() for name in row_names(world, nodes, rpn) if keep(name)]


def check_case(case: Case, expected: torch.Tensor | None = None) -> tuple[str, str]:
    """Run ``case`` once and compare its output with the reference: ``("PASS" | "FAIL" | "ERROR", detail)``."""
    try:
        if case.start is not None:
            case.output.copy_(case.start)
        else:  # nothing left from before
            case.output.fill_(0x55 if case.output.dtype == torch.uint8 else float("nan"))
        case.fn()
        diff = compare(case.output, case.expected() if expected is None else expected, case.layout)
        return ("PASS", "") if diff is None else ("FAIL", diff)
    except Exception as e:  # noqa: BLE001 - one broken row must not hide the others
        return "ERROR", f"{type(e).__name__}: {str(e)[:300]}"


def copy_of(nbytes: int, device: torch.device) -> Callable[[], object]:
    """A device copy that moves ``nbytes`` bytes: ``nbytes // 2`` read, as many written (a row's floor)."""
    src = torch.full((nbytes // 2,), 1, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


class Copies:
    """The time of a device copy of ``nbytes`` bytes (read + written), measured once per size in a run."""

    def __init__(self, device: torch.device, timer: Timer) -> None:
        self.device, self.timer, self.times = device, timer, {}

    def __call__(self, nbytes: int) -> float:
        half = nbytes // 2
        if half not in self.times:
            self.times[half] = self.timer(copy_of(nbytes, self.device))[0]
        return self.times[half]


def timing(case: Case, timer: Timer, copies: Copies, fn: Callable[[], object] | None = None) -> dict:
    """The row's timing columns (``fn`` defaults to the case's kernel)."""
    t, lo, hi = timer(fn or case.fn)
    t_copy = copies(case.nbytes)
    return {"ms": t * 1e3, "ms p20": lo * 1e3, "ms p80": hi * 1e3, "GB/s": case.nbytes / t / 1e9,
            "elem/s": case.numel / t, "copy ms": t_copy * 1e3, "copy GB/s": 2 * (case.nbytes // 2) / t_copy / 1e9,
            "floor/time": t_copy / t}


def run_config(args, n: int, dtype: str, block: int, device: torch.device, timer: Timer, copies: Copies, ds,
               emit: Callable[[dict], None]) -> None:
    """Every row of one size, dtype and block size: built, checked (``--check``), timed, passed to ``emit``."""
    from zeropp import quant

    cases = build_cases(n, DTYPES[dtype], block, args.world, args.nodes, args.ranks_per_node, device, ds, Reference(),
                        lambda name: not args.kernels or name in args.kernels)
    for c in cases:
        row = {"dtype": dtype, "block": block, "kernel": c.name, "op": c.op, "bits": c.bits, "numel": n,
               "size": size_label(n), "bytes": c.nbytes, "backend": quant.backend_name(c.output)}
        if args.check:
            row["check"], row["detail"] = check_case(c)
        try:
            row.update(timing(c, timer, copies))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if c.ds_note:
            row["DS note"] = c.ds_note
        if c.ds_fn is not None and "ms" in row:
            try:
                t_ds = timer(c.ds_fn)[0]
                row.update({"DS ms": t_ds * 1e3, "DS GB/s": c.nbytes / t_ds / 1e9,
                            "DS floor/time": row["copy ms"] / 1e3 / t_ds})
            except Exception as e:  # noqa: BLE001 - a DeepSpeed version mismatch must not stop the benchmark
                row["DS note"] = f"error: {type(e).__name__}: {str(e)[:60]}"
        emit(row)


def default_tile(c: Case, block: int) -> tuple[int, int]:
    """The tile the launcher of ``c``'s op picks by itself: (elements per program, warps)."""
    from zeropp.quant import BlockFormat
    from zeropp.quant._triton import common, quantize, reduce

    if c.op == "reduce_requantize":
        shape = reduce.requantize_shape(BlockFormat(c.bits, block), c.groups, seeded=c.seeded)
    elif c.op == "quantize":
        shape = quantize.quantize_shape(BlockFormat(c.bits, block), True, c.seeded, "rotated" in c.name)
    else:
        shape = common.launch_shape(c.op, block)
    return shape.blocks_per_program * block, shape.num_warps


def sweep_config(args, n: int, dtype: str, block: int, device: torch.device, timer: Timer, copies: Copies,
                 emit: Callable[[dict], None]) -> None:
    """The sweep rows of one size, dtype and block size: each main row at every tile of the grid and the default."""
    from zeropp import quant
    from zeropp.quant._triton import common

    keep = (lambda name: name in args.kernels) if args.kernels else (lambda name: name.startswith(SWEEP_ROWS))
    cases = build_cases(n, DTYPES[dtype], block, args.world, args.nodes, args.ranks_per_node, device, None,
                        Reference(), keep)
    for c in cases:
        default = default_tile(c, block)
        grid = sorted({(max(e, block), w) for e in args.tile_elements for w in args.tile_warps} | {default})
        expected = c.expected().to(device) if args.check else None
        base = {"dtype": dtype, "block": block, "kernel": c.name, "op": c.op, "bits": c.bits, "numel": n,
                "size": size_label(n), "bytes": c.nbytes, "backend": quant.backend_name(c.output)}
        for elements, warps in grid:
            row = {**base, "elements": elements, "warps": warps,
                   "default": "yes" if (elements, warps) == default else ""}
            try:
                with common.tile_override(c.op, elements, warps):
                    if args.check:
                        row["check"], row["detail"] = check_case(c, expected)
                    row.update(timing(c, timer, copies))
            except Exception as e:  # noqa: BLE001 - a tile that fails to compile or launch is a row, not the end
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            emit(row)


def sweep_tables(rows: Sequence[dict]) -> str:
    """The sweep as a table (each tile's speed against the default tile's), then the best tile per row."""
    default = {(r["dtype"], r["block"], r["kernel"], r["size"]): r["ms"]
               for r in rows if r.get("default") and "ms" in r}
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["dtype"], r["block"], r["kernel"], r["size"])
        if "ms" in r and key in default:
            r["vs default"] = default[key] / r["ms"]
        if "ms" in r and r.get("check", "PASS") == "PASS" and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    cols = ["op", "kernel", "bits", "dtype", "block", "size", "elements", "warps", "default", "ms", "floor/time",
            "vs default", "check", "error"]
    summary = [{**b, "best tile": f"{b['elements']} x {b['warps']}w", "best floor/time": b["floor/time"],
                "default floor/time": b["floor/time"] / b.get("vs default", float("nan"))} for b in best.values()]
    return "\n\n".join([rows_table(rows, cols, FORMATS), "Best tile per row (checked rows only):",
                        rows_table(summary, ["kernel", "dtype", "block", "size", "best tile", "best floor/time",
                                             "default floor/time", "vs default"],
                                   {**FORMATS, "best floor/time": ".3f", "default floor/time": ".3f"})])


def run_far_checks(args, dtype: str, block: int, device: torch.device, emit: Callable[[dict], None]) -> None:
    """The ops past 2^31 elements (``kernel_check.far_checks``), one row per op."""
    base = {"dtype": dtype, "block": block, "numel": args.far_numel, "size": size_label(args.far_numel), "op": "far"}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
        need = far_memory(args.far_numel, DTYPES[dtype])
        if free < need:
            emit({**base, "kernel": "past 2^31", "check": "SKIP",
                  "detail": f"needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"})
            return
    far = min(1 << 31, args.far_numel * 5 // 8)
    try:
        results = far_checks(args.far_numel, DTYPES[dtype], block, device, far=far)
    except Exception as e:  # noqa: BLE001 - e.g. an op that makes the input of the next ones failed
        results = [("", f"error: {type(e).__name__}: {str(e)[:300]}")]
    for name, diff in results:
        emit({**base, "kernel": f"past 2^31: {name}" if name else "past 2^31", "check": "PASS" if diff is None
              else "FAIL", "detail": diff or ""})
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", nargs="+", type=parse_size, help="elements per row (e.g. 2^28); default by device")
    p.add_argument("--dtype", nargs="+", default=["fp16"], choices=sorted(DTYPES), help="input/output dtypes (fp16)")
    p.add_argument("--block-size", nargs="+", type=int, default=None, help="default: zeropp's DEFAULT_BLOCK_SIZE")
    p.add_argument("--world", type=int, default=8, help="packs in the gathered qwZ buffer (default 8)")
    p.add_argument("--nodes", type=int, default=2, help="qgZ nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="qgZ ranks per node for the swizzle (default 8)")
    p.add_argument("--reps", type=int, default=None,
                   help="GPU: milliseconds of timed runs per row (do_bench; default 100); CPU: runs (default 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="GPU: milliseconds of untimed runs first (default 25); CPU: runs (default 1)")
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="statistic over the timed runs (min resists other load on a shared CPU)")
    p.add_argument("--check", action="store_true",
                   help="compare every row's output with the CPU reference bit for bit; exit 1 on any mismatch")
    p.add_argument("--far-numel", type=parse_size, default=None,
                   help="--check: elements of the check past 2^31 (default on a GPU: 2^31 + 2^22; 0: none)")
    p.add_argument("--sweep", action="store_true", help="time the main rows over --tile-elements x --tile-warps")
    p.add_argument("--tile-elements", nargs="+", type=parse_size, default=list(SWEEP_ELEMENTS),
                   help=f"--sweep: elements per program (default {' '.join(map(str, SWEEP_ELEMENTS))})")
    p.add_argument("--tile-warps", nargs="+", type=int, default=list(SWEEP_WARPS),
                   help=f"--sweep: warps per program (default {' '.join(map(str, SWEEP_WARPS))})")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--kernels", nargs="+", metavar="NAME", help="only these rows, by their exact names (see the "
                   "module docstring; an unknown name lists the valid ones)")
    p.add_argument("--backend", choices=["auto", "torch", "triton", "native"], help="sets ZEROPP_QUANT_BACKEND")
    p.add_argument("--no-deepspeed", action="store_true", help="do not time DeepSpeed's kernels")
    p.add_argument("--csv", metavar="PATH", help="also write the rows as CSV ('-' for stdout), rewritten after each")
    p.add_argument("--quiet", dest="progress", action="store_false", help="no per-row progress on stderr")
    args = p.parse_args(argv)
    valid = row_names(args.world, args.nodes, args.ranks_per_node)
    unknown = [k for k in args.kernels or () if k not in valid]
    if unknown:
        p.error(f"--kernels: no row is named {', '.join(map(repr, unknown))}; the rows are (with --world "
                f"{args.world}, --nodes {args.nodes}, --ranks-per-node {args.ranks_per_node}): "
                + ", ".join(map(repr, valid)))

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if args.backend:
        os.environ["ZEROPP_QUANT_BACKEND"] = args.backend
    from zeropp import quant
    from zeropp.quant import native

    if not args.backend and not gpu:  # the interpreter would take hours
        os.environ.setdefault("ZEROPP_QUANT_BACKEND", "native" if native.available() else "torch")
    from zeropp.quant.format import DEFAULT_BLOCK_SIZE

    blocks = args.block_size or [DEFAULT_BLOCK_SIZE]
    sizes = args.sizes or ([1 << 26, 1 << 28] if gpu else [1 << 20, 1 << 22, 1 << 24])
    if args.far_numel is None:
        args.far_numel = FAR_NUMEL if gpu else 0
    if args.threads:
        torch.set_num_threads(args.threads)
    timer = Timer(device, args.warmup if args.warmup is not None else (25 if gpu else 1),
                  args.reps if args.reps is not None else (100 if gpu else 5), args.stat)
    ds, ds_reason = (None, "--no-deepspeed") if args.no_deepspeed or args.sweep else load_deepspeed(device)

    if gpu:
        where = f"{torch.cuda.get_device_name(device)}"
    else:
        where = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
                f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f})"
    versions = f"torch {torch.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    backend = quant.backend_name(torch.empty(0, device=device))
    print(f"zeropp kernel benchmark on {where}; {versions}; quant backend {backend}"
          + ("" if gpu else " -- GPU kernels NOT measured"))
    timing_note = (f"do_bench median, {timer.warmup} ms warm-up, {timer.reps} ms of runs, L2 cleared before each"
                   if gpu else f"{args.stat} of {timer.reps} after {timer.warmup} warm-up")
    print(f"dtype {' '.join(args.dtype)}, block {' '.join(map(str, blocks))}, world {args.world}, nodes {args.nodes} "
          f"x {args.ranks_per_node}; {timing_note}; DeepSpeed: "
          f"{'timed' if ds is not None else 'not timed (' + ds_reason + ')'}"
          + ("; --check vs the CPU reference" + (" (the torch backend: the reference against itself)"
                                                  if backend == "torch" else "") if args.check else ""))

    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if args.csv and args.csv != "-":
            write_csv(rows, args.csv)  # the rows so far survive a run that is stopped
        if args.progress:
            took = f"{row['ms']:.4f} ms, floor/time {row['floor/time']:.3f}" if "ms" in row else row.get("error", "")
            tile = f" {row['elements']} x {row['warps']}w" if "elements" in row else ""
            check = f" [{row['check']}{': ' + row['detail'] if row.get('detail') else ''}]" if "check" in row else ""
            progress(f"  {row['size']:>6} {row['dtype']} b{row['block']} {row['kernel']}{tile}: {took}{check}")

    copies = Copies(device, timer)
    for dtype in args.dtype:
        for block in blocks:
            for n in sizes:
                if args.sweep:
                    sweep_config(args, n, dtype, block, device, timer, copies, emit)
                else:
                    run_config(args, n, dtype, block, device, timer, copies, ds, emit)
                if gpu:
                    torch.cuda.empty_cache()
        if args.check and args.far_numel and not args.sweep:
            run_far_checks(args, dtype, blocks[0], device, emit)

    timed = [r for r in rows if r.get("op") != "far"]
    print()
    if args.sweep:
        print(sweep_tables(timed))
    else:
        cols = ["dtype", "block", "kernel", "size", "bytes", "ms", "GB/s", "copy ms", "floor/time", "check", "error"]
        if ds is not None:
            cols += ["DS ms", "DS GB/s", "DS floor/time", "DS note"]
        print(rows_table(timed, cols, FORMATS))
    far = [r for r in rows if r.get("op") == "far"]
    if far:
        print()
        print(rows_table(far, ["dtype", "block", "kernel", "size", "check", "detail"]))
    if args.csv:
        write_csv(rows, args.csv)
    bad = [r for r in rows if r.get("check") in ("FAIL", "ERROR") or r.get("error")]
    if args.check:
        counts = {s: sum(r.get("check") == s for r in rows) for s in ("PASS", "FAIL", "ERROR", "SKIP")}
        print("\ncheck: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v or k == "PASS"))
    for r in bad:
        print(f"  {r.get('check', 'ERROR')}: {r['dtype']} b{r['block']} {r['size']} {r['kernel']}"
              + (f" {r['elements']} x {r['warps']}w" if "elements" in r else "")
              + f": {r.get('detail') or r.get('error')}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
