/* Tercel's own int4 matmul for the sampled rows (decode steps, tree nodes): int4 weights
 * against activations quantized to integers, as llama.cpp's Q4_1 x Q8_1 dot products, but
 * with 15 bits held in two int8 digits (one digit cost 1.4 points of top-1 agreement).
 *
 * Why: torch's int4 kernel converts the weights for every row it multiplies, so on these
 * CPUs each verify row past the first costs about a fifth of a decode step, and a tree of 8
 * rows costs 2.7 of them (figures: docs/quantization.md). Here a tile of weights is unpacked
 * once into registers and multiplied into up to Q4_ROWS rows by integer dot products (VNNI's
 * vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd): the weight stream, which bounds a decode step,
 * is read once for all of them.
 *
 * Weights, packed at load by verifier/quantized/own_kernels/q4x16.py:pack_q4 (w = (q - 8) *
 * scale + zero per 32 weights of a row, q in 0..15): tiles of Q4_TILE = 16 output channels, a tile's K / 32
 * blocks in order, each Q4_BLOCK_BYTES = 320 bytes:
 *   bytes 0..255    4 groups j of 64 bytes; byte 4 r + b of group j holds channel r's
 *                   weight 4 j + b in its low nibble and weight 16 + 4 j + b in its high one
 *   bytes 256..287  the 16 channels' scales, bf16
 *   bytes 288..319  the 16 channels' zeros, bf16
 * so that one 32-bit lane of a vector is one channel and vpdpbusd against four activation
 * bytes broadcast to every lane adds four products into each of 16 channels.
 *
 * Activations (act_quant.h): each row of x (bf16 [M, K]) is quantized per 32 values before the
 * tiles run, X = round(x / d) with d = max |x| / 32512, stored as two int8 digits X = 256 hi + lo
 * (lo in -128..127). For a channel and a block, with A = 256 (sum of q * hi) + (sum of q * lo)
 * (an exact integer, below 2^24 in magnitude after the - 8 S) and S = sum of X:
 *   y += scale * (float(A - 8 S) * d) + zero * (d * S)          (two fmas, in block order)
 *
 * Exactness: every output is computed by one thread, over the blocks in order, with the
 * same integer sums and the same float operations whatever M, the thread count or the
 * instruction set (the integer sums are exact; the float steps are the same IEEE operations
 * in the scalar reference `q4_matmul_ref`, the AVX2 and the AVX-512 paths). A row's output
 * is therefore bitwise the same alone or among others (tests/kernels/test_q4.py).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "act_quant.h"
#include "q4_nibbles.h"

#define Q4_TILE 16
#define Q4_BLOCK ACT_BLOCK
#define Q4_BLOCK_BYTES 320
#define Q4_ROWS 8          /* rows multiplied per pass over a tile's weights (registers) */
#define Q4_AHEAD 8         /* blocks prefetched ahead (see prefetch_block) */

/* The block Q4_AHEAD blocks on: the weight stream bounds a one-row call, and the hardware
 * prefetchers alone left it at 0.7-0.8 of the speed with it (4 to 16 blocks ahead measured
 * alike; docs/quantization.md). Past a tile's end it reaches into the next tile, which the
 * same thread takes next under the static schedule. */
static inline void prefetch_block(const uint8_t *w) {
    for (int l = 0; l < Q4_BLOCK_BYTES; l += 64) __builtin_prefetch(w + Q4_AHEAD * Q4_BLOCK_BYTES + l, 0, 3);
}

/* The scalar reference: channel by channel, the operations every path performs. */
static void tile_ref(const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    for (int64_t i = 0; i < rows * Q4_TILE; i++) y[i] = 0.0f;
    for (int64_t b = 0; b < a->nb; b++, w += Q4_BLOCK_BYTES) {
        const bf16 *sc = (const bf16 *)(w + 256), *ze = (const bf16 *)(w + 288);
        for (int64_t i = 0; i < rows; i++) {
            int64_t j = (r0 + i) * a->nb + b;
            const int8_t *xq = a->q + j * 2 * Q4_BLOCK;
            for (int c = 0; c < Q4_TILE; c++) {
                float f = (float)(nibble_sum_ref(w, c, xq) - a->s8[j]) * a->d[j];
                float *yc = y + i * Q4_TILE + c;
                *yc = fmaf(bf16_to_f32(sc[c]), f, *yc);
                *yc = fmaf(bf16_to_f32(ze[c]), a->ds[j], *yc);
            }
        }
    }
}

#if IMM_AVX512
static inline __attribute__((always_inline)) void tile_n(const uint8_t *w, const Act *a, int64_t r0, const int rows,
                                                         float *y) {
    __m512 acc[Q4_ROWS];
    for (int i = 0; i < Q4_ROWS; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++, w += Q4_BLOCK_BYTES) {
        __m512i lo[4], hi[4];
        prefetch_block(w);
        nibbles_load(w, lo, hi);
        __m512 sc = bf16x16(w + 256), ze = bf16x16(w + 288);
        #pragma GCC unroll 8
        for (int i = 0; i < rows; i++) {
            int64_t j = (r0 + i) * a->nb + b;
            const int8_t *xq = a->q + j * 2 * Q4_BLOCK;
            __m512i s = _mm512_sub_epi32(nibble_sums(lo, hi, xq), _mm512_set1_epi32(a->s8[j]));
            __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a->d[j]));
            acc[i] = _mm512_fmadd_ps(sc, f, acc[i]);
            acc[i] = _mm512_fmadd_ps(ze, _mm512_set1_ps(a->ds[j]), acc[i]);
        }
    }
    for (int64_t i = 0; i < rows; i++) _mm512_storeu_ps(y + i * Q4_TILE, acc[i]);
}

