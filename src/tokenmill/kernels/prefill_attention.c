/* Causal attention of a step's chunks (prefills, decodes, verification rows) on AMX tiles: bfloat16 Q, K,
 * V; float32 scores, softmax and sums.
 *
 * Chunk c owns query rows [query_start, query_start + query_len) of q: the last query_len of its
 * context_len positions, whose K/V this step already wrote into the paged cache
 * [2, num_blocks, kv_heads, block_size, head_dim]. Row i (position context_len - query_len + i)
 * attends to keys 0 .. its position.
 *
 * Everything runs transposed, one query row per lane, so that the softmax bookkeeping (running max, sum,
 * rescaling) is lane-wise with no horizontal reduction per row:
 *   S^T = K Q^T: the A operand is 16 keys x 32 dims read straight from the cache (a block's keys are
 *       rows head_dim apart; block_size is a multiple of 16), the B operand Q^T is built once per work item;
 *   P^T = 2^(scale log2(e) S^T - m), a key per 16-lane vector, as two bfloat16 parts, its rounding and
 *       what that rounding left (together about 16 bits, as exact as the exp), each in B tiles (two keys'
 *       vectors interleaved per tile row);
 *   O^T += V^T P^T, V^T in A tiles (16 dims x 32 keys, keys past the context zero), a product for each
 *       part, the float32 O^T [head_dim][16 lanes] rescaled lane-wise by 2^(m_old - m_new).
 * A lane is one (query, query head) of a chunk and kv head; it sees keys 0 .. its position. A work item
 * (a chunk, a kv head, up to 16 lane sets of 16) runs over the keys its last lane sees, KEY_BLOCK at a time
 * from key 0, each block for all its sets (the block's tiles stay in L1). A chunk of over 16 queries is cut
 * into tiles of 16 queries, a set per query head, its V^T packed once for all of them; a smaller chunk (a
 * decode, a verification, a short chunk) is one item per kv head whose lanes are its queries times the
 * group's heads, its V^T packed a key block at a time as it goes; where that would leave threads idle
 * (a lone decode of few kv heads), its heads are split over as many items as there are idle threads,
 * sharing V^T packed beforehand. A lane's output is O / l, rounded to bfloat16.
 *
 * Invariant: a lane's arithmetic does not depend on the other lanes, sets or items. Its scores, maxima,
 * probabilities and sums are its own column of every tile; the key blocks are the same ones (from key
 * 0) in every item; the keys past the lane's position that its item also covers are masked: they add
 * probability 0 and exact zeros to its sums (their V rows are finite, or zero past the context), and a
 * block it sees nothing of rescales by exactly 1. So each query's bits are the same whether it comes in a
 * 2,048-token prompt, a chunk of any size, after a prefix-cache hit, as a verification row or alone.
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

#define KEY_BLOCK 256  /* keys per softmax step: 8 x 32 */
#define MAX_HEAD_DIM 256

typedef struct {
    const uint16_t *cache;
    int64_t values_offset;  /* elements from the key plane to the value plane (0: a key-only cache) */
    int64_t num_kv_heads, block_size, head_dim;
} paged_kv;

/* Key `key` of kv head h (of a sequence with block table `blocks`): its K row, or its V row when `v`. */
static inline const uint16_t *cache_row(const paged_kv *kv, const int32_t *blocks, int64_t h, int64_t key, int v) {
    const int64_t block = blocks[key / kv->block_size], offset = key % kv->block_size;
    return kv->cache + (v ? kv->values_offset : 0) + ((block * kv->num_kv_heads + h) * kv->block_size + offset) * kv->head_dim;
}

/* Bfloat16 element indices that interleave the low and high 16 elements of a vector: 32-bit lane i becomes
 * (low[i], high[i]). */
static inline __m512i pair_interleave(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                            23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}

