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
 *   KV cache      bf16 [slots, NKV, D]            (slot = block * block_size + offset)
 *   rope tables   fp32 [positions, D]; sin has its first half negated (see verifier/model/rope.py)
 * Invariance comes from structure, not from the compiler: every loop's trip count is a
 * model dimension or a key count whose remainder is padded, never the batch.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#define LANES 16

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

/* Lane by lane, b where it is larger than a, else a (a NaN in b is never taken). */
static inline v8f max8v(v8f a, v8f b) {
    v8i gt = b > a;
    return (v8f)(((v8i)b & gt) | ((v8i)a & ~gt));
}

/* The largest lane of a, the first of equal ones (lanes in order). */
static inline float max8(v8f a) {
    float m = a[0];
    for (int j = 1; j < 8; j++) m = a[j] > m ? a[j] : m;
    return m;
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

/* exp for x <= 0 lane by lane (softmax after the max is subtracted; silu's exp(-|g|)): Cephes'
 * expf polynomial, about 1 ulp, without branches. One body for each vector width (V float
 * lanes, I the int lanes of as many): each lane's arithmetic, hence its bits, is the same. */
#define EXP_NEG(name, V, I)                                                                      \
    static inline V name(V x) {                                                                  \
        const V one = (V){0} + 1.0f;                                                             \
        I low = x < -87.0f;                                                                      \
        x = (V)(((I)x & ~low) | ((I)(one * -87.0f) & low));                                      \
        V t = x * 1.44269504088896341f + 0.5f;                                                   \
        V n = __builtin_convertvector(__builtin_convertvector(t, I), V);     /* trunc toward 0 */ \
        n = n - (V)((I)one & (n > t));                                       /* floor */          \
        V r = x - n * 0.693359375f;                                                              \
        r = r - n * -2.12194440e-4f;                                                             \
        V p = one * 1.9875691500e-4f;                                                            \
        p = p * r + 1.3981999507e-3f;                                                            \
        p = p * r + 8.3334519073e-3f;                                                            \
        p = p * r + 4.1665795894e-2f;                                                            \
        p = p * r + 1.6666665459e-1f;                                                            \
        p = p * r + 5.0000001201e-1f;                                                            \
        p = p * r * r + r + 1.0f;                                                                \
        return p * (V)((__builtin_convertvector(n, I) + 127) << 23);                             \
    }
EXP_NEG(exp_neg8, v8f, v8i)

/* tanh on 8 lanes: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|); +-1 where e underflows */
static inline v8f tanh8(v8f x) {
    const v8f one = {1, 1, 1, 1, 1, 1, 1, 1};
    v8i sign = (v8i)x & (v8i)(one * -0.0f);
    v8f e = exp_neg8((v8f)((v8i)(x + x) | (v8i)(one * -0.0f)));     /* exp(-2|x|) */
    return (v8f)((v8i)((one - e) / (one + e)) | sign);
}

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef int8_t v8c __attribute__((vector_size(8), aligned(1)));

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

/* Put y[c] into the k largest so far (best, idx; low: the smallest of them) if above it. */
static inline void offer(float y, int64_t c, float *best, int64_t *idx, int64_t k, int64_t *low) {
    if (!(y > best[*low])) return;
    best[*low] = y;
    idx[*low] = c;
    for (int64_t j = 0; j < k; j++) *low = best[j] < best[*low] ? j : *low;
}

/* out fp32 [M, V] = scan bf16 [M, V]; top[m] = the indices of the k (<= 64) largest entries of
 * row m, in no order (of equal entries, the first). One pass: blocks of 64 are converted, and
 * only a block whose maximum beats the k-th largest so far is looked at entry by entry. */
void scan_topk(const bf16 *scan, int64_t rows, int64_t v, int64_t k, float *out, int64_t *top) {
    for (int64_t m = 0; m < rows; m++) {
        const bf16 *x = scan + m * v;
        float *y = out + m * v, best[64];
        int64_t *idx = top + m * k, low = 0, i = 0;
        for (; i < k; i++) {
            y[i] = best[i] = bf16_to_f32(x[i]);
            idx[i] = i;
            low = best[i] < best[low] ? i : low;
        }
        for (; i < v && (i % 64 || i + 64 > v); i++) offer(y[i] = bf16_to_f32(x[i]), i, best, idx, k, &low);
        for (; i + 64 <= v; i += 64) {
            v8f mx = load_bf16x8(x + i);
            for (int c = 0; c < 64; c += 8) {
                v8f f = load_bf16x8(x + i + c);
                store8(y + i + c, f);
                mx = max8v(mx, f);
            }
            if (max8(mx) > best[low])
                for (int c = 0; c < 64; c++) offer(y[i + c], i + c, best, idx, k, &low);
        }
        for (; i < v; i++) offer(y[i] = bf16_to_f32(x[i]), i, best, idx, k, &low);
    }
}

/* The first index of the largest of x[0 .. n), as torch.argmax gives it, or -1 if x holds a NaN
 * (the caller asks torch then: a NaN counts as the largest there). Serial on purpose: greedy
 * decoding takes one argmax per row after Python glue, when an OpenMP reduction (torch's)
 * first waits for its sleeping threads, which cost more than the scan (figures:
 * docs/quantization.md). Blocks of 64: only a block whose maximum beats the best so far is
 * looked at entry by entry. */
int64_t argmax_f32(const float *x, int64_t n) {
    int64_t best = 0, i = 0;
    v8i nan = {0};
    for (; i + 64 <= n; i += 64) {
        v8f mx = load8(x + i);
        for (int c = 0; c < 64; c += 8) {
            v8f f = load8(x + i + c);
            nan |= f != f;
            mx = max8v(mx, f);
        }
        if (max8(mx) > x[best] || i == 0)
            for (int c = 0; c < 64; c++) best = x[i + c] > x[best] ? i + c : best;
    }
    for (; i < n; i++) {
        if (x[i] != x[i]) return -1;
        best = x[i] > x[best] ? i : best;
    }
    for (int j = 0; j < 8; j++)
        if (nan[j]) return -1;
    return best;
}

/* logits fp32 [rows, v] = -inf where the row's bitmask (int32 [rows, ceil(v / 32)], bit j of
 * word i: token 32 i + j allowed) has a zero bit: a grammar's mask, applied in place. */
void apply_bitmask(float *logits, const int32_t *mask, int64_t rows, int64_t v) {
    const int64_t words = (v + 31) / 32;
    for (int64_t r = 0; r < rows; r++) {
        float *x = logits + r * v;
        const uint32_t *m = (const uint32_t *)mask + r * words;
        for (int64_t i = 0; i < words; i++) {
            const uint32_t w = m[i];
            const int64_t n = v - 32 * i < 32 ? v - 32 * i : 32;
            if (w == 0xFFFFFFFFu && n == 32) continue;
            for (int64_t j = 0; j < n; j++)
                if (!((w >> j) & 1u)) x[32 * i + j] = -INFINITY;
        }
    }
}

/* out[m, top[m, j]] = x[m] . w[top[m, j]] in fp32 for an int8 table w = q * scale (q int8
 * [V, H], scale fp32 [V, H / g], H % 8 == 0, g % 8 == 0): the exact logits of each row's
 * candidates. The k rows are requested from memory before the first is read. */
void rescore_int8(const float *x, const int64_t *top, const int8_t *q, const float *scale, int64_t rows, int64_t k,
                  int64_t h, int64_t g, float *out, int64_t v) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < k; j++)
            for (int64_t e = 0; e < h; e += 64) __builtin_prefetch(q + top[m * k + j] * h + e);
    for (int64_t m = 0; m < rows; m++) {
        const float *xm = x + m * h;
        for (int64_t j = 0; j < k; j++) {
            int64_t t = top[m * k + j];
            const int8_t *qt = q + t * h;
            const float *st = scale + t * (h / g);
            v8f acc = {0};
            for (int64_t e = 0; e < h; e += 8) {
                v8f w = __builtin_convertvector(*(const v8c *)(qt + e), v8f) * st[e / g];
                acc += w * load8(xm + e);
            }
            out[m * v + t] = sum8(acc);
        }
    }
}

