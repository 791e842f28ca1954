/* Paged attention on AVX-512 and AVX2 in tiles of queries, with one arithmetic per query: a query's
 * result depends only on its q row, its context length, the window and the cached K/V, never on the
 * other queries of its step, so it attends alike as a lone decode, in a prefill chunk of any size, after
 * a prefix-cache hit or as a speculative verification row.
 *
 * A query's keys [first, ctx) are cut into spans at multiples of `span_keys` from key 0 (64 keys,
 * rounded to whole cache blocks), and each (query head, span) runs alone:
 *   1. scores: the span's keys transposed LANES (16, or 8 on AVX2) to a vector, so that each key's
 *      score is one chain over the dimensions in order in its own lane (AVX512-BF16 dot products of
 *      dimension pairs on bfloat16 caches, else float32 fused multiply-adds), times scale (and soft-capped,
 *      softcap * tanh(score / softcap), where the layer has a cap);
 *   2. top = the row's largest score in the span; e = fast_exp16 / fast_exp8 (score - top), LANES keys
 *      at a time from the row's first key there, their total summed lane-wise in key order and then by
 *      one fixed tree;
 *   3. part = the sum over the row's keys in order of e * v (a fused multiply-add chain per dimension).
 * Over a one-byte cache (int8 or e4m3 rows with a float32 scale each, attention/kv_quant.py) a key or value
 * is its widened byte times its row's scale, one float32 rounding, the same wherever the query comes; the
 * scores then take the float32 chains. A block's keys are stored transposed, so step 1 reads LANES keys'
 * dimension as one vector of bytes.
 * The spans are then folded in order (fold_span): (m, l, o) starts as the first span's (top, total, part)
 * and each later span rescales both sides by fast_exp of their tops less the new maximum; the output is
 * o / l (a layer's attention sink first joined to l, fold_sink), rounded once to the storage dtype.
 * The two levels' results differ (other lanes, other trees);
 * within a level they never depend on the batch.
 *
 * How the work is shared changes none of those operations. A tile is up to TILE_QUERIES consecutive
 * queries of one sequence (a prefill chunk's, `query_tiles`) and one kv head: its rows (query x query
 * head of the group) take each span in turn while its keys and values are in L1, V rows loaded once
 * for PV_ROWS rows. A row's chain skips the keys outside its own range by a masked fused multiply-add,
 * which leaves its accumulator exactly as it was. A tile of one query (a decode) takes its spans as
 * separate work items, so that one long sequence keeps every core busy, keeps their partial results
 * and folds them afterwards in the same order.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_avx2.h"
#include "cpu_common.h"
#include "paged_queries.h"
#include "q8_rows.h"

#if defined(__AVX512F__) || defined(TM_AVX2)
#include <immintrin.h>

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#define SPAN_KEYS 64
#define TILE_QUERIES 16
#ifdef __AVX512F__
#define PV_ROWS 6   /* rows whose PV accumulators share one load of a V row: 6 x 4 vectors in registers */
#else
#define PV_ROWS 2   /* AVX2's 16 registers: 2 x 4 accumulators, a V row's 4 vectors and the weight (3 rows spill:
                       the attention of a 2,048-token prompt took 4.4-4.8 s against 3.9-4.3 s, one thread) */
#endif
#define PV_VECTORS 4

typedef struct {
    void *out;
    const void *q, *k_cache, *v_cache;
    const int64_t *token_index;
    const int32_t *block_tables, *context_lens;
    int64_t num_kv_heads, group, head_dim, block_size, max_blocks, q_row_stride, q_head_stride, out_row_stride;
    int64_t window, chunk, span_keys;  /* chunk > 0: Llama 4's chunked local attention (window_first) */
    float scale;
    float softcap;      /* > 0: scores -> softcap * tanh(score / softcap) before the softmax (Gemma 2) */
    const float *sinks; /* GPT-OSS's attention sinks [heads], joined to each row's total as it is written; or NULL */
    int bf16;
    int rows;           /* TM_ROWS_*: what the cache rows hold */
    int paired;         /* the scores take bfloat16 dot products of dimension pairs (PAIRED, bfloat16 rows) */
    int64_t row_width;  /* a cache row's elements: head_dim, or head_dim + 4 bytes for one-byte rows */
} paged_args;

