"""qwZ for DeepSpeed's ZeRO-3: the parameter gather DeepSpeed's coordinator calls, on ``zeropp.comm.all_gather``.

DeepSpeed's ``Init._convert_to_deepspeed_param`` gives every parameter a closure
``param.all_gather_coalesced(params, safe_mode=False, quantize=False)``; the prefetch coordinator calls it on a
bucket with ``quantize=zero_quantized_weights`` and waits on the handle it returns before the module runs.
``ParamGather`` replaces that closure (``patches.py``) and keeps the original for what it does not take over.

Layout of one quantized gather (the bucket's parameters of one shard dtype, sorted by ``ds_id``): parameter ``j``
with shard ``p.ds_tensor`` of ``s_j = ds_tensor.ds_numel`` elements (DeepSpeed's ``ceil(ds_numel / P)``) sits in
the rank's flat shard at ``o_j = sum_{i<j} a_i``, ``a_i = s_i`` rounded up to the block size, the gap zeroed; so
is the part of the last ranks' shards beyond ``ds_numel``. Every block lies inside one parameter's shard. The
flat shard of ``A = sum a_j`` elements goes through ONE ``zeropp.comm.all_gather(bits=8)`` into ``out`` of
``P * A`` elements of the same dtype (rank ``r``'s values at ``out[r * A:(r + 1) * A]``); the parameter is then
``out.view(P, A)[:, o_j:o_j + s_j]`` flattened, cut to ``ds_numel`` and shaped ``ds_shape`` (one copy, as
DeepSpeed's concatenation).

Error: every gathered weight is within half a block scale (``absmax(block) / 254``, int8) of the shard value it
came from, the block being that parameter's ``block_size`` elements of one rank's shard
(``zeropp.quant.format``). Bytes per rank: ``(P - 1) * packed_bytes(A)`` sent and received
(``zeropp.comm.stats()["all_gather"]``), about ``A`` bytes plus ``4 A / block_size`` of scales per peer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import (
    Init,
    MultipleAllGatherHandles,
    ZeroParamStatus,
)
from deepspeed.runtime.zero.utils import assert_ints_same_as_other_ranks
from torch.nn import Parameter

from .. import comm
from ..comm import CollectiveWork, Topology
from ..quant import DEFAULT_BLOCK_SIZE
from .topology import topology_for

WEIGHT_BITS = 8
"""Code width of the weight gathers: DeepSpeed's qwZ is int8."""


def stored_quantized(param: Parameter) -> bool:
    """Whether DeepSpeed stores the weight quantized (``zero_quantized_nontrainable_weights``; primary or hpZ
    secondary shard)."""
    secondary = getattr(param, "ds_secondary_tensor", None)
    return hasattr(param.ds_tensor, "ds_quant_scale") or (
        secondary is not None and hasattr(secondary, "ds_quant_scale")
    )


def begin_gather(init: Init, params: list[Parameter]) -> None:
    """DeepSpeed's bookkeeping before a gather of ``params``: NVMe-swapped shards brought in, each parameter
    checked ``NOT_AVAILABLE`` and marked ``INFLIGHT``."""
    init._ensure_availability_of_partitioned_params(params)
    for p in params:
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"expected a partitioned parameter to gather, got {p.ds_summary()}")
        p.ds_status = ZeroParamStatus.INFLIGHT


