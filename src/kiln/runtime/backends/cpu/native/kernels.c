/* kiln's compiled CPU helpers: float32 kernels where NumPy's per-call overhead or its extra passes over memory
 * dominate (depthwise convolution on small maps, composite activations, im2col without a padded copy).
 *
 * Plain C99, no intrinsics (qdot.c, the integer dot products, is the exception): the loops are written so the compiler
 * vectorizes them (contiguous inner loops, no aliasing through `restrict`). Every function is a leaf over caller-
 * owned, C-contiguous buffers; the caller checks dtypes, shapes and contiguity. Built on first use by
 * native/__init__.py and cached.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pool.h"
#include "quant.h"

#include "vec16.h"
#include "vmath.h"

/* erfc(|x|) by the Chebyshev fit of Numerical Recipes (fractional error below 1.2e-7). */
static inline float erfc_abs_f32(float x) {
    float z = x < 0.0f ? -x : x;
    float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    return t * exp_f32(p - z * z);
}

/* ---------------------------------------------------------------------------------------------------------
 * Unary activations, y = f(x) over n elements (y may be x). NaN in, NaN out, as PyTorch gives.
 */
#define UNARY(name, expr)                                                      \
    void kiln_##name##_f32(const float *restrict x, float *y, i64 n) {         \
        for (i64 i = 0; i < n; i++) {                                          \
            float v = x[i];                                                    \
            float r = (expr);                                                  \
            y[i] = v != v ? v : r;                                             \
        }                                                                      \
    }

static inline float sigmoid_f32(float v) { return 1.0f / (1.0f + exp_f32(-v)); }
static inline float hardsigmoid_f32(float v) {
    float h = (v + 3.0f) * (1.0f / 6.0f);
    h = h < 0.0f ? 0.0f : h;
    return h > 1.0f ? 1.0f : h;
}
/* gelu(x) = x/2 (1 + erf(x/sqrt2)); 1 + erf(u) = erfc(|u|) for u < 0 and 2 - erfc(|u|) otherwise, so the left
 * tail has no cancellation. */
static inline float gelu_erf_f32(float v) {
    float e = erfc_abs_f32(v * 0.70710678118654752f);
    return 0.5f * v * (v >= 0.0f ? 2.0f - e : e);
}
/* tanh(u) = 1 - 2 / (exp(2u) + 1): exact at both saturated ends, no inf/inf. */
static inline float tanh_f32(float u) { return 1.0f - 2.0f / (exp_f32(2.0f * u) + 1.0f); }
static inline float gelu_tanh_f32(float v) {
    return 0.5f * v * (1.0f + tanh_f32(0.79788456080286536f * (v + 0.044715f * v * v * v)));
}
static inline float erf_f32(float v) {
    float e = 1.0f - erfc_abs_f32(v);
    return v < 0.0f ? -e : e;
}

UNARY(sigmoid, sigmoid_f32(v))
UNARY(silu, v * sigmoid_f32(v))
UNARY(hardsigmoid, hardsigmoid_f32(v))
UNARY(hardswish, v * hardsigmoid_f32(v))
UNARY(gelu_erf, gelu_erf_f32(v))
UNARY(gelu_tanh, gelu_tanh_f32(v))
UNARY(erf, erf_f32(v))

/* Clamp to [lo, hi] (pass -inf/inf for an absent bound); NaN stays NaN. y may be x. */
void kiln_clamp_f32(const float *x, float *y, i64 n, float lo, float hi) {
    for (i64 i = 0; i < n; i++) {
        float v = x[i];
        v = v < lo ? lo : v;
        y[i] = v > hi ? hi : v;
    }
}

/* A convolution's fused activation over one run of outputs: 0 none, 1 clamp to [lo, hi], 2 hardswish. */
void conv_activate(float *y, i64 n, int act, float lo, float hi) {
    if (act == 1)
        kiln_clamp_f32(y, y, n, lo, hi);
    else if (act == 2)
        kiln_hardswish_f32(y, y, n);
}

/* A convolution's epilogue over [planes = batch * channels][size]: bias per channel (may be NULL), then the
 * activation, in one pass while each plane is in cache. */
void kiln_bias_activate_f32(float *y, const float *bias, i64 planes, i64 channels, i64 size, i64 act, float lo,
                            float hi) {
    for (i64 p = 0; p < planes; p++) {
        float *yp = y + p * size;
        if (bias) {
            const float b = bias[p % channels];
            for (i64 i = 0; i < size; i++) yp[i] += b;
        }
        conv_activate(yp, size, (int)act, lo, hi);
    }
}


/* ---------------------------------------------------------------------------------------------------------
 * im2col for 2-d convolution, one image, output rows [r_begin, r_end):
 * cols[c][i][j][(r - r_begin) * ow + q] = x[c][r*sh + i*dh - pt][q*sw + j*dw - pl], zero outside x. No padded copy
 * of the input; the inner loop copies a contiguous run when sw == 1. A band of rows at a time lets the caller keep
 * the patch matrix in cache between writing it and the GEMM reading it.
 */
void kiln_im2col2d_f32(const float *restrict x, float *restrict cols, i64 c, i64 h, i64 wd, i64 kh, i64 kw, i64 sh,
                       i64 sw, i64 pt, i64 pl, i64 dh, i64 dw, i64 r_begin, i64 r_end, i64 ow) {
    const i64 oh = r_end - r_begin;
    for (i64 ch = 0; ch < c; ch++) {
        const float *xc = x + ch * h * wd;
        for (i64 i = 0; i < kh; i++)
            for (i64 j = 0; j < kw; j++) {
                float *dst = cols + ((ch * kh + i) * kw + j) * oh * ow;
                /* output columns [lo, hi) read inside the row; the rest are zero */
                const i64 off = j * dw - pl;
                i64 lo = off >= 0 ? 0 : (-off + sw - 1) / sw;
                i64 hi = (wd - off + sw - 1) / sw;
                if (hi > ow) hi = ow;
                if (lo > hi) lo = hi;
                for (i64 r = 0; r < oh; r++) {
                    const i64 src_r = (r + r_begin) * sh + i * dh - pt;
                    float *d = dst + r * ow;
                    if (src_r < 0 || src_r >= h) {
                        memset(d, 0, (size_t)ow * sizeof(float));
                        continue;
                    }
                    const float *s = xc + src_r * wd + off;
                    for (i64 o = 0; o < lo; o++) d[o] = 0.0f;
                    if (sw == 1)
                        memcpy(d + lo, s + lo, (size_t)(hi - lo) * sizeof(float));
                    else
                        for (i64 o = lo; o < hi; o++) d[o] = s[o * sw];
                    for (i64 o = hi; o < ow; o++) d[o] = 0.0f;
                }
            }
    }
}

