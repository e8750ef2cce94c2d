"""Plan-time specializations of the CPU backend (Backend.prepare): a node whose constants the compiled helpers can
bind once gets a kernel made for it when a session plans its method.

- quantized_linear with constant weights: their addresses taken once, the few-row scratch kept (quant.py), so a
  decode step's ~120 quantized linears stop paying the general kernel's per-call checks and conversions; int4
  and symmetric int8 weights in the lanes form (resident.node_lanes) where the helpers have it, for the rows that
  take integer products (quant.lanes_rows); its fused forms (gated_quantized_linear,
  add_rms_norm_quantized_linear) run their composition with that kernel.
"""

from __future__ import annotations

from kiln.ir.graph import Method, Node
from kiln.runtime.backends.base import Prepared, PreparerRegistry, absent, constant_ref
from kiln.runtime.backends.cpu import resident
from kiln.runtime.program import Program

PREPARERS = PreparerRegistry("cpu")
preparer = PREPARERS.register
prepare = PREPARERS.prepare


def _bound(program: Program, method: Method, node: Node, first: int):
    """The bound few-row kernel of the node's quantized weight (q at input `first`, then scale, zero, bias; its
    attributes by name), or None where the weights are not constants it can bind."""
    from kiln.runtime.backends.cpu.quant import bound_lanes, bound_linear, yields_output

    refs = [constant_ref(method, node, first + i) for i in range(4)]  # q, scale, zero, bias
    if refs[0] is None or refs[1] is None or any(r is None and not absent(node, first + i)
                                                 for i, r in enumerate(refs)):
        return None
    bits, group, offset = int(node.attrs["bits"]), int(node.attrs["group_size"]), bool(node.attrs.get("offset", False))
    lanes = resident.node_lanes(program, method, node, first)
    if lanes is not None:
        packed, n, k, group = lanes
        bias = None if refs[3] is None else resident.constant(program, refs[3])
        stored = tuple(None if r is None else program.constant(r) for r in refs[:3])
        return bound_lanes(packed, stored, bias, n, k, group, bits, offset, refine=yields_output(method, node))
    arrays = [None if r is None else resident.constant(program, r) for r in refs]
    return bound_linear(*arrays, bits, group, offset, refine=yields_output(method, node))


@preparer("quantized_linear")
def quantized_linear(program: Program, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    run = _bound(program, method, node, 1)
    return None if run is None else (run, tuple(node.inputs))


@preparer("gated_quantized_linear", "add_rms_norm_quantized_linear")
def fused_quantized_linear(program: Program, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    from kiln.runtime.backends import composite
    from kiln.runtime.backends.cpu.registry import CPU_KERNELS

    run = _bound(program, method, node, 1 if node.op == "gated_quantized_linear" else 3)
    if run is None:
        return None
    kernels = {**CPU_KERNELS.kernels, "quantized_linear": run}
    return composite.bind(composite.COMPOSITES[node.op], kernels), tuple(node.inputs)
