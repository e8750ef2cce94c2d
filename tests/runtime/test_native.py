"""The compiled CPU helpers: equal to PyTorch (and so to the NumPy kernels) over a grid of geometries, and a clean
fallback to NumPy when they are turned off or cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.runtime.backends.cpu import conv as conv_kernels
from kiln.runtime.backends.cpu import forms, native
from kiln.runtime.backends.cpu.registry import CPU_KERNELS

lib = native.library()
ACTIVATIONS = {"none": (("none", None, None), lambda t: t), "relu6": (("clamp", 0.0, 6.0), F.relu6),
               "hardswish": (("hardswish", None, None), F.hardswish)}
needs_native = pytest.mark.skipif(lib is None, reason="no C compiler here: the compiled helpers are not built")


def _conv_cases():
    """(name, in channels, out channels, groups, size, kernel, stride, padding, dilation, batch)."""
    rng = np.random.default_rng(7)
    yield "mobilenet_dw_5x5", 24, 24, 24, (14, 14), (5, 5), (1, 1), (2, 2), (1, 1), 1
    yield "dw_stride2_odd", 8, 8, 8, (13, 11), (3, 3), (2, 2), (1, 1), (1, 1), 2
    yield "dw_stride3_dilated", 5, 5, 5, (17, 19), (3, 5), (3, 2), (2, 3), (2, 1), 1
    yield "dw_no_padding", 6, 6, 6, (9, 9), (7, 7), (1, 1), (0, 0), (1, 1), 1
    yield "dw_big_padding", 4, 4, 4, (5, 6), (3, 3), (1, 2), (3, 4), (1, 1), 1
    yield "dw_1x1", 4, 4, 4, (5, 5), (1, 1), (2, 2), (0, 0), (1, 1), 1
    yield "dense_3x3", 6, 10, 1, (12, 12), (3, 3), (1, 1), (1, 1), (1, 1), 2
    yield "winograd", 16, 24, 1, (15, 14), (3, 3), (1, 1), (1, 1), (1, 1), 2  # odd size: cropped tiles
    yield "winograd_asymmetric", 8, 8, 1, (16, 16), (3, 3), (1, 1), ((0, 1), (2, 0)), (1, 1), 1
    yield "winograd_no_padding", 12, 9, 1, (20, 17), (3, 3), (1, 1), (0, 0), (1, 1), 1
    yield "dense_7x7_s2", 3, 8, 1, (23, 23), (7, 7), (2, 2), (3, 3), (1, 1), 1
    yield "grouped_dilated", 8, 6, 2, (10, 9), (3, 2), (1, 2), (2, 1), (2, 3), 1
    yield "dense_1x1_padded", 4, 5, 1, (6, 6), (1, 1), (1, 1), (1, 1), (1, 1), 1
    yield "dw_same_asymmetric", 6, 6, 6, (14, 14), (5, 5), (2, 2), ((1, 2), (2, 1)), (1, 1), 1  # (before, after)
    yield "dense_asymmetric", 3, 4, 1, (9, 8), (3, 3), (2, 2), ((0, 1), (1, 0)), (1, 1), 1
    yield "dw_big_map", 18, 18, 18, (33, 31), (3, 3), (1, 1), (1, 1), (1, 1), 1  # bands of rows, tails of 16
    yield "dw_big_map_s2_5x5", 5, 5, 5, (40, 36), (5, 5), (2, 2), (2, 2), (1, 1), 2
    yield "pointwise_packed_7x7", 64, 96, 1, (7, 7), (1, 1), (1, 1), (0, 0), (1, 1), 2  # 49 = 32 + 16 + 1 columns
    yield "pointwise_packed_tails", 70, 101, 1, (14, 15), (1, 1), (1, 1), (0, 0), (1, 1), 1  # 210 = 6 x 32 + 18
    yield "pointwise_packed_1x1_map", 64, 96, 1, (1, 1), (1, 1), (1, 1), (0, 0), (1, 1), 3
    for i in range(6):  # random geometries: every combination path gets exercised
        k = tuple(int(v) for v in rng.integers(1, 6, 2))
        s = tuple(int(v) for v in rng.integers(1, 4, 2))
        d = tuple(int(v) for v in rng.integers(1, 3, 2))
        p = tuple(int(v) for v in rng.integers(0, 4, 2))
        size = tuple(int(v) + (kk - 1) * dd + 1 for v, kk, dd in zip(rng.integers(1, 12, 2), k, d))
        c = int(rng.integers(1, 7))
        yield f"random_dw_{i}", c, c, c, size, k, s, p, d, int(rng.integers(1, 3))
        yield f"random_dense_{i}", c, 3, 1, size, k, s, p, d, 1


@needs_native
@pytest.mark.parametrize("case", list(_conv_cases()), ids=lambda c: c[0])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ["none", "relu6", "hardswish"])
def test_compiled_conv2d_matches_torch(case, with_bias, activation):
    _, c, o, groups, size, k, s, p, d, n = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, *size), dtype=np.float32)
    w = rng.standard_normal((o, c // groups, *k), dtype=np.float32)
    b = rng.standard_normal(o, dtype=np.float32) if with_bias else None
    before, after = zip(*p) if isinstance(p[0], tuple) else (p, p)
    got = conv_kernels._conv2d_compiled(x, w, b, s, before, after, d, groups, ACTIVATIONS[activation][0])
    xt = F.pad(torch.from_numpy(x), (before[1], after[1], before[0], after[0]))
    want = F.conv2d(xt, torch.from_numpy(w), None if b is None else torch.from_numpy(b), s, 0, d, groups)
    want = ACTIVATIONS[activation][1](want).numpy()
    assert got is not None and got.shape == want.shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(np.prod(k) * c / groups))


@needs_native
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (12, 5, 32), (13, 7, 33), (5, 3, 17), (30, 40, 49), (100, 64, 196),
                                   (25, 9, 20), (7, 0, 10), (37, 300, 70), (9, 20, 35), (14, 50, 98),
                                   (300, 500, 45)])  # the last: A big, B packed whole
@pytest.mark.parametrize("activation", ["none", "relu6", "hardswish"])
@pytest.mark.parametrize("b_rows", [False, True], ids=["b", "b_transposed"])
def test_packed_gemm_matches_float64_on_any_thread_count(m, k, n, activation, b_rows, monkeypatch):
    """Every tile shape (full, 16 wide, padded, the last few columns), rows past the last panel, strided operands,
    B given as [k, n] or as its transpose (a linear layer's input rows); the same bits on 1 and 2 threads."""
    rng = np.random.default_rng(m * 1000 + n)
    a = rng.standard_normal((m, k), dtype=np.float32)
    given = rng.standard_normal((n, k + 3) if b_rows else (k, n + 3), dtype=np.float32) * 3
    given = given[:, 2:given.shape[1] - 1]  # rows strided
    b = given.T if b_rows else given
    bias = rng.standard_normal(m, dtype=np.float32)
    (name, lo, hi), fn = ACTIVATIONS[activation]
    packed = native.pack_gemm_weight(a)
    outs = []
    for threads in (1, 2):
        monkeypatch.setenv("KILN_THREADS", str(threads))
        out = np.full((m, n + 5), np.nan, np.float32)
        native.gemm_packed(packed, m, given, out[:, :n], bias, name, lo, hi, b_rows=b_rows)
        assert np.isnan(out[:, n:]).all()  # nothing written past the output's columns
        outs.append(out[:, :n])
    np.testing.assert_array_equal(outs[0], outs[1])
    want = fn(torch.from_numpy(a.astype(np.float64) @ b.astype(np.float64) + bias[:, None])).numpy()
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5 * np.sqrt(max(k, 1)) * 3)


