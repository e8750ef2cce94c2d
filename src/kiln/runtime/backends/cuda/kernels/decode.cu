// One-query attention (a decode step) over a KV cache, flash-decoding style: the keys split in chunks (`chunk`
// keys, a multiple of DECODE_CHUNK, chosen by attention.py), a block per (chunk, kv head, batch) serving the q heads
// of its kv head (k and v read once per group), and a second kernel combining the chunks' softmax partials. Where
// the batch has few kv heads, `parts` blocks share a kv head's group, `groups` q heads each (blockIdx.y = kv head *
// parts + part): each block's chain of dependent math is that much shorter (attention.py's DECODE_HEADS).
//
// The kernel is built for latency, not throughput: at batch 1 a layer's whole cache is a few MB, so what costs is
// the chain of dependent steps. Every lane issues all its 16-byte k and v loads of a phase before using any; a key
// row of E values is read by E / PER16 lanes at once (8 lanes for E = 64 in half precision: a warp reads 4 keys
// per load); each lane keeps a running max, sum and output per head over its keys (online softmax, no shared
// scores), merged across lanes by shuffles and across warps once at the end.
//
// q [B, Hkv * G, 1, E] contiguous; k, v [B, Hkv, S, E], unit stride on E, rows 16-byte aligned (strides kb, kh,
// ks in elements); mask (kind 0 none, 1 bool keep, 2 additive float32) read through strides mb, mh, ms. A key
// that the mask hides from every head of the group (false, or -inf) is not read: a static cache's unwritten
// slots cost nothing, and a chunk with no visible key only writes an empty partial. part [B, Hq, splits, E + 2]
// gets each head's unnormalized output, its max score and its exp-sum.
//
// A serving program's cache of several sequences (slot_attention) is read in place: with `slots`, query row b
// reads cache row slots[b] (a slot outside [0, slot_count) reads nothing: NaN, as a query that sees no key), and
// with `positions`, it sees keys up to positions[b] (and, with a window > 0, none before positions[b] - window + 1),
// so a chunk past a sequence's length costs one empty partial whatever the cache's length. With `run_rows` > 0,
// rows in an aligned group of that many that is one prompt run (common.cuh's slot_run) are left to flash.cu: their
// chunks write empty partials, and flash.cu writes their output after the combine.

#define DECODE_WARPS 4    // warps per block (attention.py's DECODE_THREADS / 32)
#define DECODE_CHUNK 64   // the fewest keys per block (attention.py's DECODE_CHUNK; 32, 128 and 256 measured within
                          // 1.5 us for one sequence)
#define DECODE_LOADS 4    // key rows each lane has in flight per phase

// The mask's additive term for key s of q head h: 0 or -inf for a bool mask, the value for a float one.
__device__ __forceinline__ float mask_term(const void* mask, int kind, long long at) {
    if (kind == MASK_BOOL) return static_cast<const unsigned char*>(mask)[at] ? 0.0f : -KILN_INF;
    if (kind == MASK_FLOAT) return static_cast<const float*>(mask)[at];
    return 0.0f;
}

// (m, l, o) of one head merged with another partial (m2, l2, o2): both rescaled to the larger max.
template <int V>
__device__ __forceinline__ void merge_partial(float& m, float& l, float* o, float m2, float l2, const float* o2) {
    const float top = fmaxf(m, m2);
    if (top == -KILN_INF) return;  // neither saw a key
    const float a = expf(m - top), b = expf(m2 - top);
    l = l * a + l2 * b;
#pragma unroll
    for (int i = 0; i < V; ++i) o[i] = o[i] * a + o2[i] * b;
    m = top;
}

// Asks L2 for the key and value rows [s0, s1) of one head (rows ks and vs elements apart, e elements each): the
// block's share of a layer's cache, which the weights streamed since the last step have pushed out to DRAM. With a
// mask (`kind`; key s's term at at + s * ms, the block's first q head), only the keys it shows: most of a single
// sequence's static cache is slots not yet written, and asking for them streamed the whole cache every step (an 8B
// shape's 4096-slot cache: ~0.5 GB a step; attention.DECODE_PREFETCH_VISIBLE). Read before the wait, the mask is a
// hint here, as the prefetch is.
template <class S>
__device__ __forceinline__ void prefetch_cache_rows(const typename S::T* keys, long long ks,
                                                    const typename S::T* values, long long vs, int e, int s0, int s1,
                                                    const void* mask, int kind, long long at, long long ms) {
    const int lines = (int)((e * sizeof(typename S::T) + 127) / 128);
    const char* kbase = reinterpret_cast<const char*>(keys);
    const char* vbase = reinterpret_cast<const char*>(values);
    for (int i = threadIdx.x; i < (s1 - s0) * lines; i += blockDim.x) {
        const long long s = s0 + i / lines;
        if (kind != MASK_NONE && mask_term(mask, kind, at + s * ms) == -KILN_INF) continue;
        prefetch_line(kbase + s * ks * (long long)sizeof(typename S::T) + (i % lines) * 128);
        prefetch_line(vbase + s * vs * (long long)sizeof(typename S::T) + (i % lines) * 128);
    }
}

