"""``Cluster``: the machine the planner plans for: nodes, ranks per node, the two link classes, memory and rates.

Link classes: *intra* (between ranks of one node: NVLink, or the loopback of an emulated node) with a bandwidth per
rank, and *inter* (between nodes) with a bandwidth per **node** that the node's ranks share (the emulated cluster
shapes one link per node, ``zeropp.cluster``; a DGX node's 8 NICs of 400 Gbit/s are one 3.2 Tbit/s node link).
Bandwidths are in bits per second on the command line (``zeropp.cluster.rates``) and bytes per second here; each
class has a latency ``alpha`` per message (seconds).

Rates: ``flops`` is the dense training throughput one rank reaches (FLOP/s, achieved, not peak), ``mem_bw`` its
memory bandwidth (bytes/s: the quantization kernels and the optimizer step are memory-bound, ``bench/cost_model.py``
predicts the rewritten kernels at floor/time 1.0), ``host_bw`` the device-host link per rank and ``nvme_bw`` the
NVMe bandwidth per rank (offload tiers), ``host_mem_bw`` the host memory bandwidth per rank (a CPU optimizer step).
``kernel_bw`` is the rate of the
quantization kernels (bytes read and written per second) where it is not the memory bandwidth: ``None`` (the
default) times them at ``mem_bw``, which ``bench/cost_model.py`` predicts for the GPU kernels; on a CPU the native
kernels compute more per byte than a copy and the calibration measures them. ``overlap`` is the fraction of compute
time that can hide communication (1: every prefetched gather and every bucketed reduce-scatter runs under compute;
0: nothing overlaps, as on a CPU cluster whose collectives copy and sum on the cores the ranks compute on: the
calibration measures it). ``overlap_intra`` is the same fraction for the collectives bounded by the intra-node link
(``None``, the default: ``overlap``): on a CPU cluster a loopback collective is the cores' own copying and cannot
hide under compute on them, while one that waits on a shaped node link can; the calibration measures both.
``backend`` is the collective library
(``BACKENDS``): torch's gloo runs an exact ``reduce_scatter_tensor`` as an all-reduce of the whole tensor and a copy
of the rank's slice (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), twice a ring reduce-scatter's steps;
NCCL runs a ring reduce-scatter.

A calibration run (``--calibrate``, ``zeropp.plan.calibrate``) writes these fields as JSON; ``Cluster.from_json``
reads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path


BACKENDS = ("nccl", "gloo")
"""The collective libraries whose algorithms ``zeropp.plan.cost`` times."""


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` ranks; see the module docstring for the units."""

    nodes: int
    ranks_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float
    inter_latency: float
    memory: float
    flops: float
    mem_bw: float
    host_bw: float = 25e9
    host_mem_bw: float = 20e9
    nvme_bw: float = 3e9
    kernel_bw: float | None = None
    overlap: float = 1.0
    backend: str = "nccl"
    overlap_intra: float | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"cluster backend={self.backend!r} must be one of {BACKENDS}")
        for name in ("nodes", "ranks_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"cluster {name}={v!r} must be a positive integer")
        for name in ("intra_bw", "inter_bw", "memory", "flops", "mem_bw", "host_bw", "host_mem_bw", "nvme_bw"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ValueError(f"cluster {name}={v!r} must be a positive number")
        if self.kernel_bw is not None and not (isinstance(self.kernel_bw, (int, float)) and self.kernel_bw > 0
                                               and not math.isnan(self.kernel_bw)):
            raise ValueError(f"cluster kernel_bw={self.kernel_bw!r} must be a positive number, or None (mem_bw)")
        for name in ("intra_latency", "inter_latency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < math.inf):
                raise ValueError(f"cluster {name}={v!r} s must be a finite number >= 0")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"cluster overlap={self.overlap!r} must be in [0, 1]")
        if self.overlap_intra is not None and not (isinstance(self.overlap_intra, (int, float))
                                                   and 0.0 <= self.overlap_intra <= 1.0):
            raise ValueError(f"cluster overlap_intra={self.overlap_intra!r} must be in [0, 1], or None (overlap)")

    @property
    def intra_overlap(self) -> float:
        """``overlap_intra``, or ``overlap`` where it was not measured."""
        return self.overlap if self.overlap_intra is None else self.overlap_intra

    @classmethod
    def default(cls, nodes: int = 2, ranks_per_node: int = 8) -> Cluster:
        """H100 nodes, the defaults of ``python -m zeropp.plan`` and of ``"partition": "auto"`` without a
        calibration file (``zeropp.engine.auto_partition``): 3.6 Tbit/s per rank inside a node (NVLink), 100 Gbit/s
        per node across, 5 and 20 us latency, 80 GiB, 400 TFLOP/s achieved and 2.966 TB/s of memory bandwidth per
        rank, NCCL, full overlap."""
        return cls(nodes, ranks_per_node, 3.6e12 / 8, 100e9 / 8, 5e-6, 20e-6, float(80 * 2**30), 400e12, 2.966e12)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: str | Path) -> Cluster:
        """A cluster written by ``to_json`` (or by hand): every field by name, SI units as above."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the cluster file {str(path)!r}: {e}") from e
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"cluster file {str(path)!r} has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data)
