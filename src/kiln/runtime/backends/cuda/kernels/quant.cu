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

#define MAX_ROWS 8   // input rows qlinear_rows takes (quant_linear.py's QUANT_ROWS)
#define WARPS 8      // warps per block of qlinear_rows (quant_linear.py's QUANT_WARPS)

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

// qgemv<N>: 65 66 68 72 129 130 132 136
// out[r, n] for r < rows <= MAX_ROWS as qlinear_rows, with the weight streamed as bf16 GEMV streams it (gemv.cu): a
// warp per output feature, every lane issuing QGEMV_LOADS 16-byte loads (32 int4 or 16 int8 weights each) before it
// uses the first, so a warp has 2 KB of its row in flight where qlinear_rows had 128 bytes. Codes become floats
// without a conversion instruction (a quarter-rate op that would bound the stream): an int8 byte, read as q + 128,
// into the mantissa of 2^23 (then 2^23 + 128 subtracted); an int4 nibble into the top mantissa bits of 1.0 by one
// byte permute, f = 1 + code / 128, and sum(code x) = 128 (sum(f x) - sum(x)), so a weight costs the permute and
// one FMA. Per piece (one group, or a part of one): scale * (codes . x) plus the group's additive term times
// sum(x) (the zero point's -z * scale, or the offset), sums in float32.
// Needs k a multiple of the piece (32 / 16 weights), the group a multiple of it, and q, x 16-byte aligned
// (quant_linear.py).
#define QGEMV_LOADS 4

// The lane's QGEMV_LOADS pieces of one round of a row, from piece p0 (zeros past the row's end).
__device__ __forceinline__ void qgemv_loads(U4 (&wv)[QGEMV_LOADS], const U4* row, int p0, int pieces, int lane) {
#pragma unroll
    for (int u = 0; u < QGEMV_LOADS; ++u) {
        const int p = p0 + u * 32 + lane;
        wv[u] = p < pieces ? load_stream(row + p) : U4{0u, 0u, 0u, 0u};
    }
}

// acc[r] += the lane's share of x[r] . (row o's pieces p0.., already in wv)
template <class S, int BITS, int ROWS>
__device__ __forceinline__ void qgemv_round(const typename S::T* __restrict__ x, const typename S::T* __restrict__ srow,
                                            const typename S::T* __restrict__ zrow, const U4 (&wv)[QGEMV_LOADS],
                                            float (&acc)[ROWS], int rows, int k, int group, int zero_mode,
                                            int pieces, int p0, int lane) {
    constexpr int PER = BITS == 4 ? 32 : 16;  // weights per 16-byte piece
    constexpr int V = S::PER16;
    const float base = 8388608.0f + 128.0f;  // int8: 2^23 and the read-as-unsigned shift
    const bool additive = zrow != nullptr;  // a term per group (zero point or offset): needs sum(x)
#pragma unroll
    for (int u = 0; u < QGEMV_LOADS; ++u) {
        const int p = p0 + u * 32 + lane;
        if (p >= pieces) break;
        const int j0 = p * PER, g = j0 / group;
        const float s = S::load(srow[g]);
        const float b = additive ? (zero_mode == ZERO_OFFSETS ? S::load(zrow[g]) : -s * S::load(zrow[g])) : 0.0f;
        const unsigned int words[4] = {wv[u].x, wv[u].y, wv[u].z, wv[u].w};
        float wf[PER];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (BITS == 4) {  // f = 1 + code / 128: the nibble as the top mantissa bits (one PRMT a weight)
                const unsigned int lo = (words[i] & 0x0F0F0F0Fu) | 0x80808080u;  // elements 2j: 0x80 | code
                const unsigned int hi = ((words[i] >> 4) & 0x0F0F0F0Fu) | 0x80808080u;  // elements 2j + 1
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    wf[8 * i + 2 * j] = __uint_as_float(__byte_perm(lo, 0x3F000000u, 0x7054u | (j << 8)));
                    wf[8 * i + 2 * j + 1] = __uint_as_float(__byte_perm(hi, 0x3F000000u, 0x7054u | (j << 8)));
                }
            } else {
                const unsigned int flipped = words[i] ^ 0x80808080u;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    wf[4 * i + e] = __uint_as_float(0x4B000000u | ((flipped >> (8 * e)) & 255u)) - base;
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r >= rows) break;
            const typename S::T* xr = x + (long long)r * k + j0;
            float dq[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sx[2] = {0.0f, 0.0f};  // (independent chains)
#pragma unroll
            for (int c = 0; c < PER / V; ++c) {
                float xf[V];
                S::unpack(*reinterpret_cast<const U4*>(xr + c * V), xf);
#pragma unroll
                for (int i = 0; i < V; ++i) {
                    dq[i & 3] = fmaf(wf[c * V + i], xf[i], dq[i & 3]);
                    if (BITS == 4 || additive) sx[i & 1] += xf[i];
                }
            }
            const float sum_x = sx[0] + sx[1], dots = (dq[0] + dq[1]) + (dq[2] + dq[3]);
            // int4: sum code x = 128 (sum f x - sum x), less the implicit zero point 8 where there is one
            const float zero8 = zero_mode == ZERO_ABSENT ? 8.0f : 0.0f;
            const float codes_x = BITS == 4 ? 128.0f * (dots - sum_x) - zero8 * sum_x : dots;
            acc[r] += s * codes_x + b * sum_x;
        }
    }
}

// acc[r] += the lane's share of x[r] . W[o] for the weight row at `row` (its scales and zero terms at srow, zrow),
// the row streamed QGEMV_LOADS pieces a lane at a time: qgemv's and gathered_qgemv's warp.
template <class S, int BITS, int ROWS>
__device__ __forceinline__ void qgemv_row(const typename S::T* __restrict__ x, const U4* row,
                                          const typename S::T* __restrict__ srow,
                                          const typename S::T* __restrict__ zrow, float (&acc)[ROWS], int rows,
                                          int k, int group, int zero_mode, int lane) {
    const int pieces = k / (BITS == 4 ? 32 : 16);
    for (int p0 = 0; p0 < pieces; p0 += 32 * QGEMV_LOADS) {  // (a warp-wide bound)
        U4 wv[QGEMV_LOADS];
        qgemv_loads(wv, row, p0, pieces, lane);
        qgemv_round<S, BITS, ROWS>(x, srow, zrow, wv, acc, rows, k, group, zero_mode, pieces, p0, lane);
    }
}

