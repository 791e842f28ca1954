/* The int8 product of quant_kernels.c (tm_qlinear) for many input rows, its integer dot products on
 * AMX-INT8 tiles.
 *
 * Per 32-feature block b, the products need the exact integer dots (u . q)_b of every weight row with
 * every quantised input row; vpdpbusd computes them 64 multiply-adds an instruction, a tile 8,192. The
 * cell layout (quant_cells.h) is already an AMX "B" operand: an int8 cell's 8 chunks of 64 bytes are 8
 * tile rows, chunk c holding features 4c .. 4c + 3 of each of the 16 weight rows; an int4 cell's low
 * nibbles are rows 0-3 and its high nibbles rows 4-7, expanded to bytes a panel of groups at a time. The "A"
 * operand is 16 quantised input rows' 32 bytes of the block, read in place. TDPBSUD (signed A,
 * unsigned B) gives C[row][output] = (u . q)_b, an exact int32 as vpdpbusd's sum is.
 *
 * The float work then runs exactly as the vector kernel's (cells_tile), in the same order: per block,
 * acc = fma(float(dot), scale * dx, acc), then acc = fma(offset, s, acc); at the end acc + (bias or 0),
 * rounded once to the storage dtype. So each output is bit-identical to tm_qlinear's vector path at any
 * row count (tests/kernels/test_quant_kernels.py), and which of the two runs changes no result.
 * Sub-scaled cells (QS_SUB) keep the vector path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "quant_cells.h"

#if defined(TM_AMX) && defined(__AMX_INT8__)
#include <cpuid.h>
#include <omp.h>

/* tm_amx_init's verdict: the tile data state is permitted (amx_kernels.c). */
extern int tm_amx_permitted;

/* Tiles: C 0-3 (16 rows x 16 int32: four blocks in flight, so a block's dots are stored only after the
 * next three are issued), A 4 and 6 (16 rows x 32 bytes), B 5 and 7 (8 rows x 64 bytes). */
static void configure_int8_tiles(void) {
    tm_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    cfg.rows[4] = cfg.rows[6] = 16, cfg.colsb[4] = cfg.colsb[6] = 32;
    cfg.rows[5] = cfg.rows[7] = 8, cfg.colsb[5] = cfg.colsb[7] = 64;
    _tile_loadconfig(&cfg);
}

static int amx_int8_present(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);
}

/* The B tiles of `count` consecutive cells, one per block: int8 cells are read in place (returns them,
 * *tile_stride = the cell size); int4 nibbles are expanded into `buffer` (count x 512 bytes, *tile_stride
 * = 512). */
