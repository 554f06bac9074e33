// The native CPU implementation of zeropp's block quantization ops: bit for bit the spec of
// zeropp/quant/format.py, as the torch reference (zeropp/quant/reference.py) computes it. A plain C ABI (pointers,
// sizes, dtype codes), loaded by zeropp/quant/native.py through ctypes.
//
// Exactness. Built without -ffast-math and with -ffp-contract=off, so every rounding is the one written
// (-fno-trapping-math only lets the compiler compute both sides of a select):
//  * scale = absmax / qmax in float division; absmax on the magnitude bits as integers (a NaN's bits exceed
//    Inf's, so the maximum propagates NaN, as the spec wants; float16 and bfloat16 magnitudes order the same way);
//  * code = rne(x * r) of the exact product, r = 1 / scale rounded to 24 bits. The portable kernels take r and
//    the product in double, where both are exact, and round it by adding 1.5 * 2^52. The AVX2 kernels do so for a
//    subnormal scale only (r can then overflow a float); for a normal one r is a normal float (1.0f / scale,
//    correctly rounded: scale <= FLT_MAX / 7) and fma(x, r, 1.5 * 2^23) rounds the exact product once, to an
//    integer q; |x * r| <= qmax * (1 + 2^-22), so no clamp is needed, and the float's bits are those of
//    1.5 * 2^23 plus q, so its low bits are q's;
//  * the fused sums are acc = fma(code, scale, acc), the spec's own operation; the final division is IEEE
//    division, or a multiplication by 1 / divisor where that is exact (a power of two): the same rounding of the
//    same real number;
//  * conversions to float16 and bfloat16 round to nearest even, NaN stays NaN;
//  * stochastic rounding (format.py's noise): p = x * r rounded once to float (a float multiplication where r is a
//    float; in double, then rounded, for a subnormal scale), then the floor of |p| and the comparison of its
//    fraction with 1 - u, all exact. The hash is 32-bit lane arithmetic with its per-index key computed once per
//    run of indices that share their high 32 bits (noise_thresholds), so it vectorizes: 8 lanes in the AVX2
//    kernels, which round stochastically for every normal scale (int8, int4 and int2), the compiler's in the
//    portable ones (and for the blocks with a subnormal scale).
//
// Three sets of kernels, chosen when the library is first called: the AVX-512 kernels (the AVX2 ones with their
// own fused int4 reduce-requantize, which needs AVX-512 F, BW, VL and VBMI2) on x86-64 CPUs that have them, the
// AVX2 kernels (AVX2, FMA and F16C, 8 floats a vector; vcvtph2ps and vcvtps2ph are exact IEEE conversions) on
// those that have these, and the portable kernels (plain C++, one element at a time; fmaf is the C library's exact
// FMA) elsewhere. ZEROPP_NO_AVX512 builds the AVX2 and portable ones, ZEROPP_BASELINE_ONLY the portable ones alone
// (two more libraries, so that the tests run every set on a CPU that has AVX-512).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "isa.h"
#if ZEROPP_X86_KERNELS
// GCC 12's AVX-512 intrinsics start from deliberately undefined vectors, which -Wmaybe-uninitialized flags when
// they are inlined (GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// How elements of a dtype are stored: float, or the 16 bits of a bfloat16 or float16.
template <int D>
using Storage = std::conditional_t<D == kFloat32, float, uint16_t>;

constexpr double kRounder64 = 6755399441055744.0;  // 1.5 * 2^52: x + kRounder64 rounds |x| < 2^51 to an integer
constexpr int kMaxBlock = 8192;

template <int Bits>
constexpr int kQmax = (1 << (Bits - 1)) - 1;

// Blocks [first, first + count) of one pack: their codes, then their float32 scales (4 bytes each; the bytes may
// be unaligned).
template <typename Byte>
struct Run {
    Byte* codes;
    Byte* scales;
    int64_t count;
};

struct Layout {
    int bits, block;
    int64_t block_code_bytes() const { return int64_t(block) * bits / 8; }
    int64_t blocks(int64_t numel) const { return (numel + block - 1) / block; }
    int64_t pack_bytes(int64_t numel) const { return blocks(numel) * (block_code_bytes() + 4); }
    template <typename Byte>
    Run<Byte> run(Byte* pack, int64_t blocks, int64_t first, int64_t count) const {
        return {pack + first * block_code_bytes(), pack + blocks * block_code_bytes() + 4 * first, count};
    }
};

#include "float_bits.h"

ZEROPP_INLINE float load_float(const uint8_t* p) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
}

ZEROPP_INLINE void store_float(uint8_t* p, float v) { std::memcpy(p, &v, 4); }

// float16 -> float32 on the bits, in integer and exact float operations (the other way: float_bits.h). Agrees with
// IEEE conversion, NaN stays NaN.
ZEROPP_INLINE float half_to_float(uint16_t h) {
    const uint32_t magnitude = uint32_t(h & 0x7FFF) << 13;
    float v = float_of(magnitude) * 0x1p112f;  // rebias the exponent: exact, subnormal halves included
    uint32_t u = magnitude >= (0x7C00u << 13) ? magnitude | 0x7F800000u : bits_of(v);  // Inf and NaN
    return float_of(u | (uint32_t(h & 0x8000) << 16));
}



template <int D>
ZEROPP_INLINE float to_float(Storage<D> x) {
    if constexpr (D == kFloat32) {
        return x;
    } else if constexpr (D == kBFloat16) {
        return float_of(uint32_t(x) << 16);
    } else {
        return half_to_float(x);
    }
}