typedef unsigned char v16u8u __attribute__((vector_size(16), aligned(1))); /* 16 uint8, unaligned */
/* unsigned bytes to floats through 32-bit integers (GCC 12 scalarizes a direct char-to-float conversion, and
 * any signed one: int8 weights are read as q + 128, unsigned, and 128 is subtracted in float) */
static inline v16 to_float16u(v16u8u b) { return __builtin_convertvector(__builtin_convertvector(b, v16i32), v16); }

/* ---------------------------------------------------------------------------------------------------------
 * A pool of worker threads for the helpers that split their outputs (`parallel_for`, pool.h). A call cuts its range
 * into CHUNKS_PER_THREAD contiguous chunks a thread, which the calling thread and the workers take in order from one
 * counter until none are left; the caller then closes the call and waits for the workers inside it (a worker that
 * comes late stays out). Taken rather than dealt out: on a machine
 * whose cores also run other work (a server's HTTP process and client on the same two cores, another tenant's
 * threads), a thread that loses its core for a while no longer holds back the whole call by what it was dealt; the
 * others take its chunks. Workers spin briefly between calls (a decode step
 * calls the linear kernels back to back, tens of microseconds apart) and then sleep on a condition variable. One call
 * at a time uses the pool; a second thread calling meanwhile runs its work alone rather than wait. Every helper that
 * uses it computes each output the same way whatever the split, so results do not depend on the thread count.
 */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

enum { MAX_THREADS = 64, SPIN_NS = 100000, CHUNKS_PER_THREAD = 4, CALL_CLOSED = 128, CALL_PARTS = 127 };

static struct {
    pthread_mutex_t lock;      /* guards sleeping and the wake-up */
    pthread_cond_t wake;
    pthread_mutex_t busy;      /* held by the call that owns the pool */
    int started;               /* workers running (threads - 1 of the largest call so far) */
    long call;                 /* generation << 8 | CALL_CLOSED | parts, published once a call's fields are set:
                                * workers wait for the generation to change and take part if the call is still open
                                * and their index is below its parts (one word, so that a worker never reads one
                                * call's parts and another's fields) */
    int sleepers;
    int active;                /* workers inside the current call: the caller waits for these, and only these */
    task_fn fn;
    const void *ctx;
    i64 count, chunks;
    i64 next;                  /* the next chunk to take */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .busy = PTHREAD_MUTEX_INITIALIZER};

/* the current call's chunks, taken one at a time until none are left */
static void run_chunks(void) {
    const i64 count = pool.count, chunks = pool.chunks;
    for (;;) {
        const i64 c = __atomic_fetch_add(&pool.next, 1, __ATOMIC_RELAXED);
        if (c >= chunks) return;
        pool.fn(pool.ctx, count * c / chunks, count * (c + 1) / chunks);
    }
}

static i64 now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (i64)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void *pool_worker(void *arg) {
    /* arg: the worker's index and the generation before the call that started it, which it then waits for */
    const i64 index = (i64)((intptr_t)arg & 255);
    long seen = (long)((intptr_t)arg >> 8);
    for (;;) {
        const i64 until = now_ns() + SPIN_NS;
        int polls = 0;
        while (__atomic_load_n(&pool.call, __ATOMIC_ACQUIRE) >> 8 == seen) {
            cpu_relax();
            if (++polls % 256 == 0 && now_ns() > until) {
                pthread_mutex_lock(&pool.lock);
                __atomic_add_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                while (__atomic_load_n(&pool.call, __ATOMIC_SEQ_CST) >> 8 == seen)
                    pthread_cond_wait(&pool.wake, &pool.lock);
                __atomic_sub_fetch(&pool.sleepers, 1, __ATOMIC_SEQ_CST);
                pthread_mutex_unlock(&pool.lock);
            }
        }
        const long call = __atomic_load_n(&pool.call, __ATOMIC_SEQ_CST);
        seen = call >> 8;
        if (!(call & CALL_CLOSED) && index < (call & CALL_PARTS)) {
            __atomic_add_fetch(&pool.active, 1, __ATOMIC_SEQ_CST);
            /* still open after joining: the caller now waits for this worker, so the fields stay as they are */
            if (__atomic_load_n(&pool.call, __ATOMIC_SEQ_CST) == call) run_chunks();
            __atomic_sub_fetch(&pool.active, 1, __ATOMIC_RELEASE);
        }
    }
    return 0;
}

/* a forked child has none of the parent's workers: start afresh */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, 0);
    pthread_cond_init(&pool.wake, 0);
    pthread_mutex_init(&pool.busy, 0);
    pool.started = pool.sleepers = pool.active = 0;
}

/* workers 1..threads-1 exist afterwards, or as many as could be started */
static void pool_grow(int threads) {
    static int registered;
    if (!registered) registered = !pthread_atfork(0, 0, pool_after_fork);
    while (pool.started + 1 < threads) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, pool_worker,
                                          (void *)(((intptr_t)(pool.call >> 8) << 8) | (pool.started + 1)));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.started++;
    }
}

static __thread struct {
    void *memory;
    i64 bytes;
} scratch[SCRATCH_SLOTS];

void *thread_scratch(int slot, i64 bytes) {
    if (scratch[slot].bytes < bytes) {
        free(scratch[slot].memory);
        scratch[slot].memory = NULL;
        scratch[slot].bytes = 0;
        if (posix_memalign(&scratch[slot].memory, 64, (size_t)bytes) != 0) {
            scratch[slot].memory = NULL;
            return NULL;
        }
        scratch[slot].bytes = bytes;
    }
    return scratch[slot].memory;
}

