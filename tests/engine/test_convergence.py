"""Full ZeRO++ converges like exact ZeRO-3 (issue 4, test 2).

One launched job on 4 gloo ranks as 2 emulated nodes of 2 (``ZEROPP_RANKS_PER_NODE=2``) trains the tiny GPT
(``GPTConfig.preset("tiny")``, 120,576 parameters) 100 AdamW steps (lr 1e-3, weight decay 0.1, clipping 1.0) on
random 32-byte crops of the Python standard library's sources (``zeropp.data``: 1 MiB corpus, global batch 16, 4
per rank), twice from the same weights and data: exact ZeRO-3, then ZeRO-3 with qwZ (int8 weights), hpZ 2 and
qgZ (int4 gradients), block 128 — the defaults. The yardstick is the loss on held-out crops (another seed: 16
batches, 8,192 tokens) after the last step, and the mean training loss of the last 10 steps.

Measured (torch 2.13 CPU, 2-core box at load average ~20): eval loss exact 2.5907, ZeRO++ 2.5967 (+0.23%); last-10
training loss 2.7130 and 2.7269 (+0.51%); from 5.43 at the first step (ln 256 = 5.55). Bounds: eval 1%, last-10
1.5%. At 200 steps (the file's first version, twice the time, bound 2% on both) the gaps were alike: eval 2.3613 and
2.3696 (+0.35%), last-10 2.3090 and 2.3190 (+0.43%); for scale there, the exact run with another data seed ended at
eval 2.3704 (0.4% from the first), and its ZeRO++ twin at 2.3897 (+0.8%). The bounds are tighter than 200 steps'
because a quantizer's bias shows less in fewer steps: codes rounded down instead of to nearest (``floor_`` in
``reference.quantize_blocks``' code rounding) put ZeRO++ +3.8% (eval) and +3.6% (last-10) above exact at 200 steps, only
+1.7% and +1.9% at 100, which the old 2% let through and these bounds catch.

The learning rate matters: at lr 3e-3 (which learns less well in 200 steps: exact eval 2.33 on 4 eval batches) the
same job put ZeRO++ 4.6% above exact, with qgZ error feedback (``zeropp.error_feedback``) 1.8%, with int8 gradients
2.8%, without qgZ 0.9%, with block 64 0.0%, and at 400 steps 2.1%: int4 gradients without error feedback round an
element below 1/14 of its block's absmax to zero, and Adam then barely moves it, which costs most where the
update is large (those figures are from 200-step runs). Wall time of this file: 147 s at load average ~20 (30
CPU-seconds; 200 steps took 40 s at load average 5).
"""

from __future__ import annotations

import math

from engine_launch import launch

STEPS = 100
EVAL_BOUND, LAST10_BOUND = 0.01, 0.015  # relative gaps to exact, see the docstring


def test_zeropp_loss_within_1_percent_of_exact_zero3(tmp_path):
    results = launch("convergence_workers:exact_vs_zeropp", 4, tmp_path, env={"ZEROPP_RANKS_PER_NODE": "2"},
                     timeout=600, steps=STEPS)
    for r in results[1:]:  # losses are averaged over the ranks: every rank reports the same numbers
        assert all(r[k]["losses"] == results[0][k]["losses"] and r[k]["eval"] == results[0][k]["eval"]
                   for k in ("exact", "zeropp"))
    exact, zpp = results[0]["exact"], results[0]["zeropp"]
    assert len(exact["losses"]) == len(zpp["losses"]) == STEPS
    # the same start: ln(256) up to the initialisation, and the same weights up to qwZ's int8 rounding
    assert abs(exact["losses"][0] - math.log(256)) < 0.2 and abs(zpp["losses"][0] - exact["losses"][0]) < 1e-3
    last = {name: sum(run["losses"][-10:]) / 10 for name, run in (("exact", exact), ("zeropp", zpp))}
    # the job learns, so the comparison means something
    assert exact["eval"] < 0.6 * math.log(256) and last["exact"] < 0.6 * math.log(256), (exact["eval"], last)
    assert abs(zpp["eval"] - exact["eval"]) <= EVAL_BOUND * exact["eval"], (zpp["eval"], exact["eval"])
    assert abs(last["zeropp"] - last["exact"]) <= LAST10_BOUND * last["exact"], last