template <int D>
ZEROPP_INLINE Storage<D> from_float(float v) {
    if constexpr (D == kFloat32) {
        return v;
    } else if constexpr (D == kBFloat16) {
        return float_to_bfloat16(v);
    } else {
        return float_to_half(v);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The portable kernels, one element at a time. Their encoding of a block also serves the vector kernels for the
// blocks whose scale is not a normal float.
namespace portable {

// The codes q[0..block) into `codes`: int8 bytes, two int4 codes a byte (element 2k in the low nibble), or four
// int2 codes a byte (element 4k in the lowest two bits).
template <int Bits>
ZEROPP_INLINE void pack_codes(const int32_t* q, int block, uint8_t* codes) {
    if constexpr (Bits == 8) {
        for (int i = 0; i < block; ++i) codes[i] = uint8_t(q[i]);
    } else if constexpr (Bits == 2) {
        for (int i = 0; i < block / 4; ++i) {
            uint32_t byte = 0;
            for (int k = 0; k < 4; ++k) byte |= (uint32_t(q[4 * i + k]) & 3) << (2 * k);
            codes[i] = uint8_t(byte);
        }
    } else {
        for (int i = 0; i < block / 2; ++i) {
            codes[i] = uint8_t((uint32_t(q[2 * i]) & 0xF) | uint32_t(q[2 * i + 1]) << 4);
        }
    }
}

}  // namespace portable

// The noise of stochastic rounding (format.py): u = (h >> 9) * 2^-23 for element `index`, h the hash below.
struct Noise {
    uint32_t seed;
};

// MurmurHash3's 32-bit finalizer.
ZEROPP_INLINE uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

// The key of the noise of the indices whose high 32 bits are `hi`: fmix32(fmix32(hi) ^ seed).
ZEROPP_INLINE uint32_t noise_key(const Noise& noise, uint32_t hi) { return fmix32(fmix32(hi) ^ noise.seed); }

// The largest n' <= n such that indices first .. first + n' - 1 share their high 32 bits (one key): n unless the
// run crosses a multiple of 2^32.
ZEROPP_INLINE int64_t same_key_run(int64_t first, int64_t n) {
    return std::min<int64_t>(n, int64_t((uint64_t(1) << 32) - (uint64_t(first) & 0xFFFFFFFFu)));
}

// t[0..n) = 1 - u of the indices first .. first + n - 1 (exact in float: (2^23 - (h >> 9)) * 2^-23), h =
// fmix32(lo * 0x9E3779B1 + key) with key = noise_key(hi) and lo, hi an index's low and high 32 bits. The key is
// computed once per run of equal high halves, and lo * 0x9E3779B1 + key (mod 2^32) of element j is that of the
// run's first plus j * 0x9E3779B1, so the inner loop is 32-bit lane arithmetic with no branch, which compilers
// vectorize.
inline void noise_thresholds(const Noise& noise, int64_t first, int64_t n, float* __restrict t) {
    for (int64_t i = 0; i < n;) {
        const int64_t m = same_key_run(first + i, n - i);
        const uint64_t index = uint64_t(first + i);
        const uint32_t base = uint32_t(index) * 0x9E3779B1u + noise_key(noise, uint32_t(index >> 32));
        for (int64_t j = 0; j < m; ++j) {
            const uint32_t h = fmix32(base + uint32_t(j) * 0x9E3779B1u);
            t[i + j] = float(int32_t(8388608u - (h >> 9))) * 0x1p-23f;
        }
        i += m;
    }
}

namespace portable {

// The codes of v[0..block) for its `scale`, which is any float: 0 for an all-zero, NaN or Inf block. r is a double
// (for a subnormal scale 1 / scale to 24 bits can overflow a float), where the product is exact and is rounded to
// an integer by adding 1.5 * 2^52; the clamp only acts for a subnormal scale (the product can then round past qmax).
// With `noise`, rounded stochastically instead, element i with the noise of index first + i: p = x * r rounded to
// float once, code = sign(p) * min(floor(|p|) + (|p| - floor(|p|) >= 1 - u), qmax), every step exact.
template <int Bits>
void encode(const float* v, int block, float scale, uint8_t* codes, const Noise* noise = nullptr,
            int64_t first = 0) {
    if (!(scale > 0.0f && scale <= FLT_MAX)) {
        std::memset(codes, 0, size_t(block) * Bits / 8);
        return;
    }
    constexpr double qmax = kQmax<Bits>;
    int e;
    const double m = std::frexp(1.0 / double(scale), &e);
    const double r = std::ldexp((std::ldexp(m, 24) + kRounder64) - kRounder64, e - 24);
    int32_t q[kMaxBlock];
    if (noise) {
        float t[kMaxBlock];
        noise_thresholds(*noise, first, block, t);
        for (int i = 0; i < block; ++i) {  // |p| < 2^31 (at most about 2 qmax), so truncation is its floor
            const float p = float(double(v[i]) * r);
            const float a = std::fabs(p);
            const int32_t whole = int32_t(a);
            const int32_t c = std::min(whole + int32_t(a - float(whole) >= t[i]), int32_t(qmax));
            q[i] = p < 0.0f ? -c : c;
        }
    } else {
        for (int i = 0; i < block; ++i) {
            const double c = (double(v[i]) * r + kRounder64) - kRounder64;
            q[i] = int32_t(std::min(std::max(c, -qmax), qmax));
        }
    }
    pack_codes<Bits>(q, block, codes);
}

// The same from x[0..block) of dtype D.
template <int Bits, int D>
void encode(const Storage<D>* x, int block, float scale, uint8_t* codes, const Noise* noise = nullptr,
            int64_t first = 0) {
    float v[kMaxBlock];
    for (int i = 0; i < block; ++i) v[i] = to_float<D>(x[i]);
    encode<Bits>(v, block, scale, codes, noise, first);
}

// Codes and scale of the float values v[0..block) (rounded stochastically with `noise`, element i with the noise
// of index first + i).
template <int Bits>
void quantize_block(const float* v, int block, uint8_t* codes, uint8_t* scale, const Noise* noise = nullptr,
                    int64_t first = 0) {
    uint32_t absmax_bits = 0;
    for (int i = 0; i < block; ++i) absmax_bits = std::max(absmax_bits, bits_of(v[i]) & 0x7FFFFFFFu);
    const float s = float_of(absmax_bits) / float(kQmax<Bits>);  // NaN for a NaN block, Inf for an Inf one
    store_float(scale, s);
    encode<Bits>(v, block, s, codes, noise, first);
}

// The two int4 codes of a byte (element 2k in the low nibble), sign-extended by arithmetic shifts.
ZEROPP_INLINE float low_code(uint8_t byte) { return float(int8_t(byte << 4) >> 4); }
ZEROPP_INLINE float high_code(uint8_t byte) { return float(int8_t(byte) >> 4); }

// Int2 code k (element 4i + k of byte i), sign-extended by arithmetic shifts.
ZEROPP_INLINE float int2_code(uint8_t byte, int k) { return float(int8_t(byte << (6 - 2 * k)) >> 6); }

// The codes of a block as floats, into q[0..block).
template <int Bits>
ZEROPP_INLINE void decode(const uint8_t* codes, int block, float* q) {
    if constexpr (Bits == 8) {
        for (int i = 0; i < block; ++i) q[i] = float(int8_t(codes[i]));
    } else if constexpr (Bits == 2) {
        for (int i = 0; i < block / 4; ++i) {
            for (int k = 0; k < 4; ++k) q[4 * i + k] = int2_code(codes[i], k);
        }
    } else {
        for (int i = 0; i < block / 2; ++i) {
            q[2 * i] = low_code(codes[i]);
            q[2 * i + 1] = high_code(codes[i]);
        }
    }
}

// acc[0..block) = the fused sum of one block of `groups` packs: acc = 0, then acc = fma(code, scale, acc) for each
// pack in order; the block of pack g lies g * stride bytes after that of `in`.
template <int Bits>
void sum_block(const Run<const uint8_t>& in, int64_t stride, int groups, int block, float* acc) {
    std::fill(acc, acc + block, 0.0f);
    for (int g = 0; g < groups; ++g) {
        const uint8_t* codes = in.codes + g * stride;
        const float s = load_float(in.scales + g * stride);
        if constexpr (Bits == 8) {
            for (int i = 0; i < block; ++i) acc[i] = std::fma(float(int8_t(codes[i])), s, acc[i]);
        } else if constexpr (Bits == 2) {
            for (int i = 0; i < block; ++i) acc[i] = std::fma(int2_code(codes[i / 4], i % 4), s, acc[i]);
        } else {  // decoded in the same loop: on x86-64 without FMA, fmaf is a call, and a separate loop costs more
            for (int i = 0; i < block / 2; ++i) {
                acc[2 * i] = std::fma(low_code(codes[i]), s, acc[2 * i]);
                acc[2 * i + 1] = std::fma(high_code(codes[i]), s, acc[2 * i + 1]);
            }
        }
    }
}

// The kernels of every instruction set, on runs of whole blocks, and the fused sum of one block in element
// order (for the reduce-requantize into another format).
struct Kernels {
    template <int Bits>
    static void sum_elements(const Run<const uint8_t>& in, int64_t stride, int groups, int block, float* acc) {
        sum_block<Bits>(in, stride, groups, block, acc);
    }

    // Codes and scales of the run's blocks from x[0 .. count * block) (with `noise`, rounded stochastically,
    // x[i] with the noise of index first + i).
    template <int Bits, int D>
    static void quantize(const Storage<D>* x, int block, const Run<uint8_t>& out, const Noise* noise = nullptr,
                         int64_t first = 0) {
        float v[kMaxBlock];
        for (int64_t b = 0; b < out.count; ++b, x += block) {
            for (int i = 0; i < block; ++i) v[i] = to_float<D>(x[i]);
            quantize_block<Bits>(v, block, out.codes + b * block * Bits / 8, out.scales + 4 * b, noise,
                                 first + b * block);
        }
    }

    // The values of the run's blocks (code * scale, clamped to the finite floats: NaN stays NaN) into out.
    template <int Bits, int D>
    static void dequantize(const Run<const uint8_t>& in, int block, Storage<D>* out) {
        float v[kMaxBlock];
        for (int64_t b = 0; b < in.count; ++b, out += block) {
            decode<Bits>(in.codes + b * block * Bits / 8, block, v);
            const float s = load_float(in.scales + 4 * b);
            for (int i = 0; i < block; ++i) {
                const float y = v[i] * s;
                v[i] = y > FLT_MAX ? FLT_MAX : (y < -FLT_MAX ? -FLT_MAX : y);
            }
            for (int i = 0; i < block; ++i) out[i] = from_float<D>(v[i]);
        }
    }

    // The run's values added into out: out = D(float(code * scale, clamped) + float(out)), the float32 sum
    // rounded once to D (a product, then a sum: not an FMA).
    template <int Bits, int D>
    static void dequantize_add(const Run<const uint8_t>& in, int block, Storage<D>* out) {
        float v[kMaxBlock];
        for (int64_t b = 0; b < in.count; ++b, out += block) {
            decode<Bits>(in.codes + b * block * Bits / 8, block, v);
            const float s = load_float(in.scales + 4 * b);
            for (int i = 0; i < block; ++i) {
                const float y = v[i] * s;
                v[i] = y > FLT_MAX ? FLT_MAX : (y < -FLT_MAX ? -FLT_MAX : y);
            }
            for (int i = 0; i < block; ++i) out[i] = from_float<D>(v[i] + to_float<D>(out[i]));
        }
    }

    // The run's blocks of `groups` packs (pack g `stride` bytes after `in`), summed, requantized into out.
    template <int Bits>
    static void reduce_requantize(const Run<const uint8_t>& in, int64_t stride, int groups, int block,
                                  const Run<uint8_t>& out) {
        float acc[kMaxBlock];
        for (int64_t b = 0; b < in.count; ++b) {
            const int64_t code_offset = b * block * Bits / 8;
            sum_block<Bits>({in.codes + code_offset, in.scales + 4 * b, 1}, stride, groups, block, acc);
            quantize_block<Bits>(acc, block, out.codes + code_offset, out.scales + 4 * b);
        }
    }

    // The run's blocks of `groups` packs, summed, divided by `divisor`, into out.
    template <int Bits, int D>
    static void reduce_dequantize(const Run<const uint8_t>& in, int64_t stride, int groups, int block, float divisor,
                                  Storage<D>* out) {
        float acc[kMaxBlock];
        for (int64_t b = 0; b < in.count; ++b, out += block) {
            sum_block<Bits>({in.codes + b * block * Bits / 8, in.scales + 4 * b, 1}, stride, groups, block, acc);
            for (int i = 0; i < block; ++i) acc[i] /= divisor;
            for (int i = 0; i < block; ++i) out[i] = from_float<D>(acc[i]);
        }
    }
};

}  // namespace portable

#if ZEROPP_X86_KERNELS
// ---------------------------------------------------------------------------------------------------------------
// The AVX2 kernels: 8 floats a vector. Blocks are powers of two of at least 16 elements, so the loops take whole
// vectors.
namespace avx2 {

// Blocks are quantized in batches: first each block's largest magnitude, then the scales and their reciprocals of
// all of them in one vector (which takes the divisions' latency off each block's path), then the codes of each. A
// batch is kBatchElements elements (at most kBatch blocks, at least one): its second pass reads them again from
// the cache while no new data streams in, so larger batches slow the whole.
constexpr int kBatch = 8, kBatchElements = 1024;

inline int batch_blocks(int block) { return std::clamp(kBatchElements / block, 1, kBatch); }

constexpr float kRounder = 12582912.0f;  // 1.5 * 2^23: x + kRounder rounds |x| < 2^22 to an integer

// Whether r = 1 / divisor is a float, so that x * r rounds as x / divisor does.
inline bool exact_reciprocal(float divisor) {
    const float r = 1.0f / divisor;
    return std::isfinite(r) && double(r) * double(divisor) == 1.0;  // a product of two floats is exact in double
}

#define ZEROPP_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZEROPP_AVX2_INLINE inline __attribute__((always_inline, target("avx2,fma,f16c")))

ZEROPP_AVX2_INLINE __m128i load_u128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Eight elements as floats (exact conversions).
template <int D>
ZEROPP_AVX2_INLINE __m256 load8(const Storage<D>* p) {
    if constexpr (D == kFloat32) {
        return _mm256_loadu_ps(p);
    } else if constexpr (D == kBFloat16) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_u128(p)), 16));
    } else {
        return _mm256_cvtph_ps(load_u128(p));
    }
}

