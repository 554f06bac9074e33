"""Reduce-scatter, exact or quantized in two hops (qgZ), with optional error feedback.

Layout (both paths): the flat input of ``numel`` elements is cut into ``P`` slices of ``S = ceil(numel / P)``
elements; rank ``r`` (its position in the data-parallel group) receives slice ``r`` of the sum or mean,
``[r * S, min((r + 1) * S, numel))`` — ``shard_range`` — which is ``torch.distributed.reduce_scatter_tensor``'s
layout when ``P`` divides ``numel``. Otherwise the last slices are short (or empty) and padded internally.

qgZ with ``n`` nodes of ``d`` ranks, every slice packed on its own (``B = fmt.packed_bytes(S)`` bytes):

1. ``swizzle_quantize``: pack the ``P`` slices into one buffer, grouped by destination local index ``k``: run
   ``k`` holds, in the order of local index ``k``'s inter-node group, the slices whose owners have local index k;
2. intra-node ``all_to_all_single``: local peer ``k`` gets run ``k`` (``n * B`` bytes per peer);
3. ``reduce_requantize``: sum the ``d`` received runs pack-wise in float32 and requantize (one fused op);
4. inter-node ``all_to_all_single``: node peer ``i`` gets pack ``i`` (``B`` bytes per peer);
5. ``reduce_dequantize``: sum the ``n`` packs in float32, divide by ``P`` for a mean (once), write ``out``.

One node skips 3–4 (step 5 sums the ``d`` packs of hop 1); one rank per node skips 2–3; one rank copies.
Bytes per rank: hop 1 sends and receives ``(d - 1) * n * B1`` intra-node, hop 2 ``(n - 1) * B`` inter-node;
with int4 that is about ``numel / (2 d) * (n - 1) / n`` bytes across nodes, plus the scales. ``B1 = B`` unless
``intra_bits`` gives the intra-node hop its own width (SDP4Bit's 8 bits inside the node, 4 across): step 1 then
packs in ``intra_bits`` and step 3 requantizes the partial sums to ``bits`` (``reduce_requantize``'s ``out_fmt``).

Exact path with ``wire_dtype`` (the engine's ``communication_data_type`` bf16/fp16): an ``all_to_all_single`` in
that dtype moves the same bytes as a reduce-scatter in it, but the sum happens at the receiver in float64, not on
the wire in 16 bits. The result is the correctly rounded mean of the ranks' wire values whenever their float64 sum
is exact: always for ``P <= 2^11`` values of one 16-bit format whose magnitudes are within ``2^30`` of each other
(bf16 keeps 8 significant bits, fp16 11; float64 53); outside that, within one float64 rounding of it. The division
by ``P`` comes after the sum (post-divide): with no 16-bit sum there is nothing for DeepSpeed's pre-division
(``gradient_predivide_factor``) to keep from overflowing, and pre-dividing would push small fp16 gradients into
its subnormal range.

Error bound (per element of the result, before the division by ``P``): the sum over the ``P`` ranks of their
hop-1 errors (each at most half the scale of its block) plus the hop-2 requantization error of each partial sum
(at most half the scale of the partial-sum block).

Rotation (``rotation=R``, ``zeropp.quant.rotation``): step 1 zero-pads each rank's slice to ``S' =
rotated_numel(S, R)`` elements and rotates its blocks of ``R`` by the Hadamard matrix ``H`` before packing
(``swizzle_quantize_rotated``); steps 2-4 move and sum the rotated packs unchanged (``H`` is linear, so the sum of
rotated slices is the rotated sum); step 5 sums, unrotates by ``H / R`` and divides (``reduce_dequantize_rotated``).
On the native CPU and Triton backends steps 1 and 5 are fused kernels (the rotation inside the quantize, seeded
or not, the inverse inside the final reduce: no pass of their own), bit for bit the unfused ops.
``R`` divides the block size, so a pack of ``S'`` rotated values has the bytes of a pack of ``S`` plain ones: the
traffic is unchanged. Error bound: the bound above holds in the rotated space, with the scales of the rotated
blocks; unrotating maps an error ``e`` of a rotation block to ``H e / R``, each element of which is the mean of
``R`` terms ``+-e_j``, so an element-wise bound carries over unchanged (and the block's 2-norm error shrinks by
``sqrt(R)``, since ``H / R`` has norm ``1 / sqrt(R)``). What it buys: a block's scale follows its largest value;
after the rotation an outlier ``M`` contributes ``+-M`` to each of ``R`` values whose typical size has grown by
``sqrt(R)``, so it dominates the scale ``sqrt(R)`` times less and the other values of a heavy-tailed block keep
more of their bits.

Stochastic rounding (``seed=``, QSDP's unbiased rounding): every quantization of steps 1 and 3 rounds its codes
stochastically (``zeropp.quant.format``), deterministic from ``seed``: rank ``r`` (group rank) rounds step 1 with
``hop_seed(seed, 1, r)`` and step 3 with ``hop_seed(seed, 2, r)``, so the noise of every hop and rank is its own
while a run with the same seeds gives the same bytes. Each code is then unbiased (its mean over the noise is the
value it codes), so the result's expectation is the exact mean; the per-element bound doubles (a code is one of the
two nearest, within a full scale instead of half of one). The caller gives each call (step, buffer) its own seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from ..quant import (
    DEFAULT_BLOCK_SIZE,
    BlockFormat,
    chunk_numel,
    dequantize_add_chunks,
    dequantize_chunks,
    quantize_chunks,
    reduce_dequantize,
    reduce_dequantize_rotated,
    reduce_requantize,
    rotate_slices,
    rotated_numel,
    swizzle_quantize,
    swizzle_quantize_rotated,
    swizzle_source,
)
from ..quant.rotation import check_rotation_size
from . import accounting
from ._dist import reduce_scatter_flat
from .checks import (
    UNUSED,
    call_record,
    check_bits,
    check_input,
    check_out,
    dtype_code,
    verify_agreement,
)
from .topology import Topology, get_default_topology
from .work import CollectiveWork, Pending, run


class ReduceOp(Enum):
    """How ``reduce_scatter`` combines the ranks' tensors."""

    SUM = "sum"
    AVG = "avg"


