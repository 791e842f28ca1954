/* What the paged attention kernels share about their queries: the keys a query attends, the walk over
 * a sequence's cache blocks, and the grouping of consecutive queries of one sequence into tiles. */
#ifndef TOKENMILL_PAGED_QUERIES_H
#define TOKENMILL_PAGED_QUERIES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* What a paged cache's rows hold: values of the storage dtype (float32 or bfloat16, as q's), or one-byte
 * rows (attention/kv_quant.py) of head_dim int8 values or e4m3 bits and the row's float32 scale. */
enum { TM_ROWS_DTYPE = 0, TM_ROWS_INT8 = 1, TM_ROWS_FP8 = 2 };

/* attention_tiles.c (AVX-512 and AVX2 only): every query of a step in tiles, over a cache of `rows`. */
void tm_attention_tiles(void *out, const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                        int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                        int64_t max_blocks, int64_t q_row_stride, int64_t q_head_stride, int64_t out_row_stride,
                        float scale, int64_t window, int64_t chunk, float softcap, const float *sinks, int bf16,
                        int rows);

/* The first key a query of context `ctx` (at position ctx - 1) attends: within its `window` latest keys (window <= 0:
 * no window) and, with chunk > 0 (Llama 4's chunked local attention), from the start of its own chunk of `chunk`
 * positions, (ctx - 1) / chunk * chunk. */
static inline int64_t window_first(int64_t ctx, int64_t window, int64_t chunk) {
    const int64_t first = window > 0 && ctx > window ? ctx - window : 0;
    const int64_t chunk_start = chunk > 0 && ctx > 0 ? (ctx - 1) / chunk * chunk : 0;
    return first > chunk_start ? first : chunk_start;
}

/* Gemma 2's score soft cap: each of n scores s becomes cap * tanh(s / cap), in place, before the softmax (as
 * transformers divides, takes tanh and multiplies, in float32); cap <= 0 leaves them as they are. Score by
 * score, so a query's scores stay a function of its own keys. */
static inline void softcap_scores(float *scores, int64_t n, float cap) {
    if (cap <= 0.0f)
        return;
    for (int64_t i = 0; i < n; i++) scores[i] = cap * tanhf(scores[i] / cap);
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

/* Whether query b + 1 continues query b's sequence at the next position: its block table extends b's
 * (a table lists the blocks of its own context only, so a tile's last query's table serves them all). */
static inline int continues(const int64_t *token_index, const int32_t *block_tables, const int32_t *context_lens,
                            int64_t b, int64_t max_blocks, int64_t block_size) {
    if (token_index[b + 1] != token_index[b] + 1 || context_lens[b + 1] != context_lens[b] + 1)
        return 0;
    const int64_t used = (context_lens[b] + block_size - 1) / block_size;
    return memcmp(block_tables + b * max_blocks, block_tables + (b + 1) * max_blocks, sizeof(int32_t) * (size_t)used) == 0;
}

/* The queries in tiles of at most `most` consecutive positions of one sequence: tile i is queries
 * [starts[i], starts[i + 1]). Returns the tile count; `starts` holds num_seqs + 1 values. */
static inline int64_t query_tiles(int64_t *starts, const int64_t *token_index, const int32_t *block_tables,
                                  const int32_t *context_lens, int64_t num_seqs, int64_t max_blocks,
                                  int64_t block_size, int64_t most) {
    int64_t tiles = 0;
    for (int64_t b = 0; b < num_seqs;) {
        starts[tiles++] = b;
        int64_t end = b + 1;
        while (end < num_seqs && end - b < most
               && continues(token_index, block_tables, context_lens, end - 1, max_blocks, block_size))
            end++;
        b = end;
    }
    starts[tiles] = num_seqs;
    return tiles;
}

#endif
