"""The kernels against the torch reference (``zeropp.quant.reference``): the Triton kernels
(``zeropp.quant._triton``), the native CPU library (``zeropp.quant.native``) in each of its builds (the default
one, with the best kernels for this CPU; the one without AVX-512 kernels; the portable baseline), and the native
CUDA kernels (``zeropp.quant.native_cuda``).

Triton kernels run on ``kernel_device`` (the GPU, or the CPU under Triton's interpreter), the native CPU ones on
the CPU and the native CUDA ones on the GPU (skipped, saying what is missing, where they cannot run); the reference
always runs on the CPU. Codes must agree bit for bit and scales exactly (NaN where the reference has NaN).
Dequantized values must agree exactly too, the final reduce's included: the kernels do the spec's correctly rounded
operations in the same order (the exact products and FMAs of ``format.py``, IEEE division) and round to the output
dtype to nearest even, so anything looser would let an approximate division or a reordered sum through.
"""

import zlib
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import zeropp.quant as zq
from conftest import exact_triton, native_cuda_module, native_library
from zeropp.quant import BlockFormat, _triton, native, native_cuda, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SWIZZLES = [(1, 1), (2, 2), (2, 4), (4, 2), (1, 4)]  # (nodes, ranks_per_node)


@dataclass
class Kernels:
    """One implementation under test: its ops (the reference's signatures) and the device its tensors live on."""

    ops: ModuleType | native.Library | native_cuda.Module
    device: str


# The native CPU library's builds: fixture parameter -> library file beside the default one (None: the default).
NATIVE_BUILDS = {"native": None, "native-avx2": "libzeropp_cpu_avx2.so", "native-baseline": "libzeropp_cpu_baseline.so"}


def native_build(param: str) -> Kernels:
    """The native CPU library's build named by a fixture parameter (see ``NATIVE_BUILDS``)."""
    name = NATIVE_BUILDS[param]
    return Kernels(native_library(str(native.DEFAULT_PATH.with_name(name)) if name else None), "cpu")


# The implementations that every kernel test runs; the build without AVX-512 kernels differs from the default one in
# the fused int4 reduce-requantize alone, so only that test and the special values run it too.
IMPLEMENTATIONS = ["triton", "native", "native-baseline", "native-cuda"]


def implementation(param: str, kernel_device: str) -> Kernels:
    """The implementation named by a fixture parameter."""
    if param == "triton":
        return Kernels(_triton, exact_triton(kernel_device))
    if param == "native-cuda":
        return Kernels(native_cuda_module(), "cuda")
    return native_build(param)


@pytest.fixture(scope="session", params=IMPLEMENTATIONS)
def kernels(request, kernel_device) -> Kernels:
    return implementation(request.param, kernel_device)


@pytest.fixture(scope="session", params=[*IMPLEMENTATIONS, "native-avx2"])
def requantize_kernels(request, kernel_device) -> Kernels:
    """As ``kernels``, and the native build without AVX-512 kernels (whose fused int4 reduce-requantize differs)."""
    return implementation(request.param, kernel_device)


@pytest.fixture(scope="session", params=list(NATIVE_BUILDS))
def native_kernels(request) -> Kernels:
    """The native CPU library alone, in each of its builds."""
    return native_build(request.param)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's id, so every parametrization draws its own reproducible data."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def random_values(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Gaussian values whose magnitude varies over six decades, so blocks get very different scales."""
    magnitude = 10.0 ** (torch.rand(numel, generator=gen) * 6 - 3)
    return (torch.randn(numel, generator=gen) * magnitude).to(dtype)


def random_packs(fmt: BlockFormat, packs: int, pack_numel: int, gen: torch.Generator) -> torch.Tensor:
    """``packs`` reference packs of ``pack_numel`` random values each (the padding of each pack is zeros)."""
    x = random_values(packs * pack_numel, torch.float32, gen)
    buf = torch.empty(fmt.chunked_bytes(x.numel(), packs), dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, packs, 1, buf)
    return buf