void parallel_for(task_fn fn, const void *ctx, i64 count, i64 threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > count) threads = count;
    if (threads <= 1 || pthread_mutex_trylock(&pool.busy) != 0) {
        fn(ctx, 0, count);
        return;
    }
    pool_grow((int)threads);
    const i64 parts = pool.started + 1 < threads ? pool.started + 1 : threads;
    pool.fn = fn, pool.ctx = ctx, pool.count = count;
    pool.chunks = count < parts * CHUNKS_PER_THREAD ? count : parts * CHUNKS_PER_THREAD;
    __atomic_store_n(&pool.next, 0, __ATOMIC_RELAXED);
    const long open = ((pool.call >> 8) + 1) << 8 | parts;
    __atomic_store_n(&pool.call, open, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleepers, __ATOMIC_SEQ_CST) > 0) {
        pthread_mutex_lock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    run_chunks();
    /* Closed: a worker that has not joined by now stays out, and the call waits only for those inside it. It
     * waited for every worker to check in, so a worker still asleep or without a core (the server's HTTP process
     * and client on the same cores) held up a call whose chunks were all done: `kiln serve`'s 4-row decode step
     * 10.18 -> 9.54-9.65 ms on this project's 2-core machine. The workers' last chunks take about as long as this
     * one's: spin a little, then yield, so that on a machine with more runnable threads than cores the worker being
     * waited for can have this core. */
    __atomic_store_n(&pool.call, open | CALL_CLOSED, __ATOMIC_SEQ_CST);
    for (int polls = 0; __atomic_load_n(&pool.active, __ATOMIC_SEQ_CST) > 0; polls++) {
        if (polls < 4096) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.busy);
}

/* ---------------------------------------------------------------------------------------------------------
 * Linear for few rows (a batched decode step): out[r][o] = sum_j x[r][j] w[o][j] + bias[o], each weight row
 * streamed from memory once for up to LROWS rows. BLAS's SGEMM packs the whole weight on every call (2 rows cost
 * 2.4x one row's GEMV on SmolLM2's layers); here m rows cost about what one does, since a decode step is bound by
 * reading the weights. Every output is summed in the same order whatever m, the thread count or the row's place
 * in the batch (one 8-lane accumulator over j, its lanes summed as a fixed tree, then the tail, then the bias),
 * so a sequence's logits are bitwise the same alone and batched: greedy streams do not depend on their neighbours.
 */
#define LROWS 8
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));

/* a * b + c in one rounding where the CPU has FMA: written out, since the compiler's own contraction of a * b + c
 * may differ between two inlined copies of one loop, and the copies must agree to the bit */
static inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__) && defined(__AVX__)
    return __builtin_ia32_vfmaddps256(a, b, c);
#elif defined(__aarch64__)
    for (int i = 0; i < 8; i++) c[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return c;
#else
    volatile v8 product = a * b; /* rounded once here and once in the sum, in every copy */
    return c + product;
#endif
}

static inline float sum_lanes8(v8 v) {
    typedef float v4 __attribute__((vector_size(16)));
    const v4 h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (h[0] + h[2]) + (h[1] + h[3]);
}

/* outputs o..o+valid-1 (valid <= WR) for R rows; R is a constant at every call, so acc[][] can live in
 * registers. A short last block rereads its last row rather than use a narrower code path: the compiler may
 * contract a narrower path's multiply-adds differently, and every output must come out of the same arithmetic. */
static inline __attribute__((always_inline)) void linear_block(const float *restrict x, const float *restrict w,
                                                               const float *restrict bias, float *restrict out,
                                                               i64 n, i64 k, i64 o, i64 valid, const int R) {
    enum { WR = 4 }; /* weight rows a pass */
    v8 acc[WR][LROWS]; /* fixed sizes, not [WR][R]: the compiler keeps a fixed array in registers, not a VLA */
    const float *row[WR];
    for (int a = 0; a < WR; a++) {
        row[a] = w + (o + (a < valid ? a : valid - 1)) * k;
        for (int r = 0; r < R; r++) acc[a][r] = (v8){0};
    }
    /* the hardware prefetcher falls behind once each byte feeds several rows: ask for the weight rows four blocks
     * ahead, a cache line per pair of steps (4 rows of SmolLM2's LM head: 5.6 -> 3.8 ms) */
    const i64 ahead = 4 * WR * k;
    const int far = o + 5 * WR <= n;
    i64 j = 0;
    for (; j + 8 <= k; j += 8)
        for (int a = 0; a < WR; a++) {
            if (far && (j & 15) == 0) __builtin_prefetch(row[a] + ahead + j);
            const v8 wv = *(const v8u *)(row[a] + j);
            for (int r = 0; r < R; r++) acc[a][r] = fma8(*(const v8u *)(x + r * k + j), wv, acc[a][r]);
        }
    for (int a = 0; a < valid; a++)
        for (int r = 0; r < R; r++) {
            float total = sum_lanes8(acc[a][r]);
            for (i64 t = j; t < k; t++) total = fmaf(x[r * k + t], row[a][t], total);
            out[r * n + o + a] = total + (bias ? bias[o + a] : 0.0f);
        }
}

/* outputs [o0, o1) for one row, a weight row after another: the same arithmetic as linear_block's for each output
 * (one 8-lane FMA chain over j, its lanes as the same tree, the tail, the bias), so the same bits, but the weight
 * read as one sequential stream, where eight rows a pass (linear_block's blocks) read eight streams 32 bytes each:
 * 13.6-14.4 -> 20-24.5 GB/s on [3072, 576] float32 weights from DRAM (NumPy summing the same bytes: 23), SmolLM2's
 * float32 decode step 38.5-40.7 -> 26.5-27.0 ms at 1 thread. Consecutive rows' chains are independent, so the
 * core overlaps them. */
static void linear_one_row(const float *restrict x, const float *restrict w, const float *restrict bias,
                           float *restrict out, i64 k, i64 o0, i64 o1) {
    for (i64 o = o0; o < o1; o++) {
        const float *row = w + o * k;
        v8 acc = (v8){0};
        i64 j = 0;
        for (; j + 8 <= k; j += 8) acc = fma8(*(const v8u *)(x + j), *(const v8u *)(row + j), acc);
        float total = sum_lanes8(acc);
        for (; j < k; j++) total = fmaf(x[j], row[j], total);
        out[o] = total + (bias ? bias[o] : 0.0f);
    }
}

