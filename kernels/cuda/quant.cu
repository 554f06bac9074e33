// The CUDA C++ implementation of zeropp's block quantization ops: bit for bit the spec of zeropp/quant/format.py,
// as the torch reference (zeropp/quant/reference.py) and the CPU library (kernels/cpu/quant.cpp) compute it.
// extern "C" kernels, built into build/zeropp_cuda.fatbin by CMakeLists.txt and launched by
// zeropp/quant/native_cuda.py through CuPy (raw pointers and sizes, no torch ABI).
//
// Exactness. Built with -fmad=false -ftz=false -prec-div=true -prec-sqrt=true, and every float operation whose
// rounding matters is written as its correctly rounded intrinsic (__fmaf_rn, __fmul_rn, __fadd_rn, __fdiv_rn), so
// nothing is contracted and subnormals are kept (tests/quant/test_cuda_compile.py checks the PTX and SASS):
//  * scale = absmax / qmax by IEEE division; absmax on the magnitude bits as unsigned integers (a NaN's bits
//    exceed Inf's, so the maximum propagates NaN, as the spec wants);
//  * code = rne(x * r) of the exact product, r = 1 / scale rounded to 24 bits: for a normal scale r is a normal
//    float (a finite scale is at most FLT_MAX / 7 < 2^126) and one FMA, x * r + (1.5 * 2^23 + 2^(bits - 1)),
//    rounds the exact product once, to an integer held in the low mantissa bits (|x * r| <= qmax * (1 + 2^-22),
//    so no clamp); for a subnormal scale r may overflow a float, and the product is taken in double, where it is
//    exact, then rounded and clamped, as quant.cpp does;
//  * the fused sums are acc = fma(code, scale, acc) from acc = 0, the spec's own operation; the final division
//    is IEEE division, or a multiplication by the exact reciprocal of a power-of-two divisor (the same exact
//    quotient, rounded once).
//
// Layout of the work. Every thread holds kPerThread = 16 consecutive elements of one quantization block: 4 or 2
// 16-byte vector loads or stores of floats where they are 16-byte aligned and all present (else one element at a
// time), and 4 or 2 words of codes. A block of block_size elements is held by block_size / 16 threads (1 to 512, a
// power of two), which find its absmax with warp shuffles, and through shared memory when the block spans several
// warps (block_size >= 1024). A CTA has max(256, block_size / 16) threads, so it holds 4096 elements (8192 at
// block size 8192): a tile of whole blocks. The grid is 2-D: x a tile of a pack, y (with z, past 65535 packs) the
// pack, so no element index is divided at run time and no CTA spans two packs. Offsets are int64 wherever a
// buffer can pass 2^31 bytes.
//
// Codes are read and written as 32-bit words, code i of a word in bits [i * bits, (i + 1) * bits): the spec's
// byte order on a little-endian machine and int4's "element 2k in the low nibble" rule. Every pack starts 4-byte
// aligned (format.py), so words are always aligned; a thread's words are moved as one 16- or 8-byte vector when
// its pack's codes happen to be aligned to that.
#include <cfloat>
#include <cstdint>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

enum Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int kPerThread = 16;                 // elements per thread, consecutive, within one block
constexpr int kMaxThreads = 512;               // the CTA size at block size 8192 (256 below)
constexpr int kGroupsInFlight = 4;             // packs whose loads a fused sum issues together
constexpr float kRounder = 12582912.0f;        // 1.5 * 2^23: x + kRounder rounds |x| < 2^22 to an integer
constexpr uint32_t kCodeExponent = 0x4B000000;  // the bits of 2^23: a mantissa unit is then worth 1

template <typename To, typename From>
__device__ __forceinline__ To bit_cast(const From& from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
    To to;
    memcpy(&to, &from, sizeof(To));
    return to;
}

