"""The gated MLP activation act(gate) * up (Llama's SwiGLU, Gemma's GeGLU) becomes one `gated_activation` node,
which a backend runs as one pass (the CPU backend: the activation's output multiplied in place)."""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import Method

ACTIVATIONS = {"silu": lambda node: "silu",
               "gelu": lambda node: "gelu_tanh" if node.attrs.get("approximate") == "tanh" else "gelu"}


def fuse_gated_mlp(method: Method) -> int:
    """Rewrite each mul(act(gate), up) of equal shapes in place; returns how many."""
    usage = Usage.of(method)
    count = 0
    for mul in method.nodes:
        if mul.op != "mul":
            continue
        shape = method.values[mul.outputs[0]].shape
        for a, b in ((0, 1), (1, 0)):
            act = usage.producer.get(mul.inputs[a])
            if act is None or act.op not in ACTIVATIONS or not usage.only_reader_may_absorb(mul.inputs[a]):
                continue
            if method.values[act.inputs[0]].shape != shape or method.values[mul.inputs[b]].shape != shape:
                continue  # a broadcasting product is not the gated MLP
            mul.op, mul.inputs = "gated_activation", [act.inputs[0], mul.inputs[b]]
            mul.attrs = {"activation": ACTIVATIONS[act.op](act)}
            count += 1
            break
    return count
