"""The LLM's own GPU kernels against float64 references: the matrix-vector kernel (gemv.cu) on the weight shapes it
takes, with the residual add + RMSNorm before it and the gated activation after it, the split-key one-query
attention (decode.cu) over group sizes, head widths, masks and cache lengths that are not a multiple of its chunk,
the fused RoPE and KV-cache write of a decode step, and the flash prefill attention (flash.cu) over the same and
over causal limits, query counts that are not a multiple of its tile and queries read through a transposed view.
Each test first checks that the kernel under test is the one that runs, so a change of dispatch cannot leave them
testing cuBLAS or the products path instead."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.backends.array_api import BFLOAT16
from tests.conftest import BACKENDS

pytestmark = [pytest.mark.cuda, pytest.mark.skipif("cuda" not in BACKENDS, reason="needs an NVIDIA GPU with CuPy")]

DTYPES = [np.float32, np.float16, BFLOAT16]
IDS = ["float32", "float16", "bfloat16"]
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, BFLOAT16: 1.6e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,k", [(512, 64), (2051, 200), (4000, 1000), (72, 2048), (2050, 2048), (72, 8192)],
                         ids=["tall", "odd-n", "long-k", "wide", "split-odd-n", "split-8"])
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_gemv_matches_float64(dtype, n, k, rows, with_bias) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.linalg import _gemv_applies, linear

    rng = np.random.default_rng(n + k + rows)
    x = rng.standard_normal((rows, k)).astype(dtype)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype) if with_bias else None
    xd, wd, bd = (None if a is None else cp.asarray(a) for a in (x, w, bias))
    assert _gemv_applies(xd, wd, bd)
    want = x.astype(np.float64) @ w.astype(np.float64).T + (0 if bias is None else bias.astype(np.float64))
    got = linear(xd, wd, bd)
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol)


def test_gemv_shares_the_rows_of_a_layer_with_few_outputs() -> None:
    """Llama-3.2-1B's projections in bfloat16: q/k/v and o (K 2048) get 2 warps a row, down (K 8192) 8, the LM
    head one; the shapes above run 1, 2 (split-odd-n: a last block with two rows of its four), 4 and 8 warps a
    row."""
    from kiln.runtime.backends.cuda.kernels.linalg import _gemv_split

    llama = [(3072, 2048), (2048, 2048), (2048, 8192), (128256, 2048)]
    assert [_gemv_split(n, k, 2) for n, k in llama] == [1, 1, 3, 0]
    assert [_gemv_split(2050, 2048, 2), _gemv_split(72, 2048, 4), _gemv_split(4000, 1000, 2)] == [1, 2, 0]
    assert _gemv_split(72, 8192, 4) == 3


def test_gemv_leaves_what_it_cannot_read_to_cublas() -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.linalg import _gemv_applies, linear

    w = cp.asarray(np.random.default_rng(0).standard_normal((512, 64)).astype(np.float32))
    x = cp.asarray(np.random.default_rng(1).standard_normal((1, 65)).astype(np.float32))[:, 1:]  # 4 bytes off
    assert not _gemv_applies(x, w, None)
    assert not _gemv_applies(x[:, :0], w[:, :0], None)
    assert not _gemv_applies(cp.ones((5, 64), cp.float32), w, None)  # more rows than the kernel takes
    np.testing.assert_allclose(cp.asnumpy(linear(x, w, None)), cp.asnumpy(x) @ cp.asnumpy(w).T, rtol=1e-5,
                               atol=1e-5)


ACTIVATIONS64 = {"": None, "silu": lambda g: g / (1 + np.exp(-g)),
                 "gelu_tanh": lambda g: 0.5 * g * (1 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3)))}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,k", [(512, 64), (2051, 200), (20000, 64), (72, 2048), (2050, 2048)],
                         ids=["tall", "odd-n", "strided-grid", "wide", "split-odd-n"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("activation", list(ACTIVATIONS64), ids=["plain", "silu", "gelu_tanh"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
def test_gemv_prologue_and_epilogue_match_float64(monkeypatch, dtype, n, k, rows, activation, norm) -> None:
    """gemv.cu's MODE: the residual add + RMSNorm before the product (add_rms_norm_linear) and the gated activation
    after it (gated_linear), against float64 with the op's roundings (the sum, the normalized row, each half)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import linalg

    if not norm and not activation:
        pytest.skip("the plain product: test_gemv_matches_float64")
    ran = []
    gemv = linalg._gemv
    monkeypatch.setattr(linalg, "_gemv", lambda *a, **kw: ran.append(a) or gemv(*a, **kw))
    rng = np.random.default_rng(n + k + rows)
    x, r = (rng.standard_normal((rows, k)).astype(dtype) for _ in range(2))
    nw = (rng.random(k) + 0.5).astype(dtype)
    w = (rng.standard_normal(((2 if activation else 1) * n, k)) / np.sqrt(k)).astype(dtype)
    bias = rng.standard_normal(w.shape[0]).astype(dtype)
    xd, rd, nwd, wd, bd = (cp.asarray(a) for a in (x, r, nw, w, bias))

    def rounded(a):
        return np.asarray(a).astype(dtype).astype(np.float64)

    if norm:
        total, got = linalg.add_rms_norm_linear(xd, rd, nwd, wd, bd, 1, 1e-5, activation)
        s = rounded(x.astype(np.float64) + r.astype(np.float64))
        np.testing.assert_array_equal(cp.asnumpy(total), s.astype(dtype))
        row = rounded(s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-5) * nw.astype(np.float64))
    else:
        got, row = linalg.gated_linear(xd, wd, bd, activation), x.astype(np.float64)
    assert len(ran) == 1, "the fused GEMV did not run"
    h = row @ w.astype(np.float64).T + bias.astype(np.float64)
    want = h if not activation else ACTIVATIONS64[activation](rounded(h[:, :n])) * rounded(h[:, n:])
    assert got.shape == (rows, n) and got.dtype == dtype
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=2 * tol, atol=2 * tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gemv_norm_prologue_at_its_longest_row(monkeypatch, dtype) -> None:
    """A row of norm.NORM_ROW_MAX bytes: every thread of the prologue holds all its pieces."""
    test_gemv_prologue_and_epilogue_match_float64(monkeypatch, dtype, 40, 4096 * 4 // np.dtype(dtype).itemsize, 1,
                                                  "silu", True)


