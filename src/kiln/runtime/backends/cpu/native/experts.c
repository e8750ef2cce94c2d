/* A mixture-of-experts layer's router pick and experts over a decode step's few rows, for the CPU kernels
 * (cpu/experts.py) and the native executor alike, so a MoE decode step lowers whole and both paths give the same
 * bits.
 *
 * kiln_route_experts_f32: the op set's route_experts for float32 logits: per row, p = exp(x - max) / sum (the sum
 * in order), the k largest p by k passes (NaN above everything, ties to the lower index, as topk orders them),
 * divided by their sum (in pick order) when `normalize`.
 *
 * kiln_gathered_linear_f32: gathered_linear for s <= 64 rows (a decode step's top-k rows, of up to 64 / k
 * sequences when a serving program decodes them together): the rows grouped by expert (ascending, rows in order
 * within a group, as cpu/experts.py's expert_groups), each group's rows copied together, 8 at most at a time, and
 * multiplied by their expert through kiln_linear_rows_f32 (whose sums do not depend on how many rows it takes), then,
 * with combine [t, topk], each token's rows weighted and added in order (NumPy's float32 product and its sum over
 * that axis).
 * Returns 0 without writing where an index is outside 0 .. experts - 1 (the caller raises the op's error).
 *
 * kiln_gathered_qlinear_f32: gathered_quantized_linear the same way, each group through the quantized few-row
 * linear the Python kernel calls (kiln_qlinear_dot_f32 where `dot` and the helpers take it, else kiln_qlinear_f32)
 * on its expert's q, scale and zero rows (format: quant.h's bits and flags).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant.h"

typedef int64_t i64;

void kiln_linear_rows_f32(const float *x, const float *w, const float *bias, float *out, i64 m, i64 n, i64 k,
                          i64 threads);
i64 kiln_qlinear_dot_f32(const float *x, const void *q, const float *scale, const float *zero, const float *bias,
                         float *out, void *work, i64 m, i64 n, i64 k, i64 format, i64 group, i64 threads);
void kiln_qlinear_f32(const float *x, const void *qv, const float *scale, const float *zero, const float *bias,
                      float *out, float *xs, i64 m, i64 n, i64 k, i64 format, i64 group, i64 threads);

enum { GATHERED_ROWS_MAX = 64, GROUP_ROWS_MAX = 8 };

/* whether probability a (at index ia) comes before b (at ib) in topk's order */
static inline int picked_before(float a, i64 ia, float b, i64 ib) {
    const int na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

void kiln_route_experts_f32(const float *logits, float *weights, i64 *ids, i64 rows, i64 n, i64 k, i64 normalize,
                            float *work) {
    for (i64 r = 0; r < rows; ++r) {
        const float *x = logits + r * n;
        float *p = work;
        float top = -INFINITY;
        int nan = 0;
        for (i64 i = 0; i < n; ++i) {
            nan |= x[i] != x[i];
            if (x[i] > top) top = x[i];
        }
        float sum = 0.0f;
        for (i64 i = 0; i < n; ++i) {
            p[i] = nan ? NAN : expf(x[i] - top);
            sum += p[i];
        }
        for (i64 i = 0; i < n; ++i) p[i] = p[i] / sum;
        float *w = weights + r * k;
        i64 *id = ids + r * k;
        for (i64 j = 0; j < k; ++j) {
            i64 best = -1;
            for (i64 i = 0; i < n; ++i) {
                int taken = 0;
                for (i64 t = 0; t < j; ++t) taken |= id[t] == i;
                if (!taken && (best < 0 || picked_before(p[i], i, p[best], best))) best = i;
            }
            id[j] = best;
            w[j] = p[best];
        }
        if (normalize) {
            float total = 0.0f;
            for (i64 j = 0; j < k; ++j) total += w[j];
            for (i64 j = 0; j < k; ++j) w[j] = w[j] / total;
        }
    }
}

/* The rows grouped by expert (ascending, rows in order within a group) into order[]; 0 where an index is out. */
static int expert_order(const i64 *index, i64 s, i64 experts, i64 *order) {
    for (i64 i = 0; i < s; ++i) {
        if (index[i] < 0 || index[i] >= experts) return 0;
        i64 j = i;
        for (; j > 0 && index[order[j - 1]] > index[i]; --j) order[j] = order[j - 1]; /* (stable) */
        order[j] = i;
    }
    return 1;
}

/* out[t] = sum over j of rows[t topk + j] * combine[t, j], each product rounded before it is added (no FMA
 * contraction here: the op's combine defines it so) */
__attribute__((optimize("fp-contract=off"))) static void combine_rows(const float *rows, const float *combine,
                                                                       float *out, i64 s, i64 n, i64 topk) {
    for (i64 t = 0; t < s / topk; ++t) {
        float *o = out + t * n;
        for (i64 j = 0; j < topk; ++j) {
            const float c = combine[t * topk + j];
            const float *row = rows + (t * topk + j) * n;
            if (j == 0) {
                for (i64 i = 0; i < n; ++i) o[i] = row[i] * c;
            } else {
                for (i64 i = 0; i < n; ++i) o[i] += row[i] * c;
            }
        }
    }
}

/* One expert's group of m rows (a float or quantized weight): `quant` null for float32 weights. */
typedef struct {
    const void *q;
    const float *scale, *zero;
    i64 format, group, dot;
    void *work;
} quant_args;

static i64 gathered(const float *x, const i64 *index, const float *w, const quant_args *quant, const float *bias,
                    const float *combine, float *out, float *work, i64 s, i64 n, i64 k, i64 experts, i64 topk,
                    i64 threads) {
    i64 order[GATHERED_ROWS_MAX];
    if (s > GATHERED_ROWS_MAX || !expert_order(index, s, experts, order)) return 0;
    float *xg = work, *og = work + GROUP_ROWS_MAX * k;
    float *rows = topk ? og + GROUP_ROWS_MAX * n : out;
    for (i64 first = 0; first < s;) {
        const i64 e = index[order[first]];
        i64 m = 0; /* the rows of expert e from `first`, GROUP_ROWS_MAX at most at a time */
        for (; m < GROUP_ROWS_MAX && first + m < s && index[order[first + m]] == e; ++m)
            memcpy(xg + m * k, x + order[first + m] * k, (size_t)k * sizeof(float));
        const float *b = bias ? bias + e * n : 0;
        if (quant) {
            const i64 row_bytes = QUANT_BITS(quant->format) == 4 ? k / 2 : k, groups = k / quant->group;
            const char *q = (const char *)quant->q + e * n * row_bytes;
            const float *scale = quant->scale + e * n * groups, *zero = quant->zero ? quant->zero + e * n * groups : 0;
            if (!(quant->dot && kiln_qlinear_dot_f32(xg, q, scale, zero, b, og, quant->work, m, n, k, quant->format,
                                                     quant->group, threads)))
                kiln_qlinear_f32(xg, q, scale, zero, b, og, quant->work, m, n, k, quant->format, quant->group,
                                 threads);
        } else {
            kiln_linear_rows_f32(xg, w + e * n * k, b, og, m, n, k, threads);
        }
        for (i64 i = 0; i < m; ++i) memcpy(rows + order[first + i] * n, og + i * n, (size_t)n * sizeof(float));
        first += m;
    }
    if (topk) combine_rows(rows, combine, out, s, n, topk);
    return 1;
}

i64 kiln_gathered_linear_f32(const float *x, const i64 *index, const float *w, const float *bias,
                             const float *combine, float *out, float *work, i64 s, i64 n, i64 k, i64 experts,
                             i64 topk, i64 threads) {
    return gathered(x, index, w, 0, bias, combine, out, work, s, n, k, experts, topk, threads);
}

/* work: 8 (k + n) + 64 n floats (a group's rows in and out, and the rows a combine sums), then the quantized
 * linear's 2 * 8 (k + k / group) (cpu/experts.py's gathered_work) */
i64 kiln_gathered_qlinear_f32(const float *x, const i64 *index, const void *q, const float *scale, const float *zero,
                              const float *bias, const float *combine, float *out, float *work, i64 s, i64 n, i64 k,
                              i64 experts, i64 topk, i64 format, i64 group, i64 dot, i64 threads) {
    const quant_args quant = {q, scale, zero, format, group, dot,
                              work + GROUP_ROWS_MAX * (k + n) + GATHERED_ROWS_MAX * n};
    return gathered(x, index, 0, &quant, bias, combine, out, work, s, n, k, experts, topk, threads);
}