def split_packs(buf: torch.Tensor, fmt: BlockFormat, chunks: int, chunk_numel: int):
    """Codes ``(chunks, code_bytes)`` and float32 scales ``(chunks, blocks)`` of a chunked buffer (on the CPU)."""
    packs = buf.cpu().view(chunks, -1)
    split = fmt.code_bytes(chunk_numel)
    return packs[:, :split], packs[:, split:].contiguous().view(torch.float32)


def assert_same_floats(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values (Inf included) and NaN at the same places."""
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(actual.nan_to_num(0.0, 1.0, -1.0), expected.nan_to_num(0.0, 1.0, -1.0))
    assert torch.equal(actual.isinf(), expected.isinf())


def assert_same_packs(actual: torch.Tensor, expected: torch.Tensor, fmt: BlockFormat, chunks: int, numel: int):
    """Chunked buffers with bit-identical codes and equal scales (NaN positions equal)."""
    chunk_numel = zq.chunk_numel(numel, chunks)
    codes, scales = split_packs(actual, fmt, chunks, chunk_numel)
    ref_codes, ref_scales = split_packs(expected, fmt, chunks, chunk_numel)
    assert torch.equal(codes, ref_codes)
    assert_same_floats(scales, ref_scales)


def check_quantize(x: torch.Tensor, fmt: BlockFormat, chunks: int, nodes: int, kernels: Kernels) -> torch.Tensor:
    """Quantize ``x`` with both backends, compare, and return the reference buffer."""
    nbytes = fmt.chunked_bytes(x.numel(), chunks)
    expected = torch.empty(nbytes, dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, chunks, nodes, expected)
    # Garbage in ``out`` shows any byte the kernel fails to write (padding codes included).
    actual = torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=kernels.device)
    kernels.ops.quantize_chunks(x.to(kernels.device), fmt, chunks, nodes, actual)
    assert_same_packs(actual, expected, fmt, chunks, x.numel())
    return expected


def sizes(block_size: int) -> list[int]:
    """One element, a ragged few, one block short, one element over, and several tiles' worth."""
    return sorted({1, 17, block_size - 1, block_size + 1, 3001})


QUANTIZE_CASES = [(bits, bs, n) for bits in (8, 4) for bs in (16, 64, 256, 2048) for n in sizes(bs)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,block_size,numel", QUANTIZE_CASES)
def test_quantize(bits, block_size, numel, dtype, kernels, gen):
    """One pack of any size from any input dtype."""
    check_quantize(random_values(numel, dtype, gen), BlockFormat(bits, block_size), 1, 1, kernels)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("nodes,ranks_per_node", SWIZZLES[1:])
@pytest.mark.parametrize("numel", [5, 203, 4099])
def test_swizzle_quantize(numel, nodes, ranks_per_node, bits, kernels, gen):
    """Slices reordered by ``swizzle_source``, including slices that are short or empty (numel 5 over 8)."""
    x = random_values(numel, torch.bfloat16, gen)
    check_quantize(x, BlockFormat(bits, 64), nodes * ranks_per_node, nodes, kernels)


# Interpreted Triton costs ~0.7 CPU-s an example (3000 elements), the native builds milliseconds: the interpreter
# draws fewer random examples, after the same deterministic edge cases (every swizzle, block size, dtype and both
# bit widths among them).
PROPERTY_EXAMPLES = {"interpreted": 15, "compiled": 60}


def test_quantize_chunks_property(kernels):
    """Random sizes, formats and swizzles: tiles that straddle packs, packs with a ragged or empty last slice. The
    explicit examples: one element over 4 packs (3 empty), 5 over 8 across nodes (short and empty slices), packs of
    750 elements (not whole blocks of 16: tiles straddle packs), packs of exactly 2 blocks, one pack with a ragged
    last block."""
    interpreted = kernels.ops is _triton and kernels.device == "cpu"

    @settings(max_examples=PROPERTY_EXAMPLES["interpreted" if interpreted else "compiled"], deadline=None,
              derandomize=True)
    @given(
        numel=st.integers(1, 3000),
        bits=st.sampled_from([8, 4]),
        block_size=st.sampled_from([16, 32, 128]),
        swizzle=st.sampled_from(SWIZZLES),
        dtype=st.sampled_from(DTYPES),
        seed=st.integers(0, 2**31 - 1),
    )
    @example(numel=1, bits=8, block_size=16, swizzle=(1, 4), dtype=torch.float32, seed=1)
    @example(numel=5, bits=4, block_size=32, swizzle=(2, 4), dtype=torch.bfloat16, seed=2)
    @example(numel=3000, bits=8, block_size=16, swizzle=(2, 2), dtype=torch.bfloat16, seed=3)
    @example(numel=2048, bits=4, block_size=128, swizzle=(4, 2), dtype=torch.float16, seed=4)
    @example(numel=2999, bits=4, block_size=128, swizzle=(1, 1), dtype=torch.float16, seed=5)
    def check(numel, bits, block_size, swizzle, dtype, seed):
        nodes, ranks_per_node = swizzle
        x = random_values(numel, dtype, torch.Generator().manual_seed(seed))
        check_quantize(x, BlockFormat(bits, block_size), nodes * ranks_per_node, nodes, kernels)

    check()


DEQUANTIZE_CASES = [(bits, bs) for bits in (8, 4) for bs in (16, 64, 256, 2048)]


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("bits,block_size", DEQUANTIZE_CASES)
@pytest.mark.parametrize(
    "chunks,chunk_numel,out_numel", [(1, 1, 1), (1, 2049, 2049), (3, 1001, 3000), (2, 300, 250)]
)
def test_dequantize(chunks, chunk_numel, out_numel, bits, block_size, out_dtype, kernels, gen):
    """Packs straight into ``out``; the last slice may be short (3 x 1001 packs into 3000 elements) or missing."""
    fmt = BlockFormat(bits, block_size)
    buf = random_packs(fmt, chunks, chunk_numel, gen)
    expected = torch.empty(out_numel, dtype=out_dtype)
    reference.dequantize_chunks(buf, fmt, chunks, chunk_numel, expected)
    actual = torch.full((out_numel,), float("nan"), dtype=out_dtype, device=kernels.device)
    kernels.ops.dequantize_chunks(buf.to(kernels.device), fmt, chunks, chunk_numel, actual)
    assert_same_floats(actual, expected)


def test_dequantize_into_view(kernels, gen):
    """``out`` a view into the middle of a larger tensor: the elements around it are left untouched."""
    fmt = BlockFormat(4, 64)
    buf = random_packs(fmt, 2, 300, gen)
    big = torch.full((1000,), -7.0, dtype=torch.bfloat16, device=kernels.device)
    kernels.ops.dequantize_chunks(buf.to(kernels.device), fmt, 2, 300, big[123:723])
    expected = torch.empty(600, dtype=torch.bfloat16)
    reference.dequantize_chunks(buf, fmt, 2, 300, expected)
    assert_same_floats(big[123:723], expected)
    assert (big[:123] == -7.0).all() and (big[723:] == -7.0).all()


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("bits,block_size", [(8, 16), (4, 64), (2, 2048)])
@pytest.mark.parametrize("chunks,chunk_numel,out_numel", [(1, 2049, 2049), (3, 1001, 3000), (2, 300, 250)])
def test_dequantize_add(chunks, chunk_numel, out_numel, bits, block_size, out_dtype, kernels, gen):
    """Packs added into ``out`` in place (the weight deltas' ``add_delta``): the reference against the unfused spec
    (dequantize to float32, add ``out`` widened to float32, round once to its dtype), the kernels against the
    reference, on fresh random packs and values of other magnitudes; odd sizes leave short blocks and slices, and
    the elements past ``out`` (of a short last slice, or of a missing one) are not touched."""
    fmt = BlockFormat(bits, block_size)
    buf = random_packs(fmt, chunks, chunk_numel, gen)
    start = random_values(out_numel + 5, out_dtype, gen)
    spec = torch.empty(out_numel, dtype=torch.float32)
    reference.dequantize_chunks(buf, fmt, chunks, chunk_numel, spec)
    spec = spec.add_(start[:out_numel].float()).to(out_dtype)
    expected = start.clone()
    reference.dequantize_add_chunks(buf, fmt, chunks, chunk_numel, expected[:out_numel])
    assert_same_floats(expected[:out_numel], spec)
    actual = start.to(kernels.device, copy=True)
    kernels.ops.dequantize_add_chunks(buf.to(kernels.device), fmt, chunks, chunk_numel, actual[:out_numel])
    assert_same_floats(actual, torch.cat([spec, start[out_numel:]]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,block_size,numel", [(8, 16, 4099), (4, 128, 3001), (2, 2048, 2049), (4, 64, 1)])
def test_quantize_delta(bits, block_size, numel, dtype, native_kernels, gen):
    """The pack of a difference (the weight deltas' ``pack_delta``): the reference and every native build against the
    unfused spec (the float32 difference, then ``quantize_chunks``), on fresh values of close magnitudes (the
    difference cancels most bits) and a short last block."""
    fmt = BlockFormat(bits, block_size)
    base = random_values(numel, dtype, gen)
    target = (base.float() + random_values(numel, torch.float32, gen) * 1e-2).to(dtype)
    spec = torch.empty(fmt.packed_bytes(numel), dtype=torch.uint8)
    reference.quantize_chunks(target.float() - base.float(), fmt, 1, 1, spec)
    expected = torch.full_like(spec, 0xAB)
    reference.quantize_delta(target, base, fmt, expected)
    assert_same_packs(expected, spec, fmt, 1, numel)
    actual = torch.full_like(spec, 0xAB)
    native_kernels.ops.quantize_delta(target, base, fmt, actual)
    assert_same_packs(actual, spec, fmt, 1, numel)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 2])
def test_dequantize_add_special_values(bits, dtype, kernels):
    """NaN, Inf, huge (a product clamped to the float32 range before the sum: in every dtype the sum with a
    negative value then stays finite), subnormal and tie blocks added into values of both signs."""
    fmt = BlockFormat(bits, 16)
    x = special_blocks(16, fmt.qmax)
    numel = x.numel()
    packs = torch.empty(fmt.packed_bytes(numel), dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, 1, 1, packs)
    start = (torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 1e38).to(dtype)
    spec = torch.empty(numel, dtype=torch.float32)
    reference.dequantize_chunks(packs, fmt, 1, numel, spec)
    spec = spec.add_(start.float()).to(dtype)
    expected = start.clone()
    reference.dequantize_add_chunks(packs, fmt, 1, numel, expected)
    assert_same_floats(expected, spec)
    actual = start.to(kernels.device, copy=True)
    kernels.ops.dequantize_add_chunks(packs.to(kernels.device), fmt, 1, numel, actual)
    assert_same_floats(actual, expected)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [16, 256, 2048])
@pytest.mark.parametrize("groups,chunks,chunk_numel",
                         [(1, 1, 1), (2, 4, 37), (3, 2, 1000), (8, 1, 2100), (4, 2, 5 * 4096 + 77)])
def test_reduce_requantize(groups, chunks, chunk_numel, bits, block_size, requantize_kernels, gen):
    """The last case makes the persistent Triton kernel loop: under the interpreter (one multiprocessor) two
    programs take 3 (int4) or 6 (int8) tiles each, the last one partial."""
    fmt = BlockFormat(bits, block_size)
    buf = random_packs(fmt, groups * chunks, chunk_numel, gen)
    expected = torch.empty(chunks * fmt.packed_bytes(chunk_numel), dtype=torch.uint8)
    reference.reduce_requantize(buf, fmt, groups, chunks, chunk_numel, expected)
    actual = torch.full_like(expected, 0xAB, device=requantize_kernels.device)
    requantize_kernels.ops.reduce_requantize(buf.to(requantize_kernels.device), fmt, groups, chunks, chunk_numel, actual)
    assert_same_packs(actual, expected, fmt, chunks, chunks * chunk_numel)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("bits,block_size", [(8, 16), (8, 2048), (4, 64), (4, 256)])
@pytest.mark.parametrize(
    "groups,chunk_numel,out_numel,divisor",
    [(1, 1, 1, 1.0), (2, 2049, 2049, 8.0), (3, 1000, 999, 3.0), (2, 5000, 300, 6.0)],
)
def test_reduce_dequantize(groups, chunk_numel, out_numel, divisor, bits, block_size, out_dtype, kernels, gen):
    """The mean over ``groups`` packs; the last rank's ``out`` may be shorter than a pack (999 of 1000), even by
    many blocks (300 of 5000)."""
    fmt = BlockFormat(bits, block_size)
    buf = random_packs(fmt, groups, chunk_numel, gen)
    # The float32 result, cast once: the same as the reference writing ``out_dtype`` directly.
    expected32 = torch.empty(out_numel, dtype=torch.float32)
    reference.reduce_dequantize(buf, fmt, groups, chunk_numel, expected32, divisor)
    actual = torch.full((out_numel,), float("nan"), dtype=out_dtype, device=kernels.device)
    kernels.ops.reduce_dequantize(buf.to(kernels.device), fmt, groups, chunk_numel, actual, divisor)
    assert_same_floats(actual, expected32.to(out_dtype))


def special_blocks(block_size: int, qmax: int) -> torch.Tensor:
    """One block per special case, float32, concatenated."""
    blocks = torch.randn(13, block_size, generator=torch.Generator().manual_seed(7))
    blocks[0, 3] = float("nan")
    blocks[1, -1] = float("inf")
    blocks[2, 0] = float("-inf")
    blocks[3, 1], blocks[3, 2] = float("inf"), float("nan")
    blocks[4] = 0.0
    blocks[5] *= 1e37  # huge scale; the largest element is near float32's limit
    blocks[5, 0] = 3.0e38
    blocks[6] *= 1e-41  # subnormal values and scale
    blocks[7] = 0.0
    blocks[7, 5] = 1e-45  # absmax / qmax underflows: scale 0, codes 0 (in float32; 0 in bfloat16)
    # Exact ties: scale 1, so every value lands halfway between two codes (round half to even).
    ties = torch.arange(block_size, dtype=torch.float32) % (2 * qmax) - qmax + 0.5
    blocks[8] = ties
    blocks[8, 0] = qmax
    blocks[9] = -ties
    blocks[9, 0] = -qmax
    blocks[10] = -0.0
    blocks[11, :] = 1e-30  # a constant block: every code is qmax
    blocks[12, 0] = torch.finfo(torch.float32).max  # code * scale rounds past float32's limit: clamped back
    return blocks.reshape(-1)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [16, 64])
