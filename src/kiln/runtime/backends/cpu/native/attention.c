/* Attention for a few queries (a decode step): softmax(q k^T * scale, masked) v, one query row at a time over
 * the keys it sees. NumPy's composition (two batched matmuls, a mask select, max, exp, sum, divide, and the
 * narrowing of a static cache to the keys some query sees) cost ~65 us a layer of SmolLM2 for ~0.3 MFLOP; this is
 * a few microseconds. Keys a query does not see are skipped, not multiplied: a static KV cache of 1024 slots at
 * position 128 costs 129 keys.
 *
 * q [B, Hq, L, D] and out [B, Hq, L, Dv] contiguous; k and v addressed by strides (in elements) over batch, kv
 * head and key, their last dimension contiguous; Hq a multiple of Hkv (the q heads of a kv head are consecutive,
 * as GQA lays them out). mask: bytes (bool) addressed by strides over batch, q head, query and key (0 where it
 * broadcasts), or none; causal: query i sees keys j <= i (the reference's tril(ones(L, S))). A query that sees
 * no key gets NaN, as the reference (softmax of all -inf) gives. sinks [Hq], or none: each q head's sink logit,
 * one more term in its softmax's sum with no value (gpt-oss); a query that sees no key then gets zeros. Scores are
 * kept for one query at a time in the thread's scratch (S floats).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"
#include "vec16.h"
#include "vmath.h"

enum { ATTEND_AHEAD = 8 }; /* key rows ahead that attend asks the cache for */
/* keys x heads x (D + Dv) values a thread's part of a decode step's attention reads at least (memory-bound: a
 * quarter of the linear layers' LINEAR_MIN_PART) */
enum { ATTENTION_MIN_PART = LINEAR_MIN_PART / 4 };

static inline float sum_lanes(v16 v) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    const v8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 f = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (f[0] + f[2]) + (f[1] + f[3]);
}

static inline float dot(const float *restrict a, const float *restrict b, i64 n) {
    v16 acc = {0};
    i64 j = 0;
    for (; j + 16 <= n; j += 16) acc += *(const v16u *)(a + j) * *(const v16u *)(b + j);
    float total = sum_lanes(acc);
    for (; j < n; j++) total += a[j] * b[j];
    return total;
}

/* o[0:n] = sum_j p[j] x[j * stride + 0:n] over the j with p[j] != 0, 64 outputs at a time held in registers
 * (accumulating in memory chained every key through a store and a reload) */
static inline void weighted_sum(float *restrict o, const float *restrict p, i64 count, const float *restrict x,
                                i64 stride, i64 n) {
    i64 e = 0;
    for (; e + 64 <= n; e += 64) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (i64 j = 0; j < count; j++) {
            if (j + ATTEND_AHEAD < count)
                for (i64 f = 0; f < 64; f += 16) __builtin_prefetch(x + (j + ATTEND_AHEAD) * stride + e + f);
            if (p[j] == 0.0f) continue;
            const v16 pv = {p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j], p[j],
                            p[j]};
            const float *xj = x + j * stride + e;
            a0 += pv * *(const v16u *)xj, a1 += pv * *(const v16u *)(xj + 16);
            a2 += pv * *(const v16u *)(xj + 32), a3 += pv * *(const v16u *)(xj + 48);
        }
        *(v16u *)(o + e) = a0, *(v16u *)(o + e + 16) = a1, *(v16u *)(o + e + 32) = a2, *(v16u *)(o + e + 48) = a3;
    }
    for (; e < n; e++) {
        float a = 0.0f;
        for (i64 j = 0; j < count; j++) a += p[j] * x[j * stride + e];
        o[e] = a;
    }
}

/* The scores w[0..count) (top their maximum with the sink) into exp(w - top), the softmax's weights before its
 * division; returns 1 / (their sum + the sink's term) */
static inline float softmax_weights(float *restrict w, i64 count, float top, float sink) {
    for (i64 j = 0; j < count; j++) w[j] = exp_f32(w[j] - top); /* (vectorized; hidden keys: 0) */
    v16 sums = {0};
    i64 j = 0;
    for (; j + 16 <= count; j += 16) sums += *(const v16u *)(w + j);
    float total = sum_lanes(sums);
    for (; j < count; j++) total += w[j];
    total += exp_f32(sink - top); /* (0 without a sink) */
    return 1.0f / total;
}

