/* What kiln's compiled helpers share across their source files: the integer type of sizes and the thread pool
 * (defined in kernels.c). Internal: nothing here is exported from the library. */
#ifndef KILN_POOL_H
#define KILN_POOL_H

#include <stdint.h>

typedef int64_t i64;

typedef void (*task_fn)(const void *ctx, i64 begin, i64 end);

/* fn(ctx, begin, end) over [0, count) on up to `threads` threads (the calling one among them), in contiguous chunks
 * that the threads take in turn: fn may be called several times a thread, on ranges of any size and in any order */
__attribute__((visibility("hidden"))) void parallel_for(task_fn fn, const void *ctx, i64 count, i64 threads);

/* a convolution's fused activation over n outputs in place: 0 none, 1 clamp to [lo, hi], 2 hardswish */
__attribute__((visibility("hidden"))) void conv_activate(float *y, i64 n, int act, float lo, float hi);

/* A buffer of at least `bytes` (64-byte aligned) owned by the calling thread, kept for its next call of the same
 * slot (NULL if it cannot be had). The helpers' temporary buffers run to megabytes, which glibc serves by mmap:
 * allocated per call they paid page faults each time and, freed while the pool's threads ran, TLB shootdowns
 * (the packed GEMM at 2 threads: 163 -> 120 us on a 1536 x 384 layer with them kept). A slot is one use, so
 * a helper that calls another never shares a buffer with it. */
enum { SCRATCH_GEMM_A, SCRATCH_GEMM_B, SCRATCH_GEMM_SPAN, SCRATCH_GEMM_ROWS, SCRATCH_DEPTHWISE, SCRATCH_DIRECT_INPUT, SCRATCH_DIRECT_WEIGHTS,
       SCRATCH_WINOGRAD, SCRATCH_ATTENTION, SCRATCH_SLOTS };
__attribute__((visibility("hidden"))) void *thread_scratch(int slot, i64 bytes);

enum { LINEAR_MIN_PART = 1 << 16 }; /* weight elements a thread's part reads at least: smaller calls run alone */

/* The threads a call whose work fills `parts` minimum parts may use: at most `threads`, at least 1 */
static inline i64 threads_for(i64 threads, i64 parts) { return threads < parts ? threads : (parts > 1 ? parts : 1); }

#endif