__device__ __forceinline__ bool aligned(const void* p, unsigned bytes) {
    return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Elements: a thread's 16 floats from and to memory of dtype D, exact in, rounded to nearest even out.

template <int D>
struct Elements;

template <>
struct Elements<kFloat32> {
    using T = float;
    static __device__ __forceinline__ void load16(const float* p, float (&v)[kPerThread]) {
#pragma unroll
        for (int k = 0; k < kPerThread / 4; ++k) {
            const float4 a = __ldg(reinterpret_cast<const float4*>(p) + k);
            v[4 * k] = a.x;
            v[4 * k + 1] = a.y;
            v[4 * k + 2] = a.z;
            v[4 * k + 3] = a.w;
        }
    }
    static __device__ __forceinline__ float load1(const float* p) { return __ldg(p); }
    static __device__ __forceinline__ void store16(float* p, const float (&v)[kPerThread]) {
#pragma unroll
        for (int k = 0; k < kPerThread / 4; ++k) {
            reinterpret_cast<float4*>(p)[k] = make_float4(v[4 * k], v[4 * k + 1], v[4 * k + 2], v[4 * k + 3]);
        }
    }
    static __device__ __forceinline__ void store1(float* p, float v) { *p = v; }
};

// bfloat16 and float16 elements are handled as their 16-bit patterns, two per 32-bit word (element 2k low): one
// template for both, each format giving only its conversions of a word to two floats and back (rounded to nearest
// even) and of one element.
template <typename Format>
struct HalfElements {
    using T = uint16_t;
    static __device__ __forceinline__ void load16(const uint16_t* p, float (&v)[kPerThread]) {
#pragma unroll
        for (int k = 0; k < kPerThread / 8; ++k) {
            const uint4 a = __ldg(reinterpret_cast<const uint4*>(p) + k);
            const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 f = Format::unpack(w[j]);
                v[8 * k + 2 * j] = f.x;
                v[8 * k + 2 * j + 1] = f.y;
            }
        }
    }
    static __device__ __forceinline__ float load1(const uint16_t* p) {
        return Format::to_float(__ldg(reinterpret_cast<const unsigned short*>(p)));
    }
    static __device__ __forceinline__ void store16(uint16_t* p, const float (&v)[kPerThread]) {
#pragma unroll
        for (int k = 0; k < kPerThread / 8; ++k) {
            uint32_t w[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = Format::pack(v[8 * k + 2 * j], v[8 * k + 2 * j + 1]);
            reinterpret_cast<uint4*>(p)[k] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    static __device__ __forceinline__ void store1(uint16_t* p, float v) { *p = Format::from_float(v); }
};

struct BFloat16Format {
    static __device__ __forceinline__ float2 unpack(uint32_t w) {
        return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
    }
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        return bit_cast<uint32_t>(__floats2bfloat162_rn(a, b));
    }
    static __device__ __forceinline__ float to_float(unsigned short h) { return __uint_as_float(uint32_t(h) << 16); }
    static __device__ __forceinline__ uint16_t from_float(float v) {
        return __bfloat16_as_ushort(__float2bfloat16_rn(v));
    }
};

struct Float16Format {
    static __device__ __forceinline__ float2 unpack(uint32_t w) { return __half22float2(bit_cast<__half2>(w)); }
    static __device__ __forceinline__ uint32_t pack(float a, float b) {
        return bit_cast<uint32_t>(__floats2half2_rn(a, b));
    }
    static __device__ __forceinline__ float to_float(unsigned short h) { return __half2float(__ushort_as_half(h)); }
    static __device__ __forceinline__ uint16_t from_float(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

template <>
struct Elements<kBFloat16> : HalfElements<BFloat16Format> {};

template <>
struct Elements<kFloat16> : HalfElements<Float16Format> {};

// How many of a thread's 16 elements lie in the first `available` (any int64) from its first: 0 to 16.
__device__ __forceinline__ int present(int64_t available) {
    return int(min(max(available, int64_t(0)), int64_t(kPerThread)));
}

// The 16 elements at p, of which the first `count` (0 to 16) exist; the others read as 0.
template <int D>
__device__ __forceinline__ void load_elements(const typename Elements<D>::T* p, int count, float (&v)[kPerThread]) {
    if (count == kPerThread && aligned(p, 16)) {
        Elements<D>::load16(p, v);
    } else {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) v[i] = i < count ? Elements<D>::load1(p + i) : 0.0f;
    }
}

// The first `count` (0 to 16) of the 16 values v into p.
template <int D>
__device__ __forceinline__ void store_elements(typename Elements<D>::T* p, int count, const float (&v)[kPerThread]) {
    if (count == kPerThread && aligned(p, 16)) {
        Elements<D>::store16(p, v);
    } else {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            if (i < count) Elements<D>::store1(p + i, v[i]);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Codes: a thread's 16 codes as kWords 32-bit words, to and from floats.

template <int Bits>
struct Codes {
    static constexpr int kWords = kPerThread * Bits / 32;  // 4 for int8, 2 for int4
    static constexpr int kBytes = 4 * kWords;
    static constexpr uint32_t kSigns = Bits == 8 ? 0x80808080u : 0x88888888u;  // every code's sign bit

    // The words at p (4-byte aligned), as one vector load when p allows it.
    static __device__ __forceinline__ void load(const uint8_t* p, uint32_t (&w)[kWords]) {
        if (aligned(p, kBytes)) {
            if (kWords == 4) {
                const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
                w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
            } else {
                const uint2 a = __ldg(reinterpret_cast<const uint2*>(p));
                w[0] = a.x, w[1] = a.y;
            }
        } else {
#pragma unroll
            for (int k = 0; k < kWords; ++k) w[k] = __ldg(reinterpret_cast<const uint32_t*>(p) + k);
        }
    }

    static __device__ __forceinline__ void store(uint8_t* p, const uint32_t (&w)[kWords]) {
        if (aligned(p, kBytes)) {
            if (kWords == 4) {
                *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
            } else {
                *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
            }
        } else {
#pragma unroll
            for (int k = 0; k < kWords; ++k) reinterpret_cast<uint32_t*>(p)[k] = w[k];
        }
    }

    // The codes of the words as exact floats. With every sign bit flipped a code is u = code + 2^(bits - 1),
    // unsigned; a byte permute puts it (int4: after splitting the nibbles into bytes) in the low byte of 2^23,
    // whose mantissa unit is 1, and subtracting 2^23 + 2^(bits - 1) leaves the code.
    static __device__ __forceinline__ void decode(const uint32_t (&w)[kWords], float (&c)[kPerThread]) {
        constexpr float kBias = 8388608.0f + (1 << (Bits - 1));
#pragma unroll
        for (int k = 0; k < kWords; ++k) {
            const uint32_t u = w[k] ^ kSigns;
            if (Bits == 8) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    c[4 * k + i] = __fadd_rn(__uint_as_float(__byte_perm(u, kCodeExponent, 0x7650 + i)), -kBias);
                }
            } else {
                const uint32_t even = u & 0x0F0F0F0Fu, odd = (u >> 4) & 0x0F0F0F0Fu;  // codes 2j, 2j + 1 in byte j
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    c[8 * k + 2 * j] = __fadd_rn(__uint_as_float(__byte_perm(even, kCodeExponent, 0x7650 + j)), -kBias);
                    c[8 * k + 2 * j + 1] =
                        __fadd_rn(__uint_as_float(__byte_perm(odd, kCodeExponent, 0x7650 + j)), -kBias);
                }
            }
        }
    }

    // Words from offset codes: u[i] holds code i + 2^(bits - 1) in its low `bits` bits with zeros above them up
    // to bit 7 (the bits of the float kRounder + 2^(bits - 1) + code). Bytes are gathered with byte permutes
    // (int4: byte j is u[2j] + (u[2j + 1] << 4) first), then every sign bit is flipped back.
    static __device__ __forceinline__ void encode(const uint32_t (&u)[kPerThread], uint32_t (&w)[kWords]) {
#pragma unroll
        for (int k = 0; k < kWords; ++k) {
            uint32_t b[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                b[j] = Bits == 8 ? u[4 * k + j] : u[8 * k + 2 * j] + (u[8 * k + 2 * j + 1] << 4);
            }
            w[k] = __byte_perm(__byte_perm(b[0], b[1], 0x0040), __byte_perm(b[2], b[3], 0x0040), 0x5410) ^ kSigns;
        }
    }
};

// ---------------------------------------------------------------------------------------------------------------
// Blocks

// Where a thread's elements sit: CTA-wide tile geometry for block_size (a power of two, 16..8192).
struct Place {
    int lane;       // the thread's index among the threads of its block
    int64_t block;  // the block's index in its pack
    int64_t first;  // the index in the pack of the thread's first element

    __device__ __forceinline__ Place(int block_size) {
        const int shift = __ffs(block_size / kPerThread) - 1;  // log2 of the threads per block
        lane = threadIdx.x & ((1 << shift) - 1);
        block = int64_t(blockIdx.x) * (blockDim.x >> shift) + (threadIdx.x >> shift);
        first = block * block_size + lane * kPerThread;
    }
};

// The largest of m over the `threads` threads of a block (a power of two; consecutive threads, aligned). Every
// thread of the CTA calls it (it synchronizes the CTA when a block spans several warps).
__device__ __forceinline__ uint32_t block_max(uint32_t m, int threads) {
    __shared__ uint32_t warp_max[kMaxThreads / 32];
    for (int offset = 1; offset < threads && offset < 32; offset <<= 1) {
        m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
    }
    if (threads > 32) {
        const int warp = threadIdx.x >> 5, warps = threads >> 5;
        if ((threadIdx.x & 31) == 0) warp_max[warp] = m;
        __syncthreads();
        const int first = warp & ~(warps - 1);
        m = warp_max[first];
        for (int k = 1; k < warps; ++k) m = max(m, warp_max[first + k]);
    }
    return m;
}

// The code words of a thread's 16 float values v and their block's scale (returned); the block is held by
// `threads` threads, every thread of the CTA calls this.
template <int Bits>
__device__ __forceinline__ float quantize(const float (&v)[kPerThread], int threads,
                                          uint32_t (&w)[Codes<Bits>::kWords]) {
    constexpr int kQmax = (1 << (Bits - 1)) - 1;
    constexpr float kOffset = kRounder + (1 << (Bits - 1));  // its float bits hold the offset code 2^(bits - 1)
    uint32_t amax = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) amax = max(amax, __float_as_uint(v[i]) & 0x7FFFFFFFu);
    amax = block_max(amax, threads);
    const float scale = __fdiv_rn(__uint_as_float(amax), float(kQmax));  // NaN or Inf for such a block
    uint32_t u[kPerThread];
    if (scale >= FLT_MIN && scale <= FLT_MAX) {
        // normal and correctly rounded: the spec's r (IEEE division: __frcp_rn's inline SASS holds an .FTZ)
        const float r = __fdiv_rn(1.0f, scale);
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) u[i] = __float_as_uint(__fmaf_rn(v[i], r, kOffset));
    } else if (scale > 0.0f && scale < FLT_MIN) {
        // A subnormal scale: r = 1 / scale rounded to 24 bits can pass FLT_MAX. 1 / scale in double, scaled into
        // float's range by 2^-64 and rounded to float there, is r * 2^-64 (53 >= 2 * 24 + 2 bits: the double
        // rounding is innocuous); the product with x is exact in double.
        const double r = double(__double2float_rn(__drcp_rn(double(scale)) * 0x1p-64)) * 0x1p64;
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const double c = fmin(fmax(rint(double(v[i]) * r), double(-kQmax)), double(kQmax));
            u[i] = __float_as_uint(__fadd_rn(float(c), kOffset));
        }
    } else {  // all zero, NaN or Inf: codes 0
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) u[i] = __float_as_uint(kOffset);
    }
    Codes<Bits>::encode(u, w);
    return scale;
}

