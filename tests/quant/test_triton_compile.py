"""The Triton kernels compiled for a real GPU (sm_90, to PTX and cubin), with no GPU needed.

Without a GPU the other kernel tests run under Triton's interpreter, which does not enforce the type and shape
rules of the compiler nor know which operations its code generator lacks, so a kernel can pass every interpreted
test and still not compile on a GPU. Here each kernel is compiled ahead of time for ``sm_90`` (Triton's LLVM and
the ``ptxas`` in the triton wheel need no GPU), specialized exactly as its launcher would specialize it. Trial
breakages that the interpreted tests all passed and these tests caught: an ``if`` whose branches leave a value
bf16 in one and float32 in the other (compile error for bf16/fp16 input only), ``/`` for ``tl.math.div_rn``
(``div.full.f32``), and a launcher without ``enable_fp_fusion=False``.

How: ``zeropp.quant._triton.aot`` (shared with ``bench/cost_model.py``) compiles each case in a fresh process,
outside the interpreter that ``conftest.py`` switches on here: the real launchers (``quantize_chunks``, ...) are
called on ``meta`` tensors (shapes, dtypes and alignments without memory, so sizes past 2**31 cost nothing) and
each launched ``@triton.jit`` kernel is handed, with the launch's arguments, constexprs and options, to
``JITFunction.warmup``, which specializes it as a GPU launch would and builds it for sm_90. Nothing about the launch
is restated here, so a launcher change is compiled as it is.

The PTX is then checked for what the bit-for-bit agreement with ``zeropp.quant.reference`` relies on: no
floating-point contraction (no FMA, every float add/sub/mul correctly rounded ``.rn`` so ``ptxas`` cannot fuse
them either, fusion off in the options, which also gives ``ptxas --fmad=false``), IEEE division (``div.rn.f32``)
wherever a kernel divides and no approximate division anywhere, and no flush-to-zero of subnormals.

And the cubin is checked for register spills: none in any specialization (0 bytes of spill stores and loads in
the ``ptxas -v`` log that Triton writes when ``TRITON_DUMP_PTXAS_LOG`` is set, and a stack frame of 0 bytes in
``cuobjdump -res-usage``, the wheel's own, read off the cubin itself). A kernel that spills moves its per-row
values through local memory, which a tile heuristic must not cause (see ``launch_shape``). Run as
``python tests/quant/test_triton_compile.py --report`` this file prints the registers and spills of every case.

If the toolchain cannot run here (no NVIDIA backend in triton, no ``ptxas``), the tests skip and say what is missing.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a script: this checkout's zeropp, and tests/ for ``ahead``
    sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import ahead  # noqa: E402
import pytest  # noqa: E402

TARGET = ("cuda", 90, 32)  # backend, compute capability, warp size: an H100 (``aot.TARGET``)

# The specializations compiled, one launcher call each. Sizes are elements (numel, chunk_numel, out_numel) and
# pick the integer specializations as on a GPU: multiples of 16 get Triton's divisibility hint, others do not,
# 1 becomes a constant, 2**31 and above is int64. ``offset`` (elements) misaligns the float tensor's pointer;
# Between them aligned cases (16-byte aligned float tensors, element counts divisible by 16: vectorized, big tiles)
# and unaligned ones (``launch_shape``'s smaller tiles) are compiled for every op that has a float tensor.
# Between them the cases give every (op, bits) each dtype, and each of block sizes 16, DEFAULT_BLOCK_SIZE and
# 2048 with ONE_PACK True and False; GROUPS of the reductions are 1, 2, 4 and 8. Block size 8192 (the largest)
# is the one tile of more than 4096 elements: one block per program and 8 warps. The register-pressure cases
# (odd sizes, so nothing is vectorized and every thread holds every row of a block-128 tile, across packs) include
# ones that spilled before ``launch_shape`` bounded the rows per thread: blocks 32, 64 and 128 over several packs,
# and ``blocks_per_pack == 1`` (a constant to Triton). Packs shorter than a tile need no case of their own: the
# pack arithmetic (``divmod_from``) has no branch, so they run the same kernel as long packs.
_BIG = 5 * 2**30 + 3  # past int32: exercises the int64 offsets
CASES: list[dict] = [
    # quantize: x (dtype) -> chunked packs
    dict(op="quantize", bits=8, block_size=16, dtype="float32", numel=2**20, chunks=1, nodes=1),
    dict(op="quantize", bits=8, block_size=16, dtype="bfloat16", numel=1_000_003, chunks=8, nodes=2),
    dict(op="quantize", bits=8, block_size="default", dtype="bfloat16", numel=2**24, chunks=1, nodes=1),
    dict(op="quantize", bits=8, block_size="default", dtype="float16", numel=2**24 + 1, chunks=16, nodes=2),
    dict(op="quantize", bits=8, block_size=2048, dtype="float16", numel=12345, chunks=1, nodes=1,
         offset=1),
    dict(op="quantize", bits=8, block_size=2048, dtype="float32", numel=2**22, chunks=4, nodes=1),
    dict(op="quantize", bits=4, block_size=16, dtype="bfloat16", numel=4097, chunks=1, nodes=1),
    dict(op="quantize", bits=4, block_size=16, dtype="float16", numel=2**20, chunks=4, nodes=4),
    dict(op="quantize", bits=4, block_size="default", dtype="float16", numel=2**20, chunks=1, nodes=1),
    dict(op="quantize", bits=4, block_size="default", dtype="float32", numel=_BIG, chunks=2, nodes=2),
    dict(op="quantize", bits=4, block_size=2048, dtype="float32", numel=2**20, chunks=1, nodes=1),
    dict(op="quantize", bits=4, block_size=2048, dtype="bfloat16", numel=999_999, chunks=8, nodes=2, offset=3),
    dict(op="quantize", bits=8, block_size=8192, dtype="bfloat16", numel=2**20, chunks=2, nodes=2),
    dict(op="quantize", bits=8, block_size=64, dtype="bfloat16", numel=100_003, chunks=4, nodes=2),
    dict(op="quantize", bits=4, block_size=32, dtype="float16", numel=100_003, chunks=8, nodes=2),
    # dequantize: chunked packs -> out (dtype)
    dict(op="dequantize", bits=8, block_size=16, dtype="float32", chunks=1, chunk_numel=2**20, out_numel=2**20),
    dict(op="dequantize", bits=8, block_size="default", dtype="bfloat16", chunks=8, chunk_numel=131_072,
         out_numel=1_000_000),
    dict(op="dequantize", bits=8, block_size=2048, dtype="float16", chunks=4, chunk_numel=_BIG, out_numel=_BIG - 7, offset=1),
    dict(op="dequantize", bits=4, block_size=16, dtype="bfloat16", chunks=4, chunk_numel=1001, out_numel=4001),
    dict(op="dequantize", bits=4, block_size="default", dtype="float16", chunks=1, chunk_numel=2**24,
         out_numel=2**24),
    dict(op="dequantize", bits=4, block_size=2048, dtype="float32", chunks=16, chunk_numel=2**20,
         out_numel=2**24),
    dict(op="dequantize", bits=4, block_size=2048, dtype="bfloat16", chunks=2, chunk_numel=2**20,
         out_numel=2**20, offset=5),
    dict(op="dequantize", bits=4, block_size=8192, dtype="float16", chunks=1, chunk_numel=2**20, out_numel=2**20),
    dict(op="dequantize", bits=4, block_size="default", dtype="bfloat16", chunks=4, chunk_numel=100_001,
         out_numel=400_001),
    dict(op="dequantize", bits=8, block_size=2048, dtype="float32", chunks=3, chunk_numel=1001, out_numel=3000),
    # dequantize_add_chunks: chunked packs added into out (dtype) in place
    dict(op="dequantize", add=True, bits=4, block_size="default", dtype="bfloat16", chunks=1, chunk_numel=100_001,
         out_numel=100_001),
    dict(op="dequantize", add=True, bits=8, block_size=2048, dtype="float32", chunks=2, chunk_numel=2**20,
         out_numel=2**21),
    # reduce_requantize: groups runs of chunks packs -> chunks packs
    dict(op="reduce_requantize", bits=8, block_size=16, groups=2, chunks=1, chunk_numel=2**20),
    dict(op="reduce_requantize", bits=8, block_size="default", groups=8, chunks=4, chunk_numel=2**20),
    dict(op="reduce_requantize", bits=8, block_size=2048, groups=1, chunks=2, chunk_numel=_BIG),
    dict(op="reduce_requantize", bits=4, block_size=16, groups=8, chunks=2, chunk_numel=1001),
    dict(op="reduce_requantize", bits=4, block_size="default", groups=4, chunks=1, chunk_numel=2**24),
    dict(op="reduce_requantize", bits=4, block_size=2048, groups=2, chunks=8, chunk_numel=2**20),
    dict(op="reduce_requantize", bits=4, block_size=8192, groups=2, chunks=2, chunk_numel=2**20),
    dict(op="reduce_requantize", bits=4, block_size="default", groups=8, chunks=2, chunk_numel=100_001),
    # reduce_dequantize: groups packs -> out (dtype), divided by divisor; every block is in the first pack
    dict(op="reduce_dequantize", bits=8, block_size=16, dtype="float32", groups=1, chunk_numel=2**20,
         out_numel=2**20, divisor=1.0),
    dict(op="reduce_dequantize", bits=8, block_size="default", dtype="bfloat16", groups=8, chunk_numel=2**20,
         out_numel=2**20 - 5, divisor=64.0),
    dict(op="reduce_dequantize", bits=8, block_size=2048, dtype="float16", groups=2, chunk_numel=_BIG,
         out_numel=_BIG, divisor=16.0, offset=1),
    dict(op="reduce_dequantize", bits=4, block_size=16, dtype="bfloat16", groups=4, chunk_numel=1001,
         out_numel=1001, divisor=3.0, offset=1),
    dict(op="reduce_dequantize", bits=4, block_size="default", dtype="float16", groups=2, chunk_numel=2**20,
         out_numel=2**20, divisor=2.0),
    dict(op="reduce_dequantize", bits=4, block_size=2048, dtype="float32", groups=8, chunk_numel=2**22,
         out_numel=2**22, divisor=8.0),
    dict(op="reduce_dequantize", bits=8, block_size=8192, dtype="bfloat16", groups=2, chunk_numel=2**20,
         out_numel=2**20, divisor=2.0),
    # the wider formats: int2 through every op, stochastic rounding (``seed``: int64 element indices past 2**32
    # among them), a reduce into another format (``out_bits``, ``out_block_size``) either way of block size
    dict(op="quantize", bits=2, block_size=16, dtype="bfloat16", numel=1_000_003, chunks=8, nodes=2),
    dict(op="quantize", bits=2, block_size="default", dtype="float32", numel=2**20, chunks=1, nodes=1, seed=1),
    dict(op="quantize", bits=4, block_size="default", dtype="float16", numel=_BIG, chunks=2, nodes=2,
         seed=2**32 - 1),
    dict(op="dequantize", bits=2, block_size="default", dtype="bfloat16", chunks=4, chunk_numel=100_001,
         out_numel=400_001),
    dict(op="reduce_requantize", bits=2, block_size=16, groups=8, chunks=2, chunk_numel=1001),
    dict(op="reduce_requantize", bits=8, block_size="default", groups=2, chunks=2, chunk_numel=2**20, out_bits=4,
         seed=5),
    dict(op="reduce_requantize", bits=4, block_size=32, groups=4, chunks=2, chunk_numel=100_001, out_bits=8,
         out_block_size=2048),
    dict(op="reduce_requantize", bits=8, block_size=2048, groups=2, chunks=2, chunk_numel=2**20, out_bits=2,
         out_block_size=16),
    dict(op="reduce_dequantize", bits=2, block_size=2048, dtype="float16", groups=2, chunk_numel=2**20,
         out_numel=2**20, divisor=16.0),
    # qgZ's first and last steps with the Hadamard rotation fused (``rotation``): each size among them, unaligned
    # slices and outputs, int64 offsets, a divisor that divides; stochastic rounding fused too (aligned: the largest
    # tile; noise indices past 2**32)
    dict(op="quantize", bits=4, block_size="default", dtype="float32", numel=1_000_003, chunks=8, nodes=2,
         rotation=32),
    dict(op="quantize", bits=8, block_size=2048, dtype="bfloat16", numel=_BIG, chunks=2, nodes=2, rotation=128),
    dict(op="quantize", bits=2, block_size=16, dtype="float16", numel=2**20, chunks=4, nodes=1, rotation=16),
    dict(op="quantize", bits=4, block_size="default", dtype="float32", numel=2**33, chunks=2, nodes=2, rotation=32,
         seed=2**32 - 1),
    dict(op="reduce_dequantize", bits=4, block_size="default", dtype="bfloat16", groups=2, chunk_numel=2**20,
         out_numel=2**20, divisor=16.0, rotation=32),
    dict(op="reduce_dequantize", bits=8, block_size=64, dtype="float32", groups=4, chunk_numel=1001,
         out_numel=1001, divisor=3.0, offset=1, rotation=64),
]
# The block Hadamard rotation (``rotation.py``): each size, both directions, each input dtype, a partial last block,
# a misaligned input and int64 offsets.
ROTATION_CASES: list[dict] = [
    dict(op="rotation", size=16, inverse=False, numel=2**20),
    dict(op="rotation", size=32, inverse=False, numel=1_000_003, offset=1, dtype="bfloat16"),
    dict(op="rotation", size=32, inverse=True, numel=2**24),
    dict(op="rotation", size=64, inverse=True, numel=_BIG),
    dict(op="rotation", size=128, inverse=False, numel=2**20 + 5, dtype="float16"),
]
KERNELS = {
    "quantize": "_quantize_kernel",
    "dequantize": "_dequantize_kernel",
    "reduce_requantize": "_reduce_requantize_kernel",
    "reduce_dequantize": "_reduce_dequantize_kernel",
}
def expected_aligned(case: dict) -> bool:
    """Whether the launcher sees the case's float tensor 16-byte aligned and its element counts divisible by 16
    (``common.is_aligned``), which picks the vectorized tile. The reduce-requantize has no float tensor."""
    if case["op"] == "reduce_requantize":
        return True
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[case["dtype"]]
    counts = {"quantize": [-(-case.get("numel", 0) // case.get("chunks", 1))], "dequantize": [case.get("chunk_numel")]}
    return case.get("offset", 0) * itemsize % 16 == 0 and all(c % 16 == 0 for c in counts.get(case["op"], []))


def divides(case: dict) -> bool:
    """Whether the case's kernel divides in float32: the quantizing kernels (a block's reciprocal, and the exact
    path), and the final reduce unless its divisor is a power of two (then it multiplies by the exact inverse)."""
    from zeropp.quant._triton.reduce import DIVIDE_BY_MULTIPLY, divide_mode

    if case["op"] == "reduce_dequantize":
        return divide_mode(case["divisor"])[0] != DIVIDE_BY_MULTIPLY
    return case["op"] in ("quantize", "reduce_requantize")


def case_id(case: dict) -> str:
    if case["op"] == "rotation":
        parts = ["rotation", f"s{case['size']}", "inverse" if case["inverse"] else "forward", f"n{case['numel']}",
                 case.get("dtype", "float32")]
        return "-".join(parts + ([f"off{case['offset']}"] if case.get("offset") else []))
    parts = [case["op"] + ("-add" if case.get("add") else ""), f"int{case['bits']}", f"bs{case['block_size']}"]
    parts += [f"to-int{case.get('out_bits', case['bits'])}-bs{case.get('out_block_size', case['block_size'])}"
              for k in ("out_bits", "out_block_size") if k in case][:1]
    parts += ["seeded"] if "seed" in case else []
    parts += [f"rot{case['rotation']}"] if "rotation" in case else []
    parts += [case[k] for k in ("dtype",) if k in case]
    parts += [f"{k}{case[k]}" for k in ("groups", "chunks") if k in case]
    parts += ["i64"] if _BIG in (case.get("numel"), case.get("chunk_numel")) else []
    parts += [f"off{case['offset']}"] if case.get("offset") else []
    return "-".join(map(str, parts))


IDS = [case_id(c) for c in CASES]
ROTATION_IDS = [case_id(c) for c in ROTATION_CASES]
ALL_CASES = dict(zip(IDS + ROTATION_IDS, CASES + ROTATION_CASES))
assert len(ALL_CASES) == len(IDS) + len(ROTATION_IDS), "case ids must be unique"


# --------------------------------------------------------------------------------------------------------------
# The tests.


def compile_all(out_dir: Path) -> dict:
    """``compiled``'s background job (``tests/ahead.py``): every case compiled into ``out_dir`` (two compile
    processes where there are two cores), the summary; ``{"skip": why}`` where the toolchain cannot run,
    ``{"fail": why}`` if a compile process failed as a whole."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"skip": "triton is not installed (it is a dependency on Linux only)"}
    from zeropp.quant._triton import aot

    try:
        return aot.compile_in_subprocess(ALL_CASES, out_dir, jobs=min(2, os.cpu_count() or 1))
    except aot.CompileProcessError as e:
        return {"fail": str(e)}


