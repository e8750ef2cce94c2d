"""Constant folding: nodes whose inputs are all constants run once at export and become constants.

Weight-only subgraphs (a transposed or reshaped weight, Gemma's 1 + weight, RoPE frequency tables, masks built
from static shapes) then cost nothing at run time. The CPU backend's kernels compute the folded values, so they
are exactly what the runtime would have computed. A result is kept only when it is small (MAX_FOLDED_BYTES) or no
bigger than its inputs, so folding never inflates the file with, say, a broadcast mask.
"""

from __future__ import annotations

import logging

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import add_constant, constant_value, replace_uses
from kiln.ir import ops
from kiln.ir.graph import NO_VALUE, Method, ValueKind
from kiln.ir.symbolic import ExprError
from kiln.runtime.session import resolve_attrs

log = logging.getLogger("kiln.passes")

MAX_FOLDED_BYTES = 1 << 20


def _static_attrs(op: str, attrs: dict) -> dict | None:
    """The node's attributes as a kernel takes them, or None if any depends on a symbol."""
    try:
        return resolve_attrs(ops.OPS[op], attrs, {})
    except (ExprError, KeyError, TypeError, ValueError):
        return None


def fold_constants(method: Method, builder: ProgramBuilder) -> int:
    """Replace every foldable node's outputs by constants; returns how many nodes were folded."""
    from kiln.runtime.backends.cpu import CPU_KERNELS

    kept = set(method.outputs) | {u.value for u in method.state_updates}
    count = 0
    for node in list(method.nodes):
        if not node.outputs or any(o in kept for o in node.outputs) or node.attrs.get("in_place"):
            continue
        if any(i != NO_VALUE and method.values[i].kind != ValueKind.CONSTANT for i in node.inputs):
            continue
        if not all(isinstance(d, int) for o in node.outputs for d in method.values[o].shape):
            continue
        attrs = _static_attrs(node.op, node.attrs)
        kernel = CPU_KERNELS.kernels.get(node.op)
        if attrs is None or kernel is None:
            continue
        inputs = [None if i == NO_VALUE else constant_value(method, builder, i) for i in node.inputs]
        in_bytes = sum(a.nbytes for a in inputs if a is not None)
        out_bytes = sum(method.values[o].dtype.itemsize * int(np.prod(method.values[o].shape))
                        for o in node.outputs)
        if out_bytes > max(MAX_FOLDED_BYTES, in_bytes):
            continue
        try:
            with np.errstate(all="ignore"):
                result = kernel(*inputs, **attrs)
        except Exception as exc:  # a kernel that cannot run here just leaves the node in place
            log.debug("not folding %s: %s", node.op, exc)
            continue
        results = [result] if len(node.outputs) == 1 else list(result)
        for o, r in zip(node.outputs, results, strict=True):
            value = method.values[o]
            arr = np.asarray(r)
            if arr.shape != tuple(value.shape) or arr.dtype != value.dtype.numpy:
                break
            replace_uses(method, o, add_constant(method, builder, arr, value.dtype, f"folded.{value.name}"))
        else:
            count += 1
    return count
