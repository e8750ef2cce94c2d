"""Weight quantization: the quantizer's error bounds, the kernels against the NumPy reference (compiled and
fallback paths), the export pass (tied weights stored once, what it declines) and the CLI."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.export.quantize import Quantize, quantize_rows
from kiln.runtime.backends.array_api.quant import dequantize, quantized_embedding
from kiln.runtime.backends.cpu import native, quant
from tests.test_cli import cli

CONFIGS = [(8, 384, True), (8, 64, False), (4, 64, True), (4, 32, False), (4, 128, True), (8, 40, True)]
"""(bits, group_size, symmetric); group 40 leaves tails the compiled kernel's 16-wide loop does not cover."""


def _weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("bits,group,symmetric", CONFIGS)
def test_quantize_then_dequantize_is_within_half_a_step(bits, group, symmetric) -> None:
    w = _weight(24, 3 * group if group != 384 else 384)
    q, scale, zero = quantize_rows(w, bits, group, symmetric)
    assert q.dtype == (np.int8 if bits == 8 else np.uint8)
    assert q.shape == (w.shape[0], w.shape[1] // (1 if bits == 8 else 2))
    back = dequantize(np, q, scale.astype(np.float32), None if zero is None else zero.astype(np.float32), bits, group)
    step = np.repeat(scale, group, axis=1)
    assert np.all(np.abs(back - w) <= 0.5 * step + 1e-6 * np.abs(w))


@pytest.mark.parametrize("bits,group,symmetric", CONFIGS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("path", ["compiled", "int8-dot", "numpy"])
def test_quantized_linear_matches_reference(bits, group, symmetric, rows, path, monkeypatch) -> None:
    """Each path against float64 products with the dequantized weight: the float paths within float32 rounding;
    the integer-dot path (few rows, inputs rounded to int8 per 32) within what that rounding can move an output,
    sum_j |W[o, j]| * (the step of x[j]'s block) / 2, which is a bound, not a fitted tolerance."""
    if path != "numpy" and native.library() is None:
        pytest.skip("no C compiler: the compiled helpers are not built")
    if path == "int8-dot" and not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    if path == "numpy":
        monkeypatch.setattr(native, "library", lambda: None)
    monkeypatch.setenv("KILN_QUANT_DOT", "int8" if path == "int8-dot" else "float")
    k = 3 * group if group != 384 else 384
    w = _weight(37, k)
    q, scale, zero = quantize_rows(w, bits, group, symmetric)
    scale = scale.astype(np.float32)
    zero = None if zero is None else zero.astype(np.float32)
    bias = np.random.default_rng(1).standard_normal(37).astype(np.float32)
    x = np.random.default_rng(2).standard_normal((rows, k)).astype(np.float32)
    weight = dequantize(np, q, scale, zero, bits, group).astype(np.float64)
    want = x.astype(np.float64) @ weight.T + bias
    got = quant.quantized_linear(x.reshape(1, rows, k), q, scale, zero, bias, bits, group)
    assert got.shape == (1, rows, 37) and got.dtype == np.float32
    slack = 1e-4 * np.sqrt(k)
    taken = k % 64 == 0 and (group == 32 or group % 64 == 0) if bits == 4 else k % 32 == 0 and group % 32 == 0
    dot_rows = quant.INT4_DOT_ROWS if bits == 4 else quant.FEW_ROWS  # (int4 past FEW_ROWS too: quant.py)
    if path == "int8-dot" and rows <= dot_rows and taken:  # (other shapes run the float kernel)
        step = np.repeat(np.abs(x.reshape(rows, k // 32, 32)).max(axis=-1) / 127, 32, axis=-1)
        bound = step @ np.abs(weight).T / 2 * (1 + 1e-5) + slack
        assert np.all(np.abs(got[0] - want) <= bound)
        assert np.abs(got[0] - want).max() > 1e-4 * np.abs(want).max()  # (the integer path ran: float is ~100x closer)
    else:
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=slack)


@pytest.mark.parametrize("bits,group,symmetric", CONFIGS[:4])
def test_quantized_embedding_matches_reference(bits, group, symmetric) -> None:
    w = _weight(50, 2 * group if group != 384 else 384)
    q, scale, zero = quantize_rows(w, bits, group, symmetric)
    scale = scale.astype(np.float32)
    zero = None if zero is None else zero.astype(np.float32)
    idx = np.array([[3, 0, 49], [7, 7, 1]])
    got = quantized_embedding(np, q, scale, zero, idx, bits, group)
    np.testing.assert_array_equal(got, dequantize(np, q, scale, zero, bits, group)[idx])


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(96, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 96, bias=False)
        self.head.weight = self.embed.weight
        self.odd = nn.Linear(64, 6)

    def forward(self, tokens):
        h = torch.relu(self.mid(self.embed(tokens)))
        return self.head(h), self.odd(h)


@pytest.mark.parametrize("mode", ["int8", "int4", "bf16", "fp16"])
def test_export_quantizes_and_stores_tied_weights_once(mode) -> None:
    model = TiedLM().eval()
    tokens = torch.randint(0, 96, (2, 5))
    program = kiln.export(model, (tokens,), quantize=mode).load()
    ops = [n.op for n in program.ir.methods["forward"].nodes]
    if mode in ("int8", "int4"):
        assert ops.count("quantized_linear") == 3 and ops.count("quantized_embedding") == 1
        names = [c.name for c in program.ir.constants]
        assert sum(n.endswith(".q") for n in names) == 3  # embed (= head), mid, odd: the tied table once
    else:
        assert "cast" in ops and ops.count("linear") == 3
    got = program.session(validate=True).run("forward", tokens.numpy())
    with torch.no_grad():
        want = model(tokens)
    tol = {"int8": 0.02, "int4": 0.2, "bf16": 0.02, "fp16": 0.002}[mode]
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w.numpy()).max() <= tol * np.abs(w.numpy()).max()
    plain = kiln.export(model, (tokens,)).to_bytes()
    assert program.header.file_size < len(plain) * {"int8": 0.4, "int4": 0.3, "bf16": 0.6, "fp16": 0.6}[mode]


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, True), (4, 64, False), (8, 48, True), (8, 96, False)])
def test_quantizing_in_blocks_of_rows_does_not_change_the_result(bits, group, symmetric, monkeypatch) -> None:
    """quantize_rows splits a large weight into blocks of rows on threads: the same bytes as one block."""
    from kiln.export import quantize

    w = _weight(203, 4 * group, seed=bits + group)
    whole = quantize._quantize_block(w, bits, group, symmetric)
    monkeypatch.setattr(quantize, "PARALLEL_QUANTIZE_ELEMENTS", 1)
    monkeypatch.setattr(quantize, "QUANTIZE_BLOCK_ELEMENTS", 7 * w.shape[1] + 5)  # 7 rows a block, 6 left over
    split = quantize_rows(w, bits, group, symmetric)
    for a, b in zip(split, whole, strict=True):
        assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))


