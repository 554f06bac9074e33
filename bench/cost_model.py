"""Static cost model of the Triton kernels on an H100, read off their SASS: no GPU needed.

    python bench/cost_model.py                          # every row, as a table
    python bench/cost_model.py --kernels reduce --csv cost.csv --json cost.json
    python bench/cost_model.py --write-budget           # commit every row's instr/elem to bench/cost_budget.json
    python bench/cost_model.py --cuda                   # the CUDA C++ kernels of the same rows (needs nvcc)
    python bench/cost_model.py --cubin ds.cubin --kernel quantize --elements-per-thread 8 --bytes-per-element 3.03
    python bench/cost_model.py --kernels "quantize int8 fp16 b128" --work-dir /tmp/k   # keep the cubins, then:
    python bench/cost_model.py --cubin /tmp/k/quantize_int8_fp16_b128.cubin --kernel _quantize_kernel \
        --elements-per-thread 16 --print-path                # the SASS of the steady-state path

**Rows.** Each row is one kernel specialization that the launchers launch, at 2^28 elements (a multiple of every
block, tile and pack count, so every program runs the full-tile path): quantize, the qgZ swizzled quantize (2 nodes
x 8 ranks: 16 packs in the two-hop order), dequantize, the dequantize of an all-gathered buffer of 8 packs (qwZ),
the fused dequantize-reduce-requantize of d = 2, 4, 8 runs of 2 packs (qgZ step 3) and the fused final
reduce-dequantize of g = 2, 4, 8 packs (qgZ step 5); int8 and int4; fp32, bf16 and fp16 where the op has a float
tensor; blocks of 128 and 2048 elements. The wider qgZ formats add rows at bf16 and blocks of 128
(``wide_rows``): int2 through every op, int4 rounded stochastically ("seeded"), and the per-hop reduce-requantize
of d = 2 runs of int8 packs into int4 ("int8->int4", also seeded) or int2; and qgZ's swizzled quantize and final
reduce with the 32-element Hadamard rotation fused ("swizzle_quantize_rotated", also seeded,
"reduce_dequantize_rotated"), int4, fp32 and bf16. Names follow ``bench/kernels.py`` plus
dtype and block, e.g. "quantize int8 fp16 b128". The kernels are compiled for sm_90 by ``zeropp.quant._triton.aot`` (the real launchers
on ``meta`` tensors, as ``tests/quant/test_triton_compile.py`` compiles them).

**What is counted.** Each cubin is disassembled (``nvdisasm`` from the triton wheel, else the CUDA toolkit's) and
its control-flow graph built: basic blocks split at branch targets and after every ``BRA``/``EXIT``/``RET``; a
predicated branch or exit has two edges (taken, fall through); a ``CALL`` (the ``div.rn`` slow path is a
``CALL.REL`` subroutine, and so is a 64-bit division) costs the callee's own path to its ``RET``; code that no path
reaches from the entry (the NOP padding and the trap loop after the last ``EXIT``) is not code. The
**steady-state path** is the full-tile, finite-data path: among the paths from the entry to an ``EXIT``, the ones
that store the most bytes to global memory (a persistent kernel's path through its loop, not around it), then of
those the ones with the fewest masked global loads and stores (under a predicate guard), and of those the one with
the fewest instructions (no masking arithmetic, no fallback: the exact-division slow path, the reference-arithmetic
fallback). The fewest instructions alone is not it: ptxas turns some masked stores into branches around them, so
a masked tail tile can be *shorter* while storing less. A kernel whose steady-state path stores nothing is
refused, and the test checks that the path moves at least the bytes the row must move ("path bytes/elem", masked
accesses counted in full; of loads or stores under complementary guards in one block, ``@P``/``@!P`` with nothing
between them naming ``P``, only one side moves). The longest path (most instructions, anything taken) is reported
too. A loop (a back edge, found by depth-first search from the entry) counts its trip count times one trip's path
from header to latch and is left through any of its exits; a kernel with a loop and no trip count is an error. The
trip count is one number for every loop (the Triton rows: a persistent kernel's tiles per program; a trip along the
steady-state rule, most bytes loaded coming right after most stored) or a function of each loop (``TripCount``:
the CUDA rows; a trip along its longest path, all of a run-time loop's work, and a loop it counts is on the path).
Per row:

* instr/elem: thread-level instructions per element = path instructions x 32 x num_warps / elements per program
  (``BLOCKS x BLOCK_SIZE`` of the compiled constexprs; for the reductions the elements of the *output* blocks),
  split by class: fp (FADD FMUL FFMA FMNMX FSEL FSETP FCHK, HFMA2...), int (IMAD IADD3 LOP3 SHF LEA ISETP SEL
  PRMT IMNMX MOV...), conv (F2F F2I I2F F2FP I2FP FRND), sfu (MUFU), shfl (SHFL, REDUX), mem (LDG STG LDS STS
  LDC...), uniform (U*, R2UR, S2UR), ctrl (BRA BAR BSSY BSYNC EXIT CALL RET S2R NOP...), other (anything else);
* registers per thread (``cuobjdump -res-usage``), and the global loads and stores on the path by width in bits
  (e.g. ``ld 128x4`` = four 128-bit loads per thread per program);
* bytes/elem: bytes that must move (inputs read once, outputs written once, scales included: ``bench/kernels.py``'s
  ``bytes``) per element.

**The model** (H100 SXM, compute capability 9.0; every rate per SM per clock):

* t_floor = bytes / 2966 GB/s (the device-to-device copy ceiling measured in DESIGN.md section 3);
* t_issue = warp instructions / (132 SMs x 4 issue slots x 1.755 GHz) / eta, with eta = ``ISSUE_EFFICIENCY``;
* t_pipe, per pipe = sum over its instructions of thread instructions / lanes per clock / (132 x 1.755 GHz), with
  ``PIPES``' rates from the CUDA C++ Programming Guide's arithmetic-instruction throughput table for 9.0: FP32
  add/mul/fma 128 lanes, 32-bit integer add/logic/shift/compare/min/max 64, integer multiply(-add) 64, type
  conversions 16, MUFU 16, warp shuffle 32, warp reduce 16. Pipes that share hardware are one pipe: FP32 and IMAD
  share the FMA datapaths (on GH100 ``fmaheavy`` runs FP32 and IMAD, ``fmalite`` FP32 only; NVIDIA's forum answer
  on separate FP16/FP32 pipes), so ``fma`` takes both at 128 and ``fmaheavy`` IMAD alone at 64; conversions and
  MUFU share the ``xu`` pipe at 16. Assumptions awaiting calibration: F2FP (float to packed fp16/bf16) and I2FP
  (int to float) run on the ALU at 64 (Nsight Compute: the ALU does the fast FP32-to-FP16 conversion since Ampere;
  I2FP is assumed to be the same kind), and global/shared loads and stores issue to the LSU at the shuffle's 32
  lanes per clock. Uniform, constant-load and control instructions cost issue slots only.
* predicted floor/time = t_floor / max(t_floor, t_issue, every t_pipe); "bound" names the largest term.

eta (``ISSUE_EFFICIENCY`` = 0.75) is calibrated against DeepSpeed's kernels (compiled with nvcc for sm_90 and
counted the same way; measured anchors in DESIGN.md section 3): see bench/RESULTS.md. The model counts no
latency, occupancy or memory-system effects beyond the copy ceiling. Checked on an H100 (bench/RESULTS.md, "The GPU
check on an H100"): right for every kernel whose loads are in flight while it computes, blind to one that waits on
them: the unpipelined reduce-requantize, near t_issue = t_floor, was predicted at 1.0 and measured at 0.64-0.74.

**The CUDA C++ rows** (``--cuda``: ``kernels/cuda/quant.cu`` compiled here for sm_90 with the fatbin's flags,
``<row> [cuda]``; not the wider formats' rows, which those kernels lack) are counted the same way per 16 elements of a thread (``native_cuda.PER_THREAD``; output elements
for the fused reductions), with two things the SASS alone does not say (``cuda_trip_count``, ``cuda_code_fma``): a
loop's trips follow from what one trip does (the fused sum's loop over the packs loads k packs per trip and runs
d / k times, fractional where k does not divide d: per element, one pack's instructions times d plus the
epilogue; the block maximum's shuffle loop runs log2(min(threads per block, 32)) times and its shared-memory pass
once per other warp), and a kernel that quantizes takes its normal-scale branch (the FMA that rounds the codes),
not the shorter all-zero one. Each thread reads its block's scale, so a CUDA row's path moves more bytes per
element than the row must (by 4 bytes per 16 elements per pack); the prediction uses the row's bytes.

**Budget.** ``bench/cost_budget.json`` holds each row's committed instr/elem; ``tests/quant/test_cost_model.py``
fails a row more than ``BUDGET_TOLERANCE`` above it, a row missing from it, and a budget row that no longer exists.
After an intended change: ``python bench/cost_model.py --write-budget``, and commit the file. It names the triton
that compiled the rows; under an older one (torch 2.11 brings 3.6: 3-11% more instructions) the test skips.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: this checkout's zeropp
    sys.path.insert(0, str(ROOT))

from zeropp.bench.report import markdown_table, write_csv  # noqa: E402
from zeropp.quant.format import BlockFormat  # noqa: E402

# ------------------------------------------------------------------------------------------------------------------
# The machine.

SMS = 132
"""Streaming multiprocessors of an H100 SXM."""
ISSUE_SLOTS = 4
"""Warp instructions issued per SM per clock (4 schedulers, one each)."""
CLOCK_HZ = 1.755e9
"""SM clock under load, Hz."""
COPY_BYTES_PER_S = 2966e9
"""Device-to-device copy ceiling, bytes read + written per second (DESIGN.md section 3)."""
ISSUE_EFFICIENCY = 0.75
"""eta: the fraction of issue slots an instruction-bound streaming kernel fills. Calibrated against DeepSpeed's
kernels (bench/RESULTS.md, "Calibration"): its fused int4 reduction, measured at 0.39 of the floor, needs 88 thread
instructions per output element, which the model reproduces with eta = 0.766; its memory-bound kernels measured at
the floor need eta >= 0.63. 0.75 fits all five anchors."""

_FP32_ARITH = {"FADD", "FMUL", "FFMA", "FADD32I", "FMUL32I", "FFMA32I", "FSWZADD", "HADD2", "HMUL2", "HFMA2"}
_INT_MUL = {"IMAD", "IMAD32I", "IMUL", "IMUL32I", "IDP", "IDP4A"}
_FP_COMPARE = {"FMNMX", "FSEL", "FSET", "FSETP", "FCHK", "HMNMX2", "HSET2", "HSETP2"}
_INT_ALU = {
    "IADD3", "IADD", "IADD32I", "IABS", "LOP3", "LOP", "LOP32I", "SHF", "SHL", "SHR", "LEA", "ISCADD", "ISETP",
    "ICMP", "SEL", "PRMT", "IMNMX", "VIMNMX", "VIMNMX3", "VIADD", "VIADDMNMX", "BMSK", "SGXT", "BFE", "BFI", "MOV",
    "MOV32I", "PLOP3", "PSETP", "P2R", "R2P", "CS2R", "VOTE", "MATCH",
}
_PACKED_CONVERSIONS = {"F2FP", "I2FP"}
_XU = {"MUFU", "F2F", "F2I", "I2F", "FRND", "I2I", "FLO", "POPC", "BREV"}
_CONVERSIONS = {"F2F", "F2I", "I2F", "FRND", "I2I", "F2FP", "I2FP"}
_LSU = {
    "LDG", "STG", "LDS", "STS", "LD", "ST", "LDL", "STL", "ATOM", "ATOMS", "ATOMG", "RED", "REDG", "LDSM", "STSM",
    "LDGSTS", "SHFL",
}
_MEMORY = (_LSU - {"SHFL"}) | {
    "LDC", "LDGDEPBAR", "DEPBAR", "MEMBAR", "FENCE", "CCTL", "CCTLL", "ERRBAR", "SULD", "SUST", "TLD", "TEX",
    "UTMALDG", "UTMASTG", "UBLKCP", "UTMACCTL", "UTMAPF", "SYNCS",
}
_CONTROL = {
    "BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "KILL", "BPT", "BAR", "BSSY", "BSYNC", "BMOV", "WARPSYNC",
    "NOP", "YIELD", "NANOSLEEP", "S2R", "ELECT", "WARPGROUP", "ACQBULK", "PMTRIG",
}
_GLOBAL_STORES = {"STG", "ST", "RED", "REDG", "ATOM", "ATOMG"}
_GLOBAL_LOADS = {"LDG", "LD", "LDGSTS"}

PIPES: dict[str, dict[str, int]] = {
    "fma": {**dict.fromkeys(_FP32_ARITH, 128), **dict.fromkeys(_INT_MUL, 128)},
    "fmaheavy": dict.fromkeys(_INT_MUL, 64),
    "alu": dict.fromkeys(_INT_ALU | _FP_COMPARE | _PACKED_CONVERSIONS, 64),
    "xu": dict.fromkeys(_XU, 16),
    "lsu": {**dict.fromkeys(_LSU, 32), "REDUX": 16},
}
"""Per pipe: the SASS opcodes (without modifiers) it executes and at how many thread instructions per SM per clock
(see the module docstring for the sources). An opcode in no pipe costs issue slots only."""

CLASSES = ("fp", "int", "conv", "sfu", "shfl", "mem", "uniform", "ctrl", "other")
"""The instruction classes reported, in table order (see ``opcode_class``)."""


def opcode_class(opcode: str) -> str:
    """The class (one of ``CLASSES``) of a SASS opcode, with or without modifiers (``LDG.E.128``)."""
    base = opcode.split(".", 1)[0]
    if base in _FP32_ARITH | _FP_COMPARE | {"DADD", "DMUL", "DFMA", "DSETP", "DMNMX"}:
        return "fp"
    if base in _INT_MUL | _INT_ALU:
        return "int"
    if base in _CONVERSIONS:
        return "conv"
    if base == "MUFU":
        return "sfu"
    if base in ("SHFL", "REDUX"):
        return "shfl"
    if base in _MEMORY:
        return "mem"
    if base.startswith("U") or base in ("R2UR", "S2UR", "VOTEU"):
        return "uniform"
    if base in _CONTROL:
        return "ctrl"
    return "other"


# ------------------------------------------------------------------------------------------------------------------
# SASS: instructions, basic blocks, paths.


class CostModelError(RuntimeError):
    """The SASS cannot be counted as asked (a loop without a trip count, an indirect branch, no such kernel...)."""


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction as ``nvdisasm`` prints it."""

    address: int
    """Byte offset in its section."""
    section: str
    """The code section (a kernel or device function, ``.text.<name>``) it lies in."""
    guard: str
    """The predicate guard (``@P0``, ``@!UP1``), or ``""``."""
    opcode: str
    """With modifiers, e.g. ``LDG.E.128``."""
    operands: str
    target: str | None
    """The label that a branch or call goes to."""

    @property
    def base(self) -> str:
        """The opcode without modifiers."""
        return self.opcode.split(".", 1)[0]

    @property
    def may_fall_through(self) -> bool:
        """Whether a branch or exit may not be taken: a guard other than ``@PT``, or a condition operand before the
        target (``BRA.DIV UR4, ...``, ``BRA.U !UP0, ...``)."""
        if self.guard not in ("", "@PT"):
            return True
        return self.base in _JUMPS and bool(self.operands.split("`", 1)[0].strip(" ,"))

    @property
    def never_taken(self) -> bool:
        return self.guard == "@!PT"

    def where(self) -> str:
        return f"{self.section}+0x{self.address:04x} ({self.opcode} {self.operands})".rstrip()


