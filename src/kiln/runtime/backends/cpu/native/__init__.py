"""kiln's compiled CPU helpers: `kernels.c`, built on first use with the machine's C compiler and cached.

Why compile at run time instead of shipping a binary: the runtime stays a pure-Python install (seconds, any
platform), and the helpers are built for the CPU they run on (`-march=native`). Why it is optional: a machine
without a C compiler still runs every op through the NumPy kernels, which remain the reference; the helpers only
replace kernels where a benchmark showed they pay (docs/benchmarks.md).

`library()` returns the loaded helpers or None. Set KILN_NATIVE=0 to turn them off, CC to pick the compiler and
KILN_CACHE_DIR to move the cache (default: $XDG_CACHE_HOME/kiln or ~/.cache/kiln). Helpers that split their work
over threads (the few-row linear) use `threads()`: KILN_THREADS, else every core the process may run on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kiln.runtime.backends.array_api.quant import integer_products_asked
from kiln.runtime.cache_dir import cache_dir

log = logging.getLogger("kiln.native")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.c", "qdot.c", "attention.c", "executor.c",
                                                              "gemm.c", "depthwise.c", "direct.c", "conv.c",
                                                              "experts.c"))
"""Compiled together into one library; HEADERS are what they include (the build key reads them all)."""
HEADERS = tuple(Path(__file__).with_name(name) for name in ("pool.h", "vmath.h", "vec16.h", "quant.h"))
FLAGS = ("-O3", "-std=gnu99", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared",
         "-pthread")
"""gnu99 for the vector extensions; FMA contraction allowed; no -ffast-math, so NaN and inf keep their meaning;
-pthread for the helpers' thread pool."""
TUNING = ("-march=native", "-mprefer-vector-width=512") if platform.machine().lower() in ("x86_64", "amd64") \
    else ("-mcpu=native",)
"""Build for this CPU: 512-bit vectors made the exp-based activations 2x faster on an AVX-512 Xeon. If the compiler
rejects these, the helpers are built without them."""

