// A mixture-of-experts layer's experts over many rows (a prompt's tokens, each routed to its top-k experts: the
// op set's gathered_linear): the rows are grouped by expert on the GPU (expert_plan), and each group multiplies
// its expert's weight on the tensor cores (expert_gemm), so each picked expert's weight is read once per 64 rows
// that picked it, and the experts no row picked are not read. Grouping on the GPU keeps the index there: no copy
// to the host, and the step can be captured as a CUDA graph. (A few rows, a decode step's, take gemv.cu's
// gathered_gemv instead: one weight row per warp, no grouping.)

#define EXPERT_TILE_M 64    // rows of one expert a block multiplies (4 warps of 16)
#define EXPERT_TILE_N 64    // outputs a block computes (8 mma tiles of 8 a warp)
#define EXPERT_TILE_K 32    // K a stage copies to shared memory (two mma steps of 16)
#define EXPERT_PAD 8        // halves after each shared row: rows 80 bytes apart, the fragment loads conflict-free
#define EXPERT_MAX 1024     // experts the plan's shared counters hold (experts.py checks)
#define EXPERT_PLAN_THREADS 1024

// expert_plan<S>: F32
// order[0 .. rows - 1]: the rows grouped by expert (experts in order; within one, in no fixed order: each row's
// sums do not depend on where it sits in a tile); tiles[t] = (expert, first position in order, rows), one per 64
// rows of an expert, then (-1, 0, 0) up to max_tiles (= rows / 64 + experts + 2 rounded up: experts.py). Rows whose
// index is outside 0 .. experts - 1 form a last group with expert = experts (expert_gemm writes them NaN). One
// block: shared counters per expert, a serial scan (experts are at most EXPERT_MAX).
template <class S>
__global__ void __launch_bounds__(EXPERT_PLAN_THREADS) expert_plan(const long long* __restrict__ index, int rows,
                                                                   int experts, int* __restrict__ order,
                                                                   int* __restrict__ tiles, int max_tiles) {
    __shared__ int count[EXPERT_MAX + 1], start[EXPERT_MAX + 1], tile_start[EXPERT_MAX + 2];
    grid_dependency_sync();
    const int groups = experts + 1;  // (the out-of-range rows last)
    for (int e = threadIdx.x; e < groups; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < rows; s += blockDim.x) {
        const long long e = index[s];
        atomicAdd(&count[e >= 0 && e < experts ? (int)e : experts], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0, tile = 0;
        for (int e = 0; e < groups; ++e) {
            start[e] = run, tile_start[e] = tile;
            run += count[e], tile += (count[e] + EXPERT_TILE_M - 1) / EXPERT_TILE_M;
        }
        tile_start[groups] = tile;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < groups; e += blockDim.x) {
        for (int t = tile_start[e]; t < tile_start[e + 1]; ++t) {
            const int first = (t - tile_start[e]) * EXPERT_TILE_M;
            tiles[3 * t] = e, tiles[3 * t + 1] = start[e] + first;
            tiles[3 * t + 2] = min(EXPERT_TILE_M, count[e] - first);
        }
        count[e] = 0;  // (now the group's fill cursor)
    }
    for (int t = tile_start[groups] + threadIdx.x; t < max_tiles; t += blockDim.x)
        tiles[3 * t] = -1, tiles[3 * t + 1] = 0, tiles[3 * t + 2] = 0;
    __syncthreads();
    for (int s = threadIdx.x; s < rows; s += blockDim.x) {
        const long long e = index[s];
        const int g = e >= 0 && e < experts ? (int)e : experts;
        order[start[g] + atomicAdd(&count[g], 1)] = s;
    }
}

// expert_gemm<S>: F16 BF16
// out[order[first + r], n0 + c] = x[order[first + r]] . W[e, n0 + c] + bias[e, n0 + c] for the tile (e, first, rows)
// of blockIdx.y and the 64 outputs n0 = 64 blockIdx.x: the tile's rows gathered from x and the expert's weight
// rows copied to shared memory 32 columns at a time (cp.async, two stages: the next copy in flight while the tensor
// cores multiply this one), mma m16n8k16 with float32 sums, each output rounded once with its bias. Both operands
// are K-contiguous rows, which is what mma's row.col form takes, so nothing is transposed.
// Needs K a multiple of EXPERT_TILE_K and x, W 16-byte aligned rows (experts.py checks).
template <class S>
__global__ void __launch_bounds__(128) expert_gemm(const typename S::T* __restrict__ x, long long x_row,
                                                   const typename S::T* __restrict__ w,
                                                   const typename S::T* __restrict__ bias,
                                                   const int* __restrict__ order, const int* __restrict__ tiles,
                                                   typename S::T* __restrict__ out, int n, int k, int experts,
                                                   int has_bias) {
    typedef typename S::T T;
    constexpr int LD = EXPERT_TILE_K + EXPERT_PAD;
    __shared__ __align__(16) T xs[2][EXPERT_TILE_M][LD];
    __shared__ __align__(16) T ws[2][EXPERT_TILE_N][LD];
    grid_dependency_sync();
    const int e = tiles[3 * blockIdx.y], first = tiles[3 * blockIdx.y + 1], rows = tiles[3 * blockIdx.y + 2];
    if (e < 0) return;  // (a tile past the plan's: the grid is sized for the most tiles rows can make)
    const int n0 = blockIdx.x * EXPERT_TILE_N, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (e >= experts) {  // rows whose index is out of range
        for (int i = tid; i < rows * EXPERT_TILE_N; i += blockDim.x) {
            const int c = n0 + i % EXPERT_TILE_N;
            if (c < n) out[(long long)order[first + i / EXPERT_TILE_N] * n + c] = S::store(__int_as_float(0x7fc00000));
        }
        return;
    }
    // Each thread copies two 16-byte pieces of x's tile and two of W's per stage: rows tid / 4 and 32 + tid / 4,
    // column piece tid % 4.
    const int piece = (tid & 3) * 8;
    const T* xsrc[2];
    const T* wsrc[2];
    bool xvalid[2], wvalid[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int r = (tid >> 2) + 32 * j;
        xvalid[j] = r < rows, wvalid[j] = n0 + r < n;
        xsrc[j] = xvalid[j] ? x + (long long)order[first + r] * x_row + piece : x;
        wsrc[j] = wvalid[j] ? w + ((long long)e * n + n0 + r) * k + piece : w;
    }
    const int stages = k / EXPERT_TILE_K;
    auto copy_stage = [&](int stage, int buffer) {
        const int k0 = stage * EXPERT_TILE_K;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = (tid >> 2) + 32 * j;
            copy_async16(&xs[buffer][r][piece], xsrc[j] + (xvalid[j] ? k0 : 0), xvalid[j]);
            copy_async16(&ws[buffer][r][piece], wsrc[j] + (wvalid[j] ? k0 : 0), wvalid[j]);
        }
        cp_async_commit();
    };
    float acc[EXPERT_TILE_N / 8][4] = {};
    const int g = lane >> 2, t2 = (lane & 3) * 2, m0 = warp * 16;
    const bool busy = m0 < rows;  // (a warp whose 16 rows are all past the tile's rows only copies)
    copy_stage(0, 0);
    for (int stage = 0; stage < stages; ++stage) {
        const int buffer = stage & 1;
        if (stage + 1 < stages) {
            copy_stage(stage + 1, buffer ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (busy) mma_stage<S, EXPERT_TILE_K>(acc, xs[buffer], ws[buffer], m0, lane);
        __syncthreads();  // (the next stage's copy overwrites this buffer)
    }
    if (!busy) return;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the warp's 16
        const int r = m0 + g + 8 * half;
        if (r >= rows) continue;
        T* orow = out + (long long)order[first + r] * n;
#pragma unroll
        for (int j = 0; j < EXPERT_TILE_N / 8; ++j) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int c = n0 + 8 * j + t2 + i;
                if (c < n)
                    orow[c] = S::store(acc[j][2 * half + i] + (has_bias ? S::load(bias[(long long)e * n + c]) : 0.0f));
            }
        }
    }
}

