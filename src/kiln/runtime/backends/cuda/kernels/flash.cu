// Attention of several queries (prefill) on the tensor cores, flash-style: the scores of a tile of queries
// against a tile of keys live in registers, the softmax runs online over the key tiles, and neither scores nor
// probabilities ever reach memory. Key tiles past the causal limit are not visited and tiles the mask hides from
// every query of the tile are neither read nor multiplied, so a prompt written into a long cache costs what the
// prompt's own keys cost.
//
// A block serves FLASH_M query rows of one kv head: its 4 warps own 16 rows each. The rows of a kv head's group
// of q heads are stacked (row r is query r % queries of the group's q head r / queries), so k and v are read once
// per group, never repeated. Each key tile (FLASH_N keys) is copied to shared memory by the whole block; the
// products are mma.sync m16n8k16 with float32 accumulation; the probabilities are rounded to the storage type
// before the product with v, as the products path rounds them.
//
// Slot runs (slots given): the queries are rows of a slotted decode step ([rows, Hq, 1, E] seen through q's strides
// as [rows / queries, Hq, queries, E]), and block z serves rows z * queries .. + queries - 1 if they are one prompt
// run (common.cuh's slot_run: one slot, consecutive positions p0 ..): it reads that slot's keys, query j seeing
// keys up to p0 + j. A block whose rows are not a run returns at once (decode.cu takes those rows).

#define FLASH_M 64
#define FLASH_N 64
#define FLASH_THREADS 128

// flash_attention<S>: F16 BF16
// flash_attention<N>: 32 64 80 96 128

#define LOG2E 1.4426950408889634f

// 2^x by the special-function unit (relative error ~2^-22; the probabilities are rounded to 16 bits after it).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The mask of 32 keys (k0 + first ...) of one query row as bytes (1 = visible; keys past the end and rows past the
// last are 0), in 8 words. A bool mask whose rows are 16-byte aligned (mask_aligned) is read 16 bytes at a time.
__device__ __forceinline__ void mask_words(unsigned* words, const void* mask, int mask_kind, bool mask_aligned,
                                           long long row_offset, bool row_live, long long m_j, int key0, int keys) {
    if (mask_kind == MASK_BOOL && mask_aligned && row_live && key0 + 32 <= keys) {
        const U4* src = reinterpret_cast<const U4*>(static_cast<const unsigned char*>(mask) + row_offset + key0);
        const U4 a = src[0], b = src[1];
        words[0] = a.x, words[1] = a.y, words[2] = a.z, words[3] = a.w;
        words[4] = b.x, words[5] = b.y, words[6] = b.z, words[7] = b.w;
        return;
    }
#pragma unroll
    for (int w = 0; w < 8; ++w) {
        words[w] = 0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int key = key0 + 4 * w + c;
            if (!row_live || key >= keys) continue;
            const long long at = row_offset + key * m_j;
            const bool ok = mask_kind == MASK_BOOL ? static_cast<const unsigned char*>(mask)[at] != 0
                                                   : static_cast<const float*>(mask)[at] != -KILN_INF;
            words[w] |= (unsigned)ok << (8 * c);
        }
    }
}

#define FLASH_FLAG_WORDS 32  // which key tiles the mask shows any query of the block: the first 1024 tiles