def _as_op(op: object) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str) and op.lower() in ("sum", "avg"):
        return ReduceOp(op.lower())
    if op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if op == dist.ReduceOp.AVG:
        return ReduceOp.AVG
    raise ValueError(f"op={op!r} is not supported; use ReduceOp.AVG or ReduceOp.SUM")


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of a flat tensor of ``numel`` that rank ``rank`` of ``world_size`` receives from
    ``reduce_scatter`` (slices of ``ceil(numel / world_size)``; the last ones may be short or empty)."""
    s = chunk_numel(numel, world_size) if numel else 0
    start = min(rank * s, numel)
    return start, min(start + s, numel)


def derive_seed(*parts: object) -> int:
    """A stochastic-rounding seed (``[0, 2**32)``) named by ``parts``: the first 4 bytes, little-endian, of SHA-256
    of the parts joined by ``/`` (``derive_seed(7, 1, 0)`` hashes ``"7/1/0"``). Every caller that needs a seed per
    reduction, hop or call derives it here."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "little")


def hop_seed(seed: int, hop: int, rank: int) -> int:
    """The stochastic-rounding seed of qgZ's hop ``hop`` (1: the slices' packing, 2: the requantization of the
    partial sums) on group rank ``rank`` for a ``reduce_scatter(seed=seed)``: ``derive_seed(seed, hop, rank)``."""
    return derive_seed(seed, hop, rank)


