/* Tercel's matmul for GGUF's 5-, 6- and 8-bit blocks (Q5_0, Q6_K, Q8_0) as they are stored:
 * the int4 kernel's scheme (q4_matmul.c) with wider weights, for the sampled rows.
 *
 * Why: a Q4_K_M file mixes Q4_K with Q6_K (and Q5_0 / Q8_0 where a row is not a multiple of
 * 256); requantizing those to 4 bits, or to int8 per channel, loses the file's accuracy, and
 * dequantizing them to fp32 makes the model several times slower than its int4 neighbours.
 *
 * Weights, packed at load by verifier/quantized/own_kernels/q8x16.py:pack_q8 (w = q * scale
 * per `group` = 16 or 32 weights of a row, q in -2^(bits-1) .. 2^(bits-1) - 1, bits 5, 6 or 8), held as
 * u = q + 2^(bits-1): tiles of Q8_TILE = 16 output channels, a tile's K / 32 blocks in order,
 * each 256 + 64 (bits - 4) + 32 (32 / group) bytes. Vector v (0..7, 64 bytes: byte 4 c + e for channel c) holds
 * the weights 16 (v / 4) + 4 (v % 4) + e, so vectors 0..3 are the first half-block:
 *   5 and 6 bits: bytes 0..255, u's low four bits: byte 64 g + 4 c + e holds vector g's in its
 *                    low nibble and vector 4 + g's in its high one (q4_matmul.c's nibbles);
 *                    then per bit p of u's bits 4 .. bits-1, 64 bytes, as planes (AVX2 and
 *                    scalar builds): bit v of byte 4 c + e is bit p of vector v's weight there;
 *                    or as masks (AVX-512 builds, Q8_PLANE_MASKS): 8 bytes per vector v, whose
 *                    bit 4 c + e (little-endian) is that bit, so that one kmovq loads the mask
 *                    of a masked add where planes took a test per vector (q8_plane_masks tells
 *                    the packer which)
 *   8 bits:       bytes 0..511, vector v's u at 64 v + 4 c + e (no unpacking)
 *   then the 16 channels' bf16 scales: for weights 0..15, then for 16..31 (group 16), or for
 *                    all 32 (group 32: the bytes the file's Q5_0 or Q8_0 block spends);
 *                    or (group 256, Q6_K's own: w = (d * sc) * q per 16 weights, an int8 sc per
 *                    16 and an fp16 d per 256) the 16 channels' sc, int8, for 0..15 then 16..31,
 *                    and before every 8 blocks the channels' d, fp16 (32 bytes): 6.56 bits a
 *                    weight where bf16 scales per 16 take 7, and d * sc exact in fp32
 * Per channel, block and scale group h, with A = 256 (sum of u * hi) + (sum of u * lo) over the
 * group (an exact integer) and S its activations' sum (act_quant.h):
 *   y += scale_h * (float(A - 2^(bits-1) S) * d)          (one fma per group, in order)
 *
 * Exactness: as q4_matmul.c. Every output is computed by one thread, over the blocks in order,
 * with the same integer sums and the same float operations in the scalar reference, the AVX2
 * and the AVX-512 paths, so a row's output is bitwise the same alone or among others
 * (tests/kernels/test_q8.py).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "act_quant.h"

#define Q8_TILE 16
#define Q8_ROWS 8          /* rows multiplied per pass over a tile's weights (registers) */
#define Q8_AHEAD 8         /* blocks prefetched ahead, as q4_matmul.c */
#define Q8_BLOCK_BYTES(planes, halves) (256 + 64 * (planes) + 32 * (halves))
#if IMM_AVX512                       /* the higher bits' layout: masks where kmovq loads them */
#define Q8_PLANE_MASKS 1
#else
#define Q8_PLANE_MASKS 0
#endif

#define Q8_SUPER 8                     /* blocks under one d, for group 256 */
#define Q8_SUPER_HEAD 32               /* the 16 channels' d, fp16 */

typedef struct {
    int64_t planes, bytes;      /* bits - 4, bytes per block (without the d before a super-block) */
    int32_t off;                /* 2^(bits-1) */
    int halves;                 /* scales per block: 2 (group 16 and 256) or 1 (group 32) */
    int super;                  /* group 256: int8 scales under a d per 8 blocks */
} Weights;