@pytest.mark.parametrize("mode", ["int4", "bf16"])
def test_an_llm_export_quantizes_each_weight_once(mode, monkeypatch) -> None:
    """Prefill and decode read the same weights: the second method takes the first one's stacked and quantized
    constants (builder.derived) instead of stacking, quantizing and hashing them again."""
    from kiln.export import quantize
    from kiln.models.llm import export_llama
    from kiln.models.zoo import tiny_decoder

    calls: list[tuple] = []
    real = quantize.quantize_rows
    monkeypatch.setattr(quantize, "quantize_rows", lambda w, *a: calls.append(w.shape) or real(w, *a))
    builder = export_llama(tiny_decoder("llama"), 32, 8, quantize=mode)
    methods = builder.methods
    assert {"prefill", "decode"} <= set(methods)
    refs = {name: {v.ref for v in m.values if v.kind.name == "CONSTANT"} for name, m in methods.items()}
    weights = [c for c in builder.constants if c.name.endswith(".q" if mode == "int4" else ".bf16")]
    assert weights and all(builder.constants.index(c) in refs["prefill"] & refs["decode"] for c in weights)
    if mode == "int4":
        assert len(calls) == len(weights)  # (each stored weight quantized once, not once a method)
    derived = [k for k in builder.derived if k[0] in ("fuse_projections", "quantize_weights", "store_half")]
    assert {k[0] for k in derived} >= {"fuse_projections", "quantize_weights" if mode == "int4" else "store_half"}


