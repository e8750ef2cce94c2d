// Matrix-vector products for a few input rows (every linear layer of a decode step): out[r, o] = x[r] . W[o] +
// bias[o] for W [N, K] row-major. At batch 1 a linear layer is a stream of its weight, so the kernel is built to
// keep enough bytes in flight: a warp per output feature, every lane issuing GEMV_LOADS 16-byte weight loads before
// it uses the first (GEMV_LOADS * 512 bytes per warp and row in flight), the weight read past L1 (read once), x read
// through L1 (every warp of the SM reads it). Sums in float32, one rounding at the end. When W is a program
// constant (w_constant), the first loads are issued before grid_dependency_sync: the weight stream of the layer
// starts while the kernel before it (launched early, launch.py) still finishes.
// Needs K a multiple of PER16 and x, W 16-byte aligned (linalg.py checks).
//
// A layer with few outputs (Llama-3.2-1B's o and down projections: 2048) gives too few warps to keep the memory
// busy, each with one long row: `split` warps (1, 2, 4 or 8, linalg.py picks it) then share each row, each summing
// a contiguous 1/split of K, and the row's first warp adds their sums in slice order (shared memory, a barrier).
// MODE >> 3 is log2(split), instantiated for the products without an activation (a gated layer is an MLP's wide
// one; a runtime split would cost the gated kernels registers, and so resident warps).
//
// MODE folds the small nodes around a linear layer into it (gated_linear, add_rms_norm_linear), each of which
// would otherwise be a kernel of its own in the decode step's chain:
// - MODE & 3, the gated activation (common.cuh's gate_activation; 0 none): W stacks N gate rows and then N up
//   rows, and a warp computes gate row o and up row N + o, rounds each as the linear would, and writes
//   act(gate) * up, rounded once, as gated_activation does.
// - MODE & 4, the residual add and RMSNorm before it: every block adds x and the residual r, rounded as the add
//   rounds (block 0 writes that sum out), and normalizes it into shared memory, as fused.cu's rms_norm does (the
//   sum of squares in another order). The warps issue their first weight loads before that, so the weight stream
//   starts while the block normalizes, and (without an activation) the block asks L2 for r and the norm weight
//   before its wait. The grid is then capped at the resident blocks (linalg.py) and each warp takes every
//   stride-th output, so a block normalizes once, not once per 8 outputs.

#define GEMV_WARPS 8     // warps per block: linalg.py's GEMV_WARPS (4 and 16 measured: slower end to end)
#define GEMV_ROWS 4      // input rows at most: linalg.py's GEMV_ROWS
#define GEMV_LOADS 2     // 16-byte weight loads per lane and weight row in flight (docs/benchmarks.md: whole decode
                         // steps took 1.36, 1.23-1.25, 1.25 and 1.29 ms with 1, 2, 4 and 8 on the H100)

// The lane's GEMV_LOADS weight pieces of one round from p0 (zeros past the row's end).
__device__ __forceinline__ void issue_loads(U4 (&wv)[GEMV_LOADS], const void* row, int p0, int pieces, int lane) {
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
        const int p = p0 + u * 32 + lane;
        wv[u] = p < pieces ? load_stream(static_cast<const U4*>(row) + p) : U4{0u, 0u, 0u, 0u};
    }
}

