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

/* One block's 32 values: its digits at qb (the 32 hi, then the 32 lo), d, and X's sum over each
 * half. The scalar reference; act_block_fast performs the same IEEE operations 8 lanes at a
 * time (a maximum and integer sums do not depend on the order of their terms). */
static void act_block_ref(const bf16 *xb, int8_t *qb, float *d_out, int32_t s[2]) {
    float v[ACT_BLOCK], amax = 0.0f;
    for (int i = 0; i < ACT_BLOCK; i++) {
        v[i] = bf16_to_f32(xb[i]);
        float u = fabsf(v[i]);
        amax = u > amax ? u : amax;
    }
    float d = amax / ACT_XMAX, id = d > 0.0f ? 1.0f / d : 0.0f;
    s[0] = s[1] = 0;
    for (int i = 0; i < ACT_BLOCK; i++) {
        float t = nearbyintf(v[i] * id);
        int32_t big = (int32_t)(t > ACT_XMAX ? ACT_XMAX : t < -ACT_XMAX ? -ACT_XMAX : t);
        int32_t hi = (big + 128) >> 8;
        qb[i] = (int8_t)hi, qb[ACT_BLOCK + i] = (int8_t)(big - 256 * hi);
        s[i >= ACT_BLOCK / 2] += big;
    }
    *d_out = d;
}

#if IMM_AVX512 || IMM_AVX2
static inline int32_t act_hsum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1)));
}

/* 32 int32 (4 x 8, in order) to 32 int8 in order: the packs interleave 128-bit lanes */
static inline __m256i act_pack8(__m256i a, __m256i b, __m256i c, __m256i e) {
    __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
    return _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void act_block_fast(const bf16 *xb, int8_t *qb, float *d_out, int32_t s[2]) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int g = 0; g < 4; g++) {
        __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(xb + 8 * g)));
        v[g] = _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
        amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[g]), amax);   /* u > amax ? u : amax */
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    float am = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    float d = am / ACT_XMAX, id = d > 0.0f ? 1.0f / d : 0.0f;
    __m256i big[4], hi[4], lo[4];
    for (int g = 0; g < 4; g++) {
        __m256 t = _mm256_round_ps(_mm256_mul_ps(v[g], _mm256_set1_ps(id)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);   /* nearbyintf */
        t = _mm256_max_ps(_mm256_min_ps(t, _mm256_set1_ps(ACT_XMAX)), _mm256_set1_ps(-ACT_XMAX));
        big[g] = _mm256_cvtps_epi32(t);
        hi[g] = _mm256_srai_epi32(_mm256_add_epi32(big[g], _mm256_set1_epi32(128)), 8);
        lo[g] = _mm256_sub_epi32(big[g], _mm256_slli_epi32(hi[g], 8));
    }
    _mm256_storeu_si256((void *)qb, act_pack8(hi[0], hi[1], hi[2], hi[3]));
    _mm256_storeu_si256((void *)(qb + ACT_BLOCK), act_pack8(lo[0], lo[1], lo[2], lo[3]));
    s[0] = act_hsum8(_mm256_add_epi32(big[0], big[1]));
    s[1] = act_hsum8(_mm256_add_epi32(big[2], big[3]));
    *d_out = d;
}
#else
#define act_block_fast act_block_ref
#endif

/* Row r of x (bf16 [M, K]) into a, block by block (ref: the scalar reference). */
static void act_quantize_row(const bf16 *x, int64_t r, int ref, Act *a) {
    for (int64_t b = 0; b < a->nb; b++) {
        int64_t j = r * a->nb + b;
        int32_t s[2];
        float d;
        (ref ? act_block_ref : act_block_fast)(x + r * a->k + b * ACT_BLOCK, a->q + j * 2 * ACT_BLOCK, &d, s);
        a->d[j] = d, a->s8[j] = 8 * (s[0] + s[1]), a->ds[j] = d * (float)(s[0] + s[1]);
        a->sh[2 * j] = s[0], a->sh[2 * j + 1] = s[1];
    }
}

/* Room for m rows of k values: 0, or 1 when out of memory; act_free releases it. */
static int act_alloc(Act *a, int64_t m, int64_t k) {
    a->k = k, a->nb = k / ACT_BLOCK;
    int64_t n = m * a->nb;
    char *buf = malloc((size_t)(2 * m * k + 20 * n + 64));
    if (!buf) return 1;
    a->d = (float *)buf, a->ds = a->d + n, a->s8 = (int32_t *)(a->ds + n), a->sh = a->s8 + n;
    a->q = (int8_t *)(a->sh + 2 * n);
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
