// Fused CUDA kernels for kiln's cuda backend, compiled at run time by NVRTC (kiln.runtime.backends.cuda.nvrtc).
// Each replaces a chain of CuPy calls (one launch and one pass over memory instead of five to fifteen); the
// semantics are the op set's, as the CPU kernels compute them: float16/bfloat16 values are read into float32, the
// math runs in float32, and each output is rounded once.
// (The storage types, block_sum and sigmoid are in common.cuh.)

// rms_norm over the last dim: y = x / sqrt(mean(x^2) + eps) * w (w read only when has_w). One block per row.
// With a residual r (add_rms_norm), x + r is first rounded to the storage type and written to sum, as the add
// would write it, and normalized from there.
template <class S>
__global__ void rms_norm(const typename S::T* __restrict__ x, const typename S::T* __restrict__ r,
                         const typename S::T* __restrict__ w, typename S::T* __restrict__ sum,
                         typename S::T* __restrict__ y, int d, float eps, int has_w, int has_r) {
    grid_dependency_sync();
    const long long row = blockIdx.x;
    const typename S::T* xr = x + row * d;
    typename S::T* yr = y + row * d;
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = S::load(xr[i]);
        if (has_r) {
            const typename S::T t = S::store(v + S::load(r[row * d + i]));
            sum[row * d + i] = t;
            v = S::load(t);
        }
        s += v * v;
    }
    const float inv = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
    const typename S::T* src = has_r ? sum + row * d : xr;  // (each thread reads back only what it wrote)
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = S::load(src[i]) * inv;
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
    grid_dependency_sync();
    const long long row = blockIdx.x;
    layer_norm_row<S, block_sum>(x + row * d, w, b, y + row * d, d, eps, has_w, has_b, threadIdx.x, blockDim.x);
}

// layer_norm with a warp per row (blockDim.x / 32 rows per block): short rows pay no block-wide barriers.
template <class S>
__global__ void layer_norm_warp(const typename S::T* __restrict__ x, const typename S::T* __restrict__ w,
                                const typename S::T* __restrict__ b, typename S::T* __restrict__ y, long long rows,
                                int d, float eps, int has_w, int has_b) {
    grid_dependency_sync();
    const long long row = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // (whole warps: the shuffles see every lane)
    layer_norm_row<S, warp_sum>(x + row * d, w, b, y + row * d, d, eps, has_w, has_b, threadIdx.x & 31, 32);
}

// gated_activation: y = act(g) * u elementwise over [rows, d] (g and u rows at strides gs, us: the two halves of one
// fused projection are views); act as gate_activation's (common.cuh). y is contiguous.
template <class S>
__global__ void gated(const typename S::T* __restrict__ g, const typename S::T* __restrict__ u,
                      typename S::T* __restrict__ y, long long rows, int d, long long gs, long long us, int act) {
    grid_dependency_sync();
    const long long n = rows * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / d;
        const int c = (int)(i - r * d);
        y[i] = S::store(gate_activation(S::load(g[r * gs + c]), act) * S::load(u[r * us + c]));
    }
}

// x[j] of a row of d values (stride xs) rotated with its partner and scaled by cos/sin at j (stride cs): the rope
// op's formula in float32, rotate-half or interleaved.
template <class S>
__device__ __forceinline__ typename S::T rotated(const typename S::T* __restrict__ x, long long xs,
                                                 const typename S::T* __restrict__ cos_,
                                                 const typename S::T* __restrict__ sin_, long long cs, int j, int d,
                                                 int interleaved) {
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
    const float v = S::load(x[j * xs]), p = S::load(x[partner * xs]);
    return S::store(v * S::load(cos_[j * cs]) + sign * p * S::load(sin_[j * cs]));
}

// rope on x viewed as [n0, n1, n2, D] with element strides xs (any layout), cos/sin [.., D] broadcast to it through
// strides cs (0 on broadcast dims; cos and sin share their layout); y is contiguous. One thread per output element.
template <class S>
__global__ void rope(const typename S::T* __restrict__ x, const typename S::T* __restrict__ cos_,
                     const typename S::T* __restrict__ sin_, typename S::T* __restrict__ y,
                     int n1, int n2, int d, long long xs0, long long xs1, long long xs2, long long xs3,
                     long long cs0, long long cs1, long long cs2, long long cs3, long long total, int interleaved) {
    grid_dependency_sync();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i % d);
        long long r = i / d;
        const int i2 = (int)(r % n2);
        r /= n2;
        const int i1 = (int)(r % n1);
        const long long i0 = r / n1;
        const long long cb = i0 * cs0 + i1 * cs1 + i2 * cs2;
        y[i] = rotated<S>(x + i0 * xs0 + i1 * xs1 + i2 * xs2, xs3, cos_ + cb, sin_ + cb, cs3, j, d, interleaved);
    }
}

