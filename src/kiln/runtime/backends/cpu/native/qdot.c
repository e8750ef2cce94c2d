/* Quantized linear for few rows (a decode step) by integer dot products, as llama.cpp runs its quantized types
 * on the CPU: each input row is quantized to int8 in blocks of 32 (one float scale per block, max |x| -> 127),
 * and each block's products with int4 or int8 weights are summed exactly in int32 by the CPU's byte dot product
 * (AVX-512 VNNI's vpdpbusd, 32 products a 256-bit instruction, 64 a 512-bit one for int4 where AVX-512BW is there
 * too; AVX2's vpmaddubsw + vpmaddwd where VNNI is missing, the same integers). The float kernel in kernels.c converts every weight to float and spends about
 * four vector instructions per 8 weights; this spends about one per 6 and reads the same bytes, so a decode
 * step on one core stops being bound by arithmetic.
 *
 *   out[r][o] = sum_g s[o][g] * (sum_{b in g} d[r][b] * sum_{j in b} q[o][j] xq[r][j]  -  z[o][g] * xz[r][g])
 *
 * with xz[r][g] = sum_{b in g} d[r][b] * sum_{j in b} xq[r][j] (the zero point's term from the same quantized
 * input, so the error is that of (q - z) x, centred, not of q x). The result differs from the float kernel by
 * the input's rounding to 8 bits (about 0.3% of a typical output; the int4 weights' own rounding is ~10x that):
 * quantized programs accept it by default, KILN_QUANT_DOT=float turns it off (native/__init__.py).
 *
 * Shapes taken: k a multiple of 64 (int4) or 32 (int8), groups of 32 or a multiple of 64 (int4) or of 32
 * (int8); anything else returns 0 and the caller runs the float kernel. Each output is computed the same way
 * whatever the batch, the row's place in it or the thread count, so results do not depend on any of them.
 */
#include "pool.h"
#include "quant.h"
#include "vec16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdlib.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QDOT_LEVEL 2
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define QDOT_LEVEL 2
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define QDOT_LEVEL 1
/* u8 x s8 pairs to int16 (never saturating here: |u| <= 128 and |s| <= 127 by construction), then to int32 */
static inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

/* acc + u1 . s1 + u2 . s2 for int4 weights (u1, u2 at most 15): on AVX2 the two byte products are added as int16
 * (each pair sum at most 2 * 15 * 127 = 3810, two of them 7620: no saturation) and widened once, one
 * vpmaddwd and one add fewer than two dot_u8s8; the integers are the same either way */
static inline __m256i dot2_u4s8(__m256i acc, __m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#if QDOT_LEVEL == 2
    return dot_u8s8(dot_u8s8(acc, u1, s1), u2, s2);
#else
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

#define QDOT_ROWS 4 /* weight rows a pass: each input vector loaded once feeds four dot products */
#define AHEAD 4     /* passes ahead that the weights are prefetched */
#define QDOT_INPUTS 4 /* input rows an int4 pass multiplies each unpacked weight vector into */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* int4 products 128 weights a 512-bit step (q4_rows): the inputs' codes laid out by 128 (quantize_row) */
#define Q4_WIDE 1
#else
#define Q4_WIDE 0
#endif

static inline float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

static inline int hsum8i(__m256i v) {
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xb1)));
}

/* One input row to int8 blocks of 32: xq (k bytes), d (k / 32 scales) and xz (k / group zero-point sums). For
 * int4 (split) each 64 bytes are reordered to the even elements, then the odd ones: a weight byte's low nibble
 * is element 2j and its high nibble 2j + 1, so the nibbles unpacked side by side meet the inputs in that order. */
static int quantize_row(const float *restrict x, i64 k, i64 group, int split, signed char *restrict xq,
                        float *restrict d, float *restrict xz, float *restrict residual) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (i64 g = 0; g < k / group; g++) xz[g] = 0.0f;
    for (i64 b = 0; b < k / 32; b++) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q)); /* (max_ps drops NaN) */
        }
        if (_mm256_movemask_ps(nan)) return 0;
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        if (!(top <= 3.0e38f)) return 0; /* inf: the float kernel gives it (and NaN) their meaning */
        const float scale = top / 127.0f;
        const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
        if (residual) /* what the rounding left: x - scale * q (QUANT_REFINE rounds it again) */
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(residual + 32 * b + 8 * j,
                                 _mm256_sub_ps(v[j], _mm256_mul_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(i[j]))));
        const int total = hsum8i(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
        /* packs interleave 128-bit lanes: the permute puts the 32 bytes back in element order */
        const __m256i packed = _mm256_permutevar8x32_epi32(
            _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])),
            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(xq + 32 * b), packed);
        d[b] = scale;
        xz[32 * b / group] += scale * (float)total;
    }
    if (!split) return 1;
    const __m256i gather = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    /* by 64 (blocks 2c, 2c + 1): [E 2c | E 2c+1 | O 2c | O 2c+1], E the evens' 16 codes and O the odds'; by 128
     * (Q4_WIDE, blocks 4c'..4c'+3, every whole 128 of k): the four blocks' evens, then their odds. In place: the
     * 64-chunks of a 128 are both read before either is written. */
    const i64 wide = Q4_WIDE ? k / 128 * 2 : 0; /* 64-chunks laid out by 128 */
    for (i64 c = 0; c < k / 64; c += c < wide ? 2 : 1) {
        __m256i evens[2], odds[2];
        const int chunks = c < wide ? 2 : 1;
        for (int h = 0; h < chunks; h++) {
            /* per half: [evens | odds] of its 32 bytes; then the evens of both halves, then the odds */
            const signed char *at = xq + 64 * (c + h);
            const __m256i a = _mm256_permute4x64_epi64(
                _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)at), gather), 0xd8);
            const __m256i b = _mm256_permute4x64_epi64(
                _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(at + 32)), gather), 0xd8);
            evens[h] = _mm256_permute2x128_si256(a, b, 0x20);
            odds[h] = _mm256_permute2x128_si256(a, b, 0x31);
        }
        for (int h = 0; h < chunks; h++) {
            _mm256_storeu_si256((__m256i *)(xq + 64 * c + 32 * h), evens[h]);
            _mm256_storeu_si256((__m256i *)(xq + 64 * c + 32 * chunks + 32 * h), odds[h]);
        }
    }
    return 1;
}

/* the scales (or zero points) of the rows a pass AHEAD reads: a few lines, fetched once a pass */
static inline void prefetch_rows(const float *p, i64 count) {
    for (i64 byte = 0; byte < 4 * count; byte += 64) _mm_prefetch((const char *)p + byte, _MM_HINT_T0);
}

/* out[i] (i < R) = the lanes of total[i], plus the groups' additive terms (quant.h's quant_term) times their input
 * sums, plus the bias. The terms are summed 8 groups a vector into total's own vector (one horizontal sum for both),
 * and not at all where every one is 0 (int8 without zero points: the LM head's bits are unchanged); with 4 rows the
 * four horizontal sums are taken together (two rounds of pairwise adds for the four). Summed one group at a time the
 * terms were a chain of 18-48 dependent adds an output, a fifth to a third of the few-row linears' time; summed 8 a
 * vector but each output's terms and total apart, still ~1/4 of SmolLM2's int4 layers (K = 576; measured against
 * the terms left out), of which taking them together saves about half. */
