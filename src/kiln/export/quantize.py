"""Weight quantization at export: linear and embedding weights stored as bf16/fp16, or weight-only int8/int4.

    kiln.export(model, args, quantize=kiln.export.Quantize("int4", group_size=64))
    kiln export factory.py:make -o model.kiln --quantize int4 --group-size 64 [--asymmetric]

int8 and int4 round to nearest with a scale per group of `group_size` consecutive weights of a row (int8 default:
one group per row, i.e. per output channel; int4 default 64; when a row's length is not a multiple of the group
size, the largest even divisor of it below the group size is used, e.g. 96 for 576-wide rows and group 128),
asymmetric by default (a float zero point per group, from the group's min and max) or symmetric (zero point
fixed: 0 for int8, 8 for int4's unsigned nibbles). Asymmetric is the default because it measured better on
SmolLM2-135M: greedy tokens equal to float32's for 24/24 tokens with int8 per channel, 19/24 symmetric
(docs/benchmarks.md). The layout is
the op set's quantized_linear / quantized_embedding. A weight shared by an embedding and an LM head (tied) is
quantized once and stored once. bf16/fp16 store the weight in half precision and cast it back at run time (half
the file; the arithmetic stays in the activations' dtype).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import add_constant, constant_value, derived_constant, derived_constants
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Method, Node, Value, ValueKind

MODES = ("int8", "int4", "bf16", "fp16")


@dataclass
class QuantizedWeight:
    """One weight [N, K] already in the op set's layout: q, scale, zero (zero points; with `offset`, additive
    offsets; or None), bits, group size. `source` says where the quantization came from (e.g. "GGUF Q4_K")."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    bits: int
    group: int
    offset: bool
    source: str

    @property
    def layout(self) -> tuple:
        """What two weights must share to be stacked into one quantized weight."""
        return self.bits, self.group, self.offset, self.zero is None, self.source

    def rows(self, index: np.ndarray | slice) -> QuantizedWeight:
        return QuantizedWeight(self.q[index], self.scale[index], None if self.zero is None else self.zero[index],
                               self.bits, self.group, self.offset, self.source)


class KnownQuantization(Protocol):
    """Weights whose quantized form is known already (a GGUF file's), found by their float values: the export keeps
    that form instead of quantizing again (kiln.models.gguf_quant.GGUFQuantization)."""

    def lookup(self, weight: np.ndarray) -> QuantizedWeight | None:
        """The quantized form whose dequantization is `weight` ([N, K], as the model holds it), or None."""

    def layout_of(self, weight: np.ndarray) -> tuple | None:
        """lookup(weight).layout without building it (None when unknown): linears stack only when equal."""


@dataclass(frozen=True)
class Quantize:
    """What to quantize: mode one of MODES; group_size None = int8 per channel / int4 64; symmetric or not."""

    mode: str
    group_size: int | None = None
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"quantize mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.group_size is not None and (self.group_size < 2 or self.group_size % 2):
            raise ValueError(f"group_size {self.group_size}: give an even number >= 2 (32, 64, 128 are usual)")
        if self.mode in ("bf16", "fp16") and (self.group_size is not None or self.symmetric):
            raise ValueError(f"{self.mode} takes no group size or symmetric range")

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}.get(self.mode, 16)

    def group_for(self, k: int) -> int | None:
        """The group size for rows of length k, or None when k cannot be split so (the weight stays float)."""
        group = min(self.group_size or (k if self.mode == "int8" else 64), k)
        for size in range(group, 1, -1):
            if k % size == 0 and (self.bits == 8 or size % 2 == 0):
                return size
        return None


def quantize_rows(w: np.ndarray, bits: int, group_size: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray,
                                                                                       np.ndarray | None]:
    """(q, scale, zero or None) for a float weight [N, K], in the op set's layout; scale/zero in float64.

    Rows are independent, so a large weight is quantized in blocks of rows on every core (NumPy's loops release
    the interpreter lock): one thread took ~54 s of a 100 s export of a Llama-3.2-1B-shaped model in int4, and
    an 8B one has 6.5x its weights. The blocks are small (QUANTIZE_BLOCK_ELEMENTS), so that each of the dozen
    float64 temporaries a block makes stays in the core's cache: one block a core over a [14336, 4096] weight
    took 1.1 s on this project's 2-core machine, blocks of 2^18 elements 0.4 s. The result does not depend on the
    split."""
    n, k = w.shape
    if n * k < PARALLEL_QUANTIZE_ELEMENTS:
        return _quantize_block(w, bits, group_size, symmetric)
    rows = max(1, QUANTIZE_BLOCK_ELEMENTS // k)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        parts = list(pool.map(lambda start: _quantize_block(w[start:start + rows], bits, group_size, symmetric),
                              range(0, n, rows)))
    zeros = [p[2] for p in parts]
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
            None if zeros[0] is None else np.concatenate(zeros))