/* outputs [o0, o1) for R rows: a weight row after another for one row, 4 a pass for more */
static inline __attribute__((always_inline)) void linear_rows(const float *restrict x, const float *restrict w,
                                                              const float *restrict bias, float *restrict out, i64 n,
                                                              i64 k, i64 o0, i64 o1, const int R) {
    if (R == 1) {
        linear_one_row(x, w, bias, out, k, o0, o1);
        return;
    }
    for (i64 o = o0; o < o1; o += 4) linear_block(x, w, bias, out, n, k, o, o1 - o < 4 ? o1 - o : 4, R);
}

typedef struct {
    const float *x, *w, *bias;
    float *out;
    i64 m, n, k;
} linear_args;

enum { LINEAR_ALIGN = 8 }; /* outputs per part a multiple of this, so parts keep the widest blocks */

enum { LINEAR_CHUNK_BYTES = 96 << 10 }; /* weight rows a chunk: stays in L2 while every block of rows reads it */

static void linear_part(const void *ctx, i64 begin, i64 end) {
    const linear_args *a = ctx;
    const i64 first = begin * LINEAR_ALIGN, last = end * LINEAR_ALIGN < a->n ? end * LINEAR_ALIGN : a->n;
    /* more rows than a block takes: the weight is read from memory once, a chunk of its rows at a time, not once
     * a block of rows (chunks are multiples of LINEAR_ALIGN, so every output keeps its arithmetic) */
    i64 chunk = a->m <= LROWS ? last - first : LINEAR_CHUNK_BYTES / (4 * a->k) / LINEAR_ALIGN * LINEAR_ALIGN;
    if (chunk < LINEAR_ALIGN) chunk = LINEAR_ALIGN;
    for (i64 o0 = first; o0 < last; o0 += chunk) {
        const i64 o1 = o0 + chunk < last ? o0 + chunk : last;
        for (i64 r0 = 0; r0 < a->m; r0 += LROWS) {
            const float *x = a->x + r0 * a->k;
            float *out = a->out + r0 * a->n;
            switch (a->m - r0 < LROWS ? a->m - r0 : LROWS) {
                case 1: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 1); break;
                case 2: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 2); break;
                case 3: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 3); break;
                case 4: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 4); break;
                case 5: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 5); break;
                case 6: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 6); break;
                case 7: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 7); break;
                default: linear_rows(x, a->w, a->bias, out, a->n, a->k, o0, o1, 8); break;
            }
        }
    }
}

void kiln_linear_rows_f32(const float *restrict x, const float *restrict w, const float *restrict bias,
                          float *restrict out, i64 m, i64 n, i64 k, i64 threads) {
    const linear_args args = {x, w, bias, out, m, n, k};
    const i64 blocks = (n + LINEAR_ALIGN - 1) / LINEAR_ALIGN, most = n * k / LINEAR_MIN_PART;
    parallel_for(linear_part, &args, blocks, threads_for(threads, most));
}

/* ---------------------------------------------------------------------------------------------------------
 * Winograd F(2x2, 3x3) for 3x3, stride-1 convolutions: each 2x2 output tile costs 16 multiplies per (in, out)
 * channel pair instead of 36, done as 16 GEMMs [O, C] x [C, tiles] (packed, conv.c) between the two transforms
 * below. The weight transform U = G g G^T is done once per weight, in NumPy (conv.py).
 *
 * Input transform: v[k][c][tile] = (B^T d B)[k] for each 4x4 input patch d starting at (2 ti - pt, 2 tj - pl),
 * zero outside x; tiles of all images side by side (tile = (b * th + ti) * tw + tj).
 */
typedef struct {
    const float *x, *m, *bias;
    float *v, *y;
    i64 n, c, h, w, pt, pl, th, tw, o, oh, ow, act;
    float lo, hi;
} winograd_args;

/* planes [begin, end) of (image, input channel) */
static void winograd_input_part(const void *ctx, i64 begin, i64 end) {
    const winograd_args *a = ctx;
    const i64 c = a->c, h = a->h, w = a->w, th = a->th, tw = a->tw, ntiles = a->n * th * tw;
    /* a row of tiles is transformed into `row` ([16][tw]) and then copied out as 16 contiguous runs: writing the
     * 16 positions of each tile directly hits addresses c * ntiles floats apart, which thrashes the cache sets */
    float *row = (float *)thread_scratch(SCRATCH_WINOGRAD, 16 * tw * (i64)sizeof(float));
    if (!row) return;
    for (i64 p = begin; p < end; p++) {
        const i64 b = p / c, ch = p % c;
        const float *plane = a->x + (b * c + ch) * h * w;
        float *vc = a->v + ch * ntiles + b * th * tw;
        for (i64 ti = 0; ti < th; ti++) {
            for (i64 tj = 0; tj < tw; tj++) {
                const i64 r0 = 2 * ti - a->pt, c0 = 2 * tj - a->pl;
                float d[4][4];
                if (r0 >= 0 && c0 >= 0 && r0 + 4 <= h && c0 + 4 <= w) {
                    for (int r = 0; r < 4; r++)
                        for (int s = 0; s < 4; s++) d[r][s] = plane[(r0 + r) * w + c0 + s];
                } else {
                    for (int r = 0; r < 4; r++)
                        for (int s = 0; s < 4; s++) {
                            const i64 rr = r0 + r, cc = c0 + s;
                            d[r][s] = (rr >= 0 && rr < h && cc >= 0 && cc < w) ? plane[rr * w + cc] : 0.0f;
                        }
                }
                float t[4][4]; /* B^T d */
                for (int s = 0; s < 4; s++) {
                    t[0][s] = d[0][s] - d[2][s];
                    t[1][s] = d[1][s] + d[2][s];
                    t[2][s] = d[2][s] - d[1][s];
                    t[3][s] = d[1][s] - d[3][s];
                }
                for (int r = 0; r < 4; r++) { /* (B^T d) B */
                    row[(r * 4 + 0) * tw + tj] = t[r][0] - t[r][2];
                    row[(r * 4 + 1) * tw + tj] = t[r][1] + t[r][2];
                    row[(r * 4 + 2) * tw + tj] = t[r][2] - t[r][1];
                    row[(r * 4 + 3) * tw + tj] = t[r][1] - t[r][3];
                }
            }
            for (int k = 0; k < 16; k++)
                memcpy(vc + k * c * ntiles + ti * tw, row + k * tw, (size_t)tw * sizeof(float));
        }
    }
}

