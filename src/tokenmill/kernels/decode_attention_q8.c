/* Decode attention over a one-byte KV cache (--kv-cache-dtype int8, or fp8 with `fp8` set).
 *
 * Cache layout (attention/kv_quant.py): per plane, a block_size x (head_dim + 4) byte tile per (block, kv
 * head). Values: block_size rows of head_dim one-byte values and the row's float32 scale. Keys: transposed,
 * head_dim x block_size values (a dimension's keys adjacent) then block_size float32 scales, so the
 * scores of a block's keys run in the vector lanes, read straight from the cache, with no horizontal sums.
 * A value byte is an int8, or with `fp8` the bits of a float8 e4m3 number, widened exactly.
 *
 * At the avx2 level and up, where the shapes suit the query tiles (head_dim a multiple of 64 up to 256, at
 * most 8 query heads a kv head, block_size a multiple of 16), every query goes to attention_tiles.c, which
 * reads these rows itself (its arithmetic is described there); that choice depends on the shapes and the
 * level only. Otherwise the loops below run, per query: at avx2 and up a whole block's scores and the
 * value rows on intrinsics, 16 values at a time (e4m3 through F16C); the portable loops (other levels,
 * partial blocks) widen e4m3 through a 256-entry table.
 *
 * Arithmetic per query of the loops: each key's score is (q . k_values), summed over the head dimension in order,
 * times the key's scale and the softmax scale (the keys of a block sit in the vector lanes); softmax with
 * fast_exp; the output sums p * (v_values * v_scale) in key order. A query's result depends only on its own
 * context, never on the other rows of the batch, the thread count or the tiling.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "paged_queries.h"
#include "q8_rows.h"

#define Q8_LANES 16     /* keys scored together: a whole block at the default block size */
#define Q8_MAX_GROUP 8  /* query heads per KV head whose scores stay in registers */

#ifdef Q8_VECTOR
/* The scores of a whole 16-key block for the G query heads of a KV head, as the portable loop computes them
 * (each key's dot product summed over d in order, then times its scale and the softmax scale), with the G
 * sums in registers: G is a constant where this is inlined. */
static inline __attribute__((always_inline)) void q8_block_scores(const int G, const float *qf, const int8_t *keys,
                                                                  int64_t block_size, int64_t head_dim,
                                                                  const float *key_scales, float scale,
                                                                  float *scores, int64_t len, int fp8) {
    q8_vec s[Q8_MAX_GROUP][Q8_REGS], kv[Q8_REGS];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < Q8_REGS; r++) s[g][r] = Q8_ZERO();
    for (int64_t d = 0; d < head_dim; d++) {
        q8_widen16(kv, keys + d * block_size, fp8);
        for (int g = 0; g < G; g++) {
            const q8_vec qd = Q8_SET1(qf[g * head_dim + d]);
            for (int r = 0; r < Q8_REGS; r++) s[g][r] = Q8_FMADD(qd, kv[r], s[g][r]);
        }
    }
    const q8_vec sc = Q8_SET1(scale);
    for (int g = 0; g < G; g++)
        for (int r = 0; r < Q8_REGS; r++)
            Q8_STORE(scores + g * len + r * Q8_STEP, Q8_MUL(Q8_MUL(s[g][r], Q8_LOAD(key_scales + r * Q8_STEP)), sc));
}

/* 16 dimensions of a value row, widened and times the row's scale, into dst. */
static inline void q8_value16(float *dst, const int8_t *src, float row_scale, int fp8) {
    q8_vec v[Q8_REGS];
    q8_widen16(v, src, fp8);
    for (int r = 0; r < Q8_REGS; r++) Q8_STORE(dst + r * Q8_STEP, Q8_MUL(v[r], Q8_SET1(row_scale)));
}
#endif

/* A value byte as a float: an int8, or through the e4m3 table when there is one. */
static inline float q8_widen(int8_t byte, const float *table) {
    return table ? table[(uint8_t)byte] : (float)byte;
}

/* Rows [first, first + n) of one block of one head, widened: tile[t * head_dim + d] = value * row scale. */
static inline void q8_load_rows(float *tile, const int8_t *plane, int64_t block, int64_t head, int64_t first,
                                int64_t n, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                                const float *table) {
    const int64_t width = head_dim + 4;
    const int8_t *rows = plane + ((block * num_kv_heads + head) * block_size + first) * width;
    for (int64_t t = 0; t < n; t++) {
        const int8_t *row = rows + t * width;
        float row_scale;
        memcpy(&row_scale, row + head_dim, sizeof(float));
        float *dst = tile + t * head_dim;
        int64_t d0 = 0;
#ifdef Q8_VECTOR
        for (; d0 + 16 <= head_dim; d0 += 16) q8_value16(dst + d0, row + d0, row_scale, table != NULL);
#endif
        #pragma omp simd
        for (int64_t d = d0; d < head_dim; d++) dst[d] = q8_widen(row[d], table) * row_scale;
    }
}

