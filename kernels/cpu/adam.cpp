// One Adam / AdamW step on a contiguous float32 tensor set, bit for bit torch's fused CPU step
// (torch.optim.adam.adam(..., fused=True), aten/src/ATen/native/cpu/FusedAdamKernel.cpp, float32, no amsgrad, no
// maximize, no grad scale), optionally writing the new parameters rounded to bfloat16 or float16 (round to nearest
// even, as param.to(dtype)) in the same pass. A plain C ABI, loaded by zeropp/optim/native.py through ctypes.
//
// The spec, as torch computes it. With s = float(step) as a double:
//   bc1 = 1 - pow(beta1, s), step_size = lr / bc1, bc2_sqrt = sqrt(1 - pow(beta2, s))      (all double)
// and these rounded to float: w = 1 - beta1, c2 = 1 - beta2, beta2, eps, bc2_sqrt, -step_size, weight_decay
// (Adam) or 1 - lr * weight_decay (AdamW, computed in double). Per element, in float:
//   Adam with weight_decay != 0:  g = g + p * weight_decay
//   AdamW with weight_decay != 0: p = p * (1 - lr * weight_decay)
//   m = (|w| < 0.5 ? w : w - 1) * (g - m) + (|w| < 0.5 ? m : g)      (torch's lerp, its vector form)
//   v = v * beta2 + (c2 * g) * g
//   p = p + (-step_size * m) / (sqrt(v) / bc2_sqrt + eps)
// Where torch's kernels use FMA (its AVX2 and AVX-512 kernels: GCC contracts their products and sums, and the
// lerp is an explicit fmadd), three of these sums are one FMA each, with one rounding:
//   g = fma(p, weight_decay, g),  m = fma(w or w - 1, g - m, m or g),  v = fma(c2 * g, g, v * beta2)
// except in the last n % width elements (width = 8 floats on AVX2, 16 on AVX-512: torch's vector length), which
// torch's scalar tail loop computes, and where GCC contracted the other product: v = fma(v, beta2, (c2 * g) * g)
// (its lerp, m + w * (g - m) or g - (g - m) * (1 - w), is the same FMA as the vector one: w - 1 is -(1 - w)
// exactly). Without FMA (torch's default kernels) every operation rounds, the same in both loops. The caller says
// which (zeropp/optim/native.py finds it by running torch's step on probes). Every other operation is one IEEE
// float operation (this file is built with -ffp-contract=off; the FMAs are explicit).
//
// The kernels are one loop written for auto-vectorization (this file alone is built with -fno-math-errno, without
// which the square root does not vectorize), compiled three times (AVX-512, AVX2 + FMA, portable) and chosen when
// called, as in quant.cpp; ZEROPP_NO_AVX512 and ZEROPP_BASELINE_ONLY drop sets the same way (the
// portable loop's FMAs are the C library's exact fmaf). The elements are split over `threads` OpenMP threads in
// ranges of whole 64-byte lines; each element's result does not depend on the split.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "isa.h"

