/* The cell layout of a block-quantised weight, as the native kernels read it.
 *
 * A weight W [n, k] with w[j, i] = scale[j, b] * u[j, i] + offset[j, b] (b = i / 32, u an unsigned
 * byte value; kernels/quantized.py's row layout, which tm_qcells_pack converts from) is held in cells
 * of 16 weight rows ("a group") x 32 input features (one block), ordered [group][block]. Rows are
 * padded to whole groups with zero cells, features to padded_k (a multiple of 64) as in the row layout.
 * A cell holds its data, then the 16 rows' scales, then their offsets (float16 when `scales` has
 * QS_HALF, else float32), then, when `scales` has QS_SUB (int8 data only), 32 signed bytes: the
 * sub-scale of features [16 f, 16 f + 16) of row r at byte 16 f + r, which multiplies the row's value
 * there, w = sub * (scale * u + offset):
 *   int8 (512 data bytes): 8 chunks of 64 bytes; byte 4r + e of chunk c is u[r][4c + e];
 *   int4 (256 data bytes): 4 chunks of 64 bytes; byte 4r + e of chunk c holds u[r][4c + e] in its low
 *        nibble and u[r][16 + 4c + e] in its high nibble.
 * So one 64-byte load (after masking the nibbles) gives 4 features of 16 rows, lane r for row r: the
 * operand of one vpdpbusd against 4 broadcast input bytes, each lane accumulating one output.
 */
#ifndef TOKENMILL_QUANT_CELLS_H
#define TOKENMILL_QUANT_CELLS_H

#include <stdint.h>

#include "cpu_common.h"
#ifdef __F16C__
#include <immintrin.h>
#endif

#define QBLOCK 32
#define QPAIR 64
#define QGROUP 16
#define QSUB 16  /* features per sub-scale */
/* flags of a cell's `scales` */
#define QS_HALF 1  /* scales and offsets are float16, else float32 */
#define QS_SUB 2   /* int8 sub-scales follow the offsets */

static inline int64_t qcell_data_bytes(int bits) { return QGROUP * QBLOCK * bits / 8; }

static inline int64_t qcell_scale_bytes(int scales) { return (scales & QS_HALF) ? 2 : 4; }

static inline int64_t qcell_bytes(int bits, int scales) {
    return qcell_data_bytes(bits) + 2 * QGROUP * qcell_scale_bytes(scales) + ((scales & QS_SUB) ? 2 * QGROUP : 0);
}

/* The cell's sub-scales: byte 16 f + r for row r, features [16 f, 16 f + 16). */
static inline const int8_t *qcell_subs(const uint8_t *cell, int bits, int scales) {
    return (const int8_t *)(cell + qcell_data_bytes(bits) + 2 * QGROUP * qcell_scale_bytes(scales));
}

static inline int64_t qpadded_k(int64_t k) { return (k + QPAIR - 1) / QPAIR * QPAIR; }

static inline int64_t qgroups(int64_t n) { return (n + QGROUP - 1) / QGROUP; }

/* The cell of weight rows [16 g, 16 g + 16) and features [32 b, 32 b + 32). */
static inline const uint8_t *qcell(const uint8_t *cells, int64_t g, int64_t b, int64_t blocks, int bits, int scales) {
    return cells + (g * blocks + b) * qcell_bytes(bits, scales);
}

/* The byte of a cell that holds u[r][i], i < 32 (for int4, in its low nibble when i < 16, else in its
 * high nibble). */
static inline int64_t qcell_byte(int bits, int r, int i) {
    return (bits == 8 ? i / 4 : (i % 16) / 4) * 64 + 4 * r + i % 4;
}

/* u[r][i] of a cell, i < 32. */
static inline int qcell_value(const uint8_t *cell, int bits, int r, int i) {
    const uint8_t byte = cell[qcell_byte(bits, r, i)];
    return bits == 8 ? byte : i < 16 ? byte & 0x0f : byte >> 4;
}

/* Row r's scale (`which` 0) or offset (1) in a cell, as float32. */
static inline float qcell_scale(const uint8_t *cell, int bits, int scales, int which, int r) {
    const uint8_t *base = cell + qcell_data_bytes(bits) + which * QGROUP * qcell_scale_bytes(scales);
#ifdef __F16C__
    return (scales & QS_HALF) ? _cvtsh_ss(((const uint16_t *)base)[r]) : ((const float *)base)[r];
#else
    return (scales & QS_HALF) ? f16_to_f32(((const uint16_t *)base)[r]) : ((const float *)base)[r];
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* A cell's 16 scales or offsets (float16 with QS_HALF, else float32) as float32 lanes. */
static inline __m512 load_scales16(const uint8_t *p, const int scales) {
    return (scales & QS_HALF) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}

/* 16 float32 lanes -> bfloat16, rounded to nearest even as f32_to_bf16 rounds. */
static inline __m256i bf16_lanes(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    return bf16_round16(v);
#endif
}
#endif

#endif
