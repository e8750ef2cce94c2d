// Matrix-vector products for a few input rows (every linear layer of a decode step): out[r, n] = x[r] . W[n] +
// bias[n] for W [N, K] row-major. At batch 1 a linear layer is a stream of its weight, so the kernel is built to
// keep enough bytes in flight: a warp per output feature, every lane issuing GEMV_LOADS 16-byte weight loads before
// it uses the first (GEMV_LOADS * 512 bytes per warp in flight), the weight read past L1 (read once), x read
// through L1 (every warp of the SM reads it). Sums in float32, one rounding at the end.
// Needs K a multiple of PER16 and x, W 16-byte aligned (linalg.py checks).

#define GEMV_WARPS 8     // warps per block: linalg.py's GEMV_WARPS
#define GEMV_ROWS 4      // input rows at most: linalg.py's GEMV_ROWS
#define GEMV_LOADS 4     // 16-byte weight loads per lane in flight (4, 8 and 16 measured: 4 was best or tied)

template <class S>
__global__ void __launch_bounds__(GEMV_WARPS * 32) gemv(const typename S::T* __restrict__ x, long long x_row,
                                                        const typename S::T* __restrict__ w,
                                                        const typename S::T* __restrict__ bias,
                                                        typename S::T* __restrict__ out, int rows, int n, int k,
                                                        int has_bias) {
    constexpr int V = S::PER16;
    const int lane = threadIdx.x & 31;
    const long long o = (long long)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (o >= n) return;  // (whole warps: the shuffles below see every lane)
    const int pieces = k / V;
    const typename S::T* wr = w + o * k;
    float acc[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) acc[r] = 0.0f;
    for (int p0 = 0; p0 < pieces; p0 += 32 * GEMV_LOADS) {  // (a warp-wide bound)
        U4 wv[GEMV_LOADS];
#pragma unroll
        for (int u = 0; u < GEMV_LOADS; ++u) {
            const int p = p0 + u * 32 + lane;
            wv[u] = p < pieces ? load_stream(wr + p * V) : U4{0u, 0u, 0u, 0u};
        }
#pragma unroll
        for (int u = 0; u < GEMV_LOADS; ++u) {
            const int p = p0 + u * 32 + lane;
            if (p >= pieces) break;
            float wf[V];
            S::unpack(wv[u], wf);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r) {
                if (r >= rows) break;
                float xf[V];
                S::unpack(*reinterpret_cast<const U4*>(x + r * x_row + p * V), xf);
                float a = acc[r];
#pragma unroll
                for (int i = 0; i < V; ++i) a += wf[i] * xf[i];
                acc[r] = a;
            }
        }
    }
    const float b = has_bias ? S::load(bias[o]) : 0.0f;
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; ++r) {
        if (r >= rows) break;
        const float total = warp_sum(acc[r]);
        if (lane == 0) out[(long long)r * n + o] = S::store(total + b);
    }
}