static const uint8_t *expanded_tiles(uint8_t *buffer, const uint8_t *cells, int64_t count, int bits, int scales,
                                     int64_t *tile_stride) {
    const int64_t cell_bytes = qcell_bytes(bits, scales);
    if (bits == 8) {
        *tile_stride = cell_bytes;
        return cells;
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t t = 0; t < count; t++) {
        const uint8_t *cell = cells + t * cell_bytes;
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512(cell + 64 * c);
            _mm512_store_si512((__m512i *)(buffer + t * 512 + 64 * c), _mm512_and_si512(v, low));
            _mm512_store_si512((__m512i *)(buffer + t * 512 + 64 * (c + 4)), _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
    *tile_stride = 512;
    return buffer;
}

/* This thread's buffer for expanded tiles, grown as needed and kept for later calls (OpenMP's threads
 * persist between parallel regions). */
static uint8_t *thread_buffer(size_t bytes) {
    static __thread uint8_t *buffer;
    static __thread size_t capacity;
    if (bytes > capacity) {
        free(buffer);
        capacity = (bytes + 65535) / 65536 * 65536;
        buffer = aligned_alloc(64, capacity);
    }
    return buffer;
}

/* y rows [r0, r0 + 16) (those below m) x the outputs of group g: every block's dots on the tiles (four
 * blocks in flight, so a block's dots are stored only after the next three are issued), then
 * cells_tile's float steps for each row. (Issuing the next four blocks' dots before the float steps of
 * the current four measured no faster.) */
static inline void rows_product(void *y, int64_t y_stride, const uint8_t *group_cells, const uint8_t *tiles,
                                int64_t tile_stride, int64_t j, __m512 add, __mmask16 valid, const int8_t *q,
                                const float *dx, const float *s, int64_t r0, int64_t m, int64_t padded_k, int bits,
                                int scales, int bf16) {
    const int64_t blocks = padded_k / QBLOCK, cell_bytes = qcell_bytes(bits, scales);
    const int64_t data_bytes = qcell_data_bytes(bits), sb = qcell_scale_bytes(scales);
    const int8_t *q_rows = q + r0 * padded_k;
    int32_t dots[4][16][16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
        const int count = blocks - b0 < 4 ? (int)(blocks - b0) : 4;
        /* the tile numbers must be constants */
#define BLOCK_DOTS(C, A, B, i)                                                  \
        if (i < count) {                                                        \
            _tile_zero(C);                                                      \
            _tile_loadd(A, q_rows + (b0 + i) * QBLOCK, padded_k);               \
            _tile_loadd(B, tiles + (b0 + i) * tile_stride, 64);                  \
            _tile_dpbsud(C, A, B);                                              \
        }
        BLOCK_DOTS(0, 4, 5, 0)
        BLOCK_DOTS(1, 6, 7, 1)
        BLOCK_DOTS(2, 4, 5, 2)
        BLOCK_DOTS(3, 6, 7, 3)
#undef BLOCK_DOTS
        _tile_stored(0, dots[0], 64);
        if (count > 1) _tile_stored(1, dots[1], 64);
        if (count > 2) _tile_stored(2, dots[2], 64);
        if (count > 3) _tile_stored(3, dots[3], 64);
        for (int i = 0; i < count; i++) {
            const int64_t b = b0 + i;
            const uint8_t *cell = group_cells + b * cell_bytes;
            const __m512 scale = load_scales16(cell + data_bytes, scales);
            const __m512 offset = load_scales16(cell + data_bytes + QGROUP * sb, scales);
            for (int r = 0; r < 16; r++) {
                const __m512 weight = _mm512_mul_ps(scale, _mm512_set1_ps(dx[(r0 + r) * blocks + b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[i][r])), weight, acc[r]);
                acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(s[(r0 + r) * blocks + b]), acc[r]);
            }
        }
    }
    for (int r = 0; r < 16 && r0 + r < m; r++) {
        const __m512 v = _mm512_add_ps(acc[r], add);
        if (bf16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (r0 + r) * y_stride + j, valid, bf16_lanes(v));
        else
            _mm512_mask_storeu_ps((float *)y + (r0 + r) * y_stride + j, valid, v);
    }
}

/* Bytes of B tiles a thread expands at a time (they stay in L2), and rows that pass over a group's
 * tiles together (their inputs stay in L2, the group's tiles in L1). */
#define PANEL_BYTES (256 << 10)
#define ROWS_CHUNK 128
#endif

/* tm_qlinear's product from its quantised rows (q [ceil(m / 16) * 16, padded_k], the rows past m zero;
 * dx, s [m, padded_k / 32]) on AMX-INT8 tiles, bit-identical to its vector path. Returns 0, or -1 (nothing
 * done) where AMX-INT8 is not compiled in, not on this CPU or not permitted, or the cells have sub-scales. */
int tm_amx_int8_qlinear(void *y, int64_t y_stride, const uint8_t *cells, const float *bias, const int8_t *q,
                        const float *dx, const float *s, int64_t m, int64_t padded_k, int64_t n, int bits, int scales,
                        int bf16) {
#if defined(TM_AMX) && defined(__AMX_INT8__)
    static int present = -1;
    if (present < 0)
        present = amx_int8_present();
    if (!present || !tm_amx_permitted || (scales & QS_SUB))
        return -1;
    const int64_t groups = qgroups(n), blocks = padded_k / QBLOCK, cell_bytes = qcell_bytes(bits, scales);
    const int64_t elem = bf16 ? 2 : 4;
    #pragma omp parallel
    {
        configure_int8_tiles();
        /* each thread its contiguous share of the groups, a panel of them at a time */
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
        /* one chunk of rows reuses no group's tiles: each is expanded just before its use (L1) */
        int64_t panel = m <= ROWS_CHUNK ? 1 : PANEL_BYTES / (blocks * 512);
        if (panel < 1) panel = 1;
        uint8_t *buffer = bits == 4 ? thread_buffer((size_t)(panel * blocks * 512)) : NULL;
        for (int64_t p0 = g0; p0 < g1; p0 += panel) {
            const int64_t p1 = p0 + panel < g1 ? p0 + panel : g1;
            int64_t tile_stride;
            const uint8_t *tiles = expanded_tiles(buffer, cells + p0 * blocks * cell_bytes, (p1 - p0) * blocks, bits,
                                                  scales, &tile_stride);
            for (int64_t c0 = 0; c0 < m; c0 += ROWS_CHUNK)
                for (int64_t g = p0; g < p1; g++) {
                    const int64_t j = g * QGROUP;
                    const __mmask16 valid = n - j >= QGROUP ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
                    const __m512 add = bias ? _mm512_maskz_loadu_ps(valid, bias + j) : _mm512_setzero_ps();
                    /* the outputs' lines, owned before the rows are done: a store that misses would hold
                     * up the tile loads behind it */
                    for (int64_t r = c0; r < c0 + ROWS_CHUNK && r < m; r++)
                        _m_prefetchw((char *)y + (r * y_stride + j) * elem);
                    for (int64_t r0 = c0; r0 < c0 + ROWS_CHUNK && r0 < m; r0 += 16)
                        rows_product(y, y_stride, cells + g * blocks * cell_bytes, tiles + (g - p0) * blocks * tile_stride,
                                     tile_stride, j, add, valid, q, dx, s, r0, m, padded_k, bits, scales, bf16);
                }
        }
        _tile_release();
    }
    return 0;
#else
    (void)y; (void)y_stride; (void)cells; (void)bias; (void)q; (void)dx; (void)s; (void)m; (void)padded_k; (void)n;
    (void)bits; (void)scales; (void)bf16;
    return -1;
#endif
}