/* One tile: queries [b0, b0 + n), `table` the block table of its last (longest) query. */
typedef struct {
    int64_t b0, n;
    const int32_t *table;
} query_tile;

/* Keys per span: SPAN_KEYS rounded down to whole blocks, at least one. A fixed length, so that a query's
 * spans are a function of its own context. */
static inline int64_t span_length(int64_t block_size) {
    return (SPAN_KEYS / block_size > 1 ? SPAN_KEYS / block_size : 1) * block_size;
}

/* Query b's keys in span c: [*key0, *key1), empty when *key0 >= *key1. */
static inline void span_keys_of(const paged_args *a, int64_t b, int64_t c, int64_t *key0, int64_t *key1) {
    const int64_t ctx = a->context_lens[b], first = window_first(ctx, a->window, a->chunk);
    const int64_t start = c * a->span_keys, end = start + a->span_keys;
    *key0 = start > first ? start : first;
    *key1 = end < ctx ? end : ctx;
}

/* What a value row's widened bytes are multiplied by: a one-byte row's scale (at byte `row` of the value
 * plane, after its head_dim values) times q8_unit, as the raw widenings need; 0 for rows of the dtype. */
static inline float value_row_scale(const paged_args *a, int64_t row) {
    if (a->rows == TM_ROWS_DTYPE)
        return 0.0f;
    float scale;
    memcpy(&scale, (const int8_t *)a->v_cache + row + a->head_dim, sizeof(float));
    return scale * q8_unit(a->rows == TM_ROWS_FP8);
}

#ifdef __AVX512F__
#include "attention_tiles_avx512.h"
#else
#include "attention_tiles_avx2.h"
#endif

/* One thread's scratch: for a tile's rows, their scores (a row of padded_span floats each), span
 * partials and float32 q rows; the span's transposed keys. */
typedef struct {
    float *scores, *parts, *tops, *totals, *q;
    void *kt;
} span_scratch;

/* Scores row length: the span rounded up to a multiple of 64 (whole SCORE_KEYS vectors on either level). */
static inline int64_t padded_span(int64_t span_keys) {
    return (span_keys + 63) / 64 * 64;
}

/* Where the scores take float32 q from bfloat16 storage: the tile's q rows widened into ws->q (row r =
 * query r / group, head r % group), once per tile and kv head, before its spans. */
static void widen_q(const paged_args *a, const query_tile *t, int64_t kvh, span_scratch *ws) {
    if (a->paired || !a->bf16)
        return;
    for (int64_t i = 0; i < t->n; i++)
        for (int64_t g = 0; g < a->group; g++)
            load_row(ws->q + (i * a->group + g) * a->head_dim, a->q,
                     a->token_index[t->b0 + i] * a->q_row_stride + (kvh * a->group + g) * a->q_head_stride,
                     a->head_dim, 1);
}

/* The span partials (top, total, part) of the tile's rows in span c, for kv head kvh: row r = (query
 * r / group, head r % group) into tops[r], totals[r], parts[r]; rows whose query has no key in the span
 * are left untouched. widen_q has run for this tile and kv head. */
