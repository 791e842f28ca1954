/* Weight-only quantised linear layers: y = x W^T (+ bias), W in the cell layout of quant_cells.h.
 *
 * Activations are quantised per 32-value block like llama.cpp's q8 dot products:
 *   x[r, i] ~ dx[r, b] * q[r, i],  dx = absmax / 127,  q = round_half_even(x / dx) in [-127, 127]
 * so that, with s[r, b] = dx[r, b] * sum_i q[r, i] over the block,
 *   y[r, j] = sum_b (scale[j, b] dx[r, b]) (u . q)_b + offset[j, b] s[r, b].
 * With sub-scales (QS_SUB: sub[j, f] over features [16 f, 16 f + 16)), per block of halves f0, f1
 *   t = sub[j, f0] (u . q)_f0 + sub[j, f1] (u . q)_f1,  z = sub[j, f0] sum_f0 q + sub[j, f1] sum_f1 q
 *   y[r, j] = sum_b t (scale[j, b] dx[r, b]) + z (offset[j, b] dx[r, b]),
 * t and z exact integers (|t| < 2^28).
 * The integer dot products are exact (vpdpbusd on AVX512-VNNI, 16 outputs in the lanes of one vector;
 * on AVX-512 without VNNI, vpmaddubsw + vpmaddwd over 16 outputs, on AVX2 over 8, which give the same
 * integers); the float sums run over the blocks in order, two fused multiply-adds per block, per
 * output, on every level (the portable C path with fmaf). A row's result therefore does not depend on
 * the other rows of the batch, the tiling or the thread count, nor, for a given input, on the level.
 */
#include <math.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_avx2.h"
#include "cpu_common.h"
#include "quant_cells.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_VNNI 1
#endif
/* cells_tile's 16 outputs a vector: AVX-512 with BW, with or without VNNI */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TM_WIDE_CELLS 1
#endif

/* amx_int8.c: the same product's integer dots on AMX-INT8 tiles, bit-identical; -1 where it cannot run. */
int tm_amx_int8_qlinear(void *y, int64_t y_stride, const uint8_t *cells, const float *bias, const int8_t *q,
                        const float *dx, const float *s, int64_t m, int64_t padded_k, int64_t n, int bits, int scales,
                        int bf16);
/* Input rows from which tm_qlinear takes the AMX-INT8 tiles where they run (either path gives the same bits). */
#define AMX_INT8_FROM_ROWS 16

/* Bytes of the cells of an [n, k] weight. */
int64_t tm_qcells_bytes(int64_t n, int64_t k, int bits, int scales) {
    return qgroups(n) * (qpadded_k(k) / QBLOCK) * qcell_bytes(bits, scales);
}

/* Row-layout weight (kernels/quantized.py: row j's data at data + j * row_bytes, blocks scales and
 * offsets per row, and with QS_SUB its sub-scales, padded_k / 16 per row) -> cells (tm_qcells_bytes of
 * them). */
void tm_qcells_pack(uint8_t *cells, const uint8_t *data, const void *scale, const void *offset, const int8_t *sub,
                    int64_t n, int64_t k, int bits, int scales) {
    const int64_t padded_k = qpadded_k(k), blocks = padded_k / QBLOCK, groups = qgroups(n);
    const int64_t row_bytes = bits == 4 ? padded_k / 2 : padded_k, sb = qcell_scale_bytes(scales);
    const int64_t cell_bytes = qcell_bytes(bits, scales), data_bytes = qcell_data_bytes(bits);
    memset(cells, 0, (size_t)tm_qcells_bytes(n, k, bits, scales));
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *cell = cells + (g * blocks + b) * cell_bytes;
            for (int r = 0; r < QGROUP && g * QGROUP + r < n; r++) {
                const int64_t j = g * QGROUP + r;
                for (int i = 0; i < QBLOCK; i++) {
                    if (bits == 8) {
                        cell[qcell_byte(bits, r, i)] = data[j * row_bytes + b * QBLOCK + i];
                    } else {  /* row layout: block b in the low (even b) or high nibbles of pair b / 2 */
                        const uint8_t byte = data[j * row_bytes + (b / 2) * QBLOCK + i];
                        const int u = (b & 1) ? byte >> 4 : byte & 0x0f;
                        cell[qcell_byte(bits, r, i)] |= (uint8_t)(i < 16 ? u : u << 4);
                    }
                }
                memcpy(cell + data_bytes + r * sb, (const char *)scale + (j * blocks + b) * sb, (size_t)sb);
                memcpy(cell + data_bytes + (QGROUP + r) * sb, (const char *)offset + (j * blocks + b) * sb, (size_t)sb);
                if (scales & QS_SUB)
                    for (int f = 0; f < QBLOCK / QSUB; f++)
                        ((int8_t *)qcell_subs(cell, bits, scales))[f * QGROUP + r] = sub[j * (padded_k / QSUB) + b * 2 + f];
            }
        }
}