// rope_cache_update for one new position (a decode step) in one launch instead of four: q [B, hq, 1, D] rotated
// into q_out (contiguous); k [B, hkv, 1, D] rotated and v copied into the caches [B, hkv, size, D] (contiguous) at
// slot index[0]. q, k and v in any layout (element strides over batch, head and D); cos/sin the same for every
// head (strides cs0 over batch, cs3 over D). One thread per element of q, k and v.
template <class S>
__global__ void rope_cache_update(const typename S::T* __restrict__ q, const typename S::T* __restrict__ k,
                                  const typename S::T* __restrict__ v, const typename S::T* __restrict__ cos_,
                                  const typename S::T* __restrict__ sin_, typename S::T* __restrict__ q_out,
                                  typename S::T* __restrict__ k_cache, typename S::T* __restrict__ v_cache,
                                  const long long* __restrict__ index, int hq, int hkv, int d, int size,
                                  long long qs0, long long qs1, long long qs3, long long ks0, long long ks1,
                                  long long ks3, long long vs0, long long vs1, long long vs3, long long cs0,
                                  long long cs3, long long total, int interleaved) {
    grid_dependency_sync();
    const long long slot = index[0] < 0 ? index[0] + size : index[0];
    const int heads = hq + 2 * hkv;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int j = (int)(i % d);
        const long long r = i / d;
        const int h = (int)(r % heads);
        const long long b = r / heads;
        if (h < hq) {
            q_out[(b * hq + h) * d + j] = rotated<S>(q + b * qs0 + h * qs1, qs3, cos_ + b * cs0, sin_ + b * cs0,
                                                     cs3, j, d, interleaved);
        } else if (h < hq + hkv) {
            const int hk = h - hq;
            k_cache[((b * hkv + hk) * size + slot) * d + j] =
                rotated<S>(k + b * ks0 + hk * ks1, ks3, cos_ + b * cs0, sin_ + b * cs0, cs3, j, d, interleaved);
        } else {
            const int hk = h - hq - hkv;
            v_cache[((b * hkv + hk) * size + slot) * d + j] = v[b * vs0 + hk * vs1 + j * vs3];
        }
    }
}

// norm_rope_cache_update for one new position: rope_cache_update's step (same layouts) of q's and k's rows first
// RMS-normalized with their weights qw, kw [D] and rounded as rms_norm rounds them (Qwen3's q_norm and k_norm: two
// kernels fewer a layer). A warp per row of q, k or v (D <= NORM_ROPE_WIDTH): the row normalized into shared
// memory (a value's RoPE partner is another lane's), then rotated from there and written; v's rows copied.
#define NORM_ROPE_WARPS 8    // rows a block takes (attention.py's NORM_ROPE_WARPS)
#define NORM_ROPE_WIDTH 256  // the widest row (attention.py's NORM_ROPE_WIDTH)
template <class S>
__global__ void __launch_bounds__(NORM_ROPE_WARPS * 32) norm_rope_cache_update(
        const typename S::T* __restrict__ q, const typename S::T* __restrict__ k, const typename S::T* __restrict__ v,
        const typename S::T* __restrict__ cos_, const typename S::T* __restrict__ sin_,
        const typename S::T* __restrict__ qw, const typename S::T* __restrict__ kw, typename S::T* __restrict__ q_out,
        typename S::T* __restrict__ k_cache, typename S::T* __restrict__ v_cache, const long long* __restrict__ index,
        int batch, int hq, int hkv, int d, int size, long long qs0, long long qs1, long long qs3, long long ks0,
        long long ks1, long long ks3, long long vs0, long long vs1, long long vs3, long long cs0, long long cs3,
        float eps, int interleaved) {
    typedef typename S::T T;
    __shared__ float rows[NORM_ROPE_WARPS][NORM_ROPE_WIDTH];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, heads = hq + 2 * hkv;
    const long long r = (long long)blockIdx.x * NORM_ROPE_WARPS + warp;
    const bool live = r < (long long)batch * heads;
    const int h = (int)(r % heads);
    const long long b = r / heads;
    if (live && h < hq + hkv) {  // the row's norm weight and cos/sin asked of L2 while q, k, v are still computed
        prefetch_l2(h < hq ? qw : kw, (long long)d * sizeof(T), lane, 32);
        if (cs3 == 1) {
            prefetch_l2(cos_ + b * cs0, (long long)d * sizeof(T), lane, 32);
            prefetch_l2(sin_ + b * cs0, (long long)d * sizeof(T), lane, 32);
        }
    }
    grid_dependency_sync();
    if (!live) return;  // (whole warps: no block barrier follows)
    const long long slot = index[0] < 0 ? index[0] + size : index[0];
    if (h >= hq + hkv) {
        const int hk = h - hq - hkv;
        for (int j = lane; j < d; j += 32)
            v_cache[((b * hkv + hk) * size + slot) * d + j] = v[b * vs0 + hk * vs1 + j * vs3];
        return;
    }
    const bool is_q = h < hq;
    const int hk = h - hq;
    const T* x = is_q ? q + b * qs0 + h * qs1 : k + b * ks0 + hk * ks1;
    const long long xs = is_q ? qs3 : ks3;
    const T* w = is_q ? qw : kw;
    float* row = rows[warp];
    float ss = 0.0f, wl[NORM_ROPE_WIDTH / 32];  // (the weight read with the row: one round trip, not two)
#pragma unroll
    for (int i = 0; i < NORM_ROPE_WIDTH / 32; ++i) {
        const int j = lane + 32 * i;
        if (j < d) {
            const float t = S::load(x[j * xs]);
            row[j] = t;
            ss += t * t;
            wl[i] = S::load(w[j]);
        }
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) / (float)d + eps);
#pragma unroll
    for (int i = 0; i < NORM_ROPE_WIDTH / 32; ++i) {
        const int j = lane + 32 * i;
        if (j < d) row[j] = S::load(S::store(row[j] * inv * wl[i]));
    }
    __syncwarp();
    T* out = is_q ? q_out + (b * hq + h) * d : k_cache + ((b * hkv + hk) * size + slot) * d;
    const T* c = cos_ + b * cs0;
    const T* sn = sin_ + b * cs0;
    const int half = d / 2;
    for (int j = lane; j < d; j += 32) {
        const int partner = interleaved ? j ^ 1 : (j < half ? j + half : j - half);
        const float sign = interleaved ? ((j & 1) ? 1.0f : -1.0f) : (j < half ? -1.0f : 1.0f);
        out[j] = S::store(row[j] * S::load(c[j * cs3]) + sign * row[partner] * S::load(sn[j * cs3]));
    }
}

