"""Weight-only quantized linear on the CPU (int8 per channel or group, int4 in groups; the op set's
quantized_linear; the embedding and the reference dequantization are portable: kiln.runtime.backends.array_api.quant).

Where the helpers have the lanes form (AVX-512 VNNI and BW; lanes_form: int4, or int8 without zero points, in
power-of-two groups of 32 or more), a constant weight is packed once into it (resident.packed_lanes, qdot.c) and
the rows that take integer products (up to lanes_rows: a decode step's, a short prompt's) run them there, one
kernel for all of them: a decode step of SmolLM2 at 1.2-1.3x the stored layout's speed. Longer prompts keep the
float GEMM on the stored weights (below), whose inputs are not rounded to int8.

Otherwise, few rows (a decode step): the compiled kernel reads each quantized weight row once and converts it in
registers, so the step reads 4x (int8) or 8x (int4) fewer weight bytes than float32. Many rows (prefill,
encoders): the packed GEMM dequantizes blocks of 32 weight rows as it packs them (gemm.c's kiln_qgemm_f32), so a
prefill costs about what float32 does without ever holding the whole float32 weight; without the helpers, bands of
dequantized rows go to BLAS.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kiln.ir.graph import Method, Node
from kiln.runtime.backends.array_api.quant import dequantize
from kiln.runtime.backends.cpu import forms, native
from kiln.runtime.backends.cpu.registry import kernel, upcast

FEW_ROWS = 8
"""Up to this many input rows the compiled row-streaming kernel runs; above, the packed GEMM (or bands + BLAS)."""

INT4_DOT_ROWS = 32
"""int4 weights: up to this many rows the integer dot products (qdot.c, where native.integer_dot) run past
FEW_ROWS too, as a short prompt's chunk: the packed GEMM dequantizes every weight panel for the rows it has, which
at 16-32 rows costs as much as their products. SmolLM2's int4 layers, 2 threads: the dot kernel took 0.44-0.59x the
GEMM's time at 16 rows, 0.68-0.81x at 32, 0.71-1.02x at 48 (int8: 1.5-2.7x, its rows taken one at a time)."""

_BAND_BYTES = 1 << 20
"""Float32 bytes of dequantized weight per band (fits in L2 next to the input rows)."""

WEIGHT_FIRST_ROWS = 32
"""Up to this many input rows a band's product is taken as (W x^T)^T, above as x W^T: OpenBLAS gives the same bits
either way, and the weight-first form was 1.3-1.9x faster at 9-32 rows on SmolLM2's layers, even at 64 and
10-20% slower at 128-256 (this project's 2-core Xeon)."""


_F32 = np.dtype(np.float32)


def _few_rows(lib, args: tuple) -> None:
    """kiln_qlinear_f32's call (x, q, scale, zero, bias, out, work, rows, n, k, format, group, threads) by integer
    dot products where the helpers take it (native.integer_dot, qdot.c), else by the float kernel. work holds
    2 * rows * (k + k / group) floats (refined inputs take two quantized rows each)."""
    if not (native.integer_dot() and lib.kiln_qlinear_dot_f32(*args)):
        lib.kiln_qlinear_f32(*args)


def yields_output(method: Method, node: Node) -> bool:
    """Whether the node's result is one of the method's outputs (or reshaped into one): a language model's logits.
    Their int8 inputs are refined (quant.h's QUANT_REFINE: the rounding's residual rounded again): one rounding to
    int8 moves a logit by ~0.3%, enough to flip the near ties a greedy answer often starts with (SmolLM2's Q4_1
    GGUF: "The" 25.33 vs "L" 25.24 for the demo question became 25.31 vs 25.36, and with it the whole answer, as
    llama.cpp's own answer flips), and refining costs twice the integer work of one linear of ~200. (int8 weights on
    AVX-512 go to float32 instead, qdot.c's q8_float_rows: as fast at one row, 2.4x at four.)"""
    outputs = set(method.outputs)
    for later in reversed(method.nodes):  # (through the reshape an LM's logits leave by)
        if later.op == "reshape" and later.outputs[0] in outputs:
            outputs.add(later.inputs[0])
    return any(out in outputs for out in node.outputs)


