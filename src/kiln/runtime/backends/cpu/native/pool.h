/* What kiln's compiled helpers share across their source files: the integer type of sizes and the thread pool
 * (defined in kernels.c). Internal: nothing here is exported from the library. */
#ifndef KILN_POOL_H
#define KILN_POOL_H

#include <stdint.h>

typedef int64_t i64;

typedef void (*task_fn)(const void *ctx, i64 begin, i64 end);

/* fn(ctx, begin, end) over [0, count) in up to `threads` contiguous parts, the first on the calling thread */
__attribute__((visibility("hidden"))) void parallel_for(task_fn fn, const void *ctx, i64 count, i64 threads);

/* a convolution's fused activation over n outputs in place: 0 none, 1 clamp to [lo, hi], 2 hardswish */
__attribute__((visibility("hidden"))) void conv_activate(float *y, i64 n, int act, float lo, float hi);

enum { LINEAR_MIN_PART = 1 << 16 }; /* weight elements a thread's part reads at least: smaller calls run alone */

#endif