// code * scale clamped to the finite float range (NaN stays NaN).
__device__ __forceinline__ float clamp_finite(float y) { return y > FLT_MAX ? FLT_MAX : (y < -FLT_MAX ? -FLT_MAX : y); }

// acc[i] = fma(code_i, scale, acc[i]) over `groups` packs in order: pack g's codes of the thread at
// codes + g * stride and its block's scale at scale + g * stride (bytes). The loads of kGroupsInFlight packs are
// issued before their sums, so that a thread has that many packs' bytes in flight.
template <int Bits>
__device__ __forceinline__ void sum_groups(const uint8_t* codes, const uint8_t* scale, int64_t stride, int groups,
                                           float (&acc)[kPerThread]) {
    for (int first = 0; first < groups; first += kGroupsInFlight) {
        uint32_t w[kGroupsInFlight][Codes<Bits>::kWords];
        float s[kGroupsInFlight];
#pragma unroll
        for (int k = 0; k < kGroupsInFlight; ++k) {
            if (first + k < groups) {
                const int64_t offset = (first + k) * stride;
                Codes<Bits>::load(codes + offset, w[k]);
                s[k] = __ldg(reinterpret_cast<const float*>(scale + offset));
            }
        }
#pragma unroll
        for (int k = 0; k < kGroupsInFlight; ++k) {
            if (first + k < groups) {
                float c[kPerThread];
                Codes<Bits>::decode(w[k], c);
#pragma unroll
                for (int i = 0; i < kPerThread; ++i) acc[i] = __fmaf_rn(c[i], s[k], acc[i]);
            }
        }
    }
}

