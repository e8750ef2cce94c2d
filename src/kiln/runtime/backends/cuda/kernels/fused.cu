// Fused CUDA kernels for kiln's cuda backend, compiled at run time by NVRTC (kiln.runtime.backends.cuda.nvrtc).
// Each replaces a chain of CuPy calls (one launch and one pass over memory instead of five to fifteen); the
// semantics are the op set's, as the CPU kernels compute them: float16/bfloat16 values are read into float32, the
// math runs in float32, and each output is rounded once.
// (The storage types, block_sum and sigmoid are in common.cuh.)

// rms_norm over the last dim: y = x / sqrt(mean(x^2) + eps) * w (w read only when has_w). One block per row.
template <class S>
__global__ void rms_norm(const typename S::T* __restrict__ x, const typename S::T* __restrict__ w,
                         typename S::T* __restrict__ y, int d, float eps, int has_w) {
    const long long row = blockIdx.x;
    const typename S::T* xr = x + row * d;
    typename S::T* yr = y + row * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = S::load(xr[i]);
        s += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = S::load(xr[i]) * inv;
        yr[i] = S::store(has_w ? v * S::load(w[i]) : v);
    }
}

// layer_norm of one row of d elements: y = (x - mean) / sqrt(var + eps) * w + b (w, b read only when given), by
// the threads first, first + step, ... with Sum reducing over them (a warp's or the block's). The variance is the
// mean of the centered squares (a second pass over the row, from cache), as the CPU kernel computes it.
template <class S, float (*Sum)(float)>
__device__ void layer_norm_row(const typename S::T* __restrict__ xr, const typename S::T* __restrict__ w,
                               const typename S::T* __restrict__ b, typename S::T* __restrict__ yr, int d,
                               float eps, int has_w, int has_b, int first, int step) {
    float s = 0.0f;
    for (int i = first; i < d; i += step) s += S::load(xr[i]);
    const float mean = Sum(s) / (float)d;
    float q = 0.0f;
    for (int i = first; i < d; i += step) {
        const float c = S::load(xr[i]) - mean;
        q += c * c;
    }
    const float inv = 1.0f / sqrtf(Sum(q) / (float)d + eps);
    for (int i = first; i < d; i += step) {
        float v = (S::load(xr[i]) - mean) * inv;
        if (has_w) v *= S::load(w[i]);
        if (has_b) v += S::load(b[i]);
        yr[i] = S::store(v);
    }
}

// layer_norm with a block per row (rows longer than ROW_WARP_MAX, registry.py).
template <class S>
__global__ void layer_norm(const typename S::T* __restrict__ x, const typename S::T* __restrict__ w,
                           const typename S::T* __restrict__ b, typename S::T* __restrict__ y, int d, float eps,
                           int has_w, int has_b) {
    const long long row = blockIdx.x;
    layer_norm_row<S, block_sum>(x + row * d, w, b, y + row * d, d, eps, has_w, has_b, threadIdx.x, blockDim.x);
}

// layer_norm with a warp per row (blockDim.x / 32 rows per block): short rows pay no block-wide barriers.
template <class S>
__global__ void layer_norm_warp(const typename S::T* __restrict__ x, const typename S::T* __restrict__ w,
                                const typename S::T* __restrict__ b, typename S::T* __restrict__ y, long long rows,
                                int d, float eps, int has_w, int has_b) {
    const long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // (whole warps: the shuffles see every lane)
    layer_norm_row<S, warp_sum>(x + row * d, w, b, y + row * d, d, eps, has_w, has_b, threadIdx.x & 31, 32);
}

// gated_activation: y = act(g) * u elementwise over [rows, d] (g and u rows at strides gs, us: the two halves of one
// fused projection are views); act 0 silu, 1 gelu (erf form), 2 gelu (tanh form). y is contiguous.
template <class S>
__global__ void gated(const typename S::T* __restrict__ g, const typename S::T* __restrict__ u,
                      typename S::T* __restrict__ y, long long rows, int d, long long gs, long long us, int act) {
    const long long n = rows * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / d;
        const int c = (int)(i - r * d);
        const float v = S::load(g[r * gs + c]);
        float a;
        if (act == 0) {
            a = v * sigmoid(v);
        } else if (act == 1) {
            a = 0.5f * v * erfcf(-v * 0.70710678118654752f);
        } else {
            a = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
        }
        y[i] = S::store(a * S::load(u[r * us + c]));
    }
}

