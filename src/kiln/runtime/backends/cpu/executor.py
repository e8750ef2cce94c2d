"""The CPU backend's native executor: a method whose every node the compiled helpers can run is lowered, once per
plan, to a list of instructions that native/executor.c runs in one call.

Why: a decode step of SmolLM2-135M is ~670 nodes. From Python each pays the interpreter loop, the kernel's
checks, `ndarray.ctypes` (~1 us an array), a ctypes call (~0.1 us an argument) and an allocation, 2-40 us a node
around microseconds of work: ~40% of the step at one thread, and all of it serial when the linears use two cores.

How: every value gets a place when the plan is built (the plan's arena, a constant, an input, a state buffer or
an output allocated per run), so views (reshape, slice, permute, expand) cost nothing at run time: they are
offsets and strides. Compute nodes become instructions that call the helpers the Python kernels call, with the
same arguments, so the two paths give the same results; a value a helper needs contiguous is copied first.

What it takes: a method whose every node lowers runs whole (lower). Otherwise each run of consecutive nodes that
lower (lower_runs: at least MIN_RUN_NODES of them) becomes one step of the method's Python plan, reading the values
the Python steps before it made and handing back the ones the steps after it read; the nodes it cannot take
(another op, dtype or shape) run from Python between runs. `KILN_EXECUTOR=python` turns it off.
At run time an instruction may decline (an index outside its table): the method (or the run) then runs from
Python, which raises the op's own error.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.ir.graph import NO_VALUE, Method, Node, ValueKind
from kiln.ir.ops import COMPARE
from kiln.ir.symbolic import resolve_shape
from kiln.registry import register_once
from kiln.runtime.backends.array_api.conv import pool_geometry
from kiln.runtime.backends.array_api.norm import rms_norm_eps
from kiln.runtime.backends.cpu import conv, forms, linalg, native, quant, resident
from kiln.runtime.backends.cpu import experts as cpu_experts
from kiln.runtime.backends.cpu.reduce import reduced_shape, trailing_rows
from kiln.runtime.program import Program

log = logging.getLogger("kiln.runtime.cpu")

OP = {"qlinear": 1, "linear": 2, "rms_norm": 3, "rope_cache": 4, "attention": 5, "gated": 6, "qembed": 7,
      "gather": 8, "compare": 9, "copy": 10, "binary": 11, "slot_attention": 12, "rope_slot": 13, "layer_norm": 14,
      "unary": 15, "conv": 16, "sum_rows": 17, "max_pool": 18, "clamp": 19, "gemm_rows": 20, "route": 21,
      "gathered": 22, "gathered_q": 23, "qlanes": 24}
"""executor.c's instruction codes."""
COMPARE_CODES = {"lt": 0, "le": 1, "gt": 2, "ge": 3, "eq": 4, "ne": 5}
ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
BINARY = {"add": (0, "if"), "sub": (1, "if"), "mul": (2, "if"), "div": (3, "f"), "remainder": (4, "i"),
          "bitwise_and": (5, "ib"), "bitwise_or": (6, "ib"), "bitwise_xor": (7, "ib")}
"""op -> (executor.c's kind, the dtypes it takes: i int64, f float32, b bool)."""
BINARY_DTYPES = {"i": (np.dtype(np.int64), 0), "f": (np.dtype(np.float32), 1), "b": (np.dtype(np.bool_), 2)}
MAX_ARENA_BYTES = 256 << 20
ALIGN = 64

F32, I64, BOOL = np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.bool_)


def enabled() -> bool:
    return os.environ.get("KILN_EXECUTOR", "native").strip().lower() != "python" and native.library() is not None


class Decline(Exception):
    """A node (or the method) the native executor does not take; the method runs from Python."""


@dataclass(eq=False)
class Root:
    """Memory the plan writes: a region of the arena, or (output) an array allocated for each run."""
    nbytes: int
    output: int = -1
    """The method output it is allocated as, or -1 (the arena)."""
    base: int = 0
    offset: int = 0


