"""The 1-bit reduce-scatter of 1-bit Adam's compressed phase (``zeropp.engine.onebit`` has the algorithm).

Every rank splits its compensated momentum ``x`` (``P * S`` elements) into ``P`` slices of ``S``, compresses each to
signs and per-block scales (``zeropp.quant.onebit``), keeps what the compression lost as its new worker error, and
sends slice ``r`` to rank ``r`` in one ``all_to_all_single`` of uint8 rows. Rank ``r`` decodes the ``P`` rows it
receives and averages them (summed in float64 in group-rank order, divided once, rounded once to fp32): its slice of
the mean of the ranks' compressed momenta. No second compression and no all-gather follow (DeepSpeed's
``compressed_allreduce`` recompresses the mean and all-gathers it, with a server error): the owner of a slice is the
only rank that uses it.

Bytes (counted under ``"reduce_scatter"`` in ``zeropp.comm.stats``): ``(P - 1) * (S / 8 + 4 * S / B)`` sent and the
same received per rank, split intra/inter-node by peer as every all-to-all (``zeropp.comm.accounting``).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.distributed as dist

from ..quant.onebit import onebit_compress, onebit_decompress, onebit_packed_bytes
from . import accounting
from .checks import call_record, dtype_code, verify_agreement
from .topology import Topology, get_default_topology
from .work import Pending, run


def onebit_reduce_scatter(x: torch.Tensor, out: torch.Tensor, error: torch.Tensor, *, block_size: int,
                          topology: Topology | None = None) -> torch.Tensor:
    """Average the 1-bit compression of every rank's ``x`` over the data-parallel group; this rank's slice goes
    into ``out``, and ``x`` minus what this rank sent (its compression error) into ``error``.

    Args:
        x: contiguous float32, ``P * S`` elements (``S`` a multiple of ``block_size``); slice ``r`` goes to rank
            ``r``. Every rank passes the same numel.
        out: float32, ``S`` elements: the mean over the ranks of their decoded slice ``rank``.
        error: float32, ``P * S`` elements (may be ``x`` itself): set to ``x - decoded(x)``.
        block_size: elements per scale (a multiple of 8).
        topology: the data-parallel group (default: ``get_default_topology()``).

    Returns:
        ``out``.
    """
    topo = topology if topology is not None else get_default_topology()
    size = topo.world_size
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() % size:
        raise ValueError(f"onebit_reduce_scatter takes a contiguous float32 tensor of P * S elements (P={size}), got "
                         f"{x.dtype} of {x.numel()} elements")
    s = x.numel() // size
    if out.numel() != s or error.numel() != x.numel():
        raise ValueError(f"onebit_reduce_scatter: out must have {s} elements and error {x.numel()}, got "
                         f"{out.numel()} and {error.numel()}")
    nbytes = onebit_packed_bytes(s, block_size)
    record = call_record("reduce_scatter", numel=x.numel(), dtype=dtype_code(x.dtype), bits=1, block_size=block_size)
    verify_agreement(topo.verified_calls, topo.group, x.device, record)
    what = f"onebit_reduce_scatter of {x.numel()} float32 elements (blocks of {block_size}) over ranks {topo.ranks}"
    return run(_steps(x, out, error, block_size, nbytes, topo), False, (x, out), what)


def _steps(x: torch.Tensor, out: torch.Tensor, error: torch.Tensor, block_size: int, nbytes: int,
           topo: Topology) -> Generator[Pending, None, torch.Tensor]:
    size = topo.world_size
    s = x.numel() // size
    rows = x.view(size, s)
    send = onebit_compress(rows, block_size)
    error.view(size, s).copy_(rows - onebit_decompress(send, s, block_size))
    same = topo.same_node_count(topo.group)
    accounting.record("reduce_scatter", accounting.all_to_all_traffic(nbytes, same - 1, size - same))
    recv = torch.empty_like(send)
    if size > 1:
        yield dist.all_to_all_single(recv, send, group=topo.group, async_op=True), (send, recv), ""
    else:
        recv.copy_(send)
    decoded = onebit_decompress(recv, s, block_size)
    total = decoded[0].to(torch.float64)
    for q in range(1, size):
        total.add_(decoded[q])
    out.view(-1).copy_(total.div_(size))
    return out