#elif IMM_AVX2
/* One row's block into 8 channels' sums: the steps every AVX2 pass takes (j: the row's block). */
static inline __attribute__((always_inline)) __m256 row_step(const __m256i lo[4], const __m256i hi[4], __m256 sc,
                                                             __m256 ze, const Act *a, int64_t j, __m256 acc) {
    __m256i s = _mm256_sub_epi32(nibble_sums(lo, hi, a->q + j * 2 * Q4_BLOCK), _mm256_set1_epi32(a->s8[j]));
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a->d[j]));
    return _mm256_fmadd_ps(ze, _mm256_set1_ps(a->ds[j]), _mm256_fmadd_ps(sc, f, acc));
}

/* One loop for every row count: with 16 registers, copies unrolled per count (as the AVX-512
 * path has) spill and measured 10-15% slower at 3 to 8 rows (NIBBLE_TILE_FAST). */
static void tile_stream(const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    __m256 acc[Q4_ROWS][2];
    for (int i = 0; i < Q4_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++, w += Q4_BLOCK_BYTES) {
        prefetch_block(w);
        for (int h = 0; h < 2; h++) {            /* channels 8 h .. 8 h + 7 */
            __m256i lo[4], hi[4];
            nibbles_load(w, h, lo, hi);
            __m256 sc = bf16x8(w + 256 + 16 * h), ze = bf16x8(w + 288 + 16 * h);
            for (int i = 0; i < Q4_ROWS; i++) {
                if (i == rows) break;
                acc[i][h] = row_step(lo, hi, sc, ze, a, (r0 + i) * a->nb + b, acc[i][h]);
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        _mm256_storeu_ps(y + i * Q4_TILE, acc[i][0]);
        _mm256_storeu_ps(y + i * Q4_TILE + 8, acc[i][1]);
    }
}

/* Channels 8 h .. 8 h + 7 for h from h0 to h1 - 1, of `rows` rows (NIBBLE_TILE_FAST). */
static inline __attribute__((always_inline)) void tile_pass(const uint8_t *w, const Act *a, int64_t r0,
                                                            const int rows, const int h0, const int h1, float *y) {
    __m256 acc[NIBBLE_HALF_ROWS][2];
    for (int i = 0; i < NIBBLE_HALF_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++, w += Q4_BLOCK_BYTES) {
        for (int h = h0; h < h1; h++) {
            __m256i lo[4], hi[4];
            nibbles_load(w, h, lo, hi);
            __m256 sc = bf16x8(w + 256 + 16 * h), ze = bf16x8(w + 288 + 16 * h);
            for (int i = 0; i < rows; i++) acc[i][h] = row_step(lo, hi, sc, ze, a, (r0 + i) * a->nb + b, acc[i][h]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int h = h0; h < h1; h++) _mm256_storeu_ps(y + i * Q4_TILE + 8 * h, acc[i][h]);
}

NIBBLE_TILE_FAST(tile_fast, tile_stream, tile_pass, Q4_TILE)
#endif

#if IMM_AVX512
/* one copy of the loop per row count, so that each keeps its accumulators in registers */
static void tile_fast(const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    switch (rows) {
    case 1: tile_n(w, a, r0, 1, y); break;
    case 2: tile_n(w, a, r0, 2, y); break;
    case 3: tile_n(w, a, r0, 3, y); break;
    case 4: tile_n(w, a, r0, 4, y); break;
    case 5: tile_n(w, a, r0, 5, y); break;
    case 6: tile_n(w, a, r0, 6, y); break;
    case 7: tile_n(w, a, r0, 7, y); break;
    default: tile_n(w, a, r0, 8, y); break;
    }
}
#elif !IMM_AVX2
#define tile_fast tile_ref
#endif

/* mixed_matmul.c's runner: every int4 matmul is a weight of one part */
int64_t parts_matmul(int ref, const uint8_t *w, const int64_t *table, int64_t nparts, int64_t n, int64_t k,
                     const bf16 *x, int64_t m, bf16 *out);

/* out bf16 [M, N] = x bf16 [M, K] @ W.T for W packed as above (ceil(N / 16) tiles, K a
 * multiple of 32). Returns 0, or 1 (K not a multiple of 32, or no memory). */
int64_t q4_matmul(const uint8_t *w, int64_t n, int64_t k, const bf16 *x, int64_t m, bf16 *out) {
    const int64_t part[3] = {n, 4, 0};
    return parts_matmul(0, w, part, 1, n, k, x, m, out);
}

/* The same through the scalar reference (tests compare the two bit for bit). */
int64_t q4_matmul_ref(const uint8_t *w, int64_t n, int64_t k, const bf16 *x, int64_t m, bf16 *out) {
    const int64_t part[3] = {n, 4, 0};
    return parts_matmul(1, w, part, 1, n, k, x, m, out);
}

/* One tile of rows r0 .. r0 + rows (ref: the scalar reference), and a block's bytes: what
 * mixed_matmul.c's runner calls for this layout. */
void q4_tile(int ref, const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y) {
    (ref ? tile_ref : tile_fast)(w, a, r0, rows, y);
}

int64_t q4_block_bytes(void) { return Q4_BLOCK_BYTES; }

/* Which path q4_matmul takes on this build: 512 (AVX-512 VNNI), 256 (AVX2) or 0 (scalar). */
int64_t q4_isa(void) {
#if IMM_AVX512
    return 512;
#elif IMM_AVX2
    return 256;
#else
    return 0;
#endif
}
