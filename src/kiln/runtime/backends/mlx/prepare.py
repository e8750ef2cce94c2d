"""Plan-time specializations of the MLX backend (Backend.prepare): a node whose constants MLX has a better format
for, or whose inputs come from a pattern that maps onto one of MLX's fused primitives, gets a kernel made for it
when a session plans its method. Conversions happen once per program (constants.ProgramArrays.derived).

- quantized_linear / quantized_embedding with constant weights: kiln's int8/int4 groups become MLX's affine
  quantized format (quantized.py), run by mx.quantized_matmul and mx.dequantize of the gathered rows; a constant
  expert stack of gathered_quantized_linear likewise, run by mx.gather_qmm.
- rope / rope_cache_update whose cos and sin are rows of rotary tables gathered at positions: mx.fast.rope at
  those positions with the tables' frequencies (rope.py), when the tables are cos and sin of position times a
  frequency per pair.
- conv with a constant weight: the weight moved to MLX's channels-last layout once.
- sdpa with a mask computed from the inputs: attention over the keys the plan's hint says some query sees
  (visible.py).
"""

from __future__ import annotations

from typing import Any

from kiln.ir.graph import Method, Node
from kiln.runtime.backends.base import Prepared, PreparerRegistry, absent, constant_ref
from kiln.runtime.backends.mlx.constants import ProgramArrays

PREPARERS = PreparerRegistry("mlx")
preparer = PREPARERS.register
prepare = PREPARERS.prepare


def producers(arrays: ProgramArrays, method: Method) -> dict[int, Node]:
    """The node that computes each value of the method."""
    def make() -> dict[int, Node]:
        return {out: node for node in method.nodes for out in node.outputs}
    return arrays.derived(("producers", method.name, id(method)), make, evaluate=False)


@preparer("conv")
def conv(arrays: ProgramArrays, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    """A constant weight moved to MLX's channels-last layout once, not at every run."""
    from kiln.runtime.backends.mlx.kernels.conv import conv_with, weight_channels_last

    ref = constant_ref(method, node, 1)
    if ref is None:
        return None
    groups, transposed = int(node.attrs.get("groups", 1)), bool(node.attrs.get("transposed", False))
    weight: Any = arrays.derived(("conv", ref, groups, transposed),
                                 lambda: weight_channels_last(arrays.array(ref), groups, transposed))
    return conv_with(weight), tuple(node.inputs)


@preparer("quantized_linear", "quantized_embedding")
def quantized(arrays: ProgramArrays, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    from kiln.runtime.backends.mlx import quantized as formats

    weight = _mlx_weight(arrays, method, node, 1 if node.op == "quantized_linear" else 0)
    if weight is None:
        return None
    kernel = formats.linear_kernel(weight) if node.op == "quantized_linear" else formats.embedding_kernel(weight)
    return kernel, tuple(node.inputs)


@preparer("gathered_quantized_linear")
def gathered_quantized(arrays: ProgramArrays, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    """A constant expert stack converted once and read quantized by mx.gather_qmm."""
    from kiln.runtime.backends.mlx import quantized as formats

    weight = _mlx_weight(arrays, method, node, 1)
    return None if weight is None else (formats.gathered_kernel(weight), tuple(node.inputs))


@preparer("gated_quantized_linear", "add_rms_norm_quantized_linear")
def fused_quantized_linear(arrays: ProgramArrays, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    """The fused forms run their composition with the converted weight's quantized_matmul."""
    from kiln.runtime.backends import composite
    from kiln.runtime.backends.mlx import quantized as formats
    from kiln.runtime.backends.mlx.kernels import MLX_KERNELS

    weight = _mlx_weight(arrays, method, node, 1 if node.op == "gated_quantized_linear" else 3)
    if weight is None:
        return None
    kernels = {**MLX_KERNELS.kernels, "quantized_linear": formats.linear_kernel(weight)}
    return composite.bind(composite.COMPOSITES[node.op], kernels), tuple(node.inputs)


def _mlx_weight(arrays: ProgramArrays, method: Method, node: Node, first: int) -> Any:
    """The node's quantized weight (q at input `first`, then scale and zero, all constants) in MLX's format, once
    per program; None where it is not constants or MLX has no such format."""
    from kiln.runtime.backends.mlx import quantized as formats

    q, scale, zero = (constant_ref(method, node, first + i) for i in range(3))
    if q is None or scale is None or (zero is None and not absent(node, first + 2)):
        return None
    bits, group_size = int(node.attrs["bits"]), int(node.attrs["group_size"])
    offset = bool(node.attrs.get("offset", False))
    return arrays.derived(("quantized", q, scale, zero, bits, group_size, offset),
                          lambda: formats.to_mlx_format(arrays.program, q, scale, zero, bits, group_size, offset))


@preparer("rope", "rope_cache_update", "norm_rope_cache_update")
def rope(arrays: ProgramArrays, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    """The positions the cos and sin rows were gathered at become an extra input of the node."""
    from kiln.runtime.backends.mlx import rope as fast

    cos_at = 1 if node.op == "rope" else 3
    source = fast.table_source(arrays, method, producers(arrays, method), node.inputs[cos_at],
                               node.inputs[cos_at + 1], bool(node.attrs.get("interleaved", False)))
    if source is None:
        return None
    positions, freqs = source
    if node.op == "norm_rope_cache_update":  # the q/k norms, then the fast step (positions ride with the indices)
        from kiln.runtime.backends import composite
        from kiln.runtime.backends.mlx.kernels import MLX_KERNELS

        kernels = {**MLX_KERNELS.kernels, "rope_cache_update": fast.rope_cache_update_kernel(freqs)}
        return composite.bind(composite.norm_rope_cache_update, kernels), tuple(node.inputs) + (positions,)
    kernel = fast.rope_kernel(freqs) if node.op == "rope" else fast.rope_cache_update_kernel(freqs)
    return kernel, tuple(node.inputs) + (positions,)


@preparer("sdpa")
def sdpa(arrays: ProgramArrays, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    from kiln.runtime.backends.mlx import visible

    kernel = visible.sdpa_for(node, env)
    return None if kernel is None else (kernel, tuple(node.inputs))


@preparer("slot_attention")
def slot_attention(arrays: ProgramArrays, method: Method, node: Node, env: dict[str, int]) -> Prepared | None:
    from kiln.runtime.backends.mlx import visible

    kernel = visible.slot_attention_for(node, env)
    return None if kernel is None else (kernel, tuple(node.inputs))
