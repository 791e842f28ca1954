/* Batch-invariant products with float weights: y = x W^T (+ bias), W float32 or bfloat16.
 *
 * Every output is one chain of fused multiply-adds over the input features in order, from zero:
 *   y[r, j] = fma(x[r, k-1], w[j, k-1], ... fma(x[r, 1], w[j, 1], x[r, 0] * w[j, 0]) ...) (+ bias[j])
 * then rounded once to the storage dtype. The tiles only decide which outputs share loads, never an
 * output's operations, so a row's result does not depend on how many rows the product has, the tiling
 * or the thread count, nor, with fmaf in the portable path, on the instruction-set level. (BLAS gemm
 * changes its summation order with the row count: a gemv for one row, other kernels for others.)
 * The weight is packed once into panels of 16 outputs: panel p holds w[16p .. 16p + 15, k] for each k in
 * turn, so one step of a chain loads 16 weights, one per output, from one line.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_avx2.h"
#include "cpu_common.h"

#define PANEL 16
/* rows of x per block: their K values stay in L2 while every panel streams past them */
#define ROW_BLOCK 96

/* Values in the packed weight of an [n, k] weight. */
int64_t tm_dense_packed_values(int64_t n, int64_t k) {
    return (n + PANEL - 1) / PANEL * PANEL * k;
}

/* w [n, k] (row stride k, float32 or bfloat16 per `bf16`) -> panels (tm_dense_packed_values values of the
 * same dtype; outputs past n are zero). */
void tm_dense_pack(void *packed, const void *w, int64_t n, int64_t k, int bf16) {
    const int64_t panels = (n + PANEL - 1) / PANEL, elem = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t j = p * PANEL + c;
                char *dst = (char *)packed + ((p * k + i) * PANEL + c) * elem;
                if (j < n)
                    memcpy(dst, (const char *)w + (j * k + i) * elem, (size_t)elem);
                else
                    memset(dst, 0, (size_t)elem);
            }
}

#ifdef TM_AVX2
/* Rows [r0, r0 + R) x panels [p0, p0 + P) of the product, R * P <= 6 * 1 or 1 * 4: accumulators in
 * registers, one fused multiply-add per (row, output, k). */
static inline __attribute__((always_inline)) void dense_tile(
    void *y, const void *x, const void *packed, const float *bias, int64_t r0, const int R, int64_t p0, const int P,
    int64_t k, int64_t n, int64_t x_stride, int64_t y_stride, int w_bf16, int x_bf16, int y_bf16, int64_t w_p0) {
    __m256 acc[6][8];
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2 * P; h++) acc[r][h] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m256 w[8];
        for (int p = 0; p < P; p++)
            for (int h = 0; h < 2; h++) w[2 * p + h] = load8(packed, ((w_p0 + p) * k + i) * PANEL + 8 * h, w_bf16);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_set1_ps(load_value(x, (r0 + r) * x_stride + i, x_bf16));
            for (int h = 0; h < 2 * P; h++) acc[r][h] = _mm256_fmadd_ps(xv, w[h], acc[r][h]);
        }
    }
    for (int p = 0; p < P; p++)
        for (int h = 0; h < 2; h++) {
            const int64_t j = (p0 + p) * PANEL + 8 * h;
            const int64_t valid = n - j >= 8 ? 8 : n - j;
            if (valid <= 0)
                continue;
            const __m256i mask = lanes_below8(valid);
            for (int r = 0; r < R; r++) {
                __m256 v = acc[r][2 * p + h];
                if (bias)
                    v = _mm256_add_ps(v, _mm256_maskload_ps(bias + j, mask));
                store8_first(y, (r0 + r) * y_stride + j, v, valid, y_bf16);
            }
        }
}
#endif

#ifdef TM_AVX2
/* The tiles of tm_dense_linear, with the dtypes as constants so that each inlined tile loads directly.
 * Several rows: bfloat16 inputs are widened to float32 once, and each weight panel once per block of
 * rows into a per-thread buffer (widening is exact, so the chains are the same ones). */
