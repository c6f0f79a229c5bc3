/* One matmul over a fused projection whose parts a file stores in different formats (a
 * Q4_K_M's Q8_0 attn_v below Q5_0 attn_q and attn_k, or Q6_K below Q4_K): each part in its own
 * kernel's layout, all parts in one call.
 *
 * Why: held in one layout, the parts take the widest part's (an 8-bit qkv where two thirds of
 * it is stored in 5 bits, or Q4_K requantized to 8 bits beside a Q6_K part), and two calls pay
 * the activations' quantization and a parallel region twice. Its runner (`parts_matmul`) is
 * also q4_matmul's and q8_matmul's: a weight in one layout is one part.
 *
 * Weights: the parts' packings one after another, each as its kernel lays it out
 * (q4_matmul.c's int4 tiles, q8_matmul.c's 5-, 6- or 8-bit tiles); parts int64 [nparts, 3]:
 * (rows, bits, group) per part, bits 4 for q4_matmul.c's layout (group 0) or q4k_matmul.c's
 * (group 256, K a multiple of 256), 5, 6 or 8 for q8_matmul.c's (group 16 or 32, or 256 for its
 * int8 scales under a d per 256, Q6_K's). A part's rows need not fill its last tile.
 *
 * Exactness: every tile is the part's kernel's own tile function over the same quantized
 * activations, so a row's outputs are bitwise what q4_matmul / q8_matmul give for that part,
 * alone or among other rows (tests/kernels/test_mixed_matmul.py).
 */
#include <omp.h>
#include <stdint.h>

#include "act_quant.h"

#define MIXED_TILE 16       /* output channels per tile, both layouts */
#define MIXED_ROWS 8        /* rows per tile call: Q4_ROWS = Q8_ROWS */
#define MIXED_PARTS 8       /* the most parts a weight has (q, k, v: 3) */

/* q4_matmul.c's, q8_matmul.c's and q4k_matmul.c's tiles and block sizes (ref: the scalar reference) */
void q4_tile(int ref, const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y);
int64_t q4_block_bytes(void);
void q8_tile(int ref, int64_t bits, int64_t group, const uint8_t *w, const Act *a, int64_t r0, int64_t rows,
             float *y);
int64_t q8_block_bytes(int64_t bits, int64_t group);
void q4k_tile(int ref, const uint8_t *w, const Act *a, int64_t r0, int64_t rows, float *y);   /* q4k_matmul.c */
int64_t q4k_block_bytes(void);

typedef struct {
    int64_t rows, bits, group;
    int64_t first_tile, out_row, offset, tile_bytes;
} Part;

/* The parts' tiles and offsets; returns the total tiles, or -1 for a bad table. */
static int64_t lay_out(const int64_t *table, int64_t nparts, int64_t n, int64_t nb, Part *parts) {
    int64_t tiles = 0, rows = 0, offset = 0;
    if (nparts < 1 || nparts > MIXED_PARTS) return -1;
    for (int64_t p = 0; p < nparts; p++) {
        Part *pt = &parts[p];
        pt->rows = table[3 * p], pt->bits = table[3 * p + 1], pt->group = table[3 * p + 2];
        int super = pt->group == 256 && nb % 8 == 0;           /* K-quant scales under a d per 256 */
        int q8 = (pt->bits == 5 || pt->bits == 6 || pt->bits == 8) && (pt->group == 16 || pt->group == 32 || super);
        int q4 = pt->bits == 4 && pt->group == 0, q4k = pt->bits == 4 && super;
        if (pt->rows < 1 || !(q8 || q4 || q4k)) return -1;
        pt->tile_bytes = nb * (q8 ? q8_block_bytes(pt->bits, pt->group) : q4k ? q4k_block_bytes() : q4_block_bytes());
        pt->first_tile = tiles, pt->out_row = rows, pt->offset = offset;
        int64_t t = (pt->rows + MIXED_TILE - 1) / MIXED_TILE;
        tiles += t, rows += pt->rows, offset += t * pt->tile_bytes;
    }
    return rows == n ? tiles : -1;
}

/* The runner of every integer matmul (q4_matmul and q8_matmul are weights of one part):
 * out = x @ W.T over the parts' tiles, each tile's rows by one thread in block order. */
int64_t parts_matmul(int ref, const uint8_t *w, const int64_t *table, int64_t nparts, int64_t n, int64_t k,
                     const bf16 *x, int64_t m, bf16 *out) {
    Part parts[MIXED_PARTS];
    Act a;
    if (k % ACT_BLOCK) return 1;
    int64_t tiles = lay_out(table, nparts, n, k / ACT_BLOCK, parts);
    if (tiles < 0 || act_alloc(&a, m, k)) return 1;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) act_quantize_row(x, r, ref, &a);
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t p = 0;
            while (p + 1 < nparts && parts[p + 1].first_tile <= t) p++;
            const Part *pt = &parts[p];
            int64_t lt = t - pt->first_tile, valid = pt->rows - lt * MIXED_TILE;
            const uint8_t *wt = w + pt->offset + lt * pt->tile_bytes;
            float y[MIXED_ROWS * MIXED_TILE];
            for (int64_t r0 = 0; r0 < m; r0 += MIXED_ROWS) {
                int64_t rows = m - r0 < MIXED_ROWS ? m - r0 : MIXED_ROWS;
                if (pt->bits == 4 && pt->group == 256)
                    q4k_tile(ref, wt, &a, r0, rows, y);
                else if (pt->bits == 4)
                    q4_tile(ref, wt, &a, r0, rows, y);
                else
                    q8_tile(ref, pt->bits, pt->group, wt, &a, r0, rows, y);
                for (int64_t i = 0; i < rows; i++)
                    store_row(y + i * MIXED_TILE, valid < MIXED_TILE ? valid : MIXED_TILE,
                              out + (r0 + i) * n + pt->out_row + lt * MIXED_TILE);
            }
        }
    }
    act_free(&a);
    return 0;
}

/* out bf16 [M, N] = x bf16 [M, K] @ W.T for W packed as above (N the parts' rows together, K a
 * multiple of 32). Returns 0, or 1 (a bad K or part table, or no memory). */
int64_t mixed_matmul(const uint8_t *w, const int64_t *parts, int64_t nparts, int64_t n, int64_t k, const bf16 *x,
                     int64_t m, bf16 *out) {
    return parts_matmul(0, w, parts, nparts, n, k, x, m, out);
}

/* The same through the parts' scalar references (tests compare the two bit for bit). */
int64_t mixed_matmul_ref(const uint8_t *w, const int64_t *parts, int64_t nparts, int64_t n, int64_t k,
                         const bf16 *x, int64_t m, bf16 *out) {
    return parts_matmul(1, w, parts, nparts, n, k, x, m, out);
}
