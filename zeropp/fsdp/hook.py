"""What zeropp's two FSDP2 communication hooks share: their settings, FSDP2's buffer allocation, and the test of
whether FSDP2 passed the group the hook was built for."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import comm


class FlatBufferHook:
    """Base of ``ZeroppAllGather`` and ``ZeroppReduceScatter`` (mixed in before torch's interface class, whose
    abstract ``allocate`` it provides).

    Streams (CUDA): FSDP2 calls a hook inside its own stream context (its all-gather stream, its reduce-scatter
    stream) and records an event on that stream right after the call, which later work waits on. The hooks run
    ``zeropp.comm``'s kernels and collectives synchronously on that current stream (with gloo the host returns once
    the collective is done and its copy back is ordered on the stream; with NCCL the work is enqueued there) and
    return ``None``, so FSDP2's event orders everything after them, ``async_op`` or not. Buffers the hooks allocate
    are allocated and used on that one stream. ``tests/fsdp/test_fsdp_cuda.py`` runs FSDP2 + zeropp on a CUDA mesh
    (gloo ranks sharing one GPU) against plain FSDP2 on CPU.

    Args:
        topology: the ``zeropp.comm.Topology`` of FSDP2's shard group.
        bits: 8 or 4 for the quantized collective, ``None`` for exact.
        block_size: elements per quantization block.
    """

    def __init__(self, topology: comm.Topology, bits: int | None, block_size: int) -> None:
        self.topology = topology
        self.bits = bits
        self.block_size = block_size

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new uninitialised tensor of ``size`` (FSDP2's flat input/output buffers)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def is_shard_group(self, group: dist.ProcessGroup) -> bool:
        """Whether ``group`` has the ranks of ``topology.group`` (FSDP2 passes its own group object)."""
        shard = self.topology.group
        return group is shard or dist.get_process_group_ranks(group) == dist.get_process_group_ranks(shard)
