// The instruction sets the CPU kernels (quant.cpp, adam.cpp) are compiled for, and the check that this CPU runs
// the AVX2 kernels. Each file compiles its loops three times (AVX-512, AVX2 + FMA + F16C, portable) and picks one
// when called; ZEROPP_NO_AVX512 and ZEROPP_BASELINE_ONLY drop sets (CMakeLists.txt builds those variants for the
// tests). Included before each file's anonymous namespace.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(ZEROPP_BASELINE_ONLY)
#define ZEROPP_X86_KERNELS 1
#include <cpuid.h>
#else
#define ZEROPP_X86_KERNELS 0
#endif
#if ZEROPP_X86_KERNELS && !defined(ZEROPP_NO_AVX512)
#define ZEROPP_AVX512_KERNELS 1
#else
#define ZEROPP_AVX512_KERNELS 0
#endif
#define ZEROPP_INLINE inline __attribute__((always_inline))

#if ZEROPP_X86_KERNELS
namespace {

// Whether this CPU (and its operating system, which must save the vector registers) runs the AVX2 kernels (AVX2,
// FMA and F16C). F16C is read from CPUID: clang's __builtin_cpu_supports does not know it.
bool avx2_usable() {
    static const bool usable = [] {
        __builtin_cpu_init();
        unsigned eax, ebx, ecx, edx;
        const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    }();
    return usable;
}

}  // namespace
#endif