// A warp per output feature (measured against a warp walking rows with the next row's loads issued before the
// current one is computed: int4 rows 3-5% faster, int8 rows up to 16% slower, docs/benchmarks.md).
// N = 16 * bits + the most input rows this instance takes (1, 2, 4 or 8): a decode step's one row keeps one
// accumulator, not MAX_ROWS, so more warps fit on an SM (Nsight Compute, int4 LM head: 99 registers a thread, 2
// blocks and 23% occupancy per SM with 8 rows' registers; 3 blocks from 80 registers for up to 4 rows, 2 for 8, where
// 3 would spill).
template <class S, int N>
__global__ void __launch_bounds__(32 * WARPS, N % 16 <= 4 ? 3 : 2) qgemv(const typename S::T* __restrict__ x,
                      const unsigned char* __restrict__ q, const typename S::T* __restrict__ scale,
                      const typename S::T* __restrict__ zero, const typename S::T* __restrict__ bias,
                      typename S::T* __restrict__ out, int rows, int n, int k, int group, int zero_mode,
                      int has_bias) {
    constexpr int BITS = N / 16, ROWS = N % 16;
    grid_dependency_sync();
    const int lane = threadIdx.x & 31;
    const int o = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (o >= n) return;
    const int ngroups = k / group;
    const U4* row = reinterpret_cast<const U4*>(q + (long long)o * (BITS == 8 ? k : k / 2));
    const bool has_zero = zero_mode == ZERO_POINTS || zero_mode == ZERO_OFFSETS;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) acc[r] = 0.0f;
    qgemv_row<S, BITS, ROWS>(x, row, scale + (long long)o * ngroups,
                             has_zero ? zero + (long long)o * ngroups : nullptr, acc, rows, k, group, zero_mode, lane);
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        if (r >= rows) break;
        const float v = warp_sum(acc[r]);
        if (lane == 0) out[(long long)r * n + o] = S::store(v + (has_bias ? S::load(bias[o]) : 0.0f));
    }
}

// gathered_qgemv<N>: 4 8
// gathered_quantized_linear over a few rows (gemv.cu's gathered_gemv, quantized): out[s, o] = x[s] . W[index[s], o]
// + bias[index[s], o] with each expert's q [N, K or K/2], scale and zero [N, K / group] stacked over E experts.
// Block row blockIdx.y is input row s; a warp per output streams the picked expert's row as qgemv does. N = bits.
// An index outside 0 .. E - 1 gives NaN outputs.
template <class S, int N>
__global__ void __launch_bounds__(32 * WARPS, 3) gathered_qgemv(const typename S::T* __restrict__ x,
                      const long long* __restrict__ index, const unsigned char* __restrict__ q,
                      const typename S::T* __restrict__ scale, const typename S::T* __restrict__ zero,
                      const typename S::T* __restrict__ bias, typename S::T* __restrict__ out, int n, int k,
                      int group, int zero_mode, int has_bias, int experts) {
    grid_dependency_sync();
    const int lane = threadIdx.x & 31;
    const long long o = blockIdx.x * WARPS + (threadIdx.x >> 5), s = blockIdx.y;
    if (o >= n) return;
    const long long e = index[s], ngroups = k / group, w = e * n + o;  // (the expert's row o in the stack)
    const bool valid = e >= 0 && e < experts;
    const bool has_zero = zero_mode == ZERO_POINTS || zero_mode == ZERO_OFFSETS;
    float acc[1] = {0.0f};
    if (valid)
        qgemv_row<S, N, 1>(x + s * k, reinterpret_cast<const U4*>(q + w * (N == 8 ? k : k / 2)),
                           scale + w * ngroups, has_zero ? zero + w * ngroups : nullptr, acc, 1, k, group,
                           zero_mode, lane);
    const float v = warp_sum(acc[0]);
    if (lane == 0)
        out[s * n + o] = S::store(valid ? v + (has_bias ? S::load(bias[w]) : 0.0f) : __int_as_float(0x7fc00000));
}

// qgemv_staged<N>: 141 142 144 181 182 184 241 242 281 282 441 442 481 482 1241 1242 1281 1282 1441 1442 1481 1482
// out[r, n] for r < rows as qgemv computes it, built for what bounded qgemv (Nsight Compute: a warp's life was one
// short burst of weight loads, then the scale loads and the x loads, each a round trip of its own, then the warp
// left; the SM's bytes in flight were a fraction of what the memory needs, at 25-40% of the bandwidth):
// - x is staged once per block in shared memory as float32, laid out [row][4-weight chunk][piece] so that 32 lanes
//   reading 32 consecutive pieces hit 32 banks, with each piece's sum of x (the int4 and offset terms need it)
//   beside it: a weight then costs one conversion and one FMA, the x work is done once per block, not per weight;
// - a warp takes WR weight rows at once (N / 100: 1, 2 or 4), every lane loading UP = QS_LOADS / WR pieces of
//   each, so a warp has 2 KB in flight whatever K is (an int4 row of 2048 weights is 1 KB: qgemv left half its
//   loads idle), and each x chunk read from shared memory serves the WR rows;
// - the scales and zero points of a round are loaded with its weights, and where q, scale and zero are program
//   constants (`constant`) the first round's loads are issued before grid_dependency_sync, so the layer's stream
//   starts while the kernel before it finishes (as gemv.cu does).
// N = 100 * WR + 10 * BITS + ROWS (the most input rows this instance takes: 1, 2 or 4; WR > 1 only up to 2 rows,
// where the registers allow it without spilling; 8 rows are qgemv's), + 1000 for the gated form
// (gated_quantized_linear): q stacks n / 2 gate rows and then n / 2 up rows, a warp takes WR / 2 gate rows and the
// up rows that pair with them, and writes act(gate) * up [rows, n / 2] (`act`: common.cuh's gate_activation), each
// half rounded to the storage type first, as the linear's output and the gated_activation kernel after it would
// be: the same bits as the two kernels, one kernel and hand-over fewer a layer.
// Needs what qgemv needs, and ROWS * K * 4 (+ the sums) bytes of shared memory (quant_linear.py's QGEMV_STAGED_SMEM).
// QS_LOADS: 16-byte weight loads per lane and round (WR rows x UP pieces). 8 with 2 blocks an SM (128 registers)
// against 4 with 3 (80), H100, 1 row, us: int4 g64 q/k/v 6.4 -> 4.1, gate/up 12.7 -> 11.9, LM head 73.8 -> 67.6,
// down 9.0 -> 10.1 (two rounds of its K = 8192 where 8 took one); int8 q/k/v 7.1 -> 4.6, LM head 97.2 -> 93.7.
// 4 input rows need 2 blocks' registers (80 would spill).
#define QS_LOADS 4

// Round p0's loads of the warp's WR rows: UP weight pieces of each a lane, and each piece's scale and zero term,
// kept in their storage type until used (a conversion here would wait for the load).
// The warp's weight row j: o0 + j, or in the gated form gate row o0 + j % (WR / 2) for j < WR / 2 and its up row
// (n / 2 further) after; whether that row exists.
template <int WR, bool GATED>
__device__ __forceinline__ int qstaged_row(int o0, int j, int n, bool& live) {
    if (!GATED) {
        live = o0 + j < n;
        return o0 + j;
    }
    constexpr int PAIRS = WR > 1 ? WR / 2 : 1;  // (WR is even in the gated form: the bound is for the compiler)
    const int half = n / 2, gate = o0 + j % PAIRS;
    live = gate < half;
    return j < PAIRS ? gate : half + gate;
}