static inline __attribute__((always_inline)) void dense_tiles(
    void *y, const void *x, const void *packed, const float *bias, int64_t m, int64_t k, int64_t n, int64_t x_stride,
    int64_t y_stride, const int w_bf16, const int x_bf16) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    if (m == 1) {  /* four panels per tile: eight independent chains hide the latency of each */
        #pragma omp parallel for schedule(static)
        for (int64_t q = 0; q < (panels + 3) / 4; q++) {
            int64_t p = 4 * q;
            if (panels - p >= 4)
                dense_tile(y, x, packed, bias, 0, 1, p, 4, k, n, x_stride, y_stride, w_bf16, x_bf16, x_bf16, p);
            else
                for (; p < panels; p++)
                    dense_tile(y, x, packed, bias, 0, 1, p, 1, k, n, x_stride, y_stride, w_bf16, x_bf16, x_bf16, p);
        }
        return;
    }
    float *xf = NULL;
    if (x_bf16) {
        xf = (float *)malloc(sizeof(float) * (size_t)(m * k));
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < m; r++) load_row(xf + r * k, x, r * x_stride, k, 1);
    }
    const void *xs = x_bf16 ? (const void *)xf : x;
    const int64_t xs_stride = x_bf16 ? k : x_stride;
    #pragma omp parallel
    {
        float *wf = w_bf16 ? (float *)malloc(sizeof(float) * (size_t)(k * PANEL)) : NULL;
        for (int64_t b0 = 0; b0 < m; b0 += ROW_BLOCK) {
            const int64_t b1 = b0 + ROW_BLOCK < m ? b0 + ROW_BLOCK : m;
            #pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const void *w = packed;
                int64_t w_p0 = p;
                if (w_bf16) {
                    load_row(wf, packed, p * k * PANEL, k * PANEL, 1);
                    w = wf;
                    w_p0 = 0;
                }
                int64_t r = b0;
                for (; r + 6 <= b1; r += 6)
                    dense_tile(y, xs, w, bias, r, 6, p, 1, k, n, xs_stride, y_stride, 0, 0, x_bf16, w_p0);
                for (; r + 2 <= b1; r += 2)
                    dense_tile(y, xs, w, bias, r, 2, p, 1, k, n, xs_stride, y_stride, 0, 0, x_bf16, w_p0);
                for (; r < b1; r++)
                    dense_tile(y, xs, w, bias, r, 1, p, 1, k, n, xs_stride, y_stride, 0, 0, x_bf16, w_p0);
            }
        }
        free(wf);
    }
    free(xf);
}
#endif

/* y [m, n] = x [m, k] W^T (+ bias, float32, may be NULL), W from tm_dense_pack. x and y share the storage
 * dtype (`x_bf16`); the weight's is `w_bf16`. Rows of x at x_stride, of y at y_stride (elements). */
void tm_dense_linear(void *y, const void *x, const void *packed, const float *bias, int64_t m, int64_t k,
                     int64_t n, int64_t x_stride, int64_t y_stride, int w_bf16, int x_bf16) {
#ifdef TM_AVX2
    if (!w_bf16 && !x_bf16)
        dense_tiles(y, x, packed, bias, m, k, n, x_stride, y_stride, 0, 0);
    else if (w_bf16 && x_bf16)
        dense_tiles(y, x, packed, bias, m, k, n, x_stride, y_stride, 1, 1);
    else
        dense_tiles(y, x, packed, bias, m, k, n, x_stride, y_stride, w_bf16, x_bf16);
#else
    const int64_t panels = (n + PANEL - 1) / PANEL;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < PANEL && p * PANEL + c < n; c++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < k; i++)
                    acc = fmaf(load_value(x, r * x_stride + i, x_bf16), load_value(packed, (p * k + i) * PANEL + c, w_bf16), acc);
                store_value(y, r * y_stride + p * PANEL + c, bias ? acc + bias[p * PANEL + c] : acc, x_bf16);
            }
#endif
}