/* One activation row -> q (padded_k int8), dx and s (padded_k / 32 floats each) and the integer sums of
 * q over each 16 values (qhalf, padded_k / 16). Every level quantises alike: the same absmax, scale and
 * rounding. */
static void quantize_row(int8_t *q, float *dx, float *s, int32_t *qhalf, const void *x, int64_t k, int64_t padded_k,
                         int bf16) {
    for (int64_t b = 0; b < padded_k / QBLOCK; b++) {
        int8_t *qb = q + b * QBLOCK;
        if (b * QBLOCK >= k) {
            memset(qb, 0, QBLOCK);
            dx[b] = 0.0f;
            s[b] = 0.0f;
            qhalf[2 * b] = qhalf[2 * b + 1] = 0;
            continue;
        }
#ifdef __AVX512F__
        const __m512 v0 = load16(x, b * QBLOCK, bf16), v1 = load16(x, b * QBLOCK + 16, bf16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
        /* converting rounds half to even (the default rounding mode), as nearbyintf does */
        const __m512i q0 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), lim), neg);
        const __m512i q1 = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), lim), neg);
        _mm_storeu_si128((__m128i *)qb, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(qb + 16), _mm512_cvtepi32_epi8(q1));
        dx[b] = d;
        qhalf[2 * b] = _mm512_reduce_add_epi32(q0);
        qhalf[2 * b + 1] = _mm512_reduce_add_epi32(q1);
        s[b] = d * (float)(qhalf[2 * b] + qhalf[2 * b + 1]);
#elif defined(TM_AVX2)
        const __m256 sign = _mm256_set1_ps(-0.0f);
        __m256 v[4], amax8 = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = load8(x, b * QBLOCK + 8 * j, bf16);
            amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[j]));
        }
        const float d = reduce_max8(amax8) / 127.0f;
        const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
        const __m256i lim = _mm256_set1_epi32(127), neg = _mm256_set1_epi32(-127);
        __m256i qi[4];
        for (int j = 0; j < 4; j++)  /* converting rounds half to even, as nearbyintf does */
            qi[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv)), lim), neg);
        /* packing interleaves the 128-bit halves: dwords a0 b0 c0 d0 a1 b1 c1 d1 back into a0 a1 b0 b1 .. */
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        dx[b] = d;
        qhalf[2 * b] = reduce_add8_epi32(_mm256_add_epi32(qi[0], qi[1]));
        qhalf[2 * b + 1] = reduce_add8_epi32(_mm256_add_epi32(qi[2], qi[3]));
        s[b] = d * (float)(qhalf[2 * b] + qhalf[2 * b + 1]);
#else
        float v[QBLOCK], amax = 0.0f;
        for (int i = 0; i < QBLOCK; i++) {
            v[i] = load_value(x, b * QBLOCK + i, bf16);
            const float a = fabsf(v[i]);
            amax = a > amax ? a : amax;  /* as fmaxf (a NaN is passed over), which gcc 12 cannot vectorise for aarch64 here */
        }
        const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum[2] = {0, 0};
        for (int i = 0; i < QBLOCK; i++) {
            float r = nearbyintf(v[i] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            qb[i] = (int8_t)r;
            sum[i / QSUB] += qb[i];
        }
        dx[b] = d;
        qhalf[2 * b] = sum[0];
        qhalf[2 * b + 1] = sum[1];
        s[b] = d * (float)(sum[0] + sum[1]);
#endif
    }
}

/* The quantised input rows of one product. */
typedef struct {
    const int8_t *q;
    const float *dx, *s;
    const int32_t *qhalf;  /* [m, 2 blocks]: sums of q over each 16 values */
    int64_t padded_k, blocks;
} quantized_rows;