static inline void finish_rows(__m256 *total, const int R, const float *restrict s, const float *restrict z,
                               i64 format, const float *restrict xz, i64 ngroups, const float *restrict bias,
                               float *restrict out) {
    const int offset = (format & QUANT_OFFSET) != 0;
    if (z || quant_point(z, 0, format) != 0.0f) { /* (otherwise every term is 0) */
        const __m256 absent = _mm256_set1_ps(quant_point(z, 0, format)), minus = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < R; i++) {
            const float *si = s + i * ngroups, *zi = z ? z + i * ngroups : 0;
            __m256 sum = total[i];
            i64 g = 0;
            for (; g + 8 <= ngroups; g += 8) {
                const __m256 zv = zi ? _mm256_loadu_ps(zi + g) : absent;
                const __m256 t = offset ? zv : _mm256_mul_ps(_mm256_xor_ps(_mm256_loadu_ps(si + g), minus), zv);
                sum = _mm256_fmadd_ps(t, _mm256_loadu_ps(xz + g), sum);
            }
            if (g < ngroups) { /* the last ngroups % 8 */
#if defined(__AVX512VL__)
                const __mmask8 live = (__mmask8)((1u << (ngroups - g)) - 1u);
                const __m256 zv = zi ? _mm256_maskz_loadu_ps(live, zi + g) : _mm256_maskz_mov_ps(live, absent);
                const __m256 t = offset ? zv
                                        : _mm256_mul_ps(_mm256_xor_ps(_mm256_maskz_loadu_ps(live, si + g), minus), zv);
                sum = _mm256_fmadd_ps(t, _mm256_maskz_loadu_ps(live, xz + g), sum);
#else
                float rest = 0.0f;
                for (; g < ngroups; g++) rest += quant_term(zi, g, si[g], format) * xz[g];
                sum = _mm256_add_ps(sum, _mm256_setr_ps(rest, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f));
#endif
            }
            total[i] = sum;
        }
    }
    if (R == 4) {
        const __m256 a = _mm256_hadd_ps(total[0], total[1]), b = _mm256_hadd_ps(total[2], total[3]);
        const __m256 c = _mm256_hadd_ps(a, b); /* lanes 0-3: rows 0-3's low halves; 4-7: their high halves */
        __m128 sums = _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
        if (bias) sums = _mm_add_ps(sums, _mm_loadu_ps(bias));
        _mm_storeu_ps(out, sums);
        return;
    }
    for (int i = 0; i < R; i++) out[i] = hsum8(total[i]) + (bias ? bias[i] : 0.0f);
}

/* The scale of 64-chunk c's two 32-blocks as [s 2c x4, s 2c+1 x4] (groups of 32, `pairs`), or its group's. */
static inline __m256 q4_scale64(const float *restrict s, i64 c, i64 group, const int pairs) {
    return pairs ? _mm256_set_m128(_mm_set1_ps(s[2 * c + 1]), _mm_set1_ps(s[2 * c])) : _mm256_set1_ps(s[64 * c / group]);
}

#if Q4_WIDE
/* q4_rows' 512-bit step: 64-chunks c and c + 1 (blocks 2c..2c+3, the inputs' codes laid out by 128: evens at 64 c,
 * odds at 64 c + 64) into wide[r][i], lanes 4b..4b+3 block 2c + b; or (`tail`) chunk c alone (laid out by 64: evens
 * at 64 c, odds at 64 c + 32) in the low half, the high half's codes, scales and so products zero. */
static inline __attribute__((always_inline)) void q4_wide_step(__m512 (*wide)[QDOT_ROWS], const char *restrict work,
                                                               i64 stride, const int M,
                                                               const unsigned char *restrict q,
                                                               const float *restrict scale, i64 ngroups, i64 k,
                                                               i64 group, const int R, const int pairs, i64 c,
                                                               const char *next, const int tail) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __mmask16 blocks = tail ? 0x3 : 0xF;
    for (int line = 0; line < (tail ? 1 : 2) * (R / 2 + 1); line++)
        _mm_prefetch(next + (R / 2 + 1) * 64 * c + 64 * line, _MM_HINT_T0);
    __m512 sv[QDOT_ROWS], dv[QDOT_INPUTS];
    for (int i = 0; i < R; i++) {
        const float *s = scale + i * ngroups;
        sv[i] = pairs ? _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(blocks, s + 2 * c))
                      : _mm512_insertf32x8(_mm512_set1_ps(s[64 * c / group]),
                                           _mm256_set1_ps(s[(tail ? 64 * c : 64 * (c + 1)) / group]), 1);
    }
    for (int r = 0; r < M; r++)
        dv[r] = _mm512_permutexvar_ps(spread,
                                      _mm512_maskz_loadu_ps(blocks, (const float *)(work + r * stride + k) + 2 * c));
    for (int i = 0; i < R; i++) {
        const unsigned char *qi = q + i * (k / 2) + 32 * c;
        const __m512i b = tail ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)qi))
                               : _mm512_loadu_si512((const void *)qi);
        const __m512i lo = _mm512_and_si512(b, low), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
        for (int r = 0; r < M; r++) {
            const signed char *xq = (const signed char *)(work + r * stride) + 64 * c;
            const __m512i xe = tail ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)xq))
                                    : _mm512_loadu_si512((const void *)xq);
            const __m512i xo = tail ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(xq + 32)))
                                    : _mm512_loadu_si512((const void *)(xq + 64));
            const __m512i acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
            wide[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dv[r], sv[i]), wide[r][i]);
        }
    }
}

/* v's 16 lanes summed by sum_lanes16's tree: j + (j + 8), then + 4, + 2, + 1 */
static inline float sum16(__m512 v) {
    const __m256 t1 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 t2 = _mm_add_ps(_mm256_castps256_ps128(t1), _mm256_extractf128_ps(t1, 1));
    const __m128 t3 = _mm_add_ps(t2, _mm_movehl_ps(t2, t2));
    return _mm_cvtss_f32(_mm_add_ss(t3, _mm_movehdup_ps(t3)));
}

/* out[r * n + i] for the wide sums: each of wide[r][i]'s 16 lanes summed, plus the groups' additive terms
 * (quant_term) times their input sums, plus the bias. The terms go into the wide sums 16 groups a vector before
 * they are reduced (one reduction for both), and the M x R sums are reduced together (vec16.h's sum_lanes16: two
 * vectors into one by a pair of permutes and an add, level by level): 46 instructions for 16 outputs where
 * folding each to 8 lanes and taking four horizontal sums a row took 76, and the terms 32
 * multiply-adds and 16 loads where 8 groups a vector took 48 and 96. Each output is still one fixed tree of adds
 * over its own lanes, the same whatever M, R or the thread count. */