void tm_decode_attention_q8(void *out, const void *q, const int8_t *k_cache, const int8_t *v_cache,
                            const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                            int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride,
                            int64_t out_row_stride, float scale, int64_t window, int64_t chunk, float softcap,
                            const float *sinks, int bf16, int fp8) {
    const int64_t group = num_heads / num_kv_heads;
#ifdef Q8_VECTOR
    if (head_dim % 64 == 0 && head_dim <= 256 && group <= 8 && block_size % 16 == 0) {
        tm_attention_tiles(out, q, k_cache, v_cache, token_index, block_tables, context_lens, num_seqs,
                           num_kv_heads, group, head_dim, block_size, max_blocks, q_row_stride, q_head_stride,
                           out_row_stride, scale, window, chunk, softcap, sinks, bf16, fp8 ? TM_ROWS_FP8 : TM_ROWS_INT8);
        return;
    }
#endif
    float e4m3[256];
    if (fp8) e4m3_table(e4m3);
    const float *e4m3_values = fp8 ? e4m3 : NULL;
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; b++) {
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            const int64_t ctx = context_lens[b], first = window_first(ctx, window, chunk), len = ctx - first;
            const int32_t *table = block_tables + b * max_blocks;
            float *qf = (float *)malloc(sizeof(float) * (size_t)(group * head_dim * 2 + block_size * head_dim
                                                                  + block_size + group * len));
            float *acc = qf + group * head_dim;
            float *tile = acc + group * head_dim;
            float *key_scales = tile + block_size * head_dim;
            float *scores = key_scales + block_size;
            const int64_t qrow = token_index[b] * q_row_stride;
            for (int64_t g = 0; g < group; g++)
                load_row(qf + g * head_dim, q, qrow + (kvh * group + g) * q_head_stride, head_dim, bf16);
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
            for (int64_t start = first, end; start < ctx; start = end) {
                const int64_t block = table[start / block_size], offset = start % block_size;
                end = start - offset + block_size < ctx ? start - offset + block_size : ctx;
                const int64_t n = end - start;
                const int8_t *keys = k_cache + (block * num_kv_heads + kvh) * block_size * (head_dim + 4);
                memcpy(key_scales, keys + head_dim * block_size + 4 * offset, sizeof(float) * (size_t)n);
#ifdef Q8_VECTOR
                if (n == Q8_LANES && group <= Q8_MAX_GROUP) {
                    float *sg = scores + (start - first);
                    switch (group) {
#define Q8_SCORES(G) \
    case G: q8_block_scores(G, qf, keys + offset, block_size, head_dim, key_scales, scale, sg, len, fp8); break;
                        Q8_SCORES(1) Q8_SCORES(2) Q8_SCORES(3) Q8_SCORES(4)
                        Q8_SCORES(5) Q8_SCORES(6) Q8_SCORES(7) Q8_SCORES(8)
#undef Q8_SCORES
                    }
                    continue;
                }
#endif
                if (n == Q8_LANES && group <= Q8_MAX_GROUP) {
                    /* a whole 16-key block: each dimension's 16 keys widened once for every query head, the
                     * scores held in registers */
                    float s[Q8_MAX_GROUP][Q8_LANES] = {{0.0f}};
                    for (int64_t d = 0; d < head_dim; d++) {
                        const int8_t *kd = keys + d * block_size + offset;
                        float kf[Q8_LANES];
                        #pragma omp simd
                        for (int t = 0; t < Q8_LANES; t++) kf[t] = q8_widen(kd[t], e4m3_values);
                        for (int64_t g = 0; g < group; g++) {
                            const float qd = qf[g * head_dim + d];
                            #pragma omp simd
                            for (int t = 0; t < Q8_LANES; t++) s[g][t] += qd * kf[t];
                        }
                    }
                    for (int64_t g = 0; g < group; g++) {
                        float *sg = scores + g * len + (start - first);
                        #pragma omp simd
                        for (int t = 0; t < Q8_LANES; t++) sg[t] = s[g][t] * key_scales[t] * scale;
                    }
                    continue;
                }
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qf + g * head_dim;
                    float *sg = scores + g * len + (start - first);
                    for (int64_t t = 0; t < n; t++) sg[t] = 0.0f;
                    for (int64_t d = 0; d < head_dim; d++) {  /* each key's dot product, summed over d in order */
                        const float qd = qg[d];
                        const int8_t *kd = keys + d * block_size + offset;
                        #pragma omp simd
                        for (int64_t t = 0; t < n; t++) sg[t] += qd * q8_widen(kd[t], e4m3_values);
                    }
                    for (int64_t t = 0; t < n; t++) sg[t] = sg[t] * key_scales[t] * scale;
                }
            }
            softcap_scores(scores, group * len, softcap);  /* Gemma 2's (decode_attention.c) */
            sink_softmax_rows(scores, group, len, sinks ? sinks + kvh * group : NULL);  /* GPT-OSS's */
            for (int64_t start = first, end; start < ctx; start = end) {
                const int64_t block = table[start / block_size], offset = start % block_size;
                end = start - offset + block_size < ctx ? start - offset + block_size : ctx;
                const int64_t n = end - start;
                q8_load_rows(tile, v_cache, block, kvh, offset, n, num_kv_heads, block_size, head_dim, e4m3_values);
                for (int64_t g = 0; g < group; g++) {
                    float *a = acc + g * head_dim;
                    const float *p = scores + g * len + (start - first);
                    int64_t d0 = 0;
                    for (; d0 + Q8_LANES <= head_dim; d0 += Q8_LANES) {  /* 16 dimensions held in a register */
                        float av[Q8_LANES];
                        for (int i = 0; i < Q8_LANES; i++) av[i] = a[d0 + i];
                        for (int64_t t = 0; t < n; t++) {
                            const float *r = tile + t * head_dim + d0;
                            const float pt = p[t];
                            #pragma omp simd
                            for (int i = 0; i < Q8_LANES; i++) av[i] += pt * r[i];
                        }
                        for (int i = 0; i < Q8_LANES; i++) a[d0 + i] = av[i];
                    }
                    for (int64_t t = 0; t < n && d0 < head_dim; t++) {
                        const float *r = tile + t * head_dim;
                        const float pt = p[t];
                        for (int64_t d = d0; d < head_dim; d++) a[d] += pt * r[d];
                    }
                }
            }
            const int64_t orow = token_index[b] * out_row_stride;
            for (int64_t g = 0; g < group; g++)
                store_row(out, orow + (kvh * group + g) * head_dim, acc + g * head_dim, head_dim, bf16);
            free(qf);
        }
    }
}