/* softmax(q . k_j * scale) over keys j < count (k_j at kq + j * ks; mq, when given, hides key j where mq[j * ms]
 * is 0) and the sink logit (-inf: none) times the values at vq + j * vs, into oi; NaN where no key (and no sink)
 * is seen, as the reference's softmax gives */
static void attend(const float *restrict qi, const float *restrict kq, i64 ks, const float *restrict vq, i64 vs,
                   const unsigned char *restrict mq, i64 ms, i64 count, i64 D, i64 Dv, float scale, float sink,
                   float *restrict work, float *restrict oi) {
    float top = sink;
    for (i64 j = 0; j < count; j++) {
        if (j + ATTEND_AHEAD < count) /* (the rows are a kv head's of a cache row: strided, and the step's reads
                                        * are few enough that the hardware prefetcher does not get ahead) */
            for (i64 e = 0; e < D; e += 16) __builtin_prefetch(kq + (j + ATTEND_AHEAD) * ks + e);
        work[j] = mq && !mq[j * ms] ? -INFINITY : dot(qi, kq + j * ks, D) * scale;
        top = work[j] > top ? work[j] : top;
    }
    if (!(top > -INFINITY)) { /* no key seen (or NaN scores) */
        for (i64 e = 0; e < Dv; e++) oi[e] = NAN;
        return;
    }
    const float inverse = softmax_weights(work, count, top, sink);
    weighted_sum(oi, work, count, vq, vs, Dv);
    for (i64 e = 0; e < Dv; e++) oi[e] *= inverse;
}

/* keys a block of scores; q heads a pass over the values holds; q heads a group at most (bits of a mask) */
enum { GROUP_KEYS = 16, GROUP_HEADS = 4, MAX_GROUP = 64 };

/* attend for the `heads` q heads of one kv head (GQA's group: q rows qs apart, outputs os apart), every key and
 * value row read once for all of them, where one head at a time read the group's cache rows `heads` times (the
 * second and third from L2, but at 3x the instructions); the scores 16 keys a block, their sums across lanes
 * taken 16 at a time (sum_lanes16). Each head's result is attend's, bit for bit (the same products, sums and
 * order; a value row whose weight is 0 skipped for that head, as weighted_sum skips it). work: heads * count
 * floats. D a multiple of 16, Dv of 64. */
