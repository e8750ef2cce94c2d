/* A float32 GEMM with its left operand packed once: C[M][N] = A[M][K] B[K][N] (+ bias per row, activation), for
 * convolutions. A is a weight (a 1x1 convolution's [out, in], or [out, in * kh * kw] against an im2col band),
 * packed when a plan first meets it; B is the activations, row-major with leading dimension ldb (a 1x1
 * convolution's input planes [in][H * W], or the im2col band); C is row-major with leading dimension ldc.
 *
 * Why: BLAS packs A on every call, and its blocking is tuned for big square products. A network's 1x1
 * convolutions are many small products (MobileNetV3-small: 16..576 channels over 7x7..56x56 maps), where that
 * packing and BLAS's edge handling cost as much as the multiplies (OpenBLAS: 59-79 GFLOP/s on EfficientNet-lite0's
 * pointwise layers).
 *
 * How: the output is computed in tiles of MR rows x NR columns held in registers (12 x 32: 24 vectors of 16 lanes,
 * written with the compiler's vector extensions so the same source uses AVX-512, AVX2 or NEON). Per step of k a
 * tile loads two vectors of B and broadcasts 12 values of A: 24 multiply-adds. A's panels of MR rows are
 * interleaved by k when packed (rows past M are zero); each task copies the NR columns of B it works on into a
 * contiguous panel (zero past N), so the inner loop reads two streams in order. Columns go in blocks of 32, then
 * one of 16 at the end when that is all that is left.
 *
 * Every output is one tile's sum over k = 0..K-1 in order, then the bias, then the activation, whatever the thread
 * count or where the tile falls: results do not depend on the number of threads.
 */
#include <stdlib.h>
#include <string.h>

#include "pool.h"
#include "quant.h"
#include "vec16.h"


enum { MR = 12, NR = 32, PANELS_PER_TASK = 8, TAIL_COLUMNS = 4 };

/* kiln_gemm_packed_f32's layout bits: B given transposed, as [n][k] rows ldb apart (a linear layer's input rows);
 * C written transposed, as [n][m] rows ldc apart (the linear layer's output rows, so no transpose pass after). */
enum { B_ROWS = 1, C_ROWS = 2 };

/* Floats the packed form of an [m][k] matrix takes: whole panels of MR rows, and slack for the column kernel's
 * last vector load. */
i64 kiln_gemm_packed_size(i64 m, i64 k) { return (m + MR - 1) / MR * MR * k + 16; }

/* packed[p][k][i] = a[p * MR + i][k] (lda: a's row stride in floats), rows past m zero. */
void kiln_gemm_pack_f32(const float *restrict a, float *restrict packed, i64 m, i64 k, i64 lda) {
    for (i64 p = 0; p < (m + MR - 1) / MR; p++) {
        float *dst = packed + p * MR * k;
        for (i64 i = 0; i < MR; i++) {
            const i64 row = p * MR + i;
            if (row < m)
                for (i64 j = 0; j < k; j++) dst[j * MR + i] = a[row * lda + j];
            else
                for (i64 j = 0; j < k; j++) dst[j * MR + i] = 0.0f;
        }
    }
}

/* One tile's sums: acc[i][v] = sum_k a[k][i] * b[k][16 v ..], VECS vectors of columns, for the panel's first
 * 12, 8 or 4 rows (ROWS). Unrolled by hand over the rows so that the 24 accumulators are registers. The 8- and 4-row
 * tiles are for the last panel of a product whose rows are not a multiple of MR, where a full tile multiplied up
 * to 11 rows of zeros (a 16-row prompt chunk: 24 rows of work); each row's sums are the same products in the same
 * order whichever tile runs. */
#define ROW(i)                                                                                                 \
    {                                                                                                          \
        const v16 ai = splat16(ap[i]);                                                                           \
        acc[i][0] += ai * b0;                                                                                  \
        if (vecs > 1) acc[i][1] += ai * b1;                                                                    \
    }