void kiln_winograd23_input_f32(const float *restrict x, float *restrict v, i64 n, i64 c, i64 h, i64 w, i64 pt,
                               i64 pl, i64 th, i64 tw, i64 threads) {
    const winograd_args a = {.x = x, .v = v, .n = n, .c = c, .h = h, .w = w, .pt = pt, .pl = pl, .th = th, .tw = tw};
    parallel_for(winograd_input_part, &a, n * c, threads);
}

/* planes [begin, end) of (image, output channel) */
static void winograd_output_part(const void *ctx, i64 begin, i64 end) {
    const winograd_args *a = ctx;
    const i64 o = a->o, oh = a->oh, ow = a->ow, th = a->th, tw = a->tw, ntiles = a->n * th * tw;
    float *row = (float *)thread_scratch(SCRATCH_WINOGRAD, 16 * tw * (i64)sizeof(float)); /* a row of tiles */
    if (!row) return;
    for (i64 p = begin; p < end; p++) {
        const i64 b = p / o, oc = p % o;
        const float *mo = a->m + oc * ntiles + b * th * tw;
        float *plane = a->y + (b * o + oc) * oh * ow;
        const float bv = a->bias ? a->bias[oc] : 0.0f;
        for (i64 ti = 0; ti < th; ti++) {
            for (int k = 0; k < 16; k++)
                memcpy(row + k * tw, mo + k * o * ntiles + ti * tw, (size_t)tw * sizeof(float));
            for (i64 tj = 0; tj < tw; tj++) {
                float q[4][4];
                for (int k = 0; k < 16; k++) q[k / 4][k % 4] = row[k * tw + tj];
                float t[2][4]; /* A^T q */
                for (int s = 0; s < 4; s++) {
                    t[0][s] = q[0][s] + q[1][s] + q[2][s];
                    t[1][s] = q[1][s] - q[2][s] - q[3][s];
                }
                for (int r = 0; r < 2; r++) {
                    const i64 rr = 2 * ti + r;
                    if (rr >= oh) break;
                    plane[rr * ow + 2 * tj] = t[r][0] + t[r][1] + t[r][2] + bv;
                    if (2 * tj + 1 < ow) plane[rr * ow + 2 * tj + 1] = t[r][1] - t[r][2] - t[r][3] + bv;
                }
            }
        }
        conv_activate(plane, oh * ow, (int)a->act, a->lo, a->hi);
    }
}

/* Output transform: y = A^T m A for each tile's 16 GEMM results m[k][o][tile], cropped to [oh, ow], plus the
 * bias, then the fused activation on each finished plane. Both transforms split their planes over the threads. */
void kiln_winograd23_output_f32(const float *restrict m, const float *restrict bias, float *restrict y, i64 n, i64 o,
                                i64 oh, i64 ow, i64 th, i64 tw, i64 act, float lo, float hi, i64 threads) {
    const winograd_args a = {.m = m, .bias = bias, .y = y, .n = n, .o = o, .oh = oh, .ow = ow, .th = th, .tw = tw,
                             .act = act, .lo = lo, .hi = hi};
    parallel_for(winograd_output_part, &a, n * o, threads);
}

/* ---------------------------------------------------------------------------------------------------------
 * 2-d max pooling over planes of [h, w]: positions outside x (padding, ceil_mode's extra) never win, NaN wins as
 * in PyTorch. Output geometry (oh, ow) comes from the caller, which applies PyTorch's ceil_mode rules. Planes are
 * split over the threads.
 */
typedef struct {
    const float *x;
    float *y;
    i64 h, w, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow;
} maxpool_args;

static void maxpool_part(const void *ctx, i64 begin, i64 end) {
    const maxpool_args *a = ctx;
    const i64 h = a->h, w = a->w, sh = a->sh, sw = a->sw, dw = a->dw, oh = a->oh, ow = a->ow;
    for (i64 p = begin; p < end; p++) {
        const float *xp = a->x + p * h * w;
        float *yp = a->y + p * oh * ow;
        for (i64 r = 0; r < oh; r++) {
            float *yr = yp + r * ow;
            for (i64 c = 0; c < ow; c++) yr[c] = -__builtin_inff();
            for (i64 i = 0; i < a->kh; i++) {
                const i64 rr = r * sh - a->pt + i * a->dh;
                if (rr < 0 || rr >= h) continue;
                const float *xr = xp + rr * w;
                for (i64 j = 0; j < a->kw; j++) {
                    /* one tap across the output row: columns c with 0 <= c * sw + off < w */
                    const i64 off = j * dw - a->pl;
                    const i64 lo = off >= 0 ? 0 : (-off + sw - 1) / sw;
                    i64 hi = (w - off + sw - 1) / sw;
                    hi = hi < ow ? hi : ow;
                    for (i64 c = lo; c < hi; c++) {
                        const float v = xr[c * sw + off];
                        yr[c] = (v > yr[c] || v != v) ? v : yr[c]; /* once NaN, stays NaN */
                    }
                }
            }
        }
    }
}

void kiln_maxpool2d_f32(const float *restrict x, float *restrict y, i64 planes, i64 h, i64 w, i64 kh, i64 kw, i64 sh,
                        i64 sw, i64 pt, i64 pl, i64 dh, i64 dw, i64 oh, i64 ow, i64 threads) {
    const maxpool_args a = {x, y, h, w, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow};
    parallel_for(maxpool_part, &a, planes, threads);
}

/* ---------------------------------------------------------------------------------------------------------
 * Weight-only quantized linear for few rows (decode, small batches): out[r][n] = sum_k x[r][k] W[n][k] + bias[n]
 * with W[n][k] = (q[n][k] - zero[n][g]) * scale[n][g], g = k / group (the op set's quantized_linear). Each
 * weight row is read once, as int8 or packed int4, and converted in registers; per group the zero point comes
 * out of the sum: scale * (sum_k x q - zero * sum_k x). xs holds, per row, x split into even and odd elements
 * (so int4's low and high nibbles meet contiguous x) and the per-group sums of x; the caller allocates it:
 * m * (k + k / group) floats.
 */
