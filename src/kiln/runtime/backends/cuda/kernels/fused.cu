// Fused CUDA kernels for kiln's cuda backend, compiled at run time by NVRTC (kiln.runtime.backends.cuda.nvrtc).
// Each replaces a chain of CuPy calls (one launch and one pass over memory instead of five or six); the
// semantics are the op set's, as the CPU kernels compute them. float32, contiguous rows.

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    const float total = partial[0];
    __syncthreads();  // partial is reused by the next call
    return total;
}

// rms_norm over the last dim: y = x / sqrt(mean(x^2) + eps) * w (w read only when has_w). One block per row.
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const float* __restrict__ w,
                                        float* __restrict__ y, int d, float eps, int has_w) {
    const long long row = blockIdx.x;
    const float* xr = x + row * d;
    float* yr = y + row * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    const float inv = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = has_w ? xr[i] * inv * w[i] : xr[i] * inv;
}

// gated_activation with silu: y = silu(g) * u elementwise, silu(g) = g * sigmoid(g) computed without overflow.
extern "C" __global__ void silu_mul_f32(const float* __restrict__ g, const float* __restrict__ u,
                                        float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float v = g[i], e = expf(-fabsf(v));
        const float sig = v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        y[i] = v * sig * u[i];
    }
}