// Thread (warp w, lane = 4 g + t) holds, of its warp's 16 rows, rows g and g + 8 (x = 0, 1), and of each 8-key
// slice j of a key tile the keys 8 j + 2 t + c (c = 0, 1): score s[j][2 x + c].
//
// Before the products the block finds which key tiles the mask shows to any of its queries (every thread reads
// 32 keys of one row per tile, several tiles in flight), so hidden tiles cost one read of their mask and no
// barrier. Then the visible tiles are visited two-stage: the next tile's k, v and mask are copied (cp.async)
// while the current one is multiplied. Shared memory (dynamic, flash_smem_bytes in attention.py):
// k and v [2 stages][FLASH_N][E + 8], the mask as bytes [2][FLASH_M][FLASH_N + 16].
template <class S, int E>
__global__ void __launch_bounds__(FLASH_THREADS, 2) flash_attention(
    const typename S::T* __restrict__ q, const typename S::T* __restrict__ k, const typename S::T* __restrict__ v,
    const void* __restrict__ mask, typename S::T* __restrict__ out, long long qs0, long long qs1, long long qs2,
    long long ks0, long long ks1, long long ks2, long long vs0, long long vs1, long long vs2, int mask_kind,
    int mask_aligned, long long m_b, long long m_h, long long m_i, long long m_j, int groups, int queries, int keys,
    float scale, int causal, long long os0, long long os1, long long os2, const long long* __restrict__ slots,
    const long long* __restrict__ positions, int slot_count) {
    grid_dependency_sync();
    typedef typename S::T T;
    constexpr int PAD = E + 8;  // a row of 2 E + 16 bytes: the 8 rows a fragment load touches fall in distinct banks
    constexpr int KSTEPS = E / 16, ESLICES = E / 8, PIECES = E / 8, SEEN = FLASH_N + 16;
    extern __shared__ __align__(16) unsigned char flash_smem[];
    T (*k_tile)[FLASH_N][PAD] = reinterpret_cast<T (*)[FLASH_N][PAD]>(flash_smem);
    T (*v_tile)[FLASH_N][PAD] = reinterpret_cast<T (*)[FLASH_N][PAD]>(flash_smem + 2 * FLASH_N * PAD * sizeof(T));
    unsigned char (*seen)[FLASH_M][SEEN] =
        reinterpret_cast<unsigned char (*)[FLASH_M][SEEN]>(flash_smem + 4 * FLASH_N * PAD * sizeof(T));
    __shared__ unsigned tile_flags[FLASH_FLAG_WORDS];

    const int kv_head = blockIdx.y, b = blockIdx.z;
    long long kv_row = b;  // the k/v row this block reads (a slot, for slot runs)
    int offset = 0;        // the causal limit of query j is j + offset (a run's first position)
    if (slots != nullptr) {
        const long long first = (long long)b * queries;
        if (!slot_run(slots, positions, first, queries, slot_count)) return;  // (the same answer in every thread)
        kv_row = slots[first];
        offset = (int)positions[first];
    }
    const int rows = groups * queries;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * FLASH_M;  // the last queries see the most keys: they start first
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    // Row r of the block is query r % queries of q head kv_head * groups + r / queries; rows past the end compute
    // a copy of the last row and store nothing.
    auto locate = [&](int r, int& h, int& query) {
        const int rr = min(r, rows - 1);
        h = kv_head * groups + rr / queries;
        query = rr % queries;
    };
    int query[2];
    bool live[2];
    long long mask_row[2];
    const T* q_row[2];
    T* out_row[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const int r = r0 + warp * 16 + g + 8 * x;
        int h;
        locate(r, h, query[x]);
        live[x] = r < rows;
        q_row[x] = q + b * qs0 + h * qs1 + query[x] * qs2;
        out_row[x] = out + b * os0 + h * os1 + query[x] * os2;
        mask_row[x] = b * m_b + h * m_h + query[x] * m_i;
    }
    // the mask row (and half of each tile's keys) this thread reads for the block
    int fill_h, fill_query;
    locate(r0 + (threadIdx.x >> 1), fill_h, fill_query);
    const bool fill_live = r0 + (threadIdx.x >> 1) < rows;
    const long long fill_row = b * m_b + fill_h * m_h + fill_query * m_i;
    const int fill_first = (threadIdx.x & 1) * 32;

    unsigned qf[KSTEPS][4];  // this warp's 16 x E queries as mma A fragments, read once
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        const int col = 16 * s + 2 * t;
        qf[s][0] = *reinterpret_cast<const unsigned*>(q_row[0] + col);
        qf[s][1] = *reinterpret_cast<const unsigned*>(q_row[1] + col);
        qf[s][2] = *reinterpret_cast<const unsigned*>(q_row[0] + col + 8);
        qf[s][3] = *reinterpret_cast<const unsigned*>(q_row[1] + col + 8);
    }
    float acc[ESLICES][4];
