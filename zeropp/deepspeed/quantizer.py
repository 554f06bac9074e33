"""What stands in for DeepSpeed's ``CUDAQuantizer`` (``runtime.zero.partition_parameters``) while installed.

DeepSpeed's ``zero.Init`` makes a ``CUDAQuantizer`` whenever ``zero_quantized_weights`` or
``zero_quantized_nontrainable_weights`` is on, and its constructor JIT-builds the quantizer op (nvcc; "not
implemented" on the CPU accelerator). With zeropp installed the qwZ gathers never call it (``all_gather.py``);
only weights stored quantized (``zero_quantized_nontrainable_weights``) do, through DeepSpeed's own gather code
and DeepSpeed's wire format. Until that format is provided (the kernel-module path of this package's design),
this stand-in builds nothing and refuses to quantize, naming the flag, at the first weight DeepSpeed would store
quantized (at ``zero.Init``, before any step).
"""

from __future__ import annotations

import torch


class UnsupportedQuantizer:
    """``CUDAQuantizer``'s interface (``quantize``, ``dequantize``); both raise ``NotImplementedError``."""

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError(
            "zeropp.deepspeed does not yet store weights quantized (DeepSpeed's "
            "zero_quantized_nontrainable_weights, which runs DeepSpeed's quantizer op on its own wire format): "
            f"turn that flag off (a tensor of {param.numel()} {param.dtype} elements was to be quantized), or "
            "zeropp.deepspeed.uninstall() to run DeepSpeed's op"
        )

    def dequantize(
        self, quantized_param: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        raise NotImplementedError(
            "zeropp.deepspeed does not yet read weights stored quantized (DeepSpeed's "
            "zero_quantized_nontrainable_weights): turn that flag off, or zeropp.deepspeed.uninstall()"
        )
