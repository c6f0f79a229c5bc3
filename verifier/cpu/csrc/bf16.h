/* bf16 as its uint16 bit pattern, and the two conversions every CPU kernel uses (decode_ops.c,
 * q4_matmul.c); fp16 to fp32 for the K-quants' d (q4k_matmul.c, q8_matmul.c's scalar paths).
 * verifier/cpu/cpu_ops.py keys the compiled library on this file too. */
#ifndef TERCEL_BF16_H
#define TERCEL_BF16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) {           /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    return (bf16)(nan ? (u >> 16) | 0x40 : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* IEEE half to single, exact (as vcvtph2ps) */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, man = h & 0x3ff, bits;
    if (e == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    bits = sign | (e == 31 ? 0x7f800000u | (man << 13) : ((e + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#endif