ahead.register(__file__, "compiled", "compile_all")


@pytest.fixture(scope="module")
def compiled() -> tuple[Path, dict]:
    """Every case compiled once (``compile_all``, started in the background when the tests were collected): the
    folder with ``<case id>.ptx`` / ``.cubin`` and the summary."""
    try:
        out, result = ahead.result(__file__, "compiled")
    except ahead.AheadError as e:
        pytest.fail(str(e))
    if "skip" in result:
        pytest.skip(result["skip"])
    if "fail" in result:
        pytest.fail(result["fail"])
    return out, result


def _case(compiled, cid: str) -> dict:
    entry = compiled[1]["cases"][cid]
    if "error" in entry:
        pytest.fail(f"{cid} did not compile for sm_{TARGET[1]}:\n{entry['error']}", pytrace=False)
    return entry


# PTX floating-point instructions: opcode, modifiers, type.
_FLOAT_OP = re.compile(
    r"^\s*(?:@!?%\w+\s+)?([a-z]+)((?:\.[A-Za-z0-9]+)*?)\.(f16x2|bf16x2|f16|bf16|f32|f64)\s", re.MULTILINE
)


def _float_ops(ptx: str) -> list[tuple[str, str, str]]:
    return _FLOAT_OP.findall(ptx)


def test_every_launched_kernel_is_covered(compiled):
    _, result = compiled
    launched = set(result["launched"])
    assert set(KERNELS.values()) <= launched, f"kernel discovery found only {sorted(launched)}"
    covered = {entry.get("kernel") for entry in result["cases"].values()}
    assert launched <= covered, f"kernels no case compiles: {sorted(launched - covered)}"
    for op in KERNELS:  # the advertised cover of the specializations
        cases = [c for c in CASES if c["op"] == op]
        assert {c["bits"] for c in cases} == {8, 4, 2}
        assert {c["block_size"] for c in cases} >= {16, "default", 2048, 8192}
        if op != "reduce_requantize":
            assert {c["dtype"] for c in cases} == {"float32", "bfloat16", "float16"}
        if op != "reduce_requantize":
            assert {expected_aligned(c) for c in cases} == {True, False}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiles_for_sm90_as_launched(compiled, case):
    """The kernel compiles to a cubin for sm_90, with the launcher's constexprs and options."""
    from zeropp.quant import DEFAULT_BLOCK_SIZE, BlockFormat
    from zeropp.quant._triton.common import launch_shape
    from zeropp.quant._triton.quantize import quantize_shape
    from zeropp.quant._triton.reduce import requantize_shape

    out, _ = compiled
    cid = case_id(case)
    entry = _case(compiled, cid)
    assert entry["kernel"] == KERNELS[case["op"]]
    assert entry["target"][:2] == list(TARGET[:2])

    cubin = (out / f"{cid}.cubin").read_bytes()
    assert len(cubin) > 1000 and cubin[:4] == b"\x7fELF", "the cubin is not an ELF object"
    ptx = (out / f"{cid}.ptx").read_text()
    assert re.search(rf"^\.target sm_{TARGET[1]}a?\b", ptx, re.MULTILINE)
    assert re.search(rf"^\.visible \.entry {entry['kernel']}\(", ptx, re.MULTILINE)

    block_size = DEFAULT_BLOCK_SIZE if case["block_size"] == "default" else case["block_size"]
    if case["op"] == "reduce_requantize":
        out_fmt = BlockFormat(case.get("out_bits", case["bits"]), case.get("out_block_size", block_size))
        shape = requantize_shape(BlockFormat(case["bits"], block_size), case["groups"], out_fmt, "seed" in case)
    elif case["op"] == "quantize":
        shape = quantize_shape(BlockFormat(case["bits"], block_size), expected_aligned(case), "seed" in case,
                               case.get("rotation", 0))
    else:
        shape = launch_shape(case["op"], block_size, expected_aligned(case))
    constexprs = entry["constexprs"]
    assert constexprs["BLOCK_SIZE"] == block_size and constexprs["BITS"] == case["bits"]
    assert constexprs["BLOCKS"] == shape.blocks_per_program
    assert entry["num_warps"] == shape.num_warps
    if "groups" in case:
        assert constexprs["GROUPS"] == case["groups"]
    ptr = "x_ptr" if case["op"] == "quantize" else "out_ptr"
    dtype = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}[case.get("dtype", "float32")]
    assert entry["signature"][ptr] == ("*u8" if case["op"] == "reduce_requantize" else dtype)
    if _BIG in (case.get("numel"), case.get("chunk_numel")):
        assert "i64" in entry["signature"].values()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_no_float_contraction(compiled, case):
    """No contraction: ``code * scale + acc`` (and every other product and sum) is rounded twice, as in the reference.

    Off in the options (which also runs ``ptxas --fmad=false``), no ``mad`` in the PTX, and every float add/sub/mul
    carries ``.rn``: LLVM writes the bare ``mul.f32``/``add.f32``, which ptxas may fuse, when it is allowed to
    contract. An explicit ``fma.rn.f32`` is allowed: it is a ``tl.fma`` written in the kernel source (the exact
    division's corrections, ``fma(-q, d, x)``, are computed with one rounding on purpose), never a product and a sum
    that the compiler contracted, which fusion off rules out.
    """
    out, _ = compiled
    cid = case_id(case)
    entry = _case(compiled, cid)
    assert entry["enable_fp_fusion"] is False
    assert entry["launch_kwargs"].get("enable_fp_fusion") is False
    ops = _float_ops((out / f"{cid}.ptx").read_text())
    assert ops, "no floating-point instructions found: the PTX pattern is stale"
    fused = sorted({f"{op}{mods}.{ty}" for op, mods, ty in ops if op in ("fma", "mad")} - {"fma.rn.f32"})
    assert not fused, f"fused multiply-adds other than an explicit fma.rn.f32 in the PTX: {fused}"
    loose = sorted({f"{op}{mods}.{ty}" for op, mods, ty in ops if op in ("add", "sub", "mul") and ".rn" not in mods})
    assert not loose, f"float add/sub/mul without .rn (ptxas may contract them): {loose}"
    assert any(op == "mul" for op, _, _ in ops) or case["op"] == "quantize"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ieee_division_and_no_flush_to_zero(compiled, case):
    """Every float32 division is the correctly rounded ``div.rn.f32``; nothing flushes subnormals to zero."""
    out, _ = compiled
    cid = case_id(case)
    _case(compiled, cid)
    ops = _float_ops((out / f"{cid}.ptx").read_text())
    divisions = sorted({f"{op}{mods}.{ty}" for op, mods, ty in ops if op in ("div", "rcp")})
    if divides(case):
        assert "div.rn.f32" in divisions, f"no IEEE division in a kernel that divides: {divisions}"
    assert set(divisions) <= {"div.rn.f32"}, f"approximate or non-IEEE division: {divisions}"
    ftz = sorted({f"{op}{mods}.{ty}" for op, mods, ty in ops if ".ftz" in mods})
    assert not ftz, f"flush-to-zero float instructions: {ftz}"


