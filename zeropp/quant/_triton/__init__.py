"""Triton kernels of the block-quantization ops, one module per op with its launcher.

The functions take the arguments of ``zeropp.quant.reference`` (already validated by ``zeropp.quant.ops``),
write into ``out`` and agree with the reference bit for bit. They run on CUDA tensors, or on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1``). ``common.TILE_ELEMENTS`` is the tuning knob.
"""

from .dequantize import dequantize_add_chunks, dequantize_chunks
from .quantize import quantize_chunks, quantize_chunks_rotated
from .reduce import reduce_dequantize, reduce_dequantize_rotated, reduce_requantize
from .rotation import hadamard

__all__ = [
    "dequantize_add_chunks",
    "dequantize_chunks",
    "hadamard",
    "quantize_chunks",
    "quantize_chunks_rotated",
    "reduce_dequantize",
    "reduce_dequantize_rotated",
    "reduce_requantize",
]
