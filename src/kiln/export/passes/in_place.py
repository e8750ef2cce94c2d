"""Mark state-buffer writes that may happen in place (the KV-cache update).

A decode step functionalized by torch.export writes a cache as `new = index_put(cache, values, position)` and
makes `new` the cache's next state: a copy of the whole cache per layer and step. When the old cache value has no
other reader (so nothing can observe it after the write) and the result is exactly that buffer's next state, the
write may go into the buffer's own memory. The node is marked `in_place`; backends honour it. The
ring-buffer caches of sliding-window layers (kiln.models.llm) write at position mod ring size and are the same
pattern to this pass.
"""

from __future__ import annotations

import logging

from kiln.export.passes.usage import Usage
from kiln.ir.graph import Method, ValueKind

log = logging.getLogger("kiln.passes")

WRITES = ("index_put", "index_copy", "slice_scatter")
"""Ops that return a copy of their first input with part of it replaced."""


def mark_in_place_state_writes(method: Method) -> int:
    """Set in_place on every qualifying write; returns how many were marked."""
    usage = Usage.of(method)
    next_state = {u.value: u.state for u in method.state_updates}
    count = 0
    for node in method.nodes:
        if node.op not in WRITES or node.attrs.get("in_place"):
            continue
        x = method.values[node.inputs[0]]
        if x.kind != ValueKind.STATE:
            continue
        if next_state.get(node.outputs[0]) != x.ref:
            log.debug("%s into state %s: its result is not that buffer's next state", node.op, x.name)
            continue
        if not usage.only_reader_may_absorb(node.inputs[0]):
            log.debug("%s into state %s: the old contents are read elsewhere", node.op, x.name)
            continue
        node.attrs["in_place"] = True
        count += 1
    return count