_SECTION = re.compile(r"^\s*\.section\s+\.text\.([^,\s]+)")
_LABEL = re.compile(r"^([.$A-Za-z_][\w.$]*):\s*$")
_CODE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);")
_TARGET = re.compile(r"`\(([^)]+)\)")
_JUMPS = {"BRA", "JMP"}
_INDIRECT = {"BRX", "JMX"}
_RETURNS = {"RET"}


def _ends_program(ins: Instruction) -> bool:
    return ins.base in ("EXIT", "KILL") or ins.opcode.startswith("BPT.TRAP")


def _transfers(ins: Instruction) -> bool:
    """Whether ``ins`` may send control elsewhere than the next instruction (it ends a basic block)."""
    return ins.base in _JUMPS | _RETURNS | _INDIRECT or _ends_program(ins)


@dataclass
class Program:
    """The code of a disassembled cubin: every section's instructions in order, and where each label points."""

    instructions: list[Instruction] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    """Label -> index of the instruction it names."""
    sections: dict[str, int] = field(default_factory=dict)
    """Section name (a kernel's name) -> index of its first instruction."""


def parse_sass(text: str) -> Program:
    """The instructions and labels of ``nvdisasm`` output (``nvdisasm -c``)."""
    program = Program()
    section = ""
    pending: list[str] = []
    for line in text.splitlines():
        if found := _SECTION.match(line):
            section = found.group(1)
            program.sections[section] = len(program.instructions)
            pending = []
        elif found := _LABEL.match(line.strip()):
            pending.append(found.group(1))
        elif found := _CODE.match(line):
            address, guard, opcode, operands = found.groups()
            target = _TARGET.search(operands)
            ins = Instruction(int(address, 16), section, guard or "", opcode, operands.strip(),
                              target.group(1) if target else None)
            for label in pending:
                program.labels[label] = len(program.instructions)
            pending = []
            program.instructions.append(ins)
    return program


