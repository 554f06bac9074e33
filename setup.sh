#!/usr/bin/env bash
# Set up zeropp in .venv (idempotent, no questions asked; quiet unless something goes wrong).
#
#   ./setup.sh            then use .venv/bin/python
#
# * .venv is made with --system-site-packages, so a GPU machine's own CUDA build of torch (and its triton) is
#   used as it is.
# * Where torch is missing, or it sees no CUDA device (no GPU, no driver, or a CPU build) and is not 2.13.0,
#   torch==2.13.0 is installed into .venv: on the CPU machines that release is a CPU build lying on disk (an
#   unpinned `torch` would pull a multi-GB CUDA build). A torch that sees a GPU is kept if it is in the range
#   pyproject.toml supports (outside it, the zeropp install below asks pip for one that is).
# * Then zeropp itself, editable, with its test, bench and docs extras (tests/test_docs.py builds the docs), without
#   its CMake build (SKBUILD_WHEEL_CMAKE=false: a `pip install .` builds kernels/ into the package's _native/ folder
#   with scikit-build-core; a checkout builds it here, into build/, where zeropp looks first in a checkout,
#   incrementally and with the test-only CPU builds).
# * Then the native kernels with CMake: the CPU library (kernels/cpu -> build/libzeropp_cpu.so) when a C++ compiler
#   is there (cmake from pip if none is installed; without it the torch reference runs on the CPU, and this says
#   so; ZEROPP_REQUIRE_NATIVE=1, set by CI, makes that an error), and the CUDA kernels (kernels/cuda ->
#   build/zeropp_cuda.fatbin, loaded through CuPy) where nvcc is (optional: a failed build only says so).
# A re-run with nothing changed checks a stamp and a few imports and returns in a second or two.
# PYTHON=/path/to/python3 picks the interpreter the venv is made from (3.10 or newer).
# ZEROPP_VENV=dir sets up that venv instead of .venv. ZEROPP_TORCH=X.Y[.Z] installs exactly torch==X.Y[.Z] there,
#   GPU or not, in a venv without system site-packages, with the pip configuration's constraints lifted for this
#   run's installs (this machine's pip caps torch at the releases lying on its disk); .ci/torch_version uses both.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$(pwd -P)
VENV=${ZEROPP_VENV:-.venv}
VPY=$VENV/bin/python
STAMP=$VENV/.zeropp-setup-stamp
TORCH_CPU_PIN=2.13.0
TORCH_PIN=${ZEROPP_TORCH:-}

