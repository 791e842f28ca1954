/* Bfloat16 matrix products on AMX tiles: y = x W^T (+ bias), float32 accumulation, bfloat16 out.
 *
 * The weight is read as AMX "B" tiles: per 16 output columns and 32 input features, a 1 KB tile of
 * 16 rows (input-feature pairs) x 16 columns x 2 bfloat16, i.e. tile[kp][j][e] = W[j][2 kp + e].
 * Either it was packed once in that layout (tm_amx_pack, bfloat16 weights), or it is dequantised
 * into it 32 columns (two cell groups) at a time from the cell layout of quant_cells.h, in a buffer that
 * stays in L1/L2 while every input row of a chunk passes over it (no dequantised copy in memory).
 * Dequantised values are those tm_dequantize writes (scale * u, + offset, times a sub-scale where the
 * cells have them, each rounded in float32, then to bfloat16), so a product equals the reference's
 * dequantise-then-matmul up to the order of the float32 sums.
 *
 * The input rows are copied, a chunk at a time, into "A" tiles (16 rows x 32 features, 1 KB each,
 * zero past the last row). Each thread owns a contiguous range of 32-column panels and runs every
 * row of the chunk over each; tiles: C 0-3 (2 x 2 blocks of 16 x 16 float32), A 4-5, B 6-7. Each
 * output's sum runs over the features in the same order whatever the other rows, so a row's result
 * does not depend on its batch.
 *
 * Needs AMX-TILE and AMX-BF16 (compiled in only with them) and the kernel's permission for the tile
 * data state, which tm_amx_init asks for.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#ifdef TM_AMX
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "quant_cells.h"

#define KTILE 32    /* input features per tile step */
#define NPANEL 32   /* output columns per panel: two B tiles */
#define MBLOCK 32   /* input rows per step: two A tiles */
/* Rows of x per pass over the weight: bounds the A data a panel meets to ~1 MB (L2), so that for
 * quantised weights each panel is dequantised once per chunk. */
#define CHUNK_BYTES (1 << 20)

#ifdef TM_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* The cell-layout weight (quant_cells.h) as the kernel reads it. */
typedef struct {
    const uint8_t *cells;
    int64_t blocks, groups;  /* cells per group; groups of 16 rows */
    int bits, scales;  /* scales: QS_ flags */
} quantized_weight;

/* The 16 lanes of v (one per row), each repeated 4 times per lane quarter: spread[p] holds rows
 * 4p .. 4p + 3, 4 lanes each, matching 16 data bytes of a chunk. */
static inline void spread_lanes(__m512 spread[4], __m512 v) {
    for (int q = 0; q < 4; q++) {
        const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(4 * q),
                                              _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
        spread[q] = _mm512_permutexvar_ps(pick, v);
    }
}

/* The 16 rows' scales (or offsets) of a cell, spread as spread_lanes does. */
static inline void spread_scales(__m512 spread[4], const uint8_t *p, int scales) {
    spread_lanes(spread, (scales & QS_HALF) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p))
                                            : _mm512_loadu_ps((const float *)p));
}

/* One chunk's 64 unsigned values (byte 4j + e: row j, feature 4c + e) -> B tile rows 2c and 2c + 1,
 * each value scale * u, + offset, times sub (NULL: none), rounded in float32 then to bfloat16 (as
 * tm_dequantize). */
static inline void chunk_to_tile_rows(uint16_t *tile, int c, __m512i u, const __m512 scale[4], const __m512 offset[4],
                                      const __m512 *sub) {
    __m512i halves[2];
    for (int h = 0; h < 2; h++) {
        __m512 v[2];
        for (int e = 0; e < 2; e++) {
            const int q = 2 * h + e;
            const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, q)));
            v[e] = _mm512_add_ps(_mm512_mul_ps(values, scale[q]), offset[q]);  /* rounded twice */
            if (sub)
                v[e] = _mm512_mul_ps(v[e], sub[q]);
        }
        halves[h] = (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]);  /* rows 8h .. 8h + 7, 4 features each */
    }
    /* dword (feature pair) 2j + p of halves[h] is row 8h + j's pair p: pairs 0 -> tile row 2c, 1 -> 2c + 1 */
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    _mm512_store_si512((__m512i *)(tile + (2 * c) * 32), _mm512_permutex2var_epi32(halves[0], even, halves[1]));
    _mm512_store_si512((__m512i *)(tile + (2 * c + 1) * 32), _mm512_permutex2var_epi32(halves[0], odd, halves[1]));
}

