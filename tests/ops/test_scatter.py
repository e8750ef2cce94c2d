"""Reducing scatters, masked_scatter, embedding_bag, boolean-mask indexing and repeat_interleave."""

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

# scatter_reduce: every reduction, with and without self, over floats and ints
for reduce in ("sum", "prod", "mean", "amax", "amin"):
    for include_self in (True, False):
        tag = f"{reduce}{'' if include_self else '_noself'}"
        CASES += [
            Case(f"scatter_reduce_{tag}", lambda x, i, s, r=reduce, inc=include_self:
                 x.scatter_reduce(0, i, s, r, include_self=inc),
                 (In((4, 3)), In((6, 3), I64, "index:4"), In((6, 3)))),
            Case(f"scatter_reduce_{tag}_int", lambda x, i, s, r=reduce, inc=include_self:
                 x.scatter_reduce(1, i, s, r, include_self=inc),
                 (In((3, 5), I64, "int"), In((3, 7), I64, "index:5"), In((3, 7), I64, "int"))),
        ]
CASES += [
    Case("scatter_reduce_sum_f16", lambda x, i, s: x.scatter_reduce(1, i, s, "sum"),
         (In((2, 6), F16), In((2, 4), I64, "index:6"), In((2, 4), F16))),
    Case("scatter_reduce_amax_bf16", lambda x, i, s: x.scatter_reduce(0, i, s, "amax", include_self=False),
         (In((3, 4), BF16), In((5, 4), I64, "index:3"), In((5, 4), BF16))),
    Case("scatter_reduce_mean_int32", lambda x, i, s: x.scatter_reduce(0, i, s, "mean"),
         (In((3,), I32, "int"), In((7,), I64, "index:3"), In((7,), I32, "int"))),
    Case("scatter_reduce_amax_nan", lambda x, i, s: x.scatter_reduce(0, i, s, "amax"),
         (In((4,)), In((6,), I64, "index:4"), In((6,), fill="special"))),
    Case("scatter_reduce_smaller_index", lambda x, i, s: x.scatter_reduce(1, i, s, "prod"),
         (In((4, 6)), In((2, 3), I64, "index:6"), In((3, 5)))),
    Case("scatter_reduce_noncontig", lambda x, i, s: x.scatter_reduce(0, i, s, "sum"),
         (In((4, 5), noncontiguous=True), In((3, 5), I64, "index:4"), In((3, 5), noncontiguous=True))),
    Case("scatter_reduce_empty_index", lambda x, i, s: x.scatter_reduce(0, i, s, "amin"),
         (In((4, 2)), In((0, 2), I64, "index:4"), In((0, 2)))),
    Case("scatter_reduce_0d", lambda x, i, s: x.scatter_reduce(0, i, s, "sum"),
         (In(()), In((), I64, "index:1"), In(()))),
    Case("scatter_reduce_dynamic", lambda x, i, s: x.scatter_reduce(0, i, s, "mean", include_self=False),
         (In((4, 3)), In((6, 3), I64, "index:4"), In((6, 3))),
         dynamic=({}, {0: Dim("n", max=64)}, {0: Dim("n", max=64)}), run_shapes=(((4, 3), (6, 3), (6, 3)),
                                                                               ((4, 3), (11, 3), (11, 3)))),
    Case("scatter_multiply", lambda x, i, s: x.scatter(1, i, s, reduce="multiply"),
         (In((3, 4)), In((3, 2), I64, "index:4"), In((3, 2)))),
    Case("scatter_value_add", lambda x, i: x.scatter(0, i, 1.5, reduce="add"),
         (In((3, 4)), In((2, 4), I64, "index:3"))),
    Case("index_reduce_prod", lambda x, i, s: x.index_reduce(0, i, s, "prod"),
         (In((4, 3)), In((5,), I64, "index:4"), In((5, 3)))),
    Case("index_reduce_mean_noself", lambda x, i, s: x.index_reduce(1, i, s, "mean", include_self=False),
         (In((2, 5)), In((4,), I64, "index:5"), In((2, 4)))),
    Case("index_reduce_amax", lambda x, i, s: x.index_reduce(0, i, s, "amax"),
         (In((4, 3), I64, "int"), In((6,), I64, "index:4"), In((6, 3), I64, "int"))),
    Case("index_add", lambda x, i, s: x.index_add(0, i, s, alpha=2.0),
         (In((4, 3)), In((6,), I64, "index:4"), In((6, 3)))),
]

