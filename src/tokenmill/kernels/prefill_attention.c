/* Causal attention of a step's prefill chunks on AMX tiles: bfloat16 Q, K, V; float32 scores, softmax
 * and sums.
 *
 * Chunk c owns query rows [query_start, query_start + query_len) of q: the last query_len of its
 * context_len positions, whose K/V this step already wrote into the paged cache
 * [2, num_blocks, kv_heads, block_size, head_dim]. Row i (position context_len - query_len + i)
 * attends to keys 0 .. its position.
 *
 * First, per chunk and kv head, K and V are repacked once into B tiles, keys past the context zero:
 *   K^T, per 16 keys and 32 dims:  tile[kp][j][e] = K[key j][dim 32 s + 2 kp + e]
 *   V,   per 32 keys and 16 dims:  tile[kp][j][e] = V[key 2 kp + e][dim 16 t + j]
 * Then each work item (a chunk, a kv head, 16 query rows) runs over the keys its last row sees,
 * KEY_BLOCK keys at a time, each block for all the group's query heads, with the online softmax of
 * flash attention: S = Q K^T on tiles; in float32 lanes the scale, the causal mask, the running max m
 * and sum l, and P = exp(S - m) (as a power of 2, cpu_common.h's exp2_16) rounded to bfloat16 (A
 * tiles); then P V on tiles, added to float32 accumulators rescaled by exp(m_old - m_new). A row is
 * written as O / l, rounded to bfloat16.
 *
 * tm_prefill_attention returns -1 and does nothing where AMX is not compiled in or the shapes do not
 * suit it (head_dim a multiple of 32 up to 256, block_size a multiple of 16); the caller then takes
 * PyTorch's attention.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "cpu_common.h"

#ifdef TM_AMX
#include <math.h>
#include <omp.h>

#define KEY_BLOCK 128  /* keys per softmax step: 4 x 32 */
#define MAX_HEAD_DIM 256

typedef struct {
    const uint16_t *cache;
    int64_t values_offset;  /* elements from K's half of the cache to V's */
    int64_t num_kv_heads, block_size, head_dim;
} paged_kv;

/* Key `key` of kv head h (of a sequence with block table `blocks`): its K row, or its V row when `v`. */
static inline const uint16_t *cache_row(const paged_kv *kv, const int32_t *blocks, int64_t h, int64_t key, int v) {
    const int64_t block = blocks[key / kv->block_size], offset = key % kv->block_size;
    return kv->cache + (v ? kv->values_offset : 0) + ((block * kv->num_kv_heads + h) * kv->block_size + offset) * kv->head_dim;
}

/* The K^T tiles of keys [16 g, 16 g + 16), one per 32 dims. */
static void pack_keys(uint16_t *tiles, const paged_kv *kv, const int32_t *blocks, int64_t h, int64_t g, int64_t context) {
    const uint16_t *rows[16];
    for (int j = 0; j < 16; j++) rows[j] = 16 * g + j < context ? cache_row(kv, blocks, h, 16 * g + j, 0) : NULL;
    for (int64_t s = 0; s < kv->head_dim / 32; s++) {
        const uint16_t *dims[16];
        for (int j = 0; j < 16; j++) dims[j] = rows[j] ? rows[j] + 32 * s : NULL;
        tm_rows_to_b_tile(tiles + s * 512, dims);
    }
}

/* The V tiles of keys [32 b, 32 b + 32), one per 16 dims. */
static void pack_values(uint16_t *tiles, const paged_kv *kv, const int32_t *blocks, int64_t h, int64_t b, int64_t context) {
    const int64_t dim_tiles = kv->head_dim / 16;
    for (int kp = 0; kp < 16; kp++)
        for (int e = 0; e < 2; e++) {
            const int64_t key = 32 * b + 2 * kp + e;
            const uint16_t *row = key < context ? cache_row(kv, blocks, h, key, 1) : NULL;
            for (int64_t t = 0; t < dim_tiles; t++)
                for (int j = 0; j < 16; j++) tiles[t * 512 + kp * 32 + j * 2 + e] = row ? row[16 * t + j] : 0;
        }
}

/* Where chunk c's kv head h keeps its tiles in the step's buffer: its K^T tiles ([16-key group][dim
 * step], 2 * key_blocks * steps of them), then its V tiles ([32-key block][dim tile]). */
static inline uint16_t *head_tiles(uint16_t *tiles, const int64_t *first_tile, int64_t c, int64_t h,
                                   int64_t key_blocks, int64_t tiles_per_block) {
    return tiles + (first_tile[c] + h * key_blocks * tiles_per_block) * 512;
}

