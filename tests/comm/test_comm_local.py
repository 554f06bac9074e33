"""Single-process parts of zeropp.comm: layout helpers, byte formulas, benchmark argument parsing."""

from __future__ import annotations

import pytest

from zeropp import comm
from zeropp.bench.collectives import parse_bytes, sizes
from zeropp.comm import accounting as st


@pytest.mark.parametrize("numel, world", [(0, 4), (1, 4), (9, 4), (10, 4), (12, 4), (1001, 8), (7, 1)])
def test_shard_range_tiles_the_tensor(numel, world):
    ranges = [comm.shard_range(numel, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    s = -(-numel // world)
    assert all(stop - start <= s for start, stop in ranges)
    assert all(start == min(r * s, numel) for r, (start, _) in enumerate(ranges))


def test_traffic_formulas():
    # ring all-gather of 100 B per rank over 8 ranks, 2 on this node: 7 * 100 each way, 100 of it intra-node
    t = st.gather_traffic(100, 8, 2)
    assert (t.sent_intra, t.sent_inter, t.recv_intra, t.recv_inter) == (100, 600, 100, 600)
    assert t.sent == t.received == 700
    t = st.all_to_all_traffic(10, 3, 1) + st.all_to_all_traffic(5, 0, 2)
    assert (t.sent_intra, t.sent_inter) == (30, 20)


def test_stats_accumulate_and_reset():
    comm.reset_stats()
    st.record("all_gather", st.Traffic(1, 2, 3, 4))
    st.record("all_gather", st.Traffic(1, 2, 3, 4))
    s = comm.stats()
    assert s["all_gather"] == {"calls": 2, "sent_intra": 2, "sent_inter": 4, "recv_intra": 6, "recv_inter": 8}
    assert s["reduce_scatter"]["calls"] == 0
    s["all_gather"]["calls"] = 99  # a copy
    assert comm.stats()["all_gather"]["calls"] == 2
    comm.reset_stats()
    assert comm.stats()["all_gather"]["calls"] == 0


def test_bench_sizes_and_units():
    assert parse_bytes("64K") == 65536 and parse_bytes("16M") == 16 << 20 and parse_bytes("4096") == 4096
    assert sizes(1024, 16384, 4) == [1024, 4096, 16384]
    with pytest.raises(Exception, match="byte count"):
        parse_bytes("lots")


def test_topology_needs_init():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        comm.Topology()