def test_fused_gemv_leaves_what_it_cannot_take_to_the_ops_it_stands_for() -> None:
    """Too many rows, rows too long for shared memory, or one row longer than the prologue's pieces per thread:
    add_rms_norm, then linear or gated_linear."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import linalg

    rng = np.random.default_rng(0)
    for rows, k in ((6, 64), (1, linalg.GEMV_SHARED_MAX // 4 + 4), (1, linalg.NORM_ROW_MAX // 4 + 4)):
        x, r = (cp.asarray(rng.standard_normal((rows, k)).astype(np.float32)) for _ in range(2))
        w = cp.asarray((rng.standard_normal((32, k)) / np.sqrt(k)).astype(np.float32))
        total, got = linalg.add_rms_norm_linear(x, r, None, w, None, 1, 1e-5, "silu")
        s = cp.asnumpy(x + r).astype(np.float64)
        h = (s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-5)) @ cp.asnumpy(w).astype(np.float64).T
        np.testing.assert_allclose(cp.asnumpy(got), ACTIVATIONS64["silu"](h[:, :16]) * h[:, 16:], rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_array_equal(cp.asnumpy(total), cp.asnumpy(x + r))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("elements", [64, 576, 2048, 4096, 16 * 1024], ids=["64", "576", "2048", "4096", "longest"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
@pytest.mark.parametrize("one_kernel", [True, False], ids=["add_rms_norm_row", "rms_norm"])
def test_add_rms_norm_matches_float64(monkeypatch, dtype, elements, rows, with_weight, one_kernel) -> None:
    """add_rms_norm on the GPU, gemv.cu's add_rms_norm_row (a block a row, vector loads) and fused.cu's rms_norm
    (norm.ADD_RMS_NORM_ROW off) alike: the sum with the add's rounding bit for bit, the normalized row against
    float64 with the op's roundings; rows up to norm.NORM_ROW_MAX bytes ("longest": 16 KB whatever the dtype)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import norm

    monkeypatch.setattr(norm, "ADD_RMS_NORM_ROW", one_kernel)
    k = elements // np.dtype(dtype).itemsize if elements == 16 * 1024 else elements
    looked_up = []
    real = norm.nvrtc.function
    monkeypatch.setattr(norm.nvrtc, "function", lambda *a: looked_up.append(a[1]) or real(*a))
    rng = np.random.default_rng(k + rows)
    x, r = (rng.standard_normal((rows, k)).astype(dtype) for _ in range(2))
    nw = (rng.random(k) + 0.5).astype(dtype) if with_weight else None
    total, got = norm.add_rms_norm(*(None if a is None else cp.asarray(a) for a in (x, r, nw)), 1, 1e-5)
    assert looked_up == ["add_rms_norm_row" if one_kernel else "rms_norm"]
    s = (x.astype(np.float64) + r.astype(np.float64)).astype(dtype).astype(np.float64)
    np.testing.assert_array_equal(cp.asnumpy(total), s.astype(dtype))
    want = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-5)
    if with_weight:
        want = want * nw.astype(np.float64)
    tol = TOL[np.dtype(dtype)]
    assert got.shape == x.shape and got.dtype == dtype
    np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol)


def test_add_rms_norm_row_leaves_what_it_cannot_take_to_fused_rms_norm(monkeypatch) -> None:
    """Rows not of whole 16-byte pieces, longer than norm.NORM_ROW_MAX bytes, or an operand off 16-byte alignment:
    fused.cu's rms_norm, with the same results as the definition."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import norm

    looked_up = []
    real = norm.nvrtc.function
    monkeypatch.setattr(norm.nvrtc, "function", lambda *a: looked_up.append(a[1]) or real(*a))
    rng = np.random.default_rng(1)
    for k, offset in ((99, 0), (norm.NORM_ROW_MAX // 4 + 4, 0), (2048, 1)):  # (396 bytes: 24.75 pieces)
        x, r = (cp.asarray(rng.standard_normal(k + offset).astype(np.float32))[offset:][None] for _ in range(2))
        looked_up.clear()
        total, got = norm.add_rms_norm(x, r, None, 1, 1e-5)
        assert looked_up == ["rms_norm"]
        s = cp.asnumpy(x + r).astype(np.float64)
        np.testing.assert_allclose(cp.asnumpy(got), s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-5),
                                   rtol=1e-5, atol=1e-5)


def test_early_launched_kernels_wait_for_what_they_read(monkeypatch) -> None:
    """A decode step's chain of dependent kernels (norm-prologue GEMVs loading their constant weight before they
    wait, plain and gated GEMVs, RMSNorm), 160 kernels captured as one graph and launched early (launch.py): the
    same bits as the same kernels launched one after another, over replays on new inputs. A kernel that read its
    input before the kernel writing it had finished would differ."""
    import cupy as cp

    from kiln.runtime.backends.cuda import constants, launch
    from kiln.runtime.backends.cuda.kernels import linalg, norm

    if not launch.early_launch_supported(cp.cuda.Device().id):
        pytest.skip("this GPU or driver launches no kernel early")
    rng = np.random.default_rng(7)
    d = 512

    def weight(n):
        return cp.asarray((rng.standard_normal((n, d)) / np.sqrt(d)).astype(BFLOAT16))

    w_in, w_out, w_gate_up, w_down = weight(d), weight(d), weight(2 * d), weight(d)
    nw = cp.asarray((1 + rng.standard_normal(d) / 4).astype(BFLOAT16))
    program_constants = {w.data.ptr for w in (w_in, w_out, w_gate_up, w_down)}
    monkeypatch.setattr(constants, "is_constant", lambda a: a.data.ptr in program_constants)
    x = cp.zeros((1, d), BFLOAT16)

    def chain():
        total, y = x, x
        for _ in range(32):
            total, h = linalg.add_rms_norm_linear(y, total, nw, w_in, None, 1, 1e-6, "")
            y = linalg.linear(h, w_out, None)
            total, g = linalg.add_rms_norm_linear(y, total, nw, w_gate_up, None, 1, 1e-6, "silu")
            y = norm.rms_norm(linalg.linear(g, w_down, None), nw, 1, 1e-6)
        return total, y

    def one_after_another():
        launch.early_launch_supported.cache_clear()
        monkeypatch.setattr(launch, "EARLY_LAUNCH", False)
        try:
            return [cp.asnumpy(a) for a in chain()]
        finally:
            monkeypatch.setattr(launch, "EARLY_LAUNCH", True)
            launch.early_launch_supported.cache_clear()

    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        outputs = chain()
        graph = stream.end_capture()
    for _ in range(3):
        x[...] = cp.asarray(rng.standard_normal((1, d)).astype(BFLOAT16))
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        got = [cp.asnumpy(a) for a in outputs]
        for g, w in zip(got, one_after_another(), strict=True):
            assert np.isfinite(w.astype(np.float32)).all()
            np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))


def _attention64(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v in float64, kv heads repeated for the groups; -inf everywhere gives NaN."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = q @ np.swapaxes(k, -1, -2) * scale
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + mask
    with np.errstate(invalid="ignore"):
        top = scores.max(-1, keepdims=True)
        p = np.exp(scores - top)
        return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("heads,kv_heads,e", [(4, 4, 64), (6, 2, 128), (8, 2, 80), (7, 1, 32), (16, 2, 256)],
                         ids=["mha", "g3", "g4-e80", "g7", "g8-e256"])
@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("seq,visible", [(150, 37), (64, 64), (300, 1), (2200, 2113)])
def test_decode_attention_matches_float64(dtype, heads, kv_heads, e, mask_kind, seq, visible, monkeypatch) -> None:
    """The split-key kernel (attend_chunk: attend_mma off, its own tests below), against float64."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention
    from kiln.runtime.backends.cuda.kernels.attention import _decode_attention_applies, sdpa

    monkeypatch.setattr(attention, "DECODE_MMA", False)

    if np.dtype(dtype) == np.float32 and e > 128:
        pytest.skip("float32 rows over 128 wide take the products path")
    rng = np.random.default_rng(heads * seq + e)
    q = rng.standard_normal((2, heads, 1, e)).astype(dtype)
    k = rng.standard_normal((2, kv_heads, seq, e)).astype(dtype)
    v = rng.standard_normal((2, kv_heads, seq, e)).astype(dtype)
    keep = np.arange(seq) < visible  # a static cache: the first `visible` slots written
    mask = {"bool": keep[None, None, None], "none": None,
            "float": np.where(keep, rng.uniform(-1, 0, seq), -np.inf).astype(np.float32)[None, None, None]}[mask_kind]
    qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    md = None if mask is None else cp.asarray(mask)
    assert _decode_attention_applies(qd, kd, vd, md, False)
    scale = 1 / np.sqrt(e)
    got = cp.asnumpy(sdpa(qd, kd, vd, md, causal=False, scale=None)).astype(np.float64)
    want = _attention64(q, k, v, mask, scale)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads_per_block", [1, 2, 4, 8])