# masked_scatter: mask broadcast, dtypes, more source than needed
CASES += [
    Case("masked_scatter", lambda x, m, s: x.masked_scatter(m, s), (In((3, 4)), In((3, 4), torch.bool, "bool"),
                                                                     In((3, 4)))),
    Case("masked_scatter_broadcast", lambda x, m, s: x.masked_scatter(m, s),
         (In((3, 4)), In((4,), torch.bool, "bool"), In((20,)))),
    Case("masked_scatter_int", lambda x, m, s: x.masked_scatter(m, s),
         (In((5,), I64, "int"), In((5,), torch.bool, "bool"), In((2, 3), I64, "int"))),
    Case("masked_scatter_bf16", lambda x, m, s: x.masked_scatter(m, s),
         (In((2, 3), BF16), In((2, 3), torch.bool, "bool"), In((2, 3), BF16))),
    Case("masked_scatter_noncontig", lambda x, m, s: x.masked_scatter(m, s),
         (In((4, 3), noncontiguous=True), In((4, 3), torch.bool, "bool", noncontiguous=True), In((12,)))),
    Case("masked_scatter_computed_mask", lambda x, s: x.masked_scatter(x > 0, s), (In((3, 3)), In((9,)))),
    Case("masked_scatter_empty", lambda x, m, s: x.masked_scatter(m, s),
         (In((0, 3)), In((0, 3), torch.bool, "bool"), In((2,)))),
    Case("masked_scatter_0d", lambda x, m, s: x.masked_scatter(m, s), (In(()), In((), torch.bool, "bool"), In((1,)))),
]

# embedding_bag: modes, offsets with empty bags, per-sample weights, padding_idx, include_last_offset
OFFSETS = torch.tensor([0, 2, 2, 5])
CASES += [
    Case(f"embedding_bag_{mode}", lambda w, i, m=mode: F.embedding_bag(i, w, OFFSETS, mode=m),
         (In((10, 4)), In((7,), I64, "index:10"))) for mode in ("sum", "mean", "max")
] + [
    Case(f"embedding_bag_{mode}_last_offset", lambda w, i, m=mode: F.embedding_bag(
        i, w, torch.tensor([0, 1, 1, 4, 8]), mode=m, include_last_offset=True),
        (In((10, 3)), In((8,), I64, "index:10")))
    for mode in ("sum", "mean", "max")
] + [
    Case(f"embedding_bag_{mode}_padding", lambda w, i, m=mode: F.embedding_bag(
        i, w, OFFSETS, mode=m, padding_idx=2), (In((5, 3)), In((9,), I64, "index:5")))
    for mode in ("sum", "mean", "max")
] + [
    Case("embedding_bag_weights", lambda w, i, p: F.embedding_bag(i, w, OFFSETS, mode="sum", per_sample_weights=p),
         (In((10, 4)), In((6,), I64, "index:10"), In((6,)))),
    Case("embedding_bag_2d", lambda w, i: F.embedding_bag(i, w, mode="mean"),
         (In((10, 4)), In((3, 4), I64, "index:10"))),
    Case("embedding_bag_runtime_offsets", lambda w, i, o: F.embedding_bag(i, w, o.sort().values * 0 + OFFSETS[:3]),
         (In((6, 2)), In((5,), I64, "index:6"), In((3,), I64, "index:3"))),
    Case("embedding_bag_int32", lambda w, i: F.embedding_bag(i, w, OFFSETS.int(), mode="sum"),
         (In((10, 4)), In((8,), I32, "index:10"))),
    Case("embedding_bag_bf16", lambda w, i: F.embedding_bag(i, w, OFFSETS, mode="mean"),
         (In((10, 4), BF16), In((8,), I64, "index:10"))),
    Case("embedding_bag_module", lambda w, i: torch.nn.functional.embedding_bag(i, w, torch.tensor([0, 3]),
                                                                                  mode="max"),
         (In((7, 5), noncontiguous=True), In((6,), I64, "index:7"))),
    Case("embedding_bag_dynamic", lambda w, i: F.embedding_bag(i, w, torch.tensor([0, 1]), mode="sum"),
         (In((10, 4)), In((5,), I64, "index:10")), dynamic=({}, {0: Dim("n", min=2, max=64)}),
         run_shapes=(((10, 4), (5,)), ((10, 4), (13,)))),
]

