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

#include "hadamard.h"

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
    if (size != 16 && size != 32 && size != 64 && size != kMaxRotation) return 1;
    if (numel < 0) return 2;
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) return run<Avx2>(x, numel, size, inverse != 0, out, threads), 0;
#endif
    run<Portable>(x, numel, size, inverse != 0, out, threads);
    return 0;
}

}  // extern "C"