template <class S, int WR, int UP, bool GATED>
__device__ __forceinline__ void qstaged_issue(U4 (&wv)[WR][UP], typename S::T (&sc)[WR][UP],
                                              typename S::T (&zr)[WR][UP], const unsigned char* __restrict__ q,
                                              const typename S::T* __restrict__ scale,
                                              const typename S::T* __restrict__ zero, int o0, int n, int pieces,
                                              int per, int ngroups, int group, int p0, int lane, bool has_zero) {
#pragma unroll
    for (int j = 0; j < WR; ++j) {
        bool row_live;
        const int o = qstaged_row<WR, GATED>(o0, j, n, row_live);
#pragma unroll
        for (int u = 0; u < UP; ++u) {
            const int p = p0 + u * 32 + lane;
            const bool live = row_live && p < pieces;
            wv[j][u] = live ? load_stream(q + ((long long)o * pieces + p) * 16) : U4{0u, 0u, 0u, 0u};
            const long long g = (long long)o * ngroups + (p * per) / group;
            sc[j][u] = live ? scale[g] : typename S::T(0);
            zr[j][u] = live && has_zero ? zero[g] : typename S::T(0);
        }
    }
}

// qgemv_staged's and qgemv_dot's outputs from a warp's sums acc[WR][ROWS]: out[r, o] + bias, or in the gated form
// act(gate) * up (each half rounded to S first, as quantized_linear's output would be).
template <class S, int WR, int ROWS, bool GATED>
__device__ __forceinline__ void qstaged_store(const float (&acc)[WR][ROWS], const typename S::T* __restrict__ bias,
                                              typename S::T* __restrict__ out, int o0, int rows, int n, int has_bias,
                                              int act, int lane) {
    if (GATED) {
        const int half = n / 2;
#pragma unroll
        for (int j = 0; j < WR / 2; ++j) {
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r >= rows) break;
                const float g = warp_sum(acc[j][r]), u = warp_sum(acc[j + WR / 2][r]);
                const int o = o0 + j;
                if (lane == 0 && o < half) {
                    const float gate = S::load(S::store(g + (has_bias ? S::load(bias[o]) : 0.0f)));
                    const float up = S::load(S::store(u + (has_bias ? S::load(bias[half + o]) : 0.0f)));
                    out[(long long)r * half + o] = S::store(gate_activation(gate, act) * up);
                }
            }
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < WR; ++j) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r >= rows) break;
            const float v = warp_sum(acc[j][r]);
            const int o = o0 + j;
            if (lane == 0 && o < n) out[(long long)r * n + o] = S::store(v + (has_bias ? S::load(bias[o]) : 0.0f));
        }
    }
}

template <class S, int N>
__global__ void __launch_bounds__(32 * WARPS, N % 10 <= 2 ? 3 : 2) qgemv_staged(const typename S::T* __restrict__ x,
                      const unsigned char* __restrict__ q, const typename S::T* __restrict__ scale,
                      const typename S::T* __restrict__ zero, const typename S::T* __restrict__ bias,
                      typename S::T* __restrict__ out, int rows, int n, int k, int group, int zero_mode,
                      int has_bias, int constant, int act) {
    constexpr bool GATED = N >= 1000;
    constexpr int WR = N / 100 % 10, BITS = N / 10 % 10, ROWS = N % 10, UP = QS_LOADS / WR;
    static_assert(!GATED || WR % 2 == 0, "the gated form pairs gate and up rows");
    constexpr int PER = BITS == 4 ? 32 : 16;  // weights per 16-byte piece
    constexpr int C = PER / 4;                // float4 chunks of x per piece
    constexpr int V = S::PER16;               // x values per 16-byte load
    extern __shared__ float4 staged[];        // [ROWS][C][pieces] float4, then [ROWS][pieces] sums
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pieces = k / PER, ngroups = k / group;
    const int o0 = (blockIdx.x * WARPS + warp) * (GATED ? WR / 2 : WR);  // (the first gate row, gated)
    const bool has_zero = zero_mode == ZERO_POINTS || zero_mode == ZERO_OFFSETS;
    const bool sums = BITS == 4 || has_zero;  // whether sum(x) of a piece enters the result
    float* piece_sums = reinterpret_cast<float*>(staged + (long long)ROWS * C * pieces);
    U4 wv[WR][UP];
    typename S::T sc[WR][UP], zr[WR][UP];
    if (constant)
        qstaged_issue<S, WR, UP, GATED>(wv, sc, zr, q, scale, zero, o0, n, pieces, PER, ngroups, group, 0, lane,
                                        has_zero);
    grid_dependency_sync();
    if (!constant)
        qstaged_issue<S, WR, UP, GATED>(wv, sc, zr, q, scale, zero, o0, n, pieces, PER, ngroups, group, 0, lane,
                                        has_zero);
    // stage x: each thread a 16-byte load of V values; the PER / V threads of a piece add their sums by shuffles
    {
        constexpr int SPAN = PER / V;  // threads per piece (2..8), consecutive lanes
        const int per_row = k / V, total = rows * per_row;
        for (int base = 0; base < total; base += 32 * WARPS) {  // (a block-wide bound: every lane shuffles)
            const int i = base + threadIdx.x;
            float f[V];
            float s = 0.0f;
            if (i < total) {
                const int r = i / per_row, j0 = (i - r * per_row) * V, p = j0 / PER, c0 = (j0 - p * PER) / 4;
                S::unpack(*reinterpret_cast<const U4*>(x + (long long)r * k + j0), f);
#pragma unroll
                for (int h = 0; h < V / 4; ++h)
                    staged[((long long)r * C + c0 + h) * pieces + p] = make_float4(f[4 * h], f[4 * h + 1],
                                                                                   f[4 * h + 2], f[4 * h + 3]);
#pragma unroll
                for (int e = 0; e < V; ++e) s += f[e];
            }
#pragma unroll
            for (int o = 1; o < SPAN; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (i < total && (i % SPAN) == 0) piece_sums[(i / per_row) * pieces + (i % per_row) / SPAN] = s;
        }
    }
    __syncthreads();
    float acc[WR][ROWS];
#pragma unroll
    for (int j = 0; j < WR; ++j)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[j][r] = 0.0f;
    const float zero8 = zero_mode == ZERO_ABSENT && BITS == 4 ? 8.0f : 0.0f;
    for (int p0 = 0; p0 < pieces; p0 += 32 * UP) {  // (a warp-wide bound)
        if (p0 > 0)
            qstaged_issue<S, WR, UP, GATED>(wv, sc, zr, q, scale, zero, o0, n, pieces, PER, ngroups, group, p0, lane,
                                            has_zero);
#pragma unroll
        for (int u = 0; u < UP; ++u) {
            const int p = p0 + u * 32 + lane;
            if (p >= pieces) break;
            float dq[WR][ROWS];
#pragma unroll
            for (int j = 0; j < WR; ++j)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) dq[j][r] = 0.0f;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                float4 xv[ROWS];
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
                    if (r < rows) xv[r] = staged[((long long)r * C + c) * pieces + p];
#pragma unroll
                for (int j = 0; j < WR; ++j) {
                    const unsigned int word = (&wv[j][u].x)[BITS == 4 ? c >> 1 : c];
                    float wf[4];
                    if (BITS == 4) {  // f = 1 + code / 128 (qgemv_round's byte permute); lo, hi shared by 2 chunks
                        const unsigned int lo = (word & 0x0F0F0F0Fu) | 0x80808080u;
                        const unsigned int hi = ((word >> 4) & 0x0F0F0F0Fu) | 0x80808080u;
                        const unsigned int b = 2 * (c & 1);  // the chunk's first byte of the word
                        wf[0] = __uint_as_float(__byte_perm(lo, 0x3F000000u, 0x7054u | (b << 8)));
                        wf[1] = __uint_as_float(__byte_perm(hi, 0x3F000000u, 0x7054u | (b << 8)));
                        wf[2] = __uint_as_float(__byte_perm(lo, 0x3F000000u, 0x7054u | ((b + 1) << 8)));
                        wf[3] = __uint_as_float(__byte_perm(hi, 0x3F000000u, 0x7054u | ((b + 1) << 8)));
                    } else {  // the byte read as unsigned (code + 128) in the mantissa of 2^23
                        const unsigned int flipped = word ^ 0x80808080u;
                        const float base = 8388608.0f + 128.0f;
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            wf[e] = __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7440u | e)) - base;
                    }
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        if (r < rows) {
                            float d = dq[j][r];
                            d = fmaf(wf[0], xv[r].x, d);
                            d = fmaf(wf[1], xv[r].y, d);
                            d = fmaf(wf[2], xv[r].z, d);
                            d = fmaf(wf[3], xv[r].w, d);
                            dq[j][r] = d;
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r >= rows) break;
                const float sum_x = sums ? piece_sums[r * pieces + p] : 0.0f;
#pragma unroll
                for (int j = 0; j < WR; ++j) {
                    const float s = S::load(sc[j][u]);
                    const float z = has_zero ? S::load(zr[j][u]) : 0.0f;
                    const float b = zero_mode == ZERO_OFFSETS ? z : (zero_mode == ZERO_POINTS ? -s * z : 0.0f);
                    // (rounded step by step, never contracted: every instance, the gated form's too, sums the
                    // same bits)
                    const float codes_x = BITS == 4 ? __fsub_rn(__fmul_rn(128.0f, __fsub_rn(dq[j][r], sum_x)),
                                                                __fmul_rn(zero8, sum_x))
                                                    : dq[j][r];
                    acc[j][r] = __fadd_rn(acc[j][r], __fadd_rn(__fmul_rn(s, codes_x), __fmul_rn(b, sum_x)));
                }
            }
        }
    }
    qstaged_store<S, WR, ROWS, GATED>(acc, bias, out, o0, rows, n, has_bias, act, lane);
}

