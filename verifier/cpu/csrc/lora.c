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
 * Exactness: each row's outputs come from one fixed sequence of operations (16 lanes over K,
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

#define LANES 16
#define CHUNK 4             /* rows of one adapter sharing each read of its weights */

/* 16 lanes as GCC's vector extension: one AVX-512 register, or two AVX2 ones, whatever the build. */
typedef float f16v __attribute__((vector_size(4 * LANES)));
typedef uint32_t u16v __attribute__((vector_size(4 * LANES)));
typedef uint16_t h16v __attribute__((vector_size(2 * LANES)));

static inline f16v load_bf16(const bf16 *p) {
    h16v h;
    memcpy(&h, p, sizeof h);
    u16v u = __builtin_convertvector(h, u16v) << 16;
    f16v f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline f16v load_f32(const float *p) {
    f16v f;
    memcpy(&f, p, sizeof f);
    return f;
}

static inline float scalar_bf16(const bf16 *p) { return bf16_to_f32(*p); }
static inline float scalar_f32(const float *p) { return *p; }

/* The lanes summed in a fixed tree. */
static inline float lanes_sum(f16v v) {
    float s[LANES];
    memcpy(s, &v, sizeof s);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) s[l] += s[l + w];
    return s[0];
}

/* DOTS: u[i * stride] = A_j . x_i for the chunk's rows (x fp32 [rows, k]), one pass over A_j: per
 * row a 16-lane accumulator over K's full lanes, summed in a fixed tree, then K's tail in order.
 * AXPYS: d_i[c] += u_i * b[c], c < n, for the chunk's rows (d_i at d + i * ny), one pass over b.
 * ADD_ROWS: up to CHUNK rows of one slot: x fp32 [rows, k], y bf16 rows (ys[i]: row i's [ny]); u
 * scratch [CHUNK, rank], d scratch [CHUNK, ny]. Each row's operations are those it would get alone.
 * One copy per weight type W (LOAD: 16 lanes of it as fp32, SCALAR: one). */
#define LORA_KERNELS(SUFFIX, W, LOAD, SCALAR)                                                              \
static void dots_##SUFFIX(const W *a, const float *x, int64_t rows, int64_t k, float *u, int64_t stride) {   \
    f16v acc[CHUNK] = {{0}};                                                                               \
    int64_t full = k - k % LANES;                                                                          \
    for (int64_t e = 0; e < full; e += LANES) {                                                            \
        f16v av = LOAD(a + e);                                                                             \
        for (int64_t i = 0; i < rows; i++) acc[i] += av * load_f32(x + i * k + e);                         \
    }                                                                                                      \
    for (int64_t i = 0; i < rows; i++) {                                                                   \
        float t = lanes_sum(acc[i]);                                                                       \
        for (int64_t e = full; e < k; e++) t += SCALAR(a + e) * x[i * k + e];                              \
        u[i * stride] = t;                                                                                 \
    }                                                                                                      \
}                                                                                                          \
                                                                                                           \
static void axpys_##SUFFIX(const W *b, const float *u, int64_t ustride, int64_t rows, int64_t n, float *d,   \
                           int64_t ny) {                                                                   \
    int64_t full = n - n % LANES;                                                                          \
    for (int64_t c = 0; c < full; c += LANES) {                                                            \
        f16v bv = LOAD(b + c);                                                                             \
        for (int64_t i = 0; i < rows; i++) {                                                               \
            f16v dv = load_f32(d + i * ny + c) + u[i * ustride] * bv;                                      \
            memcpy(d + i * ny + c, &dv, sizeof dv);                                                        \
        }                                                                                                  \
    }                                                                                                      \
    for (int64_t c = full; c < n; c++)                                                                     \
        for (int64_t i = 0; i < rows; i++) d[i * ny + c] += u[i * ustride] * SCALAR(b + c);                \
}                                                                                                          \
                                                                                                           \
static void add_rows_##SUFFIX(const LoraTable *t, int64_t slot, const float *x, int64_t rows, int64_t k,    \
                              int64_t ny, bf16 *const *ys, float *u, int64_t rank, float *d) {             \
    for (int64_t i = 0; i < rows * ny; i++) d[i] = 0.0f;                                                   \
    for (int64_t g = t->first[slot - 1]; g < t->first[slot]; g++) {                                        \
        const LoraSegment *s = &t->segs[g];                                                                \
        const W *a = s->a, *bt = s->bt;                                                                    \
        for (int64_t j = 0; j < s->rank; j++) dots_##SUFFIX(a + j * k, x, rows, k, u + j, rank);           \
        for (int64_t j = 0; j < s->rank; j++)                                                              \
            axpys_##SUFFIX(bt + j * s->n, u + j, rank, rows, s->n, d + s->off, ny);                        \
    }                                                                                                      \
    for (int64_t i = 0; i < rows; i++)                                                                     \
        for (int64_t c = 0; c < ny; c++) ys[i][c] = f32_to_bf16(bf16_to_f32(ys[i][c]) + d[i * ny + c]);    \
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
        float *buf = malloc(sizeof(float) * (size_t)(CHUNK * (k + rank + ny)));
        bf16 *ys[CHUNK];
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            if (!buf) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            int64_t m = starts[c + 1] - starts[c];
            for (int64_t i = 0; i < m; i++) {
                int64_t r = order[starts[c] + i];
                ys[i] = y + r * ny;
                for (int64_t e = 0; e < k; e++) buf[i * k + e] = bf16_to_f32(x[r * k + e]);
            }
            (t->bf16 ? add_rows_bf16 : add_rows_f32)(t, slots[order[starts[c]]], buf, m, k, ny, ys, buf + CHUNK * k,
                                                     rank, buf + CHUNK * (k + rank));
        }
        free(buf);
    }
    free(order);
    return failed;
}
