/* Helpers shared by tokenmill's C kernels: bfloat16 <-> float32 as PyTorch converts them, row loads and
 * stores in the storage dtype, and the softmax (its exp). */
#ifndef TOKENMILL_CPU_COMMON_H
#define TOKENMILL_CPU_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, as PyTorch does; NaN stays a quiet NaN. Branch-free, so loops vectorise. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* Element i of a float32 or bfloat16 (`bf16`) array, as float32. */
static inline float load_value(const void *base, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Store v at element i of a float32 or bfloat16 array (rounded to nearest even for bfloat16). */
static inline void store_value(void *base, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = f32_to_bf16(v);
    else
        ((float *)base)[i] = v;
}

/* v as it reads back once stored in the storage dtype. */
static inline float rounded_to_storage(float v, int bf16) {
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

/* IEEE half -> float32, exactly (subnormals included). */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t u;
    if (exponent == 0x1fu) {
        u = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        u = sign;
    } else {  /* subnormal: normalise */
        int shift = 0;
        while (!(mantissa & 0x400u)) { mantissa <<= 1; shift++; }
        u = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Load n contiguous values as float32. */
static inline void load_row(float *dst, const void *base, int64_t offset, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)n * 4);
    }
}

/* Store n float32 values contiguously in the storage dtype. */
static inline void store_row(void *base, int64_t offset, const float *src, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + offset, src, (size_t)n * 4);
    }
}

/* exp for the softmax: Cody-Waite range reduction and a degree-6 polynomial, within 2 ulp of expf
 * on [-87, 88]; written branch-free so the compiler vectorises the loops that call it. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    /* k = round(x / ln 2) by the 1.5 * 2^23 trick: pure arithmetic, so the loops vectorise */
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693145751953125f;
    r = r - k * 1.428606765330187045e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.16666666666f + r * (0.041666666666f
              + r * (0.0083333333333f + r * 0.0013888888889f)))));
    union { int32_t i; float f; } scale = { .i = ((int32_t)k + 127) << 23 };
    return p * scale.f;
}

/* Each of `rows` rows of `len` scores (rows adjacent) replaced by its softmax: the row's max, fast_exp of the
 * differences (their sum taken along), then times the sum's reciprocal. */
static inline void softmax_rows(float *scores, int64_t rows, int64_t len) {
    for (int64_t g = 0; g < rows; g++) {
        float *sg = scores + g * len;
        float mx = -INFINITY, sum = 0.0f;
        #pragma omp simd reduction(max:mx)
        for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; t++) { sg[t] = fast_exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
}

/* softmax_rows with GPT-OSS's attention sinks: row g's denominator also holds exp(sinks[g]), a logit that takes no
 * value (the row's weights then sum to less than 1); sinks NULL: softmax_rows. */
static inline void sink_softmax_rows(float *scores, int64_t rows, int64_t len, const float *sinks) {
    if (!sinks) {
        softmax_rows(scores, rows, len);
        return;
    }
    for (int64_t g = 0; g < rows; g++) {
        float *sg = scores + g * len;
        float mx = sinks[g], sum = 0.0f;
        #pragma omp simd reduction(max:mx)
        for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; t++) { sg[t] = fast_exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.0f / (sum + fast_exp(sinks[g] - mx));
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
}

/* A row's finished online softmax (max m, total *l, unnormalised output o) with GPT-OSS's sink logit `sink` joined:
 * both rescaled to max(m, sink) and exp(sink - that) added to the total, which the caller then divides o by. */
static inline void fold_sink(float m, float *l, float *o, int64_t head_dim, float sink) {
    const float top = sink > m ? sink : m;
    const float keep = fast_exp(m - top);
    *l = *l * keep + fast_exp(sink - top);
    for (int64_t d = 0; d < head_dim; d++) o[d] *= keep;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* Load 16 storage values as float32 lanes. */
static inline __m512 load16(const void *base, int64_t i, int bf16) {
    if (bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

/* fast_exp on 16 lanes, the same operations in the same order, so each lane equals fast_exp. */
static inline __m512 fast_exp16(__m512 x) {
    /* max/min return their second operand for a NaN lane: NaN passes through, as in fast_exp */
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    __m512 k = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693145751953125f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(1.428606765330187045e-06f)));
    __m512 p = _mm512_add_ps(_mm512_set1_ps(0.0083333333333f), _mm512_mul_ps(r, _mm512_set1_ps(0.0013888888889f)));
    p = _mm512_add_ps(_mm512_set1_ps(0.041666666666f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(0.16666666666f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(0.5f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_mul_ps(r, p));
    __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}

/* 2^x in 16 float32 lanes for x in [-126, 126] (clamped there), to about 1e-7 relative: x = n + f with
 * |f| <= 1/2, 2^f by its degree-6 Taylor polynomial in fused multiply-adds, times 2^n. Cheaper than
 * fast_exp16 (fewer, fused operations), which stays where a lane must equal the scalar fast_exp. */
static inline __m512 exp2_16(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(126.0f), _mm512_max_ps(_mm512_set1_ps(-126.0f), x));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.5403530e-4f), f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 16 float32 lanes -> bfloat16 bits, rounded to nearest even as f32_to_bf16 rounds (NaN kept quiet,
 * subnormals kept: the same bits on every level, where AVX512-BF16's conversion flushes subnormals). */
static inline __m256i bf16_round16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(rounded);
}

/* Transpose a 16 x 16 matrix of 32-bit elements held as 16 rows: afterwards r[i] lane j = old r[j] lane i. */
static inline void tm_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int half = 0; half < 16; half += 8)
        for (int i = 0; i < 4; i++) {
            t[half + i] = _mm512_shuffle_i32x4(r[half + i], r[half + i + 4], 0x88);
            t[half + i + 4] = _mm512_shuffle_i32x4(r[half + i], r[half + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

#endif

#endif
