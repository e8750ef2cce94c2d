"""Matrix products on cuBLASLt with the algorithm chosen by measurement, once per shape and process.

Why: cublasGemmEx (cublas.py) runs the one algorithm cuBLAS's heuristics pick, and for the skinny products of a
batched decode step (64 rows against a [2048, 2048] weight) that pick leaves most of the GPU idle: 16 output tiles
for 132 SMs. Measured on an H200 at 64 rows (benchmarks/gpu_kernels.py --rows 64), cuBLAS read Llama-3.2-1B's o
projection at 27% of the copy bandwidth, q/k/v at 38%, down at 54%. cuBLASLt returns a list of candidate
algorithms for a problem (split-K ones among them); which is fastest for a shape is a measurement, not a rule, so
the first product of each shape times the heuristics' first CANDIDATES algorithms and cublasGemmEx itself, each on
the real operands with L2 flushed before every run (a decode step reads its weights from DRAM, not L2), and keeps
the fastest. GemmEx stays where nothing beats it by TUNE_MARGIN.

A plan is only tuned outside stream capture (a capture cannot time anything): a shape first seen inside a capture
runs cublasGemmEx there, and kiln's sessions run every method eagerly before capturing it. Only 2-d products of
float16/bfloat16 operands whose pointers are 256-byte aligned take this path (the heuristics assume that
alignment; a view at another offset keeps GemmEx).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cupy as cp

from kiln.runtime.backends.cuda import cublas
from kiln.runtime.backends.cuda.cublas import check

log = logging.getLogger("kiln.cuda")

CANDIDATES = 16
"""Algorithms asked of cuBLASLt's heuristics for a new shape (it may return fewer)."""
TUNE_RUNS = 7
"""Timed runs of each candidate (the median counts), each after an L2 flush."""
TUNE_MARGIN = 0.03
"""How much faster than cublasGemmEx (median) a cuBLASLt algorithm must be to replace it."""
ALIGNMENT = 256
WORKSPACE_BYTES = 32 << 20

_COMPUTE_32F, _R_32F = 68, 0  # cublasComputeType_t, cudaDataType_t (the scale type)
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
_OP_N = 0


class _HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: the algorithm (an opaque 64-byte struct), its workspace, status, waves."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.cache
def _library() -> ctypes.CDLL:
    """The libcublasLt that CuPy's cuBLAS loaded (libcublas links it)."""
    cublas._library()
    return _declare(cublas.loaded_library("cublasLt"))


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i32, u64, i64, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(p), i32, i32],
        "cublasLtMatmulDescSetAttribute": [p, i32, p, size],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(p), i32, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(p)],
        "cublasLtMatmulPreferenceSetAttribute": [p, i32, p, size],
        "cublasLtMatmulAlgoGetHeuristic": [p, p, p, p, p, p, p, i32, p, ctypes.POINTER(i32)],
        "cublasLtMatmul": [p, p, p, p, p, p, p, p, p, p, p, p, p, p, size, p],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    return lib


def _create_handle() -> tuple[ctypes.c_void_p, Any]:
    handle = ctypes.c_void_p()
    check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle, cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)


_HANDLES = cublas.DeviceHandles(_create_handle)


@dataclass
class Plan:
    """One shape's product: its descriptors, and the measured choice (algo None: cublasGemmEx)."""

    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]  # A, B, C (= D)
    algo: _HeuristicResult | None
    timings: dict[str, float]  # microseconds, median: "gemmex" and "lt i" for each candidate that ran


_PLANS: dict[tuple, Plan] = {}
_LOCK = threading.Lock()


def plans() -> dict[tuple, Plan]:
    """The tuned plans of this process (for benchmarks and tests)."""
    return dict(_PLANS)


@dataclass(frozen=True)
class Product:
    """cuBLAS's column-major view of a 2-d product, as cublas.matmul builds it: C [n, m] = op_a(A) op_b(B) with A
    the weight side ([n, k] after its op), B the activations ([k, m]), C the output, beta 0 or 1."""

    op_a: int
    op_b: int
    n: int
    m: int
    k: int
    a: int  # device pointers
    lda: int
    b: int
    ldb: int
    c: int
    kind: int  # cudaDataType_t of A and B
    out_kind: int
    beta: float

    def key(self) -> tuple:
        return (cp.cuda.runtime.getDevice(), self.op_a, self.op_b, self.n, self.m, self.k, self.lda, self.ldb,
                self.kind, self.out_kind, self.beta != 0.0)

    def applies(self) -> bool:
        return all(ptr % ALIGNMENT == 0 for ptr in (self.a, self.b, self.c))