static void attend_group(const float *restrict q, i64 qs, int heads, const float *restrict kq, i64 ks,
                         const float *restrict vq, i64 vs, i64 count, i64 D, i64 Dv, float scale,
                         const float *restrict sinks, float *restrict work, float *restrict o, i64 os) {
    i64 j = 0;
    for (; j + GROUP_KEYS <= count; j += GROUP_KEYS) {
        for (i64 m = 0; m < GROUP_KEYS; m++) /* the next block's rows (ATTEND_AHEAD's reason) */
            if (j + GROUP_KEYS + m < count)
                for (i64 e = 0; e < D; e += 16) __builtin_prefetch(kq + (j + GROUP_KEYS + m) * ks + e);
        for (int h = 0; h < heads; h++) {
            const float *qh = q + h * qs;
            v16 acc[GROUP_KEYS];
            for (int m = 0; m < GROUP_KEYS; m++) {
                v16 a = {0};
                for (i64 e = 0; e < D; e += 16) a += *(const v16u *)(qh + e) * *(const v16u *)(kq + (j + m) * ks + e);
                acc[m] = a;
            }
            *(v16u *)(work + h * count + j) = sum_lanes16(acc) * scale;
        }
    }
    for (; j < count; j++)
        for (int h = 0; h < heads; h++) work[h * count + j] = dot(q + h * qs, kq + j * ks, D) * scale;
    float inverse[MAX_GROUP];
    unsigned long long live = 0; /* heads that saw a key: bit h */
    for (int h = 0; h < heads; h++) {
        float *w = work + h * count;
        const float sink = sinks ? sinks[h] : -INFINITY;
        float top = sink;
        for (i64 i = 0; i < count; i++) top = w[i] > top ? w[i] : top;
        if (!(top > -INFINITY)) { /* no key seen (or NaN scores): NaN, as attend */
            for (i64 e = 0; e < Dv; e++) o[h * os + e] = NAN;
            continue;
        }
        live |= 1ull << h;
        inverse[h] = softmax_weights(w, count, top, sink);
    }
    for (int h0 = 0; h0 < heads; h0 += GROUP_HEADS) {
        const int hn = heads - h0 < GROUP_HEADS ? heads - h0 : GROUP_HEADS;
        for (i64 e = 0; e < Dv; e += 64) {
            v16 acc[GROUP_HEADS][4];
            for (int h = 0; h < hn; h++) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = (v16){0};
            for (i64 i = 0; i < count; i++) {
                if (i + ATTEND_AHEAD < count)
                    for (i64 f = 0; f < 64; f += 16) __builtin_prefetch(vq + (i + ATTEND_AHEAD) * vs + e + f);
                const float *xi = vq + i * vs + e;
                const v16 x0 = *(const v16u *)xi, x1 = *(const v16u *)(xi + 16), x2 = *(const v16u *)(xi + 32),
                          x3 = *(const v16u *)(xi + 48);
                for (int h = 0; h < hn; h++) {
                    const float p = work[(h0 + h) * count + i];
                    if (p == 0.0f || !(live >> (h0 + h) & 1)) continue;
                    const v16 pv = {p, p, p, p, p, p, p, p, p, p, p, p, p, p, p, p};
                    acc[h][0] += pv * x0, acc[h][1] += pv * x1, acc[h][2] += pv * x2, acc[h][3] += pv * x3;
                }
            }
            for (int h = 0; h < hn; h++) {
                if (!(live >> (h0 + h) & 1)) continue;
                float *oh = o + (h0 + h) * os + e;
                for (int c = 0; c < 4; c++) {
                    float lanes[16];
                    *(v16u *)lanes = acc[h][c];
                    for (int l = 0; l < 16; l++) oh[16 * c + l] = lanes[l] * inverse[h0 + h];
                }
            }
        }
    }
}

/* The keys query i may see, [first, seen): causal and the mask's first and last true entries bound them. */
static inline void visible(const unsigned char *mi, i64 ms, i64 i, i64 S, i64 causal, i64 *first, i64 *seen) {
    const i64 last = causal ? i : S - 1; /* the last key this query may see (causal: as tril(ones(L, S))) */
    i64 f = 0, n = last < S ? last + 1 : S;
    if (mi) {
        if (ms == 1) { /* 8 bytes at a time past runs of hidden keys (a static cache's unused tail) */
            uint64_t word;
            while (f + 8 <= n && (memcpy(&word, mi + f, 8), word == 0)) f += 8;
            while (n - 8 >= f && (memcpy(&word, mi + n - 8, 8), word == 0)) n -= 8;
        }
        while (f < n && !mi[f * ms]) f++;
        while (n > f && !mi[(n - 1) * ms]) n--;
    }
    *first = f;
    *seen = n;
}

typedef struct {
    const float *q, *k, *v;
    const unsigned char *mask;
    const float *sinks;
    float *out;
    i64 Hq, Hkv, L, S, D, Dv, kb, kh, ks, vb, vh, vs, mb, mh, ml, ms, causal;
    float scale;
} attention_args;

enum { QT = 8, KT = 16 }; /* queries a tile, keys a vector */

/* The queries of one head (task = (batch, q head)) in tiles of QT: the keys any of them sees transposed once
 * ([D][keys]: no sums across lanes), each tile's scores against the keys its queries see, 16 keys a vector and QT
 * rows in registers; each row's softmax; then the values weighted by the rows, 4 rows x 64 outputs in registers,
 * each value row loaded once for them. For prefill (128 queries and more), where one query at a time re-read
 * every key for each query and summed each dot product across lanes. */
