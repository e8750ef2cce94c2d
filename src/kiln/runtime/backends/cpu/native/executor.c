/* The native executor: a method's nodes run from one compiled plan in one call, without returning to Python per
 * node (cpu/executor.py builds the plan). A decode step of a small LLM is ~670 nodes; run from Python each cost
 * 2-40 us of dispatch, argument checks and array allocation around microseconds of work, ~40% of the step.
 *
 * A plan is `count` instructions of WORDS int64 each: the op, then its arguments. An array argument is two
 * words, (base, byte offset): the address is bases[base] + offset, or none where base is -1. The bases are the
 * plan's memory (its arena, constants) and what the caller fills in for each run (inputs, state, outputs), so
 * the plan holds no address that changes between runs. Every view (slice, reshape, permute, expand) was resolved
 * to offsets and strides when the plan was built: only instructions that compute remain.
 *
 * Each instruction calls the helper the Python kernel of its op calls, with the same arguments, so the results
 * are the Python path's. kiln_execute returns 0, or 1 + the index of an instruction that declined its inputs at
 * run time (an index outside its table, a position outside the cache): the caller then runs the method from
 * Python, which raises the op's own error.
 */
#include <string.h>
#include <time.h>

#include "pool.h"
#include "quant.h"

enum { WORDS = 48 };

enum {
    OP_QLINEAR = 1,   /* x q scale zero bias out work | m n k format group dot (format: quant.h) */
    OP_LINEAR = 2,    /* x w bias out | m n k */
    OP_RMS_NORM = 3,  /* x residual weight total out | rows n eps(float bits) */
    OP_ROPE_CACHE = 4,/* q k v cos sin k_cache v_cache positions q_out | 18 sizes and strides (attention.c) */
    OP_ATTENTION = 5, /* q k v mask sinks out | 18 sizes and strides, scale(float bits) */
    OP_GATED = 6,     /* gate up out | n activation (0 silu, 1 gelu_tanh, 2 gelu_erf) */
    OP_QEMBED = 7,    /* q scale zero ids out | count vocab k format group */
    OP_GATHER = 8,    /* table ids out | count rows row_bytes */
    OP_COMPARE = 9,   /* a b out | kind dtype(0 int64, 1 float32) shape[4] a_strides[4] b_strides[4] (elements) */
    OP_COPY = 10,     /* src dst | item shape[4] src_strides[4] (bytes); dst contiguous */
    OP_BINARY = 11,   /* a b out | kind dtype(0 int64, 1 float32, 2 bool) shape[4] a_strides[4] b_strides[4] */
    OP_SLOT_ATTENTION = 12, /* q k_cache v_cache slots positions sinks out | 9 sizes, scale(float bits) */
    OP_ROPE_SLOT = 13,      /* q k v cos sin k_cache v_cache slots positions q_out | 14 sizes and strides */
    OP_LAYER_NORM = 14,     /* x weight bias out | rows n eps(float bits) */
    OP_UNARY = 15,          /* x out | n function (native.UNARY's order) */
    OP_CONV = 16,           /* x w bias out work | route band act lo hi (float bits) geometry[15] (conv.c) */
    OP_SUM_ROWS = 17,       /* x out | rows n divisor(float bits) */
    OP_MAX_POOL = 18,       /* x out | planes h w kh kw sh sw ph pw dh dw oh ow */
    OP_CLAMP = 19,          /* x out | n lo hi (float bits) */
    OP_GEMM_ROWS = 20,      /* x packed bias out work | m n k: out[m][n] = x W^T + bias, W packed (linalg.linear) */
    OP_ROUTE = 21,          /* logits weights ids work | rows n k normalize (experts.c) */
    OP_GATHERED = 22,       /* x index w bias combine out work | s n k experts topk (experts.c; 0: an index is out) */
    OP_GATHERED_Q = 23,     /* x index q scale zero bias combine out work | s n k experts topk format group dot */
    OP_QLANES = 24,         /* x packed bias out work | m n k format group (a weight in qdot.c's lanes form) */
};