// The bfloat16 bits of v (in the low half of each lane), rounded to nearest even; NaN stays NaN (quiet).
ZEROPP_AVX2_INLINE __m256i bfloat16_bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v), high = _mm256_srli_epi32(u, 16);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i quiet = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// Sixteen floats (v0, then v1) stored as dtype D, rounded to nearest even. float16 goes through registers: Zen 4
// runs vcvtps2ph with a memory operand at half the speed.
template <int D>
ZEROPP_AVX2_INLINE void store16(Storage<D>* p, __m256 v0, __m256 v1) {
    if constexpr (D == kFloat32) {
        _mm256_storeu_ps(p, v0);
        _mm256_storeu_ps(p + 8, v1);
    } else {
        __m256i halves;
        if constexpr (D == kBFloat16) {  // packus works per 128-bit lane
            halves = _mm256_permute4x64_epi64(_mm256_packus_epi32(bfloat16_bits(v0), bfloat16_bits(v1)), 0xD8);
        } else {
            halves = _mm256_setr_m128i(_mm256_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT),
                                       _mm256_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT));
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
    }
}

// Eight codes as floats, from the block's codes of element i on.
template <int Bits>
ZEROPP_AVX2_INLINE __m256 decode8(const uint8_t* codes, int i) {
    if constexpr (Bits == 8) {
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i))));
    } else if constexpr (Bits == 2) {  // the 2 bytes in every lane; code k shifted to the top, then back down
        uint16_t word;
        std::memcpy(&word, codes + i / 4, 2);
        const __m256i shifts = _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16);
        const __m256i top = _mm256_sllv_epi32(_mm256_set1_epi32(word), shifts);
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 30));
    } else {  // the 4 bytes in every lane; nibble k shifted to the top, then arithmetically back down
        uint32_t word;
        std::memcpy(&word, codes + i / 2, 4);
        const __m256i shifts = _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0);
        const __m256i top = _mm256_sllv_epi32(_mm256_set1_epi32(int(word)), shifts);
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 28));
    }
}

// The codes of 8 elements for the reciprocal r of a normal scale: y = fma(x, r, kRounder) has the bits of kRounder
// plus the code (see the top).
template <int D>
ZEROPP_AVX2_INLINE __m256i codes8(const Storage<D>* x, __m256 r) {
    const __m256 rounder = _mm256_set1_ps(kRounder);
    const __m256 y = _mm256_fmadd_ps(load8<D>(x), r, rounder);
    return _mm256_sub_epi32(_mm256_castps_si256(y), _mm256_castps_si256(rounder));
}

// fmix32 (MurmurHash3's finalizer) of 8 lanes.
ZEROPP_AVX2_INLINE __m256i fmix32x8(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int(0x85EBCA6Bu)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(int(0xC2B2AE35u)));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// noise_thresholds (above), 8 lanes a step: lane k of step j hashes base + (8 j + k) * 0x9E3779B1.
ZEROPP_AVX2 void noise_thresholds8(const Noise& noise, int64_t first, int64_t n, float* t) {
    const __m256i golden = _mm256_set1_epi32(int(0x9E3779B1u)), step = _mm256_set1_epi32(int(8u * 0x9E3779B1u));
    const __m256i lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), golden);
    for (int64_t i = 0; i < n;) {
        const int64_t m = same_key_run(first + i, n - i);
        const uint64_t index = uint64_t(first + i);
        const uint32_t base = uint32_t(index) * 0x9E3779B1u + noise_key(noise, uint32_t(index >> 32));
        __m256i hashed = _mm256_add_epi32(_mm256_set1_epi32(int(base)), lanes);
        int64_t j = 0;
        for (; j + 8 <= m; j += 8, hashed = _mm256_add_epi32(hashed, step)) {
            const __m256i h = fmix32x8(hashed);
            const __m256i steps = _mm256_sub_epi32(_mm256_set1_epi32(8388608), _mm256_srli_epi32(h, 9));
            _mm256_storeu_ps(t + i + j, _mm256_mul_ps(_mm256_cvtepi32_ps(steps), _mm256_set1_ps(0x1p-23f)));
        }
        if (j < m) noise_thresholds(noise, first + i + j, m - j, t + i + j);  // a run cut by a multiple of 2^32
        i += m;
    }
}

// The codes of 8 elements rounded stochastically (see portable::encode) for the reciprocal r of a normal scale, t:
// their 1 - u. r is a float, so the float product is the spec's p (x * r rounded once); |p| <= qmax (1 + 2^-22),
// so truncation is floor(|p|), and the fraction |p| - floor(|p|) is exact. The sign goes back on by vpsignd, which
// leaves 0 for p = +-0 (where the code is 0 anyway: 1 - u > 0).
template <int Bits, int D>
ZEROPP_AVX2_INLINE __m256i stochastic_codes8(const Storage<D>* x, __m256 r, const float* t) {
    const __m256 p = _mm256_mul_ps(load8<D>(x), r);
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), p);
    const __m256i whole = _mm256_cvttps_epi32(a);
    const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(a, _mm256_cvtepi32_ps(whole)), _mm256_loadu_ps(t), _CMP_GE_OQ);
    const __m256i c = _mm256_min_epi32(_mm256_sub_epi32(whole, _mm256_castps_si256(up)),  // up: all ones = -1
                                       _mm256_set1_epi32(kQmax<Bits>));
    return _mm256_sign_epi32(c, _mm256_castps_si256(p));
}

// The int2 bytes of byte codes (|q| <= 1, element order): the 32-bit lane k holds the byte of codes 4k .. 4k + 3
// (code 4k + j in bits 2j, 2j + 1): their low 2 bits, pairs summed as even + 4 odd (maddubs), then those as
// low + 16 high (madd).
ZEROPP_AVX2_INLINE __m128i int2_quads(__m128i bytes) {
    const __m128i pairs = _mm_maddubs_epi16(_mm_and_si128(bytes, _mm_set1_epi8(3)), _mm_set1_epi16(0x0401));
    return _mm_madd_epi16(pairs, _mm_set1_epi32(0x00100001));
}

ZEROPP_AVX2_INLINE __m256i int2_quads(__m256i bytes) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_and_si256(bytes, _mm256_set1_epi8(3)), _mm256_set1_epi16(0x0401));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x00100001));
}

// The sixteen codes (int32, |q| <= 127) of a 16-element block stored.
template <int Bits>
ZEROPP_AVX2_INLINE void store_codes16(uint8_t* codes, __m256i q0, __m256i q1) {
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  // packs works per lane
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    if constexpr (Bits == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), bytes);
    } else if constexpr (Bits == 2) {
        const __m128i quads = int2_quads(bytes);
        const uint32_t packed = uint32_t(_mm_cvtsi128_si32(_mm_packus_epi16(_mm_packus_epi32(quads, quads), quads)));
        std::memcpy(codes, &packed, 4);
    } else {  // low nibbles of each byte pair: the even one times 1 plus the odd one times 16
        const __m128i nibbles = _mm_and_si128(bytes, _mm_set1_epi8(0xF));
        const __m128i pairs = _mm_maddubs_epi16(nibbles, _mm_set1_epi16(0x1001));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(pairs, pairs));
    }
}

// Thirty-two codes (int32, |q| <= 127) stored from element i of the block's codes.
template <int Bits>
ZEROPP_AVX2_INLINE void store_codes32(uint8_t* codes, int i, __m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    // packs works per 128-bit lane: the bytes come out as 4-byte groups 0 2 4 6 1 3 5 7
    const __m256i mixed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    const __m256i bytes = _mm256_permutevar8x32_epi32(mixed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if constexpr (Bits == 8) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), bytes);
    } else if constexpr (Bits == 2) {
        const __m256i quads = int2_quads(bytes);
        const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i / 4), _mm_packus_epi16(words, words));
    } else {  // low nibbles of each byte pair: the even one times 1 plus the odd one times 16
        const __m256i nibbles = _mm256_and_si256(bytes, _mm256_set1_epi8(0xF));
        const __m256i pairs = _mm256_maddubs_epi16(nibbles, _mm256_set1_epi16(0x1001));
        const __m128i packed = _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i / 2), packed);
    }
}

ZEROPP_AVX2_INLINE __m256i magnitude_bits(__m256 v) {
    return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
}

// The largest of the 8 unsigned lanes of m.
ZEROPP_AVX2_INLINE uint32_t horizontal_max(__m256i m) {
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
    return uint32_t(_mm_cvtsi128_si32(h));
}

// The block's largest magnitude, in its own dtype. 16-bit dtypes are compared on their magnitude bits.
template <int D>
ZEROPP_AVX2_INLINE Storage<D> absmax(const Storage<D>* x, int block) {
    if constexpr (D == kFloat32) {
        __m256i m0 = _mm256_setzero_si256(), m1 = m0;
        for (int i = 0; i < block; i += 16) {
            m0 = _mm256_max_epu32(m0, magnitude_bits(_mm256_loadu_ps(x + i)));
            m1 = _mm256_max_epu32(m1, magnitude_bits(_mm256_loadu_ps(x + i + 8)));
        }
        return float_of(horizontal_max(_mm256_max_epu32(m0, m1)));
    } else {
        __m256i m = _mm256_setzero_si256();
        for (int i = 0; i < block; i += 16) {
            const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
            m = _mm256_max_epu16(m, _mm256_and_si256(words, _mm256_set1_epi16(0x7FFF)));
        }
        // the largest of the 16 words: the complement of the smallest complement (minpos)
        const __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
        return uint16_t(~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi16(-1)))));
    }
}

// The scales of up to kBatch blocks from their largest magnitudes (dtype D), and r = 1 / scale rounded to a float
// (used for normal scales only).
template <int Bits, int D>
ZEROPP_AVX2_INLINE void batch_scales(const Storage<D>* largest, float* scale, float* r) {
    const __m256 s = _mm256_div_ps(load8<D>(largest), _mm256_set1_ps(float(kQmax<Bits>)));
    _mm256_storeu_ps(scale, s);
    _mm256_storeu_ps(r, _mm256_div_ps(_mm256_set1_ps(1.0f), s));
}

