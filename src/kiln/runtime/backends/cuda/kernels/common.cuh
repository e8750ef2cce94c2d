// What every kernel source of kiln's cuda backend shares; nvrtc.py puts it in front of each .cu file before
// compiling (so CuPy's kernel cache, keyed by the source, sees a change here too).
//
// Kernels are templates over their storage type S (F32, F16, BF16 below); nvrtc.py instantiates each
// `template <class S> __global__` kernel for the three. No CUDA headers are included (NVRTC finds none by
// default): half and bfloat16 are 16-bit patterns converted here. Values are read into float32, the math runs in
// float32, and each output is rounded once.

#define KILN_INF __int_as_float(0x7f800000)

// Every kernel here is launched early (launch.py: programmatic dependent launch), so it may start while the kernel
// before it in the stream still runs. Each calls this in every block before it reads or writes anything an earlier
// kernel may touch, or returns: it waits until the kernel before has completed and its writes are visible, then
// lets the kernel after this one launch (whose blocks take the SMs this one frees, and wait here in turn). Before
// it a kernel may only read what no kernel writes (a program constant: the GEMV's weight rows).
#ifdef KILN_TIMELINE
// timeline.py's buffer, [count, capacity, records of 4 u64], set by nvrtc.py when it loads the module.
extern "C" {
__device__ unsigned long long* kiln_timeline;
}

__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#endif

