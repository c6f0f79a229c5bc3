/* A GGUF's blocks repacked into Tercel's kernel layouts in one pass over the file's bytes
 * (verifier/quantized/own_kernels/from_file.py calls these at load).
 *
 * Every function takes the weight's rows as an array of row addresses (`row`, rows of one
 * fused projection may lie in several tensors of the file) and writes whole tiles of 16
 * channels, channels past `rows` zero. The layouts are the ones the kernels read and the
 * Python packers write (own_kernels/q4x16.py pack_q4, q4k.py pack_q4k, q8x16.py pack_q8),
 * byte for byte (tests/model/test_model_sizes.py).
 *
 * Nibble bytes of a block of 32 weights (csrc/q4_nibbles.h): byte 64 g + 4 c + e holds
 * channel c's weights 4 g + e (low nibble) and 16 + 4 g + e (high nibble). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Each product and quotient rounded on its own, as torch rounds them (no fused multiply-add):
 * the LM head's scan requantized here is the one `quantize_int4` gives, bit for bit. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define TILE 16

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline void store_bf16(uint8_t *p, float f) {
    bf16 v = f32_to_bf16(f);
    memcpy(p, &v, 2);
}

/* Q4_0 (d; w = d (q - 8)) or Q4_1 (d, m; w = d q + m) -> q4x16: per tile and block 256 nibble
 * bytes, 16 bf16 scales d, 16 bf16 zeros (0, or m + 8 d). A block's byte j holds weights j and
 * j + 16 in the file as in the layout: the nibble bytes are the file's, reordered. */
void repack_q4x16(const int64_t *row, int64_t rows, int64_t blocks, int64_t affine, uint8_t *out) {
    const int64_t size = affine ? 20 : 18, qs_at = affine ? 4 : 2, tiles = (rows + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *o = out + (t * blocks + b) * 320;
            memset(o, 0, 320);
            for (int c = 0; c < TILE && t * TILE + c < rows; c++) {
                const uint8_t *blk = (const uint8_t *)(intptr_t)row[t * TILE + c] + b * size;
                for (int g = 0; g < 4; g++)
                    memcpy(o + 64 * g + 4 * c, blk + qs_at + 4 * g, 4);
                float d = f16_to_f32(load_u16(blk));
                store_bf16(o + 256 + 2 * c, d);
                store_bf16(o + 288 + 2 * c, affine ? f16_to_f32(load_u16(blk + 2)) + 8.0f * d : 0.0f);
            }
        }
    }
}

/* A Q4_K super-block's 8 sub-blocks' 6-bit scales and mins from its 12 bytes at blk + 4: bytes
 * 0-3 hold scales 0-3 (and the top bits of scales 4-7), 4-7 mins 0-3 (and the top bits of mins
 * 4-7), 8-11 the low four bits of scales and mins 4-7 (gguf_blocks/q4_k.py:k_scales). */
static inline void q4k_scales(const uint8_t *blk, uint8_t *sc, uint8_t *mn) {
    const uint8_t *d4 = blk + 4, *m4 = blk + 8, *low = blk + 12;
    for (int j = 0; j < 8; j++) {
        sc[j] = (uint8_t)(j < 4 ? d4[j] & 63 : (low[j - 4] & 15) | ((d4[j - 4] >> 2) & 0x30));
        mn[j] = (uint8_t)(j < 4 ? m4[j] & 63 : (low[j - 4] >> 4) | ((m4[j - 4] >> 2) & 0x30));
    }
}

/* One 32-byte chunk of a Q4_K super-block (lo: weights 0-15's bytes, hi: 16-31's; sub-block
 * 2 j in the low nibbles, 2 j + 1 in the high ones) -> channel c's nibble bytes of both
 * sub-blocks at `even` and `even` + 256 (byte 64 g + e: weights 4 g + e and 16 + 4 g + e). */
