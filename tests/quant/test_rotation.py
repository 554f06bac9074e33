"""The block Hadamard rotation (``zeropp.quant.rotation``): the torch reference against the Hadamard matrix in
float64, the kernels (Triton, the native CPU library's builds, see ``test_kernels.py``) against the reference bit
for bit, the round trip and the commutation with the sum over ranks within the bounds the spec states."""

import itertools
import math

import pytest
import torch

import zeropp.quant as zq
from conftest import native_library
from test_kernels import (  # noqa: F401
    DTYPES,
    NATIVE_BUILDS,
    assert_same_floats,
    assert_same_packs,
    gen,
    implementation,
    random_values,
)
from zeropp.quant import native_cuda, rotation
from zeropp.quant import reference as reference_ops

SIZES = list(rotation.ROTATION_SIZES)
U = 2.0**-24


def sylvester(size: int) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard matrix of Sylvester's order, in float64, from its closed form."""
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in range(size)] for a in range(size)])
    return 1.0 - 2.0 * parity.double()


def blocks64(x: torch.Tensor, size: int) -> torch.Tensor:
    """Flat ``x`` zero-padded to whole blocks, as a float64 ``(blocks, size)`` matrix."""
    padded = torch.zeros(rotation.rotated_numel(x.numel(), size), dtype=torch.float64)
    padded[: x.numel()] = x.double()
    return padded.view(-1, size)


def forward_error(size: int) -> float:
    """``g = (1 + u) ** k - 1``: the forward butterfly's error per unit of a block's sum of magnitudes."""
    return (1 + U) ** int(math.log2(size)) - 1


def reference(x: torch.Tensor, size: int, inverse: bool = False) -> torch.Tensor:
    out = torch.empty(rotation.rotated_numel(x.numel(), size))
    rotation.hadamard(x.float(), size, inverse, out)
    return out


@pytest.mark.parametrize("size", SIZES)
def test_reference_is_the_matrix(size, gen):
    """On small integers (every sum exact in float32) the reference is ``H v`` exactly, and ``H H v / size`` is
    ``v``; on random floats it is within the forward bound of ``H v`` in float64."""
    ints = torch.randint(-1000, 1000, (3 * size + 5,), generator=gen).float()
    h = sylvester(size)
    assert torch.equal(reference(ints, size).double().view(-1, size), blocks64(ints, size) @ h.T)
    assert torch.equal(reference(reference(ints, size), size, inverse=True)[: ints.numel()], ints)
    x = random_values(4 * size, torch.float32, gen)
    exact = blocks64(x, size) @ h.T
    bound = forward_error(size) * blocks64(x, size).abs().sum(1, keepdim=True)
    assert ((reference(x, size).double().view(-1, size) - exact).abs() <= bound).all()


@pytest.mark.parametrize("param", ["triton", *NATIVE_BUILDS])
def test_kernels_match_reference(param, kernel_device, gen):
    """Every kernel writes the reference's bits, forward and inverse, for each size, with a partial last block,
    subnormals, Inf and NaN among the inputs (NaN at the same places); the Triton kernel also from bfloat16 and
    float16 inputs, which it widens itself (the native library takes float32 only)."""
    kernels = implementation(param, kernel_device)
    dtypes = DTYPES if param == "triton" else [torch.float32]
    for size, dtype in itertools.product(SIZES, dtypes):
        for numel in (1, size - 1, 3 * size + 5):
            x = random_values(numel, torch.float32, gen)
            if numel > 4:
                x[:4] = torch.tensor([float("inf"), 1e-40, float("nan"), -3e38])
            x = x.to(dtype)
            for inverse in (False, True):
                expected = reference(x, size, inverse)
                out = torch.full_like(expected, 7.0, device=kernels.device)
                kernels.ops.hadamard(x.to(kernels.device), size, inverse, out)
                assert_same_floats(out, expected)


@pytest.mark.parametrize("size", SIZES)
def test_round_trip_within_bound(size, gen):
    """Unrotating a rotation gives ``x`` back within ``g * (2 + g) * S`` per element (``S`` the block's sum of
    magnitudes, plus ``2 ** -150`` for a subnormal), measured in float64; the padding comes back as 0 within the
    same bound."""
    x = random_values(5 * size - 3, torch.float32, gen)
    back = reference(reference(x, size), size, inverse=True)
    g = forward_error(size)
    bound = g * (2 + g) * blocks64(x, size).abs().sum(1, keepdim=True) + 2.0**-150
    assert ((back.double().view(-1, size) - blocks64(x, size)).abs() <= bound).all()


