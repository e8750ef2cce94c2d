"""Refuse, at export, sizes that depend on tensor data (`.item()`, a nonzero count) rather than on input shapes.

The runtime binds every symbol of a method from an input dimension that is exactly that symbol, and `kiln.load`
refuses a file that uses any other. torch.export names a size it cannot know ahead of time with an unbacked symbol
(u0, u1, ...); where one survives lowering and the passes, the file would be written and then refused by the
loader. So the exporter runs the loader's own rule on each method before anything is written, and names the ops
(and user source lines) that use such sizes.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import DATA_DEPENDENT, ProgramFormatError
from kiln.export.method import Failures, Lowered
from kiln.format.reader import _check_symbols_bindable
from kiln.ir import ops
from kiln.ir.graph import NO_VALUE, Method, Node
from kiln.ir.ops import AttrType
from kiln.ir.symbolic import parse


def check_bindable(lowered: Lowered, failures: Failures) -> None:
    """Add to `failures` every node of the method that brings in a size no input dimension gives (the nodes after
    it, which only carry that size on, are not listed: fixing the first fixes them)."""
    method = lowered.method
    if _bindable(method):
        return
    found = False
    for node in method.nodes:
        if _bindable(_probe(method, node)):
            continue
        found = True
        carried = set().union(*(_unbound(method, method.values[i].shape) for i in node.inputs if i != NO_VALUE))
        names = _unbound(method, _node_dims(method, node))
        if names - carried or not names:
            failures.add(lowered.origin(node), _reason(lowered, sorted(names - carried)), node.source)
    if not found:  # a value no node produces (a stand-in after an unsupported op): its users are reported
        try:
            _check_symbols_bindable(method, f"method {method.name!r}")
        except ProgramFormatError as e:
            failures.add(f"method {method.name}", f"{DATA_DEPENDENT}: {e}", "")


def _bindable(method: Method) -> bool:
    try:
        _check_symbols_bindable(method, f"method {method.name!r}")
    except ProgramFormatError:
        return False
    return True


def _probe(method: Method, node: Node) -> Method:
    """A method of the inputs and this one node, so the loader's rule judges the node alone."""
    inputs = [method.values[i] for i in method.inputs]
    outputs = [method.values[i] for i in node.outputs]
    return Method(method.name, inputs + outputs, list(range(len(inputs))), [], [node])


def _node_dims(method: Method, node: Node) -> list:
    """The dimensions a node declares: its outputs' and its symbolic-int attributes'."""
    attrs = ops.OPS[node.op].attr_map
    dims = [d for i in node.outputs for d in method.values[i].shape]
    for name, value in node.attrs.items():
        kind = attrs[name].type
        if kind in (AttrType.SYMINT, AttrType.SYMINTS):
            dims += value if kind == AttrType.SYMINTS else [value]
    return dims


def _unbound(method: Method, dims: Any) -> set[str]:
    """Symbols in `dims` that no input dimension names (for the message and for telling the node that brings a
    size in from those that carry it on; whether a node is refused is the loader's rule's decision)."""
    given = {d for i in method.inputs for d in method.values[i].shape}
    return {s for d in dims if isinstance(d, str) for s in parse(d).symbols} - given


def _reason(lowered: Lowered, names: list[str]) -> str:
    """Which data-dependent sizes a node uses and which ops they come from."""
    origins = [f"{name} from {lowered.data_symbols[name]}" for name in names if name in lowered.data_symbols]
    if origins:
        return f"{DATA_DEPENDENT} ({'; '.join(origins)}), which kiln cannot know ahead of time"
    return f"{DATA_DEPENDENT} (size {', '.join(names) or '?'}), not on the method's input shapes"
