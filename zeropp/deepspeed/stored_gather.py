"""Weights stored quantized (``zero_quantized_nontrainable_weights``): DeepSpeed's storage and gather, with its
two defects on that path fixed and its wire format kept.

Storage. DeepSpeed 0.19.8's ``Init._partition_param`` (and ``_partition_param_sec``, hpZ's secondary shard)
quantizes a frozen weight's freshly allocated, uninitialised partition (``torch.empty``), keeps those int8 codes
as ``ds_tensor`` and then copies the float weights INTO them (a float-to-int8 cast: weights below 1 in magnitude
become 0), so the stored weight is garbage times garbage scales. ``partition_wrapper`` wraps both methods: it
quantizes the rank's slice of the weight (``Init.quantizer_module``, i.e. ``quantizer.CUDAQuantizer``) before
DeepSpeed runs, hands DeepSpeed those codes and scales in place of the ones of its empty buffer, and writes the
codes back after DeepSpeed's float copy into them.

Gather. DeepSpeed's ``all_gather_coalesced`` closure, for a bucket of such weights (``quantize=True``; the
coordinator sends them apart from the others), concatenates their codes and scales and dequantizes the gathered
whole with ONE group size (weights with other group counts come out with other weights' scales), then casts the
result to ``ds_tensor.dtype`` (int8); for one weight it cuts the padded codes to the weight's size before
dequantizing (groups misplaced when the size is not a multiple of the world). ``StoredGather`` replaces that
closure for buckets of stored-quantized weights with DeepSpeed's coalesced wire format — rank ``r`` sends its
weights' codes back to back (int8, ``sum s_j`` bytes) and their scales back to back (float32, ``sum g_j``), two
``all_gather_into_tensor`` calls — and dequantizes each weight's ``P`` partitions with its own groups (every
partition of a weight has the same size ``s_j`` and group count ``g_j``), into the weight's own dtype, then cuts to
``ds_numel``. hpZ: buckets whose weights have a secondary shard gather those in DeepSpeed's
``zero_param_process_group`` (``num_ranks_in_param_group`` ranks), as DeepSpeed does.

Error: every gathered weight is within the int8 bound of its value (``ds_format``: half its group's scale, a full
scale for the clamped top values), plus the rounding to its dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import Init, MultipleAllGatherHandles, ZeroParamStatus
from torch.nn import Parameter

from .all_gather import QuantizedGatherHandle, begin_gather, stored_quantized


def partition_wrapper(original: Callable[..., Any], secondary: bool) -> Callable[..., Any]:
    """``Init._partition_param`` (``secondary=False``) or ``_partition_param_sec`` with the stored codes and scales
    computed from the weight's values (see the module docstring)."""

    def _partition(self: Init, param: Parameter, *args: Any, **kwargs: Any) -> None:
        attr = "ds_secondary_tensor" if secondary else "ds_tensor"
        fresh = (param.ds_status is ZeroParamStatus.AVAILABLE and getattr(param, attr, None) is None
                 and not param.requires_grad and self.quantized_nontrainable_weights)
        if not fresh:
            return original(self, param, *args, **kwargs)
        if secondary:
            size = self._aligned_size(param) // self.num_ranks_in_param_group
            start = size * self.rank_in_group
        else:
            size = self._aligned_size(param) // self._partition_world_size(param)
            start = size * self._partition_rank(param)
        flat = param.data.detach().reshape(-1)
        part = torch.zeros(size, dtype=param.dtype, device=flat.device)  # DeepSpeed's shard, zero padded
        valid = max(0, min(size, param.ds_numel - start))
        part[:valid] = flat[start:start + valid]
        quantizer = self.quantizer_module
        codes, scales = quantizer.quantize(part)
        self.quantizer_module = _Quantized(codes, scales)  # what DeepSpeed's call quantizes is torch.empty
        try:
            original(self, param, *args, **kwargs)
        finally:
            self.quantizer_module = quantizer
        stored = getattr(param, attr)
        if hasattr(stored, "ds_quant_scale"):  # DeepSpeed cast the float weights into the codes
            stored.data.copy_(codes.view_as(stored))

    _partition.__wrapped__ = original  # type: ignore[attr-defined]
    return _partition