// The pack's index: blockIdx.y, continued in blockIdx.z past 65535 packs.
__device__ __forceinline__ int64_t pack_index() { return int64_t(blockIdx.z) * gridDim.y + blockIdx.y; }

// ---------------------------------------------------------------------------------------------------------------
// Ops. Sizes in elements unless named *_bytes; a pack is blocks_per_pack blocks of codes then their float32 scales.

// Pack `chunks` slices of chunk_numel elements of x (numel elements) into `out`; pack p holds slice
// (p % nodes) * (chunks / nodes) + p / nodes (format.swizzle_source; slice p when nodes == 1). Elements past a
// slice's end or past numel read as 0. Grid: (tiles per pack, packs).
template <int Bits, int D>
__device__ __forceinline__ void quantize_chunks(const typename Elements<D>::T* __restrict__ x,
                                                uint8_t* __restrict__ out, int64_t numel, int64_t chunk_numel,
                                                int64_t blocks_per_pack, int64_t pack_bytes, int chunks, int nodes,
                                                int block_size) {
    const int64_t pack = pack_index();
    if (pack >= chunks) return;
    const int p = int(pack), per_node = chunks / nodes;
    const int64_t slice_start = int64_t((p % nodes) * per_node + p / nodes) * chunk_numel;
    const Place at(block_size);
    float v[kPerThread];
    load_elements<D>(x + slice_start + at.first, present(min(chunk_numel, numel - slice_start) - at.first), v);
    uint32_t w[Codes<Bits>::kWords];
    const float scale = quantize<Bits>(v, block_size / kPerThread, w);
    if (at.block < blocks_per_pack) {
        uint8_t* base = out + pack * pack_bytes;
        const int64_t block_code_bytes = block_size * Bits / 8;
        Codes<Bits>::store(base + at.block * block_code_bytes + at.lane * Codes<Bits>::kBytes, w);
        if (at.lane == 0) reinterpret_cast<float*>(base + blocks_per_pack * block_code_bytes)[at.block] = scale;
    }
}

