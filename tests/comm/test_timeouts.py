"""Every collective kind over every group zeropp uses fails within twice the user's timeout when one rank skips it
(issue 20, part 2): 4 gloo ranks as 2 emulated nodes, ``init_process_group(timeout=2 s)``, nothing passed to zeropp
(its groups must take the default group's timeout, not torch's 30-minute default), and one case with an explicit
zeropp timeout, which wins. The cases are in ``timeout_workers.py``."""

from __future__ import annotations

import pytest
from comm_launch import launch

# Every case waits its timeout out in full (13 cases: 12 x TIMEOUT_S + EXPLICIT_S of the module's time), so they are
# short; the set-up collectives between the file-store syncs take milliseconds.
TIMEOUT_S = 2.0  # the default group's (init_process_group's)
EXPLICIT_S = 4.5  # a zeropp timeout above the default's 2x bound: a raise after it cannot be the default's
# Beyond the 2x: once gloo's timer fires, the error reaches Python in milliseconds; 1 s covers a waking
# thread that waits for a core on a loaded 2-core machine.
SLACK_S = 1.0

# case -> (the collective the message must name, per waiting rank the step it must name ("" for none))
HOP1 = "at hop 1 (intra-node all-to-all over ranks [0, 1])"
HOP2_02 = "at hop 2 (inter-node all-to-all over ranks [0, 2])"
HOP2_13 = "at hop 2 (inter-node all-to-all over ranks [1, 3])"
WAITING3 = {0: "", 1: "", 2: ""}
EXPECTED = {
    "all_gather exact": ("all_gather(bits=None) of 1000 torch.float32 elements per rank over ranks [0, 1, 2, 3]",
                         WAITING3),
    "all_gather qwZ int8": ("all_gather(bits=8) of 1000 torch.float32 elements per rank over ranks [0, 1, 2, 3]",
                            WAITING3),
    "all_gather qwZ int4": ("all_gather(bits=4) of 1000 torch.float32 elements per rank over ranks [0, 1, 2, 3]",
                            WAITING3),
    "reduce_scatter exact": ("reduce_scatter(bits=None, op=avg) of 1000 torch.float32 elements over ranks "
                             "[0, 1, 2, 3]", WAITING3),
    "fsdp forward all_gather": ("all_gather(bits=8)", WAITING3),
    "reduce_scatter qgZ, rank 1 skips": ("reduce_scatter(bits=4, op=avg) of 1000 torch.float32 elements over ranks "
                                         "[0, 1, 2, 3]", {0: HOP1, 2: HOP2_02, 3: HOP2_13}),
    "reduce_scatter qgZ, node 1 skips": ("reduce_scatter(bits=4, op=avg)", {0: HOP2_02, 1: HOP2_13}),
    "hpZ partition all_gather": ("all_gather(bits=None) of 1000 torch.float32 elements per rank over ranks [0, 1]",
                                 {0: ""}),
    "subgroup all_gather": ("all_gather(bits=None) of 1000 torch.float32 elements per rank over ranks [0, 3]",
                            {0: ""}),
    "fsdp backward reduce_scatter": ("reduce_scatter(bits=4, op=avg)", {0: HOP1, 2: HOP2_02, 3: HOP2_13}),
    # rank 0 waits in the first layer's backward gather over FSDP2's post-forward group {0, 1}; ranks 2 and 3
    # complete theirs and wait in that layer's gradient reduce-scatter
    "fsdp hpZ backward all_gather": (None, {0: "all_gather(bits=None)", 2: "reduce_scatter(bits=4, op=avg)",
                                           3: "reduce_scatter(bits=4, op=avg)"}),
    "reduce_scatter qgZ, explicit timeout": ("reduce_scatter(bits=4, op=avg)", {0: HOP2_02, 1: HOP2_13}),
    "all_gather exact, default topology": ("all_gather(bits=None) of 1000 torch.float32 elements per rank over "
                                           "ranks [0, 1, 2, 3]", WAITING3),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeouts")
    per_rank = launch("timeout_workers:skipped_calls", 4, tmp, timeout=360, pg_timeout=TIMEOUT_S,
                      env={"ZEROPP_RANKS_PER_NODE": "2"}, sync_path=str(tmp / "sync"), timeout_s=TIMEOUT_S,
                      explicit_s=EXPLICIT_S)
    return per_rank


def test_the_default_topology_takes_the_default_groups_timeout(results):
    assert [r["default topology timeout"] for r in results] == [TIMEOUT_S] * 4


@pytest.mark.parametrize("case", list(EXPECTED))
def test_waiting_ranks_raise_naming_the_collective_within_twice_the_timeout(results, case):
    collective, steps = EXPECTED[case]
    timeout = EXPLICIT_S if "explicit" in case else TIMEOUT_S
    waited = {rank: r[case] for rank, r in enumerate(results) if case in r}
    assert set(waited) == set(steps), (case, waited)
    for rank, got in waited.items():
        assert got["type"] == "CollectiveError", (case, rank, got)
        assert collective is None or collective in got["message"], (case, rank, got["message"])
        assert steps[rank] in got["message"], (case, rank, got["message"])
        assert "timeout" in got["message"].lower() or "timed out" in got["message"].lower(), (case, rank, got)
        # it waited for the timeout (an explicit one: longer than the default's whole bound) and no longer than 2x
        assert timeout - 0.1 <= got["elapsed"] <= 2 * timeout + SLACK_S, (case, rank, got)
