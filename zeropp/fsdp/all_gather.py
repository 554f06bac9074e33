"""FSDP2's parameter all-gather run by ``zeropp.comm.all_gather``: exact, or qwZ over the data-parallel group.

Subclasses ``AllGather`` from ``torch.distributed.fsdp._fully_shard._fsdp_api``, the interface that the public
``FSDPModule.set_custom_all_gather`` takes. That module is private: the class is not exported elsewhere; checked
against torch 2.13 only (the issue reports the same interface in 2.11).

What FSDP2 passes (torch 2.13, ``_fsdp_collectives.foreach_all_gather``): ``output_tensor`` is a flat buffer of
``P * n`` elements that it allocated with ``allocate``; ``input_tensor`` is this rank's ``n`` elements, the
concatenated shards of every parameter of the module (padded), and a VIEW of ``output_tensor[rank * n:(rank + 1)
* n]`` (an in-place gather). ``group`` is the module's shard group, except in backward for a module wrapped
with ``reshard_after_forward=N`` (hpZ, see ``zeropp.fsdp.hpz``): then it is the post-forward group of ``N``
ranks and ``input_tensor`` holds this rank's slice of the weights the FORWARD gather produced (dequantized, with
qwZ). It reads ``output_tensor`` back split by parameter, so every rank's part must land at
``[i * n, (i + 1) * n)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from .. import comm
from ..quant.format import FLOAT_DTYPES
from .hook import FlatBufferHook


class ZeroppAllGather(FlatBufferHook, AllGather):
    """All-gather of FSDP2's flat parameter shards through ``zeropp.comm.all_gather``.

    Over ``topology.group`` (FSDP2's shard group) with ``bits`` set: qwZ — this rank's shard is quantized into one
    packed buffer BEFORE anything is written to ``output_tensor`` (the shard is a view of it), one all-gather moves
    the packs, and every rank's part, its own included, is dequantized into ``output_tensor``: all ranks hold the
    same weights. Over any other group (hpZ's post-forward group) or with ``bits=None``: exact, so a backward
    gather over the post-forward group rebuilds the forward weights bit for bit (quantizing them again would not).
    Bytes are counted by the nodes of ``topology``: a post-forward group inside a node moves intra-node bytes only. The call always
    completes before returning and returns ``None``: FSDP2 then treats it as a synchronous collective (it waits
    on the stream event it records after the call), which is correct for ``async_op`` either way.

    Args:
        topology: the ``zeropp.comm.Topology`` of FSDP2's shard group (byte accounting, node layout).
        bits: 8 or 4 for qwZ, ``None`` for exact.
        block_size: elements per quantization block. Blocks are cut from FSDP2's flat input, which concatenates
            the module's parameter shards, so a block may span two parameters.
    """

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        bits = self.bits if self.is_shard_group(group) else None
        if bits is not None and input_tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"zeropp.fsdp: FSDP2 all-gathers {input_tensor.dtype} parameters (e.g. a tensor subclass with "
                f"fsdp_pre_all_gather, such as float8); qwZ quantizes {', '.join(map(str, FLOAT_DTYPES))} only: "
                "enable with weight_bits=None for these modules"
            )
        comm.all_gather(input_tensor, bits, group=group, topology=self.topology, out=output_tensor,
                        block_size=self.block_size)
        return None