// The codes of x[0..block) for its `scale`, any float (r: its reciprocal, as batch_scales gives it); with `noise`
// rounded stochastically, element i with the noise of index first + i.
template <int Bits, int D>
ZEROPP_AVX2_INLINE void encode(const Storage<D>* x, int block, float scale, float r, uint8_t* codes,
                               const Noise* noise = nullptr, int64_t first = 0) {
    if (!(scale >= FLT_MIN && scale <= FLT_MAX)) {
        return portable::encode<Bits, D>(x, block, scale, codes, noise, first);
    }
    const __m256 vr = _mm256_set1_ps(r);
    if (noise) {
        alignas(32) float t[kMaxBlock];
        noise_thresholds8(*noise, first, block, t);
        if (block == 16) {
            return store_codes16<Bits>(codes, stochastic_codes8<Bits, D>(x, vr, t),
                                       stochastic_codes8<Bits, D>(x + 8, vr, t + 8));
        }
        for (int i = 0; i < block; i += 32) {
            store_codes32<Bits>(codes, i, stochastic_codes8<Bits, D>(x + i, vr, t + i),
                                stochastic_codes8<Bits, D>(x + i + 8, vr, t + i + 8),
                                stochastic_codes8<Bits, D>(x + i + 16, vr, t + i + 16),
                                stochastic_codes8<Bits, D>(x + i + 24, vr, t + i + 24));
        }
        return;
    }
    if (block == 16) return store_codes16<Bits>(codes, codes8<D>(x, vr), codes8<D>(x + 8, vr));
    for (int i = 0; i < block; i += 32) {
        store_codes32<Bits>(codes, i, codes8<D>(x + i, vr), codes8<D>(x + i + 8, vr), codes8<D>(x + i + 16, vr),
                            codes8<D>(x + i + 24, vr));
    }
}

// The reductions keep the sums of 16 elements in two vectors: elements 0..7 and 8..15 for int8 and int2 (element
// order); for int4 the even and the odd elements, which a byte's two nibbles split into at less cost than into
// element order.
template <int Bits>
constexpr bool kElementOrder = Bits != 4;

// Sixteen codes from element i of a block's codes, as floats in the sums' order.
template <int Bits>
ZEROPP_AVX2_INLINE void decode16(const uint8_t* codes, int i, __m256& first, __m256& second) {
    if constexpr (Bits == 8) {
        first = decode8<8>(codes, i);
        second = decode8<8>(codes, i + 8);
    } else if constexpr (Bits == 2) {  // the 4 bytes in every lane; code k shifted to the top, then back down
        uint32_t word;
        std::memcpy(&word, codes + i / 4, 4);
        const __m256i words = _mm256_set1_epi32(int(word));
        const __m256i low = _mm256_sllv_epi32(words, _mm256_setr_epi32(30, 28, 26, 24, 22, 20, 18, 16));
        const __m256i high = _mm256_sllv_epi32(words, _mm256_setr_epi32(14, 12, 10, 8, 6, 4, 2, 0));
        first = _mm256_cvtepi32_ps(_mm256_srai_epi32(low, 30));
        second = _mm256_cvtepi32_ps(_mm256_srai_epi32(high, 30));
    } else {  // each byte sign-extended; its low nibble shifted to the top and back down, its high one down
        const __m256i bytes = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2)));
        first = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(bytes, 28), 28));
        second = _mm256_cvtepi32_ps(_mm256_srai_epi32(bytes, 4));
    }
}

// Sixteen values in the sums' order stored as dtype D, in element order.
template <int Bits, int D>
ZEROPP_AVX2_INLINE void store_sums16(Storage<D>* p, __m256 first, __m256 second) {
    if constexpr (kElementOrder<Bits>) {
        store16<D>(p, first, second);
    } else if constexpr (D == kFloat32) {  // unpack works per 128-bit lane
        const __m256 low = _mm256_unpacklo_ps(first, second), high = _mm256_unpackhi_ps(first, second);
        _mm256_storeu_ps(p, _mm256_permute2f128_ps(low, high, 0x20));
        _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(low, high, 0x31));
    } else if constexpr (D == kBFloat16) {  // an even element in the low half of each 32-bit lane, the odd one above
        const __m256i pairs = _mm256_or_si256(bfloat16_bits(first), _mm256_slli_epi32(bfloat16_bits(second), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pairs);
    } else {
        const __m128i even = _mm256_cvtps_ph(first, _MM_FROUND_TO_NEAREST_INT);
        const __m128i odd = _mm256_cvtps_ph(second, _MM_FROUND_TO_NEAREST_INT);
        const __m256i halves = _mm256_setr_m128i(_mm_unpacklo_epi16(even, odd), _mm_unpackhi_epi16(even, odd));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
    }
}

// sums[2u], sums[2u + 1] = the fused sums of the 16 elements from element i + 16 u of one block of `groups` packs
// (see portable::sum_block), a pack at a time: 2 U independent chains of FMAs, so that their latency overlaps.
template <int Bits, int U, int G = 0>
ZEROPP_AVX2_INLINE void sum_units(const Run<const uint8_t>& in, int64_t stride, int runtime_groups, int i,
                                  __m256 (&sums)[2 * U]) {
    const int groups = G ? G : runtime_groups;
    for (__m256& sum : sums) sum = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        const uint8_t* codes = in.codes + g * stride;
        const __m256 s = _mm256_set1_ps(load_float(in.scales + g * stride));
        for (int u = 0; u < U; ++u) {
            __m256 first, second;
            decode16<Bits>(codes, i + 16 * u, first, second);
            sums[2 * u] = _mm256_fmadd_ps(first, s, sums[2 * u]);
            sums[2 * u + 1] = _mm256_fmadd_ps(second, s, sums[2 * u + 1]);
        }
    }
}

// 16-element units summed at a time: 4, or the whole of a smaller block.
constexpr int kSumUnits = 4;

// acc[0..block) = the fused sum of one block of `groups` packs, in the sums' order, U units at a time; returns its
// largest magnitude.
template <int Bits, int U, int G>
ZEROPP_AVX2_INLINE float sum_block(const Run<const uint8_t>& in, int64_t stride, int groups, int block, float* acc) {
    __m256i m = _mm256_setzero_si256();
    for (int i = 0; i < block; i += 16 * U) {
        __m256 sums[2 * U];
        sum_units<Bits, U, G>(in, stride, groups, i, sums);
        for (int v = 0; v < 2 * U; ++v) {
            _mm256_store_ps(acc + i + 8 * v, sums[v]);
            m = _mm256_max_epu32(m, magnitude_bits(sums[v]));
        }
    }
    return float_of(horizontal_max(m));
}

// The codes of a block's sums acc[0..block) (in the sums' order) for its `scale`, as encode.
template <int Bits>
ZEROPP_AVX2_INLINE void encode_sums(const float* acc, int block, float scale, float r, uint8_t* codes) {
    if constexpr (kElementOrder<Bits>) {
        encode<Bits, kFloat32>(acc, block, scale, r, codes);
    } else if (!(scale >= FLT_MIN && scale <= FLT_MAX)) {
        float v[kMaxBlock];  // in element order: element 16 u + 2 j + h is acc[16 u + 8 h + j]
        for (int i = 0; i < block; ++i) v[i] = acc[i / 16 * 16 + i % 2 * 8 + i % 16 / 2];
        portable::encode<4>(v, block, scale, codes);
    } else {
        const __m256 vr = _mm256_set1_ps(r), rounder = _mm256_set1_ps(kRounder);
        int i = 0;
        for (; i + 64 <= block; i += 64) {  // 64 codes a time: one 32-byte store
            __m256i pairs[4];
            for (int k = 0; k < 4; ++k) {
                const __m256i even = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_load_ps(acc + i + 16 * k), vr, rounder));
                const __m256i odd =
                    _mm256_castps_si256(_mm256_fmadd_ps(_mm256_load_ps(acc + i + 16 * k + 8), vr, rounder));
                pairs[k] = _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0xF)),
                                           _mm256_and_si256(_mm256_slli_epi32(odd, 4), _mm256_set1_epi32(0xF0)));
            }
            // packus works per 128-bit lane: the 4-byte groups come out as pairs[0..3] lows, then pairs[0..3] highs
            const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(pairs[0], pairs[1]),
                                                      _mm256_packus_epi32(pairs[2], pairs[3]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i / 2),
                                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        for (; i < block; i += 16) {
            const __m256i even = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_load_ps(acc + i), vr, rounder));
            const __m256i odd = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_load_ps(acc + i + 8), vr, rounder));
            // the low nibbles of the codes (see codes8): a pair's byte in each 32-bit lane
            const __m256i pairs = _mm256_or_si256(_mm256_and_si256(even, _mm256_set1_epi32(0xF)),
                                                  _mm256_and_si256(_mm256_slli_epi32(odd, 4), _mm256_set1_epi32(0xF0)));
            const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
            _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i / 2), _mm_packus_epi16(words, words));
        }
    }
}

// y clamped to the finite floats, for a float32 output (min and max return their second operand for a NaN). A
// 16-bit output needs no clamp: +-FLT_MAX and +-Inf both round to +-Inf there.
template <int D>
ZEROPP_AVX2_INLINE __m256 clamp_finite(__m256 y) {
    if constexpr (D != kFloat32) return y;
    return _mm256_max_ps(_mm256_set1_ps(-FLT_MAX), _mm256_min_ps(_mm256_set1_ps(FLT_MAX), y));
}

// The run's blocks of `groups` packs, summed, divided by the divisor (Multiply: times its exact reciprocal `by`),
// U units at a time.
template <int Bits, int D, int U, bool Multiply>
ZEROPP_AVX2_INLINE void mean_blocks(const Run<const uint8_t>& in, int64_t stride, int groups, int block, __m256 by,
                                    Storage<D>* out) {
    for (int64_t b = 0; b < in.count; ++b, out += block) {
        const Run<const uint8_t> one{in.codes + b * block * Bits / 8, in.scales + 4 * b, 1};
        for (int i = 0; i < block; i += 16 * U) {
            __m256 sums[2 * U];
            sum_units<Bits, U>(one, stride, groups, i, sums);
            for (__m256& sum : sums) sum = Multiply ? _mm256_mul_ps(sum, by) : _mm256_div_ps(sum, by);
            for (int u = 0; u < U; ++u) store_sums16<Bits, D>(out + i + 16 * u, sums[2 * u], sums[2 * u + 1]);
        }
    }
}

