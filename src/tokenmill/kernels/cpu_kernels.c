/* tokenmill's CPU kernels: KV cache writes and the fused element-wise ops of a Llama block (decode
 * attention is in decode_attention.c). Plain C over raw pointers, called through ctypes (see
 * cpu_kernels.py), built once per instruction-set level (kernels/isa.py, kernels/build.py) with -O3
 * and OpenMP (the libgomp PyTorch already loaded is reused). Each kernel has an AVX-512 path, an AVX2
 * path (cpu_avx2.h) and a portable one, chosen at compile time.
 *
 * Storage is float32 or bfloat16 (`bf16` flag); all arithmetic is float32. Built with
 * -ffp-contract=off so a*b + c*d rounds the way PyTorch's element-wise ops do.
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

/* The features this library was compiled with, one bit each in cpu_kernels.py's COMPILED_FEATURES
 * order, so the loader can say what it runs. */
int tm_compiled_features(void) {
    int bits = 0;
#ifdef __AVX2__
    bits |= 1 << 0;
#endif
#ifdef __FMA__
    bits |= 1 << 1;
#endif
#ifdef __F16C__
    bits |= 1 << 2;
#endif
#ifdef __AVX512F__
    bits |= 1 << 3;
#endif
#ifdef __AVX512BW__
    bits |= 1 << 4;
#endif
#ifdef __AVX512VNNI__
    bits |= 1 << 5;
#endif
#ifdef __AVX512BF16__
    bits |= 1 << 6;
#endif
#ifdef __AMX_BF16__
    bits |= 1 << 7;
#endif
    return bits;
}

/* The values of n float32 results once stored in the storage dtype, in place. */
static inline void round_row(float *v, int64_t n, int bf16) {
    if (bf16)
        for (int64_t i = 0; i < n; i++) v[i] = rounded_to_storage(v[i], bf16);
}

/* Write token t's K and V (rows of k/v at k_row_stride/v_row_stride, kv heads contiguous) into slot
 * slots[t] of one layer's key and value planes [num_blocks, kv_heads, block_size, head_dim]. v NULL: a
 * key-only cache, whose keys are its values; only K is written. */
void tm_cache_write(void *k_cache, void *v_cache, const void *k, const void *v, const int64_t *slots,
                    int64_t num_tokens, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                    int64_t k_row_stride, int64_t v_row_stride, int bf16) {
    const int64_t elem = bf16 ? 2 : 4;
    #pragma omp parallel for if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            int64_t dst = ((block * num_kv_heads + h) * block_size + offset) * head_dim;
            memcpy((char *)k_cache + dst * elem, (const char *)k + (t * k_row_stride + h * head_dim) * elem,
                   (size_t)(head_dim * elem));
            if (v)
                memcpy((char *)v_cache + dst * elem, (const char *)v + (t * v_row_stride + h * head_dim) * elem,
                       (size_t)(head_dim * elem));
        }
    }
}

#ifdef __AVX512F__
/* 16 float32 lanes -> their bfloat16 bits (round to nearest even, NaN kept quiet, as f32_to_bf16). */
static inline __m256i bf16_bits16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    return bf16_round16(v);
#endif
}

/* 16 float32 lanes rounded to bfloat16 and back. */
static inline __m512 round16_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits16(v)), 16));
}

static inline void store16(void *base, int64_t i, __m512 v, int bf16) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), bf16_bits16(v));
    else
        _mm512_storeu_ps((float *)base + i, v);
}

/* 1 / d to within an ulp or two of float32 division: the 14-bit estimate and one Newton step. */
static inline __m512 reciprocal16(__m512 d) {
    const __m512 r = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(r, _mm512_sub_ps(_mm512_set1_ps(2.0f), _mm512_mul_ps(d, r)));
}
#endif

/* residual += x (rounded to the storage dtype, as a PyTorch add would), then
 * out = residual / sqrt(mean(residual^2) + eps) * weight. With residual == NULL: out = norm(x).
 * The squares are summed in 16 lanes (a fixed order for a given hidden size), then across them. */
void tm_add_rms_norm(void *out, const void *x, void *residual, const void *weight, int64_t num_tokens,
                     int64_t hidden, float eps, int bf16) {
    #pragma omp parallel for if (num_tokens > 16)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t row = t * hidden;
        const void *normed = residual ? residual : x;  /* the row whose norm is taken, once stored */
        int64_t i = 0;
        float ss = 0.0f;
#ifdef __AVX512F__
        __m512 squares = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
            __m512 v = load16(x, row + i, bf16);
            if (residual) {
                v = _mm512_add_ps(v, load16(residual, row + i, bf16));
                store16(residual, row + i, v, bf16);
                if (bf16) v = round16_bf16(v);
            }
            squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
        }
        ss = _mm512_reduce_add_ps(squares);
