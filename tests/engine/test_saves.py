"""A stage-3 save from one rank never hangs (issue 20, part 1), on real gloo processes (workers in
saves_workers.py): 2 ranks (2 nodes of 1) and 4 ranks (2 emulated nodes of 2, hpZ 2).

* ``with engine.gathered_parameters(): if rank == 0: model.save_pretrained(d)`` (PEFT) and ``torch.save(
  model.state_dict(), path)`` write the whole trained weights, equal to the exact fp32 masters and to a
  single-process PEFT model trained on the same data, without any communication on the writing rank;
* ``if rank == 0: model.save_pretrained(d)`` without the block raises ``EngineUsageError`` on rank 0 within twice
  ``zero_optimization.zeropp.entry_check_timeout`` (set to 3 s here), naming the missing ranks and the pattern; a
  rank other than the first alone raises within the bound too; later checked calls raise at once on every rank.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_launch import launch

# Looked up, not imported: importing peft (and transformers with it) at collection cost every pytest-xdist worker
# ~6 CPU-s; the workers import it.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None,
                                reason="the PEFT save tests need the peft package (the test extra installs it)")

TIMEOUT = 3.0
PATTERN = "with engine.gathered_parameters():"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    tmp = tmp_path_factory.mktemp("saves")
    out = {}
    for world, per_node, hpz in ((2, "1", 1), (4, "2", 2)):
        out[world] = launch("saves_workers:suite", world, tmp, env={"ZEROPP_RANKS_PER_NODE": per_node},
                            timeout=240, save_dir=str(tmp / f"save{world}"), timeout_s=TIMEOUT, hpz=hpz)
    return out


def rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(((got[k].double() - w.double()).norm() / w.double().norm()).item() for k, w in want.items())


@pytest.mark.parametrize("world", [2, 4])
def test_save_inside_gathered_parameters_from_one_rank(runs, world):
    r = runs[world][0]
    assert r["gathers_while_saving"] == 0  # the block's weights were read, nothing gathered
    adapter, full = r["adapter_saved"], r["full_saved"]
    assert len(adapter) == 8 and all(v.numel() > 0 for v in adapter.values())
    # bit for bit the engine's exact weights (fp32: the compute shards are the masters)
    assert adapter.keys() == r["adapter_exact"].keys()
    assert all(torch.equal(adapter[k], r["adapter_exact"][k]) for k in adapter)
    assert full.keys() == r["full_exact"].keys()
    assert all(torch.equal(full[k], r["full_exact"][k]) for k in full)
    # and the single-process PEFT model trained on the same global batches
    assert rel_error(adapter, r["adapter_ref"]) < 1e-5
    assert rel_error(full, r["full_ref"]) < 1e-5
    trained = [k for k in adapter if "lora_B" in k]  # zero at init: the save holds trained values
    assert trained and all(adapter[k].abs().max() > 0 for k in trained)
    sub = r["sub"]
    assert len(sub) == 4, sorted(sub)  # base_layer weight and bias, lora_A, lora_B
    prefix = "base_model.model.blocks.1.fc2."
    assert all(torch.equal(sub[k], full[prefix + k]) for k in sub)


@pytest.mark.parametrize("world", [2, 4])
def test_save_from_one_rank_without_the_block_raises_in_time(runs, world):
    elapsed, message = runs[world][0]["alone"]
    assert TIMEOUT * 0.9 < elapsed < 2 * TIMEOUT, elapsed
    assert runs[world][0]["wrote_nothing"]
    assert f"global ranks {list(range(1, world))} of the group" in message, message
    assert "model.state_dict() at stage 3" in message and PATTERN in message and "entry_check_timeout" in message
    for r in runs[world]:  # the ranks are out of step now: every checked call raises at once, on every rank
        elapsed, message = r["after"]
        assert elapsed < TIMEOUT / 2, elapsed
        assert "engine.consolidated_state_dict()" in message, message


def test_other_rank_alone_and_partial_block(runs):
    first, other = runs[2]
    assert first["partial_equal"] and other["partial_equal"]  # held unit read, the others gathered, on every rank
    elapsed, message = other["follower"]  # rank 1 alone: it waits for the first rank's answer, 1.25x the bound
    assert TIMEOUT < elapsed < 2 * TIMEOUT, elapsed
    assert "the group's first rank (0) did not confirm" in message and PATTERN in message, message


def test_arrival_names_the_missing_rank(runs):
    """comm.Arrival on 4 ranks, rank 2 skipping the check: the first rank names it within the bound; the others
    (which cannot know which rank it was) fail within 1.25x the bound."""
    results = runs[4]
    assert "partial" not in results[2]
    elapsed, missing = results[0]["partial"]
    assert missing == [2] and TIMEOUT * 0.9 < elapsed < 1.5 * TIMEOUT, (missing, elapsed)
    for r in (results[1], results[3]):
        elapsed, missing = r["partial"]
        assert missing is None and elapsed < 2 * TIMEOUT, (missing, elapsed)
