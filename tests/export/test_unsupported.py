"""A model with ops kiln cannot lower fails export with one UnsupportedOpsError that lists all of them, each with
its count, the reason and the user's source line, and writes nothing."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import UnsupportedOpsError
from kiln.export.lower import HANDLERS

aten = torch.ops.aten
UNLOWERED = {"aten._fft_r2c.default": aten._fft_r2c.default, "aten._linalg_det.default": aten._linalg_det.default}


def line_of(fn, marker: str) -> int:
    """The line in this file where `marker` appears inside `fn`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


class Unexportable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        spectrum = torch.fft.rfft(h).abs()  # marker:fft-1
        spectrum2 = torch.fft.rfft(h * 2).abs()  # marker:fft-2
        det = torch.linalg.det(h[:, :4].reshape(-1, 2, 2))  # marker:det
        wide = h.to(torch.complex64).real  # marker:complex
        return spectrum.sum() + spectrum2.sum() + det.sum() + wide.sum()


def test_ops_under_test_have_no_lowering():
    """If someone adds one of these lowerings, pick another unlowered op for this test."""
    assert not [name for name, op in UNLOWERED.items() if op in HANDLERS]


def test_every_unsupported_op_is_reported_once_with_count_reason_and_source(tmp_path):
    target = tmp_path / "model.kiln"
    with pytest.raises(UnsupportedOpsError) as info:
        kiln.export(Unexportable(), (torch.randn(4, 8),)).save(target)
    error = info.value
    by_target = {op.target: op for op in error.ops}
    this_file = __file__
    forward = Unexportable.forward

    fft = by_target["aten._fft_r2c.default"]
    assert fft.count == 2
    assert fft.reason == "no lowering for this op yet"
    assert fft.source.startswith(f"{this_file}:{line_of(forward, 'marker:fft-1')} in forward:")
    assert "torch.fft.rfft(h)" in fft.source
    # both places are kept, in order: the message names each line to change
    assert [place.split(" in ")[0] for place in fft.sources] == [
        f"{this_file}:{line_of(forward, 'marker:fft-1')}", f"{this_file}:{line_of(forward, 'marker:fft-2')}"]

    det = by_target["aten._linalg_det.default"]
    assert det.count == 1
    assert det.source.startswith(f"{this_file}:{line_of(forward, 'marker:det')} in forward:")

    # a handler that exists but refuses the node says why
    complex_ops = [op for op in error.ops if "complex" in op.reason]
    assert complex_ops, error.ops
    assert all(op.source.startswith(f"{this_file}:{line_of(forward, 'marker:complex')}") for op in complex_ops)

    assert len(error.ops) >= 3
    assert len({(op.target, op.reason) for op in error.ops}) == len(error.ops)  # grouped: one entry per op/reason
    message = str(error)
    assert message.startswith(f"cannot export: {len(error.ops)} unsupported op(s); nothing was written.")
    assert "aten._fft_r2c.default (x2): no lowering for this op yet" in message
    assert f"at {this_file}:{line_of(forward, 'marker:fft-1')} in forward" in message
    assert f"at {this_file}:{line_of(forward, 'marker:fft-2')} in forward" in message
    assert "aten._linalg_det.default (x1)" in message
    assert "add a lowering" in message
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_supported_part_alone_exports(tmp_path):
    """The same model minus the unsupported calls exports, so the failure above is about those ops."""

    class Supported(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x).abs().sum()

    path = kiln.export(Supported(), (torch.randn(4, 8),)).save(tmp_path / "ok.kiln")
    assert path.exists()
