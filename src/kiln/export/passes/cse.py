"""Common subexpression elimination by structural value numbering.

Two nodes compute the same value when they run the same op on the same inputs with the same attributes. HF
decoders rebuild the same mask, position and RoPE subgraphs in every layer; after this pass each is computed once.
Constants are numbered by their content reference, so two values over one deduplicated constant count as equal.

Never merged: nodes marked `in_place` (they write into their input), nodes with no outputs, and a node whose
output is a method output or a state update (the issue's rule: keep graph outputs distinct values).
"""

from __future__ import annotations

from typing import Any

from kiln.export.passes.usage import Usage, replace_uses
from kiln.ir.graph import NO_VALUE, Method, ValueKind

IMPURE: frozenset[str] = frozenset()
"""Ops whose result is not a function of their inputs and attributes (kiln's op set has none yet: random ops are
not applicable at inference). Listed here so a future one is excluded by name."""


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, float) and value != value:
        return "nan"  # NaN != NaN would keep equal nodes apart
    return value


def eliminate_common_subexpressions(method: Method) -> int:
    """Rewire readers of each repeated computation to its first occurrence; returns how many nodes repeated."""
    usage = Usage.of(method)
    canonical: dict[int, int] = {}  # value -> its representative
    for i, v in enumerate(method.values):
        if v.kind == ValueKind.CONSTANT:
            canonical.setdefault(i, i)
    by_ref: dict[int, int] = {}
    for i, v in enumerate(method.values):
        if v.kind == ValueKind.CONSTANT:
            canonical[i] = by_ref.setdefault(v.ref, i)
    seen: dict[tuple, list[int]] = {}
    count = 0
    for node in method.nodes:
        node.inputs = [canonical.get(i, i) if i != NO_VALUE else i for i in node.inputs]
        if node.op in IMPURE or not node.outputs or node.attrs.get("in_place"):
            continue
        key = (node.op, tuple(node.inputs), _freeze(node.attrs))
        first = seen.get(key)
        if first is None:
            seen[key] = list(node.outputs)
            continue
        if any(o in usage.kept for o in node.outputs) or len(first) != len(node.outputs):
            continue
        for mine, theirs in zip(node.outputs, first, strict=True):
            canonical[mine] = theirs
            replace_uses(method, mine, theirs)
        count += 1
    return count
