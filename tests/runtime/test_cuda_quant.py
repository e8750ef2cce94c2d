"""The GPU's weight-only quantized linear (row-streaming kernels for a few rows, gemm_rows on the tensor cores for a
batched step's 9-64, dequantize + cuBLAS for more) against the op's definition (the portable dequantization), in the
storage types a model uses."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.export.quantize import quantize_rows
from kiln.runtime.backends.array_api import BFLOAT16
from kiln.runtime.backends.array_api.quant import dequantize
from tests.conftest import BACKENDS
from tests.runtime.int8_dot import integer_dot

pytestmark = [pytest.mark.cuda, pytest.mark.skipif("cuda" not in BACKENDS, reason="needs an NVIDIA GPU with CuPy")]

CONFIGS = [(8, 64, True), (8, 96, False), (4, 64, True), (4, 32, False), (8, 40, True), (4, 40, False),
           (4, 32, "offset"), (8, 16, "offset"), (4, 40, "offset")]
"""(bits, group, symmetric): group 40 is not a multiple of the 4-byte loads and takes the element-wise path;
"offset": the zero points turned into the op's additive offsets (W = q * scale + offset, GGUF's form)."""


def _case(rng, lead: tuple[int, ...], n: int, k: int, bits: int, group: int, symmetric, dtype, with_bias: bool):
    """((x, q, scale, zero, bias) on the host, the float64 product of x and the dequantized weight, bias added)."""
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
    offset = symmetric == "offset"
    q, scale, zero = quantize_rows(w, bits, group, symmetric is True)
    if offset:
        zero = -zero * scale
    scale, zero = scale.astype(dtype), None if zero is None else zero.astype(dtype)
    bias = rng.standard_normal(n).astype(dtype) if with_bias else None
    x = rng.standard_normal((*lead, k)).astype(dtype)
    f32 = [None if a is None else a.astype(np.float32) for a in (x, scale, zero, bias)]
    want = f32[0].astype(np.float64) @ dequantize(np, q, f32[1], f32[2], bits, group, offset).T.astype(np.float64)
    if with_bias:
        want += f32[3]
    return (x, q, scale, zero, bias), want


@pytest.mark.parametrize("bits,group,symmetric", CONFIGS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_quantized_linear_matches_definition(bits, group, symmetric, rows, dtype, with_bias, monkeypatch) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear
    from kiln.runtime.backends.cuda.kernels.quant_linear import quantized_linear

    monkeypatch.setattr(quant_linear, "QUANT_DOT", False)  # (the float products; qgemv_dot: the integer-product test)
    k = 3 * group
    args, want = _case(np.random.default_rng(rows * 7 + bits), (2, rows), 45, k, bits, group, symmetric, dtype,
                       with_bias)
    got = quantized_linear(*(None if a is None else cp.asarray(a) for a in args), bits, group, symmetric == "offset")
    assert got.shape == (2, rows, 45) and got.dtype == dtype
    tol = 1e-4 if dtype == np.float32 else 2e-2  # bfloat16: one rounding of the output (and of W for many rows)
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol * np.sqrt(k))


def _kernels_looked_up(quant_linear, monkeypatch) -> list[tuple]:
    """The (kernel, dtype[, size]) of each quant.cu kernel quant_linear looks up from now on (nvrtc.function's arguments
    after the source's name)."""
    launched: list[tuple] = []
    real = quant_linear.nvrtc.function
    monkeypatch.setattr(quant_linear.nvrtc, "function", lambda *a: launched.append(a[1:]) or real(*a))
    return launched


def _gemm_rows_bits(quant_linear, monkeypatch, arrays, bits: int, offset: bool, gated: bool) -> tuple:
    """(the result's 16-bit patterns, the gemm_rows instances looked up) of quantized_linear, or with `gated` of
    gated_quantized_linear with SiLU, over `arrays` (x, q, scale, zero, bias on the GPU) in groups of 32."""
    import cupy as cp

    launched = _kernels_looked_up(quant_linear, monkeypatch)
    if gated:
        got = quant_linear.gated_quantized_linear(*arrays, bits, 32, offset, "silu")
    else:
        got = quant_linear.quantized_linear(*arrays, bits, 32, offset)
    return cp.asnumpy(got).view(np.uint16), [f[2] for f in launched if f[0] == "gemm_rows"]


STAGED_CASES = [(4, 32, "offset", 3072), (4, 64, False, 4160), (4, 128, True, 2048), (8, 32, True, 2400),
                (8, 16, "offset", 1024), (8, 64, False, 4096)]
"""(bits, group, symmetric, k) for qgemv_staged: k from one partial round of loads to several (an int4 round of a
warp of 4 weight rows is 64 pieces of 32 weights, of 1 row 256), each zero form."""


@pytest.mark.parametrize("bits,group,symmetric,k", STAGED_CASES)
@pytest.mark.parametrize("weight_rows", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("constant", [False, True], ids=["operands", "constants"])
def test_staged_quantized_linear_matches_definition(bits, group, symmetric, k, weight_rows, rows, dtype, constant,
                                                    monkeypatch) -> None:
    """qgemv_staged (x staged in shared memory, 1, 2 or 4 weight rows a warp, the first loads before the
    dependency wait when the weights are program constants) against the op's definition, with a row count that
    leaves some warps of the last block without rows."""
    import cupy as cp

    from kiln.runtime.backends.cuda import constants
    from kiln.runtime.backends.cuda.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "QGEMV_WEIGHT_ROWS", weight_rows)
    monkeypatch.setattr(quant_linear, "QUANT_DOT", False)  # (the float products: qgemv_dot has a test of its own)
    monkeypatch.setattr(constants, "is_constant", lambda array: constant)
    args, want = _case(np.random.default_rng(k + rows), (rows,), 77, k, bits, group, symmetric, dtype, True)
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    got = quant_linear.quantized_linear(*(None if a is None else cp.asarray(a) for a in args), bits, group,
                                  symmetric == "offset")
    assert [f[0] for f in launched] == ["qgemv_staged"]
    tol = 1e-4 if dtype == np.float32 else 2e-2
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol * np.sqrt(k))