// The keys [s0, s1) a block of the decode kernels reads for query row b and the cache row it reads them from: its
// chunk cut at the row's position (and window), none for a slot outside the cache. With `balance` (and positions),
// the chunks are the row's own: its visible keys [lo, positions[b]] in `splits` equal pieces of whole 16-key steps,
// at least `chunk` keys each, so a batch far below the cache's length keeps every block busy (the fixed chunks of
// the cache's length leave the blocks past every position with nothing to read). HINT: before
// grid_dependency_sync, the positions and slots read through L2 as they stand (for prefetches only).
template <bool HINT>
__device__ __forceinline__ void decode_keys(int split, int splits, int chunk, bool balance, int seq, int b,
                                            const long long* positions, const long long* slots, int slot_count,
                                            int window, int& s0, int& s1, long long& row) {
    s0 = split * chunk, s1 = min(seq, s0 + chunk), row = b;
    if (positions != nullptr) {
        const long long last = HINT ? __ldcg(positions + b) : positions[b];
        if (balance) {
            const long long hi = min((long long)seq, last + 1), lo = window > 0 ? max(0LL, last - window + 1) : 0;
            const long long per = max((long long)chunk, ((max(hi - lo, 0LL) + splits - 1) / splits + 15) / 16 * 16);
            s0 = (int)min(hi, lo + split * per), s1 = (int)min(hi, s0 + per);
            s1 = max(s0, s1);
        } else {
            s1 = (int)max((long long)s0, min((long long)s1, last + 1));
            if (window > 0) s0 = (int)min((long long)s1, max((long long)s0, last - window + 1));
        }
    }
    if (slots != nullptr) {
        row = HINT ? __ldcg(slots + b) : slots[b];
        if (row < 0 || row >= slot_count) s1 = s0, row = 0;
    }
}

// The block's partial of each of its `groups` tile rows from its warps' (max, exp-sum) and unnormalized outputs in
// shared memory: part row (qh + g, split) = the outputs merged to the warps' largest max, that max, the exp-sum.
// With `per` > 0 (attend_mma's packed prompt runs) tile row g is head g % per of the query `g / per` rows on,
// whose heads start `stride` part rows further.
template <int G, int W>
__device__ __forceinline__ void store_block_partial(const float (&merged)[DECODE_WARPS][G][2],
                                                    const float (&out_s)[DECODE_WARPS][G][W], float* part,
                                                    long long qh, int groups, int e, int splits, int split,
                                                    int per = 0, long long stride = 0) {
    for (int i = threadIdx.x; i < groups * e; i += DECODE_WARPS * 32) {
        const int g = i / e, c = i - g * e;
        float top = -KILN_INF;
#pragma unroll
        for (int w = 0; w < DECODE_WARPS; ++w) top = fmaxf(top, merged[w][g][0]);
        float sum = 0.0f, acc = 0.0f;
        if (top != -KILN_INF) {
#pragma unroll
            for (int w = 0; w < DECODE_WARPS; ++w) {
                const float a = expf(merged[w][g][0] - top);
                sum += merged[w][g][1] * a;
                acc += out_s[w][g][c] * a;
            }
        }
        const long long at = per > 0 ? qh + (g / per) * stride + g % per : qh + g;
        float* row = part + (at * splits + split) * (e + 2);
        row[c] = acc;
        if (c == 0) row[e] = top, row[e + 1] = sum;
    }
}