// acc[j][r] += one round (GEMV_LOADS pieces a lane, from p0) of the lane's share of x[r] . (row j of w), its loads
// already in wv[j][d]. Each x piece is read once for the NR rows.
template <class S, int NR, int DEPTH>
__device__ __forceinline__ void round_dot(const typename S::T* __restrict__ x, long long x_row, int rows, int pieces,
                                          int lane, int p0, int d, U4 (&wv)[NR][DEPTH][GEMV_LOADS],
                                          float (&acc)[NR][GEMV_ROWS]) {
    constexpr int V = S::PER16;
#pragma unroll
    for (int u = 0; u < GEMV_LOADS; ++u) {
        const int p = p0 + u * 32 + lane;
        if (p >= pieces) break;
        float wf[NR][V];
#pragma unroll
        for (int j = 0; j < NR; ++j) S::unpack(wv[j][d][u], wf[j]);
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            if (r >= rows) break;
            float xf[V];
            S::unpack(*reinterpret_cast<const U4*>(x + r * x_row + p * V), xf);
#pragma unroll
            for (int j = 0; j < NR; ++j) {
                float a = acc[j][r];
#pragma unroll
                for (int i = 0; i < V; ++i) a += wf[j][i] * xf[i];
                acc[j][r] = a;
            }
        }
    }
}

// acc[j][r] += the lane's share of x[r] . (row j of w, rows `step` elements apart: the gate and up rows of a gated
// product), the first DEPTH rounds' loads already in wv; each later round's loads of all NR rows are issued before
// any is used.
template <class S, int NR, int DEPTH>
__device__ __forceinline__ void rows_dot(const typename S::T* __restrict__ w, long long step,
                                         const typename S::T* __restrict__ x, long long x_row, int rows, int pieces,
                                         int lane, U4 (&wv)[NR][DEPTH][GEMV_LOADS], float (&acc)[NR][GEMV_ROWS]) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
        const int p0 = d * 32 * GEMV_LOADS;
        if (p0 < pieces) round_dot<S, NR, DEPTH>(x, x_row, rows, pieces, lane, p0, d, wv, acc);
    }
    for (int p0 = DEPTH * 32 * GEMV_LOADS; p0 < pieces; p0 += 32 * GEMV_LOADS) {  // (a warp-wide bound)
#pragma unroll
        for (int j = 0; j < NR; ++j) issue_loads(wv[j][0], w + j * step, p0, pieces, lane);
        round_dot<S, NR, DEPTH>(x, x_row, rows, pieces, lane, p0, 0, wv, acc);
    }
}

// The first DEPTH rounds of the lane's loads of rows o (and o + step) into wv.
template <int NR, int DEPTH>
__device__ __forceinline__ void issue_first(U4 (&wv)[NR][DEPTH][GEMV_LOADS], const void* row, long long step_bytes,
                                            int pieces, int lane) {
#pragma unroll
    for (int j = 0; j < NR; ++j) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d)
            issue_loads(wv[j][d], static_cast<const char*>(row) + j * step_bytes, d * 32 * GEMV_LOADS, pieces, lane);
    }
}

#define GEMV_NORM_PIECES 4  // 16-byte pieces of each row a thread of the norm prologue holds (k <= 8192 at 2 bytes)

// Asks L2 for what add_rms_norm_rows reads besides x, before the caller's grid_dependency_sync: x comes from the
// kernel just before (in L2), but res from a few kernels back and the norm weight nw from DRAM (nw is read after
// the block's sum of squares, so it would be a second round trip to DRAM).
template <class S>
__device__ __forceinline__ void prefetch_norm_inputs(const typename S::T* __restrict__ res,
                                                     const typename S::T* __restrict__ nw, int rows, int k,
                                                     int has_nw) {
    prefetch_l2(res, (long long)rows * k * sizeof(typename S::T), threadIdx.x, blockDim.x);
    if (has_nw) prefetch_l2(nw, (long long)k * sizeof(typename S::T), threadIdx.x, blockDim.x);
}