@needs_native
@pytest.mark.parametrize("shape,out,groups,kernel,stride", [
    ((2, 37, 7, 7), 37, 37, 5, 1), ((1, 16, 14, 13), 16, 16, 3, 2), ((1, 5, 3, 3), 5, 5, 3, 1),  # depthwise.c
    ((2, 3, 15, 17), 20, 1, 3, 2), ((1, 3, 40, 33), 16, 1, 7, 2)])  # direct.c: an image's channels
def test_channel_vector_kernels_are_the_same_on_any_thread_count(shape, out, groups, kernel, stride, monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape, dtype=np.float32)
    w = rng.standard_normal((out, shape[1] // groups, kernel, kernel), dtype=np.float32)
    b = rng.standard_normal(out, dtype=np.float32)
    outs = []
    for threads in (1, 2):
        monkeypatch.setenv("KILN_THREADS", str(threads))
        outs.append(conv_kernels._conv2d_compiled(x, w, b, (stride, stride), (kernel // 2,) * 2, (kernel // 2,) * 2,
                                                  (1, 1), groups, ("hardswish", None, None)))
    np.testing.assert_array_equal(outs[0], outs[1])
    want = F.hardswish(F.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), stride, kernel // 2,
                                1, groups)).numpy()
    np.testing.assert_allclose(outs[0], want, rtol=1e-5, atol=1e-5 * kernel * (shape[1] // groups))


@needs_native
@pytest.mark.parametrize("kind,c,o,k", [("winograd", 8, 8, 3), ("gemm", 64, 96, 1)])
def test_weights_are_transformed_once_per_array(kind, c, o, k):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, c, 16, 16), dtype=np.float32)
    w = rng.standard_normal((o, c, k, k), dtype=np.float32)
    args = (None, (1, 1), (k // 2, k // 2), (k // 2, k // 2), (1, 1), 1, ("none", None, None))
    first = conv_kernels._conv2d_compiled(x, w, *args)
    key = (kind, id(w))
    cached = forms._forms[key][1]
    np.testing.assert_array_equal(conv_kernels._conv2d_compiled(x, w, *args), first)
    assert forms._forms[key][1] is cached
    del w
    assert key not in forms._forms  # dropped with its weight


@needs_native
def test_compiled_conv2d_declines_what_it_cannot_take():
    x = np.ones((1, 2, 5, 5), np.float32)
    w = np.ones((2, 1, 3, 3), np.float32)
    none = ("none", None, None)
    compiled = conv_kernels._conv2d_compiled
    assert compiled(x.astype(np.float64), w.astype(np.float64), None, (1, 1), (1, 1), (1, 1), (1, 1), 2, none) is None
    assert compiled(x[..., 0], w[..., 0], None, (1,), (1,), (1,), (1,), 2, none) is None  # 1-d
    assert compiled(x, w, None, (1, 1), (0, 0), (0, 0), (4, 4), 2, none) is None  # empty output
    noncontig = np.ones((1, 2, 5, 10), np.float32)[..., ::2]
    got = compiled(noncontig, w, None, (1, 1), (1, 1), (1, 1), (1, 1), 2, none)
    np.testing.assert_allclose(got, F.conv2d(torch.from_numpy(np.ascontiguousarray(noncontig)), torch.from_numpy(w),
                                             None, 1, 1, 1, 2).numpy(), rtol=1e-6)


_TORCH_UNARY = {
    "sigmoid": torch.sigmoid, "silu": F.silu, "hardsigmoid": F.hardsigmoid, "hardswish": F.hardswish,
    "gelu_erf": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "erf": torch.erf,
}


@needs_native
@pytest.mark.parametrize("name", native.UNARY)
def test_compiled_unary_matches_torch(name):
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(5000, dtype=np.float32) * 4, np.linspace(-120, 120, 2001, dtype=np.float32),
                        np.array([0.0, -0.0, np.nan, 1e-30, -1e-30, 3e38, -3e38], np.float32)])
    got = native.unary(name, x)
    want = _TORCH_UNARY[name](torch.from_numpy(x)).numpy()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-6, atol=1e-6)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    strided = x[:7000].reshape(2, -1)[:, ::3]  # non-contiguous
    np.testing.assert_array_equal(native.unary(name, strided), native.unary(name, strided.copy()))
    assert native.unary(name, np.float32(0.5).reshape(())).shape == ()
    assert native.unary(name, x.astype(np.float64)) is None


def test_every_compiled_function_is_declared():
    lines = [line for f in native.SOURCES for line in f.read_text().splitlines()]
    declared = set(native.SIGNATURES)
    defined = {f"kiln_{m}_f32" for m in native.UNARY}
    defined |= {line.split("(")[0].split()[-1] for line in lines if line.startswith(("void kiln_", "i64 kiln_"))}
    assert declared == defined
    returning = {line.split("(")[0].split()[-1] for line in lines if line.startswith("i64 kiln_")}
    assert returning == set(native.RESULTS)