def _successors(program: Program, last: int) -> list[int | str]:
    """Where control goes after the block ending at instruction ``last``: instruction indices, ``"end"`` (EXIT) or
    ``"return"`` (RET)."""
    ins = program.instructions[last]
    out: list[int | str] = []
    if ins.base in _INDIRECT:
        raise CostModelError(f"indirect branch at {ins.where()}: the control-flow graph cannot follow it")
    if ins.base in _JUMPS and not ins.never_taken:
        if ins.target not in program.labels:
            raise CostModelError(f"branch to an unknown label at {ins.where()}")
        out.append(program.labels[ins.target])
    elif _ends_program(ins) and not ins.never_taken:
        out.append("end")
    elif ins.base in _RETURNS and not ins.never_taken:
        out.append("return")
    if not _transfers(ins) or ins.may_fall_through:
        nxt = last + 1
        if nxt >= len(program.instructions) or program.instructions[nxt].section != ins.section:
            raise CostModelError(f"control falls through past the end of {ins.section} after {ins.where()}")
        out.append(nxt)
    return list(dict.fromkeys(out))


def _blocks(program: Program, entry: int) -> dict[int, tuple[int, list[int | str]]]:
    """Basic blocks reachable from instruction ``entry``: first instruction -> (last instruction, successors)."""
    leaders = {entry}
    for ins in program.instructions:
        if ins.base in _JUMPS and ins.target in program.labels:
            leaders.add(program.labels[ins.target])
    blocks: dict[int, tuple[int, list[int | str]]] = {}
    todo = [entry]
    while todo:
        first = todo.pop()
        if first in blocks:
            continue
        last = first
        while not _transfers(program.instructions[last]) and last + 1 < len(program.instructions):
            if last + 1 in leaders or program.instructions[last + 1].section != program.instructions[last].section:
                break
            last += 1
        succ = _successors(program, last)
        blocks[first] = (last, succ)
        todo.extend(s for s in succ if isinstance(s, int))
    return blocks


@dataclass(frozen=True)
class Cost:
    """What a stretch of code executes: instructions per opcode (with modifiers), how many of them are global
    loads or stores under a predicate guard (masked accesses), and the bytes of guarded loads and stores that do not
    move because their alternative under the opposite guard does (``_alternative_bytes``). A loop's cost is one
    trip's times its trip count, which may be fractional (``Loop``), and so may the numbers."""

    counts: Counter[str] = field(default_factory=Counter)
    masked: float = 0
    unmoved_loads: float = 0
    """Bytes per thread of guarded global loads whose alternative is counted (of each ``@P``/``@!P`` pair, the
    smaller side)."""
    unmoved_stores: float = 0
    """The same for global stores."""

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.counts + other.counts, self.masked + other.masked, self.unmoved_loads + other.unmoved_loads,
                    self.unmoved_stores + other.unmoved_stores)

    def __mul__(self, times: float) -> Cost:
        return Cost(Counter({op: n * times for op, n in self.counts.items()}), self.masked * times,
                    self.unmoved_loads * times, self.unmoved_stores * times)

    @property
    def total(self) -> float:
        """Instructions."""
        return sum(self.counts.values())


_GUARD = re.compile(r"^@(!?)(U?P\d+)$")


def _alternative_bytes(instructions: Sequence[Instruction]) -> tuple[int, int]:
    """Bytes (loads, stores) per thread of guarded global accesses that do not move because they are alternatives:
    within a basic block, accesses under ``@P`` and under ``@!P`` with no instruction between them naming ``P`` in
    its operands (which might redefine it) run on exclusive lanes, so of the two sides only the larger moves per
    thread (nvcc's ``if (aligned) one 64-bit load else two 32-bit loads`` becomes three guarded loads, 8 bytes)."""
    memory = _GLOBAL_STORES | _GLOBAL_LOADS
    unmoved = [0, 0]
    sides: dict[str, list[list[int]]] = {}  # predicate -> [[load, store] bytes under @P, [load, store] under @!P]

    def close(predicate: str) -> None:
        pos, neg = sides.pop(predicate)
        for kind in (0, 1):
            unmoved[kind] += min(pos[kind], neg[kind])

    for ins in instructions:
        for predicate in [p for p in sides if re.search(rf"\b{p}\b", ins.operands)]:
            close(predicate)
        guard = _GUARD.match(ins.guard)
        if guard and ins.base in memory:
            side = sides.setdefault(guard.group(2), [[0, 0], [0, 0]])[guard.group(1) == "!"]
            side[ins.base in _GLOBAL_STORES] += access_bits(ins.opcode) // 8
    for predicate in list(sides):
        close(predicate)
    return unmoved[0], unmoved[1]


def _cost(instructions: Sequence[Instruction]) -> Cost:
    memory = _GLOBAL_STORES | _GLOBAL_LOADS
    masked = sum(1 for ins in instructions if ins.guard not in ("", "@PT") and ins.base in memory)
    return Cost(Counter(ins.opcode for ins in instructions), masked, *_alternative_bytes(instructions))


def access_bits(opcode: str) -> int:
    """Bits one thread moves with a load or store opcode: ``.128``, ``.64``, ``.U8``/``.S8``, ``.U16``/``.S16``
    modifiers, else 32."""
    bits = 32
    for mod in opcode.split(".")[1:]:
        bits = {"128": 128, "64": 64, "U8": 8, "S8": 8, "U16": 16, "S16": 16}.get(mod, bits)
    return bits


def global_bytes(counts: Counter[str], stores: bool = True, loads: bool = True) -> float:
    """Bytes that the global stores and/or loads in ``counts`` would move (per thread; masked ones counted in full,
    and both sides of guarded alternatives: see ``moved_bytes``)."""
    bases = (_GLOBAL_STORES if stores else set()) | (_GLOBAL_LOADS if loads else set())
    return sum(n * access_bits(op) / 8 for op, n in counts.items() if op.split(".", 1)[0] in bases)


def moved_bytes(cost: Cost, stores: bool = True, loads: bool = True) -> float:
    """Bytes per thread that the global stores and/or loads of ``cost`` move: masked ones in full, of guarded
    alternatives (``@P``/``@!P``) one side."""
    return (global_bytes(cost.counts, stores=stores, loads=loads) - (cost.unmoved_stores if stores else 0)
            - (cost.unmoved_loads if loads else 0))


def _steady_key(cost: Cost) -> tuple:
    """Order of preference for the steady-state path (highest first): most bytes stored to global memory, fewest
    masked global accesses, fewest instructions; ties broken by the opcode counts, so the choice is reproducible."""
    return moved_bytes(cost, loads=False), -cost.masked, -cost.total, sorted(cost.counts.items())


