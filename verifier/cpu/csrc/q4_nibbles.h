/* The int4 weights' 256-byte nibble group, shared by q4_matmul.c (Q4_0 / Q4_1 blocks) and
 * q4k_matmul.c (Q4_K's sub-blocks): 16 channels x 32 weights, 4 groups j of 64 bytes, byte
 * 4 r + b of group j holding channel r's weight 4 j + b in its low nibble and 16 + 4 j + b in its
 * high one. What is computed from it per channel and row: A = 256 (sum of q * hi) + (sum of q * lo)
 * over the block's activation digits (act_quant.h), an exact integer below 2^24 in magnitude. */
#ifndef TERCEL_Q4_NIBBLES_H
#define TERCEL_Q4_NIBBLES_H

#include "act_quant.h"

#define Q4_NIBBLE_BYTES 256

/* channel c's weight i (0..31) of the group at w */
static inline int32_t nibble_q(const uint8_t *w, int c, int i) {
    uint8_t byte = w[64 * ((i % 16) / 4) + 4 * c + i % 4];
    return i < 16 ? byte & 15 : byte >> 4;
}

/* A for one channel: the scalar reference's sum */
static inline int32_t nibble_sum_ref(const uint8_t *w, int c, const int8_t *xq) {
    int32_t acc[2] = {0, 0};
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < ACT_BLOCK; i++) acc[h] += nibble_q(w, c, i) * xq[h * ACT_BLOCK + i];
    return acc[0] * 256 + acc[1];
}

#if IMM_AVX512
static inline __attribute__((always_inline)) void nibbles_load(const uint8_t *w, __m512i lo[4], __m512i hi[4]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int g = 0; g < 4; g++) {
        __m512i p = _mm512_loadu_si512(w + 64 * g);
        lo[g] = _mm512_and_si512(p, low);
        hi[g] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
    }
}

/* A of the 16 channels, one per 32-bit lane */
static inline __attribute__((always_inline)) __m512i nibble_sums(const __m512i lo[4], const __m512i hi[4],
                                                                 const int8_t *xq) {
    __m512i s = _mm512_setzero_si512(), t = _mm512_setzero_si512();
    for (int g = 0; g < 4; g++) {
        s = dot_bcast(s, lo[g], xq + 4 * g);
        s = dot_bcast(s, hi[g], xq + 16 + 4 * g);
        t = dot_bcast(t, lo[g], xq + ACT_BLOCK + 4 * g);
        t = dot_bcast(t, hi[g], xq + ACT_BLOCK + 16 + 4 * g);
    }
    return _mm512_add_epi32(_mm512_slli_epi32(s, 8), t);
}
#elif IMM_AVX2
/* channels 8 h .. 8 h + 7 */
static inline __attribute__((always_inline)) void nibbles_load(const uint8_t *w, int h, __m256i lo[4],
                                                               __m256i hi[4]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int g = 0; g < 4; g++) {
        __m256i p = _mm256_loadu_si256((const void *)(w + 64 * g + 32 * h));
        lo[g] = _mm256_and_si256(p, low);
        hi[g] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
    }
}

/* One digit's 32 products per channel: vpmaddubsw sums two u8 x s8 products per 16-bit half
 * lane (|2 * 15 * 128| = 3840), eight of those add up in 16 bits exactly (30720 < 32768), and
 * one vpmaddwd then adds the two halves into the channel's 32-bit lane. Widening once per
 * digit instead of once per vpmaddubsw takes a row's multiplies per block from 64 to 36; the
 * sum is the same integer. `x` is the digit's 32 values. */
static inline __m256i dot32(const __m256i lo[4], const __m256i hi[4], const int8_t *x) {
    __m256i s = _mm256_maddubs_epi16(lo[0], bcast4(x));
    s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[0], bcast4(x + 16)));
    for (int g = 1; g < 4; g++) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[g], bcast4(x + 4 * g)));
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[g], bcast4(x + 16 + 4 * g)));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* A of 8 channels */
static inline __attribute__((always_inline)) __m256i nibble_sums(const __m256i lo[4], const __m256i hi[4],
                                                                 const int8_t *xq) {
    __m256i s = dot32(lo, hi, xq), t = dot32(lo, hi, xq + ACT_BLOCK);
    return _mm256_add_epi32(_mm256_slli_epi32(s, 8), t);
}

#define NIBBLE_HALF_ROWS 4   /* rows whose sums stay in registers beside a half tile's nibbles */

/* Defines `name`, an AVX2 tile function (w, a, r0, rows, y) of q4_matmul.c and q4k_matmul.c. A
 * tile's first rows (the runner's r0 0) read it from memory: `stream` takes up to 8 in one pass
 * over both halves of the channels, so that their products overlap the stream. Later rows find
 * it in the caches: `pass` (w, a, r0, rows, h0, h1, y: halves h0 .. h1 - 1, always inline) takes
 * them four at a time, 2 rows over both halves or 3-4 over one half at a time, since the
 * nibbles' 8 registers leave room for 4 sums (8 rows over both halves spill theirs). Every path
 * performs the same operations per output in the same order: the same bits. */
#define NIBBLE_TILE_FAST(name, stream, pass, tile)                                                    \
    static void name(const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {           \
        if (r0 == 0) {                                                                                 \
            stream(w, a, r0, rows, y);                                                                 \
            return;                                                                                    \
        }                                                                                              \
        for (int64_t i = 0; i < rows; i += NIBBLE_HALF_ROWS) {                                         \
            float *yi = y + i * (tile);                                                                \
            switch (rows - i < NIBBLE_HALF_ROWS ? rows - i : NIBBLE_HALF_ROWS) {                       \
            case 1: pass(w, a, r0 + i, 1, 0, 2, yi); break;                                            \
            case 2: pass(w, a, r0 + i, 2, 0, 2, yi); break;                                            \
            case 3: pass(w, a, r0 + i, 3, 0, 1, yi); pass(w, a, r0 + i, 3, 1, 2, yi); break;           \
            default: pass(w, a, r0 + i, 4, 0, 1, yi); pass(w, a, r0 + i, 4, 1, 2, yi); break;          \
            }                                                                                          \
        }                                                                                              \
    }
#endif

#endif
