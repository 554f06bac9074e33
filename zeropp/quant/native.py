"""The native CPU backend: ``kernels/cpu/quant.cpp`` (with qgZ's swizzled quantize and final reduce fused with the
Hadamard rotation, ``hadamard.h``) and ``rotation.cpp`` (the standalone rotation) built into
``libzeropp_cpu.so``, called through ctypes.

The functions take the arguments of ``zeropp.quant.reference`` (validated by ``zeropp.quant.ops``), write into
``out`` and agree with the reference bit for bit; they run on CPU tensors, on ``torch.get_num_threads()`` OpenMP
threads. No torch C++ ABI is involved: the library sees raw pointers.

The library is looked for at ``ZEROPP_NATIVE_LIB`` (a path) if that is set, else at ``DEFAULT_PATH``:
``build/libzeropp_cpu.so`` in a source checkout, which ``cmake -S . -B build && cmake --build build`` (run by
``setup.sh``) makes, or ``zeropp/_native/libzeropp_cpu.so``, which ``pip install`` puts there where a C++ compiler is
(``native_loader.build_path``). ``available()`` says whether it loaded; ``unavailable_reason()`` says why not.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from .format import BlockFormat
from .native_loader import NativeBackend, build_path

ABI_VERSION = 4
"""The ``zeropp_cpu_abi_version()`` this module is written for (kernels/cpu/quant.cpp)."""

LIBRARY_NAME = "libzeropp_cpu.so"
DEFAULT_PATH = build_path(LIBRARY_NAME)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

BUILD_HINT = (
    "in a zeropp checkout build it with ./setup.sh (or `cmake -S . -B build && cmake --build build`); an installed "
    "zeropp has it where a C++ compiler was present at `pip install` (`pip install -v` shows its CMake build)"
)


class NativeLibraryError(RuntimeError):
    """The native library is missing, of another ABI version, or refused its arguments."""


class Library:
    """The ops of one loaded ``libzeropp_cpu`` (a path, for tests that load a second build)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise NativeLibraryError(f"{self.path} does not exist; {BUILD_HINT}")
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise NativeLibraryError(f"{self.path} did not load ({e}); rebuild it: {BUILD_HINT}") from e
        version = lib.zeropp_cpu_abi_version()
        if version != ABI_VERSION:
            raise NativeLibraryError(
                f"{self.path} has ABI version {version}, this zeropp needs {ABI_VERSION}; rebuild it: {BUILD_HINT}"
            )
        i32, i64, u32, ptr, f32 = ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_float
        signatures = {
            "zeropp_quantize_chunks": [ptr, i32, i64, i32, i32, i64, i64, ptr, i32, u32, i32],
            "zeropp_dequantize_chunks": [ptr, i32, i32, i64, i64, ptr, i32, i64, i32],
            "zeropp_dequantize_add_chunks": [ptr, i32, i32, i64, i64, ptr, i32, i64, i32],
            "zeropp_quantize_delta": [ptr, ptr, i32, i64, i32, i32, ptr, i32],
            "zeropp_reduce_requantize": [ptr, i32, i32, i32, i64, i64, ptr, i32, i32, i32, u32, i32],
            "zeropp_reduce_dequantize": [ptr, i32, i32, i32, i64, ptr, i32, i64, f32, i32],
            "zeropp_hadamard": [ptr, i64, i32, i32, ptr, i32],
            "zeropp_quantize_chunks_rotated": [ptr, i32, i64, i32, i32, i64, i64, i32, ptr, i32, u32, i32],
            "zeropp_reduce_dequantize_rotated": [ptr, i32, i32, i32, i64, i32, ptr, i32, i64, f32, i32],
            "zeropp_noise_thresholds": [u32, i64, i64, ptr],
        }
        for name, argtypes in signatures.items():
            if not hasattr(lib, name):
                raise NativeLibraryError(f"{self.path} has no {name} (an older build); rebuild it: {BUILD_HINT}")
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, i32
        self._lib = lib

    def _call(self, name: str, *args: object) -> None:
        status = getattr(self._lib, name)(*args, torch.get_num_threads())
        if status:
            raise NativeLibraryError(f"{name} refused its arguments (status {status}): {args}")

    def quantize_chunks(self, x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor,
                        seed: int | None = None) -> None:
        """As ``reference.quantize_chunks``."""
        x = x.contiguous()
        self._call("zeropp_quantize_chunks", x.data_ptr(), _DTYPES[x.dtype], x.numel(), fmt.bits, fmt.block_size,
                   chunks, nodes, out.data_ptr(), seed is not None, seed or 0)

    def dequantize_chunks(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                          out: torch.Tensor) -> None:
        """As ``reference.dequantize_chunks``."""
        self._call("zeropp_dequantize_chunks", buf.data_ptr(), fmt.bits, fmt.block_size, chunks, chunk_numel,
                   out.data_ptr(), _DTYPES[out.dtype], out.numel())

    def quantize_delta(self, target: torch.Tensor, reference: torch.Tensor, fmt: BlockFormat,
                       out: torch.Tensor) -> None:
        """As ``reference.quantize_delta`` (flat contiguous inputs of one dtype)."""
        self._call("zeropp_quantize_delta", target.data_ptr(), reference.data_ptr(), _DTYPES[target.dtype],
                   target.numel(), fmt.bits, fmt.block_size, out.data_ptr())

    def dequantize_add_chunks(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                              out: torch.Tensor) -> None:
        """As ``reference.dequantize_add_chunks``."""
        self._call("zeropp_dequantize_add_chunks", buf.data_ptr(), fmt.bits, fmt.block_size, chunks, chunk_numel,
                   out.data_ptr(), _DTYPES[out.dtype], out.numel())

    def reduce_requantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int,
                          out: torch.Tensor, out_fmt: BlockFormat | None = None, seed: int | None = None) -> None:
        """As ``reference.reduce_requantize``."""
        out_fmt = fmt if out_fmt is None else out_fmt
        if chunk_numel:
            self._call("zeropp_reduce_requantize", buf.data_ptr(), fmt.bits, fmt.block_size, groups, chunks,
                       chunk_numel, out.data_ptr(), out_fmt.bits, out_fmt.block_size, seed is not None, seed or 0)

    def reduce_dequantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int,
                          out: torch.Tensor, divisor: float) -> None:
        """As ``reference.reduce_dequantize`` (``divisor`` rounded to float32, as the reference's tensor is)."""
        self._call("zeropp_reduce_dequantize", buf.data_ptr(), fmt.bits, fmt.block_size, groups, chunk_numel,
                   out.data_ptr(), _DTYPES[out.dtype], out.numel(), divisor)

    def hadamard(self, x: torch.Tensor, size: int, inverse: bool, out: torch.Tensor) -> None:
        """As ``rotation.hadamard`` (float32 ``x`` and ``out``)."""
        if x.dtype != torch.float32 or out.dtype != torch.float32:
            raise TypeError(f"the native rotation takes float32 x and out, got {x.dtype} and {out.dtype}; widen x "
                            "with .float() first (zeropp.quant.hadamard_rotate does)")
        x = x.contiguous()
        self._call("zeropp_hadamard", x.data_ptr(), x.numel(), size, int(inverse), out.data_ptr())

    def quantize_chunks_rotated(self, x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, size: int,
                                out: torch.Tensor, seed: int | None = None) -> None:
        """As ``rotation.swizzle_quantize_rotated`` (the rotation fused into the quantize; with a ``seed``, the
        stochastic rounding too)."""
        x = x.contiguous()
        self._call("zeropp_quantize_chunks_rotated", x.data_ptr(), _DTYPES[x.dtype], x.numel(), fmt.bits,
                   fmt.block_size, chunks, nodes, size, out.data_ptr(), seed is not None, seed or 0)

    def reduce_dequantize_rotated(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int,
                                  size: int, out: torch.Tensor, divisor: float) -> None:
        """As ``rotation.reduce_dequantize_rotated`` (the inverse rotation fused into the final reduce;
        ``divisor`` rounded to float32, as the reference's tensor is)."""
        self._call("zeropp_reduce_dequantize_rotated", buf.data_ptr(), fmt.bits, fmt.block_size, groups,
                   chunk_numel, size, out.data_ptr(), _DTYPES[out.dtype], out.numel(), divisor)

    def noise_thresholds(self, seed: int, first: int, n: int) -> torch.Tensor:
        """``1 - u`` (float32, ``n`` values) of the stochastic rounding's noise for ``seed`` and the indices from
        ``first`` on (``format.py``), as the library's quantize kernels compute it (a test hook: it reaches indices
        past ``2**32``, which no op of a testable size does)."""
        out = torch.empty(n, dtype=torch.float32)
        status = self._lib.zeropp_noise_thresholds(seed, first, n, out.data_ptr())
        if status:
            raise NativeLibraryError(f"zeropp_noise_thresholds refused first={first}, n={n} (status {status}): both "
                                     "must be >= 0")
        return out


