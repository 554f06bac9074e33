"""``all_reduce``: the exact sum or average of a float tensor over a group of a topology's ranks, counted in
``stats()["all_reduce"]`` (MiCS's cross-group gradient reduction, ``zeropp.engine.partition``).

Bytes (``zeropp.comm.accounting``): a ring all-reduce of ``N`` elements of ``b`` bytes over ``R`` ranks is a
reduce-scatter and an all-gather of ``ceil(N / R)`` elements each, so each rank sends and receives twice what an
all-gather of ``ceil(N / R) * b`` bytes moves, split by the node of each peer as there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..quant import chunk_numel
from . import accounting
from .reduce_scatter import ReduceOp, _as_op
from .topology import Topology
from .work import run


def all_reduce(tensor: torch.Tensor, *, group: ProcessGroup, topology: Topology,
               op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
    """Sum (``ReduceOp.SUM``) or average (``ReduceOp.AVG``: the sum divided once by the group size) ``tensor``
    over ``group``, in place, and return it.

    Args:
        tensor: a contiguous floating point tensor, the same numel and dtype on every rank of ``group``.
        group: a process group of ``topology``'s ranks holding this rank (e.g. from ``Topology.subgroup``).
        topology: the node layout the bytes are split by (intra- or inter-node peers).
        op: ``ReduceOp.SUM`` (default) or ``ReduceOp.AVG``.

    Raises:
        CollectiveError: the backend failed (a timeout, a peer gone), naming the call.
    """
    if not tensor.is_floating_point() or not tensor.is_contiguous():
        raise TypeError(f"all_reduce takes a contiguous floating point tensor, got {tensor.dtype} "
                        f"(contiguous={tensor.is_contiguous()})")
    reduce_op = _as_op(op)
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