// rope on x viewed as [n0, n1, n2, D] with element strides xs (any layout), cos/sin [.., D] broadcast to it through
// strides cs (0 on broadcast dims; cos and sin share their layout); y is contiguous. One thread per output element.
template <class S>
__global__ void rope(const typename S::T* __restrict__ x, const typename S::T* __restrict__ cos_,
                     const typename S::T* __restrict__ sin_, typename S::T* __restrict__ y,
                     int n1, int n2, int d, long long xs0, long long xs1, long long xs2, long long xs3,
                     long long cs0, long long cs1, long long cs2, long long cs3, long long total, int interleaved) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i % d);
        long long r = i / d;
        const int i2 = (int)(r % n2);
        r /= n2;
        const int i1 = (int)(r % n1);
        const long long i0 = r / n1;
        const long long xb = i0 * xs0 + i1 * xs1 + i2 * xs2, cb = i0 * cs0 + i1 * cs1 + i2 * cs2;
        int partner;
        float sign;
        if (interleaved) {
            partner = j ^ 1;
            sign = (j & 1) ? 1.0f : -1.0f;
        } else {
            const int half = d / 2;
            partner = j < half ? j + half : j - half;
            sign = j < half ? -1.0f : 1.0f;
        }
        const float v = S::load(x[xb + j * xs3]), p = S::load(x[xb + partner * xs3]);
        y[i] = S::store(v * S::load(cos_[cb + j * cs3]) + sign * p * S::load(sin_[cb + j * cs3]));
    }
}