@pytest.mark.parametrize("bits,group,symmetric,k", STAGED_CASES)
@pytest.mark.parametrize("weight_rows", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16], ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dot", [False, True], ids=["float", "dot"])
def test_gated_staged_form_gives_the_bits_of_the_two_kernels(bits, group, symmetric, k, weight_rows, rows, dtype,
                                                             activation, dot, monkeypatch) -> None:
    """gated_quantized_linear's one kernel (qgemv_staged's gated form: a warp's gate rows and their up rows,
    act(gate) * up in the epilogue) against quantized_linear and gated_activation run apart (QGEMV_GATED off):
    the same bits, for a count of outputs (77) that leaves warps of the last block without rows; 1 weight row a
    warp is taken as 2 (a gate row and its up row); 3 input rows are not the kernel's (the two kernels run)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "QGEMV_WEIGHT_ROWS", weight_rows)
    monkeypatch.setattr(quant_linear, "QUANT_DOT", dot)
    args, _ = _case(np.random.default_rng(k + rows), (1, rows), 2 * 77, k, bits, group, symmetric, dtype, True)
    arrays = [None if a is None else cp.asarray(a) for a in args]
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    got = quant_linear.gated_quantized_linear(*arrays, bits, group, symmetric == "offset", activation)
    gated = [f for f in launched if f[0] in ("qgemv_staged", "qgemv_dot") and len(f) > 2 and f[2] % 4000 >= 1000]
    assert len(gated) == (1 if rows <= 2 else 0)
    monkeypatch.setattr(quant_linear, "QGEMV_GATED", False)
    want = quant_linear.gated_quantized_linear(*arrays, bits, group, symmetric == "offset", activation)
    assert got.shape == want.shape == (1, rows, 77) and got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint8), cp.asnumpy(want).view(np.uint8))


@pytest.mark.parametrize("bits,group,symmetric,k", STAGED_CASES)
@pytest.mark.parametrize("weight_rows", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
def test_integer_products_match_their_definition(bits, group, symmetric, k, weight_rows, rows, dtype,
                                                 monkeypatch) -> None:
    """qgemv_dot against the integer product's definition (int8_dot.py, which the CPU's qdot is held to) within
    the output's rounding and float32 sums, and against the float definition within what x's rounding costs (~1%
    of the outputs' scale)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "QGEMV_WEIGHT_ROWS", weight_rows)
    monkeypatch.setattr(quant_linear, "QUANT_DOT", True)
    args, want_float = _case(np.random.default_rng(k * 3 + rows), (rows,), 77, k, bits, group, symmetric, dtype,
                             True)
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    got = quant_linear.quantized_linear(*(None if a is None else cp.asarray(a) for a in args), bits, group,
                                  symmetric == "offset")
    assert [f[0] for f in launched] == ["qgemv_dot"]
    got = cp.asnumpy(got).astype(np.float64)
    x, q, scale, zero, bias = args
    f32 = [None if a is None else a.astype(np.float32) for a in (x, scale, zero, bias)]
    want = integer_dot(f32[0], q, f32[1], f32[2], f32[3], bits, group, symmetric == "offset")
    scale_of = np.abs(want_float).max()
    tol = 1e-5 if dtype == np.float32 else 8e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale_of)
    assert np.abs(got - want_float).max() <= 0.02 * scale_of