static void quantize_rows(int8_t *q, float *dx, float *s, int32_t *qhalf, const void *x, int64_t m, int64_t k,
                          int64_t x_stride, int bf16) {
    const int64_t padded_k = qpadded_k(k), blocks = padded_k / QBLOCK;
    const int64_t elem = bf16 ? 2 : 4;
    /* rows are independent: threads change no result */
    #pragma omp parallel for schedule(static) if (m >= 64)
    for (int64_t r = 0; r < m; r++)
        quantize_row(q + r * padded_k, dx + r * blocks, s + r * blocks, qhalf + r * 2 * blocks,
                     (const char *)x + r * x_stride * elem, k, padded_k, bf16);
}

/* Input rows x [m, k] (row stride x_stride) quantised: q [m, padded_k] int8, dx and s [m, padded_k / 32]
 * (tm_qlinear's first step; the tests call it alone). */
void tm_quantize_activations(int8_t *q, float *dx, float *s, const void *x, int64_t m, int64_t k,
                             int64_t x_stride, int bf16) {
    int32_t *qhalf = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * (qpadded_k(k) / QSUB)));
    quantize_rows(q, dx, s, qhalf, x, m, k, x_stride, bf16);
    free(qhalf);
}

#ifdef TM_WIDE_CELLS
/* Outputs of groups [g0, g0 + G) for input rows [r0, r0 + R) (+ bias) -> y. Always inlined with
 * constant G, R, bits and scales, so the accumulators acc[g][r] (16 lanes: the group's rows) live in
 * registers. Without VNNI the dots are cells_tile8's (vpmaddubsw, 16-bit sums for int4, |w| x sign(q, w)
 * for int8), 16 lanes at a time: the same exact integers. */
