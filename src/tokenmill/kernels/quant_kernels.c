/* Weight-only quantised linear layers: y = x W^T (+ bias), W kept in 32-weight blocks.
 *
 * Weight layout (built by tokenmill/layers/quantized.py; rows padded to a multiple of 64 columns,
 * padding blocks have scale 0 and offset 0; scales and offsets are float16 or float32 per `half`):
 *   w[j, i] = scale[j, b] * u[j, i] + offset[j, b],  b = i / 32,  u an unsigned byte value
 *   int8: u stored one per byte, row j at data + j * padded_k.
 *   int4: u in 0..15, row j at data + j * padded_k / 2; the 32 bytes of block pair p hold block 2p in
 *         their low nibbles and block 2p + 1 in their high nibbles.
 * Activations are quantised per 32-value block like llama.cpp's q8 dot products:
 *   x[r, i] ~ dx[r, b] * q[r, i],  dx = absmax / 127,  q = round_half_even(x / dx) in [-127, 127]
 * so that, with s[r, b] = dx[r, b] * sum_i q[r, i] over the block,
 *   y[r, j] = sum_b scale[j, b] dx[r, b] (u . q)_b + sum_b offset[j, b] s[r, b].
 * The integer dot products are exact (vpdpbusd on AVX512-VNNI); sums run in float32 in a fixed order
 * per output, so a row's result does not depend on the other rows of the batch or the thread count.
 */
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define QBLOCK 32
#define QPAIR 64
/* Weight rows are taken 4 at a time, so each loaded input block serves four dot products, and input
 * rows 4 at a time, so each loaded (and unpacked) weight block serves four as well. A row's result
 * does not depend on which tile it falls in: per (weight row, input row) the same operations run
 * in the same order. */
#define ROW_TILE 4
#define INPUT_TILE 4

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_VNNI 1
#endif

/* One activation row -> q (padded_k int8), dx and s (padded_k / 32 floats each). */
static void quantize_row(int8_t *q, float *dx, float *s, const void *x, int64_t k, int64_t padded_k, int bf16) {
    for (int64_t b = 0; b < padded_k / QBLOCK; b++) {
        int8_t *qb = q + b * QBLOCK;
        if (b * QBLOCK >= k) {
            memset(qb, 0, QBLOCK);
            dx[b] = 0.0f;
            s[b] = 0.0f;
            continue;
        }
        float v[QBLOCK], amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            v[i] = load_value(x, b * QBLOCK + i, bf16);
            amax = fmaxf(amax, fabsf(v[i]));
        }
        float d = amax / 127.0f;
        float inv = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QBLOCK; i++) {
            float r = nearbyintf(v[i] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            qb[i] = (int8_t)r;
            sum += qb[i];
        }
        dx[b] = d;
        s[b] = d * (float)sum;
    }
}

/* Row j's unsigned weight bytes in plain order (padded_k of them) into `dst`. */
static void unpack_int4_row(uint8_t *dst, const uint8_t *src, int64_t padded_k) {
    for (int64_t p = 0; p < padded_k / QPAIR; p++) {
        const uint8_t *in = src + p * QBLOCK;
        uint8_t *out = dst + p * QPAIR;
#ifdef TM_VNNI
        __m256i raw = _mm256_loadu_si256((const __m256i *)in);
        __m256i mask = _mm256_set1_epi8(0x0f);
        _mm256_storeu_si256((__m256i *)out, _mm256_and_si256(raw, mask));
        _mm256_storeu_si256((__m256i *)(out + QBLOCK), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
#else
        for (int i = 0; i < QBLOCK; i++) {
            out[i] = in[i] & 0x0f;
            out[QBLOCK + i] = in[i] >> 4;
        }
#endif
    }
}

#ifdef TM_VNNI
/* Sum each of four vectors: out[t] = sum of v[t]'s 16 lanes. */
static inline void reduce4(float *out, const __m512 *v) {
    __m256 h[4];
    for (int t = 0; t < 4; t++) h[t] = _mm256_add_ps(_mm512_castps512_ps256(v[t]), _mm512_extractf32x8_ps(v[t], 1));
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)));
}

