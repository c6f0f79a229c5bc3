/* Fused CPU kernels for the decode and tree-verify rows of a quantized target.
 *
 * Two reasons for C here. (1) Each row is computed alone, by one thread, in a fixed order:
 * a token's attention output and norms are bitwise the same whether it is decoded alone,
 * beside other sequences, or verified as a node of a draft tree. Attention walks exactly the
 * keys the query sees, in logical order, skipping masked ones, so a tree node and the same
 * token decoded after its ancestors were committed reduce over the same keys in the same
 * order. (2) Speed: one call per fused step instead of 10 to 20 torch ops.
 *
 * Layouts (all contiguous, row-major):
 *   activations   x fp32 [T, H]; bf16 tensors are uint16 bit patterns
 *   qkv           bf16 [T, (NH + 2 * NKV) * D]   (q heads, then k heads, then v heads)
 *   KV cache      fp32 [slots, NKV, D]            (slot = block * block_size + offset)
 *   rope tables   fp32 [positions, D]; sin has its first half negated (see verifier/rope.py)
 * Invariance comes from structure, not from the compiler: every loop's trip count is a
 * model dimension or a key count whose remainder is padded, never the batch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

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

/* sum of a[i] * b[i] with LANES partial sums and a fixed final order (n % LANES == 0 or not) */
static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += a[i] * b[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

static inline void norm_row(const float *x, const float *w, float eps, int64_t h, bf16 *out) {
    float r = 1.0f / sqrtf(dot(x, x, h) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = f32_to_bf16((x[i] * r) * w[i]);
}

/* out[t] = rms_norm(x[idx[t]]) * w in fp32 (the final norm, of the sampled rows only) */
void rms_norm_rows(const float *x, const int64_t *idx, const float *w, float eps, int64_t rows, int64_t h,
                   float *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + idx[t] * h;
        float r = 1.0f / sqrtf(dot(xt, xt, h) / (float)h + eps);
        for (int64_t i = 0; i < h; i++) out[t * h + i] = (xt[i] * r) * w[i];
    }
}

/* out[t] = bf16(rms_norm(x[t]) * w); with y: x[t] += y[t] first (the residual add); out NULL:
 * the add alone. */
void add_rms_norm(float *x, const bf16 *y, const float *w, float eps, int64_t rows, int64_t h, bf16 *out) {
    for (int64_t t = 0; t < rows; t++) {
        float *xt = x + t * h;
        if (y) {
            const bf16 *yt = y + t * h;
            for (int64_t i = 0; i < h; i++) xt[i] += bf16_to_f32(yt[i]);
        }
        if (out) norm_row(xt, w, eps, h, out + t * h);
    }
}

/* The visible keys of every row, as KV slots in logical order: the ctx cached positions,
 * then new token j where the row's mask allows it (no mask: j <= row). Returns the count. */
static int64_t visible_slots(const int32_t *table, int64_t bs, int64_t ctx, int64_t nnew, int64_t row,
                             const uint8_t *mask, int64_t *slots) {
    int64_t n = 0;
    for (int64_t blk = 0; blk * bs < ctx; blk++) {
        int64_t base = (int64_t)table[blk] * bs, end = ctx - blk * bs < bs ? ctx - blk * bs : bs;
        for (int64_t o = 0; o < end; o++) slots[n++] = base + o;
    }
    for (int64_t j = 0; j < (mask ? nnew : row + 1); j++)
        if (!mask || mask[j]) slots[n++] = (int64_t)table[(ctx + j) / bs] * bs + (ctx + j) % bs;
    return n;
}

/* Vectors of 8 floats (GCC vector extensions: AVX on x86, NEON pairs on ARM). */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline float sum8(v8f a) {      /* ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* lane j of the result = sum8(a[j]): three rounds of adding interleaved halves */
static inline v8f sum8x8(const v8f a[8]) {
    const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo3 = {0, 8, 2, 10, 4, 12, 6, 14}, hi3 = {1, 9, 3, 11, 5, 13, 7, 15};
    v8f u[4], w[2];
    for (int i = 0; i < 4; i++)        /* [x0+x4, x1+x5, x2+x6, x3+x7] of a[2i] and a[2i+1] */
        u[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi);
    for (int i = 0; i < 2; i++)        /* [(0+4)+(2+6), (1+5)+(3+7)] per source vector */
        w[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], lo2) + __builtin_shuffle(u[2 * i], u[2 * i + 1], hi2);
    v8f z = __builtin_shuffle(w[0], w[1], lo3) + __builtin_shuffle(w[0], w[1], hi3);
    /* lanes 0..7 of z hold the sums of a[0], a[4], a[2], a[6], a[1], a[5], a[3], a[7] */
    const v8i order = {0, 4, 2, 6, 1, 5, 3, 7};
    return __builtin_shuffle(z, order);
}

/* exp for x <= 0 on 8 lanes (softmax after the max is subtracted; silu's exp(-|g|)): Cephes'
 * expf polynomial, about 1 ulp, without branches. */
static inline v8f exp_neg8(v8f x) {
    const v8f one = {1, 1, 1, 1, 1, 1, 1, 1};
    v8i low = x < -87.0f;
    x = (v8f)(((v8i)x & ~low) | ((v8i)(one * -87.0f) & low));
    v8f t = x * 1.44269504088896341f + 0.5f;
    v8f n = __builtin_convertvector(__builtin_convertvector(t, v8i), v8f);   /* trunc toward 0 */
    n = n - (v8f)((v8i)one & (n > t));                                        /* floor */
    v8f r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v8f p = one * 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (v8f)((__builtin_convertvector(n, v8i) + 127) << 23);
}

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8f load_bf16x8(const bf16 *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

static inline void store_bf16x8(bf16 *p, v8f f) {       /* round to nearest even (finite inputs) */
    v8u u = (v8u)f;
    v8h h = __builtin_convertvector((u + 0x7fffu + ((u >> 16) & 1u)) >> 16, v8h);
    memcpy(p, &h, sizeof h);
}

/* out[t, i] = bf16(silu(g) * u) for gu[t] = [g (inter) | u (inter)]; inter % 8 == 0 */
void silu_mul(const bf16 *gu, int64_t rows, int64_t inter, bf16 *out) {
    const v8f one = {1, 1, 1, 1, 1, 1, 1, 1};
    for (int64_t t = 0; t < rows; t++) {
        const bf16 *g = gu + t * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 8) {
            v8f a = load_bf16x8(g + i);
            v8i neg = a < 0.0f;
            v8f e = exp_neg8((v8f)((v8i)a | (v8i)(one * -0.0f)));           /* exp(-|a|) */
            v8f num = (v8f)(((v8i)e & neg) | ((v8i)one & ~neg));             /* a < 0 ? e : 1 */
            store_bf16x8(out + t * inter + i, a * (num / (one + e)) * load_bf16x8(u + i));
        }
    }
}

/* out = rope(x) for one head, x = bf16 [D] (+ bias fp32 [D] or NULL):
 * x * cos + roll(x, D/2) * sin_signed (= x * cos + rotate_half(x) * sin); D % 16 == 0 */
static inline void rotate(const bf16 *x, const float *bias, const float *c, const float *s, int64_t d, v8f *out) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < d; i += 8) {
        int64_t j = i < half ? i + half : i - half;
        v8f a = load_bf16x8(x + i), b = load_bf16x8(x + j);
        if (bias) {
            a += load8(bias + i);
            b += load8(bias + j);
        }
        out[i / 8] = a * load8(c + i) + b * load8(s + i);
    }
}

