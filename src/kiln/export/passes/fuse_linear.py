"""A linear layer absorbs the small nodes around it: the gated activation after a stacked gate/up projection
(`gated_linear`), and the residual add + RMSNorm before a projection that is the norm's only reader
(`add_rms_norm_linear`).

At batch 1 on a GPU a decode step is a chain of ~200 kernels, and a kernel that only normalizes 2048 values or
multiplies two 8192-wide halves costs a launch and a ramp-up (2-3 us) for almost no work. Inside the
matrix-vector product they cost nothing: every block of the product reads the whole input row anyway, so it can
normalize it on the way in, and a warp that computes gate row i can compute up row i and write act(gate) * up.
Backends without such a kernel run the ops these nodes stand for (kiln.runtime.backends.composite).

Both passes run last, after quantize_weights (a quantized linear is not absorbed) and fuse_projections (which
makes the stacked gate/up projection the gated pattern needs).
"""

from __future__ import annotations

from kiln.export.passes.usage import Usage
from kiln.ir.graph import NO_VALUE, Method, Node


def _halves(method: Method, usage: Usage, gate: int, up: int) -> Node | None:
    """The linear whose output's first and second halves (last dim) are gate and up, read by nothing else."""
    slices = [usage.producer_of(v, "slice") for v in (gate, up)]
    if None in slices or not all(usage.only_reader_may_absorb(v) for v in (gate, up)):
        return None
    (g, u), h = slices, slices[0].inputs[0]
    if u.inputs[0] != h or len(usage.reader_nodes.get(h, ())) != 2 or h in usage.kept:
        return None
    linear = usage.producer_of(h, "linear")
    shape = method.values[h].shape
    if linear is None or not shape or not isinstance(shape[-1], int) or shape[-1] % 2:
        return None
    n, last = shape[-1] // 2, len(shape) - 1
    expected = ({"dim": last, "start": 0, "end": n}, {"dim": last, "start": n, "end": 2 * n})
    for node, want in zip((g, u), expected):
        if node.attrs.get("step", 1) != 1 or any(node.attrs.get(k) != v for k, v in want.items()):
            return None
    return linear


def fuse_gated_linear(method: Method) -> int:
    """Rewrite each gated_activation(linear(x)[..., :N], linear(x)[..., N:]) as gated_linear; returns how many."""
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
        node.op, node.inputs = "gated_linear", list(linear.inputs)
        node.attrs = {"activation": node.attrs["activation"]}
        gone.update(id(n) for n in (linear, *slices))
        count += 1
    method.nodes[:] = [n for n in method.nodes if id(n) not in gone]
    return count


def fuse_norm_linear(method: Method) -> int:
    """Rewrite each add_rms_norm over the last dim whose normalized output only a linear or gated_linear reads (as
    its input row) as add_rms_norm_linear; returns how many."""
    usage = Usage.of(method)
    position = {id(node): i for i, node in enumerate(method.nodes)}
    gone: set[int] = set()
    for norm in method.nodes:
        if norm.op != "add_rms_norm" or norm.attrs.get("axes") != 1:
            continue
        normed = norm.outputs[1]
        readers = usage.reader_nodes.get(normed, [])
        if len(readers) != 1 or normed in usage.kept or readers[0].op not in ("linear", "gated_linear"):
            continue
        linear = readers[0]
        if linear.inputs[0] != normed or normed in linear.inputs[1:]:
            continue
        makers = [usage.producer.get(v) for v in linear.inputs[1:] if v != NO_VALUE]
        if any(m is not None and position[id(m)] > position[id(norm)] for m in makers):
            continue  # a weight computed after the norm: it would not exist where the fused node goes
        x, residual, *weight = norm.inputs
        norm.inputs = [x, residual, weight[0] if weight else NO_VALUE, *linear.inputs[1:]]
        norm.op, norm.outputs = "add_rms_norm_linear", [norm.outputs[0], linear.outputs[0]]
        norm.attrs = {**norm.attrs, "activation": linear.attrs.get("activation", "")}
        gone.add(id(linear))
    method.nodes[:] = [n for n in method.nodes if id(n) not in gone]
    return len(gone)