__device__ __forceinline__ void grid_dependency_sync() {
#ifdef KILN_TIMELINE
    const bool recorder = (threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0;
    const unsigned long long started = recorder ? global_ns() : 0ull;
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#ifdef KILN_TIMELINE
    if (recorder && kiln_timeline) {  // after the launch of the next kernel: the round trip below does not delay it
        const unsigned long long released = global_ns();
        const unsigned long long slot = atomicAdd(kiln_timeline, 1ull);
        if (slot < kiln_timeline[1]) {
            unsigned long long* r = kiln_timeline + 2 + 4 * slot;
            r[0] = started;
            r[1] = released;
            r[2] = gridDim.x | (unsigned long long)gridDim.y << 21 | (unsigned long long)gridDim.z << 42;
            r[3] = blockDim.x | (unsigned long long)blockDim.y << 21 | (unsigned long long)blockDim.z << 42;
        }
    }
#endif
}

// Whether rows first .. first + count - 1 of a slotted decode step are one prompt run: one slot inside the cache,
// at consecutive positions. flash.cu attends to such a run's queries together (its keys read once per run) and
// decode.cu then leaves them out; both ask this of the same rows, so each row is attended to exactly once.
__device__ __forceinline__ bool slot_run(const long long* slots, const long long* positions, long long first,
                                         int count, int slot_count) {
    const long long slot = slots[first], p0 = positions[first];
    bool run = slot >= 0 && slot < slot_count;
    for (int j = 1; j < count; ++j) run &= slots[first + j] == slot && positions[first + j] == p0 + j;
    return run;
}

// What an attention kernel's mask argument points to (attention.py's MASK_NONE, MASK_BOOL, MASK_FLOAT).
#define MASK_NONE 0
#define MASK_BOOL 1
#define MASK_FLOAT 2

// 16 bytes moved by one load or store instruction (8 halves or 4 floats): the unit of the memory-bound kernels.
struct alignas(16) U4 {
    unsigned int x, y, z, w;
};

// A 16-byte load that bypasses L1 (streamed weights read once: L1 stays for what is reused, such as x).
__device__ __forceinline__ U4 load_stream(const void* p) {
    U4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Asks L2 for the 128-byte lines of `bytes` bytes from p, thread t of `threads` a line at a time: for a kernel's
// inputs that come from DRAM (a layer's norm weights, the residual of a few kernels ago, a KV cache), issued before
// grid_dependency_sync so that the reads after it find them in L2 instead of waiting a DRAM round trip each. L2 is
// where every SM's writes meet, so a line fetched while the kernel before still writes it is not stale (L1 is not
// touched): safe on any input, whoever writes it. A hint; the caller passes addresses inside the tensor.
__device__ __forceinline__ void prefetch_line(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes, int t, int threads) {
    const char* c = static_cast<const char*>(p);
    for (long long at = (long long)t * 128; at < bytes; at += (long long)threads * 128) prefetch_line(c + at);
}

// Each type also unpacks a U4 into its PER16 values as floats.
struct F32 {
    typedef float T;
    static constexpr int PER16 = 4;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
    static __device__ __forceinline__ void unpack(const U4& u, float* f) {
        f[0] = __uint_as_float(u.x), f[1] = __uint_as_float(u.y), f[2] = __uint_as_float(u.z);
        f[3] = __uint_as_float(u.w);
    }
};

// Two values of a 16-bit storage type in one register (PTX_TYPE "bf16" or "f16"), low half first: pack2 rounds two
// floats as store rounds them (NaN aside: the hardware's canonical NaN) in one instruction, not ~7 each; sub2 and
// mul2 round each result once (no contraction): the packed arithmetic of gemm_rows's int4 dequantization.
#define KILN_PAIR_OPS(PTX_TYPE)                                                                             \
    static __device__ __forceinline__ unsigned int pack2(float lo, float hi) {                              \
        unsigned int u;                                                                                     \
        asm("cvt.rn." PTX_TYPE "x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));                           \
        return u;                                                                                           \
    }                                                                                                       \
    static __device__ __forceinline__ unsigned int sub2(unsigned int a, unsigned int b) {                   \
        unsigned int d;                                                                                     \
        asm("sub.rn." PTX_TYPE "x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));                                 \
        return d;                                                                                           \
    }                                                                                                       \
    static __device__ __forceinline__ unsigned int mul2(unsigned int a, unsigned int b) {                   \
        unsigned int d;                                                                                     \
        asm("mul.rn." PTX_TYPE "x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));                                 \
        return d;                                                                                           \
    }

struct BF16 {
    typedef unsigned short T;
    static constexpr int PER16 = 8;
    static __device__ __forceinline__ void unpack(const U4& u, float* f) {  // low half first
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) f[2 * i] = __uint_as_float(w[i] << 16), f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }

    static __device__ __forceinline__ float load(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }
    static __device__ __forceinline__ unsigned short store(float v) {  // round to nearest even, NaN kept quiet
        unsigned int u = __float_as_uint(v);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
        u += 0x7fffu + ((u >> 16) & 1u);
        return (unsigned short)(u >> 16);
    }
    KILN_PAIR_OPS("bf16")
    static constexpr unsigned int INT_BASE = 0x4300u;  // 128.0: its bits OR a code 0..127 are 128 + code, exactly
};

struct F16 {
    typedef unsigned short T;
    static constexpr int PER16 = 8;

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
    KILN_PAIR_OPS("f16")
    static constexpr unsigned int INT_BASE = 0x6400u;  // 1024.0: codes 0..1023 exact
    static __device__ __forceinline__ void unpack(const U4& u, float* f) {
        const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) f[2 * i] = load((unsigned short)(w[i] & 0xffffu)), f[2 * i + 1] = load((unsigned short)(w[i] >> 16));
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

// Top-k keys (topk.cu's topk_rows and the routers' pick): each element and its index as one 64-bit key whose larger
// value wins: the value's order in the high word, the index reversed in the low word.

// The float's place in the order as an unsigned word (larger wins): NaN highest for largest, lowest for smallest.
__device__ __forceinline__ unsigned long long topk_key(float v, long long at, int largest) {
    if (v == 0.0f) v = 0.0f;  // (-0.0 ties with +0.0)
    unsigned int u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending floats to ascending words
    if (v != v) u = 0xffffffffu;
    if (!largest) u = ~u;
    return ((unsigned long long)u << 32) | (0xffffffffu - (unsigned int)at);
}

// The warp's largest 64-bit key: on sm_80 on, two redux.sync (the high words' max, then the low words' max among the
// lanes holding it: keys are unique, so that is the largest key) where five rounds of 64-bit shuffles took ten
// dependent shuffles; the shuffles elsewhere.
__device__ __forceinline__ unsigned long long warp_max_key(unsigned long long key) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned int hi = (unsigned int)(key >> 32);
    unsigned int top, low;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(top) : "r"(hi));
    const unsigned int mine = hi == top ? (unsigned int)key : 0u;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(low) : "r"(mine));
    return (unsigned long long)top << 32 | low;
#else
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    return key;
#endif
}

