"""View and shape ops, including symbolic (dynamic) shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.ops.harness import Case, In, check

Dim = torch.export.Dim
CASES = [
    Case("view", lambda x: x.view(6, 4), (In((2, 3, 4)),)),
    Case("reshape_noncontig", lambda x: x.reshape(-1), (In((3, 4), noncontiguous=True),)),
    Case("flatten", lambda x: x.flatten(1), (In((2, 3, 4)),)),
    Case("permute", lambda x: x.permute(2, 0, 1), (In((2, 3, 4)),)),
    Case("transpose", lambda x: x.transpose(-1, -2), (In((2, 3, 4)),)),
    Case("t", lambda x: x.t(), (In((3, 4)),)),
    Case("expand", lambda x: x.expand(3, 4, 5), (In((4, 1)),)),
    Case("expand_int", lambda x: x.expand(2, 5), (In((5,), torch.int64, "int"),)),
    Case("squeeze", lambda x: x.squeeze(1), (In((3, 1, 4)),)),
    Case("squeeze_all", lambda x: x.squeeze(), (In((1, 3, 1, 4)),)),
    Case("unsqueeze", lambda x: x.unsqueeze(-1), (In((3, 4)),)),
    Case("slice", lambda x: x[1:3], (In((5, 4)),)),
    Case("slice_step", lambda x: x[:, ::2], (In((5, 7)),)),
    Case("slice_negative", lambda x: x[:, -3:], (In((5, 7)),)),
    Case("slice_clamped", lambda x: x[:, 2:100], (In((5, 7)),)),
    Case("select", lambda x: x[:, 1], (In((5, 7)),)),
    Case("select_negative", lambda x: x[-1], (In((5, 7)),)),
    Case("narrow", lambda x: x.narrow(1, 2, 3), (In((5, 7)),)),
    Case("cat", lambda a, b: torch.cat([a, b], 1), (In((2, 3)), In((2, 5)))),
    Case("cat_promote", lambda a, b: torch.cat([a, b]), (In((2, 3), torch.int64, "int"), In((2, 3)))),
    Case("stack", lambda a, b: torch.stack([a, b], -1), (In((2, 3)), In((2, 3)))),
    Case("split", lambda x: x.split(2, 1), (In((3, 7)),)),
    Case("split_sizes", lambda x: x.split([1, 4, 2], 1), (In((3, 7)),)),
    Case("chunk", lambda x: x.chunk(3, 0), (In((6, 2)),)),
    Case("unbind", lambda x: x.unbind(1), (In((2, 3, 2)),)),
    Case("flip", lambda x: x.flip(0, 2), (In((2, 3, 4)),)),
    Case("pad_constant", lambda x: F.pad(x, (1, 2, 0, 1), value=0.5), (In((2, 3, 4)),)),
    Case("pad_crop", lambda x: F.pad(x, (-1, 2)), (In((2, 3, 4)),)),
    Case("pad_reflect", lambda x: F.pad(x, (2, 1), mode="reflect"), (In((2, 3, 5)),)),
    Case("pad_replicate", lambda x: F.pad(x, (2, 1, 1, 1), mode="replicate"), (In((1, 2, 3, 5)),)),
    Case("tril", lambda x: torch.tril(x), (In((4, 5)),)),
    Case("triu_diag", lambda x: torch.triu(x, 1), (In((2, 4, 5)),)),
    Case("repeat", lambda x: x.repeat(2, 3), (In((2, 3)),)),
    Case("roll", lambda x: torch.roll(x, 2, 1), (In((2, 5)),)),
    Case("contiguous_f16", lambda x: x.transpose(0, 1).contiguous(), (In((3, 4), torch.float16),)),
    Case("view_bool", lambda x: x.view(-1), (In((3, 4), torch.bool, "bool"),)),
    Case("dyn_view", lambda x: x.view(x.shape[0], 2, 2), (In((3, 4)),), dynamic=({0: Dim("n", max=32)},),
         run_shapes=(((3, 4),), ((7, 4),))),
    Case("dyn_flatten", lambda x: x.flatten(), (In((3, 4)),), dynamic=({0: Dim("n", max=32)},),
         run_shapes=(((3, 4),), ((5, 4),))),
    Case("dyn_slice_last", lambda x: x[-1:], (In((3, 4)),), dynamic=({0: Dim("n", max=32)},),
         run_shapes=(((3, 4),), ((6, 4),))),
    Case("dyn_slice_negative", lambda x: x[:, -2:], (In((4, 3)),), dynamic=({1: Dim("n", min=3, max=32)},),
         run_shapes=(((4, 3),), ((4, 9),))),
    Case("dyn_cat", lambda a, b: torch.cat([a, b], 0), (In((3, 4)), In((2, 4))),
         dynamic=({0: Dim("n", max=32)}, {0: Dim("m", max=32)}), run_shapes=(((3, 4), (2, 4)), ((5, 4), (7, 4)))),
    Case("dyn_expand", lambda x, y: x.expand(y.shape[0], 4) + y, (In((1, 4)), In((3, 4))),
         dynamic=(None, {0: Dim("n", max=32)}), run_shapes=(((1, 4), (3, 4)), ((1, 4), (8, 4)))),
    Case("dyn_transpose", lambda x: x.transpose(0, 1) * 2, (In((3, 4)),), dynamic=({0: Dim("n", max=32)},),
         run_shapes=(((3, 4),), ((6, 4),))),
]

SHAPE_OPS = {
    "view": (lambda x: x.view(4, 6), (2, 3, 4)),
    "permute": (lambda x: x.permute(1, 2, 0), (2, 3, 4)),
    "expand": (lambda x: x.expand(2, 3, 4), (3, 1)),
    "slice": (lambda x: x[:, 1::2], (3, 6)),
    "select": (lambda x: x[1], (3, 6)),
    "cat": (lambda x: torch.cat([x, x.flip(0)], 1), (3, 4)),
    "flip": (lambda x: x.flip(-1), (3, 4)),
    "pad": (lambda x: F.pad(x, (1, 1)), (3, 4)),
    "tril": (lambda x: torch.tril(x, -1), (4, 4)),
    "split": (lambda x: x.split(2, 1), (3, 5)),
    "unsqueeze": (lambda x: x.unsqueeze(0), (3, 4)),
    "transpose": (lambda x: x.transpose(0, 1), (3, 4)),
    "repeat": (lambda x: x.repeat(1, 2), (3, 4)),
    "roll": (lambda x: x.roll(1, 0), (3, 4)),
}
DTYPE_FILL = {torch.float16: "randn", torch.bfloat16: "randn", torch.int64: "int", torch.int32: "int",
              torch.bool: "bool", torch.uint8: "index:200"}
for name, (fn, shape) in SHAPE_OPS.items():
    for dt, fill in DTYPE_FILL.items():
        if name == "pad" and dt == torch.bool:
            continue
        CASES.append(Case(f"{name}_{str(dt)[6:]}", fn, (In(shape, dt, fill),)))
    if name != "view":  # torch itself refuses .view of a non-contiguous tensor
        CASES.append(Case(f"{name}_noncontig", fn, (In(shape, noncontiguous=True),)))
CASES += [
    Case("reshape_0d", lambda x: x.reshape(1, 1), (In(()),)),
    Case("reshape_empty", lambda x: x.reshape(0, 6), (In((2, 0, 3)),)),
    Case("cat_empty", lambda a, b: torch.cat([a, b]), (In((0, 3)), In((2, 3)))),
    Case("slice_empty", lambda x: x[3:3], (In((5, 2)),)),
    Case("permute_empty", lambda x: x.permute(1, 0), (In((0, 3)),)),
    Case("expand_0d", lambda x: x.expand(2, 3), (In(()),)),
    Case("flip_0d_like", lambda x: x.flip(0), (In((1,)),)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_shape(case: Case, backend: str) -> None:
    check(case, backend)
