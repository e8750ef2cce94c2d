"""The GPU's weight-only quantized linear (row-streaming kernel for a few rows, dequantize + cuBLAS for more)
against the op's definition (the portable dequantization), in the storage types a model uses."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.export.quantize import quantize_rows
from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.array_api.quant import dequantize
from tests.conftest import BACKENDS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif("cuda" not in BACKENDS, reason="needs an NVIDIA GPU with CuPy")]

CONFIGS = [(8, 64, True), (8, 96, False), (4, 64, True), (4, 32, False), (8, 40, True), (4, 40, False),
           (4, 32, "offset"), (8, 16, "offset"), (4, 40, "offset")]
"""(bits, group, symmetric): group 40 is not a multiple of the 4-byte loads and takes the element-wise path;
"offset": the zero points turned into the op's additive offsets (W = q * scale + offset, GGUF's form)."""


@pytest.mark.parametrize("bits,group,symmetric", CONFIGS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_quantized_linear_matches_definition(bits, group, symmetric, rows, dtype, with_bias) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.linalg import quantized_linear

    rng = np.random.default_rng(rows * 7 + bits)
    k, n = 3 * group, 45
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
    offset = symmetric == "offset"
    q, scale, zero = quantize_rows(w, bits, group, symmetric is True)
    if offset:
        zero = -zero * scale
    scale, zero = scale.astype(dtype), None if zero is None else zero.astype(dtype)
    bias = rng.standard_normal(n).astype(dtype) if with_bias else None
    x = rng.standard_normal((2, rows, k)).astype(dtype)
    f32 = [None if a is None else a.astype(np.float32) for a in (x, scale, zero, bias)]
    want = f32[0].astype(np.float64) @ dequantize(np, q, f32[1], f32[2], bits, group, offset).T.astype(np.float64)
    if with_bias:
        want += f32[3]
    got = quantized_linear(*(None if a is None else cp.asarray(a) for a in (x, q, scale, zero, bias)), bits, group,
                           offset)
    assert got.shape == (2, rows, n) and got.dtype == dtype
    tol = 1e-4 if dtype == np.float32 else 2e-2  # bfloat16: one rounding of the output (and of W for many rows)
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol * np.sqrt(k))
