"""RoPE on mx.fast.rope where the graph's cos and sin are rows of rotary tables gathered at positions.

An exported LLM reads its rotary embedding from two constant tables, cos and sin of position * frequency for
positions 0 .. max_context - 1, at the step's positions (kiln.models.llm._RotaryTable), and multiplies them in
(rope, rope_cache_update, norm_rope_cache_update). mx.fast.rope computes the same rotation in one kernel from the
positions and the frequencies. The frequencies are read off the tables (the angle at position 1) and the whole
tables are checked against cos and sin of position * frequency before they are used (tables of another kind,
scaled by an attention factor, say, keep the composed kernel). The kernel still takes cos and sin and falls back to
them for shapes mx.fast.rope does not cover (more than one sequence, positions not one per row of x).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from kiln.ir.graph import Method, Node, ValueKind
from kiln.runtime.backends.mlx.constants import ProgramArrays
from kiln.runtime.backends.mlx.kernels import attention
from kiln.runtime.backends.mlx.kernels.index import write_at

PASS_THROUGH = ("reshape", "cast")
"""Ops between a table lookup and the rope node that change neither which rows nor their order."""


def _lookup(method: Method, made_by: dict[int, Node], value: int) -> tuple[int, int] | None:
    """(table constant, positions value) when `value` is rows of a constant [P, D] table gathered at positions."""
    node = made_by.get(value)
    while node is not None and node.op in PASS_THROUGH:
        node = made_by.get(node.inputs[0])
    if node is None or node.op != "index" or tuple(node.attrs.get("dims", ())) != (0,) or len(node.inputs) != 2:
        return None
    table, positions = method.values[node.inputs[0]], method.values[node.inputs[1]]
    if table.kind != ValueKind.CONSTANT or len(table.shape) != 2 or not positions.dtype.name.startswith("int"):
        return None
    return table.ref, node.inputs[1]


def frequencies(cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray | None:
    """The per-pair frequencies f with cos[p] = cos(p * f) and sin[p] = sin(p * f) (each pair's f repeated as the
    rotate-half or the interleaved layout repeats it), or None where the tables are not of that form."""
    cos, sin = cos.astype(np.float64), sin.astype(np.float64)
    positions, d = cos.shape
    if positions < 2 or d % 2 or sin.shape != cos.shape:
        return None
    first = (slice(None), slice(0, None, 2)) if interleaved else (slice(None), slice(0, d // 2))
    second = (slice(None), slice(1, None, 2)) if interleaved else (slice(None), slice(d // 2, None))
    if not (np.array_equal(cos[first], cos[second]) and np.array_equal(sin[first], sin[second])):
        return None
    f = np.arctan2(sin[1][first[1]], cos[1][first[1]])
    if np.any(f <= 0):
        return None
    # Tables are cos/sin of float32 angles, stored in the model's type: allow their rounding, no more.
    tolerance = 4 * float(np.finfo(np.float32).eps) * (positions * float(f.max()) + 1) + 2.0 ** -7
    angles = np.arange(positions)[:, None] * f[None, :]
    if max(np.abs(np.cos(angles) - cos[first]).max(), np.abs(np.sin(angles) - sin[first]).max()) > tolerance:
        return None
    return f


def table_source(arrays: ProgramArrays, method: Method, made_by: dict[int, Node], cos_value: int, sin_value: int,
                 interleaved: bool) -> tuple[int, mx.array] | None:
    """(positions value, MLX's freqs: the periods 1 / f) where cos and sin are rows of rotary tables gathered at
    the same positions, else None."""
    cos, sin = _lookup(method, made_by, cos_value), _lookup(method, made_by, sin_value)
    if cos is None or sin is None or cos[1] != sin[1]:
        return None

    def periods() -> mx.array | None:
        f = frequencies(arrays.program.constant(cos[0]), arrays.program.constant(sin[0]), interleaved)
        return None if f is None else mx.array((1 / f).astype(np.float32))

    freqs = arrays.derived(("rope", cos[0], sin[0], interleaved), periods)
    return None if freqs is None else (cos[1], freqs)


def fast_rope(x: mx.array, positions: mx.array, freqs: mx.array, interleaved: bool) -> mx.array | None:
    """x [..., H, T, D] (one sequence: leading dims 1) rotated at positions [T] by mx.fast.rope, or None for
    shapes it does not cover. Each of the T rows is given its own position by making it a batch entry of one."""
    if x.ndim < 3 or math.prod(x.shape[:-3]) != 1 or positions.size != x.shape[-2]:
        return None
    heads, t, d = x.shape[-3:]
    offsets = positions.reshape(-1).astype(mx.int32)
    if t == 1:  # (a decode step: x is already one sequence of one row)
        return mx.fast.rope(x.reshape(1, heads, 1, d), d, traditional=interleaved, base=None, scale=1.0,
                            offset=offsets, freqs=freqs).reshape(x.shape)
    rows = mx.swapaxes(x.reshape(heads, t, d), 0, 1)[:, :, None, :]  # [T, H, 1, D]
    out = mx.fast.rope(rows, d, traditional=interleaved, base=None, scale=1.0, offset=offsets, freqs=freqs)
    return mx.swapaxes(out[:, :, 0, :], 0, 1).reshape(x.shape)


def _rotated(x: mx.array, cos: mx.array, sin: mx.array, positions: mx.array, freqs: mx.array,
             interleaved: bool) -> mx.array:
    per_row = cos.shape[-2] if cos.ndim >= 2 else 1
    fast = fast_rope(x, positions, freqs, interleaved) if per_row == positions.size else None
    return attention.rope(x, cos, sin, interleaved) if fast is None else fast


def rope_kernel(freqs: mx.array) -> Callable[..., mx.array]:
    def rope(x: mx.array, cos: mx.array, sin: mx.array, positions: mx.array, interleaved: bool = False) -> mx.array:
        return _rotated(x, cos, sin, positions, freqs, interleaved)
    return rope


def rope_cache_update_kernel(freqs: mx.array) -> Callable[..., Any]:
    def rope_cache_update(q: mx.array, k: mx.array, v: mx.array, cos: mx.array, sin: mx.array, k_cache: mx.array,
                          v_cache: mx.array, *rest: mx.array, dims: Any, interleaved: bool,
                          in_place: bool) -> tuple[mx.array, mx.array, mx.array]:
        *indices, positions = rest
        return (_rotated(q, cos, sin, positions, freqs, interleaved),
                write_at(k_cache, _rotated(k, cos, sin, positions, freqs, interleaved), dims, indices),
                write_at(v_cache, v, dims, indices))
    return rope_cache_update