def _steady_trip_key(cost: Cost) -> tuple:
    """The same for one trip of a loop, with most bytes loaded from global memory right after most stored: a trip is
    counted whole (a fused sum's trip loads all of its packs, though each pack's loads sit under a branch), not
    along a path that skips its loads."""
    return moved_bytes(cost, loads=False), moved_bytes(cost, stores=False), *_steady_key(cost)[1:]


def _longest_key(cost: Cost) -> tuple:
    return cost.total, sorted(cost.counts.items())


def _postorder(start: Any, succ: Mapping[Any, Sequence[Any]], ends: set) -> list:
    """Nodes reachable from ``start`` (not past ``ends``), each after all of its successors."""
    order, seen, stack = [], {start}, [(start, iter(() if start in ends else succ.get(start, ())))]
    while stack:
        node, it = stack[-1]
        for s in it:
            if s not in seen:
                seen.add(s)
                stack.append((s, iter(() if s in ends else succ.get(s, ()))))
                break
        else:
            stack.pop()
            order.append(node)
    return order


def _back_edges(start: Any, succ: Mapping[Any, Sequence[Any]]) -> list[tuple[Any, Any]]:
    """Edges ``(u, v)`` to a node ``v`` on the depth-first search stack: the loops' back edges."""
    back, on_stack, seen = [], {start}, {start}
    stack = [(start, iter(succ.get(start, ())))]
    while stack:
        node, it = stack[-1]
        for s in it:
            if s in on_stack:
                back.append((node, s))
            elif s not in seen:
                seen.add(s)
                on_stack.add(s)
                stack.append((s, iter(succ.get(s, ()))))
                break
        else:
            stack.pop()
            on_stack.discard(node)
    return back


@dataclass
class PathCount:
    """A path: what it executes, and its nodes in order (the first instruction of each basic block, ``"loopN"`` for
    a loop counted at its trip count, ``"end"`` or ``"return"`` last)."""

    cost: Cost
    nodes: list
    loops: list[tuple[str, float]] = field(default_factory=list)
    """The loops on the path, nested ones included, in path order: (where the header starts, trips)."""

    @property
    def counts(self) -> Counter[str]:
        """Executions per opcode (with modifiers)."""
        return self.cost.counts


@dataclass(frozen=True)
class Loop:
    """A loop as ``find_path`` counts it, for a trip-count function (``TripCount``) to name its trips."""

    entry: str
    """The function's label."""
    where: str
    """Its header's first instruction (``Instruction.where``), or "an enclosing loop"."""
    trip: Cost
    """One trip along its steady-state path from the header to a latch (inner loops at their trip counts)."""


TripCount = int | float | Callable[[Loop], float]
"""How many times ``find_path`` counts each loop: one number for every loop (a persistent kernel's tiles per
program; a trip along its steady-state path), or a function of the loop (a trip along its longest path: all of a
run-time loop's work, which the function divides up); a loop the function gives a positive count is on the
steady-state path (the path goes through it, as a run-time loop the rule would otherwise go around), one it gives
0 costs nothing."""


def _dag_path(start: Any, succ: Mapping[Any, Sequence[Any]], weight: Mapping[Any, Cost], ends: set,
              key: Callable[[Cost], tuple]) -> PathCount:
    """The path from ``start`` to a node of ``ends`` (both included) in an acyclic graph whose counts ``key`` ranks
    highest. Every key is a sum over the path's instructions (then a tie-break), so the best path's tail from any
    node is that node's best path."""
    best: dict[Any, Cost] = {}
    choice: dict[Any, Any] = {}
    for node in _postorder(start, succ, ends):
        options = [s for s in succ.get(node, ()) if s in best] if node not in ends else []
        if node in ends or options:
            choice[node] = max(options, key=lambda s: key(best[s])) if options else None
            best[node] = weight[node] + (best[choice[node]] if options else Cost())
    if start not in best:
        raise CostModelError("no path reaches the end")
    nodes, node = [], start
    while node is not None:
        nodes.append(node)
        node = choice[node]
    return PathCount(best[start], nodes)


def _dag_path_through(start: Any, succ: Mapping[Any, Sequence[Any]], weight: Mapping[Any, Cost], ends: set,
                      key: Callable[[Cost], tuple], through: Sequence[Any]) -> PathCount:
    """``_dag_path`` constrained to pass through every node of ``through``: the best path to the first of them (in
    topological order), from there to the next, and so on to ``ends``."""
    if not through:
        return _dag_path(start, succ, weight, ends, key)
    rank = {n: i for i, n in enumerate(reversed(_postorder(start, succ, ends)))}
    stops = sorted(through, key=lambda n: rank.get(n, -1))
    if stops[0] not in rank:
        raise CostModelError(f"node {stops[0]} that the path must pass through is not reachable")
    nodes: list = []
    at = start
    for stop in [*stops, None]:
        try:
            segment = _dag_path(at, succ, weight, ends if stop is None else {stop}, key)
        except CostModelError:
            raise CostModelError(f"no path from {at} reaches {stop or 'the end'}: the nodes the path must pass "
                                 "through (loops with a positive trip count, named blocks) must lie on one path"
                                 ) from None
        nodes += segment.nodes[1:] if nodes else segment.nodes
        at = stop
    return PathCount(sum((weight[n] for n in nodes), Cost()), nodes)


def find_path(program: Program, entry: str, *, longest: bool = False, trip_count: TripCount | None = None,
              through: Callable[[Instruction], bool] | None = None, require_store: bool = True,
              _calls: dict | None = None) -> PathCount:
    """The steady-state (or the ``longest``) path from label ``entry`` to an ``EXIT`` (a subroutine's: to its
    ``RET``), the paths of its calls included in its counts, its loops at ``trip_count``. With ``through``, the
    steady-state path passes through every basic block holding an instruction that ``through`` accepts (a
    data-dependent branch whose common side is the longer one: quant.cu's quantize has a shorter all-zero-block
    branch). See the module docstring for the rules; raises ``CostModelError``, also when the steady-state path
    stores nothing to global memory (with ``require_store``: a kernel's must)."""
    calls = {} if _calls is None else _calls
    if entry not in program.labels:
        raise CostModelError(f"no label {entry!r} in the disassembly")
    key = _longest_key if longest else _steady_key
    # A trip of a loop that a function counts is its longest path: a run-time loop does all of its work per trip (a
    # fused sum's trip sums all of its packs, each under a branch that only the last trip may skip).
    trip_key = _longest_key if longest or callable(trip_count) else _steady_trip_key
    blocks = _blocks(program, program.labels[entry])
    weight: dict[Any, Cost] = {"end": Cost(), "return": Cost()}
    succ: dict[Any, list] = {}
    for first, (last, nexts) in blocks.items():
        cost = _cost(program.instructions[first:last + 1])
        for ins in program.instructions[first:last + 1]:
            if ins.base == "CALL":
                if calls.get((ins.target, longest)) == "active":
                    raise CostModelError(f"recursive call at {ins.where()}")
                if (ins.target, longest) not in calls:
                    calls[ins.target, longest] = "active"  # until its path is known
                    calls[ins.target, longest] = find_path(program, ins.target, longest=longest,
                                                           trip_count=trip_count, require_store=False,
                                                           _calls=calls).cost
                cost += calls[ins.target, longest]
        weight[first] = cost
        succ[first] = nexts
    start = program.labels[entry]
    # Nodes the path must pass through: the blocks ``through`` names, loops with a positive count from a function.
    must = [] if longest or through is None else [
        first for first, (last, _) in blocks.items() if any(map(through, program.instructions[first:last + 1]))]
    described: dict[str, tuple[str, float, list]] = {}  # loop node -> (where, trips, its body path's nodes)
    while back := _back_edges(start, succ):
        if trip_count is None:
            header = back[0][1]
            at = program.instructions[header].where() if isinstance(header, int) else "an enclosing loop"
            raise CostModelError(f"{entry} has a loop (a back edge to {at}): give a trip count to count it")
        # The innermost loop first: the header with the smallest natural loop.
        latches: dict[Any, set] = {}
        for t, h in back:
            latches.setdefault(h, set()).add(t)
        preds: dict[Any, set] = {}
        for n, ss in succ.items():
            for s in ss:
                preds.setdefault(s, set()).add(n)
        bodies = {}
        for h, ts in latches.items():
            body, todo = {h}, list(ts)
            while todo:
                n = todo.pop()
                if n not in body:
                    body.add(n)
                    todo.extend(preds.get(n, ()))
            bodies[h] = body
        header = min(bodies, key=lambda h: (len(bodies[h]), str(h)))
        body = bodies[header]
        if start in body - {header} or any(p not in body for n in body - {header} for p in preds.get(n, ())):
            raise CostModelError(f"{entry} has a loop with more than one entry: the control flow is irreducible")
        inner = {n: [s for s in succ[n] if s in body and s != header] for n in body}
        one = _dag_path_through(header, inner, weight, latches[header], trip_key, [n for n in must if n in body])
        where = program.instructions[header].where() if isinstance(header, int) else "an enclosing loop"
        trips = trip_count(Loop(entry, where, one.cost)) if callable(trip_count) else trip_count
        if trips < 0:
            raise CostModelError(f"{entry}: a negative trip count ({trips}) for the loop at {where}")
        node = f"loop{len(described) + 1}"
        described[node] = (where, trips, one.nodes)
        weight[node] = one.cost * trips
        succ[node] = list(dict.fromkeys(s for n in body for s in succ[n] if s not in body))
        for n in body:
            del succ[n]
        for n, ss in succ.items():
            succ[n] = list(dict.fromkeys(node if s == header else s for s in ss))
        forced = any(n in body for n in must) or (callable(trip_count) and trips > 0 and not longest)
        must = [n for n in must if n not in body] + ([node] if forced else [])
        if start == header:
            start = node
    found = _dag_path_through(start, succ, weight, {"end", "return"}, key, must)

    def loops_on(nodes: Sequence[Any]) -> list[tuple[str, float]]:
        out = []
        for n in nodes:
            if n in described:
                where, trips, inside = described[n]
                out += [(where, trips), *loops_on(inside)]
        return out

    found.loops = loops_on(found.nodes)
    if require_store and not longest and not global_bytes(found.counts, loads=False):
        raise CostModelError(f"no path from {entry} to its end stores to global memory")
    return found


