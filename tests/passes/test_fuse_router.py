"""fuse_router: a mixture-of-experts router's chain (float32 softmax, top-k, renormalization, cast back) as one
route_experts node, on every backend against eager PyTorch; chains that are not a router's pick stay as they are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export import export
from kiln.runtime.backends.array_api import BFLOAT16
from tests.conftest import to_numpy

EXPERTS, D = 12, 32
NUMPY = {torch.float32: np.float32, torch.bfloat16: BFLOAT16}


class Router(torch.nn.Module):
    """transformers' Qwen3-MoE / Mixtral router after its linear layer, in the model's dtype."""

    def __init__(self, k: int, normalize: bool, dtype: torch.dtype, downcast: bool = True):
        super().__init__()
        torch.manual_seed(4)
        self.gate = torch.nn.Linear(D, EXPERTS, bias=False).to(dtype)
        self.k, self.normalize, self.downcast = k, normalize, downcast

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probabilities = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probabilities, self.k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.downcast else weights), ids


def _export(module: torch.nn.Module, dtype: torch.dtype):
    tokens = torch.export.Dim("tokens", min=1, max=64)
    return export(module, (torch.randn(3, D, dtype=dtype),), dynamic_shapes=({0: tokens},))


def _ops(builder) -> list[str]:
    return [n.op for n in builder.methods["forward"].nodes]


def _one_route_node(module: torch.nn.Module, dtype: torch.dtype, gone: set[str], backend: str) -> tuple:
    """(the export's one route_experts node, a session of it on backend), no op of `gone` left beside it."""
    builder = _export(module, dtype)
    ops = _ops(builder)
    assert ops.count("route_experts") == 1 and not gone & set(ops), ops
    [node] = [n for n in builder.methods["forward"].nodes if n.op == "route_experts"]
    return node, builder.load().session(backend)


def _token_rows(dtype: torch.dtype) -> list[torch.Tensor]:
    """A decode step's one row of tokens and a prompt's nine, in dtype."""
    return [torch.randn(tokens, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
            for tokens, seed in ((1, 0), (9, 1))]


@pytest.mark.parametrize("k,normalize", [(4, True), (2, False), (12, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_router_chain_becomes_one_node_and_matches_eager(k, normalize, dtype, backend):
    module = Router(k, normalize, dtype)
    node, session = _one_route_node(module, dtype, {"softmax", "topk", "div", "cast"}, backend)
    assert node.attrs["k"] == k and node.attrs["normalize"] == normalize
    for x in _token_rows(dtype):
        with torch.no_grad():
            want_weights, want_ids = module(x)
            logits = module.gate(x).float().numpy()
        weights, ids = session.run("forward", x.float().numpy().astype(NUMPY[dtype]))  # (exact: x is in dtype)
        # bfloat16 logits tie often, and PyTorch orders ties as it likes (kiln: the lower index first): each pick
        # is the expert eager picked or one whose logit equals it
        picked = np.take_along_axis(logits, to_numpy(ids), axis=-1)
        np.testing.assert_array_equal(picked, np.take_along_axis(logits, want_ids.numpy(), axis=-1))
        np.testing.assert_allclose(to_numpy(weights).astype(np.float32), want_weights.float().numpy(),
                                   rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


def test_float32_weights_without_a_cast_back_are_fused():
    builder = _export(Router(3, True, torch.bfloat16, downcast=False), torch.bfloat16)
    [node] = [n for n in builder.methods["forward"].nodes if n.op == "route_experts"]
    assert node.attrs["dtype"].name == "float32" and "topk" not in _ops(builder)


class LogitsFirst(torch.nn.Module):
    """gpt-oss's router: the top k of the logits (its linear layer has a bias), then the softmax of those in the
    logits' dtype."""

    def __init__(self, dtype: torch.dtype = torch.float32, k: int = 4, values_too: bool = False):
        super().__init__()
        torch.manual_seed(6)
        self.gate = torch.nn.Linear(D, EXPERTS).to(dtype)
        self.k, self.values_too = k, values_too

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, ids = torch.topk(self.gate(x), self.k, dim=-1)
        weights = torch.softmax(values, dim=-1, dtype=values.dtype)
        return (weights, ids) + ((values,) if self.values_too else ())


@pytest.mark.parametrize("k", [4, 1, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_logits_first_router_is_route_experts_and_matches_eager(k, dtype, backend):
    """The top k of the logits and their softmax are the top k of the softmax renormalized: one route_experts node
    (normalize), equal to gpt-oss's chain to float32 rounding."""
    module = LogitsFirst(dtype, k)
    node, session = _one_route_node(module, dtype, {"softmax", "topk"}, backend)
    assert node.attrs["k"] == k and node.attrs["normalize"] and node.attrs["dtype"].name == str(dtype)[6:]
    for x in _token_rows(dtype):
        with torch.no_grad():
            want_weights, _ = module(x)
            logits = module.gate(x).float().numpy()
        weights, ids = session.run("forward", x.float().numpy().astype(NUMPY[dtype]))
        picked = np.take_along_axis(logits, to_numpy(ids), axis=-1)
        top = -np.sort(-logits, axis=-1)[:, :k]  # (kiln's bfloat16 logits may round a unit apart from eager's)
        np.testing.assert_allclose(picked, top, rtol=0, atol=0 if dtype == torch.float32 else 8e-3 * np.abs(top).max())
        np.testing.assert_allclose(to_numpy(weights).astype(np.float32), want_weights.float().numpy(),
                                   rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


class ProbabilitiesReadElsewhere(torch.nn.Module):
    """The probabilities are an output too: the softmax cannot be absorbed."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(D, EXPERTS)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        probabilities = torch.softmax(self.gate(x), dim=-1)
        weights, ids = torch.topk(probabilities, 4, dim=-1)
        return weights, ids, probabilities


@pytest.mark.parametrize("module", [LogitsFirst(values_too=True), ProbabilitiesReadElsewhere()],
                         ids=["logits-first-values-returned", "shared"])
def test_other_chains_are_left_alone(module):
    ops = _ops(_export(module, torch.float32))
    assert "route_experts" not in ops and "topk" in ops and "softmax" in ops


@pytest.mark.parametrize("n,k", [(128, 8), (12, 3), (5, 5)])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_cpu_route_kernel_equals_the_chain(n, k, normalize):
    """native/experts.c's route_experts (the CPU kernel and the executor's instruction) against the op's chain of
    NumPy kernels: the same experts on tied logits and NaN rows, the same weights to float32 rounding."""
    from kiln.ir.dtypes import DType
    from kiln.runtime.backends import composite
    from kiln.runtime.backends.array_api import PORTABLE, bind
    from kiln.runtime.backends.cpu import native
    from kiln.runtime.backends.cpu.experts import route_experts

    if native.library() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(n + k)
    logits = (rng.integers(-20, 20, (9, n)) / 4).astype(np.float32)
    logits[2, 1] = np.nan
    portable = {name: bind(fn, np) for name, fn in PORTABLE.kernels.items()}
    want_weights, want_ids = composite.route_experts(portable, logits, k, normalize, DType.float32)
    weights, ids = route_experts(logits, k, normalize, DType.float32)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=2e-6, atol=1e-7)