/* Up to 4 weight rows (their unsigned bytes in plain order, or int4-packed when `packed4`) against one
 * quantised input row: out[t] = sum_b scale_t[b] dx[b] (u_t . q)_b + sum_b offset_t[b] s[b].
 * dx16 holds the input's scales expanded per block pair: [dx[2p] x 8, dx[2p + 1] x 8]. Always inlined
 * with a constant nt and packed4, so the accumulators live in registers. */
/* 16 (masked) scales or offsets from element i on, float16 or float32 per `half`, as float32 lanes. */
static inline __m512 load_scales(const void *base, int64_t i, __mmask16 valid, const int half) {
    if (half) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, (const uint16_t *)base + i));
    return _mm512_maskz_loadu_ps(valid, (const float *)base + i);
}

static inline __attribute__((always_inline)) void dot_tile(
    float *out, const int nt, const int nr, const int packed4, const int half, const uint8_t *const *w,
    const void *const *scale, const void *const *offset, const int8_t *q, const float *dx16, const float *s,
    int64_t padded_k) {
    const int64_t pairs = padded_k / QPAIR, blocks = padded_k / QBLOCK;
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m512 acc[ROW_TILE][INPUT_TILE];
    /* the offsets' share first: sum_b offset_t[b] s_r[b], 16 blocks per step */
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < nr; r++) acc[t][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 16) {
        const __mmask16 valid = blocks - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (blocks - b)) - 1);
        for (int t = 0; t < nt; t++) {
            const __m512 off = load_scales(offset[t], b, valid, half);
            for (int r = 0; r < nr; r++)
                acc[t][r] = _mm512_fmadd_ps(off, _mm512_maskz_loadu_ps(valid, s + r * blocks + b), acc[t][r]);
        }
    }
    /* then the blocks' dot products, 8 pairs (16 scales) per group; each weight vector loaded (and
     * unpacked) once serves all nr input rows */
    for (int64_t g = 0; g < pairs; g += 8) {
        const int64_t in_group = pairs - g >= 8 ? 8 : pairs - g;
        const __mmask16 valid = in_group == 8 ? (__mmask16)0xffff : (__mmask16)((1u << (2 * in_group)) - 1);
        __m512 group[ROW_TILE];
        for (int t = 0; t < nt; t++) group[t] = load_scales(scale[t], 2 * g, valid, half);
        for (int64_t i = 0; i < in_group; i++) {
            const int64_t p = g + i;
            /* lanes 0-7 of a pair's dot product belong to block 2p, lanes 8-15 to block 2p + 1 */
            const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32((int)(2 * i)),
                                                  _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
            for (int t = 0; t < nt; t++) {
                __m512i wu;
                if (packed4) {
                    __m256i raw = _mm256_loadu_si256((const __m256i *)(w[t] + p * QBLOCK));
                    wu = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, nibble)),
                                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble), 1);
                } else {
                    wu = _mm512_loadu_si512(w[t] + p * QPAIR);
                }
                const __m512 row_scales = _mm512_permutexvar_ps(pick, group[t]);
                for (int r = 0; r < nr; r++) {
                    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu,
                                                      _mm512_loadu_si512(q + r * padded_k + p * QPAIR));
                    __m512 weights = _mm512_mul_ps(row_scales, _mm512_loadu_ps(dx16 + (r * pairs + p) * 16));
                    acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), weights, acc[t][r]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++) {
        if (nt == ROW_TILE) {
            __m512 row[ROW_TILE];
            for (int t = 0; t < ROW_TILE; t++) row[t] = acc[t][r];
            reduce4(out + r * ROW_TILE, row);
        } else {
            for (int t = 0; t < nt; t++) out[r * ROW_TILE + t] = _mm512_reduce_add_ps(acc[t][r]);
        }
    }
}
#else
static inline float scale_at(const void *base, int64_t i, const int half) {
    return half ? f16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static void dot_tile(float *out, const int nt, const int nr, const int packed4, const int half,
                     const uint8_t *const *w, const void *const *scale, const void *const *offset, const int8_t *q,
                     const float *dx16, const float *s, int64_t padded_k) {
    const int64_t blocks = padded_k / QBLOCK, pairs = padded_k / QPAIR;
    for (int r = 0; r < nr; r++) {
        const int8_t *q_r = q + r * padded_k;
        const float *dx16_r = dx16 + r * pairs * 16, *s_r = s + r * blocks;
        for (int t = 0; t < nt; t++) {
            float acc = 0.0f, corr = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int i = 0; i < QBLOCK; i++) {
                    int64_t col = b * QBLOCK + i;
                    int32_t u;
                    if (packed4) {
                        const uint8_t byte = w[t][(b / 2) * QBLOCK + i];
                        u = (b & 1) ? byte >> 4 : byte & 0x0f;
                    } else {
                        u = w[t][col];
                    }
                    dot += u * (int32_t)q_r[col];
                }
                acc += scale_at(scale[t], b, half) * dx16_r[(b / 2) * 16 + (b & 1) * 8] * (float)dot;
                corr += scale_at(offset[t], b, half) * s_r[b];
            }
            out[r * ROW_TILE + t] = acc + corr;
        }
    }
}
#endif