PARALLEL_QUANTIZE_ELEMENTS = 1 << 22
"""Weights of at least this many elements are quantized on several threads."""

QUANTIZE_BLOCK_ELEMENTS = 1 << 18
"""About how many weights a thread quantizes at a time (whole rows: at least one)."""


def _quantize_block(w: np.ndarray, bits: int, group_size: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray,
                                                                                         np.ndarray | None]:
    n, k = w.shape
    groups = w.astype(np.float64).reshape(n, k // group_size, group_size)
    if symmetric:
        qmax = 127 if bits == 8 else 7
        scale = np.abs(groups).max(axis=-1) / qmax
        scale[scale == 0] = 1.0
        q = np.clip(np.rint(groups / scale[..., None]), -qmax - 1, qmax)
        zero = None
        if bits == 4:
            q = q + 8  # stored unsigned; the op's implicit zero point is 8
    else:
        # the group's own range [min, max] on 2^bits levels, with a float zero point: a weight that already sits on
        # such a grid (a GGUF Q4_1 model's, say) is reproduced exactly
        levels = 255 if bits == 8 else 15
        lo, hi = groups.min(axis=-1), groups.max(axis=-1)
        scale = (hi - lo) / levels
        scale[scale == 0] = 1.0
        zero = -lo / scale - (128 if bits == 8 else 0)  # q in [-128, 127] (int8) or [0, 15] (int4)
        q = np.clip(np.rint(groups / scale[..., None] + zero[..., None]), -128 if bits == 8 else 0,
                    127 if bits == 8 else 15)
    q = q.reshape(n, k)
    if bits == 8:
        return q.astype(np.int8), scale, zero
    q = q.astype(np.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8), scale, zero


WEIGHT_SLOT = {"linear": 1, "embedding": 0, "gathered_linear": 1}
"""The ops whose constant float weight quantization rewrites, and the weight's input slot."""


def quantize_weights(method: Method, builder: ProgramBuilder, config: Quantize | None,
                     known: KnownQuantization | None = None) -> int:
    """Rewrite every linear / embedding with a constant float weight: in its known quantized form where `known`
    has one, else as `config` asks (None: left float); returns how many nodes were rewritten."""
    done: dict[int, tuple[tuple[int, ...], dict] | None] = {}  # weight ref -> (constants, attrs) (tied weights)
    halves: dict[int, int] = {}  # weight ref -> its bf16/fp16 constant's value
    count = 0
    for node in list(method.nodes):  # (bf16/fp16 insert cast nodes)
        slot = WEIGHT_SLOT.get(node.op)
        if slot is None or node.inputs[slot] == NO_VALUE:
            continue
        weight = method.values[node.inputs[slot]]
        rank = 3 if node.op == "gathered_linear" else 2  # (a stack of experts' weights [E, N, K])
        if weight.kind != ValueKind.CONSTANT or not weight.dtype.is_float or len(weight.shape) != rank:
            continue
        if weight.ref not in done:
            done[weight.ref] = _quantized_once(method, builder, node.inputs[slot], config, known)
        if done[weight.ref] is None:
            if config is not None and config.bits == 16 and known is None:
                count += _store_half(method, builder, node, slot, weight, config, halves)
            continue
        parts, attrs = done[weight.ref]
        if node.op == "linear":
            bias = node.inputs[2] if len(node.inputs) > 2 else NO_VALUE
            node.op, node.inputs, node.attrs = "quantized_linear", [node.inputs[0], *parts, bias], dict(attrs)
        elif node.op == "gathered_linear":
            x, _, index, *bias = node.inputs
            node.op, node.inputs, node.attrs = "gathered_quantized_linear", [x, *parts, index, *bias], dict(attrs)
        else:
            node.op, node.inputs, node.attrs = "quantized_embedding", [*parts, node.inputs[1]], dict(attrs)
        count += 1
    return count


def _quantized_once(method: Method, builder: ProgramBuilder, value: int, config: Quantize | None,
                    known: KnownQuantization | None) -> tuple[tuple[int, ...], dict] | None:
    """_quantized_parts, computed once per program (derived_constants): a later method reading the same weight (an
    LLM's decode after its prefill) gets the first one's constants without quantizing or hashing them again."""
    key = ("quantize_weights", method.values[value].ref, config, id(known))
    found = derived_constants(method, builder, key, lambda: _quantized_parts(method, builder, value, config, known))
    return None if found is None else (found[0], dict(found[1]))


def _quantized_parts(method: Method, builder: ProgramBuilder, value: int, config: Quantize | None,
                     known: KnownQuantization | None) -> tuple[tuple[int, ...], dict] | None:
    """The constants (q, scale, zero) and attributes a weight is stored as, or None to leave it as it is. A stack
    of experts' weights [E, N, K] is quantized as its E * N rows, each expert's part of q, scale and zero being
    what its own [N, K] weight would have."""
    weight = method.values[value]
    data = None
    if len(weight.shape) == 3:
        stack = constant_value(method, builder, value)
        rows = stack.reshape(-1, stack.shape[-1])
        if known is not None and (stored := known.lookup(rows)) is not None:
            return _add_parts(method, builder, weight, _per_expert(stored, stack.shape), _known_tag(stored))
        if config is None or config.bits == 16 or (group := config.group_for(weight.shape[-1])) is None:
            return None
        q, scale, zero = quantize_rows(rows, config.bits, group, config.symmetric)
        return _add_parts(method, builder, weight,
                          _per_expert(QuantizedWeight(q, scale, zero, config.bits, group, False, ""), stack.shape),
                          config.mode)
    if known is not None:
        data = constant_value(method, builder, value)
        stored = known.lookup(data)
        if stored is not None:
            return _add_parts(method, builder, weight, stored, _known_tag(stored))
    if config is None or config.bits == 16:
        return None
    group = config.group_for(weight.shape[1])
    if group is None:
        return None
    q, scale, zero = quantize_rows(constant_value(method, builder, value) if data is None else data, config.bits,
                                   group, config.symmetric)
    return _add_parts(method, builder, weight, QuantizedWeight(q, scale, zero, config.bits, group, False, ""),
                      config.mode)


def _per_expert(stored: QuantizedWeight, shape: tuple[int, ...]) -> QuantizedWeight:
    """A stack's quantized rows [E * N, ...] as [E, N, ...] parts, each expert's what its own weight would have."""
    q, scale, zero = (a if a is None else a.reshape(shape[:2] + a.shape[-1:]) for a in (stored.q, stored.scale,
                                                                                         stored.zero))
    return QuantizedWeight(q, scale, zero, stored.bits, stored.group, stored.offset, stored.source)


def _known_tag(stored: QuantizedWeight) -> str:
    """The constant-name tag of a weight kept in its known form ("GGUF Q4_K" -> "gguf_q4_k")."""
    return stored.source.replace(" ", "_").lower()


def _add_parts(method: Method, builder: ProgramBuilder, weight: Value, stored: QuantizedWeight,
               tag: str) -> tuple[tuple[int, ...], dict]:
    name = f"{weight.name}.{tag}"
    parts = (add_constant(method, builder, stored.q, DType.from_numpy(stored.q.dtype), f"{name}.q"),
             add_constant(method, builder, stored.scale, weight.dtype, f"{name}.scale"),
             NO_VALUE if stored.zero is None else add_constant(method, builder, stored.zero, weight.dtype,
                                                               f"{name}.zero"))
    attrs = {"bits": stored.bits, "group_size": stored.group}
    if stored.offset:
        attrs["offset"] = True
    return parts, attrs


def _store_half(method: Method, builder: ProgramBuilder, node: Node, slot: int, weight: Value, config: Quantize,
                halves: dict[int, int]) -> int:
    """Store the weight in bf16/fp16 and cast it back to its dtype in front of the node."""
    half = DType.bfloat16 if config.mode == "bf16" else DType.float16
    if weight.dtype == half:
        return 0
    stored = halves.get(weight.ref)
    if stored is None:
        stored = halves[weight.ref] = derived_constant(
            method, builder, ("store_half", weight.ref, half),
            lambda: (constant_value(method, builder, node.inputs[slot]).astype(np.float64), half,
                     f"{weight.name}.{config.mode}"))
    method.values.append(Value(f"{weight.name}.{config.mode}.cast", weight.dtype, weight.shape))
    cast = Node("cast", [stored], [len(method.values) - 1], {"dtype": weight.dtype}, source=node.source)
    method.nodes.insert(method.nodes.index(node), cast)
    node.inputs[slot] = cast.outputs[0]
    return 1