#elif defined(TM_AVX2)
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  /* the 16 lanes of the AVX-512 path */
        for (; i + 16 <= hidden; i += 16) {
            __m256 v[2] = {load8(x, row + i, bf16), load8(x, row + i + 8, bf16)};
            for (int h = 0; h < 2; h++) {
                if (residual) {
                    v[h] = _mm256_add_ps(v[h], load8(residual, row + i + 8 * h, bf16));
                    store8(residual, row + i + 8 * h, v[h], bf16);
                    if (bf16) v[h] = round8_bf16(v[h]);
                }
            }
            lo = _mm256_add_ps(lo, _mm256_mul_ps(v[0], v[0]));
            hi = _mm256_add_ps(hi, _mm256_mul_ps(v[1], v[1]));
        }
        ss = reduce_add16(lo, hi);
#endif
        for (; i < hidden; i++) {
            float v = load_value(x, row + i, bf16);
            if (residual) {
                v = rounded_to_storage(v + load_value(residual, row + i, bf16), bf16);
                store_value(residual, row + i, v, bf16);
            }
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= hidden; i += 16) {
            __m512 v = _mm512_mul_ps(load16(normed, row + i, bf16), _mm512_set1_ps(inv));
            if (bf16) v = round16_bf16(v);
            store16(out, row + i, _mm512_mul_ps(v, load16(weight, i, bf16)), bf16);
        }
#elif defined(TM_AVX2)
        for (; i + 8 <= hidden; i += 8) {
            __m256 v = _mm256_mul_ps(load8(normed, row + i, bf16), _mm256_set1_ps(inv));
            if (bf16) v = round8_bf16(v);
            store8(out, row + i, _mm256_mul_ps(v, load8(weight, i, bf16)), bf16);
        }
#endif
        for (; i < hidden; i++) {
            const float v = rounded_to_storage(load_value(normed, row + i, bf16) * inv, bf16);
            store_value(out, row + i, v * load_value(weight, i, bf16), bf16);
        }
    }
}

/* out[t, i] = act(gate_up[t, i]) * gate_up[t, inner + i], each factor rounded to the storage dtype
 * first, as the unfused PyTorch ops would. act is SiLU, g / (1 + e^-g), or with `gelu` GELU's tanh
 * form 0.5 g (1 + tanh(z)), z = sqrt(2 / pi) (g + 0.044715 g^3), taken as the equal g / (1 + e^-2z).
 * The vector lanes take the exponential as a power of 2 (exp2_16) and divide by a refined reciprocal
 * (reciprocal16): within a few float32 units of the last place. */