@pytest.mark.parametrize("heads,kv_heads,e,seq,visible", [(32, 4, 128, 1280, 128), (8, 2, 64, 300, 257),
                                                           (12, 4, 64, 70, 1)], ids=["qwen3", "g4", "g3"])
def test_decode_attention_with_a_group_split_over_blocks(heads_per_block, heads, kv_heads, e, seq, visible,
                                                         monkeypatch) -> None:
    """A kv head's group of q heads shared by several blocks (DECODE_HEADS a block), against float64, for one
    sequence and a batch of 3."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    monkeypatch.setattr(attention, "DECODE_HEADS", heads_per_block)
    monkeypatch.setattr(attention, "DECODE_MMA", False)  # attend_chunk's split of a group
    rng = np.random.default_rng(heads + seq)
    for batch in (1, 3):
        q = rng.standard_normal((batch, heads, 1, e)).astype(BFLOAT16)
        k = rng.standard_normal((batch, kv_heads, seq, e)).astype(BFLOAT16)
        v = rng.standard_normal((batch, kv_heads, seq, e)).astype(BFLOAT16)
        mask = (np.arange(seq) < visible)[None, None, None]
        got = attention.sdpa(*(cp.asarray(a) for a in (q, k, v, mask)), causal=False, scale=None)
        got = cp.asnumpy(got).astype(np.float64)
        want = _attention64(q, k, v, mask, 1 / np.sqrt(e))
        np.testing.assert_allclose(got, want, rtol=TOL[BFLOAT16], atol=TOL[BFLOAT16])


def test_decode_attention_of_a_query_that_sees_nothing_is_nan() -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.attention import sdpa

    q, k = cp.ones((1, 2, 1, 64), cp.float32), cp.ones((1, 1, 100, 64), cp.float32)
    mask = cp.zeros((1, 1, 1, 100), cp.bool_)
    mask[..., 50] = True
    mask = cp.concatenate([mask, cp.zeros_like(mask)], axis=1)  # head 0 sees one key, head 1 none
    out = cp.asnumpy(sdpa(q, k, k, mask, causal=False, scale=None))
    assert np.allclose(out[0, 0], 1.0) and np.isnan(out[0, 1]).all()


def _slot_attention64(q, k_cache, v_cache, slots, positions, scale, window):
    """slot_attention in float64 from its definition: query t of sequence b sees the keys of slot slots[b] at
    cache positions <= positions[b, t] (and > positions[b, t] - window when window > 0)."""
    keys = np.swapaxes(k_cache[slots], 1, 2)  # [B, Hkv, L, E]
    values = np.swapaxes(v_cache[slots], 1, 2)
    key = np.arange(keys.shape[2])[None, None, None, :]
    position = positions[:, None, :, None]
    visible = (key <= position) & ((key > position - window) if window > 0 else True)
    return _attention64(q, keys, values, visible, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("heads,kv_heads,e", [(4, 4, 64), (8, 2, 64), (6, 1, 128)], ids=["mha", "g4", "g6-e128"])
@pytest.mark.parametrize("window", [0, 50], ids=["full", "window"])
def test_slot_decode_attention_reads_each_slot_in_place(dtype, heads, kv_heads, e, window, monkeypatch) -> None:
    """A batch of sequences in shuffled slots (one slot twice), each at its own position (0, inside the first
    chunk, on a chunk boundary, near the cache's end) by the split-key kernel (attend_chunk), against float64."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention
    from kiln.runtime.backends.cuda.kernels.attention import _slot_decode_applies, slot_attention

    monkeypatch.setattr(attention, "DECODE_MMA", False)

    rng = np.random.default_rng(heads + e + window)
    slots_n, length = 6, 300
    k_cache = rng.standard_normal((slots_n, length, kv_heads, e)).astype(dtype)
    v_cache = rng.standard_normal((slots_n, length, kv_heads, e)).astype(dtype)
    slots = np.array([4, 0, 2, 5, 2], np.int64)
    positions = np.array([[0], [37], [127], [299], [64]], np.int64)
    q = rng.standard_normal((slots.size, heads, 1, e)).astype(dtype)
    args = [cp.asarray(a) for a in (q, k_cache, v_cache, slots, positions)]
    assert _slot_decode_applies(args[0], cp.swapaxes(args[1], 1, 2), cp.swapaxes(args[2], 1, 2), args[3], args[4])
    got = cp.asnumpy(slot_attention(*args, scale=0.125, window=window)).astype(np.float64)
    want = _slot_attention64(q, k_cache, v_cache, slots, positions, 0.125, window)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _step_with_prompt_runs(decode: list[tuple[int, int]], runs: list[tuple[int, int, int]]) -> tuple:
    """slots [rows] and positions [rows, 1] of a serving step: decode rows (slot, position), then prompt runs
    (slot, first position, count: consecutive positions of one slot), then 3 rows of padding repeating the last."""
    slots, positions = [s for s, _ in decode], [p for _, p in decode]
    for slot, first, count in runs:
        slots += [slot] * count
        positions += list(range(first, first + count))
    slots += [slots[-1]] * 3
    positions += [positions[-1]] * 3
    return np.array(slots, np.int64), np.array(positions, np.int64)[:, None]


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4), (6, 2)], ids=["g4", "mha", "g3"])
@pytest.mark.parametrize("mma", [False, True], ids=["chunk", "mma"])
def test_slot_decode_step_with_prompt_runs_by_flash(dtype, heads, kv_heads, mma, monkeypatch) -> None:
    """A serving step's rows: decode rows of distinct slots, then prompt runs (one slot, consecutive positions)
    that fill aligned groups of FLASH_M / group-size rows (flash.cu) or only part of one (the decode kernel), a run
    crossing a group boundary, and padding that repeats the last row; every row against float64."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    rng = np.random.default_rng(heads + kv_heads)
    run = attention.FLASH_M // (heads // kv_heads)
    slots_n, length, e = 6, 400, 64
    k_cache = rng.standard_normal((slots_n, length, kv_heads, e)).astype(dtype)
    v_cache = rng.standard_normal((slots_n, length, kv_heads, e)).astype(dtype)
    slots, positions = _step_with_prompt_runs([(0, 17), (4, 399), (2, 64)],
                                              [(3, 100, 2 * run + 5), (1, 0, run + 3), (5, 250, 7)])
    q = rng.standard_normal((slots.size, heads, 1, e)).astype(dtype)
    called = []
    runs = attention._slot_runs_attention
    monkeypatch.setattr(attention, "_slot_runs_attention", lambda *a: called.append(a[6]) or runs(*a))
    monkeypatch.setattr(attention, "SLOT_RUNS_ABOVE", 0)  # (a step this small takes the decode kernel otherwise)
    monkeypatch.setattr(attention, "DECODE_MMA_PACKED_RUNS", False)
    monkeypatch.setattr(attention, "DECODE_MMA", mma)  # (the decode rows by attend_mma, the runs left out as before)
    got = cp.asnumpy(attention.slot_attention(*(cp.asarray(a) for a in (q, k_cache, v_cache, slots, positions)),
                                              scale=0.125)).astype(np.float64)
    assert called == [run]
    want = _slot_attention64(q, k_cache, v_cache, slots, positions, 0.125, 0)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,e", [(32, 8, 64), (16, 2, 128), (8, 4, 64), (4, 4, 64), (6, 2, 64),
                                              (12, 2, 128)],
                         ids=["llama1b", "g8-e128", "g2", "mha", "g3", "g6-e128"])
def test_slot_step_with_prompt_runs_packed_on_the_tensor_cores(dtype, heads, kv_heads, e, monkeypatch) -> None:
    """attention.DECODE_MMA_PACKED_RUNS: a serving step's prompt runs (one slot, consecutive positions) served
    16 / groups rows a block by attend_mma (instance + 16000), each row up to its own position: runs starting on
    and off the aligned groups, one shorter than a group, one at the cache's start, one reaching its end; decode rows
    of distinct slots beside them and padding that repeats the last row; every row against float64, flash.cu's runs
    not launched. A step of no more rows than slots is not packed."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    monkeypatch.setattr(attention, "DECODE_MMA", True)
    monkeypatch.setattr(attention, "DECODE_MMA_PACKED_RUNS", True)
    monkeypatch.setattr(attention, "PACKED_RUNS_ABOVE", 0)
    monkeypatch.setattr(attention, "SLOT_RUNS_ABOVE", 0)  # (packing, where it applies, takes the runs instead)
    rng = np.random.default_rng(heads + e)
    slots_n, length = 7, 300
    k_cache, v_cache = (rng.standard_normal((slots_n, length, kv_heads, e)).astype(dtype) for _ in range(2))
    slots, positions = _step_with_prompt_runs([(0, 17), (4, 299), (2, 64)],
                                              [(3, 100, 37), (1, 0, 19), (5, 250, 3), (6, 261, 39)])
    q = rng.standard_normal((slots.size, heads, 1, e)).astype(dtype)
    flash_runs = []
    runs = attention._slot_runs_attention
    monkeypatch.setattr(attention, "_slot_runs_attention", lambda *a: flash_runs.append(a[6]) or runs(*a))
    tol = TOL[np.dtype(dtype)]
    for rows in (slots.size, slots_n):  # the step, then its first rows alone (no more rows than slots)
        looked_up = _decode_kernels(attention, monkeypatch)
        args = (q[:rows], k_cache, v_cache, slots[:rows], positions[:rows])
        got = cp.asnumpy(attention.slot_attention(*(cp.asarray(a) for a in args), scale=0.125)).astype(np.float64)
        assert ("attend_mma", e + 16000) in looked_up if rows > slots_n else \
            ("attend_mma", e + 16000) not in looked_up
        np.testing.assert_allclose(got, _slot_attention64(*args, 0.125, 0), rtol=tol, atol=tol)
    assert flash_runs == []


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,e", [(8, 2, 64), (4, 4, 64), (6, 1, 128)], ids=["g4", "mha", "g6-e128"])
@pytest.mark.parametrize("window", [0, 50], ids=["full", "window"])
def test_slot_decode_rows_all_by_flash(dtype, heads, kv_heads, e, window, monkeypatch) -> None:
    """attention.SLOT_FLASH_ROWS_ABOVE: every row of a decode step by flash.cu as a run of one query (a block per
    row and kv head; decode.cu not launched), sequences in shuffled slots (one twice) at positions 0, inside the
    first key tile, on a tile boundary and at the cache's end, against float64; with a window (a limit flash.cu's
    runs do not take) the decode kernel as before."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    rng = np.random.default_rng(heads + e)
    slots_n, length = 6, 400
    k_cache = rng.standard_normal((slots_n, length, kv_heads, e)).astype(dtype)
    v_cache = rng.standard_normal((slots_n, length, kv_heads, e)).astype(dtype)
    slots = np.array([4, 0, 2, 5, 2, 1], np.int64)
    positions = np.array([[0], [37], [127], [399], [64], [200]], np.int64)
    q = rng.standard_normal((slots.size, heads, 1, e)).astype(dtype)
    runs, decodes = [], []
    flash, decode = attention._slot_runs_attention, attention._decode_attention
    monkeypatch.setattr(attention, "_slot_runs_attention", lambda *a: runs.append(a[6]) or flash(*a))
    monkeypatch.setattr(attention, "_decode_attention", lambda *a, **kw: decodes.append(1) or decode(*a, **kw))
    monkeypatch.setattr(attention, "SLOT_FLASH_ROWS_ABOVE", 0)
    got = cp.asnumpy(attention.slot_attention(*(cp.asarray(a) for a in (q, k_cache, v_cache, slots, positions)),
                                              scale=0.125, window=window)).astype(np.float64)
    assert (runs, decodes) == (([], [1]) if window else ([1], []))
    want = _slot_attention64(q, k_cache, v_cache, slots, positions, 0.125, window)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _decode_kernels(attention, monkeypatch) -> list[tuple]:
    """(kernel, instance) of each decode.cu kernel attention.py looks up from now on."""
    looked_up: list[tuple] = []
    real = attention.nvrtc.function

    def function(*a):
        if a[0] == "decode":
            looked_up.append((a[1], a[3] if len(a) > 3 else None))
        return real(*a)

    monkeypatch.setattr(attention.nvrtc, "function", function)
    return looked_up


def _slot_batch(seed: int, dtype, heads: int, kv_heads: int, e: int, last: tuple[int, int]) -> tuple:
    """A 300-slot cache of 7 slots and 9 decode rows in shuffled slots (one twice) at positions 0, inside the first
    16-key step, on a step and a chunk boundary, mid-cache and at the cache's end; the last row's (slot, position)
    as given: (q, k_cache, v_cache, slots, positions)."""
    rng = np.random.default_rng(seed)
    k_cache, v_cache = (rng.standard_normal((7, 300, kv_heads, e)).astype(dtype) for _ in range(2))
    slots = np.array([4, 0, 2, 5, 2, 6, 1, 3, last[0]], np.int64)
    positions = np.array([[0], [9], [15], [63], [64], [200], [299], [130], [last[1]]], np.int64)
    q = rng.standard_normal((slots.size, heads, 1, e)).astype(dtype)
    return q, k_cache, v_cache, slots, positions


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("heads,kv_heads,e", [(4, 4, 64), (8, 2, 64), (32, 8, 64), (16, 2, 128), (12, 1, 128),
                                              (16, 1, 64), (5, 1, 128)],
                         ids=["mha", "g4", "llama1b", "g8-e128", "g12-e128", "g16", "g5-e128"])
@pytest.mark.parametrize("window", [0, 50], ids=["full", "window"])
def test_slot_decode_on_the_tensor_cores_matches_float64(dtype, heads, kv_heads, e, window, monkeypatch) -> None:
    """attention.DECODE_MMA: decode.cu's attend_mma (scores and p v as m16n8k16 products, each lane's operands
    loaded in fragment order) for a batch in shuffled slots (one twice, one outside the cache: NaN), at positions
    0, inside the first 16-key step, on a step and a chunk boundary, mid-cache and at the cache's end, against
    float64; groups of 1 to 16 q heads (rows 8-15 of the tile from 9), heads of 64 and 128."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    monkeypatch.setattr(attention, "DECODE_MMA", True)
    monkeypatch.setattr(attention, "DECODE_MMA_PACKED_RUNS", False)  # this batch has more rows than slots
    looked_up = _decode_kernels(attention, monkeypatch)
    q, k_cache, v_cache, slots, positions = _slot_batch(heads + e + window, dtype, heads, kv_heads, e, (9, 20))
    got = cp.asnumpy(attention.slot_attention(*(cp.asarray(a) for a in (q, k_cache, v_cache, slots, positions)),
                                              scale=0.125, window=window)).astype(np.float64)
    assert ("attend_mma", e + (1000 if heads // kv_heads > 8 else 0)) in looked_up
    assert "attend_chunk" not in [name for name, _ in looked_up]
    assert np.isnan(got[-1]).all()  # slot 9 of 7: a query that sees no key
    want = _slot_attention64(q[:-1], k_cache, v_cache, slots[:-1], positions[:-1], 0.125, window)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got[:-1], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("mma", [True, False], ids=["mma", "chunk"])
@pytest.mark.parametrize("heads,kv_heads,e", [(32, 8, 64), (16, 2, 128), (6, 1, 64)], ids=["llama1b", "g8-e128", "g6"])
@pytest.mark.parametrize("window", [0, 50], ids=["full", "window"])
@pytest.mark.parametrize("blocks", [40, 1024])
def test_slot_decode_with_balanced_chunks_matches_float64(mma, heads, kv_heads, e, window, blocks,
                                                          monkeypatch) -> None:
    """attention.SLOT_BALANCED_CHUNKS: each decode row's own visible keys split into the step's chunks (decode.cu's
    decode_keys with balance), by attend_mma and attend_chunk. With DECODE_BLOCKS 40 the 9 rows get 1 (32/8 heads),
    3 (16/2) or 5 (6/1) chunks of a 300-slot cache: at position 200 one piece of 201 keys, three of 80 (whole
    16-key steps off the 64-key boundaries) or 64-key pieces; with the window, 50 keys from 151. With 1024, five
    64-key chunks and pieces of at least 64. Against float64, with balanced chunks and with fixed ones."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    monkeypatch.setattr(attention, "DECODE_MMA", mma)
    monkeypatch.setattr(attention, "DECODE_BLOCKS", blocks)
    q, k_cache, v_cache, slots, positions = _slot_batch(heads + e + window + blocks, BFLOAT16, heads, kv_heads, e,
                                                        (6, 17))
    args = [cp.asarray(a) for a in (q, k_cache, v_cache, slots, positions)]
    results = []
    for balanced in (True, False):
        monkeypatch.setattr(attention, "SLOT_BALANCED_CHUNKS", balanced)
        looked_up = _decode_kernels(attention, monkeypatch)
        results.append(cp.asnumpy(attention.slot_attention(*args, scale=0.125, window=window)).astype(np.float64))
        assert [name for name, _ in looked_up][:1] == ["attend_mma" if mma else "attend_chunk"]
    want = _slot_attention64(q, k_cache, v_cache, slots, positions, 0.125, window)
    for got in results:
        np.testing.assert_allclose(got, want, rtol=TOL[BFLOAT16], atol=TOL[BFLOAT16])


@pytest.mark.parametrize("heads,kv_heads,mask_kind", [(32, 8, "none"), (20, 2, "bool"), (4, 4, "float")])
def test_attend_mma_without_the_next_step_in_flight_gives_the_same_bits(heads, kv_heads, mask_kind,
                                                                        monkeypatch) -> None:
    """attention.DECODE_MMA_PIPELINED = False (heads of 64: instance + 8000, a warp's next keys loaded after its
    step) computes the same steps in the same order: the same bits, for each mask kind and both tile heights."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    monkeypatch.setattr(attention, "DECODE_MMA", True)
    rng = np.random.default_rng(heads)
    seq, e = 700, 64
    q, k, v = (cp.asarray(rng.standard_normal(shape).astype(BFLOAT16))
               for shape in ((3, heads, 1, e), (3, kv_heads, seq, e), (3, kv_heads, seq, e)))
    keep = np.arange(seq) < 531
    mask = {"none": None, "bool": cp.asarray(keep[None, None, None]),
            "float": cp.asarray(np.where(keep, -0.5, -np.inf).astype(np.float32)[None, None, None])}[mask_kind]
    results = []
    for pipelined in (True, False):
        monkeypatch.setattr(attention, "DECODE_MMA_PIPELINED", pipelined)
        looked_up = _decode_kernels(attention, monkeypatch)
        results.append(cp.asnumpy(attention.sdpa(q, k, v, mask, causal=False, scale=None)).view(np.uint16))
        assert looked_up[0][0] == "attend_mma" and (looked_up[0][1] >= 8000) == (not pipelined)
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize("heads,kv_heads,e", [(8, 2, 64), (32, 4, 128), (32, 8, 128), (16, 1, 64)],
                         ids=["g4", "qwen3", "llama8b", "g16"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("seq,visible", [(1, 1), (37, 37), (300, 129), (2200, 2113)])
def test_decode_on_the_tensor_cores_matches_float64(heads, kv_heads, e, mask_kind, seq, visible, monkeypatch) -> None:
    """attention.DECODE_MMA for sdpa's one-query decode, one sequence and three, from one key to more than one chunk:
    with no mask, or a static cache's mask that every head shares (bool, or float with -inf past the written slots;
    a hidden key's k and v not read), against float64; a mask that differs by head takes the split-key kernel (no
    decode kernel at groups of more than 8)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    monkeypatch.setattr(attention, "DECODE_MMA", True)
    rng = np.random.default_rng(heads + seq)
    keep = np.arange(seq) < visible
    mask = {"bool": keep[None, None, None], "none": None,
            "float": np.where(keep, rng.uniform(-1, 0, seq), -np.inf).astype(np.float32)[None, None, None]}[mask_kind]
    for batch in (1, 3):
        q = rng.standard_normal((batch, heads, 1, e)).astype(BFLOAT16)
        k = rng.standard_normal((batch, kv_heads, seq, e)).astype(BFLOAT16)
        v = rng.standard_normal((batch, kv_heads, seq, e)).astype(BFLOAT16)
        looked_up = _decode_kernels(attention, monkeypatch)
        md = None if mask is None else cp.asarray(mask)
        got = attention.sdpa(*(cp.asarray(a) for a in (q, k, v)), md, causal=False, scale=None)
        assert [name for name, _ in looked_up][:1] == ["attend_mma"]
        want = _attention64(q, k, v, mask, 1 / np.sqrt(e))
        np.testing.assert_allclose(cp.asnumpy(got).astype(np.float64), want, rtol=TOL[BFLOAT16], atol=TOL[BFLOAT16])
    if mask is not None:
        by_head = cp.asarray(np.broadcast_to(mask, (1, heads, 1, seq)).copy())
        looked_up.clear()
        attention.sdpa(*(cp.asarray(a) for a in (q, k, v)), by_head, causal=False, scale=None)
        assert [name for name, _ in looked_up][:1] == (["attend_chunk"] if heads // kv_heads <= 8 else [])


def test_slot_decode_attention_of_a_slot_outside_the_cache_reads_nothing() -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.attention import slot_attention

    cache = cp.ones((2, 70, 1, 64), cp.float16)
    out = cp.asnumpy(slot_attention(cp.ones((2, 2, 1, 64), cp.float16), cache, cache,
                                    cp.asarray([1, 7], cp.int64), cp.asarray([[5], [5]], cp.int64), scale=0.1))
    assert np.allclose(out[0], 1.0) and np.isnan(out[1]).all()


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("window", [0, 40], ids=["full", "window"])
def test_slot_prefill_attention_by_flash_with_the_positions_as_mask(dtype, window, monkeypatch) -> None:
    """A prefill chunk of 70 queries at positions 90..159 of slot 2 (a chunk after the first), against float64."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import attention

    rng = np.random.default_rng(7 + window)
    k_cache = rng.standard_normal((3, 256, 2, 64)).astype(dtype)
    v_cache = rng.standard_normal((3, 256, 2, 64)).astype(dtype)
    q = rng.standard_normal((1, 8, 70, 64)).astype(dtype)
    slots, positions = np.array([2], np.int64), np.arange(90, 160, dtype=np.int64)[None]
    called = []
    flash = attention._flash_attention
    monkeypatch.setattr(attention, "_flash_attention", lambda *a: called.append(1) or flash(*a))
    got = cp.asnumpy(attention.slot_attention(*(cp.asarray(a) for a in (q, k_cache, v_cache, slots, positions)),
                                              scale=0.125, window=window)).astype(np.float64)
    assert called
    want = _slot_attention64(q, k_cache, v_cache, slots, positions, 0.125, window)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_cache_update_of_one_position_in_one_kernel(dtype, interleaved) -> None:
    """q/k/v as transposed views of one projection (a Llama's layout), cos/sin [1, D], a negative slot, the caches
    written in place; against the rope op's float64 formula."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import rope

    rng = np.random.default_rng(3)
    b, hq, hkv, d, size = 2, 8, 2, 64, 40
    qkv = cp.asarray(rng.standard_normal((b, 1, (hq + 2 * hkv) * d)).astype(dtype))
    q, k, v = (qkv[..., lo * d:hi * d].reshape(b, 1, hi - lo, d).transpose(0, 2, 1, 3)
               for lo, hi in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)))
    angles = rng.standard_normal((1, d))
    cos, sin = (cp.asarray(f(angles).astype(dtype)) for f in (np.cos, np.sin))
    caches = [cp.asarray(rng.standard_normal((b, hkv, size, d)).astype(dtype)) for _ in range(2)]
    before = [cp.asnumpy(c).astype(np.float64) for c in caches]
    index = cp.asarray(np.array([-3], np.int64))
    assert rope._one_position_cos_sin(q, k, v, cos, sin, *caches, (index,), [2]) is not None

    def rope64(x):
        x, c, s = (cp.asnumpy(a).astype(np.float64) for a in (x, cos, sin))
        if interleaved:
            turned = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
        else:
            turned = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * c + turned * s

    q_out, k_out, v_out = rope.rope_cache_update(q, k, v, cos, sin, *caches, index, dims=[2],
                                                      interleaved=interleaved, in_place=True)
    assert k_out is caches[0] and v_out is caches[1]
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(cp.asnumpy(q_out).astype(np.float64), rope64(q), rtol=tol, atol=tol)
    want_k, want_v = before
    want_k[:, :, size - 3], want_v[:, :, size - 3] = rope64(k)[:, :, 0], cp.asnumpy(v).astype(np.float64)[:, :, 0]
    np.testing.assert_allclose(cp.asnumpy(k_out).astype(np.float64), want_k, rtol=tol, atol=tol)
    np.testing.assert_array_equal(cp.asnumpy(v_out).astype(np.float64), want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("d", [128, 80], ids=["d128", "d80"])
def test_norm_rope_cache_update_of_one_position_in_one_kernel(dtype, interleaved, d, monkeypatch) -> None:
    """Qwen3's q/k norms folded in: q/k/v as transposed views of one projection, the caches written in place at a
    negative slot; equal to the rms_norm and rope_cache_update kernels it stands for (float32: within rounding of
    the sums' order; half types: the same bits or one ulp), and that fused kernel is the one that runs."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import rope
    from kiln.runtime.backends.cuda.kernels.norm import rms_norm

    rng = np.random.default_rng(d)
    b, hq, hkv, size = 2, 8, 2, 40
    qkv = cp.asarray(rng.standard_normal((b, 1, (hq + 2 * hkv) * d)).astype(dtype))
    q, k, v = (qkv[..., lo * d:hi * d].reshape(b, 1, hi - lo, d).transpose(0, 2, 1, 3)
               for lo, hi in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)))
    angles = rng.standard_normal((1, d))
    cos, sin = (cp.asarray(f(angles).astype(dtype)) for f in (np.cos, np.sin))
    qw, kw = (cp.asarray(rng.uniform(0.5, 1.5, d).astype(dtype)) for _ in range(2))
    start = [cp.asarray(rng.standard_normal((b, hkv, size, d)).astype(dtype)) for _ in range(2)]
    index = cp.asarray(np.array([-3], np.int64))
    want = rope.rope_cache_update(rms_norm(q, qw, 1, 1e-6), rms_norm(k, kw, 1, 1e-6), v, cos, sin,
                                       *(c.copy() for c in start), index, dims=[2], interleaved=interleaved,
                                       in_place=True)
    monkeypatch.setattr(rope.composite, "norm_rope_cache_update", None)  # the unfused path would fail
    caches = [c.copy() for c in start]
    got = rope.norm_rope_cache_update(q, k, v, cos, sin, *caches, qw, kw, index, dims=[2],
                                           interleaved=interleaved, eps=1e-6, in_place=True)
    assert got[1] is caches[0] and got[2] is caches[1]
    tol = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 2e-3, BFLOAT16: 1.6e-2}[np.dtype(dtype)]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(cp.asnumpy(g).astype(np.float64), cp.asnumpy(w).astype(np.float64), rtol=tol,
                                   atol=tol)


def _rope64(x, cos, sin, interleaved):
    """The rope op's formula in float64 on the host (cos/sin broadcast against x)."""
    import cupy as cp

    x, c, s = (cp.asnumpy(a).astype(np.float64) for a in (x, cos, sin))
    d = x.shape[-1]
    if interleaved:
        turned = np.stack([-x[..., 1::2], x[..., 0::2]], axis=-1).reshape(x.shape)
    else:
        turned = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * c + turned * s


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_cache_update_of_a_slotted_decode_step_in_one_kernel(dtype, interleaved, monkeypatch) -> None:
    """A serving program's decode step: q [B, Hq, 1, D] and k/v [B, 1, Hkv, D] as views of one projection, cos/sin
    [B, 1, 1, D] per sequence, the caches [slots, S, Hkv, D] written in place at (slot, position) with a negative
    slot and position, and two rows writing one place (the later one wins, as index_put keeps the last); against
    float64. The fused kernel is the one that runs (the per-op path is made to fail)."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import rope

    rng = np.random.default_rng(5)
    b, hq, hkv, d, slot_count, size = 5, 8, 2, 64, 4, 40
    qkv = cp.asarray(rng.standard_normal((b, 1, (hq + 2 * hkv) * d)).astype(dtype))
    q = qkv[..., :hq * d].reshape(b, 1, hq, d).transpose(0, 2, 1, 3)
    k = qkv[..., hq * d:(hq + hkv) * d].reshape(b, 1, hkv, d)
    v = qkv[..., (hq + hkv) * d:].reshape(b, 1, hkv, d)
    angles = rng.standard_normal((b, 1, 1, d))
    cos, sin = (cp.asarray(f(angles).astype(dtype)) for f in (np.cos, np.sin))
    caches = [cp.asarray(rng.standard_normal((slot_count, size, hkv, d)).astype(dtype)) for _ in range(2)]
    before = [cp.asnumpy(c).astype(np.float64) for c in caches]
    slots_host, positions_host = np.array([2, 0, -1, 1, 2], np.int64), np.array([7, 0, 39, -2, 7], np.int64)
    slots, positions = cp.asarray(slots_host[:, None]), cp.asarray(positions_host[:, None])
    assert rope._slot_step_cos_sin(q, k, v, cos, sin, *caches, (slots, positions), [0, 1]) is not None
    monkeypatch.setattr(rope, "index_put", None)  # the unfused path would fail
    q_out, k_out, v_out = rope.rope_cache_update(q, k, v, cos, sin, *caches, slots, positions, dims=[0, 1],
                                                      interleaved=interleaved, in_place=True)
    assert k_out is caches[0] and v_out is caches[1]
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(cp.asnumpy(q_out).astype(np.float64), _rope64(q, cos, sin, interleaved),
                               rtol=tol, atol=tol)
    want_k, want_v = before
    rotated, values = _rope64(k, cos, sin, interleaved), cp.asnumpy(v).astype(np.float64)
    for row in range(b):  # in order, so the last writer of a place wins
        want_k[slots_host[row], positions_host[row]] = rotated[row, 0]
        want_v[slots_host[row], positions_host[row]] = values[row, 0]
    np.testing.assert_allclose(cp.asnumpy(k_out).astype(np.float64), want_k, rtol=tol, atol=tol)
    np.testing.assert_array_equal(cp.asnumpy(v_out).astype(np.float64), want_v)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_index_put_at_slot_and_position_is_one_flat_scatter(dtype, monkeypatch) -> None:
    """A slotted prefill's cache write, cache[slot [1, 1], positions [1, T]] = values [1, T, Hkv, D], and a batch
    of rows with a repeated place: equal to NumPy's assignment (its last writer winning), without the portable
    path."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels import index

    rng = np.random.default_rng(6)
    monkeypatch.setattr(index.portable, "index_put", None)
    cache = rng.standard_normal((3, 50, 2, 16)).astype(dtype)
    for rows, at in ((np.array([[1]]), np.arange(10, 30)[None]), (np.array([[0], [2], [0]]), np.array([[4], [9], [4]])),
                     (np.array([[-1]]), np.array([[-3, 5]]))):
        values = rng.standard_normal(np.broadcast_shapes(rows.shape, at.shape) + (2, 16)).astype(dtype)
        want = cache.copy()
        want[rows, at] = values
        got = index.index_put(cp.asarray(cache), cp.asarray(values), cp.asarray(rows), cp.asarray(at), dims=[0, 1],
                              accumulate=False, in_place=False)
        np.testing.assert_array_equal(cp.asnumpy(got), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_argmax_rows_in_the_logits_own_type_as_numpy(dtype) -> None:
    """argmax.cu over vocabulary-wide rows: the first of tied maxima, a maximum in the last column, -inf rows and
    NaN (the first NaN wins, as np.argmax has it); equal to np.argmax on the same values."""
    import cupy as cp

    from kiln.runtime.backends import create

    rng = np.random.default_rng(7)
    rows = rng.standard_normal((6, 50257)).astype(np.float32)
    rows[1, [17, 4000, 50000]] = 9.0
    rows[2, -1] = 10.0
    rows[3] = -np.inf
    rows[4, [30, 900]] = np.nan
    rows = rows.astype(dtype)
    backend = create("cuda", None)
    np.testing.assert_array_equal(backend.argmax_rows(cp.asarray(rows)), np.argmax(rows.astype(np.float32), axis=1))


def _prefill_case(mode: str, queries: int, keys: int, rng: np.random.Generator):
    """The mask and causal flag of a prefill: 'causal' (queries == keys, is_causal), 'cache' (the queries are the
    last positions written into a longer cache, a bool mask over [query, slot]), 'float' (an additive float mask
    with some -inf, per head), 'causal+bool' (both), 'none'."""
    if mode == "cache":
        first = keys // 3
        return (np.arange(keys)[None] <= (first + np.arange(queries))[:, None])[None, None], False
    if mode == "float":
        m = rng.uniform(-2, 0, (1, 2, queries, keys)).astype(np.float32)
        m[rng.uniform(size=m.shape) < 0.3] = -np.inf
        m[..., 0] = 0.0  # every query sees key 0
        return m, False
    if mode == "causal+bool":
        return (rng.uniform(size=(1, 1, 1, keys)) < 0.7) | (np.arange(keys) == 0), True
    return None, mode == "causal"


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=IDS[1:])
@pytest.mark.parametrize("heads,kv_heads,e", [(4, 4, 64), (6, 2, 128), (8, 2, 80), (7, 1, 32), (4, 2, 96)],
                         ids=["mha", "g3-e128", "g4-e80", "g7-e32", "g2-e96"])
@pytest.mark.parametrize("mode", ["causal", "cache", "float", "causal+bool", "none"])
@pytest.mark.parametrize("queries,keys", [(100, 100), (7, 150), (130, 333), (64, 320)],
                         ids=["q100", "q7", "q130", "q64"])
def test_flash_attention_matches_float64(dtype, heads, kv_heads, e, mode, queries, keys) -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.attention import _flash_attention_applies, sdpa

    if mode in ("causal", "causal+bool") and queries != keys:
        keys = queries
    rng = np.random.default_rng(heads * queries + keys + e)
    q = rng.standard_normal((2, queries, heads, e)).astype(dtype)  # transposed to [b, h, l, e] as a view below
    k = rng.standard_normal((2, kv_heads, keys, e)).astype(dtype)
    v = rng.standard_normal((2, kv_heads, keys, e)).astype(dtype)
    mask, causal = _prefill_case(mode, queries, keys, rng)
    if mode == "float":
        mask = np.repeat(mask, heads // 2, axis=1) if heads % 2 == 0 else mask[:, :1]
    qd = cp.asarray(q).transpose(0, 2, 1, 3)
    kd, vd = cp.asarray(k), cp.asarray(v)
    md = None if mask is None else cp.asarray(mask)
    assert _flash_attention_applies(qd, kd, vd, md)
    full = np.tril(np.ones((queries, keys), bool)) if causal else None
    want_mask = mask if full is None else (full if mask is None else mask & full)
    want = _attention64(q.transpose(0, 2, 1, 3), k, v, want_mask, 1 / np.sqrt(e))
    got = cp.asnumpy(sdpa(qd, kd, vd, md, causal=causal, scale=None)).astype(np.float64)
    tol = TOL[np.dtype(dtype)]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_flash_attention_scale_and_a_query_that_sees_nothing() -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.attention import _flash_attention_applies, sdpa

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 70, 64)).astype(np.float16) for _ in range(3))
    mask = np.ones((1, 1, 70, 70), bool)
    mask[..., 5, :] = False  # query 5 sees no key
    qd, kd, vd, md = (cp.asarray(a) for a in (q, k, v, mask))
    assert _flash_attention_applies(qd, kd, vd, md)
    got = cp.asnumpy(sdpa(qd, kd, vd, md, causal=False, scale=0.3)).astype(np.float64)
    assert np.isnan(got[:, :, 5]).all()
    want = _attention64(q, k, v, mask, 0.3)
    keep = np.arange(70) != 5
    np.testing.assert_allclose(got[:, :, keep], want[:, :, keep], rtol=2e-3, atol=2e-3)


