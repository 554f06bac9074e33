"""ZeRO++ collectives on torch.distributed (NCCL on GPU, gloo on CPU), built on ``zeropp.quant``.

* ``Topology``: nodes of a data-parallel group, its intra-node, inter-node and hpZ partition groups;
* ``all_gather``: exact or quantized (qwZ) all-gather, over the DP group or a node-local (hpZ) group;
* ``reduce_scatter``: exact or two-hop quantized (qgZ) reduce-scatter, with optional ``ErrorFeedback``;
* ``stats`` / ``reset_stats``: bytes each collective sent and received, intra- and inter-node.

This package knows nothing of ``nn.Module``; it uses only the public ops of ``zeropp.quant``.
"""

from .all_gather import all_gather
from .checks import debug_enabled
from .reduce_scatter import ErrorFeedback, ReduceOp, reduce_scatter, shard_range
from .accounting import Traffic, reset_stats, stats
from .topology import ENV_RANKS_PER_NODE, Topology, get_default_topology, set_default_topology
from .work import CollectiveWork

__all__ = [
    "ENV_RANKS_PER_NODE",
    "CollectiveWork",
    "ErrorFeedback",
    "ReduceOp",
    "Topology",
    "Traffic",
    "all_gather",
    "debug_enabled",
    "get_default_topology",
    "reduce_scatter",
    "reset_stats",
    "set_default_topology",
    "shard_range",
    "stats",
]
