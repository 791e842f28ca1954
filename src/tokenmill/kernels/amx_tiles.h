/* What every AMX kernel shares: whether AMX is compiled in (TM_AMX), and the one tile shape they use.
 * Every tile is 16 rows of 64 bytes: 16 x 32 bfloat16 (A and B operands) or 16 x 16 float32 (C). */
#ifndef TOKENMILL_AMX_TILES_H
#define TOKENMILL_AMX_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TM_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tm_tile_config;

/* Configure the calling thread's 8 tiles as 16 rows x 64 bytes (palette 1); _tile_release() when done. */
static inline void tm_configure_tiles(void) {
    tm_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

/* The B tile of 16 rows of 32 bfloat16, row j giving the tile's column j: tile[kp][j][e] = rows[j][2 kp + e]
 * (a 16 x 16 transpose of bfloat16 pairs). A NULL row reads as zeros. */
static inline void tm_rows_to_b_tile(uint16_t *tile, const uint16_t *const rows[16]) {
    __m512i r[16];
    for (int j = 0; j < 16; j++) r[j] = rows[j] ? _mm512_loadu_si512(rows[j]) : _mm512_setzero_si512();
    tm_transpose16(r);
    for (int kp = 0; kp < 16; kp++) _mm512_store_si512((__m512i *)(tile + kp * 32), r[kp]);
}
#endif

#endif