static inline __attribute__((always_inline)) void cells_tile(
    void *y, int64_t y_stride, const uint8_t *cells, int64_t g0, const int G, int64_t r0, const int R,
    const int bits, const int scales, const quantized_rows *in, const float *bias, int64_t n, int bf16) {
    const int64_t blocks = in->blocks, padded_k = in->padded_k, cell_bytes = qcell_bytes(bits, scales);
    const int64_t data_bytes = qcell_data_bytes(bits), sb = qcell_scale_bytes(scales);
    const int8_t *const q = in->q + r0 * padded_k;
    const float *const dx = in->dx + r0 * blocks, *const s = in->s + r0 * blocks;
    const int32_t *const qhalf = in->qhalf + r0 * 2 * blocks;
    const int sub = scales & QS_SUB;
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    __m512 acc[4][4];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) acc[g][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        for (int g = 0; g < G; g++) {
            const uint8_t *cell = cells + ((g0 + g) * blocks + b) * cell_bytes;
            /* the group's cell 4 blocks ahead, into L1: each group of the tile is a stream of its own */
            if (b + 4 < blocks)
                for (int64_t line = 0; line < cell_bytes; line += 64) _mm_prefetch((const char *)cell + 4 * cell_bytes + line, _MM_HINT_T0);
            __m512i dot[2][4];  /* [feature half (with sub-scales; else all in 0)][row] */
#ifdef TM_VNNI
            for (int f = 0; f < 2; f++)
                for (int r = 0; r < R; r++) dot[f][r] = _mm512_setzero_si512();
            for (int c = 0; c < (bits == 4 ? 4 : 8); c++) {
                const int f = sub && c >= 4;
                const __m512i v = _mm512_loadu_si512(cell + c * 64);
                const __m512i first = bits == 4 ? _mm512_and_si512(v, nibble) : v;
                for (int r = 0; r < R; r++) {
                    const int8_t *qb = q + r * padded_k + b * QBLOCK;
                    dot[f][r] = _mm512_dpbusd_epi32(dot[f][r], first, _mm512_set1_epi32(*(const int32_t *)(qb + 4 * c)));
                }
                if (bits == 4) {
                    const __m512i second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    for (int r = 0; r < R; r++) {
                        const int8_t *qb = q + r * padded_k + b * QBLOCK;
                        dot[0][r] = _mm512_dpbusd_epi32(dot[0][r], second, _mm512_set1_epi32(*(const int32_t *)(qb + 16 + 4 * c)));
                    }
                }
            }
#else
            const __m512i ones = _mm512_set1_epi16(1);
            if (bits == 4) {
                /* a block's pair sums add up in 16 bits without overflow (|sum| <= 8 x 2 x 15 x 127) */
                __m512i pairs[4];
                for (int r = 0; r < R; r++) pairs[r] = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    const __m512i v = _mm512_loadu_si512(cell + c * 64);
                    const __m512i first = _mm512_and_si512(v, nibble);
                    const __m512i second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    for (int r = 0; r < R; r++) {
                        const int8_t *qb = q + r * padded_k + b * QBLOCK;
                        pairs[r] = _mm512_add_epi16(pairs[r], _mm512_maddubs_epi16(first, _mm512_set1_epi32(*(const int32_t *)(qb + 4 * c))));
                        pairs[r] = _mm512_add_epi16(pairs[r], _mm512_maddubs_epi16(second, _mm512_set1_epi32(*(const int32_t *)(qb + 16 + 4 * c))));
                    }
                }
                for (int r = 0; r < R; r++) dot[0][r] = _mm512_madd_epi16(pairs[r], ones);
            } else {
                /* w = u - 128 as |w| x sign(q, w) (each pair within 2 x 128 x 127), and u . q = w . q + 128 sum(q) */
                const __m512i bias128 = _mm512_set1_epi8((char)0x80);
                for (int r = 0; r < R; r++) {
                    const int32_t *qh = qhalf + r * 2 * blocks + 2 * b;
                    dot[0][r] = _mm512_set1_epi32(128 * (sub ? qh[0] : qh[0] + qh[1]));
                    dot[1][r] = _mm512_set1_epi32(128 * qh[1]);
                }
                for (int c = 0; c < 8; c++) {
                    const int f = sub && c >= 4;
                    const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(cell + c * 64), bias128);
                    const __m512i magnitude = _mm512_abs_epi8(w);
                    const __mmask64 negative = _mm512_movepi8_mask(w);
                    for (int r = 0; r < R; r++) {
                        const int8_t *qb = q + r * padded_k + b * QBLOCK;
                        const __m512i qs = _mm512_set1_epi32(*(const int32_t *)(qb + 4 * c));
                        const __m512i signed_q = _mm512_mask_sub_epi8(qs, negative, _mm512_setzero_si512(), qs);
                        dot[f][r] = _mm512_add_epi32(dot[f][r], _mm512_madd_epi16(_mm512_maddubs_epi16(magnitude, signed_q), ones));
                    }
                }
            }
#endif
            const __m512 scale = load_scales16(cell + data_bytes, scales);
            const __m512 offset = load_scales16(cell + data_bytes + QGROUP * sb, scales);
            if (sub) {
                const int8_t *subs = qcell_subs(cell, bits, scales);
                const __m512i sub0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)subs));
                const __m512i sub1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(subs + QGROUP)));
                for (int r = 0; r < R; r++) {
                    const int32_t *qh = qhalf + r * 2 * blocks + 2 * b;
                    const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(sub0, dot[0][r]), _mm512_mullo_epi32(sub1, dot[1][r]));
                    const __m512i z = _mm512_add_epi32(_mm512_mullo_epi32(sub0, _mm512_set1_epi32(qh[0])),
                                                       _mm512_mullo_epi32(sub1, _mm512_set1_epi32(qh[1])));
                    const __m512 d = _mm512_set1_ps(dx[r * blocks + b]);
                    acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(scale, d), acc[g][r]);
                    acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_mul_ps(offset, d), acc[g][r]);
                }
                continue;
            }
            for (int r = 0; r < R; r++) {
                const __m512 weight = _mm512_mul_ps(scale, _mm512_set1_ps(dx[r * blocks + b]));
                acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[0][r]), weight, acc[g][r]);
                acc[g][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s[r * blocks + b]), acc[g][r]);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const int64_t j = (g0 + g) * QGROUP;
        const __mmask16 valid = n - j >= QGROUP ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + j) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 v = _mm512_add_ps(acc[g][r], add);
            if (bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + (r0 + r) * y_stride + j, valid, bf16_lanes(v));
            else
                _mm512_mask_storeu_ps((float *)y + (r0 + r) * y_stride + j, valid, v);
        }
    }
}
#endif

