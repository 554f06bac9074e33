"""Checkpoints (issue 4): ``save_checkpoint`` / ``load_checkpoint`` with torch.distributed.checkpoint, the
consolidated state dict online and offline. One launch of 4 real gloo processes (``checkpoint_workers.all_checks``;
starting processes costs more than all the checks), 2 emulated nodes of 2 ranks (``ZEROPP_RANKS_PER_NODE=2``);
world size 2 is a subgroup of ranks 0 and 1 (its own ``Topology``).

* Resume (world 4): a run saved after 3 steps and resumed in a new engine built from a differently seeded model
  continues bit for bit like the uninterrupted run (losses, fp32 masters, optimizer state, qgZ residuals): stage 3
  with qwZ + hpZ + qgZ with error feedback and 2 accumulation steps; stage 3 qgZ with LoCo's 8-bit residuals and
  stochastic rounding (a fp32-residual checkpoint loads into it with its residuals left out); stage 2 exact in fp16
  with the loss scale moved off its initial value; stage 1 SGD with momentum and two parameter groups whose learning rate was changed
  by hand. The model has dropout 0.1, so this holds only with the RNG restored.
* Resharding: the stage-3 ZeRO++ checkpoint of world 4 (block-aligned layout) loads at world 2 into stage 1 exact
  (no alignment); that run's checkpoint loads back at world 4 into stage 3 ZeRO++. Masters and optimizer state are
  the saved ones exactly, and training goes on.
* Consolidated: ``consolidated_state_dict`` of an exact stage-3 run loads into a plain GPT (strict) and gives the
  logits of ``full_parameters``; the offline ``consolidate(dir)`` of each checkpoint equals the online dict.
* Errors: save in the middle of an accumulation window; a model of another width or depth (the parameter named);
  another optimizer; a missing tag, directory or ``latest``.
"""

from __future__ import annotations

import pytest
import torch
from engine_launch import launch

from zeropp.engine.checkpoint import consolidate

ENV4 = {"ZEROPP_RANKS_PER_NODE": "2"}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}}
RUNS = {
    # error feedback with qgZ's rotation: its residuals (in the rotated space) resume bit for bit too
    "zeropp": {"zero": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True,
                        "zeropp": {"error_feedback": True, "gradient_rotation": "hadamard"}}, "accum": 2},
    # LoCo's 8-bit residuals and stochastic rounding (seeded by the micro-step: restored, so the noise repeats)
    "loco-sr": {"zero": {"zero_quantized_gradients": True,
                         "zeropp": {"error_feedback": "loco", "gradient_stochastic_rounding": True}}},
    "stage2-fp16": {"stage": 2, "extra": FP16},
    "stage1-sgd-groups": {"stage": 1, "optimizer": SGD, "groups": True},
}
STAGE1 = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
          "zero_optimization": {"stage": 1}}
ZEROPP3 = {**STAGE1, "zero_optimization": {"stage": 3, **RUNS["zeropp"]["zero"]}}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (what, key)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkpoint")
    root = tmp / "ckpt"
    results = launch("checkpoint_workers:all_checks", 4, tmp, env=ENV4, timeout=300, root=str(root), runs=RUNS,
                     stage1=STAGE1, zeropp3=ZEROPP3)
    return root, results


def test_resume_is_bit_exact(job):
    root, results = job
    for rank, res in enumerate(results):
        for name, r in res["resume"].items():
            assert r["resumed_losses"] == r["losses"], (rank, name)  # every micro-batch of the rank, bit for bit
            assert_same(r["loaded"], r["saved"], name)
            assert_same(r["resumed_final"], r["final"], name)
            assert len(r["residuals"]) == len(r["resumed_residuals"])
            assert all(torch.equal(a, b) for a, b in zip(r["resumed_residuals"], r["residuals"])), name
    res = results[0]["resume"]
    assert len(res["zeropp"]["residuals"]) >= 2  # residual and partial residual of every unit
    assert res["loco-sr"]["residuals"] and all(t.dtype == torch.uint8 for t in res["loco-sr"]["residuals"])
    assert res["stage2-fp16"]["scale"] == 512.0  # doubled once (window 2) from 2 ** 8: not the initial scale
    assert res["stage1-sgd-groups"]["lr"] == [1.5e-3, 1e-3]
    assert {n.split(".")[0] for n in res["stage1-sgd-groups"]["saved"]} == {"master", "momentum_buffer"}
    assert {n.split(".")[0] for n in res["zeropp"]["saved"]} == {"master", "exp_avg", "exp_avg_sq"}
    assert sorted(p.name for p in (root / "zeropp").iterdir()) == ["global_step3", "latest"]
    assert (root / "zeropp" / "latest").read_text() == "global_step3"


def test_load_at_another_world_size_and_layout(job):
    root, results = job
    saved = results[0]["resume"]["zeropp"]["saved"]  # world 4, stage 3, block-aligned
    masters = {k[len("master."):]: v for k, v in saved.items() if k.startswith("master.")}
    two, four = results[0]["two"], results[0]["four"]
    assert two["world_size"] == 2 and four["world_size"] == 4
    assert all(align == 1 for align, _ in two["units"]) and all(align == 128 for align, _ in four["units"])
    assert_same(two["loaded"], saved, "4 -> 2")
    assert_same({k: two["consolidated"][k] for k in masters}, masters, "4 -> 2 consolidated")
    assert_same(four["loaded"], two["saved"], "2 -> 4")
    for r in (two, four):  # training goes on
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        assert not any(torch.equal(r["saved"][k], r["loaded"][k]) for k in r["saved"] if k.startswith("master."))


def test_consolidated_state_dict(job):
    root, results = job
    cons = results[0]["consolidated"]
    assert cons["logits_equal"]
    # offline, one process: equal to the online dict (tag read from `latest`, or the tag's directory)
    assert_same(consolidate(root / "exact"), cons["consolidated"], "offline")
    assert_same(consolidate(root / "exact" / "final"), cons["consolidated"], "offline, tag directory")
    # the checkpoint's masters are the exact fp32 ones, not the qwZ-dequantized weights; the tied alias is there
    offline = consolidate(root / "zeropp")
    saved = results[0]["resume"]["zeropp"]["saved"]
    assert_same({k: offline[k] for k in offline if k != "lm_head.weight"},
                {k[len("master."):]: v for k, v in saved.items() if k.startswith("master.")}, "offline ZeRO++")
    assert torch.equal(offline["lm_head.weight"], offline["wte.weight"])


def test_errors(job):
    _, results = job
    m = results[0]["consolidated"]["messages"]
    assert "accumulation" in m["save_mid_accumulation"] and "step()" in m["save_mid_accumulation"]
    assert "'wte.weight' has shape (256, 32) here but (256, 64)" in m["other_model_shape"]
    assert "blocks.1." in m["other_model_depth"]
    assert "AdamW" in m["other_optimizer"] and "SGD" in m["other_optimizer"]
    assert "global_step9" in m["missing_tag"]
    assert "nowhere" in m["missing_dir"] and "does not exist" in m["missing_dir"]
    assert "latest" in m["no_latest"]
    assert all(r["consolidated"]["messages"] == m for r in results[1:])