def _probe(env_update: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    code = ("import numpy as np; from kiln.runtime.backends.cpu import native;"
            "from kiln.runtime.backends.cpu.registry import CPU_KERNELS;"
            "print('lib', native.library() is not None);"
            "x = np.linspace(-3, 3, 7, dtype=np.float32);"
            "print('gelu', CPU_KERNELS.kernels['gelu'](x, 'none').round(5).tolist())")
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path), **env_update}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_helpers_build_wherever_a_compiler_is():
    """A C compiler here and the helpers not built is a bug in their sources: every test marked needs_native would
    skip and every kernel fall back to NumPy, with only a warning in the log to tell (a signature changed in one
    file and not its callers did that once)."""
    if os.environ.get("KILN_NATIVE", "1") == "0" or native._compiler() is None:
        pytest.skip("the helpers are turned off or there is no C compiler")
    assert lib is not None, "a C compiler is here but kiln's CPU helpers did not build: see the kiln.native warning"


@pytest.mark.parametrize("env", [{"KILN_NATIVE": "0"}, {"CC": "false", "PATH": "/nonexistent"}],
                         ids=["turned_off", "no_compiler"])
def test_numpy_fallback_without_the_helpers(env, tmp_path):
    result = _probe(env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "lib False" in result.stdout
    want = F.gelu(torch.linspace(-3, 3, 7)).numpy().round(5).tolist()
    assert f"gelu {want}" in result.stdout


@needs_native
def test_failed_build_falls_back_with_a_warning(tmp_path):
    fake_cc = tmp_path / "cc"
    fake_cc.write_text("#!/bin/sh\necho 'fake compiler: error' >&2\nexit 1\n")
    fake_cc.chmod(0o755)
    result = _probe({"CC": str(fake_cc)}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "lib False" in result.stdout
    assert "helpers are unavailable" in result.stderr and "fake compiler" in result.stderr


@needs_native
def test_build_is_cached_per_source(tmp_path):
    first = _probe({}, tmp_path)
    assert "lib True" in first.stdout, first.stderr
    built = sorted((tmp_path / "native").glob("kernels-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    assert "lib True" in _probe({}, tmp_path).stdout
    assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert not list((tmp_path / "native").glob("*.tmp*"))


def test_kernels_run_without_the_helpers(monkeypatch):
    """The NumPy fallback of each accelerated kernel, in this process (the op suite runs the compiled path)."""
    monkeypatch.setattr(native, "library", lambda: None)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 4, 9, 9), dtype=np.float32)
    w = rng.standard_normal((4, 1, 3, 3), dtype=np.float32)
    for padding_end, activation, reference in (((1, 1), ("none", None, None), lambda t: t),
                                               ((2, 0), ("clamp", 0.0, 6.0), F.relu6),
                                               ((0, 2), ("hardswish", None, None), F.hardswish)):
        got = CPU_KERNELS.kernels["conv"](x, w, None, (2, 2), (1, 1), (1, 1), 4, False, (), padding_end, *activation)
        xt = F.pad(torch.from_numpy(x), (1, padding_end[1], 1, padding_end[0]))
        want = reference(F.conv2d(xt, torch.from_numpy(w), None, 2, 0, 1, 4)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(CPU_KERNELS.kernels["clamp"](x, -0.5, 0.5), np.clip(x, -0.5, 0.5))
    for name, ref in (("sigmoid", torch.sigmoid), ("silu", F.silu), ("hardswish", F.hardswish)):
        np.testing.assert_allclose(CPU_KERNELS.kernels[name](x), ref(torch.from_numpy(x)).numpy(), rtol=1e-5,
                                   atol=1e-6)


@needs_native
@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", [
    ((3, 3), (2, 2), (1, 1), (1, 1), False), ((2, 3), (2, 1), (0, 1), (1, 1), True),
    ((3, 2), (3, 2), (1, 0), (2, 1), True), ((1, 1), (1, 1), (0, 0), (1, 1), False)])
def test_compiled_max_pool_matches_torch(kernel, stride, padding, dilation, ceil_mode):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 11, 10), dtype=np.float32)
    x[0, 0, 2, 3] = np.nan
    x[1, 2, 5:7, 4] = -np.inf
    got = CPU_KERNELS.kernels["max_pool"](x, kernel, stride, padding, dilation, ceil_mode)
    want = F.max_pool2d(torch.from_numpy(x), kernel, stride, padding, dilation, ceil_mode).numpy()
    np.testing.assert_array_equal(got, want)


def _linear_rows(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, threads: int) -> np.ndarray:
    out = np.full((x.shape[0], w.shape[0]), np.nan, dtype=np.float32)
    lib.kiln_linear_rows_f32(x.ctypes.data, w.ctypes.data, native.address(bias), out.ctypes.data, x.shape[0],
                             w.shape[0], x.shape[1], threads)
    return out


