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

/* One query token per sequence against its paged context.
 * q/out rows: token_index[b] selects the row of sequence b; heads at q_head_stride within a row.
 * Cache (one layer, one of K or V): [num_blocks, kv_heads, block_size, head_dim], contiguous.
 * Query head h reads kv head h / (num_heads / kv_heads).
 * Sliding window: query b sits at position context_lens[b] - 1 and attends the keys
 * [window_first(context_lens[b], window), context_lens[b]). The blocks wholly before that first key
 * are never read (a window's sequence may have given them back), and with no window, or a context no
 * longer than it, every path runs exactly the operations it runs without one. */

/* The first key a query of context `ctx` attends: window <= 0 is full attention. */
static inline int64_t window_first(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* One step of a walk over keys [start, last) block by block, from any offset: sets *block (its index in
 * the table) and *end (that block's end, or last if sooner) and returns where key `start`'s row of kv
 * head kvh sits in the cache. */
static inline int64_t block_run(const int32_t *table, int64_t start, int64_t last, int64_t block_size,
                                int64_t kvh, int64_t num_kv_heads, int64_t head_dim, int64_t *block, int64_t *end) {
    *block = start / block_size;
    *end = (*block + 1) * block_size < last ? (*block + 1) * block_size : last;
    return ((int64_t)table[*block] * num_kv_heads + kvh) * block_size * head_dim
           + (start - *block * block_size) * head_dim;
}

#ifdef __AVX512F__
/* Ask for the cache lines of `count` storage values from element `first` on. */
static inline void prefetch_tile(const void *base, int64_t first, int64_t count, int bf16) {
    const char *p = (const char *)base + first * (bf16 ? 2 : 4);
    for (int64_t offset = 0; offset < count * (bf16 ? 2 : 4); offset += 64)
        _mm_prefetch(p + offset, _MM_HINT_T0);
}

/* Lane j of the result: the sum of the 16 lanes of v[j]. */
static inline __m512 sum_each_of_16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: the lane's part of the sums of four vectors */
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]))));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
}

/* q . k for one key, per lane partial sums (their total is the dot product): bfloat16 pairs on
 * AVX512-BF16 (exact products, float32 sums), else float32 FMAs. */
#ifdef __AVX512BF16__
#define BF16_VECTORS(name, NV, base, first, bf16)                                                    \
    __m512bh name[NV / 2];                                                                           \
    for (int v = 0; v < NV / 2; v++)                                                                \
        name[v] = bf16 ? (__m512bh)_mm512_loadu_si512((const uint16_t *)(base) + (first) + 32 * v)     \
                       : (__m512bh)_mm512_setzero_si512();
#define DEFINE_KEY_DOT(NV)                                                                           \
static inline __m512 key_dot_##NV(const __m512 *qv, const __m512bh *qh, const void *k_cache,      \
                                  int64_t base, int bf16) {                                          \
    __m512 acc = _mm512_setzero_ps();                                                                \
    if (bf16) {                                                                                      \
        for (int v = 0; v < NV / 2; v++)                                                            \
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const uint16_t *)k_cache + base + 32 * v), qh[v]); \
        return acc;                                                                                  \
    }                                                                                                \
    for (int v = 0; v < NV; v++) acc = _mm512_fmadd_ps(qv[v], load16(k_cache, base + 16 * v, 0), acc); \
    return acc;                                                                                      \
}
#else
#define BF16_VECTORS(name, NV, base, first, bf16) const void *name = NULL;
#define DEFINE_KEY_DOT(NV)                                                                           \
static inline __m512 key_dot_##NV(const __m512 *qv, const void *qh, const void *k_cache,          \
                                  int64_t base, int bf16) {                                          \
    (void)qh;                                                                                        \
    __m512 acc = _mm512_setzero_ps();                                                                \
    for (int v = 0; v < NV; v++) acc = _mm512_fmadd_ps(qv[v], load16(k_cache, base + 16 * v, bf16), acc); \
    return acc;                                                                                      \
}
#endif
DEFINE_KEY_DOT(4)
DEFINE_KEY_DOT(8)
DEFINE_KEY_DOT(12)
DEFINE_KEY_DOT(16)

