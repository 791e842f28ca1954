/* 8-lane (AVX2 + FMA) twins of cpu_common.h's 16-lane helpers, for the avx2 level and for AVX-512
 * machines' code that has no 512-bit form of its own. Each helper does per lane what its scalar or
 * 16-lane counterpart does, in the same operations, unless its comment says otherwise. */
#ifndef TOKENMILL_CPU_AVX2_H
#define TOKENMILL_CPU_AVX2_H

#if defined(__AVX2__) && defined(__FMA__)
#define TM_AVX2 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Load 8 storage values (float32, or bfloat16 when `bf16`) as float32 lanes. */
static inline __m256 load8(const void *base, int64_t i, int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + i);
}

/* 8 float32 lanes -> their bfloat16 bits in 8 16-bit lanes (round to nearest even, NaN kept quiet), as
 * f32_to_bf16. */
static inline __m128i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i bits = _mm256_blendv_epi8(rounded, quiet, nan);
    /* the low 16 bits of each 32-bit lane, in order (values fit, so unsigned saturation keeps them) */
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

/* 8 float32 lanes rounded to bfloat16 and back. */
static inline __m256 round8_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
}

/* Store 8 float32 lanes in the storage dtype (rounded to nearest even for bfloat16). */
static inline void store8(void *base, int64_t i, __m256 v, int bf16) {
    if (bf16)
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i), bf16_bits8(v));
    else
        _mm256_storeu_ps((float *)base + i, v);
}

/* The sum of 16 lanes held as lo (lanes 0-7) and hi (8-15), added in the order _mm512_reduce_add_ps
 * adds them, so a 16-lane accumulator reduces to the same float on either level. */
static inline float reduce_add16(__m256 lo, __m256 hi) {
    const __m256 t3 = _mm256_add_ps(hi, lo);
    const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m128 t10 = _mm_add_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtss_f32(t10);
}

/* The sum of 8 lanes, by one fixed tree. */
static inline float reduce_add8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* The largest of 8 lanes. */
static inline float reduce_max8(__m256 v) {
    const __m128 h = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(q, _mm_movehdup_ps(q)));
}

/* The sum of 8 int32 lanes. */
static inline int32_t reduce_add8_epi32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(h);
}

/* 2^x on 8 lanes as exp2_16 computes it (x clamped to [-126, 126]; the power of 2 applied by a
 * multiplication, which is exact where scalef is). */
static inline __m256 exp2_8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(126.0f), _mm256_max_ps(_mm256_set1_ps(-126.0f), x));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(1.5403530e-4f), f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* Lanes below `count` (0..8) set: a mask for maskload / maskstore. */
static inline __m256i lanes_below8(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The first `count` (1..8) lanes stored in the storage dtype, rounded as store8 rounds; the rest of
 * memory untouched. */
static inline void store8_first(void *base, int64_t i, __m256 v, int64_t count, int bf16) {
    if (!bf16) {
        _mm256_maskstore_ps((float *)base + i, lanes_below8(count), v);
    } else if (count == 8) {
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i), bf16_bits8(v));
    } else {
        uint16_t lanes[8];
        _mm_storeu_si128((__m128i *)lanes, bf16_bits8(v));
        memcpy((uint16_t *)base + i, lanes, (size_t)count * 2);
    }
}
#endif

#endif
