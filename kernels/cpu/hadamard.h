// The block Hadamard butterflies of zeropp/quant/rotation.py's spec, shared by rotation.cpp (the standalone
// rotation) and quant.cpp (the rotation fused into qgZ's swizzled quantize and final reduce). Included inside each
// file's anonymous namespace, after isa.h and <immintrin.h>.
//
// Exactness: every output is the spec's float32 additions and subtractions, one rounding each, in the spec's stage
// order (h = 1, 2, 4, ...), then for the inverse one float32 multiplication by 1 / size; built without -ffast-math
// and with -ffp-contract=off (CMakeLists.txt). Two versions: the portable one (plain C++, one pair at a time) and
// the AVX2 one (8 floats a vector; the stages h = 1, 2, 4 inside a vector by a permutation and a blend, the others
// between vectors), which the callers run where avx2_usable() (isa.h).
#pragma once

constexpr int kMaxRotation = 128;

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

// Blocks [0, count) of Size floats of v in place through the butterfly.
template <int Size, bool Inverse>
void butterflies(float* v, int64_t count) {
    for (int64_t k = 0; k < count; ++k) butterfly<Size, Inverse>(v + k * Size);
}

#if ZEROPP_X86_KERNELS
#ifndef ZEROPP_AVX2
#define ZEROPP_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZEROPP_AVX2_INLINE inline __attribute__((always_inline, target("avx2,fma,f16c")))
#endif

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

// The same as butterflies, by avx2_block.
template <int Size, bool Inverse>
ZEROPP_AVX2 void avx2_butterflies(float* v, int64_t count) {
    for (int64_t k = 0; k < count; ++k) avx2_block<Size, Inverse>(v + k * Size, v + k * Size);
}
#endif