/* One (sequence, kv head, span of keys) of decode attention with NV 16-lane vectors per head row:
 * scores 16 keys at a time (one horizontal-sum tree for all 16), exponentials 16 lanes at a time,
 * and the G output accumulators in registers while V streams through once per VC of the NV vectors
 * (each output lane sums its own products in key order, so how the columns are split changes no
 * result). Keys [key0, key1); key0 may sit inside a block (a window's first span), and each block's
 * keys are taken from key0's offset, 16 at a time, so a span starting on a block boundary runs the
 * same operations whatever block_size is. Per query row g it leaves the span's score maximum top[g],
 * the sum of exp(score - top[g]) in total[g], and the exp-weighted sum of V rows (not yet divided by
 * the total) in out_rows[g]; decode_attention merges the spans. `scores` holds G * (key1 - key0)
 * floats. Only the blocks holding keys of the span are read. */
#define DEFINE_DECODE_ITEM(NV, VC)                                                                      \
static void decode_item_##NV(float *out_rows, float *top, float *total, const void *q, int64_t q_row,  \
                             int64_t q_head_stride, const void *k_cache, const void *v_cache,            \
                             const int32_t *table, int64_t key0, int64_t key1, int64_t kvh,              \
                             int64_t num_kv_heads, int64_t block_size, int64_t group, float scale,       \
                             int bf16, float *scores) {                                                  \
    const int64_t head_dim = 16 * NV, tile = block_size * head_dim, span = key1 - key0;                 \
    for (int64_t g = 0; g < group; g++) {                                                                \
        __m512 qv[NV];                                                                                   \
        for (int v = 0; v < NV; v++) qv[v] = load16(q, q_row + (kvh * group + g) * q_head_stride + 16 * v, bf16); \
        BF16_VECTORS(qh, NV, q, q_row + (kvh * group + g) * q_head_stride, bf16);                        \
        float *sg = scores + g * span;                                                                   \
        __m512 mx = _mm512_set1_ps(-INFINITY);                                                           \
        for (int64_t start = key0, block, end; start < key1; start = end) {                              \
            const int64_t tile_base = block_run(table, start, key1, block_size, kvh, num_kv_heads,       \
                                                head_dim, &block, &end);                                 \
            const int64_t n = end - start;                                                               \
            if (g == 0 && end < key1)  /* the next block is elsewhere: fetch it early */                 \
                prefetch_tile(k_cache, ((int64_t)table[block + 1] * num_kv_heads + kvh) * tile, tile, bf16); \
            for (int64_t j0 = 0; j0 < n; j0 += 16) {                                                     \
                const int count = (int)(n - j0 < 16 ? n - j0 : 16);                                      \
                __m512 dots[16];                                                                         \
                for (int j = 0; j < 16; j++) {                                                           \
                    dots[j] = _mm512_setzero_ps();                                                       \
                    if (j < count)                                                                       \
                        dots[j] = key_dot_##NV(qv, qh, k_cache, tile_base + (j0 + j) * head_dim, bf16);   \
                }                                                                                        \
                const __mmask16 valid = (__mmask16)((1u << count) - 1);                                  \
                const __m512 sc = _mm512_mul_ps(sum_each_of_16(dots), _mm512_set1_ps(scale));            \
                _mm512_mask_storeu_ps(sg + (start - key0) + j0, valid, sc);                              \
                mx = _mm512_mask_max_ps(mx, valid, mx, sc);                                              \
            }                                                                                            \
        }                                                                                                \
        top[g] = _mm512_reduce_max_ps(mx);                                                               \
        const __m512 top_v = _mm512_set1_ps(top[g]);                                                     \
        __m512 sums = _mm512_setzero_ps();                                                               \
        for (int64_t t = 0; t < span; t += 16) {                                                         \
            const __mmask16 valid = span - t >= 16 ? 0xFFFF : (__mmask16)((1u << (span - t)) - 1);       \
            const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sg + t), top_v));     \
            _mm512_mask_storeu_ps(sg + t, valid, e);                                                     \
            sums = _mm512_mask_add_ps(sums, valid, sums, e);                                             \
        }                                                                                                \
        total[g] = _mm512_reduce_add_ps(sums);                                                           \
    }                                                                                                    \
    for (int c = 0; c < NV; c += VC) {                                                                   \
        __m512 acc[8][VC];                                                                               \
        for (int64_t g = 0; g < group; g++)                                                              \
            for (int v = 0; v < VC; v++) acc[g][v] = _mm512_setzero_ps();                               \
        for (int64_t start = key0, block, end; start < key1; start = end) {                              \
            const int64_t tile_base = block_run(table, start, key1, block_size, kvh, num_kv_heads,       \
                                                head_dim, &block, &end) + 16 * c;                        \
            const int64_t n = end - start;                                                               \
            if (end < key1)                                                                              \
                prefetch_tile(v_cache, ((int64_t)table[block + 1] * num_kv_heads + kvh) * tile, tile, bf16); \
            for (int64_t j = 0; j < n; j++) {                                                            \
                __m512 row[VC];                                                                          \
                for (int v = 0; v < VC; v++) row[v] = load16(v_cache, tile_base + j * head_dim + 16 * v, bf16); \
                for (int64_t g = 0; g < group; g++) {                                                    \
                    const __m512 p = _mm512_set1_ps(scores[g * span + (start - key0) + j]);              \
                    for (int v = 0; v < VC; v++) acc[g][v] = _mm512_fmadd_ps(p, row[v], acc[g][v]);     \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int64_t g = 0; g < group; g++)                                                              \
            for (int v = 0; v < VC; v++) _mm512_storeu_ps(out_rows + g * head_dim + 16 * (c + v), acc[g][v]); \
    }                                                                                                    \
}
DEFINE_DECODE_ITEM(4, 4)
DEFINE_DECODE_ITEM(8, 8)
DEFINE_DECODE_ITEM(12, 6)  /* head_dim 192 and 256 take V in halves: G x NV accumulators would not */
DEFINE_DECODE_ITEM(16, 8)  /* come near the 32 registers */
/* decode_item_NV for head_dim 64 (NV 4), 128, 192 and 256 */
static void (*const decode_items[4])(float *, float *, float *, const void *, int64_t, int64_t, const void *,
                                     const void *, const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, float, int, float *) = {decode_item_4, decode_item_8, decode_item_12,
                                                                      decode_item_16};
#endif

/* Keys per span of the AVX-512 decode path, rounded down to whole blocks (at least one): spans are
 * the parallel work items, so that one long sequence keeps both cores busy. A fixed length, so that a
 * sequence's spans, and its result, do not depend on the rest of the batch. */
#define SPAN_KEYS 64

#ifdef __AVX512F__
/* The spans' partial results of one (sequence, kv head) merged into its G output rows. */
static void merge_spans(void *out, int64_t out_row, const float *rows, const float *tops, const float *totals,
                        int64_t spans, int64_t group, int64_t head_dim, int bf16) {
    float merged[8 * 128];
    for (int64_t g = 0; g < group; g++) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t c = 0; c < spans; c++) top = tops[c * group + g] > top ? tops[c * group + g] : top;
        for (int64_t d = 0; d < head_dim; d++) merged[d] = 0.0f;
        for (int64_t c = 0; c < spans; c++) {
            const float weight = fast_exp(tops[c * group + g] - top);
            total += totals[c * group + g] * weight;
            const float *r = rows + (c * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; d++) merged[d] += r[d] * weight;
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < head_dim; d++) merged[d] *= inv;
        store_row(out, out_row + g * head_dim, merged, head_dim, bf16);
    }
}