// Dequantize pack k (of chunk_numel elements) into out[k * chunk_numel, ...), up to out_numel elements in all (the
// padding of each pack, and whatever lies past out_numel, is dropped). Grid: (tiles per pack, packs holding output).
template <int Bits, int D>
__device__ __forceinline__ void dequantize_chunks(const uint8_t* __restrict__ buf,
                                                  typename Elements<D>::T* __restrict__ out, int64_t out_numel,
                                                  int64_t chunk_numel, int64_t blocks_per_pack, int64_t pack_bytes,
                                                  int packs, int block_size) {
    const int64_t pack = pack_index();
    if (pack >= packs) return;
    const Place at(block_size);
    const int64_t start = pack * chunk_numel + at.first;
    const int count = present(min(chunk_numel - at.first, out_numel - start));
    if (count == 0) return;
    const uint8_t* base = buf + pack * pack_bytes;
    const int64_t block_code_bytes = block_size * Bits / 8;
    uint32_t w[Codes<Bits>::kWords];
    Codes<Bits>::load(base + at.block * block_code_bytes + at.lane * Codes<Bits>::kBytes, w);
    const float s = __ldg(reinterpret_cast<const float*>(base + blocks_per_pack * block_code_bytes) + at.block);
    float y[kPerThread];
    Codes<Bits>::decode(w, y);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) y[i] = __fmul_rn(y[i], s);
    // |code| <= 128, so below 2^120 no product nears FLT_MAX. Only float32 output can tell a clamped product from
    // an overflow to Inf: in bfloat16 and float16 both round to Inf.
    if (D == kFloat32 && !(fabsf(s) <= 0x1p120f)) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) y[i] = clamp_finite(y[i]);
    }
    store_elements<D>(out + start, count, y);
}

