"""Rotary position embedding in transformers' rotate-half form becomes one `rope` node.

    x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin        (slice, slice, neg, cat, mul, mul, add: 7 nodes)

HF Llama applies it to q and k in every layer, so a decode step of a 30-layer model loses 360 nodes. The match is
checked node by node (both slices of the same x at the half, the negated one first, x itself in the cos product,
every intermediate read only here) and declines otherwise. The interleaved form (GPT-J) is not matched yet.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import Method, Node


def fuse_rope(method: Method) -> int:
    """Rewrite each matched rotary embedding in place into one rope node; returns how many."""
    usage = Usage.of(method)
    count = 0
    for add in method.nodes:
        if add.op != "add":
            continue
        for a, b in ((0, 1), (1, 0)):
            match = _match(method, usage, add.inputs[a], add.inputs[b])
            if match is not None:
                add.op, add.inputs, add.attrs = "rope", list(match), {}
                count += 1
                break
    return count


def _mul_parts(usage: Usage, value: int) -> tuple[int, int] | None:
    node = usage.producer_of(value, "mul")
    if node is None or not usage.only_reader_may_absorb(value):
        return None
    return node.inputs[0], node.inputs[1]


def _half_slice(method: Method, node: Node | None, x: int | None, start_at_half: bool) -> int | None:
    """x if `node` is x[..., D/2:] (start_at_half) or x[..., :D/2] on the last dim, else None."""
    if node is None or node.op != "slice" or node.attrs.get("step", 1) != 1:
        return None
    source = node.inputs[0]
    shape = method.values[source].shape
    dim, last = node.attrs["dim"], len(shape) - 1
    size = shape[-1]
    if dim != last or not isinstance(size, int) or size % 2 or (x is not None and source != x):
        return None
    want = (size // 2, size) if start_at_half else (0, size // 2)
    return source if (node.attrs["start"], node.attrs["end"]) == want else None


def _match(method: Method, usage: Usage, cos_term: int, sin_term: int) -> tuple[int, int, int] | None:
    first, second = _mul_parts(usage, cos_term), _mul_parts(usage, sin_term)
    if first is None or second is None:
        return None
    for rotated, sin in ((second[0], second[1]), (second[1], second[0])):
        cat = usage.producer_of(rotated, "cat")
        if cat is None or len(cat.inputs) != 2 or not usage.only_reader_may_absorb(rotated):
            continue
        if cat.attrs.get("dim") != len(method.values[rotated].shape) - 1:
            continue
        neg = usage.producer_of(cat.inputs[0], "neg")
        if neg is None or not usage.only_reader_may_absorb(cat.inputs[0]):
            continue
        x = _half_slice(method, usage.producer.get(neg.inputs[0]), None, start_at_half=True)
        if x is None or _half_slice(method, usage.producer.get(cat.inputs[1]), x, start_at_half=False) is None:
            continue
        if x in first:
            cos = first[1] if first[0] == x else first[0]
            shape = method.values[x].shape  # cos and sin broadcast into x, not x into them
            if method.values[cos_term].shape == shape == method.values[sin_term].shape:
                return x, cos, sin
    return None