/* The V^T tiles of keys [32 b, 32 b + 32), one per 16 dims: tile[d][key] = V[32 b + key][16 t + d] (zero
 * past the context). Two keys' rows interleave into 16 pairs, which one 16 x 16 transpose of pairs puts
 * in tile rows. */
static void pack_values(uint16_t *tiles, const paged_kv *kv, const int32_t *blocks, int64_t h, int64_t b, int64_t context) {
    const int64_t dim_tiles = kv->head_dim / 16;
    const uint16_t *rows[32];
    for (int key = 0; key < 32; key++) rows[key] = 32 * b + key < context ? cache_row(kv, blocks, h, 32 * b + key, 1) : NULL;
    const __m512i interleave = pair_interleave();
    for (int64_t t = 0; t < dim_tiles; t++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) {
            const __m256i even = rows[2 * j] ? _mm256_loadu_si256((const __m256i *)(rows[2 * j] + 16 * t)) : _mm256_setzero_si256();
            const __m256i odd = rows[2 * j + 1] ? _mm256_loadu_si256((const __m256i *)(rows[2 * j + 1] + 16 * t)) : _mm256_setzero_si256();
            r[j] = _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1));
        }
        tm_transpose16(r);
        for (int d = 0; d < 16; d++) _mm512_store_si512((__m512i *)(tiles + t * 512 + d * 32), r[d]);
    }
}

/* Where chunk c's kv head h keeps its V^T tiles in the step's buffer: [32-key block][dim tile]. */
static inline uint16_t *head_tiles(uint16_t *tiles, const int64_t *first_tile, int64_t c, int64_t h,
                                   int64_t key_blocks, int64_t dim_tiles) {
    return tiles + (first_tile[c] + h * key_blocks * dim_tiles) * 512;
}

/* One set of up to 16 lanes of an item: lane j is the query head row q[j] (head_dim values), written to
 * out[j], at position[j]. */
typedef struct {
    const uint16_t *q[16];
    uint16_t *out[16];
    int32_t position[16];
    int lanes;
} lane_set;

/* One thread's scratch; q, o, m and l hold every set of the item (set g at g * their size). */
typedef struct {
    float s[KEY_BLOCK][16];                           /* one set's S^T of a key block: a key per row */
    uint16_t p[KEY_BLOCK / 32][16 * 32];              /* B tiles of its P^T, rounded to bfloat16 ... */
    uint16_t p_rest[KEY_BLOCK / 32][16 * 32];         /* ... and of what that rounding left, P^T - p */
    float pv[64][16];                                 /* V^T P^T of 4 dim tiles */
    uint16_t vt[KEY_BLOCK / 32 * MAX_HEAD_DIM / 16 * 512];  /* [32 keys][dim tile] V^T tiles of a key block, packed as it goes */
    uint16_t *q;                                      /* [set][dim step] B tiles of Q^T */
    float *o;                                         /* [set][head_dim][16] running O^T */
    float *m, *l;                                     /* [set][16] running max and sum, one lane per row */
    lane_set *sets;                                   /* [max sets] */
} scratch;

/* The work item's geometry. */
typedef struct {
    const paged_kv *kv;
    const int32_t *blocks;      /* the chunk's block table */
    int64_t kv_head, context;   /* the chunk's context length */
    const uint16_t *value_tiles;  /* the chunk and kv head's V^T tiles ([32-key block][dim tile]), or NULL */
    int sets;                   /* lane sets, in the scratch */
    int64_t keys;               /* keys its last lane sees */
} work_item;

/* 2^x in 16 lanes for the probabilities, x <= 0 (a lane above is masked out after): x = n + f with
 * |f| <= 1/2, 2^f by a degree-4 polynomial fitted for relative error (2.7e-6, about what the probabilities'
 * two bfloat16 parts hold), times 2^n, which goes to 0 without a clamp. */
static inline __m512 exp2_probability(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.00956051983f), f, _mm512_set1_ps(0.0559171228f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240249817f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693121958f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999919f));
    return _mm512_scalef_ps(p, n);
}