#if !defined(TM_WIDE_CELLS) && defined(TM_AVX2)
static inline __m256 load_scales8(const uint8_t *p, const int scales) {
    return (scales & QS_HALF) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

/* The 8-output twin of cells_tile: a cell's 16 rows as two halves of 8 lanes (32 bytes of each 64-byte
 * chunk). int4: vpmaddubsw (unsigned nibble x signed q) sums feature pairs into 16 bits, 8 of them per
 * block without overflow (|sum| <= 8 x 2 x 15 x 127 = 30480), then vpmaddwd widens. int8: the bytes
 * become signed w = u - 128 and multiply as |w| x sign(q, w) (each pair within 2 x 128 x 127), and
 * u . q = w . q + 128 sum(q). Either way the same exact integers as the VNNI path, then the same two
 * fused multiply-adds per block. */
static inline __attribute__((always_inline)) void cells_tile8(
    void *y, int64_t y_stride, const uint8_t *cells, int64_t g0, const int G, int64_t r0, const int R,
    const int bits, const int scales, const quantized_rows *in, const float *bias, int64_t n, int bf16) {
    const int64_t blocks = in->blocks, padded_k = in->padded_k, cell_bytes = qcell_bytes(bits, scales);
    const int64_t data_bytes = qcell_data_bytes(bits), sb = qcell_scale_bytes(scales);
    const int8_t *const q = in->q + r0 * padded_k;
    const float *const dx = in->dx + r0 * blocks, *const s = in->s + r0 * blocks;
    const int32_t *const qhalf = in->qhalf + r0 * 2 * blocks;
    const int sub = scales & QS_SUB;
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), bias128 = _mm256_set1_epi8((char)0x80);
    __m256 acc[4][2][4];
    for (int g = 0; g < G; g++)
        for (int h = 0; h < 2; h++)
            for (int r = 0; r < R; r++) acc[g][h][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        for (int g = 0; g < G; g++) {
            const uint8_t *cell = cells + ((g0 + g) * blocks + b) * cell_bytes;
            if (b + 4 < blocks)
                for (int64_t line = 0; line < cell_bytes; line += 64) _mm_prefetch((const char *)cell + 4 * cell_bytes + line, _MM_HINT_T0);
            for (int h = 0; h < 2; h++) {
                __m256i dot[4], dot1[4];  /* dot1: features 16..31 with sub-scales */
                if (bits == 4) {
                    for (int r = 0; r < R; r++) dot[r] = _mm256_setzero_si256();
                    for (int c = 0; c < 4; c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(cell + c * 64 + 32 * h));
                        const __m256i first = _mm256_and_si256(v, nibble);
                        const __m256i second = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
                        for (int r = 0; r < R; r++) {
                            const int8_t *qb = q + r * padded_k + b * QBLOCK;
                            dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(first, _mm256_set1_epi32(*(const int32_t *)(qb + 4 * c))));
                            dot[r] = _mm256_add_epi16(dot[r], _mm256_maddubs_epi16(second, _mm256_set1_epi32(*(const int32_t *)(qb + 16 + 4 * c))));
                        }
                    }
                    for (int r = 0; r < R; r++) dot[r] = _mm256_madd_epi16(dot[r], ones);
                } else {
                    for (int r = 0; r < R; r++) {
                        const int32_t *qh = qhalf + r * 2 * blocks + 2 * b;
                        dot[r] = _mm256_set1_epi32(128 * (sub ? qh[0] : qh[0] + qh[1]));
                        dot1[r] = _mm256_set1_epi32(128 * qh[1]);
                    }
                    for (int c = 0; c < 8; c++) {
                        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(cell + c * 64 + 32 * h)), bias128);
                        const __m256i magnitude = _mm256_abs_epi8(w);
                        for (int r = 0; r < R; r++) {
                            const int8_t *qb = q + r * padded_k + b * QBLOCK;
                            const __m256i signed_q = _mm256_sign_epi8(_mm256_set1_epi32(*(const int32_t *)(qb + 4 * c)), w);
                            const __m256i part = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_q), ones);
                            if (sub && c >= 4)
                                dot1[r] = _mm256_add_epi32(dot1[r], part);
                            else
                                dot[r] = _mm256_add_epi32(dot[r], part);
                        }
                    }
                }
                const __m256 scale = load_scales8(cell + data_bytes + 8 * h * sb, scales);
                const __m256 offset = load_scales8(cell + data_bytes + (QGROUP + 8 * h) * sb, scales);
                if (sub) {
                    const int8_t *subs = qcell_subs(cell, bits, scales) + 8 * h;
                    const __m256i sub0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)subs));
                    const __m256i sub1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(subs + QGROUP)));
                    for (int r = 0; r < R; r++) {
                        const int32_t *qh = qhalf + r * 2 * blocks + 2 * b;
                        const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(sub0, dot[r]), _mm256_mullo_epi32(sub1, dot1[r]));
                        const __m256i z = _mm256_add_epi32(_mm256_mullo_epi32(sub0, _mm256_set1_epi32(qh[0])),
                                                           _mm256_mullo_epi32(sub1, _mm256_set1_epi32(qh[1])));
                        const __m256 d = _mm256_set1_ps(dx[r * blocks + b]);
                        acc[g][h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(scale, d), acc[g][h][r]);
                        acc[g][h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(z), _mm256_mul_ps(offset, d), acc[g][h][r]);
                    }
                    continue;
                }
                for (int r = 0; r < R; r++) {
                    const __m256 weight = _mm256_mul_ps(scale, _mm256_set1_ps(dx[r * blocks + b]));
                    acc[g][h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), weight, acc[g][h][r]);
                    acc[g][h][r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(s[r * blocks + b]), acc[g][h][r]);
                }
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int h = 0; h < 2; h++) {
            const int64_t j = (g0 + g) * QGROUP + 8 * h;
            const int64_t valid = n - j >= 8 ? 8 : n - j;
            if (valid <= 0)
                continue;
            const __m256i mask = lanes_below8(valid);
            const __m256 add = bias ? _mm256_maskload_ps(bias + j, mask) : _mm256_setzero_ps();
            for (int r = 0; r < R; r++)
                store8_first(y, (r0 + r) * y_stride + j, _mm256_add_ps(acc[g][h][r], add), valid, bf16);
        }
}
#define TM_CELLS_TILE cells_tile8
#elif defined(TM_WIDE_CELLS)
#define TM_CELLS_TILE cells_tile
#endif