static inline __attribute__((always_inline)) void tile_span(const paged_args *a, const query_tile *t, int64_t kvh,
                                                           int64_t c, span_scratch *ws, const int NV) {
    const int64_t group = a->group, head_dim = 16 * NV, sk = a->span_keys, stride = padded_span(sk);
    const int64_t span_start = c * sk;
    const int paired = a->paired;
    int64_t key0[TILE_QUERIES], key1[TILE_QUERIES], u0 = INT64_MAX, u1 = 0;
    for (int64_t i = 0; i < t->n; i++) {
        span_keys_of(a, t->b0 + i, c, &key0[i], &key1[i]);
        if (key0[i] < key1[i]) {
            u0 = key0[i] < u0 ? key0[i] : u0;
            u1 = key1[i] > u1 ? key1[i] : u1;
        }
    }
    if (u0 >= u1)
        return;
    const int64_t v0 = (u0 - span_start) / LANES, v1 = (u1 - span_start + LANES - 1) / LANES;
    transpose_keys(ws->kt, a, t->table, kvh, span_start, u0, u1, v0, v1, NV);
    /* at most 8 query heads a kv head: tm_decode_attention sends larger groups to the portable loop */
    int64_t rows[TILE_QUERIES * 8], row_key0[TILE_QUERIES * 8], row_key1[TILE_QUERIES * 8];
    const void *q_rows[TILE_QUERIES * 8];
    int live = 0;
    for (int64_t i = 0; i < t->n; i++) {
        if (key0[i] >= key1[i])
            continue;
        const int64_t q_row = a->token_index[t->b0 + i] * a->q_row_stride;
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = i * group + g, q_at = q_row + (kvh * group + g) * a->q_head_stride;
            if (paired)
                q_rows[live] = (const uint16_t *)a->q + q_at;
            else if (a->bf16)  /* widened once per tile by widen_q */
                q_rows[live] = ws->q + r * head_dim;
            else
                q_rows[live] = (const float *)a->q + q_at;
            rows[live] = r;
            row_key0[live] = key0[i];
            row_key1[live] = key1[i];
            live++;
        }
    }
    for (int first = 0; first < live; first += SCORE_ROWS) {
        const int R = live - first < SCORE_ROWS ? live - first : SCORE_ROWS;
        float *s[SCORE_ROWS];
        for (int r = 0; r < R; r++) s[r] = ws->scores + rows[first + r] * stride;
        /* from a whole SCORE_KEYS group: the vectors before v0 hold no key of any row (their lanes are never
         * read); R as a constant, so that a decode's group of 3 rows computes no fourth */
        const int64_t vs = v0 / SCORE_KEYS * SCORE_KEYS;
        const void *const *qr = q_rows + first;
#if SCORE_ROWS == 4
        if (R == 4) rows_scores(s, qr, 4, ws->kt, vs, v1, a->scale, paired, NV);
        else
#endif
        if (R == 3) rows_scores(s, qr, 3, ws->kt, vs, v1, a->scale, paired, NV);
        else if (R == 2) rows_scores(s, qr, 2, ws->kt, vs, v1, a->scale, paired, NV);
        else rows_scores(s, qr, 1, ws->kt, vs, v1, a->scale, paired, NV);
    }
    for (int x = 0; x < live; x++) {
        const int64_t r = rows[x], from = row_key0[x] - span_start, len = row_key1[x] - row_key0[x];
        float *sr = ws->scores + r * stride;
        softcap_scores(sr + from, len, a->softcap);  /* the row's own scores only: still one arithmetic per query */
        ws->tops[r] = row_max(sr + from, len);
        ws->totals[r] = row_exponentials(sr + from, len, ws->tops[r]);
    }
    for (int first = 0; first < live; first += PV_ROWS) {
        const int R = live - first < PV_ROWS ? live - first : PV_ROWS;
        float *part[PV_ROWS];
        const float *e[PV_ROWS];
        for (int r = 0; r < R; r++) {
            part[r] = ws->parts + rows[first + r] * head_dim;
            e[r] = ws->scores + rows[first + r] * stride;
        }
        for (int64_t c0 = 0; c0 < head_dim / LANES; c0 += PV_VECTORS)
            rows_values(part, e, row_key0 + first, row_key1 + first, R, a, t->table, kvh, span_start, u0, u1, c0);
    }
}

/* tile_span for head_dim 64, 128, 192 and 256 */
#define DEFINE_TILE_SPAN(NV)                                                                                   \
    static void tile_span_##NV(const paged_args *a, const query_tile *t, int64_t kvh, int64_t c, span_scratch *ws) { \
        tile_span(a, t, kvh, c, ws, NV);                                                                       \
    }
DEFINE_TILE_SPAN(4)
DEFINE_TILE_SPAN(8)
DEFINE_TILE_SPAN(12)
DEFINE_TILE_SPAN(16)
static void (*const tile_spans[4])(const paged_args *, const query_tile *, int64_t, int64_t, span_scratch *) = {
    tile_span_4, tile_span_8, tile_span_12, tile_span_16};

/* A row's state (m, l, o) with one more span's partial folded in; `first`: the row's first span, which
 * the state becomes. The spans of a row are folded in key order. */
