/* One pass of an EAGLE-3 head's decoder layer (drafters/eagle3/head.py: project, attend, finish)
 * over a few rows, a draft-tree level or a catch-up on accepted tokens, on weights packed for
 * q8_matmul (int8 in groups of 32). One call instead of some forty torch ops, whose dispatch
 * cost more than the products. Draft numbers need only the torch path's values, not its bits:
 * a draft is a point mass the target verifies.
 *
 * Layouts (contiguous, row-major): emb, hid, out fp32 [T, H]; K and V fp32 [slots, NKV, D];
 * rope tables fp32 [positions, D], sin's first half negated (verifier/model/rope.py). A row
 * sees every one of the `ctx` context slots, then the tree's `ntmp` slots where
 * mask[row * ntmp + j] is 1; the T rows' own keys and values are written to tree slots
 * [ntmp - T, ntmp) first.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

int64_t q8_matmul(const uint8_t *w, int64_t bits, int64_t group, int64_t n, int64_t k, const bf16 *x, int64_t m,
                  bf16 *out);
void silu_mul(const bf16 *gu, int64_t rows, int64_t inter, bf16 *out);
void add_rms_norm(float *x, const bf16 *y, const float *w, float eps, int64_t rows, int64_t h, bf16 *out);

#define Q8_BITS 8
#define Q8_GROUP 32

typedef struct {            /* DraftLayer in verifier/cpu/cpu_ops.py */
    int64_t hidden, heads, kv_heads, head_dim, inter, norm_before_residual, norm_output, positions;
    float eps;
    const float *hidden_norm, *input_norm, *post_norm, *final_norm;
    const uint8_t *qkv, *o, *gate_up, *down;      /* q8_matmul's packed weights */
    const float *cos_tab, *sin_tab;
} DraftLayer;

static float dotf(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void norm_f32(const float *x, const float *w, float eps, int64_t h, float *out) {
    float r = 1.0f / sqrtf(dotf(x, x, h) / (float)h + eps);
    for (int64_t i = 0; i < h; i++) out[i] = x[i] * r * w[i];
}

static void to_bf16(const float *x, int64_t n, bf16 *out) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(x[i]);
}

/* HF's half-split rotation: out = x * cos + roll(x, D / 2) * sin_signed */
static void rope(const bf16 *x, const float *c, const float *s, int64_t d, float *out) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < d; i++)
        out[i] = bf16_to_f32(x[i]) * c[i] + bf16_to_f32(x[i < half ? i + half : i - half]) * s[i];
}

/* out [nh * D] = softmax(q . k / sqrt(D)) v for one row over the keys it sees */
static void attend_row(const DraftLayer *L, const float *q, const float *kc, const float *vc, int64_t ctx,
                       const float *kt, const float *vt, int64_t ntmp, const uint8_t *mask, float *sc, float *out) {
    int64_t d = L->head_dim, kvs = L->kv_heads * d, g = L->heads / L->kv_heads;
    float scale = 1.0f / sqrtf((float)d);
    for (int64_t h = 0; h < L->heads; h++) {
        const float *qh = q + h * d;
        int64_t off = (h / g) * d;
        float top = -INFINITY, total = 0.0f;
        for (int64_t j = 0; j < ctx + ntmp; j++) {
            int seen = j < ctx || mask[j - ctx];
            const float *k = j < ctx ? kc + j * kvs + off : kt + (j - ctx) * kvs + off;
            sc[j] = seen ? dotf(qh, k, d) * scale : -INFINITY;
            if (sc[j] > top) top = sc[j];
        }
        float *o = out + h * d;
        memset(o, 0, (size_t)d * sizeof *o);
        for (int64_t j = 0; j < ctx + ntmp; j++) {
            if (sc[j] == -INFINITY) continue;
            float p = expf(sc[j] - top);
            const float *v = j < ctx ? vc + j * kvs + off : vt + (j - ctx) * kvs + off;
            total += p;
            for (int64_t i = 0; i < d; i++) o[i] += p * v[i];
        }
        for (int64_t i = 0; i < d; i++) o[i] /= total;
    }
}

