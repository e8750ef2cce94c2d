/* Vectors of 16 float32 lanes through GCC/Clang's vector extensions, not intrinsics: the compiler maps them to the
 * widest units -march=native has (one AVX-512 register, two AVX2, four NEON). Shared by the helpers' source files
 * (static inline: each file gets its own copy). */
#ifndef KILN_VEC16_H
#define KILN_VEC16_H

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* the same, for unaligned loads and stores */
typedef int v16i32 __attribute__((vector_size(64)));

static inline v16 splat16(float v) { return (v16){v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v}; }

/* m ? a : b per lane, m a comparison's result (all bits set or none) */
static inline v16 select16(v16i32 m, v16 a, v16 b) { return (v16)((m & (v16i32)a) | (~m & (v16i32)b)); }

/* A convolution's fused activation (kernels.c's conv_activate) on 16 lanes, to the same bits: 0 none, 1 clamp to
 * [lo, hi], 2 hardswish; NaN stays NaN. */
static inline v16 activate16(v16 v, int act, v16 lo, v16 hi) {
    if (act == 1) {
        v = select16(v < lo, lo, v);
        return select16(v > hi, hi, v);
    }
    if (act == 2) {
        v16 h = (v + splat16(3.0f)) * splat16(1.0f / 6.0f);
        h = select16(h < splat16(0.0f), splat16(0.0f), h);
        h = select16(h > splat16(1.0f), splat16(1.0f), h);
        return select16(v != v, v, v * h);
    }
    return v;
}

#endif
