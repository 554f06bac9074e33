"""The static cost model (``bench/cost_model.py``): its SASS control-flow analysis against hand-counted answers, its
machine model, and the committed instruction budget of every kernel row.

The budget test compiles every row for sm_90 (``zeropp.quant._triton.aot``, in fresh processes: no GPU, no
interpreter) once per session and fails when a row's instructions per element on the steady-state path exceed
``bench/cost_budget.json`` by more than ``BUDGET_TOLERANCE``, when a row is missing from it, or when it names a row
that no longer exists. If the toolchain cannot run here (no NVIDIA backend in triton, no ``ptxas``, no
``nvdisasm``), those tests skip and say what is missing; the analysis tests run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import ahead
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_cost_model():
    spec = importlib.util.spec_from_file_location("cost_model", ROOT / "bench" / "cost_model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


cm = _load_cost_model()

# A kernel as nvdisasm prints it: an early exit that stores nothing, a predicated branch over a slow block, a call
# into a subroutine with a branch of its own, an unconditional branch over dead code, and after the last EXIT the
# trap loop and NOP padding that no path reaches.
KERNEL = """
//--------------------- .text.k                  --------------------------
	.section	.text.k,"ax",@progbits
	.align	128
        .global         k
k:
.text.k:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0020*/               @P0 EXIT ;
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0040*/                   FSETP.GEU.AND P1, PT, |R4|, 1, PT ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/                   FMUL R4, R4, 0.5 ;
        /*0070*/                   FMUL R5, R5, 0.5 ;
        /*0080*/                   FMUL R6, R6, 0.5 ;
        /*0090*/                   FMUL R7, R7, 0.5 ;
.L_x_0:
        /*00a0*/                   MOV R8, 0xc0 ;
        /*00b0*/                   CALL.REL.NOINC `($__internal_0_$__slow) ;
        /*00c0*/                   BRA `(.L_x_1) ;
        /*00d0*/                   FADD R4, R4, 1 ;
.L_x_1:
        /*00e0*/                   STG.E.128 desc[UR4][R2.64], R4 ;
        /*00f0*/                   EXIT ;
$__internal_0_$__slow:
        /*0100*/                   FCHK P0, R4, R5 ;
        /*0110*/              @!P0 BRA `(.L_x_2) ;
        /*0120*/                   MUFU.RCP R9, R5 ;
        /*0130*/                   FFMA R4, R4, R9, RZ ;
.L_x_2:
        /*0140*/                   HFMA2.MMA R11, -RZ, RZ, 0, 0 ;
        /*0150*/                   RET.REL.NODEC R8 `(k) ;
.L_x_3:
        /*0160*/                   BRA `(.L_x_3);
        /*0170*/                   NOP;
        /*0180*/                   NOP;
.L_x_4:


//--------------------- SYMBOLS --------------------------
"""

# A full tile stores unconditionally (9 instructions, 36 bytes); the masked tail's branch skips its code stores
# (ptxas does that to masked stores), so its fewest-instruction path (8) stores only the scale (4 bytes); with
# every store it takes 10.
MASKED = """
	.section	.text.masked,"ax",@progbits
masked:
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   ISETP.GE.AND P2, PT, R0, R1, PT ;
        /*0020*/               @P2 BRA `(.L_x_0) ;
        /*0030*/                   IADD3 R8, R4, 0x1, RZ ;
        /*0040*/                   IADD3 R9, R5, 0x1, RZ ;
        /*0050*/                   STG.E.128 desc[UR4][R2.64], R8 ;
        /*0060*/                   STG.E.128 desc[UR4][R2.64+0x800], R8 ;
        /*0070*/                   STG.E desc[UR4][R10.64], R12 ;
        /*0080*/                   EXIT ;