// qgemv_dot<N>: 141 142 144 181 182 184 241 242 281 282 441 481 482 1241 1242 1281 1282 1441 1481 1482
// qgemv_dot<N>: 4141 4142 4144 4181 4182 4184 4241 4242 4281 4282 4441 4481 4482 5241 5242 5281 5282 5441 5481
// qgemv_dot<N>: 5482
// qgemv_staged with the products in integers, as llama.cpp's CUDA backend and kiln's CPU (native/qdot.c) run a
// decode step's quantized linears: x is quantized while it is staged, in blocks of 32 (scale d = max |x| / 127, codes
// rounded to nearest even, as qdot.c rounds them), and each piece's 32 (int4) or 16 (int8) weights meet their x
// codes in dp4a instructions, summed exactly in int32. An int4 weight costs ~1 instruction (a nibble mask for four,
// a dp4a for four) where qgemv_staged spends ~2.5 (a byte permute and an FMA each, and x read as float4s), which
// bounds qgemv_staged at 64-77% of the bandwidth on the wide layers (int8 reaches 86-96% there). The result
// differs from the float kernels by x's rounding to 8 bits, as the CPU's does (qdot.c: ~0.3% of a typical output);
// quant_linear.QUANT_DOT (KILN_QUANT_DOT=float) keeps the float kernel. Per piece: s * d * (sum q xq) plus the group's
// additive term times d * (sum xq) (the zero point's -z * s or the offset; int4's implicit 8 as -8 sum xq in the
// integers). N and the rest as qgemv_staged (int4 with 4 weight rows a warp takes 1 input row: 2 would spill);
// shared memory: ROWS x K bytes of codes and 8 bytes a piece; K a multiple of 32.
// + 4000: the interleaved form (quant_linear._interleaves: where x takes more than one turn): x is staged a turn at a
// time just before the first round of products that reads it, its loads in flight beside that round's weights,
// where the plain form stages all of x first (a K = 14336 row: 7 turns, each an L2 round trip, before the first
// product; the 8B int4 down layer took 18.1 us for 10.5 us of bytes, H100). The same codes, so the same bits as
// the plain form.
// A block of x holding inf or NaN gives NaN outputs for its rows.
#define QDOT_BLOCK 32

