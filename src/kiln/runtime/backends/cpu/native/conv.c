/* One entry for a 2-d float32 convolution by a compiled route (cpu/conv.py `route` picks it when a plan is built):
 * the CPU kernel and the native executor both call kiln_conv2d_f32, so the two give the same bits, and a network
 * run by the executor pays no Python between its convolutions.
 *
 * Routes: 0 depthwise (depthwise.c), 1 an image's few channels (direct.c), 2 a 1x1 stride-1 convolution as one
 * packed GEMM per image (gemm.c: the weight packed once, [out][in] against the image's planes [in][h * w]),
 * 3 im2col in bands of `band` output rows, each band's patch matrix (in `work`: in * kh * kw * band * ow floats)
 * multiplied by the packed weight while it is in cache, 4 a 1x1 convolution of 1x1 maps (squeeze-and-excitation)
 * as a linear layer over the images' rows [n][in] (kiln_linear_rows_f32, each weight row read once for all rows),
 * 5 a 3x3 stride-1 convolution as Winograd F(2x2, 3x3): the input transform into `work` ([16][in][tiles]), 16
 * products by the packed GEMM (w: U's 16 [out][in] matrices packed one after another) into the rest of `work`
 * ([16][out][tiles]), the output transform with the bias and activation. Its products went to BLAS from Python,
 * whose threads then spun against the helpers' pool at 2 threads.
 * The bias and the activation (0 none, 1 clamp [lo, hi], 2 hardswish) are applied by the route.
 */
#include "pool.h"

void kiln_dwconv2d_blocked_f32(const float *x, const float *w, const float *bias, float *y, i64 n, i64 c, i64 h,
                               i64 wd, i64 kh, i64 kw, i64 sh, i64 sw, i64 pt, i64 pl, i64 dh, i64 dw, i64 oh,
                               i64 ow, i64 act, float lo, float hi, i64 threads);
void kiln_conv2d_direct_f32(const float *x, const float *w, const float *bias, float *y, i64 n, i64 c, i64 h, i64 wd,
                            i64 o, i64 kh, i64 kw, i64 sh, i64 sw, i64 pt, i64 pl, i64 dh, i64 dw, i64 oh, i64 ow,
                            i64 act, float lo, float hi, i64 threads);
void kiln_gemm_packed_f32(const float *packed, const float *b, const float *bias, float *c, i64 m, i64 n, i64 k,
                          i64 ldb, i64 layout, i64 ldc, i64 act, float lo, float hi, i64 threads);
void kiln_linear_rows_f32(const float *x, const float *w, const float *bias, float *out, i64 m, i64 n, i64 k,
                          i64 threads);
i64 kiln_gemm_packed_size(i64 m, i64 k);
void kiln_winograd23_input_f32(const float *x, float *v, i64 n, i64 c, i64 h, i64 w, i64 pt, i64 pl, i64 th, i64 tw,
                               i64 threads);
void kiln_winograd23_output_f32(const float *m, const float *bias, float *y, i64 n, i64 o, i64 oh, i64 ow, i64 th,
                                i64 tw, i64 act, float lo, float hi, i64 threads);
void kiln_im2col2d_f32(const float *restrict x, float *restrict cols, i64 c, i64 h, i64 wd, i64 kh, i64 kw, i64 sh,
                       i64 sw, i64 pt, i64 pl, i64 dh, i64 dw, i64 r_begin, i64 r_end, i64 ow);

enum { ROUTE_DEPTHWISE = 0, ROUTE_DIRECT = 1, ROUTE_POINTWISE = 2, ROUTE_IM2COL = 3, ROUTE_ROWS = 4,
       ROUTE_WINOGRAD = 5 };

/* g: the shape's 15 sizes n c h w o kh kw sh sw pt pl dh dw oh ow; w: the weight as given (routes 0, 1) or packed
 * (2, 3; route 4: as given, [o][c]). Returns 0 for an unknown route (nothing written), else 1. */
i64 kiln_conv2d_f32(i64 route, const float *x, const float *w, const float *bias, float *y, float *work,
                    const i64 *g, i64 band, i64 act, float lo, float hi, i64 threads) {
    const i64 n = g[0], c = g[1], h = g[2], wd = g[3], o = g[4], kh = g[5], kw = g[6], sh = g[7], sw = g[8],
              pt = g[9], pl = g[10], dh = g[11], dw = g[12], oh = g[13], ow = g[14];
    switch (route) {
        case ROUTE_DEPTHWISE:
            kiln_dwconv2d_blocked_f32(x, w, bias, y, n, c, h, wd, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, act, lo, hi,
                                      threads);
            return 1;
        case ROUTE_DIRECT:
            kiln_conv2d_direct_f32(x, w, bias, y, n, c, h, wd, o, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, act, lo, hi,
                                   threads);
            return 1;
        case ROUTE_POINTWISE:
            for (i64 b = 0; b < n; b++)
                kiln_gemm_packed_f32(w, x + b * c * h * wd, bias, y + b * o * h * wd, o, h * wd, c, h * wd, 0, h * wd,
                                     act, lo, hi, threads);
            return 1;
        case ROUTE_IM2COL: {
            if (band <= 0) return 0;
            const i64 k = c * kh * kw;
            for (i64 b = 0; b < n; b++)
                for (i64 r0 = 0; r0 < oh; r0 += band) {
                    const i64 r1 = r0 + band < oh ? r0 + band : oh, length = (r1 - r0) * ow;
                    kiln_im2col2d_f32(x + b * c * h * wd, work, c, h, wd, kh, kw, sh, sw, pt, pl, dh, dw, r0, r1, ow);
                    kiln_gemm_packed_f32(w, work, bias, y + b * o * oh * ow + r0 * ow, o, length, k, length, 0,
                                         oh * ow, act, lo, hi, threads);
                }
            return 1;
        }
        case ROUTE_WINOGRAD: {
            const i64 th = (oh + 1) / 2, tw = (ow + 1) / 2, tiles = n * th * tw, step = kiln_gemm_packed_size(o, c);
            float *v = work, *m = work + 16 * c * tiles;
            kiln_winograd23_input_f32(x, v, n, c, h, wd, pt, pl, th, tw, threads);
            for (i64 e = 0; e < 16; e++)
                kiln_gemm_packed_f32(w + e * step, v + e * c * tiles, 0, m + e * o * tiles, o, tiles, c, tiles, 0,
                                     tiles, 0, -__builtin_inff(), __builtin_inff(), threads);
            kiln_winograd23_output_f32(m, bias, y, n, o, oh, ow, th, tw, act, lo, hi, threads);
            return 1;
        }
        case ROUTE_ROWS:
            kiln_linear_rows_f32(x, w, bias, y, n, o, c, threads);
            conv_activate(y, n * o, (int)act, lo, hi);
            return 1;
        default: return 0;
    }
}