def test_special_values(block_size, bits, dtype, kernels):
    """NaN, +-Inf, all-zero, huge, subnormal, rounding-tie blocks through every op, including their sums."""
    fmt = BlockFormat(bits, block_size)
    x = special_blocks(block_size, fmt.qmax).to(dtype)
    numel = x.numel()
    expected = check_quantize(x, fmt, 1, 1, kernels)
    _, scales = split_packs(expected, fmt, 1, numel)
    assert scales[0, 0].isnan() and scales[0, 1] == float("inf") and scales[0, 4] == 0

    out = torch.empty(numel, dtype=torch.float32, device=kernels.device)
    kernels.ops.dequantize_chunks(expected.to(kernels.device), fmt, 1, numel, out)
    ref = torch.empty(numel, dtype=torch.float32)
    reference.dequantize_chunks(expected, fmt, 1, numel, ref)
    assert_same_floats(out, ref)

    # Two groups of the same pack: the huge block's sum overflows to Inf.
    twice = torch.cat([expected, expected])
    req = torch.empty_like(expected)
    reference.reduce_requantize(twice, fmt, 2, 1, numel, req)
    actual = torch.empty_like(expected, device=kernels.device)
    kernels.ops.reduce_requantize(twice.to(kernels.device), fmt, 2, 1, numel, actual)
    assert_same_packs(actual, req, fmt, 1, numel)
    assert split_packs(req, fmt, 1, numel)[1][0, 5] == float("inf")

    reference.reduce_dequantize(twice, fmt, 2, numel, ref, 2.0)
    kernels.ops.reduce_dequantize(twice.to(kernels.device), fmt, 2, numel, out, 2.0)
    assert_same_floats(out, ref.to(out.dtype))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "bits,block_size", [(b, n) for b in (8, 4) for n in (16, 32, 128, 8192)] + [(2, 16), (2, 32), (2, 128)]
)
def test_native_special_values_every_path(block_size, bits, dtype, native_kernels):
    """Every code path of the native kernels on the special blocks, from and into every dtype: the vector kernels'
    paths for blocks of 16, 32 and more elements (8192, the largest, is alone in its batch), the portable encoding
    they fall back on for zero, NaN, Inf and subnormal scales, and the final division by a power of two (a
    multiplication, also by a subnormal reciprocal) and by other divisors (3, and 2^-130, whose reciprocal
    overflows). Int2 skips 8192, whose path int8 and int4 reach."""
    fmt = BlockFormat(bits, block_size)
    x = special_blocks(block_size, fmt.qmax).to(dtype)
    numel = x.numel()
    packed = check_quantize(x, fmt, 1, 1, native_kernels)
    twice = torch.cat([packed, packed])
    summed = torch.empty_like(packed)
    reference.reduce_requantize(twice, fmt, 2, 1, numel, summed)
    actual = torch.full_like(summed, 0xAB)
    native_kernels.ops.reduce_requantize(twice, fmt, 2, 1, numel, actual)
    assert_same_packs(actual, summed, fmt, 1, numel)
    for out_dtype in DTYPES:
        expected = torch.empty(numel, dtype=out_dtype)
        reference.dequantize_chunks(packed, fmt, 1, numel, expected)
        out = torch.full((numel,), float("nan"), dtype=out_dtype)
        native_kernels.ops.dequantize_chunks(packed, fmt, 1, numel, out)
        assert_same_floats(out, expected)
        for divisor in (2.0, 3.0, 2.0**127, 2.0**-130):
            expected32 = torch.empty(numel, dtype=torch.float32)
            reference.reduce_dequantize(twice, fmt, 2, numel, expected32, divisor)
            native_kernels.ops.reduce_dequantize(twice, fmt, 2, numel, out, divisor)
            assert_same_floats(out, expected32.to(out_dtype))


