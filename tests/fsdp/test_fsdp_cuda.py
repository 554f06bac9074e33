"""zeropp.fsdp on a device against plain FSDP2 on CPU (see ``fsdp_device_workers.py``): 4 gloo ranks as 2
emulated nodes of 2; exact comms match the reference, qwZ int8 + qgZ int4 + hpZ trains within 2% of it, and the
byte counters are the same on CPU and on the device.

``test_cuda_matches_cpu_reference`` puts every rank on ``cuda:0`` (FSDP2 on a CUDA mesh over the gloo default
group: NCCL refuses two ranks on one GPU) with the Triton kernels; it needs a GPU. ``test_cpu_runs_the_same_checks``
runs the same worker on CPU tensors with the workers' default backend (conftest.worker_quant_backend), so the
test's own logic runs in CI (a few seconds).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fsdp_device_workers import STEPS
from conftest import worker_quant_backend
from fsdp_launch import launch

WORLD = 4
ENV = {"ZEROPP_RANKS_PER_NODE": "2"}
RUNS = ("plain_cpu", "exact_cpu", "zeropp_hpz_cpu")


def _check_results(results: list[dict], device: str, backend: str) -> None:
    """What the worker returns after its own checks passed: every run trained, on the device asked for."""
    assert len(results) == WORLD
    for r in results:
        assert r["backend"] == backend and r["param_device"].startswith(device), r
        assert set(r["losses"]) == {*RUNS, f"exact_{device}", f"zeropp_hpz_{device}"}, r["losses"]
        assert all(len(losses) == STEPS for losses in r["losses"].values()), r["losses"]
        assert r["moved"] > 0  # the comparisons cover real updates
        for name in ("exact", "zeropp_hpz"):
            stats = r["stats"][f"{name}_{device}"]
            assert stats["all_gather"]["calls"] > 0 and stats["reduce_scatter"]["calls"] > 0, stats


def test_cpu_runs_the_same_checks(tmp_path):
    results = launch("fsdp_device_workers:device_vs_reference", WORLD, tmp_path, env=ENV, timeout=120,
                     device="cpu")
    _check_results(results, "cpu", worker_quant_backend())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_cuda_matches_cpu_reference(tmp_path):
    # TRITON_INTERPRET must be off: the device runs use the compiled kernels ("auto": Triton on CUDA tensors)
    env = {**ENV, "ZEROPP_QUANT_BACKEND": "auto", "TRITON_INTERPRET": "0"}
    results = launch("fsdp_device_workers:device_vs_reference", WORLD, tmp_path, env=env, timeout=300,
                     device="cuda")
    _check_results(results, "cuda", "triton")
