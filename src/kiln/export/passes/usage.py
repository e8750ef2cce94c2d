"""Who produces and who reads each value of a method, and the small edits every rewriting pass makes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.export.builder import ProgramBuilder
from kiln.export.lower.registry import TORCH_OF
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Method, Node, Value, ValueKind


@dataclass
class Usage:
    producer: dict[int, Node]
    reader_nodes: dict[int, list[Node]]  # a node reading a value twice is listed twice
    kept: set[int]  # method outputs and state updates: their values must survive any rewrite

    @classmethod
    def of(cls, method: Method) -> Usage:
        reader_nodes: dict[int, list[Node]] = {}
        for node in method.nodes:
            for i in node.inputs:
                if i != NO_VALUE:
                    reader_nodes.setdefault(i, []).append(node)
        return cls({o: node for node in method.nodes for o in node.outputs}, reader_nodes,
                   set(method.outputs) | {u.value for u in method.state_updates})

    def only_reader_may_absorb(self, value: int) -> bool:
        """Whether `value` is read by exactly one node and by nothing outside the graph, so that node may fuse
        its producer away."""
        return len(self.reader_nodes.get(value, ())) == 1 and value not in self.kept

    def sole_reader(self, value: int, op: str) -> Node | None:
        """The one node reading `value`, if it is an `op` node and nothing outside the graph reads `value`."""
        nodes = self.reader_nodes.get(value, [])
        if len(nodes) != 1 or value in self.kept or nodes[0].op != op:
            return None
        return nodes[0]

    def producer_of(self, value: int, op: str) -> Node | None:
        """The node computing `value` if it is an `op` node."""
        node = self.producer.get(value)
        return node if node is not None and node.op == op else None


def is_constant(method: Method, v: int) -> bool:
    """An absent optional input counts as constant."""
    return v == NO_VALUE or method.values[v].kind == ValueKind.CONSTANT


def replace_uses(method: Method, old: int, new: int) -> None:
    """Every node reading `old` reads `new` instead (the caller makes sure `old` is not a method output)."""
    for node in method.nodes:
        if old in node.inputs:
            node.inputs = [new if i == old else i for i in node.inputs]


def add_constant(method: Method, builder: ProgramBuilder, data: np.ndarray, dtype: DType, name: str) -> int:
    """A new constant value holding `data` rounded once to `dtype` (content-deduplicated by the builder)."""
    data = np.array(data, copy=True)
    if data.dtype == DType.bfloat16.numpy:  # torch cannot take ml_dtypes' bfloat16: pass the bits
        tensor = torch.from_numpy(data.view(np.uint16)).view(torch.bfloat16).to(TORCH_OF[dtype])
    else:
        tensor = torch.from_numpy(data).to(TORCH_OF[dtype])
    ref = builder.constant(tensor, name)
    method.values.append(Value(name, dtype, tuple(tensor.shape), ValueKind.CONSTANT, ref))
    return len(method.values) - 1


def existing_constant(method: Method, builder: ProgramBuilder, ref: int) -> int:
    """A new value of `method` for the builder's constant `ref` (one another method added before)."""
    c = builder.constants[ref]
    method.values.append(Value(c.name, c.dtype, c.shape, ValueKind.CONSTANT, ref))
    return len(method.values) - 1


def derived_constants(method: Method, builder: ProgramBuilder, key: tuple,
                      make: Callable[[], tuple[tuple[int, ...], Any] | None]) -> tuple[tuple[int, ...], Any] | None:
    """`make`'s result made once per program: its constant values of `method` (NO_VALUE for a part it has not)
    and whatever else it returns beside them, or None. `key` names what they are derived from (the pass and its
    source constants' refs); a later method asking with the same key gets values of the first one's constants
    (builder.derived) without computing or hashing them again."""
    if key in builder.derived:
        known = builder.derived[key]
        if known is None:
            return None
        refs, extra = known
        return tuple(NO_VALUE if r is None else existing_constant(method, builder, r) for r in refs), extra
    made = make()
    builder.derived[key] = None if made is None else (
        tuple(None if v == NO_VALUE else method.values[v].ref for v in made[0]), made[1])
    return made


def derived_constant(method: Method, builder: ProgramBuilder, key: tuple,
                     make: Callable[[], tuple[np.ndarray, DType, str]]) -> int:
    """A value for the one constant `make` computes (its data, dtype and name), made once per program
    (derived_constants)."""
    (value,), _ = derived_constants(method, builder, key, lambda: ((add_constant(method, builder, *make()),), None))
    return value


def constant_value(method: Method, builder: ProgramBuilder, v: int) -> np.ndarray | None:
    """The contents of constant value `v`, or None when it is not a constant."""
    value = method.values[v] if v != NO_VALUE else None
    if value is None or value.kind != ValueKind.CONSTANT:
        return None
    return builder.constant_array(value.ref)