namespace {

enum OutDtype : int { kNone = -1, kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
enum Decay : int { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

// The step's constants, rounded to float as torch rounds them.
struct Constants {
    float decay;          // weight_decay (kL2) or 1 - lr * weight_decay (kDecoupled)
    float coeff;          // the lerp's multiplier: w if |w| < 0.5, else w - 1 (w = 1 - beta1, torch's lerp weight)
    bool small;           // |w| < 0.5: the lerp's base is m, else g
    float beta2, c2;      // beta2, 1 - beta2
    float bc2_sqrt, eps;  // sqrt(1 - beta2^step), eps
    float neg_step_size;  // -lr / (1 - beta1^step)
};

#include "float_bits.h"

template <int Out>
ZEROPP_INLINE void store_out(void* out, int64_t i, float p) {
    if constexpr (Out == kFloat32) {
        static_cast<float*>(out)[i] = p;
    } else if constexpr (Out == kBFloat16) {
        static_cast<uint16_t*>(out)[i] = float_to_bfloat16(p);
    } else if constexpr (Out == kFloat16) {
        static_cast<uint16_t*>(out)[i] = float_to_half(p);
    }
}

// Elements [a, e): the spec, with FMAs where Fma, as torch's scalar tail loop where Tail.
template <int D, int Out, bool Fma, bool Tail = false>
ZEROPP_INLINE void step_range(float* __restrict__ param, const float* __restrict__ grad,
                              float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, void* __restrict__ out,
                              const Constants& k, int64_t a, int64_t e) {
    const float decay = k.decay, coeff = k.coeff, beta2 = k.beta2, c2 = k.c2, bc2_sqrt = k.bc2_sqrt, eps = k.eps,
                neg_step_size = k.neg_step_size;
    const bool small = k.small;
    for (int64_t i = a; i < e; ++i) {
        float p = param[i], g = grad[i];
        const float m0 = exp_avg[i], v0 = exp_avg_sq[i];
        if constexpr (D == kDecoupled) p = p * decay;
        float m, v;
        if constexpr (Fma) {
            if constexpr (D == kL2) g = __builtin_fmaf(p, decay, g);
            m = __builtin_fmaf(coeff, g - m0, small ? m0 : g);
            v = Tail ? __builtin_fmaf(v0, beta2, (c2 * g) * g) : __builtin_fmaf(c2 * g, g, v0 * beta2);
        } else {
            if constexpr (D == kL2) g = g + p * decay;
            m = coeff * (g - m0) + (small ? m0 : g);
            v = v0 * beta2 + (c2 * g) * g;
        }
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        p = p + (neg_step_size * m) / (std::sqrt(v) / bc2_sqrt + eps);
        param[i] = p;
        store_out<Out>(out, i, p);
    }
}

// The loop compiled for each instruction set (the target attribute lets GCC and clang vectorize it with that set;
// FMA is part of each x86 set).
struct Portable {
    template <int D, int Out, bool Fma>
    static void run(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out,
                    const Constants& k, int64_t a, int64_t e) {
        step_range<D, Out, Fma>(param, grad, exp_avg, exp_avg_sq, out, k, a, e);
    }
};

#if ZEROPP_X86_KERNELS
struct Avx2 {
    template <int D, int Out, bool Fma>
    __attribute__((target("avx2,fma,f16c"))) static void run(float* param, const float* grad, float* exp_avg,
                                                              float* exp_avg_sq, void* out, const Constants& k,
                                                              int64_t a, int64_t e) {
        step_range<D, Out, Fma>(param, grad, exp_avg, exp_avg_sq, out, k, a, e);
    }
};
#endif

#if ZEROPP_AVX512_KERNELS
struct Avx512 {
    template <int D, int Out, bool Fma>
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))) static void run(
        float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, const Constants& k, int64_t a,
        int64_t e) {
        step_range<D, Out, Fma>(param, grad, exp_avg, exp_avg_sq, out, k, a, e);
    }
};

bool avx512_usable() {
    static const bool usable = avx2_usable() && __builtin_cpu_supports("avx512f") &&
                               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    return usable;
}
#endif

constexpr int64_t kLine = 16;  // floats in a 64-byte line: the unit of the threads' split

// One call's tensors (n elements each) and thread count.
struct Tensors {
    float* param;
    const float* grad;
    float* exp_avg;
    float* exp_avg_sq;
    void* out;
    int64_t n;
    int64_t tail;  // the last elements, computed as torch's scalar loop does (n % width of the tensor torch stepped)
    int threads;
};

template <class Isa, int D, int Out, bool Fma>
void step(const Tensors& t, const Constants& k) {
    const int64_t body = Fma ? t.n - t.tail : t.n;
    const int64_t lines = (body + kLine - 1) / kLine;
    auto range = [&](int64_t i, int64_t count) {
        const int64_t a = std::min(body, lines * i / count * kLine);
        const int64_t e = std::min(body, lines * (i + 1) / count * kLine);
        Isa::template run<D, Out, Fma>(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.out, k, a, e);
    };
    if (t.threads <= 1 || lines < 2) {
        range(0, 1);
    } else {
#pragma omp parallel num_threads(t.threads)
        {
#ifdef _OPENMP
            range(omp_get_thread_num(), omp_get_num_threads());
#else
            range(0, 1);
#endif
        }
    }
    step_range<D, Out, Fma, true>(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.out, k, body, t.n);
}

