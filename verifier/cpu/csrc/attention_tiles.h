/* Prompt rows' attention on AMX tiles (Sapphire Rapids and later), included by decode_ops.c
 * after its Item, bundles, soft_cap and chunk_softmax: one chunk of keys for up to 16 query
 * vectors that see the same keys, as attend_chunk computes it, with both products over the
 * KV cache on tiles. Scores: K rows as they lie in the cache (16 keys x 32 dims) times q
 * rounded to bf16, 16 keys x 16 vectors a tile, transposed in registers to a vector's row of
 * scores; the softmax as attend_chunk's; values: p rounded to bf16 (16 vectors x 32 keys)
 * times V regrouped in pairs of keys, 16 vectors x 16 dims a tile. Each tile instruction serves
 * all 16 vectors of a KV head (a prompt chunk fills them); what is left per vector is the
 * softmax. Timings: docs/quantization.md, "Attention".
 *
 * Only prompt rows (Rows.tiles: the rows before a sequence's first sampled one) take it: a
 * decode row and a tree's nodes keep the vector path, so speculation's rows are unchanged
 * and still equal a plain decode's. A prompt row's bits still depend on nothing but its own
 * keys: each score is its own tile element, the softmax runs per vector over its own keys (the
 * pads of its last group of 8 a visible key's score), and in the value tiles its p is zero past
 * its own last key (0 x v adds nothing to a sum). The rows of one sequence read one key list,
 * each a prefix of it, so an item's tiles run once for all of its vectors, to its longest
 * vector's last key (one_list), where bundles of equal key counts would run them once per row
 * in the chunk holding the rows' own positions. So a prompt leaves the same KV cache in any
 * chunking or batch (the bulk path's contract, docs/quantization.md "Exactness"). Where the tiles are not built or the
 * kernel refuses them (tiles_usable), every row takes the vector path. */
#ifndef TERCEL_ATTENTION_TILES_H
#define TERCEL_ATTENTION_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TILES_BUILT 1
#define TILES_MAX_D 256          /* head dims the stack buffers hold (gather, qb); wider heads take vectors */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int tiles_on = -1;        /* -1: not asked yet; then whether this process may use the tiles */

/* Ask Linux once for the tiles' state (a process-wide permission); the answer never changes. */
static int tiles_usable(void) {
    if (tiles_on < 0) tiles_on = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return tiles_on;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* All 8 tiles 16 rows of 64 bytes. Scores: tmm0-3 four groups of 16 keys x 16 vectors (fp32),
 * tmm4/5 K (16 keys x 32 dims), tmm6 q (16 dim pairs x 16 vectors x 2). Values: tmm0-3 the
 * outputs (16 vectors x 16 dims fp32), tmm4 p (16 vectors x 32 keys), tmm5-7 V (16 key pairs x
 * 16 dims x 2). */
static inline void tiles_configure(void) {
    TileConfig cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* r[i][j] = r[j][i] over 16 x 16 floats */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {      /* u[4i + j], 128-bit lane L: rows 4i..4i+3 of column j + 4L */
        u[4 * i] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        u[4 * i + 1] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i], (__m512d)t[4 * i + 2]);
        u[4 * i + 2] = (__m512)_mm512_unpacklo_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
        u[4 * i + 3] = (__m512)_mm512_unpackhi_pd((__m512d)t[4 * i + 1], (__m512d)t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512 a = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        __m512 c = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD), d = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_f32x4(a, b, 0x88);
        r[j + 8] = _mm512_shuffle_f32x4(a, b, 0xDD);
        r[j + 4] = _mm512_shuffle_f32x4(c, d, 0x88);
        r[j + 12] = _mm512_shuffle_f32x4(c, d, 0xDD);
    }
}

/* Keys list[i..i+16) as an A tile's rows: the cache itself where they are 16 consecutive slots
 * (stride: one slot's K), else copied into `gather` (rows from m on copies of the first, so a
 * short group's pads score as a visible key, as chunk_softmax needs). */
typedef struct {
    const bf16 *k;
    int64_t stride;
} KeyRows;

static inline KeyRows tile_keys(const int64_t *list, int64_t i, int m, const bf16 *kc, int64_t nkv, int64_t kvh,
                                int64_t D, bf16 *gather) {
    int run = m == 16;
    for (int j = 1; j < m && run; j++) run = list[i + j] == list[i] + j;
    if (run) return (KeyRows){kc + (list[i] * nkv + kvh) * D, nkv * D * (int64_t)sizeof(bf16)};
    for (int j = 0; j < 16; j++)
        memcpy(gather + j * D, kc + (list[i + (j < m ? j : 0)] * nkv + kvh) * D, sizeof(bf16) * D);
    return (KeyRows){gather, D * (int64_t)sizeof(bf16)};
}