def bound_linear(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bias: np.ndarray | None, bits: int,
                 group_size: int, offset: bool = False, refine: bool = False) -> Callable[..., np.ndarray] | None:
    """quantized_linear for one node whose weights are program constants (prepare.py): their addresses are taken
    once and the few-row path's scratch is kept, so a decode step's call costs the compiled work and about 3 us,
    not the ~15 us of checks, conversions and allocations the general kernel repeats; other inputs (many rows,
    another dtype) go to it. None when the helpers cannot take these weights."""
    lib = native.library()
    if lib is None or not (native.float32_contiguous(scale, zero, bias) and q.flags.c_contiguous):
        return None
    n, k = q.shape[0], q.shape[1] * 8 // bits
    weights = (q.ctypes.data, scale.ctypes.data, native.address(zero), native.address(bias))
    work = np.empty(2 * FEW_ROWS * (k + k // group_size), dtype=np.float32)
    scratch = work.ctypes.data

    form = native.quant_format(bits, offset, refine)

    def run(x: np.ndarray, *constants: np.ndarray | None, bits: int, group_size: int,
            offset: bool = False) -> np.ndarray:
        rows = x.size // k if x.shape[-1:] == (k,) else FEW_ROWS + 1
        if x.dtype is not _F32 or rows > FEW_ROWS or not x.flags.c_contiguous:
            return quantized_linear(x, *constants, bits=bits, group_size=group_size, offset=offset)
        out = np.empty(x.shape[:-1] + (n,), dtype=np.float32)
        _few_rows(lib, (x.ctypes.data, *weights, out.ctypes.data, scratch, rows, n, k, form, group_size,
                        native.threads()))
        return out

    run.work = work  # (kept alive with the closure)
    return run


def lanes_rows(bits: int) -> int:
    """The most input rows a call multiplies in the lanes form, as many as took integer products before it
    (INT4_DOT_ROWS, FEW_ROWS for int8); more go to the float GEMM on the stored weights. Rounding a prompt's rows to
    int8 too ran its 96 tokens 1.4x faster, but moved SmolLM2's logits by ~1 against float inputs (the demo
    question's first token: "L" 24.57 over "The" 24.43, where the GEMM gives "The" 25.33 over "L" 25.24, and with it
    the whole answer): a prompt's errors go into every later token's keys and values."""
    return INT4_DOT_ROWS if bits == 4 else FEW_ROWS


def lanes_form(bits: int, group_size: int, n: int, k: int, zero: bool, offset: bool) -> bool:
    """Whether a quantized [n, k] weight of these attributes (zero: it has zero points or offsets) runs in the lanes
    form (resident.packed_lanes, qdot.c's kiln_qlanes_linear_f32) where it is a program constant: int4, or int8
    without zero points, in groups of 32 or a larger power of two, on CPUs with AVX-512 VNNI and BW, integer products
    on (native.integer_dot). Up to lanes_rows rows one kernel takes them all, so a row's bits do not depend on how
    many rows share its call."""
    if bits == 8 and (zero or offset):
        return False
    return bits in (4, 8) and native.lanes_bytes(n, k, group_size, bits) > 0


def bound_lanes(packed: np.ndarray, stored: tuple[np.ndarray, np.ndarray, np.ndarray | None],
                bias: np.ndarray | None, n: int, k: int, group: int, bits: int, offset: bool,
                refine: bool = False) -> Callable[..., np.ndarray]:
    """quantized_linear for one node whose weights are held in the lanes form (resident.packed_lanes), up to
    lanes_rows(bits) rows (the inputs' scratch kept and grown as rows need it); more rows go to the general kernel
    with the stored weights (q, scale, zero: the file's own pages, read only by such calls)."""
    lib = native.library()
    form = native.quant_format(bits, offset, refine)
    work = [np.empty(0, np.uint8)]
    bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)

    def run(x: np.ndarray, *constants: np.ndarray | None, bits: int, group_size: int,
            offset: bool = False) -> np.ndarray:
        if x.shape[-1] != k:
            raise ValueError(f"quantized_linear: input of {x.shape[-1]} features for a weight of {k}")
        if x.size // k > lanes_rows(bits):
            return quantized_linear(x, *stored, bias, bits=bits, group_size=group_size, offset=offset)
        x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)
        out = np.empty(x.shape[:-1] + (n,), dtype=np.float32)
        work[0] = _lanes_rows(lib, x2, packed, bias, out.reshape(-1, n), n, k, group, form, work[0])
        return out

    run.packed = packed  # (kept alive with the closure)
    return run


