/* IEEE 754 binary16 (GGUF's fp16 block scales) <-> binary32 in plain C, exact and portable: the conversions
 * linear_quant.c and linear_q8.c share (their vector paths use F16C's _cvtsh_ss instead, the same bits for every
 * non-NaN value).
 *
 * g4h_f16_to_f32: the fp16 value widened exactly (subnormals normalised; infinities kept; a NaN stays a NaN, its
 *   payload moved to the top of the fp32 mantissa).
 * g4h_f16_load: the little-endian fp16 at p (a block's d or dmin), widened.
 * g4h_f32_to_f16: round to nearest even; overflow to infinity; NaN stays NaN (quiet).
 * Source of the format: IEEE 754-2008 binary16; ggml-impl.h's ggml_compute_fp16_to_fp32 /
 * ggml_compute_fp32_to_fp16 (the portable branch) are the same conversions.
 *
 * A kernel that includes this file is built again when it changes: fast/cpu_kernels.py's build() keys its cache by
 * the bytes of every header beside the source (tests/test_quant_kernels.py checks it for both kernels).
 */
#ifndef G4H_FP16_H
#define G4H_FP16_H

#include <stdint.h>
#include <string.h>

static inline float g4h_f16_to_f32(uint16_t h) {
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    if (e == 0 && m == 0) {
        bits = s;
    } else if (e == 0) { /* subnormal: m * 2^-24, normalised */
        e = 113;
        while (!(m & 0x400u)) { m <<= 1; e--; }
        bits = s | (e << 23) | ((m & 0x3ffu) << 13);
    } else if (e == 31) {
        bits = s | 0x7f800000u | (m << 13);
    } else {
        bits = s | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float g4h_f16_load(const uint8_t *p) { return g4h_f16_to_f32((uint16_t)(p[0] | (p[1] << 8))); }

static inline uint16_t g4h_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
    if (e == 0xffu) return (uint16_t)(sign | 0x7c00u | (m ? 0x200u | (m >> 13) : 0u));
    int he = (int)e - 127 + 15;
    if (he >= 31) return (uint16_t)(sign | 0x7c00u);
    if (he <= 0) { /* fp16 subnormal (or zero): units of 2^-24 */
        if (e == 0) return (uint16_t)sign; /* fp32 zero or subnormal: far below 2^-25 */
        int shift = 14 - he;
        if (shift > 24) return (uint16_t)sign;
        m |= 0x800000u;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((uint32_t)he << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++; /* a carry into the exponent is right (up to inf) */
    return (uint16_t)(sign | r);
}

#endif