static inline __attribute__((always_inline)) void q4_wide_finish(__m512 (*wide)[QDOT_ROWS], const int M, const int R,
                                                                 const float *restrict s, const float *restrict z,
                                                                 i64 format, const char *restrict work, i64 stride,
                                                                 i64 k, i64 ngroups, const float *restrict bias,
                                                                 float *restrict out, i64 n) {
    if (z || quant_point(z, 0, format) != 0.0f) { /* (otherwise every term is 0) */
        const int offset = (format & QUANT_OFFSET) != 0;
        const __m512 absent = _mm512_set1_ps(quant_point(z, 0, format)), minus = _mm512_set1_ps(-0.0f);
        for (i64 g = 0; g < ngroups; g += 16) {
            const __mmask16 live = ngroups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (ngroups - g)) - 1u);
            __m512 t[QDOT_ROWS];
            for (int i = 0; i < R; i++) {
                const __m512 zv = z ? _mm512_maskz_loadu_ps(live, z + i * ngroups + g) : _mm512_maskz_mov_ps(live, absent);
                t[i] = offset ? zv
                              : _mm512_mul_ps(_mm512_xor_ps(_mm512_maskz_loadu_ps(live, s + i * ngroups + g), minus), zv);
            }
            for (int r = 0; r < M; r++) {
                const __m512 xz = _mm512_maskz_loadu_ps(live, (const float *)(work + r * stride + k) + k / 32 + g);
                for (int i = 0; i < R; i++) wide[r][i] = _mm512_fmadd_ps(t[i], xz, wide[r][i]);
            }
        }
    }
    if (R == QDOT_ROWS && M == QDOT_INPUTS) {
        v16 sums[QDOT_INPUTS * QDOT_ROWS];
        for (int r = 0; r < QDOT_INPUTS; r++)
            for (int i = 0; i < QDOT_ROWS; i++) sums[QDOT_ROWS * r + i] = (v16)wide[r][i];
        const __m512 ordered = (__m512)sum_lanes16(sums); /* lane 4 r + i: output (r, i) */
        const __m128 b = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
        _mm_storeu_ps(out, _mm_add_ps(_mm512_castps512_ps128(ordered), b));
        _mm_storeu_ps(out + n, _mm_add_ps(_mm512_extractf32x4_ps(ordered, 1), b));
        _mm_storeu_ps(out + 2 * n, _mm_add_ps(_mm512_extractf32x4_ps(ordered, 2), b));
        _mm_storeu_ps(out + 3 * n, _mm_add_ps(_mm512_extractf32x4_ps(ordered, 3), b));
        return;
    }
    for (int r = 0; r < M; r++)
        for (int i = 0; i < R; i++) out[r * n + i] = sum16(wide[r][i]) + (bias ? bias[i] : 0.0f);
}
#endif

/* int4 weight rows o..o+R-1 against M input rows (the work area's rows, `stride` bytes apart: quantize_row's
 * layout), outputs out[r * n + i]. Each 64 weights (32 bytes) are unpacked to their low nibbles (the even elements of
 * both 32-blocks) and high nibbles (the odd ones) once for the M rows: two dot products into one int32 vector whose
 * lanes 0-3 hold block 2c and lanes 4-7 block 2c + 1, scaled by [d 2c x4, d 2c+1 x4] times the weight scale (with
 * groups of 32, [s 2c x4, s 2c+1 x4]). Per 64 weights and row the unpack's 3 instructions and the scale's broadcast
 * are shared by the M rows and the input's scale by the R weight rows: ~6 vector instructions a row where one row
 * at a time took ~9. With Q4_WIDE the same 128 weights at a time in 512-bit vectors (four blocks, lanes 4b..4b+3
 * block b), half the instructions: 1.5-1.8x in a harness at 4 rows (3.8 -> 2.1-2.4 cycles per 64 weights and row
 * at K = 512-1536); the last 64 of a K that is not a multiple of 128 in a step's low half, and the wide sums
 * folded into 256-bit ones for the finish. Each output's arithmetic is the same whatever M. */
static inline __attribute__((always_inline)) void q4_rows(const char *restrict work, i64 stride, const int M,
                                                          const unsigned char *restrict q,
                                                          const float *restrict scale, const float *restrict zero,
                                                          const float *restrict bias, float *restrict out, i64 n,
                                                          i64 k, i64 group, i64 format, const int R,
                                                          const int pairs) {
    const i64 ngroups = k / group;
    /* the weights of the blocks AHEAD passes on (rows o+R*AHEAD..) stream in while this one computes: the
     * hardware prefetcher alone left a decode step's layers at 6-11 GB/s of the core's ~27 */
    const char *next = (const char *)q + AHEAD * R * (k / 2);
    prefetch_rows(scale + AHEAD * R * ngroups, R * ngroups);
    if (zero) prefetch_rows(zero + AHEAD * R * ngroups, R * ngroups);
    i64 c = 0;
#if Q4_WIDE
    __m512 wide[QDOT_INPUTS][QDOT_ROWS];
    for (int r = 0; r < M; r++)
        for (int i = 0; i < R; i++) wide[r][i] = _mm512_setzero_ps();
    for (; c + 2 <= k / 64; c += 2)
        q4_wide_step(wide, work, stride, M, q, scale, ngroups, k, group, R, pairs, c, next, 0);
    if (c < k / 64) /* the last 64 (laid out by 64) in the low half, the high half zero */
        q4_wide_step(wide, work, stride, M, q, scale, ngroups, k, group, R, pairs, c, next, 1);
    q4_wide_finish(wide, M, R, scale, zero, format, work, stride, k, ngroups, bias, out, n);
#else
    __m256 total[QDOT_INPUTS][QDOT_ROWS];
    const __m256i low = _mm256_set1_epi8(15);
    for (int r = 0; r < M; r++)
        for (int i = 0; i < R; i++) total[r][i] = _mm256_setzero_ps();
    for (; c < k / 64; c++) {
        for (int line = 0; line < R / 2 + 1; line++)
            _mm_prefetch(next + (R / 2 + 1) * 64 * c + 64 * line, _MM_HINT_T0);
        __m256 sv[QDOT_ROWS], dv[QDOT_INPUTS];
        for (int i = 0; i < R; i++) sv[i] = q4_scale64(scale + i * ngroups, c, group, pairs);
        for (int r = 0; r < M; r++) {
            const float *d = (const float *)(work + r * stride + k);
            dv[r] = _mm256_set_m128(_mm_set1_ps(d[2 * c + 1]), _mm_set1_ps(d[2 * c]));
        }
        for (int i = 0; i < R; i++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(q + i * (k / 2) + 32 * c));
            const __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
            for (int r = 0; r < M; r++) {
                const signed char *xq = (const signed char *)(work + r * stride);
                const __m256i acc = dot2_u4s8(_mm256_setzero_si256(), lo,
                                              _mm256_loadu_si256((const __m256i *)(xq + 64 * c)), hi,
                                              _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32)));
                total[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(dv[r], sv[i]), total[r][i]);
            }
        }
    }
    for (int r = 0; r < M; r++) {
        const float *xz = (const float *)(work + r * stride + k) + k / 32;
        finish_rows(total[r], R, scale, zero, format, xz, ngroups, bias, out + r * n);
    }
#endif
}

/* int8 weight rows o..o+R-1 for one input row, a 32-block at a time: |w| (unsigned) times x with w's sign, so
 * the unsigned-by-signed product is w x; per group the blocks' sums, scaled by d, are then scaled by s. */
