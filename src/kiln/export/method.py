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
from kiln.ir.graph import Method, Node, StateUpdate, ValueKind

aten = torch.ops.aten

IGNORED = {
    aten._assert_scalar.default, aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default,
    aten._assert_tensor_metadata.default, aten._assert_async.msg,
}
"""Nodes that only assert facts torch.export already checked at capture; they have no runtime effect."""

FROM_DATA = {"aten._local_scalar_dense.default": "tensor.item()", "aten.item.default": "tensor.item()"}
"""ATen ops that read a number out of a tensor, by the name a user wrote them with."""

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def source_line(node: torch.fx.Node) -> str:
    """The innermost user frame of the node's stack trace: 'file:line in function: code'."""
    trace = node.meta.get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return ""
    path, line, fn, code = frames[-1]
    return f"{path}:{line} in {fn}: {code.strip()}"


def module_path(node: torch.fx.Node) -> str:
    """Where a node without a stack trace (one a decomposition made) sits in the model: its innermost module."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, kind = list(stack.values())[-1]
    name = getattr(kind, "__name__", None) or str(kind).rsplit(".", 1)[-1].strip("'>")
    return f"module {_strip(path) or '(the model itself)'} ({name})"


@dataclass
class Failures:
    """Unsupported ops across all methods, grouped by (target, reason), in order of first appearance, each with the
    distinct places it occurs."""

    groups: dict[tuple[str, str], list] = field(default_factory=dict)
    total: int = 0
    """How many failures were added (a method lowered completely iff this did not grow while lowering it)."""

    def add(self, target: str, reason: str, source: str) -> None:
        entry = self.groups.setdefault((target, reason), [0, []])
        entry[0] += 1
        if source and source not in entry[1]:
            entry[1].append(source)
        self.total += 1

    def ops(self) -> list[UnsupportedOp]:
        return [UnsupportedOp(t, n, r, places[0] if places else "", tuple(places))
                for (t, r), (n, places) in self.groups.items()]


@dataclass
class Lowered:
    """One method as lowered, with what export needs to report problems in it in the user's terms."""

    method: Method
    complete: bool
    """Every node lowered (otherwise the method holds stand-in values and is only good for more checks)."""
    aten: dict[int, tuple[Node, str]] = field(default_factory=dict)
    """id(kiln node) -> (that node, the ATen op it was lowered from)."""
    data_symbols: dict[str, str] = field(default_factory=dict)
    """kiln symbol name -> the ATen op (and user source line) whose tensor data gives its value (`.item()`)."""

    def origin(self, node: Node) -> str:
        """The ATen op a kiln node came from, or its kiln op where a pass made it."""
        entry = self.aten.get(id(node))
        return entry[1] if entry is not None and entry[0] is node else f"kiln op {node.op}"


def _strip(name: str) -> str:
    return name[len(BoundMethod.PREFIX):] if name.startswith(BoundMethod.PREFIX) else name


def lower_method(name: str, ep: torch.export.ExportedProgram, builder: ProgramBuilder, state_names: set[str],
                 user_names: dict[str, str], failures: Failures) -> Lowered:
    """The kiln method for `ep`, with every op it cannot lower added to `failures`.

    Lowering goes on past a node it cannot lower (its results get stand-in values of the right dtype and shape), so
    one export names every unsupported op of the model rather than the first of a chain.
    """
    symbols = SymbolTable(ep.range_constraints, user_names)
    ctx = LowerContext(symbols, builder.constant)
    before = failures.total
    inputs = _lower_inputs(ep, ctx, builder, state_names, failures)
    lowered = Lowered(Method(name, ctx.values, inputs, [], ctx.nodes, symbols.symbols), complete=False)
    skipped: set[torch.fx.Node] = {n for n in ep.graph.nodes if n.op == "placeholder" and n not in ctx.env}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target in IGNORED:
            continue
        _note_data_symbols(node, symbols, lowered)
        if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)):
            continue  # shape arithmetic: consumers read it from node.meta as a symbolic expression
        if any(a in skipped for a in node.all_input_nodes):
            skipped.add(node)  # an input has no value, not even a stand-in: the failure upstream says why
            continue
        _lower_node(node, ctx, builder, failures, lowered, skipped)
    if failures.total != before:
        return lowered
    outputs, updates = _lower_outputs(ep, ctx, builder, failures)
    lowered.method.outputs, lowered.method.state_updates = outputs, updates
    lowered.complete = failures.total == before
    return lowered