/* kind: 0 +, 1 -, 2 *, 3 / (float32), 4 remainder (int64: the divisor's sign, as NumPy's; by 0: 0), 5 &, 6 |, 7 ^
 * (int64 and bool). One operation a result, rounded once: NumPy's float32 arithmetic, to the bit. */
static inline i64 binary_i64(i64 kind, i64 a, i64 b) {
    switch (kind) {
        case 0: return (i64)((uint64_t)a + (uint64_t)b); /* wrapping, as NumPy's int64 */
        case 1: return (i64)((uint64_t)a - (uint64_t)b);
        case 2: return (i64)((uint64_t)a * (uint64_t)b);
        case 4: {
            if (b == 0) return 0;
            if (b == -1) return 0; /* (INT64_MIN % -1 traps) */
            const i64 r = a % b;
            return r != 0 && ((r < 0) != (b < 0)) ? r + b : r;
        }
        case 5: return a & b;
        case 6: return a | b;
        default: return a ^ b;
    }
}

static inline float binary_f32(i64 kind, float a, float b) {
    switch (kind) {
        case 0: return a + b;
        case 1: return a - b;
        case 2: return a * b;
        default: return a / b;
    }
}

/* out[i] = x[i * xs] op y[i * ys] over a row of n: the kind chosen once a row, and loops the compiler vectorizes
 * for the common strides (both contiguous, or one operand a scalar broadcast along the row). */
#define BINARY_ROW(OP)                                                                             \
    do {                                                                                           \
        if (xs == 1 && ys == 1)                                                                    \
            for (i64 i = 0; i < n; i++) out[i] = x[i] OP y[i];                                     \
        else if (xs == 0 && ys == 1) {                                                             \
            const float a = x[0];                                                                  \
            for (i64 i = 0; i < n; i++) out[i] = a OP y[i];                                        \
        } else if (xs == 1 && ys == 0) {                                                           \
            const float b = y[0];                                                                  \
            for (i64 i = 0; i < n; i++) out[i] = x[i] OP b;                                        \
        } else                                                                                     \
            for (i64 i = 0; i < n; i++) out[i] = x[i * xs] OP y[i * ys];                           \
    } while (0)

static void binary_row_f32(i64 kind, const float *restrict x, i64 xs, const float *restrict y, i64 ys,
                           float *restrict out, i64 n) {
    switch (kind) {
        case 0: BINARY_ROW(+); break;
        case 1: BINARY_ROW(-); break;
        case 2: BINARY_ROW(*); break;
        default: BINARY_ROW(/); break;
    }
}
#undef BINARY_ROW

i64 kiln_qlinear_dot_f32(const float *x, const void *q, const float *scale, const float *zero, const float *bias,
                         float *out, void *work, i64 m, i64 n, i64 k, i64 format, i64 group, i64 threads);
i64 kiln_qlanes_linear_f32(const float *x, const void *packed, const float *bias, float *out, void *work, i64 m,
                           i64 n, i64 k, i64 format, i64 group, i64 threads);
void kiln_qlinear_f32(const float *x, const void *qv, const float *scale, const float *zero, const float *bias,
                      float *out, float *xs, i64 m, i64 n, i64 k, i64 format, i64 group, i64 threads);
void kiln_linear_rows_f32(const float *x, const float *w, const float *bias, float *out, i64 m, i64 n, i64 k,
                          i64 threads);
void kiln_add_rms_norm_f32(const float *x, const float *r, const float *w, float *total, float *out, i64 rows, i64 n,
                           float eps);
i64 kiln_rope_cache_update_f32(const float *q, const float *k, const float *v, const float *cos, const float *sin,
                               float *k_cache, float *v_cache, const i64 *positions, float *q_out, i64 B, i64 Hq,
                               i64 Hkv, i64 L, i64 D, i64 S, i64 qsb, i64 qsh, i64 qsl, i64 ksb, i64 ksh, i64 ksl,
                               i64 vsb, i64 vsh, i64 vsl, i64 csb, i64 csl, i64 interleaved);
