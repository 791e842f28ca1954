/* Batch-invariant products with float weights: y = x W^T (+ bias), x and W both float32 or both bfloat16.
 *
 * Every output is one chain over the input features in order, from zero, then (+ bias) rounded once to
 * the storage dtype. The chain's step is the level's fastest exact one:
 * - float32 weights, and bfloat16 weights where the CPU has no bfloat16 dot product: one fused
 *   multiply-add per feature, y[r, j] = fma(x[r, k-1], w[j, k-1], ... fma(x[r, 0], w[j, 0], 0) ...), the
 *   same operations on every level (widening bfloat16 is exact), so the levels agree to the bit;
 * - bfloat16 weights on AVX512-BF16: one vdpbf16ps per feature pair (both products are exact in float32
 *   and added to the chain by the instruction), twice the multiply-adds of an FMA per instruction.
 * The tiles only decide which outputs share loads, never an output's operations, so a row's result does
 * not depend on how many rows the product has, the tiling or the thread count. (BLAS gemm changes its
 * summation order with the row count: a gemv for one row, other kernels for others.)
 * The weight is packed once into panels of 16 outputs: panel p holds w[16p .. 16p + 15, k] for each k in
 * turn, so one step of a chain loads 16 weights, one per output, from one line; for vdpbf16ps, panel p
 * holds feature pairs instead, w[16p + c, 2i .. 2i + 1] at ((p * pairs + i) * 16 + c) * 2 (an odd last
 * feature paired with a zero).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu_avx2.h"
#include "cpu_common.h"

#define PANEL 16
/* rows of x per block: their K values stay in L2 while every panel streams past them */
#define ROW_BLOCK 96

#ifdef __AVX512BF16__
#define PAIRED_BF16 1 /* bfloat16 weights are packed in feature pairs, for vdpbf16ps */
#else
#define PAIRED_BF16 0
#endif

static inline int64_t dense_panels(int64_t n) { return (n + PANEL - 1) / PANEL; }

/* Values in the packed weight of an [n, k] weight of float32 or bfloat16 (`bf16`). */
int64_t tm_dense_packed_values(int64_t n, int64_t k, int bf16) {
    return dense_panels(n) * PANEL * (bf16 && PAIRED_BF16 ? (k + 1) / 2 * 2 : k);
}

/* w [n, k] (row stride k, float32 or bfloat16 per `bf16`) -> panels (tm_dense_packed_values values of the
 * same dtype; outputs past n, and the pair of an odd last feature, are zero). */
void tm_dense_pack(void *packed, const void *w, int64_t n, int64_t k, int bf16) {
    const int64_t panels = dense_panels(n), elem = bf16 ? 2 : 4;
    const int pairs = bf16 && PAIRED_BF16;
    const int64_t depth = pairs ? (k + 1) / 2 * 2 : k;
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t i = 0; i < depth; i++)
            for (int64_t c = 0; c < PANEL; c++) {
                const int64_t j = p * PANEL + c;
                const int64_t at = pairs ? (p * depth + i / 2 * 2) * PANEL + 2 * c + i % 2 : (p * depth + i) * PANEL + c;
                char *dst = (char *)packed + at * elem;
                if (j < n && i < k)
                    memcpy(dst, (const char *)w + (j * k + i) * elem, (size_t)elem);
                else
                    memset(dst, 0, (size_t)elem);
            }
}

#if defined(TM_AVX2) && !defined(__AVX512F__)
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
#define ROWS_PER_TILE 6
#define PANELS_PER_TILE 1
#define LONE_ROW_PANELS 4
#endif

#ifdef __AVX512F__
/* The accumulators of rows [r0, r0 + R) x panels [p0, p0 + P), plus the bias, stored in the storage dtype;
 * outputs past n untouched. */
static inline __attribute__((always_inline)) void store_tile(
    void *y, __m512 acc[8][8], const float *bias, int64_t r0, const int R, int64_t p0, const int P, int64_t n,
    int64_t y_stride, int y_bf16) {
    for (int p = 0; p < P; p++) {
        const int64_t j = (p0 + p) * PANEL;
        if (j >= n)
            continue;
        const __mmask16 mask = n - j >= PANEL ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 v = bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
            if (y_bf16)
                _mm256_mask_storeu_epi16((uint16_t *)y + (r0 + r) * y_stride + j, mask, bf16_round16(v));
            else
                _mm512_mask_storeu_ps((float *)y + (r0 + r) * y_stride + j, mask, v);
        }
    }
}

