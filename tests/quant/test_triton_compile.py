"""The Triton kernels compiled for a real GPU (sm_90, to PTX and cubin), with no GPU needed.

Without a GPU the other kernel tests run under Triton's interpreter, which does not enforce the type and shape
rules of the compiler nor know which operations its code generator lacks, so a kernel can pass every interpreted
test and still not compile on a GPU. Here each kernel is compiled ahead of time for ``sm_90`` (Triton's LLVM and
the ``ptxas`` in the triton wheel need no GPU), specialized exactly as its launcher would specialize it. Trial
breakages that the interpreted tests all passed and these tests caught: an ``if`` whose branches leave a value
bf16 in one and float32 in the other (compile error for bf16/fp16 input only), ``/`` for ``tl.math.div_rn``
(``div.full.f32``), and a launcher without ``enable_fp_fusion=False``.

How: ``triton.jit`` picks the interpreter when ``triton`` is imported and ``conftest.py`` switches it on in this
process, so the compilation runs in a subprocess (this file run as a script) with ``TRITON_INTERPRET`` and
``ZEROPP_QUANT_BACKEND`` removed from its environment. There the real launchers (``quantize_chunks``, ...) are
called on ``meta`` tensors (shapes, dtypes and alignments without memory, so sizes past 2**31 cost nothing) with
each launched ``@triton.jit`` kernel swapped for a stand-in that hands the launch's arguments, constexprs and
options (``num_warps``, ``enable_fp_fusion``) to ``JITFunction.warmup``: Triton's own specialization turns them
into the signature and attributes a GPU launch would get, and ``triton.compile`` builds the kernel for the target
that a minimal stand-in driver reports. Nothing about the launch is restated here, so a launcher change is
compiled as it is.

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

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

TARGET = ("cuda", 90, 32)  # backend, compute capability, warp size: an H100
WORKER_TIMEOUT_S = 900

# The specializations compiled, one launcher call each. Sizes are elements (numel, chunk_numel, out_numel) and
# pick the integer specializations as on a GPU: multiples of 16 get Triton's divisibility hint, others do not,
# 1 becomes a constant, 2**31 and above is int64. ``offset`` (elements) misaligns the float tensor's pointer;
# ``one_pack`` is the ONE_PACK the launcher is expected to choose, so the cover of both values is checked.
# Between them the cases give every (op, bits) each dtype, and each of block sizes 16, DEFAULT_BLOCK_SIZE and
# 2048 with ONE_PACK True and False; GROUPS of the reductions are 1, 2, 4 and 8. Block size 8192 (the largest)
# is the one tile of more than 4096 elements: one block per program and 8 warps. The register-pressure cases
# (odd sizes, so nothing is vectorized and every thread holds every row of a block-128 tile, across packs) include
# ones that spilled before ``launch_shape`` bounded the rows per thread: blocks 32, 64 and 128 over several packs,
# and ``blocks_per_pack == 1`` (a constant to Triton). Packs shorter than a tile need no case of their own: the
# pack arithmetic (``divmod_from``) has no branch, so they run the same kernel as long packs.
_BIG = 5 * 2**30 + 3  # past int32: exercises the int64 offsets
CASES: list[dict] = [
    # quantize: x (dtype) -> chunked packs; ONE_PACK iff chunks == 1
    dict(op="quantize", bits=8, block_size=16, dtype="float32", numel=2**20, chunks=1, nodes=1, one_pack=True),
    dict(op="quantize", bits=8, block_size=16, dtype="bfloat16", numel=1_000_003, chunks=8, nodes=2, one_pack=False),
    dict(op="quantize", bits=8, block_size="default", dtype="bfloat16", numel=2**24, chunks=1, nodes=1, one_pack=True),
    dict(op="quantize", bits=8, block_size="default", dtype="float16", numel=2**24 + 1, chunks=16, nodes=2,
         one_pack=False),
    dict(op="quantize", bits=8, block_size=2048, dtype="float16", numel=12345, chunks=1, nodes=1, one_pack=True,
         offset=1),
    dict(op="quantize", bits=8, block_size=2048, dtype="float32", numel=2**22, chunks=4, nodes=1, one_pack=False),
    dict(op="quantize", bits=4, block_size=16, dtype="bfloat16", numel=4097, chunks=1, nodes=1, one_pack=True),
    dict(op="quantize", bits=4, block_size=16, dtype="float16", numel=2**20, chunks=4, nodes=4, one_pack=False),
    dict(op="quantize", bits=4, block_size="default", dtype="float16", numel=2**20, chunks=1, nodes=1,
         one_pack=True),
    dict(op="quantize", bits=4, block_size="default", dtype="float32", numel=_BIG, chunks=2, nodes=2,
         one_pack=False),
    dict(op="quantize", bits=4, block_size=2048, dtype="float32", numel=2**20, chunks=1, nodes=1, one_pack=True),
    dict(op="quantize", bits=4, block_size=2048, dtype="bfloat16", numel=999_999, chunks=8, nodes=2,
         one_pack=False, offset=3),
    dict(op="quantize", bits=8, block_size=8192, dtype="bfloat16", numel=2**20, chunks=2, nodes=2, one_pack=False),
    dict(op="quantize", bits=8, block_size=64, dtype="bfloat16", numel=100_003, chunks=4, nodes=2, one_pack=False),
    dict(op="quantize", bits=4, block_size=32, dtype="float16", numel=100_003, chunks=8, nodes=2, one_pack=False),
    # dequantize: chunked packs -> out (dtype); ONE_PACK iff out lies in the first pack
    dict(op="dequantize", bits=8, block_size=16, dtype="float32", chunks=1, chunk_numel=2**20, out_numel=2**20,
         one_pack=True),
    dict(op="dequantize", bits=8, block_size="default", dtype="bfloat16", chunks=8, chunk_numel=131_072,
         out_numel=1_000_000, one_pack=False),
    dict(op="dequantize", bits=8, block_size=2048, dtype="float16", chunks=4, chunk_numel=_BIG, out_numel=_BIG - 7,
         one_pack=True, offset=1),
    dict(op="dequantize", bits=4, block_size=16, dtype="bfloat16", chunks=4, chunk_numel=1001, out_numel=4001,
         one_pack=False),
    dict(op="dequantize", bits=4, block_size="default", dtype="float16", chunks=1, chunk_numel=2**24,
         out_numel=2**24, one_pack=True),
    dict(op="dequantize", bits=4, block_size=2048, dtype="float32", chunks=16, chunk_numel=2**20,
         out_numel=2**24, one_pack=False),
    dict(op="dequantize", bits=4, block_size=2048, dtype="bfloat16", chunks=2, chunk_numel=2**20,
         out_numel=2**20, one_pack=True, offset=5),
    dict(op="dequantize", bits=4, block_size=8192, dtype="float16", chunks=1, chunk_numel=2**20, out_numel=2**20,
         one_pack=True),
    dict(op="dequantize", bits=4, block_size="default", dtype="bfloat16", chunks=4, chunk_numel=100_001,
         out_numel=400_001, one_pack=False),
    dict(op="dequantize", bits=8, block_size=2048, dtype="float32", chunks=3, chunk_numel=1001, out_numel=3000,
         one_pack=False),
    # reduce_requantize: groups runs of chunks packs -> chunks packs; ONE_PACK iff chunks == 1
    dict(op="reduce_requantize", bits=8, block_size=16, groups=2, chunks=1, chunk_numel=2**20, one_pack=True),
    dict(op="reduce_requantize", bits=8, block_size="default", groups=8, chunks=4, chunk_numel=2**20,
         one_pack=False),
    dict(op="reduce_requantize", bits=8, block_size=2048, groups=1, chunks=2, chunk_numel=_BIG, one_pack=False),
    dict(op="reduce_requantize", bits=4, block_size=16, groups=8, chunks=2, chunk_numel=1001, one_pack=False),
    dict(op="reduce_requantize", bits=4, block_size="default", groups=4, chunks=1, chunk_numel=2**24,
         one_pack=True),
    dict(op="reduce_requantize", bits=4, block_size=2048, groups=2, chunks=8, chunk_numel=2**20, one_pack=False),
    dict(op="reduce_requantize", bits=4, block_size=8192, groups=2, chunks=2, chunk_numel=2**20, one_pack=False),
    dict(op="reduce_requantize", bits=4, block_size="default", groups=8, chunks=2, chunk_numel=100_001,
         one_pack=False),
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
]
KERNELS = {
    "quantize": "_quantize_kernel",
    "dequantize": "_dequantize_kernel",
    "reduce_requantize": "_reduce_requantize_kernel",
    "reduce_dequantize": "_reduce_dequantize_kernel",
}
# Ops whose kernels divide in float32 (block scale absmax / qmax and v / scale; the final reduce's divisor).
DIVIDING_OPS = {"quantize", "reduce_requantize", "reduce_dequantize"}


def case_id(case: dict) -> str:
    parts = [case["op"], f"int{case['bits']}", f"bs{case['block_size']}"]
    parts += [case[k] for k in ("dtype",) if k in case]
    parts += [f"{k}{case[k]}" for k in ("groups", "chunks") if k in case]
    parts += ["i64"] if _BIG in (case.get("numel"), case.get("chunk_numel")) else []
    parts += [f"off{case['offset']}"] if case.get("offset") else []
    return "-".join(map(str, parts))


IDS = [case_id(c) for c in CASES]
assert len(set(IDS)) == len(IDS), "case ids must be unique"


# --------------------------------------------------------------------------------------------------------------
# The subprocess: compile every case, write PTX, cubin and a summary under the output folder.


def _launch_case(case: dict) -> None:
    """Call the launcher of ``case["op"]`` on meta tensors of the case's sizes."""
    import torch

    from zeropp.quant import DEFAULT_BLOCK_SIZE, BlockFormat
    from zeropp.quant import _triton as kernels

    def meta(numel: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        # A view at ``offset`` elements: data_ptr() is offset * itemsize, which is what alignment is judged on.
        return torch.empty(numel + offset, device="meta", dtype=dtype)[offset:]

    bs = DEFAULT_BLOCK_SIZE if case["block_size"] == "default" else case["block_size"]
    fmt = BlockFormat(case["bits"], bs)
    dtype = getattr(torch, case.get("dtype", "float32"))
    offset = case.get("offset", 0)
    u8 = torch.uint8
    op = case["op"]
    if op == "quantize":
        numel, chunks = case["numel"], case["chunks"]
        x = meta(numel, dtype, offset)
        kernels.quantize_chunks(x, fmt, chunks, case["nodes"], meta(fmt.chunked_bytes(numel, chunks), u8))
    elif op == "dequantize":
        chunks, chunk_numel = case["chunks"], case["chunk_numel"]
        buf = meta(chunks * fmt.packed_bytes(chunk_numel), u8)
        kernels.dequantize_chunks(buf, fmt, chunks, chunk_numel, meta(case["out_numel"], dtype, offset))
    elif op == "reduce_requantize":
        groups, chunks, chunk_numel = case["groups"], case["chunks"], case["chunk_numel"]
        pack = fmt.packed_bytes(chunk_numel)
        kernels.reduce_requantize(meta(groups * chunks * pack, u8), fmt, groups, chunks, chunk_numel,
                                  meta(chunks * pack, u8))
    elif op == "reduce_dequantize":
        groups, chunk_numel = case["groups"], case["chunk_numel"]
        buf = meta(groups * fmt.packed_bytes(chunk_numel), u8)
        kernels.reduce_dequantize(buf, fmt, groups, chunk_numel, meta(case["out_numel"], dtype, offset),
                                  case["divisor"])
    else:
        raise ValueError(f"unknown op {op!r}")


def _toolchain_problem(target) -> str | None:
    """Why Triton cannot compile for ``target`` on this machine, or None."""
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        return f"the installed triton {triton.__version__} has no NVIDIA backend"
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:  # another triton: no look-up to ask first, a missing ptxas fails the compilation loudly
        return None
    try:
        get_ptxas(target.arch)  # triton's own look-up: $TRITON_PTXAS[_BLACKWELL]_PATH, then the wheel's binary
    except RuntimeError as e:
        return f"{e}, the ptxas triton runs for sm_{target.arch} (it ships in triton/backends/nvidia/bin)"
    return None


_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def _ptxas_usage(log: str, kernel: str) -> dict | None:
    """Registers, stack frame and spill bytes of ``kernel`` from the ``ptxas -v`` log, or None without a log."""
    start = log.find(f"Compiling entry function '{kernel}'")
    if start < 0:
        return None
    spills, regs = _PTXAS_SPILLS.search(log, start), _PTXAS_REGS.search(log, start)
    if not spills or not regs:
        return None
    frame, stores, loads = map(int, spills.groups())
    return {"registers": int(regs.group(1)), "stack_frame": frame, "spill_stores": stores, "spill_loads": loads}


def _res_usage(cubin: Path, kernel: str) -> dict | str:
    """``REG`` and ``STACK`` of ``kernel`` as ``cuobjdump -res-usage`` reads them off the cubin, or why not."""
    try:
        from triton import knobs

        tool = knobs.nvidia.cuobjdump.path  # the wheel's triton/backends/nvidia/bin/cuobjdump, or $TRITON_..._PATH
    except Exception as e:  # noqa: BLE001 - another triton: reported by the spill test
        return f"no cuobjdump: {e!r}"
    proc = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=False)
    found = re.search(rf"Function {re.escape(kernel)}:\s*\n\s*REG:(\d+) STACK:(\d+)", proc.stdout)
    if proc.returncode != 0 or not found:
        return f"cuobjdump -res-usage failed (exit {proc.returncode}): {proc.stdout[-500:]}{proc.stderr[-500:]}"
    return {"registers": int(found.group(1)), "stack": int(found.group(2))}