class ErrorFeedback:
    """Error-feedback state of one gradient buffer for quantized ``reduce_scatter``.

    Keeps what quantization dropped last time and adds it back next time: the residual of this rank's hop-1
    quantization (``numel`` elements) and of its hop-2 requantization (``n * S`` elements of the partial sums it
    forwards). With a rotation both live in the rotated space (what the quantization dropped of the rotated
    values): ``P * S'`` and ``n * S'`` elements, ``S' = rotated_numel(S, R)``. Use one object per buffer; the
    accumulated error of repeated reductions then stays bounded instead of growing with the number of steps. Off
    unless passed to ``reduce_scatter``. A step whose gradient holds a NaN or Inf (an fp16 overflow the optimizer
    will skip) leaves zeros, not NaNs, in the residual.

    Two stores (``store``):

    * ``"fp32"`` (default): the residual in float32, 4 bytes per element; for a value ``x`` (gradient plus
      residual) packed as ``q``: ``e <- x - dequantize(q)``.
    * ``"loco"`` (LoCo, arXiv 2407.04480: the error kept as a moving average and stored in 8 bits): the residual
      is stored as int8 packs of ``block_size`` (``BlockFormat(8, block_size)``, blocks from each slice's start as
      the gradient's: ``1 + 4 / block_size`` bytes per element, 1.03 at 128), and updated as
      ``e <- quantize8(beta * e + (1 - beta) * (x - dequantize(q)))`` (``e`` on the right the stored,
      dequantized residual, ``x = g + e``; ``beta`` the moving-average coefficient, in ``[0, 1)``; rounded to
      nearest, in float32, NaN/Inf to 0). ``beta = 0`` is the fp32 store's recurrence with its residual rounded to
      8 bits. For a steady error ``d`` per step the stored residual tends to ``d``, as the fp32 one does; the
      average damps the step-to-step noise of the error.

    The stores' residuals are ``residual`` and ``partial_residual``: float32 elements, or the uint8 packs of the
    8-bit store (``values`` reads either as float32). CUDA streams: ``residual`` is updated on the stream that
    issues a reduction, ``partial_residual`` on the one that ``wait()``s for it; wait for successive reductions of
    one buffer on one stream (or order the streams).
    """

    STORES = ("fp32", "loco")

    def __init__(self, store: str = "fp32", beta: float = 0.0) -> None:
        if store not in self.STORES:
            raise ValueError(f"store={store!r} must be one of {self.STORES} (float32 or LoCo's 8-bit residuals)")
        if not 0.0 <= beta < 1.0 or (store == "fp32" and beta):
            raise ValueError(f"beta={beta!r} must be in [0, 1), and 0 with the fp32 store (LoCo's moving average "
                             "needs store='loco')")
        self.store, self.beta = store, beta
        self.residual: torch.Tensor | None = None
        self.partial_residual: torch.Tensor | None = None
        self._key: tuple[Any, ...] | None = None
        self._shapes: tuple[tuple[int, int], tuple[int, int]] | None = None  # (elements, slices) of each residual

    def reset(self) -> None:
        """Forget the residuals (e.g. after the buffer is reallocated)."""
        self.residual = self.partial_residual = None
        self._key = self._shapes = None

    @property
    def key(self) -> tuple[Any, ...] | None:
        """``(numel, bits, block_size, group size, rotation size or 0, intra-node hop's bits, store bits)`` of the
        reduce-scatter the residuals belong to (``None``: no residuals yet; store bits 0 for fp32, 8 for LoCo). The
        residuals' layout and space depend on all seven and on the node layout."""
        return self._key

    @property
    def numels(self) -> tuple[int, int]:
        """Elements of ``residual`` and ``partial_residual`` (``(0, 0)`` before the first reduction)."""
        return (self._shapes[0][0], self._shapes[1][0]) if self._shapes else (0, 0)

    @property
    def nbytes(self) -> int:
        """Bytes the residuals take: 4 per element with the fp32 store, ``1 + 4 / block_size`` with LoCo's."""
        return sum(t.numel() * t.element_size() for t in (self.residual, self.partial_residual) if t is not None)

    def _format(self) -> BlockFormat:
        assert self._key is not None
        return BlockFormat(8, self._key[2])

    def allocate(self, key: tuple[Any, ...], numel: int, partial: int, device: torch.device,
                 slices: tuple[int, int] = (1, 1)) -> None:
        """Make zeroed residuals of ``numel`` and ``partial`` elements (cut into ``slices`` slices each: the packs
        of the 8-bit store) for the reduce-scatter ``key``, unless residuals for ``key`` exist; raises if they exist
        for another key. A checkpoint loader calls it to get the tensors to read saved residuals into."""
        key = (*key[:6], 8 if self.store == "loco" else 0)
        if self._key is None:
            self._key = key
            self._shapes = ((numel, slices[0]), (partial, slices[1]))
            if self.store == "fp32":
                self.residual = torch.zeros(numel, dtype=torch.float32, device=device)
                self.partial_residual = torch.zeros(partial, dtype=torch.float32, device=device)
            else:  # all-zero packs: zero codes and scales, which dequantize to 0
                fmt = self._format()
                self.residual = torch.zeros(fmt.chunked_bytes(numel, slices[0]), dtype=torch.uint8, device=device)
                self.partial_residual = torch.zeros(fmt.chunked_bytes(partial, slices[1]), dtype=torch.uint8,
                                                    device=device)
        elif self._key != key:
            raise ValueError(
                f"this ErrorFeedback was used for a reduce_scatter of {self._key[:6]} (numel, bits, block_size, "
                f"group size, rotation, intra_bits) and now gets {key[:6]}; use one ErrorFeedback per buffer, or "
                "reset() it"
            )

    def values(self, partial: bool = False) -> torch.Tensor:
        """The residual (``partial``: the partial sums' one) as float32 elements: the stored tensor itself with
        the fp32 store, a new dequantized tensor with LoCo's."""
        stored = self.partial_residual if partial else self.residual
        assert stored is not None and self._shapes is not None, "allocate() first"
        if self.store == "fp32":
            return stored
        numel, slices = self._shapes[partial]
        out = torch.empty(numel, dtype=torch.float32, device=stored.device)
        return dequantize_chunks(stored, self._format(), slices, chunk_numel(numel, slices) if numel else 0, out)

    def add_to(self, x: torch.Tensor, partial: bool = False) -> None:
        """Add the residual (``partial``: the partial sums' one) into the float32 ``x`` in place: the residual's
        elements, flat or viewed as ``(slices, elements per slice)`` with any strides (``store_error``'s forms)."""
        x.add_(self.values(partial).view(x.shape))

    def update(self, x: torch.Tensor, sent: torch.Tensor, partial: bool = False) -> None:
        """Record what the quantization of the float32 ``x`` (gradient plus residual, the residual's layout)
        dropped, ``x - sent`` with ``sent`` what the packs hold (float32, same layout; may be overwritten), into
        the residual (``partial``: the partial sums' one), by the store's recurrence."""
        self.store_error(torch.sub(x, sent, out=sent).nan_to_num_(0.0, 0.0, 0.0), partial)

    def store_error(self, error: torch.Tensor, partial: bool = False) -> None:
        """Record ``error`` (float32, finite; may be overwritten), what the quantization dropped, into the residual
        (``partial``: the partial sums' one) by the store's recurrence (``update``). ``error`` holds the residual's
        elements in its layout: flat, or viewed as ``(slices, elements per slice)`` with any strides (e.g. one
        unit's columns of a bucket's error, ``BucketErrorFeedback``)."""
        if self.store == "fp32":
            (self.partial_residual if partial else self.residual).view(error.shape).copy_(error)
            return
        assert self._shapes is not None
        if self.beta:
            error.mul_(1.0 - self.beta).add_(self.values(partial).view(error.shape).mul_(self.beta))
        slices = self._shapes[partial][1]
        quantize_chunks(error.reshape(-1), self._format(), slices,
                        out=self.partial_residual if partial else self.residual)

    def rescale(self, factor: float) -> None:
        """Multiply the residuals by ``factor`` (a power of two: exact), e.g. when the loss scale they are in
        changes: the fp32 values, or the 8-bit packs' scales."""
        for stored, (numel, slices) in zip((self.residual, self.partial_residual), self._shapes or ()):
            if stored is None:
                continue
            if self.store == "fp32":
                stored.mul_(factor)
            else:
                fmt = self._format()
                blocks = fmt.num_blocks(chunk_numel(numel, slices) if numel else 0)
                packs = stored.view(slices, -1)
                scales = packs[:, blocks * fmt.block_code_bytes :].clone().view(torch.float32).mul_(factor)
                packs[:, blocks * fmt.block_code_bytes :] = scales.view(torch.uint8)


