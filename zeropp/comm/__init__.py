"""ZeRO++ collectives on torch.distributed (NCCL on GPU, gloo on CPU), built on ``zeropp.quant``.

* ``Topology``: nodes of a data-parallel group, its intra-node, inter-node and hpZ partition groups;
* ``all_gather``: exact or quantized (qwZ) all-gather, over the DP group or a node-local (hpZ) group;
  ``pack_shard`` / ``all_gather_packed``: the quantized one in two halves (quantize once, gather the pack often);
* ``reduce_scatter``: exact or two-hop quantized (qgZ) reduce-scatter, with optional ``ErrorFeedback``
  (``BucketErrorFeedback``: several buffers' residuals for one reduce-scatter of them side by side);
* ``all_reduce``: exact sum or average over a group (MiCS's cross-group gradient reduction);
* ``exchange``: one byte buffer to chosen peers and theirs back (``exchange_parts``: in parts, each waited for on
  its own); ``pack_delta`` / ``add_delta``: the quantized
  differences the weight-delta tier sends with it;
* ``onebit_reduce_scatter``: 1-bit Adam's sign-and-scale momentum exchange (``zeropp.comm.onebit``);
* ``stats`` / ``reset_stats``: bytes each collective sent and received, intra- and inter-node.

Example (under torchrun; 2 emulated nodes of 2 ranks on one machine with ``ZEROPP_RANKS_PER_NODE=2``)::

    dist.init_process_group("gloo")              # or "nccl"
    topo = comm.Topology()                        # collective: all ranks create it
    full = comm.all_gather(shard, bits=8, topology=topo)                       # qwZ over the DP group
    full = comm.all_gather(secondary, bits=None, group=topo.intra_group, topology=topo)   # hpZ, in the node
    grad_shard = comm.reduce_scatter(grad, bits=4, op=comm.ReduceOp.AVG, topology=topo)  # qgZ, slice r
    work = comm.reduce_scatter(grad, bits=4, topology=topo, async_op=True); ...; grad_shard = work.wait()
    comm.stats()["reduce_scatter"]["sent_inter"]  # bytes this rank sent across nodes

Every distinct call (kind, group, numel, dtype, bits, block size, op) is checked once for agreement across the
ranks (later identical calls cost nothing); ``ZEROPP_DEBUG=1`` checks every call. A collective failing in the
backend (a timeout, a peer gone) raises ``CollectiveError`` naming it. ``Arrival`` checks, with a bounded wait,
that every rank of a group reached a call before a collective that a program might make on some ranks only.
This package knows nothing of ``nn.Module``; it uses only the public ops of ``zeropp.quant``.
"""

from .accounting import Traffic, reset_stats, stats
from .all_gather import all_gather, all_gather_packed, pack_shard
from .all_reduce import all_reduce
from .arrival import Arrival, ArrivalError
from .checks import debug_enabled
from .deltas import add_delta, pack_delta
from .error_feedback_bucket import BucketErrorFeedback
from .exchange import exchange, exchange_parts
from .onebit import onebit_reduce_scatter
from .reduce_scatter import ErrorFeedback, ReduceOp, derive_seed, hop_seed, reduce_scatter, shard_range
from .topology import (
    ENV_RANKS_PER_NODE,
    Topology,
    get_default_topology,
    set_default_topology,
)
from .work import CollectiveError, CollectiveWork

__all__ = [
    "Arrival",
    "ArrivalError",
    "BucketErrorFeedback",
    "ENV_RANKS_PER_NODE",
    "CollectiveError",
    "CollectiveWork",
    "ErrorFeedback",
    "ReduceOp",
    "Topology",
    "Traffic",
    "add_delta",
    "all_gather",
    "all_gather_packed",
    "all_reduce",
    "debug_enabled",
    "derive_seed",
    "exchange",
    "exchange_parts",
    "get_default_topology",
    "hop_seed",
    "onebit_reduce_scatter",
    "pack_delta",
    "pack_shard",
    "reduce_scatter",
    "reset_stats",
    "set_default_topology",
    "shard_range",
    "stats",
]
