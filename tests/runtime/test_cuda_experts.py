"""The GPU's mixture-of-experts kernels (kiln.runtime.backends.cuda.kernels.experts) against the op's float64
definition: the gathered GEMV (a decode step's few rows), the grouped tensor-core product (a prompt's rows, grouped
by expert on the GPU), the quantized forms of both, out-of-range indices, and a capture as a CUDA graph."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.export.quantize import quantize_rows
from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.array_api.quant import dequantize
from tests.conftest import BACKENDS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif("cuda" not in BACKENDS, reason="needs an NVIDIA GPU with CuPy")]

DTYPES = [np.float32, np.float16, BFLOAT16]
ULP = {np.dtype(np.float32): 2.5e-6, np.dtype(np.float16): 1e-3, BFLOAT16: 8e-3}
"""Relative tolerance per storage type: the output is rounded once, sums in float32."""


def _index(rng, rows: int, experts: int) -> np.ndarray:
    """Rows routed as top-k routes them: mostly distinct experts, some repeated, some experts never picked."""
    return rng.integers(0, experts, rows).astype(np.int64)


def _check(got, want, dtype) -> None:
    import cupy as cp

    got = cp.asnumpy(got).astype(np.float64)
    scale = np.abs(want).max(axis=-1, keepdims=True) + 1e-6
    np.testing.assert_array_less(np.abs(got - want) / scale, ULP[np.dtype(dtype)] * 4)


def _gathered_case(seed: int, rows: int, experts: int, n: int, k: int, dtype, with_bias: bool) -> tuple:
    """(x, w, bias or None, index, float64 x[s] . W[index[s]] + bias[index[s]]) for a gathered linear."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(dtype)
    w = (rng.standard_normal((experts, n, k)) / np.sqrt(k)).astype(dtype)
    bias = rng.standard_normal((experts, n)).astype(dtype) if with_bias else None
    index = _index(rng, rows, experts)
    f64 = [None if a is None else a.astype(np.float64) for a in (x, w, bias)]
    return x, w, bias, index, np.einsum("sk,snk->sn", f64[0], f64[1][index]) + (f64[2][index] if with_bias else 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 8, 16, 17, 100, 300])
@pytest.mark.parametrize("experts,n,k", [(5, 40, 64), (130, 200, 96), (9, 72, 40), (4, 45, 32), (6, 2048, 768)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gathered_linear_matches_definition(dtype, rows, experts, n, k, with_bias) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gathered_linear

    x, w, bias, index, want = _gathered_case(rows + n, rows, experts, n, k, dtype, with_bias)
    got = gathered_linear(cp.asarray(x), cp.asarray(w), cp.asarray(index),
                          None if bias is None else cp.asarray(bias))
    assert got.shape == (rows, n) and got.dtype == x.dtype
    _check(got, want, dtype)


def test_gathered_linear_takes_strided_rows_and_int32_indices() -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gathered_linear

    rng = np.random.default_rng(3)
    wide = rng.standard_normal((40, 256)).astype(BFLOAT16)
    w = rng.standard_normal((7, 48, 128)).astype(BFLOAT16)
    index = rng.integers(0, 7, 40).astype(np.int32)
    for rows in (4, 40):
        x = cp.asarray(wide)[:rows, 64:192]  # rows 512 bytes apart, K 128
        want = np.einsum("sk,snk->sn", wide[:rows, 64:192].astype(np.float64), w.astype(np.float64)[index[:rows]])
        _check(gathered_linear(x, cp.asarray(w), cp.asarray(index[:rows])), want, BFLOAT16)


@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
def test_out_of_range_experts_give_nan_rows(rows, dtype) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gathered_linear

    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, 64)).astype(dtype)
    w = rng.standard_normal((4, 32, 64)).astype(dtype)
    index = _index(rng, rows, 4)
    index[1], index[2] = 4, -1
    got = cp.asnumpy(gathered_linear(cp.asarray(x), cp.asarray(w), cp.asarray(index))).astype(np.float64)
    assert np.isnan(got[1:3]).all()
    keep = np.ones(rows, bool)
    keep[1:3] = False
    want = np.einsum("sk,snk->sn", x[keep].astype(np.float64), w.astype(np.float64)[index[keep]])
    np.testing.assert_allclose(got[keep], want, rtol=0.05, atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("bits,group,symmetric", [(8, 64, True), (4, 32, False), (4, 64, "offset"), (8, 32, False)])
@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gathered_quantized_linear_matches_definition(bits, group, symmetric, rows, dtype, with_bias) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gathered_quantized_linear

    rng = np.random.default_rng(rows * 3 + bits)
    experts, n, k = 6, 72, 4 * group
    w = rng.standard_normal((experts * n, k)).astype(np.float32)
    offset = symmetric == "offset"
    q, scale, zero = quantize_rows(w, bits, group, symmetric is True)
    if offset:
        zero = -zero * scale
    scale, zero = scale.astype(dtype), None if zero is None else zero.astype(dtype)
    weight = dequantize(np, q, scale.astype(np.float32), None if zero is None else zero.astype(np.float32), bits,
                        group, offset).astype(np.float64).reshape(experts, n, k)
    stack = [None if a is None else a.reshape(experts, n, -1) for a in (q, scale, zero)]
    bias = rng.standard_normal((experts, n)).astype(dtype) if with_bias else None
    x = rng.standard_normal((rows, k)).astype(dtype)
    index = _index(rng, rows, experts)
    want = np.einsum("sk,snk->sn", x.astype(np.float64), weight[index])
    if with_bias:
        want += bias.astype(np.float64)[index]
    got = gathered_quantized_linear(cp.asarray(x), *(None if a is None else cp.asarray(a) for a in stack),
                                    cp.asarray(index), None if bias is None else cp.asarray(bias), bits=bits,
                                    group_size=group, offset=offset)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    _check(got, want, dtype)


GATES = {"silu": lambda g: g / (1.0 + np.exp(-g)),
         "gelu": lambda g: 0.5 * g * (1.0 + np.vectorize(math.erf)(g / math.sqrt(2.0))),
         "gelu_tanh": lambda g: 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))}


