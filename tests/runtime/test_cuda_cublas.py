"""kiln's own cuBLAS calls (capturable, bfloat16): every operand layout the kernels pass, against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import BACKENDS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif("cuda" not in BACKENDS, reason="needs an NVIDIA GPU with CuPy")]

def _transposed_view(xp, x):
    return xp.ascontiguousarray(x.swapaxes(-1, -2)).swapaxes(-1, -2)


def _strided_rows(xp, x):
    padded = xp.zeros(x.shape[:-1] + (x.shape[-1] + 3,), dtype=x.dtype)
    padded[..., :x.shape[-1]] = x
    return padded[..., :x.shape[-1]]


LAYOUTS = {  # (a's, b's): the same values, laid out as the kernels pass them
    "plain": (lambda xp, a: a, lambda xp, b: b),
    "b transposed view": (lambda xp, a: a, _transposed_view),
    "a transposed view": (_transposed_view, lambda xp, b: b),
    "strided rows": (_strided_rows, _strided_rows),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shapes", [((5, 7), (7, 3)), ((1, 64), (64, 9)), ((2, 3, 4, 8), (3, 8, 5)),
                                    ((4, 1, 6), (1, 6, 2)), ((3, 2, 5), (5, 1))])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_matmul_layouts(layout, shapes, dtype):
    import cupy as cp
    import ml_dtypes

    from kiln.runtime.backends.cuda import cublas

    rng = np.random.default_rng(0)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    a, b = (rng.standard_normal(s).astype(np.float32).astype(np_dtype) for s in shapes)
    want = np.matmul(a.astype(np.float32), b.astype(np.float32))
    make_a, make_b = LAYOUTS[layout]
    got = cp.asnumpy(cublas.matmul(make_a(cp, cp.asarray(a)), make_b(cp, cp.asarray(b)))).astype(np.float32)
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4)


def test_matmul_accumulates_into_out_rounded_once():
    import cupy as cp

    from kiln.runtime.backends.cuda import cublas

    rng = np.random.default_rng(1)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((4, 16), (16, 8), (4, 8)))
    out = cp.asarray(c)
    cublas.matmul(cp.asarray(a), cp.asarray(b), out=out, accumulate=True)
    np.testing.assert_allclose(cp.asnumpy(out), a @ b + c, rtol=1e-5, atol=1e-5)


def test_matmul_is_capturable():
    import cupy as cp

    from kiln.runtime.backends.cuda import cublas

    a, b = cp.ones((8, 32), dtype=cp.float32), cp.ones((32, 4), dtype=cp.float32)
    cublas.matmul(a, b)  # set the handle up outside the capture
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        stream.begin_capture()
        out = cublas.matmul(a, b)
        graph = stream.end_capture()
    a += 1
    graph.launch()
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), np.full((8, 4), 64.0, dtype=np.float32))
