"""RMSNorm written out by hand (transformers' LlamaRMSNorm and its many copies) becomes one `rms_norm` node.

The pattern, in Core ATen after lowering:

    xf = cast(x, float32)?            the upcast, absent when x is already float32
    r  = rsqrt(mean(pow(xf, 2) | mul(xf, xf), dims=[last], keepdim) + eps)
    y  = mul(xf, r)
    out = cast?(mul?(cast?(y), weight))   weight a constant [D] (Gemma's 1 + weight is folded by then)

Six to eight nodes and five passes over the activations become one. The pattern is checked node by node and
declines (logging why at debug level) when an intermediate is read elsewhere, the reduction is not over the last
dim, the exponent is not 2, or the result's dtype is not x's.
"""

from __future__ import annotations

import logging

import numpy as np

from kiln.export.builder import ProgramBuilder
from kiln.export.passes.usage import Usage, add_constant, constant_value
from kiln.ir.dtypes import DType
from kiln.ir.graph import NO_VALUE, Method, Node

log = logging.getLogger("kiln.passes")


def _scalar(method: Method, builder: ProgramBuilder, v: int) -> float | None:
    data = constant_value(method, builder, v)
    return float(data) if data is not None and data.size == 1 else None


def _other(node: Node, v: int) -> int:
    """The other input of a two-input node that reads `v`."""
    a, b = node.inputs[:2]
    return b if a == v else a


def fuse_rms_norm(method: Method, builder: ProgramBuilder) -> int:
    """Rewrite each matched RMSNorm in place into one rms_norm node; returns how many."""
    usage = Usage.of(method)
    count = 0
    for rsqrt in [n for n in method.nodes if n.op == "rsqrt"]:
        match = _match(method, builder, usage, rsqrt)
        if match is None:
            continue
        x, weight, eps, last = match
        if weight != NO_VALUE and method.values[weight].dtype != method.values[x].dtype:
            data = constant_value(method, builder, weight).astype(np.float64)
            weight = add_constant(method, builder, data, method.values[x].dtype,
                                  f"{method.values[weight].name}.as_{method.values[x].dtype.name}")
        last.op, last.inputs, last.attrs = "rms_norm", [x, weight], {"axes": 1, "eps": eps}
        count += 1
    return count


def _match(method: Method, builder: ProgramBuilder, usage: Usage, rsqrt: Node):
    """(x, weight or NO_VALUE, eps, the node whose output is the norm's result) or None."""
    add = usage.producer_of(rsqrt.inputs[0], "add")
    mean = add and (usage.producer_of(add.inputs[0], "mean") or usage.producer_of(add.inputs[1], "mean"))
    if mean is None:
        return None
    eps = _scalar(method, builder, _other(add, mean.outputs[0]))
    square = usage.producer.get(mean.inputs[0])
    if eps is None or square is None:
        return None
    xf = square.inputs[0]
    if square.op == "pow":
        if _scalar(method, builder, square.inputs[1]) != 2.0:
            return None
    elif not (square.op == "mul" and square.inputs[0] == square.inputs[1]):
        return None
    shape = method.values[xf].shape
    if tuple(mean.attrs.get("dims", ())) != (len(shape) - 1,) or not mean.attrs.get("keepdim", False):
        log.debug("rms_norm: mean over %s (keepdim %s) is not over the last dim", mean.attrs.get("dims"),
                  mean.attrs.get("keepdim"))
        return None
    if any(usage.sole_reader(v, op) is None for v, op in ((square.outputs[0], "mean"), (mean.outputs[0], "add"),
                                                    (add.outputs[0], "rsqrt"))):
        log.debug("rms_norm: an intermediate of the norm at %s is read elsewhere", rsqrt.source)
        return None
    scale = usage.sole_reader(rsqrt.outputs[0], "mul")
    if scale is None or _other(scale, rsqrt.outputs[0]) != xf:
        return None
    upcast = usage.producer_of(xf, "cast")
    x = upcast.inputs[0] if upcast is not None and method.values[xf].dtype == DType.float32 else xf
    last, weight = scale, NO_VALUE
    for op in ("cast", "mul", "cast"):
        follower = usage.sole_reader(last.outputs[0], op)
        if follower is None:
            continue
        if op == "mul":
            w = _other(follower, last.outputs[0])
            if constant_value(method, builder, w) is None or method.values[w].shape != (shape[-1],):
                break
            weight = w
        last = follower
    if method.values[last.outputs[0]].dtype != method.values[x].dtype and method.values[xf].dtype == \
            method.values[last.outputs[0]].dtype:
        x = xf  # upcast but no downcast: the norm runs on the float32 value
    if method.values[last.outputs[0]].dtype != method.values[x].dtype:
        log.debug("rms_norm at %s: result dtype %s is not the input's %s", rsqrt.source,
                  method.values[last.outputs[0]].dtype.name, method.values[x].dtype.name)
        return None
    return x, weight, eps, last
