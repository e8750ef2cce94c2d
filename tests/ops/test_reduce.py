"""Reductions, scans, softmax."""

from __future__ import annotations

import pytest
import torch

from tests.ops.harness import Case, In, check

CASES: list[Case] = []
for name, fn in {"sum": torch.sum, "mean": torch.mean, "amax": torch.amax, "amin": torch.amin}.items():
    CASES += [
        Case(f"{name}_all", lambda x, f=fn: f(x) if f not in (torch.amax, torch.amin) else f(x, (0, 1, 2)),
             (In((2, 3, 4)),)),
        Case(f"{name}_dim", lambda x, f=fn: f(x, 1), (In((2, 3, 4)),)),
        Case(f"{name}_dims_keep", lambda x, f=fn: f(x, (0, -1), keepdim=True), (In((2, 3, 4)),)),
        Case(f"{name}_f16", lambda x, f=fn: f(x, -1), (In((3, 64), torch.float16),)),
        Case(f"{name}_bf16", lambda x, f=fn: f(x, -1), (In((3, 64), torch.bfloat16),)),
        Case(f"{name}_noncontig", lambda x, f=fn: f(x, 0), (In((5, 6), noncontiguous=True),)),
    ]
CASES += [
    Case("sum_int32", lambda x: torch.sum(x, 0), (In((4, 3), torch.int32, "int"),)),
    Case("sum_bool", lambda x: torch.sum(x, 1), (In((4, 3), torch.bool, "bool"),)),
    Case("sum_dtype", lambda x: torch.sum(x, 1, dtype=torch.float64), (In((4, 3)),)),
    Case("amax_int", lambda x: torch.amax(x, 1), (In((4, 3), torch.int64, "int"),)),
    Case("amax_nan", lambda x: torch.amax(x, 0), (In((8,), fill="special"),)),
    Case("prod", lambda x: torch.prod(x, 1), (In((3, 4)),)),
    Case("any", lambda x: torch.any(x, 1), (In((3, 4), torch.bool, "bool"),)),
    Case("all", lambda x: torch.all(x), (In((3, 4), torch.bool, "bool"),)),
    Case("var", lambda x: torch.var(x, 1), (In((3, 8)),)),
    Case("var_pop_keep", lambda x: torch.var(x, (0, 1), correction=0, keepdim=True), (In((3, 8)),)),
    Case("std", lambda x: torch.std(x, -1), (In((3, 8)),)),
    Case("argmax", lambda x: torch.argmax(x, 1), (In((3, 8)),)),
    Case("argmax_flat", lambda x: torch.argmax(x), (In((3, 8)),)),
    Case("argmin_keep", lambda x: torch.argmin(x, 0, keepdim=True), (In((3, 8)),)),
    Case("max_dim", lambda x: torch.max(x, 1), (In((3, 8)),)),
    Case("min_dim_keep", lambda x: torch.min(x, 0, keepdim=True), (In((3, 8)),)),
    Case("max_all", lambda x: torch.max(x), (In((3, 8)),)),
    Case("cumsum", lambda x: torch.cumsum(x, 1), (In((3, 8)),)),
    Case("cumsum_int", lambda x: torch.cumsum(x, 0), (In((5,), torch.int32, "int"),)),
    Case("logsumexp", lambda x: torch.logsumexp(x, 1), (In((3, 8)),)),
    Case("norm2", lambda x: torch.linalg.vector_norm(x, dim=-1), (In((3, 8)),)),
    Case("mean_dynamic", lambda x: x.mean(0), (In((4, 3)),), dynamic=({0: torch.export.Dim("n", min=1, max=16)},),
         run_shapes=(((4, 3),), ((9, 3),))),
]
for name, fn in {"softmax": torch.softmax, "log_softmax": torch.log_softmax}.items():
    CASES += [Case(f"{name}_last", lambda x, f=fn: f(x, -1), (In((2, 3, 16)),)),
              Case(f"{name}_dim0", lambda x, f=fn: f(x, 0), (In((4, 5)),)),
              Case(f"{name}_f16", lambda x, f=fn: f(x, -1), (In((4, 32), torch.float16),)),
              Case(f"{name}_bf16", lambda x, f=fn: f(x, -1), (In((4, 32), torch.bfloat16),)),
              Case(f"{name}_inf", lambda x, f=fn: f(x.masked_fill(x > 1, float("-inf")), -1), (In((4, 16)),)),
              Case(f"{name}_wide", lambda x, f=fn: f(x, -1), (In((3, 3000)),))]  # rows longer than a GPU block


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reduce(case: Case, backend: str) -> None:
    check(case, backend)
