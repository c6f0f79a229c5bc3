/* LoRA adapters' products added to a quantized projection's output, row by row
 * (verifier/model/lora.py builds the tables; decode_loop.cpp and the Python loop call lora_add
 * after the projection's own kernel).
 *
 * A projection's pair under one adapter is a list of segments, one per part of a fused
 * projection (q, k and v of qkv_proj; gate and up of gate_up_proj): output columns
 * [off, off + n) get (x A^T) B^T, A [rank, K] and B^T [rank, n] (the scale folded in) in fp32, or
 * in bf16 where the table says (half the bytes a step streams per adapter, at some precision:
 * docs/performance.md, "LoRA adapters"); products and sums in fp32, rounded to bf16 once per
 * output.
 *
 * Exactness: each row's outputs come from one fixed sequence of operations (a register's lanes over K,
 * summed in a fixed tree, then K's tail; then the rank's terms in order), on one thread,
 * whichever rows share its chunk: a row's bits do not depend on the rows beside it, how many
 * there are, or the thread count.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

typedef struct {
    int64_t rank, off, n;
    const void *a, *bt;         /* float, or bf16 where the table's bf16 is set */
} LoraSegment;

/* One projection's adapters: slot s (1 .. slots) has segments segs[first[s - 1] .. first[s]);
 * first has slots + 1 entries, first[0] = 0. */
typedef struct {
    const LoraSegment *segs;
    const int64_t *first;
    int64_t slots, bf16;
} LoraTable;

/* One vector register's lanes (GCC's vector extension): wider types split into registers that GCC
 * then shuffles through the stack. JB * CHUNK accumulators, CHUNK of x and one of A fit the file. */
#ifdef __AVX512F__
#define LANES 16
#define JB 4                /* rows of A per pass */
#else
#define LANES 8
#define JB 2
#endif
#define CHUNK 4             /* rows of one adapter sharing each read of its weights */

typedef float fv __attribute__((vector_size(4 * LANES)));
typedef uint32_t uv __attribute__((vector_size(4 * LANES)));
typedef uint16_t hv __attribute__((vector_size(2 * LANES)));

static inline fv load_bf16(const bf16 *p) {
    hv h;
    memcpy(&h, p, sizeof h);
    uv u = __builtin_convertvector(h, uv) << 16;
    fv f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline fv load_f32(const float *p) {
    fv f;
    memcpy(&f, p, sizeof f);
    return f;
}

static inline float scalar_bf16(const bf16 *p) { return bf16_to_f32(*p); }
static inline float scalar_f32(const float *p) { return *p; }

/* The lanes summed in a fixed tree. */
static inline float lanes_sum(fv v) {
    float s[LANES];
    memcpy(s, &v, sizeof s);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) s[l] += s[l + w];
    return s[0];
}

/* DOTS: u[i * rank + j] = A_j . x_i for the chunk's CHUNK rows (x fp32 [CHUNK, k]; rows past the
 * chunk's own repeat its first, their results unused) and all r of A's rows, JB rows of A per pass
 * (JB * CHUNK accumulators in registers; each loaded vector of A and of x feeds several FMAs): per
 * (row, j) a one-register accumulator over K's full lanes, summed in a fixed tree, then K's tail in order.
 * ADDS: y_i[off + c] += sum_j u_i[j] * b_j[c] for c < n, the terms in j's order from zero, in
 * registers, rounded to bf16 once (ys[i]: row i's output row).
 * ADD_ROWS: one slot's segments over a chunk (u scratch [CHUNK, rank]). Each row's operations are
 * those it would get alone, whatever JB and the rows beside it.
 * One copy per weight type W (LOAD: LANES of it as fp32, SCALAR: one). */
#define LORA_KERNELS(SUFFIX, W, LOAD, SCALAR)                                                              \
static void dots_##SUFFIX(const W *a, int64_t r, const float *x, int64_t k, float *u, int64_t rank) {      \
    int64_t full = k - k % LANES, j = 0;                                                                   \
    for (; j + JB <= r; j += JB) {                                                                         \
        fv acc[JB][CHUNK] = {{{0}}};                                                                     \
        for (int64_t e = 0; e < full; e += LANES) {                                                        \
            fv xv[CHUNK];                                                                                \
            for (int i = 0; i < CHUNK; i++) xv[i] = load_f32(x + i * k + e);                               \
            for (int q = 0; q < JB; q++) {                                                                 \
                fv av = LOAD(a + (j + q) * k + e);                                                       \
                for (int i = 0; i < CHUNK; i++) acc[q][i] += av * xv[i];                                   \
            }                                                                                              \
        }                                                                                                  \
        for (int q = 0; q < JB; q++)                                                                       \
            for (int i = 0; i < CHUNK; i++) u[i * rank + j + q] = dot_tail_##SUFFIX(acc[q][i], a + (j + q) * k, \
                                                                                 x + i * k, full, k);      \
    }                                                                                                      \
    for (; j < r; j++) {                                                                                   \
        fv acc[CHUNK] = {{0}};                                                                           \
        for (int64_t e = 0; e < full; e += LANES) {                                                        \
            fv av = LOAD(a + j * k + e);                                                                 \
            for (int i = 0; i < CHUNK; i++) acc[i] += av * load_f32(x + i * k + e);                        \
        }                                                                                                  \
        for (int i = 0; i < CHUNK; i++) u[i * rank + j] = dot_tail_##SUFFIX(acc[i], a + j * k, x + i * k, full, k); \
    }                                                                                                      \
}                                                                                                          \
                                                                                                           \