@pytest.mark.parametrize("size", [16, 32])
def test_rotation_commutes_with_the_sum(size, gen):
    """What lets qgZ reduce rotated gradients: the float32 sum over 4 ranks of their rotations is the rotation of
    their sum (float64) within the ranks' forward bounds and the float32 sum's rounding, and unrotating that sum
    gives the plain sum back within the round-trip bound of the float64 sum's magnitudes."""
    ranks = [random_values(6 * size, torch.float32, gen) for _ in range(4)]
    rotated_sum = torch.stack([reference(x, size) for x in ranks]).sum(0)  # float32, one rounding per addition
    exact_sum = sum(x.double() for x in ranks)
    exact = blocks64(exact_sum, size) @ sylvester(size).T
    masses = sum(blocks64(x, size).abs().sum(1, keepdim=True) for x in ranks)
    g = forward_error(size)
    sum_rounding = 3 * U * (1 + g) * masses  # three float32 additions of values within (1 + g) * S_r
    assert ((rotated_sum.double().view(-1, size) - exact).abs() <= g * masses + sum_rounding).all()
    back = reference(rotated_sum, size, inverse=True).double().view(-1, size)
    assert ((back - blocks64(exact_sum, size)).abs() <= (2 * g + 4 * U) * masses * 1.01).all()


def test_rotation_lowers_int4_error_on_outliers(monkeypatch, gen):
    """The point of the rotation: a block with an outlier (here 20x its neighbours) loses its other elements to
    int4 rounding, its rotation spreads the outlier; quantize, dequantize and unrotate then beats quantizing the
    plain gradient, by more than 4x in squared error here (about 8x measured). The quantization runs on the torch
    reference: this tests the format, not the kernels."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")
    x = torch.randn(64 * 32, generator=gen)
    x[::32] *= 20
    plain = zq.dequantize(zq.quantize(x, bits=4, block_size=32))
    back = zq.hadamard_unrotate(zq.dequantize(zq.quantize(zq.hadamard_rotate(x, 32), bits=4, block_size=32)), 32)
    assert (back - x).square().sum() * 4 < (plain - x).square().sum()


def test_public_ops(quant_backend, gen):
    """Through ``zeropp.quant`` with each backend: the reference's bits; bfloat16 and float16 inputs are widened to
    float32 exactly; ``out`` is filled and returned; an empty input gives an empty result."""
    x = random_values(1000, torch.bfloat16, gen)
    expected = reference(x.float(), 64)
    rotated = zq.hadamard_rotate(x.to(quant_backend), 64)
    assert_same_floats(rotated, expected)
    out = torch.empty(1024, device=quant_backend)
    assert zq.hadamard_unrotate(rotated, 64, out=out) is out
    assert_same_floats(out, reference(expected, 64, inverse=True))
    half = x.to(torch.float16)
    assert_same_floats(zq.hadamard_rotate(half.to(quant_backend), 16), reference(half.float(), 16))
    assert zq.hadamard_rotate(torch.empty(0, device=quant_backend)).numel() == 0


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: zq.hadamard_rotate(torch.ones(8), 8), ValueError, r"size=8 must be one of \(16, 32, 64, 128\)"),
        (lambda: zq.hadamard_rotate(torch.ones(8), 48), ValueError, "size=48"),
        (lambda: zq.hadamard_rotate(torch.ones(8), True), ValueError, "size=True"),
        (lambda: zq.hadamard_rotate(torch.ones(8, dtype=torch.int32)), TypeError, "floating point"),
        (lambda: zq.hadamard_rotate(torch.ones(8, device="meta")), ValueError, "meta device"),
        (lambda: zq.hadamard_rotate(torch.ones(8), out=torch.empty(32, dtype=torch.bfloat16)), TypeError,
         "float32"),
        (lambda: zq.hadamard_rotate(torch.ones(40), out=torch.empty(40)), ValueError, "64 elements"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_native_takes_float32_only():
    """The native library reads raw float32: another dtype is refused, naming the fix, not misread."""
    with pytest.raises(TypeError, match="widen x"):
        native_library().hadamard(torch.ones(32, dtype=torch.bfloat16), 32, False, torch.empty(32))


@pytest.mark.parametrize("threads", [1, 3])
def test_native_threads_agree(threads, gen):
    """The native library splits the blocks over ``torch.get_num_threads()`` threads; any split gives the
    reference's bits (3 threads over 63 blocks with a partial last one)."""
    lib = native_library()
    x = random_values(2000, torch.float32, gen)
    out = torch.empty(2016)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lib.hadamard(x, 32, False, out)
    finally:
        torch.set_num_threads(previous)
    assert_same_floats(out, reference(x, 32))