say() { echo "setup.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }
# DS_BUILD_OPS=0: the deepspeed test extra builds none of DeepSpeed's C++/CUDA ops (zeropp.deepspeed replaces them)
pip_install() { DS_BUILD_OPS=0 "$VPY" -m pip install --quiet --disable-pip-version-check --no-input "$@"; }

# The native CPU library; incremental (a second or so when nothing changed).
build_native() {
    local cmake cxx
    cxx=$(command -v c++ || command -v g++ || command -v clang++ || true)
    cmake=$(command -v cmake || true)
    if [ -z "$cmake" ] && [ -x "$VENV/bin/cmake" ]; then
        cmake=$VENV/bin/cmake
    fi
    if [ -n "$cxx" ] && [ -z "$cmake" ]; then
        pip_install cmake && cmake=$VENV/bin/cmake
    fi
    if [ -z "$cxx" ] || [ -z "$cmake" ]; then
        native_missing "no C++ compiler or no cmake"
        return
    fi
    mkdir -p build
    local jobs
    jobs=$(nproc 2>/dev/null || echo 2)
    if ! { "$cmake" -S . -B build -DCMAKE_BUILD_TYPE=Release >build/setup.log 2>&1 \
        && "$cmake" --build build --target zeropp_cpu zeropp_cpu_avx2 zeropp_cpu_baseline -j "$jobs" \
            >>build/setup.log 2>&1; }; then
        tail -n 20 build/setup.log >&2
        # never leave a stale library to be loaded
        rm -f build/libzeropp_cpu.so build/libzeropp_cpu_avx2.so build/libzeropp_cpu_baseline.so
        native_missing "its build failed, log in build/setup.log"
        return
    fi
    # the CUDA fatbin (only where nvcc is): optional, CUDA tensors run the Triton kernels without it
    if ! "$cmake" --build build -j "$jobs" >>build/setup.log 2>&1; then
        rm -f build/zeropp_cuda.fatbin
        say "the CUDA kernels (build/zeropp_cuda.fatbin) did not build, log in build/setup.log: CUDA tensors use" \
            "the Triton kernels"
    fi
}

native_missing() {
    [ "${ZEROPP_REQUIRE_NATIVE:-}" != 1 ] || die "ZEROPP_REQUIRE_NATIVE=1 but the native CPU library was not built: $1"
    say "native CPU library not built ($1): CPU tensors use the torch reference (slower)"
}

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    PY=$(command -v python3 || command -v python || true)
fi
if [ -n "$TORCH_PIN" ]; then
    [[ "$TORCH_PIN" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] \
        || die "ZEROPP_TORCH=$TORCH_PIN is not a torch release; give one such as 2.15.0 or 2.15"
    # pip's --constraint from its configuration would hold torch back; the pin itself is passed to every install
    export PIP_CONSTRAINT=/dev/null
fi
[ -n "$PY" ] || die "no python3 found; install Python 3.10 or newer (or set PYTHON=/path/to/python3)"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || die "$PY is Python $("$PY" -c 'import platform; print(platform.python_version())'); zeropp needs 3.10 or newer"

# The stamp records what the last successful run installed for: this checkout, this pyproject.toml and torch pin.
stamp_value="$ROOT $(cksum < pyproject.toml | cut -d' ' -f1) $(cksum < setup.sh | cut -d' ' -f1) $TORCH_PIN"
if [ -x "$VPY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$stamp_value" ] \
    && "$VPY" - "$ROOT" 2>/dev/null <<'EOF'
import os, sys
import numpy, pytest, xdist, hypothesis, pytest_benchmark, scikit_build_core, torch, matplotlib, mkdocs, mkdocstrings  # noqa: F401
import zeropp
sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(zeropp.__file__))) != sys.argv[1])
EOF
then
    build_native
    exit 0
fi

if [ ! -x "$VPY" ] && [ -n "$TORCH_PIN" ]; then
    say "creating $VENV from $PY"
    "$PY" -m venv "$VENV" || die "could not create $VENV (is the venv module installed?)"
elif [ ! -x "$VPY" ]; then
    say "creating $VENV from $PY (with system site-packages)"
    "$PY" -m venv --system-site-packages "$VENV" || die "could not create $VENV (is the venv module installed?)"
fi

torch_version=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
torch_cuda=$("$VPY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

if [ -n "$TORCH_PIN" ]; then
    if [ "$torch_version" != "$TORCH_PIN" ] && [ "$torch_version" != "$TORCH_PIN.0" ]; then
        say "installing torch==$TORCH_PIN into $VENV${torch_version:+ (it has $torch_version)}"
        pip_install "torch==$TORCH_PIN" \
            || die "pip could not install torch==$TORCH_PIN (pip's message above): if it is no release for this" \
                "Python and platform, '$VPY -m pip index versions torch' lists those there are"
    fi
elif [ -z "$torch_version" ]; then
    say "torch is not importable: installing torch==$TORCH_CPU_PIN"
    pip_install "torch==$TORCH_CPU_PIN"
elif [ "$torch_cuda" != 1 ] && [ "$torch_version" != "$TORCH_CPU_PIN" ]; then
    # A GPU machine whose torch sees its GPU keeps that torch, if pyproject.toml's range admits it.
    say "torch $torch_version sees no CUDA device: installing torch==$TORCH_CPU_PIN into $VENV"
    pip_install "torch==$TORCH_CPU_PIN"
fi

export SKBUILD_WHEEL_CMAKE=false  # read by scikit-build-core only: the native build is build_native's
if [ -n "$TORCH_PIN" ]; then
    pip_install -e ".[test,bench,docs]" "torch==$TORCH_PIN" \
        || die "zeropp's dependencies do not install beside torch==$TORCH_PIN (pip's message above); if it is" \
            "outside the torch range in pyproject.toml, widen that range to try it"
else
    pip_install -e ".[test,bench,docs]"
fi

"$VPY" -c 'import zeropp, torch, numpy, pytest' || die "the installed environment does not import"
build_native
echo "$stamp_value" > "$STAMP"
say "ready: $("$VPY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")')"
