"""Attention on the GPU: one-token decode attention split over the keys (decode.cu: attend_chunk on the CUDA cores,
attend_mma on the tensor cores), a serving step's sequences read in their KV-cache slots in place (slot_attention),
several queries (prefill) in float16/bfloat16 flash-style on the tensor cores (flash.cu), other types as two cuBLAS
products around one fused masked softmax (softmax.cu), and the portable sdpa (products on cuBLAS) for what none
takes. RoPE and the KV-cache writes are rope.py's."""

from __future__ import annotations

import math
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import BFLOAT16, slot_visibility, upcast
from kiln.runtime.backends.array_api import sdpa as portable_sdpa
from kiln.runtime.backends.array_api import slot_attention as portable_slot_attention
from kiln.runtime.backends.cuda import cublas, nvrtc
from kiln.runtime.backends.cuda.kernels.linalg import matmul_cublas
from kiln.runtime.backends.cuda.kernels.registry import elements, kernel


@kernel("sdpa")
def sdpa(q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, *, causal: bool, scale: float | None) -> Any:
    """softmax(q k^T * scale + mask) v: one query per head by the split-key decode kernel, several by the flash
    kernel (float16/bfloat16) or two cuBLAS products around the fused masked softmax, anything else by the
    portable path (products on cuBLAS).

    The keys the mask hides are skipped on the device (the decode kernel reads the mask before k and v), not by
    narrowing the cache on the host as the CPU kernel does: that needs the mask on the host, and the
    synchronization per layer cost more than it saved (SmolLM2-shaped decode at 128 of 512 slots on an H100: 78.6
    ms with it, 73.1 without).

    With sinks (gpt-oss), the portable path: no kernel here takes a sink logit yet."""
    if sinks is None and _decode_attention_applies(q, k, v, mask, causal):
        return _decode_attention(q, k, v, mask, scale)
    if sinks is None and _flash_attention_applies(q, k, v, mask):
        return _flash_attention(q, k, v, mask, causal, scale)
    if sinks is None and _grouped_attention(q, k, v, mask) and cublas.supports(q.dtype):
        return _products_attention(q, k, v, mask, causal, scale)
    dtype = q.dtype
    q, k, v, mask, sinks = upcast(q, k, v, mask, sinks)
    return portable_sdpa(cp, q, k, v, mask, causal, scale, matmul=matmul_cublas,
                         sinks=sinks).astype(dtype, copy=False)


@kernel("slot_attention")
def slot_attention(q: Any, k_cache: Any, v_cache: Any, slots: Any, positions: Any, sinks: Any = None, *,
                   scale: float, window: int = 0) -> Any:
    """A decode step (one query per sequence) by the split-key decode kernel reading each sequence's slot in
    place, up to its own position (no gather, no host read of the positions, so a CUDA graph holds it); several
    queries per sequence (a prefill chunk) by the flash kernel over the gathered slots with the positions as a bool
    mask built on the device (key tiles past the last position are skipped there), or, for types flash.cu does
    not take and with sinks (gpt-oss), by the portable composition over the whole slot (cuBLAS products)."""
    keys, values = cp.swapaxes(k_cache, 1, 2), cp.swapaxes(v_cache, 1, 2)  # [N, Hkv, L, E] views
    if sinks is None and _slot_decode_applies(q, keys, values, slots, positions):
        groups = q.shape[1] // keys.shape[1]
        packs = _mma_takes(q, True, groups) and _packs_runs(q.shape[0], keys.shape[0], groups, slots, window,
                                                            MASK_NONE)
        run = 0 if packs else _slot_runs_apply(q, keys, values, window)
        if not run and _slot_flash_applies(q, keys, values, window):
            out = cp.empty(q.shape, dtype=q.dtype)
            _slot_runs_attention(out, q if q.flags.c_contiguous else cp.ascontiguousarray(q), keys, values, slots,
                                 positions, 1, scale)
            return out
        out = _decode_attention(q, keys, values, None, scale, slots=slots, positions=positions, window=window,
                                run_rows=run)
        if run:
            _slot_runs_attention(out, q if q.flags.c_contiguous else cp.ascontiguousarray(q), keys, values, slots,
                                 positions, run, scale)
        return out
    k_rows, v_rows = k_cache[slots], v_cache[slots]  # [B, L, Hkv, E]
    keys, values = cp.swapaxes(k_rows, 1, 2), cp.swapaxes(v_rows, 1, 2)
    if sinks is None and positions.shape == q.shape[:1] + q.shape[2:3] and \
            _flash_attention_applies(q, keys, values, None):
        visible = slot_visibility(cp.arange(keys.shape[2]), positions, window)
        return _flash_attention(q, keys, values, visible, False, scale)
    dtype = q.dtype
    q, keys, values, sinks = upcast(q, k_rows, v_rows, sinks)
    return portable_slot_attention(cp, q, keys, values, positions, 0, scale, window, matmul=matmul_cublas,
                                   sinks=sinks).astype(dtype, copy=False)