// The float a key was made from (topk_key's order inverted; largest keys only).
__device__ __forceinline__ float key_value(unsigned long long key) {
    const unsigned int u = (unsigned int)(key >> 32);
    return __uint_as_float((u & 0x80000000u) ? (u & 0x7fffffffu) : ~u);
}

// A mixture-of-experts router's pick of one row (route_experts; topk.cu's route_rows and gemv.cu's
// add_rms_norm_route), by a whole warp holding the row's logits in registers (v[j] is element 32 j + lane, -inf past
// n <= 32 N; k <= 32): the softmax in float32 (exp(x - max) / sum, as the portable softmax computes it), the k
// largest probabilities picked as topk_rows picks, renormalized by their sum when asked, written as float32
// (out_float32) or the storage type with their int64 indices at row k. A NaN logit makes every probability NaN, as
// the softmax it stands for does.
template <class S, int N>
__device__ __forceinline__ void route_row(float (&v)[N], int n, int k, int normalize, int out_float32,
                                          void* __restrict__ weights, long long* __restrict__ indices,
                                          long long row) {
    const int lane = threadIdx.x & 31;
    float top = -KILN_INF;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        nan |= v[j] != v[j];
        top = fmaxf(top, v[j]);
    }
    top = warp_max(top);
    nan = __any_sync(0xffffffffu, nan);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        v[j] = 32 * j + lane < n ? expf(v[j] - top) : 0.0f;
        sum += v[j];
    }
    sum = warp_sum(sum);
    unsigned long long keys[N];
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const int at = 32 * j + lane;
        keys[j] = at < n ? topk_key(nan ? __int_as_float(0x7fc00000) : v[j] / sum, at, 1) : 0ull;
    }
    float mine = 0.0f;  // lane r keeps the r-th pick
    long long mine_at = 0;
    for (int round = 0; round < k; ++round) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int j = 0; j < N; ++j) best = keys[j] > best ? keys[j] : best;
        best = warp_max_key(best);
        const int at = (int)(0xffffffffu - (unsigned int)(best & 0xffffffffu));
        if ((at & 31) == lane) {
#pragma unroll
            for (int j = 0; j < N; ++j) keys[j] = j == (at >> 5) ? 0ull : keys[j];
        }
        if (lane == round) mine = key_value(best), mine_at = at;
    }
    const float total = normalize ? warp_sum(lane < k ? mine : 0.0f) : 1.0f;
    if (lane < k) {
        const float w = normalize ? mine / total : mine;
        if (out_float32)
            static_cast<float*>(weights)[row * k + lane] = w;
        else
            static_cast<typename S::T*>(weights)[row * k + lane] = S::store(w);
        indices[row * k + lane] = mine_at;
    }
}

__device__ __forceinline__ float sigmoid(float v) {  // without overflow for either sign
    const float e = expf(-fabsf(v));
    return v >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// The activation of a gated MLP (gated_activation, gated_linear): 1 silu, 2 gelu (erf form), 3 gelu (tanh form).
__device__ __forceinline__ float gate_activation(float v, int act) {
    if (act == 1) return v * sigmoid(v);
    if (act == 2) return 0.5f * v * erfcf(-v * 0.70710678118654752f);
    return 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
}

// The tensor cores' product and asynchronous copies (flash.cu, experts.cu).

// d += a b for one 16x8 tile, a 16x16 (row major), b 16x8 (column major), in the storage type's mma.
template <class S>
__device__ __forceinline__ void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1);