struct Kernels {  // as portable::Kernels
    // 8 elements a vector, a pack at a time.
    template <int Bits>
    ZEROPP_AVX2 static void sum_elements(const Run<const uint8_t>& in, int64_t stride, int groups, int block,
                                         float* acc) {
        for (int i = 0; i < block; i += 8) {
            __m256 sum = _mm256_setzero_ps();
            for (int g = 0; g < groups; ++g) {
                const __m256 s = _mm256_set1_ps(load_float(in.scales + g * stride));
                sum = _mm256_fmadd_ps(decode8<Bits>(in.codes + g * stride, i), s, sum);
            }
            _mm256_storeu_ps(acc + i, sum);
        }
    }

    template <int Bits, int D>
    ZEROPP_AVX2 static void quantize(const Storage<D>* x, int block, const Run<uint8_t>& out,
                                     const Noise* noise = nullptr, int64_t first = 0) {
        const int batch = batch_blocks(block);
        for (int64_t b = 0; b < out.count; b += batch) {
            const int n = int(std::min<int64_t>(batch, out.count - b));
            const Storage<D>* blocks = x + b * block;
            Storage<D> largest[kBatch] = {};
            for (int k = 0; k < n; ++k) largest[k] = absmax<D>(blocks + k * block, block);
            float scale[kBatch], r[kBatch];
            batch_scales<Bits, D>(largest, scale, r);
            std::memcpy(out.scales + 4 * b, scale, 4 * n);
            for (int k = 0; k < n; ++k) {
                encode<Bits, D>(blocks + k * block, block, scale[k], r[k], out.codes + (b + k) * block * Bits / 8,
                                noise, first + (b + k) * block);
            }
        }
    }

    template <int Bits, int D>
    ZEROPP_AVX2 static void dequantize(const Run<const uint8_t>& in, int block, Storage<D>* out) {
        for (int64_t b = 0; b < in.count; ++b, out += block) {
            const uint8_t* codes = in.codes + b * block * Bits / 8;
            const __m256 s = _mm256_set1_ps(load_float(in.scales + 4 * b));
            for (int i = 0; i < block; i += 16) {
                store16<D>(out + i, clamp_finite<D>(_mm256_mul_ps(decode8<Bits>(codes, i), s)),
                           clamp_finite<D>(_mm256_mul_ps(decode8<Bits>(codes, i + 8), s)));
            }
        }
    }

    // The products are clamped for every D: the sum, not the product, is rounded to D.
    template <int Bits, int D>
    ZEROPP_AVX2 static void dequantize_add(const Run<const uint8_t>& in, int block, Storage<D>* out) {
        for (int64_t b = 0; b < in.count; ++b, out += block) {
            const uint8_t* codes = in.codes + b * block * Bits / 8;
            const __m256 s = _mm256_set1_ps(load_float(in.scales + 4 * b));
            for (int i = 0; i < block; i += 16) {
                const __m256 y0 = clamp_finite<kFloat32>(_mm256_mul_ps(decode8<Bits>(codes, i), s));
                const __m256 y1 = clamp_finite<kFloat32>(_mm256_mul_ps(decode8<Bits>(codes, i + 8), s));
                store16<D>(out + i, _mm256_add_ps(y0, load8<D>(out + i)), _mm256_add_ps(y1, load8<D>(out + i + 8)));
            }
        }
    }

    template <int Bits, int G>
    ZEROPP_AVX2 static void reduce_requantize_groups(const Run<const uint8_t>& in, int64_t stride, int groups, int block,
                                              const Run<uint8_t>& out) {
        alignas(32) float acc[kMaxBlock];  // the sums of a batch of blocks
        const int batch = batch_blocks(block);
        for (int64_t first = 0; first < in.count; first += batch) {
            const int n = int(std::min<int64_t>(batch, in.count - first));
            float largest[kBatch] = {};
            for (int k = 0; k < n; ++k) {
                const Run<const uint8_t> one{in.codes + (first + k) * block * Bits / 8, in.scales + 4 * (first + k), 1};
                largest[k] = block >= 16 * kSumUnits
                                 ? sum_block<Bits, kSumUnits, G>(one, stride, groups, block, acc + k * block)
                                 : sum_block<Bits, 1, G>(one, stride, groups, block, acc + k * block);
            }
            float scale[kBatch], r[kBatch];
            batch_scales<Bits, kFloat32>(largest, scale, r);
            std::memcpy(out.scales + 4 * first, scale, 4 * n);
            for (int k = 0; k < n; ++k) {
                encode_sums<Bits>(acc + k * block, block, scale[k], r[k], out.codes + (first + k) * block * Bits / 8);
            }
        }
    }

    template <int Bits>
    ZEROPP_AVX2 static void reduce_requantize(const Run<const uint8_t>& in, int64_t stride, int groups, int block,
                                              const Run<uint8_t>& out) {
        switch (groups) {
            case 2: return reduce_requantize_groups<Bits, 2>(in, stride, groups, block, out);
            case 4: return reduce_requantize_groups<Bits, 4>(in, stride, groups, block, out);
            case 8: return reduce_requantize_groups<Bits, 8>(in, stride, groups, block, out);
            default: return reduce_requantize_groups<Bits, 0>(in, stride, groups, block, out);
        }
    }

    template <int Bits, int D>
    ZEROPP_AVX2 static void reduce_dequantize(const Run<const uint8_t>& in, int64_t stride, int groups, int block,
                                              float divisor, Storage<D>* out) {
        const bool multiply = exact_reciprocal(divisor), units = block >= 16 * kSumUnits;
        const __m256 by = _mm256_set1_ps(multiply ? 1.0f / divisor : divisor);
        if (multiply && units) return mean_blocks<Bits, D, kSumUnits, true>(in, stride, groups, block, by, out);
        if (units) return mean_blocks<Bits, D, kSumUnits, false>(in, stride, groups, block, by, out);
        if (multiply) return mean_blocks<Bits, D, 1, true>(in, stride, groups, block, by, out);
        mean_blocks<Bits, D, 1, false>(in, stride, groups, block, by, out);
    }
};

}  // namespace avx2

#endif

#if ZEROPP_AVX512_KERNELS
// ---------------------------------------------------------------------------------------------------------------
// The AVX-512 kernels: the AVX2 ones, but for the fused int4 reduce-requantize of blocks of 128 elements or more,
// which takes a unit of 128 elements in 16 lanes of 32 bits (lane j holds elements 8 j .. 8 j + 7, 4 code bytes):
// nibble k of each lane becomes a float through a 16-entry table (vpermps reads an index's low 4 bits), and the
// requantized nibbles go back into their lanes with concatenating shifts (vpshrdd, AVX512-VBMI2). Per unit and
// pack that is 7 shifts, 8 permutes and 8 FMAs, where the AVX2 kernel decodes with shifts and int-to-float
// conversions (64 instructions).
namespace avx512 {

#define ZEROPP_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi2")))
#define ZEROPP_AVX512_INLINE \
    inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vbmi2")))

constexpr int kUnit = 128;

// sums[k] lane j = the fused sum of element i + 8 j + k of one block of `groups` packs (see portable::sum_block).
template <int G>
ZEROPP_AVX512_INLINE void sum_unit(const Run<const uint8_t>& in, int64_t stride, int runtime_groups, int i,
                                   __m512 (&sums)[8]) {
    const int groups = G ? G : runtime_groups;
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    for (__m512& sum : sums) sum = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        const __m512i words = _mm512_loadu_si512(in.codes + g * stride + i / 2);
        const __m512 s = _mm512_set1_ps(load_float(in.scales + g * stride));
        sums[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(words, codes), s, sums[0]);
        for (int k = 1; k < 8; ++k) {
            const __m512 code = _mm512_permutexvar_ps(_mm512_srli_epi32(words, 4 * k), codes);
            sums[k] = _mm512_fmadd_ps(code, s, sums[k]);
        }
    }
}

// The 128 codes of a unit's sums (v[k] lane j: element 8 j + k) for the reciprocal r of a normal scale, stored.
ZEROPP_AVX512_INLINE void store_unit_codes(const __m512 (&v)[8], __m512 r, uint8_t* codes) {
    const __m512 rounder = _mm512_set1_ps(avx2::kRounder);  // low 4 bits of fma(x, r, rounder): the code's nibble
    __m512i words = _mm512_slli_epi32(_mm512_castps_si512(_mm512_fmadd_ps(v[0], r, rounder)), 28);
    for (int k = 1; k < 8; ++k) {  // the words shift down a nibble, code k comes in at the top
        words = _mm512_shrdi_epi32(words, _mm512_castps_si512(_mm512_fmadd_ps(v[k], r, rounder)), 4);
    }
    _mm512_storeu_si512(codes, words);
}

// The codes of a block's sums acc[0..block) (unit by unit, as sum_unit orders them) for its `scale`, as encode.
ZEROPP_AVX512_INLINE void encode_sums(const float* acc, int block, float scale, float r, uint8_t* codes) {
    if (!(scale >= FLT_MIN && scale <= FLT_MAX)) {
        float v[kMaxBlock];  // in element order: element i + 8 j + k is acc[i + 16 k + j]
        for (int e = 0; e < block; ++e) v[e] = acc[e / kUnit * kUnit + e % 8 * 16 + e % kUnit / 8];
        return portable::encode<4>(v, block, scale, codes);
    }
    const __m512 vr = _mm512_set1_ps(r);
    for (int i = 0; i < block; i += kUnit) {
        __m512 v[8];
        for (int k = 0; k < 8; ++k) v[k] = _mm512_load_ps(acc + i + 16 * k);
        store_unit_codes(v, vr, codes + i / 2);
    }
}

