/* The AVX-512 span kernels of attention_tiles.c (included there once, after paged_args, query_tile,
 * PV_ROWS and PV_VECTORS): keys transposed per span, scores as per-lane chains, masked p.V. */
#ifndef TOKENMILL_ATTENTION_TILES_AVX512_H
#define TOKENMILL_ATTENTION_TILES_AVX512_H

/* Whether the scores take bfloat16 dot products of dimension pairs (bfloat16 storage on AVX512-BF16). */
#ifdef __AVX512BF16__
#define PAIRED(bf16) (bf16)
#else
#define PAIRED(bf16) 0
#endif

/* transpose_keys over a one-byte cache: kt[v][d] = the 16 keys' dimension d widened (one vector of bytes:
 * a block's keys are stored transposed), times each key's scale; keys outside [u0, u1) are zeros. The 16
 * keys of a vector lie in one block (block_size a multiple of 16), so a vector with any key in [u0, u1)
 * has its block in the table. */
static inline __attribute__((always_inline)) void transpose_key_bytes(
    void *kt_buffer, const paged_args *a, const int32_t *table, int64_t kvh, int64_t span_start, int64_t u0, int64_t u1,
    int64_t v0, int64_t v1, const int NV) {
    __m512 *const kt = kt_buffer;
    const int64_t head_dim = 16 * NV, block_size = a->block_size;
    const int fp8 = a->rows == TM_ROWS_FP8;
    for (int64_t v = v0; v < v1; v++) {
        const int64_t key = span_start + 16 * v;
        const int64_t lo = u0 > key ? u0 - key : 0, hi = u1 - key < 16 ? u1 - key : 16;
        if (lo >= hi) {
            for (int64_t d = 0; d < head_dim; d++) kt[v * head_dim + d] = _mm512_setzero_ps();
            continue;
        }
        const __mmask16 valid = (__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1));
        const int64_t offset = key % block_size;
        const int8_t *tile = (const int8_t *)a->k_cache
                             + ((int64_t)table[key / block_size] * a->num_kv_heads + kvh) * block_size * a->row_width;
        const __m512 scales = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, (const float *)(tile + head_dim * block_size) + offset),
                                            _mm512_set1_ps(q8_unit(fp8)));
        for (int64_t d = 0; d < head_dim; d++)
            kt[v * head_dim + d] = _mm512_maskz_mul_ps(valid, q8_raw16(tile + d * block_size + offset, fp8), scales);
    }
}

/* Keys [span_start + 16 v0, span_start + 16 v1) of the span transposed, 16 keys to a vector, into kt:
 * paired, kt[v][p] holds the 16 keys' dimension pair p (bfloat16 k[2p], k[2p + 1] in each 32-bit lane);
 * else kt[v][d] their dimension d as float32. Keys outside [u0, u1) are zeros. */
static inline __attribute__((always_inline)) void transpose_keys(
    void *kt_buffer, const paged_args *a, const int32_t *table, int64_t kvh, int64_t span_start, int64_t u0, int64_t u1,
    int64_t v0, int64_t v1, const int NV) {
    if (a->rows != TM_ROWS_DTYPE) {
        transpose_key_bytes(kt_buffer, a, table, kvh, span_start, u0, u1, v0, v1, NV);
        return;
    }
    __m512i *const kt = kt_buffer;
    const int64_t head_dim = 16 * NV, block_size = a->block_size;
    const int paired = a->paired, columns = paired ? NV / 2 : NV, lanes = 16 * columns;
    for (int64_t v = v0; v < v1; v++) {
        int64_t at[16];
        for (int j = 0; j < 16; j++) {
            const int64_t key = span_start + 16 * v + j;
            at[j] = key >= u0 && key < u1 ? ((int64_t)table[key / block_size] * a->num_kv_heads + kvh) * block_size * head_dim
                                            + (key % block_size) * head_dim : -1;
        }
        for (int h = 0; h < columns; h++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++)
                r[j] = at[j] < 0 ? _mm512_setzero_si512()
                       : paired ? _mm512_loadu_si512((const uint16_t *)a->k_cache + at[j] + 32 * h)
                                : _mm512_castps_si512(load16(a->k_cache, at[j] + 16 * h, a->bf16));
            tm_transpose16(r);
            for (int i = 0; i < 16; i++) kt[v * lanes + 16 * h + i] = r[i];
        }
    }
}

/* Scores of R <= SCORE_ROWS rows (a constant; q[r]: paired, the row's bfloat16 q; else its float32 q) against the
 * key vectors [v0, v1) of kt (SCORE_KEYS vectors at a time, rounded up: kt has room), times scale, into
 * s[r][16 v ..]: per key, one chain over the dimensions (pairs) in order, in that key's lane. */
#define SCORE_ROWS 4
#define SCORE_KEYS 4
static inline __attribute__((always_inline)) void rows_scores(
    float *const *s, const void *const *q, const int R, const void *kt_buffer, int64_t v0, int64_t v1, float scale,
    int paired, const int NV) {
    const __m512i *const kt = kt_buffer;
    const int64_t head_dim = 16 * NV, lanes = paired ? 8 * NV : 16 * NV;
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t v = v0; v < v1; v += SCORE_KEYS) {
        __m512 acc[SCORE_ROWS][SCORE_KEYS];
        for (int r = 0; r < R; r++)
            for (int k = 0; k < SCORE_KEYS; k++) acc[r][k] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
        if (paired) {
            for (int64_t p = 0; p < head_dim / 2; p++)
                for (int k = 0; k < SCORE_KEYS; k++) {
                    const __m512bh keys = (__m512bh)_mm512_load_si512(kt + (v + k) * lanes + p);
                    for (int r = 0; r < R; r++)
                        acc[r][k] = _mm512_dpbf16_ps(acc[r][k], keys,
                                                     (__m512bh)_mm512_set1_epi32(((const int32_t *)q[r])[p]));
                }
        } else
#endif
        for (int64_t d = 0; d < head_dim; d++)
            for (int k = 0; k < SCORE_KEYS; k++) {
                const __m512 keys = _mm512_castsi512_ps(_mm512_load_si512(kt + (v + k) * lanes + d));
                for (int r = 0; r < R; r++)
                    acc[r][k] = _mm512_fmadd_ps(_mm512_set1_ps(((const float *)q[r])[d]), keys, acc[r][k]);
            }
        for (int r = 0; r < R; r++)
            for (int k = 0; k < SCORE_KEYS; k++) _mm512_storeu_ps(s[r] + 16 * (v + k), _mm512_mul_ps(acc[r][k], scale_v));
    }
}

