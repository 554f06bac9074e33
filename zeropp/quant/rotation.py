"""The block Hadamard rotation of qgZ gradients: its specification (the torch reference) and the public ops.

A gradient block with one large element gets a large scale, and int4 rounds its other elements to 0. Rotating
blocks of ``size`` consecutive elements by a Hadamard matrix before quantizing spreads every outlier over its
block (SDP4Bit, NeurIPS'24: 32-element rotations, validation loss 1.9313 with them, 1.9508 without, at 4-bit
inter-node gradients); undoing the rotation after the reduction restores the gradient.

**Spec.** ``size`` is a power of two from 16 to 128 (``ROTATION_SIZES``, default 32). A flat float32 tensor of
``n`` elements is cut into ``ceil(n / size)`` blocks of ``size`` consecutive elements from element 0; the last
block, when partial, is padded with zeros, and the result has ``rotated_numel(n, size)`` elements (the padding is
rotated with its block and carries part of it: keep it until the block is unrotated). Each block ``v`` becomes
``H v``, with ``H`` the unnormalized Walsh-Hadamard matrix of Sylvester's order (entries +1 and -1,
``H[i, j] = (-1) ** popcount(i & j)``), computed as the fast butterfly in this fixed order: for stage
``h = 1, 2, 4, ..., size / 2``, for every pair of positions ``(j, j + h)`` with ``j & h == 0``,
``(a, b) -> (a + b, a - b)``, each a float32 addition or subtraction rounded once to nearest even. The inverse is
the same butterfly followed by a multiplication by ``1 / size`` (a power of two, so exact unless the product is
subnormal, where it rounds once). Every backend does the same float32 operations on the same operands, so they
agree bit for bit (a NaN where the reference has one; NaN payloads are not specified). Inputs in bfloat16 and
float16 are widened to float32 first (exactly); the rotation itself always works in, and returns, float32.

**Accuracy.** ``H H = size * I``, so unrotating a rotation gives ``x`` back up to the butterflies' rounding: with
``u = 2 ** -24``, ``k = log2(size)`` and ``g = (1 + u) ** k - 1``, each element of a block is within
``g * (2 + g) * S`` of the original (plus ``2 ** -150`` for a subnormal result), ``S`` the sum of the block's
magnitudes: the forward butterfly is within ``g * S`` of ``H v`` element-wise, and the inverse adds ``g`` times
the sum of magnitudes of what it is given, at most ``size * (1 + g) * S``, before its division by ``size``.

**Why qgZ can reduce in the rotated space.** ``H`` is linear: ``sum_r H g_r = H sum_r g_r`` over the ranks'
gradients ``g_r``. So every rank rotates its gradient blocks, quantizes them (the swizzled quantize), and the
reductions (intra-node reduce-requantize, inter-node reduce-dequantize) sum rotated values exactly as they sum
plain ones: the sum of dequantized rotated blocks is the rotated sum, up to the quantization error (which the
rotation spreads evenly) and the float32 rounding of the sums. Only the final reduced shard is unrotated, once,
and the division by the world size (a scalar) commutes with it too. What the rotation needs from the layout:
each rotation block must lie within one rank's slice, so that a rank can unrotate its shard alone.

**qgZ's steps with the rotation.** ``swizzle_quantize_rotated`` and ``reduce_dequantize_rotated`` are qgZ's first
and last steps with the rotation, composed from the ops (the middle step, ``reduce_requantize``, is unchanged: it
sums and requantizes whole blocks, padding included): each rank's slice of ``S = ceil(numel / world)`` elements is
zero-padded to ``rotated_numel(S, size)`` and rotated on its own, then packed as ``swizzle_quantize`` packs it
(rounded stochastically with a seed, each rotated value with the noise of its index among the rotated slices);
since ``size`` divides the quantization block size, the packs have exactly the bytes of the unrotated ones. The
final step sums the packs in float32 (``reduce_dequantize``'s fused sum, divisor 1, padding included), unrotates,
divides by ``divisor`` in float32 and converts to ``out``'s dtype, dropping the padding last: the padding of a
rotated slice holds part of its last block. These compositions are the spec of the fused kernels (native CPU and
Triton), which rotate each block inside the quantize and unrotate it inside the final reduce, saving the two extra
passes over the gradient (``docs/rotation.md``), stochastic rounding included; the torch backend runs the
compositions themselves.

**Backends**, as for the quantization ops (``ops.backend_name``): the native CPU library
(``kernels/cpu/rotation.cpp``, and ``quant.cpp`` for the fused steps) for CPU tensors where it is built, else this
reference; the Triton kernels (``zeropp.quant._triton.rotation``, and the quantize and reduce kernels for the fused
steps) for CUDA tensors and for CPU tensors under ``TRITON_INTERPRET=1``. The standalone rotation runs the Triton
kernel with ``ZEROPP_QUANT_BACKEND=native`` too (the native CUDA kernels have no rotation); the fused steps are
refused there with a ``NativeCudaError`` that names the Triton kernels. The Triton kernel widens a bfloat16 or
float16 input as it loads it; the native library takes float32, so torch widens such an input first (one more pass).
"""