/* tile t += dims [32 s, 32 s + 32) of group t's keys x q (K in tile a) */
#define TILE_GROUP(t, a)                                                                         \
    if (t < groups) {                                                                            \
        _tile_loadd(a, rows[t].k + 32 * s, rows[t].stride);                                      \
        _tile_dpbf16ps(t, a, 6);                                                                 \
    }

/* The item's query vectors rounded to bf16 as B tiles, one per 32 dims: qb[s][pair][vector]
 * (a pair of dims, one 32-bit word; vectors from nq on zero). */
static void tile_queries(const Item *it, int64_t D, uint32_t (*qb)[16][16]) {
    for (int64_t s = 0; s < D / 32; s++) {
        __m512 r[16];
        for (int b = 0; b < 16; b++)        /* vector b's 16 pairs of dims 32 s .. 32 s + 32 */
            r[b] = b < it->nq ? (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(it->q[b] + 32 * s + 16),
                                                            _mm512_loadu_ps(it->q[b] + 32 * s))
                              : _mm512_setzero_ps();
        transpose16(r);
        for (int k = 0; k < 16; k++) _mm512_store_ps((float *)qb[s][k], r[k]);
    }
}

/* score[v[b]][i - c0] = bf16(q[v[b]]) . k[i] * scale for keys [c0, to), the nb vectors v[0..nb)
 * that see the same keys there (qb: every vector of the item, tile_queries); 64 keys (four
 * tiles) in flight, their K rows requested 64 keys ahead and their V rows now (`ahead`). */
static void tile_scores(const Item *it, const int *v, int nb, int64_t c0, int64_t to, const bf16 *kc,
                        const bf16 *vc, int64_t nkv, int64_t D, float scale, uint32_t (*qb)[16][16], float *score,
                        int ahead) {
    bf16 gather[4][16 * TILES_MAX_D] __attribute__((aligned(64)));
    float c[4][16][16] __attribute__((aligned(64)));
    const int64_t *list = it->list[v[0]], n = it->n[v[0]];
    for (int64_t i0 = c0; i0 < to; i0 += 64) {
        if (ahead)
            for (int64_t j = i0; j < i0 + 64 && j < to; j++)
                for (int64_t e = 0; e < D; e += 32) {
                    if (j + 64 < n) __builtin_prefetch(kc + (list[j + 64] * nkv + it->kvh) * D + e);
                    __builtin_prefetch(vc + (list[j] * nkv + it->kvh) * D + e);
                }
        const int groups = (int)((to - i0 + 15) / 16 < 4 ? (to - i0 + 15) / 16 : 4);
        KeyRows rows[4];
        for (int g = 0; g < groups; g++) {
            int64_t i = i0 + 16 * g;
            rows[g] = tile_keys(list, i, to - i < 16 ? (int)(to - i) : 16, kc, nkv, it->kvh, D, gather[g]);
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < D / 32; s++) {
            _tile_loadd(6, qb[s], 64);
            TILE_GROUP(0, 4) TILE_GROUP(1, 5) TILE_GROUP(2, 4) TILE_GROUP(3, 5)
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        for (int g = 0; g < groups; g++) {
            __m512 r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_load_ps(c[g][j]);
            transpose16(r);
            for (int b = 0; b < nb; b++)
                _mm512_storeu_ps(score + v[b] * CH + i0 + 16 * g - c0, _mm512_mul_ps(r[v[b]], _mm512_set1_ps(scale)));
        }
    }
}

/* Rows 2k and 2k + 1 of one 64-dim slice of V, interleaved (the B tile's pairs of keys): the
 * slice's 4 tiles of 16 dims, row k of each. Keys past the bundle's are zeros. */
static inline void pair_values(const bf16 *a, const bf16 *b, bf16 (*vt)[16][32], int k) {
    static const uint16_t zeros[64] __attribute__((aligned(64)));
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    a = a ? a : zeros, b = b ? b : zeros;
    for (int h = 0; h < 2; h++) {
        __m512i x = _mm512_loadu_si512(a + 32 * h), y = _mm512_loadu_si512(b + 32 * h);
        _mm512_store_si512(vt[2 * h][k], _mm512_permutex2var_epi16(x, lo, y));
        _mm512_store_si512(vt[2 * h + 1][k], _mm512_permutex2var_epi16(x, hi, y));
    }
}

/* part[v[b]][0 .. D) = sum over keys [c0, own[v[b]]) of bf16(p[v[b]][i - c0]) v[i] (p in score,
 * from chunk_softmax), every vector's own end at or before `to`: 32 keys a tile, 64 dims (four
 * output tiles) at a time, a vector's p zero past its own end (adding 0 x v leaves its sums as
 * they are) and V rows past `to` zero. */
static void tile_values(const Item *it, const int *v, int nb, int64_t c0, int64_t to, const int64_t *own,
                        const bf16 *vc, int64_t nkv, int64_t D, const float *score, float *part) {
    bf16 p[CH / 32][16][32] __attribute__((aligned(64)));
    bf16 vt[4][16][32] __attribute__((aligned(64)));
    float o[16][64] __attribute__((aligned(64)));
    const int64_t *list = it->list[v[0]], blocks = (to - c0 + 31) / 32;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t k0 = c0 + 32 * blk;
        for (int b = 0; b < 16; b++) {
            const int64_t left = b < nb ? own[v[b]] - k0 : 0;     /* this vector's keys from k0 on */
            if (left <= 0) {
                memset(p[blk][b], 0, sizeof p[blk][b]);
                continue;
            }
            const __mmask16 m0 = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            const __mmask16 m1 = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            const float *sc = score + v[b] * CH + 32 * blk;
            __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, sc + 16), _mm512_maskz_loadu_ps(m0, sc));
            _mm512_store_si512(p[blk][b], (__m512i)pb);
        }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t k0 = c0 + 32 * blk;
            for (int k = 0; k < 16; k++) {
                const int64_t i = k0 + 2 * k;
                pair_values(i < to ? vc + (list[i] * nkv + it->kvh) * D + d0 : NULL,
                            i + 1 < to ? vc + (list[i + 1] * nkv + it->kvh) * D + d0 : NULL, vt, k);
            }
            _tile_loadd(4, p[blk], 64);
            _tile_loadd(5, vt[0], 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vt[1], 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, vt[2], 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vt[3], 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, &o[0][0], 256);
        _tile_stored(1, &o[0][16], 256);
        _tile_stored(2, &o[0][32], 256);
        _tile_stored(3, &o[0][48], 256);
        for (int b = 0; b < nb; b++) memcpy(part + v[b] * (D + 2) + d0, o[b], sizeof o[b]);
    }
}