static void store_outputs(void *y, int64_t index, const float *v, int nt, const float *bias, int64_t j, int bf16) {
    for (int t = 0; t < nt; t++) store_value(y, index + t, bias ? v[t] + bias[j + t] : v[t], bf16);
}

/* dot_tile with nt, nr, packed4 and half as constants (one specialisation each): full tiles of
 * ROW_TILE weight rows, a partial one row by row; INPUT_TILE input rows at a time, the rest one by one. */
#define DOT_TILE_ROWS(NR, PACKED4, HALF)                                                                    \
    if (nt == ROW_TILE)                                                                                     \
        dot_tile(v, ROW_TILE, NR, PACKED4, HALF, w, scale_t, offset_t, q_r, dx16_r, s_r, padded_k);      \
    else                                                                                                    \
        for (int t = 0; t < nt; t++)                                                                        \
            dot_tile(v + t, 1, NR, PACKED4, HALF, w + t, scale_t + t, offset_t + t, q_r, dx16_r, s_r, padded_k);
#define DOT_TILE_CASE(PACKED4, HALF)                                                                        \
    if (nr == INPUT_TILE) { DOT_TILE_ROWS(INPUT_TILE, PACKED4, HALF) }                                      \
    else { DOT_TILE_ROWS(1, PACKED4, HALF) }
#define DOT_TILE_DISPATCH()                                                                                 \
    do {                                                                                                    \
        if (packed4 && half) { DOT_TILE_CASE(1, 1) }                                                        \
        else if (packed4) { DOT_TILE_CASE(1, 0) }                                                           \
        else if (half) { DOT_TILE_CASE(0, 1) }                                                              \
        else { DOT_TILE_CASE(0, 0) }                                                                        \
    } while (0)

#define PREFETCH_TILES 4

static inline void prefetch_bytes(const void *start, int64_t bytes) {
#ifdef __AVX512F__
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char *)start + offset, _MM_HINT_T0);
#else
    (void)start;
    (void)bytes;
#endif
}


/* y[r, j] for r < m, j < n. x rows at x_stride, y rows at y_stride (elements of the storage dtype,
 * float32 or bfloat16 per `bf16`); bias (float32, n) may be NULL. bits is 8 or 4; `half` says the
 * scales and offsets are float16. With 4 or more
 * input rows, int4 rows are unpacked once into a buffer and shared by all of them. */