static inline __attribute__((always_inline)) void q8_rows(const signed char *restrict xq, const float *restrict d,
                                                          const float *restrict xz, const signed char *restrict q,
                                                          const float *restrict scale, const float *restrict zero,
                                                          const float *restrict bias, float *restrict out, i64 k,
                                                          i64 group, i64 format, const int R) {
    const i64 ngroups = k / group;
    __m256 total[QDOT_ROWS];
    for (int i = 0; i < R; i++) total[i] = _mm256_setzero_ps();
    /* as q4_rows: the rows AHEAD passes on stream in, R * 32 bytes a block, as fast as these are read */
    const char *next = (const char *)q + AHEAD * R * k;
    prefetch_rows(scale + AHEAD * R * ngroups, R * ngroups);
    if (zero) prefetch_rows(zero + AHEAD * R * ngroups, R * ngroups);
    for (i64 g = 0; g < ngroups; g++) {
        __m256 sum[QDOT_ROWS];
        for (int i = 0; i < R; i++) sum[i] = _mm256_setzero_ps();
        for (i64 b = g * group / 32; b < (g + 1) * group / 32; b++) {
            for (int line = 0; line < (R + 1) / 2; line++) _mm_prefetch(next + R * 32 * b + 64 * line, _MM_HINT_T0);
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
            const __m256 dv = _mm256_set1_ps(d[b]);
            for (int i = 0; i < R; i++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + i * k + 32 * b));
                const __m256i acc = dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
                sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), dv, sum[i]);
            }
        }
        for (int i = 0; i < R; i++)
            total[i] = _mm256_fmadd_ps(sum[i], _mm256_set1_ps(scale[i * ngroups + g]), total[i]);
    }
    finish_rows(total, R, scale, zero, format, xz, ngroups, bias, out);
}

typedef struct {
    const void *q;
    const float *scale, *zero, *bias;
    float *out;
    const char *work;
    i64 m, n, k, format, group, stride;
} qdot_args;

/* out[r * n + i] (r < M, i < R) = weight rows o.. times input rows r0.. of the work area (quantize_row's layout) */
static inline void rows_times(const qdot_args *a, i64 o, int R, i64 r0, int M, const float *bias, float *out) {
    const i64 k = a->k, group = a->group, ngroups = k / group, n = a->n;
    const float *s = a->scale + o * ngroups, *z = a->zero ? a->zero + o * ngroups : 0;
    const char *work = a->work + r0 * a->stride;
    const i64 f = a->format;
    if (QUANT_BITS(f) == 4) {
        const unsigned char *q = (const unsigned char *)a->q + o * (k / 2);
        const i64 st = a->stride;
#define Q4_ROWS(M_, R_, PAIRS) q4_rows(work, st, M_, q, s, z, bias, out, n, k, group, f, R_, PAIRS)
#define Q4_BY_ROWS(M_)                                                                                                \
    (R == QDOT_ROWS ? (group == 32 ? Q4_ROWS(M_, QDOT_ROWS, 1) : Q4_ROWS(M_, QDOT_ROWS, 0))                           \
                    : (group == 32 ? Q4_ROWS(M_, 1, 1) : Q4_ROWS(M_, 1, 0)))
        switch (M) {
        case 4: Q4_BY_ROWS(4); break;
        case 3: Q4_BY_ROWS(3); break;
        case 2: Q4_BY_ROWS(2); break;
        default: Q4_BY_ROWS(1); break;
        }
#undef Q4_BY_ROWS
#undef Q4_ROWS
        return;
    }
    const signed char *q = (const signed char *)a->q + o * k;
    for (int r = 0; r < M; r++) {
        const signed char *xq = (const signed char *)(work + r * a->stride);
        const float *d = (const float *)(xq + k), *xz = d + k / 32;
        if (R == QDOT_ROWS) q8_rows(xq, d, xz, q, s, z, bias, out + r * n, k, group, f, QDOT_ROWS);
        else q8_rows(xq, d, xz, q, s, z, bias, out + r * n, k, group, f, 1);
    }
}

/* weight rows [begin * QDOT_ROWS, end * QDOT_ROWS) for every input row, QDOT_INPUTS rows at a time; the last
 * n % QDOT_ROWS weight rows one by one. With QUANT_REFINE the work area holds two quantized rows per input row (the
 * value, then its residual): the second product, without the bias, is added while the weight rows are still in L1. */
static void qdot_part(const void *ctx, i64 begin, i64 end) {
    const qdot_args *a = ctx;
    const i64 n = a->n;
    const i64 stop = end * QDOT_ROWS < n ? end * QDOT_ROWS : n;
    const int refine = (a->format & QUANT_REFINE) != 0;
    for (i64 o = begin * QDOT_ROWS; o < stop;) {
        const int R = o + QDOT_ROWS <= stop ? QDOT_ROWS : 1;
        const float *bias = a->bias ? a->bias + o : 0;
        if (!refine) {
            for (i64 r0 = 0; r0 < a->m; r0 += QDOT_INPUTS) {
                const int M = a->m - r0 < QDOT_INPUTS ? (int)(a->m - r0) : QDOT_INPUTS;
                rows_times(a, o, R, r0, M, bias, a->out + r0 * n + o);
            }
        } else {
            for (i64 r = 0; r < a->m; r++) {
                float *out = a->out + r * n + o;
                float extra[QDOT_ROWS];
                rows_times(a, o, R, 2 * r, 1, bias, out);
                rows_times(a, o, R, 2 * r + 1, 1, 0, extra);
                for (int i = 0; i < R; i++) out[i] += extra[i];
            }
        }
        o += R;
    }
}
#endif

/* ---- int4 and int8 weights laid out one block of 32 a lane (the CPU backend's packed form, made once per
 * weight: kiln_qlanes_pack; groups of 32 or a larger power of two) ----
 *
 * q4_rows multiplies the weights as the program stores them: a 512-bit product holds four blocks, four lanes each,
 * so every 128 weights and row cost a conversion to float, a scale product and a multiply-add beside the two dot
 * products. Here the weights are rearranged once so that lane l of every 512-bit code vector holds four codes of
 * block l: eight dot products accumulate a block's 32 products whole in its lane, and the float work is one
 * conversion, product and multiply-add per 512 weights and row.
 *
 * A pass is 4 weight rows, stored together: their codes (int4: 2k bytes, int8: 4k) chunk by chunk, then their
 * scales [4][k / group], then their points [4][k / group] (quant_point, explicit even where the program has none).
 * Chunks: 16 blocks (512 weights; int4: 256 bytes a row, byte j of its u-th 64 holding elements 8u + j % 4 (low
 * nibble) and 8u + 4 + j % 4 (high) of block j / 4), then 4 blocks (int4: 64 bytes a row, byte j holding elements
 * j % 16 and 16 + j % 16 of block j / 16), then 2 (int4: 32 bytes a row, byte j holding element j of the first block
 * and of the second). int8 codes are stored as the unsigned dot product takes them, q + 128 (its point 128: only
 * symmetric int8 is taken, so the point is exact), each chunk already in the order its int4 codes unpack to: code
 * vector v of a 16-block chunk holds elements 4v..4v+3 of block l in lane l. The input's codes follow the same
 * order (lanes_codes). */
