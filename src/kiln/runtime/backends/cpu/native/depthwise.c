/* Depthwise 2-d convolution over blocks of 16 channels, NCHW float32 in and out.
 *
 * Why: a plane-by-plane kernel (one channel at a time, the vector along a row) pays a fixed cost per plane (its
 * padded copy, vector blocks cut by the map's edge, the copy out), which dominates on the small maps where
 * networks put their many channels (EfficientNet-lite0: 1152 channels of 7x7, 11 GFLOP/s). Here the vector runs
 * across 16 channels, as ONNX Runtime's NCHWc kernels do: every tap of every output pixel is one multiply-add of
 * 16 lanes, with no lanes lost to a map's edge, whatever its size. Measured against that plane kernel on
 * EfficientNet-lite0's and MobileNetV3-small's layers (1 thread): 1.4-2.9x, 4.3 -> 2.1 ms over the 21 shapes.
 *
 * How: for each block of 16 channels, a band of input rows (sized for L2) is transposed into a zero-padded scratch
 * of [row][column][16] (16x16 blocks by register shuffles, transpose16; the padding written once, so the taps
 * need no bounds checks); each output row is computed eight pixels at a time with the 16 weights of a tap held in
 * a vector, bias first and the fused activation in registers, then transposed back into the 16 output planes.
 * Channels past the last full block compute on zero weights and are not written. (Block, band) pairs go to the
 * helpers' threads, so a map of few channels splits too; every output is the same sum in the same order whatever
 * the thread count.
 */
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "vec16.h"

enum { LANES = 16, PIXELS = 8, MAX_TAPS = 1024, BAND_BYTES = 96 << 10 };

typedef struct {
    const float *x, *w, *bias;
    float *y;
    i64 n, c, h, wd, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, act;
    float lo, hi;
    i64 blocks; /* channel blocks per image */
    i64 band;   /* output rows per band */
} dw_args;

/* One output row's sums for a 5x5 kernel at stride 1 (dilation 1), PIXELS outputs at a time: each input vector of
 * a kernel row is loaded once and multiplied into every output of the group whose window covers it, the row's 5
 * weights held in registers. The generic loop loads an input vector for every multiply-add (and each tap's weight
 * and offset). Each output's sum keeps the generic loop's order (kernel rows, then columns), so the results are
 * its bits (tested). Measured against it, 1 thread: 5x5 stride 1 layers 7-14% faster (1152 ch on 7x7 100 -> 91 us,
 * 672 on 14x14 163 -> 141), so only they use it; 3x3 and stride 2 were 2-12% slower this way (fewer reuses per
 * load, and a row of 16 or more registers where the generic loop streams). base: the output row's first input
 * row in the scratch; out gets the sums (bias included), not yet activated. */
static void row_k5s1(const v16 *restrict base, i64 cols, const v16 *restrict wt, i64 kh, v16 bias,
                     v16 *restrict out, i64 ow) {
    enum { KW = 5 };
    for (i64 ox = 0; ox < ow; ox += PIXELS) {
        v16 s[PIXELS];
        for (int p = 0; p < PIXELS; p++) s[p] = bias;
        for (i64 ky = 0; ky < kh; ky++) {
            const v16 *in = base + ky * cols + ox;
            v16 w[KW];
#pragma GCC unroll 8
            for (int kx = 0; kx < KW; kx++) w[kx] = wt[ky * KW + kx];
#pragma GCC unroll 32
            for (int j = 0; j < PIXELS - 1 + KW; j++) {
                const v16 v = in[j];
#pragma GCC unroll 8
                for (int kx = 0; kx < KW; kx++)
                    if (j - kx >= 0 && j - kx < PIXELS) s[j - kx] += w[kx] * v;
            }
        }
        for (int p = 0; p < PIXELS; p++) out[ox + p] = s[p];
    }
}