static void attention_tiles(const void *ctx, i64 begin, i64 end) {
    const attention_args *a = ctx;
    const i64 D = a->D, Dv = a->Dv, S = a->S, group = a->Hq / a->Hkv;
    const i64 span = (S + KT - 1) / KT * KT;
    float *memory = (float *)thread_scratch(SCRATCH_ATTENTION, (D * span + QT * span + 4 * a->L) * (i64)sizeof(float));
    if (!memory) return;
    float *kt = memory, *scores = memory + D * span; /* [D][span], [QT][span] */
    i64 *bounds = (i64 *)(scores + QT * span);      /* [L][2]: each query's visible keys */
    for (i64 bh = begin; bh < end; bh++) { /* task: (batch, q head) */
        const i64 b = bh / a->Hq, h = bh % a->Hq;
        const float *kq = a->k + b * a->kb + (h / group) * a->kh, *vq = a->v + b * a->vb + (h / group) * a->vh;
        const unsigned char *mh = a->mask ? a->mask + b * a->mb + h * a->mh : 0;
        const float sink = a->sinks ? a->sinks[h] : -INFINITY;
        /* the keys any query of the head sees, transposed once ([D][keys], zero past them) */
        i64 lo = S, hi = 0;
        for (i64 i = 0; i < a->L; i++) {
            i64 *f = &bounds[2 * i], *n = &bounds[2 * i + 1];
            visible(mh ? mh + i * a->ml : 0, a->ms, i, S, a->causal, f, n);
            if (*n > *f) {
                lo = *f < lo ? *f : lo;
                hi = *n > hi ? *n : hi;
            }
        }
        const i64 all = hi > lo ? hi - lo : 0, stride = (all + KT - 1) / KT * KT;
        for (i64 j = 0; j < stride; j++)
            for (i64 d = 0; d < D; d++) kt[d * stride + j] = j < all ? kq[(lo + j) * a->ks + d] : 0.0f;
        for (i64 i0 = 0; i0 < a->L; i0 += QT) {
            const i64 rows = a->L - i0 < QT ? a->L - i0 : QT;
            float *o0 = a->out + ((b * a->Hq + h) * a->L + i0) * Dv;
            i64 first[QT], seen[QT], tlo = hi, thi = lo;
            for (i64 r = 0; r < rows; r++) {
                first[r] = bounds[2 * (i0 + r)], seen[r] = bounds[2 * (i0 + r) + 1];
                if (seen[r] > first[r]) {
                    tlo = first[r] < tlo ? first[r] : tlo;
                    thi = seen[r] > thi ? seen[r] : thi;
                }
            }
            if (thi <= tlo) { /* no row sees a key: NaN, or zeros beside a sink */
                for (i64 e = 0; e < rows * Dv; e++) o0[e] = a->sinks ? 0.0f : NAN;
                continue;
            }
            const i64 j0 = (tlo - lo) / KT * KT, j1 = thi - lo; /* the tile's keys, from a whole vector of kt */
            const float *qt = a->q + ((b * a->Hq + h) * a->L + i0) * D;
            for (i64 j = j0; j < j1; j += KT) {
                v16 acc[QT];
                for (int r = 0; r < QT; r++) acc[r] = (v16){0};
                for (i64 d = 0; d < D; d++) {
                    const v16 kv = *(const v16 *)(kt + d * stride + j);
                    for (int r = 0; r < QT; r++) acc[r] += kv * qt[(r < rows ? r : 0) * D + d];
                }
                for (int r = 0; r < QT; r++) *(v16u *)(scores + r * span + j) = acc[r];
            }
            int dead[QT] = {0};
            for (i64 r = 0; r < rows; r++) {
                float *sr = scores + r * span, top = sink;
                const unsigned char *mi = mh ? mh + (i0 + r) * a->ml : 0;
                for (i64 j = j0; j < j1; j++) {
                    const i64 key = lo + j;
                    const int hidden = key < first[r] || key >= seen[r] || (mi && !mi[key * a->ms]);
                    sr[j] = hidden ? -INFINITY : sr[j] * a->scale;
                    top = sr[j] > top ? sr[j] : top;
                }
                if (!(top > -INFINITY)) { /* no key seen (or NaN scores): NaN, as the reference's softmax */
                    dead[r] = 1;
                    for (i64 j = j0; j < j1; j++) sr[j] = 0.0f;
                    continue;
                }
                float total = exp_f32(sink - top); /* (0 without a sink) */
                for (i64 j = j0; j < j1; j++) sr[j] = exp_f32(sr[j] - top); /* (vectorized; hidden keys: 0) */
                for (i64 j = j0; j < j1; j++) total += sr[j];
                const float inverse = 1.0f / total;
                for (i64 j = j0; j < j1; j++) sr[j] *= inverse;
            }
            for (i64 r0 = 0; r0 < rows; r0 += 4) { /* out rows r0.. = sum_j p[r][j] v[j], 64 outputs at a time */
                const i64 rn = rows - r0 < 4 ? rows - r0 : 4;
                for (i64 e = 0; e < Dv; e += 64) {
                    v16 acc[4][4];
                    for (int r = 0; r < 4; r++)
                        for (int c = 0; c < 4; c++) acc[r][c] = (v16){0};
                    for (i64 j = j0; j < j1; j++) {
                        const float *vj = vq + (lo + j) * a->vs + e;
                        const v16 v0 = *(const v16u *)vj, v1 = *(const v16u *)(vj + 16),
                                  v2 = *(const v16u *)(vj + 32), v3 = *(const v16u *)(vj + 48);
                        for (int r = 0; r < 4; r++) {
                            const float p = scores[(r0 + (r < rn ? r : 0)) * span + j];
                            acc[r][0] += v0 * p, acc[r][1] += v1 * p, acc[r][2] += v2 * p, acc[r][3] += v3 * p;
                        }
                    }
                    for (i64 r = 0; r < rn; r++)
                        for (int c = 0; c < 4; c++)
                            *(v16u *)(o0 + (r0 + r) * Dv + e + 16 * c) = dead[r0 + r] ? (v16){0} / 0.0f : acc[r][c];
                }
            }
        }
    }
}