static inline void fold_span(float *m, float *l, float *o, float top, float total, const float *part,
                             int64_t head_dim, int first) {
    if (first) {
        *m = top;
        *l = total;
        memcpy(o, part, sizeof(float) * (size_t)head_dim);
        return;
    }
    const float m_new = top > *m ? top : *m;
    const float keep = fast_exp(*m - m_new), add = fast_exp(top - m_new);
    *l = *l * keep + total * add;
    *m = m_new;
    for (int64_t d = 0; d < head_dim; d++) o[d] = o[d] * keep + part[d] * add;
}

/* out row = o / l in the storage dtype, for query head `head` of state (m, l, o): with sinks, the head's sink
 * folded in first (fold_sink). */
static inline void write_row(const paged_args *a, int64_t out_at, float *o, float m, float l, int64_t head) {
    if (a->sinks)
        fold_sink(m, &l, o, a->head_dim, a->sinks[head]);
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < a->head_dim; d++) o[d] *= inv;
    store_row(a->out, out_at, o, a->head_dim, a->bf16);
}

/* Span range of query b: [first span, last span]. */
static inline void query_spans(const paged_args *a, int64_t b, int64_t *c_first, int64_t *c_last) {
    const int64_t ctx = a->context_lens[b];
    *c_first = window_first(ctx, a->window, a->chunk) / a->span_keys;
    *c_last = (ctx - 1) / a->span_keys;
}

/* A whole tile for one kv head: every span in order, folded as it comes, then the rows written. */
static void attend_tile(const paged_args *a, const query_tile *t, int64_t kvh, span_scratch *ws, float *state) {
    const int64_t group = a->group, head_dim = a->head_dim, rows = t->n * group;
    float *m = state, *l = m + rows, *o = l + rows;
    int64_t c_begin = INT64_MAX, c_end = 0;
    for (int64_t i = 0; i < t->n; i++) {
        int64_t c_first, c_last;
        query_spans(a, t->b0 + i, &c_first, &c_last);
        c_begin = c_first < c_begin ? c_first : c_begin;
        c_end = c_last + 1 > c_end ? c_last + 1 : c_end;
    }
    widen_q(a, t, kvh, ws);
    for (int64_t c = c_begin; c < c_end; c++) {
        tile_spans[head_dim / 64 - 1](a, t, kvh, c, ws);
        for (int64_t i = 0; i < t->n; i++) {
            int64_t c_first, c_last;
            query_spans(a, t->b0 + i, &c_first, &c_last);
            if (c < c_first || c > c_last)
                continue;
            for (int64_t g = 0; g < group; g++) {
                const int64_t r = i * group + g;
                fold_span(&m[r], &l[r], o + r * head_dim, ws->tops[r], ws->totals[r], ws->parts + r * head_dim,
                          head_dim, c == c_first);
            }
        }
    }
    for (int64_t i = 0; i < t->n; i++) {
        const int64_t out_row = a->token_index[t->b0 + i] * a->out_row_stride + kvh * group * head_dim;
        for (int64_t g = 0; g < group; g++)
            write_row(a, out_row + g * head_dim, o + (i * group + g) * head_dim, m[i * group + g], l[i * group + g],
                      kvh * group + g);
    }
}

/* Attention of every query (see tm_decode_attention) on AVX-512 or AVX2: head_dim a multiple of 64 up to
 * 256, group at most 8; `rows` (TM_ROWS_*) what the cache holds, one-byte rows with block_size a
 * multiple of 16 (decode_attention_q8.c's layout). */