/* q_out[t] = rope(q heads); k_cache[slot[t]] = rope(k heads), v_cache[slot[t]] = v heads (all
 * fp32). bias (fp32 [(NH + 2 NKV) D]) may be NULL. */
void rope_store(const bf16 *qkv, const float *bias, const float *cos_tab, const float *sin_tab,
                const int64_t *pos, const int64_t *slot, int64_t rows, int64_t nh, int64_t nkv, int64_t d,
                float *q_out, float *k_cache, float *v_cache) {
    int64_t width = (nh + 2 * nkv) * d;
    v8f r[32];
    for (int64_t t = 0; t < rows; t++) {
        const bf16 *x = qkv + t * width;
        const float *c = cos_tab + pos[t] * d, *s = sin_tab + pos[t] * d;
        for (int64_t h = 0; h < nh + nkv; h++) {
            rotate(x + h * d, bias ? bias + h * d : NULL, c, s, d, r);
            float *dst = h < nh ? q_out + (t * nh + h) * d : k_cache + (slot[t] * nkv + h - nh) * d;
            for (int64_t i = 0; i < d; i += 8) store8(dst + i, r[i / 8]);
        }
        for (int64_t h = 0; h < nkv; h++) {
            const bf16 *v = x + (nh + nkv + h) * d;
            const float *vb = bias ? bias + (nh + nkv + h) * d : NULL;
            for (int64_t i = 0; i < d; i += 8)
                store8(v_cache + (slot[t] * nkv + h) * d + i, vb ? load_bf16x8(v + i) + load8(vb + i) : load_bf16x8(v + i));
        }
    }
}

