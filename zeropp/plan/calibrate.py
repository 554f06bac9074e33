"""``python -m zeropp.plan --calibrate FILE``: measure this cluster's links and rates and write the ``Cluster`` JSON
the planner reads (``--cluster FILE``). Run it on every rank, under torchrun or ``python -m zeropp.cluster``::

    torchrun --nnodes 2 --nproc-per-node 8 ... -m zeropp.plan --calibrate cluster.json
    python -m zeropp.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- python -m zeropp.plan --calibrate c.json

What it measures (each a median over ``repeats`` timed calls after one warm-up, the slowest rank's median taken
so every rank writes the same numbers):

* **links**: ring all-gathers (``torch.distributed.all_gather``, the algorithm ``zeropp.plan.cost`` models) of
  ``SIZES`` shards per rank (one element, and 1/8, 1/2 and all of ``chunk`` bytes), over the node's ranks
  (``Topology.intra_group``) and over the ranks of one local index on every node (``Topology.inter_group``; the
  ``d`` such groups run at once and share each node's link, as ``cost.call_time`` assumes). A ring of ``g`` ranks
  takes ``g - 1`` steps; a step of ``c`` bytes takes ``alpha + c / bw`` inside a node and ``alpha + d c /
  inter_bw`` across nodes. The line through the step times is fitted robustly (``fit_line``, a repeated median),
  so one size stalled by load moves neither the latency nor the bandwidth (a single one-element step gave 68 ms
  for a 2 ms link under a load of 28).
* **compute**: a square matmul of ``matmul`` rows in the compute dtype (bf16 on a GPU, float32 on a CPU),
  ``2 n^3`` FLOPs per call: ``flops``. (A model's own step may run slower: ``zeropp.plan.validate`` measures that.)
* **memory bandwidth**: a copy of ``copy_bytes`` bytes, read and written: ``mem_bw``.
* **quantization kernels**: an int8 quantize and dequantize of ``copy_bytes`` of float32, their bytes counted as
  ``zeropp.plan.traffic`` counts them (each reads or writes the values and the pack): ``kernel_bw``.
* **overlap**: an all-gather of ``chunk`` bytes per rank over every rank, started asynchronously while the rank runs
  as many matmuls as take about as long, against each alone: ``overlap = (t_comm + t_compute - t_both) /
  min(t_comm, t_compute)``, clamped to [0, 1]. On a GPU the collective runs on its own engine (about 1); on a CPU
  cluster whose collectives copy and sum on the cores the ranks compute on, it competes with compute (about 0),
  except for the time it waits on a slow link. ``overlap_intra``: the same with the all-gather over the node's
  ranks (``Topology.intra_group``), the time of the collectives the intra-node link bounds (on a CPU the loopback
  is the cores' own copying: nothing to wait on).
* **memory per rank**: the device's total memory, or on a CPU the host's physical memory over its ranks.

Not measured (left at ``Cluster``'s defaults, the file says which): the host link, host memory and NVMe bandwidths
of the offload tiers.
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

NOT_MEASURED = ("host_bw", "host_mem_bw", "nvme_bw")
"""``Cluster`` fields a calibration leaves at their defaults."""

SIZES = (0.0, 0.125, 0.5, 1.0)
"""The all-gather shards per rank, fractions of ``chunk_bytes`` (0: one element)."""


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


def fit_line(name: str, sizes: list[int], times: list[float]) -> tuple[float, float]:
    """(latency s, seconds per byte) of ``times[i] = alpha + beta * sizes[i]`` for distinct ``sizes``, robustly
    (Siegel's repeated median: one stalled measurement of four moves neither): ``beta`` the median over the sizes of
    the median slope from that size to the others, ``alpha`` the median of ``times[i] - beta * sizes[i]``, at
    least 0.

    Raises:
        ValueError: when the slope is not positive (the sizes are lost in noise).
    """
    beta = statistics.median(statistics.median((times[j] - times[i]) / (sizes[j] - sizes[i])
                                               for j in range(len(sizes)) if j != i) for i in range(len(sizes)))
    if not beta > 0:
        raise ValueError(f"calibration of the {name} link: ring steps of {sizes} bytes took "
                         f"{[f'{t:.3g}' for t in times]} s, not growing with the size: the sizes are lost in noise; "
                         f"raise chunk_bytes")
    return max(0.0, statistics.median(t - beta * b for b, t in zip(sizes, times))), beta


def overlap_of(comm: float, compute: float, both: float) -> float:
    """The fraction of the shorter of a collective (``comm`` seconds alone) and a computation (``compute`` seconds
    alone) that hid under the other when both ran at once in ``both`` seconds, clamped to [0, 1]: 1 when ``both``
    is the longer alone, 0 when it is their sum (or more)."""
    return min(1.0, max(0.0, (comm + compute - both) / min(comm, compute)))


def _overlap(topology: Topology, group: dist.ProcessGroup, numel: int, matmul: torch.Tensor, repeats: int,
             device: torch.device) -> float:
    """The fraction of the shorter of an all-gather over ``group`` (this rank's: the world's or its node's) and a run
    of matmuls that hides under the other when both run at once (module docstring); every rank's the same (the
    slowest rank's times over ``topology.group``)."""
    shard = torch.ones(numel, dtype=torch.float32, device=device)
    out = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    comm = _median_time(lambda: dist.all_gather(out, shard, group=group), repeats, device, topology.group)
    one = _median_time(lambda: matmul @ matmul, repeats, device, topology.group)
    count = torch.tensor([max(1, round(comm / max(one, 1e-9)))], dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=topology.group)
    k = int(count.item())

    def compute() -> None:
        for _ in range(k):
            matmul @ matmul

    def both() -> None:
        work = dist.all_gather(out, shard, group=group, async_op=True)
        compute()
        work.wait()

    alone = _median_time(compute, repeats, device, topology.group)
    together = _median_time(both, repeats, device, topology.group)
    times = torch.tensor([comm, alone, together], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=topology.group)
    return overlap_of(*times.tolist())


def _kernel_time(numel: int, repeats: int, device: torch.device) -> tuple[float, int]:
    """(seconds, bytes) of an int8 quantize and dequantize of ``numel`` float32 elements, the bytes counted as
    ``zeropp.plan.traffic`` counts a kernel's (the values and the pack, once each per kernel)."""
    from ..quant import BlockFormat, dequantize, quantize

    x = torch.randn(numel, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    seconds = _median_time(lambda: dequantize(quantize(x, 8), out=y), repeats, device)
    return seconds, 2 * (numel * 4 + BlockFormat(8).packed_bytes(numel))


def measure(topology: Topology, *, chunk_bytes: int = 4 << 20, matmul: int = 1024, copy_bytes: int = 64 << 20,
            repeats: int = 5, device: torch.device | None = None) -> Cluster:
    """Measure the cluster of ``topology`` (a collective over its group: every rank calls it with the same
    arguments) and return the same ``Cluster`` on every rank (see the module docstring).

    Args:
        topology: the data-parallel layout; needs at least 2 nodes and 2 ranks per node (both link classes).
        chunk_bytes: the largest all-gather shard per rank, bytes (a multiple of 32, so each of ``SIZES`` is a
            whole number of float32 elements).
        matmul: the matmul's side, rows.
        copy_bytes: the copied (and quantized) buffer, bytes.
        repeats: timed calls per measurement.
        device: where tensors live (default: the current CUDA device if CUDA is available, else the CPU).

    Raises:
        ValueError: for a layout with one node or one rank per node, bad sizes, or a measurement lost in noise.
    """
    d, n = topology.ranks_per_node, topology.num_nodes
    if d < 2 or n < 2:
        raise ValueError(f"calibration needs at least 2 nodes and 2 ranks per node to measure both link classes; "
                         f"this layout is {n} node(s) x {d} rank(s)")
    for name, value, least in (("chunk_bytes", chunk_bytes, 32), ("matmul", matmul, 1),
                               ("copy_bytes", copy_bytes, 4), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"calibration {name}={value!r} must be an integer >= {least}")
    if chunk_bytes % 32:
        raise ValueError(f"calibration chunk_bytes={chunk_bytes} must be a multiple of 32 (1/8 of it whole float32 "
                         f"elements)")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    numels = [max(1, int(f * chunk_bytes) // 4) for f in SIZES]
    steps = [_ring_step(group, numel, repeats, device) for group in (topology.intra_group, topology.inter_group)
             for numel in numels]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(matmul, matmul, device=device, dtype=dtype)
    matmul_s = _median_time(lambda: a @ a, repeats, device)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), repeats, device)
    kernel_s, kernel_bytes = _kernel_time(copy_bytes // 4, repeats, device)
    times = torch.tensor([*steps, matmul_s, copy_s, kernel_s], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=topology.group)  # the slowest rank's, the same everywhere
    *steps, matmul_s, copy_s, kernel_s = times.tolist()
    sizes = [4 * numel for numel in numels]
    intra_alpha, intra_beta = fit_line("intra-node", sizes, steps[:len(sizes)])
    inter_alpha, inter_beta = fit_line("inter-node", sizes, steps[len(sizes):])
    overlap = _overlap(topology, topology.group, chunk_bytes // 4, a, repeats, device)
    overlap_intra = _overlap(topology, topology.intra_group, chunk_bytes // 4, a, repeats, device)
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / d
    backend = "gloo" if dist.get_backend(topology.group) == "gloo" else "nccl"
    return Cluster(n, d, 1.0 / intra_beta, d / inter_beta, intra_alpha, inter_alpha, memory,
                   2.0 * matmul**3 / matmul_s, 2.0 * copy_bytes / copy_s, kernel_bw=kernel_bytes / kernel_s,
                   overlap=overlap, backend=backend, overlap_intra=overlap_intra)


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
                  f"{cluster.flops / 1e12:.4g} TFLOP/s, {cluster.mem_bw / 1e9:.4g} GB/s memory, "
                  f"{cluster.kernel_bw / 1e9:.4g} GB/s quantization kernels, overlap {cluster.overlap:.2f} "
                  f"({cluster.overlap_intra:.2f} inside a node); "
                  f"not measured: "
                  f"{', '.join(NOT_MEASURED)} (defaults)")
    finally:
        dist.destroy_process_group()
    return 0