/* S^T of head g for keys [k0, k0 + 16 * groups) -> ws->s. */
static void scores(scratch *ws, const work_item *w, int64_t g, int64_t steps, int64_t k0, int groups) {
    const int64_t stride = w->kv->head_dim * 2;
    for (int i = 0; i < groups; i += 2) {
        const uint16_t *k_a = cache_row(w->kv, w->blocks, w->kv_head, k0 + 16 * i, 0);
        const uint16_t *k_b = i + 1 < groups ? cache_row(w->kv, w->blocks, w->kv_head, k0 + 16 * (i + 1), 0) : NULL;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < steps; s++) {
            _tile_loadd(6, ws->q + (g * steps + s) * 512, 64);
            _tile_loadd(4, k_a + 32 * s, stride);
            _tile_dpbf16ps(0, 4, 6);
            if (k_b) {
                _tile_loadd(5, k_b + 32 * s, stride);
                _tile_dpbf16ps(1, 5, 6);
            }
        }
        _tile_stored(0, ws->s[16 * i], 64);
        if (k_b)
            _tile_stored(1, ws->s[16 * (i + 1)], 64);
    }
}

/* 16 bfloat16 values widened to float32 (exactly). */
static inline __m512 widen_bf16(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* Softmax step of head g over the block's `span` keys from k0, in base 2 (scale2 = scale * log2(e), so
 * that 2^(scale2 s) = e^(scale s)), lane j being row j: key k0 + i counts for the lanes whose position
 * is at least it. Updates m and l, rescales O^T and writes P^T (zero past the span) into the P tiles. */
static void softmax_block(scratch *ws, const work_item *w, int64_t g, int64_t k0, int span, int64_t head_dim,
                          float scale2) {
    const lane_set *set = ws->sets + g;
    const __mmask16 rows = (__mmask16)((1u << set->lanes) - 1);
    const __m512i positions = _mm512_maskz_loadu_epi32(rows, set->position);
    /* keys before this one are seen by every lane: no mask to build */
    const int64_t unmasked = _mm512_mask_reduce_min_epi32(rows, positions) + 1 - k0;
    float *m = ws->m + g * 16, *l = ws->l + g * 16, *o = ws->o + g * head_dim * 16;
#define LIVE(key) ((key) < unmasked ? rows : _mm512_mask_cmpge_epi32_mask(rows, positions, _mm512_set1_epi32((int)(k0 + (key)))))
    /* four independent chains in registers: one max per key would wait on the previous one's latency */
    __m512 tops[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                      _mm512_set1_ps(-INFINITY)};
    int i = 0;
    for (; i + 4 <= span; i += 4) {
        tops[0] = _mm512_mask_max_ps(tops[0], LIVE(i), tops[0], _mm512_load_ps(ws->s[i]));
        tops[1] = _mm512_mask_max_ps(tops[1], LIVE(i + 1), tops[1], _mm512_load_ps(ws->s[i + 1]));
        tops[2] = _mm512_mask_max_ps(tops[2], LIVE(i + 2), tops[2], _mm512_load_ps(ws->s[i + 2]));
        tops[3] = _mm512_mask_max_ps(tops[3], LIVE(i + 3), tops[3], _mm512_load_ps(ws->s[i + 3]));
    }
    for (; i < span; i++) tops[0] = _mm512_mask_max_ps(tops[0], LIVE(i), tops[0], _mm512_load_ps(ws->s[i]));
    const __m512 top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
    const __m512 m_old = _mm512_load_ps(m);
    /* every live row sees key 0 in the first block, so m_new is finite from there on */
    const __m512 m_new = _mm512_max_ps(m_old, _mm512_mul_ps(top, _mm512_set1_ps(scale2)));
    const __m512 neg_m = _mm512_sub_ps(_mm512_setzero_ps(), m_new);
    const __m512 scale = _mm512_set1_ps(scale2);
    const __m512i interleave = pair_interleave();
    __m512 sums[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int padded = (span + 31) / 32 * 32;
    for (i = 0; i < padded; i += 2) {
        __m512 p[2];
        for (int e = 0; e < 2; e++) {
            const int key = i + e;
            if (key >= span) {
                p[e] = _mm512_setzero_ps();
                continue;
            }
            p[e] = _mm512_maskz_mov_ps(LIVE(key), exp2_probability(_mm512_fmadd_ps(_mm512_load_ps(ws->s[key]), scale, neg_m)));
            sums[e] = _mm512_add_ps(sums[e], p[e]);
        }
        const __m512i high = (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]);
        const __m512 rest0 = _mm512_sub_ps(p[0], widen_bf16(_mm512_castsi512_si256(high)));
        const __m512 rest1 = _mm512_sub_ps(p[1], widen_bf16(_mm512_extracti64x4_epi64(high, 1)));
        const __m512i low = (__m512i)_mm512_cvtne2ps_pbh(rest1, rest0);
        _mm512_store_si512((__m512i *)(ws->p[i / 32] + (i % 32) / 2 * 32), _mm512_permutexvar_epi16(interleave, high));
        _mm512_store_si512((__m512i *)(ws->p_rest[i / 32] + (i % 32) / 2 * 32), _mm512_permutexvar_epi16(interleave, low));
    }
#undef LIVE
    /* 2^-inf would be clamped to 2^-126, not 0: a row's first block has nothing to rescale anyway */
    const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                             exp2_16(_mm512_sub_ps(m_old, m_new)));
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), alpha, _mm512_add_ps(sums[0], sums[1])));
    _mm512_store_ps(m, m_new);
    for (int64_t d = 0; d < head_dim; d++)
        _mm512_store_ps(o + d * 16, _mm512_mul_ps(_mm512_load_ps(o + d * 16), alpha));
}