.L_x_0:
        /*0090*/                   ISETP.GE.AND P0, PT, R0, R3, PT ;
        /*00a0*/                   MOV R8, R4 ;
        /*00b0*/               @P0 BRA `(.L_x_1) ;
        /*00c0*/                   STG.E.128 desc[UR4][R2.64], R8 ;
        /*00d0*/                   STG.E.128 desc[UR4][R2.64+0x800], R4 ;
.L_x_1:
        /*00e0*/                   STG.E desc[UR4][R10.64], R12 ;
        /*00f0*/                   EXIT ;
"""

# One loop (entry 1, body 5 with the latch's predicated back edge, exit 1) and two nested ones (entry 1; outer
# header 1, inner body 3, outer tail 4; exit 1).
LOOPS = """
	.section	.text.loop,"ax",@progbits
loop:
        /*0000*/                   MOV R0, RZ ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0030*/                   ISETP.GE.AND P0, PT, R0, R1, PT ;
        /*0040*/                   STG.E desc[UR4][R6.64], R2 ;
        /*0050*/              @!P0 BRA `(.L_x_0) ;
        /*0060*/                   EXIT ;
	.section	.text.nested,"ax",@progbits
nested:
        /*0000*/                   MOV R0, RZ ;
.L_x_1:
        /*0010*/                   MOV R1, RZ ;
.L_x_2:
        /*0020*/                   IADD3 R1, R1, 0x1, RZ ;
        /*0030*/                   ISETP.GE.AND P0, PT, R1, R3, PT ;
        /*0040*/              @!P0 BRA `(.L_x_2) ;
        /*0050*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0060*/                   ISETP.GE.AND P1, PT, R0, R3, PT ;
        /*0070*/                   STG.E desc[UR4][R6.64], R0 ;
        /*0080*/              @!P1 BRA `(.L_x_1) ;
        /*0090*/                   EXIT ;
"""


def test_steady_state_path_of_a_hand_written_kernel():
    program = cm.parse_sass(KERNEL)
    assert len(program.instructions) == 25 and set(program.sections) == {"k"}
    steady = cm.find_path(program, "k")
    # S2R ISETP @P0-EXIT LDG FSETP @!P1-BRA (taken) | MOV CALL BRA | STG EXIT, and the callee's shortest path:
    # FCHK @!P0-BRA (taken) HFMA2 RET. The early exit (3 instructions) stores nothing: not the steady state.
    assert sum(steady.counts.values()) == 15
    assert steady.counts["LDG.E.128"] == steady.counts["STG.E.128"] == steady.counts["CALL.REL.NOINC"] == 1
    assert "FMUL" not in steady.counts and "MUFU.RCP" not in steady.counts and "FADD" not in steady.counts
    assert steady.nodes == [0, 3, 10, 14, "end"]  # basic blocks by their first instruction
    longest = cm.find_path(program, "k", longest=True)
    # The slow block (4 FMUL) and the callee's slow path (MUFU, FFMA); never the dead FADD, trap loop or NOPs.
    assert sum(longest.counts.values()) == 21
    assert longest.counts["FMUL"] == 4 and longest.counts["MUFU.RCP"] == 1 and "NOP" not in longest.counts
    path = cm.format_path(program, "k", steady)
    assert "CALL.REL.NOINC" in path and "FMUL" not in path and path.endswith("[end]")


def test_the_steady_state_path_stores_the_whole_tile():
    program = cm.parse_sass(MASKED)
    steady = cm.find_path(program, "masked")
    assert sum(steady.counts.values()) == 9 and steady.counts["STG.E.128"] == 2 and "MOV" not in steady.counts
    assert steady.nodes == [0, 3, "end"]
    assert sum(cm.find_path(program, "masked", longest=True).counts.values()) == 10
    # A masked tail whose stores are predicated rather than branched around: as many bytes in fewer instructions (7),
    # but masked; the full tile's path (9) is the steady state.
    predicated = MASKED.replace("masked", "predicated").split(".L_x_0:")[0] + """.L_x_0:
        /*0090*/              @!P0 STG.E.128 desc[UR4][R2.64], R4 ;
        /*00a0*/              @!P0 STG.E.128 desc[UR4][R2.64+0x800], R4 ;
        /*00b0*/                   STG.E desc[UR4][R10.64], R12 ;
        /*00c0*/                   EXIT ;