def _compile_all(out_dir: Path) -> dict:
    assert "TRITON_INTERPRET" not in os.environ, "the compile subprocess must not run under the interpreter"
    import importlib
    import inspect
    import pkgutil

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    target = GPUTarget(*TARGET)
    problem = _toolchain_problem(target)
    if problem:
        return {"skip": f"cannot compile Triton kernels for sm_{target.arch} here: {problem}"}

    class CompileOnlyDriver:
        """Just what ``JITFunction.warmup`` asks of a driver: the target to compile for, a device and a stream."""

        def get_current_target(self):
            return target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    # The kernels the launchers launch: jitted functions of the package's modules that are subscripted with a grid
    # or handed to ``common.launch``.
    import zeropp.quant._triton as package

    launched = {}  # name -> (module, JITFunction)
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        source = inspect.getsource(module)
        for name, obj in vars(module).items():
            launches = f"{name}[" in source or re.search(rf"\blaunch\(\s*{name}\b", source)
            if isinstance(obj, JITFunction) and obj.module == module.__name__ and launches:
                launched[name] = (module, obj)

    compiled: list = []

    class CompileOnLaunch:
        """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` compiles it as that launch would, no more."""

        def __init__(self, fn: JITFunction):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                log = io.StringIO()  # triton prints the ptxas -v log of each compilation (TRITON_DUMP_PTXAS_LOG)
                with contextlib.redirect_stdout(log):
                    kernel = self.fn.warmup(*args, grid=grid, **kwargs)
                compiled.append((self.fn.__name__, kernel, kwargs, log.getvalue()))

            return launch

    driver.set_active(CompileOnlyDriver())
    for module, fn in launched.values():
        setattr(module, fn.__name__, CompileOnLaunch(fn))

    results = {}
    usage_by_hash = {}  # a kernel Triton already compiled is not compiled (nor logged) again
    for case in CASES:
        cid = case_id(case)
        del compiled[:]
        try:
            _launch_case(case)
            if len(compiled) != 1:
                raise AssertionError(f"expected one kernel launch, got {[c[0] for c in compiled]}")
            name, kernel, kwargs, ptxas_log = compiled[0]
            (out_dir / f"{cid}.ptx").write_text(kernel.asm["ptx"])
            (out_dir / f"{cid}.cubin").write_bytes(kernel.asm["cubin"])
            src = kernel.src
            names = list(src.signature)
            results[cid] = {
                "kernel": name,
                "signature": dict(src.signature),
                "constexprs": {names[path[0]]: value for path, value in src.constants.items() if len(path) == 1},
                "launch_kwargs": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, bool))},
                "num_warps": kernel.metadata.num_warps,
                "enable_fp_fusion": kernel.metadata.enable_fp_fusion,
                "target": [kernel.metadata.target.backend, kernel.metadata.target.arch],
                "ptxas": usage_by_hash.setdefault(kernel.hash, _ptxas_usage(ptxas_log, name)),
                "res_usage": _res_usage(out_dir / f"{cid}.cubin", name),
            }
        except Exception:  # noqa: BLE001 - reported by that case's tests, the other cases still compile
            results[cid] = {"error": traceback.format_exc(limit=-6)}
    return {"triton": triton.__version__, "launched": sorted(launched), "cases": results}


