"""All-gather, exact or block-quantized (qwZ), over the data-parallel group or a node-local (hpZ) group.

Quantized: each rank packs its shard (codes then scales, ``zeropp.quant.format``) into ONE uint8 buffer of
``B = fmt.packed_bytes(shard.numel())`` bytes, ONE ``all_gather_into_tensor`` moves the ``P`` packs, and
``dequantize_chunks`` writes rank ``i``'s values straight into ``out[i * numel:(i + 1) * numel]`` (no temporary,
no concatenation copy). Every rank, its own part included, ends with the same dequantized values.

``pack_shard`` and ``all_gather_packed`` split the quantized gather in two, for a shard that is gathered several
times between changes (the weight-delta tier's hpZ secondary, ``zeropp.engine.weight_deltas``): quantize once, then
gather the pack as often as needed. ``all_gather_packed(pack_shard(x, bits), x.numel(), bits)`` writes the same
values, bit for bit, and counts the same bytes as ``all_gather(x, bits)`` on a group of more than one rank (on one,
``all_gather`` copies ``x`` and ``all_gather_packed`` dequantizes the pack).

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
    return (yield from _packed_steps(quantize_chunks(shard, fmt), shard.numel(), out, fmt, pg, size, same_node))


def pack_shard(shard: torch.Tensor, bits: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """The pack a quantized ``all_gather`` of ``shard`` sends (uint8, ``BlockFormat(bits, block_size).packed_bytes(
    shard.numel())`` bytes: codes then float32 scales), for ``all_gather_packed``."""
    check_bits(bits)
    check_input(shard, "shard", quantized=True)
    return quantize_chunks(shard.view(-1), BlockFormat(bits, block_size))


def all_gather_packed(
    pack: torch.Tensor,
    numel: int,
    bits: int,
    *,
    group: ProcessGroup | None = None,
    topology: Topology | None = None,
    out: torch.Tensor,
    async_op: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor | CollectiveWork:
    """``all_gather(shard, bits, ...)`` of a shard already packed by ``pack_shard(shard, bits)``: gather every
    rank's ``pack`` (of ``numel`` elements, every rank the same) and dequantize rank ``i``'s into ``out[i * numel:(i
    + 1) * numel]``, its own included, even on a group of one. ``out``: contiguous, any float dtype, ``P * numel``
    elements, on ``pack``'s device. Returns ``out`` (or a ``CollectiveWork`` when ``async_op``)."""
    check_bits(bits)
    if bits is None:
        raise ValueError("all_gather_packed needs the bits of the pack (8, 4 or 2), not None")
    fmt = BlockFormat(bits, block_size)
    if pack.dtype != torch.uint8 or pack.dim() != 1 or pack.numel() != fmt.packed_bytes(numel):
        raise ValueError(f"pack must be a flat uint8 tensor of {fmt.packed_bytes(numel)} bytes (pack_shard of {numel} "
                         f"elements at {bits} bits, block {block_size}); got {pack.dtype} {tuple(pack.shape)}")
    topo = topology if topology is not None else get_default_topology()
    pg = topo.group if group is None else group
    size = dist.get_world_size(pg)
    check_out(out, size * numel, pack.device, dtype=None, float_only=True)
    record = call_record("all_gather", numel=numel, dtype=dtype_code(pack.dtype), bits=bits, block_size=block_size,
                         out_dtype=dtype_code(out.dtype))
    verify_agreement(topo.verified_calls, pg, pack.device, record)
    what = f"all_gather_packed(bits={bits}) of {numel} elements per rank over ranks {dist.get_process_group_ranks(pg)}"
    steps = _packed_steps(pack, numel, out, fmt, pg, size, topo.same_node_count(pg) if size > 1 else 1)
    return run(steps, async_op, (pack, out), what)


def _packed_steps(
    pack: torch.Tensor, numel: int, out: torch.Tensor, fmt: BlockFormat, pg: ProcessGroup, size: int, same_node: int
) -> Generator[Pending, None, torch.Tensor]:
    flat = out.view(-1)
    if size == 1:
        accounting.record("all_gather", accounting.Traffic())
        dequantize_chunks(pack, fmt, 1, numel, flat)
        return out
    gathered = torch.empty(size * pack.numel(), dtype=torch.uint8, device=pack.device)
    accounting.record("all_gather", accounting.gather_traffic(pack.numel(), size, same_node))
    yield all_gather_flat(gathered, pack, group=pg, async_op=True), (pack, gathered), ""
    dequantize_chunks(gathered, fmt, size, numel, flat)
    return out