/* One thread's scratch; q, o, m and l hold every query head of the group (head g at g * their size). */
typedef struct {
    float s[16][KEY_BLOCK];                           /* one head's scores of a key block */
    uint16_t p[KEY_BLOCK / 32][16 * 32];              /* A tiles of its probabilities */
    float pv[16][64];                                 /* P V of 4 dim tiles */
    uint16_t *q;                                      /* [group][dim step] A tiles of 16 query rows */
    float *o;                                         /* [group][16][head_dim] running outputs */
    float *m, *l;                                     /* [group][16] running max and sum */
} scratch;

/* The work item's geometry. */
typedef struct {
    const uint16_t *q;          /* row 0, head 0 of the item */
    uint16_t *out;              /* row 0, head 0 of the item's output */
    int64_t q_stride, out_stride;
    const uint16_t *key_tiles;  /* this chunk and kv head's K^T tiles: [16-key group][dim step] */
    const uint16_t *value_tiles;  /* [32-key block][dim tile] */
    int64_t first_position;     /* position of row 0 */
    int rows;                   /* query rows (<= 16) */
    int64_t keys;               /* keys the last row sees */
} work_item;

/* Scores of head g's 16 rows for keys [k0, k0 + 32 * blocks) -> ws->s. */
static void scores(scratch *ws, const work_item *w, int64_t g, int64_t steps, int64_t k0, int blocks) {
    for (int b = 0; b < blocks; b++) {
        const int64_t group = k0 / 16 + 2 * b;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < steps; s++) {
            _tile_loadd(4, ws->q + (g * steps + s) * 512, 64);
            _tile_loadd(6, w->key_tiles + (group * steps + s) * 512, 64);
            _tile_loadd(7, w->key_tiles + ((group + 1) * steps + s) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, &ws->s[0][32 * b], KEY_BLOCK * 4);
        _tile_stored(1, &ws->s[0][32 * b + 16], KEY_BLOCK * 4);
    }
}

/* Softmax step of row r over the block's scores, in base 2 (scale2 = scale * log2(e), so that
 * 2^(scale2 s) = e^(scale s)): the first `visible` keys count, the rest are masked. Updates m and l,
 * rescales o, and writes the row's probabilities into the P tiles. */
static void softmax_row(scratch *ws, int64_t g, int r, int visible, int blocks, int64_t head_dim, float scale2) {
    const int vectors = 2 * blocks;
    uint16_t *p_row[KEY_BLOCK / 32];
    for (int b = 0; b < blocks; b++) p_row[b] = ws->p[b] + r * 32;
    if (visible <= 0) {
        for (int b = 0; b < blocks; b++) memset(p_row[b], 0, 64);
        return;
    }
    __m512 x[KEY_BLOCK / 16];
    __mmask16 live[KEY_BLOCK / 16];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < vectors; v++) {
        const int left = visible - 16 * v;
        live[v] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        x[v] = _mm512_mul_ps(_mm512_loadu_ps(&ws->s[r][16 * v]), _mm512_set1_ps(scale2));
        top = _mm512_mask_max_ps(top, live[v], top, x[v]);
    }
    float *m = ws->m + g * 16 + r, *l = ws->l + g * 16 + r, *o = ws->o + (g * 16 + r) * head_dim;
    const float m_old = *m, m_new = fmaxf(m_old, _mm512_reduce_max_ps(top));
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < vectors; v++) {
        const __m512 p = _mm512_maskz_mov_ps(live[v], exp2_16(_mm512_sub_ps(x[v], _mm512_set1_ps(m_new))));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i *)(p_row[v / 2] + 16 * (v % 2)), (__m256i)_mm512_cvtneps_pbh(p));
    }
    const float alpha = m_old == -INFINITY ? 0.0f : exp2f(m_old - m_new);
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    if (alpha != 1.0f)
        for (int64_t d = 0; d < head_dim; d += 16)
            _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(alpha)));
}

