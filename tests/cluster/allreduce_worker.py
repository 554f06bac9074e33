"""Per-rank script for tests/cluster: gloo all-reduce, Topology check, optional failure or timing.

Env: CLUSTER_TEST_FAIL_RANK=<r> makes rank r exit 3 after init, the others sleep 10 minutes (a hang);
CLUSTER_TEST_MEASURE=<MB> times intra-node and inter-node all-reduces of that size and prints them (rank 0).
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from zeropp.comm import Topology


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = int(os.environ["ZEROPP_RANKS_PER_NODE"])
    expected_world = int(os.environ["ZEROPP_CLUSTER_NODES"]) * rpn
    assert world == expected_world, (world, expected_world)
    if os.environ.get("CLUSTER_TEST_FAIL_RANK") == str(rank):
        print(f"rank {rank}: failing on purpose", flush=True)
        sys.exit(3)
    if os.environ.get("CLUSTER_TEST_FAIL_RANK"):
        time.sleep(600)  # the others hang (as in a collective that never completes): the launcher must kill them
    topo = Topology()
    assert topo.ranks_per_node == rpn and topo.num_nodes == world // rpn, topo
    assert topo.node == rank // rpn, (topo.node, rank)
    if "ZEROPP_CLUSTER_NODE" in os.environ:
        assert int(os.environ["ZEROPP_CLUSTER_NODE"]) == topo.node
    t = torch.full((1000,), float(rank))
    dist.all_reduce(t)
    assert torch.all(t == world * (world - 1) / 2), t[:4]
    mb = float(os.environ.get("CLUSTER_TEST_MEASURE", "0"))
    if mb:
        x = torch.ones(int(mb * 2**20 / 4))
        for name, group in (("intra", topo.intra_group), ("inter", topo.inter_group)):
            dist.all_reduce(x, group=group)  # warm-up (connections)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            dist.barrier()
            dt = time.perf_counter() - t0
            n = dist.get_world_size(group)
            # ring all-reduce: each rank sends 2 (n-1)/n of the buffer
            gbit = 2 * (n - 1) / n * x.numel() * 4 * 8 / dt / 1e9
            if rank == 0:
                print(f"MEASURE {name} {mb:g}MB {dt * 1e3:.1f} ms {gbit:.3f} Gbit/s per rank", flush=True)
    dist.barrier()
    if rank == 0:
        print(f"OK world={world} nodes={topo.num_nodes}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