#define QROWS 4

/* out[i] = the lanes of total[i] + tail[i] + bias[i], for the QROWS rows a quantized pass computed */
static inline void finish_rows(const v16 *total, const float *tail, const float *restrict bias, float *restrict out) {
    for (int i = 0; i < QROWS; i++) {
        float acc = tail[i];
        for (int lane = 0; lane < 16; lane++) acc += total[i][lane];
        out[i] = acc + (bias ? bias[i] : 0.0f);
    }
}

/* int8 rows o..o+QROWS-1 of kiln_qlinear_f32 for one x row. The bytes are read unsigned (q ^ 128 = q + 128, see
 * to_float16u), and the 128 is folded into the group's additive term b (quant.h): sum x (q s + b) =
 * s sum x (q + 128) + (b - 128 s) sum x. */
static void qlinear8_rows(const float *restrict xr, const unsigned char *restrict q, const float *restrict scale,
                          const float *restrict zero, const float *restrict bias, float *restrict out,
                          const float *restrict xsum, i64 k, i64 group, i64 format) {
    const i64 ngroups = k / group;
    const v16u8u flip = (v16u8u){128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128};
    v16 total[QROWS];
    float tail[QROWS];
    for (int i = 0; i < QROWS; i++) total[i] = splat16(0.0f), tail[i] = 0.0f;
    for (i64 g = 0; g < ngroups; g++) {
        const float *xg = xr + g * group;
        v16 dot[QROWS];
        float rest[QROWS];
        for (int i = 0; i < QROWS; i++) dot[i] = splat16(0.0f), rest[i] = 0.0f;
        i64 j = 0;
        for (; j + 16 <= group; j += 16) {
            const v16 xv = *(const v16u *)(xg + j);
            for (int i = 0; i < QROWS; i++)
                dot[i] += xv * to_float16u(*(const v16u8u *)(q + i * k + g * group + j) ^ flip);
        }
        for (; j < group; j++)
            for (int i = 0; i < QROWS; i++) rest[i] += xg[j] * (float)(q[i * k + g * group + j] ^ 128);
        for (int i = 0; i < QROWS; i++) {
            const float s = scale[i * ngroups + g], b = quant_term(zero ? zero + i * ngroups : 0, g, s, format);
            total[i] += splat16(s) * dot[i];
            tail[i] += s * rest[i] + (b - 128.0f * s) * xsum[g];
        }
    }
    finish_rows(total, tail, bias, out);
}

/* int4 rows o..o+QROWS-1 of kiln_qlinear_f32 for one x row, split into even (xe) and odd (xo) elements: the low
 * nibble of byte j is weight 2j, the high nibble weight 2j + 1. */
static void qlinear4_rows(const float *restrict xe, const float *restrict xo, const unsigned char *restrict q,
                          const float *restrict scale, const float *restrict zero, const float *restrict bias,
                          float *restrict out, const float *restrict xsum, i64 k, i64 group, i64 format) {
    const i64 ngroups = k / group, half = group / 2;
    v16 total[QROWS];
    float tail[QROWS];
    for (int i = 0; i < QROWS; i++) total[i] = splat16(0.0f), tail[i] = 0.0f;
    for (i64 g = 0; g < ngroups; g++) {
        const float *eg = xe + g * half, *og = xo + g * half;
        v16 dot[QROWS];
        float rest[QROWS];
        for (int i = 0; i < QROWS; i++) dot[i] = splat16(0.0f), rest[i] = 0.0f;
        i64 j = 0;
        for (; j + 16 <= half; j += 16) {
            const v16 ev = *(const v16u *)(eg + j), ov = *(const v16u *)(og + j);
            for (int i = 0; i < QROWS; i++) {
                const v16u8u b = *(const v16u8u *)(q + i * (k / 2) + g * half + j);
                dot[i] += ev * to_float16u(b & 15) + ov * to_float16u(b >> 4);
            }
        }
        for (; j < half; j++)
            for (int i = 0; i < QROWS; i++) {
                const unsigned char b = q[i * (k / 2) + g * half + j];
                rest[i] += eg[j] * (float)(b & 15) + og[j] * (float)(b >> 4);
            }
        for (int i = 0; i < QROWS; i++) {
            const float s = scale[i * ngroups + g], b = quant_term(zero ? zero + i * ngroups : 0, g, s, format);
            total[i] += splat16(s) * dot[i];
            tail[i] += s * rest[i] + b * xsum[g];
        }
    }
    finish_rows(total, tail, bias, out);
}

typedef struct {
    const float *x;
    const void *qv;
    const float *scale, *zero, *bias;
    float *out;
    const float *xs;
    i64 m, n, k, format, group;
} qlinear_args;

/* outputs [begin * QROWS, end * QROWS) of kiln_qlinear_f32, in blocks of QROWS weight rows, the last part's
 * n % QROWS outputs one by one: each output takes the same path whatever the split, so the thread count does
 * not change a result */