@pytest.mark.parametrize("bits", [4, 8])
def test_int4_takes_two_weight_rows_a_warp_where_one_would_need_a_second_wave(bits, monkeypatch) -> None:
    """qgemv_dot at 1 weight row a warp over 4096 outputs needs 512 blocks, more than an H100 or H200 holds at once
    (3 an SM): int4 then takes 2 rows a warp (quant_linear._waves), int8 keeps 1; both against the integer
    definition."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear, registry

    monkeypatch.setattr(quant_linear, "QUANT_DOT", True)
    args, _ = _case(np.random.default_rng(bits), (1,), 4096, 256, bits, 32, True, BFLOAT16, False)
    one_row = registry.resident_blocks(quant_linear.nvrtc.function("quant", "qgemv_dot", BFLOAT16, 100 + 10 * bits + 1),
                                       0, 32 * quant_linear.QUANT_WARPS)
    if bits == 4:  # (int8 keeps one row whatever the waves; its 181 fits 4 blocks an SM, 528 on an H100)
        assert 4096 // quant_linear.QUANT_WARPS > one_row, "this GPU holds 512 blocks at once: the case tests no rule"
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    got = quant_linear.quantized_linear(*(None if a is None else cp.asarray(a) for a in args), bits, 32, False)
    assert launched[-1][2] == (241 if bits == 4 else 181)
    x, q, scale, zero, bias = args
    f32 = [None if a is None else a.astype(np.float32) for a in (x, scale, zero, bias)]
    want = integer_dot(f32[0], q, f32[1], f32[2], f32[3], bits, 32, False)
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=8e-3, atol=8e-3 * np.abs(want).max())


@pytest.mark.parametrize("bits,group,symmetric,k", STAGED_CASES + [(4, 32, True, 14336), (8, 32, True, 14336)])
@pytest.mark.parametrize("weight_rows", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ["", "silu"], ids=["plain", "gated"])
def test_interleaved_staging_gives_the_bits_of_staging_first(bits, group, symmetric, k, weight_rows, rows, dtype,
                                                              activation, monkeypatch) -> None:
    """qgemv_dot's interleaved form (quant_linear.QDOT_INTERLEAVED: x staged a turn at a time beside the rounds of
    products that read it, the turns walking x block by block across the rows) against the plain form (all of x
    staged first): the same codes, so the same bits, for one to several turns and rounds (k up to the 8B shape's
    down layer, 14336) and 1 to 3 input rows."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "QGEMV_WEIGHT_ROWS", weight_rows)
    monkeypatch.setattr(quant_linear, "QUANT_DOT", True)
    n = 2 * 77 if activation else 77
    args, _ = _case(np.random.default_rng(k * 7 + rows), (rows,), n, k, bits, group, symmetric, dtype, True)
    arrays = [None if a is None else cp.asarray(a) for a in args]

    def product():
        if activation:
            return quant_linear.gated_quantized_linear(*arrays, bits, group, symmetric == "offset", activation)
        return quant_linear.quantized_linear(*arrays, bits, group, symmetric == "offset")

    monkeypatch.setattr(quant_linear, "QDOT_INTERLEAVED", True)
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    got = product()
    assert [f[2] // 4000 for f in launched if f[0] == "qgemv_dot"] == [1]
    monkeypatch.setattr(quant_linear, "QDOT_INTERLEAVED", False)
    want = product()
    assert got.shape == want.shape and got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint8), cp.asnumpy(want).view(np.uint8))


