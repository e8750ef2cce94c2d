"""Weights quantized before the export (a GGUF file's blocks, a torchao model's tensors), found again among the
float weights of the exported graph by their rows, so the export can store them as they were quantized.

Why by rows: the model the export traces holds dequantized floats (transformers dequantizes a GGUF file; tracing a
torchao model folds its dequantization into a constant), its loaders reorder rows (Llama's query and key weights
from GGUF), and the export itself stacks projections (q/k/v, gate/up). A row's float bytes survive all of that, so
each weight of the graph is looked up row by row; when every row comes from source tensors of one kiln layout, the
weight is stored in that layout, its rows gathered from the sources' codes, and checked to dequantize to the
graph's values bit for bit (kiln.export.quantize.KnownQuantization).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.export.quantize import QuantizedWeight


@dataclass
class SourceTensor:
    """One quantized tensor of the source: its name, its type there, its kiln form (None: no exact one; `fallback`
    decides) and its dequantized values as the model holds them, float32 [N, K]: kept only where there is no kiln
    form to dequantize again (a source's float copy is 4-8x its size: an 8B model's would be 32 GB)."""

    name: str
    type_name: str
    weight: QuantizedWeight | None
    values: np.ndarray | None = None

    def dequantized(self) -> np.ndarray:
        return self.values if self.values is not None else dequantized(self.weight)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == \
        np.ascontiguousarray(b).tobytes()


def concatenate(pieces: list[QuantizedWeight]) -> QuantizedWeight:
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    zero = None if first.zero is None else np.concatenate([p.zero for p in pieces])
    return QuantizedWeight(np.concatenate([p.q for p in pieces]), np.concatenate([p.scale for p in pieces]), zero,
                           first.bits, first.group, first.offset, first.source)


class RowIndex:
    """KnownQuantization over source tensors, by the bytes of their dequantized rows (in the dtype of the weight
    looked up: a bf16 model's weights are the sources' values rounded to bf16)."""

    def __init__(self, tensors: list[SourceTensor]):
        self.tensors = tensors
        self._index: dict[str, dict[int, tuple[int, int]]] = {}
        self.kept: dict[str, str] = {}  # source tensor name -> its type, for the ones stored as they were

    def fallback(self, weight: np.ndarray, used: list[SourceTensor]) -> QuantizedWeight | None:
        """The weight's form when its rows come from sources without one exact kiln layout; None: left float."""
        return None

    def _rows_index(self, dtype: np.dtype) -> dict[int, tuple[int, int]]:
        key = np.dtype(dtype).str
        if key not in self._index:
            index: dict[int, tuple[int, int]] = {}
            for i, t in enumerate(self.tensors):  # (one tensor's float copy at a time)
                rows = np.ascontiguousarray(t.dequantized().astype(dtype, copy=False))
                for r in range(rows.shape[0]):
                    index.setdefault(hash(rows[r].tobytes()), (i, r))
            self._index[key] = index
        return self._index[key]

    def _locate(self, weight: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(tensor index, row) of each row of `weight`, or None if any row is not the source's."""
        if weight.ndim != 2 or not self.tensors:
            return None
        index = self._rows_index(weight.dtype)
        rows = np.ascontiguousarray(weight)
        found = [index.get(hash(rows[r].tobytes())) for r in range(rows.shape[0])]
        if not found or any(f is None for f in found):
            return None
        where = np.array(found, dtype=np.int64)
        return where[:, 0], where[:, 1]

    def layout_of(self, weight: np.ndarray) -> tuple | None:
        located = self._locate(weight)
        if located is None:
            return None
        layouts = {self._layout(self.tensors[i]) for i in np.unique(located[0])}
        return layouts.pop() if len(layouts) == 1 else None

    @staticmethod
    def _layout(t: SourceTensor) -> tuple:
        return t.weight.layout if t.weight is not None else ("no exact layout", t.type_name)

    def lookup(self, weight: np.ndarray) -> QuantizedWeight | None:
        located = self._locate(weight)
        if located is None:
            return None
        tensors, rows = located
        used = [self.tensors[i] for i in np.unique(tensors)]
        if any(t.weight is None for t in used) or len({t.weight.layout for t in used}) != 1:
            return self.fallback(weight, used)
        starts = np.flatnonzero(np.diff(tensors, prepend=-1) != 0)  # runs of rows from one tensor
        pieces = [self.tensors[tensors[a]].weight.rows(rows[a:b])
                  for a, b in zip(starts, [*starts[1:], len(tensors)], strict=True)]
        stored = concatenate(pieces)
        if not same_bits(dequantized(stored).astype(weight.dtype), weight):
            return None
        for t in used:
            self.kept[t.name] = t.type_name
        return stored


def dequantized(w: QuantizedWeight) -> np.ndarray:
    """The weight as float32 [N, K], by the op set's own definition (the runtime's reference)."""
    from kiln.runtime.backends.array_api.quant import dequantize

    return dequantize(np, w.q, w.scale, w.zero, w.bits, w.group, w.offset)
