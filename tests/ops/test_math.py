"""Elementwise math functions: trigonometric and hyperbolic, logs and exponentials in other bases, erfinv/erfc,
isinf, the ELU family, and the ops that decompose into these (frac, sgn, logit, selu, celu, softplus, mish)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.harness import Case, In, check

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
aten = torch.ops.aten


def _unit(fn):
    """fn on inputs squashed into [-0.95, 0.95] (inverse trig, atanh, erfinv). Nearer 1 these functions' slopes
    turn one float32 ulp of the input into more than the tolerance, so eager's own float32 result is no reference
    there; the *_special and *_poles cases check the domain edges at fixed points."""
    return lambda x: fn(torch.tanh(x) * 0.95)


def _above_one(fn):
    return lambda x: fn(x.abs() + 1)


MATH = {
    "tan": torch.tan, "cosh": torch.cosh, "sinh": torch.sinh, "atan": torch.atan, "asinh": torch.asinh,
    "log10_abs": lambda x: torch.log10(x.abs() + 0.1), "log2_abs": lambda x: torch.log2(x.abs() + 0.1),
    "exp2": torch.exp2, "erfc": torch.erfc, "acos": _unit(torch.acos), "asin": _unit(torch.asin),
    "atanh": _unit(torch.atanh), "erfinv": _unit(torch.erfinv), "acosh": _above_one(torch.acosh),
    "elu": F.elu, "elu_alpha": lambda x: F.elu(x, alpha=0.5), "selu": F.selu, "celu": lambda x: F.celu(x, 0.7),
    "softplus": F.softplus, "softplus_beta": lambda x: F.softplus(x, beta=2.0, threshold=5.0), "mish": F.mish,
    "frac": torch.frac, "sgn": torch.sgn, "logit": _unit(lambda x: torch.logit(x.abs())),
    "logit_eps": lambda x: torch.logit(torch.sigmoid(x), eps=0.1),
}
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""One unit of the last place more than the defaults: these run in float32 and round once, and eager PyTorch
computes some of them (cosh, sinh, exp2 of larger values) in the half type itself."""
ABS_TOL = {"erfinv": 1e-5}

CASES: list[Case] = []
for name, fn in MATH.items():
    for dt in FLOATS:
        CASES.append(Case(f"{name}_{str(dt)[6:]}", fn, (In((3, 5), dt),), tol=TOL.get(dt, ABS_TOL.get(name))))
    CASES.append(Case(f"{name}_noncontig", fn, (In((4, 6), noncontiguous=True),), tol=ABS_TOL.get(name)))
    CASES.append(Case(f"{name}_0d", fn, (In(()),)))
    CASES.append(Case(f"{name}_empty", fn, (In((2, 0)),)))

# Outside the domain (NaN), at the poles (inf), and NaN/inf inputs: the raw functions, no squashing.
RAW = {"acos": torch.acos, "asin": torch.asin, "atanh": torch.atanh, "acosh": torch.acosh, "erfinv": torch.erfinv,
       "log10": torch.log10, "log2": torch.log2, "tan": torch.tan, "cosh": torch.cosh, "sinh": torch.sinh,
       "exp2": torch.exp2, "erfc": torch.erfc, "atan": torch.atan, "asinh": torch.asinh, "elu": F.elu,
       "selu": F.selu}
for name, fn in RAW.items():
    CASES.append(Case(f"{name}_special", fn, (In((12,), fill="special"),)))
CASES += [
    Case("erfinv_poles", lambda x: torch.erfinv(torch.cat([x, torch.tensor([1.0, -1.0, 0.0, 0.999999, -0.5])])),
         (In((3,)),)),
    Case("atanh_poles", lambda x: torch.atanh(torch.cat([torch.tanh(x), torch.tensor([1.0, -1.0])])), (In((3,)),)),
    Case("acos_int_promotes", torch.acos, (In((5,), torch.int64, "int"),)),
    Case("log2_int_promotes", torch.log2, (In((5,), torch.int32, "index:9"),)),
    Case("exp2_int", torch.exp2, (In((5,), torch.int64, "int"),)),
    Case("tan_f16_special", torch.tan, (In((8,), torch.float16, "special"),)),
    Case("elu_scale", lambda x: aten.elu.default(x, 0.3, 1.5, 2.0), (In((4, 5)),)),
    Case("div_scalar_mode_floor", lambda x: aten.div.Scalar_mode(x, 3, rounding_mode="floor"),
         (In((7,), torch.int64, "int"),)),
    Case("div_scalar_mode_trunc_float", lambda x: aten.div.Scalar_mode(x, -0.7, rounding_mode="trunc"), (In((7,)),)),
    Case("fill_scalar", lambda x: aten.fill.Scalar(x, 2.5) + x, (In((3, 4)),)),
    Case("fill_scalar_int", lambda x: aten.fill.Scalar(x, 7), (In((3,), torch.int32, "int"),)),
    Case("tan_dynamic", torch.tan, (In((3, 4)),), dynamic=({0: torch.export.Dim("n", max=64)},),
         run_shapes=(((3, 4),), ((9, 4),))),
]
for dt in FLOATS + (torch.int32, torch.int64):
    fill = "special" if dt == torch.float32 else ("int" if not dt.is_floating_point else "randn")
    CASES.append(Case(f"isinf_{str(dt)[6:]}", torch.isinf, (In((9,), dt, fill),)))
CASES += [Case("isinf_0d", torch.isinf, (In(()),)), Case("isinf_empty", torch.isinf, (In((0, 2)),)),
          Case("isinf_noncontig", torch.isinf, (In((3, 4), noncontiguous=True),))]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_math(case: Case, backend: str) -> None:
    check(case, backend)


COMPOSED = [
    Case("fmax", torch.fmax, (In((8,), fill="special"), In((8,)))),
    Case("fmin", torch.fmin, (In((8,)), In((8,), fill="special"))),
    Case("fmax_both_nan", lambda a: torch.fmax(a, a), (In((8,), fill="special"),)),
    Case("fmin_int", torch.fmin, (In((6,), torch.int64, "int"), In((6,), torch.int64, "int"))),
    Case("fmax_f16", torch.fmax, (In((4, 5), torch.float16), In((5,), torch.float16))),
    Case("hypot", torch.hypot, (In((4, 5)), In((5,)))),
    Case("hypot_large", lambda a, b: torch.hypot(a * 1e30, b * 1e30), (In((6,)), In((6,)))),
    Case("hypot_special", torch.hypot, (In((8,), fill="special"), In((8,)))),
    Case("hypot_bf16", torch.hypot, (In((3, 4), torch.bfloat16), In((3, 4), torch.bfloat16))),
    Case("copysign", torch.copysign, (In((4, 5)), In((4, 5)))),
    Case("copysign_zero", lambda a: torch.copysign(a, torch.tensor([0.0, -0.0, 1.0, -2.0])), (In((3, 4)),)),
    Case("copysign_scalar", lambda a: torch.copysign(a, -1.0), (In((5,)),)),
    Case("copysign_int_promotes", torch.copysign, (In((5,), torch.int64, "int"), In((5,)))),
]


@pytest.mark.parametrize("case", COMPOSED, ids=str)
def test_composed_math(case: Case, backend: str) -> None:
    check(case, backend)
