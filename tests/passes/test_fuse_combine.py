"""fuse_combine: a mixture-of-experts layer's weighted sum of each token's k expert rows folded into the down
projection's gathered_linear (its combine input), float and quantized, on every backend against eager PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export import Quantize, export
from kiln.runtime.backends.array_api import BFLOAT16
from tests.conftest import to_numpy

EXPERTS, N, K, TOP = 6, 24, 64, 3
NUMPY = {torch.float32: np.float32, torch.bfloat16: BFLOAT16}


class Down(torch.nn.Module):
    """transformers' batched_mm experts after the activation: each routed row through its expert, weighted by the
    router, summed per token."""

    def __init__(self, bias: bool, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(5)
        self.weight = torch.nn.Parameter((torch.randn(EXPERTS, N, K) / K ** 0.5).to(dtype))
        self.bias = torch.nn.Parameter(torch.randn(EXPERTS, N).to(dtype)) if bias else None

    def forward(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = torch.bmm(self.weight[flat], h.unsqueeze(-1)).squeeze(-1)
        if self.bias is not None:
            rows = rows + self.bias[flat]
        rows = rows * weights.reshape(-1, 1)
        return rows.reshape(ids.shape[0], TOP, N).sum(dim=1)


def _export(module: Down, dtype: torch.dtype, quantize: Quantize | None = None):
    tokens = torch.export.Dim("tokens", min=1, max=32)
    args = (torch.randn(2 * TOP, K, dtype=dtype), torch.tensor([[0, 3, 5], [3, 1, 0]]),
            torch.rand(2, TOP, dtype=dtype))
    return export(module, args, dynamic_shapes=({0: tokens * TOP}, {0: tokens}, {0: tokens}), quantize=quantize)


def _inputs(tokens: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens * TOP, K, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP, generator=g).to(dtype)
    return h, ids, weights


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(NUMPY[t.dtype]) if t.is_floating_point() else t.numpy()


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_combine_folds_into_the_gathered_linear_and_matches_eager(bias, dtype, backend):
    module = Down(bias, dtype)
    builder = _export(module, dtype)
    nodes = builder.methods["forward"].nodes
    ops = [n.op for n in nodes]
    assert ops.count("gathered_linear") == 1 and "sum" not in ops and "mul" not in ops, ops
    [node] = [n for n in nodes if n.op == "gathered_linear"]
    assert len(node.inputs) == 5 and node.inputs[4] >= 0
    session = builder.load().session(backend)
    for tokens, seed in ((1, 0), (2, 1), (20, 2)):  # decode steps, and a prompt's rows (the grouped path)
        h, ids, weights = _inputs(tokens, seed, dtype)
        with torch.no_grad():
            want = module(h, ids, weights).float().numpy()
        got = to_numpy(session.run("forward", _numpy(h), _numpy(ids), _numpy(weights))[0]).astype(np.float32)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_quantized_experts_take_the_combine_too(backend, monkeypatch):
    monkeypatch.setenv("KILN_QUANT_DOT", "float")
    module = Down(True, torch.float32)
    builder = _export(module, torch.float32, Quantize("int8"))
    [node] = [n for n in builder.methods["forward"].nodes if n.op.startswith("gathered")]
    assert node.op == "gathered_quantized_linear" and len(node.inputs) == 7 and node.inputs[6] >= 0
    session = builder.load().session(backend)
    h, ids, weights = _inputs(4, 3, torch.float32)
    with torch.no_grad():
        want = module(h, ids, weights).numpy()
    got = to_numpy(session.run("forward", h.numpy(), ids.numpy(), weights.numpy())[0])
    np.testing.assert_allclose(got, want, rtol=0.02, atol=0.02 * np.abs(want).max())  # (int8 weights)


class SumReadElsewhere(Down):
    """The weighted rows are an output too: nothing folds."""

    def forward(self, h, ids, weights):
        flat = ids.reshape(-1)
        rows = torch.bmm(self.weight[flat], h.unsqueeze(-1)).squeeze(-1) * weights.reshape(-1, 1)
        return rows.reshape(ids.shape[0], TOP, N).sum(dim=1), rows


def test_rows_read_elsewhere_are_left_alone():
    ops = [n.op for n in _export(SumReadElsewhere(False, torch.float32), torch.float32).methods["forward"].nodes]
    assert "sum" in ops and "mul" in ops and "gathered_linear" in ops