"""
    steady = cm.find_path(cm.parse_sass(predicated), "predicated")
    assert sum(steady.counts.values()) == 9 and steady.cost.masked == 0 and steady.nodes == [0, 3, "end"]


def test_loops_are_weighted_by_the_trip_count():
    program = cm.parse_sass(LOOPS)
    for kernel in ("loop", "nested"):
        with pytest.raises(cm.CostModelError, match="has a loop .* give a trip count"):
            cm.find_path(program, kernel)
    assert sum(cm.find_path(program, "loop", trip_count=4).counts.values()) == 1 + 4 * 5 + 1
    nested = cm.find_path(program, "nested", trip_count=3)
    assert sum(nested.counts.values()) == 1 + 3 * (1 + 3 * 3 + 4) + 1
    assert nested.counts["STG.E"] == 3 and nested.counts["IADD3"] == 3 * 3 + 3


def test_a_kernel_without_a_store_or_with_an_indirect_branch_is_refused():
    program = cm.parse_sass(KERNEL.replace("STG.E.128 desc[UR4][R2.64], R4", "FADD R4, R4, 2"))
    with pytest.raises(cm.CostModelError, match="no path from k to its end stores to global memory"):
        cm.find_path(program, "k")
    program = cm.parse_sass(KERNEL.replace("@!P1 BRA `(.L_x_0)", "BRX R2 -0x60"))
    with pytest.raises(cm.CostModelError, match="indirect branch"):
        cm.find_path(program, "k")


def test_opcode_classes_and_access_widths():
    expected = {"FFMA": "fp", "FMNMX": "fp", "IMAD.MOV.U32": "int", "LOP3.LUT": "int", "F2FP.BF16.F32.PACK_AB": "conv",
                "I2FP.F32.S32": "conv", "MUFU.RCP": "sfu", "SHFL.BFLY": "shfl", "LDG.E.128": "mem", "LDC": "mem",
                "ULDC.64": "uniform", "R2UR": "uniform", "BSSY": "ctrl", "EXIT": "ctrl", "S2R": "ctrl"}
    assert {op: cm.opcode_class(op) for op in expected} == expected
    counts = Counter({"LDG.E.128": 4, "LDG.E": 1, "LDG.E.U8": 2, "STG.E.64": 2, "LDGSTS.E.BYPASS.128": 3})
    assert cm.access_widths(counts, "LDG") == "128x4 128x3a 32x1 8x2"
    assert cm.access_widths(counts, "STG") == "64x2"
    assert cm.access_widths(Counter(), "STG") == "-"


def test_the_model_takes_the_largest_of_its_terms():
    # 100 FFMA per element and 1 byte: issue-bound (FFMA has 128 lanes, issue 4 x 32 slots x eta).
    issue = 100 / 32 / (cm.SMS * cm.ISSUE_SLOTS * cm.CLOCK_HZ) / cm.ISSUE_EFFICIENCY
    model = cm.predict(Counter({"FFMA": 100.0}), 1.0)
    assert model["bound"] == "issue" and model["times"]["issue"] == pytest.approx(issue)
    assert model["times"]["fma"] == pytest.approx(100 / 128 / (cm.SMS * cm.CLOCK_HZ))
    assert model["floor/time"] == pytest.approx(1.0 / cm.COPY_BYTES_PER_S / issue)
    # Conversions run on the quarter-rate XU pipe; IMAD on the FMA-heavy half.
    assert cm.predict(Counter({"I2F.F32.S32": 10.0}), 1.0)["bound"] == "xu"
    assert cm.predict(Counter({"IMAD": 30.0, "FFMA": 10.0}), 0.01)["bound"] == "fmaheavy"
    model = cm.predict(Counter({"LOP3.LUT": 1.0}), 4.0)
    assert model["bound"] == "floor" and model["floor/time"] == 1.0


def test_budget_problems():
    records = [{"kernel": "a", "instr/elem": 10.2}, {"kernel": "b", "instr/elem": 10.31},
               {"kernel": "c", "instr/elem": 1.0}, {"kernel": "d", "error": "did not compile"}]
    problems = cm.budget_problems(records, {"a": 10.0, "b": 10.0, "d": 5.0, "gone": 1.0})
    assert problems == [
        "b: 10.31 instr/elem, budget 10.00 (+3.1%, more than 3%)",
        "c: not in the budget (1.00 instr/elem now)",
        "d: did not compile",
        "gone: in the budget but no longer a row",
    ]


# --------------------------------------------------------------------------------------------------------------
# The kernels, compiled.


def measure_rows(out_dir: Path) -> dict:
    """``measured``'s background job (``tests/ahead.py``): every row compiled into ``out_dir`` and counted (two
    compile processes where there are two cores), ``{"records": [...]}``; ``{"skip": why}`` where the toolchain
    cannot run, ``{"fail": why}`` if a compile process failed as a whole."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"skip": "triton is not installed (it is a dependency on Linux only)"}
    try:
        cm.tool("nvdisasm")
    except FileNotFoundError as e:
        return {"skip": f"cannot disassemble cubins here: {e}"}
    from zeropp.quant._triton import aot

    try:
        records = cm.measure(cm.rows(), out_dir, jobs=min(2, os.cpu_count() or 1))
    except aot.CompileProcessError as e:
        return {"fail": str(e)}
    return {"skip": records[0]["skip"]} if "skip" in records[0] else {"records": records}