/* Head g's O^T += V^T P^T for the block's keys [k0, k0 + 32 * blocks). */
static void add_values(scratch *ws, const work_item *w, int64_t g, int64_t head_dim, int64_t k0, int blocks) {
    const int64_t dim_tiles = head_dim / 16;
    for (int64_t t0 = 0; t0 < dim_tiles; t0 += 4) {
        const int n = dim_tiles - t0 < 4 ? (int)(dim_tiles - t0) : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int b = 0; b < blocks; b++) {
            const uint16_t *v = (w->value_tiles ? w->value_tiles + (k0 / 32 + b) * dim_tiles * 512 : ws->vt + b * dim_tiles * 512)
                                + t0 * 512;
            _tile_loadd(6, ws->p[b], 64);
            /* the tile numbers must be constants: one load and product per accumulator; then the same
             * products with what the probabilities' rounding left, the V tiles still loaded taken first */
            _tile_loadd(4, v, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (n > 1) {
                _tile_loadd(5, v + 512, 64);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (n > 2) {
                _tile_loadd(7, v + 1024, 64);
                _tile_dpbf16ps(2, 7, 6);
            }
            if (n > 3) {
                _tile_loadd(4, v + 1536, 64);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_loadd(6, ws->p_rest[b], 64);
            if (n > 3)
                _tile_dpbf16ps(3, 4, 6);
            if (n > 2)
                _tile_dpbf16ps(2, 7, 6);
            if (n > 1)
                _tile_dpbf16ps(1, 5, 6);
            if (n > 3)
                _tile_loadd(4, v, 64);
            _tile_dpbf16ps(0, 4, 6);
        }
        _tile_stored(0, ws->pv[0], 64);
        _tile_stored(1, ws->pv[16], 64);
        _tile_stored(2, ws->pv[32], 64);
        _tile_stored(3, ws->pv[48], 64);
        float *o = ws->o + (g * head_dim + 16 * t0) * 16;
        for (int d = 0; d < 16 * n; d++)
            _mm512_store_ps(o + d * 16, _mm512_add_ps(_mm512_load_ps(o + d * 16), _mm512_load_ps(ws->pv[d])));
    }
}

/* The item's lane sets. Key blocks are the outer loop, so that a block's K/V tiles stay in L1 for all
 * the sets; set g + 1's scores are computed between set g's softmax and its P V, which gives the stored
 * probabilities time to reach L1 before the tile loads read them (tile loads do not take forwarded
 * stores). */
static void attend(scratch *ws, const work_item *w, int64_t head_dim, float scale) {
    const int64_t steps = head_dim / 32;
    const float scale2 = scale * 1.44269504088896341f;
    const int sets = w->sets;
    for (int g = 0; g < sets; g++)
        for (int64_t s = 0; s < steps; s++) {
            const uint16_t *rows[16];
            for (int j = 0; j < 16; j++) rows[j] = j < ws->sets[g].lanes ? ws->sets[g].q[j] + 32 * s : NULL;
            tm_rows_to_b_tile(ws->q + (g * steps + s) * 512, rows);
        }
    for (int64_t i = 0; i < sets * 16; i++) {
        ws->m[i] = -INFINITY;
        ws->l[i] = 0.0f;
    }
    memset(ws->o, 0, sizeof(float) * (size_t)(sets * head_dim * 16));
    for (int64_t k0 = 0; k0 < w->keys; k0 += KEY_BLOCK) {
        const int span = (int)(w->keys - k0 < KEY_BLOCK ? w->keys - k0 : KEY_BLOCK);
        const int groups = (span + 15) / 16, blocks = (span + 31) / 32;
        scores(ws, w, 0, steps, k0, groups);
        if (!w->value_tiles)
            for (int b = 0; b < blocks; b++)
                pack_values(ws->vt + b * (head_dim / 16) * 512, w->kv, w->blocks, w->kv_head, k0 / 32 + b, w->context);
        for (int g = 0; g < sets; g++) {
            softmax_block(ws, w, g, k0, span, head_dim, scale2);
            if (g + 1 < sets)
                scores(ws, w, g + 1, steps, k0, groups);
            add_values(ws, w, g, head_dim, k0, blocks);
        }
    }
    for (int g = 0; g < sets; g++) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_load_ps(ws->l + g * 16));  /* l >= 1: the max scores 2^0 */
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
            __m512i dims[16];  /* dim d0 + i, a lane per query row, then lane r's 16 dims */
            for (int i = 0; i < 16; i++)
                dims[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_load_ps(ws->o + (g * head_dim + d0 + i) * 16), inv));
            tm_transpose16(dims);
            for (int r = 0; r < ws->sets[g].lanes; r++)
                _mm256_storeu_si256((__m256i *)(ws->sets[g].out[r] + d0),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(dims[r])));
        }
    }
}