// attend_chunk<N>: 1 2 4 8
// Before its wait, a block asks L2 for its chunk's key and value rows (where the query's row and last position
// are, read through L2 as they stand: the kernel before writes at most the newest key, and L2 is coherent), so the
// first phase after the wait reads them from L2, not DRAM.
// (G, the group size its registers hold: q heads per kv head up to 1, 2, 4 or 8)
template <class S, int G>
__global__ void __launch_bounds__(DECODE_WARPS * 32) attend_chunk(const typename S::T* __restrict__ q, const typename S::T* __restrict__ k,
                             const typename S::T* __restrict__ v, const void* __restrict__ mask,
                             float* __restrict__ part, int groups, int seq, int e, float scale, long long kb,
                             long long kh, long long ks, long long vb, long long vh, long long vs, int mask_kind,
                             long long mb, long long mh, long long ms, int splits,
                             const long long* __restrict__ slots, const long long* __restrict__ positions,
                             int slot_count, int window, int chunk, int run_rows, int parts, int visible_only,
                             int balance) {
    {
        const int b = blockIdx.z, hk = blockIdx.y / parts;
        int s0, s1;
        long long row;
        decode_keys<true>(blockIdx.x, splits, chunk, balance, seq, b, positions, slots, slot_count, window, s0, s1,
                          row);
        if (s1 > s0)
            prefetch_cache_rows<S>(k + row * kb + hk * kh, ks, v + row * vb + hk * vh, vs, e, s0, s1, mask,
                                   visible_only ? mask_kind : MASK_NONE, b * mb + (long long)blockIdx.y * groups * mh,
                                   ms);
    }
    grid_dependency_sync();
    constexpr int V = S::PER16;
    __shared__ float merged[DECODE_WARPS][G][2];
    __shared__ float out_s[DECODE_WARPS][G][256];
    const int pieces = e / V;  // 16-byte pieces per row, at most 32
    int lpk = 1;               // lanes per key row: a power of two, so a key's lanes are one shuffle group
    while (lpk < pieces) lpk <<= 1;
    const int kpw = 32 / lpk;  // keys a warp reads per load
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int sub = lane & (lpk - 1), slot = lane / lpk;
    const bool reads = sub < pieces;
    const int split = blockIdx.x, hk = blockIdx.y / parts, b = blockIdx.z;  // (the block's kv head)
    const int heads = gridDim.y * groups;
    int s0, s1;
    long long row;  // the cache row this query reads
    decode_keys<false>(split, splits, chunk, balance, seq, b, positions, slots, slot_count, window, s0, s1, row);
    if (slots != nullptr) {
        const long long group = b / max(run_rows, 1) * run_rows;
        if (run_rows > 0 && group + run_rows <= gridDim.z && slot_run(slots, positions, group, run_rows, slot_count))
            s1 = s0;  // flash.cu attends to this row with the rest of its run
    }
    const int h0 = blockIdx.y * groups;               // the block's first q head
    const long long qh = (long long)b * heads + h0;  // its row in q and part

    float qf[G][V];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        U4 u = {0u, 0u, 0u, 0u};
        if (g < groups && reads) u = *reinterpret_cast<const U4*>(q + (qh + g) * e + sub * V);
        S::unpack(u, qf[g]);
#pragma unroll
        for (int i = 0; i < V; ++i) qf[g][i] *= scale;
    }
    float m[G], l[G], o[G][V];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -KILN_INF, l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < V; ++i) o[g][i] = 0.0f;
    }
    const typename S::T* kp = k + row * kb + hk * kh + sub * V;
    const typename S::T* vp = v + row * vb + hk * vh + sub * V;
    const int step = DECODE_WARPS * kpw;  // keys the block reads per load
    // the loop bound is the warp's, not the lane's: every lane must reach the shuffles below
    for (int first = s0 + warp * kpw; first < s1; first += step * DECODE_LOADS) {
        const int base = first + slot;
        float term[DECODE_LOADS][G];
        bool seen[DECODE_LOADS];
#pragma unroll
        for (int j = 0; j < DECODE_LOADS; ++j) {
            const int s = base + j * step;
            seen[j] = false;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                term[j][g] = -KILN_INF;
                if (g < groups && s < s1) {
                    term[j][g] = mask_term(mask, mask_kind, b * mb + (long long)(h0 + g) * mh + s * ms);
                    seen[j] |= term[j][g] != -KILN_INF;
                }
            }
        }
        U4 kr[DECODE_LOADS], vr[DECODE_LOADS];
#pragma unroll
        for (int j = 0; j < DECODE_LOADS; ++j) {
            const long long s = base + j * step;
            kr[j] = vr[j] = U4{0u, 0u, 0u, 0u};
            if (seen[j] && reads) {
                kr[j] = *reinterpret_cast<const U4*>(kp + s * ks);
                vr[j] = *reinterpret_cast<const U4*>(vp + s * vs);
            }
        }
        // the phase's scores first, all of them (their shuffles overlap), then one rescale per head
        float score[DECODE_LOADS][G];
