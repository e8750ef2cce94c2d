"""A residual add followed by an RMSNorm of its sum (every pre-norm transformer block: h = x + attn(x), then
norm(h)) becomes one `add_rms_norm` node with both results, the sum and its normalization.

On a GPU a decode step is a chain of small kernels, each paying a launch and a ramp-up whatever its size; the add
was one of them per norm. The fused node takes the add's place in the node order (the norm's weight is a constant,
so everything it reads exists there); the sum stays an output for the residual path after the norm.
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import NO_VALUE, Method


def fuse_residual_norm(method: Method) -> int:
    """Rewrite each rms_norm(add(x, r)) with x and r of one shape and float dtype; returns how many."""
    usage = Usage.of(method)
    position = {id(node): i for i, node in enumerate(method.nodes)}
    fused = []
    for norm in method.nodes:
        if norm.op != "rms_norm":
            continue
        add = usage.producer_of(norm.inputs[0], "add")
        if add is None:
            continue
        x, r = (method.values[v] for v in add.inputs)
        total = method.values[add.outputs[0]]
        if not (x.dtype.is_float and x.dtype == r.dtype == total.dtype and x.shape == r.shape == total.shape):
            continue  # a broadcasting or type-promoting add is not the residual path
        weight = norm.inputs[1] if len(norm.inputs) > 1 else NO_VALUE
        maker = usage.producer.get(weight)
        if maker is not None and position[id(maker)] > position[id(add)]:
            continue  # a weight computed after the add: it would not exist where the fused node goes
        add.op, add.inputs = "add_rms_norm", [*add.inputs, weight]
        add.outputs, add.attrs = [add.outputs[0], norm.outputs[0]], dict(norm.attrs)
        fused.append(norm)
    gone = {id(node) for node in fused}
    method.nodes[:] = [node for node in method.nodes if id(node) not in gone]
    return len(fused)