i64 kiln_attention_f32(const float *q, const float *k, const float *v, const unsigned char *mask,
                       const float *sinks, float *out, i64 B, i64 Hq, i64 Hkv, i64 L, i64 S, i64 D, i64 Dv, i64 kb,
                       i64 kh, i64 ks, i64 vb, i64 vh, i64 vs, i64 mb, i64 mh, i64 ml, i64 ms, i64 causal,
                       float scale, i64 threads);
i64 kiln_slot_attention_f32(const float *q, const float *k, const float *v, const i64 *slots, const i64 *positions,
                            const float *sinks, float *out, i64 B, i64 Hq, i64 Hkv, i64 T, i64 S, i64 D, i64 Dv,
                            i64 slot_count, i64 window, float scale, i64 threads);
i64 kiln_rope_slot_update_f32(const float *q, const float *k, const float *v, const float *cos, const float *sin,
                              float *k_cache, float *v_cache, const i64 *slots, const i64 *positions, float *q_out,
                              i64 B, i64 Hq, i64 Hkv, i64 D, i64 S, i64 slot_count, i64 qsb, i64 qsh, i64 ksb,
                              i64 ksh, i64 vsb, i64 vsh, i64 csb, i64 interleaved);
void kiln_dequantize_f32(const void *qv, const float *scale, const float *zero, float *w, i64 rows, i64 k, i64 format,
                         i64 group);
void kiln_layer_norm_f32(const float *x, const float *w, const float *b, float *out, i64 rows, i64 n, float eps);
void kiln_route_experts_f32(const float *logits, float *weights, i64 *ids, i64 rows, i64 n, i64 k, i64 normalize,
                            float *work);
i64 kiln_gathered_linear_f32(const float *x, const i64 *index, const float *w, const float *bias,
                             const float *combine, float *out, float *work, i64 s, i64 n, i64 k, i64 experts,
                             i64 topk, i64 threads);
i64 kiln_gathered_qlinear_f32(const float *x, const i64 *index, const void *q, const float *scale, const float *zero,
                              const float *bias, const float *combine, float *out, float *work, i64 s, i64 n, i64 k,
                              i64 experts, i64 topk, i64 format, i64 group, i64 dot, i64 threads);
void kiln_sigmoid_f32(const float *x, float *y, i64 n);
void kiln_silu_f32(const float *x, float *y, i64 n);
void kiln_hardsigmoid_f32(const float *x, float *y, i64 n);
void kiln_hardswish_f32(const float *x, float *y, i64 n);
void kiln_gelu_erf_f32(const float *x, float *y, i64 n);
void kiln_gelu_tanh_f32(const float *x, float *y, i64 n);
void kiln_erf_f32(const float *x, float *y, i64 n);
void kiln_clamp_f32(const float *x, float *y, i64 n, float lo, float hi);
i64 kiln_conv2d_f32(i64 route, const float *x, const float *w, const float *bias, float *y, float *work,
                    const i64 *g, i64 band, i64 act, float lo, float hi, i64 threads);
void kiln_gemm_packed_f32(const float *packed, const float *b, const float *bias, float *c, i64 m, i64 n, i64 k,
                          i64 ldb, i64 layout, i64 ldc, i64 act, float lo, float hi, i64 threads);
void kiln_sum_rows_f32(const float *x, float *out, i64 rows, i64 n, float divisor);
void kiln_maxpool2d_f32(const float *x, float *y, i64 planes, i64 h, i64 w, i64 kh, i64 kw, i64 sh, i64 sw, i64 pt,
                        i64 pl, i64 dh, i64 dw, i64 oh, i64 ow, i64 threads);