#pragma unroll
        for (int j = 0; j < DECODE_LOADS; ++j) {
            float kf[V];
            S::unpack(kr[j], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float a = 0.0f;
#pragma unroll
                for (int i = 0; i < V; ++i) a += qf[g][i] * kf[i];
                score[j][g] = a;
            }
        }
        for (int off = 1; off < lpk; off <<= 1) {
#pragma unroll
            for (int j = 0; j < DECODE_LOADS; ++j) {
#pragma unroll
                for (int g = 0; g < G; ++g) score[j][g] += __shfl_xor_sync(0xffffffffu, score[j][g], off);
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float top = m[g];
#pragma unroll
            for (int j = 0; j < DECODE_LOADS; ++j) {
                score[j][g] += term[j][g];  // -inf for a hidden or absent key
                top = fmaxf(top, score[j][g]);
            }
            if (top == -KILN_INF) continue;  // nothing seen yet
            const float a = expf(m[g] - top);
            l[g] *= a;
#pragma unroll
            for (int i = 0; i < V; ++i) o[g][i] *= a;
#pragma unroll
            for (int j = 0; j < DECODE_LOADS; ++j) {
                const float p = expf(score[j][g] - top);
                float vf[V];
                S::unpack(vr[j], vf);
                l[g] += p;
#pragma unroll
                for (int i = 0; i < V; ++i) o[g][i] += p * vf[i];
            }
            m[g] = top;
        }
    }
    // merge the lanes that read other keys (same sub, other slot), then the warps
    for (int off = lpk; off < 32; off <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float o2[V];
#pragma unroll
            for (int i = 0; i < V; ++i) o2[i] = __shfl_xor_sync(0xffffffffu, o[g][i], off);
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], off), l2 = __shfl_xor_sync(0xffffffffu, l[g], off);
            merge_partial<V>(m[g], l[g], o[g], m2, l2, o2);
        }
    }
    if (slot == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (reads) {
#pragma unroll
                for (int i = 0; i < V; ++i) out_s[warp][g][sub * V + i] = o[g][i];
            }
            if (sub == 0) merged[warp][g][0] = m[g], merged[warp][g][1] = l[g];
        }
    }
    __syncthreads();
    store_block_partial<G, 256>(merged, out_s, part, qh, groups, e, splits, split);
}