static void qlinear_part(const void *ctx, i64 begin, i64 end) {
    const qlinear_args *a = ctx;
    const float *restrict x = a->x, *restrict scale = a->scale, *restrict zero = a->zero, *restrict bias = a->bias;
    const float *restrict xs = a->xs;
    const void *restrict qv = a->qv;
    float *restrict out = a->out;
    const i64 m = a->m, n = a->n, k = a->k, format = a->format, bits = QUANT_BITS(format), group = a->group;
    const i64 ngroups = k / group;
    const i64 stop = end * QROWS < n ? end * QROWS : n;
    i64 o = begin * QROWS;
    /* four weight rows per pass: each x vector loaded once feeds four FMA chains */
    for (; o + QROWS <= stop; o += QROWS)
        for (i64 r = 0; r < m; r++) {
            const float *xe = xs + r * (k + ngroups);
            const float *zo = zero ? zero + o * ngroups : 0, *bo = bias ? bias + o : 0;
            if (bits == 8)
                qlinear8_rows(x + r * k, (const unsigned char *)qv + o * k, scale + o * ngroups, zo, bo,
                              out + r * n + o, xe + k, k, group, format);
            else
                qlinear4_rows(xe, xe + k / 2, (const unsigned char *)qv + o * (k / 2), scale + o * ngroups, zo, bo,
                              out + r * n + o, xe + k, k, group, format);
        }
    for (; o < stop; o++) {
        const float *so = scale + o * ngroups;
        const float *zo = zero ? zero + o * ngroups : 0;
        for (i64 r = 0; r < m; r++) {
            const float *xr = x + r * k;
            const float *xe = xs + r * (k + ngroups), *xo = xe + k / 2, *xsum = xe + k;
            v16 total = splat16(0.0f); /* sum over groups of scale * (x . q), one horizontal sum at the end */
            float tail = 0.0f;
            for (i64 g = 0; g < ngroups; g++) {
                v16 dot = splat16(0.0f);
                float rest = 0.0f;
                if (bits == 8) {
                    const unsigned char *qg = (const unsigned char *)qv + o * k + g * group;
                    const float *xg = xr + g * group;
                    const v16u8u flip = (v16u8u){128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128, 128,
                                                 128, 128, 128};
                    i64 j = 0;
                    v16 dot2 = splat16(0.0f); /* two accumulators: one FMA chain would wait on its own latency */
                    for (; j + 32 <= group; j += 32) {
                        dot += *(const v16u *)(xg + j) * (to_float16u(*(const v16u8u *)(qg + j) ^ flip) - 128.0f);
                        dot2 += *(const v16u *)(xg + j + 16) *
                                (to_float16u(*(const v16u8u *)(qg + j + 16) ^ flip) - 128.0f);
                    }
                    for (; j + 16 <= group; j += 16)
                        dot += *(const v16u *)(xg + j) * (to_float16u(*(const v16u8u *)(qg + j) ^ flip) - 128.0f);
                    dot += dot2;
                    for (; j < group; j++) rest += xg[j] * (float)(signed char)qg[j];
                } else {
                    const unsigned char *qg = (const unsigned char *)qv + o * (k / 2) + g * (group / 2);
                    const float *eg = xe + g * (group / 2), *og = xo + g * (group / 2);
                    i64 j = 0;
                    v16 dot2 = splat16(0.0f);
                    for (; j + 16 <= group / 2; j += 16) {
                        const v16u8u b = *(const v16u8u *)(qg + j);
                        dot += *(const v16u *)(eg + j) * to_float16u(b & 15);
                        dot2 += *(const v16u *)(og + j) * to_float16u(b >> 4);
                    }
                    dot += dot2;
                    for (; j < group / 2; j++) rest += eg[j] * (float)(qg[j] & 15) + og[j] * (float)(qg[j] >> 4);
                }
                total += splat16(so[g]) * dot;
                tail += so[g] * rest + quant_term(zo, g, so[g], format) * xsum[g];
            }
            float acc = tail;
            for (int lane = 0; lane < 16; lane++) acc += total[lane];
            out[r * n + o] = acc + (bias ? bias[o] : 0.0f);
        }
    }
}

void kiln_qlinear_f32(const float *restrict x, const void *restrict qv, const float *restrict scale,
                      const float *restrict zero, const float *restrict bias, float *restrict out, float *restrict xs,
                      i64 m, i64 n, i64 k, i64 format, i64 group, i64 threads) {
    const i64 ngroups = k / group, bits = QUANT_BITS(format);
    for (i64 r = 0; r < m; r++) {
        const float *xr = x + r * k;
        float *xe = xs + r * (k + ngroups), *xo = xe + k / 2, *xsum = xe + k;
        if (bits == 4)
            for (i64 j = 0; j < k / 2; j++) {
                xe[j] = xr[2 * j];
                xo[j] = xr[2 * j + 1];
            }
        for (i64 g = 0; g < ngroups; g++) {
            float s = 0.0f;
            for (i64 j = 0; j < group; j++) s += xr[g * group + j];
            xsum[g] = s;
        }
    }
    const qlinear_args args = {x, qv, scale, zero, bias, out, xs, m, n, k, format, group};
    const i64 blocks = (n + QROWS - 1) / QROWS, most = n * k / LINEAR_MIN_PART;
    parallel_for(qlinear_part, &args, blocks, threads_for(threads, most));
}

#if defined(__AVX512F__)
/* One int4 group's 16-byte pieces (32 weights each) to floats in element order: a byte's low nibble is element
 * 2j, its high nibble 2j + 1; each value rounded as quant_value defines it. (GCC's vector extensions lowered the
 * byte-to-float conversion lane by lane: slower than the scalar loop.) */
static inline void dequantize_int4_group(const unsigned char *restrict qg, float *restrict wg, i64 group, float s,
                                         float point, i64 format) {
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8)), low = _mm512_set1_epi32(15);
    const __m512 sv = _mm512_set1_ps(s), pv = _mm512_set1_ps(point);
    for (i64 j = 0; j < group / 2; j += 16) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qg + j)));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        _mm512_storeu_ps(wg + 2 * j, quant_value16(_mm512_permutex2var_ps(lo, first, hi), sv, pv, format));
        _mm512_storeu_ps(wg + 2 * j + 16, quant_value16(_mm512_permutex2var_ps(lo, second, hi), sv, pv, format));
    }
}
#endif

/* Dequantize rows [0, rows) of a quantized weight into float32 w [rows, k] (for many-row inputs, which then use
 * BLAS on a band of dequantized rows at a time; an embedding's rows). q, scale and zero point at the first row. */