void tm_qlinear(void *y, const void *x, const uint8_t *data, const void *scale, const void *offset,
                const float *bias, int64_t m, int64_t k, int64_t n, int64_t x_stride, int64_t y_stride,
                int bits, int half, int bf16) {
    const int64_t padded_k = (k + QPAIR - 1) / QPAIR * QPAIR, blocks = padded_k / QBLOCK;
    const int64_t pairs = padded_k / QPAIR;
    const int64_t row_bytes = bits == 4 ? padded_k / 2 : padded_k;
    const int64_t elem = bf16 ? 2 : 4;
    const int unpack = bits == 4 && m >= 4;
    int8_t *q = (int8_t *)aligned_alloc(64, (size_t)(m * padded_k));
    float *dx = (float *)malloc(sizeof(float) * (size_t)(m * blocks));
    float *dx16 = (float *)aligned_alloc(64, sizeof(float) * (size_t)(m * pairs * 16));
    float *s = (float *)malloc(sizeof(float) * (size_t)(m * blocks));
    #pragma omp parallel for schedule(static) if (m > 4)
    for (int64_t r = 0; r < m; r++) {
        quantize_row(q + r * padded_k, dx + r * blocks, s + r * blocks,
                     (const char *)x + r * x_stride * elem, k, padded_k, bf16);
        for (int64_t b = 0; b < blocks; b++)
            for (int i = 0; i < 8; i++) dx16[(r * pairs + b / 2) * 16 + (b & 1) * 8 + i] = dx[r * blocks + b];
    }

    const int64_t tiles = (n + ROW_TILE - 1) / ROW_TILE;
    #pragma omp parallel
    {
        uint8_t *buffer = unpack ? (uint8_t *)aligned_alloc(64, (size_t)(ROW_TILE * padded_k)) : NULL;
        const int64_t scale_bytes = half ? 2 : 4;
        #pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            const int64_t j = tile * ROW_TILE;
            const int nt = n - j >= ROW_TILE ? ROW_TILE : (int)(n - j);
            const uint8_t *w[ROW_TILE];
            const void *scale_t[ROW_TILE], *offset_t[ROW_TILE];
            /* Twelve streams per tile (data, scales, offsets of 4 rows) are more than the hardware
             * prefetcher follows: fetch the tile PREFETCH_TILES ahead explicitly. */
            if (tile + PREFETCH_TILES < tiles) {
                const int64_t ahead = j + PREFETCH_TILES * ROW_TILE;
                const int64_t rows_ahead = n - ahead < ROW_TILE ? n - ahead : ROW_TILE;
                prefetch_bytes(data + ahead * row_bytes, rows_ahead * row_bytes);
                prefetch_bytes((const char *)scale + ahead * blocks * scale_bytes, rows_ahead * blocks * scale_bytes);
                prefetch_bytes((const char *)offset + ahead * blocks * scale_bytes, rows_ahead * blocks * scale_bytes);
            }
            for (int t = 0; t < nt; t++) {
                w[t] = data + (j + t) * row_bytes;
                if (unpack) {
                    unpack_int4_row(buffer + t * padded_k, w[t], padded_k);
                    w[t] = buffer + t * padded_k;
                }
                scale_t[t] = (const char *)scale + (j + t) * blocks * scale_bytes;
                offset_t[t] = (const char *)offset + (j + t) * blocks * scale_bytes;
            }
            const int packed4 = bits == 4 && !unpack;
            for (int64_t r = 0; r < m;) {
                const int nr = m - r >= INPUT_TILE ? INPUT_TILE : 1;
                float v[INPUT_TILE * ROW_TILE];  /* v[i * ROW_TILE + t]: input row r + i, weight row j + t */
                const int8_t *q_r = q + r * padded_k;
                const float *dx16_r = dx16 + r * pairs * 16, *s_r = s + r * blocks;
                DOT_TILE_DISPATCH();
                for (int i = 0; i < nr; i++)
                    store_outputs(y, (r + i) * y_stride + j, v + i * ROW_TILE, nt, bias, j, bf16);
                r += nr;
            }
        }
        free(buffer);
    }
    free(q);
    free(dx);
    free(dx16);
    free(s);
}

