"""The in-memory program: what the exporter builds, the writer serializes, the reader validates and returns.

Plain dataclasses with no behaviour beyond describing themselves, so both halves of kiln share one model.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kiln.ir.dtypes import DType
from kiln.ir.symbolic import Dim, Symbol, format_shape

NO_VALUE = -1
"""Index standing for an absent optional input."""

PASS_STATS_KEY = "kiln.passes"
"""Program metadata entry where the exporter records what its graph passes did (JSON; `kiln inspect --passes`)."""


class ValueKind(enum.IntEnum):
    """Where a value comes from; the integer is its code in the file."""

    TEMP = 0  # produced by a node
    INPUT = 1  # a user input of the method
    CONSTANT = 2  # a program constant (weights), `ref` indexes Program.constants
    STATE = 3  # a state buffer at the start of the call, `ref` indexes Program.states


@dataclass
class Value:
    name: str
    dtype: DType
    shape: tuple[Dim, ...]
    kind: ValueKind = ValueKind.TEMP
    ref: int = -1

    def spec(self) -> str:
        return f"{self.name}: {self.dtype.name}{format_shape(self.shape)}"


@dataclass
class Node:
    op: str
    inputs: list[int]
    outputs: list[int]
    attrs: dict[str, Any] = field(default_factory=dict)
    free_after: list[int] = field(default_factory=list)
    """Values whose last reader is this node: the runtime drops them once it has run (memory planning)."""
    source: str = ""
    """The user source line this node came from, for error messages."""


@dataclass
class StateUpdate:
    """After a call, state buffer `state` takes the value `value` (a buffer mutation in the model)."""

    value: int
    state: int


@dataclass
class Method:
    name: str
    values: list[Value]
    inputs: list[int]
    outputs: list[int]
    nodes: list[Node]
    symbols: list[Symbol] = field(default_factory=list)
    state_updates: list[StateUpdate] = field(default_factory=list)

    def input_specs(self) -> list[Value]:
        return [self.values[i] for i in self.inputs]

    def output_specs(self) -> list[Value]:
        return [self.values[i] for i in self.outputs]


@dataclass
class Constant:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    blob: int
    """Index into Program.blobs: constants with equal bytes share one blob."""

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class Blob:
    """A run of bytes in the constant segment; `offset` is relative to the segment and 64-byte aligned."""

    offset: int
    nbytes: int


@dataclass
class StateBuffer:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    init: int = -1
    """Constant index holding the initial contents, or -1 for zeros."""


@dataclass
class Program:
    opset_version: int
    methods: dict[str, Method]
    constants: list[Constant]
    blobs: list[Blob]
    states: list[StateBuffer]
    metadata: dict[str, str] = field(default_factory=dict)