/* Whether the item's vectors with keys in this chunk all read one key list (a prompt's rows, each
 * a prefix of it): then they are one bundle, whose tiles run to its longest vector's end, each
 * vector keeping its own keys after (bundles() would split the chunk holding the rows' own
 * positions into one bundle per row, each running every tile again). */
static int one_list(const Item *it, int64_t c0, const int64_t *to, int *member, int *size) {
    int nb = 0;
    for (int r = 0; r < it->nq; r++) {
        if (to[r] <= c0) continue;
        if (nb && it->list[r] != it->list[member[0]]) return 0;
        member[nb++] = r;
    }
    *size = nb;
    return nb > 0;
}

/* attend_chunk on tiles (D % 64 == 0, D <= TILES_MAX_D): part[r] = (o [D], m, l) per vector of the item. */
static void attend_chunk_tiles(const Item *it, int64_t c0, const bf16 *kc, const bf16 *vc, int64_t nkv,
                               const int64_t D, float scale, float cap, float *score, float *part) {
    int64_t to[QV] = {0};
    int member[QV][QV], size[QV];
    for (int r = 0; r < it->nq; r++) to[r] = c0 + CH < it->n[r] ? c0 + CH : it->n[r];
    uint32_t qb[TILES_MAX_D / 32][16][16] __attribute__((aligned(64)));
    const int nbund = one_list(it, c0, to, member[0], size) ? 1 : bundles(it, c0, to, QV, member, size);
    tile_queries(it, D, qb);
    tiles_configure();
    for (int u = 0; u < nbund; u++) {
        const int *v = member[u], nb = size[u];
        int64_t end = 0;                                       /* the bundle's longest vector's */
        for (int b = 0; b < nb; b++) end = to[v[b]] > end ? to[v[b]] : end;
        tile_scores(it, v, nb, c0, end, kc, vc, nkv, D, scale, qb, score, u == 0);
        for (int b = 0; b < nb; b++) {
            float *pr = part + v[b] * (D + 2), *sc = score + v[b] * CH;
            const int64_t cnt = to[v[b]] - c0;
            for (int64_t i = cnt; i % 8; i++) sc[i] = sc[0];     /* its last group's pads: a visible key */
            if (cap > 0.0f) soft_cap(sc, cnt, cap);
            pr[D] = chunk_softmax(sc, cnt, pr + D + 1);
        }
        tile_values(it, v, nb, c0, end, to, vc, nkv, D, score, part);
    }
    _tile_release();
    for (int r = 0; r < it->nq; r++)
        if (to[r] <= c0) part[r * (D + 2) + D] = -INFINITY, part[r * (D + 2) + D + 1] = 0.0f;
}

#else
#define TILES_BUILT 0
static inline int tiles_usable(void) { return 0; }
#endif

#endif