# boolean masks: constant masks become int indices; a runtime mask works where the result shape is static
KEEP = torch.tensor([True, False, True, True, False])
GRID = torch.tensor([[True, False, True], [False, True, True]])
CASES += [
    Case("index_const_mask", lambda x: x[KEEP], (In((5, 3)),)),
    Case("index_const_mask_dim1", lambda x: x[:, KEEP[:3]], (In((2, 3, 4)),)),
    Case("index_const_mask_2d", lambda x: x[GRID] * 2, (In((2, 3, 4)),)),
    Case("index_const_mask_int", lambda x: x[KEEP], (In((5,), I64, "int"),)),
    Case("index_const_mask_f16", lambda x: x[KEEP], (In((5, 2), F16),)),
    Case("index_const_mask_noncontig", lambda x: x[KEEP], (In((5, 4), noncontiguous=True),)),
    Case("index_mask_buffer_computed", lambda x: x[torch.arange(6) % 2 == 0], (In((6, 2)),)),
    Case("index_const_mask_all_false", lambda x: x[torch.zeros(4, dtype=torch.bool)], (In((4, 3)),)),
    Case("index_const_mask_then_int", lambda x, i: x[KEEP][i], (In((5, 3)), In((2,), I64, "index:3"))),
    Case("masked_select_const", lambda x: torch.masked_select(x, GRID), (In((2, 3)),)),
    Case("index_put_runtime_mask", lambda x: x.masked_fill(x < 0, 0.5) + x.index_put((x > 1,), torch.tensor(-1.0)),
         (In((4, 3)),)),
    Case("setitem_runtime_mask", lambda x: _setitem(x), (In((4, 3)),)),
    Case("index_put_runtime_mask_2d_dim1", lambda x, m: _setitem_dim1(x, m),
         (In((2, 3, 4)), In((3, 4), torch.bool, "bool"))),
    Case("index_put_runtime_mask_accumulate", lambda x, m: x.index_put((m,), torch.tensor(2.0), accumulate=True),
         (In((5, 2)), In((5,), torch.bool, "bool"))),
    Case("index_put_runtime_mask_int", lambda x: x.index_put((x > 0,), torch.tensor(9)), (In((6,), I64, "int"),)),
    Case("index_put_runtime_mask_dynamic", lambda x: x.index_put((x < 0,), torch.tensor(0.0)), (In((3, 2)),),
         dynamic=({0: Dim("n", max=32)},), run_shapes=(((3, 2),), ((7, 2),))),
]


def _setitem_dim1(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[:, m] = 3.0
    return y


def _setitem(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    y[y < 0] = 0.0
    return y


# repeat_interleave: int repeats (decomposed to expand) and constant tensor repeats (folded at export)
CASES += [
    Case("repeat_interleave_int", lambda x: x.repeat_interleave(3, 1), (In((2, 3)),)),
    Case("repeat_interleave_int_flat", lambda x: x.repeat_interleave(2), (In((2, 3)),)),
    Case("repeat_interleave_int_i64", lambda x: torch.repeat_interleave(x, 2, 0), (In((3,), I64, "int"),)),
    Case("repeat_interleave_const", lambda x: x.repeat_interleave(torch.tensor([1, 0, 3]), 0), (In((3, 2)),)),
    Case("repeat_interleave_const_dim1", lambda x: x.repeat_interleave(torch.tensor([2, 1, 1, 0]), 1),
         (In((2, 4), BF16),)),
    Case("repeat_interleave_indices", lambda x: x + torch.repeat_interleave(torch.tensor([2, 3])), (In((5,), I64,
                                                                                                      "int"),)),
    Case("repeat_interleave_dynamic", lambda x: x.repeat_interleave(2, 0), (In((3, 2)),),
         dynamic=({0: Dim("n", max=32)},), run_shapes=(((3, 2),), ((6, 2),))),
    Case("repeat_interleave_noncontig", lambda x: x.repeat_interleave(2, 0), (In((3, 4), noncontiguous=True),)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_scatter(case: Case, backend: str) -> None:
    check(case, backend)


def test_scatter_table_size() -> None:
    assert len(CASES) >= 70


def test_runtime_repeat_counts_are_refused() -> None:
    with pytest.raises(UnsupportedOpsError, match="repeat_interleave"):
        kiln.export(FnModule(lambda x, r: x.repeat_interleave(r, 0)), (torch.randn(3, 2), torch.tensor([1, 2, 0])))