@needs_native
@pytest.mark.parametrize("n,k", [(1, 1), (13, 19), (37, 64), (300, 576), (4099, 33)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_few_row_linear_matches_float64(n, k, with_bias):
    rng = np.random.default_rng(n * 7 + k)
    w = rng.standard_normal((n, k), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32) if with_bias else None
    for m in (1, 2, 3, 5, 8, 9, 17):  # past 8 rows the kernel takes the rows 8 at a time
        x = rng.standard_normal((m, k), dtype=np.float32)
        want = x.astype(np.float64) @ w.T.astype(np.float64) + (0.0 if bias is None else bias)
        for threads in (1, 2, 3):
            got = _linear_rows(x, w, bias, threads)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(k))


@needs_native
def test_few_row_linear_is_the_same_alone_batched_and_on_any_thread_count():
    """A sequence's logits may not depend on its neighbours in a batch, nor on the thread count: greedy streams
    served together must equal the same requests served alone (bitwise, not within a tolerance)."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((4096 + 5, 203), dtype=np.float32)
    bias = rng.standard_normal(w.shape[0], dtype=np.float32)
    x = rng.standard_normal((16, 203), dtype=np.float32)  # (past 8 rows the weight is read in chunks)
    batched = _linear_rows(x, w, bias, threads=1)
    for threads in (2, 3, 4):
        assert np.array_equal(_linear_rows(x, w, bias, threads), batched)
    for m in range(1, 16):
        for start in range(0, 16 - m + 1, 3):
            assert np.array_equal(_linear_rows(np.ascontiguousarray(x[start:start + m]), w, bias, 2),
                                  batched[start:start + m])


@needs_native
def test_linear_kernel_takes_few_rows_to_the_helper_and_many_to_blas():
    rng = np.random.default_rng(9)
    w = rng.standard_normal((70, 48), dtype=np.float32)
    bias = rng.standard_normal(70, dtype=np.float32)
    linear = CPU_KERNELS.kernels["linear"]
    for rows in (1, 8, 9, 40):
        x = rng.standard_normal((2, rows, 48), dtype=np.float32)[:, :, :]  # two leading dims
        got = linear(x[0][None], w, bias)
        np.testing.assert_allclose(got[0], x[0] @ w.T + bias, rtol=1e-5, atol=1e-5)
    x = rng.standard_normal((5, 48), dtype=np.float32)[::-1]  # not contiguous: copied first
    np.testing.assert_allclose(linear(x, w, None), x @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(linear(x[:2], w, bias), _linear_rows(np.ascontiguousarray(x[:2]), w, bias, 1))


@needs_native
def test_thread_pool_callers_on_several_threads_and_after_fork():
    """Calls from several Python threads at once (one owns the pool, the others run alone) and from a forked child
    (which has none of the parent's workers) all finish with the right result."""
    import concurrent.futures
    import multiprocessing

    rng = np.random.default_rng(11)
    w = rng.standard_normal((2048, 96), dtype=np.float32)
    xs = [rng.standard_normal((3, 96), dtype=np.float32) for _ in range(16)]
    want = [_linear_rows(x, w, None, 1) for x in xs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            got = list(pool.map(lambda x: _linear_rows(x, w, None, 2), xs))
            assert all(np.array_equal(g, e) for g, e in zip(got, want))
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as child:
        assert child.apply(_child_linear, (xs[0], w), {}) == want[0].tobytes()


def _child_linear(x: np.ndarray, w: np.ndarray) -> bytes:
    return _linear_rows(x, w, None, 2).tobytes()


def test_threads_default_and_override(monkeypatch):
    monkeypatch.delenv("KILN_THREADS", raising=False)
    assert native.threads() >= 1
    monkeypatch.setenv("KILN_THREADS", "3")
    assert native.threads() == 3
    monkeypatch.setenv("KILN_THREADS", "zero")
    assert native.threads() >= 1


def _quantized_case(bits: int, group: int, n: int, k: int, seed: int) -> tuple[np.ndarray, ...]:
    """A random int8/int4 weight (int4 with zero points) and bias."""
    rng = np.random.default_rng(seed)
    levels = 256 if bits == 8 else 16
    q = rng.integers(0, levels, (n, k if bits == 8 else k // 2), dtype=np.uint8)
    if bits == 8:
        q = q.view(np.int8)
    else:
        q = (q & 15) | ((rng.integers(0, 16, q.shape, dtype=np.uint8)) << 4)
    scale = rng.uniform(0.01, 0.1, (n, k // group)).astype(np.float32)
    zero = rng.uniform(0, levels / 2, (n, k // group)).astype(np.float32) if bits == 4 else None
    return q, scale, zero, rng.standard_normal(n, dtype=np.float32)


@needs_native
@pytest.mark.parametrize("dot", ["float", "int8"])
@pytest.mark.parametrize("bits,group", [(8, 64), (8, 200), (8, 256), (4, 32), (4, 64), (4, 128)],
                         ids=["int8-g64", "int8-channel", "int8-channel-dot", "int4-g32", "int4-g64", "int4-g128"])
def test_quantized_few_row_linear_splits_over_threads_without_changing_a_bit(bits, group, dot, monkeypatch):
    """The few-row kernels (kiln_qlinear_f32; kiln_qlinear_dot_f32 with int8 inputs) over 1, 2 and 3 threads and
    for rows alone or batched: the same bits (an output's arithmetic never depends on the split or the batch),
    and the dequantized reference within float32 rounding (float) or within what rounding the inputs to int8 per
    32 can move an output (int8: sum_j |W[o, j]| * the step of x[j]'s block / 2, a bound)."""
    from kiln.runtime.backends.array_api.quant import dequantize

    if dot == "int8" and not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    monkeypatch.setenv("KILN_QUANT_DOT", dot)
    n, k = 1030, 200 if group == 200 else 256  # (groups of 128: two 64-weight steps a scale)
    q, scale, zero, bias = _quantized_case(bits, group, n, k, bits + group)
    x = np.random.default_rng(1).standard_normal((5, k), dtype=np.float32)
    kernel = CPU_KERNELS.kernels["quantized_linear"]
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("KILN_THREADS", threads)
        results.append(kernel(x, q, scale, zero, bias, bits, group))
    assert all(np.array_equal(results[0], r) for r in results[1:])
    alone = np.concatenate([kernel(x[i:i + 1], q, scale, zero, bias, bits, group) for i in range(len(x))])
    assert np.array_equal(results[0], alone)
    weight = dequantize(np, q, scale, zero, bits, group).astype(np.float64)
    want = x.astype(np.float64) @ weight.T + bias
    if dot == "int8" and k % 32 == 0:
        step = np.repeat(np.abs(x.reshape(len(x), k // 32, 32)).max(axis=-1) / 127, 32, axis=-1)
        assert np.all(np.abs(results[0] - want) <= step @ np.abs(weight).T / 2 * (1 + 1e-5) + 1e-3)
        assert np.abs(results[0] - want).max() > 1e-3  # (the integer path ran)
    else:
        np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-3)


@needs_native
@pytest.mark.parametrize("bits,group,offset", [(8, 64, False), (8, 200, False), (4, 32, False), (4, 32, True),
                                              (4, 64, False), (4, 128, True)],
                         ids=["int8-g64", "int8-channel", "int4-g32", "int4-g32-offset", "int4-g64",
                              "int4-g128-offset"])
@pytest.mark.parametrize("rows", [9, 37, 130])
def test_quantized_many_row_linear_is_the_packed_gemm_on_any_thread_count(bits, group, offset, rows, monkeypatch):
    """Past FEW_ROWS (a prompt, an encoder) quantized_linear is gemm.c's kiln_qgemm_f32, dequantizing 32 weight
    rows at a time as it packs them: the same bits on 1, 2 and 3 threads, and the dequantized weight's float64
    product within float32 rounding; weight rows past a multiple of 32 and input rows past a multiple of 12
    included, with and without zero points and bias."""
    from kiln.runtime.backends.array_api.quant import dequantize
    from kiln.runtime.backends.cpu import quant

    monkeypatch.setenv("KILN_QUANT_DOT", "float")  # (int4 at 9-32 rows otherwise takes the integer dot products)
    n, k = 1030, 200 if group == 200 else 256
    q, scale, zero, bias = _quantized_case(bits, group, n, k, bits + group + rows)
    x = np.random.default_rng(rows).standard_normal((rows, k), dtype=np.float32)
    kernel = CPU_KERNELS.kernels["quantized_linear"]
    for z, b in ((zero, bias), (None, None)):
        results = []
        for threads in ("1", "2", "3"):
            monkeypatch.setenv("KILN_THREADS", threads)
            results.append(kernel(x, q, scale, z, b, bits, group, offset))
        assert all(np.array_equal(results[0], r) for r in results[1:])
        weight = dequantize(np, q, scale, z, bits, group, offset).astype(np.float64)
        want = x.astype(np.float64) @ weight.T + (0 if b is None else b)
        np.testing.assert_allclose(results[0], want, rtol=1e-4, atol=1e-3)
    lib, calls = native.library(), []

    class Spy:  # (what ran past FEW_ROWS was the GEMM)
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return (lambda *args: calls.append(args) or fn(*args)) if name == "kiln_qgemm_f32" else fn

    monkeypatch.setattr(native, "library", Spy)
    assert np.array_equal(kernel(x, q, scale, None, None, bits, group, offset), results[0])
    assert len(calls) == (rows > quant.FEW_ROWS)


@needs_native
@pytest.mark.parametrize("group,offset", [(32, True), (32, False), (64, False)], ids=["g32-offset", "g32", "g64"])
def test_int4_rows_past_few_rows_take_the_integer_dot_products(group, offset, monkeypatch):
    """int4 past FEW_ROWS up to INT4_DOT_ROWS (a short prompt's chunk) runs the integer dot products, not the GEMM:
    each row the same bits as the same row among at most FEW_ROWS (a decode step's), so a prompt's rows and a
    decode step's are one computation; one row more is the GEMM's again. Where the helpers have the lanes form
    (test_qlanes.py) it takes every row count, the same bits whatever the rows."""
    from kiln.runtime.backends.cpu import quant

    if not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    q, scale, zero, bias = _quantized_case(4, group, 1030, 256, group + offset)
    x = np.random.default_rng(group).standard_normal((quant.INT4_DOT_ROWS + 1, 256), dtype=np.float32)
    kernel = CPU_KERNELS.kernels["quantized_linear"]
    lanes = quant.lanes_form(4, group, 1028, 256, True, offset)  # (1030 rows: not whole passes of 4: stored layout)
    assert not quant.lanes_form(4, group, 1030, 256, True, offset)
    lib, calls = native.library(), []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return (lambda *args: calls.append(name) or fn(*args)) if name.startswith("kiln_q") and \
                not name.startswith("kiln_qlanes_") or name == "kiln_qlanes_linear_f32" else fn

    monkeypatch.setattr(native, "library", Spy)
    for rows in (quant.FEW_ROWS + 1, quant.INT4_DOT_ROWS):
        calls.clear()
        many = kernel(x[:rows], q, scale, zero, bias, 4, group, offset)
        assert calls == ["kiln_qlinear_dot_f32"]
        for r0 in range(0, rows, quant.FEW_ROWS):
            few = kernel(x[r0:min(r0 + quant.FEW_ROWS, rows)], q, scale, zero, bias, 4, group, offset)
            assert np.array_equal(many[r0:r0 + quant.FEW_ROWS], few)
    calls.clear()
    kernel(x, q, scale, zero, bias, 4, group, offset)
    assert calls == ["kiln_qgemm_f32"]
    if lanes:
        q, scale, zero, bias = q[:1028], scale[:1028], zero[:1028], bias[:1028]
        whole = kernel(x[:quant.INT4_DOT_ROWS], q, scale, zero, bias, 4, group, offset)
        for r0, rows in [(0, 1), (3, 4), (8, 9), (0, 32)]:
            calls.clear()
            assert np.array_equal(kernel(x[r0:r0 + rows], q, scale, zero, bias, 4, group, offset),
                                  whole[r0:r0 + rows])
            assert calls == ["kiln_qlanes_linear_f32"]


@needs_native
@pytest.mark.parametrize("bits,group", [(8, 64), (8, 256), (4, 32), (4, 64), (4, 128)],
                         ids=["int8-g64", "int8-channel", "int4-g32", "int4-g64", "int4-g128"])
def test_integer_dot_is_its_definition(bits, group, monkeypatch):
    """kiln_qlinear_dot_f32 against the integer product's definition (tests/runtime/int8_dot.py: the inputs
    rounded to int8 per 32, ties to even, exact integer sums), within float32 summation: the bound above allows
    the rounding's whole effect, this pins the rounding itself (what the GPU's integer kernel must match)."""
    from tests.runtime.int8_dot import integer_dot

    if not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    monkeypatch.setenv("KILN_QUANT_DOT", "int8")
    q, scale, zero, bias = _quantized_case(bits, group, 1030, 256, bits * group)
    x = np.random.default_rng(2).standard_normal((3, 256), dtype=np.float32)
    got = CPU_KERNELS.kernels["quantized_linear"](x, q, scale, zero, bias, bits, group)
    want = integer_dot(x, q, scale, zero, bias, bits, group, offset=False)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@needs_native
@pytest.mark.parametrize("bits,group,k", [(4, 64, 96), (4, 48, 192), (8, 40, 160), (8, 32, 80)])
def test_integer_dot_declines_shapes_it_cannot_take(bits, group, k):
    """int4 needs k a multiple of 64 and groups of 32 or of a multiple of 64; int8 k and groups multiples of 32:
    otherwise kiln_qlinear_dot_f32 returns 0 and leaves out alone (the caller runs the float kernel)."""
    if not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    q, scale, zero, bias = _quantized_case(bits, group, 8, k, 0)
    x = np.ones((1, k), np.float32)
    out = np.full((1, 8), 7.0, np.float32)
    work = np.empty(k + k // group, np.float32)
    taken = lib.kiln_qlinear_dot_f32(x.ctypes.data, q.ctypes.data, scale.ctypes.data, native.address(zero),
                                     bias.ctypes.data, out.ctypes.data, work.ctypes.data, 1, 8, k, bits, group, 1)
    assert taken == 0 and np.all(out == 7.0)


@needs_native
@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_integer_dot_leaves_inf_and_nan_to_the_float_kernel(value, monkeypatch):
    """An input row holding inf or NaN has no int8 scale: the float kernel runs and gives them their meaning (the
    lanes form, test_qlanes.py: that row alone in float32)."""
    if not native.integer_dot():
        pytest.skip("the helpers here have no byte dot products (AVX2 or VNNI)")
    q, scale, zero, bias = _quantized_case(4, 64, 18, 128, 3)  # (18 rows: not whole passes of 4, the stored layout)
    x = np.random.default_rng(0).standard_normal((2, 128), dtype=np.float32)
    x[1, 5] = value
    kernel = CPU_KERNELS.kernels["quantized_linear"]
    got = kernel(x, q, scale, zero, bias, 4, 64)
    monkeypatch.setenv("KILN_QUANT_DOT", "float")
    assert np.array_equal(got, kernel(x, q, scale, zero, bias, 4, 64), equal_nan=True)
    assert not np.isfinite(got[1]).any()


def _attention_reference(q, k, v, mask, causal, scale):
    from kiln.runtime.backends import array_api

    with np.errstate(all="ignore"):
        return array_api.sdpa(np, q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask, causal,
                              scale)


@needs_native
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D,Dv", [(1, 9, 3, 1, 300, 64, 64), (2, 4, 4, 3, 17, 32, 48),
                                              (1, 8, 2, 5, 40, 80, 80), (1, 2, 1, 2, 2, 16, 16),
                                              # from 16 queries, in tiles of queries (a prefill; 37: a partial tile)
                                              (1, 6, 2, 37, 70, 64, 64), (2, 2, 1, 16, 16, 24, 128)])
@pytest.mark.parametrize("mask_kind", ["none", "shared", "per_head", "prefix", "hidden_row"])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_attention_matches_float64(B, Hq, Hkv, L, S, D, Dv, mask_kind, causal):
    """kiln_attention_f32 over GQA groupings, keys read through strides (a window of a larger cache), bool masks
    shared or per head, a static cache's prefix mask, and a query that sees no key (NaN, as the reference); a
    query at a time and in tiles."""
    rng = np.random.default_rng(S + L)
    q = rng.standard_normal((B, Hq, L, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S + 5, D), dtype=np.float32)[:, :, 2:S + 2]
    v = rng.standard_normal((B, Hkv, S, Dv), dtype=np.float32)
    mask = {"none": None, "shared": rng.random((1, 1, L, S)) < 0.7, "per_head": rng.random((B, Hq, L, S)) < 0.5,
            "prefix": (np.arange(S) < max(1, S // 3))[None, None, None, :],
            "hidden_row": np.ones((1, 1, L, S), bool)}[mask_kind]
    if mask_kind == "hidden_row":
        mask[..., -1, :] = False
    got = native.attention(q, k, v, mask, causal, 0.125)
    want = _attention_reference(q, k, v, mask, causal, 0.125)
    assert got is not None and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    if mask_kind == "hidden_row":
        assert np.isnan(got[..., -1, :]).all()


@needs_native
@pytest.mark.parametrize("mask_kind", ["none", "per_head", "prefix"])
def test_compiled_decode_attention_is_the_same_on_any_thread_count(mask_kind, monkeypatch):
    """kiln_attention_f32's few queries (a decode step) split their (batch, q head) pairs over the pool's threads
    where they read enough keys (SmolLM2's heads over 300 keys do): the same bits on 1, 2 and 3 threads."""
    rng = np.random.default_rng(5)
    B, Hq, Hkv, L, S, D = 2, 9, 3, 2, 300, 64
    q = rng.standard_normal((B, Hq, L, D), dtype=np.float32)
    k, v = (rng.standard_normal((B, Hkv, S, D), dtype=np.float32) for _ in range(2))
    mask = {"none": None, "per_head": rng.random((B, Hq, L, S)) < 0.5,
            "prefix": (np.arange(S) < 250)[None, None, None, :]}[mask_kind]
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("KILN_THREADS", threads)
        results.append(native.attention(q, k, v, mask, False, 0.125))
    assert all(r is not None and np.array_equal(r, results[0]) for r in results)
    np.testing.assert_allclose(results[0], _attention_reference(q, k, v, mask, False, 0.125), rtol=1e-5, atol=1e-6)


@needs_native
def test_compiled_attention_declines_what_it_cannot_take():
    q = np.zeros((1, 2, 1, 16), np.float32)
    k = v = np.zeros((1, 1, 4, 16), np.float32)
    assert native.attention(q, k, v, np.zeros((1, 1, 1, 4), np.float32), False, 1.0) is None  # additive mask
    assert native.attention(q.astype(np.float64), k, v, None, False, 1.0) is None
    assert native.attention(q, k[..., ::2], v, None, False, 1.0) is None  # keys not contiguous in a row
    assert native.attention(q[0], k[0], v[0], None, False, 1.0) is None  # rank 3


@needs_native
@pytest.mark.parametrize("shape,axes", [((3, 5, 576), 1), ((2, 7), 1), ((4, 3, 17), 2), ((1, 1, 1536), 1)],
                         ids=["rows", "short-row", "two-axes", "decode-row"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
def test_compiled_rms_norm_matches_float64(shape, axes, with_weight, monkeypatch):
    """rms_norm and add_rms_norm of float32 rows in one compiled call (row lengths with and without a 16-lane
    tail), the sum written exactly as the add computes it; NumPy's composition is the fallback."""
    calls = []
    compiled = native.add_rms_norm
    monkeypatch.setattr(native, "add_rms_norm", lambda *a: calls.append(a) or compiled(*a))
    rng = np.random.default_rng(len(shape) + axes)
    x, r = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(shape[len(shape) - axes:]).astype(np.float32) if with_weight else None
    dims = tuple(range(len(shape) - axes, len(shape)))

    def reference(v):
        v = v.astype(np.float64)
        out = v / np.sqrt((v * v).mean(axis=dims, keepdims=True) + 1e-5)
        return out * w if w is not None else out

    total, normed = CPU_KERNELS.kernels["add_rms_norm"](x, r, w, axes, 1e-5)
    np.testing.assert_array_equal(total, x + r)
    np.testing.assert_allclose(normed, reference(x + r), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(CPU_KERNELS.kernels["rms_norm"](x, w, axes, 1e-5), reference(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 2
    assert native.add_rms_norm(x.astype(np.float64), None, None, axes, 1e-5) is None  # left to NumPy


def _rope_reference(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    x, cos, sin = (a.astype(np.float64) for a in (x, cos, sin))
    if interleaved:
        rotated = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@needs_native
@pytest.mark.parametrize("B,Hq,Hkv,L,S,D", [(1, 9, 3, 1, 40, 64), (2, 4, 2, 3, 9, 16), (1, 2, 2, 2, 5, 8)])
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("cos_kind", ["shared", "per_batch", "rank2"])
def test_compiled_rope_cache_update_matches_float64(B, Hq, Hkv, L, S, D, interleaved, cos_kind):
    """kiln_rope_cache_update_f32: q, k and v read through strides (k and v as the permute of [B, L, H, D] views
    a projection gives), cos and sin shared, per batch or of rank 2; the roped q returned, the roped k and v
    written at the positions (a negative one counting from the end) and nothing else in the caches touched."""
    rng = np.random.default_rng(B * 100 + L * 10 + D)
    q = rng.standard_normal((B, L, Hq, D), dtype=np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((B, L, Hkv, D), dtype=np.float32).transpose(0, 2, 1, 3)
    v = rng.standard_normal((B, L, Hkv, D), dtype=np.float32).transpose(0, 2, 1, 3)
    cb = B if cos_kind == "per_batch" else 1
    angles = rng.uniform(0, 6, (cb, 1, L, D)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    if cos_kind == "rank2":
        cos, sin = cos[0, 0], sin[0, 0]
    k_cache, v_cache = (rng.standard_normal((B, Hkv, S, D), dtype=np.float32) for _ in range(2))
    before_k, before_v = k_cache.copy(), v_cache.copy()
    positions = np.array([S - 2 - i for i in range(L)], np.int64)
    positions[-1] = -1  # the last slot
    q_out = CPU_KERNELS.kernels["rope_cache_update"](q, k, v, cos, sin, k_cache, v_cache, positions, dims=[2],
                                                     interleaved=interleaved, in_place=True)
    compiled = native.rope_cache_update(q, k, v, cos, sin, before_k.copy(), before_v.copy(), positions, interleaved)
    assert compiled is not None  # (the kernel above took the compiled path too)
    np.testing.assert_allclose(q_out[0], _rope_reference(q, cos, sin, interleaved), rtol=1e-5, atol=1e-6)
    assert q_out[1] is k_cache and q_out[2] is v_cache
    want_k, want_v = before_k.astype(np.float64), before_v.astype(np.float64)
    want_k[:, :, positions] = _rope_reference(k, cos, sin, interleaved)
    want_v[:, :, positions] = v
    np.testing.assert_allclose(k_cache, want_k, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(v_cache, want_v.astype(np.float32))


@needs_native
def test_compiled_rope_cache_update_leaves_bad_positions_to_numpy():
    """A position past the cache writes nothing compiled; the NumPy path then raises IndexError."""
    q = np.zeros((1, 2, 1, 8), np.float32)
    k = v = np.ones((1, 1, 1, 8), np.float32)
    cos = sin = np.ones((1, 1, 1, 8), np.float32)
    k_cache, v_cache = np.zeros((1, 1, 4, 8), np.float32), np.zeros((1, 1, 4, 8), np.float32)
    assert native.rope_cache_update(q, k, v, cos, sin, k_cache, v_cache, np.array([4]), False) is None
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(IndexError):
        CPU_KERNELS.kernels["rope_cache_update"](q, k, v, cos, sin, k_cache, v_cache, np.array([9]), dims=[2],
                                                 interleaved=False, in_place=True)
    assert native.rope_cache_update(q, k, v, cos, sin, k_cache, v_cache, np.array([1], np.int32), False) is None
    assert native.rope_cache_update(q.astype(np.float64), k, v, cos, sin, k_cache, v_cache, np.array([1]),
                                    False) is None


@needs_native
@pytest.mark.parametrize("B,Hq,Hkv,T,S,D,window", [(3, 4, 2, 1, 20, 16, 0), (2, 6, 3, 3, 17, 8, 5),
                                                   (4, 2, 2, 2, 9, 32, 3)])
def test_compiled_slot_attention_matches_float64(B, Hq, Hkv, T, S, D, window):
    """kiln_slot_attention_f32: each query of each sequence over its own slot's keys up to its position (within the
    window), GQA; the NumPy composition in float64 is the reference; an index outside the cache writes nothing."""
    from kiln.runtime.backends.array_api.attention import slot_attention as reference

    rng = np.random.default_rng(B * 10 + S)
    count = B + 2
    q = rng.standard_normal((B, Hq, T, D), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((count, S, Hkv, D), dtype=np.float32) for _ in range(2))
    slots = rng.permutation(count)[:B].astype(np.int64)
    positions = np.sort(rng.integers(0, S, (B, T)), axis=1).astype(np.int64)
    got = native.slot_attention(q, k_cache, v_cache, slots, positions, 0.3, window)
    want = reference(np, q.astype(np.float64), k_cache[slots].astype(np.float64), v_cache[slots].astype(np.float64),
                     positions, 0, 0.3, window)
    assert got is not None
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert native.slot_attention(q, k_cache, v_cache, slots + count, positions, 0.3, window) is None
    assert native.slot_attention(q, k_cache, v_cache, slots, positions + S, 0.3, window) is None


@needs_native
def test_compiled_slot_attention_is_the_same_on_any_thread_count(monkeypatch):
    """kiln_slot_attention_f32 splits a step's (sequence, q head) pairs over the pool's threads where it reads enough
    keys (a decode step of 4 sequences of SmolLM2's heads at position 300 does): the same bits on 1, 2 and 3
    threads, and within float32 rounding of the float64 reference."""
    from kiln.runtime.backends.array_api.attention import slot_attention as reference

    rng = np.random.default_rng(7)
    B, Hq, Hkv, S, D = 4, 9, 3, 512, 64
    q = rng.standard_normal((B, Hq, 1, D), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((B, S, Hkv, D), dtype=np.float32) for _ in range(2))
    slots = np.array([2, 0, 3, 1], dtype=np.int64)
    positions = np.array([[300], [17], [511], [0]], dtype=np.int64)
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("KILN_THREADS", threads)
        results.append(native.slot_attention(q, k_cache, v_cache, slots, positions, 0.125, 0))
    assert all(r is not None and np.array_equal(r, results[0]) for r in results)
    want = reference(np, q.astype(np.float64), k_cache[slots].astype(np.float64), v_cache[slots].astype(np.float64),
                     positions, 0, 0.125, 0)
    np.testing.assert_allclose(results[0], want, rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("slots,window,with_sinks", [([2], 0, False), ([1], 5, True), ([3, 0], 0, False)],
                         ids=["one-slot", "window-sinks", "two-slots"])
def test_prompt_slot_attention_is_the_compiled_attention(slots, window, with_sinks, monkeypatch):
    """slot_attention's many queries a sequence (a prompt's chunk at some offset in its slot) go to the compiled
    attention with the slot visibility as its mask, the slot's keys read in place: the float64 reference within
    float32 rounding, the same bits on 1, 2 and 3 threads; the portable path agrees."""
    from kiln.runtime.backends.array_api.attention import slot_attention as reference
    from kiln.runtime.backends.cpu.attention import slot_attention

    rng = np.random.default_rng(len(slots) + window)
    Hq, Hkv, T, S, D, offset = 6, 2, 40, 128, 64, 23
    slots = np.array(slots, dtype=np.int64)
    B = len(slots)
    q = rng.standard_normal((B, Hq, T, D), dtype=np.float32)
    k_cache, v_cache = (rng.standard_normal((4, S, Hkv, D), dtype=np.float32) for _ in range(2))
    positions = np.tile(np.arange(offset, offset + T, dtype=np.int64), (B, 1))
    sinks = rng.standard_normal(Hq, dtype=np.float32) if with_sinks else None
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("KILN_THREADS", threads)
        results.append(slot_attention(q, k_cache, v_cache, slots, positions, sinks, scale=0.125, window=window))
    assert all(np.array_equal(r, results[0]) for r in results[1:])
    last = offset + T
    want = reference(np, q.astype(np.float64), k_cache[slots, :last].astype(np.float64),
                     v_cache[slots, :last].astype(np.float64), positions, 0, 0.125, window,
                     sinks=None if sinks is None else sinks.astype(np.float64))
    np.testing.assert_allclose(results[0], want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(native, "library", lambda: None)
    portable = slot_attention(q, k_cache, v_cache, slots, positions, sinks, scale=0.125, window=window)
    np.testing.assert_allclose(portable, want, rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_compiled_rope_slot_update_matches_float64(interleaved):
    """kiln_rope_slot_update_f32: one token of each sequence roped and written at (slot, position) of the caches
    (negative indices from the end), q roped; a slot outside the cache writes nothing."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, D, S, count = 3, 4, 2, 8, 10, 5
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32).transpose(0, 2, 1, 3)
    k, v = (rng.standard_normal((B, 1, Hkv, D), dtype=np.float32) for _ in range(2))
    angles = rng.uniform(0, 6, (B, 1, 1, D)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    k_cache, v_cache = (rng.standard_normal((count, S, Hkv, D), dtype=np.float32) for _ in range(2))
    want_k, want_v = k_cache.astype(np.float64), v_cache.astype(np.float64)
    slots, positions = np.array([[4], [0], [-1]]), np.array([[2], [9], [-3]])
    q_out = native.rope_slot_update(q, k, v, cos, sin, k_cache, v_cache, slots, positions, interleaved)
    np.testing.assert_allclose(q_out, _rope_reference(q, cos, sin, interleaved), rtol=1e-5, atol=1e-6)
    want_k[slots[:, 0], positions[:, 0]] = _rope_reference(k, cos, sin, interleaved)[:, 0]
    want_v[slots[:, 0], positions[:, 0]] = v[:, 0]
    np.testing.assert_allclose(k_cache, want_k, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(v_cache, want_v.astype(np.float32))
    before = k_cache.copy()
    assert native.rope_slot_update(q, k, v, cos, sin, k_cache, v_cache, slots + 9, positions, interleaved) is None
    np.testing.assert_array_equal(k_cache, before)


@needs_native
@pytest.mark.parametrize("quantized", [False, True], ids=["float32", "int4"])
def test_gathered_rows_of_one_expert_beyond_eight_are_taken_in_chunks(quantized):
    """native/experts.c multiplies an expert's rows 8 at a time: 11 rows routed to one expert (a serving batch's)
    give, row by row, what each row gives alone (the few-row linears' sums do not depend on their row count), with
    the combine summing each token's rows in order."""
    from kiln.export.quantize import quantize_rows
    from kiln.runtime.backends.cpu.experts import gathered_linear, gathered_quantized_linear

    rng = np.random.default_rng(7)
    experts, n, k, topk = 4, 48, 64, 2
    x = rng.standard_normal((16, k)).astype(np.float32)
    index = np.array([2] * 11 + [0, 3, 2, 1, 0], dtype=np.int64)
    combine = rng.uniform(0, 1, (8, topk)).astype(np.float32)
    if quantized:
        q, scale, zero = quantize_rows(rng.standard_normal((experts * n, k)).astype(np.float32), 4, 32, False)
        parts = [a.reshape(experts, n, -1) for a in (q, scale.astype(np.float32), zero.astype(np.float32))]

        def run(rows, ids, c=None):
            return gathered_quantized_linear(rows, *parts, ids, None, c, bits=4, group_size=32)
    else:
        weight = rng.standard_normal((experts, n, k)).astype(np.float32)

        def run(rows, ids, c=None):
            return gathered_linear(rows, weight, ids, None, c)
    alone = np.concatenate([run(x[i:i + 1], index[i:i + 1]) for i in range(16)])
    np.testing.assert_array_equal(run(x, index), alone)
    products = alone.reshape(8, topk, n) * combine[:, :, None]
    np.testing.assert_array_equal(run(x, index, combine), products[:, 0] + products[:, 1])
