"""fuse_router_norm: a mixture-of-experts block's residual add + RMSNorm, its router's linear layer and its pick
become one add_rms_norm_route_experts node (the normalized rows stay an output for the experts), on every backend
equal to eager PyTorch; a router whose logits are read elsewhere, or whose weight is quantized, keeps its nodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export import Quantize, export
from kiln.runtime.backends.array_api import BFLOAT16
from tests.conftest import to_numpy

EXPERTS, D, EPS = 12, 64, 1e-6
NUMPY = {torch.float32: np.float32, torch.bfloat16: BFLOAT16}


class NormRouter(torch.nn.Module):
    """Qwen3-MoE's block between attention and experts: h = x + attention's output, Qwen3's RMSNorm of h, the
    router's linear layer over the rows and its float32 softmax, top-k and renormalization."""

    def __init__(self, k: int, normalize: bool, dtype: torch.dtype, bias: bool = False,
                 return_logits: bool = False):
        super().__init__()
        torch.manual_seed(11)
        self.norm_weight = torch.nn.Parameter((1 + 0.2 * torch.randn(D)).to(dtype))
        self.gate = torch.nn.Linear(D, EXPERTS, bias=bias).to(dtype)
        self.k, self.normalize, self.return_logits = k, normalize, return_logits

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        variance = h.float().pow(2).mean(-1, keepdim=True)
        return self.norm_weight * (h.float() * torch.rsqrt(variance + EPS)).to(h.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x + residual
        n = self.normed(h)
        logits = self.gate(n.reshape(-1, D))
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), self.k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (h, n, weights.to(x.dtype), ids) + ((logits,) if self.return_logits else ())


def _export(module: NormRouter, dtype: torch.dtype, quantize: Quantize | None = None):
    tokens = torch.export.Dim("tokens", min=1, max=64)
    args = (torch.randn(1, 3, D, dtype=dtype), torch.randn(1, 3, D, dtype=dtype))
    return export(module, args, dynamic_shapes=({1: tokens}, {1: tokens}), quantize=quantize)


def _ops(builder) -> list[str]:
    return [n.op for n in builder.methods["forward"].nodes]


@pytest.mark.parametrize("k,normalize,bias", [(4, True, False), (2, False, True), (12, True, False)],
                         ids=["top4", "top2-raw-bias", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_norm_and_router_become_one_node_and_match_eager(k, normalize, bias, dtype, backend):
    module = NormRouter(k, normalize, dtype, bias)
    builder = _export(module, dtype)
    ops = _ops(builder)
    assert ops.count("add_rms_norm_route_experts") == 1, ops
    assert not {"add_rms_norm", "rms_norm", "linear", "route_experts", "topk"} & set(ops), ops
    [node] = [n for n in builder.methods["forward"].nodes if n.op == "add_rms_norm_route_experts"]
    assert node.attrs["k"] == k and node.attrs["normalize"] == normalize and (node.inputs[4] >= 0) == bias
    session = builder.load().session(backend)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    for tokens, seed in ((1, 0), (4, 1), (9, 2)):  # a decode step's rows (one kernel on a GPU), and a prompt's
        g = torch.Generator().manual_seed(seed)
        x, residual = (torch.randn(1, tokens, D, generator=g).to(dtype) for _ in range(2))
        with torch.no_grad():
            want_h, want_n, want_weights, _ = module(x, residual)
        h, n, weights, ids = (to_numpy(a) for a in session.run("forward", *(t.float().numpy().astype(NUMPY[dtype])
                                                                             for t in (x, residual))))
        np.testing.assert_array_equal(h.astype(np.float32), want_h.float().numpy())
        np.testing.assert_allclose(n.astype(np.float32), want_n.float().numpy(), rtol=tol, atol=tol)
        # the picks against the logits of kiln's own normalized rows (a norm one rounding apart moves near-ties):
        # each pick's logit is the k-th largest's in order, the weights their softmax
        with torch.no_grad():
            logits = module.gate(torch.from_numpy(n.astype(np.float32)).to(dtype).reshape(-1, D)).double()
        top = torch.topk(logits, k, dim=-1).values.numpy()
        picked = np.take_along_axis(logits.numpy(), ids.astype(np.int64), axis=-1)
        np.testing.assert_allclose(picked, top, rtol=0, atol=tol * np.abs(top).max())
        assert all(len(set(row)) == k for row in ids.tolist())
        assert weights.shape == (tokens, k) and weights.dtype == NUMPY[dtype]
        np.testing.assert_allclose(weights.astype(np.float32), want_weights.float().numpy(), rtol=4 * tol,
                                   atol=4 * tol)


def test_a_two_dimensional_input_needs_no_reshape():
    class Flat(NormRouter):
        def forward(self, x, residual):
            return super().forward(x.unsqueeze(0), residual.unsqueeze(0))[1:]

    tokens = torch.export.Dim("tokens", min=1, max=64)
    builder = export(Flat(3, True, torch.float32), (torch.randn(3, D), torch.randn(3, D)),
                     dynamic_shapes=({0: tokens}, {0: tokens}))
    assert "add_rms_norm_route_experts" in _ops(builder)


@pytest.mark.parametrize("module,quantize", [(NormRouter(4, True, torch.float32, return_logits=True), None),
                                             (NormRouter(4, True, torch.float32), Quantize("int8"))],
                         ids=["logits-read-elsewhere", "quantized-router"])
def test_other_routers_keep_their_nodes(module, quantize):
    ops = _ops(_export(module, torch.float32, quantize))
    assert "add_rms_norm_route_experts" not in ops and "route_experts" in ops and "add_rms_norm" in ops, ops
