"""linalg.vector_norm (F.normalize uses it), lowered to kiln reductions: every ord, dims, keepdim, half dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.harness import Case, In, check

INF = float("inf")
CASES = [
    Case(f"ord_{o}", lambda x, o=o: torch.linalg.vector_norm(x, ord=o), (In((3, 5)),))
    for o in (2, 1, 3, 0.5, INF, -INF, 0)
] + [
    Case("dim1_keepdim", lambda x: torch.linalg.vector_norm(x, dim=1, keepdim=True), (In((3, 5, 2)),)),
    Case("dims_neg", lambda x: torch.linalg.vector_norm(x, ord=1, dim=(-1, 0)), (In((3, 5, 2)),)),
    Case("zeros_ord0", lambda x: torch.linalg.vector_norm(torch.relu(x), ord=0, dim=1), (In((4, 6)),)),
    Case("0d", lambda x: torch.linalg.vector_norm(x), (In(()),)),
    Case("noncontig", lambda x: torch.linalg.vector_norm(x, dim=0), (In((4, 6), noncontiguous=True),)),
    Case("float16", lambda x: torch.linalg.vector_norm(x, dim=-1), (In((3, 40), torch.float16),)),
    Case("bfloat16", lambda x: torch.linalg.vector_norm(x, dim=-1), (In((3, 40), torch.bfloat16),)),
    Case("dtype_arg", lambda x: torch.linalg.vector_norm(x, dtype=torch.float64), (In((3, 5)),)),
    Case("normalize", lambda x: F.normalize(x, dim=-1), (In((3, 7)),)),
    Case("normalize_dynamic", lambda x: F.normalize(x, p=2, dim=1), (In((3, 7)),),
         dynamic=({0: torch.export.Dim("n", max=64)},), run_shapes=(((5, 7),), ((2, 7),))),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_vector_norm(case: Case, backend: str) -> None:
    check(case, backend)
