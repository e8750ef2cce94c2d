// Weight-only quantized linear layers (the op set's quantized_linear): W[n, k] = (q[n, k] - zero[n, g]) * scale[n, g]
// with g = k / group. int8 weights are signed bytes [N, K]; int4 weights are packed two per byte [N, K/2], low
// nibble first, with an implicit zero point of 8 when there is no zero array (int8's is 0). zero_mode says what the
// zero array is: 0 absent, 1 zero points, 2 additive offsets (the op's offset: W = q * scale + zero, GGUF's form;
// absent offsets are mode 3: W = q * scale).

#define ZERO_ABSENT 0
#define ZERO_POINTS 1
#define ZERO_OFFSETS 2
#define ZERO_NO_OFFSETS 3

// W = q * s + b for a group: b from the zero point (-z * s) or the offset
__device__ __forceinline__ float group_term(const float s, const float z, int zero_mode, int bits) {
    if (zero_mode == ZERO_OFFSETS) return z;
    if (zero_mode == ZERO_NO_OFFSETS) return 0.0f;
    return -s * (zero_mode == ZERO_POINTS ? z : (bits == 4 ? 8.0f : 0.0f));
}

#define MAX_ROWS 8   // input rows qlinear_rows takes (linalg.py's QUANT_ROWS)
#define WARPS 8      // warps per block of qlinear_rows (linalg.py's QUANT_WARPS)

__device__ __forceinline__ float weight_at(const unsigned char* __restrict__ qrow, int j, int bits) {
    if (bits == 8) return (float)(signed char)qrow[j];
    const unsigned char b = qrow[j >> 1];
    return (float)((j & 1) ? (b >> 4) : (b & 15));
}

// out[r, n] = sum_j x[r, j] * W[n, j] + bias[n] for r < rows <= MAX_ROWS: one warp per output feature n streams
// its weight row once (4 bytes per lane and step: 4 int8 or 8 int4 weights) and serves every input row with it.
// x is small and read by every warp, so it stays in the L1/L2 caches. Sums in float32, one rounding at the end.
template <class S>
__global__ void qlinear_rows(const typename S::T* __restrict__ x, const unsigned char* __restrict__ q,
                             const typename S::T* __restrict__ scale, const typename S::T* __restrict__ zero,
                             const typename S::T* __restrict__ bias, typename S::T* __restrict__ out, int rows,
                             int n, int k, int bits, int group, int zero_mode, int has_bias) {
    grid_dependency_sync();
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (o >= n) return;
    const int ngroups = k / group;
    const int row_bytes = bits == 8 ? k : k / 2;
    const unsigned char* qrow = q + (long long)o * row_bytes;
    const bool has_zero = zero_mode == ZERO_POINTS || zero_mode == ZERO_OFFSETS;
    float acc[MAX_ROWS];
#pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) acc[r] = 0.0f;
    const int per_word = bits == 8 ? 4 : 8;  // weights in 4 bytes
    const bool vector = (row_bytes % 4 == 0) && (group % per_word == 0) && ((((unsigned long long)q) & 3) == 0);
    if (vector) {
        for (int w = lane; w < row_bytes / 4; w += 32) {
            const unsigned int word = ((const unsigned int*)qrow)[w];
            const int j0 = w * per_word;
            const int g = j0 / group;
            const float s = S::load(scale[(long long)o * ngroups + g]);
            const float b = group_term(s, has_zero ? S::load(zero[(long long)o * ngroups + g]) : 0.0f, zero_mode, bits);
            float wv[8];
            if (bits == 8) {
#pragma unroll
                for (int i = 0; i < 4; i++) wv[i] = (float)(signed char)((word >> (8 * i)) & 255u) * s + b;
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) wv[i] = (float)((word >> (4 * i)) & 15u) * s + b;
            }
#pragma unroll
            for (int r = 0; r < MAX_ROWS; r++) {
                if (r < rows) {
                    const typename S::T* xr = x + (long long)r * k + j0;
                    float a = acc[r];
                    for (int i = 0; i < per_word; i++) a += S::load(xr[i]) * wv[i];
                    acc[r] = a;
                }
            }
        }
    } else {
        for (int j = lane; j < k; j += 32) {
            const int g = j / group;
            const float s = S::load(scale[(long long)o * ngroups + g]);
            const float b = group_term(s, has_zero ? S::load(zero[(long long)o * ngroups + g]) : 0.0f, zero_mode, bits);
            const float wv = weight_at(qrow, j, bits) * s + b;
#pragma unroll
            for (int r = 0; r < MAX_ROWS; r++)
                if (r < rows) acc[r] += S::load(x[(long long)r * k + j]) * wv;
        }
    }
#pragma unroll
    for (int r = 0; r < MAX_ROWS; r++) {
        float v = acc[r];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0 && r < rows) out[(long long)r * n + o] = S::store(v + (has_bias ? S::load(bias[o]) : 0.0f));
    }
}

// W as S ([N, K], row-major), for products with many input rows (cuBLAS then multiplies).
template <class S>
__global__ void dequantize(const unsigned char* __restrict__ q, const typename S::T* __restrict__ scale,
                           const typename S::T* __restrict__ zero, typename S::T* __restrict__ w, long long n, int k,
                           int bits, int group, int zero_mode) {
    grid_dependency_sync();
    const long long total = n * k;
    const int ngroups = k / group;
    const int row_bytes = bits == 8 ? k : k / 2;
    const float zdefault = bits == 4 ? 8.0f : 0.0f;
    const bool has_zero = zero_mode == ZERO_POINTS || zero_mode == ZERO_OFFSETS;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long o = i / k;
        const int j = (int)(i - o * k);
        const long long sg = o * ngroups + j / group;
        const float z = has_zero ? S::load(zero[sg]) : zdefault, v = weight_at(q + o * row_bytes, j, bits);
        // each form rounded as defined: (q - z) * s, or q * s + o (GGUF's own rounding)
        w[i] = S::store(zero_mode >= ZERO_OFFSETS ? v * S::load(scale[sg]) + (has_zero ? z : 0.0f)
                                                  : (v - z) * S::load(scale[sg]));
    }
}
