/* Paged decode attention: one query token per sequence against its cached context, read straight out
 * of the cache blocks. Plain C over raw pointers, called through ctypes (see cpu_kernels.py), built with
 * the other kernels (-O3 -march=native, OpenMP, -ffp-contract=off). Storage is float32 or bfloat16
 * (`bf16` flag); softmax and accumulation are float32.
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
#include "paged_queries.h"

/* attention_tiles.c: the AVX-512 path */
void tm_attention_tiles(void *out, const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                        int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                        int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride, int64_t out_row_stride,
                        float scale, int64_t window, int bf16);

/* One query token per sequence against its paged context.
 * q/out rows: token_index[b] selects the row of sequence b; heads at q_head_stride within a row.
 * Cache (one layer, one of K or V): [num_blocks, kv_heads, block_size, head_dim], contiguous.
 * Query head h reads kv head h / (num_heads / kv_heads).
 * Sliding window: query b sits at position context_lens[b] - 1 and attends the keys
 * [window_first(context_lens[b], window), context_lens[b]). The blocks wholly before that first key
 * are never read (a window's sequence may have given them back), and with no window, or a context no
 * longer than it, every path runs exactly the operations it runs without one. */

#if defined(TM_AVX2) && !defined(__AVX512F__)
/* The AVX2 path. A query's arithmetic depends only on its q row, its context length, the window and
 * the cached K/V: every query runs the same three passes over its keys [first, ctx), whatever other
 * queries share its work item, so a token attends alike in a decode step, a prefill chunk of any size
 * or after a prefix-cache hit.
 * 1. scores, 8 keys at a time from a multiple of 8: per key, 8 lanes of fused multiply-adds over the
 *    head's dimensions in order, the lanes summed by one fixed tree (sum_each_of_8), times
 *    scale * log2(e);
 * 2. p = 2^(score - max) (exp2_8), their total summed 8 lanes at a time in key order (lane i holding
 *    the keys i mod 8; lanes outside [first, ctx) selected away, never multiplied), then one tree
 *    (reduce_add8);
 * 3. out = (sum over keys in order of p * v, fused multiply-adds) * (1 / total).
 * A work item is up to QUERY_TILE consecutive queries of one sequence (a prefill chunk's) for one kv
 * head, so the K/V they share stay in cache; each query still runs its passes alone. */
#define QUERY_TILE 8
#define LOG2E 1.44269504088896341f