@pytest.mark.parametrize("out_dtype,low_bits", [(torch.bfloat16, 16), (torch.float16, 13)])
def test_output_cast_rounds_half_to_even(out_dtype, low_bits, kernels, gen):
    """Every dequantized value an exact tie of the output dtype: codes +-1, +-2, +-4 times scales whose float32
    bits end in binary 100...0 at the cut (``low_bits`` bits are dropped), with random rounding-bit parity; the
    first block has a NaN scale."""
    fmt = BlockFormat(8, 16)
    blocks = 64
    bits = torch.randint(0, 2**31, (blocks,), generator=gen, dtype=torch.int64)
    exponent = 120 if out_dtype == torch.float16 else torch.randint(40, 200, (blocks,), generator=gen)
    bits = (bits & (2**23 - 1) & ~(2**low_bits - 1)) | 2 ** (low_bits - 1) | (exponent << 23)
    bits[0] = -1  # a NaN with every payload bit set: rounding its bits naively would carry it into +0
    scales = bits.to(torch.int32).view(torch.float32)
    choices = torch.tensor([0, 1, -1, 2, -2, 4, -4], dtype=torch.int8).view(torch.uint8)
    codes = choices[torch.randint(7, (blocks, 16), generator=gen)]
    buf = torch.cat([codes.reshape(-1), scales.view(torch.uint8)])
    expected = torch.empty(blocks * 16, dtype=out_dtype)
    reference.dequantize_chunks(buf, fmt, 1, blocks * 16, expected)
    actual = torch.empty(blocks * 16, dtype=out_dtype, device=kernels.device)
    kernels.ops.dequantize_chunks(buf.to(kernels.device), fmt, 1, blocks * 16, actual)
    assert_same_floats(actual, expected)