struct Kernels : avx2::Kernels {
    template <int G>
    ZEROPP_AVX512 static void reduce_requantize_int4(const Run<const uint8_t>& in, int64_t stride, int groups,
                                                     int block, const Run<uint8_t>& out) {
        alignas(64) float acc[kMaxBlock];  // the sums of a batch of blocks
        const int batch = avx2::batch_blocks(block);
        const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
        for (int64_t first = 0; first < in.count; first += batch) {
            const int n = int(std::min<int64_t>(batch, in.count - first));
            float largest[avx2::kBatch] = {};
            for (int k = 0; k < n; ++k) {
                const Run<const uint8_t> one{in.codes + (first + k) * block / 2, in.scales + 4 * (first + k), 1};
                __m512i m = _mm512_setzero_si512();
                for (int i = 0; i < block; i += kUnit) {
                    __m512 sums[8];
                    sum_unit<G>(one, stride, groups, i, sums);
                    for (int v = 0; v < 8; ++v) {
                        _mm512_store_ps(acc + k * block + i + 16 * v, sums[v]);
                        m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(sums[v]), magnitude));
                    }
                }
                largest[k] = float_of(_mm512_reduce_max_epu32(m));
            }
            float scale[avx2::kBatch], r[avx2::kBatch];
            avx2::batch_scales<4, kFloat32>(largest, scale, r);
            std::memcpy(out.scales + 4 * first, scale, 4 * n);
            for (int k = 0; k < n; ++k) {
                encode_sums(acc + k * block, block, scale[k], r[k], out.codes + (first + k) * block / 2);
            }
        }
    }

    template <int Bits>
    ZEROPP_AVX512 static void reduce_requantize(const Run<const uint8_t>& in, int64_t stride, int groups, int block,
                                                const Run<uint8_t>& out) {
        if (Bits != 4 || block < kUnit) return avx2::Kernels::reduce_requantize<Bits>(in, stride, groups, block, out);
        switch (groups) {
            case 2: return reduce_requantize_int4<2>(in, stride, groups, block, out);
            case 4: return reduce_requantize_int4<4>(in, stride, groups, block, out);
            case 8: return reduce_requantize_int4<8>(in, stride, groups, block, out);
            default: return reduce_requantize_int4<0>(in, stride, groups, block, out);
        }
    }
};

}  // namespace avx512
#endif

// ---------------------------------------------------------------------------------------------------------------
// The ops: jobs (one block of one pack each) split over threads, each thread's range cut into runs of consecutive
// blocks of one pack for the kernels of an instruction set (Isa: portable::Kernels or avx2::Kernels). Blocks cut
// short by the end of the input or output go through a block-sized buffer.

// body(pack, first block, count) for the runs of consecutive blocks of one pack that make up [first_job, end_job),
// job = pack * blocks + block.
template <typename Body>
void for_each_run(int64_t first_job, int64_t end_job, int64_t blocks, Body body) {
    for (int64_t job = first_job; job < end_job;) {
        const int64_t block = job % blocks, count = std::min(blocks - block, end_job - job);
        body(job / blocks, block, count);
        job += count;
    }
}

// The elements of `count` blocks that exist, of `available` from the first (none if negative).
inline int64_t present(int64_t available, int64_t count, int block) {
    return std::clamp<int64_t>(available, 0, count * block);
}

// Elements per batch of quantize_delta_jobs (at least one block): small enough to stay in the L1 cache.
constexpr int kDeltaBatch = 2048;

// With `noise` (stochastic rounding), element i of x takes the noise of index i.
template <class Isa, int Bits, int D>
void quantize_jobs(const Storage<D>* x, int64_t numel, const Layout& f, int64_t chunks, int64_t nodes, uint8_t* out,
                   const Noise* noise, int64_t first_job, int64_t end_job) {
    const int64_t slice = (numel + chunks - 1) / chunks, blocks = f.blocks(slice), per_node = chunks / nodes;
    auto quantize = [&](const Storage<D>* src, const Run<uint8_t>& run, int64_t index) {
        Isa::template quantize<Bits, D>(src, f.block, run, noise, index);
    };
    for_each_run(first_job, end_job, blocks, [&](int64_t p, int64_t b, int64_t count) {
        const int64_t source = (p % nodes) * per_node + p / nodes;  // format.swizzle_source
        const int64_t start = source * slice + b * f.block;
        const int64_t n = present(std::min((source + 1) * slice, numel) - start, count, f.block), full = n / f.block;
        uint8_t* pack = out + p * f.pack_bytes(slice);
        if (full) quantize(x + start, f.run(pack, blocks, b, full), start);
        for (int64_t k = full; k < count; ++k) {  // zero padded: the slice's short last block, and empty ones
            Storage<D> padded[kMaxBlock];
            const int64_t m = std::clamp<int64_t>(n - k * f.block, 0, f.block);
            if (m) std::copy_n(x + (start + k * f.block), m, padded);
            std::fill(padded + m, padded + f.block, Storage<D>(0));
            quantize(padded, f.run(pack, blocks, b + k, 1), start + k * f.block);
        }
    });
}

template <class Isa, int Bits, int D>
void dequantize_jobs(const uint8_t* buf, const Layout& f, int64_t chunk_numel, Storage<D>* out, int64_t out_numel,
                     int64_t first_job, int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    for_each_run(first_job, end_job, blocks, [&](int64_t k, int64_t b, int64_t count) {
        const int64_t first = k * chunk_numel + b * f.block;
        const int64_t n = present(std::min(chunk_numel - b * f.block, out_numel - first), count, f.block);
        const int64_t full = n / f.block;
        const uint8_t* pack = buf + k * pack_bytes;
        if (full) Isa::template dequantize<Bits, D>(f.run(pack, blocks, b, full), f.block, out + first);
        if (n > full * f.block) {  // the chunk's or the output's short last block
            Storage<D> values[kMaxBlock];
            Isa::template dequantize<Bits, D>(f.run(pack, blocks, b + full, 1), f.block, values);
            std::copy(values, values + (n - full * f.block), out + first + full * f.block);
        }
    });
}

// dequantize_jobs, adding into out (Isa::dequantize_add): a short last block is read into the buffer first.
template <class Isa, int Bits, int D>
void dequantize_add_jobs(const uint8_t* buf, const Layout& f, int64_t chunk_numel, Storage<D>* out,
                         int64_t out_numel, int64_t first_job, int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    for_each_run(first_job, end_job, blocks, [&](int64_t k, int64_t b, int64_t count) {
        const int64_t first = k * chunk_numel + b * f.block;
        const int64_t n = present(std::min(chunk_numel - b * f.block, out_numel - first), count, f.block);
        const int64_t full = n / f.block, rest = n - full * f.block;
        const uint8_t* pack = buf + k * pack_bytes;
        if (full) Isa::template dequantize_add<Bits, D>(f.run(pack, blocks, b, full), f.block, out + first);
        if (rest) {
            Storage<D> values[kMaxBlock] = {};
            Storage<D>* tail = out + first + full * f.block;
            std::copy(tail, tail + rest, values);
            Isa::template dequantize_add<Bits, D>(f.run(pack, blocks, b + full, 1), f.block, values);
            std::copy(values, values + rest, tail);
        }
    });
}

// The pack of the float32 difference t - r (numel elements each, dtype D; float subtraction, one rounding) for the
// blocks of jobs [first_job, end_job): the differences of a batch of blocks go through a buffer that stays in the
// cache, zero-padded past numel, then Isa's quantize of float32 values (round to nearest).
template <class Isa, int Bits, int D>
void quantize_delta_jobs(const Storage<D>* t, const Storage<D>* r, int64_t numel, const Layout& f, uint8_t* out,
                         int64_t first_job, int64_t end_job) {
    const int64_t blocks = f.blocks(numel), batch = std::max<int64_t>(1, kDeltaBatch / f.block);
    alignas(64) float v[std::max(kMaxBlock, kDeltaBatch)];
    for (int64_t b = first_job; b < end_job; b += batch) {
        const int64_t c = std::min(batch, end_job - b), start = b * f.block;
        const int64_t m = present(numel - start, c, f.block);
        for (int64_t i = 0; i < m; ++i) v[i] = to_float<D>(t[start + i]) - to_float<D>(r[start + i]);
        std::fill(v + m, v + c * f.block, 0.0f);
        Isa::template quantize<Bits, kFloat32>(v, f.block, f.run(out, blocks, b, c));
    }
}

template <class Isa, int Bits>
void reduce_requantize_jobs(const uint8_t* buf, const Layout& f, int groups, int64_t chunks, int64_t chunk_numel,
                            uint8_t* out, int64_t first_job, int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    for_each_run(first_job, end_job, blocks, [&](int64_t m, int64_t b, int64_t count) {
        Isa::template reduce_requantize<Bits>(f.run(buf + m * pack_bytes, blocks, b, count), chunks * pack_bytes,
                                              groups, f.block, f.run(out + m * pack_bytes, blocks, b, count));
    });
}

// Pack m of `out` (layout o) = the fused sum of packs g * chunks + m (layout f), g < groups, requantized, for the
// packs and elements of jobs [first_job, end_job): job = m * units + u covers elements [u * L, (u + 1) * L) of pack
// m, L the larger block size (whole blocks of both layouts); elements past the input blocks sum to 0. With `noise`
// rounded stochastically, element e of pack m with the noise of index m * chunk_numel + e. The sums and the
// quantization run Isa's kernels.
template <class Isa, int Bits, int OutBits>
void reduce_requantize_general_jobs(const uint8_t* buf, const Layout& f, const Layout& o, int groups, int64_t chunks,
                                    int64_t chunk_numel, uint8_t* out, const Noise* noise, int64_t first_job,
                                    int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    const int64_t out_blocks = o.blocks(chunk_numel), out_pack_bytes = o.pack_bytes(chunk_numel);
    const int64_t unit = std::max(f.block, o.block), units = (out_blocks * o.block + unit - 1) / unit;
    float acc[kMaxBlock];
    for (int64_t job = first_job; job < end_job; ++job) {
        const int64_t m = job / units, start = job % units * unit;
        const int64_t end_block = std::min((start + unit) / f.block, blocks);
        for (int64_t b = start / f.block; b < end_block; ++b) {
            Isa::template sum_elements<Bits>(f.run(buf + m * pack_bytes, blocks, b, 1), chunks * pack_bytes, groups,
                                             f.block, acc + (b * f.block - start));
        }
        std::fill(acc + (end_block * f.block - start), acc + unit, 0.0f);
        const int64_t first_out = start / o.block, out_end = std::min((start + unit) / o.block, out_blocks);
        if (out_end > first_out) {
            Isa::template quantize<OutBits, kFloat32>(acc + (first_out * o.block - start), o.block,
                                                      o.run(out + m * out_pack_bytes, out_blocks, first_out,
                                                            out_end - first_out),
                                                      noise, m * chunk_numel + first_out * o.block);
        }
    }
}