/* out fp32 [T, H] = rows ids of the int8 table w = q * scale (q int8 [V, H], scale fp32
 * [V, H / g]): the token embedding. */
void embed_int8(const int64_t *ids, int64_t rows, const int8_t *q, const float *scale, int64_t h, int64_t g,
                float *out) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t e = 0; e < h; e++) out[t * h + e] = (float)q[ids[t] * h + e] * scale[ids[t] * (h / g) + e / g];
}

/* out[t, i] = bf16(gelu_tanh(g) * u) for gu[t] = [g (inter) | u (inter)], gelu_tanh(g) =
 * g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) (Gemma's GeGLU); inter % 8 == 0 */
void gelu_tanh_mul(const bf16 *gu, int64_t rows, int64_t inter, bf16 *out) {
    for (int64_t t = 0; t < rows; t++) {
        const bf16 *g = gu + t * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += 8) {
            v8f a = load_bf16x8(g + i);
            v8f inner = (a + a * a * a * 0.044715f) * 0.7978845608028654f;
            store_bf16x8(out + t * inter + i, a * 0.5f * (1.0f + tanh8(inner)) * load_bf16x8(u + i));
        }
    }
}

/* x = cap * tanh(x / cap) over n floats in place (Gemma's final logits), -inf kept (a masked
 * logit stays masked). Every element goes through the same 8-lane code, the tail padded: its
 * bits depend on its value alone, never on where it sits. */
