"""The CUDA C++ kernels (``kernels/cuda/quant.cu``) compiled for real GPUs (sm_80 and sm_90), with no GPU needed.

Without a GPU the CUDA kernels cannot run here (``test_kernels.py`` skips them), but nvcc compiles them, and what
their bit-for-bit agreement with ``zeropp.quant.reference`` and their speed rely on can be read off the cubin:

* every kernel that ``zeropp.quant.native_cuda`` launches is in it, under its extern "C" name (and nothing else is:
  a kernel no launcher calls is dead code), with the ABI version symbol the loader checks;
* no kernel spills registers or has a stack frame (``ptxas -v``: 0 bytes stack frame, spill stores and loads): a
  kernel at the memory wall must not move its values through local memory;
* every float operation of the PTX is correctly rounded (``.rn``: nothing ptxas may contract into an FMA, no
  approximate division) and none flushes subnormals (no ``.ftz``): the spec keeps subnormal values and scales;
* nor does the SASS ptxas makes of it (no ``.FTZ`` in the kernels' code). NVIDIA's correctly rounded division slow
  paths (``__cuda_*_slowpath`` subroutines, entered for operands at the ends of the range) use ``.FTZ`` on operands
  they have scaled away from the subnormal range and are exempt; so is ``F2I...TRUNC`` (float to integer,
  truncating: a subnormal truncates to 0 whether flushed or not), which nvcc uses inside integer divisions.

The kernels are compiled with the flags ``CMakeLists.txt`` builds the fatbin with (its ``ZEROPP_CUDA_FLAGS``
line, read by ``native_cuda.cuda_flags``), so a change there is tested as it is. Skipped, naming what is missing,
without nvcc (or without cuobjdump / nvdisasm, which come with the CUDA toolkit or the triton wheel).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from zeropp.quant import native_cuda

SOURCE = native_cuda.SOURCE
ARCHS = (90, 80)


def tool(name: str) -> str:
    """Path of ``name`` (nvcc, cuobjdump, nvdisasm): on PATH, beside nvcc, or in the triton wheel; skips if none."""
    nvcc = shutil.which("nvcc")
    found = shutil.which(name) or (nvcc and shutil.which(name, path=str(Path(nvcc).resolve().parent)))
    if not found and name != "nvcc":
        try:
            from zeropp.quant._triton.aot import tool_path

            found = tool_path(name)
        except (ImportError, FileNotFoundError):
            found = None
    if not found:
        where = "on PATH" if name == "nvcc" else "on PATH, beside nvcc or in the triton wheel"
        pytest.skip(f"{name} not found {where} (it comes with the CUDA toolkit)")
    return found


@pytest.fixture(scope="module", params=ARCHS, ids=lambda arch: f"sm_{arch}")
def compiled(request, tmp_path_factory) -> tuple[Path, str, str]:
    """``(cubin, ptxas log, PTX)`` of quant.cu compiled for ``sm_<arch>`` with the project's flags; nvcc must not
    warn."""
    arch = request.param
    folder = tmp_path_factory.mktemp(f"sm_{arch}")
    outputs = {}
    for kind, extra in (("cubin", ["-Xptxas", "-v"]), ("ptx", [])):
        path = folder / f"quant.{kind}"
        result = subprocess.run(
            [tool("nvcc"), f"-{kind}", *native_cuda.cuda_flags(), *extra, f"-arch=sm_{arch}", "-o", str(path),
             str(SOURCE)],
            capture_output=True, text=True, timeout=300, check=False,
        )
        assert result.returncode == 0, f"nvcc -{kind} failed:\n{result.stderr}"
        warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
        assert not warnings, "nvcc warned:\n" + "\n".join(warnings)
        outputs[kind] = (path, result.stderr)
    return outputs["cubin"][0], outputs["cubin"][1], outputs["ptx"][0].read_text()


def test_cuda_flags_are_read_from_the_cmake_line(tmp_path):
    """``native_cuda.cuda_flags`` returns the words of the ``set(ZEROPP_CUDA_FLAGS ...)`` line, and says so when the
    line or the file is missing."""
    lists = tmp_path / "CMakeLists.txt"
    lists.write_text("project(x)\nset(ZEROPP_CUDA_FLAGS -O2 -fmad=false  -std=c++17)\nset(OTHER -g)\n")
    assert native_cuda.cuda_flags(lists) == ["-O2", "-fmad=false", "-std=c++17"]
    lists.write_text("project(x)\n")
    with pytest.raises(ValueError, match="no set\\(ZEROPP_CUDA_FLAGS"):
        native_cuda.cuda_flags(lists)
    with pytest.raises(FileNotFoundError, match="source checkout"):
        native_cuda.cuda_flags(tmp_path / "missing.txt")
    assert "-fmad=false" in native_cuda.cuda_flags()  # the project's own line: exactness needs it


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_\d+'")
_USAGE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def ptxas_usage(log: str) -> dict[str, dict[str, int]]:
    """Per kernel: registers, stack frame and spill bytes from a ``ptxas -v`` log."""
    usage = {}
    for match in _ENTRY.finditer(log):
        spills, registers = _USAGE.search(log, match.end()), _REGISTERS.search(log, match.end())
        frame, stores, loads = map(int, spills.groups())
        usage[match.group(1)] = dict(registers=int(registers.group(1)), stack=frame, spill_stores=stores,
                                     spill_loads=loads)
    return usage


def test_kernels_are_the_launched_ones(compiled):
    """The cubin's entry functions are exactly ``native_cuda.KERNEL_NAMES``, and the ABI version is there."""
    cubin, log, _ = compiled
    symbols = subprocess.run([tool("cuobjdump"), "-symbols", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    entries = set(re.findall(r"STO_ENTRY\s+(\w+)", symbols))
    assert entries == set(native_cuda.KERNEL_NAMES)
    assert set(ptxas_usage(log)) == entries
    assert re.search(r"\bzeropp_cuda_abi_version\b", symbols)


def test_no_spills_no_stack(compiled):
    """0 bytes of stack frame and of spill stores and loads in every kernel."""
    _, log, _ = compiled
    usage = ptxas_usage(log)
    assert usage
    spilling = {name: u for name, u in usage.items() if u["stack"] or u["spill_stores"] or u["spill_loads"]}
    assert not spilling


def sass_by_function(cubin: Path) -> dict[str, list[str]]:
    """The SASS instructions of each function of ``cubin`` (kernels and their subroutines), from nvdisasm."""
    listing = subprocess.run([tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    functions: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        label = re.match(r"^([$\w.]+):\s*$", line)
        if label and not label.group(1).startswith(".L") and not label.group(1).startswith(".text"):
            current = functions.setdefault(label.group(1), [])
        elif current is not None and re.match(r"^\s+/\*[0-9a-f]{4,}\*/", line):
            current.append(line.split("*/", 1)[1].strip())
    return functions


def test_ptx_rounds_every_float_operation(compiled):
    """Every float add, sub, mul, fma, division and reciprocal of the PTX is ``.rn``; nothing is ``.ftz``."""
    _, _, ptx = compiled
    assert "div.rn.f32" in ptx and "fma.rn.f32" in ptx
    assert not re.findall(r"\b(?:add|sub|mul|fma|div|rcp|sqrt)\.(?!rn\.)[\w.]*\bf(?:32|64)\b", ptx)
    assert ".ftz" not in ptx


def test_no_flush_to_zero(compiled):
    """No ``.FTZ`` float operation in the kernels' own SASS (see the module docstring for the exemptions)."""
    cubin, _, _ = compiled
    functions = sass_by_function(cubin)
    assert set(native_cuda.KERNEL_NAMES) <= set(functions)
    flushing = {}
    for name, instructions in functions.items():
        if re.search(r"__cuda_\w+_slowpath", name):
            continue
        bad = [i for i in instructions if ".FTZ" in i and not re.match(r"(@!?U?P\w+\s+)?F2I\.\S*TRUNC", i)]
        if bad:
            flushing[name] = bad[:3]
    assert not flushing
