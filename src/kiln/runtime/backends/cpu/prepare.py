"""Plan-time specializations of the CPU backend (Backend.prepare): a node whose constants the compiled helpers can
bind once gets a kernel made for it when a session plans its method.

- quantized_linear with constant weights: their addresses taken once, the few-row scratch kept (quant.py), so a
  decode step's ~120 quantized linears stop paying the general kernel's per-call checks and conversions.
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.ir.graph import Method, Node, ValueKind
from kiln.runtime.backends.base import Kernel
from kiln.runtime.program import Program

Prepared = tuple[Kernel, tuple[int, ...]]
Preparer = Callable[[Program, Method, Node, dict[str, int]], "Prepared | None"]
PREPARERS: dict[str, Preparer] = {}


def preparer(*ops: str) -> Callable[[Preparer], Preparer]:
    def deco(fn: Preparer) -> Preparer:
        for op in ops:
            if op in PREPARERS:
                raise ValueError(f"cpu preparer for {op!r} registered twice")
            PREPARERS[op] = fn
        return fn
    return deco


def prepare(program: Program, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    fn = PREPARERS.get(node.op)
    return None if fn is None else fn(program, method, node, env)


def constant_input(program: Program, method: Method, node: Node, position: int) -> tuple[bool, object]:
    """(whether input `position` of node is a program constant or absent, the constant's array or None)."""
    if position >= len(node.inputs) or node.inputs[position] < 0:
        return True, None
    v = method.values[node.inputs[position]]
    return (True, program.constant(v.ref)) if v.kind == ValueKind.CONSTANT else (False, None)


@preparer("quantized_linear")
def quantized_linear(program: Program, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    from kiln.runtime.backends.cpu.quant import bound_linear

    found = [constant_input(program, method, node, i) for i in range(1, 5)]  # q, scale, zero, bias
    if not all(constant for constant, _ in found) or found[0][1] is None or found[1][1] is None:
        return None
    kernel = bound_linear(*(array for _, array in found), int(node.attrs["bits"]), int(node.attrs["group_size"]))
    return None if kernel is None else (kernel, tuple(node.inputs))
