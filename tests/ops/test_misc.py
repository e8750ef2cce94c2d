"""Scans (cumprod, cummax/cummin, logcumsumexp), strided views (diagonal, as_strided, unfold), pairwise distances
(cdist, pdist), var_mean/std_mean and constant index lists."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import UnsupportedOpsError
from tests.ops.harness import Case, FnModule, In, check

Dim = torch.export.Dim
F16, BF16, I32, I64 = torch.float16, torch.bfloat16, torch.int32, torch.int64

CASES: list[Case] = []

# scans
for dtype, fill in ((torch.float32, "randn"), (F16, "randn"), (BF16, "randn"), (I32, "int"), (I64, "int")):
    tag = str(dtype).split(".")[-1]
    CASES += [
        Case(f"cumprod_{tag}", lambda x: torch.cumprod(x, 1), (In((3, 6), dtype, fill),)),
        Case(f"cummax_{tag}", lambda x: torch.cummax(x, 1), (In((3, 9), dtype, fill),)),
        Case(f"cummin_{tag}", lambda x: torch.cummin(x, 0), (In((7, 2), dtype, fill),)),
    ]
CASES += [
    Case("cumprod_bool", lambda x: torch.cumprod(x, 0), (In((5,), torch.bool, "bool"),)),
    Case("cumprod_dtype", lambda x: torch.cumprod(x, 0, dtype=torch.float64), (In((5,)),)),
    Case("cumprod_nan", lambda x: torch.cumprod(x, 0), (In((8,), fill="special"),)),
    Case("cumprod_noncontig", lambda x: torch.cumprod(x, 0), (In((4, 3), noncontiguous=True),)),
    Case("cumprod_empty", lambda x: torch.cumprod(x, 1), (In((2, 0)),)),
    Case("cumprod_0d", lambda x: torch.cumprod(x, 0), (In(()),)),
    Case("cumprod_dynamic", lambda x: torch.cumprod(x, 1), (In((2, 5)),), dynamic=({1: Dim("n", max=64)},),
         run_shapes=(((2, 5),), ((2, 12),))),
    Case("cummax_nan", lambda x: torch.cummax(x, 0), (In((9,), fill="special"),)),
    Case("cummin_nan", lambda x: torch.cummin(x, 0), (In((9,), fill="special"),)),
    Case("cummax_ties", lambda x: torch.cummax(x, -1), (In((4, 12), I64, "index:3"),)),
    Case("cummin_ties_bf16", lambda x: torch.cummin(x.round(), -1), (In((3, 10), BF16),)),
    Case("cummax_bool", lambda x: torch.cummax(x, 0), (In((6,), torch.bool, "bool"),)),
    Case("cummax_noncontig", lambda x: torch.cummax(x, 1), (In((3, 5), noncontiguous=True),)),
    Case("cummax_empty", lambda x: torch.cummax(x, 0), (In((0, 3)),)),
    Case("cummax_0d", lambda x: torch.cummax(x, 0), (In(()),)),
    Case("cummax_dynamic", lambda x: torch.cummax(x, 0), (In((4, 2)),), dynamic=({0: Dim("n", max=64)},),
         run_shapes=(((4, 2),), ((10, 2),))),
    Case("logcumsumexp", lambda x: torch.logcumsumexp(x, 1), (In((3, 7)),)),
    Case("logcumsumexp_big", lambda x: torch.logcumsumexp(x * 100, 0), (In((6,)),)),
    Case("logcumsumexp_inf", lambda x: torch.logcumsumexp(x, 0), (In((8,), fill="special"),)),
    Case("logcumsumexp_f16", lambda x: torch.logcumsumexp(x, -1), (In((2, 8), F16),)),
    Case("logcumsumexp_bf16", lambda x: torch.logcumsumexp(x, -1), (In((2, 8), BF16),)),
]

# strided views
CASES += [
    Case("diagonal", lambda x: torch.diagonal(x), (In((4, 4)),)),
    Case("diagonal_offset", lambda x: torch.diagonal(x, 2), (In((3, 6)),)),
    Case("diagonal_negative", lambda x: torch.diagonal(x, -1), (In((5, 3)),)),
    Case("diagonal_dims", lambda x: torch.diagonal(x, 1, 2, 0), (In((3, 2, 4)),)),
    Case("diagonal_batched", lambda x: torch.diagonal(x, 0, -2, -1) * 2, (In((2, 3, 3)),)),
    Case("diagonal_out_of_range", lambda x: torch.diagonal(x, 5), (In((3, 3)),)),
    Case("diagonal_int", lambda x: torch.diagonal(x), (In((3, 4), I64, "int"),)),
    Case("diagonal_f16", lambda x: torch.diagonal(x, 1), (In((4, 4), F16),)),
    Case("diagonal_bool", lambda x: torch.diagonal(x), (In((3, 3), torch.bool, "bool"),)),
    Case("diagonal_noncontig", lambda x: torch.diagonal(x, -1), (In((4, 5), noncontiguous=True),)),
    Case("diagonal_empty", lambda x: torch.diagonal(x), (In((0, 3)),)),
    Case("diagonal_dynamic", lambda x: torch.diagonal(x, 0, 1, 2), (In((2, 3, 3)),),
         dynamic=({1: Dim("n", min=2, max=32), 2: Dim("n", min=2, max=32)},), run_shapes=(((2, 3, 3),), ((2, 7, 7),))),
    Case("trace", lambda x: torch.trace(x), (In((4, 4)),)),
    Case("diag_matrix", lambda x: torch.diag(x, 1), (In((4, 5)),)),
    Case("diag_vector", lambda x: torch.diag(x), (In((4,)),)),
    Case("diag_embed", lambda x: torch.diag_embed(x), (In((2, 3)),)),
    Case("diag_embed_offset", lambda x: torch.diag_embed(x, -1), (In((3,), I64, "int"),)),
    Case("as_strided", lambda x: x.as_strided((2, 3), (1, 2)), (In((3, 4)),)),
    Case("as_strided_offset", lambda x: torch.as_strided(x, (3, 2), (4, 1), 5), (In((4, 5)),)),
    Case("as_strided_overlap", lambda x: x.as_strided((4, 3), (1, 1)), (In((6,)),)),
    Case("as_strided_zero_stride", lambda x: x.as_strided((3, 2), (0, 1)) + 1, (In((2,), I32, "int"),)),
    Case("as_strided_bf16", lambda x: x.as_strided((2, 2), (3, 1), 1), (In((2, 3), BF16),)),
    Case("as_strided_0d", lambda x: x.as_strided((), (), 4), (In((6,)),)),
    Case("as_strided_empty", lambda x: x.as_strided((0, 3), (3, 1)), (In((6,)),)),
    Case("unfold", lambda x: x.unfold(1, 3, 2), (In((2, 8)),)),
    Case("unfold_dim0", lambda x: x.unfold(0, 2, 1) * 1, (In((5, 3), I64, "int"),)),
    Case("unfold_noncontig", lambda x: x.unfold(1, 2, 2), (In((3, 6), noncontiguous=True),)),
    Case("unfold_dynamic", lambda x: x.unfold(0, 4, 4), (In((8,)),), dynamic=({0: Dim("n", min=8, max=64)},),
         run_shapes=(((8,),), ((14,),))),
]

# pairwise distances: both PyTorch algorithms (direct, and matmul for p=2 beyond 25 rows)
for p in (0.0, 1.0, 2.0, 3.0, float("inf")):
    CASES += [
        Case(f"cdist_p{p}", lambda a, b, p=p: torch.cdist(a, b, p=p), (In((5, 4)), In((6, 4)))),
        Case(f"pdist_p{p}", lambda x, p=p: F.pdist(x, p=p), (In((5, 3)),)),
    ]
CASES += [
    Case("cdist_batched", lambda a, b: torch.cdist(a, b), (In((2, 3, 4)), In((2, 5, 4)))),
    Case("cdist_broadcast", lambda a, b: torch.cdist(a, b, p=1.5), (In((2, 1, 3, 4)), In((3, 2, 4)))),
    # the matmul algorithm (|a|^2 - 2ab + |b|^2) loses a few bits to cancellation, as in eager: compare at 1e-4
    Case("cdist_mm", lambda a, b: torch.cdist(a, b), (In((30, 8)), In((7, 8))), tol=1e-4),
    Case("cdist_mm_forced", lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist"),
         (In((3, 4)), In((4, 4))), tol=1e-4),
    Case("cdist_mm_batched", lambda a, b: torch.cdist(a, b), (In((2, 27, 5)), In((2, 4, 5))), tol=1e-4),
    Case("cdist_no_mm", lambda a, b: torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist"),
         (In((30, 3)), In((26, 3)))),
    Case("cdist_noncontig", lambda a, b: torch.cdist(a, b), (In((4, 3), noncontiguous=True), In((5, 3)))),
    Case("cdist_empty", lambda a, b: torch.cdist(a, b), (In((0, 3)), In((4, 3)))),
    Case("cdist_dynamic", lambda a, b: torch.cdist(a, b, p=1), (In((4, 3)), In((5, 3))),
         dynamic=({0: Dim("n", max=20)}, None), run_shapes=(((4, 3), (5, 3)), ((11, 3), (5, 3)))),
    Case("pdist_noncontig", lambda x: F.pdist(x), (In((4, 6), noncontiguous=True),)),
    Case("pdist_one_row", lambda x: F.pdist(x), (In((1, 3)),)),
    Case("pairwise_distance", lambda a, b: F.pairwise_distance(a, b), (In((3, 4)), In((3, 4)))),
]

# var_mean / std_mean and constant index lists
CASES += [
    Case("var_mean", lambda x: torch.var_mean(x, 1), (In((3, 8)),)),
    Case("var_mean_all", lambda x: torch.var_mean(x), (In((3, 8)),)),
    Case("var_mean_keep_pop", lambda x: torch.var_mean(x, (0, 2), correction=0, keepdim=True), (In((2, 3, 4)),)),
    Case("std_mean", lambda x: torch.std_mean(x, -1), (In((4, 6)),)),
    Case("std_mean_noncontig", lambda x: torch.std_mean(x, 0), (In((5, 4), noncontiguous=True),)),
    Case("var_mean_dynamic", lambda x: torch.var_mean(x, 0), (In((4, 3)),), dynamic=({0: Dim("n", min=2, max=32)},),
         run_shapes=(((4, 3),), ((9, 3),))),
    Case("triu_indices", lambda x: x[torch.triu_indices(4, 4, 1).unbind(0)], (In((4, 4)),)),
    Case("tril_indices", lambda x: x + torch.tril_indices(3, 3).sum(), (In((2,), I64, "int"),)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_misc(case: Case, backend: str) -> None:
    check(case, backend)


def test_misc_table_size() -> None:
    assert len(CASES) >= 90


def test_as_strided_of_a_permuted_view_is_refused() -> None:
    """Strides into a permuted view name memory kiln does not keep: a clear error, not a wrong answer."""
    with pytest.raises(UnsupportedOpsError, match="contiguous"):
        kiln.export(FnModule(lambda x: x.t().as_strided((2, 2), (1, 2))), (torch.randn(3, 4),))


def test_as_strided_window_checked_at_run_time() -> None:
    """A malformed window in a program fails in the kernel instead of reading outside the array."""
    import numpy as np

    from kiln.runtime.backends.array_api.shape import as_strided
    with pytest.raises(ValueError, match="window"):
        as_strided(np, np.zeros(6, np.float32), (3, 3), (2, 1), 0)
