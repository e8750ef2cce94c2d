"""Linear layers that read the same input become one linear over their weights stacked along the output dim,
followed by one slice per original output: attention's q, k and v projections, the gated MLP's gate and up.

Why: at decode every linear is a matrix-vector product that streams its weight from memory, and one launch over
a larger weight streams closer to the bandwidth than three small launches with a gap between each (on the GPU a
decode step had 7 linears per layer). The slices are views, and the kernels that read them (RoPE, the gated
activation, attention) take strided rows, so nothing is copied back apart. The stacked weight is stored instead of
its parts, and weight quantization, which runs later, quantizes it row by row as it would have the parts. Weights
whose quantized form is known already (a GGUF file's) stack only with weights of the same form, so each stacked
weight is kept exactly (a Q4_K_M file's Q6_K value projection stays apart from its Q4_K query and key).

A weight read by several linears (a model whose layers share their weights) stacks only where every linear reading
it stacks with the same partners: the stacked weights are then equal bytes, stored once, and the parts are read by
nothing. Anywhere else the part would have to stay beside the stacked copy, so its group does not stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import Usage, constant_value, derived_constant
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Method, Node, Value, ValueKind

if TYPE_CHECKING:
    from kiln.export.quantize import KnownQuantization


def fuse_projections(method: Method, builder: ProgramBuilder, known: KnownQuantization | None = None) -> int:
    """Stack each group of >= 2 linears on one input (constant weights and biases, of one known quantized layout
    or none, read by nothing else or only by groups alike); returns how many linears were stacked."""
    usage = Usage.of(method)
    groups: dict[tuple, list[Node]] = {}
    for node in method.nodes:
        key = _group_key(method, node)
        if key is not None and known is not None:
            key += (known.layout_of(constant_value(method, builder, node.inputs[1])),)
        if key is not None:
            groups.setdefault(key, []).append(node)
    stacking = _alike_where_shared([nodes for nodes in groups.values() if len(nodes) >= 2], usage)
    fused: dict[int, Node] = {}  # id of a group's first linear -> the stacked linear to put before it
    for nodes in stacking:
        fused[id(nodes[0])] = _stack(method, builder, nodes)
    method.nodes = [n for node in method.nodes for n in ((fused[id(node)], node) if id(node) in fused else (node,))]
    return sum(len(nodes) for nodes in stacking)


def _parts(node: Node) -> tuple[int, ...]:
    """The constants a linear's stacking moves into the stacked ones: its weight and its bias, if any."""
    return tuple(v for v in node.inputs[1:3] if v != NO_VALUE)


def _alike_where_shared(groups: list[list[Node]], usage: Usage) -> list[list[Node]]:
    """The groups whose every part is read only by linears of groups that stack the same parts in the same order.
    (One pass is enough: a group dropped here holds a part whose readers' groups all hold it too.)"""
    signature = {id(node): tuple(_parts(n) for n in nodes) for nodes in groups for node in nodes}

    def alone(part: int) -> bool:
        readers = usage.reader_nodes.get(part, ())
        return len({signature.get(id(r)) for r in readers}) == 1 and id(readers[0]) in signature
    return [nodes for nodes in groups if all(alone(p) for n in nodes for p in _parts(n))]


def _group_key(method: Method, node: Node) -> tuple | None:
    """Linears stack when they read the same input with constant weights of one dtype and width, biases alike."""
    if node.op != "linear":
        return None
    x, w = node.inputs[:2]
    b = node.inputs[2] if len(node.inputs) > 2 else NO_VALUE
    weight = method.values[w]
    if weight.kind != ValueKind.CONSTANT or len(weight.shape) != 2:
        return None
    if b != NO_VALUE and method.values[b].kind != ValueKind.CONSTANT:
        return None
    bias_dtype = method.values[b].dtype if b != NO_VALUE else None
    return x, weight.dtype, weight.shape[1], bias_dtype, method.values[node.outputs[0]].dtype


def _stack(method: Method, builder: ProgramBuilder, nodes: list[Node]) -> Node:
    """The stacked linear; each node of the group becomes a slice of its output."""
    x, first_out = nodes[0].inputs[0], method.values[nodes[0].outputs[0]]
    stacked = _stacked_constant(method, builder, [n.inputs[1] for n in nodes], lambda a: a)
    bias = NO_VALUE
    if len(nodes[0].inputs) > 2 and nodes[0].inputs[2] != NO_VALUE:
        bias = _stacked_constant(method, builder, [n.inputs[2] for n in nodes], lambda a: a.reshape(-1))
    sizes = [method.values[n.inputs[1]].shape[0] for n in nodes]
    dim = len(first_out.shape) - 1
    method.values.append(Value(f"{first_out.name}.stacked", first_out.dtype, first_out.shape[:-1] + (sum(sizes),)))
    out = len(method.values) - 1
    start = 0
    for node, size in zip(nodes, sizes, strict=True):
        node.op, node.inputs = "slice", [out]
        node.attrs = {"dim": dim, "start": start, "end": start + size, "step": 1}
        start += size
    return Node("linear", [x, stacked, bias], [out], {}, source=nodes[0].source)


def _stacked_constant(method: Method, builder: ProgramBuilder, parts: list[int],
                      shaped: Callable[[np.ndarray], np.ndarray]) -> int:
    """The constants `parts` concatenated along their first axis (each `shaped` first), stacked once per program:
    the other methods of an LLM stack the same weights."""
    def make() -> tuple[np.ndarray, DType, str]:
        data = np.concatenate([shaped(constant_value(method, builder, v)) for v in parts])
        return data, method.values[parts[0]].dtype, "+".join(method.values[v].name for v in parts)
    key = ("fuse_projections", tuple(method.values[v].ref for v in parts))
    return derived_constant(method, builder, key, make)
