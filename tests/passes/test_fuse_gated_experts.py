"""fuse_gated_linear over a mixture-of-experts layer's gate/up experts: the gathered product over stacked gate/up
weights and the gated activation of its halves become one gated_gathered_linear node, on every backend equal to
eager PyTorch; a quantized stack, or halves read elsewhere, keep their nodes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export import Quantize, export
from kiln.runtime.backends.array_api import BFLOAT16
from tests.conftest import to_numpy

EXPERTS, N, K = 6, 24, 64
NUMPY = {torch.float32: np.float32, torch.bfloat16: BFLOAT16}
ACTIVATIONS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
               "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}


class GateUp(torch.nn.Module):
    """transformers' batched_mm experts before the down projection: each routed row through its expert's stacked
    gate/up weight, then act(gate) * up."""

    def __init__(self, bias: bool, dtype: torch.dtype, activation: str = "silu"):
        super().__init__()
        torch.manual_seed(7)
        self.weight = torch.nn.Parameter((torch.randn(EXPERTS, 2 * N, K) / K ** 0.5).to(dtype))
        self.bias = torch.nn.Parameter(torch.randn(EXPERTS, 2 * N).to(dtype)) if bias else None
        self.act = ACTIVATIONS[activation]

    def rows(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.bmm(self.weight[ids], h.unsqueeze(-1)).squeeze(-1)
        return rows + self.bias[ids] if self.bias is not None else rows

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate, up = self.rows(h, ids).chunk(2, dim=-1)
        return self.act(gate) * up


class HalvesReadElsewhere(GateUp):
    """The gate half is an output too: nothing fuses."""

    def forward(self, h, ids):
        gate, up = self.rows(h, ids).chunk(2, dim=-1)
        return self.act(gate) * up, gate


def _export(module: GateUp, dtype: torch.dtype, quantize: Quantize | None = None):
    rows = torch.export.Dim("rows", min=1, max=64)
    args = (torch.randn(4, K, dtype=dtype), torch.tensor([0, 3, 5, 3]))
    return export(module, args, dynamic_shapes=({0: rows}, {0: rows}), quantize=quantize)


def _inputs(rows: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, K, generator=g).to(dtype), torch.randint(0, EXPERTS, (rows,), generator=g)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(NUMPY[t.dtype]) if t.is_floating_point() else t.numpy()


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_gate_up_experts_fuse_and_match_eager(activation, bias, dtype, backend):
    module = GateUp(bias, dtype, activation)
    builder = _export(module, dtype)
    nodes = builder.methods["forward"].nodes
    ops = [n.op for n in nodes]
    assert ops.count("gated_gathered_linear") == 1 and "gathered_linear" not in ops and "slice" not in ops, ops
    [node] = [n for n in nodes if n.op == "gated_gathered_linear"]
    assert node.attrs["activation"] == activation and len(node.inputs) == 4 and (node.inputs[3] >= 0) == bias
    session = builder.load().session(backend)
    for rows, seed in ((1, 0), (8, 1), (40, 2)):  # a decode step's top-k rows, and a prompt's (grouped on a GPU)
        h, ids = _inputs(rows, seed, dtype)
        with torch.no_grad():
            want = module(h, ids).float().numpy()
        got = to_numpy(session.run("forward", _numpy(h), _numpy(ids))[0]).astype(np.float32)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def test_quantized_experts_keep_their_activation_node():
    ops = [n.op for n in _export(GateUp(False, torch.float32), torch.float32, Quantize("int8"))
           .methods["forward"].nodes]
    assert "gathered_quantized_linear" in ops and "gated_activation" in ops and "gated_gathered_linear" not in ops


def test_halves_read_elsewhere_are_left_alone():
    ops = [n.op for n in _export(HalvesReadElsewhere(False, torch.float32), torch.float32).methods["forward"].nodes]
    assert "gathered_linear" in ops and "gated_activation" in ops and "gated_gathered_linear" not in ops