@pytest.mark.parametrize("activation", sorted(GATES))
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 8, 16, 17, 60])
@pytest.mark.parametrize("experts,n,k", [(5, 40, 64), (130, 200, 96), (9, 72, 40), (6, 1536, 2048)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gated_gathered_linear_matches_definition(activation, dtype, rows, experts, n, k, with_bias) -> None:
    """The gated GEMV (a decode step's rows: act(gate) * up of each row's expert in one kernel) and the composition
    it leaves a prompt's rows to, against the op's float64 definition (each half rounded to the storage type)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gated_gathered_linear

    x, w, bias, index, h = _gathered_case(rows + n + k, rows, experts, n, k, dtype, with_bias)
    h = h.astype(dtype).astype(np.float64)
    want = GATES[activation](h[:, :n // 2]) * h[:, n // 2:]
    got = gated_gathered_linear(cp.asarray(x), cp.asarray(w), cp.asarray(index),
                                None if bias is None else cp.asarray(bias), activation=activation)
    assert got.shape == (rows, n // 2) and got.dtype == x.dtype
    _check(got, want, dtype)


def test_gated_gathered_linear_gives_nan_rows_for_out_of_range_experts() -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gated_gathered_linear

    rng = np.random.default_rng(3)
    x = cp.asarray(rng.standard_normal((4, 64)).astype(BFLOAT16))
    w = cp.asarray(rng.standard_normal((3, 32, 64)).astype(BFLOAT16))
    got = cp.asnumpy(gated_gathered_linear(x, w, cp.asarray(np.array([0, 3, -1, 2])), activation="silu"))
    assert np.isnan(got[[1, 2]].astype(np.float32)).all() and np.isfinite(got[[0, 3]].astype(np.float32)).all()


@pytest.mark.parametrize("rows", [8, 200])
def test_gathered_linear_is_captured_as_a_graph(rows) -> None:
    """Both paths keep the index on the GPU: the kernels run inside a CUDA graph capture and its replays follow
    new indices written into the same buffer."""
    import cupy as cp

    from kiln.runtime.backends.cuda import CUDABackend
    from kiln.runtime.backends.cuda.kernels.experts import gathered_linear

    rng = np.random.default_rng(rows)
    x = cp.asarray(rng.standard_normal((rows, 128)).astype(BFLOAT16))
    w = rng.standard_normal((16, 96, 128)).astype(BFLOAT16)
    index = cp.asarray(_index(rng, rows, 16))
    gathered_linear(x, cp.asarray(w), index)  # compiles the kernels outside the capture
    weight = cp.asarray(w)
    graph, (out,) = CUDABackend(None).capture(lambda: [gathered_linear(x, weight, index)])
    for seed in range(3):
        picked = _index(np.random.default_rng(seed), rows, 16)
        index[...] = cp.asarray(picked)
        graph.launch()
        want = np.einsum("sk,snk->sn", cp.asnumpy(x).astype(np.float64), w.astype(np.float64)[picked])
        _check(out, want, BFLOAT16)


@pytest.mark.parametrize("n,k", [(128, 8), (60, 4), (1024, 32), (8, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("largest", [True, False], ids=["largest", "smallest"])
def test_router_topk_equals_the_stable_order(n, k, dtype, largest) -> None:
    """topk.cu (a warp per row) picks what the CPU kernel's stable order picks: ties by position, NaN above +inf
    for largest and last for smallest, -0.0 tied with 0.0."""
    import cupy as cp

    from kiln.runtime.backends.array_api.sort import topk as portable_topk
    from kiln.runtime.backends.cuda.kernels.sort import topk

    rng = np.random.default_rng(n + k)
    x = rng.integers(-6, 6, (5, n)).astype(np.float32) / 4  # many ties
    x[1, rng.integers(0, n, 3)] = np.nan
    x[2, :4] = [0.0, -0.0, np.inf, -np.inf]
    x = x.astype(dtype)
    want_values, want_indices = portable_topk(np, x, k, 1, largest)
    values, indices = topk(cp.asarray(x), k, -1, largest)
    np.testing.assert_array_equal(cp.asnumpy(indices), want_indices)
    np.testing.assert_array_equal(cp.asnumpy(values).astype(np.float32), want_values.astype(np.float32))


@pytest.mark.parametrize("n,k", [(128, 8), (60, 4), (256, 32), (8, 1)])
@pytest.mark.parametrize("dtype,out", [(BFLOAT16, BFLOAT16), (np.float32, np.float32), (BFLOAT16, np.float32)],
                         ids=["bfloat16", "float32", "bfloat16-float32"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_route_experts_kernel_equals_the_chain(n, k, dtype, out, normalize) -> None:
    """topk.cu's route_rows (softmax, top-k, renormalization in one warp) against the op's chain of CPU kernels:
    the same experts (ties to the lower index, a NaN row's first k), the same weights to a float32 rounding."""
    import cupy as cp

    from kiln.ir.dtypes import DType
    from kiln.runtime.backends import composite
    from kiln.runtime.backends.cpu import CPU_KERNELS
    from kiln.runtime.backends.cuda.kernels.experts import route_experts

    rng = np.random.default_rng(n * k)
    logits = (rng.integers(-40, 40, (33, n)) / 8).astype(dtype)  # ties in every row
    logits[3, 5] = np.nan
    want_weights, want_ids = composite.route_experts(CPU_KERNELS.kernels, logits, k, normalize, DType.from_numpy(out))
    weights, ids = route_experts(cp.asarray(logits), k, normalize, DType.from_numpy(out))
    assert weights.dtype == np.dtype(out) and ids.dtype == np.int64
    np.testing.assert_array_equal(cp.asnumpy(ids), want_ids)
    np.testing.assert_allclose(cp.asnumpy(weights).astype(np.float32), want_weights.astype(np.float32),
                               rtol=8e-3 if out == BFLOAT16 else 1e-5)


def _combined(rows64: np.ndarray, combine: np.ndarray, dtype) -> np.ndarray:
    """The op's combine on exact rows: each row and each product rounded to dtype, the sum in float64."""
    tokens, k = combine.shape
    rounded = rows64.astype(dtype).astype(np.float64).reshape(tokens, k, -1)
    products = (rounded * combine.astype(np.float64)[:, :, None]).astype(dtype).astype(np.float64)
    return products.sum(axis=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 2, 40])
@pytest.mark.parametrize("experts,n,k,topk", [(6, 2048, 768, 8), (9, 45, 64, 3), (130, 200, 96, 8), (20, 4096, 64, 12)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gathered_linear_with_combine_matches_definition(dtype, tokens, experts, n, k, topk, with_bias) -> None:
    """gemv.cu's gathered_combine (a decode step's tokens: the k rows summed in the block) and combine_rows after
    the grouped product (a prompt's) against the op's definition."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gathered_linear

    rng = np.random.default_rng(tokens * n + topk)
    rows = tokens * topk
    x = rng.standard_normal((rows, k)).astype(dtype)
    w = (rng.standard_normal((experts, n, k)) / np.sqrt(k)).astype(dtype)
    bias = rng.standard_normal((experts, n)).astype(dtype) if with_bias else None
    combine = rng.uniform(0.0, 1.0, (tokens, topk)).astype(dtype)
    index = _index(rng, rows, experts)
    f64 = [None if a is None else a.astype(np.float64) for a in (x, w, bias)]
    exact = np.einsum("sk,snk->sn", f64[0], f64[1][index]) + (f64[2][index] if with_bias else 0.0)
    want = _combined(exact, combine, dtype)
    got = gathered_linear(cp.asarray(x), cp.asarray(w), cp.asarray(index),
                          None if bias is None else cp.asarray(bias), cp.asarray(combine))
    assert got.shape == (tokens, n) and got.dtype == x.dtype
    _check(got, want, dtype)


@pytest.mark.parametrize("tokens", [1, 10])
def test_gathered_quantized_linear_with_combine(tokens) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.experts import gathered_quantized_linear

    rng = np.random.default_rng(tokens)
    experts, n, k, topk, bits, group = 5, 64, 128, 4, 4, 32
    q, scale, zero = quantize_rows(rng.standard_normal((experts * n, k)).astype(np.float32), bits, group, False)
    scale, zero = scale.astype(BFLOAT16), zero.astype(BFLOAT16)
    weight = dequantize(np, q, scale.astype(np.float32), zero.astype(np.float32), bits, group).astype(
        np.float64).reshape(experts, n, k)
    x = rng.standard_normal((tokens * topk, k)).astype(BFLOAT16)
    combine = rng.uniform(0.0, 1.0, (tokens, topk)).astype(BFLOAT16)
    index = _index(rng, tokens * topk, experts)
    want = _combined(np.einsum("sk,snk->sn", x.astype(np.float64), weight[index]), combine, BFLOAT16)
    got = gathered_quantized_linear(cp.asarray(x), *(cp.asarray(a.reshape(experts, n, -1)) for a in (q, scale, zero)),
                                    cp.asarray(index), None, cp.asarray(combine), bits=bits, group_size=group)
    assert got.shape == (tokens, n)
    _check(got, want, BFLOAT16)


def _norm_route_case(seed: int, rows: int, experts: int, width: int, dtype, with_bias: bool, with_norm: bool):
    """(x, residual, norm weight or None, router weight, bias or None) of a MoE block's norm and router."""
    rng = np.random.default_rng(seed)
    x, residual = (rng.standard_normal((1, rows, width)).astype(dtype) for _ in range(2))
    norm_weight = (1 + 0.2 * rng.standard_normal(width)).astype(dtype) if with_norm else None
    weight = (rng.standard_normal((experts, width)) / np.sqrt(width)).astype(dtype)
    bias = rng.standard_normal(experts).astype(dtype) if with_bias else None
    return x, residual, norm_weight, weight, bias


def _check_norm_route(got: tuple, x, residual, weight, bias, k: int, normalize: bool, dtype) -> None:
    """got = (total, normed, weights, indices): the sum exact, the norm within the storage type's rounding, the picks
    the k largest logits of the kernel's own normalized rows (float64: a pick may only trade places with a logit an
    output rounding away), the weights their softmax."""
    import cupy as cp

    total, normed, weights, indices = (cp.asnumpy(a) for a in got)
    f32 = [None if a is None else a.astype(np.float32) for a in (x, residual, weight, bias)]
    np.testing.assert_array_equal(total.astype(np.float32), (f32[0] + f32[1]).astype(dtype).astype(np.float32))
    rows = normed.reshape(-1, normed.shape[-1]).astype(np.float64)
    logits = rows @ weight.astype(np.float64).T + (0.0 if bias is None else bias.astype(np.float64))
    top = -np.sort(-logits, axis=-1)[:, :k]
    ulp = ULP[np.dtype(dtype)] * 2 * np.abs(logits).max()
    np.testing.assert_allclose(np.take_along_axis(logits, indices, axis=-1), top, rtol=0, atol=ulp)
    assert all(len(set(row)) == k for row in indices.tolist())
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    want = np.take_along_axis(p / p.sum(axis=-1, keepdims=True), indices, axis=-1)
    if normalize:
        want = want / want.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(weights.astype(np.float64), want, rtol=ULP[np.dtype(weights.dtype)] * 8 + 4 * ulp,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("experts,width,k", [(128, 2048, 8), (12, 64, 3), (256, 200, 32), (40, 1024, 1)])
@pytest.mark.parametrize("with_bias,with_norm", [(False, True), (True, False)], ids=["norm", "bias-nonorm"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_add_rms_norm_route_experts_matches_definition(dtype, rows, experts, width, k, with_bias, with_norm,
                                                       normalize) -> None:
    """gemv.cu's add_rms_norm_route (up to 4 rows; the composition above) against float64: the residual sum, the
    norm, the router's picks and weights, float32 weights out as the op's dtype asks."""
    import cupy as cp

    from kiln.ir.dtypes import DType
    from kiln.runtime.backends.cuda.kernels.experts import add_rms_norm_route_experts

    case = _norm_route_case(rows * experts + width, rows, experts, width, dtype, with_bias, with_norm)
    out = np.float32 if normalize else dtype
    got = add_rms_norm_route_experts(*(None if a is None else cp.asarray(a) for a in case), axes=1, eps=1e-6, k=k,
                                     normalize=normalize, dtype=DType.from_numpy(out))
    assert got[2].shape == got[3].shape == (rows, k) and got[2].dtype == np.dtype(out)
    x, residual, norm_weight, weight, bias = case
    _check_norm_route(got, x, residual, weight, bias, k, normalize, dtype)
    sums = (x.astype(np.float32) + residual.astype(np.float32)).astype(dtype).astype(np.float64)
    want_normed = sums / np.sqrt((sums ** 2).mean(axis=-1, keepdims=True) + 1e-6)
    if norm_weight is not None:
        want_normed = want_normed * norm_weight.astype(np.float64)
    _check(got[1].reshape(rows, width), want_normed.reshape(rows, width), dtype)


def test_add_rms_norm_route_experts_gives_nan_picks_for_a_nan_row() -> None:
    """A NaN in a row makes its logits NaN; the pick is then the first k experts with NaN weights, as the
    softmax and top-k the node stands for give; the other rows are untouched."""
    import cupy as cp

    from kiln.ir.dtypes import DType
    from kiln.runtime.backends.cuda.kernels.experts import add_rms_norm_route_experts

    x, residual, norm_weight, weight, _ = _norm_route_case(3, 3, 128, 2048, BFLOAT16, False, True)
    x[0, 1, 7] = np.nan
    got = add_rms_norm_route_experts(*(cp.asarray(a) for a in (x, residual, norm_weight, weight)), None, axes=1,
                                     eps=1e-6, k=8, normalize=True, dtype=DType.bfloat16)
    weights, indices = (cp.asnumpy(a) for a in got[2:])
    assert np.isnan(weights[1].astype(np.float32)).all() and indices[1].tolist() == list(range(8))
    assert np.isfinite(weights[[0, 2]].astype(np.float32)).all()


def test_add_rms_norm_route_experts_is_captured_as_a_graph() -> None:
    """The kernel's ticket (its last block picks) is zeroed once for the graph and reset by every launch: replays
    with new rows written into the same buffers pick what the eager kernel picks for them, a second router's too
    after a temporary was written and freed (the graph's pool hands such memory out again: the ticket must not be
    there, or every replay writes over its zero)."""
    import cupy as cp

    from kiln.ir.dtypes import DType
    from kiln.runtime.backends.cuda import CUDABackend
    from kiln.runtime.backends.cuda.kernels.experts import add_rms_norm_route_experts

    x, residual, norm_weight, weight, _ = (None if a is None else cp.asarray(a)
                                           for a in _norm_route_case(0, 1, 128, 2048, BFLOAT16, False, True))

    def route() -> list:
        return list(add_rms_norm_route_experts(x, residual, norm_weight, weight, None, axes=1, eps=1e-6, k=8,
                                               normalize=True, dtype=DType.bfloat16))

    def step() -> list:
        first = route()
        scribbles = [cp.full(128, 0x7FFFFFFF, dtype=np.uint32) for _ in range(8)]  # (the pool's 512-byte blocks:
        del scribbles                                                              #  the second router's too)
        return first + route()

    route()  # compiles the kernel outside the capture
    graph, outputs = CUDABackend(None).capture(step)
    for seed in range(4):
        rng = np.random.default_rng(seed + 10)
        x[...] = cp.asarray(rng.standard_normal(x.shape).astype(BFLOAT16))
        residual[...] = cp.asarray(rng.standard_normal(x.shape).astype(BFLOAT16))
        graph.launch()
        want = route() * 2
        for got, expected in zip(outputs, want, strict=True):
            np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(expected))