static inline void prefetch_q8(const Weights *wt, const uint8_t *w) {
    prefetch_range(w + Q8_AHEAD * wt->bytes, wt->bytes);
}

/* u of channel c, weight i (0..31) of the block at w. */
static inline int32_t weight_u(const uint8_t *w, int64_t planes, int c, int i) {
    int h = i >= 16, g = (i % 16) / 4, e = i % 4, v = 4 * h + g, byte = 4 * c + e;
    if (planes == 4) return w[64 * v + byte];
    int32_t u = (w[64 * g + byte] >> (4 * h)) & 15;
    for (int p = 0; p < planes; p++) {
        const uint8_t *plane = w + 256 + 64 * p;
        int bit = Q8_PLANE_MASKS ? (plane[8 * v + byte / 8] >> (byte % 8)) & 1 : (plane[byte] >> v) & 1;
        u |= bit << (4 + p);
    }
    return u;
}

/* The scalar reference: channel by channel, the operations every path performs. */
static void q8_tile_ref(const Weights *wt, const Act *a, int64_t r0, int64_t rows, const uint8_t *w, float *y) {
    const uint16_t *dk = NULL;
    for (int64_t i = 0; i < rows * Q8_TILE; i++) y[i] = 0.0f;
    for (int64_t b = 0; b < a->nb; b++, w += wt->bytes) {
        if (wt->super && b % Q8_SUPER == 0) dk = (const uint16_t *)w, w += Q8_SUPER_HEAD;
        const uint8_t *sw = w + 256 + 64 * wt->planes;
        for (int64_t i = 0; i < rows; i++) {
            int64_t j = (r0 + i) * a->nb + b;
            const int8_t *xq = a->q + j * 2 * ACT_BLOCK;
            for (int c = 0; c < Q8_TILE; c++) {
                float *yc = y + i * Q8_TILE + c;
                int per = ACT_BLOCK / wt->halves;
                for (int h = 0; h < wt->halves; h++) {
                    int32_t hi = 0, lo = 0, s = 0;
                    for (int l = per * h; l < per * h + per; l++) {
                        int32_t u = weight_u(w, wt->planes, c, l);
                        hi += u * xq[l], lo += u * xq[ACT_BLOCK + l];
                    }
                    for (int q = h * 2 / wt->halves; q < (h + 1) * 2 / wt->halves; q++) s += a->sh[2 * j + q];
                    float f = (float)(hi * 256 + lo - wt->off * s) * a->d[j];
                    float scale = wt->super ? f16_to_f32(dk[c]) * (float)(int8_t)sw[Q8_TILE * h + c]
                                            : bf16_to_f32(((const bf16 *)sw)[Q8_TILE * h + c]);
                    *yc = fmaf(scale, f, *yc);
                }
            }
        }
    }
}

#if IMM_AVX512

static inline __m512 int8x16(const uint8_t *p) {      /* 16 int8 scales as floats */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p)));
}

