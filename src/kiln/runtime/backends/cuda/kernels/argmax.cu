// A serving engine's greedy pick: each row's index of its largest value, as np.argmax gives it (the first of equal
// values; the first NaN where a row has one), read in the logits' own type. A block per row (a decode step's
// logits [rows, vocab]): each thread scans a strided share of the row, then the threads' candidates meet through
// warp shuffles and shared memory. One pass over the logits, where CuPy's argmax needs a float32 copy first.

#define ARGMAX_THREADS 1024  // the cuda backend's ARGMAX_THREADS
#define ARGMAX_LOADS 4       // 16-byte loads each thread has in flight

struct Pick {
    float value;
    long long at;  // -1: no element seen
    bool nan;
};

// Whether a beats b under np.argmax's order: any NaN beats a number, a larger value beats a smaller one, and
// between equals (or two NaNs) the lower index wins.
__device__ __forceinline__ bool beats(const Pick& a, const Pick& b) {
    if (a.at < 0) return false;
    if (b.at < 0) return true;
    if (a.nan != b.nan) return a.nan;
    if (!a.nan && a.value != b.value) return a.value > b.value;
    return a.at < b.at;
}

template <class S>
__global__ void __launch_bounds__(ARGMAX_THREADS) argmax_rows(const typename S::T* __restrict__ x,
                                                              long long* __restrict__ out, long long cols) {
    grid_dependency_sync();
    __shared__ Pick picks[ARGMAX_THREADS / 32];
    const typename S::T* row = x + blockIdx.x * cols;
    Pick best = {-KILN_INF, -1, false};
    constexpr int V = S::PER16;
    // 16-byte loads, ARGMAX_LOADS in flight per thread (one element at a time, the row is latency-bound: a block
    // per row leaves most of the GPU idle, so each block must keep many bytes in flight); the rest one by one
    long long done = 0;
    if (reinterpret_cast<unsigned long long>(row) % 16 == 0) {
        const long long pieces = cols / V;
        const U4* p = reinterpret_cast<const U4*>(row);
        for (long long first = threadIdx.x; first < pieces; first += (long long)blockDim.x * ARGMAX_LOADS) {
            U4 u[ARGMAX_LOADS];
#pragma unroll
            for (int j = 0; j < ARGMAX_LOADS; ++j) {
                const long long piece = first + (long long)j * blockDim.x;
                u[j] = piece < pieces ? p[piece] : U4{0u, 0u, 0u, 0u};
            }
#pragma unroll
            for (int j = 0; j < ARGMAX_LOADS; ++j) {
                const long long piece = first + (long long)j * blockDim.x;
                if (piece >= pieces) break;
                float f[V];
                S::unpack(u[j], f);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    const Pick here = {f[i], piece * V + i, f[i] != f[i]};
                    if (beats(here, best)) best = here;
                }
            }
        }
        done = pieces * V;
    }
    for (long long c = done + threadIdx.x; c < cols; c += blockDim.x) {
        const float v = S::load(row[c]);
        const Pick here = {v, c, v != v};
        if (beats(here, best)) best = here;
    }
    for (int off = 16; off > 0; off >>= 1) {
        Pick other;
        other.value = __shfl_xor_sync(0xffffffffu, best.value, off);
        other.at = __shfl_xor_sync(0xffffffffu, best.at, off);
        other.nan = __shfl_xor_sync(0xffffffffu, (int)best.nan, off);
        if (beats(other, best)) best = other;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) picks[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        Pick top = picks[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
            if (beats(picks[w], top)) top = picks[w];
        out[blockIdx.x] = top.at < 0 ? 0 : top.at;  // an empty row: 0, as np.argmax has no answer for it
    }
}
