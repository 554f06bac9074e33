"""FSDP2's parameter all-gather run by ``zeropp.comm.all_gather``: exact, or qwZ over the data-parallel group, with
quantization blocks that never span two parameters.

Subclasses FSDP2's ``AllGather``, the interface that the public ``FSDPModule.set_custom_all_gather`` takes; torch
defines it only in a private module, so it comes from ``zeropp._torch_internals`` (where a test pins the signature
implemented here and that FSDP2 calls it).

What FSDP2 passes (torch 2.13, ``_fsdp_collectives.foreach_all_gather``): ``output_tensor`` is a flat buffer of
``P * n`` elements that it allocated with ``allocate``; ``input_tensor`` is this rank's ``n`` elements, the
concatenated padded shards of every parameter of the module's FSDP2 group (the segments, ``zeropp.fsdp.segments``;
a group is one ``fully_shard`` call's modules, several for ``fully_shard([a, b])``), and a VIEW of
``output_tensor[rank * n:(rank + 1) * n]`` (an in-place gather). ``group`` is the module's shard group, except in
backward for a module wrapped with ``reshard_after_forward=N`` (hpZ, see ``zeropp.fsdp.hpz``): then it is the
post-forward group of ``N`` ranks and ``input_tensor`` holds this rank's slice of the weights the FORWARD gather
produced (dequantized, with qwZ). It reads ``output_tensor`` back split by parameter, so every rank's part must
land at ``[i * n, (i + 1) * n)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import comm
from .._torch_internals import FSDPAllGather
from ..quant.format import FLOAT_DTYPES
from .hook import FlatBufferHook
from .segments import format_parts, staging


class ZeroppAllGather(FlatBufferHook, FSDPAllGather):
    """All-gather of one FSDP2 group's flat parameter shards through ``zeropp.comm.all_gather``.

    Over ``topology.group`` (FSDP2's shard group) with ``bits`` set: qwZ with per-parameter blocks. This rank's
    segments are staged into a buffer where each one starts at a block boundary (the gaps zero: zeros do not change
    a block's absmax, so every parameter's codes are exactly those of its shard quantized alone, its last block
    partial), that buffer is quantized into one packed buffer BEFORE anything is written to ``output_tensor`` (the
    input is a view of it), one all-gather moves the packs, every rank's part, its own included, is dequantized,
    and each segment is copied to its place in ``output_tensor``: all ranks hold the same weights. Runs of
    segments that need no gap are copied together; a module that needs no gap at all (every segment but the last a
    whole number of blocks) is gathered straight into ``output_tensor``. Bytes on the wire per rank: the sum over
    segments of ``BlockFormat.packed_bytes(segment)``.

    If FSDP2's input does not hold exactly ``segments`` (a tensor subclass whose ``fsdp_pre_all_gather`` returns
    other inputs than the parameter's shard, such as float8 training), the blocks are cut from the flat input
    instead, so a block may span two parameters, with a one-time warning saying why.

    Over any other group (hpZ's post-forward group) or with ``bits=None``: exact, so a backward gather over the
    post-forward group rebuilds the forward weights bit for bit (quantizing them again would not). A post-forward
    gather runs over ``topology.subgroup`` of the same ranks instead of FSDP2's group, which torch creates with the
    backend's default timeout (30 minutes for gloo) where zeropp's has the topology's. Bytes are
    counted by the nodes of ``topology``: a post-forward group inside a node moves intra-node bytes only. The call
    always completes before returning and returns ``None``: FSDP2 then treats it as a synchronous collective (it
    waits on the stream event it records after the call), which is correct for ``async_op`` either way.

    Per-parameter formats (``bits`` a sequence, one per segment, from ``enable(rules=...)``): when they differ, the
    group's segments are split by format (``zeropp.fsdp.segments.format_parts``) and each part is gathered by its
    own collective over the shard group, in order of first appearance: an exact part is its segments back to back
    (gathered exactly: bit for bit the values plain FSDP2 gathers), a quantized part is staged with each segment at
    a block boundary as above. Every part is staged before any collective writes ``output_tensor``. Bytes: each
    part's, as if it were a group of its own; the cost is one collective per extra format (its latency).

    Args:
        topology: the ``zeropp.comm.Topology`` of FSDP2's shard group (byte accounting, node layout).
        bits: 8, 4 or 2 for qwZ, ``None`` for exact; or a sequence of those, one per segment (per-parameter
            formats).
        block_size: elements per quantization block.
        segments: per-rank elements of each parameter's padded shard in the module's flat input, in order
            (``zeropp.fsdp.segments.shard_numels(module)``: the module's whole group); ``enable`` installs one hook
            per group with its own.
    """

    def __init__(self, topology: comm.Topology, bits: int | None | Sequence[int | None], block_size: int,
                 segments: Sequence[int]) -> None:
        self.segments = tuple(int(s) for s in segments)
        if any(s < 0 for s in self.segments):
            raise ValueError(f"segments={list(self.segments)} must be element counts >= 0")
        self.parts = None
        if isinstance(bits, Sequence):
            parts = format_parts(self.segments, bits, block_size, align=True)
            if len(parts) > 1:
                self.parts = parts
            bits = parts[0].bits if parts else None
        super().__init__(topology, bits, block_size)
        self.staged_numel, self.runs = staging(self.segments, block_size)
        self._warned = False

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self.is_shard_group(group):
            if self.parts is not None:
                self._gather_parts(output_tensor, input_tensor, group)
                return None
            bits = self.bits
        else:  # hpZ's post-forward group; zeropp's of the same ranks has the topology's timeout (FSDP2's: 30 min)
            bits = None
            group = self.topology.subgroup(dist.get_process_group_ranks(group))
        if bits is not None:
            _check_dtype(input_tensor)
        n = input_tensor.numel()
        if bits is None or self._flat_blocks(n):
            comm.all_gather(input_tensor, bits, group=group, topology=self.topology, out=output_tensor,
                            block_size=self.block_size)
            return None
        size = dist.get_world_size(group)
        if output_tensor.numel() != size * n or not output_tensor.is_contiguous():
            raise ValueError(
                f"zeropp.fsdp: FSDP2's all-gather output has {output_tensor.numel()} elements (contiguous: "
                f"{output_tensor.is_contiguous()}); expected a contiguous {size} x {n}"
            )
        flat = input_tensor.reshape(-1)
        staged = flat.new_zeros(self.staged_numel)
        for src, dst, length in self.runs:
            staged[dst:dst + length].copy_(flat[src:src + length])
        gathered = torch.empty(size, self.staged_numel, dtype=output_tensor.dtype, device=output_tensor.device)
        comm.all_gather(staged, bits, group=group, topology=self.topology, out=gathered, block_size=self.block_size)
        out = output_tensor.view(size, n)
        for dst, src, length in self.runs:
            out[:, dst:dst + length].copy_(gathered[:, src:src + length])
        return None

    def _gather_parts(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
        """The per-format path: stage every part (the input is a view of the output), then gather each."""
        assert self.parts is not None
        n, size = input_tensor.numel(), dist.get_world_size(group)
        if n != sum(self.segments) or output_tensor.numel() != size * n or not output_tensor.is_contiguous():
            raise ValueError(
                f"zeropp.fsdp: FSDP2 all-gathers {n} elements per rank into {output_tensor.numel()} (contiguous: "
                f"{output_tensor.is_contiguous()}), but this group's parameters have per-parameter formats and "
                f"padded shards of {list(self.segments)} elements: its input must be exactly those shards (no "
                "tensor subclass with fsdp_pre_all_gather); give the group's parameters one weight format"
            )
        if any(part.bits is not None for part in self.parts):
            _check_dtype(input_tensor)
        flat = input_tensor.reshape(-1)
        staged = []
        for part in self.parts:
            buf = flat.new_zeros(part.numel)
            for src, dst, length in part.runs:
                buf[dst:dst + length].copy_(flat[src:src + length])
            staged.append(buf)
        out = output_tensor.view(size, n)
        for part, buf in zip(self.parts, staged):
            gathered = torch.empty(size, part.numel, dtype=output_tensor.dtype, device=output_tensor.device)
            comm.all_gather(buf, part.bits, group=group, topology=self.topology, out=gathered,
                            block_size=self.block_size)
            for dst, src, length in part.runs:
                out[:, dst:dst + length].copy_(gathered[:, src:src + length])

    def _flat_blocks(self, numel: int) -> bool:
        """Whether to cut blocks from the flat input: it needs no gap, or does not hold ``segments`` (warned)."""
        if numel == sum(self.segments):
            return self.staged_numel == numel
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"zeropp.fsdp: FSDP2 all-gathers {numel} elements per rank for this module, but its parameters' "
                f"padded shards add up to {sum(self.segments)} (segments {list(self.segments)}): a tensor subclass "
                "whose fsdp_pre_all_gather returns other inputs than its shard (float8 training, for one). qwZ "
                "cuts this module's blocks from the flat input, so a block may span two parameters",
                stacklevel=2,
            )
        return True


def _check_dtype(input_tensor: torch.Tensor) -> None:
    if input_tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"zeropp.fsdp: FSDP2 all-gathers {input_tensor.dtype} parameters (e.g. a tensor subclass with "
            f"fsdp_pre_all_gather, such as float8); qwZ quantizes {', '.join(map(str, FLOAT_DTYPES))} only: "
            "enable with weight_bits=None for these modules"
        )
