/* What the integer matmuls (q4_matmul.c, q8_matmul.c) share: the instruction set they are built
 * for, its vector helpers, and the activations quantized to integers: each row of x (bf16 [M, K])
 * per 32 values, X = round(x / d) with d = max |x| / 32512, held as two int8 digits
 * X = 256 hi + lo (lo in -128..127, hi in -127..127). verifier/cpu/cpu_ops.py keys the compiled
 * library on this file too. */
#ifndef TERCEL_ACT_QUANT_H
#define TERCEL_ACT_QUANT_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IMM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define IMM_AVX2 1
#include <immintrin.h>
#endif

#define ACT_BLOCK 32
#define ACT_XMAX 32512.0f   /* the largest |X|: 256 * 127, so that hi fits an int8 */

/* One call's activations: q int8 [M, K / 32, 64] (per block the 32 hi digits, then the 32 lo
 * ones); per row and block: d, 8 S and d * S (S = sum of X), and S over each half (16 values). */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *s8, *sh;
    int64_t k, nb;
} Act;

/* Row by row, block by block: plain loops the compiler vectorizes; no reduction depends on
 * the order of its terms (a maximum, an integer sum). */
static void act_quantize_rows(const bf16 *x, int64_t m, int64_t k, Act *a) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < a->nb; b++) {
            const bf16 *xb = x + r * k + b * ACT_BLOCK;
            float v[ACT_BLOCK], amax = 0.0f;
            for (int i = 0; i < ACT_BLOCK; i++) {
                v[i] = bf16_to_f32(xb[i]);
                float u = fabsf(v[i]);
                amax = u > amax ? u : amax;
            }
            float d = amax / ACT_XMAX, id = d > 0.0f ? 1.0f / d : 0.0f;
            int8_t *qb = a->q + (r * a->nb + b) * 2 * ACT_BLOCK;
            int32_t s[2] = {0, 0};
            for (int i = 0; i < ACT_BLOCK; i++) {
                float t = nearbyintf(v[i] * id);
                int32_t big = (int32_t)(t > ACT_XMAX ? ACT_XMAX : t < -ACT_XMAX ? -ACT_XMAX : t);
                int32_t hi = (big + 128) >> 8;
                qb[i] = (int8_t)hi, qb[ACT_BLOCK + i] = (int8_t)(big - 256 * hi);
                s[i >= ACT_BLOCK / 2] += big;
            }
            int64_t j = r * a->nb + b;
            a->d[j] = d, a->s8[j] = 8 * (s[0] + s[1]), a->ds[j] = d * (float)(s[0] + s[1]);
            a->sh[2 * j] = s[0], a->sh[2 * j + 1] = s[1];
        }
}

/* 0, or 1 when out of memory; act_free releases it. */
static int act_new(Act *a, const bf16 *x, int64_t m, int64_t k) {
    a->k = k, a->nb = k / ACT_BLOCK;
    int64_t n = m * a->nb;
    char *buf = malloc((size_t)(2 * m * k + 20 * n + 64));
    if (!buf) return 1;
    a->d = (float *)buf, a->ds = a->d + n, a->s8 = (int32_t *)(a->ds + n), a->sh = a->s8 + n;
    a->q = (int8_t *)(a->sh + 2 * n);
    act_quantize_rows(x, m, k, a);
    return 0;
}

static void act_free(Act *a) { free(a->d); }

/* Every cache line of [p, p + n): blocks of 296 or 416 bytes start anywhere in a line, and a
 * prefetch per 64 bytes from p would leave a block's last line to a demand miss. */
static inline void prefetch_range(const uint8_t *p, int64_t n) {
    for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < (uintptr_t)p + (uintptr_t)n; a += 64)
        __builtin_prefetch((const void *)a, 0, 3);
}

static inline void store_row(const float *y, int64_t valid, bf16 *out) {
    for (int64_t i = 0; i < valid; i++) out[i] = f32_to_bf16(y[i]);
}

#if IMM_AVX512
static inline __m512 bf16x16(const void *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
}

/* acc += w (u8) . the four s8 at x, broadcast: one instruction with its memory operand
 * (the compiler loads the broadcast into a register first, an instruction per product). */
static inline __m512i dot_bcast(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}
#elif IMM_AVX2
static inline __m256 bf16x8(const void *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#endif

#endif
