"""Export of careless models: every unsupported op reported at once (lowering goes on past one), a size that depends
on tensor data refused at export with its source line (never a file `kiln.load` then rejects), and strict
torch.export tried where non-strict capture fails inside torch."""

from __future__ import annotations

import inspect
import logging

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.errors import DATA_DEPENDENT, InputError, TorchExportError, UnsupportedOpsError
from kiln.export.lower import HANDLERS

aten = torch.ops.aten
THIS_FILE = __file__


def line_of(fn, marker: str) -> int:
    """The line in this file where `marker` appears inside `fn`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def at(fn, marker: str) -> str:
    """How a failure's source begins for the line of `fn` that holds `marker`."""
    return f"{THIS_FILE}:{line_of(fn, marker)} in {fn.__name__}:"


def export_error(model: nn.Module, args: tuple, tmp_path, **options) -> UnsupportedOpsError:
    """The UnsupportedOpsError that exporting `model` raises; asserts that no file was written."""
    with pytest.raises(UnsupportedOpsError) as info:
        kiln.export(model, args, **options).save(tmp_path / "model.kiln")
    assert list(tmp_path.iterdir()) == []
    return info.value


# ---- every unsupported op at once ----

class Chain(nn.Module):
    """Unsupported ops that feed each other: lgamma -> digamma -> det (a tuple result) -> cholesky_ex."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.lgamma(self.proj(x).abs() + 1)  # marker:lgamma
        h = torch.digamma(h + 1)  # marker:digamma
        det = torch.linalg.det(h.reshape(-1, 2, 2))  # marker:det
        spd = h.reshape(-1, 2, 2) @ h.reshape(-1, 2, 2).transpose(1, 2) + det[:, None, None]
        return torch.linalg.cholesky_ex(spd)[0].sum() + torch.lgamma(det).sum()  # marker:last


CHAIN_OPS = {"aten.lgamma.default": aten.lgamma.default, "aten.digamma.default": aten.digamma.default,
             "aten._linalg_det.default": aten._linalg_det.default,
             "aten.linalg_cholesky_ex.default": aten.linalg_cholesky_ex.default}


def test_chain_ops_have_no_lowering():
    """If someone adds one of these lowerings, pick another unlowered op for the tests below."""
    assert not [name for name, op in CHAIN_OPS.items() if op in HANDLERS]


def test_every_op_of_a_chain_is_reported_not_only_the_first(tmp_path):
    error = export_error(Chain(), (torch.randn(4, 8),), tmp_path)
    by_target = {op.target: op for op in error.ops}
    assert set(by_target) == set(CHAIN_OPS), error
    forward = Chain.forward
    assert by_target["aten.digamma.default"].source.startswith(at(forward, "marker:digamma"))
    assert by_target["aten._linalg_det.default"].source.startswith(at(forward, "marker:det"))
    assert by_target["aten.linalg_cholesky_ex.default"].source.startswith(at(forward, "marker:last"))
    # lgamma twice: once on the first line, once on the last, after two other unsupported ops
    lgamma = by_target["aten.lgamma.default"]
    assert lgamma.count == 2
    assert [s.split(" in ")[0] for s in lgamma.sources] == [
        f"{THIS_FILE}:{line_of(forward, 'marker:lgamma')}", f"{THIS_FILE}:{line_of(forward, 'marker:last')}"]
    message = str(error)
    assert message.startswith("cannot export: 4 unsupported op(s); nothing was written.")
    assert "aten.lgamma.default (x2): no lowering for this op yet" in message
    assert f"at {at(forward, 'marker:lgamma')}" in message and f"at {at(forward, 'marker:last')}" in message


class ManyPlaces(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = torch.lgamma(x.abs() + 1)  # marker:loop
        return torch.digamma(x) + torch.lgamma(x) + torch.lgamma(x * 2) + torch.lgamma(x * 3)  # marker:tail


def test_many_places_of_one_op_are_counted_and_the_message_stays_short(tmp_path):
    error = export_error(ManyPlaces(), (torch.randn(3),), tmp_path)
    (lgamma,) = [op for op in error.ops if op.target == "aten.lgamma.default"]
    assert lgamma.count == 8
    assert len(lgamma.sources) == 2  # one line in the loop and the last line: distinct places, not calls
    lines = str(error).splitlines()
    assert len(lines) < 12, str(error)
    assert any("digamma" in line for line in lines)


# ---- sizes that depend on tensor data ----

class ItemSize(nn.Module):
    """A size read from tensor data with .item(): torch.export names it u0; no input shape gives it."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        count = n.max().item()  # marker:item
        torch._check(count >= 0)
        torch._check(count <= 16)
        return torch.arange(count) * 2  # marker:arange


