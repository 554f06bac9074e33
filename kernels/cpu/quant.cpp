// The native CPU implementation of zeropp's block quantization ops: bit for bit the spec of
// zeropp/quant/format.py, as the torch reference (zeropp/quant/reference.py) computes it. A plain C ABI (pointers,
// sizes, dtype codes), loaded by zeropp/quant/native.py through ctypes.
//
// Exactness. Built without -ffast-math and with -ffp-contract=off, so every rounding is the one written
// (-fno-trapping-math only lets the compiler compute both sides of a select, which is what vectorizes them):
//  * scale = absmax / qmax in float division; absmax on the magnitude bits as integers (a NaN's bits exceed
//    Inf's, so the maximum propagates NaN, as the spec wants);
//  * code = rne(x * r) of the exact product, r = 1 / scale rounded to 24 bits: for a normal scale r is a normal
//    float and fmaf(x, r, 1.5 * 2^23) rounds the exact product once, to an integer; for a subnormal scale (r can
//    overflow a float) the product is taken in double, where it is exact, and rounded by adding 1.5 * 2^52;
//  * the fused sums are acc = fmaf(code, scale, acc), the spec's own operation.
// The hot functions are compiled twice (GCC target clones): for x86-64-v3 (AVX2 and FMA, vectorized) and for
// the baseline, where fmaf is the C library's exact software FMA; ZEROPP_BASELINE_ONLY builds the baseline alone
// (a second library, so that the tests run both).
#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(ZEROPP_BASELINE_ONLY)
#define ZEROPP_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ZEROPP_CLONES
#endif
#define ZEROPP_INLINE inline __attribute__((always_inline))