static void adds_##SUFFIX(const W *b, int64_t r, const float *u, int64_t rank, int64_t rows, int64_t n,      \
                          bf16 *const *ys) {                                                               \
    int64_t full = n - n % LANES;                                                                          \
    for (int64_t c = 0; c < full; c += LANES) {                                                            \
        fv acc[CHUNK] = {{0}};                                                                           \
        for (int64_t j = 0; j < r; j++) {                                                                  \
            fv bv = LOAD(b + j * n + c);                                                                 \
            for (int i = 0; i < CHUNK; i++) acc[i] += u[i * rank + j] * bv;                                \
        }                                                                                                  \
        for (int64_t i = 0; i < rows; i++) {                                                               \
            float d[LANES];                                                                                \
            memcpy(d, &acc[i], sizeof d);                                                                  \
            for (int l = 0; l < LANES; l++) ys[i][c + l] = f32_to_bf16(bf16_to_f32(ys[i][c + l]) + d[l]);   \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t c = full; c < n; c++)                                                                     \
        for (int64_t i = 0; i < rows; i++) {                                                               \
            float t = 0.0f;                                                                                \
            for (int64_t j = 0; j < r; j++) t += u[i * rank + j] * SCALAR(b + j * n + c);                  \
            ys[i][c] = f32_to_bf16(bf16_to_f32(ys[i][c]) + t);                                             \
        }                                                                                                  \
}                                                                                                          \
                                                                                                           \
static void add_rows_##SUFFIX(const LoraTable *t, int64_t slot, const float *x, int64_t rows, int64_t k,    \
                              bf16 *const *ys, float *u, int64_t rank) {                                   \
    for (int64_t g = t->first[slot - 1]; g < t->first[slot]; g++) {                                        \
        const LoraSegment *s = &t->segs[g];                                                                \
        bf16 *at[CHUNK];                                                                                   \
        for (int64_t i = 0; i < rows; i++) at[i] = ys[i] + s->off;                                         \
        dots_##SUFFIX((const W *)s->a, s->rank, x, k, u, rank);                                            \
        adds_##SUFFIX((const W *)s->bt, s->rank, u, rank, rows, s->n, at);                                 \
    }                                                                                                      \
}

/* An accumulator's lanes in a fixed tree, then K's tail in order. */
static inline float dot_tail_f32(fv acc, const float *a, const float *x, int64_t full, int64_t k) {
    float t = lanes_sum(acc);
    for (int64_t e = full; e < k; e++) t += a[e] * x[e];
    return t;
}

static inline float dot_tail_bf16(fv acc, const bf16 *a, const float *x, int64_t full, int64_t k) {
    float t = lanes_sum(acc);
    for (int64_t e = full; e < k; e++) t += bf16_to_f32(a[e]) * x[e];
    return t;
}

LORA_KERNELS(f32, float, load_f32, scalar_f32)
LORA_KERNELS(bf16, bf16, load_bf16, scalar_bf16)

static int64_t max_rank(const LoraTable *t) {
    int64_t r = 1;
    for (int64_t g = 0; g < t->first[t->slots]; g++) r = t->segs[g].rank > r ? t->segs[g].rank : r;
    return r;
}

/* y bf16 [rows, ny] += each row's adapter's product over x bf16 [rows, k]: row r takes slot
 * slots[r] (0, or one the table has no segments for: unchanged). The rows of one slot go in
 * chunks of CHUNK (its weights read once a chunk), the chunks in parallel. 0, or 1 when out of
 * memory (the forward then fails). */
int64_t lora_add(const LoraTable *t, const int64_t *slots, const bf16 *x, int64_t rows, int64_t k, int64_t ny,
                 bf16 *y) {
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(2 * rows + 1)), *starts = order + rows, chunks = 0, n = 0;
    if (!order) return 1;
    for (int64_t s = 1; s <= t->slots; s++) {           /* rows by slot, cut into chunks */
        if (t->first[s - 1] == t->first[s]) continue;
        int64_t in_chunk = CHUNK;
        for (int64_t r = 0; r < rows; r++)
            if (slots[r] == s) {
                if (in_chunk == CHUNK) starts[chunks++] = n, in_chunk = 0;
                order[n++] = r, in_chunk++;
            }
    }
    starts[chunks] = n;
    int64_t rank = max_rank(t), failed = 0;
    #pragma omp parallel if (chunks > 1)
    {
        float *buf = malloc(sizeof(float) * (size_t)(CHUNK * (k + rank)));
        bf16 *ys[CHUNK];
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (!buf) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            int64_t m = starts[c + 1] - starts[c];
            for (int64_t i = 0; i < CHUNK; i++) {              /* rows past m repeat the first */
                int64_t r = order[starts[c] + (i < m ? i : 0)];
                ys[i] = y + r * ny;
                for (int64_t e = 0; e < k; e++) buf[i * k + e] = bf16_to_f32(x[r * k + e]);
            }
            (t->bf16 ? add_rows_bf16 : add_rows_f32)(t, slots[order[starts[c]]], buf, m, k, ys, buf + CHUNK * k, rank);
        }
        free(buf);
    }
    free(order);
    return failed;
}