#define LANE_CODE_BYTES(k, bits) ((bits) == 4 ? 2 * (k) : 4 * (k)) /* of a pass */
#define LANE_POINTS_OFFSET(k, group, bits) (LANE_CODE_BYTES(k, bits) + 16 * ((k) / (group)))
#define LANE_PASS_BYTES(k, group, bits) (LANE_CODE_BYTES(k, bits) + 32 * ((k) / (group)))

/* whether the form holds [n, k] in groups of `group`: whole passes, whole 64s, groups a power of two >= 32 */
static inline int lanes_shapes(i64 n, i64 k, i64 group) {
    return n % 4 == 0 && k % 64 == 0 && group >= 32 && (group & (group - 1)) == 0 && k % group == 0;
}

/* the (block, element) of an int4 chunk's code byte j's low (hi = 0) or high nibble, its chunk of W blocks at
 * block b0; an int8 chunk's byte 64 v + j is the int4 chunk's code vector v's byte j: lane_element(b0, W, 64
 * (v / 2) + j, v % 2) for 16 blocks, (b0, W, j, v) for 4, (b0, W, j % 32, j / 32) for 2 */
static inline i64 lane_element(i64 b0, int W, i64 j, int hi) {
    if (W == 16) return 32 * (b0 + j % 64 / 4) + 8 * (j / 64) + 4 * hi + j % 4;
    if (W == 4) return 32 * (b0 + j / 16) + 16 * hi + j % 16;
    return 32 * (b0 + hi) + j;
}

/* the width of the chunk at block b0 of a row of ng blocks */
static inline int lane_width(i64 b0, i64 ng) { return ng - ng % 16 > b0 ? 16 : ng - ng % 4 > b0 ? 4 : 2; }

/* the element an int8 chunk's code byte b holds (see lane_element) */
static inline i64 lane_element8(i64 b0, int W, i64 b) {
    const i64 v = b / 64, j = b % 64;
    return W == 16 ? lane_element(b0, W, 64 * (v / 2) + j, (int)(v % 2))
                   : W == 4 ? lane_element(b0, W, j, (int)v) : lane_element(b0, W, j % 32, (int)(j / 32));
}

/* whether the form takes weights of this format: int4 in either form, int8 symmetric (its point 128 exact) */
static inline int lanes_format(i64 format, const float *zero) {
    return QUANT_BITS(format) == 4 || (QUANT_BITS(format) == 8 && !zero && !(format & QUANT_OFFSET));
}

/* The packed form of int4 or int8 weight rows [n, k] (lanes_shapes, lanes_format) into out (n / 4 *
 * LANE_PASS_BYTES(k, group, bits) bytes); 0 where the shapes or the format do not allow it */
i64 kiln_qlanes_pack(const unsigned char *restrict q, const float *restrict scale, const float *restrict zero,
                     i64 n, i64 k, i64 format, i64 group, unsigned char *restrict out) {
    const int bits = (int)QUANT_BITS(format);
    if (!lanes_shapes(n, k, group) || !lanes_format(format, zero)) return 0;
    const i64 nb = k / 32, ng = k / group;
    for (i64 p = 0; p < n / 4; p++) {
        unsigned char *pass = out + p * LANE_PASS_BYTES(k, group, bits);
        float *s = (float *)(pass + LANE_CODE_BYTES(k, bits)), *z = (float *)(pass + LANE_POINTS_OFFSET(k, group, bits));
        unsigned char *c = pass;
        for (i64 b0 = 0; b0 < nb;) {
            const int W = lane_width(b0, nb);
            for (int i = 0; i < 4; i++) {
                const unsigned char *row = q + (4 * p + i) * (k * bits / 8);
                if (bits == 8)
                    for (int b = 0; b < 32 * W; b++) *c++ = (unsigned char)(row[lane_element8(b0, W, b)] ^ 0x80);
                else
                    for (int j = 0; j < 16 * W; j++) {
                        unsigned char byte = 0;
                        for (int hi = 0; hi < 2; hi++) {
                            const i64 e = lane_element(b0, W, j, hi);
                            byte |= (unsigned char)(((row[e / 2] >> (4 * (e & 1))) & 15) << (4 * hi));
                        }
                        *c++ = byte;
                    }
            }
            b0 += W;
        }
        for (int i = 0; i < 4; i++)
            for (i64 g = 0; g < ng; g++) {
                s[i * ng + g] = scale[(4 * p + i) * ng + g];
                z[i * ng + g] = bits == 8 ? 128.0f : quant_point(zero ? zero + (4 * p + i) * ng : 0, g, format);
            }
    }
    return 1;
}

#if Q4_WIDE
/* an input row's natural codes (k bytes) rearranged in place to the chunks' order: in a chunk of 16 blocks, code
 * vector v's lane l is block l's elements 4v..4v+3 (a transpose of the chunk's 32-bit words, 16 blocks x 8); in a
 * chunk of 4, vector v's lanes 4b..4b+3 are block b's elements 16v..16v+15; a chunk of 2 is in natural order */
static void lanes_codes(signed char *restrict xq, i64 k) {
    const i64 ng = k / 32;
    unsigned int chunk[128];
    for (i64 b0 = 0; b0 < ng;) {
        const int W = lane_width(b0, ng);
        if (W == 2) break;
        unsigned int *words = (unsigned int *)(xq + 32 * b0);
        __builtin_memcpy(chunk, words, 32 * W);
        if (W == 16)
            for (int v = 0; v < 8; v++)
                for (int l = 0; l < 16; l++) words[16 * v + l] = chunk[8 * l + v];
        else
            for (int v = 0; v < 2; v++)
                for (int b = 0; b < 4; b++)
                    for (int w = 0; w < 4; w++) words[16 * v + 4 * b + w] = chunk[8 * b + 4 * v + w];
        b0 += W;
    }
}

/* 4 weight rows (one pass) against M input rows of the work area (quantize_row's layout, codes by lanes_codes),
 * outputs out[r * n + i] */