/* The largest of s[0 .. len). */
static inline float row_max(const float *s, int64_t len) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 valid = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        mx = _mm512_mask_max_ps(mx, valid, mx, _mm512_maskz_loadu_ps(valid, s + t));
    }
    return _mm512_reduce_max_ps(mx);
}

/* s[0 .. len) <- fast_exp16(s - top), 16 at a time from s[0]; returns their total (lane-wise in order,
 * then _mm512_reduce_add_ps). */
static inline float row_exponentials(float *s, int64_t len, float top) {
    const __m512 top_v = _mm512_set1_ps(top);
    __m512 sums = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 valid = len - t >= 16 ? 0xFFFF : (__mmask16)((1u << (len - t)) - 1);
        const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, s + t), top_v));
        _mm512_mask_storeu_ps(s + t, valid, e);
        sums = _mm512_mask_add_ps(sums, valid, sums, e);
    }
    return _mm512_reduce_add_ps(sums);
}

/* One key's V row (PV_VECTORS vectors from column vector c0: at element `at` of the value plane, or at byte
 * `at` of one-byte rows, whose scale times q8_unit is row_scale) into the R <= PV_ROWS rows' accumulators:
 * acc[r] += e[r][key] * v, or, `masked`, only for the rows whose range [key0[r], key1[r]) holds the key (a
 * masked fused multiply-add leaves the others exactly as they were). */
static inline __attribute__((always_inline)) void add_value(
    __m512 acc[PV_ROWS][PV_VECTORS], const float *const *e, const int64_t *key0, const int64_t *key1, int R,
    const paged_args *a, int64_t at, float row_scale, int64_t key, int64_t offset, const int masked) {
    __m512 row[PV_VECTORS];
    if (a->rows != TM_ROWS_DTYPE) {
        const __m512 scale = _mm512_set1_ps(row_scale);
        for (int v = 0; v < PV_VECTORS; v++)
            row[v] = _mm512_mul_ps(q8_raw16((const int8_t *)a->v_cache + at + 16 * v, a->rows == TM_ROWS_FP8), scale);
    } else {
        for (int v = 0; v < PV_VECTORS; v++) row[v] = load16(a->v_cache, at + 16 * v, a->bf16);
    }
    for (int r = 0; r < PV_ROWS; r++) {
        if (r >= R)
            break;
        const __m512 p = _mm512_set1_ps(e[r][offset]);
        if (masked) {
            const __mmask16 mine = (__mmask16)(-(int)(key >= key0[r] && key < key1[r]));
            for (int v = 0; v < PV_VECTORS; v++) acc[r][v] = _mm512_mask3_fmadd_ps(p, row[v], acc[r][v], mine);
        } else {
            for (int v = 0; v < PV_VECTORS; v++) acc[r][v] = _mm512_fmadd_ps(p, row[v], acc[r][v]);
        }
    }
}

/* part[r][16 c0 .. 16 (c0 + PV_VECTORS)) = the sum over row r's keys [key0[r], key1[r]) in order of
 * e[r][key - span_start] * v[key], for the R <= PV_ROWS rows given; the V rows of keys [u0, u1) are read
 * once for all of them, and masks are only taken outside the keys every row has. */
static inline __attribute__((always_inline)) void rows_values(
    float *const *part, const float *const *e, const int64_t *key0, const int64_t *key1, int R, const paged_args *a,
    const int32_t *table, int64_t kvh, int64_t span_start, int64_t u0, int64_t u1, int64_t c0) {
    int64_t all0 = key0[0], all1 = key1[0];  /* the keys every row has */
    for (int r = 1; r < R; r++) {
        all0 = key0[r] > all0 ? key0[r] : all0;
        all1 = key1[r] < all1 ? key1[r] : all1;
    }
    __m512 acc[PV_ROWS][PV_VECTORS];
    for (int r = 0; r < PV_ROWS; r++)
        for (int v = 0; v < PV_VECTORS; v++) acc[r][v] = _mm512_setzero_ps();
    const int64_t width = a->row_width;
    for (int64_t start = u0, block, end; start < u1; start = end) {
        const int64_t first_row = block_run(table, start, u1, a->block_size, kvh, a->num_kv_heads, width, &block, &end);
        for (int64_t key = start; key < end; key++) {
            const int64_t row = first_row + (key - start) * width, at = row + 16 * c0;
            const float row_scale = value_row_scale(a, row);
            if (key >= all0 && key < all1)
                add_value(acc, e, key0, key1, R, a, at, row_scale, key, key - span_start, 0);
            else
                add_value(acc, e, key0, key1, R, a, at, row_scale, key, key - span_start, 1);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < PV_VECTORS; v++) _mm512_storeu_ps(part[r] + 16 * (c0 + v), acc[r][v]);
}

#endif
