"""Lower one ExportedProgram into one kiln method, collecting every op it cannot lower."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export.graph_signature import InputKind, OutputKind

from kiln.errors import UnsupportedOp
from kiln.export.builder import ProgramBuilder
from kiln.export.capture import BoundMethod
from kiln.export.lower import HANDLERS, LowerContext, Unsupported
from kiln.export.lower.registry import kiln_dtype, target_name
from kiln.export.symbols import SymbolTable
from kiln.ir.graph import Method, StateUpdate, ValueKind

aten = torch.ops.aten

IGNORED = {
    aten._assert_scalar.default, aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default,
    aten._assert_tensor_metadata.default, aten._assert_async.msg,
}
"""Nodes that only assert facts torch.export already checked at capture; they have no runtime effect."""

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_line(node: torch.fx.Node) -> str:
    """The innermost user frame of the node's stack trace: 'file:line in function: code'."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return ""
    path, line, fn, code = frames[-1]
    return f"{path}:{line} in {fn}: {code.strip()}"


@dataclass
class Failures:
    """Unsupported ops across all methods, grouped by (target, reason), in order of first appearance."""

    groups: dict[tuple[str, str], list] = field(default_factory=dict)

    def add(self, target: str, reason: str, source: str) -> None:
        entry = self.groups.setdefault((target, reason), [0, source])
        entry[0] += 1

    def ops(self) -> list[UnsupportedOp]:
        return [UnsupportedOp(t, n, r, s) for (t, r), (n, s) in self.groups.items()]


def _strip(name: str) -> str:
    return name[len(BoundMethod.PREFIX):] if name.startswith(BoundMethod.PREFIX) else name


def lower_method(name: str, ep: torch.export.ExportedProgram, builder: ProgramBuilder, state_names: set[str],
                 user_names: dict[str, str], failures: Failures) -> Method | None:
    """The kiln method for `ep`; None (with `failures` filled) when some op cannot be lowered."""
    symbols = SymbolTable(ep.range_constraints, user_names)
    ctx = LowerContext(symbols, builder.constant)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    inputs: list[int] = []
    failed: set[torch.fx.Node] = set()
    for spec in ep.graph_signature.input_specs:
        node = placeholders[spec.arg.name]
        val = node.meta.get("val")
        try:
            if spec.kind == InputKind.USER_INPUT:
                if not isinstance(val, torch.Tensor):
                    raise Unsupported(f"input {node.name} is a {type(val).__name__}; method inputs must be tensors")
                v = ctx.new_value(node.name, kiln_dtype(val.dtype), symbols.shape(val.shape), ValueKind.INPUT)
                inputs.append(v)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                target = _strip(spec.target)
                tensor = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
                if not isinstance(tensor, torch.Tensor):
                    raise Unsupported(f"{target} is a {type(tensor).__name__}, not a tensor")
                if spec.kind == InputKind.BUFFER and target in state_names:
                    ref = builder.state(target, tensor)
                    state = builder.states[ref]
                    v = ctx.new_value(target, state.dtype, state.shape, ValueKind.STATE, ref)
                else:
                    v = ctx.constant(tensor, target)
            else:
                raise Unsupported(f"input kind {spec.kind.name} ({spec.target})")
            ctx.env[node] = v
        except Unsupported as e:
            failures.add(f"input {node.name}", str(e), "")
            failed.add(node)
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target in IGNORED:
            continue
        if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)):
            continue  # shape arithmetic: consumers read it from node.meta as a symbolic expression
        if any(a in failed for a in node.all_input_nodes):
            failed.add(node)
            continue
        handler = HANDLERS.get(node.target)
        ctx.source = source_line(node)
        if handler is None:
            failures.add(target_name(node.target), "no lowering for this op yet", ctx.source)
            failed.add(node)
            continue
        try:
            ctx.env[node] = handler(ctx, node)
            builder.source_ops[target_name(node.target)] += 1
        except Unsupported as e:
            failures.add(target_name(node.target), str(e), ctx.source)
            failed.add(node)
    if failed:
        return None
    outputs: list[int] = []
    updates: list[StateUpdate] = []
    out_nodes = list(ep.graph.output_node().args[0])
    for spec, arg in zip(ep.graph_signature.output_specs, out_nodes):
        value = ctx.env.get(arg) if isinstance(arg, torch.fx.Node) else None
        if spec.kind == OutputKind.USER_OUTPUT:
            if not isinstance(value, int):
                failures.add("output", f"output {arg!r} is not a tensor (kiln methods return tensors only)", "")
                continue
            outputs.append(value)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            target = _strip(spec.target)
            state = builder._state_index.get(target)
            if state is None or not isinstance(value, int):
                failures.add("output", f"buffer {target} is mutated but is not a state buffer", "")
                continue
            want = builder.states[state]
            value = ctx.cast(value, want.dtype)
            if tuple(ctx.shape(value)) != want.shape:
                failures.add("output", f"buffer {target} changes shape from {list(want.shape)} to "
                                       f"{list(ctx.shape(value))}; state buffers have fixed shapes", "")
                continue
            updates.append(StateUpdate(value, state))
        else:
            failures.add("output", f"output kind {spec.kind.name} ({spec.target}) is not supported; a method may "
                                   "mutate buffers but not its inputs", "")
    for k, v in enumerate(outputs):
        if ctx.values[v].kind == ValueKind.TEMP:
            ctx.values[v].name = "output" if len(outputs) == 1 else f"output_{k}"
    return Method(name, ctx.values, inputs, outputs, ctx.nodes, symbols.symbols, updates)


def mutated_buffers(ep: torch.export.ExportedProgram) -> set[str]:
    return {_strip(s.target) for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}


def describe_args(args: Any) -> str:
    return ", ".join(f"{type(a).__name__}{list(a.shape) if hasattr(a, 'shape') else ''}" for a in args)