/* Returns 0, 1 when out of memory, 2 when a matmul refuses its shapes, 3 for a position past the
 * rope tables. */
int64_t draft_layer(const DraftLayer *L, int64_t t, const float *emb, const float *hid, const int64_t *pos,
                    const float *kc, const float *vc, int64_t ctx, float *kt, float *vt, int64_t ntmp,
                    const uint8_t *mask, float *out) {
    int64_t H = L->hidden, D = L->head_dim, I = L->inter, qs = L->heads * D, kvs = L->kv_heads * D;
    int64_t nqkv = qs + 2 * kvs;
    if (t < 1) return 0;
    for (int64_t r = 0; r < t; r++)
        if (pos[r] < 0 || pos[r] >= L->positions) return 3;
    float *f = malloc(sizeof(float) * (size_t)(t * (H + 2 * qs) + ctx + ntmp + H));
    bf16 *b = malloc(sizeof(bf16) * (size_t)(t * (2 * H + nqkv + qs + 3 * H + 3 * I)));
    if (!f || !b) {
        free(f);
        free(b);
        return 1;
    }
    float *res = f, *q = res + t * H, *att = q + t * qs, *sc = att + t * qs;
    float *row = sc + ctx + ntmp;
    bf16 *xin = b, *qkv = xin + t * 2 * H, *attb = qkv + t * nqkv, *ob = attb + t * qs, *xn = ob + t * H;
    bf16 *gu = xn + t * H, *act = gu + t * 2 * I, *dn = act + t * I;
    int64_t rc = 0;
    for (int64_t r = 0; r < t; r++) {         /* cat(input_layernorm(emb), hidden_norm(hid)) */
        norm_f32(emb + r * H, L->input_norm, L->eps, H, row);
        to_bf16(row, H, xin + r * 2 * H);
        norm_f32(hid + r * H, L->hidden_norm, L->eps, H, row);
        to_bf16(row, H, xin + r * 2 * H + H);
        memcpy(res + r * H, L->norm_before_residual ? row : hid + r * H, (size_t)H * sizeof(float));
    }
    if (q8_matmul(L->qkv, Q8_BITS, Q8_GROUP, nqkv, 2 * H, xin, t, qkv)) { rc = 2; goto done; }
    for (int64_t r = 0; r < t; r++) {
        const float *c = L->cos_tab + pos[r] * D, *s = L->sin_tab + pos[r] * D;
        const bf16 *in = qkv + r * nqkv;
        int64_t slot = (ntmp - t + r) * kvs;
        for (int64_t h = 0; h < L->heads; h++) rope(in + h * D, c, s, D, q + r * qs + h * D);
        for (int64_t h = 0; h < L->kv_heads; h++) rope(in + qs + h * D, c, s, D, kt + slot + h * D);
        for (int64_t i = 0; i < kvs; i++) vt[slot + i] = bf16_to_f32(in[qs + kvs + i]);
    }
    for (int64_t r = 0; r < t; r++)
        attend_row(L, q + r * qs, kc, vc, ctx, kt, vt, ntmp, mask + r * ntmp, sc, att + r * qs);
    to_bf16(att, t * qs, attb);
    if (q8_matmul(L->o, Q8_BITS, Q8_GROUP, H, qs, attb, t, ob)) { rc = 2; goto done; }
    add_rms_norm(res, ob, L->post_norm, L->eps, t, H, xn);      /* res += o; the MLP's input norm */
    if (q8_matmul(L->gate_up, Q8_BITS, Q8_GROUP, 2 * I, H, xn, t, gu)) { rc = 2; goto done; }
    silu_mul(gu, t, I, act);
    if (q8_matmul(L->down, Q8_BITS, Q8_GROUP, H, I, act, t, dn)) { rc = 2; goto done; }
    add_rms_norm(res, dn, L->post_norm, L->eps, t, H, NULL);     /* res += MLP: the layer's h */
    for (int64_t r = 0; r < t; r++) {
        if (L->norm_output) norm_f32(res + r * H, L->final_norm, L->eps, H, out + r * H);
        else memcpy(out + r * H, res + r * H, (size_t)H * sizeof(float));
    }
done:
    free(f);
    free(b);
    return rc;
}