// step<Isa, D, Out, Fma> for the runtime decay mode, output dtype and FMA flag.
template <class Isa, int D, int Out>
void dispatch_fma(bool fma, const Tensors& t, const Constants& k) {
    fma ? step<Isa, D, Out, true>(t, k) : step<Isa, D, Out, false>(t, k);
}

template <class Isa, int D>
void dispatch_out(int out_dtype, bool fma, const Tensors& t, const Constants& k) {
    switch (out_dtype) {
        case kFloat32: return dispatch_fma<Isa, D, kFloat32>(fma, t, k);
        case kBFloat16: return dispatch_fma<Isa, D, kBFloat16>(fma, t, k);
        case kFloat16: return dispatch_fma<Isa, D, kFloat16>(fma, t, k);
        default: return dispatch_fma<Isa, D, kNone>(fma, t, k);
    }
}

template <class Isa>
void dispatch(int decay, int out_dtype, bool fma, const Tensors& t, const Constants& k) {
    switch (decay) {
        case kL2: return dispatch_out<Isa, kL2>(out_dtype, fma, t, k);
        case kDecoupled: return dispatch_out<Isa, kDecoupled>(out_dtype, fma, t, k);
        default: return dispatch_out<Isa, kNoDecay>(out_dtype, fma, t, k);
    }
}

}  // namespace

extern "C" {

// Bumped whenever zeropp_adam_step's signature changes; zeropp/optim/native.py refuses a library of another
// version (or one without it, built before this file).
int zeropp_cpu_optim_abi_version(void) { return 2; }

// One step on param, exp_avg, exp_avg_sq (float32, n elements each, updated in place) from grad (float32), and,
// when out_dtype is 0/1/2 (float32/bfloat16/float16; -1: none), the new param in that dtype into out. step >= 1
// is the count after this step (torch's state_step after its increment); decoupled != 0 is AdamW; fma != 0 takes
// the FMAs of torch's AVX2 and AVX-512 kernels, whose vector length is width floats (8 or 16; see above), and
// computes the last `tail` elements as torch's scalar loop (tail < 0: n % width, torch stepping these n elements as
// one tensor; a piece of a larger tensor passes the part of that tensor's tail it holds). Returns 0, or non-zero for
// bad arguments (the Python side validates first; this is a second line).
int zeropp_adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, int64_t step,
                     double lr, double beta1, double beta2, double eps, double weight_decay, int decoupled,
                     void* out, int out_dtype, int fma, int64_t width, int64_t tail, int threads) {
    if (n < 0 || step < 1) return 1;
    if (out_dtype < kNone || out_dtype > kFloat16 || (out_dtype != kNone && out == nullptr)) return 2;
    if (fma && width != 8 && width != 16) return 3;
    if (tail > n) return 4;
    if (tail < 0) tail = n % width;
    if (n == 0) return 0;
    const double s = static_cast<float>(step);  // torch's state_step is a float32 tensor
    const double step_size = lr / (1 - std::pow(beta1, s));
    const double bias_correction2_sqrt = std::sqrt(1 - std::pow(beta2, s));
    Constants k;
    const float w = static_cast<float>(1 - beta1);
    k.small = std::abs(w) < 0.5f;
    k.coeff = k.small ? w : w - 1.0f;
    k.beta2 = static_cast<float>(beta2);
    k.c2 = static_cast<float>(1 - beta2);
    k.bc2_sqrt = static_cast<float>(bias_correction2_sqrt);
    k.eps = static_cast<float>(eps);
    k.neg_step_size = static_cast<float>(-step_size);
    const int decay = weight_decay == 0 ? kNoDecay : decoupled ? kDecoupled : kL2;
    k.decay = static_cast<float>(decay == kDecoupled ? 1 - lr * weight_decay : weight_decay);
    const Tensors t{param, grad, exp_avg, exp_avg_sq, out, n, tail, threads};
#if ZEROPP_AVX512_KERNELS
    if (avx512_usable()) {
        dispatch<Avx512>(decay, out_dtype, fma != 0, t, k);
        return 0;
    }
#endif
#if ZEROPP_X86_KERNELS
    if (avx2_usable()) {
        dispatch<Avx2>(decay, out_dtype, fma != 0, t, k);
        return 0;
    }
#endif
    dispatch<Portable>(decay, out_dtype, fma != 0, t, k);
    return 0;
}

}  // extern "C"
