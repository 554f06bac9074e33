"""Bucketed gradient reduce-scatters (``reduce_bucket_size``, issue 11) on 4 gloo ranks as 2 emulated nodes of 2,
stages 1, 2 and 3 of the tiny GPT (3 units: root, blocks.0, blocks.1), two training steps each:

* the number of reduce-scatter collectives per step is one per unit with a one-element bucket, one with a bucket
  larger than the model, and two with a bucket of the units' elements minus one (all but the last unit ready fill
  it, the last goes alone);
* the gradient shards after the first backward, the losses and the fp32 masters after two steps are bit-identical
  across the three bucketings, for exact fp32, the bf16 wire (``communication_data_type``) and qgZ; the exact
  precisions' shards also match the float64 mean of a plain model's gradients over the ranks (within one rounding);
* qgZ with error feedback (float32 residuals; LoCo's 8-bit ones with int8/int2 hops and the rotation) is bucketed
  too: shards, losses, masters and every unit's stored residuals after two steps are bit-identical to one
  collective per unit (each unit keeps its own residuals, in its own layout);
* stage 3: every unit is freed as soon as its gradients are ready, while the bucket still holds them.
"""

from __future__ import annotations

import torch
from engine_launch import launch

RUNS = {1: ["fp32", "bf16", "qgz"], 2: ["fp32", "bf16", "qgz"], 3: ["fp32", "bf16", "qgz", "qgz-ef", "qgz-loco"]}


def test_bucketed_reduce_scatter_is_bit_identical(tmp_path) -> None:
    results = launch("bucket_workers:bucketed_runs", 4, tmp_path, env={"ZEROPP_RANKS_PER_NODE": "2"},
                     timeout=300, runs=RUNS)
    for res in results:
        for stage, precisions in RUNS.items():
            for precision in precisions:
                _check(res, stage, precision)
    for key in results[0]:  # the same collectives on every rank
        assert all(r[key]["calls"] == results[0][key]["calls"] for r in results), key


def _check(res: dict, stage: int, precision: str) -> None:
    one, every, two = (res[f"{stage}/{precision}/{b}"] for b in ("one", "all", "two"))
    where = (stage, precision)
    units = one["units"]
    assert units == 3
    assert one["calls"] == [units] * 2, where
    assert every["calls"] == [1] * 2, where
    assert two["calls"] == [2] * 2, where
    assert len(one["residuals"]) == (units if precision.startswith("qgz-") else 0), where
    for other, name in ((every, "all"), (two, "two")):
        assert other["losses"] == one["losses"], (where, name)
        for a, b in zip(one["shards"], other["shards"], strict=True):
            assert torch.equal(a, b), (where, name)
        for key, want in one["masters"].items():
            assert torch.equal(other["masters"][key], want), (where, name, key)
        for a, b in zip(one["residuals"], other["residuals"], strict=True):  # error feedback: per unit, as alone
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (where, name)
    if precision in ("fp32", "bf16"):
        for run in (one, every, two):
            assert run["worst"] <= 1e-6, (where, run["worst"])
    if stage == 3:
        for run in (one, every, two):
            assert len(run["ready"]) == 2 * units, where
            assert not any(gathered for gathered, _ in run["ready"]), where
        # one bucket: every unit ready in backward is held until backward ends
        assert [held for _, held in every["ready"]] == [1, 2, 3] * 2, where