#pragma unroll
    for (int n = 0; n < ESLICES; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float top[2] = {-KILN_INF, -KILN_INF}, sum[2] = {0.0f, 0.0f};

    // With a causal limit no query of the tile sees past its largest query index.
    const int last = min(r0 + FLASH_M, rows) - 1;
    const int last_query = r0 / queries == last / queries ? last % queries : queries - 1;
    const int end = causal ? min(keys, last_query + offset + 1) : keys;
    const int tiles = (end + FLASH_N - 1) / FLASH_N;
    const float* float_mask = static_cast<const float*>(mask);
    const float scale2 = scale * LOG2E;  // scores in base 2: exp(s) = 2^(s log2 e), one ex2 instruction each
    const T* k_head = k + kv_row * ks0 + kv_head * ks1;
    const T* v_head = v + kv_row * vs0 + kv_head * vs1;

    if (mask_kind != MASK_NONE) {
        if (threadIdx.x < FLASH_FLAG_WORDS) tile_flags[threadIdx.x] = 0;
        __syncthreads();
        const int flagged = min(tiles, FLASH_FLAG_WORDS * 32);
        for (int t0 = 0; t0 < flagged; t0 += 4) {
            unsigned any[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                unsigned words[8];
                any[u] = 0;
                if (t0 + u < flagged) {
                    mask_words(words, mask, mask_kind, mask_aligned, fill_row, fill_live, m_j,
                               (t0 + u) * FLASH_N + fill_first, keys);
#pragma unroll
                    for (int w = 0; w < 8; ++w) any[u] |= words[w];
                }
            }
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (any[u]) atomicOr(&tile_flags[(t0 + u) >> 5], 1u << ((t0 + u) & 31));
        }
        __syncthreads();
    }
    auto next_visible = [&](int after) {  // the same answer in every thread
        for (int tile = after + 1; tile < tiles; ++tile)
            if (mask_kind == MASK_NONE || tile >= FLASH_FLAG_WORDS * 32 || (tile_flags[tile >> 5] >> (tile & 31) & 1u))
                return tile;
        return -1;
    };
    // A bool mask's 32 bytes this thread reads of a tile come by cp.async where aligned and inside the keys;
    // otherwise they are read and written in the tile's turn.
    auto mask_async = [&](int tile) {
        return mask_kind == MASK_BOOL && mask_aligned && fill_live && tile * FLASH_N + fill_first + 32 <= keys;
    };
    auto issue = [&](int tile, int stage) {
        const int k0 = tile * FLASH_N;
        for (int p = threadIdx.x; p < FLASH_N * PIECES; p += FLASH_THREADS) {
            const int key = p / PIECES, col = (p % PIECES) * 8;
            const bool valid = k0 + key < keys;  // keys past the end: zeros (probability 0, and 0 * v must be 0)
            const long long at = valid ? (long long)(k0 + key) : 0;
            copy_async16(&k_tile[stage][key][col], k_head + at * ks2 + col, valid);
            copy_async16(&v_tile[stage][key][col], v_head + at * vs2 + col, valid);
        }
        if (mask_async(tile)) {
            const unsigned char* src = static_cast<const unsigned char*>(mask) + fill_row + k0 + fill_first;
            copy_async16(&seen[stage][threadIdx.x >> 1][fill_first], src, true);
            copy_async16(&seen[stage][threadIdx.x >> 1][fill_first + 16], src + 16, true);
        }
        cp_async_commit();
    };

    int tile = next_visible(-1), stage = 0;
    if (tile >= 0) issue(tile, 0);
    for (; tile >= 0; stage ^= 1) {
        const int following = next_visible(tile), k0 = tile * FLASH_N;
        __syncthreads();  // every warp is done with the other stage's tile before it is refilled
        if (following >= 0) issue(following, stage ^ 1);
        else cp_async_commit();  // (an empty group, so that one wait serves both cases)
        if (mask_kind != MASK_NONE && !mask_async(tile)) {
            unsigned words[8];
            mask_words(words, mask, mask_kind, mask_aligned, fill_row, fill_live, m_j, k0 + fill_first, keys);
            unsigned* dst = reinterpret_cast<unsigned*>(&seen[stage][threadIdx.x >> 1][fill_first]);
#pragma unroll
            for (int w = 0; w < 8; ++w) dst[w] = words[w];
        }
        cp_async_wait<1>();
        __syncthreads();
        tile = following;

        float s[8][4];  // scores: s[j] = rows g, g + 8 against keys 8 j + 2 t + {0, 1}
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int st = 0; st < KSTEPS; ++st) {
                const T* kr = &k_tile[stage][8 * j + g][16 * st + 2 * t];
                mma16816<S>(s[j], qf[st], *reinterpret_cast<const unsigned*>(kr),
                            *reinterpret_cast<const unsigned*>(kr + 8));
            }
        }
