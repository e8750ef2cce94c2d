"""A linear layer absorbs the small nodes around it: the gated activation after a stacked gate/up projection
(`gated_linear`), and the residual add + RMSNorm before a projection that is the norm's only reader
(`add_rms_norm_linear`).

At batch 1 on a GPU a decode step is a chain of ~200 kernels, and a kernel that only normalizes 2048 values or
multiplies two 8192-wide halves costs a launch and a ramp-up (2-3 us) for almost no work. Inside the
matrix-vector product they cost nothing: every block of the product reads the whole input row anyway, so it can
normalize it on the way in, and a warp that computes gate row i can compute up row i and write act(gate) * up.
Backends without such a kernel run the ops these nodes stand for (kiln.runtime.backends.composite).

A quantized linear is absorbed the same way, into gated_quantized_linear and add_rms_norm_quantized_linear (its q,
scale, zero and quantization attributes carried over); a mixture-of-experts layer's gathered gate/up projection
takes its activation as gated_gathered_linear (a quantized expert stack keeps the two nodes: no backend has a kernel
that would take them as one). Both passes run last, after quantize_weights and fuse_projections (which makes the
stacked gate/up projection the gated pattern needs).
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import NO_VALUE, Method, Node

QUANT_ATTRS = ("bits", "group_size", "offset")
"""What a quantized linear's fused form carries over from it."""

GATED = {"linear": "gated_linear", "quantized_linear": "gated_quantized_linear",
         "gathered_linear": "gated_gathered_linear"}
"""The gated form of each linear op."""

NORMED = {"linear": "add_rms_norm_linear", "gated_linear": "add_rms_norm_linear",
          "quantized_linear": "add_rms_norm_quantized_linear",
          "gated_quantized_linear": "add_rms_norm_quantized_linear"}
"""The add + RMSNorm form of each (gated) linear op."""

INPUTS = {"linear": 3, "gated_linear": 3, "quantized_linear": 5, "gated_quantized_linear": 5, "gathered_linear": 4}
"""Inputs of each, the optional ones included (a fused node lists them all, absent as NO_VALUE); a gathered linear's
without combine (one with combine is a layer's down projection, never the gated one)."""


def _weight_inputs(linear: Node) -> list[int]:
    """The linear's inputs after x, padded with NO_VALUE to the op's full list."""
    return list(linear.inputs[1:]) + [NO_VALUE] * (INPUTS[linear.op] - len(linear.inputs))


def _quant_attrs(linear: Node) -> dict:
    return {k: linear.attrs[k] for k in QUANT_ATTRS if k in linear.attrs}


def _halves(method: Method, usage: Usage, gate: int, up: int) -> Node | None:
    """The linear whose output's first and second halves (last dim) are gate and up, read by nothing else."""
    slices = [usage.producer_of(v, "slice") for v in (gate, up)]
    if None in slices or not all(usage.only_reader_may_absorb(v) for v in (gate, up)):
        return None
    (g, u), h = slices, slices[0].inputs[0]
    if u.inputs[0] != h or len(usage.reader_nodes.get(h, ())) != 2 or h in usage.kept:
        return None
    linear = next((p for op in GATED if (p := usage.producer_of(h, op)) is not None), None)
    shape = method.values[h].shape
    if linear is None or not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    if len(linear.inputs) > INPUTS[linear.op] and linear.inputs[INPUTS[linear.op]] != NO_VALUE:
        return None  # a gathered linear's combine
    n, last = shape[-1] // 2, len(shape) - 1
    expected = ({"dim": last, "start": 0, "end": n}, {"dim": last, "start": n, "end": 2 * n})
    for node, want in zip((g, u), expected):
        if node.attrs.get("step", 1) != 1 or any(node.attrs.get(k) != v for k, v in want.items()):
            return None
    return linear


def fuse_gated_linear(method: Method) -> int:
    """Rewrite each gated_activation(linear(x)[..., :N], linear(x)[..., N:]) as gated_linear (of a quantized linear
    gated_quantized_linear, of a gathered one gated_gathered_linear); returns how many."""
    usage = Usage.of(method)
    gone: set[int] = set()
    count = 0
    for node in method.nodes:
        if node.op != "gated_activation":
            continue
        linear = _halves(method, usage, *node.inputs)
        if linear is None:
            continue
        slices = [usage.producer[v] for v in node.inputs]
        node.op, node.inputs = GATED[linear.op], [linear.inputs[0], *_weight_inputs(linear)]
        node.attrs = {**_quant_attrs(linear), "activation": node.attrs["activation"]}
        gone.update(id(n) for n in (linear, *slices))
        count += 1
    method.nodes[:] = [n for n in method.nodes if id(n) not in gone]
    return count


def fuse_norm_linear(method: Method) -> int:
    """Rewrite each add_rms_norm over the last dim whose normalized output only a (gated, quantized) linear reads
    (as its input row) as add_rms_norm_linear or add_rms_norm_quantized_linear; returns how many."""
    usage = Usage.of(method)
    position = {id(node): i for i, node in enumerate(method.nodes)}
    gone: set[int] = set()
    for norm in method.nodes:
        if norm.op != "add_rms_norm" or norm.attrs.get("axes") != 1:
            continue
        normed = norm.outputs[1]
        readers = usage.reader_nodes.get(normed, [])
        if len(readers) != 1 or normed in usage.kept or readers[0].op not in NORMED:
            continue
        linear = readers[0]
        if linear.inputs[0] != normed or normed in linear.inputs[1:]:
            continue
        makers = [usage.producer.get(v) for v in linear.inputs[1:] if v != NO_VALUE]
        if any(m is not None and position[id(m)] > position[id(norm)] for m in makers):
            continue  # a weight computed after the norm: it would not exist where the fused node goes
        x, residual, *weight = norm.inputs
        norm.inputs = [x, residual, weight[0] if weight else NO_VALUE, *_weight_inputs(linear)]
        norm.op, norm.outputs = NORMED[linear.op], [norm.outputs[0], linear.outputs[0]]
        norm.attrs = {**norm.attrs, **_quant_attrs(linear), "activation": linear.attrs.get("activation", "")}
        gone.add(id(linear))
    method.nodes[:] = [n for n in method.nodes if id(n) not in gone]
    return len(gone)
