"""Rotary position embedding becomes one `rope` node, in any of the three forms transformers writes.

    rotate-half (Llama):  x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin
                          (slice, slice, neg, cat, mul, mul, add: 7 nodes)
    interleaved (GPT-J):  x * cos + flatten(stack(-x[..., 1::2], x[..., 0::2], -1)) * sin
                          (slice, slice, neg, reshape, reshape, cat, reshape, mul, mul, add: 10 nodes)
    halves (gpt-oss):     cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin) for x1, x2 = x[..., :D/2], x[..., D/2:] and
                          cos, sin of width D/2 (slice, slice, 4 mul, sub, add, cat: 9 nodes): rotate-half's rope
                          with cos and sin each repeated to width D (one cat node per table, shared by every layer)

HF Llama applies it to q and k in every layer, so a decode step of a 30-layer model loses 360 nodes. The match is
checked node by node (both slices of the same x, the negated one first, x itself in the cos product, every
intermediate read only here) and declines otherwise, saying why in the debug log when the shape is close.
"""

from __future__ import annotations

import logging

from kiln.export.passes.usage import Usage
from kiln.ir.graph import Method, Node, Value

log = logging.getLogger(__name__)


def fuse_rope(method: Method) -> int:
    """Rewrite each matched rotary embedding in place into one rope node; returns how many."""
    count = _fuse_halves(method)
    usage = Usage.of(method)
    for add in method.nodes:
        if add.op != "add":
            continue
        for a, b in ((0, 1), (1, 0)):
            match = _match(method, usage, add.inputs[a], add.inputs[b])
            if match is not None:
                *inputs, interleaved = match
                add.op, add.inputs, add.attrs = "rope", inputs, {"interleaved": interleaved} if interleaved else {}
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


def _rotate_half_source(method: Method, usage: Usage, rotated: int) -> int | None:
    """x if `rotated` is cat(-x[..., D/2:], x[..., :D/2]) on the last dim, read only by the sin product."""
    cat = usage.producer_of(rotated, "cat")
    if cat is None or len(cat.inputs) != 2 or not usage.only_reader_may_absorb(rotated):
        return None
    if cat.attrs.get("dim") != len(method.values[rotated].shape) - 1:
        return None
    neg = usage.producer_of(cat.inputs[0], "neg")
    if neg is None or not usage.only_reader_may_absorb(cat.inputs[0]):
        return None
    x = _half_slice(method, usage.producer.get(neg.inputs[0]), None, start_at_half=True)
    if x is None or _half_slice(method, usage.producer.get(cat.inputs[1]), x, start_at_half=False) is None:
        return None
    return x


def _every_other(method: Method, node: Node | None, x: int | None, start: int) -> int | None:
    """x if `node` is x[..., start::2] over the whole last dim (of even size), else None."""
    if node is None or node.op != "slice" or node.attrs.get("step", 1) != 2:
        return None
    source = node.inputs[0]
    shape = method.values[source].shape
    size = shape[-1]
    if node.attrs["dim"] != len(shape) - 1 or not isinstance(size, int) or size % 2:
        return None
    if (x is not None and source != x) or (node.attrs["start"], node.attrs["end"]) != (start, size):
        return None
    return source


def _unsqueezed_last(method: Method, usage: Usage, value: int) -> int | None:
    """v if `value` is reshape(v, v.shape + (1,)) and read only here (the per-part unsqueeze of stack)."""
    node = usage.producer_of(value, "reshape")
    if node is None or not usage.only_reader_may_absorb(value):
        return None
    source = node.inputs[0]
    return source if tuple(method.values[value].shape) == (*method.values[source].shape, 1) else None


def _interleaved_source(method: Method, usage: Usage, rotated: int) -> int | None:
    """x if `rotated` is flatten(stack((-x[..., 1::2], x[..., ::2]), -1)), read only by the sin product."""
    flatten = usage.producer_of(rotated, "reshape")
    if flatten is None or not usage.only_reader_may_absorb(rotated):
        return None
    stacked = flatten.inputs[0]
    cat = usage.producer_of(stacked, "cat")
    rank = len(method.values[stacked].shape)
    if cat is None or len(cat.inputs) != 2 or cat.attrs.get("dim") != rank - 1 or method.values[stacked].shape[-1] != 2:
        return None
    if not usage.only_reader_may_absorb(stacked):
        return None
    odd, even = (_unsqueezed_last(method, usage, v) for v in cat.inputs)
    neg = None if odd is None else usage.producer_of(odd, "neg")
    if neg is None or even is None or not usage.only_reader_may_absorb(odd):
        return None
    x = _every_other(method, usage.producer.get(neg.inputs[0]), None, start=1)
    if x is None or _every_other(method, usage.producer.get(even), x, start=0) is None:
        return None
    if tuple(method.values[rotated].shape) != tuple(method.values[x].shape):
        log.debug("rope: interleaved rotation of value %d does not flatten back to x's shape; not fused", rotated)
        return None
    return x