@pytest.mark.parametrize("rows,k,n,interleaved", [(1, 2048, 64, False), (1, 4096, 64, True), (1, 14336, 64, True),
                                                   (2, 2048, 64, True), (1, 8192, 48, False)])
def test_interleaved_form_is_taken_where_x_takes_more_than_one_turn(rows, k, n, interleaved, monkeypatch) -> None:
    """quant_linear.QDOT_INTERLEAVED's default (None): the interleaved form only where staging x takes more than one
    turn of 2048 values (the 8B shape's products; the 1B shape's K = 2048 products at one row stage x first) and the
    layer has QDOT_INTERLEAVE_ROWS rows (here 64; the 1B shape's down layer, 2048 of 4096, stages first)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear

    monkeypatch.setattr(quant_linear, "QUANT_DOT", True)
    monkeypatch.setattr(quant_linear, "QDOT_INTERLEAVED", None)
    monkeypatch.setattr(quant_linear, "QDOT_INTERLEAVE_ROWS", 64)
    args, _ = _case(np.random.default_rng(k + rows), (rows,), n, k, 4, 32, True, BFLOAT16, False)
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    quant_linear.quantized_linear(*(None if a is None else cp.asarray(a) for a in args), 4, 32, False)
    assert [f[2] >= 4000 for f in launched if f[0] == "qgemv_dot"] == [interleaved]


@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, True), (4, 64, False), (4, 32, "offset"), (8, 32, True),
                                                   (8, 128, False), (8, 32, "offset")])
@pytest.mark.parametrize("rows,n,splits", [(9, 77, 1), (16, 200, 3), (40, 64, None), (64, 130, 8)])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
def test_gemm_rows_matches_definition(bits, group, symmetric, rows, n, splits, dtype, monkeypatch) -> None:
    """quant.cu's gemm_rows, the batched decode step's 9-64 rows on the tensor cores with the weight dequantized a
    tile at a time: against the float64 product of the dequantized weight, for one to 8 splits of K (gemm_rows_reduce),
    outputs not a multiple of the 64-output tile, each zero form, with and without bias."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import gemm_rows, quant_linear

    monkeypatch.setattr(gemm_rows, "GEMM_ROWS_SPLITS", splits)
    k = 1024
    args, want = _case(np.random.default_rng(rows + n + bits), (rows,), n, k, bits, group, symmetric, dtype,
                       rows % 2 == 0)
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    got = quant_linear.quantized_linear(*(None if a is None else cp.asarray(a) for a in args), bits, group,
                                  symmetric == "offset")
    names = [f[0] for f in launched]
    ran = [f[2] for f in launched if f[0] == "gemm_rows"][-1]  # (ring_stages looks up both rings' instances first)
    assert names[:1] == ["gemm_rows"] and ran % 10000 == bits + (1000 if bits == 4 and symmetric is True else 0)
    assert ("gemm_rows_reduce" in names) == (gemm_rows.splits_of(n, k) > 1)
    assert got.shape == (rows, n) and got.dtype == dtype
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=2e-2, atol=2e-2 * np.sqrt(k))