def test_empty_launches_nothing(kernels):
    """numel 0: every op returns without touching anything (a grid of 0 programs is never launched)."""
    fmt = BlockFormat(8, 16)
    empty_bytes = torch.empty(0, dtype=torch.uint8, device=kernels.device)
    kernels.ops.quantize_chunks(torch.empty(0, device=kernels.device), fmt, 4, 2, empty_bytes)
    kernels.ops.reduce_requantize(empty_bytes, fmt, 2, 4, 0, empty_bytes)
    out = torch.empty(0, device=kernels.device)
    kernels.ops.dequantize_chunks(empty_bytes, fmt, 4, 0, out)
    kernels.ops.reduce_dequantize(empty_bytes, fmt, 2, 0, out, 4.0)
    # A short last rank can own nothing while the packs are not empty.
    buf = torch.full((2 * fmt.packed_bytes(20),), 0xAB, dtype=torch.uint8, device=kernels.device)
    kernels.ops.reduce_dequantize(buf, fmt, 2, 20, out, 4.0)
    assert (buf == 0xAB).all()


@pytest.mark.parametrize("bits,block_size", [(8, 2048), (4, 256)])
def test_large(bits, block_size, kernels, gen):
    """About 100k elements through quantize (swizzled), requantize after hop 1 and the final reduce."""
    fmt = BlockFormat(bits, block_size)
    nodes, ranks_per_node = 2, 2
    world = nodes * ranks_per_node
    numel = 100_003
    x = random_values(numel, torch.bfloat16, gen)
    buf = check_quantize(x, fmt, world, nodes, kernels)
    chunk = zq.chunk_numel(numel, world)

    # Hop 1 sums ranks_per_node runs of `nodes` packs; pretend all peers sent this same buffer.
    peers = torch.cat([buf.view(ranks_per_node, -1)[0]] * ranks_per_node)
    expected = torch.empty(nodes * fmt.packed_bytes(chunk), dtype=torch.uint8)
    reference.reduce_requantize(peers, fmt, ranks_per_node, nodes, chunk, expected)
    actual = torch.empty_like(expected, device=kernels.device)
    kernels.ops.reduce_requantize(peers.to(kernels.device), fmt, ranks_per_node, nodes, chunk, actual)
    assert_same_packs(actual, expected, fmt, nodes, nodes * chunk)

    ref = torch.empty(chunk - 1, dtype=torch.float32)
    reference.reduce_dequantize(expected, fmt, nodes, chunk, ref, float(world))
    out = torch.empty(chunk - 1, dtype=torch.bfloat16, device=kernels.device)
    kernels.ops.reduce_dequantize(expected.to(kernels.device), fmt, nodes, chunk, out, float(world))
    assert_same_floats(out, ref.to(out.dtype))