/* Lane j of the result: the sum of the 8 lanes of v[j], by one fixed tree. */
static inline __m256 sum_each_of_8(const __m256 *v) {
    const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

/* Stands in for the keys outside the tile's keys, before its earliest first key or past its longest
 * context (read as float32 or bfloat16 zeros). */
static const float zero_key[256];

/* Attention of the queries [b0, b0 + tile) (one sequence, consecutive positions) for kv head kvh;
 * `table` lists the blocks of the longest context among them. */
static void attend_tile(void *out, const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *token_index, const int32_t *table, const int32_t *context_lens, int64_t b0,
                        int64_t tile, int64_t kvh, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                        int64_t block_size, int64_t q_row_stride, int64_t q_head_stride, int64_t out_row_stride,
                        float scale, int64_t window, int bf16) {
    const int64_t rows = tile * group, nv = head_dim / 8, tile_elems = block_size * head_dim;
    int64_t longest = 0, earliest = INT64_MAX;
    for (int64_t t = 0; t < tile; t++) {
        const int64_t ctx = context_lens[b0 + t], first = window_first(ctx, window);
        longest = ctx > longest ? ctx : longest;
        earliest = first < earliest ? first : earliest;
    }
    /* row r's score of key j at scores[r * stride + j - base]: the tile's keys from a multiple of 8 */
    const int64_t base = earliest / 8 * 8, stride = (longest - base + 7) / 8 * 8;
    float *qf = (float *)malloc(sizeof(float) * (size_t)(rows * (head_dim + stride)));
    float *scores = qf + rows * head_dim;
    for (int64_t t = 0; t < tile; t++)
        for (int64_t g = 0; g < group; g++)
            for (int64_t v = 0; v < nv; v++)
                _mm256_storeu_ps(qf + (t * group + g) * head_dim + 8 * v,
                                 load8(q, token_index[b0 + t] * q_row_stride + (kvh * group + g) * q_head_stride + 8 * v, bf16));
    const __m256 score_scale = _mm256_set1_ps(scale * LOG2E);
    for (int64_t j0 = base; j0 < longest; j0 += 8) {
        const void *keys[8];
        int64_t key_at[8];
        for (int i = 0; i < 8; i++) {
            const int64_t j = j0 + i, inside = j >= earliest && j < longest;
            keys[i] = inside ? k_cache : (const void *)zero_key;
            key_at[i] = inside ? ((int64_t)table[j / block_size] * num_kv_heads + kvh) * tile_elems
                                 + (j % block_size) * head_dim : 0;
        }
        for (int64_t r = 0; r < rows; r++) {
            const int64_t ctx = context_lens[b0 + r / group];
            if (j0 >= ctx || j0 + 8 <= window_first(ctx, window))
                continue;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            const float *qr = qf + r * head_dim;
            for (int64_t v = 0; v < nv; v++) {
                const __m256 qv = _mm256_loadu_ps(qr + 8 * v);
                for (int i = 0; i < 8; i++)
                    acc[i] = _mm256_fmadd_ps(qv, load8(keys[i], key_at[i] + 8 * v, bf16), acc[i]);
            }
            _mm256_storeu_ps(scores + r * stride + (j0 - base), _mm256_mul_ps(sum_each_of_8(acc), score_scale));
        }
    }
    float *inv = (float *)malloc(sizeof(float) * (size_t)rows);
    for (int64_t r = 0; r < rows; r++) {
        const int64_t ctx = context_lens[b0 + r / group], first = window_first(ctx, window);
        float *sr = scores + r * stride;
        __m256 top8 = _mm256_set1_ps(-INFINITY);
        for (int64_t j0 = first / 8 * 8; j0 < ctx; j0 += 8) {  /* a maximum is exact in any order */
            const __m256i valid = _mm256_andnot_si256(lanes_below8(first - j0), lanes_below8(ctx - j0));
            top8 = _mm256_max_ps(top8, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(sr + (j0 - base)),
                                                         _mm256_castsi256_ps(valid)));
        }
        const __m256 top = _mm256_set1_ps(reduce_max8(top8));
        __m256 sum8 = _mm256_setzero_ps();
        for (int64_t j0 = first / 8 * 8; j0 < ctx; j0 += 8) {
            const __m256 valid = _mm256_castsi256_ps(_mm256_andnot_si256(lanes_below8(first - j0), lanes_below8(ctx - j0)));
            const __m256 p = _mm256_and_ps(exp2_8(_mm256_sub_ps(_mm256_loadu_ps(sr + (j0 - base)), top)), valid);
            _mm256_storeu_ps(sr + (j0 - base), p);
            sum8 = _mm256_add_ps(sum8, p);
        }
        inv[r] = 1.0f / reduce_add8(sum8);
    }
    /* p . V with V's block in cache for all rows: each row's sums still run over the keys in order */
    float *acc = (float *)calloc((size_t)(rows * head_dim), sizeof(float));
    for (int64_t start = earliest / block_size * block_size; start < longest; start += block_size) {
        const int64_t at = ((int64_t)table[start / block_size] * num_kv_heads + kvh) * tile_elems;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t ctx = context_lens[b0 + r / group], first = window_first(ctx, window);
            if (start >= ctx || start + block_size <= first)
                continue;
            const int64_t n = ctx - start < block_size ? ctx - start : block_size;
            const int64_t skip = first > start ? first - start : 0;  /* the block's keys before the window */
            const float *pr = scores + r * stride;
            for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
                float *ar = acc + r * head_dim + d0;
                __m256 a[8];
                for (int v = 0; v < 8; v++) a[v] = _mm256_loadu_ps(ar + 8 * v);
                for (int64_t j = skip; j < n; j++) {
                    const __m256 p = _mm256_set1_ps(pr[start + j - base]);
                    for (int v = 0; v < 8; v++)
                        a[v] = _mm256_fmadd_ps(p, load8(v_cache, at + j * head_dim + d0 + 8 * v, bf16), a[v]);
                }
                for (int v = 0; v < 8; v++) _mm256_storeu_ps(ar + 8 * v, a[v]);
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t out_at = token_index[b0 + r / group] * out_row_stride + (kvh * group + r % group) * head_dim;
        const __m256 scale_r = _mm256_set1_ps(inv[r]);
        for (int64_t v = 0; v < nv; v++) store8(out, out_at + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(acc + r * head_dim + 8 * v), scale_r), bf16);
    }
    free(acc);
    free(inv);
    free(qf);
}

