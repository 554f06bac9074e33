"""The engine's optimizer step waits for the device exactly once (issue 9, part 4; issue 12, part 1): the fp16
overflow check, the fp32/bf16 non-finite gradient check and gradient clipping are one device-side computation over
all units with one all-reduce (a float64 vector: the squared norm and a flag per unit), and the host reads that
vector once per step in every precision, to skip the step or not. The fp32/bf16 read is deliberate, new with the
non-finite check (before it those steps read nothing and an Inf/NaN gradient silently destroyed the weights); the
clipping coefficient stays on the device and the norm is read when ``get_global_grad_norm()`` asks. Counted on CPU by
``sync_workers.HostSyncCounter`` (the calls of zeropp's code that would wait for a GPU) on 2 gloo ranks, several
units (root + 2 blocks); on a GPU also with ``torch.cuda.set_sync_debug_mode`` at one rank.
"""

from __future__ import annotations

import pytest
import torch
from engine_launch import launch

ALL = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
RUNS = {
    "fp16-clip-stage3-qwz-qgz": {"stage": 3, "fp16": True, "clip": 0.5, "zero": ALL},
    "fp16-stage2": {"stage": 2, "fp16": True},
    "fp32-clip-stage1": {"stage": 1, "clip": 0.5},
    "bf16-clip-stage3": {"stage": 3, "bf16": True, "clip": 0.5},
    "fp32-stage2-qgz": {"stage": 2, "zero": {"zero_quantized_gradients": True}},
}


def _check(results, runs):
    for res in results:
        for name, run in runs.items():
            r = res[name]
            assert r["units"] >= 3, (name, r["units"])
            for i, calls in enumerate(r["step"]):  # the read of the all-reduced flags (and squared norm), in step()
                if i == 0:  # the first step also makes each distinct collective call's one-time agreement check
                    calls = [c for c in calls if not c.startswith("zeropp/comm/checks.py")]
                assert len(calls) == 1 and calls[0].startswith("zeropp/engine/engine.py:"), (name, i, calls)
                assert calls[0].endswith(" tolist"), (name, i, calls)
            if run.get("clip"):
                assert r["norm"] is not None and r["norm"] > 0, (name, r["norm"])


def test_one_host_read_per_step(tmp_path):
    results = launch("sync_workers:count_step_syncs", 2, tmp_path, timeout=180, runs=RUNS)
    _check(results, RUNS)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_step_synchronizes_once(tmp_path):
    results = launch("sync_workers:count_step_syncs", 1, tmp_path, timeout=300, runs=RUNS, device="cuda")
    _check(results, RUNS)
    for name, run in RUNS.items():
        for syncs in results[0][name]["cuda_step"]:
            assert len(syncs) == 1, (name, syncs)