def test_public_ops_run_the_kernels(quant_backend, monkeypatch, gen):
    """Through ``zeropp.quant`` with each backend: the same bytes and values as the reference, and the Triton
    kernels called exactly when the Triton backend runs."""
    calls = []
    for name in ("quantize_chunks", "dequantize_chunks"):
        kernel = getattr(_triton, name)
        monkeypatch.setattr(_triton, name, lambda *a, _k=kernel, _n=name: (calls.append(_n), _k(*a))[1])
    x = random_values(1000, torch.float16, gen)
    q = zq.quantize(x.to(quant_backend), bits=4, block_size=64)
    expected = torch.empty(BlockFormat(4, 64).packed_bytes(1000), dtype=torch.uint8)
    reference.quantize_chunks(x, BlockFormat(4, 64), 1, 1, expected)
    assert_same_packs(q.buffer, expected, BlockFormat(4, 64), 1, 1000)
    ref = torch.empty(1000, dtype=torch.float16)
    reference.dequantize_chunks(expected, BlockFormat(4, 64), 1, 1000, ref)
    assert_same_floats(zq.dequantize(q), ref)
    assert calls == (["quantize_chunks", "dequantize_chunks"] if zq.backend_name(q.buffer) == "triton" else [])


def test_native_forced_for_cuda_tensors(monkeypatch):
    """``ZEROPP_QUANT_BACKEND=native`` sends CUDA tensors to the native CUDA kernels, or says why they cannot run
    and how to fix it. Without a GPU a stand-in plays the CUDA tensor (the dispatch reads only ``is_cuda``)."""
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "native")
    cuda_tensor = torch.empty(1, device="cuda") if torch.cuda.is_available() else SimpleNamespace(is_cuda=True)
    reason = native_cuda.unavailable_reason()
    if reason is None:
        assert zq.backend_name(cuda_tensor) == "native"
    else:
        with pytest.raises(RuntimeError, match="native CUDA kernels cannot run") as raised:
            zq.backend_name(cuda_tensor)
        assert reason in str(raised.value)


