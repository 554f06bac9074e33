"""Public quantization ops: input checks, then dispatch to a backend.

Backend choice, per call, from the tensor and the environment:

* CUDA tensors run the Triton kernels; the native CUDA kernels (``zeropp.quant.native_cuda``: ``kernels/cuda``
  built by CMake into a fatbin, launched through CuPy) run them when ``ZEROPP_QUANT_BACKEND=native`` asks for them;
* CPU tensors run the native CPU library (``zeropp.quant.native``, built from ``kernels/cpu`` by CMake) when it is
  built, else the torch reference (``zeropp.quant.reference``), with a warning (once) that says why; under Triton's
  interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is first imported) they run the Triton kernels;
* ``ZEROPP_QUANT_BACKEND=native``, ``=triton`` or ``=torch`` forces one backend: ``native`` is the CPU library for
  CPU tensors and the CUDA kernels for CUDA tensors (an error says so, and how to fix it, when the forced one
  cannot run the tensor). Every backend gives the reference's bits.

The ops below ``dequantize`` work on the chunked packed layout of ``zeropp.quant.format`` and are what the
collectives are built from.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import native, native_cuda, reference
from .format import (
    DEFAULT_BLOCK_SIZE,
    BlockFormat,
    check_float_tensor,
    check_has_data,
    check_out_dtype,
)
from .tensor import QuantizedTensor

BACKENDS = ("auto", "torch", "triton", "native")


def backend_name(t: torch.Tensor) -> str:
    """``"triton"``, ``"native"`` or ``"torch"``: the backend the ops use for tensors like ``t`` right now (a
    ``RuntimeWarning``, once, when the native CPU library is missing and the torch reference takes its place)."""
    choice = os.environ.get("ZEROPP_QUANT_BACKEND", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"ZEROPP_QUANT_BACKEND={choice!r} is not one of {BACKENDS}")
    if choice == "torch":
        return "torch"
    if choice == "native":
        if t.is_cuda:
            if not native_cuda.available():
                raise RuntimeError(
                    "ZEROPP_QUANT_BACKEND=native was asked for a CUDA tensor, but the native CUDA kernels cannot "
                    f"run: {native_cuda.unavailable_reason()}; or leave ZEROPP_QUANT_BACKEND unset (CUDA tensors "
                    "then run the Triton kernels)"
                )
            return "native"
        if not native.available():
            raise RuntimeError(f"ZEROPP_QUANT_BACKEND=native, but {native.unavailable_reason()}")
        return "native"
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if t.is_cuda or interpret:
        return "triton"
    if choice == "triton":
        raise RuntimeError(
            "ZEROPP_QUANT_BACKEND=triton was asked for a CPU tensor, but Triton kernels run on the CPU only "
            "under its interpreter: set TRITON_INTERPRET=1 before importing zeropp, or use a CUDA tensor"
        )
    if native.available():
        return "native"
    native.warn_unavailable("CPU tensors run the torch reference instead (slower); ZEROPP_QUANT_BACKEND=torch "
                            "picks it without this warning")
    return "torch"


def _backend(t: torch.Tensor) -> ModuleType:
    name = backend_name(t)
    if name == "torch":
        return reference
    if name == "native":
        return native_cuda if t.is_cuda else native
    from . import _triton

    return _triton


def _check_buffer(buf: torch.Tensor, nbytes: int, name: str) -> None:
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8:
        got = buf.dtype if isinstance(buf, torch.Tensor) else type(buf).__name__
        raise TypeError(f"{name} must be a uint8 tensor holding packed codes and scales, got {got}")
    check_has_data(buf, name)
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D uint8 tensor, got shape {tuple(buf.shape)}")
    if buf.numel() != nbytes:
        raise ValueError(f"{name} has {buf.numel()} bytes but this layout needs {nbytes}")
    if nbytes and buf.data_ptr() % 4:
        raise ValueError(
            f"{name} starts at an address that is not a multiple of 4 bytes, so its float32 scales cannot be "
            "read in place; slice packed buffers at multiples of 4 bytes"
        )


def _check_out(out: torch.Tensor, numel: int | None, device: torch.device, name: str = "out") -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    check_has_data(out, name)
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{name} requires grad, and writing into it would bypass autograd; dequantize under torch.no_grad() "
            f"or pass {name}.detach()"
        )
    check_out_dtype(out.dtype)
    if not out.is_contiguous():
        raise ValueError(f"{name} must be contiguous (a contiguous view into a larger buffer is fine)")
    if numel is not None and out.numel() != numel:
        raise ValueError(f"{name} has {out.numel()} elements but {numel} are needed")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device} but the input is on {device}")


def _check_seed(seed: int | None) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise ValueError(
            f"seed={seed!r} must be None (round to nearest) or an integer in [0, 2**32) (stochastic rounding); "
            "derive it from the step and rank, e.g. (step * world + rank) % 2**32"
        )


def _check_counts(**counts: int) -> None:
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def quantize(
    x: torch.Tensor, bits: int = 8, block_size: int = DEFAULT_BLOCK_SIZE, *, seed: int | None = None
) -> QuantizedTensor:
    """Block-quantize ``x`` (any shape; fp32, bf16 or fp16) to int8, int4 or int2 with one float32 scale per block.

    Blocks run over the flattened tensor; the last one is padded with zeros. See ``zeropp.quant.format``. Codes
    round to nearest even, or stochastically (unbiased, reproducible) from ``seed``, an integer in ``[0, 2**32)``.

    A tensor that requires grad is quantized from its detached values: rounding to codes has no useful
    derivative, so the result carries no autograd history and no gradient flows back through it. A ``meta``
    tensor has no values: a ``ValueError`` names its device.
    """
    check_float_tensor(x)
    fmt = BlockFormat(bits, block_size)
    buffer = quantize_chunks(x, fmt, seed=seed)
    return QuantizedTensor(buffer, x.shape, x.dtype, fmt)


def dequantize(
    q: QuantizedTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Values of ``q`` in ``dtype`` (default: the dtype it was quantized from), shaped like the original.

    ``out``, if given, receives them and is returned: any contiguous tensor with ``q``'s number of elements, for
    instance a view into a larger flat buffer. Its dtype wins over ``dtype``. An ``out`` that requires grad is
    written only under ``torch.no_grad()`` (as torch's own ``out=`` ops); the result never carries autograd history.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"dequantize takes a QuantizedTensor, got {type(q).__name__}")
    if out is None:
        dtype = q.dtype if dtype is None else dtype
        check_out_dtype(dtype)
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    elif dtype is not None and dtype != out.dtype:
        raise ValueError(f"dtype={dtype} disagrees with out.dtype={out.dtype}; pass one of them")
    _check_out(out, q.numel, q.device)
    return dequantize_chunks(q.buffer, q.fmt, 1, q.numel, out)


def quantize_chunks(
    x: torch.Tensor,
    fmt: BlockFormat,
    chunks: int = 1,
    *,
    nodes: int = 1,
    out: torch.Tensor | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """Pack flattened ``x`` as ``chunks`` slices of ``ceil(numel / chunks)`` elements, one pack per slice.

    With ``nodes > 1`` the packs are written in the qgZ order (``format.swizzle_source``) for ``nodes`` nodes of
    ``chunks // nodes`` ranks. Returns the uint8 buffer of ``fmt.chunked_bytes(numel, chunks)`` bytes (``out`` if
    given). ``x`` is read detached, as in ``quantize``. With a ``seed`` (an integer in ``[0, 2**32)``) the codes
    are rounded stochastically: the same seed gives the same bytes on every backend, element ``i`` of ``x`` taking
    the noise of index ``i`` (``format.py``); give each rank and step its own seed.
    """
    check_float_tensor(x)
    _check_counts(chunks=chunks, nodes=nodes)
    _check_seed(seed)
    if chunks % nodes:
        raise ValueError(f"chunks={chunks} must be a multiple of nodes={nodes} (one chunk per rank)")
    flat = x.detach().reshape(-1)
    nbytes = fmt.chunked_bytes(flat.numel(), chunks)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    _check_buffer(out, nbytes, "out")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device} but x is on {x.device}")
    _backend(flat).quantize_chunks(flat, fmt, chunks, nodes, out, seed)
    return out


def quantize_delta(
    target: torch.Tensor, base: torch.Tensor, fmt: BlockFormat, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The pack (``fmt``, round to nearest; one chunk of ``quantize_chunks``) of ``target - base``, taken in
    float32: both of one float dtype and element count (any shape, read flattened and detached), widened to float32
    and subtracted (one float32 rounding). The weight-delta tier's ``zeropp.comm.pack_delta``.

    The native CPU library fuses the subtraction into the quantize (no full-size float32 temporary); the torch
    reference walks it piecewise; elsewhere (CUDA tensors, Triton's interpreter) the difference is made in torch and
    quantized by the backend's ``quantize_chunks``: the same bytes. Returns the uint8 pack of ``fmt.packed_bytes(n)``
    bytes (``out`` if given).
    """
    check_float_tensor(target)
    check_float_tensor(base)
    if target.dtype != base.dtype:
        raise TypeError(f"target is {target.dtype} but base is {base.dtype}; give both one dtype (or quantize_chunks "
                        "their float32 difference)")
    if target.numel() != base.numel() or target.device != base.device:
        raise ValueError(f"target ({target.numel()} elements on {target.device}) and base ({base.numel()} on "
                         f"{base.device}) must have one element count and device")
    t = target.detach().reshape(-1).contiguous()
    b = base.detach().reshape(-1).contiguous()
    nbytes = fmt.packed_bytes(t.numel())
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=t.device)
    _check_buffer(out, nbytes, "out")
    if out.device != t.device:
        raise ValueError(f"out is on {out.device} but target is on {t.device}")
    name = backend_name(t)
    if name == "torch":
        reference.quantize_delta(t, b, fmt, out)
    elif name == "native" and not t.is_cuda:
        native.quantize_delta(t, b, fmt, out)
    else:
        quantize_chunks(t.float() - b.float(), fmt, out=out)
    return out