from __future__ import annotations

import torch

from . import native, native_cuda, ops
from .format import BlockFormat, check_float_tensor, check_has_data, check_out_dtype
from .format import chunk_numel as slice_numel
from .ops import backend_name

ROTATION_SIZES = (16, 32, 64, 128)
"""Block sizes of the rotation (elements)."""

DEFAULT_ROTATION_SIZE = 32
"""SDP4Bit's block size."""


def check_rotation_size(size: int) -> None:
    """Raise ``ValueError`` unless ``size`` is one of ``ROTATION_SIZES``."""
    if isinstance(size, bool) or size not in ROTATION_SIZES:
        raise ValueError(f"rotation size={size!r} must be one of {ROTATION_SIZES} (a power of two)")


def rotated_numel(numel: int, size: int) -> int:
    """Elements of the rotation of ``numel`` elements: ``numel`` rounded up to a multiple of ``size``."""
    return -(-numel // size) * size


def hadamard(x: torch.Tensor, size: int, inverse: bool, out: torch.Tensor) -> None:
    """The spec: ``out`` (flat float32, ``rotated_numel(x.numel(), size)`` elements) = the blocks of flat ``x``
    (float32, or bfloat16 or float16 widened to float32), zero-padded, through the butterfly of the module docstring
    (then times ``1 / size`` if ``inverse``)."""
    v = torch.zeros(out.numel(), dtype=torch.float32, device=x.device)
    v[: x.numel()] = x
    h = 1
    while h < size:
        pairs = v.view(-1, size // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        v = torch.stack((a + b, a - b), dim=2).view(-1)
        h *= 2
    if inverse:
        v = v * (1.0 / size)
    out.copy_(v)


def _run(x: torch.Tensor, size: int, inverse: bool, out: torch.Tensor | None) -> torch.Tensor:
    check_float_tensor(x)
    check_rotation_size(size)
    flat = x.detach().reshape(-1)
    numel = rotated_numel(flat.numel(), size)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=x.device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"out must be a float32 tensor (the rotation works in float32), got {got}")
    check_has_data(out, "out")
    if out.dim() != 1 or not out.is_contiguous() or out.numel() != numel:
        raise ValueError(f"out must be a contiguous 1-D tensor of {numel} elements, got shape {tuple(out.shape)}")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device} but x is on {x.device}")
    if out.requires_grad and torch.is_grad_enabled():
        raise ValueError("out requires grad, and writing into it would bypass autograd; pass out.detach()")
    if numel == 0:
        return out
    name = "triton" if flat.is_cuda else backend_name(flat)
    if name == "torch":
        hadamard(flat, size, inverse, out)
    elif name == "native":
        native.hadamard(flat.to(torch.float32), size, inverse, out)
    else:
        from . import _triton

        _triton.hadamard(flat, size, inverse, out)
    return out


def hadamard_rotate(x: torch.Tensor, size: int = DEFAULT_ROTATION_SIZE, *, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The blocks of ``size`` consecutive elements of flattened ``x`` (fp32, bf16 or fp16; the last block
    zero-padded) rotated by the unnormalized Hadamard matrix: a flat float32 tensor of
    ``rotated_numel(x.numel(), size)`` elements (``out`` if given). ``x`` is read detached; see the module
    docstring for the exact operations."""
    return _run(x, size, False, out)


def hadamard_unrotate(y: torch.Tensor, size: int = DEFAULT_ROTATION_SIZE, *, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """The inverse of ``hadamard_rotate``: the blocks of flattened ``y`` through the same butterfly, times
    ``1 / size``; a flat float32 tensor of ``rotated_numel(y.numel(), size)`` elements (``out`` if given). A
    rotation's padding must be passed back with it; slice the result to drop it."""
    return _run(y, size, True, out)


def _check_fits(fmt: BlockFormat, size: int) -> None:
    check_rotation_size(size)
    if size > fmt.block_size:
        raise ValueError(f"rotation size={size} is larger than the quantization block size {fmt.block_size}: a "
                         "rotation block must lie inside one quantization block; use a rotation size <= block size")


def swizzle_quantize_rotated(x: torch.Tensor, fmt: BlockFormat, nodes: int, ranks_per_node: int,
                             size: int = DEFAULT_ROTATION_SIZE, *, out: torch.Tensor | None = None,
                             seed: int | None = None) -> torch.Tensor:
    """qgZ's first step with the rotation: ``ops.swizzle_quantize`` of flattened ``x`` with each rank's slice
    (``ceil(numel / world)`` elements) zero-padded to a multiple of ``size`` and rotated first. Returns the uint8
    packs (``out`` if given), the same number of bytes as ``swizzle_quantize`` writes; each pack holds
    ``rotated_numel(slice, size)`` rotated values. ``size`` must not exceed ``fmt.block_size``. With a ``seed`` (an
    integer in ``[0, 2**32)``) the codes are rounded stochastically, element ``e`` of rotated slice ``s`` taking the
    noise of index ``s * rotated_numel(slice, size) + e``: its index in ``rotate_slices(x, world, size)``.

    The spec is that composition, ``swizzle_quantize(rotate_slices(x, world, size), ..., seed=seed)``, which the
    torch backend runs; the native CPU and Triton kernels rotate each block as they load it and quantize it, with
    the same noise when seeded (one pass), bit for bit the same."""
    _check_fits(fmt, size)
    check_float_tensor(x)
    ops._check_counts(nodes=nodes, ranks_per_node=ranks_per_node)
    ops._check_seed(seed)
    flat = x.detach().reshape(-1)
    chunks = nodes * ranks_per_node
    nbytes = fmt.chunked_bytes(flat.numel(), chunks)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    ops._check_buffer(out, nbytes, "out")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device} but x is on {x.device}")
    if flat.numel() == 0:
        return out
    name = backend_name(flat)
    if name == "torch":
        ops.swizzle_quantize(rotate_slices(flat, chunks, size), fmt, nodes, ranks_per_node, out=out, seed=seed)
    elif name == "native":
        (native_cuda if flat.is_cuda else native).quantize_chunks_rotated(flat, fmt, chunks, nodes, size, out, seed)
    else:
        from . import _triton

        _triton.quantize_chunks_rotated(flat, fmt, chunks, nodes, size, out, seed)
    return out