// attend_mma: the decode kernel's work (one query per sequence, keys split in chunks, a block per chunk, kv head and
// sequence, the same partials for attend_combine) on the tensor cores, with no mask (slot_attention's decode step)
// or one every head shares (a single sequence's decode over its static cache). attend_chunk spends ~48
// instructions a key a warp where the arithmetic is 16 FMAs (each key's lanes add their sums in shuffle rounds per
// head, every lane of a key computes its exp): at a serving step's 64 rows it runs at a quarter of the bandwidth,
// bound by instructions (Nsight, H200: 4,773 a warp, issue 41%). Here a warp takes 16 keys a step: scores = q k^T
// as an m16n8k16 product with the group's q heads as the tile's rows (rows 8-15 only for groups of 9-16: N + 1000),
// its 16 keys as two n-tiles, the online softmax on the score fragments, and o += p v with the scores' fragments as
// the A operand (rounded to the storage type, as flash.cu's) and v's as B: ~200 SASS instructions a step, ~12 a key.
//
// No shared memory is staged: each lane loads its operands from global memory already in fragment order, by two
// permutations the sums cannot see. Along the head dim of q k^T: lane (g = lane / 4, t = lane % 4) of key g holds
// 16-byte pieces t, t + 4, .. of the key row, and its k-step s fragment is words 2 s and 2 s + 1 of those pieces;
// q's A fragment takes the same words of q's row, so a logical column pairs the same physical dims of q and k.
// Along the output dim of p v: lane g loads pieces g, g + 8, .. of v's rows for keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9
// (the keys of its A fragment), and n-tile u's column g is dim 8 (g + 8 (u / 8)) + u % 8: one byte permute a
// register packs a pair of keys' halves. The next step's keys are loaded while this step computes (head dim 64).
//
// Packed prompt runs (N + 16000, slot steps without a mask or window, groups of at most 8): a serving step's prompt
// rows are runs of one slot at consecutive positions, and each read the same keys. An aligned group of
// P = 16 / groups rows that is such a run (common.cuh's slot_run) is served by its first row's block alone, the
// tile's rows holding its P queries' heads (tile row m: query m / groups of the run, head m % groups), each row
// seeing keys up to its own position: the run's keys and values are read once, not P times. The other rows'
// blocks return; rows outside such groups are served as before (the tile's rows past the group idle, and their
// half of the online softmax is skipped: a block-uniform test, so the shuffles stay whole).
#define MMA_STEP 16  // keys a warp takes per step
// attend_mma<S>: F16 BF16
// attend_mma<N>: 64 128 1064 1128 2064 2128 3064 3128 4064 4128 5064 5128 8064 9064 10064 11064 12064 13064 16064 16128 24064
// (N: the head dim, + 1000 for groups of 9 to 16 q heads, + 2000 a bool mask, + 4000 a float mask: no mask's steps
// pay nothing for it; + 8000: head dim 64 without the next step in flight, for fewer registers; + 16000: packed
// prompt runs)
template <class S, int N>
__global__ void __launch_bounds__(DECODE_WARPS * 32) attend_mma(
    const typename S::T* __restrict__ q, const typename S::T* __restrict__ k, const typename S::T* __restrict__ v,
    float* __restrict__ part, int groups, int seq, float scale, long long kb, long long kh, long long ks,
    long long vb, long long vh, long long vs, const void* __restrict__ mask, long long mb, long long ms, int splits,
    const long long* __restrict__ slots, const long long* __restrict__ positions, int slot_count, int window,
    int chunk, int run_rows, int visible_only, int balance) {
    constexpr int E = N % 1000;
    constexpr bool PACK = (N / 16000) % 2 == 1;           // packed prompt runs (see above)
    constexpr bool WIDE = PACK || (N / 1000) % 2 == 1;   // the tile's rows 8-15 hold heads (of the group or a run)
    constexpr int MASK = (N / 2000) % 4;        // MASK_NONE, MASK_BOOL or MASK_FLOAT
    static_assert(!PACK || MASK == MASK_NONE, "packed prompt runs are slot steps: no mask");
    constexpr int H = WIDE ? 16 : 8;    // rows of the tile that hold heads
    constexpr int KP = E / 32;          // pieces of a key row a lane holds (of q k^T)
    constexpr int VP = E / 64;          // pieces of a value row a lane holds (of p v)
    constexpr int KSTEPS = E / 16;      // k16 steps of q k^T
    constexpr int DTILES = E / 8;       // n8 tiles of p v
    constexpr bool PIPE = E <= 64 && (N / 8000) % 2 == 0;  // the next step's loads in flight during this one
    const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    {
        int s0, s1;
        long long row;
        decode_keys<true>(split, splits, chunk, balance, seq, b, positions, slots, slot_count, window, s0, s1, row);
        if (s1 > s0)
            prefetch_cache_rows<S>(k + row * kb + hk * kh, ks, v + row * vb + hk * vh, vs, E, s0, s1, mask,
                                   visible_only ? MASK : MASK_NONE, b * mb, ms);
    }
    grid_dependency_sync();
    __shared__ float merged[DECODE_WARPS][H][2];
    __shared__ float out_s[DECODE_WARPS][H][E];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int s0, s1;
    long long row;
    // packed: this block serves the P rows of a prompt run from b (P = 16 / groups), `served` tile rows
    const long long heads_q = (long long)gridDim.y * groups;  // q heads a row
    int served = groups, per = 0;
    if (PACK && slots != nullptr) {
        const int runs = 16 / groups;
        const long long group = b / runs * runs;
        if (runs > 1 && group + runs <= gridDim.z && slot_run(slots, positions, group, runs, slot_count)) {
            if (b != group) return;  // the run's first row's block serves this row
            served = runs * groups, per = groups;
        }
    }
    decode_keys<false>(split, splits, chunk, balance, seq, per ? b + served / per - 1 : b, positions, slots,
                       slot_count, window, s0, s1, row);
    if (slots != nullptr && run_rows > 0) {
        const long long group = b / run_rows * run_rows;
        if (group + run_rows <= gridDim.z && slot_run(slots, positions, group, run_rows, slot_count))
            s1 = s0;  // flash.cu attends to this row with the rest of its run
    }
    const long long qh = (long long)b * heads_q + (long long)hk * groups;  // the group's first q row
    // tile row m's q row (packed: head m % groups of the query m / groups rows on)
    auto q_row = [&](int m) { return per ? qh + (m / per) * heads_q + m % per : qh + m; };
    // packed: the last key each of this lane's tile rows (g, g + 8) sees, its query's position
    int last_key[2] = {0, 0};  // (positions below the cache's length: ints)
    if (PACK && per) {
        const int first_position = (int)positions[b];
        last_key[0] = first_position + g / per, last_key[1] = first_position + (g + 8) / per;
    }

    // q's A fragment of each k-step: rows g and g + 8 (heads past the group zero), lane t's pieces t, t + 4, ..
    unsigned qf[KSTEPS][4];
#pragma unroll
    for (int i = 0; i < KP; ++i) {
        U4 u = {0u, 0u, 0u, 0u}, w = {0u, 0u, 0u, 0u};
        if (g < served) u = *reinterpret_cast<const U4*>(q + q_row(g) * E + (t + 4 * i) * 8);
        if (WIDE && g + 8 < served) w = *reinterpret_cast<const U4*>(q + q_row(g + 8) * E + (t + 4 * i) * 8);
        qf[2 * i][0] = u.x, qf[2 * i][1] = w.x, qf[2 * i][2] = u.y, qf[2 * i][3] = w.y;
        qf[2 * i + 1][0] = u.z, qf[2 * i + 1][1] = w.z, qf[2 * i + 1][2] = u.w, qf[2 * i + 1][3] = w.w;
    }
    // A step's operands: keys first + g and first + 8 + g (pieces t + 4 i), values of keys first + 2 t, + 1, + 8,
    // + 9 (pieces g + 8 i), and those four keys' mask terms (-inf past s1), which are this lane's scores' keys. A
    // key past s1 or hidden by the mask (one for every head: its head stride is 0) is not loaded: its registers
    // keep an earlier step's values (or the zeros they start with), finite, so its value times its zero weight is
    // 0; its score is -inf. Each operand's address is worked out once and moved a step of the warp's keys at a time.
    constexpr int STRIDE = DECODE_WARPS * MMA_STEP;
    int next = s0 + warp * MMA_STEP;  // the first key of the next step to load
    const long long kstep = STRIDE * ks, vstep = STRIDE * vs;
    const typename S::T* kq[2];
    const typename S::T* vq[4];
#pragma unroll
    for (int j = 0; j < 2; ++j) kq[j] = k + row * kb + hk * kh + (next + 8 * j + g) * ks + t * 8;
#pragma unroll
    for (int c = 0; c < 4; ++c) vq[c] = v + row * vb + hk * vh + (next + 2 * t + (c & 1) + 8 * (c >> 1)) * vs + g * 8;
    const long long mrow = (long long)b * mb;
    auto term = [&](int s) { return s < s1 ? (MASK ? mask_term(mask, MASK, mrow + s * ms) : 0.0f) : -KILN_INF; };
    auto load = [&](U4 (&kr)[2][KP], U4 (&vr)[4][VP], float (&tv)[4], int& first_key) {
        first_key = next;
#pragma unroll
        for (int c = 0; c < 4; ++c) tv[c] = term(next + 2 * t + (c & 1) + 8 * (c >> 1));
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (term(next + 8 * j + g) != -KILN_INF) {
#pragma unroll
                for (int i = 0; i < KP; ++i) kr[j][i] = *reinterpret_cast<const U4*>(kq[j] + 32 * i);
            }
            kq[j] += kstep;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            if (tv[c] != -KILN_INF) {
#pragma unroll
                for (int i = 0; i < VP; ++i) vr[c][i] = *reinterpret_cast<const U4*>(vq[c] + 64 * i);
            }
            vq[c] += vstep;
        }
        next += STRIDE;
    };
    float m[2] = {-KILN_INF, -KILN_INF}, l[2] = {0.0f, 0.0f};  // rows g and g + 8, log2 units; l this lane's keys
    float o[DTILES][4];
