"""`kiln ops` and the coverage table behind it: every Core ATen op has a status, and coverage cannot regress."""

from __future__ import annotations

import contextlib
import io
import json

import torch

import kiln
from kiln.cli import main
from kiln.export.coverage import NOT_APPLICABLE_STATUS, NOT_YET, SUPPORTED, classify, core_coverage, core_ops

ALLOWED_NOT_YET = {
    "aten._fft_r2c.default": "needs complex dtypes, which the kiln format does not have",
    "aten._fft_c2r.default": "needs complex dtypes, which the kiln format does not have",
}
"""Inference ops allowed to be 'not yet', each with the reason. An op missing from here that is not yet supported
fails the test below: adding one needs a justification in review, so coverage cannot regress silently."""


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["ops", *argv])
    return code, out.getvalue()


def test_every_inference_op_is_supported_or_allowed() -> None:
    not_yet = {s.name: s.reason for s in core_coverage() if s.status == NOT_YET}
    unexpected = {name: reason for name, reason in not_yet.items() if name not in ALLOWED_NOT_YET}
    assert not unexpected, f"Core ATen inference ops without a lowering (add one, or justify in ALLOWED_NOT_YET): " \
                           f"{unexpected}"


def test_allow_list_is_not_stale() -> None:
    """An allowed op that became supported must leave the allow-list, so the list stays the true gap."""
    status = {s.name: s.status for s in core_coverage()}
    stale = [name for name in ALLOWED_NOT_YET if status.get(name) != NOT_YET]
    assert not stale, f"supported now (or no longer a core op): remove from ALLOWED_NOT_YET: {stale}"


def test_every_core_op_has_a_status_and_reason() -> None:
    statuses = core_coverage()
    assert len(statuses) == len(core_ops()) > 150
    assert len({s.name for s in statuses}) == len(statuses)
    for s in statuses:
        assert s.status in (SUPPORTED, NOT_YET, NOT_APPLICABLE_STATUS) and s.reason, s


def test_not_applicable_reasons_by_pattern() -> None:
    aten = torch.ops.aten
    cases = {aten.convolution_backward.default: "backward", aten.rand.default: "random",
             aten.native_dropout.default: "dropout", aten._local_scalar_dense.default: "data-dependent",
             aten.atan2.out: "out=", aten.resize_.default: "in-place"}
    for op, word in cases.items():
        s = classify(op)
        assert s.status == NOT_APPLICABLE_STATUS and word in s.reason, s
    assert classify(aten.add.Tensor).status == SUPPORTED
    assert classify(aten.sym_size.int).status == SUPPORTED


def test_sym_size_is_a_shape_expression() -> None:
    """The claim behind sym_size being 'supported': a graph that reads a dynamic size exports and runs."""
    class M(torch.nn.Module):
        def forward(self, x):
            return x.reshape(x.shape[0] * x.shape[1]) + x.numel()

    dim = torch.export.Dim("n", max=32)
    program = kiln.export(M(), (torch.randn(3, 4),), dynamic_shapes=({0: dim},)).load()
    x = torch.randn(5, 4)
    (got,) = program.session("cpu").run("forward", x.numpy())
    torch.testing.assert_close(torch.from_numpy(got), M()(x))


def test_cli_table_and_counts() -> None:
    code, text = _cli()
    assert code == 0
    assert "aten.add.Tensor" in text and "aten.linear.default" in text  # core and non-core sections
    last = text.strip().splitlines()[-1]
    assert last.startswith("Core ATen:") and "supported" in last and "not applicable" in last


def test_cli_missing_shows_only_not_yet() -> None:
    code, text = _cli("--missing")
    assert code == 0
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("  ")]
    assert set(rows) == {s.name for s in core_coverage() if s.status == NOT_YET}


def test_cli_json() -> None:
    code, text = _cli("--json")
    assert code == 0
    info = json.loads(text)
    assert sum(info["counts"].values()) == len(info["core"])
    assert {"name", "status", "reason", "core"} <= set(info["core"][0])
    assert any(s["name"] == "aten.scaled_dot_product_attention.default" for s in info["non_core"])
    code, text = _cli("--json", "--missing")
    assert all(s["status"] == NOT_YET for s in json.loads(text)["core"])