ahead.register(__file__, "measured", "measure_rows")


@pytest.fixture(scope="session")
def measured() -> list[dict]:
    """Every row compiled for sm_90 and counted, once per session: ``measure_rows``, started in the background when
    the tests were collected."""
    try:
        _, out = ahead.result(__file__, "measured")
    except ahead.AheadError as e:
        pytest.fail(str(e))
    if "skip" in out:
        pytest.skip(out["skip"])
    if "fail" in out:
        pytest.fail(out["fail"])
    return out["records"]


def test_every_row_is_counted(measured):
    errors = [f"{r['kernel']}: {r['error']}" for r in measured if "error" in r]
    assert not errors, "\n".join(errors)
    for r in measured:
        assert r["instr/elem"] <= r["longest instr/elem"]
        # The steady-state path moves every byte the row must move (a path that skips masked accesses would not).
        assert r["path bytes/elem"] >= 0.99 * r["bytes/elem"], f"{r['kernel']}: the path skips loads or stores"
        assert r["ld"] != "-" and r["st"] != "-", f"{r['kernel']}: no global load or store on the path"
        assert sum(r[c] for c in cm.CLASSES) == pytest.approx(r["instr/elem"], abs=0.01)


def _release(version: str) -> tuple[int, ...]:
    """``"3.9.0"`` -> ``(3, 9, 0)`` (a local or pre-release suffix dropped)."""
    return tuple(int(re.match(r"\d+", part).group()) for part in version.split("+")[0].split(".")[:3])


def test_instructions_per_element_within_budget(request):
    committed = json.loads(cm.BUDGET_FILE.read_text())
    triton = pytest.importorskip("triton", reason="triton is not installed (it is a dependency on Linux only)")
    if _release(triton.__version__) < _release(committed["triton"]):
        # torch 2.11 brings triton 3.6, whose code for the same kernels is 3-11% more instructions per element
        pytest.skip(f"the budget counts triton {committed['triton']}'s code; this older triton {triton.__version__} "
                    "compiles other code")
    problems = cm.budget_problems(request.getfixturevalue("measured"), committed["instr_per_elem"])
    assert not problems, (
        f"instructions per element against {cm.BUDGET_FILE.relative_to(ROOT)} (at most "
        f"{cm.BUDGET_TOLERANCE:.0%} over):\n" + "\n".join(problems) + "\nIf the change is intended, update the "
        "budget: python bench/cost_model.py --write-budget (and commit bench/cost_budget.json)."
    )