def _lanes_of(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int, offset: bool) -> np.ndarray:
    """The lanes form of a weight the general kernel meets (a program's constant, made once per array: forms)."""
    n, k = q.shape[0], q.shape[1] * 8 // bits
    packed = np.empty(native.lanes_bytes(n, k, k // scale.shape[1], bits), np.uint8)
    native.pack_lanes(q, scale, zero, bits, offset, packed)
    return packed


def _lanes_rows(lib, x: np.ndarray, packed: np.ndarray, bias: np.ndarray | None, out: np.ndarray, n: int, k: int,
                group: int, form: int, work: np.ndarray | None = None) -> np.ndarray:
    """out [rows, n] = x [rows, k] (float32, contiguous) times the lanes form's weight, plus bias; returns the
    scratch it used (work where large enough, else a new one, for the caller to keep)."""
    rows = x.shape[0]
    need = 2 * rows * (k + k // group) * 4
    if work is None or work.nbytes < need:
        work = np.empty(need, np.uint8)
    lib.kiln_qlanes_linear_f32(x.ctypes.data, packed.ctypes.data, native.address(bias), out.ctypes.data,
                               work.ctypes.data, rows, n, k, form, group, native.threads())
    return work


def _dot_rows(lib, x: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None,
              bias: np.ndarray | None, out: np.ndarray, form: int, group_size: int) -> bool:
    """out = the product by integer dot products (qdot.c) for more rows than FEW_ROWS (INT4_DOT_ROWS); False,
    nothing written, where the helpers or the shapes do not allow them (the caller then runs the GEMM)."""
    if not native.integer_dot():
        return False
    rows, k = x.shape
    work = np.empty(rows * (k + k // group_size), dtype=np.float32)  # (quantized rows: qdot.c's work area)
    return bool(lib.kiln_qlinear_dot_f32(x.ctypes.data, q.ctypes.data, scale.ctypes.data, native.address(zero),
                                         native.address(bias), out.ctypes.data, work.ctypes.data, rows, q.shape[0],
                                         k, form, group_size, native.threads()))


@kernel("quantized_linear")
def quantized_linear(x: np.ndarray, q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None,
                     bias: np.ndarray | None, bits: int, group_size: int, offset: bool = False) -> np.ndarray:
    dtype = scale.dtype
    x, scale, zero, bias = upcast(x, scale, zero, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = np.ascontiguousarray(x.reshape(-1, k), dtype=np.float32)
    rows, n = x2.shape[0], q.shape[0]
    lib = native.library()
    compiled = lib is not None and native.float32_contiguous(scale, zero, bias) and q.flags.c_contiguous
    out = np.empty((rows, n), dtype=np.float32)
    form = native.quant_format(bits, offset)
    if compiled and dtype == _F32 and rows <= lanes_rows(bits) and lanes_form(bits, group_size, n, k, zero is not None,
                                                                              offset):
        packed = forms.derived(f"lanes-{id(scale)}-{id(zero)}-{offset}", q,
                               lambda q: _lanes_of(q, scale, zero, bits, offset))
        _lanes_rows(lib, x2, packed, bias, out, n, k, group_size, form)
    elif compiled and rows <= FEW_ROWS:
        work = np.empty(2 * rows * (k + k // group_size), dtype=np.float32)
        _few_rows(lib, (x2.ctypes.data, q.ctypes.data, scale.ctypes.data, native.address(zero), native.address(bias),
                        out.ctypes.data, work.ctypes.data, rows, n, k, form, group_size, native.threads()))
    elif compiled and bits == 4 and rows <= INT4_DOT_ROWS and _dot_rows(lib, x2, q, scale, zero, bias, out, form,
                                                                        group_size):
        pass  # (the integer dot products took them)
    elif compiled and lib.kiln_qgemm_f32(x2.ctypes.data, q.ctypes.data, scale.ctypes.data, native.address(zero),
                                         out.ctypes.data, rows, n, k, form, group_size, native.threads()):
        if bias is not None:
            out += bias
    else:
        band = max(1, _BAND_BYTES // (4 * k))
        weight = np.empty((min(band, n), k), dtype=np.float32)
        transposed = np.empty((min(band, n), rows), dtype=np.float32) if rows <= WEIGHT_FIRST_ROWS else None
        for n0 in range(0, n, band):
            n1 = min(n, n0 + band)
            w = weight[:n1 - n0]
            if compiled:
                lib.kiln_dequantize_f32(q[n0:n1].ctypes.data, scale[n0:n1].ctypes.data,
                                        native.address(None if zero is None else zero[n0:n1]), w.ctypes.data,
                                        n1 - n0, k, form, group_size)
            else:
                w[...] = dequantize(np, q[n0:n1], scale[n0:n1], None if zero is None else zero[n0:n1], bits,
                                    group_size, offset)
            if transposed is None:
                np.matmul(x2, w.T, out=out[:, n0:n1])
            else:
                np.matmul(w, x2.T, out=transposed[:n1 - n0])
                out[:, n0:n1] = transposed[:n1 - n0].T
        if bias is not None:
            out += bias
    return out.reshape(*lead, n).astype(dtype, copy=False)