/* The nearest e4m3 bit pattern to v (ties to even), as PyTorch's cast to float8_e4m3fn rounds; |v| <= 448
 * (rows are clamped first), v not NaN. Subnormals are the multiples of 2^-9 below 2^-6. */
static uint8_t e4m3_bits(float v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    const float a = fabsf(v);
    if (a < 0.015625f)  /* 8 x 2^-9 rounds up to the smallest normal, whose bits follow on: 0x08 */
        return sign | (uint8_t)nearbyintf(a * 512.0f);
    int e;
    const float f = frexpf(a, &e);  /* a = 2f x 2^(e - 1), 2f in [1, 2); 2f - 1 and its x 8 are exact */
    int m = (int)nearbyintf((2.0f * f - 1.0f) * 8.0f), biased = e - 1 + 7;
    if (m == 8) {
        m = 0;
        biased++;
    }
    return sign | (uint8_t)(biased << 3) | (uint8_t)m;
}

#ifdef __AVX512F__
/* What q8_quantize_row does to 16 quotients, the same operations per lane (max/min return their second
 * operand for a NaN lane, as fmaxf/fminf do here), into 16 bytes. e4m3: a normal value's float32 bits
 * rounded to 3 mantissa bits (ties to even: the carry runs on into the exponent) and rebiased from 127 to 7;
 * below 2^-6 the multiple of 2^-9 nearest (ties to even), 8 of them being the smallest normal's bits. */
static inline void q8_round(uint8_t *dst, __m512 value, int fp8) {
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    if (!fp8) {
        const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(value, nearest), _mm512_set1_ps(-127.0f)),
                                       _mm512_set1_ps(127.0f));
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
        return;
    }
    value = _mm512_min_ps(_mm512_max_ps(value, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(value), 24), _mm512_set1_epi32(0x80));
    const __m512 a = _mm512_abs_ps(value);
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_sub_epi32(
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF), odd)), 20),
        _mm512_set1_epi32(120 << 3));
    const __m512i small = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)), nearest));
    const __m512i e4m3 = _mm512_mask_mov_epi32(normal, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), small);
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(_mm512_or_si512(e4m3, sign)));
}
#elif defined(Q8_VECTOR)  /* AVX2 */
/* The AVX-512 q8_round on 8 lanes. */
static inline void q8_round(uint8_t *dst, __m256 value, int fp8) {
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    int32_t lanes[8];
    if (!fp8) {
        const __m256 r = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(value, nearest), _mm256_set1_ps(-127.0f)),
                                       _mm256_set1_ps(127.0f));
        _mm256_storeu_si256((__m256i *)lanes, _mm256_cvtps_epi32(r));
    } else {
        value = _mm256_min_ps(_mm256_max_ps(value, _mm256_set1_ps(-448.0f)), _mm256_set1_ps(448.0f));
        const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(value), 24), _mm256_set1_epi32(0x80));
        const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), value);
        const __m256i bits = _mm256_castps_si256(a);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 20), _mm256_set1_epi32(1));
        const __m256i normal = _mm256_sub_epi32(
            _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF), odd)), 20),
            _mm256_set1_epi32(120 << 3));
        const __m256i small = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)), nearest));
        const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ));
        _mm256_storeu_si256((__m256i *)lanes, _mm256_or_si256(_mm256_blendv_epi8(normal, small, below), sign));
    }
    for (int i = 0; i < 8; i++) dst[i] = (uint8_t)lanes[i];
}
#endif

