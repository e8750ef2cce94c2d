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

/* The first `count` (0..16) lanes from p, the rest zero / into p, the rest of p untouched: masked loads and stores
 * where the CPU has them (nothing past p + count is touched, so a row's end may be a page's end), else a copy. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16 load16_first(const float *p, int count) {
    return (v16)_mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
}
static inline void store16_first(float *p, v16 v, int count) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1), (__m512)v);
}
#else
static inline v16 load16_first(const float *p, int count) {
    float lanes[16] = {0};
    for (int i = 0; i < count; i++) lanes[i] = p[i];
    v16 v;
    __builtin_memcpy(&v, lanes, sizeof v);
    return v;
}
static inline void store16_first(float *p, v16 v, int count) {
    for (int i = 0; i < count; i++) p[i] = v[i];
}
#endif

/* r[0..15] transposed in place (r[i][j] <-> r[j][i]): four rounds of swapping the off-diagonal blocks of 8, 4, 2
 * and 1 lanes between rows i and i + d, one two-source shuffle per row and round (64 in all, vpermt2ps on
 * AVX-512), where element by element it takes 256 loads and stores. */
#define KILN_LANES(...) __VA_ARGS__
/* the two shuffles of each round, d = 8, 4, 2, 1: the top row's new lanes, then the bottom row's */
#define KILN_TOP8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define KILN_BOTTOM8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define KILN_TOP4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define KILN_BOTTOM4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define KILN_TOP2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define KILN_BOTTOM2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define KILN_TOP1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define KILN_BOTTOM1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define KILN_SWAP_BLOCKS(d, top, bottom)                                                                         \
    for (int i = 0; i < 16; i++)                                                                              \
        if ((i & (d)) == 0) {                                                                                 \
            const v16 a = r[i], b = r[i + (d)];                                                               \
            r[i] = __builtin_shufflevector(a, b, KILN_LANES top);                                             \
            r[i + (d)] = __builtin_shufflevector(a, b, KILN_LANES bottom);                                    \
        }
static inline void transpose16(v16 r[16]) {
    /* top row: its own lanes where lane & d is 0, else the bottom row's lane - d; bottom row: the top's lane + d,
     * else its own */
    KILN_SWAP_BLOCKS(8, (KILN_TOP8), (KILN_BOTTOM8))
    KILN_SWAP_BLOCKS(4, (KILN_TOP4), (KILN_BOTTOM4))
    KILN_SWAP_BLOCKS(2, (KILN_TOP2), (KILN_BOTTOM2))
    KILN_SWAP_BLOCKS(1, (KILN_TOP1), (KILN_BOTTOM1))
}
#undef KILN_SWAP_BLOCKS

/* Sixteen vectors' lane sums in one vector (lane m: v[m]'s), each by the tree j + (j + 8), then + 4, + 2, + 1 (a
 * 16-lane horizontal sum's: attention.c's sum_lanes): each round adds the two shuffles of transpose16's (half its
 * rows' worth), so that an add serves every lane where one sum at a time left most lanes idle (attention's scores
 * 16 keys at a time, qdot.c's 4 x 4 outputs of a pass). */
static inline v16 sum_lanes16(const v16 *v) {
#define KILN_ROUND(a, b, d)                                                                                     \
    (__builtin_shufflevector(a, b, KILN_TOP##d) + __builtin_shufflevector(a, b, KILN_BOTTOM##d))
    v16 l1[8], l2[4], l3[2];
    for (int j = 0; j < 8; j++) l1[j] = KILN_ROUND(v[2 * j], v[2 * j + 1], 8);
    for (int j = 0; j < 4; j++) l2[j] = KILN_ROUND(l1[2 * j], l1[2 * j + 1], 4);
    for (int j = 0; j < 2; j++) l3[j] = KILN_ROUND(l2[2 * j], l2[2 * j + 1], 2);
    const v16 sums = KILN_ROUND(l3[0], l3[1], 1); /* v[4r + i]'s sum in lane 4 p(i) + p(r), p swapping 1 and 2 */
#undef KILN_ROUND
    return __builtin_shufflevector(sums, sums, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}
#undef KILN_TOP8
#undef KILN_BOTTOM8
#undef KILN_TOP4
#undef KILN_BOTTOM4
#undef KILN_TOP2
#undef KILN_BOTTOM2
#undef KILN_TOP1
#undef KILN_BOTTOM1
#undef KILN_LANES
#endif