#define ROWS 4          /* query rows of one sequence and head attended together */
#define KEYS 64         /* keys per block: a block's K and V rows stay in L1 across the rows */

/* Query rows q[r] (r < nrows) of one head, each over the first n[r] keys of its slot list
 * lists[r]: softmax(q . k * scale) v -> out[r] (bf16). The rows are of one sequence, whose
 * cached prefix heads every list (a causal row's list is even a prefix of the next row's),
 * so a K or V row of the prefix is read once for all of them. Each row's arithmetic is what it would be alone: a key's score is sum8x8 over its
 * 8-lane partial products (keys in groups of 8, a short last group padded with its first
 * key and masked), the exp sum keeps key i in lane i % 8, and v is accumulated in key order.
 * So a row's bits depend only on its query and its keys. score holds ROWS rows of the
 * longest count rounded up to 8. D, the head size, is a constant in each instance (64, 128
 * or any multiple of 8 up to 256) so that the output accumulators stay in registers. */
static inline void attend_rows(const float *const *q, int nrows, const int64_t *n, const float *k_cache,
                               const float *v_cache, const int64_t *const *lists, int64_t nkv, int64_t kvh,
                               const int64_t D, float scale, float *score, int64_t stride, bf16 *const *out) {
    int64_t most = 0;
    for (int r = 0; r < nrows; r++) most = n[r] > most ? n[r] : most;
    for (int64_t kb = 0; kb < most; kb += KEYS)
        for (int r = 0; r < nrows; r++)
            for (int64_t i = kb; i < kb + KEYS && i < n[r]; i += 8) {
                const int64_t *slots = lists[r];
                const float *k[8];
                for (int j = 0; j < 8; j++) k[j] = k_cache + (slots[i + j < n[r] ? i + j : i] * nkv + kvh) * D;
                v8f acc[8] = {{0}};
                for (int64_t e = 0; e < D; e += 8) {
                    v8f qe = load8(q[r] + e);
                    for (int j = 0; j < 8; j++) acc[j] += qe * load8(k[j] + e);
                }
                store8(score + r * stride + i, sum8x8(acc) * scale);
            }
    float inv[ROWS];
    for (int r = 0; r < nrows; r++) {
        float *sc = score + r * stride, m = -INFINITY;
        for (int64_t i = 0; i < n[r]; i++) m = sc[i] > m ? sc[i] : m;
        v8f total = {0};
        for (int64_t i = 0; i < n[r]; i += 8) {
            v8f e = exp_neg8(load8(sc + i) - m);
            for (int j = 0; j < 8; j++) e[j] = i + j < n[r] ? e[j] : 0.0f;
            store8(sc + i, e);
            total += e;
        }
        inv[r] = 1.0f / sum8(total);
    }
    v8f o[ROWS][32];
    for (int r = 0; r < nrows; r++)
        for (int64_t e = 0; e < D / 8; e++) o[r][e] = (v8f){0};
    for (int64_t kb = 0; kb < most; kb += KEYS)
        for (int r = 0; r < nrows; r++) {
            const float *sc = score + r * stride;
            v8f acc[32];
            for (int64_t e = 0; e < D / 8; e++) acc[e] = o[r][e];
            for (int64_t i = kb; i < kb + KEYS && i < n[r]; i++) {
                const float *v = v_cache + (lists[r][i] * nkv + kvh) * D;
                for (int64_t e = 0; e < D / 8; e++) acc[e] += sc[i] * load8(v + 8 * e);
            }
            for (int64_t e = 0; e < D / 8; e++) o[r][e] = acc[e];
        }
    for (int r = 0; r < nrows; r++)
        for (int64_t e = 0; e < D; e++) out[r][e] = f32_to_bf16(o[r][e / 8][e % 8] * inv[r]);
}

static void attend_rows_d64(const float *const *q, int nrows, const int64_t *n, const float *kc, const float *vc,
                            const int64_t *const *slots, int64_t nkv, int64_t kvh, float scale, float *score,
                            int64_t stride, bf16 *const *out) {
    attend_rows(q, nrows, n, kc, vc, slots, nkv, kvh, 64, scale, score, stride, out);
}

