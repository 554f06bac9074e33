"""Compile the launchers' kernels ahead of time for a GPU target, with no GPU needed.

Used by ``tests/quant/test_triton_compile.py`` (the compiler's rules checked on PTX and cubin) and by
``bench/cost_model.py`` (instructions counted on the SASS). A *case* is a dict naming one launcher call:
``op`` (``quantize``, ``dequantize``, ``reduce_requantize``, ``reduce_dequantize``), ``bits``, ``block_size``
(an int, or ``"default"`` for ``DEFAULT_BLOCK_SIZE``) and the sizes that op takes, in elements: ``numel``,
``chunks`` and ``nodes`` (quantize; ``nodes > 1`` is the qgZ swizzle with ``chunks // nodes`` ranks per node),
``chunks``, ``chunk_numel`` and ``out_numel`` (dequantize), ``groups``, ``chunks`` and ``chunk_numel``
(reduce_requantize), ``groups``, ``chunk_numel``, ``out_numel`` and ``divisor`` (reduce_dequantize); optionally
``dtype`` (the float tensor's, a ``torch`` dtype name, default ``float32``), ``offset`` (elements that misalign
the float tensor's pointer), ``seed`` (stochastic rounding: quantize, reduce_requantize), ``out_bits`` and
``out_block_size`` (reduce_requantize's output format, default the input's) and ``rotation`` (quantize and
reduce_dequantize with the Hadamard rotation of that size fused: ``quantize_chunks_rotated``,
``reduce_dequantize_rotated``) and ``add`` (dequantize added into ``out``: ``dequantize_add_chunks``).

How: ``triton.jit`` picks the interpreter when ``triton`` is imported, so the compilation runs in a fresh process
(``compile_in_subprocess`` starts ``python -m zeropp.quant._triton.aot``) with ``TRITON_INTERPRET`` and
``ZEROPP_QUANT_BACKEND`` removed from its environment. There the real launchers are called on ``meta`` tensors
(shapes, dtypes and alignments without memory, so sizes past 2**31 cost nothing) with each launched
``@triton.jit`` kernel swapped for a stand-in that hands the launch's arguments, constexprs and options
(``num_warps``, ``enable_fp_fusion``) to ``JITFunction.warmup``: Triton's own specialization turns them into the
signature and attributes a GPU launch would get, and ``triton.compile`` builds the kernel for the target that a
minimal stand-in driver reports. Nothing about the launch is restated here, so a launcher change is compiled as
it is. Each case must launch exactly one kernel.

Per case ``<id>.ptx`` and ``<id>.cubin`` are written into the output folder, and the summary (returned, and
written to ``result.json`` there) holds the kernel's name, signature, constexprs, grid, options and resources:
the ``ptxas -v`` log's registers and spills (Triton prints it when ``TRITON_DUMP_PTXAS_LOG`` is set) and
``cuobjdump -res-usage``'s registers and stack, read off the cubin itself. If the toolchain cannot run here (no
NVIDIA backend in triton, no ``ptxas``), the summary is ``{"skip": why}`` instead.

A ``rotation`` case (the block Hadamard rotation, ``zeropp.quant.rotation``) names ``size``, ``inverse`` and
``numel`` instead of a format, and optionally ``dtype`` and ``offset``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TARGET = ("cuda", 90, 32)
"""Backend, compute capability and warp size compiled for: an H100."""

SUBPROCESS_TIMEOUT_S = 900
"""Limit on one ``compile_in_subprocess`` run, seconds."""

SUBPROCESS_ENV_DROPPED = ("TRITON_INTERPRET", "ZEROPP_QUANT_BACKEND")
"""Variables removed from the compile process's environment: the interpreter, and a forced torch backend."""


def tool_path(name: str) -> str:
    """Path of the NVIDIA tool ``name`` (``cuobjdump``, ``nvdisasm``): the one Triton uses (``$TRITON_<NAME>_PATH``,
    else the triton wheel's ``triton/backends/nvidia/bin``), falling back to the CUDA toolkit's on ``PATH`` or in
    ``$CUDA_HOME/bin``. Raises ``FileNotFoundError``, saying where it looked, when there is none."""
    import shutil

    try:
        from triton import knobs

        return getattr(knobs.nvidia, name).path
    except Exception:  # noqa: BLE001 - a triton without knobs, or without the tool: the toolkit's, if any
        pass
    cuda_bin = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin"
    found = shutil.which(name) or shutil.which(name, path=str(cuda_bin))
    if found is None:
        raise FileNotFoundError(f"no {name}: not in the triton wheel (triton.knobs.nvidia), on PATH or in {cuda_bin}")
    return found


def toolchain_problem() -> str | None:
    """Why Triton cannot compile for ``TARGET`` on this machine, or None."""
    import triton
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        return f"the installed triton {triton.__version__} has no NVIDIA backend"
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:  # another triton: no look-up to ask first, a missing ptxas fails the compilation loudly
        return None
    try:
        get_ptxas(TARGET[1])  # triton's own look-up: $TRITON_PTXAS[_BLACKWELL]_PATH, then the wheel's binary
    except RuntimeError as e:
        return f"{e}, the ptxas triton runs for sm_{TARGET[1]} (it ships in triton/backends/nvidia/bin)"
    return None