def _slot_decode_applies(q: Any, keys: Any, values: Any, slots: Any, positions: Any) -> bool:
    """One query per sequence, int64 slots [B] and positions [B, 1] (or [B]), contiguous, and q and the caches
    (keys, values: [N, Hkv, L, E] views) as the decode kernel takes them."""
    if q.ndim != 4 or keys.ndim != 4 or q.shape[2] != 1 or not nvrtc.supports(q, keys, values):
        return False
    if slots.dtype != cp.int64 or positions.dtype != cp.int64 or slots.size != q.shape[0] or \
            positions.size != q.shape[0] or not (slots.flags.c_contiguous and positions.flags.c_contiguous):
        return False
    if 0 in q.shape + keys.shape or keys.shape[3] != q.shape[3] or q.shape[1] % keys.shape[1]:
        return False
    return _decode_kernel_takes(q, keys, values)


NULL = np.uint64(0)  # a pointer argument the kernel does not read
MASK_NONE, MASK_BOOL, MASK_FLOAT = 0, 1, 2  # as common.cuh numbers them for the attention kernels


def _grouped_attention(q: Any, k: Any, v: Any, mask: Any) -> bool:
    """What both fused attention paths take: 4-d q/k/v of one storage type, q heads a multiple of kv heads (grouped
    per kv head, k/v never repeated), no empty dim, and a bool or float mask of at most 4 dims."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or not nvrtc.supports(q, k, v) or 0 in q.shape + k.shape + v.shape:
        return False
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or q.shape[1] % k.shape[1]:
        return False
    return mask is None or (mask.ndim <= 4 and (mask.dtype == cp.bool_ or mask.dtype.kind == "f"))


def _mask_operand(mask: Any, shape: tuple[int, ...], placeholder: Any) -> tuple[np.int32, Any, list[np.int64]]:
    """The mask as the attention kernels read it: its kind, the array (placeholder without one: a pointer the
    kernel never reads) and its strides in elements over [batch, q head, query, key], 0 along broadcast dims."""
    if mask is None:
        return np.int32(MASK_NONE), placeholder, [np.int64(0)] * 4
    if mask.dtype != cp.bool_ and mask.dtype != cp.float32:
        mask = mask.astype(cp.float32)
    mask = cp.broadcast_to(mask, shape)
    kind = MASK_BOOL if mask.dtype == cp.bool_ else MASK_FLOAT
    return np.int32(kind), mask, elements(mask.strides, mask.itemsize)


def _products_attention(q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None) -> Any:
    """q k^T on cuBLAS into float32 scores (q heads grouped per kv head: no repeated k/v), one fused pass for
    scale, causal limit, mask and softmax that writes the probabilities in q's type, and their product with v.
    The scores are written and read once, where the portable path made about ten passes over them."""
    b, hq, queries, e = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = hq // kv_heads
    grouped = q.reshape(b, kv_heads, groups * queries, e)
    scores = cublas.matmul(grouped, cp.swapaxes(k, -1, -2),
                           out=cp.empty((b, kv_heads, groups * queries, keys), dtype=cp.float32))
    probs = cp.empty(scores.shape, dtype=q.dtype)
    kind, mask_arg, strides = _mask_operand(mask, (b, hq, queries, keys), scores)
    threads = 128 if keys <= 1024 else 256
    nvrtc.function("softmax", "masked_softmax", q.dtype)(
        (b * hq * queries,), (threads,),
        (scores, probs, mask_arg, kind, *strides, np.int32(kv_heads), np.int32(groups),
         np.int32(queries), np.int32(keys), np.float32(1 / math.sqrt(e) if scale is None else scale),
         np.int32(causal)))
    return cublas.matmul(probs, v).reshape(b, hq, queries, v.shape[3])


FLASH_M, FLASH_N, FLASH_THREADS = 64, 64, 128  # as flash.cu defines them
FLASH_WIDTHS = (32, 64, 80, 96, 128)  # the head widths flash.cu is instantiated for
FLASH_TYPES = (np.dtype(np.float16), BFLOAT16)


def _rows_of_16_bytes(*arrays: Any) -> bool:
    """Whether each array's rows (along its last dim, which must be contiguous) can be read 16 bytes at a time."""
    return all(a.strides[-1] == a.itemsize and a.data.ptr % 16 == 0 and all(st % 16 == 0 for st in a.strides[:-1])
               for a in arrays)


