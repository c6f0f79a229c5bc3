/* bf16 as its uint16 bit pattern, and the two conversions every CPU kernel uses (decode_ops.c,
 * q4_matmul.c). verifier/cpu/cpu_ops.py keys the compiled library on this file too. */
#ifndef TERCEL_BF16_H
#define TERCEL_BF16_H

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

#endif
