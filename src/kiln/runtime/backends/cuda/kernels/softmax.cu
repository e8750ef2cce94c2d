// softmax over contiguous rows of d elements, read and written in the storage type (the math in float32, each
// output rounded once). One block per row.
template <class S>
__global__ void softmax_rows(const typename S::T* __restrict__ x, typename S::T* __restrict__ y, int d) {
    const typename S::T* xr = x + (long long)blockIdx.x * d;
    typename S::T* yr = y + (long long)blockIdx.x * d;
    float top = -KILN_INF;
    for (int j = threadIdx.x; j < d; j += blockDim.x) top = fmaxf(top, S::load(xr[j]));
    top = block_max(top);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) sum += expf(S::load(xr[j]) - top);
    const float inv = 1.0f / block_sum(sum);
    for (int j = threadIdx.x; j < d; j += blockDim.x) yr[j] = S::store(expf(S::load(xr[j]) - top) * inv);
}

// softmax_rows for rows of at most ROW_WARP_MAX (registry.py) elements: a warp per row, reductions in shuffles.
template <class S>
__global__ void softmax_warp(const typename S::T* __restrict__ x, typename S::T* __restrict__ y, long long rows,
                             int d) {
    const long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31;
    const typename S::T* xr = x + row * d;
    typename S::T* yr = y + row * d;
    float top = -KILN_INF;
    for (int j = lane; j < d; j += 32) top = fmaxf(top, S::load(xr[j]));
    top = warp_max(top);
    float sum = 0.0f;
    for (int j = lane; j < d; j += 32) sum += expf(S::load(xr[j]) - top);
    const float inv = 1.0f / warp_sum(sum);
    for (int j = lane; j < d; j += 32) yr[j] = S::store(expf(S::load(xr[j]) - top) * inv);
}

// The softmax between attention's two products: one block per score row, the scale, the causal limit and the
// mask (bool or float, any broadcast, read through strides) applied as the row is read, probabilities written in
// the storage type the second product reads. Rows are grouped as the GQA products lay them out: row r is query
// i = r % queries of q head (r / queries) % groups within kv head ((r / queries) / groups) % kv_heads of batch b.

#define MASK_NONE 0
#define MASK_BOOL 1
#define MASK_FLOAT 2

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
