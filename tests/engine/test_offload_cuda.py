"""The offload tiers on a GPU (run when a CUDA device is present): the optimizer's side on the host (``cpu``, page-
locked) and in swap files (``nvme``), the compute shards on the device, the host-device copies on the way; the same
training as without offload.

Without offload the masters live on the GPU and torch's fused CUDA Adam steps them; offloaded, the CPU steps them
(``zeropp.optim.native``, torch's fused CPU arithmetic). Bit-identity between the two therefore also asks that torch's
CUDA and CPU fused steps round alike: if this test fails on the masters while the losses of the first step agree,
that is where to look (issue 21 note).

On an H100 (torch 2.11, bf16, 2026-11-27) the losses agreed and the masters did not: up to 2.8e-5 apart in
``wte.weight`` after 3 steps, about 1% of one step's update and 3250 times what rounding of the Adam step explains.
The suspicion: the two steps round a master apart by an ulp, that flips the rounding of a bf16 compute weight (an
ulp of bf16 is 2^-8 of it), and the next gradient differs there. So the test runs fp32 too, where the GPU's masters
must lie within ``2 eps (|w| + 4 lr)`` per step of the host's (a rounding of the weight and of the update; a wrong
update, of the order of ``lr``, is 10^5 times that), and in bf16 asks that of 99% of the elements and ``lr`` per step
of every one. The two host tiers (the same CPU arithmetic) must agree bit for bit in both. Neither case has run on a
GPU in this form yet.
"""

from __future__ import annotations

import pytest
import torch
from engine_launch import launch

RUNS = {
    "none": {},
    "cpu": {"offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "{nvme}", "pin_memory": True,
                                   "pipeline_read": True, "pipeline_write": True}},
}
STEPS = 3  # cuda_tiers' default
LR = 3e-3  # offload_workers._config's AdamW


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offloaded_training_on_a_gpu_matches(tmp_path, dtype) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    res = launch("offload_workers:cuda_tiers", 1, tmp_path, timeout=600, runs=RUNS, nvme=str(nvme), steps=STEPS,
                 dtype=dtype)[0]
    assert res["none"]["placed"] == {"master": "cuda:0", "grad_shard": "cuda:0", "shard": "cuda:0", "pinned": False}
    for name in ("cpu", "nvme"):
        assert res[name]["placed"] == {"master": "cpu", "grad_shard": "cpu", "shard": "cuda:0", "pinned": True}, name
    assert res["nvme"]["losses"] == res["cpu"]["losses"]
    for key, want in res["cpu"]["masters"].items():
        assert torch.equal(res["nvme"]["masters"][key], want), ("nvme", key)
    eps = torch.finfo(torch.float32).eps
    for key, gpu in res["none"]["masters"].items():
        diff = (res["cpu"]["masters"][key] - gpu).abs()
        ratio = diff / (2 * STEPS * eps * (gpu.abs() + 4 * LR))
        within = (ratio <= 1).float().mean().item()
        print(f"{dtype} {key}: max |cpu - gpu| = {diff.max().item():.3g}, {within:.4f} of the elements within the bound")
        if dtype == "fp32":
            assert within == 1, (key, ratio.max().item())
        else:
            assert within >= 0.99 and diff.max().item() <= STEPS * LR, (key, within, diff.max().item())
    if dtype == "fp32":
        assert max(abs(a - b) for a, b in zip(res["cpu"]["losses"], res["none"]["losses"])) <= 1e-5
    else:
        assert res["cpu"]["losses"] == res["none"]["losses"]