/* The AVX-512 path: items are (sequence, kv head, span of SPAN_KEYS keys); then one merge per
 * (sequence, kv head). Spans stay at multiples of span_keys from key 0 whatever the window: a window
 * drops the spans wholly before its first key and starts the one holding it there, so a sequence's
 * spans are a function of its own length and window. */
static void decode_attention_in_spans(void *out, const void *q, const void *k_cache, const void *v_cache,
                                      const int64_t *token_index, const int32_t *block_tables,
                                      const int32_t *context_lens, int64_t num_seqs, int64_t num_kv_heads,
                                      int64_t group, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                      int64_t q_row_stride, int64_t q_head_stride, int64_t out_row_stride,
                                      float scale, int64_t window, int bf16) {
    const int64_t span_keys = (SPAN_KEYS / block_size > 1 ? SPAN_KEYS / block_size : 1) * block_size;
    int64_t *first_span = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    first_span[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        first_span[b + 1] = first_span[b] + (context_lens[b] + span_keys - 1) / span_keys
                            - window_first(context_lens[b], window) / span_keys;
    const int64_t spans = first_span[num_seqs];
    float *rows = (float *)malloc(sizeof(float) * (size_t)(spans * num_kv_heads * group * (head_dim + 2)));
    float *tops = rows + spans * num_kv_heads * group * head_dim, *totals = tops + spans * num_kv_heads * group;
    #pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * span_keys));
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++)
            for (int64_t item = 0; item < spans; item++) {
                int64_t b = 0, hi = num_seqs - 1;  /* the sequence whose spans hold `item` */
                while (b < hi) {
                    const int64_t mid = (b + hi + 1) / 2;
                    if (first_span[mid] <= item) b = mid; else hi = mid - 1;
                }
                const int64_t first = window_first(context_lens[b], window);
                const int64_t span_start = (first / span_keys + item - first_span[b]) * span_keys;
                const int64_t key0 = span_start > first ? span_start : first;
                const int64_t key1 = span_start + span_keys < context_lens[b] ? span_start + span_keys : context_lens[b];
                const int64_t slot = kvh * spans + item;
                decode_items[head_dim / 64 - 1](
                    rows + slot * group * head_dim, tops + slot * group, totals + slot * group, q,
                    token_index[b] * q_row_stride, q_head_stride, k_cache, v_cache, block_tables + b * max_blocks,
                    key0, key1, kvh, num_kv_heads, block_size, group, scale, bf16, scores);
            }
        free(scores);
        #pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < num_seqs; b++)
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                const int64_t slot = kvh * spans + first_span[b];
                merge_spans(out, token_index[b] * out_row_stride + kvh * group * head_dim,
                            rows + slot * group * head_dim, tops + slot * group, totals + slot * group,
                            first_span[b + 1] - first_span[b], group, head_dim, bf16);
            }
    }
    free(rows);
    free(first_span);
}
#endif

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

