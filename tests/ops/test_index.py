"""Gathers, scatters, advanced indexing, embedding, and creation ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.harness import Case, In, check

Dim = torch.export.Dim
CASES = [
    Case("index_select", lambda x, i: torch.index_select(x, 1, i), (In((3, 6)), In((4,), torch.int64, "index:6"))),
    Case("gather", lambda x, i: torch.gather(x, 1, i), (In((3, 6)), In((3, 4), torch.int64, "index:6"))),
    Case("gather_smaller", lambda x, i: torch.gather(x, 0, i), (In((5, 6)), In((2, 3), torch.int64, "index:5"))),
    Case("embedding", F.embedding, (In((4, 3), torch.int64, "index:10"), In((10, 5)))),
    Case("embedding_int32", lambda i, w: F.embedding(i, w), (In((4,), torch.int32, "index:10"), In((10, 5)))),
    Case("index_tensor", lambda x, i: x[i], (In((6, 3)), In((4,), torch.int64, "index:6"))),
    Case("index_two", lambda x, i, j: x[i, j], (In((6, 5)), In((4,), torch.int64, "index:6"),
                                               In((4,), torch.int64, "index:5"))),
    Case("index_middle", lambda x, i: x[:, i], (In((2, 6, 3)), In((2, 2), torch.int64, "index:6"))),
    Case("index_negative", lambda x: x[torch.tensor([-1, 0])], (In((4, 3)),)),
    Case("index_put", lambda x, i, v: x.index_put((i,), v), (In((6, 3)), In((2,), torch.int64, "index:6"),
                                                             In((2, 3)))),
    # repeated slots (a negative one too): the last write wins, as on PyTorch's CPU, on every backend
    Case("index_put_repeated", lambda x, v: x.index_put((torch.tensor([1, 4, 1, 5, -1, 1]),), v),
         (In((6, 3)), In((6, 3)))),
    Case("index_put_accumulate", lambda x, i, v: x.index_put((i,), v, accumulate=True),
         (In((6, 3)), In((5,), torch.int64, "index:6"), In((5, 3)))),
    Case("index_copy", lambda x, i, s: x.index_copy(1, i, s), (In((3, 6)), In((2,), torch.int64, "index:3"),
                                                              In((3, 2)))),
    Case("slice_scatter", lambda x, s: torch.slice_scatter(x, s, 1, 1, 5, 2), (In((3, 6)), In((3, 2)))),
    Case("select_scatter", lambda x, s: torch.select_scatter(x, s, 0, 1), (In((3, 6)), In((6,)))),
    Case("setitem", lambda x, s: x.clone().index_fill(0, torch.tensor([1]), 0.0) + s, (In((3, 4)), In((4,)))),
    Case("scatter", lambda x, i, s: torch.scatter(x, 1, i, s), (In((3, 6)), In((3, 2), torch.int64, "index:6"),
                                                               In((3, 2)))),
    Case("scatter_add", lambda x, i, s: torch.scatter_add(x, 0, i, s), (In((4, 3)), In((6, 3), torch.int64, "index:4"),
                                                                       In((6, 3)))),
    Case("scatter_value", lambda x, i: torch.scatter(x, 1, i, 2.0), (In((3, 6)), In((3, 2), torch.int64, "index:6"))),
    Case("arange", lambda x: x + torch.arange(5), (In((5,)),)),
    Case("arange_step", lambda x: x + torch.arange(1, 11, 2, dtype=torch.float32), (In((5,)),)),
    Case("arange_float", lambda x: x + torch.arange(0.0, 1.0, 0.25), (In((4,)),)),
    Case("arange_dynamic", lambda x: x * torch.arange(x.shape[0]), (In((5,)),), dynamic=({0: Dim("n", max=64)},),
         run_shapes=(((5,),), ((12,),))),
    Case("full", lambda x: x + torch.full((2, 3), 1.5), (In((2, 3)),)),
    Case("zeros_like", lambda x: torch.zeros_like(x) + x, (In((2, 3)),)),
    Case("ones_int", lambda x: torch.ones(3, dtype=torch.int64) + x, (In((3,), torch.int64, "int"),)),
    Case("full_like_bool", lambda x: torch.full_like(x, True, dtype=torch.bool) & (x > 0), (In((2, 3)),)),
    Case("new_zeros_dynamic", lambda x: x.new_zeros(x.shape[0], 2) + 1, (In((3, 4)),),
         dynamic=({0: Dim("n", max=32)},), run_shapes=(((3, 4),), ((6, 4),))),
    Case("scalar_tensor", lambda x: x + torch.scalar_tensor(3.0), (In((2,)),)),
    Case("causal_mask", lambda x: x.masked_fill(torch.triu(torch.ones(4, 4, dtype=torch.bool), 1), float("-inf")),
         (In((4, 4)),)),
    Case("one_hot", lambda i: F.one_hot(i, 5), (In((4,), torch.int64, "index:5"),)),
]

GATHERS = {
    "index_select": (lambda x, i: torch.index_select(x, 0, i), (5, 3), (4,), 5),
    "gather": (lambda x, i: torch.gather(x, 1, i), (3, 6), (3, 4), 6),
    "embedding": (lambda x, i: F.embedding(i, x), (10, 4), (2, 3), 10),
    "index": (lambda x, i: x[:, i], (3, 6), (2,), 6),
    "index_put": (lambda x, i: x.index_put((i,), x[:2] * 2), (5, 3), (2,), 5),
    "index_copy": (lambda x, i: x.index_copy(0, i, x[:2]), (5, 3), (2,), 2),
}
for name, (fn, xshape, ishape, high) in GATHERS.items():
    for dt, fill in {torch.float16: "randn", torch.bfloat16: "randn", torch.int64: "int", torch.int32: "int",
                     torch.bool: "bool"}.items():
        if dt == torch.bool and name == "index_put":
            continue
        CASES.append(Case(f"{name}_{str(dt)[6:]}", fn,
                          (In(xshape, dt, fill), In(ishape, torch.int64, f"index:{high}"))))
    if name in ("index_select", "embedding", "index"):
        CASES.append(Case(f"{name}_int32_index", fn, (In(xshape), In(ishape, torch.int32, f"index:{high}"))))
    CASES.append(Case(f"{name}_noncontig", fn, (In(xshape, noncontiguous=True), In(ishape, torch.int64,
                                                                                    f"index:{high}"))))
CASES += [
    Case("slice_scatter_dynamic", lambda x, s: torch.slice_scatter(x, s, 0, 0, s.shape[0]), (In((8, 3)), In((2, 3))),
         dynamic=(None, {0: Dim("n", max=8)}), run_shapes=(((8, 3), (2, 3)), ((8, 3), (5, 3)))),
    Case("index_copy_dynamic", lambda x, i, s: x.index_copy(0, i, s), (In((8, 3)), In((2,), torch.int64, "index:8"),
                                                                      In((2, 3))),
         dynamic=(None, {0: Dim("n", max=8)}, {0: Dim("n", max=8)}),
         run_shapes=(((8, 3), (2,), (2, 3)), ((8, 3), (1,), (1, 3)))),
    Case("embedding_dynamic", lambda i, w: F.embedding(i, w), (In((1, 4), torch.int64, "index:10"), In((10, 3))),
         dynamic=({1: Dim("t", max=32)}, None), run_shapes=(((1, 4), (10, 3)), ((1, 9), (10, 3)))),
    Case("arange_dynamic_step", lambda x: x + torch.arange(0, 2 * x.shape[0], 2), (In((4,)),),
         dynamic=({0: Dim("n", max=32)},), run_shapes=(((4,),), ((7,),))),
    Case("full_f16", lambda x: x + torch.full((3,), 0.5, dtype=torch.float16), (In((3,), torch.float16),)),
    Case("full_bf16", lambda x: x + torch.full((3,), 0.5, dtype=torch.bfloat16), (In((3,), torch.bfloat16),)),
    Case("zeros_0d", lambda x: x + torch.zeros(()), (In(()),)),
    Case("ones_empty", lambda x: torch.ones(0, 3) + x, (In((3,)),)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_index(case: Case, backend: str) -> None:
    check(case, backend)
