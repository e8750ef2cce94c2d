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

from dataclasses import dataclass

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import add_constant, constant_value
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Method, Node, Value, ValueKind

MODES = ("int8", "int4", "bf16", "fp16")


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
    """(q, scale, zero or None) for a float weight [N, K], in the op set's layout; scale/zero in float64."""
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


def quantize_weights(method: Method, builder: ProgramBuilder, config: Quantize) -> int:
    """Rewrite every linear / embedding with a constant float weight; returns how many nodes were rewritten."""
    done: dict[int, tuple[int, ...]] = {}  # weight constant ref -> its quantized constants' values (tied weights)
    count = 0
    for node in list(method.nodes):  # (bf16/fp16 insert cast nodes)
        slot = {"linear": 1, "embedding": 0}.get(node.op)
        if slot is None or node.inputs[slot] == NO_VALUE:
            continue
        weight = method.values[node.inputs[slot]]
        if weight.kind != ValueKind.CONSTANT or not weight.dtype.is_float or len(weight.shape) != 2:
            continue
        if config.bits == 16:
            count += _store_half(method, builder, node, slot, weight, config, done)
            continue
        group = config.group_for(weight.shape[1])
        if group is None:
            continue
        parts = done.get(weight.ref)
        if parts is None:
            q, scale, zero = quantize_rows(constant_value(method, builder, node.inputs[slot]), config.bits, group,
                                           config.symmetric)
            tag = f"{weight.name}.{config.mode}"
            parts = done[weight.ref] = (
                add_constant(method, builder, q, DType.from_numpy(q.dtype), f"{tag}.q"),
                add_constant(method, builder, scale, weight.dtype, f"{tag}.scale"),
                NO_VALUE if zero is None else add_constant(method, builder, zero, weight.dtype, f"{tag}.zero"))
        attrs = {"bits": config.bits, "group_size": group}
        if node.op == "linear":
            bias = node.inputs[2] if len(node.inputs) > 2 else NO_VALUE
            node.op, node.inputs, node.attrs = "quantized_linear", [node.inputs[0], *parts, bias], attrs
        else:
            node.op, node.inputs, node.attrs = "quantized_embedding", [*parts, node.inputs[1]], attrs
        count += 1
    return count


def _store_half(method: Method, builder: ProgramBuilder, node: Node, slot: int, weight: Value, config: Quantize,
                done: dict) -> int:
    """Store the weight in bf16/fp16 and cast it back to its dtype in front of the node."""
    half = DType.bfloat16 if config.mode == "bf16" else DType.float16
    if weight.dtype == half:
        return 0
    stored = done.get(weight.ref)
    if stored is None:
        data = constant_value(method, builder, node.inputs[slot]).astype(np.float64)
        stored = done[weight.ref] = add_constant(method, builder, data, half, f"{weight.name}.{config.mode}")
    method.values.append(Value(f"{weight.name}.{config.mode}.cast", weight.dtype, weight.shape))
    cast = Node("cast", [stored], [len(method.values) - 1], {"dtype": weight.dtype}, source=node.source)
    method.nodes.insert(method.nodes.index(node), cast)
    node.inputs[slot] = cast.outputs[0]
    return 1