# --------------------------------------------------------------------------------------------------------------
# The CUDA C++ kernels (``--cuda``), and what the loop counting rests on.

# Within a block, three loads under complementary guards (nvcc's "one 64-bit load if aligned, else two 32-bit ones")
# move 8 bytes per thread; once the predicate may be redefined between them they are not alternatives.
ALTERNATIVES = """
	.section	.text.alt,"ax",@progbits
alt:
        /*0000*/                   LOP3.LUT P4, RZ, R36, 0x7, RZ, 0xc0, !PT ;
        /*0010*/               @P4 LDG.E R28, desc[UR6][R36.64] ;
        /*0020*/               @P4 LDG.E R29, desc[UR6][R36.64+0x4] ;
        /*0030*/              @!P4 LDG.E.64 R28, desc[UR6][R36.64] ;
        /*0040*/                   STG.E.64 desc[UR6][R2.64], R28 ;
        /*0050*/                   EXIT ;
"""

# A loop that only loads (one unguarded and one guarded 16-byte load per trip, like a fused sum's packs) before a
# store: the steady-state rule alone goes around it.
LOAD_LOOP = """
	.section	.text.sum,"ax",@progbits
sum:
        /*0000*/                   ISETP.GE.AND P0, PT, R0, 0x1, PT ;
        /*0010*/              @!P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0020*/                   LDG.E.128 R8, desc[UR4][R2.64] ;
        /*0030*/                   ISETP.LE.AND P1, PT, R0, R1, PT ;
        /*0040*/               @P1 BRA `(.L_x_2) ;
        /*0050*/                   LDG.E.128 R12, desc[UR4][R2.64+0x10] ;
        /*0060*/                   FADD R4, R12, R4 ;
.L_x_2:
        /*0070*/                   FADD R4, R8, R4 ;
        /*0080*/                   IADD3 R1, R1, 0x2, RZ ;
        /*0090*/                   ISETP.GT.AND P2, PT, R0, R1, PT ;
        /*00a0*/               @P2 BRA `(.L_x_0) ;
.L_x_1:
        /*00b0*/                   STG.E.128 desc[UR4][R6.64], R4 ;
        /*00c0*/                   EXIT ;
"""


def test_guarded_alternatives_move_one_side():
    program = cm.parse_sass(ALTERNATIVES)
    path = cm.find_path(program, "alt")
    assert cm.global_bytes(path.counts, stores=False) == 16  # the three loads, as written
    assert cm.moved_bytes(path.cost, stores=False) == 8 and cm.moved_bytes(path.cost) == 16
    redefined = ALTERNATIVES.replace("@!P4 LDG.E.64 R28, desc[UR6][R36.64] ;",
                                     "ISETP.NE.AND P4, PT, R0, RZ, PT ;\n        /*0031*/ @!P4 LDG.E.64 R28, "
                                     "desc[UR6][R36.64] ;")
    assert cm.moved_bytes(cm.find_path(cm.parse_sass(redefined), "alt").cost, stores=False) == 16


def test_a_trip_count_function_puts_its_loop_on_the_path():
    program = cm.parse_sass(LOAD_LOOP)
    prologue, trip, epilogue = 2, 9, 2  # instructions: before the loop, one whole trip (both loads), after it
    assert sum(cm.find_path(program, "sum", trip_count=3).counts.values()) == prologue + epilogue  # around it
    seen = []

    def per_pack(loop):  # 2 packs of 16 bytes per trip: 5 packs are 2.5 trips
        seen.append(loop)
        return 5 / (cm.moved_bytes(loop.trip, stores=False) / 16)

    path = cm.find_path(program, "sum", trip_count=per_pack)
    assert len(seen) == 1 and seen[0].trip.total == trip and seen[0].where.startswith("sum+0x0020")
    assert sum(path.counts.values()) == pytest.approx(prologue + 2.5 * trip + epilogue)
    assert path.counts["LDG.E.128"] == 5 and path.counts["FADD"] == 5 and path.loops == [(seen[0].where, 2.5)]
    assert sum(cm.find_path(program, "sum", trip_count=lambda loop: 0).counts.values()) == prologue + epilogue


