"""The host side of quant.cu's gemm_rows: a linear layer's 9 to 64 input rows (a serving program's batched decode
step) on the tensor cores, a quantized weight dequantized a tile at a time in shared memory (a 16-bit weight taken as
it is, an A/B against cuBLAS), K split where the tiles alone leave SMs idle and the splits summed in order. Which
operands it takes, how K is split, the shared memory it asks for, and the launch; quant_linear.py (and linalg.py for
a 16-bit weight) decides when a layer goes here."""

from __future__ import annotations

import functools
from typing import Any

import cupy as cp
import numpy as np

from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.cuda import nvrtc
from kiln.runtime.backends.cuda.kernels.registry import GATE_CODES, grid, resident_blocks

GEMM_ROWS_MIN = 9
"""Fewest input rows gemm_rows takes: one past quant.cu's MAX_ROWS (quant_linear.QUANT_ROWS), below which the few-row
kernels stream the weight once for all the rows."""

GEMM_ROWS_MAX = 64
"""Most input rows quant.cu's gemm_rows (tensor cores, a weight tile at a time in shared memory) takes: a serving
program's batched decode step (up to its slots); above, the rows of a prompt, dequantize + cuBLAS, whose dense copy
of the weight is paid once for many rows."""

DENSE_GEMM_ROWS: bool = False
"""Whether a 16-bit weight's 9 to GEMM_ROWS_MAX rows take gemm_rows rather than cuBLAS: an A/B aimed at the small-N
shapes cuBLAS reads at 36-62% of the bandwidth at 64 rows (H100: q/k/v, o, down). Lost with the kernel's first form
(H200, gpu_kernels.py --rows 64 --gemm-rows: q/k/v 31.2 us vs cuBLAS 7.6; the 64-slot step 3.450 vs 1.940 ms);
not yet measured with the ring and the cheaper stages."""

GEMM_ROWS_SPLITS: int | None = None
"""gemm_rows's splits of K; None: splits_of's choice."""


def applies(x2: Any, w: Any, *groups: Any) -> bool:
    """gemm_rows's operands: 16-bit storage (the tensor cores' mma types), 9 to GEMM_ROWS_MAX rows, K whole stages
    of 64, x and the weight (codes) 16-byte aligned, a quantized weight's scale and zero (`groups`, None where
    absent) 4-byte aligned (its copies read aligned words). (Its group must be a multiple of 32 too.)"""
    return (GEMM_ROWS_MIN <= x2.shape[0] <= GEMM_ROWS_MAX and x2.dtype in (np.dtype(np.float16), BFLOAT16)
            and x2.shape[1] % 64 == 0 and x2.flags.c_contiguous and x2.data.ptr % 16 == 0 and w.data.ptr % 16 == 0
            and all(a.data.ptr % 4 == 0 for a in groups if a is not None))


def quantized_applies(x2: Any, q: Any, scale: Any, zero: Any, bits: int, group_size: int) -> bool:
    """Whether a quantized weight takes gemm_rows: int4 or int8 codes in groups of a multiple of 32 (a half row's 32
    weights share a scale), and the operands `applies` asks for."""
    return bits in (4, 8) and group_size % 32 == 0 and applies(x2, q, scale, zero)


def dense_applies(x2: Any, weight: Any, bias: Any) -> bool:
    """Whether a 16-bit weight [N, K] (row-major) and bias take gemm_rows<S, 16> (DENSE_GEMM_ROWS)."""
    return (DENSE_GEMM_ROWS and weight.dtype == x2.dtype and weight.flags.c_contiguous
            and (bias is None or (bias.dtype == x2.dtype and bias.flags.c_contiguous)) and applies(x2, weight))