#define FOUR ROW(0) ROW(1) ROW(2) ROW(3)
#define EIGHT FOUR ROW(4) ROW(5) ROW(6) ROW(7)
#define TWELVE EIGHT ROW(8) ROW(9) ROW(10) ROW(11)
#define TILE(NAME, VECS, ROWS)                                                                                 \
    static void NAME(const float *restrict a, const float *restrict b, i64 k, v16 acc[MR][2]) {               \
        const int vecs = VECS;                                                                                 \
        for (int i = 0; i < MR; i++) acc[i][0] = acc[i][1] = splat16(0.0f);                                   \
        for (i64 p = 0; p < k; p++) {                                                                          \
            const float *ap = a + p * MR;                                                                      \
            const v16 b0 = *(const v16 *)(b + p * NR);                                                         \
            const v16 b1 = vecs > 1 ? *(const v16 *)(b + p * NR + 16) : b0;                                    \
            ROWS                                                                                               \
        }                                                                                                      \
    }
TILE(tile2, 2, TWELVE)
TILE(tile1, 1, TWELVE)
TILE(tile2_8, 2, EIGHT)
TILE(tile1_8, 1, EIGHT)
TILE(tile2_4, 2, FOUR)
TILE(tile1_4, 1, FOUR)
#undef TILE
#undef TWELVE
#undef EIGHT
#undef FOUR
#undef ROW

typedef void (*tile_fn)(const float *restrict a, const float *restrict b, i64 k, v16 acc[MR][2]);

/* the tile kernel for a panel of `rows` live rows and `vecs` vectors of columns */
static inline tile_fn tile_for(i64 rows, int vecs) {
    if (rows <= 4) return vecs > 1 ? tile2_4 : tile1_4;
    if (rows <= 8) return vecs > 1 ? tile2_8 : tile1_8;
    return vecs > 1 ? tile2 : tile1;
}

/* The sums of up to TAIL_COLUMNS columns for a panel's MR rows (lanes 0..MR-1; the rest read the next step's
 * values and are dropped): the same products in the same order as a tile's, so an output does not depend on which
 * kernel ran it. For the last few columns of a row of outputs, where a tile of 16 would compute mostly padding;
 * the columns' chains are independent, so they overlap. */
static void columns(const float *restrict a, const float *restrict b, i64 k, i64 count, v16 acc[TAIL_COLUMNS]) {
    for (int j = 0; j < TAIL_COLUMNS; j++) acc[j] = splat16(0.0f);
    for (i64 p = 0; p < k; p++) {
        const v16 av = *(const v16u *)(a + p * MR);
        for (int j = 0; j < TAIL_COLUMNS; j++)
            if (j < count) acc[j] += av * splat16(b[p * NR + j]);
    }
}

/* A quantized weight [n][k] as B's rows (kiln_qgemm_f32): B[p][j] = W[j][p], each block of NR rows dequantized
 * (kiln_dequantize_f32) when its panel is packed, never the whole weight at once. */
typedef struct {
    const unsigned char *q;
    const float *scale, *zero;
    i64 row_bytes, format, group;
} quant_rows;

typedef struct {
    const float *packed, *b, *bias;
    float *c;
    const float *b_packed; /* B packed whole (by_panels), or NULL */
    const quant_rows *quant; /* B as a quantized weight's rows (B_ROWS), or NULL */
    i64 m, n, k, ldb, ldc, act, layout; /* B_ROWS and C_ROWS bits, below */
    float lo, hi;
    i64 col_blocks, panel_groups;
    i64 span; /* column blocks a by_columns task packs and covers */
} gemm_args;

/* A tile's rows (its first `vecs` vectors of columns, `width` of them kept) plus bias, activated, into out (the
 * tile's first output; rows g->ldc apart, or with C_ROWS columns g->ldc apart: output (i, j) at out[j * ldc + i]). */