/* Weight rows [16 g, 16 g + 16) (a group past the last reads as zero) -> the B tiles of all k / 32
 * feature blocks: tiles[kb * 512 ...]. */
static void dequantize_tiles(uint16_t *tiles, const quantized_weight *w, int64_t g, int64_t k) {
    const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
    const int64_t cell_bytes = qcell_bytes(w->bits, w->scales), data_bytes = qcell_data_bytes(w->bits);
    for (int64_t kb = 0; kb < k / KTILE; kb++) {
        uint16_t *tile = tiles + kb * 512;
        if (g >= w->groups) {
            memset(tile, 0, 1024);
            continue;
        }
        const uint8_t *cell = w->cells + (g * w->blocks + kb) * cell_bytes;
        __m512 scale[4], offset[4], sub[2][4];
        spread_scales(scale, cell + data_bytes, w->scales);
        spread_scales(offset, cell + data_bytes + QGROUP * qcell_scale_bytes(w->scales), w->scales);
        if (w->scales & QS_SUB) {  /* chunks 0-3 hold features 0-15, 4-7 features 16-31 */
            const int8_t *subs = qcell_subs(cell, w->bits, w->scales);
            for (int f = 0; f < 2; f++) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(subs + QGROUP * f));
                spread_lanes(sub[f], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)));
            }
        }
        if (w->bits == 8) {
            for (int c = 0; c < 8; c++)
                chunk_to_tile_rows(tile, c, _mm512_loadu_si512(cell + c * 64), scale, offset,
                                   (w->scales & QS_SUB) ? sub[c / 4] : NULL);
        } else {  /* chunk c's low nibbles are features 4c.., its high nibbles 16 + 4c.. (chunk c + 4) */
            for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(cell + c * 64);
                chunk_to_tile_rows(tile, c, _mm512_and_si512(v, low_nibbles), scale, offset, NULL);
                chunk_to_tile_rows(tile, c + 4, _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles), scale, offset, NULL);
            }
        }
    }
}

/* C tiles (2 x 2 blocks as float32 [32][32] in `c`) + bias -> bfloat16 y rows [0, rows), cols [0, cols). */
static void store_block(const float *c, uint16_t *y, int64_t ldy, int rows, int cols, const float *bias) {
    const __mmask16 lo = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    const __m512 b0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c + r * 32), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b1);
        _mm256_mask_storeu_epi16(y + r * ldy, lo, (__m256i)_mm512_cvtneps_pbh(v0));
        _mm256_mask_storeu_epi16(y + r * ldy + 16, hi, (__m256i)_mm512_cvtneps_pbh(v1));
    }
}

/* Cache lines to prefetch into L2 while a block multiplies: `lines` lines from `first`, spread evenly over
 * its k steps. A burst of hundreds of prefetches that miss every cache stalls on the line-fill buffers, so
 * a panel's worth of them at once would leave the tile unit idle until they drain. */
typedef struct {
    const char *first;
    int64_t lines;
} prefetch_slice;

static inline void prefetch_step(const prefetch_slice *ahead, int64_t kb, int64_t kblocks) {
    const int64_t per_step = (ahead->lines + kblocks - 1) / kblocks;
    const int64_t end = (kb + 1) * per_step < ahead->lines ? (kb + 1) * per_step : ahead->lines;
    for (int64_t line = kb * per_step; line < end; line++) _mm_prefetch(ahead->first + 64 * line, _MM_HINT_T1);
}