UNARY = ("sigmoid", "silu", "hardsigmoid", "hardswish", "gelu_erf", "gelu_tanh", "erf")
"""The compiled elementwise functions `kiln_<name>_f32(x, y, n)`."""

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
SIGNATURES: dict[str, tuple] = {
    **{f"kiln_{name}_f32": (_ptr, _ptr, _i64) for name in UNARY},
    "kiln_clamp_f32": (_ptr, _ptr, _i64, ctypes.c_float, ctypes.c_float),
    "kiln_bias_activate_f32": (_ptr, _ptr, _i64, _i64, _i64, _i64, ctypes.c_float, ctypes.c_float),
    "kiln_im2col2d_f32": (_ptr, _ptr) + (_i64,) * 14,
    "kiln_linear_rows_f32": (_ptr,) * 4 + (_i64,) * 4,
    "kiln_qlinear_f32": (_ptr,) * 7 + (_i64,) * 6,
    "kiln_dequantize_f32": (_ptr,) * 4 + (_i64,) * 4,
    "kiln_maxpool2d_f32": (_ptr, _ptr) + (_i64,) * 14,
    "kiln_winograd23_input_f32": (_ptr, _ptr) + (_i64,) * 9,
    "kiln_winograd23_output_f32": (_ptr, _ptr, _ptr) + (_i64,) * 7 + (ctypes.c_float, ctypes.c_float, _i64),
    "kiln_add_rms_norm_f32": (_ptr,) * 5 + (_i64, _i64, ctypes.c_float),
    "kiln_route_experts_f32": (_ptr,) * 3 + (_i64,) * 4 + (_ptr,),
    "kiln_gathered_linear_f32": (_ptr,) * 7 + (_i64,) * 6,
    "kiln_gathered_qlinear_f32": (_ptr,) * 9 + (_i64,) * 9,
    "kiln_layer_norm_f32": (_ptr,) * 4 + (_i64, _i64, ctypes.c_float),
    "kiln_sum_rows_f32": (_ptr, _ptr, _i64, _i64, ctypes.c_float),
    "kiln_attention_f32": (_ptr,) * 6 + (_i64,) * 18 + (ctypes.c_float, _i64),
    "kiln_rope_cache_update_f32": (_ptr,) * 9 + (_i64,) * 18,
    "kiln_slot_attention_f32": (_ptr,) * 7 + (_i64,) * 9 + (ctypes.c_float, _i64),
    "kiln_rope_slot_update_f32": (_ptr,) * 10 + (_i64,) * 14,
    "kiln_execute": (_ptr, _i64, _ptr, _i64),
    "kiln_execute_timed": (_ptr, _i64, _ptr, _i64, _ptr),
    "kiln_gemm_packed_size": (_i64, _i64),
    "kiln_dwconv2d_blocked_f32": (_ptr,) * 4 + (_i64,) * 15 + (ctypes.c_float, ctypes.c_float, _i64),
    "kiln_conv2d_direct_f32": (_ptr,) * 4 + (_i64,) * 16 + (ctypes.c_float, ctypes.c_float, _i64),
    "kiln_gemm_pack_f32": (_ptr, _ptr, _i64, _i64, _i64),
    "kiln_conv2d_f32": (_i64,) + (_ptr,) * 6 + (_i64, _i64, ctypes.c_float, ctypes.c_float, _i64),
    "kiln_gemm_packed_f32": (_ptr,) * 4 + (_i64,) * 7 + (ctypes.c_float, ctypes.c_float, _i64),
    "kiln_execute_words": (),
    "kiln_qdot_level": (),
    "kiln_qlinear_dot_f32": (_ptr,) * 7 + (_i64,) * 6,
    "kiln_qgemm_f32": (_ptr,) * 5 + (_i64,) * 6,
    "kiln_qlanes_bytes": (_i64,) * 4,
    "kiln_qlanes_pack": (_ptr,) * 3 + (_i64,) * 4 + (_ptr,),
    "kiln_qlanes_dequantize": (_ptr,) + (_i64,) * 4 + (_ptr,),
    "kiln_qlanes_linear_f32": (_ptr,) * 5 + (_i64,) * 6,
}
"""Every exported function and its argument types: pointers are passed as integers (`array.ctypes.data`)."""
RESULTS: dict[str, type] = {name: _i64 for name in (
    "kiln_qdot_level", "kiln_conv2d_f32", "kiln_gemm_packed_size", "kiln_qlinear_dot_f32", "kiln_rope_cache_update_f32",
    "kiln_execute", "kiln_execute_timed", "kiln_execute_words", "kiln_slot_attention_f32", "kiln_rope_slot_update_f32",
    "kiln_gathered_linear_f32", "kiln_gathered_qlinear_f32", "kiln_attention_f32", "kiln_qgemm_f32",
    "kiln_qlanes_bytes", "kiln_qlanes_pack", "kiln_qlanes_linear_f32")}
"""The functions that return a value (the rest return nothing)."""