// xs[r] = rms_norm(x[r] + res[r]) * nw for the block's rows (x, res contiguous [rows, k]), the rounded sums written
// to sum where writes_sum (block 0, where every block normalizes the same rows), as fused.cu's rms_norm computes
// them. A thread loads all its 16-byte pieces of a row before it adds any and keeps them in registers; one barrier
// per row (rows are few). The norm weight is read after the sum
// of squares (from L2, where prefetch_norm_inputs put it): held from the start, its 16 registers a thread cost the
// norm-prologue GEMV a resident block per SM (64 -> 80 registers), and so a quarter of its loads in flight.
template <class S>
__device__ void add_rms_norm_rows(const typename S::T* __restrict__ x, const typename S::T* __restrict__ res,
                                  const typename S::T* __restrict__ nw, typename S::T* __restrict__ sum,
                                  typename S::T* xs, int rows, int k, float eps, int has_nw, bool writes_sum) {
    typedef typename S::T T;
    constexpr int V = S::PER16;
    __shared__ float partial[GEMV_ROWS][GEMV_WARPS];
    const int pieces = k / V, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 1
    for (int r = 0; r < rows; ++r) {
        U4 xv[GEMV_NORM_PIECES], rv[GEMV_NORM_PIECES];
#pragma unroll
        for (int i = 0; i < GEMV_NORM_PIECES; ++i) {
            const int p = threadIdx.x + i * blockDim.x;
            if (p < pieces) {
                xv[i] = *reinterpret_cast<const U4*>(x + (long long)r * k + p * V);
                rv[i] = *reinterpret_cast<const U4*>(res + (long long)r * k + p * V);
            }
        }
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < GEMV_NORM_PIECES; ++i) {
            const int p = threadIdx.x + i * blockDim.x;
            if (p < pieces) {
                T* t = reinterpret_cast<T*>(&xv[i]);
                const T* b = reinterpret_cast<const T*>(&rv[i]);
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    t[e] = S::store(S::load(t[e]) + S::load(b[e]));
                    const float v = S::load(t[e]);
                    ss += v * v;
                }
                if (writes_sum) *reinterpret_cast<U4*>(sum + (long long)r * k + p * V) = xv[i];
            }
        }
        ss = warp_sum(ss);
        if (lane == 0) partial[r][warp] = ss;
        __syncthreads();
        ss = 0.0f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) ss += partial[r][w];
        const float inv = 1.0f / sqrtf(ss / (float)k + eps);
#pragma unroll
        for (int i = 0; i < GEMV_NORM_PIECES; ++i) {
            const int p = threadIdx.x + i * blockDim.x;
            if (p < pieces) {
                T* t = reinterpret_cast<T*>(&xv[i]);
                const U4 g4 = has_nw ? *reinterpret_cast<const U4*>(nw + p * V) : U4{0u, 0u, 0u, 0u};
                const T* g = reinterpret_cast<const T*>(&g4);
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    const float v = S::load(t[e]) * inv;
                    t[e] = S::store(has_nw ? v * S::load(g[e]) : v);
                }
                *reinterpret_cast<U4*>(xs + r * k + p * V) = xv[i];
            }
        }
    }
    __syncthreads();
}

// add_rms_norm (the residual add and the RMSNorm after it, without a linear layer to take them: a quantized
// program's norms, and rows the GEMV prologue does not take) with a block of GEMV_WARPS warps a row, through
// add_rms_norm_rows: a thread's 16-byte pieces of x and the residual loaded together and kept in registers, the
// residual and the norm weight asked of L2 before grid_dependency_sync. fused.cu's rms_norm reads 2 bytes a
// thread and turn and the norm weight only after the block's sum (a DRAM round trip then): ~5 us of an 8B int4
// layer's ~76, twice a layer (H200 timeline). Rows of at most GEMV_NORM_PIECES x GEMV_WARPS x 32 pieces (norm.py's
// NORM_ROW_MAX bytes), 16-byte aligned.
template <class S>
__global__ void __launch_bounds__(GEMV_WARPS * 32) add_rms_norm_row(const typename S::T* __restrict__ x,
                                                                    const typename S::T* __restrict__ res,
                                                                    const typename S::T* __restrict__ nw,
                                                                    typename S::T* __restrict__ sum,
                                                                    typename S::T* __restrict__ y, int k, float eps,
                                                                    int has_nw) {
    const long long at = (long long)blockIdx.x * k;
    prefetch_norm_inputs<S>(res + at, nw, 1, k, has_nw);
    grid_dependency_sync();
    add_rms_norm_rows<S>(x + at, res + at, nw, sum + at, y + at, 1, k, eps, has_nw, true);
}

