"""A tiny job for test_clean_exit.py: qgZ reduce-scatters and qwZ all-gathers, then the interpreter exits at once
(``destroy`` given: after ``destroy_process_group``). ``python exit_job.py RANK WORLD STORE destroy|keep``."""

import sys

import torch
import torch.distributed as dist

from zeropp import comm

rank, world, store, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
topo = comm.Topology(ranks_per_node=1)
xs = [torch.randn(4096, generator=torch.Generator().manual_seed(r)) for r in range(world)]
works = [comm.reduce_scatter(xs[rank], 4, topology=topo, async_op=True),
         comm.all_gather(xs[rank], 8, topology=topo, async_op=True)]
part, full = (w.wait() for w in works)
ref = torch.cat(xs)
assert (full - ref).abs().max() <= ref.abs().max() / 127  # int8: at most half a block scale, absmax / 254
lo, hi = comm.shard_range(4096, world, rank)
mean = sum(xs)[lo:hi] / world
assert (part - mean).abs().max() <= ref.abs().max() / 7  # int4: at most the mean of half scales, absmax / 14
if mode == "destroy":
    dist.destroy_process_group()
