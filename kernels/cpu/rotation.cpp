// The native CPU block Hadamard rotation: bit for bit the spec of zeropp/quant/rotation.py (its torch reference).
// A plain C ABI, loaded by zeropp/quant/native.py through ctypes beside quant.cpp's ops.
//
// Exactness: every output is the spec's float32 additions and subtractions, one rounding each, in the spec's stage
// order (h = 1, 2, 4, ...), then for the inverse one float32 multiplication by 1 / size; built without -ffast-math
// and with -ffp-contract=off (CMakeLists.txt), the compiler may vectorize these operations but not reassociate or
// fuse them. The loops are templates on the block size, so they unroll and vectorize; each is compiled for
// AVX-512, for AVX2 and portably (isa.h), picked when called: the vector width changes no result.
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "isa.h"

namespace {

#include "parallel.h"

constexpr int kMaxSize = 128;

// Blocks [first, end) of `size` elements of flat x (numel elements, the last block zero-padded) into out.
template <int Size, bool Inverse>
ZEROPP_INLINE void hadamard_blocks(const float* x, int64_t numel, float* out, int64_t first, int64_t end) {
    for (int64_t block = first; block < end; ++block) {
        const int64_t start = block * Size;
        float v[Size];
        if (start + Size <= numel) {
            std::memcpy(v, x + start, sizeof v);
        } else {
            std::memset(v, 0, sizeof v);
            std::memcpy(v, x + start, sizeof(float) * size_t(numel - start));
        }
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
        std::memcpy(out + start, v, sizeof v);
    }
}

// hadamard_blocks for the runtime size and direction, over the threads.
template <int Size>
ZEROPP_INLINE void run_size(const float* x, int64_t numel, bool inverse, float* out, int threads) {
    parallel((numel + Size - 1) / Size, threads, [&](int64_t a, int64_t e) {
        if (inverse) {
            hadamard_blocks<Size, true>(x, numel, out, a, e);
        } else {
            hadamard_blocks<Size, false>(x, numel, out, a, e);
        }
    });
}

ZEROPP_INLINE void run(const float* x, int64_t numel, int size, bool inverse, float* out, int threads) {
    switch (size) {
        case 16: return run_size<16>(x, numel, inverse, out, threads);
        case 32: return run_size<32>(x, numel, inverse, out, threads);
        case 64: return run_size<64>(x, numel, inverse, out, threads);
        default: return run_size<128>(x, numel, inverse, out, threads);
    }
}

void run_portable(const float* x, int64_t numel, int size, bool inverse, float* out, int threads) {
    run(x, numel, size, inverse, out, threads);
}

#if ZEROPP_X86_KERNELS
__attribute__((target("avx2,fma,f16c"))) void run_avx2(const float* x, int64_t numel, int size, bool inverse,
                                                        float* out, int threads) {
    run(x, numel, size, inverse, out, threads);
}
#endif

#if ZEROPP_AVX512_KERNELS
__attribute__((target("avx2,fma,f16c,avx512f"))) void run_avx512(const float* x, int64_t numel, int size,
                                                                  bool inverse, float* out, int threads) {
    run(x, numel, size, inverse, out, threads);
}

bool avx512f_usable() {
    static const bool usable = avx2_usable() && __builtin_cpu_supports("avx512f");
    return usable;
}
#endif

}  // namespace

extern "C" {

// out (ceil(numel / size) * size floats) = the blocks of `size` elements of flat float32 x (numel elements, the
// last block zero-padded) through the Hadamard butterfly, times 1 / size when `inverse` is non-zero. Returns 0, or
// 1 for a size that is not 16, 32, 64 or 128, 2 for a negative numel.
int zeropp_hadamard(const float* x, int64_t numel, int size, int inverse, float* out, int threads) {
    if (size != 16 && size != 32 && size != 64 && size != kMaxSize) return 1;
    if (numel < 0) return 2;
#if ZEROPP_AVX512_KERNELS
    if (avx512f_usable()) return run_avx512(x, numel, size, inverse != 0, out, threads), 0;
#endif
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) return run_avx2(x, numel, size, inverse != 0, out, threads), 0;
#endif
    run_portable(x, numel, size, inverse != 0, out, threads);
    return 0;
}

}  // extern "C"