template <class Isa, int Bits, int D>
void reduce_dequantize_jobs(const uint8_t* buf, const Layout& f, int groups, int64_t chunk_numel, Storage<D>* out,
                            int64_t out_numel, float divisor, int64_t first_job, int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    const int64_t first = first_job * f.block;
    const int64_t n = present(out_numel - first, end_job - first_job, f.block), full = n / f.block;
    if (full) {
        Isa::template reduce_dequantize<Bits, D>(f.run(buf, blocks, first_job, full), pack_bytes, groups, f.block,
                                                 divisor, out + first);
    }
    if (n > full * f.block) {  // the output's short last block
        Storage<D> values[kMaxBlock];
        Isa::template reduce_dequantize<Bits, D>(f.run(buf, blocks, first_job + full, 1), pack_bytes, groups,
                                                 f.block, divisor, values);
        std::copy(values, values + (n - full * f.block), out + first + full * f.block);
    }
}

#include "hadamard.h"

// Blocks [0, count) of Size floats of v in place through the butterfly (hadamard.h), by AVX2 where this CPU has it.
template <int Size, bool Inverse>
void rotate(float* v, int64_t count) {
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) return avx2_butterflies<Size, Inverse>(v, count);
#endif
    butterflies<Size, Inverse>(v, count);
}

// body(std::integral_constant<int, size>) for the runtime rotation size (16, 32, 64 or 128).
template <class Body>
void with_size(int size, Body body) {
    switch (size) {
        case 16: return body(std::integral_constant<int, 16>());
        case 32: return body(std::integral_constant<int, 32>());
        case 64: return body(std::integral_constant<int, 64>());
        default: return body(std::integral_constant<int, 128>());
    }
}

// Elements a fused rotated op holds in float32 at a time (whole blocks, at least one).
constexpr int kRotatedBatch = 2048;

// quantize_jobs with the rotation fused (rotation.py's swizzle_quantize_rotated): each run's blocks are widened to
// float32 with the slice's zero padding, their Size-element sub-blocks rotated, then quantized as float32. A rotation
// block never crosses a slice's end (Size divides the block), so this is the rotation of each slice zero-padded to a
// multiple of Size, quantized. With `noise`, rounded stochastically, element e of slice s with the noise of index
// s * width + e, width = the slice rounded up to whole rotation blocks: its index in the rotated slices that the
// unfused composition quantizes.
template <class Isa, int Bits, int D, int Size>
void quantize_rotated_jobs(const Storage<D>* x, int64_t numel, const Layout& f, int64_t chunks, int64_t nodes,
                           uint8_t* out, const Noise* noise, int64_t first_job, int64_t end_job) {
    const int64_t slice = (numel + chunks - 1) / chunks, blocks = f.blocks(slice), per_node = chunks / nodes;
    const int64_t width = (slice + Size - 1) / Size * Size;
    const int64_t batch = std::max<int64_t>(1, kRotatedBatch / f.block);
    float v[std::max(kMaxBlock, kRotatedBatch)];
    for_each_run(first_job, end_job, blocks, [&](int64_t p, int64_t b, int64_t count) {
        const int64_t source = (p % nodes) * per_node + p / nodes;  // format.swizzle_source
        const int64_t start = source * slice + b * f.block;
        const int64_t n = present(std::min((source + 1) * slice, numel) - start, count, f.block);
        uint8_t* pack = out + p * f.pack_bytes(slice);
        for (int64_t k = 0; k < count; k += batch) {
            const int64_t c = std::min(batch, count - k), elements = c * f.block;
            const int64_t m = std::clamp<int64_t>(n - k * f.block, 0, elements);
            for (int64_t i = 0; i < m; ++i) v[i] = to_float<D>(x[start + k * f.block + i]);
            std::fill(v + m, v + elements, 0.0f);
            rotate<Size, false>(v, elements / Size);
            const Run<uint8_t> run = f.run(pack, blocks, b + k, c);
            Isa::template quantize<Bits, kFloat32>(v, f.block, run, noise, source * width + (b + k) * f.block);
        }
    });
}

// reduce_dequantize_jobs with the inverse rotation fused (rotation.py's reduce_dequantize_rotated): the fused sum
// of each block (the kernels' reduce-dequantize with divisor 1, which leaves it unchanged), the inverse butterfly
// (times 1 / Size), the division by `divisor` (skipped for 1, where it is the identity) and the conversion to D.
template <class Isa, int Bits, int D, int Size>
void reduce_dequantize_rotated_jobs(const uint8_t* buf, const Layout& f, int groups, int64_t chunk_numel,
                                    Storage<D>* out, int64_t out_numel, float divisor, int64_t first_job,
                                    int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    const int64_t batch = std::max<int64_t>(1, kRotatedBatch / f.block);
    float v[std::max(kMaxBlock, kRotatedBatch)];
    for (int64_t b = first_job; b < end_job; b += batch) {
        const int64_t c = std::min(batch, end_job - b), first = b * f.block;
        Isa::template reduce_dequantize<Bits, kFloat32>(f.run(buf, blocks, b, c), pack_bytes, groups, f.block, 1.0f,
                                                        v);
        rotate<Size, true>(v, c * f.block / Size);
        const int64_t n = std::min(out_numel - first, c * f.block);
        if (divisor != 1.0f) {
            for (int64_t i = 0; i < n; ++i) v[i] /= divisor;
        }
        for (int64_t i = 0; i < n; ++i) out[first + i] = from_float<D>(v[i]);
    }
}

#include "parallel.h"

// Each op with the kernels of one instruction set, for compile-time bits and dtype (run<Bits, D>).
template <class Isa>
struct Quantize {
    template <int Bits, int D>
    static void run(const void* x, int64_t numel, const Layout& f, int64_t chunks, int64_t nodes, uint8_t* out,
                    const Noise* noise, int threads) {
        const int64_t jobs = chunks * f.blocks((numel + chunks - 1) / chunks);
        parallel(jobs, threads, [&](int64_t a, int64_t e) {
            quantize_jobs<Isa, Bits, D>(static_cast<const Storage<D>*>(x), numel, f, chunks, nodes, out, noise, a, e);
        });
    }
};

template <class Isa>
struct Dequantize {
    template <int Bits, int D>
    static void run(const uint8_t* buf, const Layout& f, int64_t chunks, int64_t chunk_numel, void* out,
                    int64_t out_numel, int threads) {
        parallel(chunks * f.blocks(chunk_numel), threads, [&](int64_t a, int64_t e) {
            dequantize_jobs<Isa, Bits, D>(buf, f, chunk_numel, static_cast<Storage<D>*>(out), out_numel, a, e);
        });
    }
};

template <class Isa>
struct DequantizeAdd {
    template <int Bits, int D>
    static void run(const uint8_t* buf, const Layout& f, int64_t chunks, int64_t chunk_numel, void* out,
                    int64_t out_numel, int threads) {
        parallel(chunks * f.blocks(chunk_numel), threads, [&](int64_t a, int64_t e) {
            dequantize_add_jobs<Isa, Bits, D>(buf, f, chunk_numel, static_cast<Storage<D>*>(out), out_numel, a, e);
        });
    }
};

template <class Isa>
struct QuantizeDelta {
    template <int Bits, int D>
    static void run(const void* t, const void* r, int64_t numel, const Layout& f, uint8_t* out, int threads) {
        parallel(f.blocks(numel), threads, [&](int64_t a, int64_t e) {
            quantize_delta_jobs<Isa, Bits, D>(static_cast<const Storage<D>*>(t), static_cast<const Storage<D>*>(r),
                                              numel, f, out, a, e);
        });
    }
};

template <class Isa>
struct ReduceRequantize {  // D unused: the packs have no float dtype
    template <int Bits, int D>
    static void run(const uint8_t* buf, const Layout& f, int groups, int64_t chunks, int64_t chunk_numel,
                    uint8_t* out, int threads) {
        parallel(chunks * f.blocks(chunk_numel), threads, [&](int64_t a, int64_t e) {
            reduce_requantize_jobs<Isa, Bits>(buf, f, groups, chunks, chunk_numel, out, a, e);
        });
    }
};

template <class Isa>
struct ReduceDequantize {
    template <int Bits, int D>
    static void run(const uint8_t* buf, const Layout& f, int groups, int64_t chunk_numel, void* out,
                    int64_t out_numel, float divisor, int threads) {
        parallel(f.blocks(out_numel), threads, [&](int64_t a, int64_t e) {
            reduce_dequantize_jobs<Isa, Bits, D>(buf, f, groups, chunk_numel, static_cast<Storage<D>*>(out),
                                                 out_numel, divisor, a, e);
        });
    }
};

// The rotated ops for the runtime rotation size (16, 32, 64 or 128).
template <class Isa>
struct QuantizeRotated {
    template <int Bits, int D>
    static void run(const void* x, int64_t numel, const Layout& f, int64_t chunks, int64_t nodes, int size,
                    uint8_t* out, const Noise* noise, int threads) {
        const int64_t jobs = chunks * f.blocks((numel + chunks - 1) / chunks);
        auto body = [&](auto s) {
            parallel(jobs, threads, [&](int64_t a, int64_t e) {
                quantize_rotated_jobs<Isa, Bits, D, decltype(s)::value>(static_cast<const Storage<D>*>(x), numel, f,
                                                                        chunks, nodes, out, noise, a, e);
            });
        };
        with_size(size, body);
    }
};

template <class Isa>
struct ReduceDequantizeRotated {
    template <int Bits, int D>
    static void run(const uint8_t* buf, const Layout& f, int groups, int64_t chunk_numel, int size, void* out,
                    int64_t out_numel, float divisor, int threads) {
        auto body = [&](auto s) {
            parallel(f.blocks(out_numel), threads, [&](int64_t a, int64_t e) {
                reduce_dequantize_rotated_jobs<Isa, Bits, D, decltype(s)::value>(
                    buf, f, groups, chunk_numel, static_cast<Storage<D>*>(out), out_numel, divisor, a, e);
            });
        };
        with_size(size, body);
    }
};

