"""The collectives on a device, bit for bit against the torch reference on CPU, with async calls interleaved and
waits from a side stream (see ``device_workers.py``): 4 gloo ranks as 2 emulated nodes of 2.

``test_cuda_matches_cpu_reference`` puts every rank on ``cuda:0`` (gloo on CUDA tensors of one GPU: NCCL refuses two
ranks on one GPU) with the Triton kernels; it needs a GPU. ``test_cpu_runs_the_same_checks`` runs the same worker on
CPU tensors with the torch backend, so the test's own logic runs in CI (a few seconds).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from comm_launch import launch

ENV = {"ZEROPP_RANKS_PER_NODE": "2"}


def test_cpu_runs_the_same_checks(tmp_path):
    results = launch("device_workers:device_vs_reference", 4, tmp_path, env=ENV, timeout=120, device="cpu",
                     backend="torch", scale=1)
    assert all(r["backend"] == "torch" and len(r["cases"]) == 12 and len(r["side"]) == 7 for r in results), results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_cuda_matches_cpu_reference(tmp_path):
    # TRITON_INTERPRET must be off: the device runs use the compiled kernels ("auto": Triton on CUDA tensors)
    env = {**ENV, "ZEROPP_QUANT_BACKEND": "auto", "TRITON_INTERPRET": "0"}
    results = launch("device_workers:device_vs_reference", 4, tmp_path, env=env, timeout=300, device="cuda",
                     backend="auto", scale=100)
    assert all(r["backend"] == "triton" for r in results), results
    # the side stream was still busy when the freed memory was refilled (else the side-stream part proves little)
    assert any(r["window_open"]["ag"] for r in results), (
        "the side stream had finished its all-gather waits before the fill on every rank: lengthen the busy work in "
        "device_workers.py",
        [r["window_open"] for r in results],
    )