def test_public_ops_run_native_cuda(monkeypatch, gen):
    """Through ``zeropp.quant`` with ``ZEROPP_QUANT_BACKEND=native`` on CUDA tensors: the native CUDA kernels run
    (each op launches one kernel) and give the reference's bytes and values."""
    native_cuda_module()
    launched = []
    launch = native_cuda.Module.launch
    monkeypatch.setattr(native_cuda.Module, "launch", lambda self, *a: (launched.append(a[1]), launch(self, *a))[1])
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "native")
    fmt = BlockFormat(4, 64)
    x = random_values(1000, torch.float16, gen)
    q = zq.quantize(x.cuda(), bits=4, block_size=64)
    expected = torch.empty(fmt.packed_bytes(1000), dtype=torch.uint8)
    reference.quantize_chunks(x, fmt, 1, 1, expected)
    assert_same_packs(q.buffer, expected, fmt, 1, 1000)
    ref = torch.empty(1000, dtype=torch.float16)
    reference.dequantize_chunks(expected, fmt, 1, 1000, ref)
    assert_same_floats(zq.dequantize(q), ref)
    ops = ("quantize_chunks", "dequantize_chunks")
    assert launched == [native_cuda.kernel_name(op, 4, torch.float16) for op in ops]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_threads_agree(threads, gen):
    """The native library splits the blocks over ``torch.get_num_threads()`` OpenMP threads: any count writes the
    reference's bytes (uneven splits included: 3 threads over 2 x 1001-element packs)."""
    lib = native_library()
    fmt = BlockFormat(4, 16)
    x = random_values(2002, torch.float16, gen)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = torch.full((fmt.chunked_bytes(2002, 2),), 0xAB, dtype=torch.uint8)
        lib.quantize_chunks(x, fmt, 2, 2, actual)
        summed = torch.empty(fmt.packed_bytes(1001), dtype=torch.uint8)
        lib.reduce_requantize(actual, fmt, 2, 1, 1001, summed)
        values = torch.empty(1001, dtype=torch.bfloat16)
        lib.reduce_dequantize(actual, fmt, 2, 1001, values, 2.0)
    finally:
        torch.set_num_threads(previous)
    expected = torch.empty_like(actual)
    reference.quantize_chunks(x, fmt, 2, 2, expected)
    assert_same_packs(actual, expected, fmt, 2, 2002)
    expected_sum = torch.empty_like(summed)
    reference.reduce_requantize(expected, fmt, 2, 1, 1001, expected_sum)
    assert_same_packs(summed, expected_sum, fmt, 1, 1001)
    expected_values = torch.empty(1001, dtype=torch.bfloat16)
    reference.reduce_dequantize(expected, fmt, 2, 1001, expected_values, 2.0)
    assert_same_floats(values, expected_values)
