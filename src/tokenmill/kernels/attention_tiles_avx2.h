/* The AVX2 twins of attention_tiles_avx512.h (included by attention_tiles.c once, after paged_args,
 * query_tile, PV_ROWS and PV_VECTORS): 8 lanes, float32 arithmetic throughout. */
#ifndef TOKENMILL_ATTENTION_TILES_AVX2_H
#define TOKENMILL_ATTENTION_TILES_AVX2_H

#define PAIRED(bf16) 0
#define SCORE_ROWS 3
#define SCORE_KEYS 4

/* fast_exp on 8 lanes, fast_exp16's operations. */
static inline __m256 fast_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693145751953125f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(1.428606765330187045e-06f)));
    __m256 p = _mm256_add_ps(_mm256_set1_ps(0.0083333333333f), _mm256_mul_ps(r, _mm256_set1_ps(0.0013888888889f)));
    p = _mm256_add_ps(_mm256_set1_ps(0.041666666666f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(0.16666666666f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(r, p));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* Transpose 8 rows of 8 floats: afterwards r[i] lane j = old r[j] lane i. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* The AVX-512 transpose_key_bytes on 8 lanes: kt[v][d] = 8 keys' dimension d widened, times each key's
 * scale; keys outside [u0, u1) are zeros. */
static inline __attribute__((always_inline)) void transpose_key_bytes(
    void *kt_buffer, const paged_args *a, const int32_t *table, int64_t kvh, int64_t span_start, int64_t u0, int64_t u1,
    int64_t v0, int64_t v1, const int NV) {
    __m256 *const kt = kt_buffer;
    const int64_t head_dim = 16 * NV, block_size = a->block_size;
    const int fp8 = a->rows == TM_ROWS_FP8;
    for (int64_t v = v0; v < v1; v++) {
        const int64_t key = span_start + 8 * v;
        if (key + 8 <= u0 || key >= u1) {
            for (int64_t d = 0; d < head_dim; d++) kt[v * head_dim + d] = _mm256_setzero_ps();
            continue;
        }
        int32_t lanes[8];
        for (int j = 0; j < 8; j++) lanes[j] = -(int32_t)(key + j >= u0 && key + j < u1);
        const __m256i valid = _mm256_loadu_si256((const __m256i *)lanes);
        const int64_t offset = key % block_size;
        const int8_t *tile = (const int8_t *)a->k_cache
                             + ((int64_t)table[key / block_size] * a->num_kv_heads + kvh) * block_size * a->row_width;
        const __m256 scales = _mm256_mul_ps(_mm256_maskload_ps((const float *)(tile + head_dim * block_size) + offset, valid),
                                            _mm256_set1_ps(q8_unit(fp8)));
        for (int64_t d = 0; d < head_dim; d++)
            kt[v * head_dim + d] = _mm256_and_ps(_mm256_mul_ps(q8_raw8(tile + d * block_size + offset, fp8), scales),
                                                 _mm256_castsi256_ps(valid));
    }
}

/* Keys [span_start + 8 v0, span_start + 8 v1) transposed into kt[v][d], 8 keys' dimension d as float32;
 * keys outside [u0, u1) are zeros. */
static inline __attribute__((always_inline)) void transpose_keys(
    void *kt_buffer, const paged_args *a, const int32_t *table, int64_t kvh, int64_t span_start, int64_t u0, int64_t u1,
    int64_t v0, int64_t v1, const int NV) {
    if (a->rows != TM_ROWS_DTYPE) {
        transpose_key_bytes(kt_buffer, a, table, kvh, span_start, u0, u1, v0, v1, NV);
        return;
    }
    __m256 *const kt = kt_buffer;
    const int64_t head_dim = 16 * NV, block_size = a->block_size;
    for (int64_t v = v0; v < v1; v++) {
        int64_t at[8];
        for (int j = 0; j < 8; j++) {
            const int64_t key = span_start + 8 * v + j;
            at[j] = key >= u0 && key < u1 ? ((int64_t)table[key / block_size] * a->num_kv_heads + kvh) * block_size * head_dim
                                            + (key % block_size) * head_dim : -1;
        }
        for (int64_t h = 0; h < head_dim / 8; h++) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) r[j] = at[j] < 0 ? _mm256_setzero_ps() : load8(a->k_cache, at[j] + 8 * h, a->bf16);
            transpose8(r);
            for (int i = 0; i < 8; i++) kt[v * head_dim + 8 * h + i] = r[i];
        }
    }
}

/* Scores of R <= SCORE_ROWS rows (a constant; float32 q rows) against the key vectors [v0, v1) of kt,
 * SCORE_KEYS at a time: per key, one chain of fused multiply-adds over the dimensions in order, in that
 * key's lane. */