def _flash_attention_applies(q: Any, k: Any, v: Any, mask: Any) -> bool:
    """float16/bfloat16 with a head width flash.cu is instantiated for, k and v rows readable 16 bytes at a time
    and q's 4 (its fragments are loaded as pairs)."""
    if not _grouped_attention(q, k, v, mask) or q.dtype not in FLASH_TYPES or q.shape[3] not in FLASH_WIDTHS:
        return False
    if k.shape != v.shape or not _rows_of_16_bytes(k, v):
        return False
    return q.strides[3] == q.itemsize and q.data.ptr % 4 == 0 and all(st % 4 == 0 for st in q.strides[:3])


def _flash_attention(q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None) -> Any:
    """flash.cu: a block per FLASH_M rows of a kv head's stacked group of q heads (k and v read once per group), the
    key tiles the causal limit or the mask hide skipped."""
    b, hq, queries, e = q.shape
    hkv, keys = k.shape[1], k.shape[2]
    groups = hq // hkv
    out = cp.empty((b, hq, queries, e), dtype=q.dtype)
    kind, mask_b, ms = _mask_operand(mask, (b, hq, queries, keys), q)
    qs, ks, vs = (elements(a.strides, a.itemsize) for a in (q, k, v))
    # a bool mask whose rows the kernel can copy 16 bytes at a time
    aligned = kind == MASK_BOOL and ms[3] == 1 and mask_b.data.ptr % 16 == 0 and all(m % 16 == 0 for m in ms[:3])
    row_tiles = (groups * queries + FLASH_M - 1) // FLASH_M
    smem = flash_smem_bytes(e, q.itemsize)
    nvrtc.function("flash", "flash_attention", q.dtype, e)(
        (row_tiles, hkv, b), (FLASH_THREADS,),
        (q, k, v, mask_b, out, *qs[:3], *ks[:3], *vs[:3], kind, np.int32(aligned), *ms, np.int32(groups),
         np.int32(queries), np.int32(keys), np.float32(1 / math.sqrt(e) if scale is None else scale), np.int32(causal),
         np.int64(hq * queries * e), np.int64(queries * e), np.int64(e), NULL, NULL, np.int32(0)),
        shared_mem=smem)
    return out


