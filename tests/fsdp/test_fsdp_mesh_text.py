"""zeropp.fsdp's quantized comms over 200 steps of real text on 8-rank meshes (issue 26): HSDP (replicate 2 x shard
4, 2 emulated nodes of 4), dp 2 x tp 2 x pp 2 (``torch.distributed.pipelining``'s 1F1B, 2 micro-batches) and
HSDP + TP (replicate 2 x shard 2 x tp 2), each trained plain, with zeropp's exact comms and with qwZ int8 / qgZ int4
(HSDP: + the int4 cross-replica all-reduce) on the stdlib bytes (``text_workers``), in one launch.

Checked: exact comms bit-identical to plain FSDP2 on the same mesh for all 200 steps (losses and final parameters);
the quantized run's mean training loss over the last 20 steps (over the ranks that compute a loss) within 2% of the
exact run's; both learn (below 0.8 ln 256).

Measured (torch 2.13 CPU, 2-core box, other jobs running): HSDP last-20 exact 2.4652, quantized 2.4551 (-0.41%),
from 5.45; 3-D (pipelined) exact 2.6402, quantized 2.6538 (+0.51%), from 5.72. The launch took 305 s at load average
~20 with the manual one-micro-batch pipeline the 3-D mesh had then (HSDP's three runs 164 s, the 3-D mesh's 131 s),
535 s at load average ~20-29 beside another 8-rank launch with pipelining (HSDP 260 s, 3-D 245 s): far over a CI
test's seconds, so it is opt-in (``ZEROPP_LONG_TESTS=1``; the repo has no slow-test marker). HSDP + TP, added later
and measured on its own (``text_workers.hsdp_tp_runs`` in an 8-rank launch, load average ~30): exact bit-identical
for 200 steps, last-20 exact 2.6736, quantized 2.6893 (+0.59%), from 6.03; its three runs 198 s. The 10-step checks
of the same meshes run in CI (test_fsdp_hsdp.py, test_fsdp_meshes.py).
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch
from fsdp_launch import launch
from text_workers import STEPS

WORLD, LAST, BOUND = 8, 20, 0.02

pytestmark = pytest.mark.skipif(os.environ.get("ZEROPP_LONG_TESTS") != "1",
                                reason="200 training steps on 8 ranks take minutes: set ZEROPP_LONG_TESTS=1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    start = time.perf_counter()
    results = launch("text_workers:text_runs", WORLD, tmp_path_factory.mktemp("text"),
                     env={"ZEROPP_RANKS_PER_NODE": "4"}, timeout=1800)
    print(f"\nlaunch wall {time.perf_counter() - start:.1f} s; rank 0 seconds {results[0]['seconds']}")
    return results


def _last_mean(runs: list[dict], key: str, comms: str) -> float:
    """Mean over the ranks that compute a loss of their mean loss over the last LAST steps."""
    means = [sum(r[key][comms][0][-LAST:]) / LAST for r in runs if r[key][comms][0]]
    return sum(means) / len(means)


@pytest.mark.parametrize("key", ["hsdp", "3d", "hsdp_tp"])
def test_exact_bit_identical_to_plain_over_200_steps(runs: list[dict], key: str) -> None:
    for r in runs:
        (plain_losses, plain_params), (losses, params) = r[key]["plain"], r[key]["exact"]
        assert losses == plain_losses
        assert len(losses) == (0 if key == "3d" and r["3d"]["coord"]["pp"] == 0 else STEPS)
        assert params.keys() == plain_params.keys()
        for name in params:
            assert torch.equal(params[name], plain_params[name]), name


@pytest.mark.parametrize("key", ["hsdp", "3d", "hsdp_tp"])
def test_quantized_within_2_percent_of_exact_over_200_steps(runs: list[dict], key: str) -> None:
    exact, quantized = _last_mean(runs, key, "exact"), _last_mean(runs, key, "quantized")
    firsts = [r[key]["exact"][0][0] for r in runs if r[key]["exact"][0]]
    first = sum(firsts) / len(firsts)
    summary = f"{key}: first {first:.4f}, last-{LAST} exact {exact:.4f} quantized {quantized:.4f} " \
              f"({(quantized - exact) / exact:+.2%})"
    print(summary)
    assert exact < 0.8 * math.log(256), summary  # it learns (the first losses are about ln 256)
    assert abs(quantized - exact) <= BOUND * exact, summary