static inline void q4k_chunk(const uint8_t *lo, uint8_t *even) {
    uint8_t ev[16], od[16];
#if defined(__SSE2__)
    /* the same bytes 16 at a time (a load's repacking was byte by byte: 0.6-1 GB/s) */
    const __m128i m = _mm_set1_epi8(0x0F);
    __m128i l = _mm_loadu_si128((const __m128i *)lo), h = _mm_loadu_si128((const __m128i *)(lo + 16));
    _mm_storeu_si128((__m128i *)ev, _mm_or_si128(_mm_and_si128(l, m), _mm_slli_epi16(_mm_and_si128(h, m), 4)));
    _mm_storeu_si128((__m128i *)od, _mm_or_si128(_mm_and_si128(_mm_srli_epi16(l, 4), m), _mm_andnot_si128(m, h)));
#else
    for (int i = 0; i < 16; i++) {
        ev[i] = (uint8_t)((lo[i] & 15) | (lo[16 + i] << 4));
        od[i] = (uint8_t)((lo[i] >> 4) | (lo[16 + i] & 0xF0));
    }
#endif
    for (int g = 0; g < 4; g++) {
        memcpy(even + 64 * g, ev + 4 * g, 4);
        memcpy(even + 256 + 64 * g, od + 4 * g, 4);
    }
}

/* Q4_K super-blocks (d, dmin fp16; 12 bytes of 6-bit sc and mn; 4 chunks of 32 bytes, chunk j
 * holding sub-block 2 j in its low nibbles and 2 j + 1 in its high ones) -> q4k: per tile and
 * super-block the channels' d and dmin (fp16 as stored), sc and mn (sub-block major), then the
 * 8 sub-blocks' nibbles as q4x16 lays a block's out. */
void repack_q4k(const int64_t *row, int64_t rows, int64_t supers, uint8_t *out) {
    const int64_t tiles = (rows + TILE - 1) / TILE, bytes = 64 + 256 + 8 * 256;
    for (int64_t t = 0; t < tiles; t++) {
        memset(out + t * supers * bytes, 0, supers * bytes);
        /* channel by channel, each row read in order (a tile's 16 rows side by side, a super-block
         * at a time, were 16 streams) */
        for (int c = 0; c < TILE && t * TILE + c < rows; c++) {
            for (int64_t s = 0; s < supers; s++) {
                uint8_t *o = out + (t * supers + s) * bytes;
                const uint8_t *blk = (const uint8_t *)(intptr_t)row[t * TILE + c] + s * 144;
                uint8_t sc[8], mn[8];
                memcpy(o + 2 * c, blk, 2);
                memcpy(o + 32 + 2 * c, blk + 2, 2);
                q4k_scales(blk, sc, mn);
                for (int j = 0; j < 8; j++) {
                    o[64 + 16 * j + c] = sc[j];
                    o[192 + 16 * j + c] = mn[j];
                }
                for (int chunk = 0; chunk < 4; chunk++)
                    q4k_chunk(blk + 16 + 32 * chunk, o + 320 + 2 * chunk * 256 + 4 * c);
            }
        }
    }
}

/* A Q6_K super-block's 256 unsigned 6-bit values, in order. */
static inline void q6k_decode(const uint8_t *blk, uint8_t *u) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
        uint8_t *o = u + 128 * h;
        for (int l = 0; l < 32; l++) {
            o[l] = (uint8_t)((ql[l] & 15) | (qh[l] & 3) << 4);
            o[32 + l] = (uint8_t)((ql[32 + l] & 15) | ((qh[l] >> 2) & 3) << 4);
            o[64 + l] = (uint8_t)((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4);
            o[96 + l] = (uint8_t)((ql[32 + l] >> 4) | ((qh[l] >> 6) & 3) << 4);
        }
    }
}