static void decode_attention_avx2(void *out, const void *q, const void *k_cache, const void *v_cache,
                                  const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                                  int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                                  int64_t block_size, int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride,
                                  int64_t out_row_stride, float scale, int64_t window, int bf16) {
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    const int64_t tiles = query_tiles(starts, token_index, block_tables, context_lens, num_seqs, max_blocks,
                                      block_size, QUERY_TILE);
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t i = 0; i < tiles; i++)
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
            attend_tile(out, q, k_cache, v_cache, token_index, block_tables + (starts[i + 1] - 1) * max_blocks, context_lens,
                        starts[i], starts[i + 1] - starts[i], kvh, num_kv_heads, group, head_dim, block_size,
                        q_row_stride, q_head_stride, out_row_stride, scale, window, bf16);
    free(starts);
}
#endif

void tm_decode_attention(void *out, const void *q, const void *k_cache, const void *v_cache,
                         const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride,
                         int64_t out_row_stride, float scale, int64_t window, int bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tile_elems = block_size * head_dim;  /* one (block, kv head) tile is contiguous */
#if defined(TM_AVX2) && !defined(__AVX512F__)
    if (head_dim % 64 == 0 && head_dim <= 256) {
        decode_attention_avx2(out, q, k_cache, v_cache, token_index, block_tables, context_lens, num_seqs,
                              num_kv_heads, group, head_dim, block_size, max_blocks, q_row_stride, q_head_stride,
                              out_row_stride, scale, window, bf16);
        return;
    }
#endif
#ifdef __AVX512F__
    if (head_dim % 64 == 0 && head_dim <= 256 && group <= 8) {
        tm_attention_tiles(out, q, k_cache, v_cache, token_index, block_tables, context_lens, num_seqs,
                           num_kv_heads, group, head_dim, block_size, max_blocks, q_row_stride, q_head_stride,
                           out_row_stride, scale, window, bf16);
        return;
    }
#endif
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; b++) {
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            /* the keys [first, ctx): scores[g * len + j - first] */
            const int64_t ctx = context_lens[b], first = window_first(ctx, window), len = ctx - first;
            const int32_t *table = block_tables + b * max_blocks;
            float *qf = (float *)malloc(sizeof(float) * (size_t)(group * head_dim * 2 + tile_elems + group * len));
            float *acc = qf + group * head_dim;
            float *tile = acc + group * head_dim;
            float *scores = tile + tile_elems;
            const int64_t qrow = token_index[b] * q_row_stride;
            for (int64_t g = 0; g < group; g++)
                load_row(qf + g * head_dim, q, qrow + (kvh * group + g) * q_head_stride, head_dim, bf16);
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
            for (int64_t start = first, block, end; start < ctx; start = end) {
                const int64_t base = block_run(table, start, ctx, block_size, kvh, num_kv_heads, head_dim, &block, &end);
                const int64_t n = end - start;
                load_row(tile, k_cache, base, n * head_dim, bf16);
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qf + g * head_dim;
                    int64_t t = 0;
                    for (; t + 4 <= n; t += 4) {  /* four independent dot products keep the FMA units busy */
                        const float *r0 = tile + t * head_dim, *r1 = r0 + head_dim, *r2 = r1 + head_dim,
                                    *r3 = r2 + head_dim;
                        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                        #pragma omp simd reduction(+:s0, s1, s2, s3)
                        for (int64_t d = 0; d < head_dim; d++) {
                            s0 += qg[d] * r0[d]; s1 += qg[d] * r1[d]; s2 += qg[d] * r2[d]; s3 += qg[d] * r3[d];
                        }
                        float *sg = scores + g * len + (start - first) + t;
                        sg[0] = s0 * scale; sg[1] = s1 * scale; sg[2] = s2 * scale; sg[3] = s3 * scale;
                    }
                    for (; t < n; t++) {
                        const float *r = tile + t * head_dim;
                        float s0 = 0.0f;
                        #pragma omp simd reduction(+:s0)
                        for (int64_t d = 0; d < head_dim; d++) s0 += qg[d] * r[d];
                        scores[g * len + (start - first) + t] = s0 * scale;
                    }
                }
            }
            softmax_rows(scores, group, len);
            for (int64_t start = first, block, end; start < ctx; start = end) {
                const int64_t base = block_run(table, start, ctx, block_size, kvh, num_kv_heads, head_dim, &block, &end);
                const int64_t n = end - start;
                load_row(tile, v_cache, base, n * head_dim, bf16);
                for (int64_t g = 0; g < group; g++) {
                    float *a = acc + g * head_dim;
                    const float *p = scores + g * len + (start - first);
                    for (int64_t t = 0; t < n; t++) {
                        const float *r = tile + t * head_dim;
                        const float pt = p[t];
                        for (int64_t d = 0; d < head_dim; d++) a[d] += pt * r[d];
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