static inline __attribute__((always_inline)) void lanes_rows(const char *restrict work, i64 stride, const int M,
                                                             const unsigned char *restrict pass,
                                                             const float *restrict bias, float *restrict out, i64 n,
                                                             i64 k, i64 group, i64 format, const char *next,
                                                             const int grouped, const int bits) {
    const i64 nb = k / 32, ng = k / group, per = group / 32;
    const float *s = (const float *)(pass + LANE_CODE_BYTES(k, bits));
    const float *z = (const float *)(pass + LANE_POINTS_OFFSET(k, group, bits));
    /* the pass two on, fetched into L2 while this one computes (the L1's prefetcher takes it from there). Into L1
     * (T0) its fills held the L1's few miss buffers from the loads (SmolLM2's linears cold, 4 rows 4.57-4.83 ms
     * against 3.97-4.06; 1 row 2.61-2.78 against 2.53); into L3 (T2), or 4 passes on, no better */
    for (i64 line = 0; line < LANE_PASS_BYTES(k, group, bits); line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i shift = _mm_cvtsi64_si128(__builtin_ctzll((unsigned long long)per));
    /* a chunk's weight scales by lane (lane l: block b0 + (l >> spread)): the row's groups from b0's, spread */
#define LANE_SCALES(row, spread)                                                                                  \
    (!grouped && (spread) == 0                                                                                    \
         ? _mm512_loadu_ps((row) + b0)                                                                            \
         : _mm512_permutexvar_ps(                                                                                 \
               _mm512_srl_epi32(_mm512_add_epi32(_mm512_srli_epi32(lane, spread), _mm512_set1_epi32((int)(b0 % per))), \
                                shift),                                                                           \
               _mm512_maskz_loadu_ps((__mmask16)((1u << ((b0 % per + (16 >> (spread)) - 1) / per + 1)) - 1u),        \
                                     (row) + b0 / per)))
    const __m512i low = _mm512_set1_epi8(15);
    __m512 wide[QDOT_INPUTS][QDOT_ROWS];
    for (int r = 0; r < M; r++)
        for (int i = 0; i < QDOT_ROWS; i++) wide[r][i] = _mm512_setzero_ps();
    const unsigned char *c = pass;
    i64 b0 = 0;
    for (; b0 + 16 <= nb; b0 += 16, c += 256 * bits) { /* (4 rows of 16 blocks: 64 bits bytes each) */
        for (int i = 0; i < QDOT_ROWS; i++) {
            /* two sums a row (the low nibbles', the high nibbles'): chains of 4 dot products, interleaved over the
             * rows, where one chain of 8 a row left the products waiting on each other's latency */
            __m512i even[QDOT_INPUTS], odd[QDOT_INPUTS];
            for (int r = 0; r < M; r++) even[r] = odd[r] = _mm512_setzero_si512();
            for (int u = 0; u < 4; u++) {
                __m512i lo, hi;
                if (bits == 8) {
                    lo = _mm512_loadu_si512((const void *)(c + 512 * i + 128 * u));
                    hi = _mm512_loadu_si512((const void *)(c + 512 * i + 128 * u + 64));
                } else {
                    const __m512i b = _mm512_loadu_si512((const void *)(c + 256 * i + 64 * u));
                    lo = _mm512_and_si512(b, low), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
                }
                for (int r = 0; r < M; r++)
                    even[r] = _mm512_dpbusd_epi32(even[r], lo,
                                                  _mm512_loadu_si512((const void *)(work + r * stride + 32 * b0 + 128 * u)));
                for (int r = 0; r < M; r++)
                    odd[r] = _mm512_dpbusd_epi32(odd[r], hi,
                                                 _mm512_loadu_si512((const void *)(work + r * stride + 32 * b0 + 128 * u + 64)));
            }
            const __m512 sv = LANE_SCALES(s + i * ng, 0);
            for (int r = 0; r < M; r++)
                wide[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r])),
                                             _mm512_mul_ps(sv, _mm512_loadu_ps((const float *)(work + r * stride + k) + b0)),
                                             wide[r][i]);
        }
    }
    const __m512i spread4 = _mm512_srli_epi32(lane, 2), spread2 = _mm512_srli_epi32(lane, 3);
    for (; b0 + 4 <= nb; b0 += 4, c += 64 * bits) {
        __m512 dv[QDOT_INPUTS];
        for (int r = 0; r < M; r++)
            dv[r] = _mm512_permutexvar_ps(spread4, _mm512_maskz_loadu_ps(0xF, (const float *)(work + r * stride + k) + b0));
        for (int i = 0; i < QDOT_ROWS; i++) {
            __m512i lo, hi;
            if (bits == 8) {
                lo = _mm512_loadu_si512((const void *)(c + 128 * i));
                hi = _mm512_loadu_si512((const void *)(c + 128 * i + 64));
            } else {
                const __m512i b = _mm512_loadu_si512((const void *)(c + 64 * i));
                lo = _mm512_and_si512(b, low), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            }
            const __m512 sv = LANE_SCALES(s + i * ng, 2);
            for (int r = 0; r < M; r++) {
                const char *xr = work + r * stride + 32 * b0;
                const __m512i acc = _mm512_dpbusd_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512((const void *)xr)), hi,
                    _mm512_loadu_si512((const void *)(xr + 64)));
                wide[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sv, dv[r]), wide[r][i]);
            }
        }
    }
    if (b0 < nb) { /* the last 2 blocks: low nibbles in the low 256 bits, high nibbles in the high */
        const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        __m512 dv[QDOT_INPUTS];
        for (int r = 0; r < M; r++)
            dv[r] = _mm512_permutexvar_ps(spread2, _mm512_maskz_loadu_ps(0x3, (const float *)(work + r * stride + k) + b0));
        for (int i = 0; i < QDOT_ROWS; i++) {
            const __m512i w = bits == 8 ? _mm512_loadu_si512((const void *)(c + 64 * i))
                                        : _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256(
                                                                                 (const __m256i *)(c + 32 * i))),
                                                                             shifts),
                                                           low);
            const __m512 sv = LANE_SCALES(s + i * ng, 3);
            for (int r = 0; r < M; r++) {
                const __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                                        _mm512_loadu_si512((const void *)(work + r * stride + 32 * b0)));
                wide[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sv, dv[r]), wide[r][i]);
            }
        }
    }
#undef LANE_SCALES
    q4_wide_finish(wide, M, QDOT_ROWS, s, z, format, work, stride, k, ng, bias, out, n);
}

typedef struct {
    const unsigned char *packed;
    const float *bias;
    float *out;
    const char *work;
    i64 m, n, k, group, format, stride;
} lanes_args;

/* passes [begin, end) for every input row, QDOT_INPUTS rows at a time (refined inputs: value and residual rows
 * one at a time, the residual's product added) */