// gemv<N>: 0 1 2 3 4 5 6 7 8 12 16 20 24 28
template <class S, int MODE>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(const typename S::T* __restrict__ x, long long x_row,
                                                        const typename S::T* __restrict__ res,
                                                        const typename S::T* __restrict__ nw,
                                                        typename S::T* __restrict__ sum,
                                                        const typename S::T* __restrict__ w,
                                                        const typename S::T* __restrict__ bias,
                                                        typename S::T* __restrict__ out, int rows, int n, int k,
                                                        int has_bias, int has_nw, float eps, int w_constant) {
    typedef typename S::T T;
    constexpr int ACT = MODE & 3;
    constexpr bool NORM = (MODE & 4) != 0;
    constexpr int NR = ACT ? 2 : 1;  // weight rows a warp reads per output: gate and up, or one
    constexpr int split = 1 << (MODE >> 3);
    // Rounds of loads a lane issues before the kernel before it has finished: two for a shared row (linalg.py
    // sizes a warp's share at GEMV_SHARE_ROUNDS = 2 rounds, so the whole share is in flight at once), one otherwise.
    constexpr int DEPTH = split > 1 ? 2 : 1;
    __shared__ float partial[GEMV_WARPS][NR][GEMV_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_block = GEMV_WARPS / split, slice = warp % split;  // outputs a block takes at once; K share
    const int all = k / S::PER16, per_slice = (all + split - 1) / split;
    const int first = min(all, slice * per_slice), pieces = min(all, first + per_slice) - first;
    const long long stride = (long long)gridDim.x * per_block, step = (long long)n * k;
    const long long skip = (long long)first * S::PER16;  // this warp's first column
    long long o = (long long)blockIdx.x * per_block + warp / split;
    U4 wv[NR][DEPTH][GEMV_LOADS];
    const long long step_bytes = step * (long long)sizeof(T);
    // (Not in the gated forms: there ptxas then took 74 registers where it took 64 and spilled 12 bytes, a resident
    // block fewer per SM for a dense model's widest weight.)
    if (NORM && !ACT) prefetch_norm_inputs<S>(res, nw, rows, k, has_nw);
    if (w_constant && o < n)  // a program constant's rows: loaded while the kernel before this one finishes
        issue_first<NR, DEPTH>(wv, w + o * k + skip, step_bytes, pieces, lane);
    grid_dependency_sync();
    if (!NORM && split == 1 && o >= n) return;  // (no barrier follows: a whole warp leaves, its shuffles with it)
    if (!w_constant && o < n) issue_first<NR, DEPTH>(wv, w + o * k + skip, step_bytes, pieces, lane);
    const T* xin = x;
    long long xin_row = x_row;
    if (NORM) {
        extern __shared__ U4 normalized[];  // rows * k values
        T* xs = reinterpret_cast<T*>(normalized);
        add_rms_norm_rows<S>(x, res, nw, sum, xs, rows, k, eps, has_nw, blockIdx.x == 0);
        xin = xs, xin_row = k;
    }
    if (split == 1 && o >= n) return;  // (after the prologue's barriers)
    // The block's outputs, per_block at a time (a loop only with the prologue: the grid covers them otherwise);
    // every warp runs every iteration, for the barriers of a split row.
    for (long long base = o - warp / split; base < n; base += stride, o += stride) {
        float acc[NR][GEMV_ROWS];
#pragma unroll
        for (int j = 0; j < NR; ++j) {
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) acc[j][r] = 0.0f;
        }
        if (o < n) rows_dot<S, NR, DEPTH>(w + o * k + skip, step, xin + skip, xin_row, rows, pieces, lane, wv, acc);
        if (NORM && o + stride < n) issue_first<NR, DEPTH>(wv, w + (o + stride) * k + skip, step_bytes, pieces, lane);
#pragma unroll
        for (int j = 0; j < NR; ++j) {
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (r >= rows) break;
                acc[j][r] = warp_sum(acc[j][r]);
            }
        }
        if (split > 1) {  // the slices' sums, added in slice order by the row's first warp
            if (lane == 0) {
#pragma unroll
                for (int j = 0; j < NR; ++j) {
#pragma unroll
                    for (int r = 0; r < GEMV_ROWS; ++r) partial[warp][j][r] = acc[j][r];
                }
            }
            __syncthreads();
            if (slice == 0) {
                for (int t = 1; t < split; ++t) {
#pragma unroll
                    for (int j = 0; j < NR; ++j) {
#pragma unroll
                        for (int r = 0; r < GEMV_ROWS; ++r) acc[j][r] += partial[warp + t][j][r];
                    }
                }
            }
            __syncthreads();  // (partial is written again by the next iteration)
        }
        if (slice == 0 && o < n) {
            const float b = has_bias ? S::load(bias[o]) : 0.0f;
            const float bu = ACT && has_bias ? S::load(bias[n + o]) : 0.0f;
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (r >= rows) break;
                float y = acc[0][r] + b;
                if (ACT) {
                    const float u = S::load(S::store(acc[NR - 1][r] + bu));
                    y = gate_activation(S::load(S::store(y)), ACT) * u;
                }
                if (lane == 0) out[(long long)r * n + o] = S::store(y);
            }
        }
        if (!NORM) break;  // (the grid covers every output)
    }
}