_ROTATIONS = ((_rotate_half_source, False), (_interleaved_source, True))


def _match(method: Method, usage: Usage, cos_term: int, sin_term: int) -> tuple[int, int, int, bool] | None:
    first, second = _mul_parts(usage, cos_term), _mul_parts(usage, sin_term)
    if first is None or second is None:
        return None
    for rotated, sin in ((second[0], second[1]), (second[1], second[0])):
        for source_of, interleaved in _ROTATIONS:
            x = source_of(method, usage, rotated)
            if x is None:
                continue
            if x not in first:
                log.debug("rope: rotation of value %d is not added to that value times cos; not fused", x)
                continue
            cos = first[1] if first[0] == x else first[0]
            shape = method.values[x].shape  # cos and sin broadcast into x, not x into them
            if method.values[cos_term].shape == shape == method.values[sin_term].shape:
                return x, cos, sin, interleaved
            log.debug("rope: cos/sin of value %d would broadcast x to a larger shape; not fused", x)
    return None


def _product_of(usage: Usage, value: int, a: int, b: int) -> bool:
    """Whether `value` is a * b (either order), read only by the node taking it."""
    parts = _mul_parts(usage, value)
    return parts is not None and set(parts) == {a, b} and a != b


def _halves(method: Method, usage: Usage, cat: Node) -> tuple[int, int, int] | None:
    """(x, cos, sin) if `cat` is gpt-oss's rotation of x (the halves form above), else None."""
    if len(cat.inputs) != 2 or cat.attrs.get("dim") != len(method.values[cat.outputs[0]].shape) - 1:
        return None
    sub, add = usage.producer_of(cat.inputs[0], "sub"), usage.producer_of(cat.inputs[1], "add")
    if sub is None or add is None or not all(usage.only_reader_may_absorb(v) for v in cat.inputs):
        return None
    first, second = (_mul_parts(usage, v) for v in sub.inputs)
    if first is None or second is None:
        return None
    for x1, cos in (first, first[::-1]):
        x = _half_slice(method, usage.producer.get(x1), None, start_at_half=False)
        for x2, sin in (second, second[::-1]):
            if x is None or _half_slice(method, usage.producer.get(x2), x, start_at_half=True) is None:
                continue
            if not (_product_of(usage, add.inputs[0], x2, cos) and _product_of(usage, add.inputs[1], x1, sin)
                    or _product_of(usage, add.inputs[0], x1, sin) and _product_of(usage, add.inputs[1], x2, cos)):
                continue
            if any(len(usage.reader_nodes.get(v, ())) != 2 or v in usage.kept for v in (x1, x2)):
                continue  # a half read beside the rotation
            out, source = method.values[cat.outputs[0]], method.values[x]
            if tuple(out.shape) != tuple(source.shape) or out.dtype != source.dtype:
                log.debug("rope: the halves form over value %d changes its shape or type; not fused", x)
                continue
            half = source.shape[-1] // 2
            if any(tuple(method.values[t].shape[-1:]) != (half,) for t in (cos, sin)):
                log.debug("rope: the halves form's cos/sin of value %d are not D/2 wide; not fused", x)
                continue
            return x, cos, sin
    return None


def _fuse_halves(method: Method) -> int:
    """Rewrite each gpt-oss rotation into rope over cos and sin repeated to full width; returns how many."""
    usage = Usage.of(method)
    full: dict[int, int] = {}  # a half-width table -> its full-width value
    nodes: list[Node] = []
    count = 0
    for node in method.nodes:
        match = _halves(method, usage, node) if node.op == "cat" else None
        if match is not None:
            x, cos, sin = match
            for table in (cos, sin):
                if table not in full:
                    value = method.values[table]
                    method.values.append(Value(f"{value.name}.full", value.dtype,
                                               tuple(value.shape[:-1]) + (2 * value.shape[-1],)))
                    full[table] = len(method.values) - 1
                    nodes.append(Node("cat", [table, table], [full[table]], {"dim": len(value.shape) - 1},
                                      source=node.source))
            node.op, node.inputs, node.attrs = "rope", [x, full[cos], full[sin]], {}
            count += 1
        nodes.append(node)
    method.nodes[:] = nodes
    return count
