"""Cross-rank agreement of collective calls (always on, once per distinct call), subgroup timeouts, and the
errors naming the collective; real gloo processes (see agreement_workers.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from comm_launch import launch, launch_cases

# the flat all-gather zeropp calls: all_gather_single from torch 2.13, all_gather_into_tensor before (comm/_dist.py)
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def test_mismatches_raise_without_debug(tmp_path):
    results = launch("agreement_workers:mismatches", 2, tmp_path, timeout=60)
    for msg in results:
        assert "numel: rank 0=2000, rank 1=2040" in msg["numel"]
        assert "kind: rank 0=all_gather, rank 1=reduce_scatter" in msg["kind"]


@pytest.fixture(scope="module")
def steady(tmp_path_factory):
    """Both modes in one launch, cached first (the debug case sets ``ZEROPP_DEBUG`` for the rest of the process)."""
    return launch_cases("agreement_workers:steady_state", 4, tmp_path_factory.mktemp("steady"),
                        {"cached": {"debug": False}, "debug": {"debug": True}}, timeout=120)


@pytest.mark.parametrize("mode", ["cached", "debug"])
def test_steady_state_costs_no_extra_collective(steady, mode):
    debug = mode == "debug"
    results = steady[mode]
    # world 4, 2 nodes of 2: qwZ = 1 gather, qgZ = 2 all-to-alls, hpZ = 1 gather per iteration
    data = {GATHER: 2, "all_to_all_single": 2}
    for r in results:
        first, *rest = r["per_iteration"]
        checks = 3  # one agreement gather per distinct call
        assert first.get(GATHER, 0) == data[GATHER] + checks, first
        for counts in rest:
            extra = checks if debug else 0
            assert counts.get(GATHER, 0) == data[GATHER] + extra, counts
            assert counts.get("all_to_all_single", 0) == data["all_to_all_single"], counts
            assert sum(counts.values()) == sum(data.values()) + extra, counts


def test_skipped_call_times_out_naming_the_collective(tmp_path):
    timeout_s = 3.0
    for waiting in launch("agreement_workers:skipped_call", 4, tmp_path, timeout=60, timeout_s=timeout_s,
                          sync_path=str(tmp_path / "sync"))[:2]:
        assert timeout_s - 0.5 <= waiting["elapsed"] < timeout_s + 2.5, waiting
        assert "reduce_scatter(bits=4, op=avg) of 1000 torch.float32 elements" in waiting["message"]
        assert "Timed out" in waiting["message"] and "did not make this call" in waiting["message"]