/* One block of up to 32 packed rows (pack_rows) times one 32-column panel b0 | b1 -> y, prefetching `ahead`. */
static void multiply_block(const uint16_t *a, int rows, const uint16_t *b0, const uint16_t *b1, int64_t kblocks,
                           uint16_t *y, int64_t ldy, int cols, const float *bias, float *c, const prefetch_slice *ahead) {
    _tile_zero(0);
    _tile_zero(1);
    if (rows > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < kblocks; kb++) {
            if (kb + 2 < kblocks) {  /* the rows' tiles two steps ahead, from L2 into L1 */
                const char *rows_ahead = (const char *)(a + (kb + 2) * MBLOCK * KTILE);
                for (int line = 0; line < MBLOCK * KTILE * 2 / 64; line++) _mm_prefetch(rows_ahead + 64 * line, _MM_HINT_T0);
            }
            prefetch_step(ahead, kb, kblocks);
            _tile_loadd(4, a + kb * MBLOCK * KTILE, 64);
            _tile_loadd(5, a + kb * MBLOCK * KTILE + 16 * KTILE, 64);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
    } else {
        for (int64_t kb = 0; kb < kblocks; kb++) {
            prefetch_step(ahead, kb, kblocks);
            _tile_loadd(4, a + kb * MBLOCK * KTILE, 64);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    _tile_stored(0, c, 128);
    _tile_stored(1, c + 16, 128);
    store_block(c, y, ldy, rows, cols, bias);
}

/* Rows [first, first + rows) of x -> A tiles [block][kb][32 rows][32 features], rows past the end zero,
 * so that every tile load reads 1 KB in one piece. */
static void pack_rows(uint16_t *a, const uint16_t *x, int64_t ldx, int64_t first, int64_t rows, int64_t k) {
    const int64_t kblocks = k / KTILE;
    #pragma omp for schedule(static)
    for (int64_t block = 0; block < (rows + MBLOCK - 1) / MBLOCK; block++)
        for (int r = 0; r < MBLOCK; r++) {
            const int64_t row = block * MBLOCK + r;
            uint16_t *dst = a + block * kblocks * MBLOCK * KTILE + r * KTILE;
            for (int64_t kb = 0; kb < kblocks; kb++) {
                __m512i v = row < rows ? _mm512_loadu_si512(x + (first + row) * ldx + kb * KTILE) : _mm512_setzero_si512();
                _mm512_store_si512(dst + kb * MBLOCK * KTILE, v);
            }
        }
}

static void amx_product(uint16_t *y, const uint16_t *x, const uint16_t *packed, const quantized_weight *qw,
                        const float *bias, int64_t m, int64_t k, int64_t n, int64_t ldx, int64_t ldy) {
    const int64_t kblocks = k / KTILE, panels = (n + NPANEL - 1) / NPANEL;
    int64_t chunk = CHUNK_BYTES / (k * 2) / MBLOCK * MBLOCK;
    if (chunk < MBLOCK)
        chunk = MBLOCK;
    const int64_t chunk_rows = chunk < m ? chunk : (m + MBLOCK - 1) / MBLOCK * MBLOCK;
    uint16_t *a = (uint16_t *)aligned_alloc(64, (size_t)(chunk_rows * k * 2));
    #pragma omp parallel
    {
        tm_configure_tiles();
        float c[32 * 32] __attribute__((aligned(64)));
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t p0 = panels * me / threads, p1 = panels * (me + 1) / threads;
        uint16_t *tiles = qw ? (uint16_t *)aligned_alloc(64, (size_t)(2 * kblocks * 512 * 2)) : NULL;
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            pack_rows(a, x, ldx, m0, m1 - m0, k);  /* ends in a barrier: every thread reads all rows */
            for (int64_t p = p0; p < p1; p++) {
                const uint16_t *b0, *next = NULL;  /* next: the weights to bring from memory into L2 meanwhile */
                if (qw) {
                    dequantize_tiles(tiles, qw, 2 * p, k);
                    dequantize_tiles(tiles + kblocks * 512, qw, 2 * p + 1, k);
                    b0 = tiles;
                } else {
                    b0 = packed + p * 2 * kblocks * 512;
                    if (p + 1 < p1)
                        next = b0 + 2 * kblocks * 512;  /* the next panel, in slices over this panel's blocks */
                }
                const int64_t panel_lines = next ? 2 * kblocks * 512 * 2 / 64 : 0, blocks = (m1 - m0 + MBLOCK - 1) / MBLOCK;
                const int cols = (int)(n - p * NPANEL < NPANEL ? n - p * NPANEL : NPANEL);
                for (int64_t r = m0; r < m1; r += MBLOCK) {
                    const int rows = (int)(m1 - r < MBLOCK ? m1 - r : MBLOCK);
                    const int64_t i = (r - m0) / MBLOCK, l0 = panel_lines * i / blocks, l1 = panel_lines * (i + 1) / blocks;
                    const prefetch_slice ahead = {next ? (const char *)next + 64 * l0 : NULL, l1 - l0};
                    multiply_block(a + (r - m0) * k, rows, b0, b0 + kblocks * 512, kblocks, y + r * ldy + p * NPANEL,
                                   ldy, cols, bias ? bias + p * NPANEL : NULL, c, &ahead);
                }
            }
            #pragma omp barrier  /* before the next chunk overwrites the rows */
        }
        free(tiles);
        _tile_release();
    }
    free(a);
}
#endif

/* Whether tm_amx_init has been granted the tile data state (amx_int8.c reads it before using tiles). */
int tm_amx_permitted = 0;

/* 0 when the AMX products can run here (compiled in and tile data permitted), else -1. */
int tm_amx_init(void) {
#ifdef TM_AMX
    tm_amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return tm_amx_permitted ? 0 : -1;
#else
    return -1;
#endif
}

/* Bfloat16 w [n, k] (k % 32 == 0) -> packed B tiles [ceil(n / 32) * 2][k / 32][16][16][2], columns
 * past n zero. */
void tm_amx_pack(uint16_t *packed, const uint16_t *w, int64_t n, int64_t k) {
#ifdef TM_AMX
    const int64_t kblocks = k / KTILE, tile_rows = (n + NPANEL - 1) / NPANEL * 2;
    #pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < tile_rows; nb++)
        for (int64_t kb = 0; kb < kblocks; kb++) {
            const uint16_t *rows[16];
            for (int j = 0; j < 16; j++) rows[j] = nb * 16 + j < n ? w + (nb * 16 + j) * k + kb * KTILE : NULL;
            tm_rows_to_b_tile(packed + (nb * kblocks + kb) * 512, rows);
        }
#else
    (void)packed, (void)w, (void)n, (void)k;
#endif
}

/* y [m, n] (row stride ldy) = x [m, k] (row stride ldx) W^T + bias (float32 [n] or NULL), bfloat16,
 * W packed by tm_amx_pack; k % 32 == 0. */
void tm_amx_linear(uint16_t *y, const uint16_t *x, const uint16_t *packed, const float *bias,
                   int64_t m, int64_t k, int64_t n, int64_t ldx, int64_t ldy) {
#ifdef TM_AMX
    amx_product(y, x, packed, NULL, bias, m, k, n, ldx, ldy);
#endif
}

/* The same product with W in the cell layout of quant_cells.h (bits 8 or 4; `scales` its QS_ flags);
 * k % 32 == 0. */
void tm_amx_qlinear(uint16_t *y, const uint16_t *x, const uint8_t *cells, const float *bias, int64_t m, int64_t k,
                    int64_t n, int64_t ldx, int64_t ldy, int bits, int scales) {
#ifdef TM_AMX
    const quantized_weight qw = {cells, qpadded_k(k) / QBLOCK, qgroups(n), bits, scales};
    amx_product(y, x, NULL, &qw, bias, m, k, n, ldx, ldy);
#endif
}