def test_the_path_passes_through_the_blocks_named():
    program = cm.parse_sass(KERNEL)
    path = cm.find_path(program, "k", through=lambda ins: ins.base == "FMUL")  # the branch the rule skips
    assert sum(path.counts.values()) == 15 + 4 and path.counts["FMUL"] == 4
    assert path.nodes == [0, 3, 6, 10, 14, "end"]


def _nvcc() -> str:
    import shutil

    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc not on PATH: the CUDA toolkit compiles the CUDA kernels these tests count")
    try:
        cm.tool("nvdisasm")
    except FileNotFoundError as e:
        pytest.skip(f"cannot disassemble cubins here: {e}")
    return nvcc


# Two rows per trip, the second under a condition on the run-time row count: 2 loads, 4 FADD and 4 FMUL per trip.
SUM_ROWS = r"""
extern "C" __global__ void sum_rows(const float4* __restrict__ x, float4* __restrict__ y, int rows, long long stride) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 1
    for (int r = 0; r < rows; r += 2) {
        const float4 v = __ldg(x + i + r * stride);
        acc.x = __fadd_rn(acc.x, v.x); acc.y = __fadd_rn(acc.y, v.y);
        acc.z = __fadd_rn(acc.z, v.z); acc.w = __fadd_rn(acc.w, v.w);
        if (r + 1 < rows) {
            const float4 u = __ldg(x + i + (r + 1) * stride);
            acc.x = __fmul_rn(acc.x, u.x); acc.y = __fmul_rn(acc.y, u.y);
            acc.z = __fmul_rn(acc.z, u.z); acc.w = __fmul_rn(acc.w, u.w);
        }
    }
    y[i] = acc;
}
"""


def test_a_compiled_loop_is_counted_as_its_listing_reads(tmp_path):
    """A small CUDA kernel with one run-time loop, counted with a trip-count function (rows / rows per trip, the
    latter from the trip's loads), against a count of its own ``nvdisasm`` listing made here: every instruction
    from the entry to the EXIT once, the loop's (from its label to the backward branch) once per trip."""
    source = tmp_path / "sum_rows.cu"
    source.write_text(SUM_ROWS)
    cubin = tmp_path / "sum_rows.cubin"
    subprocess.run([_nvcc(), "-cubin", "-O3", "-arch=sm_90", "-o", str(cubin), str(source)], check=True,
                   capture_output=True)
    listing = cm.disassemble(cubin)
    code = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", listing)]
    labels = {name: int(a, 16) for name, a in re.findall(r"^(\.L_x_\d+):\s*\n\s*/\*([0-9a-f]{4})\*/", listing,
                                                           re.MULTILINE)}
    end = next(i for i, (_, text) in enumerate(code) if text.split()[-1] == "EXIT")
    backward = [(a, labels[m.group(1)]) for a, text in code[:end]
                if (m := re.search(r"BRA `\((\.L_x_\d+)\)", text)) and labels[m.group(1)] <= a]
    assert len(backward) == 1, f"expected one loop in the listing, found {backward}:\n{listing}"
    latch, header = backward[0]
    body = sum(1 for a, _ in code[:end + 1] if header <= a <= latch)
    straight = end + 1 - body
    for rows in (6, 5, 1):
        trips = rows / 2
        path = cm.find_path(cm.parse_sass(listing), "sum_rows",
                            trip_count=lambda loop, rows=rows: rows / (cm.moved_bytes(loop.trip, stores=False) / 16))
        assert sum(path.counts.values()) == pytest.approx(straight + trips * body)
        assert path.counts["FADD"] == pytest.approx(4 * trips) and path.counts["FMUL"] == pytest.approx(4 * trips)
        assert cm.moved_bytes(path.cost, stores=False) == pytest.approx(16 * rows)  # a float4 per row
        assert cm.moved_bytes(path.cost, loads=False) == 16