static void lanes_part(const void *ctx, i64 begin, i64 end) {
    const lanes_args *a = ctx;
    const i64 n = a->n, k = a->k, g = a->group, st = a->stride, f = a->format;
    const int grouped = g != 32, bits = (int)QUANT_BITS(f);
    const i64 bytes = LANE_PASS_BYTES(k, g, bits);
    const int refine = (f & QUANT_REFINE) != 0;
/* (groups of 32, the common case, without their general spread) */
#define LANES_ROWS(work_, st_, M_, pass_, bias_, out_, n_)                                                         \
    (bits == 8 ? (grouped ? lanes_rows(work_, st_, M_, pass_, bias_, out_, n_, k, g, f, next, 1, 8)               \
                          : lanes_rows(work_, st_, M_, pass_, bias_, out_, n_, k, 32, f, next, 0, 8))             \
               : (grouped ? lanes_rows(work_, st_, M_, pass_, bias_, out_, n_, k, g, f, next, 1, 4)               \
                          : lanes_rows(work_, st_, M_, pass_, bias_, out_, n_, k, 32, f, next, 0, 4)))
    for (i64 p = begin; p < end; p++) {
        const unsigned char *pass = a->packed + p * bytes;
        const char *next = (const char *)pass + 2 * bytes;
        const float *bias = a->bias ? a->bias + 4 * p : 0;
        if (!refine) {
            for (i64 r0 = 0; r0 < a->m; r0 += QDOT_INPUTS) {
                const int M = a->m - r0 < QDOT_INPUTS ? (int)(a->m - r0) : QDOT_INPUTS;
                const char *work = a->work + r0 * st;
                float *out = a->out + r0 * n + 4 * p;
                switch (M) {
                case 4: LANES_ROWS(work, st, 4, pass, bias, out, n); break;
                case 3: LANES_ROWS(work, st, 3, pass, bias, out, n); break;
                case 2: LANES_ROWS(work, st, 2, pass, bias, out, n); break;
                default: LANES_ROWS(work, st, 1, pass, bias, out, n); break;
                }
            }
        } else { /* two input rows at a time, each a value row and a residual row: out = (value + bias) + residual */
            for (i64 r0 = 0; r0 < a->m; r0 += 2) {
                float part[QDOT_INPUTS][QDOT_ROWS];
                const char *work = a->work + 2 * r0 * st;
                if (a->m - r0 >= 2) LANES_ROWS(work, st, 4, pass, 0, part[0], QDOT_ROWS);
                else LANES_ROWS(work, st, 2, pass, 0, part[0], QDOT_ROWS);
                for (int r = 0; r < 2 && r0 + r < a->m; r++)
                    for (int i = 0; i < QDOT_ROWS; i++)
                        a->out[(r0 + r) * n + 4 * p + i] = (part[2 * r][i] + (bias ? bias[i] : 0.0f)) + part[2 * r + 1][i];
            }
        }
    }
#undef LANES_ROWS
}
#endif

#if defined(__AVX512F__)
#define QFLOAT_COLS 4 /* input rows a pass of q8_float_rows holds accumulators for */
/* A refined int8 linear (a language model's logits) in float32: weight rows o..o+R-1, each 16 weights converted
 * and scaled once (quant_value's rounding) and multiplied into up to QFLOAT_COLS input rows at a time, each output
 * one FMA chain over k in order, then one horizontal sum: the same arithmetic whatever the batch. The refined
 * integer form rounds every input twice and runs two integer products for each row; at several rows this takes
 * a weight's conversion once for all of them, and it does not round the inputs at all. */
static inline __attribute__((always_inline)) void q8_float_rows(const float *restrict x, i64 m,
                                                                const signed char *restrict q,
                                                                const float *restrict scale,
                                                                const float *restrict zero, const float *bias,
                                                                i64 format, i64 k, i64 group, float *out, i64 n,
                                                                const int R) {
    const i64 ngroups = k / group;
    for (i64 r0 = 0; r0 < m; r0 += QFLOAT_COLS) {
        const int M = m - r0 < QFLOAT_COLS ? (int)(m - r0) : QFLOAT_COLS;
        __m512 acc[QDOT_ROWS][QFLOAT_COLS];
        for (int i = 0; i < R; i++)
            for (int c = 0; c < QFLOAT_COLS; c++) acc[i][c] = _mm512_setzero_ps();
        for (i64 g = 0; g < ngroups; g++) {
            __m512 sv[QDOT_ROWS], pv[QDOT_ROWS];
            for (int i = 0; i < R; i++) {
                sv[i] = _mm512_set1_ps(scale[i * ngroups + g]);
                pv[i] = _mm512_set1_ps(quant_point(zero ? zero + i * ngroups : 0, g, format));
            }
            for (i64 j = g * group; j < (g + 1) * group; j += 16) {
                __m512 w[QDOT_ROWS];
                if (j % 64 == 0) /* the rows AHEAD passes on stream in (as q8_rows) */
                    for (int i = 0; i < R; i++) _mm_prefetch((const char *)q + (i + AHEAD * R) * k + j, _MM_HINT_T0);
                for (int i = 0; i < R; i++)
                    w[i] = quant_value16(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                             _mm_loadu_si128((const __m128i *)(q + i * k + j)))),
                                         sv[i], pv[i], format);
                for (int c = 0; c < M; c++) {
                    const __m512 xv = _mm512_loadu_ps(x + (r0 + c) * k + j);
                    for (int i = 0; i < R; i++) acc[i][c] = _mm512_fmadd_ps(xv, w[i], acc[i][c]);
                }
            }
        }
        for (int c = 0; c < M; c++)
            for (int i = 0; i < R; i++)
                out[(r0 + c) * n + i] = _mm512_reduce_add_ps(acc[i][c]) + (bias ? bias[i] : 0.0f);
    }
}

typedef struct {
    const float *x, *scale, *zero, *bias;
    const signed char *q;
    float *out;
    i64 m, n, k, format, group;
} qfloat_args;

/* weight rows [begin * QDOT_ROWS, end * QDOT_ROWS) of q8_float_rows, the last n % QDOT_ROWS one by one */
static void qfloat_part(const void *ctx, i64 begin, i64 end) {
    const qfloat_args *a = ctx;
    const i64 n = a->n, k = a->k, ngroups = k / a->group;
    const i64 stop = end * QDOT_ROWS < n ? end * QDOT_ROWS : n;
    for (i64 o = begin * QDOT_ROWS; o < stop;) {
        const int R = o + QDOT_ROWS <= stop ? QDOT_ROWS : 1;
        const float *s = a->scale + o * ngroups, *z = a->zero ? a->zero + o * ngroups : 0;
        const float *bias = a->bias ? a->bias + o : 0;
        if (R == QDOT_ROWS)
            q8_float_rows(a->x, a->m, a->q + o * k, s, z, bias, a->format, k, a->group, a->out + o, n, QDOT_ROWS);
        else
            q8_float_rows(a->x, a->m, a->q + o * k, s, z, bias, a->format, k, a->group, a->out + o, n, 1);
        o += R;
    }
}
#endif

/* 2: VNNI byte dot products; 1: AVX2's (the same integers, three instructions for one); 0: none (the caller runs
 * the float kernel) */
i64 kiln_qdot_level(void) {
#if defined(QDOT_LEVEL)
    return QDOT_LEVEL;
#else
    return 0;
#endif
}

/* kiln_qlinear_f32's contract (x [m, k] float32, q [n, k * bits / 8], scale and zero [n, k / group], bias [n],
 * out [m, n]; work: at least m * 4 * (k + k / group) bytes, twice that with QUANT_REFINE) by integer dot products;
 * returns 1, or 0 without
 * touching out when it cannot take the shapes, the CPU lacks the instructions or x holds inf or NaN. */