def _lower_inputs(ep: torch.export.ExportedProgram, ctx: LowerContext, builder: ProgramBuilder,
                  state_names: set[str], failures: Failures) -> list[int]:
    """The method's input values; parameters and buffers become constants or state buffers."""
    symbols = ctx.symbols
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    inputs: list[int] = []
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
    return inputs


def _lower_node(node: torch.fx.Node, ctx: LowerContext, builder: ProgramBuilder, failures: Failures,
                lowered: Lowered, skipped: set[torch.fx.Node]) -> None:
    """Lower one ATen node; on failure record it and give the node stand-in values (or skip its users)."""
    handler = HANDLERS.get(node.target)
    ctx.source = source_line(node)
    target = target_name(node.target)
    first = len(ctx.nodes)
    try:
        if handler is None:
            raise Unsupported("no lowering for this op yet")
        ctx.env[node] = handler(ctx, node)
        builder.source_ops[target] += 1
    except Unsupported as e:
        failures.add(target, str(e), ctx.source or module_path(node))
        del ctx.nodes[first:]  # half of a node's lowering would only confuse the checks after it
        stand_in = _stand_in(ctx, node)
        if stand_in is None:
            skipped.add(node)
        else:
            ctx.env[node] = stand_in
        return
    for kiln_node in ctx.nodes[first:]:
        lowered.aten[id(kiln_node)] = (kiln_node, target)


def _stand_in(ctx: LowerContext, node: torch.fx.Node) -> Any:
    """Values that stand for the results of a node that was not lowered (nothing computes them), so the nodes after
    it are still checked; None where a result has no kiln form (a complex tensor), and its users are skipped."""
    val = node.meta.get("val")
    many = isinstance(val, (tuple, list))
    try:
        parts = [None if v is None else ctx.new_value(f"unlowered_{node.name}", *_kiln_meta(ctx, v))
                 for v in (val if many else [val])]
    except Unsupported:
        return None
    return parts if many else parts[0]


def _kiln_meta(ctx: LowerContext, val: Any) -> tuple:
    if not isinstance(val, torch.Tensor):
        raise Unsupported(f"result of type {type(val).__name__}")
    return kiln_dtype(val.dtype), ctx.symbols.shape(val.shape)


def _note_data_symbols(node: torch.fx.Node, symbols: SymbolTable, lowered: Lowered) -> None:
    """Remember which node's tensor data gives the value of each symbol torch could not know ahead of time
    (unbacked: u0 from `.item()`, a nonzero count), to say where it came from if the program still uses it."""
    for sym in node.meta.get("unbacked_bindings") or {}:
        where = source_line(node) or module_path(node)
        name = symbols.names.get(str(sym), str(sym))
        op = target_name(node.target)
        op = f"{FROM_DATA[op]} ({op})" if op in FROM_DATA else op
        lowered.data_symbols.setdefault(name, op + (f" at {where}" if where else ""))


def _lower_outputs(ep: torch.export.ExportedProgram, ctx: LowerContext, builder: ProgramBuilder,
                   failures: Failures) -> tuple[list[int], list[StateUpdate]]:
    """The method's outputs and the state updates of the buffers it mutates."""
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
    return outputs, updates


def mutated_buffers(ep: torch.export.ExportedProgram) -> set[str]:
    return {_strip(s.target) for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}


def describe_args(args: Any) -> str:
    return ", ".join(f"{type(a).__name__}{list(a.shape) if hasattr(a, 'shape') else ''}" for a in args)
