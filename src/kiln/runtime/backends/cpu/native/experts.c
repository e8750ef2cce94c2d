/* A mixture-of-experts layer's router pick and experts over a decode step's few rows, for the CPU kernels
 * (cpu/experts.py) and the native executor alike, so a MoE decode step lowers whole and both paths give the same
 * bits.
 *
 * kiln_route_experts_f32: the op set's route_experts for float32 logits: per row, p = exp(x - max) / sum (the sum
 * in order), the k largest p by k passes (NaN above everything, ties to the lower index, as topk orders them),
 * divided by their sum (in pick order) when `normalize`.
 *
 * kiln_gathered_linear_f32: gathered_linear for s <= 8 rows: the rows grouped by expert (ascending, rows in order
 * within a group, as cpu/experts.py's expert_groups), each group's rows copied together and multiplied by their
 * expert through kiln_linear_rows_f32 (what the Python kernel calls for a group of a few rows), then, with combine
 * [t, topk], each token's rows weighted and added in order (NumPy's float32 product and its sum over that axis).
 * Returns 0 without writing where an index is outside 0 .. experts - 1 (the caller raises the op's error).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int64_t i64;

void kiln_linear_rows_f32(const float *x, const float *w, const float *bias, float *out, i64 m, i64 n, i64 k,
                          i64 threads);

enum { GATHERED_ROWS_MAX = 8 };

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

/* (no FMA contraction here: each product is rounded before it is added, as the op's combine defines it) */
__attribute__((optimize("fp-contract=off"))) i64 kiln_gathered_linear_f32(const float *x, const i64 *index, const float *w, const float *bias,
                             const float *combine, float *out, float *work, i64 s, i64 n, i64 k, i64 experts,
                             i64 topk, i64 threads) {
    if (s > GATHERED_ROWS_MAX) return 0;
    i64 order[GATHERED_ROWS_MAX];
    for (i64 i = 0; i < s; ++i) {
        if (index[i] < 0 || index[i] >= experts) return 0;
        i64 j = i;
        for (; j > 0 && index[order[j - 1]] > index[i]; --j) order[j] = order[j - 1]; /* (stable) */
        order[j] = i;
    }
    float *xg = work, *og = work + GATHERED_ROWS_MAX * k;
    float *rows = topk ? og + GATHERED_ROWS_MAX * n : out;
    for (i64 first = 0; first < s;) {
        const i64 e = index[order[first]];
        i64 m = 0;
        for (; first + m < s && index[order[first + m]] == e; ++m)
            memcpy(xg + m * k, x + order[first + m] * k, (size_t)k * sizeof(float));
        kiln_linear_rows_f32(xg, w + e * n * k, bias ? bias + e * n : 0, og, m, n, k, threads);
        for (i64 i = 0; i < m; ++i) memcpy(rows + order[first + i] * n, og + i * n, (size_t)n * sizeof(float));
        first += m;
    }
    if (topk) {
        const i64 tokens = s / topk;
        for (i64 t = 0; t < tokens; ++t) {
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
    return 1;
}
