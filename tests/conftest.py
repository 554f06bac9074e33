"""Test-wide set-up.

Without a GPU the Triton kernels run under Triton's interpreter, which must be switched on before ``triton`` is
first imported. With it on, ``zeropp.quant`` would send CPU tensors to the (slow) interpreted kernels, so tests
pick the backend explicitly with ``ZEROPP_QUANT_BACKEND`` (see the ``quant_backend`` fixture), and multi-process
tests pass ``ZEROPP_QUANT_BACKEND=torch`` to their workers unless they mean to run the kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where the Triton kernels run: the GPU when there is one, else the CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"])
def quant_backend(request, monkeypatch, kernel_device) -> str:
    """Run a test once per backend of ``zeropp.quant``; yields the device to put tensors on."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", request.param)
    return kernel_device if request.param == "triton" else "cpu"