@dataclass(frozen=True)
class Loc:
    """Where a value lies: in a root of the plan's, or at a fixed base (constant, input, state); offset and
    strides in bytes."""
    home: Root | int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype

    @property
    def contiguous(self) -> bool:
        expected = self.dtype.itemsize
        for n, s in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def view(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> Loc:
        return Loc(self.home, self.offset + offset, tuple(shape), tuple(strides), self.dtype)


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def elements(loc: Loc) -> tuple[int, ...]:
    return tuple(s // loc.dtype.itemsize for s in loc.strides)


def broadcast_strides(loc: Loc, shape: tuple[int, ...]) -> tuple[int, ...]:
    """loc's element strides read as `shape` (native.broadcast_strides), or Decline."""
    strides = native.broadcast_strides(loc.shape, loc.strides, loc.dtype.itemsize, shape)
    if strides is None:
        raise Decline(f"{list(loc.shape)} does not broadcast to {list(shape)}")
    return strides


def as_float_word(x: float) -> int:
    return int(np.array(x, np.float32).view(np.int32))


@dataclass
class Lowering:
    """Builds one method's instructions (lower() below)."""
    program: Program
    method: Method
    env: dict[str, int]
    locs: dict[int, Loc] = field(default_factory=dict)
    code: list[list[Any]] = field(default_factory=list)
    roots: list[Root] = field(default_factory=list)
    fixed: list[tuple[int, Any]] = field(default_factory=list)
    """(base, array) of the bases known when the plan is built (constants)."""
    inputs: list[tuple[int, int]] = field(default_factory=list)
    """(base, input index)."""
    states: list[tuple[int, int]] = field(default_factory=list)
    """(base, state index)."""
    scratch: Root = field(default_factory=lambda: Root(0))
    bases: int = 1  # base 0: the arena
    origins: list[str] = field(default_factory=list)
    """Per instruction, the node that emitted it (op and input shapes): what a profile of the plan reports."""
    node: str = ""
    bound: list[tuple[int, int]] | None = None
    """A run of a method (lower_runs): (base, value) of each value it reads that is not a constant, bound to the
    array the step before it left, for each run; None: a whole method, which binds its inputs and state."""

    def shape_of(self, value: int) -> tuple[int, ...]:
        return tuple(resolve_shape(self.method.values[value].shape, self.env))

    def base(self) -> int:
        self.bases += 1
        return self.bases - 1

    def loc(self, value: int) -> Loc | None:
        if value == NO_VALUE:
            return None
        if value in self.locs:
            return self.locs[value]
        spec = self.method.values[value]
        if spec.kind == ValueKind.CONSTANT:
            array = resident.constant(self.program, spec.ref)
            base = self.base()
            self.fixed.append((base, array))
            loc = Loc(base, 0, array.shape, array.strides, array.dtype)
        elif self.bound is not None:
            base = self.base()
            self.bound.append((base, value))
            shape, dtype = self.shape_of(value), np.dtype(spec.dtype.numpy)
            loc = Loc(base, 0, shape, c_strides(shape, dtype.itemsize), dtype)
        elif spec.kind == ValueKind.STATE:
            base = self.base()
            self.states.append((base, spec.ref))
            shape = self.shape_of(value)
            loc = Loc(base, 0, shape, c_strides(shape, spec.dtype.numpy.itemsize), np.dtype(spec.dtype.numpy))
        elif spec.kind == ValueKind.INPUT:
            base = self.base()
            self.inputs.append((base, self.method.inputs.index(value)))
            shape = self.shape_of(value)
            loc = Loc(base, 0, shape, c_strides(shape, spec.dtype.numpy.itemsize), np.dtype(spec.dtype.numpy))
        else:
            raise Decline(f"value {spec.name} is read before it is computed")
        self.locs[value] = loc
        return loc

    def new(self, shape: tuple[int, ...], dtype: np.dtype) -> Loc:
        root = Root(max(1, math.prod(shape)) * dtype.itemsize)
        self.roots.append(root)
        return Loc(root, 0, tuple(shape), c_strides(shape, dtype.itemsize), dtype)

    def constant_array(self, loc: Loc) -> np.ndarray | None:
        """The array of a constant loc is the whole of (None: loc is something else, or a view of part of one)."""
        if isinstance(loc.home, int) and loc.offset == 0:
            for base, array in self.fixed:
                if base == loc.home and array.shape == loc.shape and array.strides == loc.strides:
                    return array
        return None

    def fixed_array(self, array: np.ndarray) -> Loc:
        """An array made when the plan is built (a weight's packed form), held by the plan."""
        base = self.base()
        self.fixed.append((base, array))
        return Loc(base, 0, array.shape, array.strides, array.dtype)

    def work(self, nbytes: int) -> Loc:
        """Scratch shared by every instruction (they run one after another)."""
        self.scratch.nbytes = max(self.scratch.nbytes, nbytes)
        return Loc(self.scratch, 0, (nbytes,), (1,), np.dtype(np.uint8))

    def contiguous(self, loc: Loc) -> Loc:
        """loc itself where its elements lie in order, else a copy that does (executor.c's copy walks at most 4
        dims: loc's dims are merged where they walk memory as one first, so a 5-d view such as GQA's keys expanded
        to [B, Hkv, G, S, D] copies as [Hkv, G, S * D])."""
        if loc.contiguous:
            return loc
        shape, strides = _merged_dims(loc.shape, loc.strides)
        if len(shape) > 4:
            raise Decline("a strided copy of more than 4 dims")
        copy = self.new(loc.shape, loc.dtype)
        pad = 4 - len(shape)
        self.emit("copy", loc, copy, loc.dtype.itemsize, *((1,) * pad + shape), *((0,) * pad + strides))
        return copy

    def emit(self, op: str, *words: Any) -> None:
        self.code.append([OP[op], *words])
        self.origins.append(self.node)

    def output(self, node: Node, *locs: Loc) -> None:
        for value, loc in zip(node.outputs, locs, strict=True):
            spec = self.method.values[value]
            if loc.shape != self.shape_of(value) or loc.dtype != np.dtype(spec.dtype.numpy):
                raise Decline(f"{node.op} would give {loc.dtype}{list(loc.shape)} for {spec.spec()}")
            self.locs[value] = loc


def _merged_dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) visiting the same elements in the same order with dims of size 1 dropped and each dim merged
    into the one before it where that one's stride is this one's stride times its size."""
    merged: list[list[int]] = []
    for size, stride in zip(shape, strides, strict=True):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    return tuple(m[0] for m in merged) or (1,), tuple(m[1] for m in merged) or (0,)


Lower = Callable[[Lowering, Node, dict[str, Any]], None]
LOWERINGS: dict[str, Lower] = {}


def lowering(*ops: str) -> Callable[[Lower], Lower]:
    return register_once(LOWERINGS, "cpu executor lowering", ops)


def _inputs(lw: Lowering, node: Node) -> list[Loc | None]:
    return [lw.loc(i) for i in node.inputs]


def _need(condition: bool, why: str) -> None:
    if not condition:
        raise Decline(why)


# ---- views: offsets and strides, nothing at run time ----

@lowering("reshape")
def _reshape(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    x = lw.contiguous(_inputs(lw, node)[0])
    shape = lw.shape_of(node.outputs[0])
    lw.output(node, x.view(0, shape, c_strides(shape, x.dtype.itemsize)))


@lowering("permute")
def _permute(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    x = _inputs(lw, node)[0]
    perm = [p % len(x.shape) for p in attrs["perm"]]
    lw.output(node, x.view(0, tuple(x.shape[p] for p in perm), tuple(x.strides[p] for p in perm)))


@lowering("slice")
def _slice(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    x = _inputs(lw, node)[0]
    dim = attrs["dim"] % len(x.shape)
    start, _, step = slice(attrs["start"], attrs["end"], attrs["step"]).indices(x.shape[dim])
    count = len(range(*slice(attrs["start"], attrs["end"], attrs["step"]).indices(x.shape[dim])))
    shape, strides = list(x.shape), list(x.strides)
    shape[dim], strides[dim] = count, strides[dim] * step
    lw.output(node, x.view(start * x.strides[dim] if count else 0, tuple(shape), tuple(strides)))


@lowering("expand")
def _expand(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    x = _inputs(lw, node)[0]
    shape = lw.shape_of(node.outputs[0])
    strides = tuple(s * x.dtype.itemsize for s in broadcast_strides(x, shape))
    lw.output(node, x.view(0, shape, strides))


# ---- compute ----

CAT_ROWS = 256
"""The most rows (the product of the dims before a cat's) the executor copies a cat's inputs for, one copy per row
and input."""


@lowering("cat")
def _cat(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """Each input's block of every row (the dims before `dim`) copied into its place in the output (executor.c's
    strided copy, one a row and input): a rotary table's gathered rows repeated to full width, as gpt-oss's rotation
    in halves has it (fuse_rope), one row a sequence of a step."""
    parts = _inputs(lw, node)
    shape = lw.shape_of(node.outputs[0])
    dim = int(attrs["dim"]) % max(len(shape), 1)
    rows = math.prod(shape[:dim])
    _need(all(p is not None for p in parts) and rows <= CAT_ROWS, f"at most {CAT_ROWS} rows")
    out = lw.new(shape, parts[0].dtype)
    row_bytes = math.prod(shape[dim:]) * out.dtype.itemsize
    for row, index in enumerate(np.ndindex(*shape[:dim])):
        offset = row * row_bytes
        for part in parts:
            block = part.shape[dim:]
            size = math.prod(block) * part.dtype.itemsize
            if size == 0:
                continue
            source = part.view(sum(i * st for i, st in zip(index, part.strides[:dim], strict=True)), block,
                               part.strides[dim:])
            merged, strides = _merged_dims(source.shape, source.strides)
            _need(len(merged) <= 4, "an input block of more than 4 strided dims")
            pad = 4 - len(merged)
            lw.emit("copy", source, out.view(offset, block, c_strides(block, part.dtype.itemsize)),
                    part.dtype.itemsize, *((1,) * pad + merged), *((0,) * pad + strides))
            offset += size
    lw.output(node, out)


def _rows(x: Loc) -> int:
    return math.prod(x.shape[:-1])


def emit_quantized_linear(lw: Lowering, node: Node, x: Loc, first: int, attrs: dict[str, Any]) -> Loc:
    """quantized_linear of x by the node's weight (q at input `first`, then scale, zero, bias; its own quantization
    attributes; its inputs refined where the node yields a method output: quant.yields_output): constants the lanes
    form takes (resident.node_lanes) up to quant.lanes_rows rows; otherwise few float32 rows by the native
    qlinear."""
    bits, group, offset = int(attrs["bits"]), int(attrs["group_size"]), bool(attrs.get("offset", False))
    refine = quant.yields_output(lw.method, node)
    _need(x.dtype == F32, "not float32 rows")
    lanes = resident.node_lanes(lw.program, lw.method, node, first) if _rows(x) <= quant.lanes_rows(bits) else None
    if lanes is not None:
        packed, n, k, group = lanes
        _need(x.shape[-1] == k, "input features")
        bias = lw.loc(node.inputs[first + 3])
        _need(bias is None or (bias.dtype == F32 and bias.shape == (n,)), "float32 bias")
        x, bias = lw.contiguous(x), None if bias is None else lw.contiguous(bias)
        out = lw.new(x.shape[:-1] + (n,), F32)
        work = lw.work(2 * _rows(x) * (k + k // group) * 4)
        lw.emit("qlanes", x, lw.fixed_array(packed), bias, out, work, _rows(x), n, k,
                native.quant_format(bits, offset, refine), group)
        return out
    q, scale, zero, bias = (lw.loc(node.inputs[first + i]) for i in range(4))
    _need(scale.dtype == F32 and _rows(x) <= quant.FEW_ROWS, "not a few float32 rows")
    k, n = x.shape[-1], q.shape[0]
    _need(bits in (4, 8) and group > 0 and k % group == 0 and q.shape == (n, k * bits // 8), "weight layout")
    _need(all(a is None or a.dtype == F32 for a in (zero, bias)), "float32 scales")
    x, q, scale = lw.contiguous(x), lw.contiguous(q), lw.contiguous(scale)
    zero, bias = (None if a is None else lw.contiguous(a) for a in (zero, bias))
    out = lw.new(x.shape[:-1] + (n,), F32)
    work = lw.work(2 * quant.FEW_ROWS * (k + k // group) * 4)  # (twice: refined inputs, quant.h)
    form = native.quant_format(bits, offset, refine)
    lw.emit("qlinear", x, q, scale, zero, bias, out, work, _rows(x), n, k, form, group, int(native.integer_dot()))
    return out


@lowering("quantized_linear")
def _quantized_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    lw.output(node, emit_quantized_linear(lw, node, lw.loc(node.inputs[0]), 1, attrs))


@lowering("gated_quantized_linear")
def _gated_quantized_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As composite.gated_quantized_linear."""
    h = emit_quantized_linear(lw, node, lw.loc(node.inputs[0]), 1, attrs)
    lw.output(node, emit_gated(lw, *_halves(h), attrs["activation"]))