_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def ptxas_usage(log: str, kernel: str) -> dict | None:
    """Registers and spill bytes of ``kernel`` from a ``ptxas -v`` log, or None if the log has no entry for it."""
    start = log.find(f"Compiling entry function '{kernel}'")
    if start < 0:
        return None
    spills, regs = _PTXAS_SPILLS.search(log, start), _PTXAS_REGS.search(log, start)
    if not spills or not regs:
        return None
    frame, stores, loads = map(int, spills.groups())
    return {"registers": int(regs.group(1)), "stack_frame": frame, "spill_stores": stores, "spill_loads": loads}


def res_usage(cubin: Path, kernel: str) -> dict | str:
    """``REG`` and ``STACK`` of ``kernel`` as ``cuobjdump -res-usage`` reads them off ``cubin``, or why not."""
    try:
        tool = tool_path("cuobjdump")
    except FileNotFoundError as e:
        return str(e)
    proc = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True, text=True, check=False)
    found = re.search(rf"Function {re.escape(kernel)}:\s*\n\s*REG:(\d+) STACK:(\d+)", proc.stdout)
    if proc.returncode != 0 or not found:
        return f"cuobjdump -res-usage failed (exit {proc.returncode}): {proc.stdout[-500:]}{proc.stderr[-500:]}"
    return {"registers": int(found.group(1)), "stack": int(found.group(2))}