_backend = NativeBackend("ZEROPP_NATIVE_LIB", DEFAULT_PATH, Library, NativeLibraryError)
library_path = _backend.path
library = _backend.library
available = _backend.available
unavailable_reason = _backend.unavailable_reason
warn_unavailable = _backend.warn_unavailable
quantize_chunks = _backend.quantize_chunks
dequantize_chunks = _backend.dequantize_chunks
dequantize_add_chunks = _backend.dequantize_add_chunks
reduce_requantize = _backend.reduce_requantize
reduce_dequantize = _backend.reduce_dequantize


def quantize_delta(target: torch.Tensor, reference: torch.Tensor, fmt: BlockFormat, out: torch.Tensor) -> None:
    """As ``reference.quantize_delta``, with the library at ``library_path()``."""
    library().quantize_delta(target, reference, fmt, out)


def hadamard(x: torch.Tensor, size: int, inverse: bool, out: torch.Tensor) -> None:
    """As ``rotation.hadamard``, with the library at ``library_path()``."""
    library().hadamard(x, size, inverse, out)


def quantize_chunks_rotated(x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, size: int,
                            out: torch.Tensor, seed: int | None = None) -> None:
    """As ``rotation.swizzle_quantize_rotated``, with the library at ``library_path()``."""
    library().quantize_chunks_rotated(x, fmt, chunks, nodes, size, out, seed)


def reduce_dequantize_rotated(buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, size: int,
                              out: torch.Tensor, divisor: float) -> None:
    """As ``rotation.reduce_dequantize_rotated``, with the library at ``library_path()``."""
    library().reduce_dequantize_rotated(buf, fmt, groups, chunk_numel, size, out, divisor)