def test_flash_attention_leaves_what_it_cannot_take_to_the_products_path() -> None:
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.attention import _flash_attention_applies

    q = cp.ones((1, 4, 16, 64), cp.float16)
    assert _flash_attention_applies(q, q, q, None)
    assert not _flash_attention_applies(q.astype(cp.float32), q.astype(cp.float32), q.astype(cp.float32), None)
    wide = cp.ones((1, 4, 16, 256), cp.float16)
    assert not _flash_attention_applies(wide, wide, wide, None)  # no instance that wide
    odd = cp.ones((1, 4, 16, 68), cp.float16)[..., 4:]  # rows 8 bytes off 16-byte alignment
    assert not _flash_attention_applies(q, odd, odd, None)


def test_flash_attention_past_the_tiles_it_flags() -> None:
    """The kernel notes which of the first 1024 key tiles the mask shows; tiles past them are visited anyway."""
    import cupy as cp

    from kiln.runtime.backends.cuda.kernels.attention import _flash_attention_applies, sdpa

    rng = np.random.default_rng(4)
    keys = 1024 * 64 + 100
    q = rng.standard_normal((1, 2, 3, 32)).astype(BFLOAT16)
    k, v = (rng.standard_normal((1, 1, keys, 32)).astype(BFLOAT16) for _ in range(2))
    mask = np.zeros((1, 1, 3, keys), bool)
    mask[..., :5] = True
    mask[..., 0, keys - 90:] = True  # query 0 also sees keys past the flagged tiles
    qd, kd, vd, md = (cp.asarray(a) for a in (q, k, v, mask))
    assert _flash_attention_applies(qd, kd, vd, md)
    got = cp.asnumpy(sdpa(qd, kd, vd, md, causal=False, scale=None)).astype(np.float64)
    np.testing.assert_allclose(got, _attention64(q, k, v, mask, 1 / np.sqrt(32)), rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_sample_rows_draws_what_its_numpy_twin_draws(dtype) -> None:
    """argmax.cu's sample_rows (the engine's device sampling: the Gumbel-max draw of (seed, counter)) against
    sampling.sample_rows_reference on the same rows: the same picks for sampled rows (the noise's hash is exact,
    its logarithms within float32 rounding), greedy rows (inverse temperature 0) their argmax, a NaN row -1; and
    the picks of one row over many counters follow its softmax."""
    import cupy as cp

    from kiln.runtime.backends import create
    from kiln.runtime.llm.sampling import sample_rows_reference

    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((8, 50257)) * 2).astype(np.float32)
    rows[5, 100] = np.nan
    rows = rows.astype(dtype)
    inv_t = np.array([1.0, 1 / 0.7, 0.0, 2.0, 1.0, 1.0, 0.0, 1 / 1.3], np.float32)
    seeds = np.array([1, 2, 3, 4, 5, 6, 7, 2**63 + 5], np.uint64)
    counters = np.array([1, 1, 1, 9, 10**6, 3, 4, 2], np.int64)
    backend = create("cuda", None)
    got = cp.asnumpy(backend.sample_rows_here(cp.asarray(rows), inv_t, seeds, counters))
    want = sample_rows_reference(rows, inv_t, seeds, counters)
    assert got[5] == -1 and got[2] == np.argmax(rows[2].astype(np.float32))
    assert (got == want).sum() >= 7, (got, want)  # a float32 near-tie may part one pick, not more
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3], np.float32))
    draws = 20000
    many = cp.asnumpy(backend.sample_rows_here(cp.asarray(np.tile(logits, (draws, 1)).astype(dtype)),
                                               np.ones(draws, np.float32), np.full(draws, 11, np.uint64),
                                               np.arange(draws, dtype=np.int64)))
    probs = np.exp(logits.astype(dtype).astype(np.float64))
    np.testing.assert_allclose(np.bincount(many, minlength=4) / draws, probs / probs.sum(), atol=0.012)
