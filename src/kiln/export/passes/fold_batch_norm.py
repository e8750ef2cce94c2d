"""Fold an inference batch norm into the convolution that feeds it.

conv(x, W, b) followed by batch_norm(mean, var, gamma, beta, eps) equals conv(x, W * s, (b - mean) * s + beta) with
s = gamma / sqrt(var + eps) per output channel. The batch norm then costs nothing at run time: on MobileNetV3 and
EfficientNet-lite0 it was about a tenth of the CPU time. The new weights are computed in float64 and rounded once
to the weight dtype, so results differ from eager only by that rounding.
"""

from __future__ import annotations

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import Usage, add_constant, is_constant
from kiln.ir.graph import NO_VALUE, Method, Node, Value


def fold_batch_norm(method: Method, builder: ProgramBuilder) -> int:
    """Rewrite every foldable conv -> batch_norm pair in place; returns how many were folded."""
    usage = Usage.of(method)
    folded: set[int] = set()
    for bn in method.nodes:
        if bn.op != "batch_norm":
            continue
        conv = usage.producer.get(bn.inputs[0])
        if not _foldable(method, conv, bn, usage):
            continue
        _fold(method, builder, conv, bn)
        folded.add(id(bn))
    method.nodes = [n for n in method.nodes if id(n) not in folded]
    return len(folded)


def _foldable(method: Method, conv: Node | None, bn: Node, usage: Usage) -> bool:
    if conv is None or conv.op != "conv" or conv.attrs.get("transposed", False):
        return False
    if conv.attrs.get("activation", "none") != "none" or not usage.only_reader_may_absorb(conv.outputs[0]):
        return False  # someone else reads the un-normalized conv output
    weight = conv.inputs[1]
    bias = conv.inputs[2] if len(conv.inputs) > 2 else NO_VALUE
    if weight == NO_VALUE or not all(is_constant(method, v) for v in (weight, bias, *bn.inputs[1:])):
        return False
    return method.values[weight].dtype.is_float


def _array(method: Method, builder: ProgramBuilder, v: int) -> np.ndarray | None:
    return None if v == NO_VALUE else builder.constant_array(method.values[v].ref).astype(np.float64)


def _add_constant(method: Method, builder: ProgramBuilder, data: np.ndarray, like: Value, name: str) -> int:
    """A new constant value of `like`'s dtype, rounded once from the float64 result."""
    return add_constant(method, builder, np.asarray(data, dtype=np.float64), like.dtype, name)


def _fold(method: Method, builder: ProgramBuilder, conv: Node, bn: Node) -> None:
    weight_v = conv.inputs[1]
    bias_v = conv.inputs[2] if len(conv.inputs) > 2 else NO_VALUE
    gamma_v, beta_v, mean_v, var_v = bn.inputs[1:5]
    weight = _array(method, builder, weight_v)
    out_channels = weight.shape[0]
    mean, var = _array(method, builder, mean_v), _array(method, builder, var_v)
    gamma = _array(method, builder, gamma_v)
    beta = _array(method, builder, beta_v)
    bias = _array(method, builder, bias_v)
    scale = (np.ones(out_channels) if gamma is None else gamma) / np.sqrt(var + bn.attrs.get("eps", 1e-5))
    new_weight = weight * scale.reshape((-1,) + (1,) * (weight.ndim - 1))
    new_bias = ((np.zeros(out_channels) if bias is None else bias) - mean) * scale
    if beta is not None:
        new_bias = new_bias + beta
    w_value = method.values[weight_v]
    name = w_value.name
    new_w = _add_constant(method, builder, new_weight, w_value, f"{name}.bn_folded")
    new_b = _add_constant(method, builder, new_bias, w_value, f"{name}.bn_folded_bias")
    conv.inputs = [conv.inputs[0], new_w, new_b]
    conv.outputs = list(bn.outputs)