#ifdef TM_CELLS_TILE
/* Input rows [r0, r0 + R) against the groups of tile [g0, g0 + ng), ng <= 4, R in 1, 2, 4. */
#define CELLS_TILE(G, R, BITS, SCALES) TM_CELLS_TILE(y, y_stride, cells, g, G, r0, R, BITS, SCALES, &in, bias, n, bf16)
#define CELLS_ROWS(BITS, SCALES)                                                                            \
    do {                                                                                                    \
        int64_t g = g0;                                                                                     \
        if (R == 1 && g1 - g == 4) CELLS_TILE(4, 1, BITS, SCALES);                                          \
        else if (R == 1) for (; g < g1; g++) CELLS_TILE(1, 1, BITS, SCALES);                                \
        else if (R == 2) {                                                                                  \
            for (; g + 2 <= g1; g += 2) CELLS_TILE(2, 2, BITS, SCALES);                                     \
            if (g < g1) CELLS_TILE(1, 2, BITS, SCALES);                                                     \
        } else for (; g < g1; g++) CELLS_TILE(1, 4, BITS, SCALES);                                          \
    } while (0)
#endif

/* y[r, j] for r < m, j < n. x rows at x_stride, y rows at y_stride (elements of the storage dtype,
 * float32 or bfloat16 per `bf16`); bias (float32, n) may be NULL. bits is 8 or 4; `scales` holds the
 * QS_ flags of the cells (QS_SUB with bits 8 only). Each thread takes a contiguous range of 4-group tiles (64 outputs)
 * and runs every input row over each, 4, 2 or 1 rows at a time so that one unpacked weight vector
 * serves several rows. */
