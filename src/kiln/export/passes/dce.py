"""Dead code elimination: drop nodes whose results nobody reads, then values nothing refers to."""

from __future__ import annotations

from kiln.ir.graph import NO_VALUE, Method, ValueKind


def eliminate_dead_code(method: Method) -> int:
    """Remove dead nodes and unreferenced values (renumbering the rest); returns how many nodes were removed."""
    live = set(method.outputs) | {u.value for u in method.state_updates} | set(method.inputs)
    kept = []
    for node in reversed(method.nodes):
        if any(o in live for o in node.outputs):
            kept.append(node)
            live.update(i for i in node.inputs if i != NO_VALUE)
    removed = len(method.nodes) - len(kept)
    method.nodes = kept[::-1]
    used = sorted(live | {o for n in method.nodes for o in n.outputs})
    remap = {old: new for new, old in enumerate(used)}
    method.values = [method.values[i] for i in used]
    method.inputs = [remap[i] for i in method.inputs]
    method.outputs = [remap[i] for i in method.outputs]
    for u in method.state_updates:
        u.value = remap[u.value]
    for node in method.nodes:
        node.inputs = [remap[i] if i != NO_VALUE else NO_VALUE for i in node.inputs]
        node.outputs = [remap[i] for i in node.outputs]
    assert all(method.values[i].kind == ValueKind.INPUT for i in method.inputs)
    return removed
