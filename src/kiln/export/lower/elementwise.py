"""Lowering of elementwise ATen ops: unary, binary with PyTorch type promotion, comparisons, where, casts."""

from __future__ import annotations

import operator

import torch

from kiln.export.lower.registry import LowerContext, Unsupported, fake, kiln_dtype, lowering
from kiln.ir.dtypes import DType

aten = torch.ops.aten

UNARY = {
    aten.neg.default: "neg", aten.abs.default: "abs", aten.exp.default: "exp", aten.log.default: "log",
    aten.sqrt.default: "sqrt", aten.rsqrt.default: "rsqrt", aten.reciprocal.default: "reciprocal",
    aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh", aten.relu.default: "relu", aten.erf.default: "erf",
    aten.sin.default: "sin", aten.cos.default: "cos", aten.floor.default: "floor", aten.ceil.default: "ceil",
    aten.round.default: "round", aten.sign.default: "sign", aten.silu.default: "silu",
    aten.hardswish.default: "hardswish", aten.hardsigmoid.default: "hardsigmoid", aten.log1p.default: "log1p",
    aten.expm1.default: "expm1", aten.trunc.default: "trunc",
}
BOOL_UNARY = {aten.logical_not.default: "logical_not", aten.isnan.default: "isnan"}


def _unary(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    x = ctx.value(node.args[0], dtype)
    return ctx.emit(UNARY[node.target], [x], (dtype, shape))


def _bool_unary(ctx: LowerContext, node: torch.fx.Node) -> int:
    x = ctx.value(node.args[0])
    if node.target == aten.logical_not.default:
        x = ctx.cast(x, DType.bool)
    return ctx.emit(BOOL_UNARY[node.target], [x], ctx.meta(node))


lowering(*UNARY)(_unary)
lowering(*BOOL_UNARY)(_bool_unary)


@lowering(aten.bitwise_not.default)
def bitwise_not(ctx: LowerContext, node: torch.fx.Node) -> int:
    return ctx.emit("bitwise_not", [ctx.value(node.args[0])], ctx.meta(node))


@lowering(aten.gelu.default)
def gelu(ctx: LowerContext, node: torch.fx.Node) -> int:
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return ctx.emit("gelu", [ctx.value(node.args[0])], ctx.meta(node), approximate=approximate)


@lowering(aten.leaky_relu.default)
def leaky_relu(ctx: LowerContext, node: torch.fx.Node) -> int:
    slope = node.args[1] if len(node.args) > 1 else node.kwargs.get("negative_slope", 0.01)
    return ctx.emit("leaky_relu", [ctx.value(node.args[0])], ctx.meta(node), negative_slope=float(slope))


@lowering(aten.clamp.default, aten.hardtanh.default)
def clamp(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    x = ctx.value(node.args[0], dtype)
    default = (None, None) if node.target == aten.clamp.default else (-1.0, 1.0)
    lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min", default[0])
    hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max", default[1])
    for bound in (lo, hi):
        if bound is not None and not isinstance(bound, (int, float)):
            raise Unsupported("clamp bounds must be numbers")
    return ctx.emit("clamp", [x], (dtype, shape), min=None if lo is None else float(lo),
                    max=None if hi is None else float(hi))


@lowering(aten.clamp.Tensor)
def clamp_tensor(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    out = ctx.value(node.args[0], dtype)
    lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if lo is not None:
        out = ctx.emit("maximum", [out, ctx.value(lo, dtype)], (dtype, shape))
    if hi is not None:
        out = ctx.emit("minimum", [out, ctx.value(hi, dtype)], (dtype, shape))
    return out


ARITHMETIC = {
    aten.add.Tensor: "add", aten.add.Scalar: "add", aten.sub.Tensor: "sub", aten.sub.Scalar: "sub",
    aten.rsub.Scalar: "sub", aten.mul.Tensor: "mul", aten.mul.Scalar: "mul", aten.div.Tensor: "div",
    aten.div.Scalar: "div", aten.pow.Tensor_Tensor: "pow", aten.pow.Tensor_Scalar: "pow", aten.pow.Scalar: "pow",
    aten.maximum.default: "maximum", aten.minimum.default: "minimum", aten.remainder.Tensor: "remainder",
    aten.remainder.Scalar: "remainder", aten.fmod.Tensor: "fmod", aten.fmod.Scalar: "fmod",
    aten.bitwise_and.Tensor: "bitwise_and", aten.bitwise_and.Scalar: "bitwise_and",
    aten.bitwise_or.Tensor: "bitwise_or", aten.bitwise_or.Scalar: "bitwise_or",
    aten.bitwise_xor.Tensor: "bitwise_xor", aten.bitwise_xor.Scalar: "bitwise_xor", aten.atan2.default: "atan2",
    aten.div.Tensor_mode: "div",
}


@lowering(*ARITHMETIC)
def arithmetic(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Binary arithmetic: inputs cast to the result dtype (PyTorch's promotion), then one kiln op."""
    dtype, shape = ctx.meta(node)
    a, b = node.args[0], node.args[1]
    if node.target == aten.rsub.Scalar:
        a, b = b, a
    va, vb = ctx.value(a, dtype), ctx.value(b, dtype)
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 and node.target != aten.div.Tensor_mode
                            else 1)
    if alpha != 1:
        vb = ctx.emit("mul", [vb, ctx.scalar(alpha, dtype)], (dtype, ctx.shape(vb)))
    attrs = {}
    if node.target == aten.div.Tensor_mode:
        mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
        attrs["rounding_mode"] = mode or "none"
    return ctx.emit(ARITHMETIC[node.target], [va, vb], (dtype, shape), **attrs)


COMPARE = {}
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    for _overload in ("Tensor", "Scalar"):
        COMPARE[getattr(getattr(aten, _name), _overload)] = _name


@lowering(*COMPARE)
def compare(ctx: LowerContext, node: torch.fx.Node) -> int:
    compute = kiln_dtype(torch.result_type(fake(node.args[0]), fake(node.args[1])))
    a, b = ctx.value(node.args[0], compute), ctx.value(node.args[1], compute)
    return ctx.emit(COMPARE[node.target], [a, b], ctx.meta(node))


LOGICAL = {aten.logical_and.default: "logical_and", aten.logical_or.default: "logical_or",
           aten.logical_xor.default: "logical_xor"}


@lowering(*LOGICAL)
def logical(ctx: LowerContext, node: torch.fx.Node) -> int:
    a, b = ctx.value(node.args[0], DType.bool), ctx.value(node.args[1], DType.bool)
    return ctx.emit(LOGICAL[node.target], [a, b], ctx.meta(node))


@lowering(aten.where.self)
def where(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    cond = ctx.value(node.args[0], DType.bool)
    return ctx.emit("where", [cond, ctx.value(node.args[1], dtype), ctx.value(node.args[2], dtype)], (dtype, shape))


@lowering(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout)
def to_copy(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, _ = ctx.meta(node)
    return ctx.cast(ctx.value(node.args[0]), dtype)


@lowering(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default, aten.detach.default,
          aten.contiguous.default)
def alias(ctx: LowerContext, node: torch.fx.Node) -> int:
    """Functional graphs never write in place, so a clone or alias is the same value."""
    return ctx.value(node.args[0])


@lowering(aten.copy.default)
def copy(ctx: LowerContext, node: torch.fx.Node) -> int:
    """copy(dst, src): src broadcast to dst's shape and cast to its dtype."""
    dtype, shape = ctx.meta(node)
    src = ctx.value(node.args[1], dtype)
    if tuple(ctx.shape(src)) == tuple(shape):
        return src
    return ctx.emit("expand", [src], (dtype, shape), shape=shape)


@lowering(operator.getitem)
def getitem(ctx: LowerContext, node: torch.fx.Node) -> int:
    parts = ctx.env.get(node.args[0])
    if not isinstance(parts, (list, tuple)):
        raise Unsupported("getitem on a value that is not a tuple of tensors")
    v = parts[node.args[1]]
    if v is None:
        raise Unsupported(f"output {node.args[1]} of {node.args[0].target} is not supported (only its result)")
    return v


# ---- math functions (A1) ----
MATH = {aten.acos.default: "acos", aten.asin.default: "asin", aten.atan.default: "atan", aten.acosh.default: "acosh",
        aten.asinh.default: "asinh", aten.atanh.default: "atanh", aten.cosh.default: "cosh", aten.sinh.default: "sinh",
        aten.tan.default: "tan", aten.log10.default: "log10", aten.log2.default: "log2", aten.exp2.default: "exp2",
        aten.erfinv.default: "erfinv", aten.erfc.default: "erfc"}
UNARY.update(MATH)
lowering(*MATH)(_unary)


@lowering(aten.isinf.default)
def isinf(ctx: LowerContext, node: torch.fx.Node) -> int:
    return ctx.emit("isinf", [ctx.value(node.args[0])], ctx.meta(node))


@lowering(aten.elu.default)
def elu(ctx: LowerContext, node: torch.fx.Node) -> int:
    alpha, scale, input_scale = (node.kwargs.get(k, node.args[i] if len(node.args) > i else 1.0)
                                 for i, k in enumerate(("alpha", "scale", "input_scale"), start=1))
    return ctx.emit("elu", [ctx.value(node.args[0])], ctx.meta(node), alpha=float(alpha), scale=float(scale),
                    input_scale=float(input_scale))


@lowering(aten.div.Scalar_mode)
def div_scalar_mode(ctx: LowerContext, node: torch.fx.Node) -> int:
    dtype, shape = ctx.meta(node)
    mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
    return ctx.emit("div", [ctx.value(node.args[0], dtype), ctx.value(node.args[1], dtype)], (dtype, shape),
                    rounding_mode=mode or "none")


def _binary_inputs(ctx: LowerContext, node: torch.fx.Node) -> tuple[int, int, DType, tuple]:
    dtype, shape = ctx.meta(node)
    return ctx.value(node.args[0], dtype), ctx.value(node.args[1], dtype), dtype, shape


@lowering(aten.fmax.default, aten.fmin.default)
def fmax_fmin(ctx: LowerContext, node: torch.fx.Node) -> int:
    """max/min that ignore a NaN operand: NaN only when both are NaN."""
    a, b, dtype, shape = _binary_inputs(ctx, node)
    op = "maximum" if node.target == aten.fmax.default else "minimum"
    both = ctx.emit(op, [a, b], (dtype, shape))
    if not dtype.is_float:
        return both
    a_nan = ctx.emit("isnan", [a], (DType.bool, ctx.shape(a)))
    b_nan = ctx.emit("isnan", [b], (DType.bool, ctx.shape(b)))
    out = ctx.emit("where", [a_nan, b, both], (dtype, shape))
    return ctx.emit("where", [b_nan, a, out], (dtype, shape))


@lowering(aten.hypot.default)
def hypot(ctx: LowerContext, node: torch.fx.Node) -> int:
    """sqrt(a^2 + b^2) as big * sqrt(1 + (small / big)^2), so squares of large values do not overflow."""
    a, b, dtype, shape = _binary_inputs(ctx, node)
    abs_a = ctx.emit("abs", [a], (dtype, ctx.shape(a)))
    abs_b = ctx.emit("abs", [b], (dtype, ctx.shape(b)))
    big = ctx.emit("maximum", [abs_a, abs_b], (dtype, shape))
    small = ctx.emit("minimum", [abs_a, abs_b], (dtype, shape))
    zero = ctx.scalar(0.0, dtype)
    is_zero = ctx.emit("eq", [big, zero], (DType.bool, shape))
    ratio = ctx.emit("div", [small, ctx.emit("where", [is_zero, ctx.scalar(1.0, dtype), big], (dtype, shape))],
                     (dtype, shape))
    root = ctx.emit("sqrt", [ctx.emit("add", [ctx.scalar(1.0, dtype), ctx.emit("mul", [ratio, ratio], (dtype, shape))],
                                      (dtype, shape))], (dtype, shape))
    out = ctx.emit("mul", [big, root], (dtype, shape))
    is_inf = ctx.emit("isinf", [big], (DType.bool, shape))  # hypot(inf, nan) is inf
    return ctx.emit("where", [is_inf, big, out], (dtype, shape))


@lowering(aten.copysign.Tensor, aten.copysign.Scalar)
def copysign(ctx: LowerContext, node: torch.fx.Node) -> int:
    """|a| with the sign of b, -0.0 included (1/b is -inf); the sign bit of a NaN b is not read (taken as +)."""
    a, b, dtype, shape = _binary_inputs(ctx, node)
    zero = ctx.scalar(0.0, dtype)
    negative = ctx.emit("lt", [b, zero], (DType.bool, ctx.shape(b)))
    b_zero = ctx.emit("eq", [b, zero], (DType.bool, ctx.shape(b)))
    neg_zero = ctx.emit("logical_and", [b_zero, ctx.emit("lt", [ctx.emit("reciprocal", [b], (dtype, ctx.shape(b))),
                                                                zero], (DType.bool, ctx.shape(b)))],
                        (DType.bool, ctx.shape(b)))
    sign_bit = ctx.emit("logical_or", [negative, neg_zero], (DType.bool, ctx.shape(b)))
    magnitude = ctx.emit("abs", [a], (dtype, ctx.shape(a)))
    return ctx.emit("where", [sign_bit, ctx.emit("neg", [magnitude], (dtype, ctx.shape(a))), magnitude],
                    (dtype, shape))
