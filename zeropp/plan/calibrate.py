"""``python -m zeropp.plan --calibrate FILE``: measure this cluster's links and rates and write the ``Cluster`` JSON
the planner reads (``--cluster FILE``). Run it on every rank, under torchrun or ``python -m zeropp.cluster``::

    torchrun --nnodes 2 --nproc-per-node 8 ... -m zeropp.plan --calibrate cluster.json
    python -m zeropp.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- python -m zeropp.plan --calibrate c.json

What it measures (each a median over ``repeats`` timed calls after one warm-up, the slowest rank's median taken
so every rank writes the same numbers):

* **links**: ring all-gathers (``torch.distributed.all_gather``, the algorithm ``zeropp.plan.cost`` models) of a
  one-element and a ``chunk``-byte shard per rank, over the node's ranks (``Topology.intra_group``) and over the
  ranks of one local index on every node (``Topology.inter_group``; the ``d`` such groups run at once and share
  each node's link, as ``cost.call_time`` assumes). A ring of ``g`` ranks takes ``g - 1`` steps; a step of ``c``
  bytes takes ``alpha + c / bw`` inside a node and ``alpha + d c / inter_bw`` across nodes. The one-element step
  is the latency ``alpha``, the slope between the two sizes the bandwidth.
* **compute**: a square matmul of ``matmul`` rows in the compute dtype (bf16 on a GPU, float32 on a CPU),
  ``2 n^3`` FLOPs per call: ``flops``.
* **memory bandwidth**: a copy of ``copy_bytes`` bytes, read and written: ``mem_bw``.
* **memory per rank**: the device's total memory, or on a CPU the host's physical memory over its ranks.

Not measured (left at ``Cluster``'s defaults, the file says which): the host link, host memory and NVMe bandwidths
of the offload tiers, and ``overlap``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm.topology import Topology
from .cluster import Cluster

NOT_MEASURED = ("host_bw", "host_mem_bw", "nvme_bw", "overlap")
"""``Cluster`` fields a calibration leaves at their defaults."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device,
                 group: dist.ProcessGroup | None = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after one warm-up; with ``group``, each call starts after a
    barrier of it (the members start together, as in a training step)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ring_step(group: dist.ProcessGroup, numel: int, repeats: int, device: torch.device) -> float:
    """Seconds of one step of a ring all-gather of ``numel`` float32 elements per rank over ``group``."""
    size = dist.get_world_size(group)
    shard = torch.ones(numel, dtype=torch.float32, device=device)
    out = [torch.empty_like(shard) for _ in range(size)]
    return _median_time(lambda: dist.all_gather(out, shard, group=group), repeats, device, group) / (size - 1)


def _fit(name: str, small: float, large: float, nbytes: int) -> tuple[float, float]:
    """(latency s, seconds per byte) from a one-element step and an ``nbytes`` step.

    Raises:
        ValueError: when the large step is not slower than the small one (the difference is lost in noise).
    """
    if not large > small:
        raise ValueError(f"calibration of the {name} link: a step of {nbytes} bytes took {large:.3g} s, not more than "
                         f"a one-element step ({small:.3g} s): the size is lost in noise; raise chunk_bytes")
    return small, (large - small) / (nbytes - 4)


def measure(topology: Topology, *, chunk_bytes: int = 4 << 20, matmul: int = 1024, copy_bytes: int = 64 << 20,
            repeats: int = 5, device: torch.device | None = None) -> Cluster:
    """Measure the cluster of ``topology`` (a collective over its group: every rank calls it with the same
    arguments) and return the same ``Cluster`` on every rank (see the module docstring).

    Args:
        topology: the data-parallel layout; needs at least 2 nodes and 2 ranks per node (both link classes).
        chunk_bytes: the large all-gather shard per rank, bytes (a multiple of 4).
        matmul: the matmul's side, rows.
        copy_bytes: the copied buffer, bytes.
        repeats: timed calls per measurement.
        device: where tensors live (default: the current CUDA device if CUDA is available, else the CPU).

    Raises:
        ValueError: for a layout with one node or one rank per node, bad sizes, or a measurement lost in noise.
    """
    d, n = topology.ranks_per_node, topology.num_nodes
    if d < 2 or n < 2:
        raise ValueError(f"calibration needs at least 2 nodes and 2 ranks per node to measure both link classes; "
                         f"this layout is {n} node(s) x {d} rank(s)")
    for name, value, least in (("chunk_bytes", chunk_bytes, 8), ("matmul", matmul, 1), ("copy_bytes", copy_bytes, 4),
                               ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"calibration {name}={value!r} must be an integer >= {least}")
    if chunk_bytes % 4:
        raise ValueError(f"calibration chunk_bytes={chunk_bytes} must be a multiple of 4 (float32 elements)")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    steps = {}
    for link, group in (("intra", topology.intra_group), ("inter", topology.inter_group)):
        steps[link] = (_ring_step(group, 1, repeats, device), _ring_step(group, chunk_bytes // 4, repeats, device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(matmul, matmul, device=device, dtype=dtype)
    matmul_s = _median_time(lambda: a @ a, repeats, device)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), repeats, device)
    times = torch.tensor([*steps["intra"], *steps["inter"], matmul_s, copy_s], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=topology.group)  # the slowest rank's, the same everywhere
    intra_small, intra_large, inter_small, inter_large, matmul_s, copy_s = times.tolist()
    intra_alpha, intra_beta = _fit("intra-node", intra_small, intra_large, chunk_bytes)
    inter_alpha, inter_beta = _fit("inter-node", inter_small, inter_large, chunk_bytes)
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / d
    backend = "gloo" if dist.get_backend(topology.group) == "gloo" else "nccl"
    return Cluster(n, d, 1.0 / intra_beta, d / inter_beta, intra_alpha, inter_alpha, memory,
                   2.0 * matmul**3 / matmul_s, 2.0 * copy_bytes / copy_s, backend=backend)


def run(path: str, topology: Topology | None = None, **kwargs: Any) -> Cluster:
    """``measure`` the cluster (on ``topology``, default ``Topology()`` of the world) and write it as JSON to
    ``path`` from the group's first rank; returns it on every rank."""
    topology = topology or Topology()
    cluster = measure(topology, **kwargs)
    if topology.rank == 0:
        with open(path, "w") as f:
            f.write(cluster.to_json() + "\n")
    dist.barrier(group=topology.group)
    return cluster


def main(path: str) -> int:
    """The ``--calibrate`` entry point: joins the process group torchrun describes (NCCL on a GPU, gloo on a CPU),
    measures, writes ``path``, prints a summary on rank 0."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ValueError("--calibrate runs on every rank of a job: start it under torchrun or python -m zeropp.cluster "
                         "(RANK and WORLD_SIZE are not set)")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        cluster = run(path)
        if dist.get_rank() == 0:
            print(f"wrote {path}: {cluster.nodes} x {cluster.ranks_per_node} ranks, intra "
                  f"{cluster.intra_bw * 8 / 1e9:.4g} Gbit/s per rank (alpha {cluster.intra_latency * 1e6:.3g} us), "
                  f"inter {cluster.inter_bw * 8 / 1e9:.4g} Gbit/s per node "
                  f"(alpha {cluster.inter_latency * 1e6:.3g} us), "
                  f"{cluster.flops / 1e12:.4g} TFLOP/s, {cluster.mem_bw / 1e9:.4g} GB/s memory; not measured: "
                  f"{', '.join(NOT_MEASURED)} (defaults)")
    finally:
        dist.destroy_process_group()
    return 0