#pragma unroll
    for (int u = 0; u < DTILES; ++u) o[u][0] = o[u][1] = o[u][2] = o[u][3] = 0.0f;
    const float scale2 = scale * 1.4426950408889634f;  // scores in log2 units: exp2 is one instruction
    // one step: the scores of keys first .. first + 15, the online softmax, o += p v
    const float mask2 = 1.4426950408889634f;  // a float mask's terms in log2 units
    auto attend = [&](const U4 (&kr)[2][KP], const U4 (&vr)[4][VP], const float (&tv)[4], int first_key) {
        float sc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const unsigned* kw = reinterpret_cast<const unsigned*>(kr[j]);
#pragma unroll
            for (int st = 0; st < KSTEPS; ++st) mma16816<S>(sc[j], qf[st], kw[2 * st], kw[2 * st + 1]);
        }
        // rows g (values 0, 1 of each n-tile) and g + 8 (2, 3); value i of a row is key first + 8 (i / 2) + 2 t + i % 2
        unsigned pa[4] = {0u, 0u, 0u, 0u};  // the A fragment of p v: rows g, g + 8 at keys 2 t .., then 2 t + 8 ..
#pragma unroll
        for (int r = 0; r < (WIDE ? 2 : 1); ++r) {
            if (PACK && r == 1 && !per) break;  // a block of one row: the tile's rows 8-15 hold no head (block-uniform)
            float x[4], top = -KILN_INF;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[i] = tv[i] == -KILN_INF ? -KILN_INF : sc[i >> 1][2 * r + (i & 1)] * scale2 + tv[i] * mask2;
                if (PACK && per && first_key + 8 * (i >> 1) + 2 * t + (i & 1) > last_key[r]) x[i] = -KILN_INF;
                top = fmaxf(top, x[i]);
            }
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
            top = fmaxf(top, m[r]);
            const float base = top == -KILN_INF ? 0.0f : top;  // nothing seen yet: every p and the rescale are 0
            const float alpha = exp2f(m[r] - base);
            float p[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) p[i] = exp2f(x[i] - base);
            l[r] = l[r] * alpha + (p[0] + p[1]) + (p[2] + p[3]);
            m[r] = top;
            if (__any_sync(0xffffffffu, alpha != 1.0f)) {  // (once the maxima settle, most steps rescale nothing)
#pragma unroll
                for (int u = 0; u < DTILES; ++u) o[u][2 * r] *= alpha, o[u][2 * r + 1] *= alpha;
            }
            pa[r] = S::pack2(p[0], p[1]);
            pa[2 + r] = S::pack2(p[2], p[3]);
        }
