/* One-byte KV rows (--kv-cache-dtype int8 / fp8, attention/kv_quant.py) widened to float32: the e4m3
 * table of the portable loops and, at the avx2 level and up (AVX2, FMA, F16C: Q8_VECTOR), 16 or 8 bytes at
 * a time on intrinsics. Every widening is exact: an int8 or an e4m3 number is a float32. Shared by the
 * one-byte decode kernel (decode_attention_q8.c) and the query tiles (attention_tiles.c). */
#ifndef TOKENMILL_Q8_ROWS_H
#define TOKENMILL_Q8_ROWS_H

#include <math.h>
#include <stdint.h>

/* value[b] of every e4m3 bit pattern b: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
 * subnormal (m / 8 * 2^-6). 0x7F and 0xFF (NaN) are never written: rows saturate at +-448. */
static inline void e4m3_table(float *table) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        table[b] = b & 0x80 ? -v : v;
    }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define Q8_VECTOR 1
/* 16 e4m3 bytes re-laid as halves: sign to bit 15, exponent and mantissa to bits 13-7, so the half's exponent
 * field is e4m3's and subnormals stay subnormal. As floats (F16C, exact) they are the e4m3 values times
 * 2^-8 (the exponent bias is 15 against 7). Sign-extended to 16 bits and shifted left by 7, a byte's sign
 * lands in bits 15 and 14 and its other bits in 13-7; the mask clears bit 14. */
static inline __m256i e4m3_halves(__m128i bytes) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7), _mm256_set1_epi16((short)0xBF80));
}

/* The raw widenings (q8_raw16, q8_raw8) give e4m3 values times 2^-8 (the halves' bias): a caller that multiplies
 * by a scale anyway takes scale * q8_unit(fp8) instead, one multiply fewer and the same bits (a power of
 * two: both products are the same real number). */
static inline float q8_unit(int fp8) {
    return fp8 ? 256.0f : 1.0f;
}

#ifdef __AVX512F__
#define Q8_REGS 1  /* 16 floats in one register */
/* 16 value bytes as floats, e4m3 ones times 2^-8 (q8_unit). */
static inline __m512 q8_raw16(const int8_t *src, int fp8) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)src);
    return fp8 ? _mm512_cvtph_ps(e4m3_halves(bytes)) : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
/* 16 value bytes as floats (a dimension of a block's 16 keys, or 16 dimensions of a value row): int8, or
 * e4m3 (`fp8`). */
static inline void q8_widen16(__m512 *dst, const int8_t *src, int fp8) {
    dst[0] = fp8 ? _mm512_mul_ps(q8_raw16(src, 1), _mm512_set1_ps(256.0f)) : q8_raw16(src, 0);
}
#define Q8_SET1 _mm512_set1_ps
#define Q8_FMADD _mm512_fmadd_ps
#define Q8_MUL _mm512_mul_ps
#define Q8_ZERO _mm512_setzero_ps
#define Q8_LOAD _mm512_loadu_ps
#define Q8_STORE _mm512_storeu_ps
#define Q8_DIV _mm512_div_ps
#define Q8_MAX _mm512_max_ps
#define Q8_ABS _mm512_abs_ps
#define Q8_REDUCE_MAX _mm512_reduce_max_ps
typedef __m512 q8_vec;
#else
#define Q8_REGS 2  /* 16 floats in two AVX2 registers */
static inline void q8_widen16(__m256 *dst, const int8_t *src, int fp8) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)src);
    if (fp8) {
        const __m256i h = e4m3_halves(bytes);
        const __m256 bias = _mm256_set1_ps(256.0f);
        dst[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), bias);
        dst[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), bias);
    } else {
        dst[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
        dst[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
    }
}
#define Q8_SET1 _mm256_set1_ps
#define Q8_FMADD _mm256_fmadd_ps
#define Q8_MUL _mm256_mul_ps
#define Q8_ZERO _mm256_setzero_ps
#define Q8_LOAD _mm256_loadu_ps
#define Q8_STORE _mm256_storeu_ps
#define Q8_DIV _mm256_div_ps
#define Q8_MAX _mm256_max_ps
#define Q8_ABS(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x))
#define Q8_REDUCE_MAX q8_reduce_max8
typedef __m256 q8_vec;
/* The largest of 8 lanes (none NaN). */
static inline float q8_reduce_max8(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float top = lanes[0];
    for (int i = 1; i < 8; i++) top = fmaxf(top, lanes[i]);
    return top;
}
#endif
#define Q8_STEP (16 / Q8_REGS)  /* floats per register */

/* 8 value bytes as float32 lanes (the avx2 tiles' vector of keys or dimensions), e4m3 ones times 2^-8
 * (q8_unit). */
static inline __m256 q8_raw8(const int8_t *src, int fp8) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)src);
    if (fp8)
        return _mm256_cvtph_ps(_mm256_castsi256_si128(e4m3_halves(bytes)));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
#endif /* Q8_VECTOR */

#endif