/* OP_UNARY's functions, in the order of native.UNARY */
static void (*const UNARY_FUNCTIONS[])(const float *, float *, i64) = {
    kiln_sigmoid_f32, kiln_silu_f32, kiln_hardsigmoid_f32, kiln_hardswish_f32, kiln_gelu_erf_f32, kiln_gelu_tanh_f32,
    kiln_erf_f32};

static inline float as_float(i64 word) {
    const int32_t bits = (int32_t)word;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* an index into a table of `rows` rows, negative ones counting from the end (as NumPy's); -1 when outside */
static inline i64 row_index(i64 i, i64 rows) {
    const i64 r = i < 0 ? i + rows : i;
    return r < 0 || r >= rows ? -1 : r;
}

/* kind: 0 <, 1 <=, 2 >, 3 >=, 4 ==, 5 != (NaN compares as IEEE says: only != holds) */
#define COMPARE(kind, a, b)                                                                                    \
    ((kind) == 0 ? (a) < (b) : (kind) == 1 ? (a) <= (b) : (kind) == 2 ? (a) > (b) : (kind) == 3 ? (a) >= (b) \
     : (kind) == 4 ? (a) == (b) : (a) != (b))

static int run(const i64 *a, char *const *bases, i64 threads) {
#define PTR(i) (a[i] < 0 ? (void *)0 : (void *)(bases[a[i]] + a[(i) + 1]))
    switch (a[0]) {
        case OP_QLINEAR: {
            const i64 *s = a + 15;
            if (!(s[5] && kiln_qlinear_dot_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), PTR(13), s[0], s[1],
                                               s[2], s[3], s[4], threads)))
                kiln_qlinear_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), PTR(13), s[0], s[1], s[2], s[3],
                                 s[4], threads);
            return 1;
        }
        case OP_QLANES:
            return (int)kiln_qlanes_linear_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), a[11], a[12], a[13], a[14],
                                               a[15], threads);
        case OP_LINEAR:
            kiln_linear_rows_f32(PTR(1), PTR(3), PTR(5), PTR(7), a[9], a[10], a[11], threads);
            return 1;
        case OP_RMS_NORM:
            kiln_add_rms_norm_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), a[11], a[12], as_float(a[13]));
            return 1;
        case OP_ROPE_CACHE: {
            const i64 *s = a + 19;
            return (int)kiln_rope_cache_update_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), PTR(13), PTR(15),
                                                   PTR(17), s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8],
                                                   s[9], s[10], s[11], s[12], s[13], s[14], s[15], s[16], s[17]);
        }
        case OP_ATTENTION: {
            const i64 *s = a + 13;
            return (int)kiln_attention_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), s[0], s[1], s[2], s[3],
                                           s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11], s[12], s[13], s[14],
                                           s[15], s[16], s[17], as_float(s[18]), threads);
        }
        case OP_GATED: {
            const float *up = PTR(3);
            float *out = PTR(5);
            const i64 n = a[7];
            if (a[8] == 0) kiln_silu_f32(PTR(1), out, n);
            else if (a[8] == 1) kiln_gelu_tanh_f32(PTR(1), out, n);
            else kiln_gelu_erf_f32(PTR(1), out, n);
            for (i64 i = 0; i < n; i++) out[i] *= up[i];
            return 1;
        }
        case OP_QEMBED: {
            const i64 *ids = PTR(7);
            const i64 count = a[11], vocab = a[12], k = a[13], format = a[14], group = a[15];
            const i64 bits = QUANT_BITS(format);
            const char *q = PTR(1);
            const float *scale = PTR(3), *zero = PTR(5);
            float *out = PTR(9);
            for (i64 i = 0; i < count; i++)
                if (row_index(ids[i], vocab) < 0) return 0;
            for (i64 i = 0; i < count; i++) {
                const i64 r = row_index(ids[i], vocab), ngroups = k / group;
                kiln_dequantize_f32(q + r * (k * bits / 8), scale + r * ngroups, zero ? zero + r * ngroups : 0,
                                    out + i * k, 1, k, format, group);
            }
            return 1;
        }
        case OP_GATHER: {
            const i64 *ids = PTR(3);
            const i64 count = a[7], rows = a[8], bytes = a[9];
            const char *table = PTR(1);
            char *out = PTR(5);
            for (i64 i = 0; i < count; i++)
                if (row_index(ids[i], rows) < 0) return 0;
            for (i64 i = 0; i < count; i++) memcpy(out + i * bytes, table + row_index(ids[i], rows) * bytes, bytes);
            return 1;
        }
        case OP_COMPARE: {
            const char *x = PTR(1), *y = PTR(3);
            unsigned char *out = PTR(5);
            const i64 kind = a[7], dtype = a[8], *n = a + 9, *xs = a + 13, *ys = a + 17;
            i64 o = 0;
            for (i64 i0 = 0; i0 < n[0]; i0++)
                for (i64 i1 = 0; i1 < n[1]; i1++)
                    for (i64 i2 = 0; i2 < n[2]; i2++)
                        for (i64 i3 = 0; i3 < n[3]; i3++) {
                            const i64 xi = i0 * xs[0] + i1 * xs[1] + i2 * xs[2] + i3 * xs[3];
                            const i64 yi = i0 * ys[0] + i1 * ys[1] + i2 * ys[2] + i3 * ys[3];
                            out[o++] = dtype == 0 ? COMPARE(kind, ((const i64 *)x)[xi], ((const i64 *)y)[yi])
                                                  : COMPARE(kind, ((const float *)x)[xi], ((const float *)y)[yi]);
                        }
            return 1;
        }
        case OP_COPY: {
            const char *src = PTR(1);
            char *dst = PTR(3);
            const i64 item = a[5], *n = a + 6, *st = a + 10;
            for (i64 i0 = 0; i0 < n[0]; i0++)
                for (i64 i1 = 0; i1 < n[1]; i1++)
                    for (i64 i2 = 0; i2 < n[2]; i2++) {
                        const char *row = src + i0 * st[0] + i1 * st[1] + i2 * st[2];
                        if (st[3] == item) {
                            memcpy(dst, row, n[3] * item);
                            dst += n[3] * item;
                        } else
                            for (i64 i3 = 0; i3 < n[3]; i3++, dst += item) memcpy(dst, row + i3 * st[3], item);
                    }
            return 1;
        }
        case OP_BINARY: {
            const char *x = PTR(1), *y = PTR(3);
            char *out = PTR(5);
            const i64 kind = a[7], dtype = a[8], *n = a + 9, *xs = a + 13, *ys = a + 17;
            i64 o = 0;
            if (dtype == 1) {
                for (i64 i0 = 0; i0 < n[0]; i0++)
                    for (i64 i1 = 0; i1 < n[1]; i1++)
                        for (i64 i2 = 0; i2 < n[2]; i2++, o += n[3]) {
                            const i64 xi = i0 * xs[0] + i1 * xs[1] + i2 * xs[2];
                            const i64 yi = i0 * ys[0] + i1 * ys[1] + i2 * ys[2];
                            binary_row_f32(kind, (const float *)x + xi, xs[3], (const float *)y + yi, ys[3],
                                           (float *)out + o, n[3]);
                        }
                return 1;
            }
            for (i64 i0 = 0; i0 < n[0]; i0++)
                for (i64 i1 = 0; i1 < n[1]; i1++)
                    for (i64 i2 = 0; i2 < n[2]; i2++)
                        for (i64 i3 = 0; i3 < n[3]; i3++, o++) {
                            const i64 xi = i0 * xs[0] + i1 * xs[1] + i2 * xs[2] + i3 * xs[3];
                            const i64 yi = i0 * ys[0] + i1 * ys[1] + i2 * ys[2] + i3 * ys[3];
                            if (dtype == 0) ((i64 *)out)[o] = binary_i64(kind, ((const i64 *)x)[xi], ((const i64 *)y)[yi]);
                            else if (dtype == 1)
                                ((float *)out)[o] = binary_f32(kind, ((const float *)x)[xi], ((const float *)y)[yi]);
                            else
                                ((unsigned char *)out)[o] = (unsigned char)binary_i64(
                                    kind, ((const unsigned char *)x)[xi], ((const unsigned char *)y)[yi]);
                        }
            return 1;
        }
        case OP_SLOT_ATTENTION: {
            const i64 *s = a + 15;
            return (int)kiln_slot_attention_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), PTR(13), s[0], s[1],
                                                s[2], s[3], s[4], s[5], s[6], s[7], s[8], as_float(s[9]), threads);
        }
        case OP_ROPE_SLOT: {
            const i64 *s = a + 21;
            return (int)kiln_rope_slot_update_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), PTR(13), PTR(15),
                                                  PTR(17), PTR(19), s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7],
                                                  s[8], s[9], s[10], s[11], s[12], s[13]);
        }
        case OP_LAYER_NORM:
            kiln_layer_norm_f32(PTR(1), PTR(3), PTR(5), PTR(7), a[9], a[10], as_float(a[11]));
            return 1;
        case OP_UNARY:
            if (a[6] < 0 || a[6] >= (i64)(sizeof UNARY_FUNCTIONS / sizeof UNARY_FUNCTIONS[0])) return 0;
            UNARY_FUNCTIONS[a[6]](PTR(1), PTR(3), a[5]);
            return 1;
        case OP_CONV:
            return (int)kiln_conv2d_f32(a[11], PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), a + 16, a[12], a[13],
                                        as_float(a[14]), as_float(a[15]), threads);
        case OP_SUM_ROWS:
            kiln_sum_rows_f32(PTR(1), PTR(3), a[5], a[6], as_float(a[7]));
            return 1;
        case OP_MAX_POOL:
            kiln_maxpool2d_f32(PTR(1), PTR(3), a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
                               a[16], a[17], threads);
            return 1;
        case OP_GEMM_ROWS: /* W x^T + bias, x's rows in and the output's rows out (layout B_ROWS | C_ROWS) */
            kiln_gemm_packed_f32(PTR(3), PTR(1), PTR(5), PTR(7), a[10], a[9], a[11], a[11], 3, a[10], 0,
                                 -__builtin_inff(), __builtin_inff(), threads);
            return 1;
        case OP_CLAMP:
            kiln_clamp_f32(PTR(1), PTR(3), a[5], as_float(a[6]), as_float(a[7]));
            return 1;
        case OP_ROUTE:
            kiln_route_experts_f32(PTR(1), PTR(3), PTR(5), a[9], a[10], a[11], a[12], PTR(7));
            return 1;
        case OP_GATHERED:
            return (int)kiln_gathered_linear_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), PTR(13), a[15],
                                                 a[16], a[17], a[18], a[19], threads);
        case OP_GATHERED_Q:
            return (int)kiln_gathered_qlinear_f32(PTR(1), PTR(3), PTR(5), PTR(7), PTR(9), PTR(11), PTR(13), PTR(15),
                                                  PTR(17), a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26],
                                                  threads);
        default: return 0;
    }
#undef PTR
}

i64 kiln_execute_words(void) { return WORDS; }

i64 kiln_execute(const i64 *code, i64 count, char *const *bases, i64 threads) {
    for (i64 i = 0; i < count; i++)
        if (!run(code + i * WORDS, bases, threads)) return i + 1;
    return 0;
}

/* kiln_execute, adding each instruction's wall time in nanoseconds to ns[i] (a profile of a lowered plan) */
i64 kiln_execute_timed(const i64 *code, i64 count, char *const *bases, i64 threads, i64 *ns) {
    for (i64 i = 0; i < count; i++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        const int ok = run(code + i * WORDS, bases, threads);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ns[i] += (t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
        if (!ok) return i + 1;
    }
    return 0;
}