/* Rows [r0, r0 + R) x panels [p0, p0 + P) of the product (R * P <= 16), one fused multiply-add per
 * (row, output, k) in 16-lane registers: the chains of the avx2 tile, lane for lane. */
static inline __attribute__((always_inline)) void dense_tile(
    void *y, const void *x, const void *packed, const float *bias, int64_t r0, const int R, int64_t p0, const int P,
    int64_t k, int64_t n, int64_t x_stride, int64_t y_stride, int w_bf16, int x_bf16, int y_bf16, int64_t w_p0) {
    __m512 acc[8][8];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 w[8];
        for (int p = 0; p < P; p++) w[p] = load16(packed, ((w_p0 + p) * k + i) * PANEL, w_bf16);
        for (int r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(load_value(x, (r0 + r) * x_stride + i, x_bf16));
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
        }
    }
    store_tile(y, acc, bias, r0, R, p0, P, n, y_stride, y_bf16);
}
#define ROWS_PER_TILE 8
#define PANELS_PER_TILE 2
#define LONE_ROW_PANELS 8
#endif

#ifdef __AVX512BF16__
/* Rows [r0, r0 + R) x panels [p0, p0 + P) (R * P <= 16) of a bfloat16 product on paired panels: one
 * vdpbf16ps per (row, 16 outputs, feature pair), x's pair broadcast to every lane. */
static inline __attribute__((always_inline)) void pair_tile(
    uint16_t *y, const uint16_t *x, const uint16_t *packed, const float *bias, int64_t r0, const int R, int64_t p0,
    const int P, int64_t k, int64_t n, int64_t x_stride, int64_t y_stride) {
    const int64_t pairs = (k + 1) / 2;
    __m512 acc[8][8];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        __m512bh w[8];
        for (int p = 0; p < P; p++) w[p] = (__m512bh)_mm512_loadu_si512(packed + ((p0 + p) * pairs + i) * 2 * PANEL);
        const int whole = 2 * i + 1 < k;
        for (int r = 0; r < R; r++) {
            const uint16_t *xr = x + (r0 + r) * x_stride + 2 * i;
            uint32_t two;  /* x's pair; an odd last feature pairs with zero, as in the packing */
            if (__builtin_expect(whole, 1))
                memcpy(&two, xr, 4);
            else
                two = xr[0];
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)two);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, w[p]);
        }
    }
    store_tile(y, acc, bias, r0, R, p0, P, n, y_stride, 1);
}
#endif

/* The calling thread's share [*first, *last) of `panels` panels, contiguous and within one of every other
 * thread's size (a lone row's work: whole tiles of panels would leave a thread idle on narrow weights). */
static inline void thread_panels(int64_t panels, int64_t *first, int64_t *last) {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    *first = panels * t / threads;
    *last = panels * (t + 1) / threads;
}

#ifdef TM_AVX2
/* One tile of either chain: vdpbf16ps on paired panels (`paired`: bfloat16 x and y, w the packed weight
 * itself), else dense_tile's fused multiply-adds. */
static inline __attribute__((always_inline)) void any_tile(
    const int paired, void *y, const void *x, const void *w, const float *bias, int64_t r0, const int R, int64_t p0,
    const int P, int64_t k, int64_t n, int64_t x_stride, int64_t y_stride, int w_bf16, int x_bf16, int y_bf16,
    int64_t w_p0) {
#if PAIRED_BF16
    if (paired) {
        pair_tile(y, x, w, bias, r0, R, p0, P, k, n, x_stride, y_stride);
        return;
    }
#endif
    (void)paired;
    dense_tile(y, x, w, bias, r0, R, p0, P, k, n, x_stride, y_stride, w_bf16, x_bf16, y_bf16, w_p0);
}

/* The tiles of tm_dense_linear, with the dtype and the chain (`paired`: vdpbf16ps on paired panels) as
 * constants so that each inlined tile loads directly. A lone row takes LONE_ROW_PANELS panels a tile
 * (independent chains hide each one's latency), each thread an even share of the panels. More rows go in
 * blocks of ROW_BLOCK, each thread running its tiles of panels over a block; for fused multiply-adds on
 * bfloat16, the inputs are widened to float32 once and each tile's weight panels once per block into a
 * per-thread buffer (widening is exact, so the chains are the same). */
