"""Test-wide set-up.

Without a GPU the Triton kernels run under Triton's interpreter, which must be switched on before ``triton`` is
first imported. With it on, ``zeropp.quant`` would send CPU tensors to the (slow) interpreted kernels, so tests
pick the backend explicitly with ``ZEROPP_QUANT_BACKEND`` (see the ``quant_backend`` fixture), and multi-process
tests pass ``worker_quant_backend()`` to their workers unless they mean to run a backend: the native CPU library where
it loads and no GPU is there (bit-exact to the torch reference and a fraction of its CPU time), else the reference.

The native CPU library (``build/libzeropp_cpu.so``, made by ``setup.sh``) is tested where it is built; where it is
not, its tests are skipped with the reason, unless ``ZEROPP_REQUIRE_NATIVE=1`` (set by ``.ci/run``) makes that a
failure. The native CUDA kernels (``build/zeropp_cuda.fatbin``, launched through CuPy) are tested where they can
run; on a machine with a CUDA device ``ZEROPP_REQUIRE_NATIVE=1`` makes a missing fatbin or CuPy a failure too.

Work that a late fixture needs and that depends on nothing else (the sm_90 compilations of ``tests/quant``) starts in
the background when collection ends, at low priority (``ahead.py``).
"""

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import ahead  # noqa: E402
from zeropp.quant import native, native_cuda  # noqa: E402


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background jobs (``ahead.py``) of the fixtures the collected tests use (none when only collecting).
    Not in a pytest-xdist worker: each worker collects every test but runs only some, and the other workers keep the
    CPU busy anyway, so a fixture there starts its own job when it asks."""
    if not session.config.option.collectonly and "PYTEST_XDIST_WORKER" not in os.environ:
        ahead.start_needed(session.items)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """In a pytest-xdist worker: the files whose fixture runs a job of ``ahead.py`` first (every worker collects the
    same order, as xdist requires)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        ahead.registered_first(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under pytest-xdist (``-n``; the README's test command runs 2 workers) each test file runs whole on one worker,
    so a module-scoped fixture (one multi-rank launch that a file's tests share) runs once."""
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the background jobs that still run and remove their folders."""
    ahead.stop_all()


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where the Triton kernels run: the GPU when there is one, else the CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def worker_quant_backend() -> str:
    """``ZEROPP_QUANT_BACKEND`` for the processes a test starts when it does not mean to test a backend: ``native``
    on a machine without CUDA where the native CPU library loads (tests/quant holds it bit-exact to the torch
    reference), else ``torch`` (never the Triton interpreter, which ``TRITON_INTERPRET=1`` would pick for CPU tensors,
    and never a native CUDA build a GPU machine may lack). Measured on the 2-core box against ``torch``, alone:
    tests/engine/test_combos.py + test_zeropp.py 9-13% less CPU, the world-4 launch of test_partition.py ~4 CPU-s
    (6%) more, the convergence harness and the HF trainer's FSDP2 tests the same."""
    return "native" if not torch.cuda.is_available() and native.available() else "torch"


def native_library(path: str | None = None) -> native.Library:
    """The native CPU library at ``path`` (default: the one ``zeropp.quant`` loads); skips the test, naming what
    is missing, when it does not load (fails instead under ``ZEROPP_REQUIRE_NATIVE=1``)."""
    try:
        return native.Library(path) if path else native.library()
    except native.NativeLibraryError as e:
        if os.environ.get("ZEROPP_REQUIRE_NATIVE") == "1":
            pytest.fail(f"ZEROPP_REQUIRE_NATIVE=1 but the native CPU library does not load: {e}")
        pytest.skip(f"native CPU library not built: {e}")


def native_cuda_module() -> native_cuda.Module:
    """The native CUDA kernels (the fatbin ``zeropp.quant`` loads); skips the test, naming what is missing (a CUDA
    device, CuPy, the fatbin), when they cannot run; fails instead under ``ZEROPP_REQUIRE_NATIVE=1`` on a machine
    with a CUDA device."""
    try:
        return native_cuda.library()
    except native_cuda.NativeCudaError as e:
        if os.environ.get("ZEROPP_REQUIRE_NATIVE") == "1" and torch.cuda.is_available():
            pytest.fail(f"ZEROPP_REQUIRE_NATIVE=1 but the native CUDA kernels cannot run: {e}")
        pytest.skip(f"native CUDA kernels cannot run: {e}")


@functools.cache
def _interpreter_fma_rounds_once() -> bool:
    """Whether Triton's interpreter computes ``tl.fma`` with one rounding, as the GPU's FMA does: (1 + 2^-12)^2 - 1
    is 2^-11 + 2^-24 exactly, 2^-11 when the product is rounded first."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(x_ptr, z_ptr, out_ptr):
        x = tl.load(x_ptr)
        tl.store(out_ptr, tl.fma(x, x, tl.load(z_ptr)))

    out = torch.empty(1)
    fma_kernel[(1,)](torch.tensor([1 + 2.0**-12]), torch.tensor([-1.0]), out)
    return out.item() == 2.0**-11 + 2.0**-24


def exact_triton(device: str) -> str:
    """``device``, for a test of the Triton kernels' bits; skips the test under a Triton interpreter whose ``tl.fma``
    rounds twice (triton 3.8 and older compute ``x * y + z`` in float32: torch 2.11 to 2.14 bring them), since the
    kernels' exact arithmetic rests on the one rounding of the GPU's FMA (triton 3.9's interpreter has it)."""
    if device == "cpu" and not _interpreter_fma_rounds_once():
        import triton

        pytest.skip(f"triton {triton.__version__}'s interpreter rounds tl.fma twice: the kernels' bits are checked "
                    "on a GPU, or on the CPU under triton 3.9 or newer")
    return device


@pytest.fixture(params=["torch", "triton", "native"])
def quant_backend(request, monkeypatch, kernel_device) -> str:
    """Run a test once per backend of ``zeropp.quant``; yields the device to put tensors on."""
    if request.param == "native":
        native_library()
    if request.param == "triton":
        exact_triton(kernel_device)
    if request.param == "triton" and kernel_device == "cuda":
        # CUDA tensors run Triton by default; forcing it would also send the CPU tensors a test builds its
        # expectations from to Triton, which runs them only under the interpreter
        monkeypatch.delenv("ZEROPP_QUANT_BACKEND", raising=False)
    else:
        monkeypatch.setenv("ZEROPP_QUANT_BACKEND", request.param)
    return kernel_device if request.param == "triton" else "cpu"