@pytest.mark.parametrize("rows,n,splits", [(9, 77, 1), (64, 200, 3)])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_gemm_rows_packed_int4_gives_the_bits_of_the_float32_dequantization(rows, n, splits, dtype, gated,
                                                                           monkeypatch) -> None:
    """gemm_rows.GEMM_ROWS_PACKED: symmetric int4 (no zero array, no offsets) dequantized two codes at a time in the
    storage type (gemm_rows instance + 1000) gives exactly the bits of the float32 dequantization, plain and gated,
    one split and several."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import gemm_rows, quant_linear

    monkeypatch.setattr(gemm_rows, "GEMM_ROWS_SPLITS", splits)
    monkeypatch.setattr(gemm_rows, "GEMM_ROWS_STAGES", 4)  # (one lookup a call: the instance that runs)
    args, _ = _case(np.random.default_rng(rows + n), (rows,), 2 * n if gated else n, 512, 4, 32, True, dtype, True)
    arrays = [None if a is None else cp.asarray(a) for a in args]
    results = {}
    for packed in (False, True):
        monkeypatch.setattr(gemm_rows, "GEMM_ROWS_PACKED", packed)
        results[packed], instances = _gemm_rows_bits(quant_linear, monkeypatch, arrays, 4, False, gated)
        assert instances == [(1000 if packed else 0) + (104 if gated else 4)]
    np.testing.assert_array_equal(results[True], results[False])


@pytest.mark.parametrize("bits,instance", [(4, 1004), (4, 104), (8, 108)])
def test_the_ring_of_3_stages_is_taken_where_it_saves_a_wave(bits, instance) -> None:
    """gemm_rows.ring_stages: 4 slots while 3 blocks an SM hold the grid in as few waves as 4 blocks do; 3 slots
    (a fourth block an SM) once that saves a wave: just past one wave of the deeper ring, and for an LM head's grid."""
    from kiln.runtime.backends.array_api import BFLOAT16
    from kiln.runtime.backends.cuda.kernels import gemm_rows, registry

    def resident(stages: int) -> int:
        function = gemm_rows.nvrtc.function("quant", "gemm_rows", BFLOAT16, instance + (10000 if stages == 3 else 0))
        return registry.resident_blocks(function, gemm_rows.shared_bytes(bits, stages), 128)

    deep, shallow = resident(4), resident(3)
    assert shallow > deep, "the ring of 3 fits no more blocks than the ring of 4 on this GPU"
    assert gemm_rows.ring_stages(deep, bits, BFLOAT16, instance) == 4
    assert gemm_rows.ring_stages(deep + 1, bits, BFLOAT16, instance) == 3
    assert gemm_rows.ring_stages(2 * deep, bits, BFLOAT16, instance) == (3 if shallow >= 2 * deep else 4)
    assert gemm_rows.ring_stages(2004, bits, BFLOAT16, instance) == (
        3 if -(-2004 // shallow) < -(-2004 // deep) else 4)


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, "offset"), (8, True)])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("stages", [4, 3])
def test_gemm_rows_with_two_dequantized_tiles_gives_the_same_bits(bits, symmetric, gated, stages, monkeypatch) -> None:
    """gemm_rows.GEMM_ROWS_TWO_TILES (instance + 20000: the next stage dequantized into a second tile beside this
    stage's products, one barrier a stage) multiplies the same stages in the same order: the same bits, for both
    rings, with K split (down to one stage a split) and not, and 24 rows (a warp's 16 rows past the last)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import gemm_rows, quant_linear

    args, _ = _case(np.random.default_rng(bits + stages), (24,), 2 * 70 if gated else 70, 640, bits, 32, symmetric,
                    BFLOAT16, True)
    arrays = [None if a is None else cp.asarray(a) for a in args]
    monkeypatch.setattr(gemm_rows, "GEMM_ROWS_STAGES", stages)
    for splits in (1, 4, 10):
        monkeypatch.setattr(gemm_rows, "GEMM_ROWS_SPLITS", splits)
        results = {}
        for two in (False, True):
            monkeypatch.setattr(gemm_rows, "GEMM_ROWS_TWO_TILES", two)
            results[two], instances = _gemm_rows_bits(quant_linear, monkeypatch, arrays, bits, symmetric == "offset",
                                                      gated)
            assert [i >= 20000 for i in instances] == [two]
        np.testing.assert_array_equal(results[True], results[False])


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, "offset")])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_gemm_rows_ring_of_3_stages_gives_the_bits_of_4(bits, symmetric, gated, monkeypatch) -> None:
    """gemm_rows.GEMM_ROWS_STAGES = 3 (instance + 10000: a smaller ring for a fourth block an SM) multiplies the same
    stages in the same order as the ring of 4: the same bits, with K split (one stage a split at the end) and not."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import gemm_rows, quant_linear

    args, _ = _case(np.random.default_rng(bits), (24,), 2 * 70 if gated else 70, 640, bits, 32, symmetric,
                    BFLOAT16, True)
    arrays = [None if a is None else cp.asarray(a) for a in args]
    for splits in (1, 4):
        monkeypatch.setattr(gemm_rows, "GEMM_ROWS_SPLITS", splits)
        results = {}
        for stages in (4, 3):
            monkeypatch.setattr(gemm_rows, "GEMM_ROWS_STAGES", stages)
            results[stages], instances = _gemm_rows_bits(quant_linear, monkeypatch, arrays, bits,
                                                         symmetric == "offset", gated)
            assert [i >= 10000 for i in instances] == [stages == 3]
        np.testing.assert_array_equal(results[3], results[4])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, "offset"])