static inline __attribute__((always_inline)) void q8_tile_n(const Weights *wt, const Act *a, int64_t r0,
                                                            const int rows, const uint8_t *w, float *y) {
    __m512 acc[Q8_ROWS];
    for (int i = 0; i < Q8_ROWS; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 dk = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++, w += wt->bytes) {
        __m512i u[8];
        if (wt->super && b % Q8_SUPER == 0)
            dk = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)w)), w += Q8_SUPER_HEAD;
        prefetch_q8(wt, w);
        if (wt->planes == 4) {
            for (int v = 0; v < 8; v++) u[v] = _mm512_loadu_si512(w + 64 * v);
        } else {
            for (int g = 0; g < 4; g++) {
                __m512i p = _mm512_loadu_si512(w + 64 * g);
                u[g] = _mm512_and_si512(p, low);
                u[4 + g] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
            }
            for (int p = 0; p < wt->planes; p++) {     /* mask v: where bit 4 + p of u[v]'s is set */
                __mmask64 *masks = (__mmask64 *)(w + 256 + 64 * p);     /* _load_mask64 takes no const */
                __m512i bit = _mm512_set1_epi8((char)(16 << p));
                #pragma GCC unroll 8
                for (int v = 0; v < 8; v++) u[v] = _mm512_mask_add_epi8(u[v], _load_mask64(masks + v), u[v], bit);
            }
        }
        const uint8_t *sw = w + 256 + 64 * wt->planes;
        __m512 sc0, sc1;
        if (wt->super) {                           /* d * sc: exact in fp32 (11 x 8 bits) */
            sc0 = _mm512_mul_ps(dk, int8x16(sw)), sc1 = _mm512_mul_ps(dk, int8x16(sw + 16));
        } else {
            sc0 = bf16x16(sw), sc1 = wt->halves == 2 ? bf16x16(sw + 32) : sc0;
        }
        #pragma GCC unroll 8
        for (int i = 0; i < rows; i++) {
            int64_t j = (r0 + i) * a->nb + b;
            const int8_t *xq = a->q + j * 2 * ACT_BLOCK;
            __m512i s0 = _mm512_setzero_si512(), s1 = s0, t0 = s0, t1 = s0;
            for (int g = 0; g < 4; g++) {
                s0 = dot_bcast(s0, u[g], xq + 4 * g);
                s1 = dot_bcast(s1, u[4 + g], xq + 16 + 4 * g);
                t0 = dot_bcast(t0, u[g], xq + ACT_BLOCK + 4 * g);
                t1 = dot_bcast(t1, u[4 + g], xq + ACT_BLOCK + 16 + 4 * g);
            }
            __m512 d = _mm512_set1_ps(a->d[j]);
            if (wt->halves == 1) {               /* one scale for the block: one sum */
                s0 = _mm512_add_epi32(s0, s1), t0 = _mm512_add_epi32(t0, t1);
                s0 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(s0, 8), t0),
                                      _mm512_set1_epi32(wt->off * (a->sh[2 * j] + a->sh[2 * j + 1])));
                acc[i] = _mm512_fmadd_ps(sc0, _mm512_mul_ps(_mm512_cvtepi32_ps(s0), d), acc[i]);
                continue;
            }
            s0 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(s0, 8), t0),
                                  _mm512_set1_epi32(wt->off * a->sh[2 * j]));
            s1 = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(s1, 8), t1),
                                  _mm512_set1_epi32(wt->off * a->sh[2 * j + 1]));
            acc[i] = _mm512_fmadd_ps(sc0, _mm512_mul_ps(_mm512_cvtepi32_ps(s0), d), acc[i]);
            acc[i] = _mm512_fmadd_ps(sc1, _mm512_mul_ps(_mm512_cvtepi32_ps(s1), d), acc[i]);
        }
    }
    for (int64_t i = 0; i < rows; i++) _mm512_storeu_ps(y + i * Q8_TILE, acc[i]);
}

static void q8_tile_fast(const Weights *wt, const Act *a, int64_t r0, int64_t rows, const uint8_t *w, float *y) {
    switch (rows) {          /* one copy per row count, so each keeps its accumulators in registers */
    case 1: q8_tile_n(wt, a, r0, 1, w, y); break;
    case 2: q8_tile_n(wt, a, r0, 2, w, y); break;
    case 3: q8_tile_n(wt, a, r0, 3, w, y); break;
    case 4: q8_tile_n(wt, a, r0, 4, w, y); break;
    case 5: q8_tile_n(wt, a, r0, 5, w, y); break;
    case 6: q8_tile_n(wt, a, r0, 6, w, y); break;
    case 7: q8_tile_n(wt, a, r0, 7, w, y); break;
    default: q8_tile_n(wt, a, r0, 8, w, y); break;
    }
}

#elif IMM_AVX2
static inline __m256i plane_bits(__m256i plane, int v, int to) {
    __m256i t = to >= v ? _mm256_sll_epi16(plane, _mm_cvtsi32_si128(to - v))
                        : _mm256_srl_epi16(plane, _mm_cvtsi32_si128(v - to));
    return _mm256_and_si256(t, _mm256_set1_epi8((char)(1 << to)));
}

/* Sum of u * x over one half (4 vectors of u, x the half's 16 digits) into 32-bit lanes.
 * vpmaddubsw saturates at 16 bits: a pair of products of u < 64 stays below 2 * 63 * 128 =
 * 16128, so two pairs add up exactly in 16 bits before vpmaddwd widens them. */