#define KILN_MMA16816(STORAGE, PTX_TYPE)                                                                       \
    template <>                                                                                                 \
    __device__ __forceinline__ void mma16816<STORAGE>(float* d, const unsigned* a, unsigned b0, unsigned b1) {  \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0, %1, %2, %3}, "   \
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"                                            \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                           \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                           \
    }
KILN_MMA16816(BF16, "bf16")
KILN_MMA16816(F16, "f16")

// A shared-memory pointer as the 32-bit address cp.async and ldmatrix take (a kernel that copies every stage works
// it out once).
__device__ __forceinline__ unsigned shared_address(const void* p) {
    unsigned long long shared;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(shared) : "l"(p));
    return (unsigned)shared;
}

// Four 8x8 matrices of 16-bit values from shared memory (ldmatrix .x4; rows 16-byte aligned): lane l gives the
// address of row l % 8 of matrix l / 8, and each thread receives, of matrix i, in r[i], the two values of row
// lane / 4 at columns 2 (lane % 4) and 2 (lane % 4) + 1: an mma fragment, in one instruction for four. TRANSPOSED
// (.trans): of column lane / 4, rows 2 (lane % 4) and 2 (lane % 4) + 1 (flash.cu's B fragments of v).
template <bool TRANSPOSED = false>
__device__ __forceinline__ void load_matrices(unsigned (&r)[4], const void* row) {
    if (TRANSPOSED)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(shared_address(row))
                     : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(shared_address(row))
                     : "memory");
}

// One stage of a tile product whose operands are K-contiguous rows in shared memory (mma's row.col form, nothing
// transposed): acc[j] += the warp's 16 rows of x (xs rows m0 ..) times the 8 weight rows 8 j .. 8 j + 7 of w, over
// the stage's KTILE columns, the fragments by ldmatrix (x's four 8x8 quarters in one; two weight fragments' b0 and
// b1 in one). Rows 16-byte aligned, a multiple of 16 bytes apart. experts.cu's expert_gemm and quant.cu's gemm_rows.
template <class S, int KTILE, int NFRAG, int LD>
__device__ __forceinline__ void mma_stage(float (&acc)[NFRAG][4], const typename S::T (*xs)[LD],
                                          const typename S::T (*ws)[LD], int m0, int lane) {
    static_assert(NFRAG % 2 == 0 && LD % 8 == 0, "weight fragments go in pairs; rows are whole 16-byte pieces");
#pragma unroll
    for (int ks = 0; ks < KTILE; ks += 16) {
        unsigned a[4];  // rows m0 + 0-7 and 8-15 at columns ks .., then the same at ks + 8 ..
        load_matrices(a, &xs[m0 + (lane & 15)][ks + (lane >> 4) * 8]);
#pragma unroll
        for (int j = 0; j < NFRAG; j += 2) {
            unsigned b[4];  // weight rows 8 j .. at columns ks .. and ks + 8 .., then rows 8 (j + 1) .. the same
            load_matrices(b, &ws[8 * (j + (lane >> 4)) + (lane & 7)][ks + ((lane >> 3) & 1) * 8]);
            mma16816<S>(acc[j], a, b[0], b[1]);
            mma16816<S>(acc[j + 1], a, b[2], b[3]);
        }
    }
}

// 16 bytes copied from global to shared memory without passing through registers (cp.async); `valid` false
// writes zeros and reads nothing. The copies a thread issued land by cp_async_wait.
__device__ __forceinline__ void copy_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
    copy_async16(shared_address(dst), src, valid);
}
// 4 bytes (src 4-byte aligned) copied the same way, reading only its first `bytes` (0, 2 or 4) and zero-filling the
// rest: a 16-bit value's aligned word where the word's other half may lie past the array's end.
__device__ __forceinline__ void copy_async4(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING)); }