void tm_attention_tiles(void *out, const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                        int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                        int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride, int64_t out_row_stride,
                        float scale, int64_t window, int64_t chunk, float softcap, const float *sinks, int bf16,
                        int rows) {
    const paged_args a = {out, q, k_cache, v_cache, token_index, block_tables, context_lens, num_kv_heads, group,
                          head_dim, block_size, max_blocks, q_row_stride, q_head_stride, out_row_stride, window,
                          chunk, span_length(block_size), scale, softcap, sinks, bf16, rows,
                          rows == TM_ROWS_DTYPE && PAIRED(bf16),
                          rows == TM_ROWS_DTYPE ? head_dim : head_dim + 4};
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    const int64_t tiles = query_tiles(starts, token_index, block_tables, context_lens, num_seqs, max_blocks,
                                      block_size, TILE_QUERIES);
    /* work items: a tile of several queries whole; a lone query's spans one by one (first_split[i] is
     * where tile i's spans start among the split items, -1 for a whole tile) */
    int64_t *first_split = malloc(sizeof(int64_t) * (size_t)(tiles + 1));
    int64_t split = 0, whole = 0;
    for (int64_t i = 0; i < tiles; i++) {
        if (starts[i + 1] - starts[i] == 1) {
            int64_t c_first, c_last;
            query_spans(&a, starts[i], &c_first, &c_last);
            first_split[i] = split;
            split += c_last - c_first + 1;
        } else {
            first_split[i] = -1;
            whole++;
        }
    }
    /* items [0, whole): whole tiles, longest (latest) first; [whole, whole + split): single spans, item it
     * being span span_of[it] of tile items[it] */
    int64_t *items = malloc(sizeof(int64_t) * (size_t)(2 * (whole + split) + 1)), *span_of = items + whole + split;
    for (int64_t i = tiles - 1, w = 0, s = whole; i >= 0; i--) {
        if (first_split[i] < 0) {
            items[w++] = i;
            continue;
        }
        int64_t c_first, c_last;
        query_spans(&a, starts[i], &c_first, &c_last);
        for (int64_t c = c_first; c <= c_last; c++, s++) {
            items[s] = i;
            span_of[s] = c - c_first;
        }
    }
    const int64_t item_count = whole + split, part_row = head_dim + 2;
    float *partials = malloc(sizeof(float) * (size_t)((split + 1) * num_kv_heads * group * part_row));
    const int64_t tile_rows = TILE_QUERIES * group, sk = a.span_keys;
    #pragma omp parallel
    {
        /* per tile row: scores, part, top, total, float32 q, state (m, l, o); then the transposed keys */
        const int64_t stride = padded_span(sk), floats = tile_rows * (stride + 3 * head_dim + 4);
        float *buffer = aligned_alloc(64, sizeof(float) * (size_t)(floats + stride * head_dim));
        span_scratch ws;
        ws.scores = buffer;
        ws.parts = ws.scores + tile_rows * stride;
        ws.tops = ws.parts + tile_rows * head_dim;
        ws.totals = ws.tops + tile_rows;
        ws.q = ws.totals + tile_rows;
        float *state = ws.q + tile_rows * head_dim;
        ws.kt = buffer + floats;
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t it = 0; it < item_count; it++)
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                if (it < whole) {
                    const int64_t i = items[it];
                    const query_tile t = {starts[i], starts[i + 1] - starts[i], block_tables + (starts[i + 1] - 1) * max_blocks};
                    attend_tile(&a, &t, kvh, &ws, state);
                    continue;
                }
                const int64_t i = items[it], offset = span_of[it];
                const query_tile t = {starts[i], 1, block_tables + starts[i] * max_blocks};
                int64_t c_first, c_last;
                query_spans(&a, starts[i], &c_first, &c_last);
                widen_q(&a, &t, kvh, &ws);
                tile_spans[head_dim / 64 - 1](&a, &t, kvh, c_first + offset, &ws);
                float *slot = partials + ((first_split[i] + offset) * num_kv_heads + kvh) * group * part_row;
                for (int64_t g = 0; g < group; g++) {
                    slot[g * part_row] = ws.tops[g];
                    slot[g * part_row + 1] = ws.totals[g];
                    memcpy(slot + g * part_row + 2, ws.parts + g * head_dim, sizeof(float) * (size_t)head_dim);
                }
            }
        /* the lone queries' spans folded in order */
        #pragma omp for collapse(2) schedule(static)
        for (int64_t i = 0; i < tiles; i++)
            for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
                if (first_split[i] < 0)
                    continue;
                int64_t c_first, c_last;
                query_spans(&a, starts[i], &c_first, &c_last);
                const int64_t out_row = token_index[starts[i]] * out_row_stride + kvh * group * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    float m = 0.0f, l = 0.0f;
                    for (int64_t c = c_first; c <= c_last; c++) {
                        const float *slot = partials + (((first_split[i] + c - c_first) * num_kv_heads + kvh) * group + g) * part_row;
                        fold_span(&m, &l, state, slot[0], slot[1], slot + 2, head_dim, c == c_first);
                    }
                    write_row(&a, out_row + g * head_dim, state, m, l, kvh * group + g);
                }
            }
        free(buffer);
    }
    free(partials);
    free(items);
    free(first_split);
    free(starts);
}
#endif