def heavy_tailed(numel: int, gen: torch.Generator) -> torch.Tensor:
    """Student-t(3) samples: a normal over the root of a chi-squared(3) / 3 (gradient-like tails)."""
    chi2 = torch.randn(3, numel, generator=gen).square().sum(0)
    return torch.randn(numel, generator=gen) / (chi2 / 3).sqrt()


def test_rotated_qgz_steps(monkeypatch, gen):
    """qgZ with the rotation, composed (``swizzle_quantize_rotated``, the unchanged ``reduce_requantize`` given the
    plain slice length, ``reduce_dequantize_rotated``), 4 ranks summed in two hops of 2 at int4, slices of 1001
    elements (not a multiple of 32, so every slice has rotated padding) and a short last slice: the same bytes as
    plain qgZ; each shard the float64 unrotation of the hops' dequantized sum (padding included) within float32
    rounding; and every rank's mean shard nearer the float64 mean than plain qgZ's, by at least 1.3x in L2 on
    heavy-tailed gradients (1.6x to 1.85x measured). Runs on the torch reference (the composition is under test,
    not the kernels)."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "torch")
    world, numel, fmt = 4, 4 * 1001 - 5, zq.BlockFormat(4, 64)
    slice_len = zq.chunk_numel(numel, world)
    grads = [heavy_tailed(numel, gen) for _ in range(world)]
    mean = sum(g.double() for g in grads) / world
    rotated = [zq.swizzle_quantize_rotated(g, fmt, 1, world, 32) for g in grads]
    plain = [zq.swizzle_quantize(g, fmt, 1, world) for g in grads]
    assert [r.numel() for r in rotated] == [p.numel() for p in plain]
    pack = fmt.packed_bytes(slice_len)
    for shard in range(world):
        want = mean[shard * slice_len: (shard + 1) * slice_len]
        errors = []
        for packs, final in ((rotated, zq.reduce_dequantize_rotated), (plain, zq.reduce_dequantize)):
            mine = [p[shard * pack: (shard + 1) * pack] for p in packs]
            hops = [zq.reduce_requantize(torch.cat(mine[i: i + 2]), fmt, 2, 1, slice_len) for i in (0, 2)]
            out = torch.empty(want.numel())
            extra = {"size": 32} if final is zq.reduce_dequantize_rotated else {}
            final(torch.cat(hops), fmt, 2, slice_len, out, divisor=world, **extra)
            errors.append(((out.double() - want).norm() / want.norm()).item())
            if extra:  # against float64: the hops' values, padding included, summed, unrotated, divided
                padded = zq.rotated_numel(slice_len, 32)
                summed = sum(zq.dequantize_chunks(h, fmt, 1, padded, torch.empty(padded)).double() for h in hops)
                exact = (blocks64(summed, 32) @ sylvester(32).T / (32 * world)).view(-1)[: want.numel()]
                mass = blocks64(summed, 32).abs().sum(1, keepdim=True).expand(-1, 32).reshape(-1)[: want.numel()]
                assert ((out.double() - exact).abs() <= 2.0**-18 * mass / world).all()
        assert errors[0] * 1.3 < errors[1] < 0.3, errors


def test_rotated_steps_refuse_a_rotation_larger_than_the_block():
    with pytest.raises(ValueError, match="larger than the quantization block size 16"):
        zq.swizzle_quantize_rotated(torch.ones(64), zq.BlockFormat(4, 16), 1, 2, 32)


@pytest.mark.parametrize("numel", [4 * 64, 4 * 64 + 3, 250, 1])
def test_rotate_slices_rotates_each_padded_slice(numel, gen):
    """``rotate_slices`` (qgZ's first step, the aligned shortcut included): each of the 4 slices of
    ``ceil(numel / 4)`` elements, zero-padded to whole rotation blocks and rotated on its own, bit for bit."""
    x = torch.randn(numel, generator=gen)
    plain = -(-numel // 4)
    width = rotation.rotated_numel(plain, 32)
    want = torch.cat([reference(torch.cat([x[i * plain : (i + 1) * plain], torch.zeros(width)])[:width], 32)
                      for i in range(4)])
    assert_same_floats(zq.rotate_slices(x, 4, 32), want)



def composed_quantize(x: torch.Tensor, fmt: zq.BlockFormat, nodes: int, per_node: int, size: int,
                      seed: int | None = None) -> torch.Tensor:
    """The spec of the fused quantize in the reference alone: each slice zero-padded to whole rotation blocks and
    rotated (``rotation.hadamard``), then packed in the swizzled order (``reference.quantize_chunks``), rounded
    stochastically with a ``seed`` (each rotated value with the noise of its index among the rotated slices)."""
    chunks, numel = nodes * per_node, x.numel()
    plain = -(-numel // chunks)
    padded = torch.zeros(chunks * plain, dtype=x.dtype)
    padded[:numel] = x
    rows = torch.zeros(chunks, rotation.rotated_numel(plain, size), dtype=x.dtype)
    rows[:, :plain] = padded.view(chunks, plain)
    rotated = reference(rows.view(-1), size)
    out = torch.empty(fmt.chunked_bytes(rotated.numel(), chunks), dtype=torch.uint8)
    reference_ops.quantize_chunks(rotated, fmt, chunks, nodes, out, seed)
    return out


def composed_reduce(buf: torch.Tensor, fmt: zq.BlockFormat, groups: int, chunk_numel: int, size: int,
                    out_numel: int, dtype: torch.dtype, divisor: float) -> torch.Tensor:
    """The spec of the fused final reduce in the reference alone: the fused sum (divisor 1) of the padded slices,
    the inverse rotation, the float32 division, the conversion, the padding dropped."""
    summed = torch.empty(rotation.rotated_numel(chunk_numel, size))
    reference_ops.reduce_dequantize(buf, fmt, groups, summed.numel(), summed, 1.0)
    values = reference(summed, size, inverse=True)[:out_numel]
    if divisor != 1.0:
        values = values / torch.tensor(divisor, dtype=torch.float32)
    return values.to(dtype)


# (bits, block, rotation size, dtype, nodes, ranks per node, numel): every code width, input dtype and rotation
# size; slices that are not whole rotation blocks, a short last slice and empty ones (numel 37 over 8 ranks)
FUSED_CASES = [
    (4, 64, 32, torch.float32, 2, 2, 4 * 1001 - 5),
    (8, 128, 128, torch.bfloat16, 2, 2, 4 * 300 + 1),
    (2, 64, 16, torch.float16, 1, 4, 4 * 77),
    (4, 32, 16, torch.bfloat16, 4, 2, 37),
    (8, 64, 64, torch.float32, 2, 4, 8 * 64),
    (2, 128, 32, torch.float32, 2, 2, 1003),
]


@pytest.mark.parametrize("param", ["triton", *NATIVE_BUILDS])
def test_fused_kernels_match_the_composition(param, kernel_device, gen):
    """The fused kernels (rotation inside the swizzled quantize, rounded to nearest or stochastically from a seed;
    inverse rotation inside the final reduce) write the bits of the unfused composition of the reference ops, for
    int8, int4 and int2, fp32, bf16 and fp16 inputs and outputs, every rotation size, padded, short and empty
    slices, special values (Inf, NaN, subnormals), and divisors 1, 4 (multiplied by its exact reciprocal) and 3
    (divided). The seeds (near 2**32 too) draw the noise of each value's index among the rotated slices: a kernel
    that took its index among the plain slices fails the cases whose slices are padded."""
    kernels = implementation(param, kernel_device)
    cases = FUSED_CASES if param != "triton" else FUSED_CASES[3:4]  # empty slices, size 16 (interpreter cost)
    for i, (bits, block, size, dtype, nodes, per_node, numel) in enumerate(cases):
        fmt, chunks = zq.BlockFormat(bits, block), nodes * per_node
        x = random_values(numel, torch.float32, gen)
        x[numel // 2: numel // 2 + 3] = torch.tensor([float("inf"), 1e-40, float("nan")])[: numel - numel // 2]
        x = x.to(dtype)
        want = composed_quantize(x, fmt, nodes, per_node, size)
        got = torch.full_like(want, 0xA5, device=kernels.device)
        kernels.ops.quantize_chunks_rotated(x.to(kernels.device), fmt, chunks, nodes, size, got)
        plain = -(-numel // chunks)
        assert_same_packs(got, want, fmt, chunks, chunks * rotation.rotated_numel(plain, size))
        seed = (2**32 - 1 - i, 7 + i)[i % 2]
        want = composed_quantize(x, fmt, nodes, per_node, size, seed)
        got = torch.full_like(want, 0xA5, device=kernels.device)
        kernels.ops.quantize_chunks_rotated(x.to(kernels.device), fmt, chunks, nodes, size, got, seed)
        assert_same_packs(got, want, fmt, chunks, chunks * rotation.rotated_numel(plain, size))
        groups = (2, 4, 3)[i % 3]
        packs = [composed_quantize(random_values(numel, torch.float32, gen), fmt, nodes, per_node, size)
                 for _ in range(groups)]
        buf = torch.cat([p[: fmt.packed_bytes(plain)] for p in packs])  # pack 0 of each: the first slice
        for divisor, out_numel in ((1.0, plain), (4.0, plain - 3), (3.0, max(plain - size - 1, 0))):
            want = composed_reduce(buf, fmt, groups, plain, size, out_numel, dtype, divisor)
            got = torch.full((out_numel,), 7.0, dtype=dtype, device=kernels.device)
            kernels.ops.reduce_dequantize_rotated(buf.to(kernels.device), fmt, groups, plain, size, got, divisor)
            assert_same_floats(got, want)


@pytest.mark.parametrize("quant_backend", ["torch", "native"], indirect=True)  # Triton: the test above
def test_public_fused_ops_dispatch(quant_backend, gen):
    """``swizzle_quantize_rotated`` (rounded to nearest, and stochastically from a seed) and
    ``reduce_dequantize_rotated`` on the CPU backends (the fused kernels on the native one, the composition on
    torch) give the same bytes and values as the unfused ops composed on that backend (``rotate_slices``,
    ``swizzle_quantize``; ``reduce_dequantize``, ``hadamard_unrotate``); a bad seed is refused."""
    fmt, world, numel = zq.BlockFormat(4, 64), 4, 4 * 250 - 3
    x = random_values(numel, torch.float32, gen).to(quant_backend)
    packs = zq.swizzle_quantize_rotated(x, fmt, 2, 2, 32)
    assert torch.equal(packs, zq.swizzle_quantize(zq.rotate_slices(x, world, 32), fmt, 2, 2))
    seeded = zq.swizzle_quantize_rotated(x.bfloat16(), fmt, 2, 2, 32, seed=12345)
    assert torch.equal(seeded, zq.swizzle_quantize(zq.rotate_slices(x.bfloat16(), world, 32), fmt, 2, 2, seed=12345))
    assert not torch.equal(seeded, zq.swizzle_quantize_rotated(x.bfloat16(), fmt, 2, 2, 32, seed=12346))
    with pytest.raises(ValueError, match=r"seed=-1 must be None"):
        zq.swizzle_quantize_rotated(x, fmt, 2, 2, 32, seed=-1)
    plain = -(-numel // world)
    width = rotation.rotated_numel(plain, 32)
    buf = packs[: 2 * fmt.packed_bytes(width)]
    out = torch.empty(plain - 1, dtype=torch.bfloat16, device=quant_backend)
    zq.reduce_dequantize_rotated(buf, fmt, 2, plain, out, 32, divisor=4)
    summed = zq.reduce_dequantize(buf, fmt, 2, width, torch.empty(width, device=quant_backend))
    unrotated = zq.hadamard_unrotate(summed, 32)[: plain - 1] / torch.tensor(4.0, device=quant_backend)
    assert_same_floats(out, unrotated.to(torch.bfloat16).cpu())


def test_native_cuda_refuses_the_fused_rotation():
    """The native CUDA kernels have no fused rotation: they refuse, naming the Triton kernels."""
    with pytest.raises(native_cuda.NativeCudaError, match="Hadamard rotation .*Triton"):
        native_cuda.quantize_chunks_rotated(torch.ones(64), zq.BlockFormat(4), 2, 1, 32, torch.empty(0))
    with pytest.raises(native_cuda.NativeCudaError, match="Hadamard rotation .*stochastic rounding.*Triton"):
        native_cuda.quantize_chunks_rotated(torch.ones(64), zq.BlockFormat(4), 2, 1, 32, torch.empty(0), seed=3)
    with pytest.raises(native_cuda.NativeCudaError, match="Hadamard rotation .*Triton"):
        native_cuda.reduce_dequantize_rotated(torch.empty(0), zq.BlockFormat(4), 2, 64, 32, torch.empty(0), 1.0)