_lock = threading.Lock()
_loaded: list = []  # [library or None] once decided


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build_key(cc: str) -> str:
    """Source, flags, compiler and CPU all change the binary: any of them changing means a new build."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    cpu = ""
    if sys.platform.startswith("linux"):
        try:
            cpu = next((line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features"))), "")
        except OSError:
            cpu = ""
    parts = (*(f.read_bytes() for f in SOURCES + HEADERS), " ".join(FLAGS + TUNING).encode(), version.encode(),
             platform.machine().encode(), cpu.encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _build(cc: str, target: Path) -> None:
    """Compile into a temporary file beside `target`, then rename: concurrent builders never see half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for tuning in (TUNING, ()):
            result = subprocess.run([cc, *FLAGS, *tuning, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True,
                                    text=True, timeout=300)
            if result.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KILN_NATIVE", "1") == "0":
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found (set CC): using the NumPy kernels only")
        return None
    try:
        target = cache_dir("native") / f"kernels-{_build_key(cc)}.so"
        if not target.exists():
            log.info("building kiln's CPU helpers with %s into %s", cc, target)
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
        for name, argtypes in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = RESULTS.get(name)
        return lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("kiln's CPU helpers are unavailable (%s): using the NumPy kernels only", exc)
        return None


def library() -> ctypes.CDLL | None:
    """The compiled helpers, built on first call; None when turned off or when they cannot be built."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_load())
    return _loaded[0]


_session_threads = threading.local()


@contextlib.contextmanager
def thread_limit(count: int | None) -> Iterator[None]:
    """Within the block, on this thread, threads() is `count` (a session's `threads=`); None changes nothing."""
    before = getattr(_session_threads, "count", None)
    _session_threads.count = count if count is not None else before
    try:
        yield
    finally:
        _session_threads.count = before


def threads() -> int:
    """Threads a helper that splits its work may use: the running session's `threads=` (thread_limit), else
    KILN_THREADS, else every core this process may run on."""
    limit = getattr(_session_threads, "count", None)
    if limit is not None:
        return limit
    value = os.environ.get("KILN_THREADS", "")
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    return _cores()


@functools.cache
def _cores() -> int:
    """The cores this process may run on, asked once: threads() runs for every linear layer of a decode step, and
    the system call cost ~1 us each time."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


QUANT_OFFSET = 256
"""quant.h's flag: the zero array holds additive offsets (the op's offset attribute)."""
QUANT_REFINE = 512
"""quant.h's flag: inputs more exact than one rounding to int8 (a language model's logits): rounded twice (value and
residual), or float32 for int8 weights on AVX-512."""


def quant_format(bits: int, offset: bool, refine: bool = False) -> int:
    """The format code the quantized helpers take in place of bits (quant.h)."""
    return int(bits) | (QUANT_OFFSET if offset else 0) | (QUANT_REFINE if refine else 0)


def integer_dot() -> bool:
    """Whether few-row quantized linears quantize their input rows to int8 and use the CPU's byte dot products
    (qdot.c: ~0.3% from the float result, as llama.cpp's CPU path): when the helpers have them (AVX2 or VNNI)
    and KILN_QUANT_DOT is not `float` (which keeps the float kernel, exact to float32 rounding)."""
    return integer_products_asked() and _dot_level() > 0


@functools.cache
def _dot_level() -> int:
    lib = library()
    return 0 if lib is None else int(lib.kiln_qdot_level())


def float32_contiguous(*arrays: np.ndarray | None) -> bool:
    """Whether every given array (None skipped) is float32 and C-contiguous, as the helpers require."""
    return all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous) for a in arrays)


def address(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def bounds(lo: float | None, hi: float | None) -> tuple[float, float]:
    """A clamp's bounds as the compiled kernels take them: an absent bound is -inf / inf."""
    return -np.inf if lo is None else lo, np.inf if hi is None else hi


def clamp(x: np.ndarray, lo: float | None, hi: float | None, out: np.ndarray | None = None) -> np.ndarray | None:
    """x clamped to [lo, hi] (None: no bound) in one pass, into `out` if given (may be x); None when the helpers
    cannot take it."""
    lib = library()
    if lib is None or x.dtype != np.float32 or (out is not None and not out.flags.c_contiguous):
        return None
    x = np.asarray(x)
    x = x if x.flags.c_contiguous else x.copy()
    y = np.empty_like(x) if out is None else out
    if x.size:
        lib.kiln_clamp_f32(x.ctypes.data, y.ctypes.data, x.size, *bounds(lo, hi))
    return y


ACTIVATION_CODES = {"none": 0, "clamp": 1, "hardswish": 2}
"""A convolution's fused activation as the compiled kernels number it."""


def lanes_bytes(n: int, k: int, group: int, bits: int) -> int:
    """The bytes of an int4 or int8 [n, k] weight in groups of `group` in the lanes form (qdot.c's
    kiln_qlanes_pack: 4 rows a pass, one block of 32 a lane), 0 where the helpers have no such form (no AVX-512
    VNNI and BW, shapes it cannot hold: n % 4, k % 64, groups not a power of two >= 32; or KILN_QUANT_DOT=float).
    int8 is taken symmetric only (pack_lanes)."""
    lib = library()
    if lib is None or not integer_dot():
        return 0
    return int(lib.kiln_qlanes_bytes(n, k, group, bits))


def pack_lanes(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int, offset: bool,
               out: np.ndarray) -> None:
    """q (int4: uint8 [n, k / 2]; int8: [n, k], symmetric: no zero, no offset), scale and zero (float32 [n, k /
    group]) into out (lanes_bytes(n, k, group, bits) bytes)."""
    lib = library()
    n, k = q.shape[0], q.shape[1] * 8 // bits
    group = k // scale.shape[1]
    arrays = [np.ascontiguousarray(a) for a in (q, scale)] + [None if zero is None else np.ascontiguousarray(zero)]
    if out.nbytes < lanes_bytes(n, k, group, bits) or arrays[1].dtype != np.float32 or \
            not lib.kiln_qlanes_pack(arrays[0].ctypes.data, arrays[1].ctypes.data, address(arrays[2]), n, k,
                                     quant_format(bits, offset), group, out.ctypes.data):
        raise ValueError(f"an int{bits} [{n}, {k}] weight in groups of {group} the lanes form cannot hold")


def pack_gemm_weight(weight: np.ndarray) -> np.ndarray | None:
    """A float32 [m, k] matrix (a convolution's weight, [out, in * kh * kw]) in the panels gemm.c multiplies by;
    None when the helpers cannot take it."""
    lib = library()
    if lib is None or weight.ndim != 2 or weight.dtype != np.float32:
        return None
    weight = np.ascontiguousarray(weight)
    m, k = weight.shape
    packed = np.empty(max(1, int(lib.kiln_gemm_packed_size(m, k))), np.float32)
    lib.kiln_gemm_pack_f32(weight.ctypes.data, packed.ctypes.data, m, k, k)
    return packed


def gemm_packed(packed: np.ndarray, m: int, b: np.ndarray, out: np.ndarray, bias: np.ndarray | None = None,
                activation: str = "none", lo: float | None = None, hi: float | None = None,
                b_rows: bool = False, out_rows: bool = False) -> None:
    """out[m, n] = A b (+ bias per row, then the activation), A packed by pack_gemm_weight; b a float32 [k, n]
    matrix whose rows may be strided (its last axis contiguous), or with b_rows its transpose [n, k] (x's rows
    for x @ A^T); out float32 [m, n], rows may be strided, or with out_rows its transpose [n, m] (the rows of
    x @ A^T + bias)."""
    n, k = b.shape if b_rows else b.shape[::-1]
    assert out.shape == ((n, m) if out_rows else (m, n)) and float32_contiguous(bias)
    assert b.dtype == out.dtype == np.float32
    assert (b.size == 0 or b.strides[1] == 4) and (out.size == 0 or out.strides[1] == 4)
    library().kiln_gemm_packed_f32(packed.ctypes.data, b.ctypes.data, address(bias), out.ctypes.data, m, n, k,
                                   b.strides[0] // 4 if b.size else b.shape[1], int(b_rows) | 2 * int(out_rows),
                                   out.strides[0] // 4 if out.size else out.shape[1], ACTIVATION_CODES[activation],
                                   *bounds(lo, hi), threads())

def unary(name: str, x: np.ndarray) -> np.ndarray | None:
    """f(x) by the compiled `kiln_<name>_f32` for float32 x; None when the helpers cannot take it."""
    lib = library()
    if lib is None or x.dtype != np.float32:
        return None
    x = np.asarray(x)  # NumPy scalars (what ufuncs give for 0-d inputs) have no buffer to pass
    x = x if x.flags.c_contiguous else x.copy()  # (np.ascontiguousarray would make 0-d arrays 1-d)
    y = np.empty_like(x)
    if x.size:
        getattr(lib, f"kiln_{name}_f32")(x.ctypes.data, y.ctypes.data, x.size)
    return y


def add_rms_norm(x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray | None, axes: int,
                 eps: float) -> tuple[np.ndarray | None, np.ndarray] | None:
    """RMSNorm over the last `axes` dims of float32 x (after adding `residual`, of x's shape, when given) in one
    compiled call: (x + residual, or None without a residual; the normalized rows times weight). None when the
    helpers cannot take it (another type, a layout other than contiguous rows, a weight not of the normalized
    shape)."""
    lib = library()
    if lib is None or axes < 1 or axes > x.ndim or any(a is not None and a.dtype != np.float32
                                                        for a in (x, residual, weight)):
        return None
    if residual is not None and residual.shape != x.shape:
        return None
    # views (a head's slice of a projection) are copied: the same rows always take the same arithmetic
    x, residual, weight = (a if a is None or a.flags.c_contiguous else np.ascontiguousarray(a)
                           for a in (x, residual, weight))
    n = math.prod(x.shape[x.ndim - axes:])  # (np.prod costs microseconds a call: this runs per decode op)
    if weight is not None and weight.size != n:
        return None
    total = np.empty_like(x) if residual is not None else None
    out = np.empty_like(x)
    if x.size:
        lib.kiln_add_rms_norm_f32(x.ctypes.data, address(residual), address(weight), address(total), out.ctypes.data,
                                  x.size // n, n, float(eps))
    return total, out


def layer_norm(x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, axes: int,
               eps: float) -> np.ndarray | None:
    """LayerNorm over the last `axes` dims of float32 x in one compiled call; None when the helpers cannot take
    it (another type, weight or bias not of the normalized shape)."""
    lib = library()
    if lib is None or axes < 1 or axes > x.ndim or any(a is not None and a.dtype != np.float32
                                                        for a in (x, weight, bias)):
        return None
    x, weight, bias = (a if a is None or a.flags.c_contiguous else np.ascontiguousarray(a) for a in (x, weight, bias))
    n = math.prod(x.shape[x.ndim - axes:])
    if any(a is not None and a.size != n for a in (weight, bias)):
        return None
    out = np.empty_like(x)
    if x.size:
        lib.kiln_layer_norm_f32(x.ctypes.data, address(weight), address(bias), out.ctypes.data, x.size // n, n,
                                float(eps))
    return out


ATTENTION_MAX_QUERIES = 16
"""Query rows per head up to which slot attention (serving steps) runs compiled; `attention` takes any count (from
16 rows in tiles of queries against blocks of keys: attention.c)."""


def _float32(sinks: np.ndarray | None) -> np.ndarray | None:
    """An attention's sinks as attention.c reads them: contiguous float32 (or None)."""
    return None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, causal: bool,
              scale: float, sinks: np.ndarray | None = None) -> np.ndarray | None:
    """sdpa of float32 q [B, Hq, L, D], k and v [B, Hkv, S, D] (any strides, the last dimension contiguous), a
    bool mask broadcastable to [B, Hq, L, S] and float32 sinks [Hq], in one compiled call (attention.c); None when
    the helpers cannot take it (other dtypes or ranks, an additive mask)."""
    lib = library()
    if lib is None or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return None
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if q.dtype != np.float32 or k.dtype != np.float32 or v.dtype != np.float32 or k.shape[::3] != (B, D) \
            or v.shape[:3] != (B, Hkv, S) or Hkv == 0 or Hq % Hkv or k.strides[3] != 4 or v.strides[3] != 4:
        return None
    if sinks is not None and sinks.shape != (Hq,):
        return None
    if mask is not None:
        if mask.dtype != np.bool_ or mask.ndim > 4:
            return None
        mask_strides = broadcast_strides(mask.shape, mask.strides, 1, (B, Hq, L, S))
        if mask_strides is None:
            return None
    else:
        mask_strides = (0, 0, 0, 0)
    q = q if q.flags.c_contiguous else np.ascontiguousarray(q)
    out = np.empty((B, Hq, L, v.shape[3]), dtype=np.float32)
    if out.size and not lib.kiln_attention_f32(q.ctypes.data, k.ctypes.data, v.ctypes.data, address(mask),
                                               address(_float32(sinks)), out.ctypes.data, B, Hq, Hkv, L, S, D,
                                               v.shape[3], *(s // 4 for s in k.strides[:3]),
                                               *(s // 4 for s in v.strides[:3]), *mask_strides, int(causal),
                                               float(scale), threads()):
        return None
    return out


def broadcast_strides(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                      target: tuple[int, ...]) -> tuple[int, ...] | None:
    """Element strides of an array (`shape`, byte `strides`) read as `target`: its shape right-aligned, each dim
    1 (stride 0: broadcast) or target's; None when it does not broadcast so. How the helpers take a broadcast
    operand (a mask, RoPE's cos and sin) without copying it."""
    pad = len(target) - len(shape)
    if pad < 0:
        return None
    out = []
    for want, n, stride in zip(target, (1,) * pad + tuple(shape), (0,) * pad + tuple(strides), strict=True):
        if n != 1 and n != want:
            return None
        out.append(0 if n == 1 else stride // itemsize)
    return tuple(out)


def _row_strides(a: np.ndarray, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Element strides of float32 `a` read as `shape` (broadcast_strides) with rows of shape[-1] contiguous
    elements, or None."""
    if a.dtype != np.float32 or a.shape[-1:] != shape[-1:]:
        return None
    strides = broadcast_strides(a.shape, a.strides, 4, shape)
    return None if strides is None or (shape[-1] > 1 and strides[-1] != 1) else strides


def rope_cache_update(q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                      k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray,
                      interleaved: bool) -> np.ndarray | None:
    """RoPE of q (returned) and of k, written with v into the caches in place at `positions` along their third
    dimension (attention.c): float32 q [B, Hq, L, D], k and v [B, Hkv, L, D], contiguous caches [B, Hkv, S, D],
    cos and sin broadcastable to [B, 1, L, D], positions int64 [L]. None when the helpers cannot take it (other
    layouts or types) or a position is outside the cache (writing nothing: the caller's indexing raises)."""
    lib = library()
    if lib is None or q.ndim != 4 or k.ndim != 4 or positions.dtype != np.int64 or positions.ndim != 1:
        return None
    B, Hq, L, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if k.shape != (B, Hkv, L, D) or v.shape != k.shape or k_cache.shape != (B, Hkv, S, D) or D % 2 \
            or v_cache.shape != k_cache.shape or positions.shape != (L,) or not float32_contiguous(k_cache, v_cache):
        return None
    views = [_row_strides(a, shape) for a, shape in ((q, q.shape), (k, k.shape), (v, v.shape), (cos, (B, 1, L, D)),
                                                     (sin, (B, 1, L, D)))]
    if any(s is None for s in views) or views[3] != views[4] or not positions.flags.c_contiguous:
        return None
    (qs, ks, vs, cs, _) = views
    out = np.empty(q.shape, dtype=np.float32)
    if q.size and not lib.kiln_rope_cache_update_f32(
            q.ctypes.data, k.ctypes.data, v.ctypes.data, cos.ctypes.data, sin.ctypes.data, k_cache.ctypes.data,
            v_cache.ctypes.data, positions.ctypes.data, out.ctypes.data, B, Hq, Hkv, L, D, S, *qs[:3], *ks[:3],
            *vs[:3], cs[0], cs[2], int(interleaved)):
        return None
    return out


def slot_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                   scale: float, window: int, sinks: np.ndarray | None = None) -> np.ndarray | None:
    """slot_attention of float32 q [B, Hq, T, D] (T <= ATTENTION_MAX_QUERIES) over contiguous caches
    [slot_count, S, Hkv, D|Dv], slots int64 [B], positions int64 [B, T] and float32 sinks [Hq] or None, in one
    compiled call (attention.c): each query reads only the keys it sees. None when the helpers cannot take it or
    an index is outside the cache (the caller's checks raise)."""
    lib = library()
    if lib is None or q.ndim != 4 or k_cache.ndim != 4 or v_cache.ndim != 4 or q.shape[2] > ATTENTION_MAX_QUERIES:
        return None
    B, Hq, T, D = q.shape
    count, S, Hkv = k_cache.shape[:3]
    if q.dtype != np.float32 or not float32_contiguous(k_cache, v_cache) or k_cache.shape[3] != D or Hkv == 0 \
            or Hq % Hkv or v_cache.shape[:3] != (count, S, Hkv) or slots.shape != (B,) or positions.shape != (B, T) \
            or slots.dtype != np.int64 or positions.dtype != np.int64 or (sinks is not None and sinks.shape != (Hq,)):
        return None
    q, slots, positions = (a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in (q, slots, positions))
    out = np.empty((B, Hq, T, v_cache.shape[3]), dtype=np.float32)
    if out.size and not lib.kiln_slot_attention_f32(q.ctypes.data, k_cache.ctypes.data, v_cache.ctypes.data,
                                                    slots.ctypes.data, positions.ctypes.data,
                                                    address(_float32(sinks)), out.ctypes.data, B, Hq, Hkv, T, S, D,
                                                    v_cache.shape[3], count, int(window), float(scale), threads()):
        return None
    return out


def rope_slot_update(q: np.ndarray, k: np.ndarray, v: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                     k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray, positions: np.ndarray,
                     interleaved: bool) -> np.ndarray | None:
    """rope_cache_update of a serving program's decode step (attention.c): float32 q [B, Hq, 1, D], k and v
    [B, 1, Hkv, D], contiguous caches [slot_count, S, Hkv, D] written in place at (slots[b], positions[b]) (int64,
    one per sequence), cos and sin one row per sequence (broadcastable to [B, 1, 1, D]); the roped q returned.
    None when the helpers cannot take it or an index is outside the cache (writing nothing)."""
    lib = library()
    if lib is None or q.ndim != 4 or k.ndim != 4 or k_cache.ndim != 4:
        return None
    B, Hq, _, D = q.shape
    count, S, Hkv = k_cache.shape[:3]
    if q.shape[2] != 1 or k.shape != (B, 1, Hkv, D) or v.shape != k.shape or k_cache.shape[3] != D or D % 2 \
            or v_cache.shape != k_cache.shape or not float32_contiguous(k_cache, v_cache) \
            or any(i.dtype != np.int64 or i.size != B for i in (slots, positions)):
        return None
    views = [_row_strides(a, shape) for a, shape in ((q, q.shape), (k, k.shape), (v, v.shape), (cos, (B, 1, 1, D)),
                                                     (sin, (B, 1, 1, D)))]
    if any(s is None for s in views) or views[3] != views[4]:
        return None
    qs, ks, vs, cs, _ = views
    slots, positions = (np.ascontiguousarray(i.reshape(B)) for i in (slots, positions))
    out = np.empty(q.shape, dtype=np.float32)
    if q.size and not lib.kiln_rope_slot_update_f32(
            q.ctypes.data, k.ctypes.data, v.ctypes.data, cos.ctypes.data, sin.ctypes.data, k_cache.ctypes.data,
            v_cache.ctypes.data, slots.ctypes.data, positions.ctypes.data, out.ctypes.data, B, Hq, Hkv, D, S, count,
            qs[0], qs[1], ks[0], ks[2], vs[0], vs[2], cs[0], int(interleaved)):
        return None
    return out
