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

/* One query token per sequence against its paged context.
 * q/out rows: token_index[b] selects the row of sequence b; heads at q_head_stride within a row.
 * Cache (one layer, one of K or V): [num_blocks, kv_heads, block_size, head_dim], contiguous.
 * Query head h reads kv head h / (num_heads / kv_heads).
 * Sliding window: query b sits at position context_lens[b] - 1 and attends the keys
 * [window_first(context_lens[b], window, chunk), context_lens[b]). The blocks wholly before that first key
 * are never read (a window's sequence may have given them back), and with no window, or a context no
 * longer than it, every path runs exactly the operations it runs without one. chunk > 0 (Llama 4's chunked
 * local attention): the query also sees no key before the start of its chunk of `chunk` positions.
 * softcap > 0: each score (q . k times scale) becomes softcap * tanh(score / softcap) before the softmax
 * (Gemma 2); 0: none.
 * sinks (GPT-OSS's attention sinks, float32 [num_heads], or NULL): head h's softmax denominator also holds
 * exp(sinks[h]), a logit that takes no value. */

void tm_decode_attention(void *out, const void *q, const void *k_cache, const void *v_cache,
                         const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride,
                         int64_t out_row_stride, float scale, int64_t window, int64_t chunk, float softcap,
                         const float *sinks, int bf16) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t tile_elems = block_size * head_dim;  /* one (block, kv head) tile is contiguous */
#if defined(__AVX512F__) || defined(TM_AVX2)
    if (head_dim % 64 == 0 && head_dim <= 256 && group <= 8) {
        tm_attention_tiles(out, q, k_cache, v_cache, token_index, block_tables, context_lens, num_seqs,
                           num_kv_heads, group, head_dim, block_size, max_blocks, q_row_stride, q_head_stride,
                           out_row_stride, scale, window, chunk, softcap, sinks, bf16, TM_ROWS_DTYPE);
        return;
    }
#endif
    #pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < num_seqs; b++) {
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            /* the keys [first, ctx): scores[g * len + j - first] */
            const int64_t ctx = context_lens[b], first = window_first(ctx, window, chunk), len = ctx - first;
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
            softcap_scores(scores, group * len, softcap);
            sink_softmax_rows(scores, group, len, sinks ? sinks + kvh * group : NULL);
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
