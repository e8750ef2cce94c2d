// KV-cache writes: out[o, index[j], t] = src[o, j, t] for out viewed as [outer, size, inner] (contiguous) and a
// 1-d index of n slots. A GPU scatter with repeated slots lets any writer win while PyTorch keeps the last, so the
// first kernel records each slot's last writer (an atomic max of the positions) and the second writes only those
// (all of them where winner is null: one position, no repeats).

template <class S>
__global__ void last_writer(const long long* __restrict__ index, int* __restrict__ winner, int n, int size) {
    grid_dependency_sync();
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += gridDim.x * blockDim.x) {
        const long long slot = index[j] < 0 ? index[j] + size : index[j];
        atomicMax(winner + slot, j);
    }
}

template <class S>
__global__ void write_slots(typename S::T* __restrict__ out, const typename S::T* __restrict__ src,
                            const long long* __restrict__ index, const int* __restrict__ winner, int n, int size,
                            long long inner, long long s_o, long long s_n, long long s_i, long long total) {
    grid_dependency_sync();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i % inner, r = i / inner;
        const int j = (int)(r % n);
        const long long o = r / n;
        const long long slot = index[j] < 0 ? index[j] + size : index[j];
        if (winner == nullptr || winner[slot] == j) out[(o * size + slot) * inner + t] = src[o * s_o + j * s_n + t * s_i];
    }
}
