"""Worker for tests/comm/test_timeouts.py: one rank (or node) skips a collective, staying alive, and the ranks that
made the call must fail with ``CollectiveError`` after a timeout nothing passed to zeropp (the default group's,
set by ``comm_launch.launch(pg_timeout=...)``), or after an explicit zeropp timeout where one is given.

After a gloo timeout the groups involved are unusable (the ranks' sequence numbers differ), so every case builds
fresh groups: a new ``Topology`` over the default group where the wait happens on zeropp's own groups (the default
group stays healthy), or over a new data-parallel group where the wait happens on the data-parallel group itself;
only the last case breaks the default group.

Every collective here has the short timeout, set-up included, so the ranks meet on a file store (no timeout that
matters) before each step of a case that communicates: a rank delayed by a loaded machine must not make the others
time out before the call under test. Every rank waits there until every waiting rank has raised, so nobody starts
the next case early or exits while others wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

import zeropp.fsdp
from zeropp import comm

D = 2  # ranks per node: 4 ranks are 2 emulated nodes, {0, 1} and {2, 3}
NUMEL = 1000
Sync = Callable[[], None]


def _data_parallel_group(timeout_s: float) -> dist.ProcessGroup:
    """A fresh group of every rank with the default group's timeout (the user's data-parallel group)."""
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout_s))
    assert group is not None
    return group


def _comm_call(rank: int, bits: int | None, kind: str, topo: comm.Topology, sync: Sync,
               group: dist.ProcessGroup | None = None) -> Callable[[], object]:
    """One agreed warm-up call (the cross-rank agreement check happens at a call's first occurrence), then the
    call to time."""
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank))
    if kind == "all_gather":
        def call() -> object:
            return comm.all_gather(x, bits, group=group, topology=topo)
    else:
        def call() -> object:
            return comm.reduce_scatter(x, bits, topology=topo)
    sync()
    call()
    return call


def _fsdp_call(rank: int, mesh: DeviceMesh, sync: Sync, *, hpz: int | None, step: str) -> Callable[[], object]:
    """A tiny model under FSDP2 + zeropp (qwZ int8, qgZ int4), one warm-up step; the call is its forward (the
    shard group's all-gather) or its backward after a forward made here (gradient reduce-scatter; with ``hpz`` the
    first layer's backward all-gather over its post-forward group comes first)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    if hpz is not None:
        fully_shard(model[0], mesh=mesh, reshard_after_forward=hpz)
    fully_shard(model, mesh=mesh)  # the root is not resharded after forward: its backward gathers nothing
    sync()
    zeropp.fsdp.enable(model, weight_bits=8, gradient_bits=4, hpz=hpz, ranks_per_node=D)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    sync()
    model(x).square().sum().backward()
    sync()
    if step == "forward":
        return lambda: model(x)
    loss = model(x).square().sum()
    sync()
    return loss.backward


def _cases(rank: int, timeout_s: float, explicit_s: float) -> list[tuple[str, set[int], set[int], Callable]]:
    """``(name, skipping ranks, waiting ranks, setup)``; ``setup(sync)`` runs on every rank and returns the call."""
    def dp_comm(bits: int | None, kind: str) -> Callable:
        def setup(sync: Sync) -> Callable[[], object]:
            group = _data_parallel_group(timeout_s)
            sync()
            return _comm_call(rank, bits, kind, comm.Topology(group, D), sync, group)
        return setup

    def default_comm(bits: int | None, kind: str, timeout: float | None = None, size: int | None = None) -> Callable:
        def setup(sync: Sync) -> Callable[[], object]:
            topo = comm.Topology(ranks_per_node=D, timeout=None if timeout is None else timedelta(seconds=timeout))
            sync()
            return _comm_call(rank, bits, kind, topo, sync, None if size is None else topo.partition_group(size))
        return setup

    def pair_subgroup(sync: Sync) -> Callable[[], object]:
        """``Topology.subgroup`` of a pair that is no node group ({0, 3} and {1, 2}), created on first use, as
        ``zeropp.fsdp`` does for post-forward groups it has not met."""
        topo = comm.Topology(ranks_per_node=D)
        sync()
        pair = [0, 3] if rank in (0, 3) else [1, 2]
        return _comm_call(rank, None, "all_gather", topo, sync, topo.subgroup(pair))

    def dp_fsdp(sync: Sync) -> Callable[[], object]:
        group = _data_parallel_group(timeout_s)
        sync()
        # a dim name of its own: DTensor hands out cached meshes that are equal by value (ranks, layout, names),
        # so the later cases' parameters over the default group's mesh could carry this one, with its broken group
        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("forward_case",))
        return _fsdp_call(rank, mesh, sync, hpz=None, step="forward")

    def world_fsdp(hpz: int | None) -> Callable:
        return lambda sync: _fsdp_call(rank, init_device_mesh("cpu", (dist.get_world_size(),)), sync, hpz=hpz,
                                       step="backward")

    def default_topology(sync: Sync) -> Callable[[], object]:
        return _comm_call(rank, None, "all_gather", comm.get_default_topology(), sync)

    waiting3 = {0, 1, 2}
    # qgZ's hop 1 runs in the node ({0, 1}, {2, 3}), hop 2 across nodes ({0, 2}, {1, 3}). Rank 1 skipping leaves
    # rank 0 waiting in hop 1 and ranks 2 and 3 in hop 2 (2 on rank 0, which never gets there; 3 on rank 1); node 1
    # skipping leaves ranks 0 and 1 waiting in hop 2, after a hop 1 that completed.
    return [
        # on the data-parallel group (a fresh one per case, with the default group's timeout)
        ("all_gather exact", {3}, waiting3, dp_comm(None, "all_gather")),
        ("all_gather qwZ int8", {3}, waiting3, dp_comm(8, "all_gather")),
        ("all_gather qwZ int4", {3}, waiting3, dp_comm(4, "all_gather")),
        ("reduce_scatter exact", {3}, waiting3, dp_comm(None, "reduce_scatter")),
        ("fsdp forward all_gather", {3}, waiting3, dp_fsdp),
        # on zeropp's own groups, nothing passed to zeropp (the default group is the data-parallel group)
        ("reduce_scatter qgZ, rank 1 skips", {1}, {0, 2, 3}, default_comm(4, "reduce_scatter")),
        ("reduce_scatter qgZ, node 1 skips", {2, 3}, {0, 1}, default_comm(4, "reduce_scatter")),
        ("hpZ partition all_gather", {1}, {0}, default_comm(None, "all_gather", size=D)),
        ("subgroup all_gather", {3}, {0}, pair_subgroup),
        ("fsdp backward reduce_scatter", {1}, {0, 2, 3}, world_fsdp(None)),
        ("fsdp hpZ backward all_gather", {1}, {0, 2, 3}, world_fsdp(D)),
        # an explicit zeropp timeout wins over the default group's
        ("reduce_scatter qgZ, explicit timeout", {2, 3}, {0, 1}, default_comm(4, "reduce_scatter", explicit_s)),
        # last: breaks the default group itself (the default topology, zeropp.initialize's, over it)
        ("all_gather exact, default topology", {3}, waiting3, default_topology),
    ]


def _barrier(store: dist.Store, key: str, rank: int, world: int) -> None:
    """Wait until every rank has reached ``key`` (on the file store: no process group, no short timeout)."""
    store.set(f"{key}/{rank}", "1")
    store.wait([f"{key}/{r}" for r in range(world)], timedelta(seconds=120))


def skipped_calls(rank: int, world: int, sync_path: str, timeout_s: float, explicit_s: float) -> dict:
    """Run every case; on each waiting rank return ``{case: {"elapsed": s, "message": str, "type": str}}``
    (elapsed from just before the call to the raise), plus the default topology's timeout."""
    assert world == 4
    store = dist.FileStore(sync_path, world)
    out: dict = {}
    for name, _skipping, waiting, setup in _cases(rank, timeout_s, explicit_s):
        steps = iter(range(100))

        def sync(name: str = name, steps=steps) -> None:
            _barrier(store, f"{name}/{next(steps)}", rank, world)

        sync()
        call = setup(sync)
        sync()
        if rank in waiting:
            t0 = time.monotonic()
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the test asserts the type, with the message
                out[name] = {"elapsed": time.monotonic() - t0, "message": str(e), "type": type(e).__name__}
            else:
                out[name] = {"elapsed": time.monotonic() - t0, "message": "", "type": "returned"}
        # the skipping ranks stay alive, not calling (a hang without the timeout), until every waiting rank raised
        sync()
    out["default topology timeout"] = comm.get_default_topology().timeout.total_seconds()
    return out
