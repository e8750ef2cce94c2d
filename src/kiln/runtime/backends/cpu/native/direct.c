/* Direct 2-d convolution for few input channels (a network's stem: 3 channels of an image), NCHW float32.
 *
 * Why: with 3 input channels a 3x3 convolution is a GEMM whose sums are 27 long. im2col writes 9x the input and
 * each output is stored after 27 multiply-adds, so im2col + GEMM ran at 18-30 GFLOP/s on MobileNetV3's and
 * EfficientNet-lite0's stems, about half of ONNX Runtime's speed there.
 *
 * How: the vector runs across 16 output channels. For each block of 16 pixels of an output row, 16 sums (one per
 * pixel, a vector over the channels) stay in registers across every input channel and tap: each step broadcasts
 * one input value per pixel against the tap's 16 weights. The input is read from a zero-padded copy of each image
 * (so no tap needs a bounds check); the block's sums are transposed (transpose16) and stored as 16 runs of pixels
 * into the 16 output planes, bias first and the fused activation in registers. Every output is the same sum in
 * the same order (channel, then tap row, then tap column) whatever the thread count.
 */
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "vec16.h"

enum { OCS = 16, PIXELS = 16 };

typedef struct {
    const float *w, *bias;
    float *y;
    i64 c, o, kh, kw, sh, sw, dh, dw, oh, ow, act;
    float lo, hi;
    i64 ph, pw;          /* the padded input's size */
    const float *padded; /* [n][c][ph][pw] */
    i64 blocks;          /* output channel blocks */
} direct_args;

static void direct_part(const void *ctx, i64 begin, i64 end) {
    const direct_args *a = (const direct_args *)ctx;
    const i64 taps = a->c * a->kh * a->kw;
    v16 *wt = (v16 *)thread_scratch(SCRATCH_DIRECT_WEIGHTS, taps * (i64)sizeof(v16)); /* [c][kh][kw] x 16 outs */
    if (!wt) return;
    const v16 lo = splat16(a->lo), hi = splat16(a->hi);
    for (i64 task = begin; task < end; task++) { /* task: (image, channel block, output row) */
        const i64 oy = task % a->oh, rest = task / a->oh;
        const i64 o0 = (rest % a->blocks) * OCS, image = rest / a->blocks;
        const i64 outs = a->o - o0 < OCS ? a->o - o0 : OCS;
        if (task == begin || oy == 0) {
            for (i64 t = 0; t < taps; t++) wt[t] = splat16(0.0f);
            for (i64 l = 0; l < outs; l++)
                for (i64 t = 0; t < taps; t++) wt[t][l] = a->w[(o0 + l) * taps + t];
        }
        float bias_lanes[OCS] = {0};
        for (i64 l = 0; l < outs && a->bias; l++) bias_lanes[l] = a->bias[o0 + l];
        v16 bias;
        memcpy(&bias, bias_lanes, sizeof bias);
        const float *xi = a->padded + image * a->c * a->ph * a->pw;
        float *yi = a->y + (image * a->o + o0) * a->oh * a->ow + oy * a->ow;
        for (i64 ox = 0; ox < a->ow; ox += PIXELS) {
            const i64 count = a->ow - ox < PIXELS ? a->ow - ox : PIXELS;
            v16 s[PIXELS];
            for (int p = 0; p < PIXELS; p++) s[p] = bias;
            const v16 *wv = wt;
            for (i64 ci = 0; ci < a->c; ci++)
                for (i64 ky = 0; ky < a->kh; ky++) {
                    const float *line = xi + (ci * a->ph + oy * a->sh + ky * a->dh) * a->pw + ox * a->sw;
                    for (i64 kx = 0; kx < a->kw; kx++, wv++) {
                        const float *px = line + kx * a->dw;
                        const v16 w = *wv;
                        /* pixels past the row's end read the padded copy's slack: computed, never stored */
                        for (int p = 0; p < PIXELS; p++) s[p] += w * splat16(px[p * a->sw]);
                    }
                }
            for (int p = 0; p < PIXELS; p++) s[p] = activate16(s[p], (int)a->act, lo, hi);
            transpose16(s); /* s[l]: output channel o0 + l at the block's 16 pixels */
            for (i64 l = 0; l < outs; l++) {
                float *out = yi + l * a->oh * a->ow + ox;
                if (count == PIXELS) *(v16u *)out = s[l];
                else store16_first(out, s[l], (int)count);
            }
        }
    }
}

/* y = conv(x, w) + bias, then act (0 none, 1 clamp [lo, hi], 2 hardswish): groups 1, w [o][c][kh][kw], NCHW. */
void kiln_conv2d_direct_f32(const float *x, const float *w, const float *bias, float *y, i64 n, i64 c, i64 h, i64 wd,
                            i64 o, i64 kh, i64 kw, i64 sh, i64 sw, i64 pt, i64 pl, i64 dh, i64 dw, i64 oh, i64 ow,
                            i64 act, float lo, float hi, i64 threads) {
    if (n <= 0 || o <= 0 || oh <= 0 || ow <= 0) return;
    /* the padded copy covers every tap of every computed pixel, the last block's past the row included */
    const i64 ph = (oh - 1) * sh + (kh - 1) * dh + 1;
    const i64 pw = ((ow + PIXELS - 1) / PIXELS * PIXELS - 1) * sw + (kw - 1) * dw + 1;
    float *padded = (float *)thread_scratch(SCRATCH_DIRECT_INPUT, n * c * ph * pw * (i64)sizeof(float));
    if (!padded) return;
    const i64 j0 = pl < pw ? pl : pw, j1 = wd + pl < pw ? wd + pl : pw; /* padded columns [j0, j1) hold x's */
    for (i64 plane = 0; plane < n * c; plane++)
        for (i64 r = 0; r < ph; r++) {
            float *dst = padded + (plane * ph + r) * pw;
            const i64 src = r - pt;
            if (src < 0 || src >= h || j1 <= j0) {
                memset(dst, 0, (size_t)pw * 4);
                continue;
            }
            memset(dst, 0, (size_t)j0 * 4);
            memcpy(dst + j0, x + (plane * h + src) * wd, (size_t)(j1 - j0) * 4);
            memset(dst + j1, 0, (size_t)(pw - j1) * 4);
        }
    direct_args a = {w, bias, y, c, o, kh, kw, sh, sw, dh, dw, oh, ow, act, lo, hi, ph, pw, padded, (o + OCS - 1) / OCS};
    parallel_for(direct_part, &a, n * a.blocks * oh, threads);
}