def run(product: Product, gemmex: Callable[[int], None]) -> bool:
    """product on cuBLASLt where a tuned plan says so (tuning it first when new and not under capture); False
    when the caller should run cublasGemmEx itself. gemmex(out_ptr) runs the GemmEx product into out_ptr (timed
    against the candidates while tuning)."""
    if not product.applies():
        return False
    key = product.key()
    plan = _PLANS.get(key)
    stream = cp.cuda.get_current_stream()
    if plan is None:
        if stream.is_capturing():
            return False
        with _LOCK:
            plan = _PLANS.get(key) or _tune(product, gemmex, stream)
            _PLANS[key] = plan
    if plan.algo is None:
        return False
    status = _matmul(plan, product, product.c, plan.algo, stream)
    if status != 0:  # never seen in tuning; GemmEx from now on, said once
        log.warning("cuBLASLt product %s failed (status %d): cublasGemmEx from now on", key, status)
        plan.algo = None
        return False
    return True


def _matmul(plan: Plan, product: Product, d: int, algo: _HeuristicResult, stream: Any) -> int:
    handle, workspace = _HANDLES.get()
    one, beta = ctypes.c_float(1.0), ctypes.c_float(product.beta)
    a_desc, b_desc, c_desc = plan.layouts
    return _library().cublasLtMatmul(
        handle, plan.desc, ctypes.byref(one), product.a, a_desc, product.b, b_desc, ctypes.byref(beta), product.c,
        c_desc, d, c_desc, ctypes.byref(algo.algo), workspace.data.ptr, WORKSPACE_BYTES, stream.ptr)


def _describe(product: Product) -> tuple[ctypes.c_void_p, tuple]:
    lib = _library()
    desc = ctypes.c_void_p()
    check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
    for attribute, op in ((_DESC_TRANSA, product.op_a), (_DESC_TRANSB, product.op_b)):
        value = ctypes.c_int32(op)
        check(lib.cublasLtMatmulDescSetAttribute(desc, attribute, ctypes.byref(value), ctypes.sizeof(value)),
               "cublasLtMatmulDescSetAttribute")
    # a layout is of the matrix as stored: rows x cols before its op
    shapes = (((product.n, product.k) if product.op_a == _OP_N else (product.k, product.n), product.lda,
               product.kind),
              ((product.k, product.m) if product.op_b == _OP_N else (product.m, product.k), product.ldb,
               product.kind),
              ((product.n, product.m), product.n, product.out_kind))
    layouts = []
    for (rows, cols), ld, kind in shapes:
        layout = ctypes.c_void_p()
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, rows, cols, ld),
               "cublasLtMatrixLayoutCreate")
        layouts.append(layout)
    return desc, tuple(layouts)


def _candidates(desc: ctypes.c_void_p, layouts: tuple) -> list[_HeuristicResult]:
    lib = _library()
    preference = ctypes.c_void_p()
    check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(preference)), "cublasLtMatmulPreferenceCreate")
    workspace = ctypes.c_uint64(WORKSPACE_BYTES)
    check(lib.cublasLtMatmulPreferenceSetAttribute(preference, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(workspace),
                                                    ctypes.sizeof(workspace)), "cublasLtMatmulPreferenceSetAttribute")
    results = (_HeuristicResult * CANDIDATES)()
    returned = ctypes.c_int(0)
    handle, _ = _HANDLES.get()
    a, b, c = layouts
    status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, preference, CANDIDATES, results,
                                                ctypes.byref(returned))
    if status != 0:
        return []
    return [results[i] for i in range(returned.value)
            if results[i].state == 0 and results[i].workspace_size <= WORKSPACE_BYTES]


def _median_us(launch: Callable[[], Any], flush: Any, stream: Any) -> float:
    """Median GPU time of one launch, L2 flushed before each (the flush outside the timed events)."""
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for i in range(TUNE_RUNS + 1):
        flush.fill(i & 0xFF)
        start.record(stream)
        if launch() not in (None, 0):
            return float("inf")
        end.record(stream)
        end.synchronize()
        if i:  # the first run warms the instruction cache and any lazy setup
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    return sorted(times)[len(times) // 2]


def _tune(product: Product, gemmex: Callable[[int], None], stream: Any) -> Plan:
    desc, layouts = _describe(product)
    plan = Plan(desc, layouts, None, {})
    item = 2 if product.out_kind != _R_32F else 4
    scratch = cp.empty(product.n * product.m * item, dtype=cp.uint8)  # D while timing: C (beta 1) stays as it is
    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())["l2CacheSize"]
    flush = cp.empty(2 * max(l2, 1 << 20), dtype=cp.uint8)
    plan.timings["gemmex"] = best = _median_us(lambda: gemmex(scratch.data.ptr), flush, stream)
    for i, candidate in enumerate(_candidates(desc, layouts)):
        us = _median_us(lambda c=candidate: _matmul(plan, product, scratch.data.ptr, c, stream), flush, stream)
        plan.timings[f"lt {i}"] = us
        if us < best * (1 - TUNE_MARGIN) and us < (plan.timings.get("chosen") or float("inf")):
            plan.algo, plan.timings["chosen"] = candidate, us
    stream.synchronize()
    log.debug("cuBLASLt plan %s: %s", product.key(), plan.timings)
    return plan


__all__ = ["CANDIDATES", "Plan", "Product", "TUNE_MARGIN", "TUNE_RUNS", "plans", "run"]