@lowering("add_rms_norm_quantized_linear")
def _add_rms_norm_quantized_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As composite.add_rms_norm_quantized_linear."""
    x, residual, norm_weight = (lw.loc(i) for i in node.inputs[:3])
    total, normed = emit_rms_norm(lw, x, residual, norm_weight, int(attrs["axes"]), attrs["eps"])
    h = emit_quantized_linear(lw, node, normed, 3, attrs)
    activation = attrs["activation"]
    lw.output(node, total, emit_gated(lw, *_halves(h), activation) if activation else h)


def emit_linear(lw: Lowering, x: Loc, weight: Loc, bias: Loc | None) -> Loc:
    """As linalg.linear's float32 paths: few rows by kiln_linear_rows_f32, more by the GEMM with the weight (a
    constant) packed once here, writing the output's rows with the bias added."""
    _need(x.dtype == F32 and weight.dtype == F32 and len(weight.shape) == 2, "float32 rows")
    _need(bias is None or bias.dtype == F32, "float32 bias")
    n, k = weight.shape
    rows = _rows(x)
    x = lw.contiguous(x)
    bias = None if bias is None else lw.contiguous(bias)
    out = lw.new(x.shape[:-1] + (n,), F32)
    if rows <= linalg.FEW_ROWS:
        lw.emit("linear", x, lw.contiguous(weight), bias, out, rows, n, k)
        return out
    array = lw.constant_array(weight)
    _need(array is not None and array.flags.c_contiguous, "many rows times a weight computed at run time")
    packed = lw.fixed_array(forms.packed_gemm_weight(array))
    lw.emit("gemm_rows", x, packed, bias, out, rows, n, k)
    return out


def emit_gated(lw: Lowering, gate: Loc, up: Loc, activation: str) -> Loc:
    _need(gate.dtype == F32 and up.dtype == F32 and gate.shape == up.shape, "float32 of one shape")
    _need(activation in ACTIVATION_CODES, "activation")
    gate, up = lw.contiguous(gate), lw.contiguous(up)
    out = lw.new(gate.shape, F32)
    lw.emit("gated", gate, up, out, gate.size, ACTIVATION_CODES[activation])
    return out


def emit_gated_linear(lw: Lowering, x: Loc, weight: Loc, bias: Loc | None, activation: str) -> Loc:
    """As composite.gated_linear: the linear over the stacked weight, then the activation of its two halves."""
    return emit_gated(lw, *_halves(emit_linear(lw, x, weight, bias)), activation)


def _halves(h: Loc) -> tuple[Loc, Loc]:
    """Views of the first and second halves of h's last dim (a stacked gate/up projection's gate and up)."""
    n = h.shape[-1] // 2
    last = len(h.shape) - 1
    return (h.view(0, h.shape[:-1] + (n,), h.strides),
            h.view(n * h.strides[last], h.shape[:-1] + (n,), h.strides))


def emit_rms_norm(lw: Lowering, x: Loc, residual: Loc | None, weight: Loc | None, axes: int,
                  eps: float | None) -> tuple[Loc | None, Loc]:
    _need(x.dtype == F32 and all(a is None or a.dtype == F32 for a in (residual, weight)), "float32")
    _need(1 <= axes <= len(x.shape) and (residual is None or residual.shape == x.shape), "shapes")
    n = math.prod(x.shape[len(x.shape) - axes:])
    _need(weight is None or weight.size == n, "weight size")
    x = lw.contiguous(x)
    residual, weight = (None if a is None else lw.contiguous(a) for a in (residual, weight))
    total = lw.new(x.shape, F32) if residual is not None else None
    out = lw.new(x.shape, F32)
    lw.emit("rms_norm", x, residual, weight, total, out, x.size // max(n, 1), n,
            as_float_word(rms_norm_eps(eps, np.dtype(np.float32))))
    return total, out


def emit_route(lw: Lowering, logits: Loc, attrs: dict[str, Any]) -> tuple[Loc, Loc]:
    """As cpu/experts.py's route_experts: float32 logits and weights by native/experts.c."""
    k, n = int(attrs["k"]), logits.shape[-1] if logits.shape else 0
    _need(logits.dtype == F32 and attrs["dtype"].numpy == F32 and 0 < k <= n, "float32 logits and weights")
    logits = lw.contiguous(logits)
    weights, ids = lw.new(logits.shape[:-1] + (k,), F32), lw.new(logits.shape[:-1] + (k,), I64)
    lw.emit("route", logits, weights, ids, lw.work(4 * n), _rows(logits), n, k, int(attrs["normalize"]))
    return weights, ids