def reduce_scatter(
    full: torch.Tensor,
    bits: int | None = None,
    *,
    op: ReduceOp | str | dist.ReduceOp = ReduceOp.AVG,
    topology: Topology | None = None,
    out: torch.Tensor | None = None,
    async_op: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    reduce_dtype: torch.dtype | None = None,
    wire_dtype: torch.dtype | None = None,
    error_feedback: ErrorFeedback | None = None,
    rotation: int | None = None,
    intra_bits: int | None = None,
    seed: int | None = None,
) -> torch.Tensor | CollectiveWork:
    """Sum or average ``full`` over the data-parallel group of ``topology``; rank ``r`` gets slice ``r``.

    Args:
        full: this rank's contiguous float tensor (any shape, any numel); every rank passes the same numel and
            dtype. qgZ takes fp32, bf16 and fp16; the exact path any floating point dtype.
        bits: ``None`` for an exact reduce-scatter (``reduce_scatter_tensor``), 8, 4 or 2 for qgZ (the bits of
            the inter-node hop, and of both hops unless ``intra_bits`` says otherwise).
        op: ``ReduceOp.AVG`` (default; divides by the group size exactly once) or ``ReduceOp.SUM``.
        topology: node layout and data-parallel group (default: ``get_default_topology()``).
        out: contiguous tensor of ``stop - start`` elements (``shard_range``) on ``full``'s device, any float
            dtype. Default: a new flat tensor of ``full``'s dtype.
        async_op: return a ``CollectiveWork`` whose ``wait()`` returns ``out``.
        block_size: elements per quantization block (qgZ only).
        reduce_dtype: exact path only: the dtype summed on the wire. Default ``full.dtype`` — bit-identical to
            ``reduce_scatter_tensor``, but gloo sums bf16/fp16 in that dtype, rounding at every step; pass
            ``torch.float32`` for one rounding at the end (twice the bytes of bf16). qgZ always sums in float32.
        wire_dtype: exact path only, instead of ``reduce_dtype``: every rank's values travel in this dtype (one
            ``all_to_all_single`` of the ``P`` slices: the bytes of a reduce-scatter in that dtype) and each rank
            sums the ``P`` slices it receives itself, in float64 and in group-rank order, divides once and rounds
            once into ``out``. Nothing is added in ``wire_dtype``, so a bf16/fp16 wire neither overflows in the
            sum nor loses low bits to it (see the module docstring); values not already of ``wire_dtype`` are
            rounded to it once, on the sender.
        error_feedback: qgZ only: an ``ErrorFeedback`` holding this buffer's residuals (default: none).
        rotation: qgZ only: the block size ``R`` of a Hadamard rotation of every rank's slice before it is
            quantized, undone after the reduction (see the module docstring); one of
            ``zeropp.quant.ROTATION_SIZES`` dividing ``block_size``. ``None`` (default): no rotation.
        intra_bits: qgZ only: the bits of the intra-node hop (step 1's packs; step 3 requantizes them to ``bits``
            for the inter-node hop), e.g. 8 inside the node and 4 across as SDP4Bit. ``None`` (default): ``bits``.
        seed: qgZ only: round stochastically (unbiased), each hop and rank with its own seed derived from this one
            (``hop_seed``; an integer in ``[0, 2**32)``, the same on every rank; see the module docstring).
            ``None`` (default): round to nearest. Give each call its own seed, or the rounding noise repeats.

    Returns:
        ``out`` (or a ``CollectiveWork`` when ``async_op``).
    """
    check_bits(bits)
    check_input(full, "full", quantized=bits is not None)
    if not full.is_floating_point():
        raise TypeError(f"full has dtype {full.dtype}; reduce_scatter takes floating point tensors")
    reduce_op = _as_op(op)
    topo = topology if topology is not None else get_default_topology()
    size, rank = topo.world_size, topo.rank
    numel = full.numel()
    start, stop = shard_range(numel, size, rank)
    if out is None:
        out = torch.empty(stop - start, dtype=full.dtype, device=full.device)
    check_out(out, stop - start, full.device, dtype=None, float_only=bits is not None)
    if not out.is_floating_point():
        raise TypeError(f"out has dtype {out.dtype}; reduce_scatter writes floating point values")
    if wire_dtype is not None:
        if bits is not None or reduce_dtype is not None:
            raise ValueError("wire_dtype applies to the exact path (bits=None) and replaces reduce_dtype; pass one")
        if not wire_dtype.is_floating_point:
            raise TypeError(f"wire_dtype={wire_dtype} must be a floating point dtype")
    if reduce_dtype is not None:
        if bits is not None:
            raise ValueError("reduce_dtype applies to the exact path (bits=None); qgZ always sums in float32")
        if not reduce_dtype.is_floating_point:
            raise TypeError(f"reduce_dtype={reduce_dtype} must be a floating point dtype")
    if error_feedback is not None and bits is None:
        raise ValueError("error_feedback applies to quantized reduce_scatter; pass bits=8 or 4")
    if rotation is not None:
        if bits is None:
            raise ValueError(f"rotation={rotation} applies to quantized reduce_scatter; pass bits=8 or 4, or "
                             "rotation=None")
        check_rotation_size(rotation)
        if block_size % rotation:
            raise ValueError(f"rotation={rotation} must divide block_size={block_size} (each rotation block inside "
                             "one quantization block); use a smaller rotation or a larger block size")
    if intra_bits is not None:
        if bits is None:
            raise ValueError(f"intra_bits={intra_bits} applies to quantized reduce_scatter; pass bits=8, 4 or 2, or "
                             "intra_bits=None")
        check_bits(intra_bits)
    if seed is not None:
        if bits is None:
            raise ValueError(f"seed={seed} (stochastic rounding) applies to quantized reduce_scatter; pass bits=8, 4 "
                             "or 2, or seed=None")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed={seed!r} must be an integer in [0, 2**32) (or None: round to nearest)")
    fmt = BlockFormat(bits, block_size) if bits is not None else None
    hop1 = BlockFormat(intra_bits, block_size) if intra_bits is not None else fmt
    record = call_record(
        "reduce_scatter", numel=numel, dtype=dtype_code(full.dtype), bits=bits or 0, block_size=block_size,
        op=0 if reduce_op is ReduceOp.SUM else 1, out_dtype=dtype_code(out.dtype),
        reduce_dtype=dtype_code(reduce_dtype) if reduce_dtype is not None else UNUSED,
        wire_dtype=dtype_code(wire_dtype) if wire_dtype is not None else UNUSED,
        rotation=rotation or 0, intra_bits=intra_bits or 0,
    )
    verify_agreement(topo.verified_calls, topo.group, full.device, record)
    rotated = f", rotation={rotation}" if rotation else ""
    rotated += f", intra_bits={intra_bits}" if intra_bits is not None else ""
    rotated += f", seed={seed}" if seed is not None else ""
    what = (f"reduce_scatter(bits={bits}, op={reduce_op.value}{rotated}) of {numel} {full.dtype} elements over ranks "
            f"{topo.ranks}")
    divisor = size if reduce_op is ReduceOp.AVG else 1
    flat = full.view(-1)
    if size == 1 or numel == 0:
        steps = _identity(flat, out)
    elif wire_dtype is not None:
        steps = _wire_steps(flat, out, topo, divisor, wire_dtype)
    elif fmt is None:
        steps = _exact_steps(flat, out, topo, divisor, reduce_dtype or full.dtype)
    else:
        steps = _qgz_steps(flat, out, fmt, hop1, topo, divisor, error_feedback, rotation, seed)
    return run(steps, async_op, (full, out), what)


