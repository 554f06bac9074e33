"""What stands in for DeepSpeed's ``CUDAQuantizer`` (``runtime.zero.partition_parameters``) and its op while
installed: DeepSpeed's interface and wire format (``ds_format``), no op to build, any device and float dtype.

DeepSpeed's ``zero.Init`` makes a ``CUDAQuantizer`` whenever ``zero_quantized_weights`` or
``zero_quantized_nontrainable_weights`` is on; its constructor JIT-builds the quantizer op (nvcc; "not
implemented" on the CPU accelerator). With zeropp installed the qwZ gathers never call it (``all_gather.py``);
weights stored quantized (``zero_quantized_nontrainable_weights``) do: ``quantize`` when DeepSpeed partitions a
frozen weight (``Init._partition_param``, ``_partition_param_sec``, ``stage3.quantize_nontrainable_params``),
``dequantize`` after gathering one (``stored_gather.py``, DeepSpeed's ``_allgather_params*`` and
``NoGatherHandle`` through the class attribute ``Init.quantizer_module``).

``CUDAQuantizer`` keeps what DeepSpeed's code touches: ``quantize(param, groups=None) -> (codes, scales)``,
``dequantize(quantized_param, scale, dtype=None)``, the class attributes ``async_flag``, ``target_group_size``,
``group_size_cache`` and ``quantizer_cuda_module`` (here the module ``ds_format``). Differences, none in the wire
format:

* group count: DeepSpeed's search (``numel / groups`` a multiple of 8, at most ``target_group_size``, doubled
  while larger) for every size it accepts, so codes and scales have DeepSpeed's shapes; sizes it refuses (not a
  multiple of 8) get the smallest divisor ``g`` of ``numel`` with ``numel / g <= target_group_size``, or, when
  that leaves fewer than 8 elements a group (a prime size above the target), the largest divisor leaving at least
  8 (possibly one group of every element);
* dtypes: bf16 and fp32 are quantized from their own values (DeepSpeed casts to fp16 first: bf16 above 65504
  becomes inf) and ``dequantize(..., dtype)`` rounds once into ``dtype`` (DeepSpeed rounds to fp16, then casts);
  without ``dtype`` it returns fp16 as DeepSpeed's does;
* scales are flat, ``(groups,)`` (the op's are ``(groups, 1)``, the same bytes): DeepSpeed all-gathers them
  into flat buffers, which gloo refuses for 2-D inputs (``zero.GatheredParameters`` fails on the CPU accelerator);
* codes stay on the input's device unless DeepSpeed's accelerator device differs, where it moves them as
  DeepSpeed does.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

from . import ds_format

WEIGHT_BITS = 8
"""``CUDAQuantizer`` quantizes weights to int8 codes."""


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def group_count(numel: int, target_group_size: int) -> int:
    """The number of groups ``CUDAQuantizer.quantize`` splits ``numel`` elements into (see the module docstring).

    Raises:
        ValueError: ``numel`` is not positive.
    """
    if numel < 1:
        raise ValueError(f"cannot quantize {numel} elements: pass a non-empty tensor")
    if numel % 8 == 0:  # DeepSpeed's search, unchanged (its asserts cannot fail for these sizes)
        groups = math.ceil(numel / target_group_size)
        while groups < numel and numel % (8 * groups):
            groups += 1
        while numel % (16 * groups) == 0 and numel / groups > target_group_size:
            groups *= 2
        return groups
    divisors = _divisors(numel)
    fits = next(d for d in divisors if numel // d <= target_group_size)
    if numel // fits >= 8 or numel < 8:
        return fits
    return max(d for d in divisors if numel // d >= 8)


class CUDAQuantizer:
    """``partition_parameters.CUDAQuantizer`` on ``ds_format``: int8 symmetric codes, float32 ``1 / s`` scales
    (flat)."""

    async_flag: ClassVar[bool] = True
    target_group_size: ClassVar[int] = 8000
    group_size_cache: ClassVar[dict[int, int]] = {}
    quantizer_cuda_module = ds_format

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes, scales)`` of ``param``: int8 of its shape, float32 ``(groups,)`` holding ``1 / s``."""
        if groups is None:
            groups = self.group_size_cache.get(param.numel())
            if groups is None:
                groups = group_count(param.numel(), self.target_group_size)
                self.group_size_cache[param.numel()] = groups
        from deepspeed.accelerator import get_accelerator

        device = torch.device(get_accelerator().device_name())
        if param.device.type != device.type:
            param = param.to(device)
        codes, scales = ds_format.quantize(param, groups, WEIGHT_BITS, ds_format.Symmetric)
        return codes, scales.view(-1)

    def dequantize(self, quantized_param: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
                   ) -> torch.Tensor:
        """``float(code) * scale`` of each element (its group ``i // ceil(numel / scale.numel())``), rounded once
        into ``dtype`` (fp16 when ``None``, DeepSpeed's output)."""
        return ds_format.dequantize_to(quantized_param, scale, scale.numel(), WEIGHT_BITS, dtype or torch.float16)