// Op<Isa>::run<Bits, D>(args...) for the runtime bits and dtype.
template <template <class> class Op, class Isa, int Bits, typename... Args>
void run_dtype(int dtype, Args... args) {
    if (dtype == kFloat32) {
        Op<Isa>::template run<Bits, kFloat32>(args...);
    } else if (dtype == kBFloat16) {
        Op<Isa>::template run<Bits, kBFloat16>(args...);
    } else {
        Op<Isa>::template run<Bits, kFloat16>(args...);
    }
}

template <template <class> class Op, class Isa, typename... Args>
void run_format(int bits, int dtype, Args... args) {
    if (bits == 8) {
        run_dtype<Op, Isa, 8>(dtype, args...);
    } else if (bits == 4) {
        run_dtype<Op, Isa, 4>(dtype, args...);
    } else {
        run_dtype<Op, Isa, 2>(dtype, args...);
    }
}

#if ZEROPP_AVX512_KERNELS
// Whether this CPU runs the AVX-512 kernels (AVX-512 F, BW, VL and VBMI2, besides the AVX2 kernels' needs).
bool avx512_usable() {
    static const bool usable = avx2_usable() && __builtin_cpu_supports("avx512f") &&
                               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                               __builtin_cpu_supports("avx512vbmi2");
    return usable;
}
#endif

// The same with the best kernels for this CPU.
template <template <class> class Op, typename... Args>
void dispatch(int bits, int dtype, Args... args) {
#if ZEROPP_AVX512_KERNELS
    if (avx512_usable()) return run_format<Op, avx512::Kernels>(bits, dtype, args...);
#endif
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) return run_format<Op, avx2::Kernels>(bits, dtype, args...);
#endif
    run_format<Op, portable::Kernels>(bits, dtype, args...);
}

// reduce_requantize_general_jobs over all jobs, for the runtime output bits.
template <int Bits>
void reduce_requantize_general(int out_bits, const uint8_t* buf, const Layout& f, const Layout& o, int groups,
                               int64_t chunks, int64_t chunk_numel, uint8_t* out, const Noise* noise, int threads) {
    const int64_t unit = std::max(f.block, o.block);
    const int64_t jobs = chunks * ((o.blocks(chunk_numel) * o.block + unit - 1) / unit);
    auto body = [&](auto isa) {
        using Isa = decltype(isa);
        parallel(jobs, threads, [&](int64_t a, int64_t e) {
            if (out_bits == 8) {
                reduce_requantize_general_jobs<Isa, Bits, 8>(buf, f, o, groups, chunks, chunk_numel, out, noise, a, e);
            } else if (out_bits == 4) {
                reduce_requantize_general_jobs<Isa, Bits, 4>(buf, f, o, groups, chunks, chunk_numel, out, noise, a, e);
            } else {
                reduce_requantize_general_jobs<Isa, Bits, 2>(buf, f, o, groups, chunks, chunk_numel, out, noise, a, e);
            }
        });
    };
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) return body(avx2::Kernels());
#endif
    body(portable::Kernels());
}

int check(int bits, int block, int dtype) {
    if (bits != 8 && bits != 4 && bits != 2) return 1;
    if (block < 16 || block > kMaxBlock || (block & (block - 1))) return 2;
    if (dtype < kFloat32 || dtype > kFloat16) return 3;
    return 0;
}

// 0 for a rotation size of 16, 32, 64 or 128 that divides the block, else 5.
int check_rotation(int size, int block) {
    if (size != 16 && size != 32 && size != 64 && size != kMaxRotation) return 5;
    return block % size ? 5 : 0;
}

}  // namespace

extern "C" {

// Bumped whenever a signature below changes; zeropp/quant/native.py refuses a library of another version.
int zeropp_cpu_abi_version(void) { return 4; }

// Returns 0, or non-zero for bad arguments (the Python side validates first; this is a second line).

// Pack flat x (numel elements, dtype 0/1/2 = float32/bfloat16/float16) as `chunks` slices into `out`, in the qgZ
// order when nodes > 1 (position p holds slice (p % nodes) * (chunks / nodes) + p / nodes); rounded
// stochastically from `seed` when `seeded` is non-zero.
int zeropp_quantize_chunks(const void* x, int dtype, int64_t numel, int bits, int block, int64_t chunks,
                           int64_t nodes, uint8_t* out, int seeded, uint32_t seed, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    if (chunks < 1 || nodes < 1 || chunks % nodes) return 4;
    if (numel == 0) return 0;
    const Noise noise{seed};
    dispatch<Quantize>(bits, dtype, x, numel, Layout{bits, block}, chunks, nodes, out, seeded ? &noise : nullptr,
                       threads);
    return 0;
}

// One pack (round to nearest) of the float32 difference t - r of two flat arrays of numel elements of one dtype.
int zeropp_quantize_delta(const void* t, const void* r, int dtype, int64_t numel, int bits, int block, uint8_t* out,
                          int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    if (numel == 0) return 0;
    dispatch<QuantizeDelta>(bits, dtype, t, r, numel, Layout{bits, block}, out, threads);
    return 0;
}

// Dequantize `chunks` packs of chunk_numel elements into the first out_numel elements of flat `out`.
int zeropp_dequantize_chunks(const uint8_t* buf, int bits, int block, int64_t chunks, int64_t chunk_numel,
                             void* out, int dtype, int64_t out_numel, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    dispatch<Dequantize>(bits, dtype, buf, Layout{bits, block}, chunks, chunk_numel, out, out_numel, threads);
    return 0;
}

// zeropp_dequantize_chunks adding into `out` in place: out[i] = dtype(float32 value + float32(out[i])).
int zeropp_dequantize_add_chunks(const uint8_t* buf, int bits, int block, int64_t chunks, int64_t chunk_numel,
                                 void* out, int dtype, int64_t out_numel, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    dispatch<DequantizeAdd>(bits, dtype, buf, Layout{bits, block}, chunks, chunk_numel, out, out_numel, threads);
    return 0;
}

// Pack m of `out` (chunks packs of out_bits, out_block) = the fused sum of packs g * chunks + m of `buf` (bits,
// block), g < groups, requantized; rounded stochastically from `seed` when `seeded` is non-zero.
int zeropp_reduce_requantize(const uint8_t* buf, int bits, int block, int groups, int64_t chunks,
                             int64_t chunk_numel, uint8_t* out, int out_bits, int out_block, int seeded,
                             uint32_t seed, int threads) {
    if (int bad = check(bits, block, kFloat32)) return bad;
    if (int bad = check(out_bits, out_block, kFloat32)) return bad;
    if (groups < 1 || chunks < 1) return 4;
    if (chunk_numel == 0) return 0;
    const Layout f{bits, block}, o{out_bits, out_block};
    if (seeded || out_bits != bits || out_block != block) {
        const Noise noise{seed}, *n = seeded ? &noise : nullptr;
        if (bits == 8) {
            reduce_requantize_general<8>(out_bits, buf, f, o, groups, chunks, chunk_numel, out, n, threads);
        } else if (bits == 4) {
            reduce_requantize_general<4>(out_bits, buf, f, o, groups, chunks, chunk_numel, out, n, threads);
        } else {
            reduce_requantize_general<2>(out_bits, buf, f, o, groups, chunks, chunk_numel, out, n, threads);
        }
        return 0;
    }
    dispatch<ReduceRequantize>(bits, kFloat32, buf, f, groups, chunks, chunk_numel, out, threads);
    return 0;
}

// The fused sum of `groups` packs of chunk_numel elements, divided by `divisor` (float division), into the first
// out_numel elements of flat `out`.
int zeropp_reduce_dequantize(const uint8_t* buf, int bits, int block, int groups, int64_t chunk_numel, void* out,
                             int dtype, int64_t out_numel, float divisor, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    if (groups < 1) return 4;
    dispatch<ReduceDequantize>(bits, dtype, buf, Layout{bits, block}, groups, chunk_numel, out, out_numel, divisor,
                               threads);
    return 0;
}

// zeropp_quantize_chunks of the rotation of each slice (rotation.py's swizzle_quantize_rotated): each slice's blocks
// are zero-padded and their `size`-element sub-blocks rotated before they are quantized; rounded stochastically from
// `seed` when `seeded` is non-zero, element e of slice s with the noise of index s * width + e (width: the slice
// rounded up to a multiple of size). size is 16, 32, 64 or 128 and divides block.
int zeropp_quantize_chunks_rotated(const void* x, int dtype, int64_t numel, int bits, int block, int64_t chunks,
                                   int64_t nodes, int size, uint8_t* out, int seeded, uint32_t seed, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    if (chunks < 1 || nodes < 1 || chunks % nodes) return 4;
    if (int bad = check_rotation(size, block)) return bad;
    if (numel == 0) return 0;
    const Noise noise{seed};
    dispatch<QuantizeRotated>(bits, dtype, x, numel, Layout{bits, block}, chunks, nodes, size, out,
                              seeded ? &noise : nullptr, threads);
    return 0;
}

// zeropp_reduce_dequantize of packs of rotated values with the inverse rotation fused (rotation.py's
// reduce_dequantize_rotated): the fused sum, unrotated, divided by `divisor`, into the first out_numel elements.
int zeropp_reduce_dequantize_rotated(const uint8_t* buf, int bits, int block, int groups, int64_t chunk_numel,
                                     int size, void* out, int dtype, int64_t out_numel, float divisor, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    if (groups < 1) return 4;
    if (int bad = check_rotation(size, block)) return bad;
    dispatch<ReduceDequantizeRotated>(bits, dtype, buf, Layout{bits, block}, groups, chunk_numel, size, out,
                                      out_numel, divisor, threads);
    return 0;
}

// 1 - u of the stochastic rounding's noise (format.py) of indices first .. first + n - 1 into out[0..n), as this
// CPU's quantize kernels compute it (so that the tests reach runs across a multiple of 2^32).
int zeropp_noise_thresholds(uint32_t seed, int64_t first, int64_t n, float* out) {
    if (first < 0 || n < 0) return 4;
    const Noise noise{seed};
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) return avx2::noise_thresholds8(noise, first, n, out), 0;
#endif
    noise_thresholds(noise, first, n, out);
    return 0;
}

}  // extern "C"
