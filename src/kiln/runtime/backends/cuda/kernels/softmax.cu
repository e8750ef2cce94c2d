// softmax of one row of d elements, read and written in the storage type (the math in float32, each output
// rounded once), by the threads first, first + step, ... with Max and Sum reducing over them.
template <class S, float (*Max)(float), float (*Sum)(float)>
__device__ void softmax_row(const typename S::T* __restrict__ xr, typename S::T* __restrict__ yr, int d, int first,
                            int step) {
    float top = -KILN_INF;
    for (int j = first; j < d; j += step) top = fmaxf(top, S::load(xr[j]));
    top = Max(top);
    float sum = 0.0f;
    for (int j = first; j < d; j += step) sum += expf(S::load(xr[j]) - top);
    const float inv = 1.0f / Sum(sum);
    for (int j = first; j < d; j += step) yr[j] = S::store(expf(S::load(xr[j]) - top) * inv);
}

// softmax with a block per row (rows longer than ROW_WARP_MAX, registry.py).
template <class S>
__global__ void softmax_rows(const typename S::T* __restrict__ x, typename S::T* __restrict__ y, int d) {
    grid_dependency_sync();
    const long long row = blockIdx.x;
    softmax_row<S, block_max, block_sum>(x + row * d, y + row * d, d, threadIdx.x, blockDim.x);
}

// softmax with a warp per row (blockDim.x / 32 rows per block).
template <class S>
__global__ void softmax_warp(const typename S::T* __restrict__ x, typename S::T* __restrict__ y, long long rows,
                             int d) {
    grid_dependency_sync();
    const long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // (whole warps: the shuffles see every lane)
    softmax_row<S, warp_max, warp_sum>(x + row * d, y + row * d, d, threadIdx.x & 31, 32);
}

// The softmax between attention's two products: one block per score row, the scale, the causal limit and the
// mask (bool or float, any broadcast, read through strides) applied as the row is read, probabilities written in
// the storage type the second product reads. Rows are grouped as the GQA products lay them out: row r is query
// i = r % queries of q head (r / queries) % groups within kv head ((r / queries) / groups) % kv_heads of batch b.

__device__ __forceinline__ float masked_score(const float* row, const void* mask, int mask_kind, long long mrow,
                                              long long m_j, int j, int limit, float scale) {
    if (j >= limit) return -KILN_INF;
    float v = row[j] * scale;
    if (mask_kind == MASK_BOOL) {
        if (!static_cast<const unsigned char*>(mask)[mrow + j * m_j]) v = -KILN_INF;
    } else if (mask_kind == MASK_FLOAT) {
        v += static_cast<const float*>(mask)[mrow + j * m_j];
    }
    return v;
}

template <class S>
__global__ void masked_softmax(const float* __restrict__ scores, typename S::T* __restrict__ out,
                               const void* __restrict__ mask, int mask_kind, long long m_b, long long m_h,
                               long long m_i, long long m_j, int kv_heads, int groups, int queries, int keys,
                               float scale, int causal) {
    grid_dependency_sync();
    const long long r = blockIdx.x;
    const int i = (int)(r % queries);
    const long long head_row = r / queries;
    const int g = (int)(head_row % groups);
    const long long kv_row = head_row / groups;
    const long long h = (kv_row % kv_heads) * groups + g, b = kv_row / kv_heads;
    const long long mrow = b * m_b + h * m_h + i * m_i;
    const float* row = scores + r * keys;
    const int limit = causal ? min(keys, i + 1) : keys;  // PyTorch's is_causal: key j <= query i
    float top = -KILN_INF;
    for (int j = threadIdx.x; j < keys; j += blockDim.x)
        top = fmaxf(top, masked_score(row, mask, mask_kind, mrow, m_j, j, limit, scale));
    top = block_max(top);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < keys; j += blockDim.x)
        sum += expf(masked_score(row, mask, mask_kind, mrow, m_j, j, limit, scale) - top);
    const float inv = 1.0f / block_sum(sum);
    typename S::T* dst = out + r * keys;
    for (int j = threadIdx.x; j < keys; j += blockDim.x)
        dst[j] = S::store(expf(masked_score(row, mask, mask_kind, mrow, m_j, j, limit, scale) - top) * inv);
}