static void dw_part(const void *ctx, i64 begin, i64 end) {
    const dw_args *a = (const dw_args *)ctx;
    const i64 taps = a->kh * a->kw;
    /* padded input columns read, and slack for the pixels of a row's last block past its end (computed, never
     * stored) */
    const i64 cols = (a->ow - 1) * a->sw + (a->kw - 1) * a->dw + 1 + PIXELS * a->sw;
    const i64 band_rows = (a->band - 1) * a->sh + (a->kh - 1) * a->dh + 1;
    const i64 row_pixels = (a->ow + 15) / 16 * 16 + PIXELS; /* whole blocks of 16 for the transpose out */
    const i64 floats = (band_rows * cols + taps + row_pixels) * LANES;
    void *memory = thread_scratch(SCRATCH_DEPTHWISE, floats * (i64)sizeof(float));
    if (!memory) return;
    v16 *in = (v16 *)memory;               /* [band_rows][cols] pixels of 16 channels */
    v16 *wt = in + band_rows * cols;      /* [taps] */
    v16 *row = wt + taps;                  /* one output row, [row_pixels] */
    const v16 lo = splat16(a->lo), hi = splat16(a->hi);
    const i64 sw = a->sw;
    i64 offset[MAX_TAPS]; /* each tap's pixel offset in the scratch from its output's first */
    for (i64 ky = 0; ky < a->kh; ky++)
        for (i64 kx = 0; kx < a->kw; kx++) offset[ky * a->kw + kx] = ky * a->dh * cols + kx * a->dw;
    const i64 bands = (a->oh + a->band - 1) / a->band;
    i64 loaded = -1; /* the (image, block) whose weights wt holds */
    v16 bias = splat16(0.0f);
    for (i64 task = begin; task < end; task++) { /* task: (image, channel block, band of output rows) */
        const i64 which = task / bands, image = which / a->blocks, c0 = (which % a->blocks) * LANES;
        const i64 lanes = a->c - c0 < LANES ? a->c - c0 : LANES;
        if (which != loaded) {
            float bias_lanes[LANES] = {0};
            for (i64 t = 0; t < taps; t++) wt[t] = splat16(0.0f);
            for (i64 l = 0; l < lanes; l++) {
                for (i64 t = 0; t < taps; t++) wt[t][l] = a->w[(c0 + l) * taps + t];
                if (a->bias) bias_lanes[l] = a->bias[c0 + l];
            }
            memcpy(&bias, bias_lanes, sizeof bias);
            loaded = which;
        }
        const float *xi = a->x + (image * a->c + c0) * a->h * a->wd;
        float *yi = a->y + (image * a->c + c0) * a->oh * a->ow;
        {
            const i64 r0 = task % bands * a->band;
            const i64 r1 = r0 + a->band < a->oh ? r0 + a->band : a->oh;
            const i64 in0 = r0 * a->sh - a->pt; /* input row of the band's first scratch row */
            const i64 rows = (r1 - r0 - 1) * a->sh + (a->kh - 1) * a->dh + 1;
            /* transpose the band's input rows in, 16 columns of the 16 channels at a time; zero outside the input */
            const i64 j0 = a->pl > 0 ? a->pl : 0; /* scratch column of input column j0 - pl */
            const i64 used = cols - PIXELS * a->sw;
            const i64 j1 = a->wd + a->pl < used ? a->wd + a->pl : used;
            for (i64 r = 0; r < rows; r++) {
                v16 *dst = in + r * cols;
                const i64 src = in0 + r;
                if (src < 0 || src >= a->h || j1 <= j0) {
                    for (i64 j = 0; j < cols; j++) dst[j] = splat16(0.0f);
                    continue;
                }
                for (i64 j = 0; j < j0; j++) dst[j] = splat16(0.0f);
                for (i64 j = j1; j < cols; j++) dst[j] = splat16(0.0f);
                i64 j = j0;
                for (; j + 16 <= j1; j += 16) { /* (whole blocks apart: with a constant count v[] stays in registers) */
                    v16 v[16];
                    for (i64 l = 0; l < 16; l++)
                        v[l] = l < lanes ? *(const v16u *)(xi + (l * a->h + src) * a->wd + (j - a->pl)) : splat16(0.0f);
                    transpose16(v);
                    for (int t = 0; t < 16; t++) dst[j + t] = v[t];
                }
                if (j < j1) {
                    const int count = (int)(j1 - j);
                    v16 v[16];
                    for (i64 l = 0; l < 16; l++)
                        v[l] = l < lanes ? load16_first(xi + (l * a->h + src) * a->wd + (j - a->pl), count) : splat16(0.0f);
                    transpose16(v);
                    for (int t = 0; t < count; t++) dst[j + t] = v[t];
                }
            }
            for (i64 oy = r0; oy < r1; oy++) {
                const v16 *base = in + (oy - r0) * a->sh * cols;
                const int act = (int)a->act;
                if (a->dh == 1 && a->dw == 1 && a->kw == 5 && sw == 1) {
                    row_k5s1(base, cols, wt, a->kh, bias, row, a->ow);
                    for (i64 ox = 0; ox < a->ow; ox++) row[ox] = activate16(row[ox], act, lo, hi);
                } else
                /* PIXELS outputs at a time, their sums in registers across the taps (independent chains) */
                for (i64 ox = 0; ox < a->ow; ox += PIXELS) {
                    v16 s0 = bias, s1 = bias, s2 = bias, s3 = bias, s4 = bias, s5 = bias, s6 = bias, s7 = bias;
                    const v16 *at = base + ox * sw;
                    for (i64 t = 0; t < taps; t++) {
                        const v16 wv = wt[t];
                        const v16 *px = at + offset[t];
                        s0 += wv * px[0];
                        s1 += wv * px[sw];
                        s2 += wv * px[2 * sw];
                        s3 += wv * px[3 * sw];
                        s4 += wv * px[4 * sw];
                        s5 += wv * px[5 * sw];
                        s6 += wv * px[6 * sw];
                        s7 += wv * px[7 * sw];
                    }
                    row[ox] = activate16(s0, act, lo, hi);
                    row[ox + 1] = activate16(s1, act, lo, hi);
                    row[ox + 2] = activate16(s2, act, lo, hi);
                    row[ox + 3] = activate16(s3, act, lo, hi);
                    row[ox + 4] = activate16(s4, act, lo, hi);
                    row[ox + 5] = activate16(s5, act, lo, hi);
                    row[ox + 6] = activate16(s6, act, lo, hi);
                    row[ox + 7] = activate16(s7, act, lo, hi);
                }
                /* transpose the row back out, 16 pixels of the 16 channels at a time */
                i64 ox = 0;
                for (; ox + 16 <= a->ow; ox += 16) {
                    v16 v[16];
                    for (int t = 0; t < 16; t++) v[t] = row[ox + t];
                    transpose16(v);
                    for (i64 l = 0; l < lanes; l++) *(v16u *)(yi + (l * a->oh + oy) * a->ow + ox) = v[l];
                }
                if (ox < a->ow) {
                    v16 v[16];
                    for (int t = 0; t < 16; t++) v[t] = row[ox + t];
                    transpose16(v);
                    for (i64 l = 0; l < lanes; l++)
                        store16_first(yi + (l * a->oh + oy) * a->ow + ox, v[l], (int)(a->ow - ox));
                }
            }
        }
    }
}

/* y = depthwise conv(x, w) + bias, then act (0 none, 1 clamp [lo, hi], 2 hardswish); w [c][kh][kw], NCHW x, y. */
void kiln_dwconv2d_blocked_f32(const float *x, const float *w, const float *bias, float *y, i64 n, i64 c, i64 h,
                               i64 wd, i64 kh, i64 kw, i64 sh, i64 sw, i64 pt, i64 pl, i64 dh, i64 dw, i64 oh,
                               i64 ow, i64 act, float lo, float hi, i64 threads) {
    if (n <= 0 || c <= 0 || oh <= 0 || ow <= 0 || kh * kw > MAX_TAPS) return;
    const i64 cols = (ow - 1) * sw + (kw - 1) * dw + 1 + PIXELS * sw;
    i64 band = oh;
    while (band > 1 && ((band - 1) * sh + (kh - 1) * dh + 1) * cols * LANES * 4 > BAND_BYTES) band--;
    dw_args a = {x, w, bias, y, n, c, h, wd, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, act, lo, hi,
                 (c + LANES - 1) / LANES, band};
    parallel_for(dw_part, &a, n * a.blocks * ((oh + band - 1) / band), threads);
}
