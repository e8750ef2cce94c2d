"""Group norm (native_group_norm), instance norm and batch norm over batch statistics (_native_batch_norm_legit
without running stats), over the float dtypes, with and without affine parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.harness import Case, In, check

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
LOW_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""A normalized value is about 1, so one rounding of the float32 result to half is about one unit in the last place
of 1: 1e-3 (float16) and 8e-3 (bfloat16); the margin covers eager computing the statistics differently."""

CASES: list[Case] = []
for dt in FLOATS:
    s = str(dt)[6:]
    tol = LOW_TOL.get(dt)
    CASES += [
        Case(f"group_norm_{s}", lambda x, w, b: F.group_norm(x, 2, w, b), (In((2, 4, 3, 3), dt), In((4,), dt),
                                                                          In((4,), dt)), tol=tol),
        Case(f"group_norm_noaffine_{s}", lambda x: F.group_norm(x, 3, eps=1e-3), (In((2, 6, 5), dt),), tol=tol),
        Case(f"instance_norm_{s}", F.instance_norm, (In((2, 3, 4, 4), dt),), tol=tol),
    ]
CASES += [
    Case("group_norm_one_group", lambda x: F.group_norm(x, 1), (In((3, 4, 2, 2)),)),
    Case("group_norm_per_channel", lambda x, w: F.group_norm(x, 4, w), (In((2, 4, 6)), In((4,)))),
    Case("group_norm_3d", lambda x, w, b: F.group_norm(x, 2, w, b), (In((1, 4, 2, 3, 3)), In((4,)), In((4,)))),
    Case("group_norm_2d_input", lambda x: F.group_norm(x, 2), (In((3, 4)),)),
    Case("group_norm_noncontig", lambda x: F.group_norm(x, 2), (In((4, 4, 3, 2), noncontiguous=True),)),
    Case("group_norm_special", lambda x: F.group_norm(x, 2), (In((1, 4, 3), fill="special"),)),
    Case("group_norm_module", torch.nn.GroupNorm(2, 6).eval(), (In((2, 6, 4, 4)),)),
    Case("group_norm_dynamic_batch", lambda x: F.group_norm(x, 2), (In((2, 4, 3, 3)),),
         dynamic=({0: torch.export.Dim("b", max=16)},), run_shapes=(((2, 4, 3, 3),), ((5, 4, 3, 3),))),
    Case("group_norm_dynamic_spatial", lambda x: F.group_norm(x, 2), (In((2, 4, 6)),),
         dynamic=({2: torch.export.Dim("t", max=64)},), run_shapes=(((2, 4, 6),), ((2, 4, 13),)),
         extra={"min_torch": ((2, 13), "2.11 guards min(t, 2*t) == t and calls it a constraint violation")}),
    Case("instance_norm_affine", lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
         (In((2, 3, 5, 5)), In((3,)), In((3,)))),
    Case("instance_norm_1d", F.instance_norm, (In((2, 3, 7)),)),
    Case("instance_norm_noncontig", F.instance_norm, (In((4, 3, 5), noncontiguous=True),)),
    Case("instance_norm_module", torch.nn.InstanceNorm2d(3, affine=True).eval(), (In((2, 3, 4, 4)),)),
    Case("batch_norm_batch_stats", lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True, eps=1e-4),
         (In((3, 4, 5)), In((4,)), In((4,)))),
    Case("batch_norm_batch_stats_noaffine", lambda x: F.batch_norm(x, None, None, training=True),
         (In((2, 3, 4, 4)),)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_norm_extra(case: Case, backend: str) -> None:
    check(case, backend)