/* 1 where every weight of the Q6_K rows fits 5 bits (u - 32 in -16..15: q8x16 holds it in 5). */
int64_t q6k_fits_5_bits(const int64_t *row, int64_t rows, int64_t supers) {
    for (int64_t n = 0; n < rows; n++)
        for (int64_t s = 0; s < supers; s++) {
            uint8_t u[256];
            q6k_decode((const uint8_t *)(intptr_t)row[n] + s * 210, u);
            for (int i = 0; i < 256; i++)
                if (u[i] < 16 || u[i] >= 48)
                    return 0;
        }
    return 1;
}

/* Q6_K -> q8x16 in `bits` (5 or 6) with Q6_K's own scales: per tile and super-block the channels'
 * d (fp16 as stored), then per block of 32 weights v's low nibbles (v = u - 32 + 2^(bits - 1)),
 * 64 bytes per higher bit (as planes: bit 4 h + g of byte 4 c + e holds weight 16 h + 4 g + e's;
 * as masks: bit 4 c + e of 64-bit mask 4 h + g), and the channels' int8 sc of its two groups of 16. */
void repack_q6k(const int64_t *row, int64_t rows, int64_t supers, int64_t bits, int64_t masks, uint8_t *out) {
    const int64_t tiles = (rows + TILE - 1) / TILE, block_bytes = 256 + 64 * (bits - 4) + 32;
    const int64_t bytes = 32 + 8 * block_bytes;
    const uint8_t shift = (uint8_t)(32 - (1 << (bits - 1)));
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *o = out + (t * supers + s) * bytes;
            memset(o, 0, bytes);
            for (int c = 0; c < TILE && t * TILE + c < rows; c++) {
                const uint8_t *blk = (const uint8_t *)(intptr_t)row[t * TILE + c] + s * 210;
                uint8_t v[256];
                q6k_decode(blk, v);
                for (int i = 0; i < 256; i++)
                    v[i] = (uint8_t)(v[i] - shift);
                memcpy(o + 2 * c, blk + 208, 2);
                for (int b = 0; b < 8; b++) {
                    uint8_t *ob = o + 32 + b * block_bytes;
                    const uint8_t *vb = v + 32 * b;
                    for (int g = 0; g < 4; g++)
                        for (int e = 0; e < 4; e++)
                            ob[64 * g + 4 * c + e] = (uint8_t)((vb[4 * g + e] & 15) | (vb[16 + 4 * g + e] & 15) << 4);
                    for (int p = 4; p < bits; p++) {
                        uint8_t *plane = ob + 256 + 64 * (p - 4);
                        for (int vec = 0; vec < 8; vec++) {          /* weights 16 h + 4 g + e, vec = 4 h + g */
                            const uint8_t *w = vb + 4 * vec;
                            if (masks) {
                                int four = 0;
                                for (int e = 0; e < 4; e++)
                                    four |= ((w[e] >> p) & 1) << e;
                                plane[8 * vec + c / 2] |= (uint8_t)(four << (4 * (c % 2)));
                            } else {
                                for (int e = 0; e < 4; e++)
                                    plane[4 * c + e] |= (uint8_t)(((w[e] >> p) & 1) << vec);
                            }
                        }
                    }
                    ob[block_bytes - 32 + c] = blk[192 + 2 * b];
                    ob[block_bytes - 16 + c] = blk[192 + 2 * b + 1];
                }
            }
        }
    }
}

/* Q6_K rows -> the int8 form a table takes (`Int8KWeight.as_grouped`): q = u - 32, int8 [N, K];
 * scale = d * sc per 16 weights, fp32 [N, K / 16]. */
void unpack_q6k(const int64_t *row, int64_t rows, int64_t supers, int8_t *q, float *scale) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        for (int64_t s = 0; s < supers; s++) {
            const uint8_t *blk = (const uint8_t *)(intptr_t)row[n] + s * 210;
            int8_t *qo = q + (n * supers + s) * 256;
            uint8_t u[256];
            q6k_decode(blk, u);
            for (int i = 0; i < 256; i++)
                qo[i] = (int8_t)(u[i] - 32);
            float d = f16_to_f32(load_u16(blk + 208));
            for (int j = 0; j < 16; j++)
                scale[(n * supers + s) * 16 + j] = d * (float)(int8_t)blk[192 + j];
        }
    }
}

