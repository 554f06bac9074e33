"""Block-quantized formats and the kernels that make, move and reduce them.

The torch reference (``zeropp.quant.reference``) is the specification; the Triton kernels
(``zeropp.quant._triton``) run on CUDA tensors and are tested against it. ``zeropp.quant.format`` documents the
formats and the packed wire layout. This package knows nothing of torch.distributed.
"""

from .format import DEFAULT_BLOCK_SIZE, BlockFormat, chunk_numel, swizzle_source
from .ops import (
    backend_name,
    dequantize,
    dequantize_add_chunks,
    dequantize_chunks,
    quantize,
    quantize_chunks,
    quantize_delta,
    reduce_dequantize,
    reduce_requantize,
    swizzle_quantize,
)
from .rotation import (
    DEFAULT_ROTATION_SIZE,
    ROTATION_SIZES,
    hadamard_rotate,
    hadamard_unrotate,
    reduce_dequantize_rotated,
    rotate_slices,
    rotated_numel,
    swizzle_quantize_rotated,
)
from .tensor import QuantizedTensor

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_ROTATION_SIZE",
    "ROTATION_SIZES",
    "BlockFormat",
    "QuantizedTensor",
    "backend_name",
    "chunk_numel",
    "dequantize",
    "dequantize_add_chunks",
    "dequantize_chunks",
    "hadamard_rotate",
    "hadamard_unrotate",
    "quantize",
    "quantize_chunks",
    "quantize_delta",
    "reduce_dequantize",
    "reduce_dequantize_rotated",
    "reduce_requantize",
    "rotate_slices",
    "rotated_numel",
    "swizzle_quantize",
    "swizzle_quantize_rotated",
    "swizzle_source",
]
