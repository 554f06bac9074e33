"""Installing as users install: a wheel built from this checkout by ``pip`` (scikit-build-core running
CMakeLists.txt, as ``pip install .`` and ``python -m build`` do) carries the native CPU library, and zeropp installed
from it runs its CPU quantization natively.

The wheel is built without build isolation (the test venv's scikit-build-core, cmake and C++ compiler; no download)
and without the CUDA fatbin (``ZEROPP_CUDA=OFF``: nvcc, where there is one, would add about a minute; the fatbin goes
into the wheel by the same install rule where nvcc is). It is installed with no dependencies into a fresh venv that
sees the test venv's packages (torch, numpy) only after its own, and a script run there (outside the checkout)
checks that zeropp comes from the wheel, that CPU tensors take the native backend, loaded from the wheel's
``zeropp/_native/``, and that its quantized bytes equal the torch reference's on fresh random input.

Without a C++ compiler (``CXX`` naming none) the wheel still builds, without the library: zeropp installed from it
runs the torch reference and warns once, saying so; so does a compiler whose compiles fail (the build is retried
without CMake). Under ``ZEROPP_REQUIRE_NATIVE=1`` both builds fail instead.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
LIBRARY = "zeropp/_native/libzeropp_cpu.so"

CHECK = """
import json, os, sys, warnings
import torch
import zeropp
from zeropp.quant import BlockFormat, backend_name, native, quantize_chunks

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backend = backend_name(torch.zeros(1))
x = torch.randn(5000, generator=torch.Generator().manual_seed(int(sys.argv[1]))).to(torch.bfloat16)
fmt = BlockFormat(4, 128)
out = quantize_chunks(x, fmt, 3)
os.environ["ZEROPP_QUANT_BACKEND"] = "torch"
same = torch.equal(out, quantize_chunks(x, fmt, 3))
print(json.dumps({"zeropp": zeropp.__file__, "backend": backend, "library": str(native.library_path()),
                  "same_bytes": same, "warnings": [str(w.message) for w in caught]}))
"""


def build_wheel(out: Path, args: Sequence[str] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``pip wheel`` of this checkout into ``out``, without build isolation, dependencies or the CUDA fatbin, with
    more pip ``args``, and ``ZEROPP_REQUIRE_NATIVE`` off (CI sets it) unless ``env`` sets it."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "--quiet",
         "-C", "cmake.define.ZEROPP_CUDA=OFF", *args, "-w", str(out), str(CHECKOUT)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "ZEROPP_REQUIRE_NATIVE": "0", **(env or {})})


def install_and_check(wheel: Path, root: Path) -> dict:
    """Install ``wheel`` into a fresh venv under ``root`` that sees this interpreter's packages after its own; run
    ``CHECK`` there (from ``root``, so the checkout is not on its path) and return what it prints."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    # a path line in a .pth file adds that folder without running its own .pth files (this venv's editable zeropp)
    (Path(venv_site) / "test_venv_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--quiet", str(wheel)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROPP_NATIVE_LIB", "ZEROPP_QUANT_BACKEND",
                                                            "TRITON_INTERPRET", "PYTHONPATH")}
    run = subprocess.run([str(python), "-c", CHECK, str(int.from_bytes(os.urandom(4), "little"))], cwd=root,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(result["zeropp"]).is_relative_to(venv), result
    return result


def needs_build_tools() -> None:
    """Skips (fails under ``ZEROPP_REQUIRE_NATIVE=1``) where the wheel cannot be built here, naming what is missing."""
    missing = [name for name, found in (("a C++ compiler", shutil.which("c++") or shutil.which("g++")),
                                        ("cmake", shutil.which("cmake") or (Path(sys.prefix) / "bin/cmake").exists()))
               if not found]
    try:
        import scikit_build_core  # noqa: F401
    except ImportError:
        missing.append("scikit-build-core (the test extra)")
    if missing:
        message = f"building a wheel here needs {', '.join(missing)}"
        if os.environ.get("ZEROPP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"ZEROPP_REQUIRE_NATIVE=1 but {message}")
        pytest.skip(message)


def test_wheel_installs_the_native_library(tmp_path: Path) -> None:
    needs_build_tools()
    built = build_wheel(tmp_path / "dist")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("zeropp-*.whl")
    assert LIBRARY in zipfile.ZipFile(wheel).namelist()
    result = install_and_check(wheel, tmp_path)
    assert result["backend"] == "native", result
    assert Path(result["library"]) == Path(result["zeropp"]).parent / "_native" / "libzeropp_cpu.so", result
    assert result["same_bytes"], result
    assert result["warnings"] == [], result


def test_wheel_without_a_compiler(tmp_path: Path) -> None:
    """No C++ compiler: CMake builds nothing and warns; a compiler whose every compile fails: scikit-build-core's
    retry without CMake (pyproject.toml's override). Either way zeropp installs without the library, unless
    ``ZEROPP_REQUIRE_NATIVE=1``."""
    needs_build_tools()
    no_compiler = {"CXX": str(tmp_path / "no-such-c++")}
    built = build_wheel(tmp_path / "dist", env=no_compiler)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("zeropp-*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "_native" in n]
    result = install_and_check(wheel, tmp_path)
    assert result["backend"] == "torch", result
    assert result["same_bytes"], result
    assert len(result["warnings"]) == 1 and "does not exist" in result["warnings"][0], result
    assert "torch reference" in result["warnings"][0], result

    broken = ["-C", "cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=false"]  # each compile runs `false g++ ...`
    retried = build_wheel(tmp_path / "dist-broken", broken)
    assert retried.returncode == 0, retried.stdout[-3000:] + retried.stderr[-3000:]
    (wheel,) = (tmp_path / "dist-broken").glob("zeropp-*.whl")
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "_native" in n]

    for args, env, message in (([], no_compiler, "ZEROPP_REQUIRE_NATIVE=1 but no C++ compiler"),
                               (broken, {}, "CMake build failed")):
        required = build_wheel(tmp_path / "dist-required", args, env={**env, "ZEROPP_REQUIRE_NATIVE": "1"})
        assert required.returncode != 0
        assert message in " ".join((required.stdout + required.stderr).split())
