// The native CPU block Hadamard rotation: bit for bit the spec of zeropp/quant/rotation.py (its torch reference).
// A plain C ABI, loaded by zeropp/quant/native.py through ctypes beside quant.cpp's ops.
//
// Exactness: every output is the spec's float32 additions and subtractions, one rounding each, in the spec's stage
// order (h = 1, 2, 4, ...), then for the inverse one float32 multiplication by 1 / size; built without -ffast-math
// and with -ffp-contract=off (CMakeLists.txt), the compiler may vectorize these operations but not reassociate or
// fuse them. Two kernels, picked when called (isa.h): the AVX2 one (8 floats a vector; the stages h = 1, 2, 4 inside
// a vector by a permutation and a blend, the others between vectors) where the CPU has AVX2, FMA and F16C, and the
// portable one (plain C++, one pair at a time) elsewhere and in the ZEROPP_BASELINE_ONLY build. Neither depends on
// AVX-512 (ZEROPP_NO_AVX512 builds the same).
#include <algorithm>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "isa.h"
#if ZEROPP_X86_KERNELS
#include <immintrin.h>
#endif

namespace {

#include "parallel.h"

constexpr int kMaxSize = 128;

// One block of Size floats in place through the butterfly (times 1 / Size if Inverse), one element at a time.
template <int Size, bool Inverse>
ZEROPP_INLINE void butterfly(float* v) {
    for (int h = 1; h < Size; h *= 2) {
        for (int i = 0; i < Size; i += 2 * h) {
            for (int j = i; j < i + h; ++j) {
                const float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
    if constexpr (Inverse) {
        for (int j = 0; j < Size; ++j) v[j] *= 1.0f / Size;
    }
}

// Kernels: Isa::blocks<Size, Inverse>(x, numel, out, first, end) puts blocks [first, end) of Size elements of flat
// x (numel elements, the last block zero-padded) through the butterfly into out.
struct Portable {
    template <int Size, bool Inverse>
    static void blocks(const float* x, int64_t numel, float* out, int64_t first, int64_t end) {
        for (int64_t block = first; block < end; ++block) {
            const int64_t start = block * Size;
            float v[Size] = {};
            std::memcpy(v, x + start, sizeof(float) * size_t(std::min<int64_t>(Size, numel - start)));
            butterfly<Size, Inverse>(v);
            std::memcpy(out + start, v, sizeof v);
        }
    }
};

#if ZEROPP_X86_KERNELS
#define ZEROPP_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZEROPP_AVX2_INLINE inline __attribute__((always_inline, target("avx2,fma,f16c")))

// One stage h < 8 inside each 8-float vector: p is v with the pairs (j, j + h) swapped; positions with bit h
// clear take v + p = a + b, those with it set p - v = a - b (the spec's operands, in its order).
template <int H>
ZEROPP_AVX2_INLINE __m256 in_vector_stage(__m256 v) {
    __m256 p;
    constexpr int kMask = H == 1 ? 0xAA : H == 2 ? 0xCC : 0xF0;
    if constexpr (H == 1) {
        p = _mm256_permute_ps(v, 0xB1);  // (1, 0, 3, 2) in each 128-bit lane
    } else if constexpr (H == 2) {
        p = _mm256_permute_ps(v, 0x4E);  // (2, 3, 0, 1) in each lane
    } else {
        p = _mm256_permute2f128_ps(v, v, 0x01);  // the two lanes swapped
    }
    return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), kMask);
}

// One block as Size / 8 vectors: stages 1, 2 and 4 inside each vector, then stages 8, 16, ... between vectors.
template <int Size, bool Inverse>
ZEROPP_AVX2_INLINE void avx2_block(const float* in, float* out) {
    constexpr int kVectors = Size / 8;
    __m256 v[kVectors];
    for (int k = 0; k < kVectors; ++k) {
        v[k] = in_vector_stage<4>(in_vector_stage<2>(in_vector_stage<1>(_mm256_loadu_ps(in + 8 * k))));
    }
    for (int h = 1; h < kVectors; h *= 2) {
        for (int i = 0; i < kVectors; i += 2 * h) {
            for (int j = i; j < i + h; ++j) {
                const __m256 a = v[j], b = v[j + h];
                v[j] = _mm256_add_ps(a, b);
                v[j + h] = _mm256_sub_ps(a, b);
            }
        }
    }
    for (int k = 0; k < kVectors; ++k) {
        if constexpr (Inverse) v[k] = _mm256_mul_ps(v[k], _mm256_set1_ps(1.0f / Size));
        _mm256_storeu_ps(out + 8 * k, v[k]);
    }
}

struct Avx2 {
    template <int Size, bool Inverse>
    ZEROPP_AVX2 static void blocks(const float* x, int64_t numel, float* out, int64_t first, int64_t end) {
        for (int64_t block = first; block < end; ++block) {
            const int64_t start = block * Size;
            if (start + Size <= numel) {
                avx2_block<Size, Inverse>(x + start, out + start);
            } else {
                float v[Size] = {};
                std::memcpy(v, x + start, sizeof(float) * size_t(numel - start));
                avx2_block<Size, Inverse>(v, out + start);
            }
        }
    }
};
#endif

// Isa::blocks for the runtime size and direction, over the threads.
template <class Isa, int Size>
void run_size(const float* x, int64_t numel, bool inverse, float* out, int threads) {
    parallel((numel + Size - 1) / Size, threads, [&](int64_t a, int64_t e) {
        if (inverse) {
            Isa::template blocks<Size, true>(x, numel, out, a, e);
        } else {
            Isa::template blocks<Size, false>(x, numel, out, a, e);
        }
    });
}

template <class Isa>
void run(const float* x, int64_t numel, int size, bool inverse, float* out, int threads) {
    switch (size) {
        case 16: return run_size<Isa, 16>(x, numel, inverse, out, threads);
        case 32: return run_size<Isa, 32>(x, numel, inverse, out, threads);
        case 64: return run_size<Isa, 64>(x, numel, inverse, out, threads);
        default: return run_size<Isa, 128>(x, numel, inverse, out, threads);
    }
}

}  // namespace

extern "C" {

// out (ceil(numel / size) * size floats) = the blocks of `size` elements of flat float32 x (numel elements, the
// last block zero-padded) through the Hadamard butterfly, times 1 / size when `inverse` is non-zero. Returns 0, or
// 1 for a size that is not 16, 32, 64 or 128, 2 for a negative numel.
int zeropp_hadamard(const float* x, int64_t numel, int size, int inverse, float* out, int threads) {
    if (size != 16 && size != 32 && size != 64 && size != kMaxSize) return 1;
    if (numel < 0) return 2;
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) return run<Avx2>(x, numel, size, inverse != 0, out, threads), 0;
#endif
    run<Portable>(x, numel, size, inverse != 0, out, threads);
    return 0;
}

}  // extern "C"
