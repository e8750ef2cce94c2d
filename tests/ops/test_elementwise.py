"""Elementwise ops: unary, binary with broadcasting and type promotion, comparisons, where, clamp, casts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.harness import Case, In, check

FLOATS = (torch.float32, torch.float16, torch.bfloat16)

UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "relu": torch.relu, "erf": torch.erf, "sin": torch.sin, "cos": torch.cos, "floor": torch.floor,
    "ceil": torch.ceil, "round": torch.round, "sign": torch.sign, "silu": F.silu, "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "expm1": torch.expm1, "trunc": torch.trunc, "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "relu6": F.relu6, "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.5), "elu_free_square": lambda x: x * x,
}
POSITIVE = {"log": torch.log, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal,
            "log1p": torch.log1p}

CASES: list[Case] = []
for name, fn in UNARY.items():
    for dt in FLOATS:
        CASES.append(Case(f"{name}_{str(dt)[6:]}", fn, (In((3, 5), dt),)))
    CASES.append(Case(f"{name}_noncontig", fn, (In((4, 6), noncontiguous=True),)))
for name, fn in POSITIVE.items():
    for dt in FLOATS:
        CASES.append(Case(f"{name}_{str(dt)[6:]}", fn, (In((3, 5), dt, "positive"),)))
for name in ("abs", "neg", "sign"):
    CASES.append(Case(f"{name}_int", UNARY[name], (In((7,), torch.int64, "int"),)))
CASES += [
    Case("abs_special", torch.abs, (In((8,), fill="special"),)),
    Case("exp_special", torch.exp, (In((8,), fill="special"),)),
    Case("sigmoid_special", torch.sigmoid, (In((8,), fill="special"),)),
    Case("relu_0d", torch.relu, (In(()),)),
    Case("exp_empty", torch.exp, (In((0, 3)),)),
    Case("isnan", torch.isnan, (In((8,), fill="special"),)),
    Case("logical_not", torch.logical_not, (In((5,), torch.bool, "bool"),)),
    Case("logical_not_float", torch.logical_not, (In((5,)),)),
    Case("bitwise_not_int", torch.bitwise_not, (In((5,), torch.int32, "int"),)),
    Case("exp_int_promotes", torch.exp, (In((5,), torch.int64, "int"),)),
]

BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
          "minimum": torch.minimum, "atan2": torch.atan2, "add_alpha": lambda a, b: torch.add(a, b, alpha=2.5),
          "sub_alpha": lambda a, b: torch.sub(a, b, alpha=0.5)}
for name, fn in BINARY.items():
    for dt in FLOATS:
        CASES.append(Case(f"{name}_{str(dt)[6:]}", fn, (In((4, 5), dt), In((4, 5), dt))))
    CASES.append(Case(f"{name}_broadcast", fn, (In((2, 1, 5)), In((3, 1)))))
    CASES.append(Case(f"{name}_noncontig", fn, (In((4, 6), noncontiguous=True), In((4, 6)))))
CASES += [
    Case("add_scalar", lambda a: a + 1.5, (In((3, 4)),)),
    Case("rsub_scalar", lambda a: 2 - a, (In((3, 4)),)),
    Case("mul_int_float_promote", lambda a, b: a * b, (In((4,), torch.int64, "int"), In((4,)))),
    Case("add_int32_int64", lambda a, b: a + b, (In((4,), torch.int32, "int"), In((4,), torch.int64, "int"))),
    Case("add_f16_f32", lambda a, b: a + b, (In((4,), torch.float16), In((4,)))),
    Case("add_bool_int", lambda a, b: a + b, (In((4,), torch.bool, "bool"), In((4,), torch.int64, "int"))),
    Case("int_mul_float_scalar", lambda a: a * 0.5, (In((4,), torch.int64, "int"),)),
    Case("div_int_true", lambda a, b: a / b, (In((6,), torch.int64, "int"), In((6,), torch.int64, "index:5"))),
    Case("div_floor_float", lambda a, b: torch.div(a, b, rounding_mode="floor"), (In((6,)), In((6,), fill="positive"))),
    Case("div_trunc_float", lambda a, b: torch.div(a, b, rounding_mode="trunc"), (In((6,)), In((6,), fill="positive"))),
    Case("floordiv_int", lambda a: torch.div(a, 3, rounding_mode="floor"), (In((9,), torch.int64, "int"),)),
    Case("truncdiv_int", lambda a: torch.div(a, 3, rounding_mode="trunc"), (In((9,), torch.int64, "int"),)),
    Case("remainder_int", lambda a: torch.remainder(a, 3), (In((9,), torch.int64, "int"),)),
    Case("remainder_float", lambda a, b: torch.remainder(a, b), (In((9,)), In((9,), fill="positive"))),
    Case("fmod_float", lambda a, b: torch.fmod(a, b), (In((9,)), In((9,), fill="positive"))),
    Case("pow_scalar", lambda a: a ** 2, (In((5,)),)),
    Case("pow_tensor", lambda a, b: a ** b, (In((5,), fill="positive"), In((5,)))),
    Case("pow_scalar_base", lambda a: 2.0 ** a, (In((5,)),)),
    Case("bitwise_and", torch.bitwise_and, (In((6,), torch.int32, "int"), In((6,), torch.int32, "int"))),
    Case("bitwise_or_bool", torch.bitwise_or, (In((6,), torch.bool, "bool"), In((6,), torch.bool, "bool"))),
    Case("bitwise_xor", torch.bitwise_xor, (In((6,), torch.int64, "int"), In((6,), torch.int64, "int"))),
    Case("logical_and", torch.logical_and, (In((6,)), In((6,), torch.bool, "bool"))),
    Case("logical_or", torch.logical_or, (In((6,), torch.bool, "bool"), In((6,), torch.bool, "bool"))),
    Case("logical_xor", torch.logical_xor, (In((6,), torch.int64, "int"), In((6,), torch.bool, "bool"))),
    Case("maximum_nan", torch.maximum, (In((8,), fill="special"), In((8,)))),
    Case("add_0d", torch.add, (In(()), In((3,)))),
    Case("mul_empty", torch.mul, (In((0, 4)), In((4,)))),
]
for op in ("eq", "ne", "lt", "le", "gt", "ge"):
    fn = getattr(torch, op)
    CASES.append(Case(f"{op}_float", fn, (In((4, 5)), In((5,)))))
    CASES.append(Case(f"{op}_int", fn, (In((6,), torch.int64, "int"), In((6,), torch.int64, "int"))))
    CASES.append(Case(f"{op}_scalar", lambda a, f=fn: f(a, 0.5), (In((6,)),)))
    CASES.append(Case(f"{op}_int_float", fn, (In((6,), torch.int32, "int"), In((6,)))))
CASES += [
    Case("where", torch.where, (In((4, 5), torch.bool, "bool"), In((4, 5)), In((5,)))),
    Case("where_scalar", lambda c, a: torch.where(c, a, 0.0), (In((4, 5), torch.bool, "bool"), In((4, 5)))),
    Case("where_promote", torch.where, (In((4,), torch.bool, "bool"), In((4,), torch.int64, "int"), In((4,)))),
    Case("masked_fill", lambda x, m: x.masked_fill(m, -1e9), (In((3, 4)), In((3, 4), torch.bool, "bool"))),
    Case("clamp", lambda x: torch.clamp(x, -0.5, 0.7), (In((4, 5)),)),
    Case("clamp_min", lambda x: torch.clamp(x, min=0.1), (In((4, 5)),)),
    Case("clamp_max_int", lambda x: torch.clamp(x, max=3), (In((8,), torch.int64, "int"),)),
    Case("clamp_nan", lambda x: torch.clamp(x, -1, 1), (In((8,), fill="special"),)),
    Case("clamp_tensor", lambda x, lo: torch.clamp(x, min=lo), (In((4, 5)), In((5,)))),
]
for src, dst in [(torch.float32, torch.int64), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
                 (torch.int64, torch.float32), (torch.bool, torch.float32), (torch.float32, torch.bool),
                 (torch.int64, torch.int32), (torch.float16, torch.float32), (torch.int32, torch.bool)]:
    fill = "int" if not src.is_floating_point and src != torch.bool else ("bool" if src == torch.bool else "randn")
    CASES.append(Case(f"cast_{str(src)[6:]}_{str(dst)[6:]}", lambda x, d=dst: x.to(d), (In((3, 4), src, fill),)))

# Sweeps: every op over the dtypes PyTorch accepts for it, 0-d and empty tensors.
for name, fn in {**UNARY, **POSITIVE}.items():
    fill = "positive" if name in POSITIVE else "randn"
    CASES.append(Case(f"{name}_0d", fn, (In((), fill=fill),)))
    CASES.append(Case(f"{name}_empty", fn, (In((2, 0), fill=fill),)))
INT_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum,
              "minimum": torch.minimum}
for name, fn in INT_BINARY.items():
    for dt in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        fill = "index:9" if dt == torch.uint8 else "int"
        CASES.append(Case(f"{name}_{str(dt)[6:]}", fn, (In((3, 4), dt, fill), In((4,), dt, fill))))
for name in ("maximum", "minimum", "mul"):
    CASES.append(Case(f"{name}_bool", getattr(torch, name),
                      (In((5,), torch.bool, "bool"), In((5,), torch.bool, "bool"))))
for op in ("eq", "ne", "lt", "le", "gt", "ge"):
    fn = getattr(torch, op)
    for dt in (torch.float16, torch.bfloat16):
        CASES.append(Case(f"{op}_{str(dt)[6:]}", fn, (In((4, 5), dt), In((4, 5), dt))))
    CASES.append(Case(f"{op}_bool", fn, (In((6,), torch.bool, "bool"), In((6,), torch.bool, "bool"))))
    CASES.append(Case(f"{op}_nan", fn, (In((8,), fill="special"), In((8,)))))
for dt in (torch.float16, torch.bfloat16, torch.int32, torch.bool):
    fill = {torch.int32: "int", torch.bool: "bool"}.get(dt, "randn")
    CASES.append(Case(f"where_{str(dt)[6:]}", torch.where, (In((3, 4), torch.bool, "bool"), In((3, 4), dt, fill),
                                                           In((3, 4), dt, fill))))
for dt in (torch.float16, torch.bfloat16):
    CASES.append(Case(f"clamp_{str(dt)[6:]}", lambda x: torch.clamp(x, -0.5, 0.5), (In((4, 5), dt),)))
    CASES.append(Case(f"div_floor_{str(dt)[6:]}", lambda a, b: torch.div(a, b, rounding_mode="floor"),
                      (In((6,), dt), In((6,), dt, "positive"))))
    CASES.append(Case(f"pow_scalar_{str(dt)[6:]}", lambda a: a ** 2, (In((5,), dt),)))
for dt in (torch.int32, torch.int16, torch.int8):
    CASES.append(Case(f"abs_{str(dt)[6:]}", torch.abs, (In((7,), dt, "int"),)))
    CASES.append(Case(f"neg_{str(dt)[6:]}", torch.neg, (In((7,), dt, "int"),)))
    CASES.append(Case(f"remainder_{str(dt)[6:]}", lambda a: torch.remainder(a, 3), (In((7,), dt, "int"),)))
    CASES.append(Case(f"clamp_{str(dt)[6:]}", lambda x: torch.clamp(x, -2, 3), (In((7,), dt, "int"),)))
for src in (torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16, torch.float64):
    for dst in (torch.float32, torch.int32, torch.bool):
        if src == dst:
            continue
        fill = "index:9" if src == torch.uint8 else ("int" if not src.is_floating_point else "randn")
        CASES.append(Case(f"cast_{str(src)[6:]}_{str(dst)[6:]}", lambda x, d=dst: x.to(d), (In((3, 4), src, fill),)))
CASES += [
    Case("add_dynamic", torch.add, (In((3, 4)), In((3, 4))),
         dynamic=({0: torch.export.Dim("n", max=64)}, {0: torch.export.Dim("n", max=64)}),
         run_shapes=(((3, 4), (3, 4)), ((9, 4), (9, 4)))),
    Case("mul_broadcast_dynamic", torch.mul, (In((3, 4)), In((4,))), dynamic=({0: torch.export.Dim("n", max=64)},
                                                                              None),
         run_shapes=(((3, 4), (4,)), ((1, 4), (4,)))),
    Case("sigmoid_dynamic", torch.sigmoid, (In((2, 5)),), dynamic=({1: torch.export.Dim("n", max=64)},),
         run_shapes=(((2, 5),), ((2, 17),))),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_elementwise(case: Case, backend: str) -> None:
    check(case, backend)