/* Whether query b + 1 continues query b's sequence at the next position: its block table extends b's
 * (a table lists the blocks of its own context only, so the tile's last query's table serves them all). */
static int continues(const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                     int64_t b, int64_t max_blocks, int64_t block_size) {
    if (token_index[b + 1] != token_index[b] + 1 || context_lens[b + 1] != context_lens[b] + 1)
        return 0;
    const int64_t used = (context_lens[b] + block_size - 1) / block_size;
    return memcmp(block_tables + b * max_blocks, block_tables + (b + 1) * max_blocks, sizeof(int32_t) * (size_t)used) == 0;
}

static void decode_attention_avx2(void *out, const void *q, const void *k_cache, const void *v_cache,
                                  const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                                  int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                                  int64_t block_size, int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride,
                                  int64_t out_row_stride, float scale, int64_t window, int bf16) {
    int64_t *starts = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    int64_t tiles = 0;
    for (int64_t b = 0; b < num_seqs;) {
        starts[tiles++] = b;
        int64_t end = b + 1;
        while (end < num_seqs && end - b < QUERY_TILE
               && continues(token_index, block_tables, context_lens, end - 1, max_blocks, block_size))
            end++;
        b = end;
    }
    starts[tiles] = num_seqs;
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
        decode_attention_in_spans(out, q, k_cache, v_cache, token_index, block_tables, context_lens, num_seqs,
                                  num_kv_heads, group, head_dim, block_size, max_blocks, q_row_stride,
                                  q_head_stride, out_row_stride, scale, window, bf16);
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