static inline __m256i half_dot(const __m256i u[4], const int8_t *x) {
    const __m256i one = _mm256_set1_epi16(1);
    __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], bcast4(x)), _mm256_maddubs_epi16(u[1], bcast4(x + 4)));
    __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], bcast4(x + 8)), _mm256_maddubs_epi16(u[3], bcast4(x + 12)));
    return _mm256_add_epi32(_mm256_madd_epi16(p, one), _mm256_madd_epi16(q, one));
}

/* The same for 4-bit parts (u < 16): four pairs add up exactly in 16 bits (4 * 3840). */
static inline __m256i half_dot4(const __m256i u[4], const int8_t *x) {
    __m256i s = _mm256_maddubs_epi16(u[0], bcast4(x));
    for (int g = 1; g < 4; g++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[g], bcast4(x + 4 * g)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* Sum of u * x over a half: u whole where it is below 64 (5 and 6 bits), else as its low and
 * high nibbles (8 bits), whose pairs would overflow 16 bits whole. */
static inline __m256i half_sum(const __m256i nib[4], const __m256i top[4], int split, const int8_t *x) {
    if (!split) return half_dot(nib, x);
    return _mm256_add_epi32(half_dot4(nib, x), _mm256_slli_epi32(half_dot4(top, x), 4));
}

static inline __m256 int8x8(const uint8_t *p) {       /* 8 int8 scales as floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p)));
}

static void q8_tile_fast(const Weights *wt, const Act *a, int64_t r0, int64_t rows, const uint8_t *w, float *y) {
    __m256 acc[Q8_ROWS][2];
    for (int i = 0; i < Q8_ROWS; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f);
    const int split = wt->planes > 2;
    __m256 dk[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};     /* per half of the channels */
    for (int64_t b = 0; b < a->nb; b++, w += wt->bytes) {
        if (wt->super && b % Q8_SUPER == 0) {
            for (int c = 0; c < 2; c++) dk[c] = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(w + 16 * c)));
            w += Q8_SUPER_HEAD;
        }
        prefetch_q8(wt, w);
        const uint8_t *sw = w + 256 + 64 * wt->planes;
        for (int c = 0; c < 2; c++) {            /* channels 8 c .. 8 c + 7 */
            __m256i nib[8], top[8];
            if (split) {                            /* 8 bits: whole bytes, as two nibbles */
                for (int v = 0; v < 8; v++) {
                    __m256i p = _mm256_loadu_si256((const void *)(w + 64 * v + 32 * c));
                    nib[v] = _mm256_and_si256(p, low);
                    top[v] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
                }
            } else {
                for (int g = 0; g < 4; g++) {
                    __m256i p = _mm256_loadu_si256((const void *)(w + 64 * g + 32 * c));
                    nib[g] = _mm256_and_si256(p, low);
                    nib[4 + g] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
                }
                for (int p = 0; p < wt->planes; p++) {
                    __m256i plane = _mm256_loadu_si256((const void *)(w + 256 + 64 * p + 32 * c));
                    for (int v = 0; v < 8; v++) nib[v] = _mm256_or_si256(nib[v], plane_bits(plane, v, 4 + p));
                }
            }
            __m256 sc0, sc1;
            if (wt->super) {                       /* d * sc: exact in fp32 (11 x 8 bits) */
                sc0 = _mm256_mul_ps(dk[c], int8x8(sw + 8 * c)), sc1 = _mm256_mul_ps(dk[c], int8x8(sw + 16 + 8 * c));
            } else {
                sc0 = bf16x8(sw + 16 * c), sc1 = wt->halves == 2 ? bf16x8(sw + 32 + 16 * c) : sc0;
            }
            for (int i = 0; i < Q8_ROWS; i++) {
                if (i == rows) break;
                int64_t j = (r0 + i) * a->nb + b;
                const int8_t *xq = a->q + j * 2 * ACT_BLOCK;
                __m256i s0 = half_sum(nib, top, split, xq), s1 = half_sum(nib + 4, top + 4, split, xq + 16);
                __m256i t0 = half_sum(nib, top, split, xq + ACT_BLOCK);
                __m256i t1 = half_sum(nib + 4, top + 4, split, xq + ACT_BLOCK + 16);
                __m256 d = _mm256_set1_ps(a->d[j]);
                if (wt->halves == 1) {           /* one scale for the block: one sum */
                    s0 = _mm256_add_epi32(s0, s1), t0 = _mm256_add_epi32(t0, t1);
                    s0 = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(s0, 8), t0),
                                          _mm256_set1_epi32(wt->off * (a->sh[2 * j] + a->sh[2 * j + 1])));
                    acc[i][c] = _mm256_fmadd_ps(sc0, _mm256_mul_ps(_mm256_cvtepi32_ps(s0), d), acc[i][c]);
                    continue;
                }
                s0 = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(s0, 8), t0),
                                      _mm256_set1_epi32(wt->off * a->sh[2 * j]));
                s1 = _mm256_sub_epi32(_mm256_add_epi32(_mm256_slli_epi32(s1, 8), t1),
                                      _mm256_set1_epi32(wt->off * a->sh[2 * j + 1]));
                acc[i][c] = _mm256_fmadd_ps(sc0, _mm256_mul_ps(_mm256_cvtepi32_ps(s0), d), acc[i][c]);
                acc[i][c] = _mm256_fmadd_ps(sc1, _mm256_mul_ps(_mm256_cvtepi32_ps(s1), d), acc[i][c]);
            }
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        _mm256_storeu_ps(y + i * Q8_TILE, acc[i][0]);
        _mm256_storeu_ps(y + i * Q8_TILE + 8, acc[i][1]);
    }
}
#else
#define q8_tile_fast q8_tile_ref
#endif

