"""fuse_experts: a mixture-of-experts layer's gathered-weight products (transformers' "batched_mm" experts) as
gathered_linear nodes, float and quantized, on every backend, against eager PyTorch and the float64 definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export import Quantize, export
from kiln.export.quantize import quantize_rows
from kiln.runtime.backends.array_api.experts import expert_groups
from kiln.runtime.backends.array_api.quant import dequantize
from tests.conftest import to_numpy

EXPERTS, N, K = 6, 24, 64


class Experts(torch.nn.Module):
    """out[s] = x[s] @ W[ids[s]].T (+ b[ids[s]]), written as transformers' batched_mm writes it: the weights
    gathered by row, then a batched product; `transposed` stores W as [E, K, N] (gpt-oss)."""

    def __init__(self, transposed: bool, bias: bool):
        super().__init__()
        torch.manual_seed(3)
        self.transposed = transposed
        shape = (EXPERTS, K, N) if transposed else (EXPERTS, N, K)
        self.weight = torch.nn.Parameter(torch.randn(shape) / K ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(EXPERTS, N)) if bias else None

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        picked = self.weight[ids]
        out = (torch.bmm(x.unsqueeze(1), picked).squeeze(1) if self.transposed
               else torch.bmm(picked, x.unsqueeze(-1)).squeeze(-1))
        return out if self.bias is None else out + self.bias[ids]

    def stack(self) -> np.ndarray:
        """W as [E, N, K]."""
        w = self.weight.detach().numpy()
        return np.ascontiguousarray(w.transpose(0, 2, 1)) if self.transposed else w


def _export(module: Experts, quantize: Quantize | None = None):
    rows = torch.export.Dim("rows", min=1, max=64)
    args = (torch.randn(4, K), torch.tensor([0, 3, 3, 5]))
    return export(module, args, dynamic_shapes=({0: rows}, {0: rows}), quantize=quantize)


def _inputs(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, K)).astype(np.float32), rng.integers(0, EXPERTS, rows).astype(np.int64)


@pytest.mark.parametrize("transposed", [False, True], ids=["stacked", "transposed"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_gathered_products_become_one_node_and_match_eager(transposed, bias, backend):
    module = Experts(transposed, bias)
    builder = _export(module)
    ops = [n.op for n in builder.methods["forward"].nodes]
    assert ops.count("gathered_linear") == 1 and "matmul" not in ops and "index" not in ops, ops
    session = builder.load().session(backend)
    for rows, seed in ((1, 0), (7, 1), (40, 2)):  # a decode step's rows, a few, a prompt's (experts repeat)
        x, ids = _inputs(rows, seed)
        with torch.no_grad():
            want = module(torch.from_numpy(x), torch.from_numpy(ids)).numpy()
        got = to_numpy(session.run("forward", x, ids)[0])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_match_their_dequantized_weights(mode, backend, monkeypatch):
    """Each expert quantized as a linear's weight would be (its rows, its groups), run by
    gathered_quantized_linear: the float64 product with the dequantized experts (the CPU's float kernels: by
    default its few-row quantized linears quantize their input rows too, tested in test_quant_offset.py)."""
    monkeypatch.setenv("KILN_QUANT_DOT", "float")
    config = Quantize(mode, group_size=32 if mode == "int4" else None)
    module = Experts(transposed=True, bias=True)
    builder = _export(module, config)
    [node] = [n for n in builder.methods["forward"].nodes if n.op.startswith("gathered")]
    assert node.op == "gathered_quantized_linear" and node.attrs["bits"] == config.bits
    stack = module.stack()
    group = config.group_for(K)
    q, scale, zero = quantize_rows(stack.reshape(-1, K), config.bits, group, config.symmetric)
    weights = dequantize(np, q, scale.astype(np.float32), zero.astype(np.float32), config.bits, group)
    weights = weights.reshape(EXPERTS, N, K).astype(np.float64)
    session = builder.load().session(backend)
    x, ids = _inputs(33, 4)
    want = np.einsum("sk,snk->sn", x.astype(np.float64), weights[ids]) + module.bias.detach().numpy()[ids]
    got = to_numpy(session.run("forward", x, ids)[0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_rows_are_grouped_by_expert_and_bad_indices_refused():
    groups = list(expert_groups(np.array([4, 1, 4, 0, 1, 4]), 5))
    assert [(e, rows.tolist()) for e, rows in groups] == [(0, [3]), (1, [1, 4]), (4, [0, 2, 5])]
    with pytest.raises(IndexError, match="out of range for 5 experts"):
        list(expert_groups(np.array([0, 5]), 5))
    with pytest.raises(IndexError, match="out of range"):
        list(expert_groups(np.array([-1]), 5))