def test_quantize_declines_weights_it_cannot_group() -> None:
    model = nn.Linear(9, 4)  # K = 9: int4 packs pairs, and no even group divides 9
    program = kiln.export(model, (torch.randn(1, 9),), quantize=Quantize("int4", group_size=4)).load()
    assert [n.op for n in program.ir.methods["forward"].nodes] == ["linear"]
    assert Quantize("int4", group_size=128).group_for(576) == 96  # the largest even divisor below 128
    assert Quantize("int8").group_for(576) == 576 and Quantize("int4").group_for(576) == 64


def test_quantize_config_is_checked() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        Quantize("int3")
    with pytest.raises(ValueError, match="even number"):
        Quantize("int4", group_size=33)
    with pytest.raises(ValueError, match="no group size"):
        Quantize("bf16", group_size=64)
    assert not Quantize("int8").symmetric  # asymmetric by default (measured better, see kiln.export.quantize)


def test_cli_quantize(tmp_path) -> None:
    factory = tmp_path / "f.py"
    factory.write_text("import torch\n"
                       "def make():\n"
                       "    torch.manual_seed(0)\n"
                       "    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), "
                       "torch.nn.Linear(128, 8)), (torch.randn(2, 64),)\n")
    code, out, err = cli("export", f"{factory}:make", "-o", tmp_path / "q.kiln", "--quantize", "int4",
                         "--group-size", "32", "--symmetric")
    assert code == 0, err
    ops = [n.op for n in kiln.load(tmp_path / "q.kiln").ir.methods["forward"].nodes]
    assert ops.count("quantized_linear") == 2
    code, _, err = cli("export", f"{factory}:make", "-o", tmp_path / "bad.kiln", "--group-size", "32")
    assert code == 2 and "--quantize" in err


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("batch,seq", [(1, 1), (2, 3), (4, 5)], ids=["decode", "few_rows", "many_rows"])
def test_cpu_session_binds_quantized_weights_at_plan_time(mode, batch, seq, monkeypatch) -> None:
    """The CPU backend prepares each quantized_linear whose weights are constants (cpu/prepare.py): the bound
    kernel gives the general kernel's bits on few rows and hands other inputs (many rows) to it; the op profiler
    still times the prepared nodes. (Node by node: the native executor would run the few-row forward whole. The
    LM head's refined int8 inputs, which only a prepared node knows to use, are tested in test_quant_offset.py.)"""
    monkeypatch.setenv("KILN_EXECUTOR", "python")
    monkeypatch.setattr("kiln.runtime.backends.cpu.quant.yields_output", lambda method, node: False)
    from kiln.runtime.backends.cpu.registry import CPU_KERNELS
    from kiln.runtime.profile import OpProfiler

    if native.library() is None:
        pytest.skip("no C compiler: the compiled helpers are not built")
    program = kiln.export(TiedLM().eval(), (torch.randint(0, 96, (batch, seq)),), quantize=mode).load()
    tokens = np.random.default_rng(0).integers(0, 96, (batch, seq))
    prepared = program.session("cpu")
    unprepared = program.session("cpu")
    unprepared.backend.prepare = lambda *args: None
    for got, want in zip(prepared.run("forward", tokens), unprepared.run("forward", tokens), strict=True):
        assert np.array_equal(got, want)
    plan = next(iter(prepared._plans["forward"].values()))
    linear = [step for step in plan.steps if step.node.op == "quantized_linear"]
    assert linear and all(step.kernel is not CPU_KERNELS.kernels["quantized_linear"] for step in linear)
    profiler_session = program.session("cpu")
    profiler = OpProfiler().attach(profiler_session)
    profiler_session.run("forward", tokens)
    assert profiler.by_op["quantized_linear"].calls == len(linear)