/* Chunks of more queries than this are cut into tiles of 16 queries; smaller ones are one item each per
 * kv head, a lane per (query, query head). */
#define SMALL_CHUNK 16

/* A chunk's items per kv head: its query tiles, or for a small chunk `parts` shares of its heads. */
static inline int64_t chunk_items(int64_t query_len, int64_t parts) {
    return query_len <= SMALL_CHUNK ? parts : (query_len + 15) / 16;
}

/* Whether a chunk's V^T is packed before its items run, for all of them to share: a chunk of tiles, or a
 * small chunk split into parts; a single small item packs its own as it goes. */
static inline int shares_values(int64_t query_len, int64_t parts) {
    return query_len > SMALL_CHUNK || parts > 1;
}

/* The lane sets of an item of a chunk for kv head h into ws->sets; returns their number. A small chunk's
 * item (row0 0, all its rows) takes the group's heads [g0, g1); a tile, every head of the group. */
static int chunk_lanes(scratch *ws, uint16_t *out, const uint16_t *q, int64_t q_stride, int64_t row0, int64_t rows,
                       int64_t start, int64_t h, int64_t group, int64_t g0, int64_t g1, int64_t num_heads,
                       int64_t head_dim, int small) {
    int sets = 0;
    if (small) {  /* lane (i, g) = query i, head g0 + g, in that order */
        const int64_t heads = g1 - g0;
        for (int64_t lane = 0; lane < rows * heads; lane++) {
            lane_set *set = ws->sets + lane / 16;
            const int64_t i = lane / heads, g = g0 + lane % heads, j = lane % 16, head = h * group + g;
            set->q[j] = q + (row0 + i) * q_stride + head * head_dim;
            set->out[j] = out + ((row0 + i) * num_heads + head) * head_dim;
            set->position[j] = (int32_t)(start + row0 + i);
            set->lanes = (int)j + 1;
            sets = (int)(lane / 16) + 1;
        }
        return sets;
    }
    for (int64_t g = 0; g < group; g++) {  /* set g = head g of the tile's queries */
        lane_set *set = ws->sets + g;
        const int64_t head = h * group + g;
        for (int64_t i = 0; i < rows; i++) {
            set->q[i] = q + (row0 + i) * q_stride + head * head_dim;
            set->out[i] = out + ((row0 + i) * num_heads + head) * head_dim;
            set->position[i] = (int32_t)(start + row0 + i);
        }
        set->lanes = (int)rows;
    }
    return (int)group;
}
#endif