/* Queries a head from which the tiles run (below, one query at a time: a decode step's few rows) */
enum { TILED_MIN_QUERIES = 16 };

/* The queries of tasks [begin, end) of a decode step's attention, a task a (batch, q head): each query its visible
 * keys one by one (attend), the scores in this thread's scratch. */
static void attention_rows(const void *ctx, i64 begin, i64 end) {
    const attention_args *a = ctx;
    const i64 group = a->Hq / a->Hkv;
    float *work = (float *)thread_scratch(SCRATCH_ATTENTION, a->S * (i64)sizeof(float));
    if (!work) return; /* (the caller asked for it first: not reached) */
    for (i64 bh = begin; bh < end; bh++) {
        const i64 b = bh / a->Hq, h = bh % a->Hq;
        const float *kh0 = a->k + b * a->kb + (h / group) * a->kh, *vh0 = a->v + b * a->vb + (h / group) * a->vh;
        for (i64 i = 0; i < a->L; i++) {
            const unsigned char *mi = a->mask ? a->mask + b * a->mb + h * a->mh + i * a->ml : 0;
            i64 first, seen;
            visible(mi, a->ms, i, a->S, a->causal, &first, &seen);
            attend(a->q + ((b * a->Hq + h) * a->L + i) * a->D, kh0 + first * a->ks, a->ks, vh0 + first * a->vs, a->vs,
                   mi ? mi + first * a->ms : 0, a->ms, seen - first, a->D, a->Dv, a->scale,
                   a->sinks ? a->sinks[h] : -INFINITY, work, a->out + ((b * a->Hq + h) * a->L + i) * a->Dv);
        }
    }
}

/* Few queries (a decode step) go one query at a time over the keys each sees, the (batch, q head) pairs split over
 * up to `threads` of the pool where the keys the first head's queries see, over all heads, come to
 * ATTENTION_MIN_PART values (memory-bound: the slot attention's measurement, d046acc); each query's arithmetic is the
 * same on any thread. Returns 0, writing nothing, when the scratch cannot be had. */