def test_item_size_is_refused_at_export_with_its_source_lines(tmp_path):
    error = export_error(ItemSize(), (torch.randn(3), torch.tensor([2, 5, 1])), tmp_path)
    dependent = [op for op in error.ops if op.reason.startswith(DATA_DEPENDENT)]
    # the op that brings the size in, not the `* 2` that only carries it on
    assert [op.target for op in dependent] == ["aten.arange.start_step"], error
    forward = ItemSize.forward
    assert dependent[0].source.startswith(at(forward, "marker:arange")), dependent
    # and the reason names where the size comes from: the .item() line
    assert f"u0 from tensor.item() (aten._local_scalar_dense.default) at {at(forward, 'marker:item')}" in \
        dependent[0].reason
    assert "tensor.item()" in str(error)  # the hint says what to do instead


class NonzeroCount(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = torch.nonzero(x > 0).shape[0]  # marker:nonzero
        return torch.ones(k) * x.sum()  # marker:ones


def test_nonzero_count_is_refused_at_export(tmp_path):
    error = export_error(NonzeroCount(), (torch.randn(6),), tmp_path)
    forward = NonzeroCount.forward
    by_target = {op.target: op for op in error.ops}
    assert "nonzero_static" in by_target["aten.nonzero.default"].reason
    dependent = [op for op in error.ops if op.reason.startswith(DATA_DEPENDENT)]
    assert [op.target for op in dependent] == ["aten.full.default"], error
    assert dependent[0].source.startswith(at(forward, "marker:ones"))
    assert f"from aten.nonzero.default at {at(forward, 'marker:nonzero')}" in dependent[0].reason


class ShapeSize(nn.Module):
    """A size from an input's shape: the runtime binds it, so this must export and run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.arange(x.shape[0], dtype=x.dtype)


def test_size_from_an_input_shape_still_exports_and_runs():
    seq = torch.export.Dim("seq", min=1, max=32)
    program = kiln.export(ShapeSize(), (torch.randn(5),), dynamic_shapes={"x": {0: seq}}).load()
    x = np.random.default_rng(0).standard_normal(7).astype(np.float32)
    out = program.session().run("forward", x)[0]
    np.testing.assert_allclose(np.asarray(out), x * np.arange(7), rtol=1e-6)


def test_export_uses_the_loaders_symbol_rule(tmp_path, monkeypatch):
    """The check at export is the loader's own rule: with the rule switched off, the data-dependent size goes
    unnoticed (so the test above fails for the right reason, not by accident of some other check)."""
    import kiln.export.data_dependent as data_dependent

    monkeypatch.setattr(data_dependent, "_check_symbols_bindable", lambda method, where: None)
    try:
        kiln.export(ItemSize(), (torch.randn(3), torch.tensor([2, 5, 1])))
    except UnsupportedOpsError as e:
        assert not [op for op in e.ops if op.reason.startswith(DATA_DEPENDENT)], e


# ---- strict export where non-strict fails ----

class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


def _export_failing(monkeypatch, fail_strict: bool, error: Exception) -> list[bool]:
    """Make torch.export.export raise `error` when non-strict (and when strict too, if `fail_strict`); returns
    the list of `strict` flags it is called with."""
    real = torch.export.export
    calls: list[bool] = []

    def export(*args, strict: bool = False, **kwargs):
        calls.append(strict)
        if not strict or fail_strict:
            raise error
        return real(*args, strict=strict, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    return calls


def test_strict_export_is_tried_when_non_strict_fails(monkeypatch, caplog):
    torch.manual_seed(0)
    model = Small().eval()
    calls = _export_failing(monkeypatch, False, RuntimeError("non-strict tracing broke inside torch"))
    with caplog.at_level(logging.WARNING, logger="kiln.export.capture"):
        program = kiln.export(model, (torch.randn(2, 4),)).load()
    assert calls == [False, True]
    assert "non-strict torch.export of Small failed" in caplog.text
    assert "non-strict tracing broke inside torch" in caplog.text and "trying strict export" in caplog.text
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(np.asarray(program.session().run("forward", x)[0]), expected, rtol=1e-5, atol=1e-6)


def test_both_failures_are_shown_concisely(monkeypatch):
    long = "first line of the torch error\n" + "\n".join(f"detail {k}" for k in range(300))
    _export_failing(monkeypatch, True, RuntimeError(long))
    with pytest.raises(TorchExportError) as info:
        kiln.export(Small(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "non-strict export failed: RuntimeError: first line of the torch error" in message
    assert "strict export (tried next) failed: RuntimeError: first line" in message
    assert "detail 200" not in message and len(message.splitlines()) < 20
    assert isinstance(info.value.non_strict, RuntimeError) and info.value.__cause__ is info.value.strict


class Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: neither kind of torch.export traces it
            return x * 2
        return x


def test_a_model_neither_export_traces_gets_both_errors():
    with pytest.raises(TorchExportError) as info:
        kiln.export(Branchy(), (torch.randn(3),))
    message = str(info.value)
    assert "non-strict export failed:" in message and "strict export (tried next) failed:" in message
    assert len(message) < 3000


def test_kiln_errors_are_not_retried(monkeypatch):
    calls = _export_failing(monkeypatch, True, InputError("a kiln error, about the model"))
    with pytest.raises(InputError):
        kiln.export(Small(), (torch.randn(2, 4),))
    assert calls == [False]
