"""Plain torch implementation of every quantization op: the specification the Triton kernels are tested against.

It runs on any device and is the CPU backend. Inputs are assumed validated by ``zeropp.quant.ops``; layouts are
described in ``zeropp.quant.format``. Where the spec rounds once an operation whose float32 form would round
twice (the product ``x * r`` of a quantization, the fused multiply-add of a reduction), it is computed in float64,
where it is exact or rounded to odd, and rounded to float32 once: the result is the spec's, bit for bit.

The arithmetic of a block is in ``quantize_blocks`` and ``dequantize_blocks``. The chunked ops walk each pack a
piece of about ``PIECE_NUMEL`` elements at a time, in place in a few piece-sized buffers (``_Scratch``) that stay
in the CPU's caches, and write codes, scales and values straight into the output: full-size float32 temporaries
made these ops several times slower. A piece is made of whole blocks and a block's result depends on its own
elements only, so the piece size changes the speed, never a bit of the result.
"""

from __future__ import annotations

import torch

from .format import BlockFormat, swizzle_source

FLOAT32_MAX = torch.finfo(torch.float32).max

PIECE_NUMEL = 1 << 18
"""Elements processed at a time (rounded to whole blocks): 1 MiB per float32 temporary."""


class _Scratch:
    """Piece-sized work buffers for packs of ``blocks`` blocks, allocated once per call: ``values`` and ``other``
    float32, float64 ones on demand (``wide``) and, for int4 and int2, int8 ``half_codes`` of one byte per code byte
    (one nibble or one 2-bit field of each); ``qmax`` as a float32 tensor on the device."""

    def __init__(self, fmt: BlockFormat, blocks: int, device: torch.device) -> None:
        self.blocks = max(1, min(PIECE_NUMEL // fmt.block_size, blocks))
        # a tensor, not a Python scalar: on CUDA torch turns division by a scalar into a reciprocal multiply
        self.qmax = torch.full((), float(fmt.qmax), dtype=torch.float32, device=device)  # no host-to-device copy
        shape = (self.blocks, fmt.block_size)
        self.values = torch.empty(shape, dtype=torch.float32, device=device)
        self.other = torch.empty(shape, dtype=torch.float32, device=device)
        self._wide = torch.empty((0, *shape), dtype=torch.float64, device=device)
        if fmt.bits < 8:
            self.half_codes = torch.empty(self.blocks, fmt.block_code_bytes, dtype=torch.int8, device=device)

    def wide(self, count: int, n: int) -> list[torch.Tensor]:
        """``count`` float64 buffers of ``n`` rows."""
        if self._wide.shape[0] < count:
            self._wide = torch.empty((count, *self._wide.shape[1:]), dtype=torch.float64, device=self._wide.device)
        return list(self._wide[:count, :n])

    def pieces(self, blocks: int) -> list[tuple[int, int]]:
        """``(first, end)`` block ranges of at most ``self.blocks`` blocks covering ``range(blocks)``."""
        return [(b, min(b + self.blocks, blocks)) for b in range(0, blocks, self.blocks)]


def reciprocal(scales: torch.Tensor) -> torch.Tensor:
    """Float64 ``1 / scales`` (positive float32 ``scales``) rounded to 24 significant bits, float32's precision,
    with no exponent limit (``1 / 2**-149`` is ``2**149``).

    ``1 / s`` is rounded to float64 first; rounding it again to 24 bits gives the correctly rounded result, as 53
    bits are more than twice 24 (double rounding is innocuous for a quotient).
    """
    mantissa, exponent = torch.frexp(torch.reciprocal(scales.double()))
    return mantissa.mul_(2.0**24).round_().mul_(torch.exp2((exponent - 24).double()))


_WORD = 0xFFFF_FFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for int64 ``h`` in ``[0, 2**32)`` and a constant ``c < 2**32``, without int64 overflow."""
    low = h * (c & 0xFFFF)
    high = (h * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return low.add_(high).bitwise_and_(_WORD)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 ``h`` in ``[0, 2**32)``: a bijection of 32-bit words."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def noise_hash(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of the stochastic rounding of element ``index`` (int64) for ``seed`` (``[0, 2**32)``), as an
    int64 in ``[0, 2**32)``: ``fmix32(lo * 0x9E3779B1 + fmix32(seed ^ fmix32(hi)))`` (mod 2**32) with ``lo`` and
    ``hi`` the index's low and high 32 bits (``format.py``)."""
    hi = _fmix32(index >> 32)
    key = _fmix32(hi.bitwise_xor_(seed))
    return _fmix32(_mul32(index & _WORD, 0x9E3779B1).add_(key).bitwise_and_(_WORD))


def noise_thresholds(seed: int, first: int, n: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Float32 ``(n, block_size)``: ``1 - u`` for the elements ``first, first + 1, ...``, ``u = (h >> 9) * 2**-23``
    with ``h = noise_hash(seed, index)``, so ``1 - u`` is in ``(0, 1]`` and exact in float32."""
    index = torch.arange(first, first + n * block_size, dtype=torch.int64, device=device)
    k = noise_hash(seed, index).bitwise_right_shift_(9)
    return k.neg_().add_(1 << 23).float().mul_(2.0**-23).view(n, block_size)


def quantize_blocks(
    values: torch.Tensor,
    fmt: BlockFormat,
    codes: torch.Tensor,
    scales: torch.Tensor,
    scratch: _Scratch,
    thresholds: torch.Tensor | None = None,
) -> None:
    """Quantize float32 ``values`` of shape ``(n, block_size)``: uint8 codes into ``codes`` (``(n,
    block_code_bytes)``) and float32 scales into ``scales`` (``(n,)``). With ``thresholds`` (float32 ``1 - u`` per
    element, ``noise_thresholds``) the codes are rounded stochastically, else to nearest even (``format.py``).

    ``scratch.other`` and ``scratch.wide`` are overwritten.
    """
    n = values.shape[0]
    qmax = fmt.qmax
    torch.amax(torch.abs(values, out=scratch.other[:n]), dim=1, out=scales)
    scales.div_(scratch.qmax)  # scale = absmax / qmax: NaN for a block holding a NaN, Inf for one holding an Inf
    usable = torch.isfinite(scales) & (scales > 0)
    # code = rne(x * r), r = 1 / scale rounded to float32 precision and the product exact (float32 * float32 fits
    # float64's 53 bits); an all-zero block uses r = 1 (its codes are 0), a NaN or Inf one is zeroed below
    r = reciprocal(torch.where(usable, scales, 1.0))
    (q,) = scratch.wide(1, n)
    torch.mul(values, r[:, None], out=q)
    if thresholds is None:
        q.round_().clamp_(-qmax, qmax)  # the clamp is a no-op unless the scale is subnormal
    else:
        # p = x * r rounded to float32 once; code = sign(p) * min(floor(|p| + u), qmax), where floor(|p| + u) is
        # floor(|p|) + 1 exactly when the fraction |p| - floor(|p|) (exact in float32) is at least 1 - u
        p = scratch.other[:n].copy_(q)
        a = torch.abs(p)
        whole = torch.floor(a)
        up = (a - whole).ge_(thresholds)
        q.copy_(whole.add_(up).clamp_(max=qmax).mul_(torch.sign(p)))
    if not usable.all():
        q[~usable] = 0  # the codes of a NaN or Inf block are 0
    if fmt.bits == 8:
        codes.view(torch.int8).copy_(q)  # two's-complement bytes
        return
    packed = codes.view(torch.int8)
    field = scratch.half_codes[:n]
    if fmt.bits == 2:
        # byte k = sum_i (q[4k + i] & 3) << 2i: element 4k in the lowest two bits (|q| <= 1, so q << 6 fits an int8)
        packed.copy_(q[:, 3::4]).bitwise_left_shift_(6)
        for i in (2, 1, 0):
            packed.bitwise_or_(field.copy_(q[:, i::4]).bitwise_and_(3).bitwise_left_shift_(2 * i))
        return
    # int4: byte k = (q[2k] & 0xF) | (q[2k + 1] << 4), element 2k in the low nibble and 2k + 1 in the high one, each
    # 4-bit two's complement (|q| <= 7, so q << 4 fits an int8 and has the high nibble's bits)
    packed.copy_(q[:, 1::2]).bitwise_left_shift_(4)
    packed.bitwise_or_(field.copy_(q[:, 0::2]).bitwise_and_(0xF))


def decode_blocks(codes: torch.Tensor, fmt: BlockFormat, values: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """The integer codes of uint8 ``codes`` (``(n, block_code_bytes)``) as float32 ``(n, block_size)``, written into
    ``values`` (returned)."""
    n = codes.shape[0]
    c = codes.view(torch.int8)  # int8 codes are two's-complement bytes
    if fmt.bits == 8:
        return values.copy_(c)
    if fmt.bits == 2:  # field i of each byte shifted to the top, then arithmetically back down
        fields = scratch.half_codes[:n]
        for i in range(4):
            values[:, i::4].copy_(torch.bitwise_left_shift(c, 6 - 2 * i, out=fields).bitwise_right_shift_(6))
        return values
    # the signed nibbles by arithmetic shifts, low = (c << 4) >> 4 and high = c >> 4, into alternate elements
    nibbles = scratch.half_codes[:n]
    values[:, 0::2].copy_(torch.bitwise_left_shift(c, 4, out=nibbles).bitwise_right_shift_(4))
    values[:, 1::2].copy_(torch.bitwise_right_shift(c, 4, out=nibbles))
    return values


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat, values: torch.Tensor, scratch: _Scratch
) -> torch.Tensor:
    """Float32 values of shape ``(n, block_size)`` from uint8 ``codes`` and float32 ``scales``, written into
    ``values`` (returned).

    ``code * scale``, clamped to the finite float32 range (NaN stays NaN: a block with a non-finite scale comes
    out all NaN).
    """
    decode_blocks(codes, fmt, values, scratch).mul_(scales[:, None])
    # code * scale can round past the float32 range when the block's absmax is within an ulp of it
    return values.clamp_(-FLOAT32_MAX, FLOAT32_MAX)


_MAGNITUDE = 0x7FFF_FFFF_FFFF_FFFF  # the bits of a float64 below its sign
_INFINITY = 0x7FF0_0000_0000_0000  # the bits of +Inf: finite magnitudes are below


def fma_(acc: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """``acc = fma(codes, scales[:, None], acc)`` in place on float32 ``(n, block_size)`` tensors (``scales``:
    ``(n,)``): the exact ``code * scale + acc`` rounded once to float32, what a fused multiply-add computes.

    The product is exact in float64 (a code has at most 8 significant bits, a scale 24). The sum is rounded to
    float64 *to odd* (to nearest, then, if that was inexact, to whichever of it and its neighbour toward the exact
    sum has an odd last bit) and then to float32: with 53 >= 24 + 2 bits, rounding to odd first makes the second
    rounding exact (Boldo and Melquiond, 2008). Non-finite values propagate as in IEEE arithmetic. Every step is
    one float64 or int64 operation in place: mixed-dtype and boolean ones are several times slower on the CPU.
    Returns ``acc``.
    """
    p, a, t, b = scratch.wide(4, acc.shape[0])
    p.copy_(codes).mul_(scales.double()[:, None])
    a.copy_(acc)
    torch.add(p, a, out=t)
    # the sum's rounding error, exactly (Knuth's TwoSum): err = (p - (t - b)) + (a - b) with b = t - p
    torch.sub(t, p, out=b)
    a.sub_(b)
    err = p.sub_(b.neg_().add_(t)).add_(a).view(torch.int64)  # NaN when t is not finite
    # round to odd on the bits (IEEE order: bits - 1 is one ulp smaller in magnitude): where err is finite and not
    # zero, move t one ulp toward zero if err and t have opposite signs, then set its last bit
    bits, flag, other = t.view(torch.int64), b.view(torch.int64), a.view(torch.int64)
    torch.bitwise_and(err, _MAGNITUDE, out=flag).sub_(1)  # |err| - 1: -1 for a zero err
    torch.bitwise_not(flag, out=other)
    flag.sub_(_INFINITY - 1).bitwise_and_(other).bitwise_right_shift_(63)  # -1 where 0 < |err| < Inf, else 0
    torch.bitwise_xor(err, bits, out=other).bitwise_right_shift_(63).bitwise_and_(flag)
    bits.add_(other).bitwise_or_(flag.bitwise_and_(1))
    return acc.copy_(t)


def _pack_parts(pack: torch.Tensor, fmt: BlockFormat, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes ``(blocks, block_code_bytes)`` (a view) and the uint8 bytes of the scales (a view) of a pack."""
    split = blocks * fmt.block_code_bytes
    return pack[:split].view(blocks, fmt.block_code_bytes), pack[split:]


def _dequantize_piece(
    pack: torch.Tensor, fmt: BlockFormat, blocks: int, first: int, end: int, values: torch.Tensor, scratch: _Scratch
) -> torch.Tensor:
    """Float32 values ``(end - first, block_size)`` of blocks ``first:end`` of a pack, into ``values``."""
    codes, scale_bytes = _pack_parts(pack, fmt, blocks)
    scales = scale_bytes[4 * first : 4 * end].clone().view(torch.float32)  # a copy: any alignment will do
    return dequantize_blocks(codes[first:end], scales, fmt, values, scratch)


def quantize_chunks(
    x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, out: torch.Tensor, seed: int | None = None
) -> None:
    """Pack flat ``x`` as ``chunks`` slices into ``out``, slices reordered by the qgZ swizzle when ``nodes > 1``.

    Each slice is taken as float32 and zero-padded to whole blocks. With a ``seed`` the codes are rounded
    stochastically, element ``e`` of slice ``s`` with the noise of index ``s * slice_numel + e`` (its index in
    ``x``; the padding's values are 0, whose codes are 0 whatever the noise).
    """
    numel = x.numel()
    if numel == 0:
        return
    slice_numel = -(-numel // chunks)
    blocks = fmt.num_blocks(slice_numel)
    bs = fmt.block_size
    scratch = _Scratch(fmt, blocks, x.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=x.device)
    packs = out.view(chunks, -1)
    for position in range(chunks):
        source = swizzle_source(position, nodes, chunks // nodes)  # the identity when nodes == 1
        slice_of_x = x[source * slice_numel : min((source + 1) * slice_numel, numel)]  # may be short or empty
        codes, scale_bytes = _pack_parts(packs[position], fmt, blocks)
        for first, end in scratch.pieces(blocks):
            values = scratch.values[: end - first]
            flat = values.view(-1)
            src = slice_of_x[first * bs : end * bs]
            flat[: src.numel()].copy_(src)
            flat[src.numel() :].zero_()
            thresholds = None
            if seed is not None:
                start = source * slice_numel + first * bs
                thresholds = noise_thresholds(seed, start, end - first, bs, x.device)
            quantize_blocks(values, fmt, codes[first:end], scales[first:end], scratch, thresholds)
        scale_bytes.copy_(scales.view(torch.uint8))


def quantize_delta(target: torch.Tensor, reference: torch.Tensor, fmt: BlockFormat, out: torch.Tensor) -> None:
    """One pack (``quantize_chunks`` of one chunk, round to nearest) of ``target - reference`` taken in float32:
    both flat, of one length, widened to float32 and subtracted (one float32 rounding), the last block zero-padded;
    a piece at a time, with no full-size temporary."""
    numel = target.numel()
    if numel == 0:
        return
    blocks = fmt.num_blocks(numel)
    bs = fmt.block_size
    scratch = _Scratch(fmt, blocks, target.device)
    scales = torch.empty(blocks, dtype=torch.float32, device=target.device)
    codes, scale_bytes = _pack_parts(out, fmt, blocks)
    for first, end in scratch.pieces(blocks):
        values = scratch.values[: end - first]
        flat = values.view(-1)
        n = min(numel - first * bs, (end - first) * bs)
        flat[:n].copy_(target[first * bs : first * bs + n]).sub_(reference[first * bs : first * bs + n])
        flat[n:].zero_()
        quantize_blocks(values, fmt, codes[first:end], scales[first:end], scratch)
    scale_bytes.copy_(scales.view(torch.uint8))


def dequantize_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Dequantize ``chunks`` packs of ``chunk_numel`` elements each into the first elements of flat ``out``."""
    if out.numel() == 0:
        return
    blocks = fmt.num_blocks(chunk_numel)
    bs = fmt.block_size
    scratch = _Scratch(fmt, blocks, buf.device)
    packs = buf.view(chunks, -1)
    for k in range(chunks):
        # chunk k fills out[k * chunk_numel : (k + 1) * chunk_numel]; its padding, and whatever lies past the end
        # of out, is dropped
        dest = out[k * chunk_numel : min((k + 1) * chunk_numel, out.numel())]
        for first, end in scratch.pieces(blocks):
            piece = dest[first * bs : end * bs]
            if piece.numel() == 0:
                break
            direct = piece.dtype == torch.float32 and piece.is_contiguous() and piece.numel() == (end - first) * bs
            values = piece.view(end - first, bs) if direct else scratch.values[: end - first]
            _dequantize_piece(packs[k], fmt, blocks, first, end, values, scratch)
            if not direct:  # round to out's dtype, drop the padding
                piece.copy_(values.view(-1)[: piece.numel()])


def dequantize_add_chunks(
    buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int, out: torch.Tensor
) -> None:
    """Add ``chunks`` packs of ``chunk_numel`` elements each into the first elements of flat ``out``, in place:
    ``out = dtype(D(pack) + float32(out))``, the dequantized value (``dequantize_blocks``: ``code * scale`` rounded
    to float32, clamped to the finite range) plus ``out`` widened to float32, added in float32 (one rounding) and
    rounded once to ``out``'s dtype (nearest even; for float32 the sum is already that). Not a fused multiply-add:
    the product is rounded before the sum."""
    if out.numel() == 0:
        return
    blocks = fmt.num_blocks(chunk_numel)
    bs = fmt.block_size
    scratch = _Scratch(fmt, blocks, buf.device)
    packs = buf.view(chunks, -1)
    for k in range(chunks):
        dest = out[k * chunk_numel : min((k + 1) * chunk_numel, out.numel())]
        for first, end in scratch.pieces(blocks):
            piece = dest[first * bs : end * bs]
            if piece.numel() == 0:
                break
            values = _dequantize_piece(packs[k], fmt, blocks, first, end, scratch.values[: end - first], scratch)
            total = values.view(-1)[: piece.numel()]
            if piece.dtype == torch.float32:
                piece.add_(total)  # float32 addition is commutative: the same bits as total + piece
            else:
                piece.copy_(total.add_(piece))


def _sum_piece(
    packs: torch.Tensor, fmt: BlockFormat, blocks: int, first: int, end: int, scratch: _Scratch
) -> torch.Tensor:
    """Float32 ``(end - first, block_size)`` sum of blocks ``first:end`` of the packs in ``packs`` (one per row),
    into ``scratch.values``: ``acc = 0``, then ``acc = fma(code, scale, acc)`` for pack 0, pack 1, ..."""
    acc = scratch.values[: end - first]
    codes = scratch.other[: end - first]
    for i, pack in enumerate(packs):
        code_bytes, scale_bytes = _pack_parts(pack, fmt, blocks)
        scales = scale_bytes[4 * first : 4 * end].clone().view(torch.float32)  # a copy: any alignment will do
        decode_blocks(code_bytes[first:end], fmt, codes, scratch)
        if i == 0:  # fma(code, scale, 0): the product rounded once, -0 turned into +0 by adding 0
            torch.mul(codes, scales[:, None], out=acc).add_(0.0)
        else:
            fma_(acc, codes, scales, scratch)
    return acc


def reduce_requantize(
    buf: torch.Tensor,
    fmt: BlockFormat,
    groups: int,
    chunks: int,
    chunk_numel: int,
    out: torch.Tensor,
    out_fmt: BlockFormat | None = None,
    seed: int | None = None,
) -> None:
    """Sum ``groups`` runs of ``chunks`` packs of ``fmt`` pack-wise (``fma`` in float32) and pack the ``chunks`` sums
    into ``out`` in ``out_fmt`` (default ``fmt``), rounded stochastically with a ``seed``.

    Element ``e`` of pack ``m`` of ``out`` is the sum over ``i`` of element ``e`` of pack ``i * chunks + m`` where
    ``e`` lies in that pack's blocks (padding included), else 0; its noise index is ``m * chunk_numel + e``.
    """
    if chunk_numel == 0:
        return
    out_fmt = fmt if out_fmt is None else out_fmt
    bs, out_bs = fmt.block_size, out_fmt.block_size
    blocks, out_blocks = fmt.num_blocks(chunk_numel), out_fmt.num_blocks(chunk_numel)
    # pieces of whole blocks of both formats: a multiple of the larger block size
    unit = max(bs, out_bs)
    piece = min(max(PIECE_NUMEL, unit), -(-out_blocks * out_bs // unit) * unit)
    scratch = _Scratch(fmt, piece // bs, buf.device)
    out_scratch = scratch if out_fmt == fmt else _Scratch(out_fmt, piece // out_bs, buf.device)
    scales = torch.empty(out_blocks, dtype=torch.float32, device=buf.device)
    packs = buf.view(groups, chunks, -1)
    out_packs = out.view(chunks, -1)
    for m in range(chunks):
        codes, scale_bytes = _pack_parts(out_packs[m], out_fmt, out_blocks)
        for start in range(0, out_blocks * out_bs, piece):
            first, end = start // bs, min((start + piece) // bs, blocks)
            out_first, out_end = start // out_bs, min((start + piece) // out_bs, out_blocks)
            n = (out_end - out_first) * out_bs
            values = out_scratch.values[: out_end - out_first]
            if out_fmt == fmt:
                values = _sum_piece(packs[:, m], fmt, blocks, first, end, scratch)
            else:
                summed = _sum_piece(packs[:, m], fmt, blocks, first, end, scratch).view(-1)[:n]
                values.view(-1)[: summed.numel()].copy_(summed)
                values.view(-1)[summed.numel() :].zero_()
            thresholds = None
            if seed is not None:
                thresholds = noise_thresholds(seed, m * chunk_numel + start, out_end - out_first, out_bs, buf.device)
            quantize_blocks(values, out_fmt, codes[out_first:out_end], scales[out_first:out_end], out_scratch,
                            thresholds)
        scale_bytes.copy_(scales.view(torch.uint8))


def reduce_dequantize(
    buf: torch.Tensor, fmt: BlockFormat, groups: int, chunk_numel: int, out: torch.Tensor, divisor: float
) -> None:
    """Sum ``groups`` packs (``fma`` in float32), divide by ``divisor`` and write the first ``out.numel()`` values."""
    if out.numel() == 0:
        return
    blocks = fmt.num_blocks(chunk_numel)
    bs = fmt.block_size
    scratch = _Scratch(fmt, fmt.num_blocks(out.numel()), buf.device)
    packs = buf.view(groups, -1)
    # A tensor divisor, not a Python scalar: on CUDA torch turns division by a scalar into a reciprocal multiply.
    divisor_t = torch.full((), divisor, dtype=torch.float32, device=buf.device)
    for first, end in scratch.pieces(blocks):
        piece = out[first * bs : end * bs]
        if piece.numel() == 0:
            break
        acc = _sum_piece(packs, fmt, blocks, first, end, scratch)
        if piece.dtype == torch.float32 and piece.is_contiguous() and piece.numel() == acc.numel():
            torch.div(acc, divisor_t, out=piece.view_as(acc))
        else:
            piece.copy_(acc.div_(divisor_t).view(-1)[: piece.numel()])