__device__ __forceinline__ int dp4a_us(unsigned int a, unsigned int b, int c) {  // unsigned a bytes x signed b bytes
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ int dp4a_ss(unsigned int a, unsigned int b, int c) {  // signed x signed
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// 4 codes (each -127..127) as the bytes of a word, the first lowest
__device__ __forceinline__ unsigned int pack4(int a, int b, int c, int d) {
    return (unsigned)(a & 255) | (unsigned)(b & 255) << 8 | (unsigned)(c & 255) << 16 | (unsigned)(d & 255) << 24;
}

// One turn of qgemv_dot's staging, for the block's thread-value i (every lane of the block calls it: shuffles): 8
// consecutive values of x quantized; the 4 threads of a block of 32 (consecutive lanes) share its largest magnitude
// and their code sums. The turns walk x row by row, or (KMAJOR) block of 32 by block of 32 across the rows, so that
// the first turns hold the start of every row (the interleaved form's rounds read x from its start).
template <class S, int BITS, int H, bool KMAJOR>
__device__ __forceinline__ void qdot_stage(const typename S::T* __restrict__ x, U4* __restrict__ xcodes,
                                           float2* __restrict__ piece_terms, int rows, int k, int pieces, int i) {
    constexpr int PER = BITS == 4 ? 32 : 16;
    const int total = rows * (k / 8);
    float f[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    float top = 0.0f;
    int r = 0, j0 = 0;
    if (i < total) {
        if (KMAJOR) {
            const int block = i / 4;
            r = block % rows;
            j0 = (block / rows) * 32 + (i % 4) * 8;
        } else {
            r = i / (k / 8);
            j0 = (i - r * (k / 8)) * 8;
        }
        const typename S::T* xr = x + (long long)r * k + j0;
#pragma unroll
        for (int h = 0; h < 8 / S::PER16; ++h)
            S::unpack(*reinterpret_cast<const U4*>(xr + h * S::PER16), f + h * S::PER16);
#pragma unroll
        for (int e = 0; e < 8; ++e) top = fmaxf(top, f[e] != f[e] ? KILN_INF : fabsf(f[e]));  // (NaN: inf)
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    const float d = top / 127.0f, inverse = top > 0.0f ? 127.0f / top : 0.0f;
    int c[8], sum = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        c[e] = __float2int_rn(f[e] * inverse);
        sum += c[e];
    }
    // the piece's code sum: int4's piece is the block (4 threads), int8's half of it (2)
#pragma unroll
    for (int o = 1; o < (BITS == 4 ? 4 : 2); o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (i >= total) return;
    const int p = j0 / PER, within = j0 - p * PER;  // the piece, and the thread's place in it
    unsigned int* words = reinterpret_cast<unsigned int*>(xcodes);
    if (BITS == 4) {  // 8 elements = one weight word: its even codes, then its odd ones
        const int word = within / 8;  // 0..3 of the piece: x code words 2 word, 2 word + 1
        const long long at = ((long long)(r * H + word / 2) * pieces + p) * 4 + (word % 2) * 2;
        words[at] = pack4(c[0], c[2], c[4], c[6]);
        words[at + 1] = pack4(c[1], c[3], c[5], c[7]);
    } else {
        const long long at = ((long long)r * pieces + p) * 4 + within / 4;
        words[at] = pack4(c[0], c[1], c[2], c[3]);
        words[at + 1] = pack4(c[4], c[5], c[6], c[7]);
    }
    if (within == 0)
        piece_terms[(long long)r * pieces + p] = make_float2(top <= 3.0e38f ? d : __int_as_float(0x7fc00000),
                                                             __int_as_float(sum));
}

template <class S, int N>
__global__ void __launch_bounds__(32 * WARPS, N % 10 <= 2 ? 3 : 2) qgemv_dot(const typename S::T* __restrict__ x,
                      const unsigned char* __restrict__ q, const typename S::T* __restrict__ scale,
                      const typename S::T* __restrict__ zero, const typename S::T* __restrict__ bias,
                      typename S::T* __restrict__ out, int rows, int n, int k, int group, int zero_mode,
                      int has_bias, int constant, int act) {
    constexpr bool GATED = N / 1000 % 2 == 1, INTERLEAVED = N >= 4000;
    constexpr int WR = N / 100 % 10, BITS = N / 10 % 10, ROWS = N % 10, UP = QS_LOADS / WR;
    static_assert(!GATED || WR % 2 == 0, "the gated form pairs gate and up rows");
    constexpr int PER = BITS == 4 ? 32 : 16;  // weights per 16-byte piece
    constexpr int H = PER / 16;               // 16-byte x code words per piece (2 for int4, 1 for int8)
    // [ROWS][H][pieces] U4 of x codes (int4: per 8 elements the even ones' codes, then the odd ones', to meet a
    // weight word's low and high nibbles), then [ROWS][pieces] (d, sum of the piece's codes)
    extern __shared__ U4 xcodes[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int pieces = k / PER, ngroups = k / group;
    const int o0 = (blockIdx.x * WARPS + warp) * (GATED ? WR / 2 : WR);
    const bool has_zero = zero_mode == ZERO_POINTS || zero_mode == ZERO_OFFSETS;
    float2* piece_terms = reinterpret_cast<float2*>(xcodes + (long long)ROWS * H * pieces);
    U4 wv[WR][UP];
    typename S::T sc[WR][UP], zr[WR][UP];
    if (constant)
        qstaged_issue<S, WR, UP, GATED>(wv, sc, zr, q, scale, zero, o0, n, pieces, PER, ngroups, group, 0, lane,
                                        has_zero);
    grid_dependency_sync();
    if (!constant)
        qstaged_issue<S, WR, UP, GATED>(wv, sc, zr, q, scale, zero, o0, n, pieces, PER, ngroups, group, 0, lane,
                                        has_zero);
    // stage x: a thread quantizes 8 consecutive values (qdot_stage); all of x before the first product, or in the
    // interleaved form each turn of the staging just before the round of products that first reads it
    const int total = rows * (k / 8), turns = (total + 32 * WARPS - 1) / (32 * WARPS);
    int staged = INTERLEAVED ? 0 : turns;
    if (!INTERLEAVED) {
        for (int t = 0; t < turns; ++t)  // (a block-wide bound: every lane shuffles)
            qdot_stage<S, BITS, H, false>(x, xcodes, piece_terms, rows, k, pieces, t * 32 * WARPS + threadIdx.x);
        __syncthreads();
    }
    float acc[WR][ROWS];
#pragma unroll
    for (int j = 0; j < WR; ++j)
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[j][r] = 0.0f;
    for (int p0 = 0; p0 < pieces; p0 += 32 * UP) {  // (a block-wide bound)
        if (p0 > 0)
            qstaged_issue<S, WR, UP, GATED>(wv, sc, zr, q, scale, zero, o0, n, pieces, PER, ngroups, group, p0, lane,
                                            has_zero);
        if (INTERLEAVED) {  // the turns holding this round's K range of every row, x's loads beside the weights'
            const int needed = min(turns, (rows * (min(pieces, p0 + 32 * UP) * PER / 8) + 32 * WARPS - 1) /
                                              (32 * WARPS));
            if (needed > staged) {
                for (int t = staged; t < needed; ++t)
                    qdot_stage<S, BITS, H, true>(x, xcodes, piece_terms, rows, k, pieces,
                                                 t * 32 * WARPS + threadIdx.x);
                __syncthreads();
                staged = needed;
            }
        }
#pragma unroll
        for (int u = 0; u < UP; ++u) {
            const int p = p0 + u * 32 + lane;
            if (p >= pieces) break;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r >= rows) break;
                U4 xc[H];
#pragma unroll
                for (int h = 0; h < H; ++h) xc[h] = xcodes[(long long)(r * H + h) * pieces + p];
                const float2 terms = piece_terms[(long long)r * pieces + p];
                const int sum_codes = __float_as_int(terms.y);
#pragma unroll
                for (int j = 0; j < WR; ++j) {
                    const unsigned int* w = &wv[j][u].x;
                    int dot = 0;
                    if (BITS == 4) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const unsigned int* xw = &xc[e / 2].x + (e % 2) * 2;
                            dot = dp4a_us(w[e] & 0x0F0F0F0Fu, xw[0], dot);
                            dot = dp4a_us((w[e] >> 4) & 0x0F0F0F0Fu, xw[1], dot);
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < 4; ++e) dot = dp4a_ss(w[e], (&xc[0].x)[e], dot);
                    }
                    const float s = S::load(sc[j][u]);
                    const float z = has_zero ? S::load(zr[j][u]) : 0.0f;
                    const float b = zero_mode == ZERO_OFFSETS ? z : (zero_mode == ZERO_POINTS ? -s * z : 0.0f);
                    const int centred = BITS == 4 && zero_mode == ZERO_ABSENT ? dot - 8 * sum_codes : dot;
                    acc[j][r] = __fadd_rn(acc[j][r], __fadd_rn(__fmul_rn(s, __fmul_rn(terms.x, (float)centred)),
                                                               __fmul_rn(b, __fmul_rn(terms.x, (float)sum_codes))));
                }
            }
        }
    }
    qstaged_store<S, WR, ROWS, GATED>(acc, bias, out, o0, rows, n, has_bias, act, lane);
}

// gemm_rows<S>: F16 BF16
// gemm_rows<N>: 4 8 16 104 108 116 1004 1104 10004 10008 10104 10108 11004 11104
// gemm_rows<N>: 20004 20008 20104 20108 21004 21104 30004 30008 30104 30108 31004 31104
// out = x W^T + bias for 9 to 64 input rows (a batched decode step's, gemm_rows.GEMM_ROWS_MAX) on the tensor cores.
// N: the weight's bits, 4 or 8 for a quantized weight (dequantized a tile at a time into shared memory), 16 for W
// in the storage type itself (gemm_rows.DENSE_GEMM_ROWS, an A/B against cuBLAS on the decode step's small-N shapes;
// scale and zero unused). A block takes 64 rows of x (4 warps of 16) and 64 outputs, over its share of K (blockIdx.z
// of gridDim.z splits, whole stages of 64). The stages stream through a ring of STAGES slots in shared memory
// (x tile, weight codes, and the 4-byte words holding each half row's scale and zero, all by cp.async), three stages
// in flight while one is multiplied (the first form of this kernel, registers one stage ahead, waited a memory
// latency a stage). Each stage a thread dequantizes 32 weights of one row (within one group: the group is a multiple
// of 32) from the ring into the tile the mma reads, rounded to the storage type as `dequantize` rounds them (two at
// a time by the hardware's cvt), so the products are those of dequantize + a GEMM, mma m16n8k16 with float32 sums
// and ldmatrix fragments; a 16-bit weight is multiplied from its ring slot as it is. The kernel is bound by the
// instructions it issues, not by memory (Nsight Compute, H200, 1B gate/up int4 at 64 rows: 5.8% of DRAM bandwidth,
// 26.3M warp instructions, ~776 a warp a stage in software rounding and per-copy address arithmetic): copies'
// addresses are worked out once, groups counted without division, ~360 a warp a stage (SASS, sm_90).
// With one split the block writes out (and bias); with several it writes its float32 sums to partial[z] and
// gemm_rows_reduce adds the splits in order (the same bits on every run; a row's result never depends on the other
// rows). N + 100: the gated form (gated_linear's and gated_quantized_linear's): W stacks gate rows then up rows (n of
// them in all), a block takes 32 gate rows and the 32 up rows that pair with them, and out [rows, n / 2] is
// act(gate) * up, each half rounded to S with its bias first (`act`: common.cuh's gate_activation), in the block or,
// where K is split, in gemm_rows_reduce. N + 1000 (int4 with no zero array and no offsets: Q4_0's layout): the
// codes dequantized two at a time in the storage type (byte permutes put two codes under the bits of 2^m, one packed
// subtract of 2^m + 8 exact, one packed multiply by the scale rounded once: the same bits as (c - 8) s in float32
// rounded once, in ~2.5 instructions a weight rather than ~5.5; gemm_rows.GEMM_ROWS_PACKED). Needs K a multiple of
// 64, the group of 32, x and W 16-byte aligned, scale and zero 4-byte aligned (gemm_rows.py checks). Dynamic shared
// memory: gemm_rows.shared_bytes. N + 20000 (a quantized weight; gemm_rows.GEMM_ROWS_TWO_TILES): two dequantized
// tiles, so a stage takes one barrier, not two: after it every warp dequantizes the next stage into one tile and
// multiplies this stage from the other, the ALU work of one beside the tensor work of the other across the warps
// (one stage fewer in flight in the ring); the same stages in the same order, so the same bits.
#define ROWS_TILE 64
#define ROWS_K 64
#define ROWS_LD 72      // halves a shared row of x (and of a 16-bit weight): 144 bytes apart, so the mma's fragment
                        // loads (8 rows x 4 words) fall in 32 different banks
#define ROWS_STAGES 4   // ring slots: three stages in flight while one is multiplied (N + 10000: one slot fewer,
                        // a smaller ring for a fourth block an SM; gemm_rows.py's GEMM_ROWS_STAGES)

template <class S, int N>
__global__ void __launch_bounds__(128) gemm_rows(const typename S::T* __restrict__ x,
                                                 const unsigned char* __restrict__ q,
                                                 const typename S::T* __restrict__ scale,
                                                 const typename S::T* __restrict__ zero,
                                                 const typename S::T* __restrict__ bias,
                                                 typename S::T* __restrict__ out,
                                                 float* __restrict__ partial, int rows, int n, int k, int group,
                                                 int zero_mode, int has_bias, int stages_a_split, int act) {
    typedef typename S::T T;
    constexpr int BITS = N % 100;
    constexpr bool GATED = N % 1000 >= 100, QUANTIZED = BITS != 16, PACKED = N % 10000 >= 1000;
    constexpr int STAGES = (N / 10000) % 2 == 1 ? ROWS_STAGES - 1 : ROWS_STAGES;
    constexpr bool TWO_TILES = QUANTIZED && N >= 20000;
    static_assert(!PACKED || BITS == 4, "the packed dequantization is int4's");
    constexpr int ROW_CODES = ROWS_K * BITS / 8;  // bytes of a weight row a stage
    constexpr int PIECES = ROW_CODES / 16;        // their 16-byte pieces: 2, 4 or 8
    constexpr int SLOT_CODES = QUANTIZED ? ROWS_TILE * ROW_CODES : ROWS_TILE * ROWS_LD * 2;  // (16-bit: padded rows)
    extern __shared__ __align__(16) unsigned char smem[];
    T (*xs)[ROWS_TILE][ROWS_LD] = reinterpret_cast<T (*)[ROWS_TILE][ROWS_LD]>(smem);
    unsigned char* codes = smem + STAGES * ROWS_TILE * ROWS_LD * sizeof(T);
    T (*sv)[ROWS_TILE][4] = reinterpret_cast<T (*)[ROWS_TILE][4]>(codes + STAGES * SLOT_CODES);  // scale words
    T (*zv)[ROWS_TILE][4] = sv + STAGES;                                                         // zero words
    T (*wt)[ROWS_TILE][ROWS_LD] = reinterpret_cast<T (*)[ROWS_TILE][ROWS_LD]>(zv + STAGES);  // dequantized stages
    T (*ws)[ROWS_LD] = wt[0];  // (one tile unless TWO_TILES)
    grid_dependency_sync();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.x * ROWS_TILE, m_base = blockIdx.y * ROWS_TILE;
    const int o0 = blockIdx.x * (ROWS_TILE / 2);  // (gated: the block's first output)
    const int first = blockIdx.z * stages_a_split, last = min(k / ROWS_K, first + stages_a_split);
    if (first >= last) return;  // (never: gemm_rows.py sizes the splits so each has stages; kept for safety)
    const int half = n / 2, ngroups = k / group;
    const long long row_bytes = (long long)k * BITS / 8, values = (long long)n * ngroups;
    const bool has_zero = zero_mode == ZERO_POINTS || zero_mode == ZERO_OFFSETS;
    // the weight row that tile row r holds (gated: rows 0-31 gate rows, 32-63 their up rows), 0 where none
    auto weight_row = [&](int r, bool& valid) {
        const int w = GATED ? (r < 32 ? o0 + r : half + o0 + r - 32) : n0 + r;
        valid = GATED ? o0 + (r & 31) < half : w < n;
        return valid ? w : 0;
    };
    // This thread's copies, worked out once: sources at column 0 and shared addresses in slot 0 (a stage adds its
    // columns and its slot). x: 8 pieces of 16 bytes a row, 4 a thread; W: 1, 2 or 4 pieces a thread.
    constexpr int X_COPIES = ROWS_TILE * ROWS_K / 8 / 128, W_COPIES = ROWS_TILE * PIECES / 128;
    constexpr int X_SLOT = ROWS_TILE * ROWS_LD * 2, GROUP_SLOT = ROWS_TILE * 4 * 2;  // bytes a slot
    const T* xsrc[X_COPIES];
    unsigned xdst[X_COPIES];
    bool xok[X_COPIES];
#pragma unroll
    for (int i = 0; i < X_COPIES; ++i) {
        const int p = tid + 128 * i, r = p >> 3, c = (p & 7) * 8;
        xok[i] = m_base + r < rows;
        xsrc[i] = x + (long long)(xok[i] ? m_base + r : 0) * k + c;  // (row 0 where none: in bounds, not read)
        xdst[i] = shared_address(&xs[0][r][c]);
    }
    const unsigned char* wsrc[W_COPIES];
    unsigned wdst[W_COPIES];
    bool wok[W_COPIES];
#pragma unroll
    for (int i = 0; i < W_COPIES; ++i) {
        const int p = tid + 128 * i, r = p / PIECES, c = p % PIECES;
        const long long w = weight_row(r, wok[i]);
        wsrc[i] = q + w * row_bytes + 16 * c;  // (w 0 where none)
        wdst[i] = shared_address(codes + (QUANTIZED ? r * ROW_CODES + 16 * c : (r * ROWS_LD + 8 * c) * 2));
    }
    // The scale and zero of this thread's half row (row tid / 2, columns 32 (tid % 2) .. + 31 of a stage, within one
    // group): its group followed from stage to stage by the copies and by dequantize_stage, each its own count (a
    // stage's 64 columns cross at most two group boundaries; no division a stage).
    const int gr = tid >> 1, gh = tid & 1;
    bool gok;
    const long long gbase = (long long)weight_row(gr, gok) * ngroups;
    const unsigned sdst = shared_address(&sv[0][gr][2 * gh]), zdst = shared_address(&zv[0][gr][2 * gh]);
    struct GroupCount {
        int col, index, next;
        __device__ void start(int column, int group) {
            col = column, index = column / group, next = (index + 1) * group;
        }
        __device__ void step(int group) {
            col += ROWS_K;
            while (col >= next) ++index, next += group;
        }
    } copied, dequantized;
    copied.start(first * ROWS_K + 32 * gh, group);
    dequantized.start(first * ROWS_K + 32 * gh, group);
    auto issue = [&](int stage) {  // the stage into slot stage % STAGES, as one cp.async group
        const int slot = stage % STAGES;
        const long long k0 = (long long)stage * ROWS_K;
#pragma unroll
        for (int i = 0; i < X_COPIES; ++i) copy_async16(xdst[i] + slot * X_SLOT, xsrc[i] + k0, xok[i]);
#pragma unroll
        for (int i = 0; i < W_COPIES; ++i) copy_async16(wdst[i] + slot * SLOT_CODES, wsrc[i] + k0 * BITS / 8, wok[i]);
        if (QUANTIZED) {  // the aligned 4-byte word holding the group's scale (zero)
            const long long word = (gbase + copied.index) & ~1LL;
            const int bytes = !gok ? 0 : word + 1 < values ? 4 : 2;
            copy_async4(sdst + slot * GROUP_SLOT, scale + word, bytes);
            if (has_zero) copy_async4(zdst + slot * GROUP_SLOT, zero + word, bytes);
            copied.step(group);
        }
        cp_async_commit();
    };
    // 32 weights of row tid / 2 into tile ws, as `dequantize` rounds them (a row past the last has zero codes, scale
    // and zero from its copies, so its weights are zeros)
    auto dequantize_stage = [&](int slot, T (*ws)[ROWS_LD]) {
        const int parity = (int)((gbase + dequantized.index) & 1);
        dequantized.step(group);
        const float s = S::load(sv[slot][gr][2 * gh + parity]);
        const float z = has_zero ? S::load(zv[slot][gr][2 * gh + parity]) : (BITS == 4 ? 8.0f : 0.0f);
        const float add = has_zero ? z : 0.0f;
        const bool offsets = zero_mode >= ZERO_OFFSETS;
        const uint4* from =
            reinterpret_cast<const uint4*>(codes + slot * SLOT_CODES + gr * ROW_CODES + gh * ROW_CODES / 2);
        if (PACKED) {  // codes 2 j, 2 j + 1 of a word under 2^m's bits, minus 2^m + 8, times the scale
            const unsigned int scale_bits = sv[slot][gr][2 * gh + parity], s2 = scale_bits | (scale_bits << 16);
            constexpr unsigned int base2 = S::INT_BASE | (S::INT_BASE << 16);
            constexpr unsigned int bias2 = (S::INT_BASE + 8u) | ((S::INT_BASE + 8u) << 16);
            const uint4 c4 = from[0];
            const unsigned int word[4] = {c4.x, c4.y, c4.z, c4.w};
#pragma unroll
            for (int part = 0; part < 4; ++part) {
                const unsigned int even = word[part] & 0x0F0F0F0Fu, odd = (word[part] >> 4) & 0x0F0F0F0Fu;
                unsigned int packed[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // byte i of `even` (code 2 i) low, byte i of `odd` (code 2 i + 1) high
                    const unsigned int pair = __byte_perm(even, odd, i | (i << 4) | ((4 + i) << 8) | ((4 + i) << 12));
                    packed[i] = S::mul2(S::sub2((pair & 0x000F000Fu) | base2, bias2), s2);
                }
                *reinterpret_cast<uint4*>(&ws[gr][32 * gh + 8 * part]) =
                    make_uint4(packed[0], packed[1], packed[2], packed[3]);
            }
            return;
        }
#pragma unroll
        for (int part = 0; part < 4; ++part) {  // 8 weights a part: one 16-byte store into the tile
            const uint4 c4 = from[BITS == 8 ? part / 2 : 0];
            const unsigned int word[4] = {c4.x, c4.y, c4.z, c4.w};
            unsigned int packed[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int at = 8 * part + 2 * i + e;  // the weight's column in the thread's 32
                    const float c = BITS == 8 ? (float)(signed char)((word[(at % 16) / 4] >> (8 * (at % 4))) & 255u)
                                              : (float)((word[at / 8] >> (4 * (at % 8))) & 15u);
                    v[e] = offsets ? c * s + add : (c - z) * s;
                }
                packed[i] = S::pack2(v[0], v[1]);
            }
            *reinterpret_cast<uint4*>(&ws[gr][32 * gh + 8 * part]) =
                make_uint4(packed[0], packed[1], packed[2], packed[3]);
        }
    };
    float acc[ROWS_TILE / 8][4] = {};
    const int g = lane >> 2, t2 = (lane & 3) * 2, m0 = warp * 16;
    const bool busy = m_base + m0 < rows;  // (a warp whose 16 rows are past the last only copies and dequantizes)
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {  // (an empty group past the last stage keeps the count the wait uses)
        if (first + i < last) issue(first + i); else cp_async_commit();
    }
    if (TWO_TILES) {  // the first stage dequantized before the loop; then one barrier a stage
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        dequantize_stage(first % STAGES, wt[first & 1]);
        for (int stage = first; stage < last; ++stage) {
            cp_async_wait<STAGES - 3>();  // this thread's copies of stage + 1 landed
            __syncthreads();  // everyone's, and this stage's tile; every warp is done with the last stage's slots
            if (stage + STAGES - 1 < last) issue(stage + STAGES - 1); else cp_async_commit();
            if (stage + 1 < last) dequantize_stage((stage + 1) % STAGES, wt[(stage + 1) & 1]);
            if (busy) mma_stage<S, ROWS_K>(acc, xs[stage % STAGES], wt[stage & 1], m0, lane);
        }
    }
    for (int stage = TWO_TILES ? last : first; stage < last; ++stage) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of `stage` landed
        __syncthreads();  // everyone's; and every warp is done with the last stage's slot and tile
        if (stage + STAGES - 1 < last) issue(stage + STAGES - 1); else cp_async_commit();
        const int slot = stage % STAGES;
        if (QUANTIZED) {
            dequantize_stage(slot, ws);
            __syncthreads();
        }
        if (busy)
            mma_stage<S, ROWS_K>(acc, xs[slot],
                                 QUANTIZED ? ws : reinterpret_cast<T (*)[ROWS_LD]>(codes + slot * SLOT_CODES), m0,
                                 lane);
    }
    if (!busy) return;
    constexpr int GATES = ROWS_TILE / 16;  // (gated: fragments j < GATES are gate rows, j + GATES their up rows)
