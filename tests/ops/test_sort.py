"""Sorting and searching: sort, argsort, topk, searchsorted, bucketize, nonzero (constant and static forms)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.errors import UnsupportedOpsError
from tests.ops.harness import Case, FnModule, In, check

Dim = torch.export.Dim
F16, BF16, I32, I64 = torch.float16, torch.bfloat16, torch.int32, torch.int64

CASES: list[Case] = []

# sort / argsort: values and indices; ties (ints, bool, half precision) keep the stable order (kiln always sorts
# stably; eager's order of ties with stable=False is unspecified, so cases with ties ask for stable=True)
for dtype, fill in ((torch.float32, "randn"), (F16, "randn"), (BF16, "randn"), (I32, "int"), (I64, "int"),
                    (torch.bool, "bool")):
    tag = str(dtype).split(".")[-1]
    CASES += [
        Case(f"sort_{tag}", lambda x: torch.sort(x, dim=-1, stable=True), (In((3, 24), dtype, fill),)),
        Case(f"sort_desc_{tag}", lambda x: torch.sort(x, dim=0, descending=True, stable=True),
             (In((9, 4), dtype, fill),)),
        Case(f"argsort_{tag}", lambda x: torch.argsort(x, dim=1, stable=True), (In((4, 10), dtype, fill),)),
    ]
CASES += [
    Case("sort_nan", lambda x: torch.sort(x, stable=True), (In((11,), fill="special"),)),
    Case("sort_nan_desc", lambda x: torch.sort(x, descending=True, stable=True), (In((2, 9), fill="special"),)),
    Case("sort_stable_kw", lambda x: torch.sort(x, dim=0, stable=True, descending=True), (In((7, 3), I64, "int"),)),
    Case("sort_noncontig", lambda x: torch.sort(x, 1), (In((5, 6), noncontiguous=True),)),
    Case("sort_3d_mid", lambda x: torch.sort(x, 1, descending=True), (In((2, 5, 3)),)),
    Case("sort_empty", lambda x: torch.sort(x, 1), (In((3, 0)),)),
    Case("sort_empty_rows", lambda x: torch.sort(x, 1), (In((0, 4)),)),
    Case("sort_0d", lambda x: torch.sort(x), (In(()),)),
    Case("argsort_desc", lambda x: torch.argsort(x, -1, descending=True), (In((3, 8)),)),
    Case("msort", lambda x: torch.msort(x), (In((6, 3)),)),
    Case("sort_dynamic", lambda x: torch.sort(x, -1, descending=True), (In((2, 6)),),
         dynamic=({1: Dim("n", min=2, max=64)},), run_shapes=(((2, 6),), ((2, 33),))),
]

# topk: random floats (PyTorch leaves the order of ties unspecified)
for dtype in (torch.float32, F16, BF16):
    tag = str(dtype).split(".")[-1]
    CASES += [
        Case(f"topk_{tag}", lambda x: torch.topk(x, 3), (In((4, 16), dtype),)),
        Case(f"topk_smallest_{tag}", lambda x: torch.topk(x, 4, 0, largest=False), (In((12, 3), dtype),)),
    ]
CASES += [
    Case("topk_int32", lambda x: torch.topk((x * 1000).to(I32), 5, -1), (In((3, 40)),)),
    Case("topk_int64_smallest", lambda x: torch.topk((x * 1000).long(), 2, 0, largest=False), (In((9, 2)),)),
    # "special" fills nan, inf, -inf, 0.0, -0.0 first: drop -0.0, a tie with 0.0 that topk may order either way
    Case("topk_nan", lambda x: torch.topk(torch.cat([x[:4], x[5:]]), 3), (In((10,), fill="special"),)),
    Case("topk_nan_smallest", lambda x: torch.topk(torch.cat([x[:4], x[5:]]), 3, largest=False),
         (In((10,), fill="special"),)),
    Case("topk_noncontig", lambda x: torch.topk(x, 2, 0), (In((6, 5), noncontiguous=True),)),
    Case("topk_k0", lambda x: torch.topk(x, 0), (In((3, 5)),)),
    Case("topk_full", lambda x: torch.topk(x, 5), (In((3, 5)),)),
    Case("topk_empty_rows", lambda x: torch.topk(x, 2), (In((0, 5)),)),
    Case("topk_0d", lambda x: torch.topk(x, 1), (In(()),)),
    Case("topk_unsorted_values", lambda x: torch.topk(x, 4, sorted=False).values.sort().values, (In((3, 9)),)),
    # the partition path (n >= 4096, k small): a vocabulary-sized row as in top-k sampling
    Case("topk_vocab", lambda x: torch.topk(x, 50), (In((2, 5000)),)),
    Case("topk_vocab_smallest", lambda x: torch.topk(x, 8, largest=False), (In((2, 4100)),)),
    Case("topk_vocab_nan", lambda x: torch.topk(torch.cat([x[:4], x[5:]]), 4), (In((4200,), fill="special"),)),
    Case("topk_vocab_nan_smallest", lambda x: torch.topk(torch.cat([x[:4], x[5:]]), 4, largest=False),
         (In((4200,), fill="special"),)),
    Case("topk_dynamic", lambda x: torch.topk(x, 3, -1), (In((2, 8)),),
         dynamic=({1: Dim("vocab", min=4, max=8192)},), run_shapes=(((2, 8),), ((2, 4500),))),
    Case("topk_dynamic_rows", lambda x: torch.topk(x, 2, -1), (In((3, 7)),),
         dynamic=({0: Dim("batch", max=16)},), run_shapes=(((3, 7),), ((1, 7),), ((9, 7),))),
]

BOUNDS = torch.tensor([-1.0, -0.25, 0.0, 0.5, 2.0])
ROWS = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 2.0, 3.0]])
CASES += [
    Case("bucketize", lambda x: torch.bucketize(x, BOUNDS), (In((3, 7)),)),
    Case("bucketize_right", lambda x: torch.bucketize(x, BOUNDS, right=True), (In((3, 7)),)),
    Case("bucketize_int32", lambda x: torch.bucketize(x, BOUNDS, out_int32=True), (In((10,)),)),
    Case("bucketize_exact", lambda x: torch.bucketize(x.round(), torch.tensor([-2.0, 0.0, 1.0]), right=True),
         (In((12,)),)),
    Case("bucketize_int", lambda x: torch.bucketize(x, torch.tensor([-4, 0, 3])), (In((9,), I64, "int"),)),
    Case("bucketize_f16", lambda x: torch.bucketize(x, BOUNDS.half()), (In((9,), F16),)),
    Case("bucketize_nan", lambda x: torch.bucketize(x, BOUNDS), (In((8,), fill="special"),)),
    Case("bucketize_runtime_bounds", lambda x, b: torch.bucketize(x, b.sort().values), (In((6,)), In((4,)))),
    Case("bucketize_noncontig", lambda x: torch.bucketize(x, BOUNDS), (In((4, 3), noncontiguous=True),)),
    Case("bucketize_0d", lambda x: torch.bucketize(x, BOUNDS), (In(()),)),
    Case("bucketize_empty", lambda x: torch.bucketize(x, BOUNDS), (In((0, 3)),)),
    Case("searchsorted", lambda x: torch.searchsorted(BOUNDS, x), (In((2, 5)),)),
    Case("searchsorted_right", lambda x: torch.searchsorted(BOUNDS, x.round(), right=True), (In((9,)),)),
    Case("searchsorted_side", lambda x: torch.searchsorted(BOUNDS, x.round(), side="right", out_int32=True),
         (In((9,)),)),
    Case("searchsorted_rows", lambda x: torch.searchsorted(ROWS, x), (In((2, 4)),)),
    Case("searchsorted_rows_right", lambda x: torch.searchsorted(ROWS, x.round(), right=True), (In((2, 6)),)),
    Case("searchsorted_sorter", lambda s, x: torch.searchsorted(s, x, sorter=torch.argsort(s)), (In((6,)), In((5,)))),
    Case("searchsorted_nan_in_seq", lambda x: torch.searchsorted(torch.tensor([0.0, 1.0, float("nan")]), x),
         (In((7,), fill="special"),)),
    Case("searchsorted_nan_rows", lambda x: torch.searchsorted(
        torch.tensor([[0.0, float("nan"), 1.0], [-1.0, 0.5, 1.0]]), x), (In((2, 5), fill="special"),)),
    Case("searchsorted_scalar", lambda x: x + torch.searchsorted(BOUNDS, 0.3), (In((2,), I64, "int"),)),
    Case("searchsorted_int32_seq", lambda x: torch.searchsorted(torch.tensor([1, 3, 5], dtype=I32), x.to(I32)),
         (In((6,), I64, "int"),)),
    Case("searchsorted_dynamic", lambda x: torch.searchsorted(BOUNDS, x), (In((5,)),),
         dynamic=({0: Dim("n", max=64)},), run_shapes=(((5,),), ((17,),))),
]

MASK = torch.tensor([[True, False, True], [False, False, True]])
CASES += [
    Case("nonzero_constant", lambda x: x + torch.nonzero(MASK).sum(), (In((3,), I64, "int"),)),
    Case("nonzero_constant_rows", lambda x: torch.nonzero(MASK) * x, (In((1, 2), I64, "int"),)),
    Case("nonzero_folded", lambda x: x[torch.nonzero(torch.arange(10) % 3 == 0).squeeze(1)], (In((10, 2)),)),
    Case("argwhere_constant", lambda x: x[:, torch.argwhere(MASK[0]).squeeze(1)], (In((2, 3)),)),
    Case("nonzero_static", lambda x: torch.nonzero_static(x > 0, size=6), (In((3, 4)),)),
    Case("nonzero_static_fill", lambda x: torch.nonzero_static(x, size=4, fill_value=7), (In((3,), I64, "int"),)),
    Case("nonzero_static_short", lambda x: torch.nonzero_static(x > 0, size=20), (In((2, 3)),)),
    Case("nonzero_static_bool", lambda x: torch.nonzero_static(x, size=3), (In((2, 2, 2), torch.bool, "bool"),)),
    Case("nonzero_static_f16", lambda x: torch.nonzero_static(x, size=5), (In((6,), F16, "special"),)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sort(case: Case, backend: str) -> None:
    check(case, backend)


def test_sort_table_size() -> None:
    assert len(CASES) >= 80


def test_nonzero_at_run_time_is_refused_with_a_way_out() -> None:
    """nonzero of a runtime tensor has a data-dependent shape: a clear error that names nonzero_static."""
    with pytest.raises(UnsupportedOpsError, match="nonzero_static"):
        kiln.export(FnModule(lambda x: torch.nonzero(x > 0)), (torch.randn(3, 4),))


def test_runtime_mask_index_is_refused_with_a_way_out() -> None:
    with pytest.raises(UnsupportedOpsError, match="torch.where"):
        kiln.export(FnModule(lambda x: x[x > 0]), (torch.randn(3, 4),))
