"""Plan-time specializations of the CPU backend (Backend.prepare): a node whose constants the compiled helpers can
bind once gets a kernel made for it when a session plans its method.

- quantized_linear with constant weights: their addresses taken once, the few-row scratch kept (quant.py), so a
  decode step's ~120 quantized linears stop paying the general kernel's per-call checks and conversions.
"""

from __future__ import annotations

from kiln.ir.graph import Method, Node
from kiln.runtime.backends.base import Prepared, PreparerRegistry, absent, constant_ref
from kiln.runtime.backends.cpu import resident
from kiln.runtime.program import Program

PREPARERS = PreparerRegistry("cpu")
preparer = PREPARERS.register
prepare = PREPARERS.prepare


@preparer("quantized_linear")
def quantized_linear(program: Program, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    from kiln.runtime.backends.cpu.quant import bound_linear, yields_output

    refs = [constant_ref(method, node, i) for i in range(1, 5)]  # q, scale, zero, bias
    if refs[0] is None or refs[1] is None or any(r is None and not absent(node, i + 1) for i, r in enumerate(refs)):
        return None
    arrays = [None if r is None else resident.constant(program, r) for r in refs]
    kernel = bound_linear(*arrays, int(node.attrs["bits"]), int(node.attrs["group_size"]),
                          bool(node.attrs.get("offset", False)), refine=yields_output(method, node))
    return None if kernel is None else (kernel, tuple(node.inputs))