/* out [T, heads * head_dim] (rows of the prefill chunks only) = causal attention of q [T, heads, head_dim]
 * (row stride q_stride, heads contiguous) over each chunk's context in the cache; chunk c: rows
 * [query_starts[c], + query_lens[c]), context_lens[c] positions, block table row c of block_tables
 * [num_chunks, max_blocks]. Returns 0, or -1 (nothing done) where unsupported; see the top comment. */
int tm_prefill_attention(uint16_t *out, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *query_starts, const int64_t *query_lens, const int64_t *context_lens,
                         const int32_t *block_tables, int64_t max_blocks, int64_t num_chunks, int64_t num_heads,
                         int64_t num_kv_heads, int64_t block_size, int64_t head_dim, int64_t q_stride, float scale) {
#ifdef TM_AMX
    if (head_dim % 32 || head_dim > MAX_HEAD_DIM || block_size % 16 || num_heads % num_kv_heads)
        return -1;
    const paged_kv kv = {k_cache, v_cache - k_cache, num_kv_heads, block_size, head_dim};
    const int64_t group = num_heads / num_kv_heads, steps = head_dim / 32, dim_tiles = head_dim / 16;
    int64_t *first_tile = malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    if (!first_tile || !first_item) {
        free(first_tile);
        free(first_item);
        return -1;
    }
    /* a small chunk's lanes are one item per kv head, or, where that leaves threads idle (a lone decode of
     * few kv heads), `parts` items of a share of its heads each: the same lanes, so the same arithmetic */
    int64_t items = 0;
    for (int64_t c = 0; c < num_chunks; c++) items += chunk_items(query_lens[c], 1) * num_kv_heads;
    const int64_t threads = omp_get_max_threads(), wanted = items < threads ? (threads + items - 1) / items : 1;
    const int64_t parts = wanted < group ? wanted : group;
    first_tile[0] = first_item[0] = 0;
    for (int64_t c = 0; c < num_chunks; c++) {
        const int64_t key_blocks = shares_values(query_lens[c], parts) ? (context_lens[c] + 31) / 32 : 0;
        first_tile[c + 1] = first_tile[c] + key_blocks * num_kv_heads * dim_tiles;
        first_item[c + 1] = first_item[c] + chunk_items(query_lens[c], parts) * num_kv_heads;
    }
    /* a small chunk's lanes fill at most SMALL_CHUNK * group / 16 sets, a tile's group sets */
    const int64_t max_sets = group > (SMALL_CHUNK * group + 15) / 16 ? group : (SMALL_CHUNK * group + 15) / 16;
    uint16_t *tiles = aligned_alloc(64, (size_t)(first_tile[num_chunks] * 1024 + 64));
    int failed = 0;
    #pragma omp parallel
    {
        tm_configure_tiles();
        scratch *ws = aligned_alloc(64, (sizeof(scratch) + 63) / 64 * 64);
        const size_t q_bytes = (size_t)(max_sets * steps * 1024), o_bytes = (size_t)(max_sets * 16 * head_dim * 4);
        const size_t ml_bytes = (size_t)(max_sets * 128 + 63) / 64 * 64;
        char *heads = aligned_alloc(64, q_bytes + o_bytes + ml_bytes + (size_t)(max_sets * sizeof(lane_set) + 63) / 64 * 64);
        if (ws && heads) {
            ws->q = (uint16_t *)heads;
            ws->o = (float *)(heads + q_bytes);
            ws->m = (float *)(heads + q_bytes + o_bytes);
            ws->l = ws->m + max_sets * 16;
            ws->sets = (lane_set *)(heads + q_bytes + o_bytes + ml_bytes);
        }
        if (!ws || !heads || !tiles) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        if (!failed) {
            for (int64_t c = 0; c < num_chunks; c++) {
                if (!shares_values(query_lens[c], parts))
                    continue;
                const int64_t key_blocks = (context_lens[c] + 31) / 32;
                const int32_t *blocks = block_tables + c * max_blocks;
                #pragma omp for schedule(static)
                for (int64_t i = 0; i < num_kv_heads * key_blocks; i++) {
                    const int64_t h = i / key_blocks, b = i % key_blocks;
                    pack_values(head_tiles(tiles, first_tile, c, h, key_blocks, dim_tiles) + b * dim_tiles * 512, &kv, blocks,
                                h, b, context_lens[c]);
                }
            }
            /* the last query tiles see the most keys: in each chunk they come first (dynamic schedule) */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < first_item[num_chunks]; i++) {
                int64_t c = 0;
                while (first_item[c + 1] <= i) c++;
                const int small = query_lens[c] <= SMALL_CHUNK;
                const int64_t local = i - first_item[c], h = local % num_kv_heads;
                const int64_t tile = small ? 0 : chunk_items(query_lens[c], parts) - 1 - local / num_kv_heads;
                const int64_t part = small ? local / num_kv_heads : 0;
                const int64_t key_blocks = (context_lens[c] + 31) / 32, row0 = 16 * tile;
                const int64_t start = context_lens[c] - query_lens[c];
                const int64_t rows = small ? query_lens[c] : (query_lens[c] - row0 < 16 ? query_lens[c] - row0 : 16);
                const work_item w = {
                    .kv = &kv, .blocks = block_tables + c * max_blocks, .kv_head = h, .context = context_lens[c],
                    .value_tiles = shares_values(query_lens[c], parts) ? head_tiles(tiles, first_tile, c, h, key_blocks, dim_tiles)
                                                                       : NULL,
                    .sets = chunk_lanes(ws, out + query_starts[c] * num_heads * head_dim, q + query_starts[c] * q_stride,
                                        q_stride, row0, rows, start, h, group, small ? part * group / parts : 0,
                                        small ? (part + 1) * group / parts : group, num_heads, head_dim, small),
                    .keys = start + row0 + rows,
                };
                if (w.sets)
                    attend(ws, &w, head_dim, scale);
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
    (void)out; (void)q; (void)k_cache; (void)v_cache; (void)query_starts; (void)query_lens; (void)context_lens;
    (void)block_tables; (void)max_blocks; (void)num_chunks; (void)num_heads; (void)num_kv_heads; (void)block_size;
    (void)head_dim; (void)q_stride; (void)scale;
    return -1;
#endif
}