// rope_cache_update for a serving program's decode step (one token of each of B sequences) in one launch instead of
// about ten: q [B, hq, 1, D] rotated into q_out (contiguous); k [B, 1, hkv, D] rotated and v [B, 1, hkv, D]
// copied into the caches [slot_count, size, hkv, D] (contiguous) at (slots[b], positions[b]). q, k and v in any
// layout (element strides over batch, head and D); cos/sin [B, 1, 1, D] (strides cs0 over batch, cs3 over D).
// Blocks (row b, piece): each block's threads first look at the rows after b together (one each), and the block
// leaves b's place to a later row writing the same one (index_put keeps the last of repeated places); a place
// outside the cache is not written (a CUDA graph cannot raise; the portable path checks the slots). Then one
// thread per element of the piece of q, k and v.
template <class S>
__global__ void rope_slot_update(const typename S::T* __restrict__ q, const typename S::T* __restrict__ k,
                                 const typename S::T* __restrict__ v, const typename S::T* __restrict__ cos_,
                                 const typename S::T* __restrict__ sin_, typename S::T* __restrict__ q_out,
                                 typename S::T* __restrict__ k_cache, typename S::T* __restrict__ v_cache,
                                 const long long* __restrict__ slots, const long long* __restrict__ positions,
                                 int batch, int hq, int hkv, int d, int slot_count, int size,
                                 long long qs0, long long qs1, long long qs3, long long ks0, long long ks2,
                                 long long ks3, long long vs0, long long vs2, long long vs3, long long cs0,
                                 long long cs3, int interleaved) {
    grid_dependency_sync();
    const int b = blockIdx.x;
    const long long slot = slots[b] < 0 ? slots[b] + slot_count : slots[b];
    const long long at = positions[b] < 0 ? positions[b] + size : positions[b];
    bool later = false;
    for (int b2 = b + 1 + threadIdx.x; b2 < batch; b2 += blockDim.x) {
        const long long s2 = slots[b2] < 0 ? slots[b2] + slot_count : slots[b2];
        const long long a2 = positions[b2] < 0 ? positions[b2] + size : positions[b2];
        later |= s2 == slot && a2 == at;
    }
    const bool writes = !__syncthreads_or(later) && slot >= 0 && slot < slot_count && at >= 0 && at < size;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const int h = i / d, j = i - h * d;
    const typename S::T* c = cos_ + b * cs0;
    const typename S::T* s = sin_ + b * cs0;
    if (h < hq) {
        q_out[((long long)b * hq + h) * d + j] = rotated<S>(q + b * qs0 + h * qs1, qs3, c, s, cs3, j, d, interleaved);
    } else if (writes && h < hq + hkv) {
        const int hk = h - hq;
        k_cache[((slot * size + at) * hkv + hk) * d + j] = rotated<S>(k + b * ks0 + hk * ks2, ks3, c, s, cs3, j, d,
                                                                      interleaved);
    } else if (writes && h < hq + 2 * hkv) {
        const int hk = h - hq - hkv;
        v_cache[((slot * size + at) * hkv + hk) * d + j] = v[b * vs0 + hk * vs2 + j * vs3];
    }
}