static void attend_rows_d128(const float *const *q, int nrows, const int64_t *n, const float *kc, const float *vc,
                            const int64_t *const *slots, int64_t nkv, int64_t kvh, float scale, float *score,
                             int64_t stride, bf16 *const *out) {
    attend_rows(q, nrows, n, kc, vc, slots, nkv, kvh, 128, scale, score, stride, out);
}

/* Attention of every new row of every sequence, out bf16 [T, NH * D].
 * Sequence b: rows [row0[b], row0[b] + nnew[b]), ctx[b] cached tokens, block table
 * tables[tab0[b]...], new-token mask masks[msk0[b]...] ([nnew, nnew] uint8, msk0 < 0:
 * causal). A unit of work is a head and up to ROWS rows of one sequence. head_dim: a
 * multiple of 8, at most 256. */
void attend(const float *q, const float *k_cache, const float *v_cache, int64_t nseq, const int64_t *row0,
            const int64_t *nnew, const int64_t *ctx, const int64_t *tab0, const int32_t *tables,
            const int64_t *msk0, const uint8_t *masks, int64_t bs, int64_t nh, int64_t nkv, int64_t d,
            float scale, bf16 *out) {
    /* work units: up to ROWS rows of one sequence (first row, count); each row's slot list */
    int64_t rows = row0[nseq - 1] + nnew[nseq - 1], units = 0, total = 0, longest = 0;
    for (int64_t b = 0; b < nseq; b++) {
        units += (nnew[b] + ROWS - 1) / ROWS;
        total += msk0[b] < 0 ? ctx[b] + nnew[b] : nnew[b] * (ctx[b] + nnew[b]);
        longest = ctx[b] + nnew[b] > longest ? ctx[b] + nnew[b] : longest;
    }
    int64_t *first = malloc(sizeof(int64_t) * units), *width = malloc(sizeof(int64_t) * units);
    int64_t *count = malloc(sizeof(int64_t) * rows), *slots = malloc(sizeof(int64_t) * total), u = 0, at = 0;
    const int64_t **list = malloc(sizeof(int64_t *) * rows);
    for (int64_t b = 0; b < nseq; b++) {
        for (int64_t r = 0; r < nnew[b]; r += ROWS, u++) {
            first[u] = row0[b] + r;
            width[u] = nnew[b] - r < ROWS ? nnew[b] - r : ROWS;
        }
        if (msk0[b] < 0) {          /* causal: row r sees the first ctx + r + 1 keys of one list */
            visible_slots(tables + tab0[b], bs, ctx[b], nnew[b], nnew[b] - 1, NULL, slots + at);
            for (int64_t r = 0; r < nnew[b]; r++) {
                count[row0[b] + r] = ctx[b] + r + 1;
                list[row0[b] + r] = slots + at;
            }
            at += ctx[b] + nnew[b];
        } else {                    /* a tree: each node its own list (the prefix, then its ancestors) */
            for (int64_t r = 0; r < nnew[b]; r++) {
                const uint8_t *mask = masks + msk0[b] + r * nnew[b];
                count[row0[b] + r] = visible_slots(tables + tab0[b], bs, ctx[b], nnew[b], r, mask, slots + at);
                list[row0[b] + r] = slots + at;
                at += ctx[b] + nnew[b];
            }
        }
    }
    int64_t stride = longest + 8;
    #pragma omp parallel if (rows * longest * nh > 1024)
    {
        float *score = malloc(sizeof(float) * ROWS * stride);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < units * nh; it++) {
            int64_t w = it / nh, h = it % nh, t = first[w], kvh = h / (nh / nkv);
            const float *qs[ROWS];
            bf16 *os[ROWS];
            for (int r = 0; r < width[w]; r++) {
                qs[r] = q + ((t + r) * nh + h) * d;
                os[r] = out + ((t + r) * nh + h) * d;
            }
            if (d == 64)
                attend_rows_d64(qs, width[w], count + t, k_cache, v_cache, list + t, nkv, kvh, scale, score, stride,
                                os);
            else if (d == 128)
                attend_rows_d128(qs, width[w], count + t, k_cache, v_cache, list + t, nkv, kvh, scale, score, stride,
                                 os);
            else
                attend_rows(qs, width[w], count + t, k_cache, v_cache, list + t, nkv, kvh, d, scale, score, stride,
                            os);
        }
        free(score);
    }
    free(first);
    free(width);
    free(list);
    free(count);
    free(slots);
}
