/* Tercel's matmul for GGUF's Q4_K blocks as they are stored, for the sampled rows: q4_matmul.c's
 * int4 products under Q4_K's own scales.
 *
 * Why: held as Q4_1 blocks (a bf16 scale and zero per 32 weights), a Q4_K weight costs 5 bits
 * against the file's 4.5, and its scales d * sc lose bits to bf16. Here a sub-block of 32
 * weights carries its 6-bit scale and min as bytes and every 256 weights their fp16 d and dmin,
 * as the file does; the products d * sc and dmin * mn (11 by 6 bits) are exact in fp32.
 *
 * Weights, packed at load by verifier/quantized/own_kernels/q4k.py:pack_q4k (w = (d * sc) * q
 * - dmin * mn per sub-block of 32 weights of a row, q in 0..15, d and dmin per 256): tiles of
 * Q4K_TILE = 16 output channels, a tile's K / 256 super-blocks in order, each Q4K_SUPER_BYTES:
 *   bytes 0..31      the 16 channels' d, fp16
 *   bytes 32..63     their dmin, fp16
 *   bytes 64..191    sc: byte 64 + 16 b + c is channel c's scale of sub-block b (0..63)
 *   bytes 192..319   mn: the mins, likewise
 *   bytes 320..2367  the 8 sub-blocks' nibbles, 256 bytes each (q4_nibbles.h)
 * Per channel, sub-block b and row, with A its exact integer sum (q4_nibbles.h), d_x and
 * d_x S the activations' block scale and scaled sum (act_quant.h), in sub-block order:
 *   y += (d * sc_b) * (float(A) * d_x);  y -= (dmin * mn_b) * (d_x S)        (two fmas)
 *
 * Exactness: as q4_matmul.c. Every output is computed by one thread over the sub-blocks in
 * order, with the same integer sums and float operations in the scalar reference, the AVX2 and
 * the AVX-512 paths (fp16 to fp32 is exact everywhere), so a row's output is bitwise the same
 * alone or among others (tests/kernels/test_q4k.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "act_quant.h"
#include "q4_nibbles.h"

#define Q4K_TILE 16
#define Q4K_ROWS 8            /* rows per pass over a tile's weights, as q4_matmul.c */
#define Q4K_SUB 8             /* sub-blocks of 32 weights per super-block */
#define Q4K_HEAD 320          /* d, dmin, sc, mn */
#define Q4K_SUPER_BYTES (Q4K_HEAD + Q4K_SUB * Q4_NIBBLE_BYTES)
#define Q4K_SUB_BYTES (Q4K_SUPER_BYTES / Q4K_SUB)     /* 296: a sub-block's share, for the runner */

/* A sub-block's share of the next super-block's bytes, so that the stream runs one
 * super-block (2368 bytes) ahead, about as far as q4_matmul.c's 8 blocks. */
static inline void prefetch_sub(const uint8_t *super, int b) {
    const uint8_t *p = super + Q4K_SUPER_BYTES + Q4K_SUB_BYTES * b;
    prefetch_range(p, Q4K_SUB_BYTES);
}

/* The scalar reference: channel by channel, the operations every path performs. */
static void q4k_tile_ref(const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    for (int64_t i = 0; i < rows * Q4K_TILE; i++) y[i] = 0.0f;
    for (int64_t s = 0; s < a->nb / Q4K_SUB; s++, w += Q4K_SUPER_BYTES) {
        const uint16_t *d = (const uint16_t *)w, *dmin = d + Q4K_TILE;
        for (int b = 0; b < Q4K_SUB; b++) {
            const uint8_t *nib = w + Q4K_HEAD + Q4_NIBBLE_BYTES * b;
            for (int64_t i = 0; i < rows; i++) {
                int64_t j = (r0 + i) * a->nb + Q4K_SUB * s + b;
                const int8_t *xq = a->q + j * 2 * ACT_BLOCK;
                for (int c = 0; c < Q4K_TILE; c++) {
                    float scale = f16_to_f32(d[c]) * (float)w[64 + 16 * b + c];
                    float mn = f16_to_f32(dmin[c]) * (float)w[192 + 16 * b + c];
                    float *yc = y + i * Q4K_TILE + c;
                    *yc = fmaf(scale, (float)nibble_sum_ref(nib, c, xq) * a->d[j], *yc);
                    *yc = fmaf(-mn, a->ds[j], *yc);
                }
            }
        }
    }
}

#if IMM_AVX512
static inline __m512 bytes_x16(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)p)));
}

static inline __attribute__((always_inline)) void q4k_tile_n(const uint8_t *w, const Act *a, int64_t r0,
                                                             const int rows, float *y) {
    __m512 acc[Q4K_ROWS];
    for (int i = 0; i < Q4K_ROWS; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < a->nb / Q4K_SUB; s++, w += Q4K_SUPER_BYTES) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)w));
        __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(w + 32)));
        for (int b = 0; b < Q4K_SUB; b++) {
            __m512i lo[4], hi[4];
            prefetch_sub(w, b);
            nibbles_load(w + Q4K_HEAD + Q4_NIBBLE_BYTES * b, lo, hi);
            __m512 scale = _mm512_mul_ps(d, bytes_x16(w + 64 + 16 * b));
            __m512 mn = _mm512_mul_ps(dmin, bytes_x16(w + 192 + 16 * b));
            #pragma GCC unroll 8
            for (int i = 0; i < rows; i++) {
                int64_t j = (r0 + i) * a->nb + Q4K_SUB * s + b;
                __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(nibble_sums(lo, hi, a->q + j * 2 * ACT_BLOCK)),
                                         _mm512_set1_ps(a->d[j]));
                acc[i] = _mm512_fmadd_ps(scale, f, acc[i]);
                acc[i] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a->ds[j]), acc[i]);
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) _mm512_storeu_ps(y + i * Q4K_TILE, acc[i]);
}