static inline __attribute__((always_inline)) void rows_scores(
    float *const *s, const void *const *q, const int R, const void *kt_buffer, int64_t v0, int64_t v1, float scale,
    int paired, const int NV) {
    (void)paired;
    const __m256 *const kt = kt_buffer;
    const int64_t head_dim = 16 * NV;
    const __m256 scale_v = _mm256_set1_ps(scale);
    for (int64_t v = v0; v < v1; v += SCORE_KEYS) {
        __m256 acc[SCORE_ROWS][SCORE_KEYS];
        for (int r = 0; r < R; r++)
            for (int k = 0; k < SCORE_KEYS; k++) acc[r][k] = _mm256_setzero_ps();
        for (int64_t d = 0; d < head_dim; d++)
            for (int k = 0; k < SCORE_KEYS; k++) {
                const __m256 keys = kt[(v + k) * head_dim + d];
                for (int r = 0; r < R; r++)
                    acc[r][k] = _mm256_fmadd_ps(_mm256_set1_ps(((const float *)q[r])[d]), keys, acc[r][k]);
            }
        for (int r = 0; r < R; r++)
            for (int k = 0; k < SCORE_KEYS; k++) _mm256_storeu_ps(s[r] + 8 * (v + k), _mm256_mul_ps(acc[r][k], scale_v));
    }
}

/* The largest of s[0 .. len). */
static inline float row_max(const float *s, int64_t len) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 8) {
        const __m256i valid = lanes_below8(len - t);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(s + t, valid),
                                                _mm256_castsi256_ps(valid)));
    }
    return reduce_max8(mx);
}

/* s[0 .. len) <- fast_exp8(s - top), 8 at a time from s[0]; returns their total (lane-wise in order, then
 * reduce_add8). */
static inline float row_exponentials(float *s, int64_t len, float top) {
    const __m256 top_v = _mm256_set1_ps(top);
    __m256 sums = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; t += 8) {
        const __m256i valid = lanes_below8(len - t);
        const __m256 e = fast_exp8(_mm256_sub_ps(_mm256_maskload_ps(s + t, valid), top_v));
        _mm256_maskstore_ps(s + t, valid, e);
        sums = _mm256_add_ps(sums, _mm256_and_ps(e, _mm256_castsi256_ps(valid)));  /* + 0 outside: sums stay >= +0 */
    }
    return reduce_add8(sums);
}

/* One key's V row (PV_VECTORS vectors of 8 from vector c0; one-byte rows widened times row_scale, their
 * scale times q8_unit) into the
 * rows' accumulators; `masked`: a row whose range lacks the key keeps its accumulators (a blend), as the
 * AVX-512 twin's masked FMA does. */
static inline __attribute__((always_inline)) void add_value(
    __m256 acc[PV_ROWS][PV_VECTORS], const float *const *e, const int64_t *key0, const int64_t *key1, int R,
    const paged_args *a, int64_t at, float row_scale, int64_t key, int64_t offset, const int masked) {
    __m256 row[PV_VECTORS];
    if (a->rows != TM_ROWS_DTYPE) {
        const __m256 scale = _mm256_set1_ps(row_scale);
        for (int v = 0; v < PV_VECTORS; v++)
            row[v] = _mm256_mul_ps(q8_raw8((const int8_t *)a->v_cache + at + 8 * v, a->rows == TM_ROWS_FP8), scale);
    } else {
        for (int v = 0; v < PV_VECTORS; v++) row[v] = load8(a->v_cache, at + 8 * v, a->bf16);
    }
    for (int r = 0; r < PV_ROWS; r++) {
        if (r >= R)
            break;
        const __m256 p = _mm256_set1_ps(e[r][offset]);
        if (masked) {
            const __m256 mine = _mm256_castsi256_ps(_mm256_set1_epi32(-(int)(key >= key0[r] && key < key1[r])));
            for (int v = 0; v < PV_VECTORS; v++)
                acc[r][v] = _mm256_blendv_ps(acc[r][v], _mm256_fmadd_ps(p, row[v], acc[r][v]), mine);
        } else {
            for (int v = 0; v < PV_VECTORS; v++) acc[r][v] = _mm256_fmadd_ps(p, row[v], acc[r][v]);
        }
    }
}

/* part[r][8 c0 .. 8 (c0 + PV_VECTORS)): the AVX-512 rows_values on 8 lanes. */
static inline __attribute__((always_inline)) void rows_values(
    float *const *part, const float *const *e, const int64_t *key0, const int64_t *key1, int R, const paged_args *a,
    const int32_t *table, int64_t kvh, int64_t span_start, int64_t u0, int64_t u1, int64_t c0) {
    int64_t all0 = key0[0], all1 = key1[0];
    for (int r = 1; r < R; r++) {
        all0 = key0[r] > all0 ? key0[r] : all0;
        all1 = key1[r] < all1 ? key1[r] : all1;
    }
    __m256 acc[PV_ROWS][PV_VECTORS];
    for (int r = 0; r < PV_ROWS; r++)
        for (int v = 0; v < PV_VECTORS; v++) acc[r][v] = _mm256_setzero_ps();
    const int64_t width = a->row_width;
    for (int64_t start = u0, block, end; start < u1; start = end) {
        const int64_t first_row = block_run(table, start, u1, a->block_size, kvh, a->num_kv_heads, width, &block, &end);
        for (int64_t key = start; key < end; key++) {
            const int64_t row = first_row + (key - start) * width, at = row + 8 * c0;
            const float row_scale = value_row_scale(a, row);
            if (key >= all0 && key < all1)
                add_value(acc, e, key0, key1, R, a, at, row_scale, key, key - span_start, 0);
            else
                add_value(acc, e, key0, key1, R, a, at, row_scale, key, key - span_start, 1);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < PV_VECTORS; v++) _mm256_storeu_ps(part[r] + 8 * (c0 + v), acc[r][v]);
}

#endif
