"""``all_reduce``: the sum or average of a float tensor over a group of a topology's ranks, exact or quantized,
counted in ``stats()["all_reduce"]`` (MiCS's cross-group gradient reduction, ``zeropp.engine.partition``; HSDP's
cross-replica one, ``zeropp.fsdp.hsdp``).

Exact: one ``dist.all_reduce``. Bytes (``zeropp.comm.accounting``): a ring all-reduce of ``N`` elements of ``b``
bytes over ``R`` ranks is a reduce-scatter and an all-gather of ``s = ceil(N / R)`` elements each, so each rank
sends and receives twice what an all-gather of ``s * b`` bytes moves, split by the node of each peer as there.

Quantized (``bits`` 8, 4 or 2): the tensor, zero-padded to ``R * s``, is reduce-scattered by
``zeropp.comm.reduce_scatter`` (qgZ, over the topology's nodes: one hop when each rank of the group is on its own
node, else its two hops; each rank packs each of its ``R`` slices, the owner of a slice sums the packs in float32
and divides by ``R`` for ``AVG``), then the reduced slices are all-gathered by ``zeropp.comm.all_gather`` (each rank
packs its slice once; every rank, its own included, dequantizes every pack, so all ranks end with the same values).
Bytes sent (and received) per rank and call: ``2 * (R - 1) * B(s)``, ``B`` the packed bytes
(``BlockFormat.packed_bytes``: ``ceil(s / block_size) * (block_size * bits / 8 + 4)``); split by node as each
half's own counting, and counted as one ``"all_reduce"`` call.

Error bound of the quantized ``AVG``, per element, with ``q = BlockFormat.qmax`` (127, 7, 1) and ``A_r`` the
absmax of rank ``r``'s block of its input: the reduce-scatter's error is at most ``E1 = mean over r of A_r / (2 q)``
when each rank is on its own node (one hop), and ``E1 = (2 + 1 / (2 q)) * mean over r of A_r / (2 q)`` with two
hops (the node's partial sum is requantized; its absmax is at most the sum of its ranks' ``A_r (1 + 1 / (2 q))``);
the all-gather adds at most ``(A + E1) / (2 q)`` (``A`` the absmax of the block of the exact mean):
``|out - mean| <= E1 * (1 + 1 / (2 q)) + A / (2 q)``, plus float32 rounding. ``SUM``: ``R`` times that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..quant import DEFAULT_BLOCK_SIZE, chunk_numel
from . import accounting
from .all_gather import all_gather
from .checks import check_bits
from .reduce_scatter import ReduceOp, _as_op, reduce_scatter
from .topology import Topology
from .work import run


def all_reduce(tensor: torch.Tensor, *, group: ProcessGroup | None = None, topology: Topology,
               op: ReduceOp | str = ReduceOp.SUM, bits: int | None = None,
               block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Sum (``ReduceOp.SUM``) or average (``ReduceOp.AVG``: the sum divided once by the group size) ``tensor``
    over ``group``, in place, and return it.

    Args:
        tensor: a contiguous floating point tensor, the same numel and dtype on every rank of ``group``.
        group: a process group of ``topology``'s ranks holding this rank (e.g. from ``Topology.subgroup``); default
            ``topology.group``. Quantized: ``topology.group`` only (its two hops follow that topology's nodes).
        topology: the node layout the bytes are split by (intra- or inter-node peers).
        op: ``ReduceOp.SUM`` (default) or ``ReduceOp.AVG``.
        bits: ``None`` (default) for the exact all-reduce, 8, 4 or 2 for the quantized one (module docstring).
        block_size: elements per quantization block (quantized only).

    Raises:
        ValueError: ``bits`` with a ``group`` other than ``topology.group``.
        CollectiveError: the backend failed (a timeout, a peer gone), naming the call.
    """
    if not tensor.is_floating_point() or not tensor.is_contiguous():
        raise TypeError(f"all_reduce takes a contiguous floating point tensor, got {tensor.dtype} "
                        f"(contiguous={tensor.is_contiguous()})")
    check_bits(bits)
    reduce_op = _as_op(op)
    group = topology.group if group is None else group
    if bits is not None:
        if group is not topology.group:
            raise ValueError(f"all_reduce(bits={bits}) runs over topology.group (ranks {topology.ranks}), its qgZ hops "
                             f"following that topology's nodes; got group ranks {dist.get_process_group_ranks(group)}: "
                             "pass the group's own comm.Topology as topology")
        return _quantized(tensor, topology, reduce_op, bits, block_size)
    size = dist.get_world_size(group)
    numel = tensor.numel()
    chunk = chunk_numel(numel, size) * tensor.element_size() if numel else 0
    once = accounting.gather_traffic(chunk, size, topology.same_node_count(group))
    accounting.record("all_reduce", once + once)
    what = f"all_reduce(op={reduce_op.value}) of {numel} {tensor.dtype} elements over ranks " \
           f"{dist.get_process_group_ranks(group)}"

    def steps():  # type: ignore[no-untyped-def]
        if size > 1 and numel:
            yield dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True), (tensor,), ""
            if reduce_op is ReduceOp.AVG:
                tensor.div_(size)
        return tensor

    out = run(steps(), False, (tensor,), what)
    assert isinstance(out, torch.Tensor)
    return out


def _quantized(tensor: torch.Tensor, topology: Topology, op: ReduceOp, bits: int, block_size: int) -> torch.Tensor:
    """The quantized all-reduce of the module docstring, in place."""
    size, n = topology.world_size, tensor.numel()
    if size == 1 or n == 0:
        accounting.record("all_reduce", accounting.Traffic())
        return tensor
    s = chunk_numel(n, size)
    flat = tensor.view(-1)
    full = flat if n == size * s else torch.cat([flat, flat.new_zeros(size * s - n)])
    mine = flat.new_empty(s)
    gathered = flat.new_empty(size * s)
    with accounting.combined("all_reduce"):
        reduce_scatter(full, bits, op=op, topology=topology, out=mine, block_size=block_size)
        all_gather(mine, bits, topology=topology, out=gathered, block_size=block_size)
    flat.copy_(gathered[:n])
    return tensor
