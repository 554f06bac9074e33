"""All-gather, exact or block-quantized (qwZ), over the data-parallel group or a node-local (hpZ) group.

Quantized: each rank packs its shard (codes then scales, ``zeropp.quant.format``) into ONE uint8 buffer of
``B = fmt.packed_bytes(shard.numel())`` bytes, ONE ``all_gather_into_tensor`` moves the ``P`` packs, and
``dequantize_chunks`` writes rank ``i``'s values straight into ``out[i * numel:(i + 1) * numel]`` (no temporary,
no concatenation copy). Every rank, its own part included, ends with the same dequantized values.

Bytes on the wire per rank (see ``zeropp.comm.accounting``): ``(P - 1) * B`` sent and received, ``B`` being the
pack size (quantized) or ``numel * itemsize`` (exact).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..quant import DEFAULT_BLOCK_SIZE, BlockFormat, dequantize_chunks, quantize_chunks
from . import accounting
from ._dist import all_gather_flat
from .checks import (
    call_record,
    check_bits,
    check_input,
    check_out,
    dtype_code,
    verify_agreement,
)
from .topology import Topology, get_default_topology
from .work import CollectiveWork, Pending, run


def all_gather(
    shard: torch.Tensor,
    bits: int | None = None,
    *,
    group: ProcessGroup | None = None,
    topology: Topology | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor | CollectiveWork:
    """Gather every rank's ``shard`` into ``out``, rank ``i``'s shard at ``out.view(-1)[i * n:(i + 1) * n]``
    (``n = shard.numel()``), like ``torch.distributed.all_gather_into_tensor``.

    Args:
        shard: this rank's contiguous shard; every rank passes the same numel and dtype.
        bits: ``None`` for an exact gather, 8 or 4 to block-quantize the shards for the wire (qwZ).
        group: the group to gather over: the data-parallel group (default, ``topology.group``), or a group of
            ``topology`` such as ``topology.intra_group`` or ``topology.partition_group(s)`` (hpZ).
        topology: node layout used for byte accounting and the default group (default: the world's,
            ``get_default_topology()``, created on first use).
        out: contiguous tensor of ``P * n`` elements (any shape) on ``shard``'s device; exact gathers need
            ``shard``'s dtype, quantized ones take any float dtype. Default: a new flat tensor of ``shard``'s dtype.
        async_op: return a ``CollectiveWork`` whose ``wait()`` returns ``out``.
        block_size: elements per quantization block (quantized only).

    Returns:
        ``out`` (or a ``CollectiveWork`` when ``async_op``).
    """
    check_bits(bits)
    check_input(shard, "shard", quantized=bits is not None)
    topo = topology if topology is not None else get_default_topology()
    pg = topo.group if group is None else group
    size = dist.get_world_size(pg)
    numel = shard.numel()
    if out is None:
        out = torch.empty(size * numel, dtype=shard.dtype, device=shard.device)
    check_out(
        out, size * numel, shard.device, dtype=shard.dtype if bits is None else None, float_only=bits is not None
    )
    fmt = BlockFormat(bits, block_size) if bits is not None else None
    record = call_record("all_gather", numel=numel, dtype=dtype_code(shard.dtype), bits=bits or 0,
                         block_size=block_size, out_dtype=dtype_code(out.dtype))
    verify_agreement(topo.verified_calls, pg, shard.device, record)
    what = (f"all_gather(bits={bits}) of {numel} {shard.dtype} elements per rank over ranks "
            f"{dist.get_process_group_ranks(pg)}")
    return run(_all_gather_steps(shard.view(-1), out, fmt, pg, size, topo), async_op, (shard, out), what)


def _all_gather_steps(
    shard: torch.Tensor, out: torch.Tensor, fmt: BlockFormat | None, pg: ProcessGroup, size: int, topo: Topology
) -> Generator[Pending, None, torch.Tensor]:
    flat = out.view(-1)
    if size == 1 or shard.numel() == 0:
        accounting.record("all_gather", accounting.Traffic())
        flat.copy_(shard)  # one rank: nothing to move, and nothing to quantize
        return out
    same_node = topo.same_node_count(pg)
    if fmt is None:
        nbytes = shard.numel() * shard.element_size()
        accounting.record("all_gather", accounting.gather_traffic(nbytes, size, same_node))
        yield all_gather_flat(flat, shard, group=pg, async_op=True), (), ""
        return out
    pack = quantize_chunks(shard, fmt)
    gathered = torch.empty(size * pack.numel(), dtype=torch.uint8, device=shard.device)
    accounting.record("all_gather", accounting.gather_traffic(pack.numel(), size, same_node))
    yield all_gather_flat(gathered, pack, group=pg, async_op=True), (pack, gathered), ""
    dequantize_chunks(gathered, fmt, size, shard.numel(), flat)
    return out