static inline void store(const gemm_args *g, v16 acc[MR][2], int vecs, i64 row0, i64 rows, float *out,
                         i64 width, v16 lo, v16 hi) {
    if (g->layout & C_ROWS) { /* 16 columns at a time: the tile's rows as lanes, by one register transpose */
        for (int v = 0; v < vecs && 16 * v < width; v++) {
            v16 t[16];
            for (int i = 0; i < 16; i++)
                t[i] = i < rows ? activate16(acc[i][v] + splat16(g->bias ? g->bias[row0 + i] : 0.0f), (int)g->act,
                                             lo, hi)
                                : splat16(0.0f);
            transpose16(t);
            const i64 count = width - 16 * v < 16 ? width - 16 * v : 16;
            for (i64 j = 0; j < count; j++) store16_first(out + (16 * v + j) * g->ldc, t[j], (int)rows);
        }
        return;
    }
    for (i64 i = 0; i < rows; i++) {
        const v16 bias = splat16(g->bias ? g->bias[row0 + i] : 0.0f);
        float *dst = out + i * g->ldc;
        float line[NR];
        for (int v = 0; v < vecs; v++) {
            const v16 o = activate16(acc[i][v] + bias, (int)g->act, lo, hi);
            if (width == NR || (vecs == 1 && width == 16)) *(v16u *)(dst + 16 * v) = o;
            else *(v16u *)(line + 16 * v) = o;
        }
        if (!(width == NR || (vecs == 1 && width == 16)))
            for (i64 j = 0; j < width; j++) dst[j] = line[j];
    }
}

/* B's columns [c0, c0 + cols) as a contiguous k x NR panel, zero past them. A quantized B's rows are first
 * dequantized into `rows` (NR x k floats). */
static void pack_b(const gemm_args *g, i64 c0, i64 cols, float *restrict panel, float *restrict rows) {
    const i64 k = g->k;
    if (g->layout & B_ROWS) { /* panel[p][j] = B[c0 + j][p]: 16 rows x 16 of their elements at a time, transposed */
        const float *b = g->b + c0 * g->ldb; /* B's row c0 */
        i64 ldb = g->ldb;
        if (g->quant) {
            const quant_rows *w = g->quant;
            const i64 ngroups = k / w->group;
            kiln_dequantize_f32(w->q + c0 * w->row_bytes, w->scale + c0 * ngroups,
                                w->zero ? w->zero + c0 * ngroups : NULL, rows, cols, k, w->format, w->group);
            b = rows;
            ldb = k;
        }
        for (i64 j0 = 0; j0 < NR; j0 += 16)
            for (i64 p0 = 0; p0 < k; p0 += 16) {
                const int count = k - p0 < 16 ? (int)(k - p0) : 16;
                v16 t[16];
                for (i64 j = 0; j < 16; j++) {
                    const float *src = b + (j0 + j) * ldb + p0;
                    t[j] = j0 + j >= cols ? splat16(0.0f) : count == 16 ? *(const v16u *)src : load16_first(src, count);
                }
                transpose16(t);
                for (int q = 0; q < count; q++) *(v16u *)(panel + (p0 + q) * NR + j0) = t[q];
            }
        return;
    }
    for (i64 p = 0; p < k; p++) {
        const float *src = g->b + p * g->ldb + c0;
        float *dst = panel + p * NR;
        if (cols == NR) {
            *(v16 *)dst = *(const v16u *)src;
            *(v16 *)(dst + 16) = *(const v16u *)(src + 16);
        } else {
            for (i64 j = 0; j < cols; j++) dst[j] = src[j];
            for (i64 j = cols; j < NR; j++) dst[j] = 0.0f;
        }
    }
}

/* The outputs of A's panel pi (MR rows) x B's column block (its packed panel): a whole tile, or for the last
 * block a tile of 16, a padded one, and the last few columns one by one. */