void soft_cap_f32(float *x, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i += 8) {
        float tmp[8] = {0};
        int64_t m = n - i < 8 ? n - i : 8;
        memcpy(tmp, x + i, sizeof(float) * m);
        v8f a = load8(tmp);
        v8i masked = a == -INFINITY;
        v8f c = tanh8(a / cap) * cap;
        store8(tmp, (v8f)(((v8i)a & masked) | ((v8i)c & ~masked)));
        memcpy(x + i, tmp, sizeof(float) * m);
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

/* q_out[t] = rope(q heads) fp32; k_cache[slot[t]] = bf16(rope(k heads)), v_cache[slot[t]] =
 * bf16(v heads + bias). bias (fp32 [(NH + 2 NKV) D]) may be NULL. */
void rope_store(const bf16 *qkv, const float *bias, const float *cos_tab, const float *sin_tab,
                const int64_t *pos, const int64_t *slot, int64_t rows, int64_t nh, int64_t nkv, int64_t d,
                float *q_out, bf16 *k_cache, bf16 *v_cache) {
    int64_t width = (nh + 2 * nkv) * d;
    v8f r[32];
    for (int64_t t = 0; t < rows; t++) {
        const bf16 *x = qkv + t * width;
        const float *c = cos_tab + pos[t] * d, *s = sin_tab + pos[t] * d;
        for (int64_t h = 0; h < nh + nkv; h++) {
            rotate(x + h * d, bias ? bias + h * d : NULL, c, s, d, r);
            if (h < nh)
                for (int64_t i = 0; i < d; i += 8) store8(q_out + (t * nh + h) * d + i, r[i / 8]);
            else
                for (int64_t i = 0; i < d; i += 8) store_bf16x8(k_cache + (slot[t] * nkv + h - nh) * d + i, r[i / 8]);
        }
        for (int64_t h = 0; h < nkv; h++) {
            const bf16 *v = x + (nh + nkv + h) * d;
            const float *vb = bias ? bias + (nh + nkv + h) * d : NULL;
            bf16 *dst = v_cache + (slot[t] * nkv + h) * d;
            if (vb)
                for (int64_t i = 0; i < d; i += 8) store_bf16x8(dst + i, load_bf16x8(v + i) + load8(vb + i));
            else
                memcpy(dst, v, sizeof(bf16) * d);
        }
    }
}

#define QV 16            /* query vectors attended together: a unit's rows x a KV head's query heads */
#define CH 256           /* keys per chunk: a row's keys are split at multiples of CH from its first */
#define PF 32            /* keys ahead that K rows are prefetched */

/* Attention's vectors are as wide as the machine's: W lanes (the dot products' lane split,
 * hence a row's bits, depend on W, but never on the batch). Up to VB query vectors that see
 * the same keys in a chunk (a row's query heads of one KV head; in a tree, also other nodes'
 * over the prefix they share) are summed from each K/V load, their accumulators within ACC
 * registers: 3 x 4 (vectors x keys) of AVX-512's 32, 3 x 4 or 6 x 2 of AVX2's 16. The values'
 * weighted sums share each V load among up to VW vectors (6 x 4 of AVX-512's registers, 6 x 2
 * of AVX2's). Which vectors share a load changes no arithmetic: each key's dot product and each
 * output's sum run in the same order whatever shares them. */
#if defined(__AVX512F__)
#define W 16
#define VB 3
#define ACC 24
#else
#define W 8
#define VB 6
#define ACC 12
#endif
#define VW 6
typedef float vf __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
EXP_NEG(exp_negw, vf, vi)

static inline vf loadw(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

static inline vf load_bf16w(const bf16 *p) {
#if W == 16     /* one widening load: GCC splits the generic form below into halves and inserts */
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
}

/* bf16(silu(g) * u) of one vector of lanes at g, u -> o: one body per vector width (V float
 * lanes; I, U their int and uint lanes; H as many uint16), each lane's operations the same. */
#define SILU_MUL(name, V, I, U, H, EXP, LOAD)                                                  \
    static inline void name(const bf16 *g, const bf16 *u, bf16 *o) {                           \
        const V one = (V){0} + 1.0f;                                                           \
        V a = LOAD(g);                                                                         \
        I neg = a < 0.0f;                                                                      \
        V e = EXP((V)((I)a | (I)(one * -0.0f)));                        /* exp(-|a|) */        \
        V num = (V)(((I)e & neg) | ((I)one & ~neg));                    /* a < 0 ? e : 1 */    \
        U b = (U)(a * (num / (one + e)) * LOAD(u));                                            \
        H h = __builtin_convertvector((b + 0x7fffu + ((b >> 16) & 1u)) >> 16, H);              \
        memcpy(o, &h, sizeof h);                                                               \
    }
SILU_MUL(silu_mul8, v8f, v8i, v8u, v8h, exp_neg8, load_bf16x8)
SILU_MUL(silu_mulw, vf, vi, vu, vh, exp_negw, load_bf16w)

static void silu_mul_row(const bf16 *g, const bf16 *u, int64_t inter, bf16 *o) {
    int64_t i = 0;
    for (; i + W <= inter; i += W) silu_mulw(g + i, u + i, o + i);
    for (; i < inter; i += 8) silu_mul8(g + i, u + i, o + i);
}

/* out[t, i] = bf16(silu(g) * u) for gu[t] = [g (inter) | u (inter)]; inter % 8 == 0. W lanes at a
 * time, 8 for a tail; rows split among the threads where each gets two or more (a prompt
 * chunk's), without a parallel region for fewer (a decode step's, once per layer): element by
 * element, so the bits depend on neither. */
void silu_mul(const bf16 *gu, int64_t rows, int64_t inter, bf16 *out) {
    if (rows < 2 * omp_get_max_threads()) {
        for (int64_t t = 0; t < rows; t++) silu_mul_row(gu + t * 2 * inter, gu + t * 2 * inter + inter, inter,
                                                        out + t * inter);
        return;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows; t++) silu_mul_row(gu + t * 2 * inter, gu + t * 2 * inter + inter, inter,
                                                    out + t * inter);
}

static inline v8f fold8(vf a) {        /* lane i + lane i + 8 (W = 16) */
    v8f lo;
    memcpy(&lo, &a, sizeof lo);
#if W == 16
    v8f hi;
    memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    return lo + hi;
#else
    return lo;
#endif
}

/* The query vectors of one work item: rows of one sequence times query heads of one KV head.
 * Vectors of the same row are consecutive and share one key list: list[r][0 .. n[r]). */
typedef struct {
    int nq;
    const float *q[QV];
    const int64_t *list[QV];
    int64_t n[QV];
    bf16 *out[QV];
    int64_t kvh;
} Item;

/* Keys (in scores) or value groups of W lanes (in weigh_values) held in registers per vector
 * when nb vectors share each load: the ACC accumulators split among them, 4 at most (8 keys
 * at a time ran slower: 4 leaves registers for the loads). */
#define PER_VECTOR(nb) (ACC / (nb) >= 4 ? 4 : ACC / (nb) >= 2 ? 2 : 1)

/* score[v[b]][i - c0] = q[v[b]] . k[i] * scale for keys [c0, to) (c0 % 8 == 0) and the nb
 * vectors v[0..nb) (which see the same keys there), padded to a whole group of 8 with the
 * group's first key: keys kg at a time, each K row read once for all nb vectors, and K rows PF
 * keys ahead (and these keys' V rows) requested from memory while these are summed (`ahead`).
 * Each key's sum: W lanes over the head dimension in order, folded to 8, then sum8. */
static inline void scores(const Item *it, const int *v, const int nb, int64_t c0, int64_t to, const bf16 *kc,
                          const bf16 *vc, int64_t nkv, const int64_t D, float scale, float *score, int ahead) {
    const int kg = PER_VECTOR(nb);
    const int64_t *list = it->list[v[0]], n = it->n[v[0]], end = c0 + ((to - c0 + 7) & ~(int64_t)7);
    for (int64_t i = c0; i < end; i += kg) {
        const bf16 *k[4];
        for (int j = 0; j < kg; j++) k[j] = kc + (list[i + j < to ? i + j : i & ~(int64_t)7] * nkv + it->kvh) * D;
        if (ahead)
            for (int j = 0; j < kg; j++) {
                const bf16 *kn = kc + (list[i + PF + j < n ? i + PF + j : i & ~(int64_t)7] * nkv + it->kvh) * D;
                const bf16 *vn = vc + (list[i + j < to ? i + j : i & ~(int64_t)7] * nkv + it->kvh) * D;
                for (int64_t e = 0; e < D; e += 32) {
                    __builtin_prefetch(kn + e);
                    __builtin_prefetch(vn + e);
                }
            }
        vf acc[VB][4] = {{{0}}};
        for (int64_t e = 0; e < D; e += W)
            for (int j = 0; j < kg; j++) {
                vf kv = load_bf16w(k[j] + e);
                for (int b = 0; b < nb; b++) acc[b][j] += loadw(it->q[v[b]] + e) * kv;
            }
        /* 8 sums per sum8x8: 8 / kg vectors' kg keys */
        for (int b = 0; b < nb; b += 8 / kg) {
            v8f folded[8];
            for (int j = 0; j < 8; j++) {
                int bb = b + j / kg;
                folded[j] = bb < nb ? fold8(acc[bb][j % kg]) : (v8f){0};
            }
            v8f sums = sum8x8(folded) * scale;
            for (int h = 0; h < 8 / kg && b + h < nb; h++)
                memcpy(score + v[b + h] * CH + i - c0, (const float *)&sums + h * kg, sizeof(float) * kg);
        }
    }
}

/* o[v[b]] = sum over keys [c0, to) of p[v[b]][i - c0] v[i] for the nb vectors v[0..nb) (p in
 * score), keys in order; W lanes x gw at a time, each V row read once for all nb vectors. */
static inline void weigh_values(const Item *it, const int *v, const int nb, int64_t c0, int64_t to, const bf16 *vc,
                                int64_t nkv, const int64_t D, const float *score, vf (*o)[256 / W]) {
    const int gw = PER_VECTOR(nb);
    const int64_t *list = it->list[v[0]];
    for (int64_t g0 = 0; g0 < D / W; g0 += gw) {
        const int64_t w = D / W - g0 < gw ? D / W - g0 : gw;
        vf acc[VW][4];
        for (int b = 0; b < nb; b++)
            for (int64_t g = 0; g < w; g++) acc[b][g] = (vf){0};
        for (int64_t i = c0; i < to; i++) {
            const bf16 *vr = vc + (list[i] * nkv + it->kvh) * D + W * g0;
            for (int64_t g = 0; g < w; g++) {
                vf vv = load_bf16w(vr + W * g);
                for (int b = 0; b < nb; b++) acc[b][g] += score[v[b] * CH + i - c0] * vv;
            }
        }
        for (int b = 0; b < nb; b++)
            for (int64_t g = 0; g < w; g++) o[v[b]][g0 + g] = acc[b][g];
    }
}

/* Whether vectors a and b see the same keys in [c0, to): the same row's query heads, or rows
 * whose key lists agree there (a tree's nodes over their shared prefix). */
static inline int same_keys(const Item *it, int a, int b, int64_t c0, const int64_t *to) {
    if (to[a] != to[b]) return 0;
    if (it->list[a] == it->list[b]) return 1;
    return memcmp(it->list[a] + c0, it->list[b] + c0, sizeof(int64_t) * (to[a] - c0)) == 0;
}

/* The item's vectors with keys in this chunk, in bundles of up to cap that see the same keys
 * (consecutive vectors, in order); returns the bundle count. */
static int bundles(const Item *it, int64_t c0, const int64_t *to, int cap, int (*member)[QV], int *size) {
    int nbund = 0;
    for (int r = 0; r < it->nq; r++) {
        if (to[r] <= c0) continue;
        if (nbund && size[nbund - 1] < cap && same_keys(it, member[nbund - 1][0], r, c0, to))
            member[nbund - 1][size[nbund - 1]++] = r;
        else
            member[nbund][0] = r, size[nbund++] = 1;
    }
    return nbund;
}

/* scores / weigh_values with nb (1..most) a constant, so that each count keeps its accumulators
 * in registers */
_Static_assert(VB <= VW && VW <= 6, "BY_COUNT names counts up to 6");
#define CASE(call, n, most) case n: call((n) < (most) ? (n) : (most)); break;
#define BY_COUNT(call, nb, most)                                                                    \
    switch (nb) {                                                                                   \
    CASE(call, 1, most) CASE(call, 2, most) CASE(call, 3, most) CASE(call, 4, most) CASE(call, 5, most) \
    default: call(most);                                                                            \
    }

/* s = cap * tanh(s / cap) over one vector's cnt scores and their group's pads (Gemma 2) */
static inline void soft_cap(float *sc, int64_t cnt, float cap) {
    for (int64_t i = 0; i < cnt; i += 8) store8(sc + i, tanh8(load8(sc + i) / cap) * cap);
}

/* p = exp(s - m) over one vector's cnt scores (the rest of their group of 8 zeroed); returns
 * m, the largest score, and puts the sum of p (key i's term in lane i % 8) in *l. */
static inline float chunk_softmax(float *sc, int64_t cnt, float *l) {
    vi lane;
    for (int j = 0; j < W; j++) lane[j] = j;
    v8f mv = load8(sc);                  /* a short last group's pads are copies of a visible key */
    for (int64_t i = 8; i < cnt; i += 8) mv = max8v(mv, load8(sc + i));
    float m = max8(mv);
    v8f total = {0};
    /* W exponentials at a time (a group of 8 past the last is read and written, never used),
     * summed 8 lanes at a time in key order, as on 8-lane machines */
    for (int64_t i = 0; i < cnt; i += W) {
        vf e = (vf)((vi)exp_negw(loadw(sc + i) - m) & (lane + (int32_t)i < (int32_t)cnt));
        memcpy(sc + i, &e, sizeof e);
        for (int h = 0; h < W; h += 8) total += load8(sc + i + h);
    }
    *l = sum8(total);
    return m;
}

/* One chunk of keys, [c0, c0 + CH), for every vector of an item: part[r] = (o [D], m, l), the
 * chunk's unnormalized output, largest score and exp sum (m = -inf, l = 0 where the vector has
 * no key in the chunk). score: QV x CH floats. cap > 0: scores soft-capped at cap. */
static inline void attend_chunk(const Item *it, int64_t c0, const bf16 *kc, const bf16 *vc, int64_t nkv,
                                const int64_t D, float scale, float cap, float *score, float *part) {
    int64_t to[QV] = {0};     /* (nq <= QV, which the compiler cannot see) */
    int member[QV][QV], size[QV];
    for (int r = 0; r < it->nq; r++) to[r] = c0 + CH < it->n[r] ? c0 + CH : it->n[r];
    int nbund = bundles(it, c0, to, VB, member, size);
    for (int u = 0; u < nbund; u++) {
        const int *v = member[u];
#define SCORES(nb) scores(it, v, nb, c0, to[v[0]], kc, vc, nkv, D, scale, score, u == 0)
        BY_COUNT(SCORES, size[u], VB)
#undef SCORES
    }
    nbund = bundles(it, c0, to, VW, member, size);
    vf o[QV][256 / W];
    for (int u = 0; u < nbund; u++) {
        const int *v = member[u];
        for (int b = 0; b < size[u]; b++) {
            float *pr = part + v[b] * (D + 2);
            if (cap > 0.0f) soft_cap(score + v[b] * CH, to[v[b]] - c0, cap);
            pr[D] = chunk_softmax(score + v[b] * CH, to[v[b]] - c0, pr + D + 1);
        }
#define WEIGH(nb) weigh_values(it, v, nb, c0, to[v[0]], vc, nkv, D, score, o)
        BY_COUNT(WEIGH, size[u], VW)
#undef WEIGH
    }
    for (int r = 0; r < it->nq; r++) {
        float *pr = part + r * (D + 2);
        if (to[r] <= c0) {
            pr[D] = -INFINITY;
            pr[D + 1] = 0.0f;
            continue;
        }
        for (int64_t g = 0; g < D / W; g++) memcpy(pr + g * W, &o[r][g], sizeof(vf));
    }
}

#include "attention_tiles.h"

/* Whether prompt rows' attention runs on AMX tiles in this process (built for them, and
 * allowed by the kernel). */
int64_t attention_tiles(void) { return TILES_BUILT && tiles_usable(); }

static void attend_chunk_d64(const Item *it, int64_t c0, const bf16 *kc, const bf16 *vc, int64_t nkv, float scale,
                             float cap, float *score, float *part) {
    attend_chunk(it, c0, kc, vc, nkv, 64, scale, cap, score, part);
}

static void attend_chunk_d128(const Item *it, int64_t c0, const bf16 *kc, const bf16 *vc, int64_t nkv,
                              float scale, float cap, float *score, float *part) {
    attend_chunk(it, c0, kc, vc, nkv, 128, scale, cap, score, part);
}

/* out[r] = bf16(sum_c o_c e^(m_c - m) / sum_c l_c e^(m_c - m)), m = max_c m_c, over one
 * vector's chunk results part[c] (stride floats apart), merged in chunk order. */
static void merge_chunks(const float *part, int64_t chunks, int64_t stride, int64_t D, bf16 *out) {
    float m = -INFINITY, l = 0.0f, o[256];
    for (int64_t c = 0; c < chunks; c++) m = part[c * stride + D] > m ? part[c * stride + D] : m;
    for (int64_t e = 0; e < D; e++) o[e] = 0.0f;
    for (int64_t c = 0; c < chunks; c++) {
        const float *pc = part + c * stride;
        if (pc[D + 1] == 0.0f) continue;
        float f = exp_neg8((v8f){0} + (pc[D] - m))[0];
        l += pc[D + 1] * f;
        for (int64_t e = 0; e < D; e += 8) store8(o + e, load8(o + e) + load8(pc + e) * f);
    }
    float inv = 1.0f / l;
    for (int64_t e = 0; e < D; e++) out[e] = f32_to_bf16(o[e] * inv);
}

/* The attention heads of a model (mirrored by verifier.cpu.cpu_ops.Heads). parallel_from: the work
 * (rows x longest key list x query heads) from which a forward's attention is spread over the
 * threads, measured at load (verifier/quantized/attention_tuning.py); below it one thread is faster.
 * prefetch_bytes: how much of a layer's KV prefetch_kv requests (a quarter of L2). softcap:
 * scores become softcap * tanh(score / softcap) before the softmax where > 0 (Gemma 2). */
typedef struct {
    int64_t nh, nkv, d;
    float scale;
    const float *cos, *sin;     /* rope tables fp32 [positions, D], sin with its first half negated */
    int64_t parallel_from, prefetch_bytes;
    float softcap;
} Heads;

/* The rows of one forward, shared by all its layers (mirrored by verifier.cpu.cpu_ops.Rows).
 * A unit is up to `per_unit` consecutive rows of one sequence, attended together. */
typedef struct {
    int64_t rows, units, longest;
    const int64_t *pos, *slot;                  /* [rows] RoPE position; KV slot the row writes */
    const int64_t *count, *start;               /* [rows] the row's visible keys: keys[start .. start + count) */
    const int64_t *keys;                        /* KV slots, in logical order */
    const int64_t *unit_first, *unit_width;     /* [units] */
    int64_t tiles;                              /* prompt rows only: attention may take the tiles */
} Rows;

/* Rows a unit holds: its query vectors (rows x the query heads of a KV head) fill QV. */
int64_t rows_per_unit(int64_t group) { return group >= QV ? 1 : QV / group; }

/* Fill a forward's KV slots, key lists and units (see Rows) from its sequences. Sequence b:
 * rows [row0[b], row0[b] + nnew[b]), ctx[b] cached tokens, block table tables[tab0[b]...],
 * new-token mask masks[msk0[b]...] ([nnew, nnew] uint8; msk0 < 0: causal, and all its rows
 * share one list); its new token r is written at logical position ctx + r. keys holds sum
 * over causal sequences of ctx + nnew, over trees of nnew (ctx + nnew); unit_first and
 * unit_width hold up to `rows` entries. Returns the units. */
int64_t row_lists(int64_t nseq, const int64_t *row0, const int64_t *nnew, const int64_t *ctx, const int64_t *tab0,
                  const int32_t *tables, const int64_t *msk0, const uint8_t *masks, int64_t bs, int64_t per_unit,
                  int64_t *slot, int64_t *count, int64_t *start, int64_t *keys, int64_t *unit_first,
                  int64_t *unit_width) {
    int64_t u = 0, at = 0;
    for (int64_t b = 0; b < nseq; b++) {
        const int32_t *table = tables + tab0[b];
        for (int64_t r = 0; r < nnew[b]; r++) slot[row0[b] + r] = (int64_t)table[(ctx[b] + r) / bs] * bs + (ctx[b] + r) % bs;
        for (int64_t r = 0; r < nnew[b]; r += per_unit, u++) {
            unit_first[u] = row0[b] + r;
            unit_width[u] = nnew[b] - r < per_unit ? nnew[b] - r : per_unit;
        }
        if (msk0[b] < 0) {          /* causal: row r sees the first ctx + r + 1 keys of one list */
            visible_slots(table, bs, ctx[b], nnew[b], nnew[b] - 1, NULL, keys + at);
            for (int64_t r = 0; r < nnew[b]; r++) {
                count[row0[b] + r] = ctx[b] + r + 1;
                start[row0[b] + r] = at;
            }
            at += ctx[b] + nnew[b];
        } else {                    /* a tree: each node its own list (the prefix, then its ancestors) */
            for (int64_t r = 0; r < nnew[b]; r++) {
                const uint8_t *mask = masks + msk0[b] + r * nnew[b];
                count[row0[b] + r] = visible_slots(table, bs, ctx[b], nnew[b], r, mask, keys + at);
                start[row0[b] + r] = at;
                at += ctx[b] + nnew[b];
            }
        }
    }
    return u;
}

/* The query vectors of unit u, KV head kvh, query heads [h0, h0 + nhq). */
static Item unit_item(const Heads *hd, const Rows *rw, const float *q, int64_t u, int64_t kvh, int64_t h0,
                      int64_t nhq, bf16 *out) {
    Item it = {.nq = 0, .kvh = kvh};
    for (int64_t t = rw->unit_first[u]; t < rw->unit_first[u] + rw->unit_width[u]; t++)
        for (int64_t h = h0; h < h0 + nhq; h++, it.nq++) {
            it.q[it.nq] = q + (t * hd->nh + h) * hd->d;
            it.out[it.nq] = out + (t * hd->nh + h) * hd->d;
            it.list[it.nq] = rw->keys + rw->start[t];
            it.n[it.nq] = rw->count[t];
        }
    return it;
}

/* How one forward's attention is split into work: an item is one chunk of keys of a unit's
 * rows for one KV head's query heads (up to `heads` of them; `splits` items cover a KV head's
 * group), `first[u]` the first item of unit u; parts holds each item's chunk results. */
typedef struct {
    const Heads *hd;
    const Rows *rw;
    const float *q;
    const bf16 *k_cache, *v_cache;
    bf16 *out;
    int64_t group, heads, splits, per_unit, stride;
    int64_t *first;
    float *parts;
} Work;

/* Item i: its unit's vectors for one KV head, over one chunk of keys. score: QV x CH floats. */
static void attend_item(const Work *w, int64_t i, float *score) {
    const Heads *hd = w->hd;
    int64_t u = 0;
    while (w->first[u + 1] <= i) u++;
    int64_t j = i - w->first[u], chunks = (w->first[u + 1] - w->first[u]) / w->per_unit;
    int64_t kvh = j / chunks / w->splits, h0 = kvh * w->group + j / chunks % w->splits * w->heads;
    int64_t nhq = h0 + w->heads <= (kvh + 1) * w->group ? w->heads : (kvh + 1) * w->group - h0;
    Item it = unit_item(hd, w->rw, w->q, u, kvh, h0, nhq, w->out);
    float *part = w->parts + i * QV * w->stride;
#if TILES_BUILT
    if (w->rw->tiles && tiles_on && hd->d % 64 == 0 && hd->d <= TILES_MAX_D) {
        attend_chunk_tiles(&it, j % chunks * CH, w->k_cache, w->v_cache, hd->nkv, hd->d, hd->scale, hd->softcap, score,
                           part);
        return;
    }
#endif
    if (hd->d == 64)
        attend_chunk_d64(&it, j % chunks * CH, w->k_cache, w->v_cache, hd->nkv, hd->scale, hd->softcap, score, part);
    else if (hd->d == 128)
        attend_chunk_d128(&it, j % chunks * CH, w->k_cache, w->v_cache, hd->nkv, hd->scale, hd->softcap, score,
                          part);
    else
        attend_chunk(&it, j % chunks * CH, w->k_cache, w->v_cache, hd->nkv, hd->d, hd->scale, hd->softcap, score,
                     part);
}

/* Group g (a unit's vectors for one KV head): each vector's chunks merged in chunk order. */
static void merge_group(const Work *w, int64_t g) {
    int64_t u = g / w->per_unit, kvh = g % w->per_unit / w->splits, h0 = kvh * w->group + g % w->splits * w->heads;
    int64_t nhq = h0 + w->heads <= (kvh + 1) * w->group ? w->heads : (kvh + 1) * w->group - h0;
    int64_t chunks = (w->first[u + 1] - w->first[u]) / w->per_unit;
    Item it = unit_item(w->hd, w->rw, w->q, u, kvh, h0, nhq, w->out);
    const float *part = w->parts + (w->first[u] + g % w->per_unit * chunks) * QV * w->stride;
    for (int r = 0; r < it.nq; r++) merge_chunks(part + r * w->stride, chunks, QV * w->stride, w->hd->d, it.out[r]);
}

/* Attention of every row, out bf16 [T, NH * D], for q fp32 [T, NH, D] over the bf16 caches,
 * flash-decoding style: the items (a single decode row at a 300-token context: 2 chunks x 3
 * KV heads) are spread over the threads, and each vector's chunks are merged in order once all
 * are done. A chunk's bounds depend only on the row's own key count, so the work split never
 * changes a row's bits. Forwards below hd->parallel_from, and every forward on one thread (the
 * thread governor's choice beside a busy neighbour), run on the calling thread alone: an OpenMP
 * region, even of one thread, costs about as much as a small forward's attention. */
void attend(const Heads *hd, const Rows *rw, const float *q, const bf16 *k_cache, const bf16 *v_cache, bf16 *out) {
    const int64_t group = hd->nh / hd->nkv, heads = group < QV ? group : QV, splits = (group + heads - 1) / heads;
    if (rw->tiles) tiles_usable();      /* before the threads read tiles_on */
    Work w = {hd, rw, q, k_cache, v_cache, out, group, heads, splits, hd->nkv * splits, hd->d + 2, NULL, NULL};
    w.first = malloc(sizeof(int64_t) * (rw->units + 1));
    w.first[0] = 0;
    for (int64_t u = 0; u < rw->units; u++) {
        int64_t most = 0;
        for (int64_t t = rw->unit_first[u]; t < rw->unit_first[u] + rw->unit_width[u]; t++)
            most = rw->count[t] > most ? rw->count[t] : most;
        w.first[u + 1] = w.first[u] + w.per_unit * ((most + CH - 1) / CH);
    }
    const int64_t items = w.first[rw->units], groups = rw->units * w.per_unit;
    w.parts = malloc(sizeof(float) * items * QV * w.stride);
    if (rw->rows * rw->longest * hd->nh >= hd->parallel_from && omp_get_max_threads() > 1) {
        #pragma omp parallel
        {
            float score[QV * CH];
            #pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < items; i++) attend_item(&w, i, score);
            #pragma omp for schedule(dynamic, 1)
            for (int64_t g = 0; g < groups; g++) merge_group(&w, g);
        }
    } else {
        float score[QV * CH];
        for (int64_t i = 0; i < items; i++) attend_item(&w, i, score);
        for (int64_t g = 0; g < groups; g++) merge_group(&w, g);
    }
    free(w.parts);
    free(w.first);
}

/* Ask the memory system for the K and V rows this layer's attention will read, up to
 * hd->prefetch_bytes of them: each unit's longest key list, in order (a tree's units share
 * their prefix, which then comes once per unit). Called before the layer's qkv matmul, so the
 * lines arrive while its weights stream: the next layers' weights evict a step's KV cache,
 * and attention would otherwise wait on each of its lines. Results do not change. */
void prefetch_kv(const Heads *hd, const Rows *rw, const bf16 *k_cache, const bf16 *v_cache) {
    const int64_t row = hd->nkv * hd->d * (int64_t)sizeof(bf16);    /* one slot's K (or V) bytes */
    int64_t bytes = hd->prefetch_bytes;
    for (int64_t u = 0; u < rw->units && bytes > 0; u++) {
        int64_t t = rw->unit_first[u];
        for (int64_t r = t; r < rw->unit_first[u] + rw->unit_width[u]; r++) t = rw->count[r] > rw->count[t] ? r : t;
        const int64_t *list = rw->keys + rw->start[t];
        for (int64_t i = 0; i < rw->count[t] && bytes > 0; i++, bytes -= 2 * row) {
            const char *k = (const char *)k_cache + list[i] * row, *v = (const char *)v_cache + list[i] * row;
            for (int64_t e = 0; e < row; e += 64) {
                __builtin_prefetch(k + e, 0, 2);
                __builtin_prefetch(v + e, 0, 2);
            }
        }
    }
}

#if defined(__x86_64__)
/* clflushopt where the CPU has it (CPUID leaf 7, EBX bit 23), whatever -march the build took:
 * clflush, the fallback, waits for each line and took seconds per load. */
__attribute__((target("clflushopt"))) static void flush_opt(const char *p, int64_t bytes) {
    for (int64_t e = 0; e < bytes; e += 64) _mm_clflushopt(p + e);
}

static int has_clflushopt(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b >> 23 & 1);
}
#endif

/* Push [p, p + bytes) out of every cache level, line by line: the attention timing's cold start
 * (verifier/quantized/attention_tuning.py) at the cost of those bytes, not of reading a buffer
 * the size of the caches. 1 where done; 0 where this build has no flush instruction. */
int64_t flush_lines(const void *p, int64_t bytes) {
#if defined(__x86_64__)
    static int opt = -1;
    if (opt < 0) opt = has_clflushopt();
    if (opt) {
        flush_opt((const char *)p, bytes);
    } else {
        for (int64_t e = 0; e < bytes; e += 64) _mm_clflush((const char *)p + e);
    }
    _mm_mfence();
    return 1;
#else
    (void)p; (void)bytes;
    return 0;
#endif
}

/* One layer's attention from its qkv projection: q = rope(q heads) into the workspace
 * q_ws fp32 [T, NH, D]; the cache's slots get rope(k heads) and the v heads; then out =
 * attention. qkv bf16 [T, (NH + 2 NKV) D]; bias fp32 [(NH + 2 NKV) D] or NULL. */
void attention(const Heads *hd, const Rows *rw, const bf16 *qkv, const float *bias, float *q_ws, bf16 *k_cache,
               bf16 *v_cache, bf16 *out) {
    rope_store(qkv, bias, hd->cos, hd->sin, rw->pos, rw->slot, rw->rows, hd->nh, hd->nkv, hd->d, q_ws, k_cache,
               v_cache);
    attend(hd, rw, q_ws, k_cache, v_cache, out);
}