// Pack m of `out` (chunks packs of blocks_per_pack blocks) = the fused sum of packs g * chunks + m of `buf`,
// g < groups, requantized; whole blocks, padding included. Grid: (tiles per pack, chunks).
template <int Bits>
__device__ __forceinline__ void reduce_requantize(const uint8_t* __restrict__ buf, uint8_t* __restrict__ out,
                                                  int64_t blocks_per_pack, int64_t pack_bytes, int groups, int chunks,
                                                  int block_size) {
    const int64_t pack = pack_index();
    if (pack >= chunks) return;
    const Place at(block_size);
    const int64_t block_code_bytes = block_size * Bits / 8;
    const int64_t code_offset = pack * pack_bytes + at.block * block_code_bytes + at.lane * Codes<Bits>::kBytes;
    const int64_t scale_offset = pack * pack_bytes + blocks_per_pack * block_code_bytes + 4 * at.block;
    const bool valid = at.block < blocks_per_pack;
    float acc[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) acc[i] = 0.0f;
    if (valid) sum_groups<Bits>(buf + code_offset, buf + scale_offset, chunks * pack_bytes, groups, acc);
    uint32_t w[Codes<Bits>::kWords];
    const float scale = quantize<Bits>(acc, block_size / kPerThread, w);
    if (valid) {
        Codes<Bits>::store(out + code_offset, w);
        if (at.lane == 0) *reinterpret_cast<float*>(out + scale_offset) = scale;
    }
}

// The fused sum of `groups` packs of blocks_per_pack blocks, divided by `divisor`, into the first out_numel
// elements of `out`: multiplied by `reciprocal` (1 / divisor, exact: a power of two) unless exact_division.
// Grid: (tiles of out's blocks).
template <int Bits, int D>
__device__ __forceinline__ void reduce_dequantize(const uint8_t* __restrict__ buf,
                                                  typename Elements<D>::T* __restrict__ out, int64_t out_numel,
                                                  int64_t blocks_per_pack, int64_t pack_bytes, float divisor,
                                                  float reciprocal, int groups, int exact_division, int block_size) {
    const Place at(block_size);
    const int count = present(out_numel - at.first);
    if (count == 0) return;
    const int64_t block_code_bytes = block_size * Bits / 8;
    const int64_t code_offset = at.block * block_code_bytes + at.lane * Codes<Bits>::kBytes;
    const int64_t scale_offset = blocks_per_pack * block_code_bytes + 4 * at.block;
    float acc[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) acc[i] = 0.0f;
    sum_groups<Bits>(buf + code_offset, buf + scale_offset, pack_bytes, groups, acc);
    if (exact_division) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) acc[i] = __fdiv_rn(acc[i], divisor);
    } else {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) acc[i] = __fmul_rn(acc[i], reciprocal);
    }
    store_elements<D>(out + at.first, count, acc);
}

}  // namespace