// One-query attention (a decode step), split over the keys. Grid (splits, kv heads, batch), ATTN_THREADS threads.
// q [B, Hkv * G, 1, E] contiguous; k, v [B, Hkv, S, E] with unit stride on E (strides kb, kh, ks, in elements);
// mask (mask_kind 0 none, 1 bool keep, 2 additive float of S) broadcast through strides mb, mh, ms (per q head).
// Each block takes ATTN_CHUNK keys for the G q heads of its kv head (k and v read once for the group), a warp per
// key; a key that a bool mask hides from every head is not read, and a chunk hidden from all of them (a static
// cache's unwritten slots) reads no v at all. Per head it writes its max score, exp-sum and unnormalized output
// to part [B, Hq, splits, E + 2].
#define ATTN_THREADS 256
#define ATTN_WARPS (ATTN_THREADS / 32)
#define ATTN_MAX_E 256
#define ATTN_MAX_G 16
#define ATTN_CHUNK 32
template <class S>
__global__ void attend_split(const typename S::T* __restrict__ q, const typename S::T* __restrict__ k,
                             const typename S::T* __restrict__ v, const void* __restrict__ mask,
                             float* __restrict__ part, int groups, int seq, int e, float scale,
                             long long kb, long long kh, long long ks, long long vb, long long vh, long long vs,
                             int mask_kind, long long mb, long long mh, long long ms, int splits) {
    __shared__ float qs[ATTN_MAX_G * ATTN_MAX_E];
    __shared__ float acc_s[ATTN_MAX_G * ATTN_MAX_E];
    __shared__ float partial[ATTN_WARPS][ATTN_MAX_E];
    __shared__ float scores[ATTN_MAX_G][ATTN_CHUNK];
    __shared__ float head_max[ATTN_MAX_G], head_sum[ATTN_MAX_G];
    __shared__ int any_visible;
    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const int heads = gridDim.y * groups;
    const int s0 = split * ATTN_CHUNK, n = min(ATTN_CHUNK, seq - s0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const typename S::T* qg = q + ((long long)b * heads + (long long)hk * groups) * e;
    for (int i = threadIdx.x; i < groups * e; i += ATTN_THREADS) {
        qs[i] = S::load(qg[i]) * scale;
        acc_s[i] = 0.0f;
    }
    if (threadIdx.x == 0) any_visible = 0;
    __syncthreads();
    const typename S::T* kp = k + b * kb + hk * kh;
    const typename S::T* vp = v + b * vb + hk * vh;
    // scores: a warp per key, lanes over E
    for (int t = warp; t < n; t += ATTN_WARPS) {
        const int s = s0 + t;
        bool hidden = false;
        if (mask_kind == 1) {  // lane g looks at head g's mask bit; the key is read if any head sees it
            bool keep = false;
            if (lane < groups) keep = ((const bool*)mask)[b * mb + (long long)(hk * groups + lane) * mh + s * ms];
            hidden = __ballot_sync(0xffffffffu, keep) == 0u;
        }
        float acc[ATTN_MAX_G];  // constant indices only (the loops unroll), so it stays in registers
#pragma unroll
        for (int g = 0; g < ATTN_MAX_G; ++g) acc[g] = 0.0f;
        if (!hidden) {
            for (int i = lane; i < e; i += 32) {
                const float kv = S::load(kp[s * ks + i]);
#pragma unroll
                for (int g = 0; g < ATTN_MAX_G; ++g)
                    if (g < groups) acc[g] += qs[g * e + i] * kv;
            }
        }
#pragma unroll
        for (int g = 0; g < ATTN_MAX_G; ++g) {
            if (g >= groups) break;
            float a = acc[g];
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (lane == 0) {
                const long long mo = b * mb + (long long)(hk * groups + g) * mh + s * ms;
                if (mask_kind == 1 && !((const bool*)mask)[mo]) a = -KILN_INF;
                else if (mask_kind == 2) a += ((const float*)mask)[mo];
                scores[g][t] = a;
            }
        }
    }
    __syncthreads();
    // per head: max and exp-sum over the chunk (a warp per head)
    for (int g = warp; g < groups; g += ATTN_WARPS) {
        float m = -KILN_INF;
        for (int t = lane; t < n; t += 32) m = fmaxf(m, scores[g][t]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.0f;
        for (int t = lane; t < n; t += 32) {
            const float p = m == -KILN_INF ? 0.0f : expf(scores[g][t] - m);
            scores[g][t] = p;
            l += p;
        }
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            head_max[g] = m;
            head_sum[g] = l;
            if (m != -KILN_INF) any_visible = 1;
        }
    }
    __syncthreads();
    // unnormalized outputs: a warp per key again, lanes over E; the warps' partial sums added in a fixed order
    // (no atomics), so a step's result does not depend on scheduling
    for (int g = 0; g < groups && any_visible; ++g) {
        float o[ATTN_MAX_E / 32];
#pragma unroll
        for (int j = 0; j < ATTN_MAX_E / 32; ++j) o[j] = 0.0f;
        for (int t = warp; t < n; t += ATTN_WARPS) {
            const float p = scores[g][t];
            const typename S::T* vr = vp + (s0 + t) * vs;
#pragma unroll
            for (int j = 0; j < ATTN_MAX_E / 32; ++j)
                if (lane + 32 * j < e) o[j] += p * S::load(vr[lane + 32 * j]);
        }
#pragma unroll
        for (int j = 0; j < ATTN_MAX_E / 32; ++j)
            if (lane + 32 * j < e) partial[warp][lane + 32 * j] = o[j];
        __syncthreads();
        for (int c = threadIdx.x; c < e; c += ATTN_THREADS) {
            float sum = 0.0f;
            for (int w = 0; w < ATTN_WARPS; ++w) sum += partial[w][c];
            acc_s[g * e + c] = sum;
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < groups * e; i += ATTN_THREADS) {
        const int g = i / e, c = i % e;
        float* out = part + (((long long)b * heads + hk * groups + g) * splits + split) * (e + 2);
        out[c] = acc_s[i];
        if (c == 0) {
            out[e] = head_max[g];
            out[e + 1] = head_sum[g];
        }
    }
}

// Combines the splits of attend_split: out [B, Hq, 1, E] = sum_i w_i o_i / sum_i w_i l_i with w_i = exp(m_i - M).
// One block per (batch, q head): the weights are computed once into shared memory, then a thread per output
// element sums over the splits (independent loads, unrolled, so they overlap). A query that sees no key gives
// NaN, as softmax over only -inf does.
#define COMBINE_THREADS 256
#define COMBINE_MAX_SPLITS 2048
template <class S>
__global__ void attend_combine(const float* __restrict__ part, typename S::T* __restrict__ out, int e, int splits) {
    __shared__ float weight[COMBINE_MAX_SPLITS];
    __shared__ float reduce[COMBINE_THREADS / 32];
    const long long row = blockIdx.x;
    const float* p = part + row * splits * (e + 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float m = -KILN_INF;
    for (int i = threadIdx.x; i < splits; i += COMBINE_THREADS) m = fmaxf(m, p[i * (e + 2) + e]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) reduce[warp] = m;
    __syncthreads();
    m = reduce[0];
    for (int w = 1; w < COMBINE_THREADS / 32; ++w) m = fmaxf(m, reduce[w]);
    __syncthreads();
    float den = 0.0f;
    for (int i = threadIdx.x; i < splits; i += COMBINE_THREADS) {
        const float w = expf(p[i * (e + 2) + e] - m);  // m = -inf: exp(nan) = nan, the all-masked answer
        weight[i] = w;
        den += w * p[i * (e + 2) + e + 1];
    }
    den = block_sum(den);  // (its barriers also publish weight[])
    for (int c = threadIdx.x; c < e; c += COMBINE_THREADS) {
        float num = 0.0f;
#pragma unroll 8
        for (int i = 0; i < splits; ++i) num += weight[i] * p[i * (e + 2) + c];
        out[row * e + c] = S::store(num / den);
    }
}