i64 kiln_qlinear_dot_f32(const float *restrict x, const void *restrict q, const float *restrict scale,
                         const float *restrict zero, const float *restrict bias, float *restrict out, void *work,
                         i64 m, i64 n, i64 k, i64 format, i64 group, i64 threads) {
#if defined(QDOT_LEVEL)
    const i64 bits = QUANT_BITS(format);
    const int shapes = bits == 4 ? k % 64 == 0 && (group == 32 || group % 64 == 0)
                                 : bits == 8 && k % 32 == 0 && group % 32 == 0;
    if (!shapes || group <= 0 || k % group != 0) return 0;
    const i64 stride = 4 * (k + k / group);
    const int refine = (format & QUANT_REFINE) != 0;
#if defined(__AVX512F__)
    if (refine && bits == 8) { /* in float32: see q8_float_rows */
        const qfloat_args args = {x, scale, zero, bias, (const signed char *)q, out, m, n, k, format, group};
        const i64 blocks = (n + QDOT_ROWS - 1) / QDOT_ROWS, most = n * k / LINEAR_MIN_PART;
        parallel_for(qfloat_part, &args, blocks, threads_for(threads, most));
        return 1;
    }
#endif
    float *residual = refine ? malloc(sizeof(float) * k) : 0;
    if (refine && !residual) return 0;
    for (i64 r = 0; r < m; r++) {
        signed char *xq = (signed char *)work + (refine ? 2 * r : r) * stride;
        float *d = (float *)(xq + k);
        int ok = quantize_row(x + r * k, k, group, bits == 4, xq, d, d + k / 32, residual);
        if (ok && refine) {
            signed char *rq = xq + stride;
            float *rd = (float *)(rq + k);
            ok = quantize_row(residual, k, group, bits == 4, rq, rd, rd + k / 32, 0);
        }
        if (!ok) {
            free(residual);
            return 0;
        }
    }
    free(residual);
    const qdot_args args = {q, scale, zero, bias, out, (const char *)work, m, n, k, format, group, stride};
    const i64 blocks = (n + QDOT_ROWS - 1) / QDOT_ROWS, most = n * k / LINEAR_MIN_PART;
    parallel_for(qdot_part, &args, blocks, threads_for(threads, most));
    return 1;
#else
    (void)x, (void)q, (void)scale, (void)zero, (void)bias, (void)out, (void)work, (void)m, (void)n, (void)k;
    (void)format, (void)group, (void)threads;
    return 0;
#endif
}

/* rows [0, n) of a packed weight (kiln_qlanes_pack) as float32 w [n, k], each weight as quant_value rounds it
 * (int8: as its stored code, (q - 0) * s): what the product is of, for the tests and for inputs the integer
 * products cannot take */
void kiln_qlanes_dequantize(const unsigned char *restrict packed, i64 n, i64 k, i64 format, i64 group,
                            float *restrict w) {
    const int bits = (int)QUANT_BITS(format);
    const i64 nb = k / 32, ng = k / group;
    for (i64 p = 0; p < n / 4; p++) {
        const unsigned char *pass = packed + p * LANE_PASS_BYTES(k, group, bits), *c = pass;
        const float *s = (const float *)(pass + LANE_CODE_BYTES(k, bits));
        const float *z = (const float *)(pass + LANE_POINTS_OFFSET(k, group, bits));
        for (i64 b0 = 0; b0 < nb;) {
            const int W = lane_width(b0, nb);
            for (int i = 0; i < 4; i++) {
                float *row = w + (4 * p + i) * k;
                if (bits == 8)
                    for (int b = 0; b < 32 * W; b++, c++) {
                        const i64 e = lane_element8(b0, W, b);
                        row[e] = quant_value((float)((int)*c - 128), 0, e / group, s[i * ng + e / group], format);
                    }
                else
                    for (int j = 0; j < 16 * W; j++, c++)
                        for (int hi = 0; hi < 2; hi++) {
                            const i64 e = lane_element(b0, W, j, hi);
                            row[e] = quant_value((float)((*c >> (4 * hi)) & 15), z + i * ng, e / group,
                                                 s[i * ng + e / group], format);
                        }
            }
            b0 += W;
        }
    }
}

/* kiln_qlinear_dot_f32's product for a weight in the packed form (kiln_qlanes_pack, its format and group): x
 * [m, k], bias [n] or NULL, out [m, n], work as kiln_qlinear_dot_f32's. A row holding inf or NaN is multiplied in
 * float32 by the dequantized rows (int8 cannot hold them; the other rows are not affected). Returns 0 where the
 * helpers lack the instructions, the shapes do not fit the form or memory ran out, else 1. */
i64 kiln_qlanes_linear_f32(const float *restrict x, const void *restrict packed, const float *restrict bias,
                           float *restrict out, void *work, i64 m, i64 n, i64 k, i64 format, i64 group,
                           i64 threads) {
#if Q4_WIDE
    if (!lanes_shapes(n, k, group) || !lanes_format(format, 0)) return 0;
    const i64 stride = 4 * (k + k / group);
    const int refine = (format & QUANT_REFINE) != 0;
    float *residual = refine ? malloc(sizeof(float) * k) : 0;
    unsigned char *fails = calloc((size_t)(m > 0 ? m : 1), 1); /* rows holding inf or NaN */
    if ((refine && !residual) || !fails) {
        free(residual), free(fails);
        return 0;
    }
    i64 failed = 0;
    for (i64 r = 0; r < m; r++) {
        signed char *xq = (signed char *)work + (refine ? 2 * r : r) * stride;
        float *d = (float *)(xq + k);
        int ok = quantize_row(x + r * k, k, group, 0, xq, d, d + k / 32, residual);
        if (ok && refine) {
            signed char *rq = xq + stride;
            float *rd = (float *)(rq + k);
            ok = quantize_row(residual, k, group, 0, rq, rd, rd + k / 32, 0);
            lanes_codes(rq, k);
        }
        if (!ok) { /* its products run on zeros, then are replaced */
            __builtin_memset(xq, 0, (size_t)((refine ? 2 : 1) * stride));
            fails[r] = 1, failed++;
        }
        lanes_codes(xq, k);
    }
    free(residual);
    const lanes_args args = {packed, bias, out, (const char *)work, m, n, k, group, format, stride};
    parallel_for(lanes_part, &args, n / 4, threads_for(threads, n * k / LINEAR_MIN_PART));
    float *w = failed ? malloc(sizeof(float) * 4 * k) : 0;
    for (i64 p = 0; w && p < n / 4; p++) { /* rows holding inf or NaN: in float32, by the dequantized rows */
        kiln_qlanes_dequantize((const unsigned char *)packed + p * LANE_PASS_BYTES(k, group, QUANT_BITS(format)), 4, k,
                               format, group, w);
        for (i64 r = 0; r < m; r++)
            for (int i = 0; fails[r] && i < 4; i++) {
                float sum = bias ? bias[4 * p + i] : 0.0f;
                for (i64 j = 0; j < k; j++) sum += x[r * k + j] * w[i * k + j];
                out[r * n + 4 * p + i] = sum;
            }
    }
    const int done = !failed || w;
    free(w), free(fails);
    return done;
#else
    (void)x, (void)packed, (void)bias, (void)out, (void)work, (void)m, (void)n, (void)k, (void)format, (void)group;
    (void)threads;
    return 0;
#endif
}

/* the bytes of an [n, k] int4 or int8 weight's packed form in groups of `group` (kiln_qlanes_pack), 0 where the
 * helpers have no such form */
i64 kiln_qlanes_bytes(i64 n, i64 k, i64 group, i64 bits) {
#if Q4_WIDE
    return lanes_shapes(n, k, group) && (bits == 4 || bits == 8) ? n / 4 * LANE_PASS_BYTES(k, group, bits) : 0;
#else
    (void)n, (void)k, (void)group, (void)bits;
    return 0;
#endif
}