/* Head g's o += P V for the block's keys [k0, k0 + 32 * blocks). */
static void add_values(scratch *ws, const work_item *w, int64_t g, int64_t head_dim, int64_t k0, int blocks) {
    const int64_t dim_tiles = head_dim / 16;
    for (int64_t t0 = 0; t0 < dim_tiles; t0 += 4) {
        const int n = dim_tiles - t0 < 4 ? (int)(dim_tiles - t0) : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int b = 0; b < blocks; b++) {
            const uint16_t *v = w->value_tiles + ((k0 / 32 + b) * dim_tiles + t0) * 512;
            _tile_loadd(4, ws->p[b], 64);
            /* the tile numbers must be constants: one load and product per accumulator */
            _tile_loadd(5, v, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (n > 1) {
                _tile_loadd(6, v + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (n > 2) {
                _tile_loadd(7, v + 1024, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (n > 3) {
                _tile_loadd(5, v + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, &ws->pv[0][0], 256);
        _tile_stored(1, &ws->pv[0][16], 256);
        _tile_stored(2, &ws->pv[0][32], 256);
        _tile_stored(3, &ws->pv[0][48], 256);
        for (int r = 0; r < 16; r++)
            for (int i = 0; i < n; i++) {
                float *o = ws->o + (g * 16 + r) * head_dim + 16 * (t0 + i);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_loadu_ps(&ws->pv[r][16 * i])));
            }
    }
}

/* The item's rows for the `group` query heads of its kv head. Key blocks are the outer loop, so
 * that a block's K/V tiles stay in L1 for all the heads; head g + 1's scores are computed between
 * head g's softmax and its P V, which gives the stored probabilities time to reach L1 before the
 * tile loads read them (tile loads do not take forwarded stores). */
static void attend(scratch *ws, const work_item *w, int64_t group, int64_t head_dim, float scale) {
    const int64_t steps = head_dim / 32;
    const float scale2 = scale * 1.44269504088896341f;
    for (int64_t g = 0; g < group; g++)
        for (int64_t s = 0; s < steps; s++) {
            uint16_t *tile = ws->q + (g * steps + s) * 512;
            for (int r = 0; r < 16; r++) {
                if (r < w->rows)
                    memcpy(tile + r * 32, w->q + r * w->q_stride + g * head_dim + 32 * s, 64);
                else
                    memset(tile + r * 32, 0, 64);
            }
        }
    for (int64_t i = 0; i < group * 16; i++) {
        ws->m[i] = -INFINITY;
        ws->l[i] = 0.0f;
    }
    memset(ws->o, 0, sizeof(float) * (size_t)(group * 16 * head_dim));
    for (int64_t k0 = 0; k0 < w->keys; k0 += KEY_BLOCK) {
        const int64_t span = w->keys - k0 < KEY_BLOCK ? w->keys - k0 : KEY_BLOCK;
        const int blocks = (int)((span + 31) / 32);
        scores(ws, w, 0, steps, k0, blocks);
        for (int64_t g = 0; g < group; g++) {
            for (int r = 0; r < 16; r++) {
                const int64_t visible = r < w->rows ? w->first_position + r + 1 - k0 : 0;
                softmax_row(ws, g, r, (int)(visible < span ? visible : span), blocks, head_dim, scale2);
            }
            if (g + 1 < group)
                scores(ws, w, g + 1, steps, k0, blocks);
            add_values(ws, w, g, head_dim, k0, blocks);
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int r = 0; r < w->rows; r++) {
            const float *o = ws->o + (g * 16 + r) * head_dim;
            const __m512 inv = _mm512_set1_ps(1.0f / ws->l[g * 16 + r]);  /* l >= 1: the max scores 2^0 */
            uint16_t *out = w->out + r * w->out_stride + g * head_dim;
            for (int64_t d = 0; d < head_dim; d += 16)
                _mm256_storeu_si256((__m256i *)(out + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d), inv)));
        }
}
#endif

/* out [T, heads * head_dim] (rows of the prefill chunks only) = causal attention of q [T, heads, head_dim]
 * (row stride q_stride, heads contiguous) over each chunk's context in the cache; chunk c: rows
 * [query_starts[c], + query_lens[c]), context_lens[c] positions, block table row c of block_tables
 * [num_chunks, max_blocks]. Returns 0, or -1 (nothing done) where unsupported; see the top comment. */
int tm_prefill_attention(uint16_t *out, const uint16_t *q, const uint16_t *cache, const int64_t *query_starts,
                         const int64_t *query_lens, const int64_t *context_lens, const int32_t *block_tables,
                         int64_t max_blocks, int64_t num_chunks, int64_t num_blocks, int64_t num_heads,
                         int64_t num_kv_heads, int64_t block_size, int64_t head_dim, int64_t q_stride, float scale) {
#ifdef TM_AMX
    if (head_dim % 32 || head_dim > MAX_HEAD_DIM || block_size % 16 || num_heads % num_kv_heads)
        return -1;
    const paged_kv kv = {cache, num_blocks * num_kv_heads * block_size * head_dim, num_kv_heads, block_size, head_dim};
    const int64_t group = num_heads / num_kv_heads, steps = head_dim / 32, dim_tiles = head_dim / 16;
    const int64_t tiles_per_block = 2 * steps + dim_tiles;  /* per 32 keys and kv head: K^T, then V */
    int64_t *first_tile = malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    first_tile[0] = first_item[0] = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        first_tile[c + 1] = first_tile[c] + (context_lens[c] + 31) / 32 * num_kv_heads * tiles_per_block;
        first_item[c + 1] = first_item[c] + (query_lens[c] + 15) / 16 * num_kv_heads;
    }
    uint16_t *tiles = aligned_alloc(64, (size_t)(first_tile[num_chunks] * 1024 + 64));
    int failed = 0;
    #pragma omp parallel
    {
        tm_configure_tiles();
        scratch *ws = aligned_alloc(64, (sizeof(scratch) + 63) / 64 * 64);
        const size_t q_bytes = (size_t)(group * steps * 1024), o_bytes = (size_t)(group * 16 * head_dim * 4);
        char *heads = aligned_alloc(64, q_bytes + o_bytes + (size_t)(group * 128 + 64) / 64 * 64);
        if (ws && heads) {
            ws->q = (uint16_t *)heads;
            ws->o = (float *)(heads + q_bytes);
            ws->m = (float *)(heads + q_bytes + o_bytes);
            ws->l = ws->m + group * 16;
        }
        if (!ws || !heads || !tiles) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            for (int64_t c = 0; c < num_chunks; c++) {
                const int64_t key_blocks = (context_lens[c] + 31) / 32;
                const int32_t *blocks = block_tables + c * max_blocks;
                #pragma omp for schedule(static)
                for (int64_t i = 0; i < num_kv_heads * key_blocks; i++) {
                    const int64_t h = i / key_blocks, b = i % key_blocks;
                    uint16_t *mine = head_tiles(tiles, first_tile, c, h, key_blocks, tiles_per_block);
                    pack_keys(mine + 2 * b * steps * 512, &kv, blocks, h, 2 * b, context_lens[c]);
                    pack_keys(mine + (2 * b + 1) * steps * 512, &kv, blocks, h, 2 * b + 1, context_lens[c]);
                    pack_values(mine + (2 * key_blocks * steps + b * dim_tiles) * 512, &kv, blocks, h, b, context_lens[c]);
                }
            }
            /* the last query tiles see the most keys: in each chunk they come first (dynamic schedule) */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < first_item[num_chunks]; i++) {
                int64_t c = 0;
                while (first_item[c + 1] <= i) c++;
                const int64_t local = i - first_item[c], tiles_in_chunk = (query_lens[c] + 15) / 16;
                const int64_t h = local % num_kv_heads, tile = tiles_in_chunk - 1 - local / num_kv_heads;
                const int64_t key_blocks = (context_lens[c] + 31) / 32, row0 = 16 * tile;
                const int64_t start = context_lens[c] - query_lens[c];
                const uint16_t *mine = head_tiles(tiles, first_tile, c, h, key_blocks, tiles_per_block);
                const int rows = (int)(query_lens[c] - row0 < 16 ? query_lens[c] - row0 : 16);
                const work_item w = {
                    .q = q + (query_starts[c] + row0) * q_stride + h * group * head_dim,
                    .out = out + (query_starts[c] + row0) * num_heads * head_dim + h * group * head_dim,
                    .q_stride = q_stride, .out_stride = num_heads * head_dim,
                    .key_tiles = mine, .value_tiles = mine + 2 * key_blocks * steps * 512,
                    .first_position = start + row0, .rows = rows, .keys = start + row0 + rows,
                };
                attend(ws, &w, group, head_dim, scale);
            }
        }
        free(heads);
        free(ws);
        _tile_release();
    }
    free(tiles);
    free(first_tile);
    free(first_item);
    return failed ? -1 : 0;
#else
    (void)out; (void)q; (void)cache; (void)query_starts; (void)query_lens; (void)context_lens; (void)block_tables;
    (void)max_blocks; (void)num_chunks; (void)num_blocks; (void)num_heads; (void)num_kv_heads; (void)block_size;
    (void)head_dim; (void)q_stride; (void)scale;
    return -1;
#endif
}
