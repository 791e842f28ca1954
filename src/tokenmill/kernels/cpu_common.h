/* Helpers shared by tokenmill's C kernels: bfloat16 <-> float32 as PyTorch converts them. */
#ifndef TOKENMILL_CPU_COMMON_H
#define TOKENMILL_CPU_COMMON_H
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

#endif
