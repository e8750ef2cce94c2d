// topk over the last dim of short rows (a mixture-of-experts router picking k of E experts a token): a warp per
// row, k rounds, each round every lane's best element not yet taken meeting the others' through shuffles, so a
// decode step's routing is one small kernel where the portable kernel sorts each row (several CUB launches).
// The order is the op's (PyTorch's stable one): for largest, NaN above +inf; for smallest, NaN last; between equal
// values (-0.0 and +0.0 are equal) the lower index first. Each element and its index are one 64-bit key whose
// larger value wins: the value's order in the high word, the index reversed in the low word.

#define TOPK_WARPS 8  // rows a block takes (topk.py's TOPK_WARPS)

// topk_rows<N>: 0 8
// N > 0: rows of at most 32 N elements, each lane's keys held in registers, read once (a router's 128 experts: 4 a
// lane); a pick zeroes the winner's key. N = 0: any row up to 1024, keys recomputed from memory each round (taken
// elements marked in a bit mask).
template <class S, int N>
__global__ void __launch_bounds__(32 * TOPK_WARPS) topk_rows(const typename S::T* __restrict__ x,
                                                             typename S::T* __restrict__ values,
                                                             long long* __restrict__ indices, long long rows, int n,
                                                             int k, int largest) {
    grid_dependency_sync();
    const long long row = blockIdx.x * (long long)TOPK_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;  // (whole warps: the shuffles see every lane)
    const int lane = threadIdx.x & 31;
    const typename S::T* xr = x + row * n;
    constexpr int HELD = N > 0 ? N : 1;
    unsigned long long keys[HELD];
    if (N > 0) {
#pragma unroll
        for (int j = 0; j < HELD; ++j) {
            const int at = 32 * j + lane;
            keys[j] = at < n ? topk_key(S::load(xr[at]), at, largest) : 0ull;
        }
    }
    unsigned int taken = 0u;  // N = 0: bit j marks element 32 j + lane picked (n <= 1024: sort.py checks)
    for (int round = 0; round < k; ++round) {
        unsigned long long best = 0ull;
        if (N > 0) {
#pragma unroll
            for (int j = 0; j < HELD; ++j) best = keys[j] > best ? keys[j] : best;
        } else {
            for (int j = 0; 32 * j + lane < n; ++j) {
                if (taken >> j & 1u) continue;
                const int at = 32 * j + lane;
                const unsigned long long key = topk_key(S::load(xr[at]), at, largest);
                best = key > best ? key : best;
            }
        }
        best = warp_max_key(best);
        const int at = (int)(0xffffffffu - (unsigned int)(best & 0xffffffffu));
        if ((at & 31) == lane) {
            if (N > 0) {
#pragma unroll
                for (int j = 0; j < HELD; ++j) keys[j] = j == (at >> 5) ? 0ull : keys[j];
            } else {
                taken |= 1u << (at >> 5);
            }
        }
        if (lane == 0) {
            values[row * k + round] = xr[at];
            indices[row * k + round] = at;
        }
    }
}

// route_rows<N>: 8
// The op set's route_experts for rows of at most 32 N logits (a router's E experts; k <= 32): a warp per row holds
// the row in registers and picks as common.cuh's route_row: the router's whole chain after its linear layer in one
// kernel.
template <class S, int N>
__global__ void __launch_bounds__(32 * TOPK_WARPS) route_rows(const typename S::T* __restrict__ logits,
                                                              void* __restrict__ weights,
                                                              long long* __restrict__ indices, long long rows, int n,
                                                              int k, int normalize, int out_float32) {
    grid_dependency_sync();
    const long long row = blockIdx.x * (long long)TOPK_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;  // (whole warps: the shuffles see every lane)
    const int lane = threadIdx.x & 31;
    const typename S::T* xr = logits + row * n;
    float v[N];
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = 32 * j + lane < n ? S::load(xr[32 * j + lane]) : -KILN_INF;
    route_row<S, N>(v, n, k, normalize, out_float32, weights, indices, row);
}
