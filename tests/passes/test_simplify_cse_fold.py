"""remove_noops, collapse_chains, cse and fold_constants: each fires on a small graph, declines where it would be
wrong, and leaves outputs unchanged."""

from __future__ import annotations

import torch
from torch import nn

from kiln.export.passes.simplify import _EXACT_CASTS
from kiln.ir.dtypes import DType
from tests.passes.common import export_checked, nodes, ops


class Redundant(nn.Module):
    """Identity views and casts, chained views, and an exact-then-narrowing cast chain."""

    def forward(self, x):
        y = x.reshape(x.shape).permute(0, 1, 2).contiguous().to(torch.float32)  # all no-ops
        y = y.reshape(2, 12).reshape(4, 6).reshape(24)  # one reshape
        z = x.permute(2, 0, 1).permute(1, 2, 0)  # [2, 3, 4] -> [4, 2, 3] -> [2, 3, 4]: the identity
        h = x.to(torch.float16).to(torch.float32)  # f32 -> f16 loses precision: must stay two casts
        w = x.to(torch.float64).to(torch.float16)  # f32 -> f64 is exact: one cast to f16 gives the same
        return y * 2, z + 1, h, w


def test_noops_and_chains_collapse() -> None:
    program = export_checked(Redundant(), (torch.randn(2, 3, 4),))
    assert ops(program).count("reshape") == 1 and "permute" not in ops(program)
    casts = [(program.ir.methods["forward"].values[n.inputs[0]].dtype, n.attrs["dtype"])
             for n in nodes(program, "cast")]
    assert casts.count((DType.float32, DType.float16)) == 2  # h's first cast, and w's collapsed one
    assert (DType.float16, DType.float32) in casts and DType.float64 not in [c[1] for c in casts]


def test_exact_casts_really_are_exact() -> None:
    """Every pair in the table round-trips every value of its source dtype exactly (sampled at the extremes)."""
    for source, targets in _EXACT_CASTS.items():
        t = getattr(torch, source.name)
        if source == DType.bool:
            x = torch.tensor([True, False])
        elif source.is_float:
            info = torch.finfo(t)
            x = torch.tensor([info.max, info.min, info.tiny, info.eps, 1 / 3, -0.0], dtype=t)
        else:
            info = torch.iinfo(t)
            x = torch.tensor([info.max, info.min, info.max - 1, 0, -1 if info.min < 0 else 1], dtype=t)
        for target in targets:
            assert torch.equal(x.to(getattr(torch, target.name)).to(t), x), (source, target)


class RepeatedWork(nn.Module):
    """Each 'layer' rebuilds the same mask and scale from the input; CSE computes them once."""

    def forward(self, x):
        out = x
        for _ in range(4):
            mask = torch.arange(x.shape[-1]) < x.shape[-1] - 1
            scale = x.abs().amax(-1, keepdim=True)
            out = torch.where(mask, out / scale, out)
        return out


def test_cse_merges_repeated_subgraphs() -> None:
    program = export_checked(RepeatedWork(), (torch.randn(3, 5),))
    assert ops(program).count("amax") == 1 and ops(program).count("abs") == 1
    assert ops(program).count("where") == 4  # the chain itself is not repeated work


class TwoOutputs(nn.Module):
    def forward(self, x):
        return x.abs() + 1, x.abs() + 1  # identical outputs stay two values


def test_cse_keeps_graph_outputs_distinct() -> None:
    program = export_checked(TwoOutputs(), (torch.randn(3),))
    method = program.ir.methods["forward"]
    assert len(set(method.outputs)) == 2


class WeightMath(nn.Module):
    """Gemma's (1 + weight), a transposed weight and a RoPE table: weight-only, computed at export."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8))
        self.proj = nn.Parameter(torch.randn(8, 6))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))

    def forward(self, x):
        table = torch.outer(torch.arange(5, dtype=torch.float32), self.inv_freq)
        y = x * (1.0 + self.weight)
        return y @ self.proj.t().t(), torch.cos(table).sum() + x.sum()


def test_constant_folding_computes_weight_only_subgraphs() -> None:
    program = export_checked(WeightMath(), (torch.randn(2, 8),))
    assert "cos" not in ops(program) and "arange" not in ops(program)
    assert ops(program).count("add") == 1  # (1 + weight) folded; only the sum + sum remains
    assert any(c.name.startswith("folded.") for c in program.ir.constants)


class BigBroadcast(nn.Module):
    def forward(self, x):
        mask = torch.ones(1, 1, 2048, 2048).tril()  # 16 MiB from nothing: must not be stored in the file
        return x + mask[0, 0, :4, :4]


def test_constant_folding_does_not_inflate_the_file() -> None:
    program = export_checked(BigBroadcast(), (torch.randn(4, 4),))
    assert sum(b.nbytes for b in program.ir.blobs) < 1 << 20


class AddmmLayers(nn.Module):
    """GPT-2's Conv1D form (addmm with a [in, out] weight) and a bare matmul by a weight."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 6))
        self.b1 = nn.Parameter(torch.randn(6))
        self.w2 = nn.Parameter(torch.randn(6, 4))

    def forward(self, x):
        h = torch.addmm(self.b1, x.reshape(-1, 8), self.w1).reshape(x.shape[0], x.shape[1], 6)
        return torch.relu(h) @ self.w2


def test_matmul_by_a_weight_becomes_linear() -> None:
    program = export_checked(AddmmLayers(), (torch.randn(2, 3, 8),))
    assert ops(program).count("linear") == 2 and "matmul" not in ops(program) and "add" not in ops(program)
    first = nodes(program, "linear")[0]
    assert program.ir.methods["forward"].values[first.inputs[1]].shape == (6, 8)  # [out, in], like nn.Linear


def test_gpt2_conv1d_layers_become_linear() -> None:
    from kiln.models.llm import export_llama
    from kiln.models.zoo import tiny_decoder

    program = export_llama(tiny_decoder("gpt2"), 16, 4).load()
    decode = ops(program, "decode")
    assert "matmul" not in decode and decode.count("linear") >= 8  # 2 layers x (qkv, proj, fc, proj) + head