void tm_qlinear(void *y, const void *x, const uint8_t *cells, const float *bias, int64_t m, int64_t k, int64_t n,
                int64_t x_stride, int64_t y_stride, int bits, int scales, int bf16) {
    const int64_t padded_k = qpadded_k(k), blocks = padded_k / QBLOCK, groups = qgroups(n);
    /* rows padded with zeros to a multiple of 16: AMX-INT8 tiles read 16 rows at a time */
    const int64_t padded_m = (m + 15) / 16 * 16;
    int8_t *q = (int8_t *)aligned_alloc(64, (size_t)(padded_m * padded_k));
    memset(q + m * padded_k, 0, (size_t)((padded_m - m) * padded_k));
    float *dx = (float *)calloc((size_t)(padded_m * blocks), sizeof(float));
    float *s = (float *)calloc((size_t)(padded_m * blocks), sizeof(float));
    int32_t *qhalf = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * 2 * blocks));
    quantize_rows(q, dx, s, qhalf, x, m, k, x_stride, bf16);
    if (m >= AMX_INT8_FROM_ROWS
        && tm_amx_int8_qlinear(y, y_stride, cells, bias, q, dx, s, m, padded_k, n, bits, scales, bf16) == 0) {
        free(q);
        free(dx);
        free(s);
        free(qhalf);
        return;
    }
    const quantized_rows in = {q, dx, s, qhalf, padded_k, blocks};
    const int64_t tiles = (groups + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t tile = 0; tile < tiles; tile++) {
        const int64_t g0 = tile * 4, g1 = g0 + 4 < groups ? g0 + 4 : groups;
        for (int64_t r0 = 0; r0 < m;) {
            const int R = m - r0 >= 4 ? 4 : m - r0 >= 2 ? 2 : 1;
#ifdef TM_CELLS_TILE
            if (bits == 4 && scales == QS_HALF) CELLS_ROWS(4, QS_HALF);
            else if (bits == 4) CELLS_ROWS(4, 0);
            else if (scales == QS_HALF) CELLS_ROWS(8, QS_HALF);
            else if (scales == 0) CELLS_ROWS(8, 0);
            else if (scales == (QS_HALF | QS_SUB)) CELLS_ROWS(8, QS_HALF | QS_SUB);
            else CELLS_ROWS(8, QS_SUB);
#else
            (void)in;
            for (int64_t j = g0 * QGROUP; j < g1 * QGROUP && j < n; j++)
                for (int r = 0; r < R; r++) {
                    const int64_t row = r0 + r;
                    const int lane = (int)(j % QGROUP);
                    float acc = 0.0f;
                    for (int64_t b = 0; b < blocks; b++) {
                        const uint8_t *cell = qcell(cells, j / QGROUP, b, blocks, bits, scales);
                        int32_t dot[2] = {0, 0};
                        for (int i = 0; i < QBLOCK; i++)
                            dot[i / QSUB] += qcell_value(cell, bits, lane, i) * (int32_t)q[row * padded_k + b * QBLOCK + i];
                        const float d = dx[row * blocks + b];
                        if (scales & QS_SUB) {
                            const int8_t *subs = qcell_subs(cell, bits, scales);
                            const int32_t *qh = qhalf + row * 2 * blocks + 2 * b;
                            const int32_t t = subs[lane] * dot[0] + subs[QGROUP + lane] * dot[1];
                            const int32_t z = subs[lane] * qh[0] + subs[QGROUP + lane] * qh[1];
                            acc = fmaf((float)t, qcell_scale(cell, bits, scales, 0, lane) * d, acc);
                            acc = fmaf((float)z, qcell_scale(cell, bits, scales, 1, lane) * d, acc);
                            continue;
                        }
                        acc = fmaf((float)(dot[0] + dot[1]), qcell_scale(cell, bits, scales, 0, lane) * d, acc);
                        acc = fmaf(qcell_scale(cell, bits, scales, 1, lane), s[row * blocks + b], acc);
                    }
                    store_value(y, row * y_stride + j, bias ? acc + bias[j] : acc, bf16);
                }
#endif
            r0 += R;
        }
    }
    free(q);
    free(dx);
    free(s);
    free(qhalf);
}

#if !defined(TM_VNNI) && defined(TM_AVX2)
/* Row r's 4 bytes of each of the chunks c0 .. c0 + 3 of a cell, in chunk order. */
static inline __m128i row_bytes_of_chunks(const uint8_t *cell, int r, int c0) {
    int32_t w[4];
    for (int c = 0; c < 4; c++) memcpy(&w[c], cell + (c0 + c) * 64 + 4 * r, 4);
    return _mm_setr_epi32(w[0], w[1], w[2], w[3]);
}
#endif