static void panel_block(const gemm_args *g, i64 pi, i64 block, const float *panel, v16 lo, v16 hi) {
    const i64 k = g->k, c0 = block * NR, cols = g->n - c0 < NR ? g->n - c0 : NR;
    const float *a = g->packed + pi * MR * k;
    const i64 rows = g->m - pi * MR < MR ? g->m - pi * MR : MR;
    float *out = g->layout & C_ROWS ? g->c + c0 * g->ldc + pi * MR : g->c + pi * MR * g->ldc + c0;
    v16 acc[MR][2];
    i64 done = 0;
    if (cols == NR) {
        tile_for(rows, 2)(a, panel, k, acc);
        store(g, acc, 2, pi * MR, rows, out, NR, lo, hi);
        return;
    }
    if (cols >= 16 || cols > TAIL_COLUMNS) {
        tile_for(rows, 1)(a, panel, k, acc);
        done = cols < 16 ? cols : 16;
        store(g, acc, 1, pi * MR, rows, out, done, lo, hi);
    }
    float *rest = out + (g->layout & C_ROWS ? done * g->ldc : done);
    if (cols - done > TAIL_COLUMNS) {
        tile_for(rows, 1)(a, panel + done, k, acc);
        store(g, acc, 1, pi * MR, rows, rest, cols - done, lo, hi);
        return;
    }
    if (cols > done) {
        v16 sums[TAIL_COLUMNS];
        float bias[16] = {0}, line[16];
        for (i64 i = 0; i < rows; i++) bias[i] = g->bias ? g->bias[pi * MR + i] : 0.0f;
        columns(a, panel + done, k, cols - done, sums);
        for (i64 j = done; j < cols; j++) {
            const v16 o = activate16(sums[j - done] + *(const v16u *)bias, (int)g->act, lo, hi);
            if (g->layout & C_ROWS) {
                store16_first(rest + (j - done) * g->ldc, o, (int)rows);
                continue;
            }
            *(v16u *)line = o;
            for (i64 i = 0; i < rows; i++) out[i * g->ldc + j] = line[i];
        }
    }
}

/* Column blocks outer (task = a span of column blocks x a group of A's panels): the span's B panels, packed by the
 * task, stay in cache while the group's panels of A (a small A, in L2) pass over them, each panel over the whole
 * span, so a tile's rows are written in runs of a span's width rather than of one block (96 rows of 128 bytes at
 * a time made the 112x112 maps' writes 2x slower than BLAS's). For wide B: a convolution's feature map. */
static void by_columns(const void *ctx, i64 begin, i64 end) {
    const gemm_args *g = (const gemm_args *)ctx;
    const i64 panels = (g->m + MR - 1) / MR, span = g->span;
    float *panels_b = (float *)thread_scratch(SCRATCH_GEMM_SPAN, (span * g->k * NR + 16) * (i64)sizeof(float));
    float *rows = g->quant ? (float *)thread_scratch(SCRATCH_GEMM_ROWS, NR * g->k * (i64)sizeof(float)) : NULL;
    if (!panels_b || (g->quant && !rows)) return;
    i64 packed_span = -1;
    const v16 lo = splat16(g->lo), hi = splat16(g->hi);
    for (i64 task = begin; task < end; task++) {
        const i64 sp = task / g->panel_groups, group = task % g->panel_groups;
        const i64 b0 = sp * span, b1 = b0 + span < g->col_blocks ? b0 + span : g->col_blocks;
        if (sp != packed_span) {
            for (i64 block = b0; block < b1; block++)
                pack_b(g, block * NR, g->n - block * NR < NR ? g->n - block * NR : NR,
                       panels_b + (block - b0) * g->k * NR, rows);
            packed_span = sp;
        }
        const i64 p1 = (group + 1) * PANELS_PER_TASK < panels ? (group + 1) * PANELS_PER_TASK : panels;
        for (i64 pi = group * PANELS_PER_TASK; pi < p1; pi++)
            for (i64 block = b0; block < b1; block++)
                panel_block(g, pi, block, panels_b + (block - b0) * g->k * NR, lo, hi);
    }
}

/* Panels of A outer (task = one panel): each panel of a big A is read from memory once and stays in L1 while
 * every column block passes over it, B packed whole beforehand (g->b_packed, small enough for L2). For narrow B:
 * a linear layer's rows. */
static void by_panels(const void *ctx, i64 begin, i64 end) {
    const gemm_args *g = (const gemm_args *)ctx;
    const v16 lo = splat16(g->lo), hi = splat16(g->hi);
    for (i64 pi = begin; pi < end; pi++)
        for (i64 block = 0; block < g->col_blocks; block++)
            panel_block(g, pi, block, g->b_packed + block * g->k * NR, lo, hi);
}

enum { WHOLE_B_BYTES = 512 << 10, BIG_A_BYTES = 512 << 10, SPAN_BYTES = 256 << 10, SPAN_BLOCKS = 8 };

/* by_columns over the pool: a span's B panels in about half of L2, at most SPAN_BLOCKS of them, and at least two
 * tasks a thread where the columns allow it (a span of everything would leave one) */
