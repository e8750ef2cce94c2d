/* A quantized weight's format code as the Python side passes it (native.quant_format): its bits (4 or 8), plus
 * QUANT_OFFSET when the zero array holds additive offsets (W = q * s + o: GGUF's and MLX's form) instead of zero
 * points (W = (q - z) * s: kiln's own export), plus QUANT_REFINE below. Kernels fold either form into one additive
 * term per group. */
#ifndef KILN_QUANT_H
#define KILN_QUANT_H

#include "pool.h"

#define QUANT_OFFSET 256
/* inputs more exact than one rounding to int8 (a language model's logits: quant.py's yields_output). qdot.c rounds
 * them twice, the value and what its rounding left (~2^-14 of the input instead of ~2^-8, twice the integer work on
 * weights read once); an int8 weight on AVX-512 is instead multiplied in float32, its conversion shared by the
 * step's rows (q8_float_rows). */
#define QUANT_REFINE 512
#define QUANT_BITS(format) ((format) & 255)

/* rows [0, rows) of a quantized weight as float32 w [rows, k] (kernels.c) */
void kiln_dequantize_f32(const void *restrict qv, const float *restrict scale, const float *restrict zero,
                         float *restrict w, i64 rows, i64 k, i64 format, i64 group);

/* group g's offset (the offset form; absent: 0) or zero point (absent: 8 for int4, 0 for int8) */
static inline float quant_point(const float *zero, i64 g, i64 format) {
    if (zero) return zero[g];
    return (format & QUANT_OFFSET) || QUANT_BITS(format) != 4 ? 0.0f : 8.0f;
}

/* b of W = q * s + b for group g: the offset, or -z * s for a zero point z */
static inline float quant_term(const float *zero, i64 g, float s, i64 format) {
    const float point = quant_point(zero, g, format);
    return format & QUANT_OFFSET ? point : -s * point;
}

/* one weight's value, rounded once in either form (the offset form as GGUF's own dequantization rounds it) */
static inline float quant_value(float q, const float *zero, i64 g, float s, i64 format) {
    const float point = quant_point(zero, g, format);
    return format & QUANT_OFFSET ? q * s + point : (q - point) * s;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* quant_value of 16 weights of one group, point = the group's quant_point */
static inline __m512 quant_value16(__m512 q, __m512 s, __m512 point, i64 format) {
    return format & QUANT_OFFSET ? _mm512_fmadd_ps(q, s, point) : _mm512_mul_ps(_mm512_sub_ps(q, point), s);
}
#endif

#endif