i64 kiln_attention_f32(const float *restrict q, const float *restrict k, const float *restrict v,
                       const unsigned char *restrict mask, const float *restrict sinks, float *restrict out, i64 B,
                       i64 Hq, i64 Hkv, i64 L, i64 S, i64 D, i64 Dv, i64 kb, i64 kh, i64 ks, i64 vb, i64 vh, i64 vs,
                       i64 mb, i64 mh, i64 ml, i64 ms, i64 causal, float scale, i64 threads) {
    const attention_args a = {q, k, v, mask, sinks, out, Hq, Hkv, L, S, D, Dv, kb, kh, ks, vb, vh, vs, mb, mh,
                              ml, ms, causal, scale};
    if (L >= TILED_MIN_QUERIES && Dv % 64 == 0) {
        parallel_for(attention_tiles, &a, B * Hq, threads);
        return 1;
    }
    if (!thread_scratch(SCRATCH_ATTENTION, S * (i64)sizeof(float))) return 0;
    i64 keys = 0;
    for (i64 b = 0; b < B; b++)
        for (i64 i = 0; i < L; i++) {
            i64 first, seen;
            visible(mask ? mask + b * mb + i * ml : 0, ms, i, S, causal, &first, &seen);
            keys += seen > first ? seen - first : 0;
        }
    const i64 most = keys * Hq * (D + Dv) / ATTENTION_MIN_PART;
    parallel_for(attention_rows, &a, B * Hq, threads_for(threads, most));
    return 1;
}

typedef struct {
    const float *q, *k, *v, *sinks;
    const i64 *slots, *positions;
    float *out;
    i64 Hq, Hkv, T, S, D, Dv, window;
    float scale;
} slot_args;

/* the cache row (of [slots * S * Hkv]) of kv head `kv`'s first key that query t of sequence b sees; *count: the
 * keys it sees (its window's, or all up to its position) */
static inline i64 slot_row(const slot_args *a, i64 b, i64 t, i64 kv, i64 *count) {
    const i64 p = a->positions[b * a->T + t], lo = a->window > 0 && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
    *count = p - lo + 1;
    return (a->slots[b] * a->S + lo) * a->Hkv + kv;
}

/* the queries of tasks [begin, end) of slot_attention, a task a (sequence, q head): each query its keys one by one
 * (attend), the scores in this thread's scratch */
static void slot_heads(const void *ctx, i64 begin, i64 end) {
    const slot_args *a = ctx;
    const i64 T = a->T, S = a->S, D = a->D, Dv = a->Dv, group = a->Hq / a->Hkv;
    float *work = (float *)thread_scratch(SCRATCH_ATTENTION, S * (i64)sizeof(float));
    if (!work) return; /* (the caller asked for it first: not reached) */
    for (i64 bh = begin; bh < end; bh++) {
        const i64 b = bh / a->Hq, h = bh % a->Hq;
        for (i64 t = 0; t < T; t++) {
            i64 count;
            const i64 row = slot_row(a, b, t, h / group, &count);
            attend(a->q + ((b * a->Hq + h) * T + t) * D, a->k + row * D, a->Hkv * D, a->v + row * Dv, a->Hkv * Dv, 0,
                   0, count, D, Dv, a->scale, a->sinks ? a->sinks[h] : -INFINITY, work,
                   a->out + ((b * a->Hq + h) * T + t) * Dv);
        }
    }
}

/* slot_heads with the tasks (sequence, kv head), each attend_group over its q heads */
static void slot_groups(const void *ctx, i64 begin, i64 end) {
    const slot_args *a = ctx;
    const i64 T = a->T, S = a->S, D = a->D, Dv = a->Dv, group = a->Hq / a->Hkv;
    float *work = (float *)thread_scratch(SCRATCH_ATTENTION, group * S * (i64)sizeof(float));
    if (!work) return; /* (the caller asked for it first: not reached) */
    for (i64 bg = begin; bg < end; bg++) {
        const i64 b = bg / a->Hkv, g = bg % a->Hkv, h = g * group;
        for (i64 t = 0; t < T; t++) {
            i64 count;
            const i64 row = slot_row(a, b, t, g, &count);
            attend_group(a->q + ((b * a->Hq + h) * T + t) * D, T * D, (int)group, a->k + row * D, a->Hkv * D,
                         a->v + row * Dv, a->Hkv * Dv, count, D, Dv, a->scale, a->sinks ? a->sinks + h : 0, work,
                         a->out + ((b * a->Hq + h) * T + t) * Dv, T * Dv);
        }
    }
}