SLOT_RUNS = True
"""Prompt runs in slotted decode steps by flash.cu (False: the decode kernel for every row; benchmarks compare)."""
SLOT_RUNS_ABOVE = 256
"""Steps of more rows than this take the flash.cu path for their prompt runs. Measured on the H100
(benchmarks/gpu_slot_decode.py --compare-slot-runs, Llama-3.2-1B shape, 64 decode rows at position 400, the rest
prompt runs of 128 tokens): step at 64 / 128 / 192 / 320 rows 2.281 / 3.189 / 3.517 / 4.508 ms with it, 2.209 /
2.755 / 3.384 / 4.986 without. flash.cu gives each run one block per kv head and group of rows, walking all its
keys in turn: with few runs there are too few blocks to fill the GPU (a split over the keys, partials combined
with the decode rows', is what would make it pay at every size)."""


SLOT_FLASH_ROWS_ABOVE: int | None = None
"""Steps of more rows than this (and not more than SLOT_RUNS_ABOVE, where prompt runs take flash.cu a group of
rows at a time) attend every row by flash.cu (a block per row and kv head: a run of one query), decode.cu and its
combine not launched; None: never. An A/B not yet measured (benchmarks/gpu_slot_decode.py
--compare-slot-flash): at 64 decode rows at position 400 (1B shape, H200) decode.cu reads the step's keys and values
at about a quarter of the bandwidth (slot_attention 833 of a 2465 us step, op by op), whatever its chunking (the
H100's DECODE_BLOCKS table); flash.cu streams each row's key tiles through shared memory to the tensor cores.
The rows of a slot outside the cache are left unwritten there (decode.cu writes NaN), which a step's padding rows
never read back."""


def _flash_takes_slot_rows(q: Any, keys: Any, values: Any, window: int) -> bool:
    """Whether flash.cu can attend this step's rows as slot runs: its type, head width and layout, no window (a
    run's limit is causal only)."""
    e = q.shape[3]
    if window or q.dtype not in FLASH_TYPES or e not in FLASH_WIDTHS or keys.shape != values.shape or \
            not _rows_of_16_bytes(keys, values):
        return False
    return not (q.strides[3] != q.itemsize or q.data.ptr % 4 or any(st % 4 for st in q.strides[:3]))


def _slot_flash_applies(q: Any, keys: Any, values: Any, window: int) -> bool:
    """Every row of this step by flash.cu (SLOT_FLASH_ROWS_ABOVE)."""
    return (SLOT_FLASH_ROWS_ABOVE is not None and q.shape[0] > SLOT_FLASH_ROWS_ABOVE
            and _flash_takes_slot_rows(q, keys, values, window))


def _slot_runs_apply(q: Any, keys: Any, values: Any, window: int) -> int:
    """The rows of a flash.cu slot-run group for this step (0: none): FLASH_M // group size, where flash.cu takes
    the rows (_flash_takes_slot_rows) and the step has more than SLOT_RUNS_ABOVE rows."""
    b, hq = q.shape[:2]
    if not SLOT_RUNS or not _flash_takes_slot_rows(q, keys, values, window):
        return 0
    run = FLASH_M // (hq // keys.shape[1])
    return run if b > SLOT_RUNS_ABOVE and b >= run else 0


