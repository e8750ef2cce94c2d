"""Quantized weights with additive offsets (the op's `offset`: W = q * scale + offset, GGUF's and MLX's form) in
every kernel that takes them, against the definition: the CPU's float and int8-input few-row kernels over any
thread count, its many-row path and embedding lookup, and MLX's quantized format."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.backends.array_api.quant import dequantize
from kiln.runtime.backends.cpu import native
from kiln.runtime.backends.cpu.registry import CPU_KERNELS

CASES = [(4, 32), (4, 16), (4, 64), (8, 32), (8, 16)]
"""(bits, group): GGUF's Q4_1/Q4_K (int4 g32), Q2_K (int4 g16), Q5_1/Q5_K (int8 g32) and kiln's own g64."""


def offset_weight(bits: int, group: int, n: int, k: int, seed: int) -> tuple[np.ndarray, ...]:
    """q (codes 0..15 or 0..31 as GGUF's "_1" and K types hold them), scale, offset, bias; some groups with scale 0
    (GGUF's form of a constant group: its offset alone)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16 if bits == 4 else 32, (n, k)).astype(np.uint8)
    q = (codes[:, 0::2] | (codes[:, 1::2] << 4)) if bits == 4 else codes.astype(np.int8)
    scale = rng.uniform(0.005, 0.05, (n, k // group)).astype(np.float32)
    scale[::7, 1] = 0.0
    offset = -rng.uniform(0.0, 0.3, (n, k // group)).astype(np.float32)
    return q, scale, offset, rng.standard_normal(n).astype(np.float32)


def test_the_definition_rounds_each_weight_once():
    q, scale, offset, _ = offset_weight(4, 32, 3, 64, 0)
    codes = np.empty((3, 64), np.float32)
    codes[:, 0::2], codes[:, 1::2] = q & 15, q >> 4
    want = (codes.reshape(3, 2, 32) * scale[..., None] + offset[..., None]).reshape(3, 64)
    assert np.array_equal(dequantize(np, q, scale, offset, 4, 32, offset=True), want)
    assert np.all(dequantize(np, q, scale, offset, 4, 32, offset=True)[::7, 32:] == offset[::7, 1:2])
    assert np.array_equal(dequantize(np, q, scale, None, 4, 32, offset=True),
                          dequantize(np, q, scale, np.zeros_like(offset), 4, 32, offset=True))


needs_native = pytest.mark.skipif(native.library() is None, reason="no C compiler here")


@needs_native
@pytest.mark.parametrize("dot", ["float", "int8"])
@pytest.mark.parametrize("bits,group", CASES, ids=[f"int{b}-g{g}" for b, g in CASES])
def test_cpu_few_rows_and_many_rows(bits, group, dot, monkeypatch):
    if dot == "int8" and not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    monkeypatch.setenv("KILN_QUANT_DOT", dot)
    n, k = 259, 256
    q, scale, offset, bias = offset_weight(bits, group, n, k, bits + group)
    x = np.random.default_rng(1).standard_normal((5, k)).astype(np.float32)
    kernel = CPU_KERNELS.kernels["quantized_linear"]
    weight = dequantize(np, q, scale, offset, bits, group, offset=True).astype(np.float64)
    want = x.astype(np.float64) @ weight.T + bias
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("KILN_THREADS", threads)
        results.append(kernel(x, q, scale, offset, bias, bits, group, offset=True))
    assert all(np.array_equal(results[0], r) for r in results[1:])
    if dot == "int8" and group % 32 == 0:  # (groups of 16 take the float kernel)
        step = np.repeat(np.abs(x.reshape(len(x), k // 32, 32)).max(axis=-1) / 127, 32, axis=-1)
        assert np.all(np.abs(results[0] - want) <= step @ np.abs(weight).T / 2 * (1 + 1e-5) + 1e-3)
    else:
        np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-4)
    many = np.random.default_rng(2).standard_normal((3, 11, k)).astype(np.float32)  # 33 rows: dequantized bands
    got = kernel(many, q, scale, offset, bias, bits, group, offset=True)
    np.testing.assert_allclose(got, many.astype(np.float64) @ weight.T + bias, rtol=1e-4, atol=1e-4)


@needs_native
@pytest.mark.parametrize("bits,group", CASES, ids=[f"int{b}-g{g}" for b, g in CASES])
def test_cpu_bound_kernel_and_embedding(bits, group, monkeypatch):
    """The plan-time kernel for constant weights (prepare.py) and the portable embedding lookup."""
    from kiln.runtime.backends.array_api.quant import quantized_embedding
    from kiln.runtime.backends.cpu.quant import bound_linear

    monkeypatch.setenv("KILN_QUANT_DOT", "float")
    q, scale, offset, bias = offset_weight(bits, group, 40, 128, 5)
    weight = dequantize(np, q, scale, offset, bits, group, offset=True)
    run = bound_linear(q, scale, offset, bias, bits, group, offset=True)
    x = np.random.default_rng(3).standard_normal((2, 128)).astype(np.float32)
    np.testing.assert_allclose(run(x, q, scale, offset, bias, bits=bits, group_size=group, offset=True),
                               x.astype(np.float64) @ weight.T + bias, rtol=1e-4, atol=1e-4)
    ids = np.array([[3, 0, 39]])
    rows = quantized_embedding(np, q, scale, offset, ids, bits, group, offset=True)
    assert np.array_equal(rows, weight[ids])


@pytest.mark.parametrize("bits,group", CASES, ids=[f"int{b}-g{g}" for b, g in CASES])
def test_mlx_format_holds_offsets(bits, group):
    """MLX stores w = q_u * scale + bias: int4 offsets are its biases as they are; int8 moves by 128 * scale."""
    mx = pytest.importorskip("mlx.core")
    from kiln.runtime.backends.mlx.quantized import convert

    q, scale, offset, _ = offset_weight(bits, group, 16, 256, 9)
    converted = convert(q, scale, offset, bits, group, offset=True)
    want = dequantize(np, q, scale, offset, bits, group, offset=True)
    if group < 32:  # MLX's smallest group is 32: kiln's own kernels keep these
        assert converted is None
        return
    packed, scales, biases, size = converted
    if bits == 4:
        assert np.array_equal(biases, np.repeat(offset, group // size, axis=1))
    got = np.array(mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size=size, bits=bits))
    eps = float(np.finfo(np.float32).eps)
    np.testing.assert_array_less(np.abs(got - want), 2 * eps * (np.abs(want) + np.abs(np.repeat(biases, size, 1))
                                                                 + 1e-30))


@needs_native
@pytest.mark.parametrize("bits,group,offset", [(4, 32, True), (4, 64, False), (8, 32, False)])
def test_refined_int8_inputs_for_logits(bits, group, offset, monkeypatch):
    """A linear that yields a method's output (an LM head) rounds its int8 inputs twice (value and residual; int8
    weights on AVX-512 are multiplied in float32 instead): within ~1/30 of what one rounding moves an output, at
    the same weights read once; each row's logits have the same bits alone as batched (qdot.c)."""
    from kiln.runtime.backends.cpu.quant import bound_linear

    if not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    monkeypatch.setenv("KILN_QUANT_DOT", "int8")
    q, scale, offset_or_zero, bias = offset_weight(bits, group, 300, 256, 4)
    weight = dequantize(np, q, scale, offset_or_zero, bits, group, offset=offset).astype(np.float64)
    x = (np.random.default_rng(5).standard_normal((3, 256)) * 4).astype(np.float32)
    want = x.astype(np.float64) @ weight.T + bias
    once, twice = (bound_linear(q, scale, offset_or_zero, bias, bits, group, offset, refine=refine)
                   for refine in (False, True))
    errors = [np.abs(run(x, q, scale, offset_or_zero, bias, bits=bits, group_size=group, offset=offset) - want).max()
              for run in (once, twice)]
    assert errors[1] < errors[0] / 30 and errors[1] < 1e-3 * np.abs(want).max()
    batched = twice(x, q, scale, offset_or_zero, bias, bits=bits, group_size=group, offset=offset)
    alone = [twice(x[i:i + 1], q, scale, offset_or_zero, bias, bits=bits, group_size=group, offset=offset)
             for i in range(len(x))]
    assert np.array_equal(batched, np.concatenate(alone))


def test_lm_heads_are_the_linears_that_yield_an_output():
    from kiln.ir.dtypes import DType
    from kiln.ir.graph import Method, Node, Value, ValueKind
    from kiln.runtime.backends.cpu.quant import yields_output

    values = [Value(name, DType.float32, (1, 4), ValueKind.INPUT if name == "x" else ValueKind.TEMP)
              for name in ("x", "hidden", "logits", "out")]
    body = Node("quantized_linear", [0], [1], {})
    head = Node("quantized_linear", [1], [2], {})
    method = Method("decode", values, [0], [3], [body, head, Node("reshape", [2], [3], {})])
    assert yields_output(method, head) and not yields_output(method, body)