def _resources(entry: dict) -> dict:
    """Registers, stack and spill bytes of a compiled case: the ptxas log's figures, checked against the cubin's."""
    usage, cubin = entry["ptxas"], entry["res_usage"]
    if isinstance(cubin, str):
        pytest.fail(cubin, pytrace=False)
    if usage is None:
        pytest.fail("no ptxas -v log captured for this case (TRITON_DUMP_PTXAS_LOG): the capture is stale")
    assert usage["registers"] == cubin["registers"], f"ptxas log {usage} does not match the cubin {cubin}"
    assert usage["stack_frame"] == cubin["stack"], f"ptxas log {usage} does not match the cubin {cubin}"
    return usage


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_no_register_spills(compiled, case):
    """Nothing spills to local memory: 0 bytes of spill stores and loads, and no stack frame at all (the kernels
    have no local arrays and call nothing that needs one), whatever the tile shape ``launch_shape`` picks."""
    entry = _case(compiled, case_id(case))
    usage = _resources(entry)
    shape = f"BLOCKS={entry['constexprs']['BLOCKS']}, num_warps={entry['num_warps']}"
    assert (usage["spill_stores"], usage["spill_loads"], usage["stack_frame"]) == (0, 0, 0), (
        f"register spills ({shape}): {usage}"
    )