static Weights weights(int64_t bits, int64_t group) {
    if (group == 256)                          /* two int8 scales per channel, 16 bytes each half */
        return (Weights){bits - 4, Q8_BLOCK_BYTES(bits - 4, 2) - 32, 1 << (bits - 1), 2, 1};
    int halves = (int)(ACT_BLOCK / group);
    return (Weights){bits - 4, Q8_BLOCK_BYTES(bits - 4, halves), 1 << (bits - 1), halves, 0};
}

/* One tile of rows r0 .. r0 + rows (ref: the scalar reference), and a block's bytes: what
 * mixed_matmul.c's runner calls for this layout. */
void q8_tile(int ref, int64_t bits, int64_t group, const uint8_t *w, const Act *a, int64_t r0, int64_t rows,
             float *y) {
    Weights wt = weights(bits, group);
    (ref ? q8_tile_ref : q8_tile_fast)(&wt, a, r0, rows, w, y);
}

/* A block's share of a tile's bytes (with group 256, an eighth of the d before 8 blocks). */
int64_t q8_block_bytes(int64_t bits, int64_t group) {
    Weights wt = weights(bits, group);
    return wt.bytes + (wt.super ? Q8_SUPER_HEAD / Q8_SUPER : 0);
}

/* 1 where this build reads the 5- and 6-bit layouts' higher bits as masks, 0 as planes. */
int64_t q8_plane_masks(void) { return Q8_PLANE_MASKS; }

/* mixed_matmul.c's runner: every 5-, 6- or 8-bit matmul is a weight of one part */
int64_t parts_matmul(int ref, const uint8_t *w, const int64_t *table, int64_t nparts, int64_t n, int64_t k,
                     const bf16 *x, int64_t m, bf16 *out);

/* out bf16 [M, N] = x bf16 [M, K] @ W.T for W packed as above with `bits` 5, 6 or 8 and a scale
 * per `group` 16 or 32 weights, or Q6_K's own scales (group 256) (ceil(N / 16) tiles, K a multiple of 32,
 * of 256 for group 256). Returns 0, or 1 (a bad K,
 * bits or group, or no memory). */
int64_t q8_matmul(const uint8_t *w, int64_t bits, int64_t group, int64_t n, int64_t k, const bf16 *x, int64_t m,
                  bf16 *out) {
    const int64_t part[3] = {n, bits, group};
    return parts_matmul(0, w, part, 1, n, k, x, m, out);
}

/* The same through the scalar reference (tests compare the two bit for bit). */
int64_t q8_matmul_ref(const uint8_t *w, int64_t bits, int64_t group, int64_t n, int64_t k, const bf16 *x,
                      int64_t m, bf16 *out) {
    const int64_t part[3] = {n, bits, group};
    return parts_matmul(1, w, part, 1, n, k, x, m, out);
}