#pragma unroll
        for (int u = 0; u < DTILES; ++u) {
            const int i = u / 8, word = (u % 8) / 2;
            const unsigned sel = (u & 1) ? 0x7632u : 0x5410u;  // the high halves or the low halves of two words
            const unsigned* w0 = reinterpret_cast<const unsigned*>(&vr[0][i]);
            const unsigned* w1 = reinterpret_cast<const unsigned*>(&vr[1][i]);
            const unsigned* w2 = reinterpret_cast<const unsigned*>(&vr[2][i]);
            const unsigned* w3 = reinterpret_cast<const unsigned*>(&vr[3][i]);
            mma16816<S>(o[u], pa, __byte_perm(w0[word], w1[word], sel), __byte_perm(w2[word], w3[word], sel));
        }
    };
    U4 ka[2][KP], va[4][VP], kb2[2][KP], vb2[4][VP];  // two steps' operands (PIPE: one loads while one computes)
    float ta[4], tb[4];
    int fa = 0, fb = 0;  // the first key of the step each holds
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < KP; ++i) ka[j][i] = kb2[j][i] = U4{0u, 0u, 0u, 0u};
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
        for (int i = 0; i < VP; ++i) va[c][i] = vb2[c][i] = U4{0u, 0u, 0u, 0u};
    // the loop bounds are the warp's: every lane reaches the shuffles
    if (PIPE) {
        if (next < s1) load(ka, va, ta, fa);
        for (int first = s0 + warp * MMA_STEP; first < s1; first += 2 * STRIDE) {
            if (next < s1) load(kb2, vb2, tb, fb);
            attend(ka, va, ta, fa);
            if (first + STRIDE >= s1) break;
            if (next < s1) load(ka, va, ta, fa);
            attend(kb2, vb2, tb, fb);
        }
    } else {
        for (int first = s0 + warp * MMA_STEP; first < s1; first += STRIDE) {
            load(ka, va, ta, fa);
            attend(ka, va, ta, fa);
        }
    }
    // this warp's rows to shared memory: (max, exp-sum) in natural units, outputs at their dims
#pragma unroll
    for (int r = 0; r < (WIDE ? 2 : 1); ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int h = g + 8 * r;
        if (t == 0) merged[warp][h][0] = m[r] * 0.6931471805599453f, merged[warp][h][1] = l[r];
#pragma unroll
        for (int u = 0; u < DTILES; ++u) {
#pragma unroll
            for (int i = 0; i < 2; ++i) out_s[warp][h][8 * (2 * t + i + 8 * (u / 8)) + u % 8] = o[u][2 * r + i];
        }
    }
    __syncthreads();
    store_block_partial<H, E>(merged, out_s, part, qh, served, E, splits, split, per, heads_q);
}

