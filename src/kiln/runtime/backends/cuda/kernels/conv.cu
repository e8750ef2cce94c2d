// Convolution pieces for 2-d, channels-first maps (the op set's conv; PyTorch's NCHW layout): an im2col gather that
// feeds one cuBLAS product, a direct depthwise convolution, and the bias + activation epilogue. Activation codes:
// 0 none, 1 clamp to [lo, hi] (NaN kept, as torch.clamp), 2 hardswish.

__device__ __forceinline__ float activate(float v, int act, float lo, float hi) {
    if (act == 1) {
        if (v < lo) v = lo;
        if (v > hi) v = hi;
    } else if (act == 2) {
        v = v * (fminf(fmaxf(v + 3.0f, 0.0f), 6.0f) / 6.0f);
    }
    return v;
}

// cols[b, ch * kh * kw + ky * kw + kx, oy * ow + ox] = x[b, ch, oy * sh - ph + ky * dh, ox * sw - pw + kx * dw], zero
// outside the input: for each image the [C*K, OH*OW] matrix the weight [O, C*K] multiplies (per group: rows of
// the group's channels). x is contiguous. One thread per element of cols, consecutive threads along ox.
template <class S>
__global__ void im2col2d(const typename S::T* __restrict__ x, typename S::T* __restrict__ cols, int c, int h, int w,
                         int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw, int oh, int ow,
                         long long total) {
    grid_dependency_sync();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int ox = (int)(i % ow);
        long long r = i / ow;
        const int oy = (int)(r % oh);
        r /= oh;
        const int kx = (int)(r % kw);
        r /= kw;
        const int ky = (int)(r % kh);
        r /= kh;  // r = b * c + ch
        const int iy = oy * sh - ph + ky * dh, ix = ox * sw - pw + kx * dw;
        const bool inside = iy >= 0 && iy < h && ix >= 0 && ix < w;
        cols[i] = inside ? x[(r * h + iy) * w + ix] : S::store(0.0f);
    }
}

// Depthwise (groups == channels == out channels): y[b, ch, oy, ox] = act(sum over taps x * w[ch, ky, kx] + bias[ch]).
// One thread per output element; the taps of neighbouring threads overlap, so the reads mostly hit the cache.
template <class S>
__global__ void depthwise2d(const typename S::T* __restrict__ x, const typename S::T* __restrict__ wt,
                            const typename S::T* __restrict__ bias, typename S::T* __restrict__ y, int c, int h, int w,
                            int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw, int oh, int ow,
                            long long total, int has_bias, int act, float lo, float hi) {
    grid_dependency_sync();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int ox = (int)(i % ow);
        long long r = i / ow;
        const int oy = (int)(r % oh);
        r /= oh;  // r = b * c + ch
        const int ch = (int)(r % c);
        const typename S::T* xc = x + r * h * w;
        const typename S::T* wc = wt + (long long)ch * kh * kw;
        float s = 0.0f;
        for (int ky = 0; ky < kh; ky++) {
            const int iy = oy * sh - ph + ky * dh;
            if (iy < 0 || iy >= h) continue;
            for (int kx = 0; kx < kw; kx++) {
                const int ix = ox * sw - pw + kx * dw;
                if (ix >= 0 && ix < w) s += S::load(xc[iy * w + ix]) * S::load(wc[ky * kw + kx]);
            }
        }
        if (has_bias) s += S::load(bias[ch]);
        y[i] = S::store(activate(s, act, lo, hi));
    }
}

// y[b, ch, :] = act(y[b, ch, :] + bias[ch]) in place over a contiguous [n, c, size] output.
template <class S>
__global__ void bias_activate(typename S::T* __restrict__ y, const typename S::T* __restrict__ bias, int c,
                              long long size, long long total, int has_bias, int act, float lo, float hi) {
    grid_dependency_sync();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float v = S::load(y[i]);
        if (has_bias) v += S::load(bias[(int)((i / size) % c)]);
        y[i] = S::store(activate(v, act, lo, hi));
    }
}