def _identity(flat: torch.Tensor, out: torch.Tensor) -> Generator[Pending, None, torch.Tensor]:
    accounting.record("reduce_scatter", accounting.Traffic())
    out.view(-1).copy_(flat)
    return out
    yield  # a generator with no communication


def _exact_steps(
    flat: torch.Tensor, out: torch.Tensor, topo: Topology, divisor: int, rdtype: torch.dtype
) -> Generator[Pending, None, torch.Tensor]:
    size = topo.world_size
    numel = flat.numel()
    s = chunk_numel(numel, size) if numel else 0
    direct = numel == size * s and flat.dtype == rdtype and out.dtype == rdtype and out.numel() == s
    if direct:
        send, recv = flat, out.view(-1)
    else:  # pad to P * S (and/or change dtype) in a staging buffer
        send = torch.empty(size * s, dtype=rdtype, device=flat.device)
        send[:numel].copy_(flat)
        send[numel:].zero_()
        recv = torch.empty(s, dtype=rdtype, device=flat.device)
    accounting.record(
        "reduce_scatter",
        accounting.gather_traffic(s * recv.element_size(), size, topo.same_node_count(topo.group)),
    )
    work = reduce_scatter_flat(recv, send, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
    yield work, (send, recv), ""
    if divisor != 1:
        recv.div_(divisor)
    if not direct:
        out.view(-1).copy_(recv[: out.numel()])
    return out


def _wire_steps(
    flat: torch.Tensor, out: torch.Tensor, topo: Topology, divisor: int, wdtype: torch.dtype
) -> Generator[Pending, None, torch.Tensor]:
    size = topo.world_size
    numel = flat.numel()
    s = chunk_numel(numel, size)
    if flat.dtype == wdtype and numel == size * s:
        send = flat
    else:  # pad to P * S (and/or round to the wire dtype) in a staging buffer
        send = torch.empty(size * s, dtype=wdtype, device=flat.device)
        send[:numel].copy_(flat)
        send[numel:].zero_()
    recv = torch.empty(size * s, dtype=wdtype, device=flat.device)
    same = topo.same_node_count(topo.group)
    accounting.record("reduce_scatter", accounting.all_to_all_traffic(s * recv.element_size(), same - 1, size - same))
    yield dist.all_to_all_single(recv, send, group=topo.group, async_op=True), (send, recv), ""
    parts = recv.view(size, s)
    total = parts[0].to(torch.float64)
    for i in range(1, size):
        total.add_(parts[i])
    if divisor != 1:
        total.div_(divisor)
    out.view(-1).copy_(total[: out.numel()])
    return out


def _qgz_steps(
    flat: torch.Tensor,
    out: torch.Tensor,
    fmt: BlockFormat,
    hop1: BlockFormat,
    topo: Topology,
    divisor: int,
    ef: ErrorFeedback | None,
    rot: int | None,
    seed: int | None,
) -> Generator[Pending, None, torch.Tensor]:
    size, n, d = topo.world_size, topo.num_nodes, topo.ranks_per_node
    numel = flat.numel()
    s = chunk_numel(numel, size) if numel else 0
    width = rotated_numel(s, rot) if rot else s  # values per pack: rotated slices are padded to whole blocks of rot
    first = hop1 if d > 1 else fmt  # step 1's format: the intra-node hop's, or the inter-node one's when it is first
    pack1, pack = first.packed_bytes(width), fmt.packed_bytes(width)
    device = flat.device
    order = topo.qgz_send_order()
    swizzled = order == [swizzle_source(p, n, d) for p in range(size)]
    seed1, seed2 = (None, None) if seed is None else (hop_seed(seed, 1, topo.rank), hop_seed(seed, 2, topo.rank))
    if ef is not None:
        ef.allocate((numel, fmt.bits, fmt.block_size, size, rot or 0, hop1.bits), size * width if rot else numel,
                    n * width, device, (size, n))
    traffic = accounting.Traffic()
    if d > 1:
        same = topo.same_node_count(topo.intra_group) - 1
        traffic += accounting.all_to_all_traffic(n * pack1, same, d - 1 - same)
    if n > 1:
        same = topo.same_node_count(topo.inter_group) - 1
        traffic += accounting.all_to_all_traffic(pack, same, n - 1 - same)
    accounting.record("reduce_scatter", traffic)

    # Step 1: pack the P slices in hop-1 order.
    if ef is None and swizzled:
        if rot:
            send = swizzle_quantize_rotated(flat, first, n, d, rot, seed=seed1)
        else:
            send = swizzle_quantize(flat, first, n, d, seed=seed1)
    else:
        x = rotate_slices(flat, size, rot) if rot else flat
        if ef is not None:  # x + residual, in place in a float32 copy (rotate_slices' result is one)
            if not rot:
                x = x.to(torch.float32, copy=True)
            ef.add_to(x)
        packs = quantize_chunks(x, first, size, seed=seed1)
        if ef is not None:  # x - sent in x, no copy of sent: -(sent + -x) + 0 is x - sent bit for bit (+0: zeros)
            dequantize_add_chunks(packs, first, size, width, x.neg_())
            ef.store_error(x.neg_().add_(0.0).nan_to_num_(0.0, 0.0, 0.0))
        if order == list(range(size)):
            send = packs
        else:
            send = packs.view(size, pack1).index_select(0, topo.qgz_send_index(device)).view(-1)

    # Steps 2-3: intra-node all-to-all, fused sum and requantization.
    if d > 1:
        recv = torch.empty(size * pack1, dtype=torch.uint8, device=device)
        kept = (send, recv) if ef is None else (send, recv, ef.residual, ef.partial_residual)
        yield (dist.all_to_all_single(recv, send, group=topo.intra_group, async_op=True), kept,
               f" at hop 1 (intra-node all-to-all over ranks {topo.intra_ranks})", n > 1)
        if n == 1:
            _final_reduce(recv, first, d, s, out, divisor, rot)
            return out
        if ef is None:
            mid = reduce_requantize(recv, first, d, n, width, out_fmt=None if first == fmt else fmt, seed=seed2)
        else:
            values = torch.empty(d * n * width, dtype=torch.float32, device=device)
            dequantize_chunks(recv, first, d * n, width, values)
            partial = values.view(d, n * width).sum(0)
            ef.add_to(partial, partial=True)
            mid = quantize_chunks(partial, fmt, n, seed=seed2)
            ef.update(partial, dequantize_chunks(mid, fmt, n, width, values[: n * width]), partial=True)
    else:
        mid = send

    # Steps 4-5: inter-node all-to-all, fused sum, division and write into out.
    recv2 = torch.empty(n * pack, dtype=torch.uint8, device=device)
    yield (dist.all_to_all_single(recv2, mid, group=topo.inter_group, async_op=True), (mid, recv2),
           f" at hop 2 (inter-node all-to-all over ranks {topo.inter_ranks})")
    _final_reduce(recv2, fmt, n, s, out, divisor, rot)
    return out


def _final_reduce(buf: torch.Tensor, fmt: BlockFormat, groups: int, s: int, out: torch.Tensor, divisor: int,
                  rot: int | None) -> None:
    """qgZ's last step: sum the ``groups`` packs of slices of ``s`` elements (rotated by ``rot``, then unrotated)
    and divide, into ``out``."""
    if rot:
        reduce_dequantize_rotated(buf, fmt, groups, s, out.view(-1), rot, divisor=divisor)
    else:
        reduce_dequantize(buf, fmt, groups, s, out.view(-1), divisor=divisor)
