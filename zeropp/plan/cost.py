"""Time of one collective call on a ``Cluster``: alpha-beta costs of the algorithms gloo and NCCL run, and the cost of
the quantization kernels.

* ring (all-gather, reduce-scatter; all-reduce = both): ``group - 1`` steps (twice that for an all-reduce, and for
  an exact reduce-scatter on gloo, which runs it as an all-reduce: ``Cluster.backend``), each
  moving one ``chunk`` per rank to its ring neighbour. Inside a node a step costs ``alpha_intra + chunk /
  intra_bw``. A ring that spans nodes (ranks ordered node by node) crosses each node's link once per step in each
  direction, and the ``groups_per_node`` rings that have ranks on one node cross it at the same time, so a step
  costs ``alpha_cross + max(chunk / intra_bw, groups_per_node * chunk / inter_bw)``. (The ring carries ``(group -
  1) * chunk`` over each node link; ``zeropp.comm.accounting`` counts ``(group - same_node) * chunk`` per rank, the
  volume any bandwidth-optimal algorithm moves between nodes: both are reported, the time uses the ring's.)
* pairwise (all-to-all, exchange): every rank sends its bytes straight to each peer at once; the node link carries
  the inter-node bytes of all the node's ranks: ``alpha + max(intra bytes / intra_bw, node's inter bytes /
  inter_bw)``, one latency (the sends are posted together): ``alpha_intra`` inside a node, ``alpha_cross``
  across.
* ``alpha_cross = max(alpha_inter, alpha_intra)``: a message between nodes takes the same per-message software
  path as one inside a node (gloo's TCP transport, NCCL's proxy) and then the node link, so its latency is at
  least the intra-node one. A calibrated ``alpha_inter`` below ``alpha_intra`` is the fit's noise (the robust fit
  clamps its intercept at 0: on the 2-core box 0 ms across nodes against 2.4 ms inside at 1 Gbit/s); GPU clusters
  (``Cluster.default``: 20 us against 5 us) are unchanged.
* kernels (qwZ/qgZ quantize, dequantize, fused reduce): ``bytes read and written / kernel_bw``, memory-bound at
  ``mem_bw`` unless the cluster has a measured ``kernel_bw`` (``bench/cost_model.py`` predicts the rewritten GPU
  kernels at floor/time 1.0 on an H100; the CPU's native kernels run below the copy's bandwidth, and
  ``zeropp.plan.calibrate`` measures them).

Each call's time is attributed to the link class that bounds it ("intra" or "inter").
"""

from __future__ import annotations

from .cluster import Cluster
from .traffic import Collective


def cross_latency(cluster: Cluster) -> float:
    """Seconds of latency of one message between nodes, ``max(inter_latency, intra_latency)`` (module docstring)."""
    return max(cluster.inter_latency, cluster.intra_latency)


def call_time(c: Collective, cluster: Cluster) -> tuple[float, str]:
    """Seconds of one call of ``c`` and the link class ("intra" or "inter") that bounds it."""
    if c.group <= 1:
        return 0.0, "intra"
    crosses = c.group > c.same_node
    if c.algorithm == "ring":
        as_all_reduce = c.kind == "all_reduce" or (c.kind == "reduce_scatter" and cluster.backend == "gloo")
        steps = (c.group - 1) * (2 if as_all_reduce else 1)
        intra = c.chunk / cluster.intra_bw
        if not crosses:
            return steps * (cluster.intra_latency + intra), "intra"
        inter = c.groups_per_node * c.chunk / cluster.inter_bw
        return steps * (cross_latency(cluster) + max(intra, inter)), "inter" if inter >= intra else "intra"
    if c.algorithm == "pairwise":
        intra = c.traffic.sent_intra / cluster.intra_bw
        inter = cluster.ranks_per_node * c.traffic.sent_inter / cluster.inter_bw
        alpha = cross_latency(cluster) if crosses else cluster.intra_latency
        return alpha + max(intra, inter), "inter" if inter > intra else "intra"
    raise ValueError(f"unknown collective algorithm {c.algorithm!r}")


def kernel_time(c: Collective, cluster: Cluster) -> float:
    """Seconds of one call's quantization kernels: their bytes at ``kernel_bw`` (``mem_bw`` when not measured)."""
    return c.kernel_bytes / (cluster.kernel_bw or cluster.mem_bw)