def test_gemm_rows_reads_the_last_scale_of_an_odd_count_alone(bits, symmetric, monkeypatch) -> None:
    """gemm_rows copies each half row's scale and zero as the aligned 4-byte word that holds it: with 77 rows of 3
    groups (231 values) the last value's word would run past the array, so that copy reads its 2 bytes alone; and
    a scale array that is not 4-byte aligned (a view one value in) goes to dequantize + cuBLAS, with the same
    result within rounding."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear

    k, n = 192, 77
    args, want = _case(np.random.default_rng(bits), (12,), n, k, bits, 64, symmetric, BFLOAT16, True)
    x, q, scale, zero, bias = (None if a is None else cp.asarray(a) for a in args)
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    got = quant_linear.quantized_linear(x, q, scale, zero, bias, bits, 64, symmetric == "offset")
    assert [f[0] for f in launched][:1] == ["gemm_rows"] and scale.size % 2 == 1
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=2e-2, atol=2e-2 * np.sqrt(k))
    shifted = cp.empty(scale.size + 1, scale.dtype)[1:].reshape(scale.shape)
    shifted[...] = scale
    launched.clear()
    moved = quant_linear.quantized_linear(x, q, shifted, zero, bias, bits, 64, symmetric == "offset")
    assert "gemm_rows" not in [f[0] for f in launched]
    np.testing.assert_allclose(cp.asnumpy(moved).astype(np.float32), cp.asnumpy(got).astype(np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows,n,k,splits", [(9, 77, 64, None), (33, 300, 2048, None), (64, 64, 512, 3)])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
def test_gemm_rows_with_a_16_bit_weight_matches_definition(rows, n, k, splits, dtype, monkeypatch) -> None:
    """gemm_rows<S, 16>, the weight in the storage type itself (gemm_rows.DENSE_GEMM_ROWS, the A/B against cuBLAS):
    the linear kernel's result against the float64 product, with a bias, one to several splits of K."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import gemm_rows, linalg

    monkeypatch.setattr(gemm_rows, "DENSE_GEMM_ROWS", True)
    monkeypatch.setattr(gemm_rows, "GEMM_ROWS_SPLITS", splits)
    rng = np.random.default_rng(rows + n)
    x, w, bias = (rng.standard_normal(shape).astype(dtype) for shape in ((rows, k), (n, k), (n,)))
    launched = _kernels_looked_up(linalg, monkeypatch)
    got = linalg.linear(cp.asarray(x), cp.asarray(w), cp.asarray(bias))
    assert [f[0] for f in launched][:1] == ["gemm_rows"] and launched[0][2] == 16
    want = x.astype(np.float64) @ w.astype(np.float64).T + bias.astype(np.float64)
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=2e-2, atol=2e-2 * np.sqrt(k))