// combine_rows<S>: F32 F16 BF16
// A gathered linear's combine on its own (the rows of a prompt, made by expert_gemm or the gathered GEMV):
// out[t, :] = sum over j of round(rows[t k + j, :] * combine[t, j]), the products rounded to the storage type and
// summed in float32 in j order, rounded once; a thread per 16-byte piece of an output row. Needs N a multiple of
// the piece and 16-byte aligned rows (experts.py checks).
template <class S>
__global__ void combine_rows(const typename S::T* __restrict__ rows, const typename S::T* __restrict__ combine,
                             typename S::T* __restrict__ out, long long tokens, int n, int topk) {
    typedef typename S::T T;
    constexpr int V = S::PER16;
    grid_dependency_sync();
    const int pieces = n / V;
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= tokens * pieces) return;
    const long long t = i / pieces, p = i % pieces;
    float acc[V] = {};
    for (int j = 0; j < topk; ++j) {
        const float c = S::load(combine[t * topk + j]);
        float v[V];
        S::unpack(*reinterpret_cast<const U4*>(rows + (t * topk + j) * n + p * V), v);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] += S::load(S::store(v[e] * c));
    }
    U4 packed;
    T* values = reinterpret_cast<T*>(&packed);
#pragma unroll
    for (int e = 0; e < V; ++e) values[e] = S::store(acc[e]);
    *reinterpret_cast<U4*>(out + t * n + p * V) = packed;
}