class _Quantized:
    """A quantizer that returns given codes and scales, for DeepSpeed's quantize of an uninitialised buffer."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.codes, self.scales = codes, scales

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if param.numel() != self.codes.numel():
            raise RuntimeError(f"expected DeepSpeed to quantize {self.codes.numel()} elements, got {param.numel()}")
        return self.codes.clone(), self.scales.clone()


class _Gather:
    """One in-flight gather of stored-quantized weights that share a group and a shard kind."""

    def __init__(self, init: Init, params: list[Parameter]) -> None:
        use_secondary = params[0].ds_secondary_tensor is not None
        if use_secondary and init.zero_param_process_group is not None:
            group, world = init.zero_param_process_group, init.num_ranks_in_param_group
        else:
            group, world = init.get_partition_dp_group(params[0]), init._partition_world_size(params[0])
        device = get_accelerator().current_device_name()
        shards = [p.ds_secondary_tensor if use_secondary else p.ds_tensor for p in params]
        for p, t in zip(params, shards):
            if not hasattr(t, "ds_quant_scale"):
                raise RuntimeError(f"parameter {p.ds_id}'s {'secondary' if use_secondary else 'primary'} shard "
                                   "is not stored quantized while its bucket's are: gather it apart")
        self.params, self.world, self.init = params, world, init
        self.sizes = [t.numel() for t in shards]
        self.groups = [t.ds_quant_scale.numel() for t in shards]
        codes = torch.cat([t.data.reshape(-1).to(device) for t in shards])
        scales = torch.cat([t.ds_quant_scale.reshape(-1).to(device, torch.float32) for t in shards])
        self.codes = torch.empty(world * codes.numel(), dtype=torch.int8, device=device)
        self.scales = torch.empty(world * scales.numel(), dtype=torch.float32, device=device)
        self.works = [dist.all_gather_into_tensor(self.codes, codes, group=group, async_op=True),
                      dist.all_gather_into_tensor(self.scales, scales, group=group, async_op=True)]

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        rows = self.codes.view(self.world, -1)
        scale_rows = self.scales.view(self.world, -1)
        offset = group_offset = 0
        for p, size, groups in zip(self.params, self.sizes, self.groups):
            codes = rows[:, offset:offset + size].reshape(-1)
            scales = scale_rows[:, group_offset:group_offset + groups].reshape(-1)
            full = self.init.quantizer_module.dequantize(codes, scales, dtype=p.dtype)
            p.data = full.narrow(0, 0, p.ds_numel).view(p.ds_shape).to(p.device)
            p.ds_status = ZeroParamStatus.AVAILABLE
            offset += size
            group_offset += groups


class StoredGather:
    """``param.all_gather_coalesced`` for weights stored quantized; any other bucket goes to ``original``.

    Args:
        init: the DeepSpeed ``Init`` that converted the parameter.
        original: the closure it replaces (DeepSpeed's, or ``all_gather.ParamGather``).
    """

    def __init__(self, init: Init, original: Callable[..., Any]) -> None:
        self.init = init
        self.original = original

    def __call__(self, params: Iterable[Parameter], safe_mode: bool = False, quantize: bool = False) -> Any:
        params = list(params)
        stored = [p for p in params if stored_quantized(p)]
        if not stored:
            return self.original(params, safe_mode=safe_mode, quantize=quantize)
        if len(stored) < len(params):
            rest = [p for p in params if not stored_quantized(p)]
            return MultipleAllGatherHandles([self(stored, safe_mode, quantize),
                                             self.original(rest, safe_mode=safe_mode, quantize=quantize)])
        init = self.init
        if all(init._partition_world_size(p) == 1 for p in params):
            return self.original(params, safe_mode=safe_mode, quantize=quantize)
        begin_gather(init, params)
        buckets: dict[tuple[int, bool], list[Parameter]] = {}
        for p in sorted(params, key=lambda p: p.ds_id):  # every rank lays the bucket out alike
            key = (id(init.get_partition_dp_group(p)), p.ds_secondary_tensor is not None)
            buckets.setdefault(key, []).append(p)
        return QuantizedGatherHandle([_Gather(init, ps) for ps in buckets.values()])