@lowering("route_experts")
def _route_experts(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    lw.output(node, *emit_route(lw, *_inputs(lw, node), attrs))


@lowering("add_rms_norm_route_experts")
def _add_rms_norm_route_experts(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As composite.add_rms_norm_route_experts: the norm, the router's linear over the rows [R, D], the pick."""
    x, residual, norm_weight, weight, bias = _inputs(lw, node)
    total, normed = emit_rms_norm(lw, x, residual, norm_weight, int(attrs["axes"]), attrs["eps"])
    rows = normed.view(0, (_rows(normed), normed.shape[-1]), c_strides((_rows(normed), normed.shape[-1]), 4))
    lw.output(node, total, normed, *emit_route(lw, emit_linear(lw, rows, weight, bias), attrs))


def _gathered_out(lw: Lowering, rows: int, n: int, combine: Loc | None) -> tuple[int, Loc]:
    """(k, the output) of a gathered linear: [rows, n], or [tokens, n] where combine [tokens, k] sums k rows."""
    return (0, lw.new((rows, n), F32)) if combine is None else (combine.shape[1], lw.new((combine.shape[0], n), F32))


@lowering("gathered_linear")
def _gathered_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    lw.output(node, emit_gathered_linear(lw, *(_inputs(lw, node) + [None] * 5)[:5]))


@lowering("gated_gathered_linear")
def _gated_gathered_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As composite.gated_gathered_linear: the gathered rows over the stacked experts, then the halves' activation."""
    x, weight, index, bias = (_inputs(lw, node) + [None] * 4)[:4]
    lw.output(node, emit_gated(lw, *_halves(emit_gathered_linear(lw, x, weight, index, bias, None)),
                               attrs["activation"]))


def emit_gathered_linear(lw: Lowering, x: Loc, weight: Loc, index: Loc, bias: Loc | None,
                         combine: Loc | None) -> Loc:
    """As cpu/experts.py's native path: a decode step's float32 rows (and their combine) by native/experts.c."""
    _need(x.dtype == F32 and weight.dtype == F32 and len(weight.shape) == 3 and index.dtype == I64, "float32 rows")
    _need(all(a is None or a.dtype == F32 for a in (bias, combine)), "float32 bias and combine")
    s, (experts, n, k) = x.shape[0], weight.shape
    _need(len(x.shape) == 2 and s <= cpu_experts.GATHERED_ROWS_MAX, "a decode step's few rows")
    x, weight, index = lw.contiguous(x), lw.contiguous(weight), lw.contiguous(index)
    bias, combine = (None if a is None else lw.contiguous(a) for a in (bias, combine))
    topk, out = _gathered_out(lw, s, n, combine)
    lw.emit("gathered", x, index, weight, bias, combine, out, lw.work(4 * cpu_experts.gathered_work(n, k)), s, n, k,
            experts, topk)
    return out


@lowering("gathered_quantized_linear")
def _gathered_quantized_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As cpu/experts.py's native path, quantized: each expert group through the quantized few-row linear."""
    x, q, scale, zero, index, bias, combine = (_inputs(lw, node) + [None] * 7)[:7]
    bits, group = int(attrs["bits"]), int(attrs["group_size"])
    _need(x.dtype == F32 and scale.dtype == F32 and index.dtype == I64 and len(q.shape) == 3, "float32 rows")
    _need(all(a is None or a.dtype == F32 for a in (zero, bias, combine)), "float32 scales, bias and combine")
    s, k, (experts, n) = x.shape[0], x.shape[-1], q.shape[:2]
    _need(len(x.shape) == 2 and s <= cpu_experts.GATHERED_ROWS_MAX, "a decode step's few rows")
    _need(bits in (4, 8) and group > 0 and k % group == 0 and q.shape[2] == k * bits // 8, "weight layout")
    x, q, scale, index = (lw.contiguous(a) for a in (x, q, scale, index))
    zero, bias, combine = (None if a is None else lw.contiguous(a) for a in (zero, bias, combine))
    topk, out = _gathered_out(lw, s, n, combine)
    form = native.quant_format(bits, attrs.get("offset", False))
    lw.emit("gathered_q", x, index, q, scale, zero, bias, combine, out,
            lw.work(4 * cpu_experts.gathered_work(n, k, group)), s, n, k, experts, topk, form, group,
            int(native.integer_dot()))
    lw.output(node, out)


@lowering("linear")
def _linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    lw.output(node, emit_linear(lw, *_inputs(lw, node)))


@lowering("gated_linear")
def _gated_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    lw.output(node, emit_gated_linear(lw, *_inputs(lw, node), attrs["activation"]))


@lowering("gated_activation")
def _gated(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    lw.output(node, emit_gated(lw, *_inputs(lw, node), attrs["activation"]))


@lowering("rms_norm")
def _rms_norm(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    x, weight = _inputs(lw, node)
    lw.output(node, emit_rms_norm(lw, x, None, weight, int(attrs["axes"]), attrs["eps"])[1])


@lowering("add_rms_norm")
def _add_rms_norm(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    lw.output(node, *emit_rms_norm(lw, *_inputs(lw, node), int(attrs["axes"]), attrs["eps"]))


@lowering("add_rms_norm_linear")
def _add_rms_norm_linear(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As composite.add_rms_norm_linear."""
    x, residual, norm_weight, weight, bias = _inputs(lw, node)
    total, normed = emit_rms_norm(lw, x, residual, norm_weight, int(attrs["axes"]), attrs["eps"])
    activation = attrs["activation"]
    out = emit_gated_linear(lw, normed, weight, bias, activation) if activation else emit_linear(lw, normed, weight,
                                                                                                  bias)
    lw.output(node, total, out)


@lowering("rope_cache_update")
def _rope_cache_update(lw: Lowering, node: Node, attrs: dict[str, Any], ins: list[Loc | None] | None = None) -> None:
    """ins: the node's inputs as read (norm_rope_cache_update's lowering passes its normalized q and k)."""
    q, k, v, cos, sin, k_cache, v_cache, *indices = ins = _inputs(lw, node) if ins is None else ins
    if bool(attrs["in_place"]) and len(indices) == 2 and tuple(attrs["dims"]) == (0, 1):
        _rope_slot_update(lw, node, attrs, ins)
        return
    _need(bool(attrs["in_place"]) and len(indices) == 1 and tuple(attrs["dims"]) == (2,), "one index on dim 2")
    positions = lw.contiguous(indices[0])
    _need(all(len(a.shape) == 4 and a.dtype == F32 for a in (q, k, v, k_cache, v_cache)), "rank-4 float32")
    B, Hq, L, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    _need(k.shape == (B, Hkv, L, D) and v.shape == k.shape and k_cache.shape == (B, Hkv, S, D) and D % 2 == 0
          and v_cache.shape == k_cache.shape and positions.dtype == I64 and positions.shape == (L,), "shapes")
    _need(k_cache.contiguous and v_cache.contiguous and cos.dtype == F32 and sin.dtype == F32, "layouts")
    strides = [broadcast_strides(a, shape) for a, shape in ((q, q.shape), (k, k.shape), (v, v.shape),
                                                            (cos, (B, 1, L, D)), (sin, (B, 1, L, D)))]
    _need(strides[3] == strides[4] and all(s[3] == 1 or D == 1 for s in strides), "cos and sin rows alike")
    q_out = lw.new(q.shape, F32)
    qs, ks, vs, cs, _ = strides
    lw.emit("rope_cache", q, k, v, cos, sin, k_cache, v_cache, positions, q_out, B, Hq, Hkv, L, D, S, *qs[:3],
            *ks[:3], *vs[:3], cs[0], cs[2], int(attrs["interleaved"]))
    lw.output(node, q_out, k_cache, v_cache)


def _rope_slot_update(lw: Lowering, node: Node, attrs: dict[str, Any], ins: list[Loc | None]) -> None:
    """A serving program's step (native.rope_slot_update's contract): one token a sequence at (slot, position)."""
    q, k, v, cos, sin, k_cache, v_cache, slots, positions = ins
    _need(all(len(a.shape) == 4 and a.dtype == F32 for a in (q, k, v, k_cache, v_cache)), "rank-4 float32")
    B, Hq, _, D = q.shape
    count, S, Hkv = k_cache.shape[:3]
    _need(q.shape[2] == 1 and k.shape == (B, 1, Hkv, D) and v.shape == k.shape and k_cache.shape[3] == D
          and v_cache.shape == k_cache.shape and D % 2 == 0 and k_cache.contiguous and v_cache.contiguous, "shapes")
    _need(all(i.dtype == I64 and i.size == B for i in (slots, positions)), "one int64 slot and position a sequence")
    strides = [broadcast_strides(a, shape) for a, shape in ((q, q.shape), (k, k.shape), (v, v.shape),
                                                            (cos, (B, 1, 1, D)), (sin, (B, 1, 1, D)))]
    _need(strides[3] == strides[4] and all(s[3] == 1 for s in strides) and cos.dtype == F32 == sin.dtype, "layouts")
    slots, positions = lw.contiguous(slots), lw.contiguous(positions)
    q_out = lw.new(q.shape, F32)
    qs, ks, vs, cs, _ = strides
    lw.emit("rope_slot", q, k, v, cos, sin, k_cache, v_cache, slots, positions, q_out, B, Hq, Hkv, D, S, count,
            qs[0], qs[1], ks[0], ks[2], vs[0], vs[2], cs[0], int(attrs["interleaved"]))
    lw.output(node, q_out, k_cache, v_cache)


@lowering("norm_rope_cache_update")
def _norm_rope_cache_update(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As composite.norm_rope_cache_update: q's and k's rows RMS-normalized, then rope_cache_update's lowering."""
    q, k, v, cos, sin, k_cache, v_cache, q_weight, k_weight, *indices = _inputs(lw, node)
    _, q = emit_rms_norm(lw, q, None, q_weight, 1, attrs["eps"])
    _, k = emit_rms_norm(lw, k, None, k_weight, 1, attrs["eps"])
    _rope_cache_update(lw, node, attrs, [q, k, v, cos, sin, k_cache, v_cache, *indices])


def _sinks(lw: Lowering, sinks: Loc | None, heads: int) -> Loc | None:
    """An attention's sinks as attention.c reads them (float32, one a q head, contiguous), or None."""
    if sinks is None:
        return None
    _need(sinks.dtype == F32 and sinks.shape == (heads,), "float32 sinks, one a q head")
    return lw.contiguous(sinks)


@lowering("slot_attention")
def _slot_attention(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    q, k_cache, v_cache, slots, positions, sinks = (_inputs(lw, node) + [None])[:6]
    _need(all(len(a.shape) == 4 and a.dtype == F32 for a in (q, k_cache, v_cache)), "rank-4 float32")
    B, Hq, T, D = q.shape
    count, S, Hkv = k_cache.shape[:3]
    _need(T <= native.ATTENTION_MAX_QUERIES and k_cache.shape[3] == D and Hkv > 0 and Hq % Hkv == 0
          and v_cache.shape[:3] == (count, S, Hkv) and k_cache.contiguous and v_cache.contiguous, "shapes")
    _need(slots.dtype == I64 and slots.shape == (B,) and positions.dtype == I64 and positions.shape == (B, T),
          "int64 slots and positions")
    sinks = _sinks(lw, sinks, Hq)
    q, slots, positions = lw.contiguous(q), lw.contiguous(slots), lw.contiguous(positions)
    out = lw.new((B, Hq, T, v_cache.shape[3]), F32)
    lw.emit("slot_attention", q, k_cache, v_cache, slots, positions, sinks, out, B, Hq, Hkv, T, S, D,
            v_cache.shape[3], count, int(attrs["window"]), as_float_word(attrs["scale"]))
    lw.output(node, out)


@lowering("sdpa")
def _sdpa(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    q, k, v, mask, sinks = (_inputs(lw, node) + [None])[:5]
    _need(all(len(a.shape) == 4 and a.dtype == F32 for a in (q, k, v)), "rank-4 float32")
    B, Hq, L, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    _need(k.shape == (B, Hkv, S, D) and v.shape[:3] == (B, Hkv, S) and Hkv > 0 and Hq % Hkv == 0, "GQA shapes")
    _need(k.strides[3] == 4 and v.strides[3] == 4, "rows of keys contiguous")
    mask_strides = (0, 0, 0, 0)
    if mask is not None:
        _need(mask.dtype == BOOL and len(mask.shape) <= 4, "a bool mask")
        mask_strides = broadcast_strides(mask, (B, Hq, L, S))
    sinks = _sinks(lw, sinks, Hq)
    q = lw.contiguous(q)
    scale = attrs["scale"] if attrs["scale"] is not None else 1 / math.sqrt(D)
    out = lw.new((B, Hq, L, Dv), F32)
    lw.emit("attention", q, k, v, mask, sinks, out, B, Hq, Hkv, L, S, D, Dv, *elements(k)[:3],
            *elements(v)[:3], *mask_strides, int(bool(attrs["causal"])), as_float_word(scale))
    lw.output(node, out)


@lowering("layer_norm")
def _layer_norm(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As native.layer_norm (the CPU kernel's float32 path)."""
    x, weight, bias = _inputs(lw, node)
    axes = int(attrs["axes"])
    _need(x.dtype == F32 and all(a is None or a.dtype == F32 for a in (weight, bias)), "float32")
    _need(1 <= axes <= len(x.shape), "axes")
    n = math.prod(x.shape[len(x.shape) - axes:])
    _need(all(a is None or a.size == n for a in (weight, bias)), "weight and bias of the normalized size")
    x = lw.contiguous(x)
    weight, bias = (None if a is None else lw.contiguous(a) for a in (weight, bias))
    out = lw.new(x.shape, F32)
    lw.emit("layer_norm", x, weight, bias, out, x.size // max(n, 1), n, as_float_word(float(attrs["eps"])))
    lw.output(node, out)


@lowering("conv")
def _conv(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """conv.route's compiled routes (kiln_conv2d_f32, as the CPU kernel calls it); a route that multiplies by a
    prepared form of the weight (packed, transformed) needs the weight to be a constant, prepared here once."""
    x, weight, bias = _inputs(lw, node)
    _need(not attrs["transposed"] and x.dtype == F32 and weight.dtype == F32 and (bias is None or bias.dtype == F32),
          "a float32 convolution")
    padding_end = tuple(attrs["padding_end"]) or tuple(attrs["padding"])
    r = conv.route(x.shape, weight.shape, tuple(attrs["stride"]), tuple(attrs["padding"]), padding_end,
                   tuple(attrs["dilation"]), int(attrs["groups"]))
    _need(r is not None and r.code is not None, "no compiled route")
    if r.prepared:
        array = lw.constant_array(weight)
        _need(array is not None, "a weight computed at run time")
        weight = lw.fixed_array(r.weight_form(array))
    else:
        weight = lw.contiguous(weight)
    x = lw.contiguous(x)
    bias = None if bias is None else lw.contiguous(bias)
    n, _, _, _, o, *_, oh, ow = r.geometry
    out = lw.new((n, o, oh, ow), F32)
    work = lw.work(4 * r.work_floats) if r.work_floats else None
    lo, hi = native.bounds(attrs["activation_min"], attrs["activation_max"])
    lw.emit("conv", x, weight, bias, out, work, r.code, r.band, native.ACTIVATION_CODES[attrs["activation"]],
            as_float_word(lo), as_float_word(hi), *r.geometry)
    lw.output(node, out)


@lowering("sum", "mean")
def _sum_rows(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As cpu/reduce.py: float32 sums over trailing dims."""
    (x,) = _inputs(lw, node)
    dims = tuple(attrs["dims"])
    shape = trailing_rows(x.shape, dims)
    _need(x.dtype == F32 and shape is not None and shape[1] > 0, "float32 over trailing dims")
    rows, n = shape
    x = lw.contiguous(x)
    out = lw.new(reduced_shape(x.shape, dims, bool(attrs["keepdim"])), F32)
    lw.emit("sum_rows", x, out, rows, n, as_float_word(float(n) if node.op == "mean" else 1.0))
    lw.output(node, out)


@lowering("max_pool")
def _max_pool(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """As cpu/conv.py's max_pool: 2-d, float32."""
    (x,) = _inputs(lw, node)
    kernel = tuple(attrs["kernel"])
    stride = tuple(attrs["stride"]) or kernel
    _need(len(kernel) == 2 and x.dtype == F32 and len(x.shape) >= 2 and x.size > 0, "2-d float32")
    out_sp, _ = pool_geometry(x.shape[-2:], kernel, stride, attrs["padding"], attrs["dilation"], attrs["ceil_mode"])
    _need(0 not in out_sp, "an empty output")
    x = lw.contiguous(x)
    out = lw.new(x.shape[:-2] + out_sp, F32)
    lw.emit("max_pool", x, out, x.size // (x.shape[-1] * x.shape[-2]), *x.shape[-2:], *kernel, *stride,
            *attrs["padding"], *attrs["dilation"], *out_sp)
    lw.output(node, out)


def _emit_clamp(lw: Lowering, node: Node, lo: float | None, hi: float | None) -> None:
    """As native.clamp (the CPU kernel's float32 path)."""
    (x,) = _inputs(lw, node)
    _need(x.dtype == F32, "float32")
    x = lw.contiguous(x)
    out = lw.new(x.shape, F32)
    lw.emit("clamp", x, out, x.size, *(as_float_word(b) for b in native.bounds(lo, hi)))
    lw.output(node, out)


@lowering("clamp")
def _clamp(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    _need(attrs["min"] is not None or attrs["max"] is not None, "no bound")
    _emit_clamp(lw, node, attrs["min"], attrs["max"])


@lowering("relu")
def _relu(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    _emit_clamp(lw, node, 0.0, None)


def _emit_unary(lw: Lowering, node: Node, name: str) -> None:
    """native.unary's compiled function `name` over float32 x (the CPU kernel's float32 path)."""
    (x,) = _inputs(lw, node)
    _need(x.dtype == F32, "float32")
    x = lw.contiguous(x)
    out = lw.new(x.shape, F32)
    lw.emit("unary", x, out, x.size, native.UNARY.index(name))
    lw.output(node, out)


@lowering("gelu")
def _gelu(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    _emit_unary(lw, node, "gelu_tanh" if attrs["approximate"] == "tanh" else "gelu_erf")


@lowering(*native.UNARY)
def _unary(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    _emit_unary(lw, node, node.op)


@lowering("quantized_embedding")
def _quantized_embedding(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    q, scale, zero, ids = _inputs(lw, node)
    bits, group = int(attrs["bits"]), int(attrs["group_size"])
    vocab, k = scale.shape[0], scale.shape[1] * group
    _need(bits in (4, 8) and q.shape == (vocab, k * bits // 8) and ids.dtype == I64, "layout")
    _need(scale.dtype == F32 and (zero is None or zero.dtype == F32), "float32 scales")
    q, scale, ids = lw.contiguous(q), lw.contiguous(scale), lw.contiguous(ids)
    zero = None if zero is None else lw.contiguous(zero)
    out = lw.new(ids.shape + (k,), F32)
    form = native.quant_format(bits, attrs.get("offset", False))
    lw.emit("qembed", q, scale, zero, ids, out, ids.size, vocab, k, form, group)
    lw.output(node, out)


def _gather_rows(lw: Lowering, node: Node, table: Loc, ids: Loc) -> None:
    _need(ids.dtype == I64 and len(table.shape) >= 1, "int64 indices")
    table, ids = lw.contiguous(table), lw.contiguous(ids)
    row = table.shape[1:]
    out = lw.new(ids.shape + row, table.dtype)
    lw.emit("gather", table, ids, out, ids.size, table.shape[0], math.prod(row) * table.dtype.itemsize)
    lw.output(node, out)


@lowering("embedding")
def _embedding(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    weight, ids = _inputs(lw, node)
    _gather_rows(lw, node, weight, ids)


@lowering("index")
def _index(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    x, *indices = _inputs(lw, node)
    _need(len(indices) == 1 and tuple(attrs["dims"]) in ((0,), (-len(x.shape),)), "one index on the first dim")
    _gather_rows(lw, node, x, indices[0])


@lowering(*COMPARE)
def _compare(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    a, b = _inputs(lw, node)
    _need(a.dtype == b.dtype and a.dtype in (I64, F32), "int64 or float32 operands of one type")
    shape = lw.shape_of(node.outputs[0])
    _need(len(shape) <= 4, "rank <= 4")
    pad = (1,) * (4 - len(shape))
    out = lw.new(shape, BOOL)
    lw.emit("compare", a, b, out, COMPARE_CODES[node.op], 0 if a.dtype == I64 else 1, *(pad + shape),
            *broadcast_strides(a, pad + shape), *broadcast_strides(b, pad + shape))
    lw.output(node, out)


@lowering(*BINARY)
def _binary(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """Elementwise arithmetic with broadcasting, all three of one dtype (NumPy's promotion otherwise: declined)."""
    a, b = _inputs(lw, node)
    kind, dtypes = BINARY[node.op]
    shape = lw.shape_of(node.outputs[0])
    out_dtype = np.dtype(lw.method.values[node.outputs[0]].dtype.numpy)
    codes = {BINARY_DTYPES[c][0]: BINARY_DTYPES[c][1] for c in dtypes}
    _need(a.dtype == b.dtype == out_dtype and a.dtype in codes, "operands of one type")
    dims, a_strides, b_strides = collapse(shape, broadcast_strides(a, shape), broadcast_strides(b, shape))
    _need(len(dims) <= 4, "more than 4 dims after merging")
    pad = 4 - len(dims)
    out = lw.new(shape, out_dtype)
    lw.emit("binary", a, b, out, kind, codes[a.dtype], *((1,) * pad + dims), *((0,) * pad + a_strides),
            *((0,) * pad + b_strides))
    lw.output(node, out)


def collapse(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """shape and the operands' element strides with adjacent dims merged where every operand steps through both
    as through one (a contiguous output always does): [1, C, 1, 1] x [1, C, H, W] becomes [C, H * W], so the
    innermost loop runs over whole planes."""
    dims = [(n, list(s)) for n, *s in zip(shape, *strides, strict=True) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, s in dims:
        if merged and all(prev == cur * n for prev, cur in zip(merged[-1][1], s, strict=True)):
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if not merged:
        return (1,), *((0,) for _ in strides)
    return tuple(n for n, _ in merged), *(tuple(s[k] for _, s in merged) for k in range(len(strides)))


# ---- the plan ----

def place_arena(lw: Lowering) -> int:
    """Offsets in the arena for the plan's roots (all but the per-run outputs), reusing the bytes of a root whose
    last instruction has run for one first written after it; the arena's size. Why: placed one after another, an
    EfficientNet-lite0 plan's arena was 24 MB, every run writing all of it (2-3x the L3 a core gets, evicting the
    weights); with reuse its maps cycle through a few MB that stay in cache, as ONNX Runtime's planned buffers do.
    The shared scratch lives throughout; a root that no instruction reads or writes gets any place."""
    first: dict[Root, int] = {}
    last: dict[Root, int] = {}
    for k, instruction in enumerate(lw.code):
        for word in instruction:
            if isinstance(word, Loc) and isinstance(word.home, Root):
                first.setdefault(word.home, k)
                last[word.home] = k

    def size(root: Root) -> int:
        return -(-root.nbytes // ALIGN) * ALIGN

    lw.scratch.base, lw.scratch.offset = 0, 0
    live: list[tuple[int, int, int]] = []  # (offset, end, last instruction), by offset
    end_of_arena = size(lw.scratch)
    for root in sorted((r for r in lw.roots if r.output < 0), key=lambda r: first.get(r, -1)):
        start = first.get(root, -1)
        live = [block for block in live if block[2] >= start]
        offset, need = size(lw.scratch), size(root)
        for block_offset, block_end, _ in live:
            if block_offset - offset >= need:
                break
            offset = max(offset, block_end)
        root.base, root.offset = 0, offset
        live.append((offset, offset + need, last.get(root, -1)))
        live.sort()
        end_of_arena = max(end_of_arena, offset + need)
    return end_of_arena


_arenas = threading.local()


def _arena(nbytes: int) -> int:
    """The address of this thread's arena, at least nbytes (64-byte aligned). Every lowered plan places its
    temporaries there for the length of one run: a thread runs one plan at a time, and no plan keeps anything in
    its arena between runs (outputs and state are arrays of their own). One arena per plan, as before, cost a
    fresh allocation's page faults on every plan's first runs (a prompt of a new length: its prefill's 31 lowered
    runs took 276 ms the first time, 99 ms after) and held a megabytes-large arena for each of up to 64 plans a
    method; shared, the memory is touched once and stays warm."""
    buffer = getattr(_arenas, "buffer", None)
    if buffer is None or buffer.nbytes < nbytes + ALIGN:
        buffer = _arenas.buffer = np.empty(max(nbytes, 1 << 16) + ALIGN, np.uint8)
        _arenas.address = buffer.ctypes.data + (-buffer.ctypes.data % ALIGN)
    return _arenas.address


class _Instructions:
    """A lowering's instructions encoded for executor.c, with the arena and the bases known when it is built."""

    def __init__(self, lw: Lowering, outputs: list[tuple[Loc, tuple[int, ...], np.dtype]], threads: int | None):
        self.lib = native.library()
        self.threads = threads
        words = int(self.lib.kiln_execute_words())
        self.arena_bytes = place_arena(lw)
        if self.arena_bytes > MAX_ARENA_BYTES:
            raise Decline(f"an arena of {self.arena_bytes} bytes")
        self.bases = np.zeros(lw.bases, np.int64)  # (base 0, the arena: set by each run, _execute)
        self.keep = [array for _, array in lw.fixed]
        for base, array in lw.fixed:
            self.bases[base] = array.ctypes.data
        code = np.zeros((len(lw.code), words), np.int64)
        for row, instruction in zip(code, lw.code, strict=True):
            encoded: list[int] = []
            for word in instruction:
                if word is None:
                    encoded += [-1, 0]
                elif isinstance(word, Loc):
                    home = word.home
                    encoded += [home.base, home.offset + word.offset] if isinstance(home, Root) else [home, word.offset]
                else:
                    encoded.append(int(word))
            if len(encoded) > words:
                raise Decline("an instruction longer than executor.c's")
            row[:len(encoded)] = encoded
        self.code = code
        self.origins = lw.origins
        self.times: np.ndarray | None = None
        """With profile(): nanoseconds spent in each instruction over the runs since."""
        self.runs = 0
        self.inputs, self.states = lw.inputs, lw.states
        self.outputs = outputs
        self.output_bases = {root.output: root.base for root in lw.roots if root.output >= 0}
        self._call = (self.code.ctypes.data, len(self.code), self.bases.ctypes.data)

    def _allocate_outputs(self) -> list[np.ndarray]:
        results = []
        for index, (_, shape, dtype) in enumerate(self.outputs):
            if index in self.output_bases:
                out = np.empty(shape, dtype)
                self.bases[self.output_bases[index]] = out.ctypes.data
                results.append(out)
            else:
                results.append(None)  # (a run's output that is one of the arrays it was given: filled by the caller)
        return results

    def _execute(self) -> bool:
        self.bases[0] = _arena(self.arena_bytes)
        threads = self.threads or native.threads()
        if self.times is not None:
            self.runs += 1
            return self.lib.kiln_execute_timed(*self._call, threads, self.times.ctypes.data) == 0
        return self.lib.kiln_execute(*self._call, threads) == 0

    def profile(self) -> None:
        """Time each instruction from now on (into self.times, by self.origins; self.runs counts the runs)."""
        self.times = np.zeros(len(self.code), np.int64)
        self.runs = 0


class NativePlan(_Instructions):
    """A lowered method: run(inputs, state) -> outputs, or None where an instruction declined its inputs."""

    def __init__(self, lw: Lowering, outputs: list[tuple[Loc, tuple[int, ...], np.dtype]], threads: int | None):
        super().__init__(lw, outputs, threads)
        self._state_seen: dict[int, tuple[Any, int]] = {}

    def __call__(self, inputs: list[np.ndarray], state: list[np.ndarray]) -> list[np.ndarray] | None:
        bases, held = self.bases, []
        for base, i in self.inputs:
            array = inputs[i] if inputs[i].flags.c_contiguous else np.ascontiguousarray(inputs[i])
            held.append(array)
            bases[base] = array.ctypes.data
        for base, i in self.states:
            array = state[i]
            seen = self._state_seen.get(base)
            if seen is None or seen[0] is not array:
                if not array.flags.c_contiguous:
                    array = state[i] = np.ascontiguousarray(array)
                seen = self._state_seen[base] = (array, array.ctypes.data)
            bases[base] = seen[1]
        results = self._allocate_outputs()
        return results if self._execute() else None


class RunPlan(_Instructions):
    """A lowered run of a method's nodes: run(*arrays of `values`) -> arrays of `outputs`, or None where the run
    cannot take these arrays or an instruction declined (the session then runs its nodes from Python)."""

    def __init__(self, lw: Lowering, outputs: list[tuple[Loc, tuple[int, ...], np.dtype]], threads: int | None,
                 passed: dict[int, int]):
        super().__init__(lw, outputs, threads)
        self.bound = [(base, lw.shape_of(value), np.dtype(lw.method.values[value].dtype.numpy))
                      for base, value in lw.bound]
        self.values = tuple(value for _, value in lw.bound)
        self.passed = passed
        """output index -> index into `values` of the array given for it (written in place: state)."""

    def __call__(self, *arrays: np.ndarray) -> list[np.ndarray] | None:
        bases, held = self.bases, []
        for (base, shape, dtype), array in zip(self.bound, arrays, strict=True):
            if type(array) is not np.ndarray or array.dtype != dtype or array.shape != shape:
                return None
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)
            held.append(array)
            bases[base] = array.ctypes.data
        results = self._allocate_outputs()
        if not self._execute():
            return None
        for index, given in self.passed.items():
            results[index] = held[given]
        return results


def lower(program: Program, method: Method, steps: list[tuple[Node, dict[str, Any]]], env: dict[str, int],
          threads: int | None = None) -> NativePlan | None:
    """`method`'s nodes (with their resolved attributes) as one native plan, or None where some node cannot be
    lowered (logged at debug level: which and why). threads: the session's (None: native.threads() per run)."""
    if not enabled() or not steps:
        return None
    lw = Lowering(program, method, env)
    try:
        for node, attrs in steps:
            _lower_node(lw, node, attrs)
        for update in method.state_updates:
            read = _state_value(method, update.state)
            loc = lw.locs.get(update.value)
            if read is None or loc is None or loc != lw.loc(read):
                raise Decline(f"state {update.state} is not updated in place")
        outputs = [_output(lw, index, value) for index, value in enumerate(method.outputs)]
        return NativePlan(lw, outputs, threads)
    except NOT_LOWERED as e:
        log.debug("method %r runs from Python: %s: %s", method.name, type(e).__name__, e)
        return None


NOT_LOWERED = (Decline, KeyError, TypeError, ValueError, IndexError)
"""What lowering a node may raise: a Decline, or an attribute or shape the rules did not expect."""


def _lower_node(lw: Lowering, node: Node, attrs: dict[str, Any]) -> None:
    """node's instructions into lw, or Decline (naming the op)."""
    rule = LOWERINGS.get(node.op)
    if rule is None:
        raise Decline(f"no lowering for {node.op}")
    lw.node = " ".join([node.op] + [f"{np.dtype(lw.method.values[v].dtype.numpy)}{list(lw.shape_of(v))}"
                                    for v in node.inputs if v != NO_VALUE])  # (as the profiler names kernel sites)
    try:
        rule(lw, node, attrs)
    except Decline as e:
        raise Decline(f"{node.op}: {e}") from None


MIN_RUN_NODES = 3
"""Nodes a run must have to be lowered: a run's call from Python (binding its arrays, allocating its outputs) costs
about what two small kernels' calls do."""


@dataclass(frozen=True)
class Run:
    """Steps [start, end) of a method's plan as one RunPlan, which reads plan.values and gives `outputs`."""
    start: int
    end: int
    plan: RunPlan
    outputs: tuple[int, ...]


def lower_runs(program: Program, method: Method, steps: list[tuple[Node, dict[str, Any]]],
               reads: list[tuple[int, ...]], env: dict[str, int], threads: int | None = None) -> list[Run]:
    """The runs of consecutive steps (at least MIN_RUN_NODES) that lower, each as a plan of its own; reads[k]: the
    values step k reads (a prepared step may read others than its node's inputs)."""
    if not enabled() or not steps:
        return []
    runs: list[Run] = []
    start = 0
    while start < len(steps):
        end = _lowerable_end(program, method, steps, start, env)
        if end - start >= MIN_RUN_NODES:
            run = _lower_run(program, method, steps, reads, start, end, env, threads)
            if run is not None:
                runs.append(run)
        start = end + 1 if end > start else start + 1  # step `end` declined: it runs from Python
    return runs


def _lowerable_end(program: Program, method: Method, steps: list[tuple[Node, dict[str, Any]]], start: int,
                   env: dict[str, int]) -> int:
    """The end of the longest run of steps from `start` that lower."""
    lw = Lowering(program, method, env, bound=[])
    for k in range(start, len(steps)):
        try:
            _lower_node(lw, *steps[k])
        except NOT_LOWERED as e:
            log.debug("method %r: node %d runs from Python: %s: %s", method.name, k, type(e).__name__, e)
            return k
    return len(steps)


def _lower_run(program: Program, method: Method, steps: list[tuple[Node, dict[str, Any]]],
               reads: list[tuple[int, ...]], start: int, end: int, env: dict[str, int],
               threads: int | None) -> Run | None:
    produced = {v for node, _ in steps[start:end] for v in node.outputs}
    later = {v for k in range(end, len(steps)) for v in reads[k]}
    later |= set(method.outputs) | {update.value for update in method.state_updates}
    outputs = tuple(sorted(produced & later))
    lw = Lowering(program, method, env, bound=[])
    try:
        for node, attrs in steps[start:end]:
            _lower_node(lw, node, attrs)
        passed: dict[int, int] = {}
        locs = [_output(lw, index, value, passed) for index, value in enumerate(outputs)]
        return Run(start, end, RunPlan(lw, locs, threads, passed), outputs)
    except NOT_LOWERED as e:
        log.debug("method %r: steps %d-%d run from Python: %s", method.name, start, end, e)
        return None


def _state_value(method: Method, state: int) -> int | None:
    """The value through which `method` reads state buffer `state` (None: it only writes it)."""
    return next((i for i, v in enumerate(method.values) if v.kind == ValueKind.STATE and v.ref == state), None)


def _output(lw: Lowering, index: int, value: int,
            passed: dict[int, int] | None = None) -> tuple[Loc, tuple[int, ...], np.dtype]:
    """Method output `index`: the root it lies in becomes an array allocated for each run (copied there first
    when it is a view of part of one, or of something else)."""
    loc = lw.locs.get(value)
    if loc is None:
        loc = lw.loc(value)
    shape, dtype = lw.shape_of(value), np.dtype(lw.method.values[value].dtype.numpy)
    home = loc.home
    whole = isinstance(home, Root) and home.output < 0 and loc.contiguous and loc.offset == 0 \
        and home.nbytes == max(1, loc.size) * dtype.itemsize and home is not lw.scratch
    if not whole and passed is not None and isinstance(home, int) and loc.offset == 0 and loc.contiguous:
        given = next((k for k, (base, _) in enumerate(lw.bound) if base == home), None)
        if given is not None and lw.shape_of(lw.bound[given][1]) == shape:
            passed[index] = given  # a value written in place in an array the run was given (a KV cache)
            return loc, shape, dtype
    if not whole:  # (a view, an array the run was given, or one another output lies in already: copied)
        pad = 4 - len(shape)
        _need(pad >= 0, "output of more than 4 dims")
        copy = lw.new(shape, dtype)
        lw.emit("copy", loc, copy, dtype.itemsize, *((1,) * pad + tuple(shape)), *((0,) * pad + loc.strides))
        loc, home = copy, copy.home
    home.output, home.base, home.offset = index, lw.base(), 0
    return loc, shape, dtype
