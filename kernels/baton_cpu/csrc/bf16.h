/* bfloat16 <-> float32 for the CPU kernels (included by the C files under engine/;
 * `engine/native.py` rebuilds a kernel when this header changes too). */
#ifndef BATON_BF16_H
#define BATON_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)h) << 16;
    return v.f;
}

/* Round to nearest even, as torch does; inf and nan pass through. */
static inline uint16_t bf16_round(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7f800000u) == 0x7f800000u) return (uint16_t)(v.u >> 16);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#endif