/* slot_attention for a few queries a sequence: query t of sequence b sees the cache positions lo..p of its slot,
 * p = positions[b][t] and lo = p - window + 1 (window > 0) or 0, and no others. q [B, Hq, T, D], caches
 * [slots, S, Hkv, D] and [slots, S, Hkv, Dv], out [B, Hq, T, Dv], all contiguous; slots [B], positions [B, T]
 * int64; sinks [Hq] or none, as kiln_attention_f32's. The (sequence, q head) pairs are split over up to `threads`
 * of the pool where the keys read come to ATTENTION_MIN_PART values (one thread took a sixth of SmolLM2's 4-row
 * decode step on this project's 2-core machine); each query's arithmetic is the same on any thread. Returns 0,
 * writing nothing, when a slot or a position is outside the cache (the caller raises). */
i64 kiln_slot_attention_f32(const float *restrict q, const float *restrict k, const float *restrict v,
                            const i64 *restrict slots, const i64 *restrict positions, const float *restrict sinks,
                            float *restrict out, i64 B, i64 Hq, i64 Hkv, i64 T, i64 S, i64 D, i64 Dv, i64 slot_count,
                            i64 window, float scale, i64 threads) {
    i64 keys = 0;
    for (i64 b = 0; b < B; b++) {
        if (slots[b] < 0 || slots[b] >= slot_count) return 0;
        for (i64 t = 0; t < T; t++) {
            const i64 p = positions[b * T + t];
            if (p < 0 || p >= S) return 0;
            keys += window > 0 && p + 1 > window ? window : p + 1;
        }
    }
    const i64 group = Hq / Hkv;
    const int grouped = group > 1 && group <= MAX_GROUP && D % 16 == 0 && Dv % 64 == 0;
    if (!thread_scratch(SCRATCH_ATTENTION, (grouped ? group : 1) * S * (i64)sizeof(float)))
        return 0; /* (the caller's portable path) */
    const slot_args args = {q, k, v, sinks, slots, positions, out, Hq, Hkv, T, S, D, Dv, window, scale};
    const i64 most = keys * Hq * (D + Dv) / ATTENTION_MIN_PART;
    if (grouped)
        parallel_for(slot_groups, &args, B * Hkv, threads_for(threads, most));
    else
        parallel_for(slot_heads, &args, B * Hq, threads_for(threads, most));
    return 1;
}

/* RoPE of x's D values (a row) by cos and sin rows into y: y = x cos + rotate(x) sin, where rotate pairs element j
 * with j + D/2 (rotate-half: (-x2, x1)) or 2i with 2i + 1 (interleaved: (-x[2i+1], x[2i])) */
static inline void rope_row(const float *restrict x, const float *restrict c, const float *restrict s, float *restrict y,
                            i64 d, int interleaved) {
    if (interleaved) {
        for (i64 i = 0; i + 1 < d; i += 2) {
            y[i] = x[i] * c[i] - x[i + 1] * s[i];
            y[i + 1] = x[i + 1] * c[i + 1] + x[i] * s[i + 1];
        }
        return;
    }
    const i64 h = d / 2;
    for (i64 i = 0; i < h; i++) y[i] = x[i] * c[i] - x[i + h] * s[i];
    for (i64 i = h; i < d; i++) y[i] = x[i] * c[i] + x[i - h] * s[i];
}

/* rope_cache_update for a step of a few positions: q_out = rope(q); k_cache[b, h, positions[l]] = rope(k[b, h, l]);
 * v_cache[b, h, positions[l]] = v[b, h, l]. NumPy's version (two ropes of ~8 array operations each and two
 * fancy-index writes) cost ~30 us a layer for ~1 KB of results.
 *
 * q [B, Hq, L, D], k and v [B, Hkv, L, D] by strides in elements over batch, head and position (the last
 * dimension contiguous); cos and sin by one pair of strides over batch and position (the same for every head);
 * caches [B, Hkv, S, D] and q_out [B, Hq, L, D] contiguous. A negative position counts from the end, as NumPy's
 * index does; returns 0, writing nothing, when a position falls outside the cache (the caller's indexing then
 * raises its error), else 1. */
