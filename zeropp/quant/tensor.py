"""``QuantizedTensor``: one block-quantized tensor held as a single packed buffer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import FLOAT_DTYPES, SCALE_BYTES, BlockFormat, check_has_data


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor of ``shape`` and ``dtype`` quantized in ``fmt``, stored as one packed uint8 ``buffer``.

    ``buffer`` follows the packed layout of ``zeropp.quant.format``: codes first, then float32 scales, no header.
    ``data`` and ``scales`` are views into it, so ``packed()`` costs nothing and one collective moves both. The
    buffer must start at a multiple of 4 bytes (``SCALE_BYTES``), in its storage and in memory, where the float32
    scales can be viewed in place; a ``ValueError`` says so otherwise (``buffer.clone()`` is an aligned copy).
    """

    buffer: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    fmt: BlockFormat

    def __post_init__(self) -> None:
        if not isinstance(self.buffer, torch.Tensor):
            raise TypeError(f"buffer must be a torch.Tensor, got {type(self.buffer).__name__}")
        bad = [d for d in self.shape if isinstance(d, bool) or not isinstance(d, int) or d < 0]
        if bad:
            raise ValueError(f"shape={tuple(self.shape)} has {bad}; every dimension must be a non-negative integer")
        check_has_data(self.buffer, "buffer")
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1 or not self.buffer.is_contiguous():
            raise ValueError(
                f"buffer must be a contiguous 1-D uint8 tensor, got dtype={self.buffer.dtype} "
                f"shape={tuple(self.buffer.shape)}"
            )
        expected = self.fmt.packed_bytes(self.numel)
        if self.buffer.numel() != expected:
            raise ValueError(
                f"buffer has {self.buffer.numel()} bytes but shape {tuple(self.shape)} in {self.fmt} "
                f"needs {expected}"
            )
        if self.dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype={self.dtype} is not a float dtype; use one of {FLOAT_DTYPES}")
        offset, address = self.buffer.storage_offset(), self.buffer.data_ptr()
        if offset % SCALE_BYTES or address % SCALE_BYTES:
            raise ValueError(
                f"buffer starts at byte {offset} of its storage (address {address:#x}), not at a multiple of "
                f"{SCALE_BYTES} bytes, so its float32 scales cannot be viewed in place; slice packed buffers at "
                f"multiples of {SCALE_BYTES} bytes, or pass buffer.clone() (an aligned copy)"
            )

    @property
    def bits(self) -> int:
        return self.fmt.bits

    @property
    def block_size(self) -> int:
        return self.fmt.block_size

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def data(self) -> torch.Tensor:
        """The codes: int8, one per element (bits=8), or uint8 with two int4 codes per byte (bits=4, element
        ``2k`` in the low nibble) or four int2 codes per byte (bits=2, element ``4k`` in the lowest two bits).
        Padded to whole blocks."""
        codes = self.buffer[: self.fmt.code_bytes(self.numel)]
        return codes.view(torch.int8) if self.bits == 8 else codes

    @property
    def scales(self) -> torch.Tensor:
        """Float32 scale of each block (absmax / qmax): shape ``(num_blocks,)``."""
        return self.buffer[self.fmt.code_bytes(self.numel) :].view(torch.float32)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed buffer, scales included."""
        return self.buffer.numel()

    def packed(self) -> torch.Tensor:
        """The packed uint8 buffer (no copy)."""
        return self.buffer

    @classmethod
    def from_packed(
        cls,
        buffer: torch.Tensor,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        bits: int,
        block_size: int,
    ) -> QuantizedTensor:
        """Wrap a packed buffer (e.g. one received from another rank) without copying it.

        ``buffer`` must start at a multiple of 4 bytes (see the class); ``shape`` must have
        non-negative integer dimensions. Both are checked here, with a ``ValueError`` naming the bad value.
        """
        if isinstance(shape, int):
            shape = (shape,)
        return cls(buffer, torch.Size(shape), dtype, BlockFormat(bits, block_size))

    def has_nonfinite(self) -> bool:
        """Whether the source held a NaN or an Inf; reads the scales only (one device sync)."""
        return not bool(torch.isfinite(self.scales).all())

    def dequantize(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """See ``zeropp.quant.dequantize``."""
        from .ops import dequantize

        return dequantize(self, dtype=dtype, out=out)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
            f"block_size={self.block_size}, nbytes={self.nbytes}, device={self.device})"
        )
