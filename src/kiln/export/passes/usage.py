"""Who produces and who reads each value of a method: what every rewriting pass checks before it fuses."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kiln.ir.graph import NO_VALUE, Method, Node, ValueKind


@dataclass
class Usage:
    producer: dict[int, Node]
    readers: Counter
    kept: set[int]  # method outputs and state updates: their values must survive any rewrite

    @classmethod
    def of(cls, method: Method) -> Usage:
        return cls({o: node for node in method.nodes for o in node.outputs},
                   Counter(i for node in method.nodes for i in node.inputs if i != NO_VALUE),
                   set(method.outputs) | {u.value for u in method.state_updates})

    def only_reader_may_absorb(self, value: int) -> bool:
        """Whether `value` is read by exactly one node and by nothing outside the graph, so that node may fuse
        its producer away."""
        return self.readers[value] == 1 and value not in self.kept


def is_constant(method: Method, v: int) -> bool:
    """An absent optional input counts as constant."""
    return v == NO_VALUE or method.values[v].kind == ValueKind.CONSTANT