def rotate_slices(x: torch.Tensor, slices: int, size: int = DEFAULT_ROTATION_SIZE) -> torch.Tensor:
    """Flattened ``x`` cut into ``slices`` slices of ``ceil(numel / slices)`` elements (the chunked layout: the last
    ones short or empty), each zero-padded to ``rotated_numel(slice, size)`` and rotated on its own: a flat float32
    tensor of ``slices * rotated_numel(slice, size)`` elements, slice after slice (what ``swizzle_quantize_rotated``
    packs)."""
    check_float_tensor(x)
    flat = x.detach().reshape(-1)
    plain = slice_numel(flat.numel(), slices)
    if flat.numel() == slices * plain and plain % size == 0:  # no padding (the engine's block-aligned shards)
        return hadamard_rotate(flat, size)
    padded = torch.zeros(slices * plain, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    rows = torch.zeros(slices, rotated_numel(plain, size), dtype=flat.dtype, device=flat.device)
    rows[:, :plain] = padded.view(slices, plain)
    return hadamard_rotate(rows, size)


def reduce_dequantize_rotated(buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, out: torch.Tensor,
                              size: int = DEFAULT_ROTATION_SIZE, *, divisor: float = 1.0) -> torch.Tensor:
    """qgZ's last step with the rotation: the float32 sum of ``groups`` packs of rotated values (of slices of
    ``chunk_numel`` plain elements, as ``swizzle_quantize_rotated`` packs them), unrotated, divided by ``divisor``
    (float32 division), the first ``out.numel()`` values (at most ``chunk_numel``) written into flat-contiguous
    ``out`` in its dtype. Returns ``out``.

    The spec is the composition that the torch backend runs: ``reduce_dequantize`` (divisor 1) into a float32
    buffer of ``rotated_numel(chunk_numel, size)`` elements, ``hadamard_unrotate``, the division, the conversion
    to ``out``'s dtype, the padding dropped. The native CPU and Triton kernels unrotate each block of sums in
    place before dividing (one pass), bit for bit the same."""
    _check_fits(fmt, size)
    ops._check_counts(groups=groups)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    check_out_dtype(out.dtype)
    if not out.is_contiguous() or out.numel() > chunk_numel:
        raise ValueError(f"out must be contiguous with at most chunk_numel={chunk_numel} elements, got "
                         f"{out.numel()}")
    if not divisor > 0:
        raise ValueError(f"divisor={divisor} must be positive")
    ops._check_buffer(buf, groups * fmt.packed_bytes(chunk_numel), "buf")
    ops._check_out(out, None, buf.device)
    if out.numel() == 0:
        return out
    name = backend_name(buf)
    if name == "torch":
        summed = torch.empty(rotated_numel(chunk_numel, size), dtype=torch.float32, device=buf.device)
        ops.reduce_dequantize(buf, fmt, groups, summed.numel(), summed)
        values = hadamard_unrotate(summed, size)[: out.numel()]
        if divisor != 1.0:
            values = values / torch.tensor(divisor, dtype=torch.float32, device=values.device)
        out.view(-1).copy_(values)
    elif name == "native":
        (native_cuda if buf.is_cuda else native).reduce_dequantize_rotated(buf, fmt, groups, chunk_numel, size,
                                                                          out.view(-1), float(divisor))
    else:
        from . import _triton

        _triton.reduce_dequantize_rotated(buf, fmt, groups, chunk_numel, size, out.view(-1), float(divisor))
    return out
