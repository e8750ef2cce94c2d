"""matmul by a constant weight (plus a constant bias) becomes one `linear` node.

GPT-2's Conv1D and any `torch.addmm(bias, x, W)` reach the graph as matmul(x, W[K, N]) + b, which the exporter
lowers to a matmul and a broadcast add. As linear(x, W^T, b) the weight takes the [out, in] layout every linear
has (stored transposed once, at export), the bias is added with the product instead of in a second pass, and
weight quantization applies to it like to any other linear layer.
"""

from __future__ import annotations

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import Usage, add_constant, constant_value
from kiln.ir.graph import NO_VALUE, Method


def canonicalize_linear(method: Method, builder: ProgramBuilder) -> int:
    """Rewrite each matmul(x, constant [K, N]) (and a constant [N] bias added to it) in place; returns how many."""
    usage = Usage.of(method)
    transposed: dict[int, int] = {}  # weight value -> its transposed constant (a weight used twice)
    count = 0
    for node in method.nodes:
        if node.op != "matmul":
            continue
        x, w = node.inputs
        weight = constant_value(method, builder, w)
        if weight is None or weight.ndim != 2 or len(method.values[x].shape) < 2:
            continue
        if w not in transposed:
            transposed[w] = add_constant(method, builder, np.ascontiguousarray(weight.T), method.values[w].dtype,
                                         f"{method.values[w].name}.t")
        bias = NO_VALUE
        add = usage.sole_reader(node.outputs[0], "add")
        if add is not None:
            other = add.inputs[1] if add.inputs[0] == node.outputs[0] else add.inputs[0]
            b = constant_value(method, builder, other)
            if b is not None and b.size == weight.shape[1] and b.shape[-1:] == (weight.shape[1],) and \
                    method.values[add.outputs[0]].shape == method.values[node.outputs[0]].shape:
                bias = other if b.ndim == 1 else add_constant(method, builder, b.reshape(-1),
                                                              method.values[other].dtype,
                                                              f"{method.values[other].name}.flat")
        node.op, node.attrs = "linear", {}
        node.inputs = [x, transposed[w], bias]
        if bias != NO_VALUE:
            node.outputs = list(add.outputs)
            add.op, add.inputs, add.outputs = "__removed__", [], []
        count += 1
    method.nodes = [n for n in method.nodes if n.op != "__removed__"]
    return count
