"""Workers for test_comm_agreement.py: cross-rank agreement checks, timeouts naming the collective.

It wraps torch.distributed's collectives at import (zeropp looks them up there at each call), so that every
collective zeropp issues is counted (``COUNTS``), independently of zeropp's own byte counters.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from zeropp import comm

COUNTS: dict[str, int] = {}


def _counting(name: str):
    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        COUNTS[name] = COUNTS.get(name, 0) + 1
        return original(*args, **kwargs)

    return wrapper


for _name in ("all_gather_single", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_single",
              "reduce_scatter_tensor", "all_reduce", "broadcast", "all_gather_object"):
    if hasattr(dist, _name):
        setattr(dist, _name, _counting(_name))


def _raises(exc: type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        return str(e)
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__}")


def mismatches(rank: int, world: int) -> dict:
    """Disagreements caught without ZEROPP_DEBUG, on every rank, before any data moves."""
    assert not comm.debug_enabled()
    topo = comm.Topology(ranks_per_node=1)
    out: dict[str, str] = {}
    # 8-bit packs of 2000 and 2040 elements (block 256) have the same size: 8 blocks of codes and scales, so the
    # gather itself would succeed and return garbage for the shorter rank.
    numel = 2000 if rank == 0 else 2040
    out["numel"] = _raises(ValueError, comm.all_gather, torch.randn(numel), 8, topology=topo, block_size=256)
    # one rank gathers while the other reduce-scatters: the same record size, so zeropp's message, not gloo's abort
    x = torch.randn(64)
    if rank == 0:
        out["kind"] = _raises(ValueError, comm.all_gather, x, 8, topology=topo)
    else:
        out["kind"] = _raises(ValueError, comm.reduce_scatter, x, 8, topology=topo)
    # the group is still usable afterwards, and agreeing calls give exact results (integers: exact gather)
    ints = torch.arange(5, dtype=torch.int64) + 100 * rank
    assert comm.all_gather(ints, topology=topo).tolist() == [i + 100 * r for r in range(world) for i in range(5)]
    return out


def steady_state(rank: int, world: int, debug: bool) -> dict:
    """Count torch.distributed calls: the agreement check runs once per distinct call (every call with debug)."""
    if debug:
        os.environ["ZEROPP_DEBUG"] = "1"
    topo = comm.Topology(ranks_per_node=2)
    g = torch.Generator().manual_seed(1234)
    xs = [torch.randn(300, generator=g, dtype=torch.float64) * (r + 1) for r in range(world)]
    counts = []
    for _ in range(4):
        start = dict(COUNTS)
        full = comm.all_gather(xs[rank].float(), 8, topology=topo)
        part = comm.reduce_scatter(xs[rank].float(), 8, topology=topo, op="sum")
        hpz = comm.all_gather(xs[rank], None, group=topo.intra_group, topology=topo)
        counts.append({k: COUNTS.get(k, 0) - start.get(k, 0) for k in COUNTS})
        # numbers against float64 references
        ref = torch.cat(xs)
        assert (full.double() - ref).abs().max() <= ref.abs().max() / 127
        lo, hi = comm.shard_range(300, world, rank)
        total = sum(xs)[lo:hi]
        assert (part.double() - total).abs().max() <= 0.05 * total.abs().max() + 1e-6
        assert torch.equal(hpz, torch.cat([xs[r] for r in topo.intra_ranks]))
    return {"per_iteration": counts}


def skipped_call(rank: int, world: int, timeout_s: float, sync_path: str) -> dict:
    """Node 1 (ranks 2, 3) skips a reduce-scatter that node 0 makes: hop 1 (intra-node) completes, hop 2 on the
    inter-node group fails within the topology's timeout (the default group keeps torch's 30 minutes), with an
    error naming the collective. The skipping ranks stay alive, not calling (a hang without the timeout), until
    both waiting ranks have raised (a file store at ``sync_path``: no process group, no short timeout)."""
    store = dist.FileStore(sync_path, world)
    topo = comm.Topology(ranks_per_node=2, timeout=timedelta(seconds=timeout_s))
    x = torch.randn(1000)
    comm.reduce_scatter(x, 4, topology=topo)  # agreed once: later calls exchange nothing first
    if rank >= 2:
        store.wait(["raised0", "raised1"], timedelta(seconds=120))
        return {}
    t0 = time.monotonic()
    try:
        message = _raises(comm.CollectiveError, comm.reduce_scatter, x, 4, topology=topo)
    finally:
        elapsed = time.monotonic() - t0
        store.set(f"raised{rank}", "1")
    return {"elapsed": elapsed, "message": message}