#pragma unroll
    for (int h8 = 0; h8 < 2; ++h8) {  // rows g and g + 8 of the warp's 16
        const int r = m_base + m0 + g + 8 * h8;
        if (r >= rows) continue;
        float gate[GATES][2];  // (gated: the gate rows' sums with their bias, rounded to S, for the up rows after)
#pragma unroll
        for (int j = 0; j < ROWS_TILE / 8; ++j) {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                // the weight row this sum multiplied (gated: o's gate row, or its up row half + o)
                const int o = GATED ? o0 + 8 * (j % GATES) + t2 + i : n0 + 8 * j + t2 + i;
                const int c = GATED && j >= GATES ? half + o : o;
                if (o >= (GATED ? half : n)) continue;
                const float v = acc[j][2 * h8 + i];
                if (gridDim.z > 1) {  // (gemm_rows_reduce adds the bias and, gated, the activation)
                    partial[((long long)blockIdx.z * rows + r) * n + c] = v;
                    continue;
                }
                const float rounded = S::load(S::store(v + (has_bias ? S::load(bias[c]) : 0.0f)));
                if (!GATED)
                    out[(long long)r * n + c] = S::store(rounded);
                else if (j < GATES)
                    gate[j][i] = rounded;
                else
                    out[(long long)r * half + o] = S::store(gate_activation(gate[j - GATES][i], act) * rounded);
            }
        }
    }
}