static inline void gated_mul(void *out, const void *gate_up, int64_t num_tokens, int64_t inner, int gelu, int bf16) {
    const float k = 0.7978845608028654f, cube = 0.044715f;  /* sqrt(2 / pi), GELU's cubic coefficient */
    #pragma omp parallel for if (num_tokens > 4)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t in_row = t * 2 * inner, out_row = t * inner;
        int64_t i = 0;
#ifdef __AVX512F__
        for (; i + 16 <= inner; i += 16) {
            const __m512 g = load16(gate_up, in_row + i, bf16), u = load16(gate_up, in_row + inner + i, bf16);
            __m512 arg = g;  /* the exponent's argument x of e^-x */
            if (gelu) {
                const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
                arg = _mm512_mul_ps(_mm512_set1_ps(2.0f * k), _mm512_fmadd_ps(_mm512_set1_ps(cube), g3, g));
            }
            const __m512 e = exp2_16(_mm512_mul_ps(arg, _mm512_set1_ps(-1.44269504088896341f)));  /* e^-arg */
            __m512 a = _mm512_mul_ps(g, reciprocal16(_mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            if (bf16) a = round16_bf16(a);
            store16(out, out_row + i, _mm512_mul_ps(a, u), bf16);
        }
#elif defined(TM_AVX2)
        for (; i + 8 <= inner; i += 8) {
            const __m256 g = load8(gate_up, in_row + i, bf16), u = load8(gate_up, in_row + inner + i, bf16);
            __m256 arg = g;
            if (gelu) {
                const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
                arg = _mm256_mul_ps(_mm256_set1_ps(2.0f * k), _mm256_fmadd_ps(_mm256_set1_ps(cube), g3, g));
            }
            const __m256 e = exp2_8(_mm256_mul_ps(arg, _mm256_set1_ps(-1.44269504088896341f)));  /* e^-arg */
            __m256 a = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            if (bf16) a = round8_bf16(a);
            store8(out, out_row + i, _mm256_mul_ps(a, u), bf16);
        }
#endif
        for (; i < inner; i++) {
            const float g = load_value(gate_up, in_row + i, bf16), u = load_value(gate_up, in_row + inner + i, bf16);
            const float arg = gelu ? 2.0f * k * fmaf(cube, g * g * g, g) : g;
            const float a = rounded_to_storage(g / (1.0f + fast_exp(-arg)), bf16);
            store_value(out, out_row + i, a * u, bf16);
        }
    }
}

void tm_silu_mul(void *out, const void *gate_up, int64_t num_tokens, int64_t inner, int bf16) {
    gated_mul(out, gate_up, num_tokens, inner, 0, bf16);
}

void tm_gelu_tanh_mul(void *out, const void *gate_up, int64_t num_tokens, int64_t inner, int bf16) {
    gated_mul(out, gate_up, num_tokens, inner, 1, bf16);
}

/* Rotate heads [0, num_heads) of each token's row in place (the "rotate half" layout):
 * x' = x * cos + rotate_half(x) * sin, with cos/sin rows (float32, head_dim wide) picked by position. */
void tm_rope(void *x, const int64_t *positions, const float *cos_table, const float *sin_table,
             int64_t num_tokens, int64_t num_heads, int64_t head_dim, int64_t row_stride, int bf16) {
    const int64_t half = head_dim / 2;
    #pragma omp parallel for if (num_tokens > 16)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos_table + positions[t] * head_dim;
        const float *s = sin_table + positions[t] * head_dim;
#ifdef __AVX512F__
        if (half % 16 == 0) {  /* the same products and roundings, 16 lanes at a time */
            __m512 cv[32], sv[32];  /* head_dim <= 512 (checked by the wrapper) */
            for (int64_t j = 0; j < head_dim / 16; j++) {
                cv[j] = _mm512_loadu_ps(c + 16 * j);
                sv[j] = _mm512_loadu_ps(s + 16 * j);
                if (bf16) {
                    cv[j] = round16_bf16(cv[j]);
                    sv[j] = round16_bf16(sv[j]);
                }
            }
            const int64_t lo_vectors = half / 16;
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t base = t * row_stride + h * head_dim;
                for (int64_t j = 0; j < lo_vectors; j++) {
                    const __m512 x1 = load16(x, base + 16 * j, bf16), x2 = load16(x, base + half + 16 * j, bf16);
                    __m512 a1 = _mm512_mul_ps(x1, cv[j]), b1 = _mm512_mul_ps(x2, sv[j]);
                    __m512 a2 = _mm512_mul_ps(x2, cv[lo_vectors + j]), b2 = _mm512_mul_ps(x1, sv[lo_vectors + j]);
                    if (bf16) {
                        a1 = round16_bf16(a1);
                        b1 = round16_bf16(b1);
                        a2 = round16_bf16(a2);
                        b2 = round16_bf16(b2);
                    }
                    store16(x, base + 16 * j, _mm512_sub_ps(a1, b1), bf16);  /* x1 c + (-x2) s */
                    store16(x, base + half + 16 * j, _mm512_add_ps(a2, b2), bf16);
                }
            }
            continue;
        }
#elif defined(TM_AVX2)
        if (half % 8 == 0) {  /* the same products and roundings, 8 lanes at a time */
            __m256 cv[64], sv[64];  /* head_dim <= 512 (checked by the wrapper) */
            for (int64_t j = 0; j < head_dim / 8; j++) {
                cv[j] = _mm256_loadu_ps(c + 8 * j);
                sv[j] = _mm256_loadu_ps(s + 8 * j);
                if (bf16) {
                    cv[j] = round8_bf16(cv[j]);
                    sv[j] = round8_bf16(sv[j]);
                }
            }
            const int64_t lo_vectors = half / 8;
            for (int64_t h = 0; h < num_heads; h++) {
                const int64_t base = t * row_stride + h * head_dim;
                for (int64_t j = 0; j < lo_vectors; j++) {
                    const __m256 x1 = load8(x, base + 8 * j, bf16), x2 = load8(x, base + half + 8 * j, bf16);
                    __m256 a1 = _mm256_mul_ps(x1, cv[j]), b1 = _mm256_mul_ps(x2, sv[j]);
                    __m256 a2 = _mm256_mul_ps(x2, cv[lo_vectors + j]), b2 = _mm256_mul_ps(x1, sv[lo_vectors + j]);
                    if (bf16) {
                        a1 = round8_bf16(a1);
                        b1 = round8_bf16(b1);
                        a2 = round8_bf16(a2);
                        b2 = round8_bf16(b2);
                    }
                    store8(x, base + 8 * j, _mm256_sub_ps(a1, b1), bf16);  /* x1 c + (-x2) s */
                    store8(x, base + half + 8 * j, _mm256_add_ps(a2, b2), bf16);
                }
            }
            continue;
        }
#endif
        float cr[512], sr[512], v[512];
        memcpy(cr, c, sizeof(float) * (size_t)head_dim);
        memcpy(sr, s, sizeof(float) * (size_t)head_dim);
        round_row(cr, head_dim, bf16);
        round_row(sr, head_dim, bf16);
        for (int64_t h = 0; h < num_heads; h++) {
            int64_t base = t * row_stride + h * head_dim;
            float rot[512];
            load_row(v, x, base, head_dim, bf16);
            for (int64_t d = 0; d < half; d++) { rot[d] = -v[d + half]; rot[d + half] = v[d]; }
            for (int64_t d = 0; d < head_dim; d++) { v[d] *= cr[d]; rot[d] *= sr[d]; }
            round_row(v, head_dim, bf16);
            round_row(rot, head_dim, bf16);
            for (int64_t d = 0; d < head_dim; d++) v[d] += rot[d];
            store_row(x, base, v, head_dim, bf16);
        }
    }
}
