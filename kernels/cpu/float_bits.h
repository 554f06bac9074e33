// Float bit helpers shared by the CPU kernels (quant.cpp, adam.cpp): reinterpretation, and float -> float16 /
// bfloat16 rounding to nearest even on the bits, in integer and exact float operations that vectorize. NaN stays a
// (quiet) NaN. Included inside each file's anonymous namespace, after ZEROPP_INLINE is defined.
#pragma once

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

ZEROPP_INLINE uint16_t float_to_half(float v) {
    uint32_t u = bits_of(v);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    const uint32_t special = u > 0x7F800000u ? 0x7E00u : 0x7C00u;  // NaN, or Inf (also for 65520 and more)
    const uint32_t subnormal = bits_of(float_of(u) + 0.5f) - 0x3F000000u;  // adding 0.5 rounds at the half step
    const uint32_t normal = (u + 0xC8000FFFu + ((u >> 13) & 1)) >> 13;  // rebias, round 13 bits to nearest even
    const uint32_t o = u >= 0x47800000u ? special : (u < (113u << 23) ? subnormal : normal);
    return uint16_t(o | (sign >> 16));
}

ZEROPP_INLINE uint16_t float_to_bfloat16(float v) {
    const uint32_t u = bits_of(v);
    const uint32_t rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;  // round 16 bits to nearest even
    return uint16_t(v != v ? (u >> 16) | 0x40 : rounded);            // NaN stays NaN (quiet)
}
