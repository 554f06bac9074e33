"""OneBitAdam on ZeRO stages 1-3 (``zeropp.engine.onebit``), 2 gloo ranks, the tiny GPT, one launch:

* warmup (steps ``1 .. freeze_step``): the fp32 masters bit-identical to AdamW's with the same hyperparameters after
  every step, at every stage, and at stage 3 with qwZ and qgZ on (the compressed phase then replaces qgZ);
* compressed phase: the whole masters after ``RECORDED`` compressed steps within float32 rounding of a float64
  reference of the algorithm written here from docs/onebit.md alone (both ranks' gradients, which the engines
  recorded, simulated in one process);
* the reduce-scatter bytes of a compressed step equal ``(P - 1) * (S / 8 + 4 S / B)`` summed over the units, 1/25.6
  of the exact fp32 reduce-scatter of a warmup step at the default block of 128;
* the training loss over the last steps within ``LOSS_BOUND`` of AdamW's;
* each rank's local gradient in the first compressed step within float32 rounding of a plain model's (stage 2 with
  two micro-batches per step: added up in the buffer); a NaN in one rank's local gradient (stage 1) skips the step
  on every rank, leaving masters, momenta and errors as they were;
* a checkpoint saved in the compressed phase (stage 2) restores every rank's local momentum, worker error and the
  frozen variance bit for bit, and the resumed run ends with the masters of the uninterrupted one.
"""

from __future__ import annotations

import math

import torch
from engine_launch import launch
from onebit_workers import HYPER

FREEZE, RECORDED = 3, 3
CASES = {
    "stage1": {"stage": 1, "freeze": FREEZE, "recorded": RECORDED, "steps": FREEZE + RECORDED, "nonfinite": True},
    "stage2": {"stage": 2, "freeze": FREEZE, "recorded": RECORDED, "steps": FREEZE + RECORDED, "accum": 2,
               "checkpoint_dir": None},  # set by the test
    "stage3": {"stage": 3, "freeze": 30, "recorded": RECORDED, "steps": 60},
    "stage3-qwZ-qgZ": {"stage": 3, "freeze": FREEZE, "recorded": RECORDED, "steps": FREEZE + RECORDED,
                       "zero": {"zero_quantized_weights": True, "zero_quantized_gradients": True}},
}
LOSS_BOUND = 0.03  # relative difference of the mean loss of the last 10 steps (measured: 0.7%)


def _compress(x: torch.Tensor, block: int) -> torch.Tensor:
    """The decoded 1-bit compression of the float64 row ``x``: per block, its RMS times the sign (0 counts as +)."""
    blocks = x.view(-1, block)
    scale = blocks.pow(2).mean(dim=1, keepdim=True).sqrt()
    return torch.where(blocks >= 0, scale, -scale).view(-1)


def _reference(res: dict, world: int, freeze: int) -> list[torch.Tensor]:
    """The whole masters after the recorded compressed steps, in float64, per unit."""
    b1, b2 = HYPER["betas"]
    lr, eps, wd = HYPER["lr"], HYPER["eps"], HYPER["weight_decay"]
    block = res["block_size"]
    out = []
    for u, layout in enumerate(res["units"]):
        s = layout["shard"]
        p = res["start"]["master"][u].double()
        v = res["start"]["exp_avg_sq"][u].double()
        m = [res["start"]["exp_avg"][u].double() for _ in range(world)]  # each rank starts from the mean
        e = [torch.zeros_like(p) for _ in range(world)]
        for k, grads in enumerate(res["grads"]):
            t = freeze + 1 + k
            sent = []
            for r in range(world):
                m[r] = b1 * m[r] + (1 - b1) * grads[u][r].double()
                x = m[r] + e[r]
                if world == 1:  # nothing is sent, nothing compressed
                    sent.append(x)
                    continue
                c = torch.cat([_compress(x[q * s : (q + 1) * s], block) for q in range(world)])
                e[r] = x - c
                sent.append(c)
            m_hat = torch.where(v == 0, 0.0, sum(sent) / world)  # no momentum where the warmup had no gradient
            denom = v.sqrt() / math.sqrt(1 - b2**freeze) + eps
            p = p * (1 - lr * wd) - lr / (1 - b1**t) * m_hat / denom
        out.append(p)
    return out


def _check_reference(res: dict, world: int, freeze: int, name: str) -> None:
    """The engine's whole masters after the recorded steps against ``_reference``, on the parameters' elements (the
    padding is no parameter's)."""
    for u, (want, got) in enumerate(zip(_reference(res, world, freeze), res["end"])):
        layout = res["units"][u]
        for off, size in zip(layout["offsets"], layout["sizes"]):
            w, g = want[off : off + size], got[off : off + size].double()
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (name, u, (g - w).abs().max().item())


def test_onebit_adam_one_rank(tmp_path) -> None:
    """One rank: AdamW until freeze_step, then the variance frozen and the momentum of the rank's own gradient, with
    no compression and no reduce-scatter bytes (as DeepSpeed)."""
    case = {"stage": 2, "freeze": FREEZE, "recorded": RECORDED, "steps": FREEZE + RECORDED}
    res = launch("onebit_workers:onebit_cases", 1, tmp_path, timeout=300, cases={"one": case})[0]["one"]
    assert res["warmup_equal"] == [True] * FREEZE
    assert res["local_gradient_error"] <= 1e-6
    assert res["sent"] == {"warmup": 0, "compressed": 0}
    _check_reference(res, 1, FREEZE, "one")


def test_onebit_adam(tmp_path) -> None:
    world = 2
    cases = {**CASES, "stage2": {**CASES["stage2"], "checkpoint_dir": str(tmp_path / "checkpoint")}}
    results = launch("onebit_workers:onebit_cases", world, tmp_path, timeout=300, cases=cases)
    assert [r["stage2"]["resumed"] for r in results] == [True] * world
    assert [r["stage1"]["nonfinite_skipped"] for r in results] == [True] * world
    for name, case in CASES.items():
        res = results[0][name]
        assert res["warmup_equal"] == [True] * case["freeze"], name
        for r in results:  # the gradients the compressed phase starts from: this rank's own, summed over micro-batches
            assert r[name]["local_gradient_error"] <= 1e-6, name
        _check_reference(res, world, case["freeze"], name)
        units = res["units"]
        formula = sum((world - 1) * (u["shard"] // 8 + 4 * u["shard"] // res["block_size"]) for u in units)
        exact = sum((world - 1) * 4 * u["shard"] for u in units)
        # stages 2 and 3 reduce-scatter every micro-batch's gradient in the warmup; the 1-bit exchange is per step
        reductions = case.get("accum", 1) if case["stage"] > 1 else 1
        for r in results:
            assert r[name]["sent"]["compressed"] == formula, name
            if "zero" not in case:  # (qgZ's warmup sends int4 codes)
                assert r[name]["sent"]["warmup"] == reductions * exact, name
        assert exact / formula == 25.6
    losses = results[0]["stage3"]["losses"]
    adamw, onebit = (sum(losses[k][-10:]) / 10 for k in ("adamw", "onebit"))
    assert abs(onebit - adamw) <= LOSS_BOUND * adamw, (onebit, adamw)