/* An int8 table (q int8 [N, K], an fp32 scale per `group` of 16 or 32) requantized to int4 groups
 * of 32 as `quantize_int4` does (per group min lo and max hi, d = (hi - lo) / 15, q rounded half
 * to even from (w - lo) / d, zero lo + 8 d) and packed for q4x16 (out [ceil(N / 16), K / 32, 320]):
 * the LM head's scan, in one pass over the table. */
void scan_int4_from_int8(const int8_t *q, const float *scale, int64_t rows, int64_t cols, int64_t group,
                         uint8_t *out) {
    const int64_t tiles = (rows + TILE - 1) / TILE, blocks = cols / 32;
    /* on every thread: a large vocabulary's scan is the longest task of a load (each tile its own bytes) */
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *o = out + (t * blocks + b) * 320;
            memset(o, 0, 320);
            for (int c = 0; c < TILE && t * TILE + c < rows; c++) {
                const int64_t n = t * TILE + c;
                const int8_t *qb = q + n * cols + 32 * b;
                const float *sb = scale + n * (cols / group) + 32 * b / group;
                float w[32], lo, hi;
                uint8_t v[32];
                for (int i = 0; i < 32; i++)            /* split so that the compiler vectorizes each */
                    w[i] = (float)qb[i] * sb[group == 32 ? 0 : i / 16];
                lo = hi = w[0];
                for (int i = 1; i < 32; i++) {
                    lo = w[i] < lo ? w[i] : lo;
                    hi = w[i] > hi ? w[i] : hi;
                }
                float d = (hi - lo) / 15.0f, safe = d > 0.0f ? d : 1.0f;
                for (int i = 0; i < 32; i++) {
                    float r = nearbyintf((w[i] - lo) / safe);
                    v[i] = (uint8_t)(r < 0.0f ? 0.0f : r > 15.0f ? 15.0f : r);
                }
                for (int g = 0; g < 4; g++)
                    for (int e = 0; e < 4; e++)
                        o[64 * g + 4 * c + e] = (uint8_t)(v[4 * g + e] | v[16 + 4 * g + e] << 4);
                store_bf16(o + 256 + 2 * c, d);
                store_bf16(o + 288 + 2 * c, lo + 8.0f * d);
            }
        }
    }
}

/* Q4_K rows -> the embedding table's form (`QuantEmbedding` over `Int4KWeight`): q two to a byte
 * in weight order (byte j: weights 2 j low, 2 j + 1 high; q [N, K / 2]), each sub-block's sc and
 * mn (uint8 [N, K / 32]), each super-block's d and dmin (fp32 [N, K / 256]). */
void unpack_q4k_table(const int64_t *row, int64_t rows, int64_t supers, uint8_t *q, uint8_t *sc, uint8_t *mn,
                      float *d, float *dmin) {
    for (int64_t n = 0; n < rows; n++) {
        for (int64_t s = 0; s < supers; s++) {
            const uint8_t *blk = (const uint8_t *)(intptr_t)row[n] + s * 144;
            const int64_t at = n * supers + s;
            d[at] = f16_to_f32(load_u16(blk));
            dmin[at] = f16_to_f32(load_u16(blk + 2));
            q4k_scales(blk, sc + 8 * at, mn + 8 * at);
            uint8_t *qo = q + 128 * at;
            for (int c = 0; c < 4; c++) {              /* chunk c: weights 64 c + l (low), 64 c + 32 + l (high) */
                const uint8_t *qs = blk + 16 + 32 * c;
                for (int l = 0; l < 32; l += 2) {
                    qo[32 * c + l / 2] = (uint8_t)((qs[l] & 15) | (qs[l + 1] & 15) << 4);
                    qo[32 * c + 16 + l / 2] = (uint8_t)((qs[l] >> 4) | (qs[l + 1] & 0xF0));
                }
            }
        }
    }
}