// gathered_gemv<N>: 0 1 2 3 4 8 16 32 48
// A mixture-of-experts layer's experts over a few rows (a decode step's top-k rows: the op set's gathered_linear):
// out[s, o] = x[s] . W[index[s], o] + bias[index[s], o], W [E, N, K]. Block row blockIdx.y is input row s, and its
// warps stream output rows of the expert s picked as gemv streams a weight, so a step reads each picked expert once
// and no other. N & 3 is log2 of the warps sharing an output row where the layer is narrow (gemv's split); (N >> 2)
// & 3 is log2 of the consecutive output rows a warp takes at once where rows are short (WR: an expert's down
// projection, K = 768, is 96 16-byte pieces a row, 3 a lane: a warp per row would have 1.5 KB in flight and leave;
// experts.py makes N a multiple of WR). Two rounds of the WR rows' loads (all of a 768-wide row) are issued before
// the first is used: with one, the third piece of each lane waited for the first two (one more trip to memory).
// N >> 4 is the gated activation (gated_gathered_linear, common.cuh's gate_activation; then N & 15 is 0): each
// expert stacks N gate rows and then N up rows ([E, 2N, K], bias [E, 2N]), and a warp takes gate row o and up row
// N + o as the two rows of a WR = 2 pass, rounds each as the gathered linear would and writes act(gate) * up,
// rounded once, as gemv's gated form does: no [S, 2N] intermediate, no activation kernel after it.
// The grid may hold fewer blocks than the outputs need (experts.py caps it at the blocks the GPU keeps resident):
// a warp then takes every gridDim.x-th group of outputs, issuing the next group's first loads before it finishes
// the current one, so the weight stream does not stop between a last wave of blocks and the ones before it.
// The index comes from the router, a kernel before this one, so no weight load can start before
// grid_dependency_sync. An index outside 0 .. E - 1 gives NaN outputs (a kernel cannot raise; the CPU's raises).
template <class S, int N>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gathered_gemv(const typename S::T* __restrict__ x, long long x_row,
                                                                 const long long* __restrict__ index,
                                                                 const typename S::T* __restrict__ w,
                                                                 const typename S::T* __restrict__ bias,
                                                                 typename S::T* __restrict__ out, int n, int k,
                                                                 int experts, int has_bias) {
    typedef typename S::T T;
    constexpr int ACT = N >> 4, DEPTH = 2;  // (see gathered_combine)
    constexpr int split = 1 << (N & 3), WR = ACT ? 2 : 1 << ((N >> 2) & 3), OUTS = ACT ? 1 : WR;
    __shared__ float partial[GEMV_WARPS][WR];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_block = GEMV_WARPS / split, slice = warp % split;
    const int all = k / S::PER16, per_slice = (all + split - 1) / split;
    const int first = min(all, slice * per_slice), pieces = min(all, first + per_slice) - first;
    const long long skip = (long long)first * S::PER16, s = blockIdx.y;
    const long long stride = (long long)gridDim.x * per_block * OUTS;  // (outputs the grid takes at once)
    const long long rows_per_expert = ACT ? 2ll * n : n, step = ACT ? (long long)n * k : k;  // (W's rows, and
    const long long step_bytes = step * (long long)sizeof(T);                                //  a warp's apart)
    grid_dependency_sync();
    const long long e = index[s];
    const bool valid = e >= 0 && e < experts;
    const T* rows = w + e * rows_per_expert * k + skip;
    long long o = ((long long)blockIdx.x * per_block + warp / split) * OUTS;  // (the warp's first output)
    U4 wv[WR][DEPTH][GEMV_LOADS];
    if (o < n && valid) issue_first<WR, DEPTH>(wv, rows + o * k, step_bytes, pieces, lane);
    // Every warp of a block runs every iteration (the barriers of a split row), its outputs past n idle.
    for (long long base = o - (warp / split) * OUTS; base < n; base += stride, o += stride) {
        float acc[WR][GEMV_ROWS] = {};
        if (o < n && valid) {
            rows_dot<S, WR, DEPTH>(rows + o * k, step, x + s * x_row + skip, x_row, 1, pieces, lane, wv, acc);
            if (o + stride < n) issue_first<WR, DEPTH>(wv, rows + (o + stride) * k, step_bytes, pieces, lane);
        }
        if (ACT) {
            if (o < n) {
                const float b = valid && has_bias ? S::load(bias[e * rows_per_expert + o]) : 0.0f;
                const float bu = valid && has_bias ? S::load(bias[e * rows_per_expert + n + o]) : 0.0f;
                const float gate = warp_sum(acc[0][0]) + b, up = S::load(S::store(warp_sum(acc[WR - 1][0]) + bu));
                const float y = gate_activation(S::load(S::store(gate)), ACT) * up;
                if (lane == 0) out[s * n + o] = S::store(valid ? y : __int_as_float(0x7fc00000));
            }
        } else {
#pragma unroll
            for (int j = 0; j < WR; ++j) {
                float y = warp_sum(acc[j][0]);
                if (split > 1) {  // the slices' sums, added in slice order by the row's first warp
                    if (lane == 0) partial[warp][j] = y;
                    __syncthreads();
                    if (slice == 0) {
                        for (int t = 1; t < split; ++t) y += partial[warp + t][j];
                    }
                    __syncthreads();  // (partial is written again by the next output)
                }
                if (slice == 0 && o + j < n && lane == 0) {
                    const float b = valid && has_bias ? S::load(bias[e * n + o + j]) : 0.0f;
                    out[s * n + o + j] = S::store(valid ? y + b : __int_as_float(0x7fc00000));
                }
            }
        }
    }
}