@pytest.fixture(scope="module")
def cuda_rows(tmp_path_factory) -> dict[str, dict]:
    """A few rows of every kind counted on quant.cu (``measure_cuda``: one compile)."""
    _nvcc()
    wanted = {"quantize int4 fp16 b128", "dequantize int8 bf16 b2048", "reduce_requantize int4 d=2 b128",
              "reduce_requantize int4 d=8 b2048", "reduce_requantize int8 d=4 b128",
              "reduce_dequantize int8 g=4 fp32 b128", "reduce_dequantize int4 g=8 fp16 b2048"}
    records = cm.measure_cuda([r for r in cm.rows() if r.name in wanted], tmp_path_factory.mktemp("cuda"), jobs=2)
    if "skip" in records[0]:
        pytest.skip(records[0]["skip"])
    assert len(records) == len(wanted)
    return {r["kernel"].removesuffix(" [cuda]"): r for r in records}


def test_the_cuda_kernels_are_counted_beside_the_triton_ones(cuda_rows):
    """Every CUDA row is counted (no error) with the Triton rows' fields, its path moving the row's bytes."""
    errors = [f"{name}: {r['error']}" for name, r in cuda_rows.items() if "error" in r]
    assert not errors, "\n".join(errors)
    for name, r in cuda_rows.items():
        assert set(cm.TABLE) <= set(r) and r["registers"] > 0
        assert r["instr/elem"] <= r["longest instr/elem"] and r["ld"] != "-" and r["st"] != "-"
        assert r["path bytes/elem"] >= 0.99 * r["bytes/elem"], name
        assert sum(r[c] for c in cm.CLASSES) == pytest.approx(r["instr/elem"], abs=0.01)
    quantize = cuda_rows["quantize int4 fp16 b128"]
    assert quantize["ld"] == "128x2" and quantize["shfl"] > 0  # 32 bytes of fp16; the block maximum's shuffles
    # A code is one FMA (x * r + offset) per element: the normal-scale branch, not the shorter all-zero one.
    assert quantize["fp"] >= 1


@pytest.mark.parametrize("name", ["reduce_requantize int4 d=2 b128", "reduce_requantize int4 d=8 b2048",
                                  "reduce_requantize int8 d=4 b128", "reduce_dequantize int8 g=4 fp32 b128",
                                  "reduce_dequantize int4 g=8 fp16 b2048"])
def test_a_fused_reduction_reads_every_pack(cuda_rows, name):
    """Per output element, the counted path loads what the op must read of d packs: their codes (bits / 8 bytes
    per element) and each thread's block scale (``SCALE_BYTES`` per ``PER_THREAD`` elements: every thread reads
    its block's scale); it sums each pack with one FMA per element (``acc = fma(code, scale, acc)``); and stores
    the codes and scale (reduce-requantize) or the values (reduce-dequantize)."""
    from zeropp.quant.format import SCALE_BYTES, BlockFormat
    from zeropp.quant.native_cuda import PER_THREAD

    row = next(r for r in cm.rows() if r.name == name)
    r = cuda_rows[name]
    bits, groups, bs = row.case["bits"], row.case["groups"], row.case["block_size"]
    fmt = BlockFormat(bits, bs)
    codes_per_elem = fmt.code_bytes(bs) / bs
    assert r["path load bytes/elem"] == pytest.approx(groups * (codes_per_elem + SCALE_BYTES / PER_THREAD))
    out = codes_per_elem + SCALE_BYTES / PER_THREAD if row.case["op"] == "reduce_requantize" else \
        {"float32": 4, "bfloat16": 2, "float16": 2}[row.case["dtype"]]
    assert r["path store bytes/elem"] == pytest.approx(out)
    # fp: one FMA and one FADD (the decode) per pack and element, plus the epilogue's (< 2 per element).
    assert 2 * groups <= r["fp"] < 2 * groups + 2