static void columns_outer(gemm_args *g, i64 threads) {
    g->span = SPAN_BYTES / (g->k * NR * (i64)sizeof(float) + 1);
    g->span = g->span < 1 ? 1 : (g->span > SPAN_BLOCKS ? SPAN_BLOCKS : g->span);
    while (g->span > 1 && (g->col_blocks + g->span - 1) / g->span * g->panel_groups < 2 * threads) g->span /= 2;
    parallel_for(by_columns, g, (g->col_blocks + g->span - 1) / g->span * g->panel_groups, threads);
}

/* C = A B (+ bias[row], then act: 0 none, 1 clamp to [lo, hi], 2 hardswish), A packed by kiln_gemm_pack_f32; B
 * [k][n] with rows ldb apart and C [m][n] with rows ldc apart, or either transposed (layout: B_ROWS, C_ROWS). */
void kiln_gemm_packed_f32(const float *packed, const float *b, const float *bias, float *c, i64 m, i64 n, i64 k,
                          i64 ldb, i64 layout, i64 ldc, i64 act, float lo, float hi, i64 threads) {
    if (m <= 0 || n <= 0) return;
    const i64 panels = (m + MR - 1) / MR;
    gemm_args g = {packed, b, bias, c, NULL, NULL, m, n, k, ldb, ldc, act, layout, lo, hi, (n + NR - 1) / NR,
                   (panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK, 0};
    const i64 work = m * n * (k > 0 ? k : 1);
    const i64 most = work / (1 << 18); /* a part worth at least ~0.25M multiply-adds */
    threads = threads_for(threads, most);
    const i64 b_bytes = g.col_blocks * NR * k * (i64)sizeof(float);
    float *whole = m * k * (i64)sizeof(float) > BIG_A_BYTES && b_bytes <= WHOLE_B_BYTES
                       ? (float *)thread_scratch(SCRATCH_GEMM_B, b_bytes + 64)
                       : NULL;
    if (whole) {
        for (i64 block = 0; block < g.col_blocks; block++)
            pack_b(&g, block * NR, n - block * NR < NR ? n - block * NR : NR, whole + block * k * NR, NULL);
        g.b_packed = whole;
        parallel_for(by_panels, &g, panels, threads);
        return;
    }
    columns_outer(&g, threads);
}

/* out[m][n] = x[m][k] W^T for a quantized weight W [n][k] (q, scale, zero in kiln_qlinear_f32's formats): the
 * packed GEMM with x as A (packed here) and W's rows as B, each block of NR rows dequantized as its panel is
 * packed, so a prompt's many rows (prefill) multiply in one call over the pool at the GEMM's speed without the
 * float32 weight ever existing whole. BLAS over dequantized bands of rows (quant.py's path without the helpers)
 * packs each band on every call and runs many small products (SmolLM2's int4 layers at 128 rows: 92-97 GFLOP/s
 * where this GEMM runs the float32 weights at 160-210), and OpenBLAS's threads then spin on the pool's cores. Every output is one sum over k in order (the tile's), whatever the
 * thread count. Returns 0 (nothing written) where the scratch cannot be had. */
i64 kiln_qgemm_f32(const float *x, const void *q, const float *scale, const float *zero, float *out, i64 m, i64 n,
                   i64 k, i64 format, i64 group, i64 threads) {
    if (m <= 0 || n <= 0) return 1;
    float *packed = (float *)thread_scratch(SCRATCH_GEMM_A, kiln_gemm_packed_size(m, k) * (i64)sizeof(float));
    if (!packed) return 0;
    kiln_gemm_pack_f32(x, packed, m, k, k);
    const quant_rows w = {(const unsigned char *)q, scale, zero, k * QUANT_BITS(format) / 8, format, group};
    const i64 panels = (m + MR - 1) / MR;
    gemm_args g = {packed, NULL, NULL, out, NULL, &w, m, n, k, k, n, 0, B_ROWS, 0.0f, 0.0f, (n + NR - 1) / NR,
                   (panels + PANELS_PER_TASK - 1) / PANELS_PER_TASK, 0};
    columns_outer(&g, threads_for(threads, m * n * k / (1 << 18)));
    return 1;
}