/* out[i, :k] = scale * u + offset (times the sub-scale with QS_SUB) for weight rows j = ids[i] (ids
 * NULL: first + i), i < count: a contiguous [count, k] matrix of the storage dtype (float32 or bfloat16
 * per `bf16`), for products with many input rows, where one dequantisation serves them all, and for
 * embedding lookups. Each value is rounded as the reference computes it: the product, then the sum
 * (then the sub-scale's product), in float32, then to the storage dtype. Rows outside [0, n) come out
 * zero; returns how many there were. */
int tm_dequantize(void *out, const uint8_t *cells, int64_t first, const int64_t *ids, int64_t count, int64_t n,
                  int64_t k, int bits, int scales, int bf16) {
    const int64_t blocks = qpadded_k(k) / QBLOCK, elem = bf16 ? 2 : 4;
    int outside = 0;
    #pragma omp parallel for schedule(static) reduction(+ : outside) if (count > 4)
    for (int64_t i = 0; i < count; i++) {
        const int64_t j = ids ? ids[i] : first + i, g = j / QGROUP;
        const int r = (int)(j % QGROUP);
        if (j < 0 || j >= n) {
            memset((char *)out + i * k * elem, 0, (size_t)(k * elem));
            outside++;
            continue;
        }
        for (int64_t b = 0; b < k / QBLOCK; b++) {
            const uint8_t *cell = qcell(cells, g, b, blocks, bits, scales);
            const int64_t base = i * k + b * QBLOCK;
            const float sc = qcell_scale(cell, bits, scales, 0, r), off = qcell_scale(cell, bits, scales, 1, r);
            const int8_t *subs = (scales & QS_SUB) ? qcell_subs(cell, bits, scales) + r : NULL;  /* [0], [QGROUP] */
#ifdef TM_VNNI
            /* row r's 32 values: 4 bytes from each chunk */
            __m256i u;
            if (bits == 8) {
                u = _mm256_i32gather_epi32((const int *)(cell + 4 * r), _mm256_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448), 1);
            } else {
                const __m128i packed = _mm_i32gather_epi32((const int *)(cell + 4 * r), _mm_setr_epi32(0, 64, 128, 192), 1);
                const __m128i low = _mm_set1_epi8(0x0f);
                u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
            }
            const __m512 vs = _mm512_set1_ps(sc), vo = _mm512_set1_ps(off);
            for (int h = 0; h < 2; h++) {
                const __m128i part = h ? _mm256_extracti128_si256(u, 1) : _mm256_castsi256_si128(u);
                __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part)), vs), vo);
                if (subs)
                    v = _mm512_mul_ps(v, _mm512_set1_ps((float)subs[QGROUP * h]));
                if (bf16)
                    _mm256_storeu_si256((__m256i *)((uint16_t *)out + base + 16 * h), bf16_lanes(v));
                else
                    _mm512_storeu_ps((float *)out + base + 16 * h, v);
            }
#elif defined(TM_AVX2)
            /* row r's 32 values: 4 bytes from each chunk */
            __m128i u[2];
            if (bits == 8) {
                u[0] = row_bytes_of_chunks(cell, r, 0);
                u[1] = row_bytes_of_chunks(cell, r, 4);
            } else {
                const __m128i packed = row_bytes_of_chunks(cell, r, 0);
                const __m128i low = _mm_set1_epi8(0x0f);
                u[0] = _mm_and_si128(packed, low);
                u[1] = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
            }
            const __m256 vs = _mm256_set1_ps(sc), vo = _mm256_set1_ps(off);
            for (int part = 0; part < 4; part++) {
                const __m128i bytes = part & 1 ? _mm_srli_si128(u[part / 2], 8) : u[part / 2];
                __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), vs), vo);
                if (subs)
                    v = _mm256_mul_ps(v, _mm256_set1_ps((float)subs[QGROUP * (part / 2)]));
                store8(out, base + 8 * part, v, bf16);
            }
#else
            for (int e = 0; e < QBLOCK; e++) {
                const float product = (float)qcell_value(cell, bits, r, e) * sc, value = product + off;
                store_value(out, base + e, subs ? value * (float)subs[QGROUP * (e / QSUB)] : value, bf16);
            }
#endif
        }
    }
    return outside;
}
