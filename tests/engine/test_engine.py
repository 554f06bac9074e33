"""The ZeRO engine on real gloo processes against plain single-process training (see engine_workers.py).

Four launched jobs keep the suite short: the training comparison at world sizes 1, 2 and 4 (4 as 2 emulated nodes of
2 ranks; 1, where every unit's shard is its whole buffer, takes the single-rank shortcuts), and one job for bad
usage, bad configs at initialize, a module called twice (with an unused parameter) and activation checkpointing.
"""

from __future__ import annotations

import pytest
from engine_launch import launch

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}
RUNS = [
    {"stage": 1, "micro": 2},
    {"stage": 1, "micro": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1,
                                                                       "adam_w_mode": False}}},
    {"stage": 2, "micro": 2, "accum": 2, "clip": 0.5},
    {"stage": 2, "micro": 1, "accum": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                                                                   "nesterov": True}}},
    {"stage": 3, "micro": 2, "accum": 2, "clip": 0.5, "frozen": ["wpe.weight"]},
    {"stage": 3, "micro": 1, "groups": "decay"},
    {"stage": 3, "micro": 1, "accum": 2, "policy": "nested"},  # LayerNorm units inside block units
]


@pytest.mark.parametrize(
    "world, env", [(1, {}), (2, {}), (4, {"ZEROPP_RANKS_PER_NODE": "2"})], ids=["world1", "world2", "world4-2nodes"]
)
def test_stages_match_single_process_training(tmp_path, world, env):
    results = launch("engine_workers:train_matches_reference", world, tmp_path, env=env, timeout=240, runs=RUNS)
    assert len(results[0]) == len(RUNS)
    for summary in results:
        for run, errors in summary.items():
            # the bar: parameters within 1e-5 relative after 10 steps (per tensor, in norm) ...
            assert errors["norm"] < 1e-5, (world, run, errors)
            # ... and no element far off either (Adam turns rounding differences of tiny gradients into larger
            # relative changes of single elements; measured up to 3e-5 of the tensor's largest value)
            assert errors["max"] < 1e-4, (world, run, errors)
            assert errors["logits"] < 1e-5, (world, run, errors)
    # every rank holds the same weights
    assert all(r == results[0] for r in results)


def test_usage_errors_module_called_twice_and_checkpointing(tmp_path):
    result = launch("engine_workers:misc", 2, tmp_path, timeout=240)[0]
    m = result["messages"]
    assert "both true" in m["bf16_and_fp16"]
    assert "torch.float16" in m["fp16_model_bf16_config"] and "bf16.enabled" in m["fp16_model_bf16_config"]
    assert "torch.bfloat16" in m["bf16_model_fp16_config"] and "fp16.enabled" in m["bf16_model_fp16_config"]
    assert "torch.float64" in m["fp64_model_bf16_config"] and "float32 model" in m["fp64_model_bf16_config"]
    assert "zero_hpz_partition_size=4" in m["hpz_divides"] and "ranks per node (2 here" in m["hpz_divides"]
    assert "set stage to 3" in m["hpz_stage"]
    assert "'fp61'" in m["unknown"] and "fp16" in m["unknown"]
    assert "no optimizer block" in m["no_optimizer"]
    assert "torch.bfloat16" in m["bf16_model"] and "neither bf16.enabled nor fp16.enabled" in m["bf16_model"]
    assert "initialize(optimizer=...) is not supported" in m["client_optimizer"]
    assert "'wpe.weight'" in m["missing_param"] and "requires_grad_(False)" in m["missing_param"]
    assert "without a forward" in m["backward_before_forward"]
    assert "without a forward" in m["backward_after_no_grad_forward"]
    assert "step() called without backward()" in m["step_without_backward"]
    assert "step() called without backward()" in m["step_twice"]
    assert "does not require grad" in m["loss_without_grad"]
    assert "twice without step()" in m["backward_twice"]
    assert "forward() after backward() without step()" in m["forward_before_step"]
    assert set(result["twice"]) == set(result["checkpointing"]) == {1, 2, 3, "3-hpz"}
    for stage, error in result["twice"].items():
        assert error < 1e-5, (stage, error)
    for stage, error in result["checkpointing"].items():
        assert error < 1e-5, (stage, error)