def swizzle_quantize(
    x: torch.Tensor,
    fmt: BlockFormat,
    nodes: int,
    ranks_per_node: int,
    *,
    out: torch.Tensor | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """The first step of qgZ: pack the flat gradient ``x`` as one slice per rank, in the two-hop order.

    Slice ``r`` (elements ``[r * S, (r + 1) * S)``, ``S = ceil(numel / world)``) is the part that rank ``r`` of
    ``nodes * ranks_per_node`` will own. Pack position ``j * nodes + m`` holds the slice of rank
    ``m * ranks_per_node + j``, so the intra-node all-to-all sends local peer ``j`` one contiguous run. ``seed``:
    stochastic rounding, as in ``quantize_chunks``.
    """
    _check_counts(nodes=nodes, ranks_per_node=ranks_per_node)
    return quantize_chunks(x, fmt, nodes * ranks_per_node, nodes=nodes, out=out, seed=seed)



def _check_packs_into(buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor) -> None:
    """The checks of writing ``chunks`` packs of ``chunk_numel`` elements from ``buf`` into flat ``out``
    (``dequantize_chunks``, ``dequantize_add_chunks``): counts, the buffer's size, ``out``'s device and size."""
    _check_counts(chunks=chunks)
    if chunk_numel < 0:
        raise ValueError(f"chunk_numel={chunk_numel} must be non-negative")
    _check_buffer(buf, chunks * fmt.packed_bytes(chunk_numel), "buf")
    _check_out(out, None, buf.device)
    if out.numel() > chunks * chunk_numel:
        raise ValueError(f"out has {out.numel()} elements but the packs hold only {chunks} x {chunk_numel}")

def dequantize_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> torch.Tensor:
    """Dequantize ``chunks`` packs of ``chunk_numel`` elements each (e.g. an all-gathered buffer of one pack per
    rank) straight into ``out``, in ``out``'s dtype.

    ``out`` is flat-contiguous with at most ``chunks * chunk_numel`` elements; the values beyond its size (the
    padding of the last slice) are dropped. Returns ``out``.
    """
    _check_packs_into(buf, fmt, chunks, chunk_numel, out)
    _backend(buf).dequantize_chunks(buf, fmt, chunks, chunk_numel, out.view(-1))
    return out


def dequantize_add_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> torch.Tensor:
    """Add ``chunks`` packs of ``chunk_numel`` elements each into flat-contiguous ``out`` in place, fused: one
    pass, no temporary. Element ``i`` becomes ``dtype(D + float32(out[i]))``: ``D`` the dequantized value in
    float32 (``code * scale``, clamped to the finite range, as ``dequantize_chunks`` gives it), the sum one float32
    addition (not a fused multiply-add), rounded once to ``out``'s dtype (float32, bfloat16 or float16).

    ``out`` has at most ``chunks * chunk_numel`` elements, as in ``dequantize_chunks``; the padding is dropped.
    The weight-delta tier's ``zeropp.comm.add_delta``. Returns ``out``.
    """
    _check_packs_into(buf, fmt, chunks, chunk_numel, out)
    _backend(buf).dequantize_add_chunks(buf, fmt, chunks, chunk_numel, out.view(-1))
    return out


def reduce_requantize(
    buf: torch.Tensor,
    fmt: BlockFormat,
    groups: int,
    chunks: int,
    chunk_numel: int,
    *,
    out: torch.Tensor | None = None,
    out_fmt: BlockFormat | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """The middle step of qgZ, fused: ``buf`` holds ``groups`` runs of ``chunks`` packs of ``fmt`` (one run from
    each local peer); pack ``m`` of the result is the float32 sum over ``i`` of pack ``i * chunks + m``,
    requantized in ``out_fmt`` (default ``fmt``).

    ``out_fmt`` lets each hop have its own format: e.g. int8 packs summed inside the node and sent across nodes as
    int4 or int2 (``BlockFormat(4)``), any block size. ``seed`` (an integer in ``[0, 2**32)``): stochastic
    rounding, element ``e`` of pack ``m`` taking the noise of index ``m * chunk_numel + e`` (``format.py``).
    Returns the uint8 buffer of ``chunks`` packs of ``out_fmt`` (``out`` if given).
    """
    _check_counts(groups=groups, chunks=chunks)
    if chunk_numel < 0:
        raise ValueError(f"chunk_numel={chunk_numel} must be non-negative")
    if out_fmt is not None and not isinstance(out_fmt, BlockFormat):
        raise TypeError(f"out_fmt must be a BlockFormat or None (the input format), got {type(out_fmt).__name__}")
    _check_seed(seed)
    _check_buffer(buf, groups * chunks * fmt.packed_bytes(chunk_numel), "buf")
    out_bytes = chunks * (out_fmt or fmt).packed_bytes(chunk_numel)
    if out is None:
        out = torch.empty(out_bytes, dtype=torch.uint8, device=buf.device)
    _check_buffer(out, out_bytes, "out")
    if out.device != buf.device:
        raise ValueError(f"out is on {out.device} but buf is on {buf.device}")
    _backend(buf).reduce_requantize(buf, fmt, groups, chunks, chunk_numel, out, out_fmt, seed)
    return out


def reduce_dequantize(
    buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, out: torch.Tensor, *, divisor: float = 1.0
) -> torch.Tensor:
    """The last step of qgZ, fused: ``out = (sum of the groups packs in float32) / divisor`` in ``out``'s dtype.

    ``out`` is flat-contiguous with at most ``chunk_numel`` elements (the last rank's slice may be short).
    ``divisor`` is the world size for a mean, 1 for a sum. Returns ``out``.
    """
    _check_counts(groups=groups)
    if chunk_numel < 0:
        raise ValueError(f"chunk_numel={chunk_numel} must be non-negative")
    if not divisor > 0:
        raise ValueError(f"divisor={divisor} must be positive")
    _check_buffer(buf, groups * fmt.packed_bytes(chunk_numel), "buf")
    _check_out(out, None, buf.device)
    if out.numel() > chunk_numel:
        raise ValueError(f"out has {out.numel()} elements but a pack holds only {chunk_numel}")
    _backend(buf).reduce_dequantize(buf, fmt, groups, chunk_numel, out.view(-1), float(divisor))
    return out