// Combines the chunks: out [B, Hq, 1, E] = sum_i w_i o_i / sum_i w_i l_i with w_i = exp(m_i - M), a block per
// (batch, q head): the weights once into shared memory, then each warp sums a quarter of the chunks for every
// output element, and the warps' sums are added in a fixed order. A query that sees no key gives NaN, as softmax
// over only -inf does.
// The kernel is a chain of dependent steps, and what costs is its round trips to memory. With few chunks (a warp's
// share at most COMBINE_HELD) every load of the block is issued at once, before any is used: each thread's chunk
// max and exp-sum and each warp's output pieces, held in registers while the block reduces the maxima. One round
// trip, not two (the old order read the pieces only once the weights were known). More chunks take the loop.
// N: 32-lane columns of the head dim (E <= 32 N), attention.py's COMBINE_COLUMNS.
#define COMBINE_THREADS 128       // attention.py's COMBINE_THREADS
#define COMBINE_MAX_SPLITS 1024   // attention.py's COMBINE_MAX_SPLITS
#define COMBINE_HELD 8            // chunks a warp holds in registers
// attend_combine<N>: 1 2 4 8
template <class S, int N>
__global__ void __launch_bounds__(COMBINE_THREADS) attend_combine(const float* __restrict__ part,
                                                                  typename S::T* __restrict__ out, int e, int splits) {
    grid_dependency_sync();
    constexpr int WARPS = COMBINE_THREADS / 32;
    __shared__ float weight[COMBINE_MAX_SPLITS];
    __shared__ float sums[WARPS][32 * N];
    const long long row = blockIdx.x;
    const float* p = part + row * splits * (e + 2);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const bool held = splits <= WARPS * COMBINE_HELD;
    float own_m = -KILN_INF, own_l = 0.0f;  // chunk threadIdx.x's, when held
    float pieces[COMBINE_HELD][N];
    if (held) {
        if (threadIdx.x < splits) {
            own_m = p[threadIdx.x * (e + 2) + e];
            own_l = p[threadIdx.x * (e + 2) + e + 1];
        }
#pragma unroll
        for (int k = 0; k < COMBINE_HELD; ++k) {
            const int i = warp + k * WARPS;
#pragma unroll
            for (int j = 0; j < N; ++j) {
                const int c = lane + 32 * j;
                pieces[k][j] = i < splits && c < e ? p[i * (e + 2) + c] : 0.0f;
            }
        }
    }
    float top = own_m;
    if (!held) {
        for (int i = threadIdx.x; i < splits; i += COMBINE_THREADS) top = fmaxf(top, p[i * (e + 2) + e]);
    }
    top = block_max(top);
    float den = 0.0f;
    for (int i = threadIdx.x; i < splits; i += COMBINE_THREADS) {
        const float m = held ? own_m : p[i * (e + 2) + e];
        const float w = m == -KILN_INF ? 0.0f : expf(m - top);
        weight[i] = w;
        den += w * (held ? own_l : p[i * (e + 2) + e + 1]);
    }
    den = block_sum(den);  // (its barriers also publish weight[]); 0 when no key is seen: 0 / 0 = NaN below
    float acc[N];
#pragma unroll
    for (int j = 0; j < N; ++j) acc[j] = 0.0f;
    if (held) {
#pragma unroll
        for (int k = 0; k < COMBINE_HELD; ++k) {
            const int i = warp + k * WARPS;
            const float w = i < splits ? weight[i] : 0.0f;
            if (w == 0.0f) continue;
#pragma unroll
            for (int j = 0; j < N; ++j) acc[j] += w * pieces[k][j];
        }
    } else {
#pragma unroll 4
        for (int i = warp; i < splits; i += WARPS) {
            const float w = weight[i];
            if (w == 0.0f) continue;
#pragma unroll
            for (int j = 0; j < N; ++j)
                if (lane + 32 * j < e) acc[j] += w * p[i * (e + 2) + lane + 32 * j];
        }
    }
#pragma unroll
    for (int j = 0; j < N; ++j)
        if (lane + 32 * j < e) sums[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    for (int c = threadIdx.x; c < e; c += COMBINE_THREADS) {
        float num = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) num += sums[w][c];
        out[row * e + c] = S::store(num / den);
    }
}
