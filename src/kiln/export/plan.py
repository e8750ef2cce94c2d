"""Memory planning: each value's last reader, so the runtime can drop temporaries as soon as they are dead."""

from __future__ import annotations

from kiln.ir.graph import NO_VALUE, Method, ValueKind


def plan_memory(method: Method) -> None:
    """Fill `free_after` of every node: the temporaries (and inputs) whose last reader it is.

    Method outputs and values that become state are never freed; a value nobody reads is freed right after the
    node that made it.
    """
    last_use: dict[int, int] = {}
    for j, node in enumerate(method.nodes):
        node.free_after = []
        for i in node.inputs:
            if i != NO_VALUE:
                last_use[i] = j
    keep = set(method.outputs) | {u.value for u in method.state_updates}
    freeable = (ValueKind.TEMP, ValueKind.INPUT)
    for v, j in sorted(last_use.items()):
        if v not in keep and method.values[v].kind in freeable:
            method.nodes[j].free_after.append(v)
    for node in method.nodes:
        for o in node.outputs:
            if o not in last_use and o not in keep:
                node.free_after.append(o)
