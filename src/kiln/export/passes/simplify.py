"""Remove no-op nodes and collapse chains of views and casts.

What the exporter's Core ATen graphs are full of: reshapes to the shape a value already has, permutes by the
identity, expands to the same shape, casts to the same dtype, full-range slices, one-input cats, copies; and chains
such as reshape(reshape(x)), permute(permute(x)), expand(expand(x)), cast(cast(x)) where the first cast loses
nothing. Each pass returns how many nodes it rewrote; dead-code elimination drops what they leave unread.
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.export.passes.usage import Usage, replace_uses
from kiln.ir.dtypes import DType
from kiln.ir.graph import Method, Node


def _same_shape(method: Method, node: Node) -> bool:
    x, out = method.values[node.inputs[0]], method.values[node.outputs[0]]
    return x.shape == out.shape and x.dtype == out.dtype


def _full_slice(method: Method, node: Node) -> bool:
    a = node.attrs
    size = method.values[node.inputs[0]].shape[a["dim"]]
    return a.get("step", 1) == 1 and a["start"] == 0 and a["end"] == size


NOOPS: dict[str, Callable[[Method, Node], bool]] = {
    "reshape": _same_shape,
    "expand": _same_shape,
    "permute": lambda method, node: tuple(node.attrs["perm"]) == tuple(range(len(node.attrs["perm"]))),
    "cast": _same_shape,
    "copy": _same_shape,  # kiln values are never written in place except by nodes marked in_place, which
    # check their readers after this pass
    "slice": _full_slice,
    "cat": lambda method, node: len(node.inputs) == 1,
}
"""Ops that, under the condition, return their (first) input unchanged."""


def remove_noops(method: Method) -> int:
    """Rewire the readers of each no-op node to its input; returns how many were bypassed."""
    usage = Usage.of(method)
    count = 0
    for node in method.nodes:
        rule = NOOPS.get(node.op)
        out = node.outputs[0] if node.outputs else None
        if rule is None or out in usage.kept or not rule(method, node):
            continue
        replace_uses(method, out, node.inputs[0])
        count += 1
    return count


# cast A -> B is exact when B holds every value of A: then cast(cast(x, B), C) == cast(x, C)
_EXACT_CASTS = {
    DType.bool: set(DType),
    DType.uint8: {DType.int16, DType.int32, DType.int64, DType.float16, DType.bfloat16, DType.float32,
                  DType.float64},
    DType.int8: {DType.int16, DType.int32, DType.int64, DType.float16, DType.bfloat16, DType.float32,
                 DType.float64},
    DType.int16: {DType.int32, DType.int64, DType.float32, DType.float64},
    DType.int32: {DType.int64, DType.float64},
    DType.float16: {DType.float32, DType.float64},
    DType.bfloat16: {DType.float32, DType.float64},
    DType.float32: {DType.float64},
}


def _compose(method: Method, outer: Node, inner: Node) -> dict | None:
    """Attributes for `outer` applied directly to `inner`'s input, or None when the chain does not collapse."""
    if outer.op != inner.op:
        return None
    if outer.op in ("reshape", "expand"):
        return dict(outer.attrs)  # the final shape alone decides the result (row-major reshape; broadcasting)
    if outer.op == "permute":
        first, second = inner.attrs["perm"], outer.attrs["perm"]
        return {**outer.attrs, "perm": tuple(first[p] for p in second)}
    if outer.op == "cast":
        source = method.values[inner.inputs[0]].dtype
        middle = method.values[inner.outputs[0]].dtype
        return dict(outer.attrs) if middle in _EXACT_CASTS.get(source, set()) else None
    return None


def collapse_chains(method: Method) -> int:
    """Make the second of two chained views/casts read the first one's input; returns how many were rewired."""
    usage = Usage.of(method)
    count = 0
    for node in method.nodes:
        if node.op not in ("reshape", "expand", "permute", "cast"):
            continue
        inner = usage.producer.get(node.inputs[0])
        while inner is not None and (attrs := _compose(method, node, inner)) is not None:
            node.attrs = attrs
            node.inputs = [inner.inputs[0], *node.inputs[1:]]
            count += 1
            inner = usage.producer.get(node.inputs[0])
    return count
