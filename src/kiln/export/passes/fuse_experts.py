"""A mixture-of-experts layer's expert products as gathered_linear nodes.

transformers runs a MoE layer's experts, exported, as its "batched_mm" implementation (kiln.models.llm selects
it): each routed row's expert weight is gathered from the stacked weights, W[index] [S, N, K], then multiplied by
the row as a batch (bmm), and a per-expert bias, where the family has one, is gathered and added the same way:

    index(W, ids) [S, N, K] @ x [S, K, 1] -> [S, N, 1] -> reshape [S, N] (+ index(B, ids) [S, N])

(gpt-oss stores its experts transposed: x [S, 1, K] @ index(W, ids) [S, K, N] -> [S, 1, N]). Run as traced, that
copies S expert weights per layer and step before multiplying. As one gathered_linear(x, W, ids, B) node each
backend reads the picked experts' weights in place (grouped by expert on the CPU, a gathered matrix product on
MLX), and weight quantization applies to the stack as to any linear's weight.
"""

from __future__ import annotations

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import Usage, add_constant, constant_value, is_constant
from kiln.ir.graph import NO_VALUE, Method, Node, Value


def fuse_experts(method: Method, builder: ProgramBuilder) -> int:
    """Rewrite each gathered-weight product (and its gathered bias add) as one gathered_linear; returns how many."""
    usage = Usage.of(method)
    transposed: dict[int, int] = {}  # a [E, K, N] stack -> its [E, N, K] constant
    replaced: dict[int, list[Node]] = {}  # id(matmul node) -> the nodes standing for it
    for node in method.nodes:
        if node.op != "matmul":
            continue
        match = _match(method, usage, node)
        if match is None:
            continue
        x3, weight, ids, flip, squeeze = match
        if flip:
            if weight not in transposed:
                data = np.ascontiguousarray(constant_value(method, builder, weight).transpose(0, 2, 1))
                transposed[weight] = add_constant(method, builder, data, method.values[weight].dtype,
                                                  f"{method.values[weight].name}.t")
            weight = transposed[weight]
        rows, k = method.values[squeeze.outputs[0]].shape[0], method.values[weight].shape[2]
        x_value = method.values[x3]
        method.values.append(Value(f"{x_value.name}.rows", x_value.dtype, (rows, k)))
        x2 = len(method.values) - 1
        flatten = Node("reshape", [x3], [x2], {"shape": (rows, k)}, source=node.source)
        out, bias, add = squeeze.outputs[0], NO_VALUE, None
        candidate = usage.sole_reader(out, "add")
        if candidate is not None:
            other = candidate.inputs[1] if candidate.inputs[0] == out else candidate.inputs[0]
            bias = _gathered_bias(method, usage, other, ids, method.values[weight].shape[:2])
            if bias != NO_VALUE and method.values[candidate.outputs[0]].shape == method.values[out].shape:
                add, out = candidate, candidate.outputs[0]
            else:
                bias = NO_VALUE
        gathered = Node("gathered_linear", [x2, weight, ids, bias], [out], {}, source=node.source)
        replaced[id(node)] = [flatten, gathered]
        for gone in (squeeze, add):
            if gone is not None:
                gone.op, gone.inputs, gone.outputs = "__removed__", [], []
    method.nodes = [n for node in method.nodes for n in replaced.get(id(node), [node]) if n.op != "__removed__"]
    return len(replaced)


def _match(method: Method, usage: Usage, node: Node) -> tuple[int, int, int, bool, Node] | None:
    """(x [S, K, 1] or [S, 1, K], the stack's constant, the expert ids, whether the stack is [E, K, N], the reshape
    to [S, N] after the product) for a matmul of gathered expert weights, else None."""
    a, b = node.inputs
    out_shape = method.values[node.outputs[0]].shape
    squeeze = usage.sole_reader(node.outputs[0], "reshape")
    if squeeze is None or len(out_shape) != 3 or len(method.values[squeeze.outputs[0]].shape) != 2:
        return None
    for gathered, x3, flip in ((a, b, False), (b, a, True)):
        picked = _picked_experts(method, usage, gathered)
        if picked is None:
            continue
        weight, ids = picked
        x_shape = method.values[x3].shape
        if len(x_shape) != 3 or x_shape[1 if flip else 2] != 1 or out_shape[1 if flip else 2] != 1:
            continue
        return x3, weight, ids, flip, squeeze
    return None


def _picked_experts(method: Method, usage: Usage, value: int) -> tuple[int, int] | None:
    """(stack, ids) when `value` is index(stack, ids) over dim 0 of a constant 3-d stack by a 1-d index."""
    node = usage.producer_of(value, "index")
    if node is None or list(node.attrs.get("dims", ())) != [0] or len(node.inputs) != 2:
        return None
    stack, ids = node.inputs
    if not is_constant(method, stack) or len(method.values[stack].shape) != 3 or len(method.values[ids].shape) != 1:
        return None
    return stack, ids


def _gathered_bias(method: Method, usage: Usage, value: int, ids: int, experts_rows: tuple) -> int:
    """The [E, N] constant when `value` is index(bias, ids) by the same ids, else NO_VALUE."""
    node = usage.producer_of(value, "index")
    if node is None or list(node.attrs.get("dims", ())) != [0] or node.inputs[1:] != [ids]:
        return NO_VALUE
    bias = method.values[node.inputs[0]]
    return node.inputs[0] if is_constant(method, node.inputs[0]) and bias.shape == tuple(experts_rows) else NO_VALUE