def _worker_main(out_dir: str) -> int:
    out = Path(out_dir)
    (out / "result.json").write_text(json.dumps(_compile_all(out), indent=1, default=str))
    return 0


# --------------------------------------------------------------------------------------------------------------
# The tests.


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, dict]:
    """Run the compile subprocess once; the folder with ``<case id>.ptx`` / ``.cubin`` and the summary."""
    pytest.importorskip("triton", reason="triton is not installed (it is a dependency on Linux only)")
    out = tmp_path_factory.mktemp("triton_sm90")
    import zeropp

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ZEROPP_QUANT_BACKEND")}
    env["TRITON_CACHE_DIR"] = str(out / "triton_cache")  # a fresh cache: really compile, leave ~/.triton alone
    env["TRITON_HOME"] = str(out / "triton_home")
    env["TRITON_DUMP_PTXAS_LOG"] = "1"  # triton prints each ptxas -v log: registers and spills
    repo_root = str(Path(zeropp.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(out)],
        env=env,
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=False,
        timeout=WORKER_TIMEOUT_S,
    )
    if proc.returncode != 0 or not (out / "result.json").exists():
        output = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        pytest.fail(f"the compile subprocess failed (exit {proc.returncode}):\n{output}")
    result = json.loads((out / "result.json").read_text())
    if "skip" in result:
        pytest.skip(result["skip"])
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
        assert {c["bits"] for c in cases} == {8, 4}
        assert {c["block_size"] for c in cases} >= {16, "default", 2048, 8192}
        if op != "reduce_requantize":
            assert {c["dtype"] for c in cases} == {"float32", "bfloat16", "float16"}
        if op != "reduce_dequantize":
            assert {c["one_pack"] for c in cases} == {True, False}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_compiles_for_sm90_as_launched(compiled, case):
    """The kernel compiles to a cubin for sm_90, with the launcher's constexprs and options."""
    from zeropp.quant import DEFAULT_BLOCK_SIZE
    from zeropp.quant._triton.common import launch_shape

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
    shape = launch_shape(case["op"], block_size)
    constexprs = entry["constexprs"]
    assert constexprs["BLOCK_SIZE"] == block_size and constexprs["BITS"] == case["bits"]
    assert constexprs["BLOCKS"] == shape.blocks_per_program
    assert entry["num_warps"] == shape.num_warps
    if "groups" in case:
        assert constexprs["GROUPS"] == case["groups"]
    if "one_pack" in case:
        assert constexprs["ONE_PACK"] == case["one_pack"]
    ptr = "x_ptr" if case["op"] == "quantize" else "out_ptr"
    dtype = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}[case.get("dtype", "float32")]
    assert entry["signature"][ptr] == ("*u8" if case["op"] == "reduce_requantize" else dtype)
    if _BIG in (case.get("numel"), case.get("chunk_numel")):
        assert "i64" in entry["signature"].values()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_no_float_contraction(compiled, case):
    """No FMA: ``code * scale + acc`` (and every other product and sum) is rounded twice, as in the reference.

    Off in the options (which also runs ``ptxas --fmad=false``), no ``fma``/``mad`` in the PTX, and every float
    add/sub/mul carries ``.rn``: LLVM writes the bare ``mul.f32``/``add.f32``, which ptxas may fuse, when it is
    allowed to contract.
    """
    out, _ = compiled
    cid = case_id(case)
    entry = _case(compiled, cid)
    assert entry["enable_fp_fusion"] is False
    assert entry["launch_kwargs"].get("enable_fp_fusion") is False
    ops = _float_ops((out / f"{cid}.ptx").read_text())
    assert ops, "no floating-point instructions found: the PTX pattern is stale"
    fused = sorted({f"{op}{mods}.{ty}" for op, mods, ty in ops if op in ("fma", "mad")})
    assert not fused, f"fused multiply-adds in the PTX: {fused}"
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
    if case["op"] in DIVIDING_OPS:
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