@pytest.mark.parametrize("case", ROTATION_CASES, ids=ROTATION_IDS)
def test_rotation_compiles_exactly(compiled, case):
    """The rotation's kernel compiles for sm_90 as launched, with only the spec's operations: the exact widening of a
    bfloat16 or float16 input, correctly rounded float32 additions and subtractions (and, inverse only,
    multiplications by ``1 / size``), no contraction, no division, no flush-to-zero; and it does not spill."""
    out, _ = compiled
    cid = case_id(case)
    entry = _case(compiled, cid)
    assert entry["kernel"] == "_hadamard_kernel" and entry["enable_fp_fusion"] is False
    assert entry["constexprs"]["SIZE"] == case["size"] and entry["constexprs"]["INVERSE"] == case["inverse"]
    ops = {f"{op}{mods}.{ty}" for op, mods, ty in _float_ops((out / f"{cid}.ptx").read_text())}
    expected = {"add.rn.f32", "sub.rn.f32"} | ({"mul.rn.f32"} if case["inverse"] else set())
    widening = {"float32": set(), "bfloat16": {"cvt.f32.bf16"}, "float16": {"cvt.f32.f16"}}
    widening = widening[case.get("dtype", "float32")]
    assert expected <= ops <= expected | widening | {"selp.f32", "mov.f32"}, f"float instructions {sorted(ops)}"
    usage = _resources(entry)
    assert (usage["spill_stores"], usage["spill_loads"], usage["stack_frame"]) == (0, 0, 0), usage