void kiln_dequantize_f32(const void *restrict qv, const float *restrict scale, const float *restrict zero,
                         float *restrict w, i64 rows, i64 k, i64 format, i64 group) {
    const i64 ngroups = k / group, bits = QUANT_BITS(format);
    /* each form rounded as it is defined (quant.h's quant_value): q * s + o is GGUF's own rounding */
    const int offset = (format & QUANT_OFFSET) != 0;
    for (i64 o = 0; o < rows; o++)
        for (i64 g = 0; g < ngroups; g++) {
            const float *zo = zero ? zero + o * ngroups : 0;
            const float s = scale[o * ngroups + g];
            const float point = quant_point(zo, g, format);
            float *wg = w + o * k + g * group;
            if (bits == 8) {
                const signed char *qg = (const signed char *)qv + o * k + g * group;
                if (offset)
                    for (i64 j = 0; j < group; j++) wg[j] = (float)qg[j] * s + point;
                else
                    for (i64 j = 0; j < group; j++) wg[j] = ((float)qg[j] - point) * s;
            } else {
                const unsigned char *qg = (const unsigned char *)qv + o * (k / 2) + g * (group / 2);
#if defined(__AVX512F__)
                if (group % 32 == 0) {
                    dequantize_int4_group(qg, wg, group, s, point, format);
                    continue;
                }
#endif
                for (i64 j = 0; j < group / 2; j++) {
                    const float lo = (float)(qg[j] & 15), hi = (float)(qg[j] >> 4);
                    wg[2 * j] = offset ? lo * s + point : (lo - point) * s;
                    wg[2 * j + 1] = offset ? hi * s + point : (hi - point) * s;
                }
            }
        }
}

/* ---------------------------------------------------------------------------------------------------------
 * LayerNorm of rows of n floats: out = (x - mean) / sqrt(mean((x - mean)^2) + eps) * w + b (w, b may be absent),
 * as the portable kernel composes it, each mean a sum of 16 lanes, the lanes in order, then the tail. An
 * encoder's norms (MiniLM: 13 of 384 floats a row) paid ~45 us each in NumPy's passes and temporaries.
 */
void kiln_layer_norm_f32(const float *restrict x, const float *restrict w, const float *restrict b,
                         float *restrict out, i64 rows, i64 n, float eps) {
    for (i64 row = 0; row < rows; row++) {
        const float *xr = x + row * n;
        float *orow = out + row * n;
        v16 acc = splat16(0.0f);
        float sum = 0.0f, tail = 0.0f;
        i64 j = 0;
        for (; j + 16 <= n; j += 16) acc += *(const v16u *)(xr + j);
        for (int lane = 0; lane < 16; lane++) sum += acc[lane];
        for (; j < n; j++) tail += xr[j];
        const float mean = (sum + tail) / (float)n;
        acc = splat16(0.0f);
        sum = tail = 0.0f;
        for (j = 0; j + 16 <= n; j += 16) {
            const v16 c = *(const v16u *)(xr + j) - splat16(mean);
            acc += c * c;
        }
        for (int lane = 0; lane < 16; lane++) sum += acc[lane];
        for (; j < n; j++) tail += (xr[j] - mean) * (xr[j] - mean);
        const float root = sqrtf((sum + tail) / (float)n + eps);
        for (j = 0; j + 16 <= n; j += 16) {
            v16 o = (*(const v16u *)(xr + j) - splat16(mean)) / splat16(root);
            if (w) o *= *(const v16u *)(w + j);
            if (b) o += *(const v16u *)(b + j);
            *(v16u *)(orow + j) = o;
        }
        for (; j < n; j++) {
            float o = (xr[j] - mean) / root;
            if (w) o *= w[j];
            if (b) o += b[j];
            orow[j] = o;
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * RMSNorm of rows of n floats, after a residual add when r is given: total = x + r (written to `total`, which
 * must then be given), out = total / sqrt(mean(total^2) + eps) * w (w may be absent). One pass over each row for
 * the sum of squares (16 lanes, then the lanes in order) and one for the output: a decode step's norms are a few
 * hundred floats each, where the NumPy composition paid ~20 us in per-call overhead for under 1 us of work.
 */
void kiln_add_rms_norm_f32(const float *restrict x, const float *restrict r, const float *restrict w,
                           float *restrict total, float *restrict out, i64 rows, i64 n, float eps) {
    for (i64 row = 0; row < rows; row++) {
        const float *xr = x + row * n, *rr = r ? r + row * n : 0;
        float *tr = total ? total + row * n : 0, *orow = out + row * n;
        v16 acc = splat16(0.0f);
        float tail = 0.0f;
        i64 j = 0;
        for (; j + 16 <= n; j += 16) {
            v16 t = *(const v16u *)(xr + j);
            if (rr) t += *(const v16u *)(rr + j);
            if (tr) *(v16u *)(tr + j) = t;
            acc += t * t;
        }
        for (; j < n; j++) {
            const float t = rr ? xr[j] + rr[j] : xr[j];
            if (tr) tr[j] = t;
            tail += t * t;
        }
        for (int lane = 0; lane < 16; lane++) tail += acc[lane];
        const float root = sqrtf(tail / (float)n + eps);
        const float *src = tr ? tr : xr;
        for (j = 0; j + 16 <= n; j += 16) {
            v16 o = *(const v16u *)(src + j) / splat16(root);
            if (w) o *= *(const v16u *)(w + j);
            *(v16u *)(orow + j) = o;
        }
        for (; j < n; j++) orow[j] = src[j] / root * (w ? w[j] : 1.0f);
    }
}

/* ---------------------------------------------------------------------------------------------------------
 * Sums of rows of n floats (a reduction over an array's trailing, contiguous dims: a network's global average
 * pool, a pooling sum), divided by `divisor` (n for a mean, else 1): four vectors of 16 lanes over the row in order,
 * the vectors and then the lanes added in order, then the tail. NumPy's `mean` over a 7x7 map cost ~25 us a call
 * (MobileNetV3-small has ten), almost all of it per-call overhead.
 */
void kiln_sum_rows_f32(const float *restrict x, float *restrict out, i64 rows, i64 n, float divisor) {
    for (i64 row = 0; row < rows; row++) {
        const float *xr = x + row * n;
        v16 a0 = splat16(0.0f), a1 = a0, a2 = a0, a3 = a0;
        i64 j = 0;
        for (; j + 64 <= n; j += 64) {
            a0 += *(const v16u *)(xr + j);
            a1 += *(const v16u *)(xr + j + 16);
            a2 += *(const v16u *)(xr + j + 32);
            a3 += *(const v16u *)(xr + j + 48);
        }
        for (; j + 16 <= n; j += 16) a0 += *(const v16u *)(xr + j);
        const v16 total = (a0 + a1) + (a2 + a3);
        float sum = 0.0f;
        for (int lane = 0; lane < 16; lane++) sum += total[lane];
        for (; j < n; j++) sum += xr[j];
        out[row] = sum / divisor;
    }
}