// Bumped whenever a kernel's parameters change; zeropp/quant/native_cuda.py refuses a fatbin of another version.
extern "C" {
__device__ int zeropp_cuda_abi_version = 1;
}

// ---------------------------------------------------------------------------------------------------------------
// The extern "C" kernels, one per (op, bits, dtype): zeropp_<op>_b<bits>[_<dtype>], dtype f32, bf16 or f16 (the
// float tensor's). Launched by zeropp/quant/native_cuda.py with max(256, block_size / 16) threads per CTA.

#define ZEROPP_DTYPE_f32 kFloat32
#define ZEROPP_DTYPE_bf16 kBFloat16
#define ZEROPP_DTYPE_f16 kFloat16

#define ZEROPP_KERNELS(BITS, NAME)                                                                                \
    extern "C" __global__ void __launch_bounds__(kMaxThreads)                                                     \
        zeropp_quantize_chunks_b##BITS##_##NAME(const void* x, uint8_t* out, int64_t numel, int64_t chunk_numel,  \
                                                int64_t blocks_per_pack, int64_t pack_bytes, int chunks,          \
                                                int nodes, int block_size) {                                      \
        using T = Elements<ZEROPP_DTYPE_##NAME>::T;                                                               \
        quantize_chunks<BITS, ZEROPP_DTYPE_##NAME>(static_cast<const T*>(x), out, numel, chunk_numel,             \
                                                   blocks_per_pack, pack_bytes, chunks, nodes, block_size);       \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(kMaxThreads)                                                     \
        zeropp_dequantize_chunks_b##BITS##_##NAME(const uint8_t* buf, void* out, int64_t out_numel,               \
                                                  int64_t chunk_numel, int64_t blocks_per_pack,                   \
                                                  int64_t pack_bytes, int packs, int block_size) {                \
        using T = Elements<ZEROPP_DTYPE_##NAME>::T;                                                               \
        dequantize_chunks<BITS, ZEROPP_DTYPE_##NAME>(buf, static_cast<T*>(out), out_numel, chunk_numel,           \
                                                     blocks_per_pack, pack_bytes, packs, block_size);             \
    }                                                                                                             \
    extern "C" __global__ void __launch_bounds__(kMaxThreads)                                                     \
        zeropp_reduce_dequantize_b##BITS##_##NAME(const uint8_t* buf, void* out, int64_t out_numel,               \
                                                  int64_t blocks_per_pack, int64_t pack_bytes, float divisor,     \
                                                  float reciprocal, int groups, int exact_division,               \
                                                  int block_size) {                                               \
        using T = Elements<ZEROPP_DTYPE_##NAME>::T;                                                               \
        reduce_dequantize<BITS, ZEROPP_DTYPE_##NAME>(buf, static_cast<T*>(out), out_numel, blocks_per_pack,       \
                                                     pack_bytes, divisor, reciprocal, groups, exact_division,     \
                                                     block_size);                                                 \
    }

ZEROPP_KERNELS(8, f32)
ZEROPP_KERNELS(8, bf16)
ZEROPP_KERNELS(8, f16)
ZEROPP_KERNELS(4, f32)
ZEROPP_KERNELS(4, bf16)
ZEROPP_KERNELS(4, f16)

#define ZEROPP_REDUCE_REQUANTIZE(BITS)                                                                            \
    extern "C" __global__ void __launch_bounds__(kMaxThreads)                                                     \
        zeropp_reduce_requantize_b##BITS(const uint8_t* buf, uint8_t* out, int64_t blocks_per_pack,               \
                                         int64_t pack_bytes, int groups, int chunks, int block_size) {            \
        reduce_requantize<BITS>(buf, out, blocks_per_pack, pack_bytes, groups, chunks, block_size);               \
    }

ZEROPP_REDUCE_REQUANTIZE(8)
ZEROPP_REDUCE_REQUANTIZE(4)