/* One row of head_dim values as the cache keeps it, exactly as attention/kv_quant.quantize computes it:
 * scale = max |x| / 127 (int8) or / 448 (fp8), each value x / scale rounded to the nearest (ties to even:
 * int8 clamped to +-127, fp8 clamped to +-448 first). The bytes go to dst[d * stride]; `bytes` is
 * head_dim bytes of scratch. At avx2 and up the lanes run q8_round, the tail the scalar loop: the same
 * bits. */
static float q8_quantize_row(int8_t *dst, int64_t stride, const float *x, int64_t head_dim, int fp8, uint8_t *bytes) {
    float amax = 0.0f;
    int64_t d0 = 0;
#ifdef Q8_VECTOR
    const int64_t vectors = head_dim / Q8_STEP * Q8_STEP;
    if (vectors) {
        q8_vec top = Q8_ZERO();
        for (int64_t d = 0; d < vectors; d += Q8_STEP) top = Q8_MAX(Q8_ABS(Q8_LOAD(x + d)), top);
        amax = Q8_REDUCE_MAX(top);
    }
    for (int64_t d = vectors; d < head_dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float row_scale = amax / (fp8 ? 448.0f : 127.0f);
    for (; d0 < vectors; d0 += Q8_STEP)
        q8_round(bytes + d0, row_scale > 0.0f ? Q8_DIV(Q8_LOAD(x + d0), Q8_SET1(row_scale)) : Q8_ZERO(), fp8);
#else
    for (int64_t d = 0; d < head_dim; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float row_scale = amax / (fp8 ? 448.0f : 127.0f);
#endif
    for (int64_t d = d0; d < head_dim; d++) {
        const float value = row_scale > 0.0f ? x[d] / row_scale : 0.0f;
        if (fp8)
            bytes[d] = e4m3_bits(fminf(fmaxf(value, -448.0f), 448.0f));
        else
            bytes[d] = (uint8_t)(int8_t)fminf(fmaxf(nearbyintf(value), -127.0f), 127.0f);
    }
    for (int64_t d = 0; d < head_dim; d++) dst[d * stride] = (int8_t)bytes[d];
    return row_scale;
}

/* Store k, v [num_tokens, num_kv_heads, head_dim] (rows k_row_stride / v_row_stride apart) at `slots` of a
 * one-byte cache (attention/kv_quant.py's layout: value rows then their scale; keys transposed in the tile,
 * then the block's key scales), quantised per token and head as kv_quant.write_tokens does, bit for bit. */
void tm_cache_write_q8(int8_t *k_cache, int8_t *v_cache, const void *k, const void *v, const int64_t *slots,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                       int64_t k_row_stride, int64_t v_row_stride, int bf16, int fp8) {
    const int64_t width = head_dim + 4;
    #pragma omp parallel for if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        float *x = (float *)malloc(sizeof(float) * (size_t)head_dim + (size_t)head_dim);
        uint8_t *bytes = (uint8_t *)(x + head_dim);
        for (int64_t h = 0; h < num_kv_heads; h++) {
            int8_t *tile = k_cache + (block * num_kv_heads + h) * block_size * width;
            load_row(x, k, t * k_row_stride + h * head_dim, head_dim, bf16);
            const float key_scale = q8_quantize_row(tile + offset, block_size, x, head_dim, fp8, bytes);
            memcpy(tile + head_dim * block_size + 4 * offset, &key_scale, sizeof(float));
            int8_t *row = v_cache + ((block * num_kv_heads + h) * block_size + offset) * width;
            load_row(x, v, t * v_row_stride + h * head_dim, head_dim, bf16);
            const float value_scale = q8_quantize_row(row, 1, x, head_dim, fp8, bytes);
            memcpy(row + head_dim, &value_scale, sizeof(float));
        }
        free(x);
    }
}