def splits_of(n: int, k: int) -> int:
    """Splits of K for gemm_rows: enough blocks for two per SM of the GPU where the 64-output tiles alone give fewer
    (the 1B shape's q/k/v, 3072 outputs, makes 48 tiles for 132 SMs), each split at least 4 stages of 64; at most 8,
    since each split writes the rows' float32 sums for gemm_rows_reduce to read back. A function of the layer only,
    not of the rows, so a row's bits do not depend on how many rows share its step."""
    if GEMM_ROWS_SPLITS is not None:
        return max(1, min(GEMM_ROWS_SPLITS, k // 64))
    tiles = -(-n // 64)
    return max(1, min(8, k // (64 * 4), -(-2 * _multiprocessors(cp.cuda.Device().id) // tiles)))


@functools.cache
def _multiprocessors(device: int) -> int:
    """The GPU's SM count, asked once (CuPy's Device.attributes queries every attribute on each read)."""
    return cp.cuda.Device(device).attributes["MultiProcessorCount"]


GEMM_ROWS_PACKED: bool = True
"""Whether int4 weights with no zero array and no offsets (Q4_0's layout) take gemm_rows's packed dequantization
(instance + 1000: two codes a packed subtract and multiply in the storage type, the same bits as the float32 path
in fewer instructions; the benchmarks' "-packed" kernels switch it off and on). Faster on every int4 layer measured
(H200, gpu_quant_linear.py --rows 64, int4 g32 sym, us): 1B q/k/v 17.2 -> 16.0, o 12.0 -> 10.3, gate/up 52.8 ->
48.5, down 24.9 -> 22.3, LM head 280.7 -> 250.1; 8B q/k/v 40.9 -> 37.4, o 27.4 -> 25.0, gate/up 160.2 -> 137.1,
down 76.3 -> 67.8, LM head 540.4 -> 479.5."""

GEMM_ROWS_STAGES: int | None = None
"""Slots of the ring of stages (64 values of K) a quantized weight's gemm_rows streams through shared memory: 4
(quant.cu's ROWS_STAGES: three in flight, 3 blocks an SM for int4 and int8) or 3 (instance + 10000: two in flight, 4
blocks an SM); None: ring_stages's choice by waves. Forced by the benchmarks' "-ring3" and "-ring4" kernels."""


GEMM_ROWS_TWO_TILES = False
"""Whether a quantized weight's gemm_rows dequantizes into two tiles (instance + 20000: one barrier a stage, the next
stage dequantized beside this one's products, 9 KB more shared memory), not one (two barriers a stage). Nsight
(H200, 1B gate/up int4 at 64 rows) found the third form bound by latency with issue slots 31% busy at 12 warps an SM;
predicted ~15-25% off the quantized layers at 64 rows. Off until measured (the benchmarks' "-twotiles" kernels)."""


def ring_stages(blocks: int, bits: int, dtype: Any, instance: int) -> int:
    """The ring for a grid of `blocks`: 3 slots where their fourth block an SM makes fewer waves than 4 slots' three,
    else 4 (the deeper ring). Measured on the H200 (gpu_quant_linear.py --rows 64, ring of 4 -> 3, us): where the
    grid took two waves at 3 blocks an SM and one at 4, the smaller ring won (1B gate/up 512 blocks, int4 52.8 ->
    42.9, int8 58.8 -> 46.5; 8B gate/up 448 blocks, 160.2 -> 128.7 and 209.1 -> 136.9; the LM heads' 2004 blocks,
    six waves against four, 1B 280.7 -> 253.3 and 336.1 -> 274.8); where one wave held every block either way, it
    lost or tied (8B o 27.4 -> 32.4, 8B down 76.3 -> 93.3, 1B q/k/v 17.2 -> 19.7; 1B o and down within 2 us)."""
    if GEMM_ROWS_STAGES is not None or bits == 16:
        return 4 if bits == 16 else GEMM_ROWS_STAGES
    dequantized_tiles = 2 if instance >= 20000 else 1
    waves = {stages: -(-blocks // resident_blocks(
        nvrtc.function("quant", "gemm_rows", dtype, (10000 if stages == 3 else 0) + instance),
        shared_bytes(bits, stages, dequantized_tiles), 128)) for stages in (4, 3)}
    return 3 if waves[3] < waves[4] else 4


def shared_bytes(bits: int, stages: int = 4, tiles: int = 1) -> int:
    """gemm_rows's dynamic shared memory for a ring of `stages` slots: the x tiles (64 rows of 72 halves) and weight
    codes (a 16-bit weight's rows padded as x's), and for a quantized weight the scale and zero words and the `tiles`
    tiles stages are dequantized into."""
    x_tiles = stages * 64 * 72 * 2
    if bits == 16:
        return 2 * x_tiles
    return x_tiles + stages * (64 * 64 * bits // 8 + 2 * 64 * 8) + tiles * 64 * 72 * 2


def gemm_rows(x2: Any, w: Any, scale: Any, zero: Any, bias: Any, bits: int, group_size: int, zero_mode: Any,
              activation: str = "") -> Any:
    """quant.cu's gemm_rows (and gemm_rows_reduce where K is split): x2 [9..64, K] times w [N, K] (codes of `bits`
    4 or 8 with their scale and zero, or 16: the weight in x2's type, scale and zero None); with an activation, w
    stacks gate and up rows and the result is act(gate) * up [rows, N / 2]."""
    rows, k = x2.shape
    n = w.shape[0]
    width = n // 2 if activation else n
    out = cp.empty((rows, width), dtype=x2.dtype)
    stages = k // 64
    per_split = -(-stages // splits_of(n, k))
    splits = -(-stages // per_split)  # (no split without stages)
    partial = cp.empty((splits, rows, n), dtype=np.float32) if splits > 1 else out
    scale = x2 if scale is None else scale
    zero_arg, bias_arg = zero if zero is not None else scale, bias if bias is not None else scale
    act = np.int32(GATE_CODES[activation] if activation else 0)
    packed = GEMM_ROWS_PACKED and bits == 4 and int(zero_mode) == 0
    output_tiles = -(-width // (32 if activation else 64))
    two_tiles = GEMM_ROWS_TWO_TILES and bits != 16
    instance = (20000 if two_tiles else 0) + (1000 if packed else 0) + (100 if activation else 0) + bits
    ring = ring_stages(output_tiles * splits, bits, x2.dtype, instance)
    instance += 10000 if ring == 3 else 0
    nvrtc.function("quant", "gemm_rows", x2.dtype, instance)(
        (output_tiles, -(-rows // 64), splits), (128,),
        (x2, w, scale, zero_arg, bias_arg, out, partial, np.int32(rows), np.int32(n), np.int32(k),
         np.int32(group_size), zero_mode, np.int32(bias is not None), np.int32(per_split), act),
        shared_mem=shared_bytes(bits, ring, 2 if two_tiles else 1))
    if splits > 1:
        nvrtc.function("quant", "gemm_rows_reduce", x2.dtype)(
            grid(rows * width), (256,), (partial, bias_arg, out, np.int32(rows), np.int32(n), np.int32(splits),
                                         np.int32(bias is not None), act))
    return out
