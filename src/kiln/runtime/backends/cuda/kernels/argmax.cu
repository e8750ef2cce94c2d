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

// The block's best of its threads' picks (warp shuffles, then the warps' bests in shared memory), for thread 0.
__device__ __forceinline__ Pick block_pick(Pick best, Pick* picks) {
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
    Pick top = picks[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
        if (beats(picks[w], top)) top = picks[w];
    return top;
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
    const Pick top = block_pick(best, picks);
    if (threadIdx.x == 0) out[blockIdx.x] = top.at < 0 ? 0 : top.at;  // an empty row: 0, as np.argmax has none
}

// A serving engine's sampled pick without the logits leaving the GPU: row r's index of the largest
// x * inv_temperature[r] + g, g a standard Gumbel variable drawn for (seeds[r], counters[r], index) by a counter
// hash (splitmix64's mixer), so that the pick is a sample of softmax(x / temperature) (the Gumbel-max trick) and the
// same seed and counter give the same pick. inv_temperature[r] == 0: no noise, the greedy pick (argmax_rows). A
// row with a NaN gets -1 (the host sampler refuses NaN logits). Sampling.py's device_noise computes the same noise
// in NumPy (the tests' reference).
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ float gumbel(unsigned long long key, long long index) {
    const unsigned long long h = mix64(key ^ mix64((unsigned long long)index));
    const float u = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1): 24 bits, never 0 or 1
    return -logf(-logf(u));
}

template <class S>
__global__ void __launch_bounds__(ARGMAX_THREADS) sample_rows(const typename S::T* __restrict__ x,
                                                              long long* __restrict__ out, long long cols,
                                                              const float* __restrict__ inv_temperature,
                                                              const unsigned long long* __restrict__ seeds,
                                                              const long long* __restrict__ counters) {
    grid_dependency_sync();
    __shared__ Pick picks[ARGMAX_THREADS / 32];
    const typename S::T* row = x + blockIdx.x * cols;
    const float scale = inv_temperature[blockIdx.x];
    const unsigned long long key = mix64(seeds[blockIdx.x] ^ mix64((unsigned long long)counters[blockIdx.x]));
    Pick best = {-KILN_INF, -1, false};
    for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
        const float f = S::load(row[c]);
        const float v = scale == 0.0f ? f : f * scale + gumbel(key, c);
        const Pick here = {v, c, f != f};
        if (beats(here, best)) best = here;
    }
    const Pick top = block_pick(best, picks);
    if (threadIdx.x == 0) out[blockIdx.x] = top.nan ? -1 : (top.at < 0 ? 0 : top.at);
}