#define GEMV_COMBINE_MAX 32  // rows a token's combine sums at most (experts.py's ROUTE_K_MAX)

// gathered_combine<N>: 0 1 2
// gathered_linear with combine over a few tokens (a decode step's down projection and the weighted sum of the k
// expert rows after it, in one kernel: no [k, N] intermediate, no product and sum kernels): block (blockIdx.x,
// token t = blockIdx.y) computes the WR = 2^N consecutive outputs from WR blockIdx.x of token t (and, where the grid
// is capped at the resident blocks as gathered_gemv's may be, every gridDim.x-th such group after it). Its warp j
// takes the token's row t k + j (and j + GEMV_WARPS ...), streams the WR weight rows of that row's expert as
// gathered_gemv does, and rounds each result (bias added) and then its product with combine[t, j] to the storage
// type, as the ops it stands for round them; the block's first warp adds the products in j order in float32 and
// rounds once. Where a warp has one row (k <= GEMV_WARPS), it issues its next group's first loads before the
// block's sum. An index outside 0 .. E - 1 makes the token's outputs NaN. Needs N a multiple of WR (experts.py).
template <class S, int N>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gathered_combine(const typename S::T* __restrict__ x,
                                                                    long long x_row,
                                                                    const long long* __restrict__ index,
                                                                    const typename S::T* __restrict__ w,
                                                                    const typename S::T* __restrict__ bias,
                                                                    const typename S::T* __restrict__ combine,
                                                                    typename S::T* __restrict__ out, int n, int k,
                                                                    int experts, int topk, int has_bias) {
    typedef typename S::T T;
    constexpr int WR = 1 << N;
    __shared__ float products[GEMV_COMBINE_MAX][WR];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pieces = k / S::PER16;
    const long long t = blockIdx.y, stride = (long long)gridDim.x * WR, step_bytes = (long long)k * sizeof(T);
    const bool single = topk <= GEMV_WARPS;  // (each warp one row of the token at most: its loads run ahead)
    long long o = (long long)blockIdx.x * WR;
    U4 wv[WR][2][GEMV_LOADS];
    // A guess at the warp's expert, read through L2 before the wait: in a MoE block the router ran two kernels
    // before this one (router, gate/up, this), so its index is final by the time this kernel may start, and the
    // first weight rows are in flight while the gate/up kernel still runs. The wait then reads the index again;
    // where the guess was wrong (the router ran just before, or a stale value), the loads are issued again.
    long long guess = single && warp < topk ? __ldcg(index + t * topk + warp) : -1;
    if (guess >= 0 && guess < experts && o < n)
        issue_first<WR, 2>(wv, w + (guess * n + o) * k, step_bytes, pieces, lane);
    grid_dependency_sync();
    const long long e0 = warp < topk ? index[t * topk + warp] : -1;
    const bool ahead = single && e0 >= 0 && e0 < experts;
    if (ahead && o < n && e0 != guess) issue_first<WR, 2>(wv, w + (e0 * n + o) * k, step_bytes, pieces, lane);
    for (; o < n; o += stride) {
        for (int j = warp; j < topk; j += GEMV_WARPS) {
            const long long s = t * topk + j, e = single ? e0 : index[s];
            const bool valid = e >= 0 && e < experts;
            float acc[WR][GEMV_ROWS] = {};
            if (valid) {
                const T* row = w + (e * n + o) * k;
                if (!single) issue_first<WR, 2>(wv, row, step_bytes, pieces, lane);
                rows_dot<S, WR, 2>(row, k, x + s * x_row, x_row, 1, pieces, lane, wv, acc);
                if (single && o + stride < n) issue_first<WR, 2>(wv, row + stride * k, step_bytes, pieces, lane);
            }
            const float c = S::load(combine[s]);
#pragma unroll
            for (int r = 0; r < WR; ++r) {
                const float y = warp_sum(acc[r][0]) + (valid && has_bias ? S::load(bias[e * n + o + r]) : 0.0f);
                if (lane == 0)
                    products[j][r] = valid ? S::load(S::store(S::load(S::store(y)) * c)) : __int_as_float(0x7fc00000);
            }
        }
        __syncthreads();
        if (warp == 0 && lane < WR) {
            float sum = 0.0f;
            for (int j = 0; j < topk; ++j) sum += products[j][lane];
            out[t * n + o + lane] = S::store(sum);
        }
        __syncthreads();  // (products is written again by the next group)
    }
}