/* one copy of the loop per row count, so that each keeps its accumulators in registers */
static void q4k_tile_fast(const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    switch (rows) {
    case 1: q4k_tile_n(w, a, r0, 1, y); break;
    case 2: q4k_tile_n(w, a, r0, 2, y); break;
    case 3: q4k_tile_n(w, a, r0, 3, y); break;
    case 4: q4k_tile_n(w, a, r0, 4, y); break;
    case 5: q4k_tile_n(w, a, r0, 5, y); break;
    case 6: q4k_tile_n(w, a, r0, 6, y); break;
    case 7: q4k_tile_n(w, a, r0, 7, y); break;
    default: q4k_tile_n(w, a, r0, 8, y); break;
    }
}

#elif IMM_AVX2
static inline __m256 bytes_x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)p)));
}

/* One row's sub-block into 8 channels' sums: the steps every AVX2 pass takes (j: the row's block). */
static inline __attribute__((always_inline)) __m256 q4k_row_step(const __m256i lo[4], const __m256i hi[4],
                                                                 __m256 scale, __m256 mn, const Act *a, int64_t j,
                                                                 __m256 acc) {
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(nibble_sums(lo, hi, a->q + j * 2 * ACT_BLOCK)),
                             _mm256_set1_ps(a->d[j]));
    return _mm256_fnmadd_ps(mn, _mm256_set1_ps(a->ds[j]), _mm256_fmadd_ps(scale, f, acc));
}

/* One loop for every row count, as q4_matmul.c's (unrolled copies spill; NIBBLE_TILE_FAST). */
static void q4k_tile_stream(const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    __m256 acc[Q4K_ROWS][2];
    for (int i = 0; i < Q4K_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < a->nb / Q4K_SUB; s++, w += Q4K_SUPER_BYTES) {
        __m256 d[2], dmin[2];                    /* per half of the channels, for the 8 sub-blocks */
        for (int h = 0; h < 2; h++) {
            d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(w + 16 * h)));
            dmin[h] = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(w + 32 + 16 * h)));
        }
        for (int b = 0; b < Q4K_SUB; b++) {
            prefetch_sub(w, b);
            for (int h = 0; h < 2; h++) {        /* channels 8 h .. 8 h + 7 */
                __m256i lo[4], hi[4];
                nibbles_load(w + Q4K_HEAD + Q4_NIBBLE_BYTES * b, h, lo, hi);
                __m256 scale = _mm256_mul_ps(d[h], bytes_x8(w + 64 + 16 * b + 8 * h));
                __m256 mn = _mm256_mul_ps(dmin[h], bytes_x8(w + 192 + 16 * b + 8 * h));
                for (int i = 0; i < Q4K_ROWS; i++) {
                    if (i == rows) break;
                    acc[i][h] = q4k_row_step(lo, hi, scale, mn, a, (r0 + i) * a->nb + Q4K_SUB * s + b, acc[i][h]);
                }
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        _mm256_storeu_ps(y + i * Q4K_TILE, acc[i][0]);
        _mm256_storeu_ps(y + i * Q4K_TILE + 8, acc[i][1]);
    }
}

/* Channels 8 h .. 8 h + 7 for h from h0 to h1 - 1, of `rows` rows, over every super-block
 * (NIBBLE_TILE_FAST). d and dmin are converted per sub-block: held across a super-block they
 * would take registers the sums need. */
static inline __attribute__((always_inline)) void q4k_pass(const uint8_t *w, const Act *a, int64_t r0,
                                                           const int rows, const int h0, const int h1, float *y) {
    __m256 acc[NIBBLE_HALF_ROWS][2];
    for (int i = 0; i < NIBBLE_HALF_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t s = 0; s < a->nb / Q4K_SUB; s++, w += Q4K_SUPER_BYTES) {
        for (int b = 0; b < Q4K_SUB; b++) {
            for (int h = h0; h < h1; h++) {
                __m256i lo[4], hi[4];
                nibbles_load(w + Q4K_HEAD + Q4_NIBBLE_BYTES * b, h, lo, hi);
                __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const void *)(w + 16 * h))),
                                             bytes_x8(w + 64 + 16 * b + 8 * h));
                __m256 mn = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const void *)(w + 32 + 16 * h))),
                                          bytes_x8(w + 192 + 16 * b + 8 * h));
                for (int i = 0; i < rows; i++)
                    acc[i][h] = q4k_row_step(lo, hi, scale, mn, a, (r0 + i) * a->nb + Q4K_SUB * s + b, acc[i][h]);
            }
        }
    }
    for (int i = 0; i < rows; i++)
        for (int h = h0; h < h1; h++) _mm256_storeu_ps(y + i * Q4K_TILE + 8 * h, acc[i][h]);
}

NIBBLE_TILE_FAST(q4k_tile_fast, q4k_tile_stream, q4k_pass, Q4K_TILE)
#else
#define q4k_tile_fast q4k_tile_ref
#endif

/* One tile of rows r0 .. r0 + rows (ref: the scalar reference; K a multiple of 256), and a
 * sub-block's share of the bytes: what mixed_matmul.c's runner calls for this layout. */
void q4k_tile(int ref, const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    (ref ? q4k_tile_ref : q4k_tile_fast)(w, a, r0, rows, y);
}

int64_t q4k_block_bytes(void) { return Q4K_SUB_BYTES; }
