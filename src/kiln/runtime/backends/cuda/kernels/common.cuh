// What every kernel source of kiln's cuda backend shares; nvrtc.py puts it in front of each .cu file before
// compiling (so CuPy's kernel cache, keyed by the source, sees a change here too).
//
// Kernels are templates over their storage type S (F32, F16, BF16 below); nvrtc.py instantiates each
// `template <class S> __global__` kernel for the three. No CUDA headers are included (NVRTC finds none by
// default): half and bfloat16 are 16-bit patterns converted here. Values are read into float32, the math runs in
// float32, and each output is rounded once.

#define KILN_INF __int_as_float(0x7f800000)

struct F32 {
    typedef float T;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};

struct BF16 {
    typedef unsigned short T;

    static __device__ __forceinline__ float load(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }
    static __device__ __forceinline__ unsigned short store(float v) {  // round to nearest even, NaN kept quiet
        unsigned int u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (unsigned short)(u >> 16);
    }
};

struct F16 {
    typedef unsigned short T;

    static __device__ __forceinline__ float load(unsigned short v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ unsigned short store(float v) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
};

// Sum and maximum of v over the warp, returned to every lane (kernels that give each warp a row of its own).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// v reduced over the block by a warp reducer (blockDim.x a multiple of 32, at most 1024), returned to every
// thread; `identity` fills the slots of warps the block does not have.
template <float (*WarpReduce)(float)>
__device__ float block_reduce(float v, float identity) {
    __shared__ float partial[32];
    v = WarpReduce(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = WarpReduce(lane < (int)(blockDim.x >> 5) ? partial[lane] : identity);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    const float total = partial[0];
    __syncthreads();  // partial is reused by the next call
    return total;
}

__device__ float block_sum(float v) { return block_reduce<warp_sum>(v, 0.0f); }
__device__ float block_max(float v) { return block_reduce<warp_max>(v, -KILN_INF); }

__device__ __forceinline__ float sigmoid(float v) {  // without overflow for either sign
    const float e = expf(-fabsf(v));
    return v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}