i64 kiln_rope_cache_update_f32(const float *restrict q, const float *restrict k, const float *restrict v,
                               const float *restrict cos, const float *restrict sin, float *restrict k_cache,
                               float *restrict v_cache, const i64 *restrict positions, float *restrict q_out, i64 B,
                               i64 Hq, i64 Hkv, i64 L, i64 D, i64 S, i64 qsb, i64 qsh, i64 qsl, i64 ksb, i64 ksh,
                               i64 ksl, i64 vsb, i64 vsh, i64 vsl, i64 csb, i64 csl, i64 interleaved) {
    for (i64 l = 0; l < L; l++) {
        const i64 p = positions[l] < 0 ? positions[l] + S : positions[l];
        if (p < 0 || p >= S) return 0;
    }
    for (i64 b = 0; b < B; b++)
        for (i64 l = 0; l < L; l++) {
            const float *c = cos + b * csb + l * csl, *s = sin + b * csb + l * csl;
            const i64 p = positions[l] < 0 ? positions[l] + S : positions[l];
            for (i64 h = 0; h < Hq; h++)
                rope_row(q + b * qsb + h * qsh + l * qsl, c, s, q_out + ((b * Hq + h) * L + l) * D, D, (int)interleaved);
            for (i64 h = 0; h < Hkv; h++) {
                const i64 row = ((b * Hkv + h) * S + p) * D;
                rope_row(k + b * ksb + h * ksh + l * ksl, c, s, k_cache + row, D, (int)interleaved);
                const float *vr = v + b * vsb + h * vsh + l * vsl;
                for (i64 i = 0; i < D; i++) v_cache[row + i] = vr[i];
            }
        }
    return 1;
}

/* rope_cache_update of a serving program's decode step: one token of each of B sequences, k and v [B, 1, Hkv, D]
 * (by strides over sequence and head) written roped / as they are at (slots[b], positions[b]) of contiguous caches
 * [slot_count, S, Hkv, D]; q [B, Hq, 1, D] by strides, roped into contiguous q_out; cos and sin one row a sequence
 * (stride csb). Negative indices count from the end, as NumPy's; returns 0, writing nothing, when one is outside. */
i64 kiln_rope_slot_update_f32(const float *restrict q, const float *restrict k, const float *restrict v,
                              const float *restrict cos, const float *restrict sin, float *restrict k_cache,
                              float *restrict v_cache, const i64 *restrict slots, const i64 *restrict positions,
                              float *restrict q_out, i64 B, i64 Hq, i64 Hkv, i64 D, i64 S, i64 slot_count, i64 qsb,
                              i64 qsh, i64 ksb, i64 ksh, i64 vsb, i64 vsh, i64 csb, i64 interleaved) {
    for (i64 b = 0; b < B; b++) {
        const i64 s = slots[b] < 0 ? slots[b] + slot_count : slots[b], p = positions[b] < 0 ? positions[b] + S
                                                                                            : positions[b];
        if (s < 0 || s >= slot_count || p < 0 || p >= S) return 0;
    }
    for (i64 b = 0; b < B; b++) {
        const i64 s = slots[b] < 0 ? slots[b] + slot_count : slots[b], p = positions[b] < 0 ? positions[b] + S
                                                                                            : positions[b];
        const float *c = cos + b * csb, *sn = sin + b * csb;
        for (i64 h = 0; h < Hq; h++) rope_row(q + b * qsb + h * qsh, c, sn, q_out + (b * Hq + h) * D, D, (int)interleaved);
        for (i64 h = 0; h < Hkv; h++) {
            const i64 row = ((s * S + p) * Hkv + h) * D;
            rope_row(k + b * ksb + h * ksh, c, sn, k_cache + row, D, (int)interleaved);
            const float *vr = v + b * vsb + h * vsh;
            for (i64 i = 0; i < D; i++) v_cache[row + i] = vr[i];
        }
    }
    return 1;
}