namespace {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr float kRounder = 12582912.0f;            // 1.5 * 2^23: x + kRounder rounds |x| < 2^22 to an integer
constexpr double kRounder64 = 6755399441055744.0;  // 1.5 * 2^52, the same for doubles
constexpr int kMaxBlock = 8192;

struct Layout {
    int bits, block;
    int64_t block_code_bytes() const { return int64_t(block) * bits / 8; }
    int64_t blocks(int64_t numel) const { return (numel + block - 1) / block; }
    int64_t pack_bytes(int64_t numel) const { return blocks(numel) * (block_code_bytes() + 4); }
    const uint8_t* codes(const uint8_t* pack, int64_t b) const { return pack + b * block_code_bytes(); }
    uint8_t* codes(uint8_t* pack, int64_t b) const { return pack + b * block_code_bytes(); }
    float scale(const uint8_t* pack, int64_t blocks, int64_t b) const {
        float s;
        std::memcpy(&s, pack + blocks * block_code_bytes() + 4 * b, 4);
        return s;
    }
    void set_scale(uint8_t* pack, int64_t blocks, int64_t b, float s) const {
        std::memcpy(pack + blocks * block_code_bytes() + 4 * b, &s, 4);
    }
};

ZEROPP_INLINE uint32_t bits_of(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return u;
}

ZEROPP_INLINE float float_of(uint32_t u) {
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

// float16 <-> float32 on the bits, in integer and exact float operations that vectorize (a scalar _Float16
// conversion per element does not). Both agree with IEEE conversion (round to nearest even), NaN stays NaN.
ZEROPP_INLINE float half_to_float(uint16_t h) {
    const uint32_t magnitude = uint32_t(h & 0x7FFF) << 13;
    float v = float_of(magnitude) * 0x1p112f;  // rebias the exponent: exact, subnormal halves included
    uint32_t u = magnitude >= (0x7C00u << 13) ? magnitude | 0x7F800000u : bits_of(v);  // Inf and NaN
    return float_of(u | (uint32_t(h & 0x8000) << 16));
}

ZEROPP_INLINE uint16_t float_to_half(float v) {
    uint32_t u = bits_of(v);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    const uint32_t special = u > 0x7F800000u ? 0x7E00u : 0x7C00u;  // NaN, or Inf (also for 2^16 and more)
    const uint32_t subnormal = bits_of(float_of(u) + 0.5f) - 0x3F000000u;  // adding 0.5 rounds at the half step
    const uint32_t normal = (u + 0xC8000FFFu + ((u >> 13) & 1)) >> 13;  // rebias, round 13 bits to nearest even
    const uint32_t o = u >= 0x47800000u ? special : (u < (113u << 23) ? subnormal : normal);
    return uint16_t(o | (sign >> 16));
}

// n elements of x (dtype D) from index `first` into float `out`
template <int D>
ZEROPP_INLINE void load(const void* x, int64_t first, int n, float* out) {
    if (D == kFloat32) {
        std::memcpy(out, static_cast<const float*>(x) + first, sizeof(float) * n);
    } else if (D == kBFloat16) {
        const uint16_t* p = static_cast<const uint16_t*>(x) + first;
        for (int i = 0; i < n; ++i) out[i] = float_of(uint32_t(p[i]) << 16);
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(x) + first;
        for (int i = 0; i < n; ++i) out[i] = half_to_float(p[i]);
    }
}

// float v[0..n) converted (round to nearest even) into out (dtype D) from index `first`
template <int D>
ZEROPP_INLINE void store(const float* v, int n, void* out, int64_t first) {
    if (D == kFloat32) {
        std::memcpy(static_cast<float*>(out) + first, v, sizeof(float) * n);
    } else if (D == kBFloat16) {
        uint16_t* p = static_cast<uint16_t*>(out) + first;
        for (int i = 0; i < n; ++i) {
            uint32_t u = bits_of(v[i]);
            uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
            p[i] = uint16_t(v[i] != v[i] ? (u >> 16) | 0x40 : rounded);  // NaN stays NaN (quiet)
        }
    } else {
        uint16_t* p = static_cast<uint16_t*>(out) + first;
        for (int i = 0; i < n; ++i) p[i] = float_to_half(v[i]);
    }
}

// code * scale, clamped to the finite float range (NaN stays NaN)
ZEROPP_INLINE float scaled(float code, float s) {
    const float y = code * s;
    return y > FLT_MAX ? FLT_MAX : (y < -FLT_MAX ? -FLT_MAX : y);
}

// The values of block b of a pack (codes times its scale) into out[0..block).
template <int Bits>
ZEROPP_INLINE void dequantize_values(const Layout& f, const uint8_t* pack, int64_t blocks, int64_t b, float* out) {
    const uint8_t* c = f.codes(pack, b);
    const float s = f.scale(pack, blocks, b);
    if (Bits == 8) {
        for (int i = 0; i < f.block; ++i) out[i] = scaled(float(int8_t(c[i])), s);
    } else {  // both nibbles of each byte, sign-extended by arithmetic shifts, into alternate elements
        for (int i = 0; i < f.block / 2; ++i) {
            const int8_t byte = int8_t(c[i]);
            out[2 * i] = scaled(float(int8_t(byte << 4) >> 4), s);
            out[2 * i + 1] = scaled(float(byte >> 4), s);
        }
    }
}

// Quantize the float values v[0..block) into block b of `pack` (of `blocks` blocks): codes and scale.
template <int Bits>
ZEROPP_INLINE void quantize_values(const float* v, const Layout& f, uint8_t* pack, int64_t blocks, int64_t b) {
    constexpr int qmax = (1 << (Bits - 1)) - 1;
    const int block = f.block;
    uint32_t amax_bits = 0;
    for (int i = 0; i < block; ++i) amax_bits = std::max(amax_bits, bits_of(v[i]) & 0x7FFFFFFFu);
    const float scale = float_of(amax_bits) / float(qmax);  // NaN for a NaN block, Inf for an Inf one
    f.set_scale(pack, blocks, b, scale);
    uint8_t* codes = f.codes(pack, b);
    if (!(scale > 0.0f && scale <= FLT_MAX)) {  // all zero, NaN or Inf: codes 0
        std::memset(codes, 0, f.block_code_bytes());
        return;
    }
    int32_t q[kMaxBlock];
    if (scale >= FLT_MIN) {
        const float r = float(1.0 / double(scale));  // correctly rounded (53 >= 2 * 24 + 2) and normal
        for (int i = 0; i < block; ++i) {
            float c = std::fma(v[i], r, kRounder) - kRounder;
            q[i] = int32_t(std::min(std::max(c, float(-qmax)), float(qmax)));
        }
    } else {  // a subnormal scale: 1 / scale to 24 bits may not fit a float
        int e;
        const double m = std::frexp(1.0 / double(scale), &e);
        const double r = std::ldexp((std::ldexp(m, 24) + kRounder64) - kRounder64, e - 24);
        for (int i = 0; i < block; ++i) {
            double c = (double(v[i]) * r + kRounder64) - kRounder64;
            q[i] = int32_t(std::min(std::max(c, double(-qmax)), double(qmax)));
        }
    }
    if (Bits == 8) {
        for (int i = 0; i < block; ++i) codes[i] = uint8_t(q[i]);
    } else {  // two codes per byte, element 2k in the low nibble: narrow to bytes, then combine byte pairs
        uint8_t narrow[kMaxBlock];
        for (int i = 0; i < block; ++i) narrow[i] = uint8_t(q[i]);
        for (int i = 0; i < block / 2; ++i) {
            uint16_t pair;
            std::memcpy(&pair, narrow + 2 * i, 2);  // little-endian: the even code in the low byte
            codes[i] = uint8_t((pair & 0xF) | ((pair >> 4) & 0xF0));
        }
    }
}

// acc[0..block) = fma(code, scale, acc) over `groups` packs, pack g at base + g * stride: acc starts at 0.
template <int Bits>
ZEROPP_INLINE void sum_blocks(const Layout& f, const uint8_t* base, int64_t stride, int groups, int64_t blocks,
                              int64_t b, float* acc) {
    std::fill(acc, acc + f.block, 0.0f);
    for (int g = 0; g < groups; ++g) {
        const uint8_t* pack = base + g * stride;
        const uint8_t* c = f.codes(pack, b);
        const float s = f.scale(pack, blocks, b);
        if (Bits == 8) {
            for (int i = 0; i < f.block; ++i) acc[i] = std::fma(float(int8_t(c[i])), s, acc[i]);
        } else {
            for (int i = 0; i < f.block / 2; ++i) {
                const int8_t byte = int8_t(c[i]);
                acc[2 * i] = std::fma(float(int8_t(byte << 4) >> 4), s, acc[2 * i]);
                acc[2 * i + 1] = std::fma(float(byte >> 4), s, acc[2 * i + 1]);
            }
        }
    }
}

// (pack, block) of consecutive jobs, job = pack * blocks + block, without a division per job.
struct Cursor {
    int64_t pack, block;
    Cursor(int64_t job, int64_t blocks) : pack(job / blocks), block(job % blocks) {}
    void next(int64_t blocks) {
        if (++block == blocks) {
            block = 0;
            ++pack;
        }
    }
};

template <int Bits, int D>
ZEROPP_CLONES void quantize_job(const void* x, int64_t numel, const Layout& f, int64_t chunks, int64_t nodes,
                                uint8_t* out, int64_t first_job, int64_t end_job) {
    const int64_t slice = (numel + chunks - 1) / chunks, blocks = f.blocks(slice), per_node = chunks / nodes;
    float v[kMaxBlock];
    Cursor at(first_job, blocks);
    for (int64_t job = first_job; job < end_job; ++job, at.next(blocks)) {
        const int64_t p = at.pack, b = at.block;
        const int64_t source = (p % nodes) * per_node + p / nodes;  // format.swizzle_source
        const int64_t start = source * slice + b * f.block;
        const int64_t end = std::min(std::min(start + f.block, (source + 1) * slice), numel);
        const int n = int(std::max<int64_t>(end - start, 0));
        load<D>(x, start, n, v);
        std::fill(v + n, v + f.block, 0.0f);
        quantize_values<Bits>(v, f, out + p * f.pack_bytes(slice), blocks, b);
    }
}

template <int Bits, int D>
ZEROPP_CLONES void dequantize_job(const uint8_t* buf, const Layout& f, int64_t chunk_numel, void* out,
                                  int64_t out_numel, int64_t first_job, int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    float v[kMaxBlock];
    Cursor at(first_job, blocks);
    for (int64_t job = first_job; job < end_job; ++job, at.next(blocks)) {
        const int64_t k = at.pack, b = at.block;
        const int64_t first = k * chunk_numel + b * f.block;
        const int n = int(std::min(std::min<int64_t>(f.block, chunk_numel - b * f.block), out_numel - first));
        if (n <= 0) continue;
        dequantize_values<Bits>(f, buf + k * pack_bytes, blocks, b, v);
        store<D>(v, n, out, first);
    }
}

template <int Bits>
ZEROPP_CLONES void reduce_requantize_job(const uint8_t* buf, const Layout& f, int groups, int64_t chunks,
                                         int64_t chunk_numel, uint8_t* out, int64_t first_job, int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    float acc[kMaxBlock];
    Cursor at(first_job, blocks);
    for (int64_t job = first_job; job < end_job; ++job, at.next(blocks)) {
        const int64_t m = at.pack, b = at.block;
        sum_blocks<Bits>(f, buf + m * pack_bytes, chunks * pack_bytes, groups, blocks, b, acc);
        quantize_values<Bits>(acc, f, out + m * pack_bytes, blocks, b);
    }
}

template <int Bits, int D>
ZEROPP_CLONES void reduce_dequantize_job(const uint8_t* buf, const Layout& f, int groups, int64_t chunk_numel,
                                         void* out, int64_t out_numel, float divisor, int64_t first_job,
                                         int64_t end_job) {
    const int64_t blocks = f.blocks(chunk_numel), pack_bytes = f.pack_bytes(chunk_numel);
    float acc[kMaxBlock];
    for (int64_t job = first_job; job < end_job; ++job) {
        const int64_t first = job * f.block;
        const int n = int(std::min<int64_t>(f.block, out_numel - first));
        if (n <= 0) continue;
        sum_blocks<Bits>(f, buf, pack_bytes, groups, blocks, job, acc);
        for (int i = 0; i < f.block; ++i) acc[i] = acc[i] / divisor;
        store<D>(acc, n, out, first);
    }
}

// Runs body(first_job, end_job) over [0, jobs) on `threads` OpenMP threads, in contiguous ranges.
template <typename Body>
void parallel(int64_t jobs, int threads, Body body) {
    if (jobs <= 0) return;
    if (threads <= 1 || jobs < 2) {
        body(int64_t(0), jobs);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
#else
        const int64_t t = 0, n = 1;
#endif
        body(jobs * t / n, jobs * (t + 1) / n);
    }
}

int check(int bits, int block, int dtype) {
    if (bits != 8 && bits != 4) return 1;
    if (block < 16 || block > kMaxBlock || (block & (block - 1))) return 2;
    if (dtype < kFloat32 || dtype > kFloat16) return 3;
    return 0;
}

// Each op's instantiation for (bits, dtype): [0] int8, [1] int4; then the dtype code.
template <template <int, int> class Op>
constexpr auto table() {
    return std::array<std::array<decltype(&Op<8, kFloat32>::run), 3>, 2>{{
        {&Op<8, kFloat32>::run, &Op<8, kBFloat16>::run, &Op<8, kFloat16>::run},
        {&Op<4, kFloat32>::run, &Op<4, kBFloat16>::run, &Op<4, kFloat16>::run},
    }};
}

template <int Bits, int D>
struct Quantize {
    static void run(const void* x, int64_t numel, const Layout& f, int64_t chunks, int64_t nodes, uint8_t* out,
                    int threads, int64_t jobs) {
        parallel(jobs, threads,
                 [&](int64_t a, int64_t e) { quantize_job<Bits, D>(x, numel, f, chunks, nodes, out, a, e); });
    }
};

template <int Bits, int D>
struct Dequantize {
    static void run(const uint8_t* buf, const Layout& f, int64_t chunk_numel, void* out, int64_t out_numel,
                    int threads, int64_t jobs) {
        parallel(jobs, threads,
                 [&](int64_t a, int64_t e) { dequantize_job<Bits, D>(buf, f, chunk_numel, out, out_numel, a, e); });
    }
};

template <int Bits, int D>
struct ReduceRequantize {  // D unused: the packs have no float dtype
    static void run(const uint8_t* buf, const Layout& f, int groups, int64_t chunks, int64_t chunk_numel,
                    uint8_t* out, int threads, int64_t jobs) {
        parallel(jobs, threads, [&](int64_t a, int64_t e) {
            reduce_requantize_job<Bits>(buf, f, groups, chunks, chunk_numel, out, a, e);
        });
    }
};

template <int Bits, int D>
struct ReduceDequantize {
    static void run(const uint8_t* buf, const Layout& f, int groups, int64_t chunk_numel, void* out,
                    int64_t out_numel, float divisor, int threads, int64_t jobs) {
        parallel(jobs, threads, [&](int64_t a, int64_t e) {
            reduce_dequantize_job<Bits, D>(buf, f, groups, chunk_numel, out, out_numel, divisor, a, e);
        });
    }
};

}  // namespace

extern "C" {

// Bumped whenever a signature below changes; zeropp/quant/native.py refuses a library of another version.
int zeropp_cpu_abi_version(void) { return 1; }

// Returns 0, or non-zero for bad arguments (the Python side validates first; this is a second line).

// Pack flat x (numel elements, dtype 0/1/2 = float32/bfloat16/float16) as `chunks` slices into `out`, in the qgZ
// order when nodes > 1 (position p holds slice (p % nodes) * (chunks / nodes) + p / nodes).
int zeropp_quantize_chunks(const void* x, int dtype, int64_t numel, int bits, int block, int64_t chunks,
                           int64_t nodes, uint8_t* out, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    if (chunks < 1 || nodes < 1 || chunks % nodes) return 4;
    if (numel == 0) return 0;
    const Layout f{bits, block};
    const int64_t jobs = chunks * f.blocks((numel + chunks - 1) / chunks);
    table<Quantize>()[bits == 4][dtype](x, numel, f, chunks, nodes, out, threads, jobs);
    return 0;
}

// Dequantize `chunks` packs of chunk_numel elements into the first out_numel elements of flat `out`.
int zeropp_dequantize_chunks(const uint8_t* buf, int bits, int block, int64_t chunks, int64_t chunk_numel,
                             void* out, int dtype, int64_t out_numel, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    const Layout f{bits, block};
    table<Dequantize>()[bits == 4][dtype](buf, f, chunk_numel, out, out_numel, threads, chunks * f.blocks(chunk_numel));
    return 0;
}

// Pack m of `out` (chunks packs) = the fused sum of packs g * chunks + m of `buf`, g < groups, requantized.
int zeropp_reduce_requantize(const uint8_t* buf, int bits, int block, int groups, int64_t chunks,
                             int64_t chunk_numel, uint8_t* out, int threads) {
    if (int bad = check(bits, block, kFloat32)) return bad;
    if (groups < 1 || chunks < 1) return 4;
    const Layout f{bits, block};
    table<ReduceRequantize>()[bits == 4][kFloat32](buf, f, groups, chunks, chunk_numel, out, threads,
                                                   chunks * f.blocks(chunk_numel));
    return 0;
}

// The fused sum of `groups` packs of chunk_numel elements, divided by `divisor` (float division), into the first
// out_numel elements of flat `out`.
int zeropp_reduce_dequantize(const uint8_t* buf, int bits, int block, int groups, int64_t chunk_numel, void* out,
                             int dtype, int64_t out_numel, float divisor, int threads) {
    if (int bad = check(bits, block, dtype)) return bad;
    if (groups < 1) return 4;
    const Layout f{bits, block};
    table<ReduceDequantize>()[bits == 4][dtype](buf, f, groups, chunk_numel, out, out_numel, divisor, threads,
                                                f.blocks(out_numel));
    return 0;
}

}  // extern "C"
