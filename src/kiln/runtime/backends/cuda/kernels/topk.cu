// topk over the last dim of short rows (a mixture-of-experts router picking k of E experts a token): a warp per
// row, k rounds, each round every lane's best element not yet taken meeting the others' through shuffles, so a
// decode step's routing is one small kernel where the portable kernel sorts each row (several CUB launches).
// The order is the op's (PyTorch's stable one): for largest, NaN above +inf; for smallest, NaN last; between equal
// values (-0.0 and +0.0 are equal) the lower index first. Each element and its index are one 64-bit key whose
// larger value wins: the value's order in the high word, the index reversed in the low word.

#define TOPK_WARPS 8  // rows a block takes (topk.py's TOPK_WARPS)

// The float's place in the order as an unsigned word (larger wins): NaN highest for largest, lowest for smallest.
__device__ __forceinline__ unsigned long long topk_key(float v, long long at, int largest) {
    if (v == 0.0f) v = 0.0f;  // (-0.0 ties with +0.0)
    unsigned int u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending floats to ascending words
    if (v != v) u = 0xffffffffu;
    if (!largest) u = ~u;
    return ((unsigned long long)u << 32) | (0xffffffffu - (unsigned int)at);
}

// The warp's largest 64-bit key: on sm_80 on, two redux.sync (the high words' max, then the low words' max among the
// lanes holding it: keys are unique, so that is the largest key) where five rounds of 64-bit shuffles took ten
// dependent shuffles; the shuffles elsewhere.
__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long key) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned int hi = (unsigned int)(key >> 32);
    unsigned int top, low;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(top) : "r"(hi));
    const unsigned int mine = hi == top ? (unsigned int)key : 0u;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(low) : "r"(mine));
    return (unsigned long long)top << 32 | low;
#else
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    return key;
#endif
}

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

// The float a key was made from (topk_key's order inverted; largest keys only).
__device__ __forceinline__ float key_value(unsigned long long key) {
    const unsigned int u = (unsigned int)(key >> 32);
    return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

// route_rows<N>: 8
// The op set's route_experts for rows of at most 32 N logits (a router's E experts; k <= 32): a warp per row holds
// the row in registers, takes the softmax in float32 (exp(x - max) / sum, as the portable softmax computes it), picks
// the k largest probabilities as topk_rows does, renormalizes them by their sum when asked, and writes them as
// float32 (out_float32) or the storage type, with their int64 indices: the router's whole chain after its linear
// layer in one kernel. A NaN logit makes every probability NaN, as the softmax it stands for does.
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
    float top = -KILN_INF;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int at = 32 * j + lane;
        v[j] = at < n ? S::load(xr[at]) : -KILN_INF;
        nan |= v[j] != v[j];
        top = fmaxf(top, v[j]);
    }
    top = warp_max(top);
    nan = __any_sync(0xffffffffu, nan);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        v[j] = 32 * j + lane < n ? expf(v[j] - top) : 0.0f;
        sum += v[j];
    }
    sum = warp_sum(sum);
    unsigned long long keys[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int at = 32 * j + lane;
        keys[j] = at < n ? topk_key(nan ? __int_as_float(0x7fc00000) : v[j] / sum, at, 1) : 0ull;
    }
    float mine = 0.0f;  // lane r keeps the r-th pick
    long long mine_at = 0;
    for (int round = 0; round < k; ++round) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int j = 0; j < N; ++j) best = keys[j] > best ? keys[j] : best;
        best = warp_max_key(best);
        const int at = (int)(0xffffffffu - (unsigned int)(best & 0xffffffffu));
        if ((at & 31) == lane) {
#pragma unroll
            for (int j = 0; j < N; ++j) keys[j] = j == (at >> 5) ? 0ull : keys[j];
        }
        if (lane == round) mine = key_value(best), mine_at = at;
    }
    const float total = normalize ? warp_sum(lane < k ? mine : 0.0f) : 1.0f;
    if (lane < k) {
        const float w = normalize ? mine / total : mine;
        if (out_float32)
            static_cast<float*>(weights)[row * k + lane] = w;
        else
            static_cast<typename S::T*>(weights)[row * k + lane] = S::store(w);
        indices[row * k + lane] = mine_at;
    }
}