static inline __attribute__((always_inline)) void dense_tiles(
    void *y, const void *x, const void *packed, const float *bias, int64_t m, int64_t k, int64_t n, int64_t x_stride,
    int64_t y_stride, const int bf16, const int paired) {
    const int64_t panels = dense_panels(n);
    if (m == 1) {
        #pragma omp parallel
        {
            int64_t p, last;
            thread_panels(panels, &p, &last);
            for (; p + LONE_ROW_PANELS <= last; p += LONE_ROW_PANELS)
                any_tile(paired, y, x, packed, bias, 0, 1, p, LONE_ROW_PANELS, k, n, x_stride, y_stride, bf16, bf16, bf16, p);
            for (; p < last; p++) any_tile(paired, y, x, packed, bias, 0, 1, p, 1, k, n, x_stride, y_stride, bf16, bf16, bf16, p);
        }
        return;
    }
    const int widen = bf16 && !paired;
    float *xf = NULL;
    if (widen) {
        xf = (float *)malloc(sizeof(float) * (size_t)(m * k));
        #pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < m; r++) load_row(xf + r * k, x, r * x_stride, k, 1);
    }
    const void *xs = widen ? (const void *)xf : x;
    const int64_t xs_stride = widen ? k : x_stride;
    #pragma omp parallel
    {
        float *wf = widen ? (float *)malloc(sizeof(float) * (size_t)(k * PANEL * PANELS_PER_TILE)) : NULL;
        for (int64_t b0 = 0; b0 < m; b0 += ROW_BLOCK) {
            const int64_t b1 = b0 + ROW_BLOCK < m ? b0 + ROW_BLOCK : m;
            #pragma omp for schedule(static)
            for (int64_t q = 0; q < (panels + PANELS_PER_TILE - 1) / PANELS_PER_TILE; q++) {
                const int64_t p = PANELS_PER_TILE * q;
                const void *w = packed;
                int64_t w_p0 = p;
                if (widen) {  /* the tile's panels are contiguous */
                    const int64_t count = panels - p < PANELS_PER_TILE ? panels - p : PANELS_PER_TILE;
                    load_row(wf, packed, p * k * PANEL, count * k * PANEL, 1);
                    w = wf;
                    w_p0 = 0;
                }
                int64_t r = b0;
                if (panels - p >= PANELS_PER_TILE) {
                    for (; r + ROWS_PER_TILE <= b1; r += ROWS_PER_TILE)
                        any_tile(paired, y, xs, w, bias, r, ROWS_PER_TILE, p, PANELS_PER_TILE, k, n, xs_stride, y_stride, 0, 0, bf16, w_p0);
                    for (; r + 2 <= b1; r += 2)
                        any_tile(paired, y, xs, w, bias, r, 2, p, PANELS_PER_TILE, k, n, xs_stride, y_stride, 0, 0, bf16, w_p0);
                    for (; r < b1; r++)
                        any_tile(paired, y, xs, w, bias, r, 1, p, PANELS_PER_TILE, k, n, xs_stride, y_stride, 0, 0, bf16, w_p0);
                } else {
                    for (; r + ROWS_PER_TILE <= b1; r += ROWS_PER_TILE)
                        any_tile(paired, y, xs, w, bias, r, ROWS_PER_TILE, p, 1, k, n, xs_stride, y_stride, 0, 0, bf16, w_p0);
                    for (; r < b1; r++)
                        any_tile(paired, y, xs, w, bias, r, 1, p, 1, k, n, xs_stride, y_stride, 0, 0, bf16, w_p0);
                }
            }
        }
        free(wf);
    }
    free(xf);
}
#endif

/* y [m, n] = x [m, k] W^T (+ bias, float32, may be NULL), W from tm_dense_pack. x, y and W share the
 * storage dtype (`bf16`). Rows of x at x_stride, of y at y_stride (elements). */
void tm_dense_linear(void *y, const void *x, const void *packed, const float *bias, int64_t m, int64_t k,
                     int64_t n, int64_t x_stride, int64_t y_stride, int bf16) {
#ifdef TM_AVX2
    if (bf16 && PAIRED_BF16)
        dense_tiles(y, x, packed, bias, m, k, n, x_stride, y_stride, 1, 1);
    else if (bf16)
        dense_tiles(y, x, packed, bias, m, k, n, x_stride, y_stride, 1, 0);
    else
        dense_tiles(y, x, packed, bias, m, k, n, x_stride, y_stride, 0, 0);
#else
    const int64_t panels = dense_panels(n);
    #pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < PANEL && p * PANEL + c < n; c++) {
                float acc = 0.0f;
                for (int64_t i = 0; i < k; i++)
                    acc = fmaf(load_value(x, r * x_stride + i, bf16), load_value(packed, (p * k + i) * PANEL + c, bf16), acc);
                store_value(y, r * y_stride + p * PANEL + c, bias ? acc + bias[p * PANEL + c] : acc, bf16);
            }
#endif
}