#pragma unroll
        for (int x = 0; x < 2; ++x) {
            const unsigned char* seen_row = seen[stage][warp * 16 + g + 8 * x];
            float tile_top = -KILN_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int key = k0 + 8 * j + 2 * t;
                const unsigned pair = mask_kind == MASK_NONE ? 0x0101u
                                      : *reinterpret_cast<const unsigned short*>(seen_row + 8 * j + 2 * t);
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    float& sv = s[j][2 * x + c];
                    const bool ok = (pair >> (8 * c) & 1u) && key + c < keys &&
                                    (!causal || key + c <= query[x] + offset);
                    if (ok) {
                        sv *= scale2;
                        if (mask_kind == MASK_FLOAT) sv += LOG2E * float_mask[mask_row[x] + (key + c) * m_j];
                    } else {
                        sv = -KILN_INF;
                    }
                    tile_top = fmaxf(tile_top, sv);
                }
            }
            tile_top = fmaxf(tile_top, __shfl_xor_sync(0xffffffffu, tile_top, 1));
            tile_top = fmaxf(tile_top, __shfl_xor_sync(0xffffffffu, tile_top, 2));
            const float new_top = fmaxf(top[x], tile_top);
            const float base = new_top == -KILN_INF ? 0.0f : new_top;  // nothing seen yet: every p is 0
            const float rescale = exp2_approx(top[x] - base);
            top[x] = new_top;
            sum[x] *= rescale;
#pragma unroll
            for (int n = 0; n < ESLICES; ++n) acc[n][2 * x] *= rescale, acc[n][2 * x + 1] *= rescale;
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float p = exp2_approx(s[j][2 * x + c] - base);
                    s[j][2 * x + c] = p;
                    sum[x] += p;
                }
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {  // 16 keys at a time: slices 2 kk and 2 kk + 1 form the A fragment
            const unsigned a[4] = {S::pack2(s[2 * kk][0], s[2 * kk][1]), S::pack2(s[2 * kk][2], s[2 * kk][3]),
                                   S::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                   S::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const int key = 16 * kk + (lane >> 3 & 1) * 8 + (lane & 7);
#pragma unroll
            for (int n = 0; n < ESLICES; n += 2) {  // v's B fragments of two 8-wide slices in one ldmatrix
                unsigned bv[4];
                load_matrices<true>(bv, &v_tile[stage][key][8 * (n + (lane >> 4))]);
                mma16816<S>(acc[n], a, bv[0], bv[1]);
                mma16816<S>(acc[n + 1], a, bv[2], bv[3]);
            }
        }
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        float total = sum[x] + __shfl_xor_sync(0xffffffffu, sum[x], 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const float inv = 1.0f / total;  // a query that sees no key: 0 / 0, NaN, as softmax over -inf gives
        if (!live[x]) continue;
#pragma unroll
        for (int n = 0; n < ESLICES; ++n)
            *reinterpret_cast<unsigned*>(out_row[x] + 8 * n + 2 * t) =
                S::pack2(acc[n][2 * x] * inv, acc[n][2 * x + 1] * inv);
    }
}
