"""Workers for test_plan.py's calibration test: ``zeropp.plan.calibrate.run`` on gloo ranks emulating nodes by host
name."""

from __future__ import annotations

from dataclasses import asdict

from zeropp.comm import Topology
from zeropp.plan.calibrate import run


def calibrate(rank: int, world: int, ranks_per_node: int, path: str) -> dict:
    topology = Topology(ranks_per_node=ranks_per_node, host=f"node{rank // ranks_per_node}")
    # 8 MiB shards: on a loaded 2-core box a one-element step can take milliseconds (scheduling); the fit over four
    # sizes (a repeated median) and the median of 3 calls per size damp single stalls
    cluster = run(path, topology, chunk_bytes=8 << 20, matmul=128, copy_bytes=4 << 20, repeats=3)
    return asdict(cluster)
