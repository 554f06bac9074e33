"""The native CUDA backend: ``kernels/cuda/quant.cu`` built into ``zeropp_cuda.fatbin``, launched through CuPy.

The functions take the arguments of ``zeropp.quant.reference`` (validated by ``zeropp.quant.ops``), write into
``out`` and agree with the reference bit for bit; they run on CUDA tensors, on torch's current stream of the
tensors' device. No torch C++ ABI is involved: the kernels get raw ``data_ptr()`` pointers (zero-copy), so the
fatbin works with any torch build. CuPy is imported only when a kernel is first needed; without it zeropp still
imports and CUDA tensors run the Triton kernels.

The fatbin is looked for at ``ZEROPP_NATIVE_CUDA_LIB`` (a path) if that is set, else at ``DEFAULT_PATH``:
``build/zeropp_cuda.fatbin`` in a source checkout, which ``cmake -S . -B build && cmake --build build`` (run by
``setup.sh``) makes where nvcc is installed, or ``zeropp/_native/zeropp_cuda.fatbin``, which ``pip install`` puts
there where nvcc is (``native_loader.build_path``). ``available()`` says whether it loads; ``unavailable_reason()`` says
why not.

Launches (see the layout notes at the top of quant.cu): ``threads(block_size) = max(256, block_size / 16)``
threads per CTA, 16 consecutive elements per thread, so a CTA holds a tile of ``16 * threads / block_size`` whole
blocks. The grid is ``(tiles per pack, packs)``, the pack count split over ``grid.y`` and ``grid.z`` past 65535;
the fused reduce-dequantize has one pack of output and a 1-D grid.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .format import BlockFormat, exact_reciprocal
from .native_loader import NativeBackend, build_path

ABI_VERSION = 1
"""The ``zeropp_cuda_abi_version`` this module is written for (kernels/cuda/quant.cu)."""

FATBIN_NAME = "zeropp_cuda.fatbin"
SOURCE_TREE = Path(__file__).resolve().parents[2]
"""The checkout this module lies in (the fatbin's sources and build files are there in a source install)."""
DEFAULT_PATH = build_path(FATBIN_NAME)
SOURCE = SOURCE_TREE / "kernels" / "cuda" / "quant.cu"
"""The CUDA C++ source of the kernels."""

PER_THREAD = 16
"""Elements per thread (``kPerThread`` in quant.cu)."""

MIN_THREADS = 256
"""Threads per CTA for block sizes up to 4096; larger blocks take ``block_size / PER_THREAD`` (512 at 8192)."""

MAX_GRID_Y = 65535
"""CUDA's limit on ``gridDim.y`` (and ``gridDim.z``); more packs continue in ``grid.z``."""

_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

OPS = ("quantize_chunks", "dequantize_chunks", "reduce_requantize", "reduce_dequantize")


def kernel_name(op: str, bits: int, dtype: torch.dtype | None = None) -> str:
    """The extern "C" name of ``op``'s kernel for ``bits`` and the float tensor's ``dtype`` (``None`` for
    ``reduce_requantize``, which has none): ``zeropp_<op>_b<bits>[_f32|_bf16|_f16]``."""
    return f"zeropp_{op}_b{bits}" + ("" if dtype is None else f"_{_DTYPE_NAMES[dtype]}")


KERNEL_NAMES = tuple(
    kernel_name(op, bits, None if op == "reduce_requantize" else dtype)
    for op in OPS
    for bits in (8, 4)
    for dtype in ((None,) if op == "reduce_requantize" else tuple(_DTYPE_NAMES))
)
"""Every kernel this module launches (what the fatbin must hold; ``tests/quant/test_cuda_compile.py`` checks)."""

BUILD_HINT = (
    "with nvcc on PATH, in a zeropp checkout build it with ./setup.sh (or `cmake -S . -B build && cmake --build "
    "build`), or reinstall zeropp (`pip install`, which builds it where nvcc is)"
)
CUPY_HINT = (
    "install CuPy for your CUDA version: `pip install cupy-cuda12x` (CUDA 12) or `pip install cupy-cuda13x` (CUDA 13)"
)


class NativeCudaError(RuntimeError):
    """The CUDA fatbin, CuPy or a CUDA device is missing, or the fatbin is of another ABI version."""


def check_supported(fmt: BlockFormat, out_fmt: BlockFormat | None = None, seed: int | None = None,
                    rotation: int | None = None) -> None:
    """Raise ``NativeCudaError`` for what these kernels lack: int2 codes, a reduce into another format, stochastic
    rounding, the Hadamard rotation fused into qgZ's quantize and final reduce (the Triton kernels have them all)."""
    wanted = []
    if rotation is not None:
        wanted.append(f"Hadamard rotation (size {rotation}) fused into the quantize or the final reduce")
    if 2 in (fmt.bits, (out_fmt or fmt).bits):
        wanted.append("int2 codes")
    if out_fmt is not None and out_fmt != fmt:
        wanted.append(f"a reduce-requantize from {fmt} into {out_fmt}")
    if seed is not None:
        wanted.append("stochastic rounding (a seed)")
    if wanted:
        raise NativeCudaError(
            f"the native CUDA kernels (ZEROPP_QUANT_BACKEND=native) have no {' or '.join(wanted)}; the Triton "
            "kernels have: leave ZEROPP_QUANT_BACKEND unset (or set it to triton) for CUDA tensors"
        )


def threads(block_size: int) -> int:
    """Threads per CTA for ``block_size``: ``max(256, block_size / 16)``."""
    return max(MIN_THREADS, block_size // PER_THREAD)


def cuda_flags(cmake_lists: str | os.PathLike = SOURCE_TREE / "CMakeLists.txt") -> list[str]:
    """The nvcc flags the fatbin is built with: the ``set(ZEROPP_CUDA_FLAGS ...)`` line of ``cmake_lists`` (the
    one place they are written; the compile test and ``bench/cost_model.py --cuda`` compile ``SOURCE`` with them).
    Raises ``FileNotFoundError`` outside a source checkout and ``ValueError`` if the line is missing."""
    path = Path(cmake_lists)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: the CUDA build flags are read from a zeropp source checkout")
    found = re.search(r"set\(ZEROPP_CUDA_FLAGS ([^)]*)\)", path.read_text())
    if not found:
        raise ValueError(f"{path} has no set(ZEROPP_CUDA_FLAGS ...) line: restore it (the fatbin's nvcc flags)")
    return found.group(1).split()


def _grid(blocks: int, packs: int, block_size: int) -> tuple[int, int, int]:
    """The grid over ``packs`` packs of ``blocks`` blocks each: ``(tiles per pack, grid.y, grid.z)`` with
    ``grid.y * grid.z >= packs`` (the kernels skip the excess)."""
    tile_blocks = threads(block_size) * PER_THREAD // block_size
    y = min(packs, MAX_GRID_Y)
    return -(-blocks // tile_blocks), y, -(-packs // y)


def _pointer(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def divide_mode(divisor: float) -> tuple[np.float32, np.float32, np.int32]:
    """``divisor`` as the reference rounds it (float32), its reciprocal and whether the kernel must divide:
    0 when ``divisor`` is a power of two whose reciprocal is a normal float32 (multiplying by it is the same
    exact quotient, rounded once), else 1 (IEEE division of every element)."""
    d = np.float32(divisor)
    reciprocal = exact_reciprocal(float(d))
    return d, np.float32(reciprocal or 0.0), np.int32(reciprocal is None)


class Module:
    """The kernels of one ``zeropp_cuda.fatbin`` (a path), loaded through CuPy on each device as it is used."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not torch.cuda.is_available():
            raise NativeCudaError("no CUDA device is visible to torch (the native CUDA kernels run on CUDA tensors)")
        try:
            import cupy
        except ImportError as e:
            raise NativeCudaError(f"CuPy does not import ({e}); {CUPY_HINT}") from e
        if not self.path.is_file():
            raise NativeCudaError(f"{self.path} does not exist; {BUILD_HINT}")
        self._cupy = cupy
        self._raw = cupy.RawModule(path=str(self.path))
        self._kernels: dict[str, Any] = {}
        device = torch.device("cuda", torch.cuda.current_device())
        with cupy.cuda.Device(device.index):
            try:
                memptr = self._raw.get_global("zeropp_cuda_abi_version")
                version = int(cupy.ndarray((1,), cupy.int32, memptr).get()[0])
            except Exception as e:  # noqa: BLE001 - any CUDA error: this fatbin cannot run here
                raise NativeCudaError(
                    f"{self.path} did not load on {device} ({type(e).__name__}: {e}); the fatbin must hold code for "
                    f"this GPU ({BUILD_HINT}) and CuPy must match the CUDA driver ({CUPY_HINT})"
                ) from e
        if version != ABI_VERSION:
            raise NativeCudaError(
                f"{self.path} has ABI version {version}, this zeropp needs {ABI_VERSION}; rebuild it: {BUILD_HINT}"
            )

    def _kernel(self, name: str) -> Any:
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = self._raw.get_function(name)
        return kernel

    def launch(self, device: torch.device, name: str, fmt: BlockFormat, blocks: int, packs: int,
               args: tuple[Any, ...]) -> None:
        """Launch kernel ``name`` over ``packs`` packs of ``blocks`` blocks of ``fmt`` (``_grid``, ``threads``) on
        ``device``, on torch's current stream there; ``args`` are numpy scalars of the kernel's parameter types
        (pointers as ``numpy.uint64``)."""
        cupy = self._cupy
        grid, block = _grid(blocks, packs, fmt.block_size), (threads(fmt.block_size), 1, 1)
        with cupy.cuda.Device(device.index):
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
            with stream:
                self._kernel(name)(grid, block, args)

    def quantize_chunks(self, x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor,
                        seed: int | None = None) -> None:
        """As ``reference.quantize_chunks`` (no ``seed``: ``check_supported``)."""
        check_supported(fmt, seed=seed)
        numel = x.numel()
        if numel == 0:
            return
        x = x.contiguous()
        chunk_numel = -(-numel // chunks)
        blocks = fmt.num_blocks(chunk_numel)
        self.launch(
            x.device,
            kernel_name("quantize_chunks", fmt.bits, x.dtype),
            fmt,
            blocks,
            chunks,
            (_pointer(x), _pointer(out), np.int64(numel), np.int64(chunk_numel), np.int64(blocks),
             np.int64(fmt.packed_bytes(chunk_numel)), np.int32(chunks), np.int32(nodes), np.int32(fmt.block_size)),
        )

    def dequantize_chunks(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                          out: torch.Tensor) -> None:
        """As ``reference.dequantize_chunks``."""
        check_supported(fmt)
        out_numel = out.numel()
        if out_numel == 0:
            return
        blocks = fmt.num_blocks(chunk_numel)
        packs = -(-out_numel // chunk_numel)  # only the packs that hold output elements
        self.launch(
            buf.device,
            kernel_name("dequantize_chunks", fmt.bits, out.dtype),
            fmt,
            blocks,
            packs,
            (_pointer(buf), _pointer(out), np.int64(out_numel), np.int64(chunk_numel), np.int64(blocks),
             np.int64(fmt.packed_bytes(chunk_numel)), np.int32(packs), np.int32(fmt.block_size)),
        )

    def dequantize_add_chunks(self, buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int,
                              out: torch.Tensor) -> None:
        """As ``reference.dequantize_add_chunks``: quant.cu has no kernel of its own for it, so the Triton kernel
        runs it (the same bits)."""
        from . import _triton

        _triton.dequantize_add_chunks(buf, fmt, chunks, chunk_numel, out)

    def reduce_requantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunks: int, chunk_numel: int,
                          out: torch.Tensor, out_fmt: BlockFormat | None = None, seed: int | None = None) -> None:
        """As ``reference.reduce_requantize`` (one format and no ``seed``: ``check_supported``)."""
        check_supported(fmt, out_fmt, seed)
        if chunk_numel == 0:
            return
        blocks = fmt.num_blocks(chunk_numel)
        self.launch(
            buf.device,
            kernel_name("reduce_requantize", fmt.bits),
            fmt,
            blocks,
            chunks,
            (_pointer(buf), _pointer(out), np.int64(blocks), np.int64(fmt.packed_bytes(chunk_numel)),
             np.int32(groups), np.int32(chunks), np.int32(fmt.block_size)),
        )

    def reduce_dequantize(self, buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int,
                          out: torch.Tensor, divisor: float) -> None:
        """As ``reference.reduce_dequantize`` (``divisor`` rounded to float32, as the reference's tensor is)."""
        check_supported(fmt)
        out_numel = out.numel()
        if out_numel == 0:
            return
        d, reciprocal, exact_division = divide_mode(divisor)
        self.launch(
            buf.device,
            kernel_name("reduce_dequantize", fmt.bits, out.dtype),
            fmt,
            fmt.num_blocks(out_numel),
            1,
            (_pointer(buf), _pointer(out), np.int64(out_numel), np.int64(fmt.num_blocks(chunk_numel)),
             np.int64(fmt.packed_bytes(chunk_numel)), d, reciprocal, np.int32(groups), exact_division,
             np.int32(fmt.block_size)),
        )


_backend = NativeBackend("ZEROPP_NATIVE_CUDA_LIB", DEFAULT_PATH, Module, NativeCudaError)
library_path = _backend.path
library = _backend.library
available = _backend.available
unavailable_reason = _backend.unavailable_reason
quantize_chunks = _backend.quantize_chunks
dequantize_chunks = _backend.dequantize_chunks
dequantize_add_chunks = _backend.dequantize_add_chunks
reduce_requantize = _backend.reduce_requantize
reduce_dequantize = _backend.reduce_dequantize


def quantize_chunks_rotated(x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, size: int,
                            out: torch.Tensor, seed: int | None = None) -> None:
    """Refuses (``check_supported``): these kernels have no fused rotation (nor stochastic rounding)."""
    check_supported(fmt, seed=seed, rotation=size)


def reduce_dequantize_rotated(buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, size: int,
                              out: torch.Tensor, divisor: float) -> None:
    """Refuses (``check_supported``): these kernels have no fused rotation."""
    check_supported(fmt, rotation=size)