def launch_case(case: Mapping[str, Any]) -> None:
    """Call the launcher of ``case["op"]`` on meta tensors of the case's sizes (see the module's docstring)."""
    import torch

    from zeropp.quant import DEFAULT_BLOCK_SIZE, BlockFormat
    from zeropp.quant import _triton as kernels

    def meta(numel: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        # A view at ``offset`` elements: data_ptr() is offset * itemsize, which is what alignment is judged on.
        return torch.empty(numel + offset, device="meta", dtype=dtype)[offset:]

    if case["op"] == "rotation":
        from zeropp.quant import rotated_numel

        numel, size = case["numel"], case["size"]
        x = meta(numel, getattr(torch, case.get("dtype", "float32")), case.get("offset", 0))
        kernels.hadamard(x, size, case["inverse"], meta(rotated_numel(numel, size), torch.float32))
        return

    bs = DEFAULT_BLOCK_SIZE if case["block_size"] == "default" else case["block_size"]
    fmt = BlockFormat(case["bits"], bs)
    dtype = getattr(torch, case.get("dtype", "float32"))
    offset = case.get("offset", 0)
    u8 = torch.uint8
    op = case["op"]
    seed = case.get("seed")
    if op == "quantize":
        numel, chunks = case["numel"], case["chunks"]
        x = meta(numel, dtype, offset)
        out = meta(fmt.chunked_bytes(numel, chunks), u8)
        if "rotation" in case:
            kernels.quantize_chunks_rotated(x, fmt, chunks, case["nodes"], case["rotation"], out, seed)
        else:
            kernels.quantize_chunks(x, fmt, chunks, case["nodes"], out, seed)
    elif op == "dequantize":
        chunks, chunk_numel = case["chunks"], case["chunk_numel"]
        buf = meta(chunks * fmt.packed_bytes(chunk_numel), u8)
        launcher = kernels.dequantize_add_chunks if case.get("add") else kernels.dequantize_chunks
        launcher(buf, fmt, chunks, chunk_numel, meta(case["out_numel"], dtype, offset))
    elif op == "reduce_requantize":
        groups, chunks, chunk_numel = case["groups"], case["chunks"], case["chunk_numel"]
        out_fmt = BlockFormat(case.get("out_bits", fmt.bits), case.get("out_block_size", bs))
        kernels.reduce_requantize(meta(groups * chunks * fmt.packed_bytes(chunk_numel), u8), fmt, groups, chunks,
                                  chunk_numel, meta(chunks * out_fmt.packed_bytes(chunk_numel), u8), out_fmt, seed)
    elif op == "reduce_dequantize":
        groups, chunk_numel = case["groups"], case["chunk_numel"]
        buf = meta(groups * fmt.packed_bytes(chunk_numel), u8)
        out = meta(case["out_numel"], dtype, offset)
        if "rotation" in case:
            kernels.reduce_dequantize_rotated(buf, fmt, groups, chunk_numel, case["rotation"], out, case["divisor"])
        else:
            kernels.reduce_dequantize(buf, fmt, groups, chunk_numel, out, case["divisor"])
    else:
        raise ValueError(f"unknown op {op!r}")


def compile_cases(cases: Mapping[str, Mapping[str, Any]], out_dir: Path) -> dict:
    """Compile each case (id -> case) for ``TARGET``; write ``<id>.ptx`` / ``<id>.cubin`` under ``out_dir`` and
    return the summary that ``result.json`` holds. Runs only in a process where triton is not interpreting."""
    assert "TRITON_INTERPRET" not in os.environ, "the compile process must not run under the interpreter"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    problem = toolchain_problem()
    if problem:
        return {"skip": f"cannot compile Triton kernels for sm_{TARGET[1]} here: {problem}"}
    target = GPUTarget(*TARGET)

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
    package = importlib.import_module(__package__)
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
                compiled.append((self.fn.__name__, kernel, grid, kwargs, log.getvalue()))

            return launch

    driver.set_active(CompileOnlyDriver())
    for module, fn in launched.values():
        setattr(module, fn.__name__, CompileOnLaunch(fn))

    results = {}
    usage_by_hash = {}  # a kernel Triton already compiled is not compiled (nor logged) again
    for cid, case in cases.items():
        del compiled[:]
        try:
            launch_case(case)
            if len(compiled) != 1:
                raise AssertionError(f"expected one kernel launch, got {[c[0] for c in compiled]}")
            name, kernel, grid, kwargs, ptxas_log = compiled[0]
            (out_dir / f"{cid}.ptx").write_text(kernel.asm["ptx"])
            (out_dir / f"{cid}.cubin").write_bytes(kernel.asm["cubin"])
            src = kernel.src
            names = list(src.signature)
            results[cid] = {
                "kernel": name,
                "signature": dict(src.signature),
                "constexprs": {names[path[0]]: value for path, value in src.constants.items() if len(path) == 1},
                "grid": [int(g) for g in grid] if isinstance(grid, (tuple, list)) else None,
                "launch_kwargs": {k: v for k, v in kwargs.items() if isinstance(v, (int, float, bool))},
                "num_warps": kernel.metadata.num_warps,
                "enable_fp_fusion": kernel.metadata.enable_fp_fusion,
                "target": [kernel.metadata.target.backend, kernel.metadata.target.arch],
                "ptxas": usage_by_hash.setdefault(kernel.hash, ptxas_usage(ptxas_log, name)),
                "res_usage": res_usage(out_dir / f"{cid}.cubin", name),
            }
        except Exception:  # noqa: BLE001 - reported by that case's users, the other cases still compile
            results[cid] = {"error": traceback.format_exc(limit=-6)}
    return {"triton": triton.__version__, "launched": sorted(launched), "cases": results}


class CompileProcessError(RuntimeError):
    """The compile process failed as a whole (not one case): its exit status and the end of its output."""


def compile_in_subprocess(
    cases: Mapping[str, Mapping[str, Any]], out_dir: Path, jobs: int = 1, timeout_s: float = SUBPROCESS_TIMEOUT_S
) -> dict:
    """Run ``compile_cases(cases, out_dir)`` in fresh Python processes (``jobs`` of them at once, each compiling
    every ``jobs``-th case) and return the summary.

    The processes import the ``zeropp`` that this process imported (its checkout goes first on ``PYTHONPATH``), run
    with a fresh Triton cache under ``out_dir`` (so they really compile and leave ``~/.triton`` alone) and with the
    ptxas log on. Raises ``CompileProcessError`` if one fails or writes no summary.
    """
    import zeropp

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    repo_root = str(Path(zeropp.__file__).resolve().parent.parent)
    items = list(cases.items())
    jobs = max(1, min(jobs, len(items)))
    deadline = time.monotonic() + timeout_s
    procs = []
    for job in range(jobs):
        (out_dir / f"cases-{job}.json").write_text(json.dumps(dict(items[job::jobs]), indent=1))
        env = {k: v for k, v in os.environ.items() if k not in SUBPROCESS_ENV_DROPPED}
        env["TRITON_CACHE_DIR"] = str(out_dir / f"triton_cache-{job}")
        env["TRITON_HOME"] = str(out_dir / f"triton_home-{job}")
        env["TRITON_DUMP_PTXAS_LOG"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", __name__, str(out_dir / f"cases-{job}.json"), str(out_dir),
                str(out_dir / f"result-{job}.json")]
        with open(out_dir / f"log-{job}.txt", "w") as log:
            procs.append(subprocess.Popen(argv, env=env, cwd=repo_root, stdout=log, stderr=subprocess.STDOUT))
    failures, results = [], []
    for job, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        summary = out_dir / f"result-{job}.json"
        if proc.returncode != 0 or not summary.exists():
            log = (out_dir / f"log-{job}.txt").read_text()[-8000:]
            failures.append(f"the compile process {job} of {jobs} failed (exit {proc.returncode}):\n{log}")
        else:
            results.append(json.loads(summary.read_text()))
    if failures:
        raise CompileProcessError("\n".join(failures))
    skipped = [r for r in results if "skip" in r]
    if skipped:
        merged = skipped[0]
    else:
        merged = {**results[0], "cases": {cid: case for r in results for cid, case in r["cases"].items()}}
    (out_dir / "result.json").write_text(json.dumps(merged, indent=1, default=str))
    return merged


def main(argv: list[str]) -> int:
    """``python -m zeropp.quant._triton.aot CASES.json OUT_DIR SUMMARY.json``: compile the cases (id -> case) into
    ``OUT_DIR`` and write the summary."""
    cases_file, out_dir, summary = map(Path, argv)
    result = compile_cases(json.loads(cases_file.read_text()), out_dir)
    summary.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