def _report() -> int:
    """Compile every case into a temporary folder and print registers and spills per case."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ZEROPP_QUANT_BACKEND")}
        env.update(TRITON_CACHE_DIR=f"{tmp}/triton_cache", TRITON_HOME=f"{tmp}/triton_home", TRITON_DUMP_PTXAS_LOG="1")
        repo_root = str(Path(__file__).resolve().parents[2])  # this checkout's zeropp, not an installed one
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), tmp], env=env, check=True)
        result = json.loads((Path(tmp) / "result.json").read_text())
    if "skip" in result:
        print(result["skip"])
        return 0
    print(f"{'case':58} {'BLOCKS':>6} {'warps':>5} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8}")
    for cid, entry in result["cases"].items():
        if "error" in entry:
            print(f"{cid:58} did not compile")
            continue
        u, c = entry["ptxas"] or {}, entry["res_usage"]
        c = c if isinstance(c, dict) else {}
        print(f"{cid:58} {entry['constexprs']['BLOCKS']:>6} {entry['num_warps']:>5} {c.get('registers', '?'):>4} "
              f"{c.get('stack', '?'):>5} {u.get('spill_stores', '?'):>8} {u.get('spill_loads', '?'):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(_report() if sys.argv[1:] == ["--report"] else _worker_main(sys.argv[1]))