/* The activation quantisation alone, for tests: q [m, padded_k] int8, dx and s [m, padded_k / 32]. */
void tm_quantize_activations(int8_t *q, float *dx, float *s, const void *x, int64_t m, int64_t k,
                             int64_t x_stride, int bf16) {
    const int64_t padded_k = (k + QPAIR - 1) / QPAIR * QPAIR, blocks = padded_k / QBLOCK;
    const int64_t elem = bf16 ? 2 : 4;
    for (int64_t r = 0; r < m; r++)
        quantize_row(q + r * padded_k, dx + r * blocks, s + r * blocks,
                     (const char *)x + r * x_stride * elem, k, padded_k, bf16);
}

/* out[j, :k] = scale * u + offset: rows [0, n) of a packed weight dequantised into a contiguous
 * [n, k] matrix of the storage dtype (float32 or bfloat16 per `bf16`), for products with many input
 * rows, where one dequantisation serves them all. */
void tm_dequantize(void *out, const uint8_t *data, const void *scale, const void *offset, int64_t n, int64_t k,
                   int bits, int half, int bf16) {
    const int64_t padded_k = (k + QPAIR - 1) / QPAIR * QPAIR, blocks = padded_k / QBLOCK;
    const int64_t row_bytes = bits == 4 ? padded_k / 2 : padded_k;
    const int64_t scale_bytes = half ? 2 : 4;
    #pragma omp parallel
    {
        uint8_t *u = (uint8_t *)aligned_alloc(64, (size_t)padded_k);
        float *sc = (float *)malloc(sizeof(float) * (size_t)blocks * 2), *off = sc + blocks;
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *src = data + j * row_bytes;
            if (bits == 4) {
                unpack_int4_row(u, src, padded_k);
                src = u;
            }
            const char *scale_j = (const char *)scale + j * blocks * scale_bytes;
            const char *offset_j = (const char *)offset + j * blocks * scale_bytes;
            for (int64_t b = 0; b < blocks; b++) {
                sc[b] = half ? f16_to_f32(((const uint16_t *)scale_j)[b]) : ((const float *)scale_j)[b];
                off[b] = half ? f16_to_f32(((const uint16_t *)offset_j)[b]) : ((const float *)offset_j)[b];
            }
            for (int64_t b = 0; b < k / QBLOCK; b++) {
                const int64_t base = j * k + b * QBLOCK;
#ifdef TM_VNNI
                const __m512 vs = _mm512_set1_ps(sc[b]), vo = _mm512_set1_ps(off[b]);
                for (int h = 0; h < QBLOCK; h += 16) {
                    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + b * QBLOCK + h))));
                    v = _mm512_add_ps(_mm512_mul_ps(v, vs), vo);  /* rounded twice, as the reference computes it */
                    if (bf16) {
#ifdef __AVX512BF16__
                        _mm256_storeu_si256((__m256i *)((uint16_t *)out + base + h), (__m256i)_mm512_cvtneps_pbh(v));
#else
                        float lanes[16];
                        _mm512_storeu_ps(lanes, v);
                        for (int i = 0; i < 16; i++) ((uint16_t *)out)[base + h + i] = f32_to_bf16(lanes[i]);
#endif
                    } else {
                        _mm512_storeu_ps((float *)out + base + h, v);
                    }
                }
#else
                for (int i = 0; i < QBLOCK; i++) store_value(out, base + i, (float)src[b * QBLOCK + i] * sc[b] + off[b], bf16);
#endif
            }
        }
        free(u);
        free(sc);
    }
}