def _print_report(result: dict) -> None:
    """Registers and spills per case of a compile summary."""
    print(f"{'case':58} {'BLOCKS':>6} {'warps':>5} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8}")
    for cid, entry in result["cases"].items():
        if "error" in entry:
            print(f"{cid:58} did not compile")
            continue
        u, c = entry["ptxas"] or {}, entry["res_usage"]
        c = c if isinstance(c, dict) else {}
        print(f"{cid:58} {entry['constexprs']['BLOCKS']:>6} {entry['num_warps']:>5} {c.get('registers', '?'):>4} "
              f"{c.get('stack', '?'):>5} {u.get('spill_stores', '?'):>8} {u.get('spill_loads', '?'):>8}")


def main(argv: list[str]) -> int:
    """``--report``: compile every case into a temporary folder and print registers and spills per case;
    ``OUT_DIR``: compile every case into ``OUT_DIR`` (``<case id>.ptx`` / ``.cubin`` and ``result.json``)."""
    from zeropp.quant._triton import aot

    if argv != ["--report"]:
        result = aot.compile_in_subprocess(ALL_CASES, Path(argv[0]))
        print(result.get("skip", f"{len(result['cases'])} cases compiled into {argv[0]}"))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        result = aot.compile_in_subprocess(ALL_CASES, Path(tmp))
    if "skip" in result:
        print(result["skip"])
    else:
        _print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