class _DtypeGather:
    """One in-flight quantized gather: the parameters of one shard dtype, their offsets in the flat shard."""

    def __init__(
        self,
        params: list[Parameter],
        group: Any,
        topology: Topology,
        world_size: int,
        rank: int,
        block_size: int,
    ) -> None:
        device = torch.device(get_accelerator().current_device_name())
        dtype = params[0].ds_tensor.dtype
        self.params = params
        self.world_size = world_size
        self.sizes = [p.ds_tensor.ds_numel for p in params]
        self.offsets: list[int] = []
        total = 0
        for s in self.sizes:
            self.offsets.append(total)
            total += -(-s // block_size) * block_size
        self.total = total
        shard = torch.zeros(total, dtype=dtype, device=device)
        for p, off, s in zip(params, self.offsets, self.sizes):
            valid = max(0, min(s, p.ds_numel - rank * s))  # the last ranks' shards end in DeepSpeed's padding
            if valid:
                shard.narrow(0, off, valid).copy_(p.ds_tensor.data.view(-1).narrow(0, 0, valid))
        self.out = torch.empty(world_size * total, dtype=dtype, device=device)
        work = comm.all_gather(shard, bits=WEIGHT_BITS, group=group, topology=topology, out=self.out,
                               async_op=True, block_size=block_size)
        assert isinstance(work, CollectiveWork)
        self.work = work

    def finish(self) -> None:
        self.work.wait()
        rows = self.out.view(self.world_size, self.total)
        for p, off, s in zip(self.params, self.offsets, self.sizes):
            full = rows.narrow(1, off, s).reshape(-1)
            p.data = full.narrow(0, 0, p.ds_numel).view(p.ds_shape)
            p.ds_status = ZeroParamStatus.AVAILABLE


class QuantizedGatherHandle:
    """The handle ``ParamGather`` (and ``stored_gather.StoredGather``) returns for a quantized gather: ``wait()``
    finishes each gather (``finish()``: dequantize into each parameter's ``data``, its dtype and full shape) and
    marks it ``AVAILABLE``, like DeepSpeed's ``AllGatherCoalescedHandle``. CUDA streams: ``zeropp.comm.CollectiveWork`` orders the waiting stream after
    the gather and records its buffers there."""

    def __init__(self, gathers: list[_DtypeGather]) -> None:
        self.gathers = gathers
        self.complete = False

    def wait(self, handle_dependency: bool = True) -> None:
        if self.complete:
            return
        for gather in self.gathers:
            gather.finish()
        self.complete = True


class ParamGather:
    """``param.all_gather_coalesced`` with zeropp's qwZ: quantized gathers of primary shards run on
    ``zeropp.comm``; the rest goes to DeepSpeed's closure ``original`` (hpZ secondary shards exactly, in the node).

    Args:
        init: the DeepSpeed ``Init`` that converted the parameter (its groups, NVMe swapper).
        original: DeepSpeed's ``all_gather_coalesced`` closure for the parameter.
        block_size: elements per quantization block.
    """

    def __init__(self, init: Init, original: Callable[..., Any], block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.init = init
        self.original = original
        self.block_size = block_size

    def __call__(self, params: Iterable[Parameter], safe_mode: bool = False, quantize: bool = False) -> Any:
        params = list(params)
        if not quantize or not params or any(stored_quantized(p) for p in params):
            return self.original(params, safe_mode=safe_mode, quantize=quantize)
        if params[0].ds_secondary_tensor is not None:
            # hpZ's backward gather of the secondary shards, in the node: exact, so backward uses the weights
            # forward dequantized (DeepSpeed would quantize them a second time).
            return self.original(params, safe_mode=safe_mode, quantize=False)
        init = self.init
        by_group: dict[int, list[Parameter]] = {}
        for p in params:
            by_group.setdefault(id(init.get_partition_dp_group(p)), []).append(p)
        if len(by_group) > 1:
            return MultipleAllGatherHandles([self(ps, safe_mode, quantize) for ps in by_group.values()])
        if all(init._partition_world_size(p) == 1 for p in params):
            return self.original(params, safe_mode=safe_mode, quantize=quantize)

        begin_gather(init, params)
        # Every rank must lay the bucket out alike: DeepSpeed's order (ds_id), and the dtypes by name.
        params = sorted(params, key=lambda p: p.ds_id)
        if safe_mode:
            assert_ints_same_as_other_ranks([p.ds_id for p in params])
            assert_ints_same_as_other_ranks([p.ds_tensor.ds_numel for p in params])
        group = init.get_partition_dp_group(params[0])
        topology = topology_for(group)
        world_size = init._partition_world_size(params[0])
        rank = init._partition_rank(params[0])
        by_dtype: dict[torch.dtype, list[Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.ds_tensor.dtype, []).append(p)
        gathers = [
            _DtypeGather(by_dtype[dtype], group, topology, world_size, rank, self.block_size)
            for dtype in sorted(by_dtype, key=str)
        ]
        return QuantizedGatherHandle(gathers)
