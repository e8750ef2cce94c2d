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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("shapes", [((64, 2048), (2048, 512)), ((5, 70), (70, 300)), ((33, 128), (128, 8))])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["product", "accumulate"])
def test_tuned_matmul_matches_and_keeps_one_plan_a_shape(layout, shapes, dtype, accumulate, monkeypatch):
    """cublas.matmul(tuned=True): each new shape timed once (cuBLASLt's candidates against GemmEx, cublaslt.py),
    the same shape again reusing the plan; against NumPy in float32 and against the untuned product, with out
    (accumulate: out += a @ b, out unchanged by the timing runs) and without, for every operand layout."""
    import cupy as cp
    import ml_dtypes

    from kiln.runtime.backends.cuda import cublas, cublaslt

    monkeypatch.setattr(cublaslt, "_PLANS", {})
    monkeypatch.setattr(cublaslt, "TUNE_RUNS", 2)
    rng = np.random.default_rng(2)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    a, b = (rng.standard_normal(s).astype(np.float32).astype(np_dtype) for s in shapes)
    c = rng.standard_normal((shapes[0][0], shapes[1][1])).astype(np.float32).astype(np_dtype)
    want = np.matmul(a.astype(np.float32), b.astype(np.float32)) + (c.astype(np.float32) if accumulate else 0)
    make_a, make_b = LAYOUTS[layout]
    results = []
    for tuned in (True, True, False):
        out = cp.asarray(c) if accumulate else None
        got = cublas.matmul(make_a(cp, cp.asarray(a)), make_b(cp, cp.asarray(b)), out=out, accumulate=accumulate,
                            tuned=tuned)
        results.append(cp.asnumpy(got).astype(np.float32))
    assert len(cublaslt.plans()) == 1
    (plan,) = cublaslt.plans().values()
    assert "gemmex" in plan.timings and (plan.algo is None or plan.timings["chosen"] < plan.timings["gemmex"])
    for got in results:
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=8e-2 * np.sqrt(shapes[0][1] / 64))
    np.testing.assert_array_equal(results[0], results[1])  # one plan, the same algorithm both times


def test_tuned_matmul_under_capture_without_a_plan_runs_gemmex_and_tunes_nothing(monkeypatch):
    """A shape first met inside a stream capture cannot be timed there: GemmEx is captured, no plan is made; the
    graph's product is right."""
    import cupy as cp

    from kiln.runtime.backends.cuda import cublas, cublaslt

    monkeypatch.setattr(cublaslt, "_PLANS", {})
    a, b = cp.ones((16, 64), dtype=cp.float16), cp.ones((64, 32), dtype=cp.float16)
    cublas.matmul(a[:1], b)  # the handles, outside the capture
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        stream.begin_capture()
        out = cublas.matmul(a, b, tuned=True)
        graph = stream.end_capture()
    assert cublaslt.plans() == {}
    a += 1
    graph.launch()
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), np.full((16, 32), 128.0, dtype=np.float16))


def test_tuned_plan_runs_inside_a_capture():
    """A shape tuned before the capture runs its chosen algorithm inside it (cuBLASLt with its own workspace)."""
    import cupy as cp

    from kiln.runtime.backends.cuda import cublas, cublaslt

    a, b = cp.ones((64, 256), dtype=cp.float16), cp.ones((256, 2048), dtype=cp.float16)
    cublas.matmul(a, b, tuned=True)
    assert any(key[3:6] == (2048, 64, 256) for key in cublaslt.plans())
    stream = cp.cuda.Stream(non_blocking=False)
    with stream:
        stream.begin_capture()
        out = cublas.matmul(a, b, tuned=True)
        graph = stream.end_capture()
    a += 1
    graph.launch()
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), np.full((64, 2048), 512.0, dtype=np.float16))


def test_tuned_matmul_of_a_view_off_the_alignment_stays_on_gemmex(monkeypatch):
    """cuBLASLt's heuristics assume 256-byte aligned operands: a view one row (128 bytes) into its array keeps
    GemmEx."""
    import cupy as cp

    from kiln.runtime.backends.cuda import cublas, cublaslt

    monkeypatch.setattr(cublaslt, "_PLANS", {})
    a, b = cp.ones((17, 64), dtype=cp.float16), cp.ones((64, 32), dtype=cp.float16)
    out = cublas.matmul(a[1:], b, tuned=True)  # 128 bytes into a pool block (CuPy's are 512-byte aligned)
    assert cublaslt.plans() == {}
    np.testing.assert_array_equal(cp.asnumpy(out), np.full((16, 32), 64.0, dtype=np.float16))