def test_gemm_rows_row_does_not_depend_on_the_other_rows(monkeypatch) -> None:
    """A serving step batches any mix of sequences: a row's bits through gemm_rows are the same with 9 rows or 64
    (the splits depend on the layer alone, each row's sums on its own data), and as dequantize + cuBLAS within
    rounding."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import quant_linear

    args, _ = _case(np.random.default_rng(5), (64,), 3072, 2048, 4, 32, True, BFLOAT16, False)
    x, q, scale, zero, bias = (None if a is None else cp.asarray(a) for a in args)
    full = quant_linear.quantized_linear(x, q, scale, zero, bias, 4, 32, False)
    part = quant_linear.quantized_linear(x[:9].copy(), q, scale, zero, bias, 4, 32, False)
    np.testing.assert_array_equal(cp.asnumpy(full[:9]).view(np.uint16), cp.asnumpy(part).view(np.uint16))
    monkeypatch.setattr(quant_linear, "QGEMM", False)
    dense = quant_linear.quantized_linear(x, q, scale, zero, bias, 4, 32, False)
    np.testing.assert_allclose(cp.asnumpy(full).astype(np.float32), cp.asnumpy(dense).astype(np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("rows,half,splits", [(9, 77, 1), (24, 100, 4), (64, 64, None)])
@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gemm_rows_gated_form_gives_the_bits_of_the_two_kernels(bits, rows, half, splits, dtype, activation,
                                                                monkeypatch) -> None:
    """gemm_rows's gated form (a block's 32 gate rows and their 32 up rows, act(gate) * up in its epilogue or in
    gemm_rows_reduce where K is split) against the plain gemm_rows and gated_activation run apart: the same bits,
    for quantized weights (gated_quantized_linear) and 16-bit ones (gated_linear, DENSE_GEMM_ROWS)."""
    import cupy as cp

    from kiln.runtime.backends import composite
    from kiln.runtime.backends.cuda.kernels import CUDA_KERNELS, gemm_rows, linalg, quant_linear

    monkeypatch.setattr(gemm_rows, "GEMM_ROWS_SPLITS", splits)
    monkeypatch.setattr(gemm_rows, "GEMM_ROWS_STAGES", 4)  # (one lookup a call: the instance that runs)
    monkeypatch.setattr(gemm_rows, "DENSE_GEMM_ROWS", True)
    rng = np.random.default_rng(rows + half + bits)
    k = 512
    launched = _kernels_looked_up(quant_linear, monkeypatch)
    if bits == 16:
        x, w, bias = (cp.asarray(rng.standard_normal(shape).astype(dtype)) for shape in ((rows, k), (2 * half, k),
                                                                                         (2 * half,)))
        got = linalg.gated_linear(x, w, bias, activation)
        sizes = [f[2] for f in launched if f[0] == "gemm_rows"]
        want = composite.gated_linear(CUDA_KERNELS.kernels, x, w, bias, activation)
    else:
        args, _ = _case(rng, (rows,), 2 * half, k, bits, 32, True, dtype, True)
        arrays = [None if a is None else cp.asarray(a) for a in args]
        got = quant_linear.gated_quantized_linear(*arrays, bits, 32, False, activation)
        sizes = [f[2] for f in launched if f[0] == "gemm_rows"]
        want = composite.gated_quantized_linear(CUDA_KERNELS.kernels, *arrays, bits, 32, False, activation)
    assert sizes == [100 + bits + (1000 if bits == 4 else 0)]  # (symmetric int4: the packed dequantization)
    assert got.shape == want.shape == (rows, half) and got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(cp.asnumpy(got).view(np.uint16), cp.asnumpy(want).view(np.uint16))