def format_path(program: Program, entry: str, path: PathCount) -> str:
    """The SASS of ``path`` (found from label ``entry``), block by block; a loop is one line (its counts are in the
    path's), and a call's callee is counted, not shown."""
    blocks = _blocks(program, program.labels[entry])
    lines = []
    for node in path.nodes:
        if isinstance(node, int):
            lines += [f"  /*{ins.address:04x}*/ {ins.guard:5} {ins.opcode} {ins.operands}".rstrip()
                      for ins in program.instructions[node:blocks[node][0] + 1]]
        else:
            lines.append(f"  [{node}]")
    return "\n".join(lines)


def tool(name: str) -> str:
    """Path of ``nvdisasm`` or ``cuobjdump``: the triton wheel's, else the CUDA toolkit's (see ``aot.tool_path``)."""
    from zeropp.quant._triton.aot import tool_path

    return tool_path(name)


def disassemble(cubin: Path) -> str:
    """``nvdisasm -c -ndf`` of ``cubin``: the SASS of its code sections (no dataflow analysis: it only annotates
    indirect branches, which the model refuses anyway, and costs a third more time)."""
    proc = subprocess.run([tool("nvdisasm"), "-c", "-ndf", str(cubin)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CostModelError(f"nvdisasm failed on {cubin} (exit {proc.returncode}): {proc.stderr[-1000:]}")
    return proc.stdout


def registers(cubin: Path, kernel: str) -> int | None:
    """Registers per thread of ``kernel`` in ``cubin`` (``cuobjdump -res-usage``), or None if not reported."""
    proc = subprocess.run([tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True, check=False)
    found = re.search(rf"Function {re.escape(kernel)}:\s*\n\s*REG:(\d+)", proc.stdout)
    return int(found.group(1)) if found else None


@dataclass
class KernelCount:
    """The steady-state and longest paths of one kernel of a cubin, per thread of one program."""

    kernel: str
    entry: str
    """The label the kernel starts at."""
    program: Program
    steady: PathCount
    longest: PathCount
    registers: int | None


def count_cubin(cubin: Path, kernel: str, trip_count: TripCount | None = None,
                through: Callable[[Instruction], bool] | None = None) -> KernelCount:
    """Count the paths of ``kernel`` (its exact name, or a substring naming one kernel of ``cubin``), its loops at
    ``trip_count`` (see ``TripCount``), the steady-state path through the blocks ``through`` names (``find_path``)."""
    program = parse_sass(disassemble(cubin))
    names = [n for n in program.sections if n == kernel] or [n for n in program.sections if kernel in n]
    if len(names) != 1:
        raise CostModelError(f"{kernel!r} names {len(names)} of the kernels in {cubin}: {sorted(program.sections)}")
    name = names[0]
    entry = name if name in program.labels else next(k for k, v in program.labels.items()
                                                     if v == program.sections[name])
    return KernelCount(
        name,
        entry,
        program,
        find_path(program, entry, trip_count=trip_count, through=through),
        find_path(program, entry, longest=True, trip_count=trip_count),
        registers(cubin, name),
    )


def access_widths(counts: Counter[str], base: str) -> str:
    """Global accesses of opcode ``base`` (``LDG``/``STG``) in ``counts`` by width: ``"128x4 32x1"`` (bits x count).
    For ``LDG`` the asynchronous global-to-shared copies (``LDGSTS``, what a pipelined loop loads with) count too,
    marked ``a``: ``"128x4a"``."""
    widths: Counter[tuple[int, str]] = Counter()
    for op, n in counts.items():
        kind = op.split(".", 1)[0]
        if kind == base or (base == "LDG" and kind == "LDGSTS"):
            widths[access_bits(op), "a" if kind == "LDGSTS" else ""] += n
    ordered = sorted(widths.items(), key=lambda item: (-item[0][0], item[0][1]))
    return " ".join(f"{bits}x{n}{mark}" for (bits, mark), n in ordered) or "-"


# ------------------------------------------------------------------------------------------------------------------
# The model.


def predict(per_elem: Counter[str], bytes_per_elem: float | None) -> dict[str, Any]:
    """Times per element (seconds) of each bound, from thread-level instructions per element by opcode, and the
    predicted floor/time and binding term (None without ``bytes_per_elem``)."""
    instructions = sum(per_elem.values())
    times = {"issue": instructions / 32 / (SMS * ISSUE_SLOTS * CLOCK_HZ) / ISSUE_EFFICIENCY}
    for pipe, rates in PIPES.items():
        times[pipe] = sum(n / rates[op.split(".", 1)[0]] for op, n in per_elem.items()
                          if op.split(".", 1)[0] in rates) / (SMS * CLOCK_HZ)
    if bytes_per_elem is None:
        return {"times": times, "bound": max(times, key=times.get), "floor/time": None}
    times = {"floor": bytes_per_elem / COPY_BYTES_PER_S, **times}
    bound = max(times, key=times.get)
    return {"times": times, "bound": bound, "floor/time": times["floor"] / times[bound]}


def summarize(name: str, count: KernelCount, elements_per_thread: float, bytes_per_elem: float | None,
              elements: int, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One row of the report: instructions per element (by class), resources, the prediction for ``elements``."""
    per_elem = Counter({op: n / elements_per_thread for op, n in count.steady.counts.items()})
    by_class = Counter()
    for op, n in per_elem.items():
        by_class[opcode_class(op)] += n
    model = predict(per_elem, bytes_per_elem)
    row: dict[str, Any] = {
        "kernel": name,
        "instr/elem": round(sum(per_elem.values()), 3),
        "longest instr/elem": round(count.longest.cost.total / elements_per_thread, 3),
        **{c: round(by_class[c], 3) for c in CLASSES},
        "registers": count.registers,
        "ld": access_widths(count.steady.counts, "LDG"),
        "st": access_widths(count.steady.counts, "STG"),
        "bytes/elem": None if bytes_per_elem is None else round(bytes_per_elem, 4),
        "path bytes/elem": round(moved_bytes(count.steady.cost) / elements_per_thread, 4),
        "path load bytes/elem": round(moved_bytes(count.steady.cost, stores=False) / elements_per_thread, 4),
        "path store bytes/elem": round(moved_bytes(count.steady.cost, loads=False) / elements_per_thread, 4),
        "bound": model["bound"],
        "floor/time": None if model["floor/time"] is None else round(model["floor/time"], 3),
        "path instructions": round(count.steady.cost.total, 2),
        "masked accesses": round(count.steady.cost.masked, 2),
        "loops": "; ".join(f"{where.split(' ', 1)[0]} x{trips:g}" for where, trips in count.steady.loops) or "-",
        "elements/thread": elements_per_thread,
        "elements": elements,
        **{f"t_{k} us": round(t * elements * 1e6, 2) for k, t in model["times"].items()},
        "function": count.kernel,
        **(extra or {}),
    }
    return row


# ------------------------------------------------------------------------------------------------------------------
# The rows.

NUMEL = 2**28
"""Elements of every row: a multiple of every block, tile and pack count, so only full tiles run."""
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}
BLOCK_SIZES = (128, 2048)
NODES, RANKS_PER_NODE, WORLD = 2, 8, 8
GROUPS = (2, 4, 8)


@dataclass(frozen=True)
class Row:
    """One specialization: its name, the ``aot`` case that compiles it, and what the model needs of it."""

    name: str
    case: dict
    elements: int
    """Elements the programs cover: input elements for quantize, output elements otherwise."""
    nbytes: int
    """Bytes that must move: inputs read once, outputs written once (``bench/kernels.py``'s ``bytes``)."""


def rows(numel: int = NUMEL) -> list[Row]:
    """Every row of the model, in table order."""
    out = []
    for bits in (8, 4):
        for bs in BLOCK_SIZES:
            fmt = BlockFormat(bits, bs)
            for dt, (dtype, item) in DTYPES.items():
                sfx = f"{dt} b{bs}"
                base = dict(bits=bits, block_size=bs, dtype=dtype)
                out.append(Row(f"quantize int{bits} {sfx}", dict(op="quantize", numel=numel, chunks=1, nodes=1, **base),
                               numel, numel * item + fmt.packed_bytes(numel)))
                sw = NODES * RANKS_PER_NODE
                out.append(Row(f"swizzle_quantize int{bits} {NODES}x{RANKS_PER_NODE} {sfx}",
                               dict(op="quantize", numel=numel, chunks=sw, nodes=NODES, **base),
                               numel, numel * item + fmt.chunked_bytes(numel, sw)))
                out.append(Row(f"dequantize int{bits} {sfx}",
                               dict(op="dequantize", chunks=1, chunk_numel=numel, out_numel=numel, **base),
                               numel, fmt.packed_bytes(numel) + numel * item))
                out.append(Row(f"dequantize gathered int{bits} x{WORLD} {sfx}",
                               dict(op="dequantize", chunks=WORLD, chunk_numel=numel // WORLD, out_numel=numel, **base),
                               numel, fmt.chunked_bytes(numel, WORLD) + numel * item))
                for g in GROUPS:
                    cn = numel // g
                    out.append(Row(f"reduce_dequantize int{bits} g={g} {sfx}",
                                   dict(op="reduce_dequantize", groups=g, chunk_numel=cn, out_numel=cn,
                                        divisor=float(g * RANKS_PER_NODE), **base),
                                   cn, fmt.chunked_bytes(numel, g) + cn * item))
            for d in GROUPS:
                cn = numel // (d * NODES)
                out.append(Row(f"reduce_requantize int{bits} d={d} b{bs}",
                               dict(op="reduce_requantize", bits=bits, block_size=bs, groups=d, chunks=NODES,
                                    chunk_numel=cn),
                               NODES * cn, fmt.chunked_bytes(numel, d * NODES) + NODES * fmt.packed_bytes(cn)))
    out += wide_rows(numel)
    order = ["quantize", "swizzle_quantize", "dequantize int", "dequantize gathered", "reduce_requantize",
             "reduce_dequantize"]
    return sorted(out, key=lambda r: next(i for i, p in enumerate(order) if r.name.startswith(p)))


SEED = 20241127
"""The seed of the stochastically rounded (``seeded``) rows."""

ROTATION_SIZE = 32
"""The Hadamard rotation of the fused rotated rows (``swizzle_quantize_rotated``, ``reduce_dequantize_rotated``)."""


def wide_rows(numel: int = NUMEL) -> list[Row]:
    """The rows of the wider qgZ formats (format.py), at bf16 and blocks of 128: int2 through every op, the seeded
    (stochastically rounded) quantize and swizzled quantize of int4 (the swizzled one at fp32 too, the engine's
    gradient dtype), and the reduce-requantize of d = 2 runs (int4 to int4 seeded; per hop: int8 packs in, int4 or
    int2 out, int8 to int4 also seeded); and the swizzled quantize (rounded to nearest and stochastically) and
    final reduce with the Hadamard rotation fused, int4, at fp32 and bf16."""
    out = []
    bs, dtype, item = 128, *DTYPES["bf16"]
    base = dict(block_size=bs, dtype=dtype)
    sw = NODES * RANKS_PER_NODE
    f2, f4, f8 = BlockFormat(2, bs), BlockFormat(4, bs), BlockFormat(8, bs)
    for fmt, seed in ((f2, None), (f4, SEED)):
        sfx = f"int{fmt.bits}" + (" seeded" if seed is not None else "") + f" bf16 b{bs}"
        extra = {} if seed is None else {"seed": seed}
        out.append(Row(f"quantize {sfx}", dict(op="quantize", numel=numel, chunks=1, nodes=1, bits=fmt.bits,
                                               **base, **extra), numel, numel * item + fmt.packed_bytes(numel)))
        out.append(Row(f"swizzle_quantize {sfx.replace(' bf16', f' {NODES}x{RANKS_PER_NODE} bf16')}",
                       dict(op="quantize", numel=numel, chunks=sw, nodes=NODES, bits=fmt.bits, **base, **extra),
                       numel, numel * item + fmt.chunked_bytes(numel, sw)))
    # the engine's qgZ packs fp32 gradients: its stochastically rounded first step (zeropp.gradient_stochastic_rounding)
    fp32, fp32_item = DTYPES["fp32"]
    out.append(Row(f"swizzle_quantize int4 seeded {NODES}x{RANKS_PER_NODE} fp32 b{bs}",
                   dict(op="quantize", numel=numel, chunks=sw, nodes=NODES, bits=4, block_size=bs, dtype=fp32,
                        seed=SEED), numel, numel * fp32_item + f4.chunked_bytes(numel, sw)))
    out.append(Row(f"dequantize int2 bf16 b{bs}", dict(op="dequantize", chunks=1, chunk_numel=numel, out_numel=numel,
                                                       bits=2, **base), numel, f2.packed_bytes(numel) + numel * item))
    out.append(Row(f"reduce_dequantize int2 g=2 bf16 b{bs}",
                   dict(op="reduce_dequantize", groups=2, chunk_numel=numel // 2, out_numel=numel // 2,
                        divisor=float(2 * RANKS_PER_NODE), bits=2, **base),
                   numel // 2, f2.chunked_bytes(numel, 2) + numel // 2 * item))
    d = 2
    cn = numel // (d * NODES)
    for fmt, out_fmt, seed in ((f2, f2, None), (f4, f4, SEED), (f8, f4, None), (f8, f4, SEED), (f8, f2, None)):
        name = f"int{fmt.bits}" if fmt == out_fmt else f"int{fmt.bits}->int{out_fmt.bits}"
        case = dict(op="reduce_requantize", bits=fmt.bits, block_size=bs, groups=d, chunks=NODES, chunk_numel=cn,
                    out_bits=out_fmt.bits, **({} if seed is None else {"seed": seed}))
        out.append(Row(f"reduce_requantize {name} d={d}" + (" seeded" if seed is not None else "") + f" b{bs}", case,
                       NODES * cn, fmt.chunked_bytes(numel, d * NODES) + NODES * out_fmt.packed_bytes(cn)))
    for dt in ("fp32", "bf16"):  # qgZ's first and last steps with the 32-element Hadamard rotation fused
        dtype, item = DTYPES[dt]
        rot = dict(block_size=bs, dtype=dtype, bits=4, rotation=ROTATION_SIZE)
        for seed in (None, SEED):  # rounded to nearest, and stochastically with the rotation fused too
            name = f"swizzle_quantize_rotated int4 {NODES}x{RANKS_PER_NODE} s={ROTATION_SIZE}"
            out.append(Row(name + (" seeded" if seed is not None else "") + f" {dt} b{bs}",
                           dict(op="quantize", numel=numel, chunks=sw, nodes=NODES, **rot,
                                **({} if seed is None else {"seed": seed})),
                           numel, numel * item + f4.chunked_bytes(numel, sw)))
        out.append(Row(f"reduce_dequantize_rotated int4 g=2 s={ROTATION_SIZE} {dt} b{bs}",
                       dict(op="reduce_dequantize", groups=2, chunk_numel=numel // 2, out_numel=numel // 2,
                            divisor=float(2 * RANKS_PER_NODE), **rot),
                       numel // 2, f4.chunked_bytes(numel, 2) + numel // 2 * item))
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def persistent_trips(programs: int, per_tile: int, elements: int) -> int:
    """Loop trips of a persistent kernel (one that takes a ``STAGES`` constexpr and loops over tiles): the row's
    tiles over its programs, rounded (2^28 elements over 132 x k programs do not divide evenly)."""
    if programs < 1 or elements % per_tile:
        raise CostModelError(f"{elements} elements are not whole tiles of {per_tile} over {programs} programs")
    return max(1, round(elements // per_tile / programs))


def measure(selected: Sequence[Row], work_dir: Path, jobs: int = 1) -> list[dict[str, Any]]:
    """Compile ``selected`` (``aot.compile_in_subprocess`` with ``jobs`` processes) and count each row (``jobs``
    disassemblers at once); a row that cannot be compiled or counted gets an ``error``. Returns ``[{"skip": why}]``
    where the toolchain cannot run here."""
    from zeropp.quant._triton import aot

    ids = {_slug(r.name): r for r in selected}
    result = aot.compile_in_subprocess({cid: r.case for cid, r in ids.items()}, work_dir, jobs=jobs)
    if "skip" in result:
        return [{"skip": result["skip"]}]

    def one(cid: str) -> dict[str, Any]:
        row, entry = ids[cid], result["cases"][cid]
        try:
            if "error" in entry:
                raise CostModelError(f"did not compile:\n{entry['error']}")
            consts = entry["constexprs"]
            per_tile = consts["BLOCKS"] * consts["BLOCK_SIZE"]
            programs = math.prod(entry["grid"] or [0])
            trips = persistent_trips(programs, per_tile, row.elements) if "STAGES" in consts else None
            if trips is None and programs * per_tile != row.elements:
                raise CostModelError(
                    f"{programs} programs x {per_tile} elements (BLOCKS x BLOCK_SIZE) != the row's {row.elements} "
                    "elements: the grid or the constexprs no longer mean what the model assumes")
            count = count_cubin(work_dir / f"{cid}.cubin", entry["kernel"], trips)
            per_program = per_tile * (trips or 1)
        except CostModelError as e:
            return {"kernel": row.name, "error": str(e)}
        return summarize(row.name, count, per_program / (32 * entry["num_warps"]), row.nbytes / row.elements,
                         row.elements, {"num_warps": entry["num_warps"], "BLOCKS": consts["BLOCKS"],
                                        "BLOCK_SIZE": consts["BLOCK_SIZE"]})

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, ids))


FP32_ROUNDER = 12582912.0
"""1.5 * 2^23: quant.cu's ``kRounder``; a code is ``FFMA x, r, kRounder + 2^(bits - 1)``."""


def cuda_trip_count(bits: int, block_size: int, groups: int) -> Callable[[Loop], float]:
    """Trips of quant.cu's loops for one thread of a row (``native_cuda.PER_THREAD`` elements of one block), told
    apart by what one trip executes:

    * a trip that loads global memory is the fused sum's loop over the packs (``sum_groups``): a thread loads its
      codes of one pack (``PER_THREAD * bits / 8`` bytes) and its block's float32 scale per pack, so a trip that
      loads k times that handles k packs, and the loop runs ``groups / k`` times (fractional when k does not divide
      ``groups``: the instructions of one pack times ``groups``, the loop's own overhead shared alike); a trip
      that loads another amount is an error, and so is such a loop in a single-pass kernel (``groups`` 0);
    * a trip with warp shuffles is the block maximum's shuffle stage: log2(min(threads per block, 32)) shuffles;
    * a trip with shared-memory loads and no shuffle is its pass over the other warps' maxima (blocks of more than
      32 threads): ptxas unrolls it by 16 and 4 with a one-load remainder loop; fewer than 4 other warps (blocks up
      to 2048 elements) run only the remainder loop, more are refused;
    * anything else is an error.
    """
    from zeropp.quant import native_cuda

    per_pack = native_cuda.PER_THREAD * bits // 8 + 4
    threads = block_size // native_cuda.PER_THREAD
    other_warps = max(threads // 32 - 1, 0)

    def trips(loop: Loop) -> float:
        loaded = moved_bytes(loop.trip, stores=False)
        by_base = Counter()
        for op, n in loop.trip.counts.items():
            by_base[op.split(".", 1)[0]] += n
        if loaded:
            packs = loaded / per_pack
            if not groups or packs < 1 or packs != int(packs):
                raise CostModelError(
                    f"{loop.entry}: the loop at {loop.where} loads {loaded:g} bytes per thread and trip, not whole "
                    f"packs of {per_pack} bytes of a fused sum over {groups} packs: quant.cu no longer has the loops "
                    "cuda_trip_count knows")
            return groups / packs
        if by_base["SHFL"]:
            return math.log2(min(threads, 32)) / by_base["SHFL"]
        if by_base["LDS"]:
            if other_warps >= 4:
                raise CostModelError(f"{loop.entry}: block size {block_size} reads {other_warps} other warps' maxima "
                                     "through ptxas's unrolled loops, which cuda_trip_count does not count")
            return other_warps if by_base["LDS"] == 1 else 0
        raise CostModelError(f"{loop.entry}: a loop at {loop.where} that cuda_trip_count does not know")

    return trips


def cuda_code_fma(bits: int) -> Callable[[Instruction], bool]:
    """Whether an instruction is quantize()'s code rounding ``FFMA x, r, kRounder + 2^(bits - 1)``: the steady-state
    path of a kernel that quantizes passes through it (a normal scale), not through the shorter all-zero branch."""
    offset = f"{FP32_ROUNDER + 2 ** (bits - 1):.0f}"
    return lambda ins: ins.base == "FFMA" and ins.operands.rsplit(",", 1)[-1].strip() == offset


def measure_cuda(selected: Sequence[Row], work_dir: Path, jobs: int = 1) -> list[dict[str, Any]]:
    """The CUDA C++ kernels (``native_cuda.SOURCE``, compiled here for sm_90 with ``native_cuda.cuda_flags()``) that
    do each row's work, counted like the Triton ones per ``native_cuda.PER_THREAD`` elements of a thread (output
    elements for the fused reductions), their loops at ``cuda_trip_count``, the path of a kernel that quantizes
    through its normal-scale branch (``cuda_code_fma``); rows named ``<row> [cuda]``, ``[{"skip": why}]`` without
    nvcc. A row whose path does not move the row's bytes (per thread: each thread reads its block's scale) gets an
    ``error``."""
    import shutil

    import torch

    from zeropp.quant import native_cuda

    nvcc = shutil.which("nvcc")
    if not nvcc:
        return [{"skip": "no nvcc on PATH (the CUDA toolkit compiles kernels/cuda/quant.cu)"}]
    work_dir.mkdir(parents=True, exist_ok=True)
    cubin = work_dir / "quant_cuda.cubin"
    built = subprocess.run([nvcc, "-cubin", *native_cuda.cuda_flags(), "-arch=sm_90", "-o", str(cubin),
                            str(native_cuda.SOURCE)], capture_output=True, text=True, check=False)
    if built.returncode:
        return [{"skip": f"nvcc failed: {built.stderr[-500:]}"}]
    ops = {"quantize": "quantize_chunks", "dequantize": "dequantize_chunks"}

    def one(row: Row) -> dict[str, Any]:
        case, name = row.case, f"{row.name} [cuda]"
        dtype = None if case["op"] == "reduce_requantize" else getattr(torch, case["dtype"])
        kernel = native_cuda.kernel_name(ops.get(case["op"], case["op"]), case["bits"], dtype)
        quantizes = case["op"] in ("quantize", "reduce_requantize")
        try:
            count = count_cubin(cubin, kernel, cuda_trip_count(case["bits"], case["block_size"], case.get("groups", 0)),
                                cuda_code_fma(case["bits"]) if quantizes else None)
            record = summarize(name, count, native_cuda.PER_THREAD, row.nbytes / row.elements, row.elements, {})
        except CostModelError as e:
            return {"kernel": name, "error": str(e)}
        if record["path bytes/elem"] < 0.99 * record["bytes/elem"]:
            return {"kernel": name, "error": f"the steady-state path moves {record['path bytes/elem']} of the "
                                             f"{record['bytes/elem']} bytes per element the row must move"}
        return record

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(one, selected))


# ------------------------------------------------------------------------------------------------------------------
# The budget.

BUDGET_FILE = Path(__file__).resolve().with_name("cost_budget.json")
BUDGET_TOLERANCE = 0.03
"""A row may exceed its committed instructions per element by this fraction."""


def write_budget(records: Sequence[Mapping[str, Any]], path: Path = BUDGET_FILE) -> None:
    """Commit every record's instr/elem to ``path``, with the triton that compiled them."""
    import triton

    budget = {
        "about": "Thread-level instructions per element on the steady-state path of each kernel row, as counted by "
                 "bench/cost_model.py; tests/quant/test_cost_model.py fails a row more than "
                 f"{BUDGET_TOLERANCE:.0%} above. Regenerate with: python bench/cost_model.py --write-budget",
        "triton": triton.__version__,
        "instr_per_elem": {r["kernel"]: r["instr/elem"] for r in records},
    }
    path.write_text(json.dumps(budget, indent=1) + "\n")


def budget_problems(records: Sequence[Mapping[str, Any]], budget: Mapping[str, float]) -> list[str]:
    """What is wrong with ``records`` against ``budget`` (row -> instr/elem): rows that failed, rows over budget by
    more than ``BUDGET_TOLERANCE``, rows missing from the budget, budget rows that no longer exist."""
    problems = []
    names = {r["kernel"] for r in records}
    for r in records:
        if "error" in r:
            problems.append(f"{r['kernel']}: {r['error']}")
        elif r["kernel"] not in budget:
            problems.append(f"{r['kernel']}: not in the budget ({r['instr/elem']:.2f} instr/elem now)")
        elif r["instr/elem"] > budget[r["kernel"]] * (1 + BUDGET_TOLERANCE):
            now, then = r["instr/elem"], budget[r["kernel"]]
            problems.append(f"{r['kernel']}: {now:.2f} instr/elem, budget {then:.2f} (+{now / then - 1:.1%}, more "
                            f"than {BUDGET_TOLERANCE:.0%})")
    problems += [f"{name}: in the budget but no longer a row" for name in sorted(set(budget) - names)]
    return problems


# ------------------------------------------------------------------------------------------------------------------
# The command line.

TABLE = ["kernel", "instr/elem", "longest instr/elem", *CLASSES, "registers", "ld", "st", "bytes/elem", "bound",
         "floor/time"]


def table(records: Sequence[Mapping[str, Any]]) -> str:
    """The report as a Markdown table (classes that no row uses are left out)."""
    used = [c for c in TABLE if c not in CLASSES or any(r.get(c) for r in records)]

    def cell(r: Mapping[str, Any], k: str) -> str:
        v = r.get(k)
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) and k != "floor/time" else str(v)

    ok = [r for r in records if "error" not in r]
    text = markdown_table([{"longest instr/elem": "longest"}.get(k, k) for k in used],
                          [[cell(r, k) for k in used] for r in ok])
    return "\n".join([text, *(f"{r['kernel']}: ERROR {r['error']}" for r in records if "error" in r)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kernels", nargs="+", metavar="SUBSTR", help="only rows whose name contains one of these")
    p.add_argument("--csv", metavar="PATH", help="also write the rows as CSV ('-' for stdout)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--work-dir", metavar="DIR", help="keep the compiled kernels here (default: a temporary folder)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="compile and disassemble processes at once (default: the CPU count)")
    p.add_argument("--write-budget", action="store_true", help=f"write every row's instr/elem to {BUDGET_FILE.name}")
    p.add_argument("--check-budget", action="store_true", help=f"exit 1 if a row breaks {BUDGET_FILE.name}")
    p.add_argument("--cuda", action="store_true",
                   help="count the CUDA C++ kernels (kernels/cuda, needs nvcc) that do the rows' work instead")
    ext = p.add_argument_group("a cubin not from zeropp (e.g. DeepSpeed's, for calibration); times for 2^28 elements")
    ext.add_argument("--cubin", type=Path, help="count this cubin's kernel instead of the rows")
    ext.add_argument("--kernel", help="the kernel's name, or a substring naming one kernel of the cubin")
    ext.add_argument("--elements-per-thread", type=float, help="elements each thread handles in one program")
    ext.add_argument("--bytes-per-element", type=float, help="bytes that must move per element (for the prediction)")
    ext.add_argument("--trip-count", type=int, help="iterations of every loop of the kernel")
    ext.add_argument("--name", help="the row's name (default: the kernel's)")
    ext.add_argument("--print-path", action="store_true", help="also print the SASS of the steady-state path")
    args = p.parse_args(argv)

    if args.cubin:
        if not args.kernel or not args.elements_per_thread:
            p.error("--cubin needs --kernel and --elements-per-thread")
        try:
            count = count_cubin(args.cubin, args.kernel, args.trip_count)
        except CostModelError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        records = [summarize(args.name or count.kernel, count, args.elements_per_thread, args.bytes_per_element,
                             NUMEL)]
        if args.print_path:
            print(f"steady-state path of {count.kernel} ({count.steady.cost.total} instructions per thread):")
            print(format_path(count.program, count.entry, count.steady))
    else:
        if args.write_budget and (args.kernels or args.cuda):
            p.error("--write-budget writes every Triton row: leave out --kernels and --cuda")
        selected = [r for r in rows() if not args.kernels or any(k in r.name for k in args.kernels)]
        if args.cuda:  # the CUDA C++ kernels have no int2, per-hop or seeded paths
            selected = [r for r in selected if r not in wide_rows()]
        if not selected:
            p.error(f"no row matches {args.kernels}")
        with tempfile.TemporaryDirectory() as tmp:
            records = (measure_cuda if args.cuda else measure)(selected, Path(args.work_dir or tmp), args.jobs)
        if "skip" in records[0]:
            print(f"cannot count here: {records[0]['skip']}", file=sys.stderr)
            return 1
    print(f"H100 model: {SMS} SMs x {ISSUE_SLOTS} issue/clk x {CLOCK_HZ / 1e9:.3f} GHz, eta {ISSUE_EFFICIENCY}, "
          f"copy {COPY_BYTES_PER_S / 1e9:.0f} GB/s; instructions per element on the steady-state path")
    print(table(records))
    if args.csv:
        write_csv(records, args.csv)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    failed = any("error" in r for r in records)
    if args.write_budget and not failed:
        write_budget(records)
        print(f"wrote {BUDGET_FILE}")
    if args.check_budget:
        budget = json.loads(BUDGET_FILE.read_text())["instr_per_elem"]
        if args.kernels:  # only the rows selected: the others are not stale
            budget = {k: v for k, v in budget.items() if any(s in k for s in args.kernels)}
        problems = budget_problems(records, budget)
        print("\n".join(problems) or "within budget", file=sys.stderr if problems else sys.stdout)
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