// gemm_rows_reduce<S>: F16 BF16
// out[r, c] = partial[0][r, c] + ... + partial[splits - 1][r, c] + bias[c], in split order, rounded once; with act
// (gated_activation's code, > 0) out [rows, n / 2] = act(gate) * up from the summed gate and up columns, each
// rounded with its bias first, as gemm_rows's gated form writes them.
template <class S>
__global__ void gemm_rows_reduce(const float* __restrict__ partial, const typename S::T* __restrict__ bias,
                                 typename S::T* __restrict__ out, int rows, int n, int splits, int has_bias, int act) {
    grid_dependency_sync();
    const long long plane = (long long)rows * n;
    const int width = act ? n / 2 : n;
    const long long total = (long long)rows * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / width;
        const int c = (int)(i - r * width);
        float v = 0.0f, u = 0.0f;
        for (int z = 0; z < splits; ++z) {
            v += partial[z * plane + r * n + c];
            if (act) u += partial[z * plane + r * n + width + c];
        }
        v += has_bias ? S::load(bias[c]) : 0.0f;
        if (act) {
            const float up = S::load(S::store(u + (has_bias ? S::load(bias[width + c]) : 0.0f)));
            out[i] = S::store(gate_activation(S::load(S::store(v)), act) * up);
        } else {
            out[i] = S::store(v);
        }
    }
}