def _slot_runs_attention(out: Any, q: Any, keys: Any, values: Any, slots: Any, positions: Any, run: int,
                         scale: float) -> None:
    """flash.cu over the step's aligned groups of `run` rows that are prompt runs (one slot, consecutive positions),
    written into `out` [rows, Hq, 1, E] over what the decode kernel left there for them; other groups return at
    once. A group's rows are q seen as [groups, Hq, run, E] through strides (row r = group * run + query)."""
    rows, hq, _, e = q.shape
    hkv = keys.shape[1]
    qs, ks, vs = (elements(a.strides, a.itemsize) for a in (q, keys, values))
    nvrtc.function("flash", "flash_attention", q.dtype, e)(
        (1, hkv, rows // run), (FLASH_THREADS,),
        (q, keys, values, q, out, qs[0] * run, qs[1], qs[0], *ks[:3], *vs[:3], np.int32(MASK_NONE), np.int32(0),
         *[np.int64(0)] * 4, np.int32(hq // hkv), np.int32(run), np.int32(keys.shape[2]), np.float32(scale),
         np.int32(1), np.int64(run * hq * e), np.int64(e), np.int64(hq * e), slots, positions,
         np.int32(keys.shape[0])),
        shared_mem=flash_smem_bytes(e, q.itemsize))


def flash_smem_bytes(e: int, itemsize: int) -> int:
    """flash.cu's dynamic shared memory: k and v tiles in two stages ([FLASH_N][e + 8] each) and the mask bytes of
    two tiles ([FLASH_M][FLASH_N + 16] each)."""
    return 4 * FLASH_N * (e + 8) * itemsize + 2 * FLASH_M * (FLASH_N + 16)


DECODE_CHUNK, DECODE_THREADS, DECODE_GROUPS = 64, 128, (1, 2, 4, 8)  # as decode.cu defines and instantiates them
DECODE_BLOCKS = 1024
"""Blocks of decode.cu a batch's chunking aims at (decode_chunk). Measured on the H100 (benchmarks/gpu_slot_decode.py,
Llama-3.2-1B shape, bfloat16, 64 sequences at position 400 of 1024): slot_attention's GPU time per step 1319 us with
64-key chunks (8192 blocks), 827 with 1024 blocks, 828 with 512, 826 with 256; one sequence's step is unchanged
(it keeps 64-key chunks below 1024 blocks)."""
COMBINE_THREADS, COMBINE_MAX_SPLITS, COMBINE_COLUMNS = 128, 1024, (1, 2, 4, 8)  # decode.cu's attend_combine
DECODE_HEADS = 2
"""q heads a block of decode.cu serves at most while the batch's (sequence, kv head) pairs are fewer than
DECODE_SPLIT_HEADS_BELOW: a kv head's group of q heads is then shared by several blocks (each reads the same keys,
from L2 after the first), so a block's chain of dependent math is shorter where few blocks hold data. Measured on
an H200 (benchmarks/gpu_decode_attention.py; Qwen3-30B-A3B's 32/4 heads of 128, cache 1280, bfloat16): 14.67 /
10.18 / 8.04 us at context 128 with 8 / 4 / 2 heads a block, 15.00 / 10.57 / 8.94 at 1024; Llama-3.2-1B's 32/8 of
64: 7.66 / 7.66 / 6.31 at 128. Chunks of 32 keys were slower with 2 heads a block (9.52 us at 128), and combining the
chunks in the last block of each group (a counter per group, no attend_combine) slower in every configuration
(10.26 us with 2 heads: the 16 last blocks' combine is less parallel than attend_combine's 32 blocks)."""
DECODE_SPLIT_HEADS_BELOW = 64

DECODE_PREFETCH_VISIBLE = True
"""Whether the decode kernels, asking L2 for their chunk's key and value rows before they wait, skip the keys the mask
hides (a single sequence's static cache: slots not yet written), as they skip reading them after. Before, every
step asked DRAM for the whole cache (1B shape at a 4096-slot cache: 134 MB a step whatever the context). Measured
on an H200 (1B int4 decode at context 128 of 4096 slots): 0.641 ms a step with it, 0.643 without: within noise,
kept since it reads less (the benchmarks' "prefetch-all" configuration sets it False)."""

SLOT_BALANCED_CHUNKS = False
"""Whether slot_attention's decode rows split their own visible keys (positions[b] + 1, or the window) into the
step's chunks, each at least DECODE_CHUNK keys (decode.cu's decode_keys with `balance`), rather than chunks of the
cache's length cut at each position. The split count comes from the cache's length and DECODE_BLOCKS (a CUDA graph
fixes the grid, and the positions stay on the device), so with fixed chunks a batch far below the cache's length
leaves the blocks past every position empty: 64 rows at position 400 of 1024 slots use 2 chunks of 512 keys, one
busy, 512 of the 1024 blocks working (1.3 waves of 3 blocks an SM on an H200). Balanced: 1024 blocks of ~200 keys.
Predicted: attend_mma at 64 rows, position 400, 27.6 -> ~20 us a layer (nothing at position 1000, where both chunks
are busy already). Measured on an H200 (2026-11-28, gpu_slot_decode.py --compare-slot-balanced, 1B bf16, 64 slots):
the 64-row step 1.629 -> 1.669 ms at position 400 and 1.493 -> 1.518 at 150, 16 rows +0.5%: lost, left off. A block
that ends at its chunk's cut reads ~200 keys in 3 warps' steps where a 512-key chunk's block streams 8: with 2-3
blocks an SM resident, the longer chunks already kept the loads in flight, and the balanced split added a combine
over twice the chunks."""

DECODE_MMA_PACKED_RUNS = True
"""Whether attend_mma serves a slot step's prompt runs packed (decode.cu's instance + 16000): an aligned group of
16 / groups rows of one slot at consecutive positions in one block, its queries' heads as the tile's rows, so the
run's keys and values are read once rather than once a row, and the step's other rows as before. Steps of more
than PACKED_RUNS_ABOVE rows (and more rows than slots: a step that carries prompt rows), no window, groups of at
most 8; flash.cu's slot runs (SLOT_RUNS_ABOVE) are then not used. Measured on an H200 (2026-11-28,
gpu_slot_decode.py --compare-packed-runs, 1B bf16, 64 decode rows at position 400 plus prompt runs of 128): the
step at 128 / 192 / 256 / 320 rows 2.081 / 2.615 / 3.029 / 4.062 ms without, 2.144 / 2.608 / 2.939 / 3.466 with
(predicted ~2.1 at 256: missed; the prompt rows' re-reads of their slot's keys mostly hit L2, and the packed
instance's second tile half costs the decode rows); serve_load at 64 streams, prompts {128, 512}, outputs
{128, 256}: 18,979 / 19,045 -> 20,774 / 20,761 tokens/s, p99 ITL 4.42 / 4.51 -> 4.01 / 4.02 ms."""
PACKED_RUNS_ABOVE = 0
"""Steps of more rows than this (and than the slots) pack their prompt runs (DECODE_MMA_PACKED_RUNS). The step alone
lost 3% at 128 rows and tied at 192, but the server (serve_load, as above) gained more packing every step that
carries prompt rows, 18,979 / 19,045 -> 20,774 / 20,761 tokens/s, than packing only those above 192 rows, 18,113 /
18,744 -> 19,974 / 19,012 (each pair of runs interleaved in one call): while prompts stream in, the engine's steps
carry fewer decode rows than the benchmark's 64."""


DECODE_MMA = True
"""Whether the decode kernel's work with no mask (slot_attention's decode step) or one all heads share (a single
sequence's decode over its static cache) in float16 or bfloat16, heads of MMA_HEAD_DIMS and at most MMA_GROUPS q heads
a kv head, goes to decode.cu's attend_mma (the scores and p v as tensor-core products, ~12 SASS instructions a key a
warp) rather than attend_chunk (~48, bound by its instructions at a quarter of the bandwidth). Measured on an H200
(2026-11-28, docs/benchmarks.md): 64 rows of 1B heads at position 400, 42.2 -> 27.6 us a layer; the 64-slot bf16
serving step 1.897 -> 1.613 ms (int4 2.598 -> 2.300); single-sequence decode 1B 0.881 -> 0.863 ms, MoE (8 layers)
0.662 -> 0.649 ms at context 1024. It also takes groups of 9-16 q heads, which attend_chunk does not."""
MMA_HEAD_DIMS = (64, 128)  # attend_mma's instances (+ 1000: groups of 9-16; + 2000 x the mask's kind; + 16000: packed)
MMA_GROUPS = 16  # q heads a kv head attend_mma serves (the rows of one m16n8k16 tile)
DECODE_MMA_PIPELINED = True
"""Whether attend_mma at heads of 64 loads a warp's next 16 keys while it computes this step's (157 registers: 3
blocks an SM) or only after (+ 8000: fewer registers, more warps to hide the loads); an A/B for its first
measurement (the benchmarks' "mma-unpipelined" configuration and --compare-decode-mma-unpipelined)."""


def _decode_mma_applies(q: Any, mask_strides: list[Any], groups: int) -> bool:
    """attend_mma's work: DECODE_MMA, a mask (if any) the heads share (its head stride 0), a 16-bit type, a head of
    MMA_HEAD_DIMS, at most 16 q heads a kv head."""
    return _mma_takes(q, mask_strides[1] == 0, groups)


def _mma_takes(q: Any, heads_share_mask: bool, groups: int) -> bool:
    return (DECODE_MMA and heads_share_mask and q.dtype in (np.dtype(np.float16), BFLOAT16)
            and q.shape[3] in MMA_HEAD_DIMS and groups <= MMA_GROUPS)


def _decode_attention_applies(q: Any, k: Any, v: Any, mask: Any, causal: bool) -> bool:
    """One query per head over a cache whose rows the decode kernel reads 16 bytes at a time: unit stride along the
    head dim, rows 16-byte aligned, at most 32 such pieces per row, at most 8 q heads per kv head, at most
    COMBINE_MAX_SPLITS chunks."""
    if causal or not _grouped_attention(q, k, v, mask) or q.shape[2] != 1:
        return False
    return _decode_kernel_takes(q, k, v, heads_share_mask=mask is None or mask.ndim < 3 or mask.shape[-3] == 1)


def _decode_kernel_takes(q: Any, k: Any, v: Any, heads_share_mask: bool = True) -> bool:
    """The head width, group size, key count and row layout decode.cu is built for: groups of up to 16 q heads a
    kv head where attend_mma takes the work, of up to DECODE_GROUPS[-1] elsewhere."""
    per16 = 16 // q.itemsize
    e = q.shape[3]
    groups = q.shape[1] // k.shape[1]
    if e % per16 or e // per16 > 32 or groups > DECODE_GROUPS[-1] and not _mma_takes(q, heads_share_mask, groups) or \
            k.shape[2] > DECODE_CHUNK * COMBINE_MAX_SPLITS or k.shape != v.shape:
        return False
    return _rows_of_16_bytes(k, v)


def decode_chunk(heads: int, seq: int) -> int:
    """Keys per block of decode.cu: DECODE_CHUNK while the (sequence, kv head) pairs alone give fewer blocks than
    DECODE_BLOCKS (one sequence: many small chunks, for latency), longer chunks, down to one per pair, as the batch
    grows (a block's fixed cost, the merge of its warps and the combine's reads, is then paid fewer times)."""
    splits = max(1, min(-(-seq // DECODE_CHUNK), -(-DECODE_BLOCKS // max(heads, 1))))
    return -(-seq // splits // DECODE_CHUNK) * DECODE_CHUNK  # ceil(ceil(seq / splits) / DECODE_CHUNK) chunks


def _decode_attention(q: Any, k: Any, v: Any, mask: Any, scale: float | None, slots: Any = None,
                      positions: Any = None, window: int = 0, run_rows: int = 0) -> Any:
    """decode.cu: the keys in chunks of DECODE_CHUNK, a block per chunk and kv head serving the group's q heads
    (k and v read once per group, keys the mask hides not read), then a kernel combining the chunks' partials.
    With slots (and positions), query row b reads k/v row slots[b] up to key positions[b] (slot_attention);
    run_rows > 0 leaves out the aligned groups of that many rows that are prompt runs (flash.cu's to fill)."""
    b, hq, _, e = q.shape
    hkv, seq = k.shape[1], k.shape[2]
    groups = hq // hkv
    q = cp.ascontiguousarray(q)
    if q.data.ptr % 16:  # a view at an odd offset: the kernel loads q 16 bytes at a time
        q = q.copy()
    kind, mask_b, ms = _mask_operand(mask, (b, hq, 1, seq), q)
    mma = _decode_mma_applies(q, ms, groups)
    packed = mma and _packs_runs(b, k.shape[0], groups, slots, window, kind)
    parts = 1 if mma else _head_parts(b * hkv, groups)
    chunk = decode_chunk(b * hkv * parts, seq)
    splits = (seq + chunk - 1) // chunk
    part = cp.empty((b, hq, splits, e + 2), dtype=cp.float32)
    ks, vs = elements(k.strides, k.itemsize), elements(v.strides, v.itemsize)
    scale = 1 / math.sqrt(e) if scale is None else scale
    balance = SLOT_BALANCED_CHUNKS and positions is not None
    rows = (NULL if slots is None else slots, NULL if positions is None else positions, np.int32(k.shape[0]),
            np.int32(window), np.int32(DECODE_CHUNK if balance else chunk), np.int32(run_rows))
    if mma:
        unpipelined = 8000 if e == 64 and not DECODE_MMA_PIPELINED else 0
        instance = e + (16000 if packed else 1000 if groups > 8 else 0) + 2000 * int(kind) + unpipelined
        nvrtc.function("decode", "attend_mma", q.dtype, instance)(
            (splits, hkv, b), (DECODE_THREADS,),
            (q, k, v, part, np.int32(groups), np.int32(seq), np.float32(scale), ks[0], ks[1], ks[2], vs[0], vs[1],
             vs[2], mask_b, ms[0], ms[3], np.int32(splits), *rows, np.int32(DECODE_PREFETCH_VISIBLE),
             np.int32(balance)))
    else:
        bound = next(g for g in DECODE_GROUPS if g >= groups // parts)
        nvrtc.function("decode", "attend_chunk", q.dtype, bound)(
            (splits, hkv * parts, b), (DECODE_THREADS,),
            (q, k, v, mask_b, part, np.int32(groups // parts), np.int32(seq), np.int32(e), np.float32(scale),
             ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], kind, ms[0], ms[1], ms[3], np.int32(splits), *rows,
             np.int32(parts), np.int32(DECODE_PREFETCH_VISIBLE), np.int32(balance)))
    out = cp.empty((b, hq, 1, e), dtype=q.dtype)
    columns = next(n for n in COMBINE_COLUMNS if 32 * n >= e)  # 32-lane columns of the head dim (e <= 256)
    nvrtc.function("decode", "attend_combine", q.dtype, columns)((b * hq,), (COMBINE_THREADS,),
                                                                  (part, out, np.int32(e), np.int32(splits)))
    return out


def _packs_runs(rows: int, slot_count: int, groups: int, slots: Any, window: int, kind: Any) -> bool:
    """Whether attend_mma packs this slot step's prompt runs (DECODE_MMA_PACKED_RUNS): more rows than slots and
    PACKED_RUNS_ABOVE, no window or mask, 2 or more queries of a run to a tile (groups of at most 8)."""
    return (DECODE_MMA_PACKED_RUNS and slots is not None and rows > max(slot_count, PACKED_RUNS_ABOVE) and not window
            and int(kind) == MASK_NONE and groups <= 8)


def _head_parts(pairs: int, groups: int) -> int:
    """Blocks sharing each kv head's group of q heads: enough that a block serves at most DECODE_HEADS of them (a
    divisor of the group) while the (sequence, kv head) pairs are fewer than DECODE_SPLIT_HEADS_BELOW; else 1."""
    if pairs >= DECODE_SPLIT_HEADS_BELOW:
        return 1
    return next((p for p in range(1, groups + 1) if groups % p == 0 and groups // p <= DECODE_HEADS), 1)