#define ROUTE_HELD 8  // logits a lane holds in the pick: experts <= 256 (experts.py's ROUTE_HELD)

// add_rms_norm_route<N>: 1 2 4
// A mixture-of-experts block's residual add, RMSNorm, router linear layer and pick (add_rms_norm_route_experts) over
// a few rows, in one kernel where they were three (norm, router GEMV, route_rows). Every block adds and normalizes
// the rows into shared memory as gemv's norm prologue does (block 0 writes the sum and the normalized rows out: the
// experts read them); warp o of the grid takes expert o's logit for every row as gemv's warps take an output (rounded
// to the storage type, as the linear layer rounds it) into float32 scratch [rows, E]. The last block to finish
// (a ticket, which it resets to 0 for the next launch: experts.py hands over a zeroed one) picks each row's k
// experts as route_rows does, a warp per row, from the scratch read through L2. N rounds of each warp's loads of its
// router row (a program constant: N * 32 * GEMV_LOADS pieces, the whole row at K = 2048 bfloat16 with N = 4) are
// issued before grid_dependency_sync, so the router's weight is in flight while the kernel before still finishes
// (and the residual and norm weight are asked of L2, as gemv's norm prologue does).
template <class S, int N>
__global__ void __launch_bounds__(GEMV_WARPS * 32) add_rms_norm_route(
        const typename S::T* __restrict__ x, const typename S::T* __restrict__ res,
        const typename S::T* __restrict__ nw, typename S::T* __restrict__ sum, typename S::T* __restrict__ normed,
        const typename S::T* __restrict__ w, const typename S::T* __restrict__ bias, float* __restrict__ logits,
        void* __restrict__ weights, long long* __restrict__ indices, unsigned int* __restrict__ ticket, int rows,
        int n, int k, int topk, int normalize, int out_float32, int has_bias, int has_nw, float eps) {
    typedef typename S::T T;
    constexpr int V = S::PER16;
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pieces = k / V;
    const long long o = (long long)blockIdx.x * GEMV_WARPS + warp;  // this warp's expert
    U4 wv[1][N][GEMV_LOADS];
    if (o < n) issue_first<1, N>(wv, w + o * k, 0, pieces, lane);
    prefetch_norm_inputs<S>(res, nw, rows, k, has_nw);
    grid_dependency_sync();
    extern __shared__ U4 normalized[];  // rows * k values
    T* xs = reinterpret_cast<T*>(normalized);
    add_rms_norm_rows<S>(x, res, nw, sum, xs, rows, k, eps, has_nw, blockIdx.x == 0);
    if (blockIdx.x == 0) {
        for (int p = threadIdx.x; p < rows * pieces; p += blockDim.x)
            reinterpret_cast<U4*>(normed)[p] = normalized[p];
    }
    if (o < n) {
        float acc[1][GEMV_ROWS] = {};
        rows_dot<S, 1, N>(w + o * k, 0, xs, k, rows, pieces, lane, wv, acc);
        const float b = has_bias ? S::load(bias[o]) : 0.0f;
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r) {
            if (r >= rows) break;
            const float y = warp_sum(acc[0][r]) + b;
            if (lane == 0) logits[r * n + o] = S::load(S::store(y));
        }
    }
    __threadfence();  // (this block's logits visible to the block that picks)
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        if (last) *ticket = 0u;  // (every block has counted: the next launch starts from 0)
    }
    __syncthreads();
    if (!last || warp >= rows) return;
    __threadfence();
    float v[ROUTE_HELD];
#pragma unroll
    for (int j = 0; j < ROUTE_HELD; ++j) {
        const int at = 32 * j + lane;
        v[j] = at < n ? __ldcg(logits + warp * n + at) : -KILN_INF;
    }
    route_row<S, ROUTE_HELD>(v, n, topk, normalize, out_float32, weights, indices, warp);
}
