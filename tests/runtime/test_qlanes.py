"""int4 and symmetric int8 weights in the CPU backend's lanes form (native/qdot.c's kiln_qlanes_*;
resident.packed_lanes): the form holds the program's weights bit for bit, its products are the integer products'
definition, each row's bits do not depend on the rows beside it or the threads, and a program's quantized constants
run in it (prepared kernels and the native executor alike) without the stored layout also being copied into
memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln.export.quantize import Quantize
from kiln.runtime.backends.cpu import native, resident
from tests.runtime.int8_dot import integer_dot

pytestmark = pytest.mark.skipif(not native.lanes_bytes(4, 64, 32, 4),
                                reason="the helpers here have no lanes form (AVX-512 VNNI and BW)")

FORMS = [(4, "offsets", True), (4, "zero points", False), (4, "centred", False), (8, "symmetric", False)]
"""(bits, zero points, offset): the formats the form takes."""
SHAPES = [(8, 64), (12, 128), (4, 192), (16, 576), (8, 640), (20, 1088), (8, 1536)]
"""k: chunks of 16, 4 and 2 blocks in every mix the form has (576 = 512 + 64, 640 = 512 + 128, 1088 = 2 x 512 +
64, 192 = 128 + 64)."""


def _weight(n: int, k: int, group: int, form: str, seed: int, bits: int = 4) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 256, (n, k * bits // 8), dtype=np.uint8)
    if bits == 8:
        q = q.view(np.int8)
    scale = rng.uniform(0.005, 0.05, (n, k // group)).astype(np.float32) / (1 if bits == 4 else 16)
    zero = {"offsets": rng.uniform(-0.2, 0.2, (n, k // group)).astype(np.float32),
            "zero points": rng.integers(0, 16, (n, k // group)).astype(np.float32)}.get(form)
    return q, scale, zero, rng.standard_normal(n, dtype=np.float32)


def _cases() -> list:
    return [pytest.param(n, k, group, id=f"{n}x{k}-g{group}") for n, k in SHAPES for group in (32, 64, 128, 256)
            if k % group == 0]


def _packed(q, scale, zero, offset, bits=4) -> np.ndarray:
    n, k = q.shape[0], q.shape[1] * 8 // bits
    out = np.empty(native.lanes_bytes(n, k, k // scale.shape[1], bits), np.uint8)
    native.pack_lanes(q, scale, zero, bits, offset, out)
    return out


def _product(x, packed, bias, n, k, group, offset, refine=False, threads=2, bits=4) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.full((x.shape[0], n), np.nan, np.float32)
    work = np.empty(2 * x.shape[0] * (k + k // group) * 4, np.uint8)
    assert native.library().kiln_qlanes_linear_f32(
        x.ctypes.data, packed.ctypes.data, native.address(bias), out.ctypes.data, work.ctypes.data, x.shape[0], n, k,
        native.quant_format(bits, offset, refine), group, threads)
    return out


def _held(packed, n, k, group, bits, offset) -> np.ndarray:
    """The packed weight's values (kiln_qlanes_dequantize)."""
    w = np.empty((n, k), np.float32)
    native.library().kiln_qlanes_dequantize(packed.ctypes.data, n, k, native.quant_format(bits, offset), group,
                                           w.ctypes.data)
    return w


@pytest.mark.parametrize("bits,form,offset", FORMS, ids=[f"int{b}-{f}" for b, f, _ in FORMS])
@pytest.mark.parametrize("n,k,group", _cases())
def test_the_form_holds_the_weights_bit_for_bit(n, k, group, bits, form, offset):
    q, scale, zero, _ = _weight(n, k, group, form, n + k + group, bits)
    stored = np.empty((n, k), np.float32)
    native.library().kiln_dequantize_f32(q.ctypes.data, scale.ctypes.data, native.address(zero), stored.ctypes.data,
                                         n, k, native.quant_format(bits, offset), group)
    assert np.array_equal(stored, _held(_packed(q, scale, zero, offset, bits), n, k, group, bits, offset))


@pytest.mark.parametrize("bits,form,offset", FORMS, ids=[f"int{b}-{f}" for b, f, _ in FORMS])
@pytest.mark.parametrize("n,k,group", _cases())
def test_products_are_the_integer_products_definition(n, k, group, bits, form, offset):
    """Against tests/runtime/int8_dot.py's definition (what the stored layout's kernel and the GPU's compute): the
    inputs rounded to int8 per 32, exact integer sums, the scales after; within float32 summation."""
    q, scale, zero, bias = _weight(n, k, group, form, 7 * n + k + group, bits)
    x = np.random.default_rng(k).standard_normal((5, k), dtype=np.float32)
    got = _product(x, _packed(q, scale, zero, offset, bits), bias, n, k, group, offset, bits=bits)
    want = integer_dot(x, q, scale, zero, bias, bits, group, offset)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max() * np.sqrt(k)


def test_int8_with_zero_points_or_offsets_is_not_taken():
    """The form stores int8 as q + 128 with the point 128, exact only where the weight has no zero point of its own."""
    q, scale, zero, _ = _weight(8, 128, 32, "offsets", 1, bits=8)
    out = np.empty(native.lanes_bytes(8, 128, 32, 8), np.uint8)
    for z, offset in [(zero, True), (zero, False), (None, True)]:
        with pytest.raises(ValueError, match="cannot hold"):
            native.pack_lanes(q, scale, z, 8, offset, out)


@pytest.mark.parametrize("bits,refine", [(4, False), (8, False), (8, True)], ids=["int4", "int8", "int8-refined"])
def test_each_row_gives_its_bits_whatever_rows_and_threads_it_shares_a_call_with(bits, refine):
    """A row's output is one fixed computation: alone, among 2-4 (one pass's rows), among 40 (ten passes), on 1-3
    threads: so a prompt's rows and a decode step's, or a stream and its neighbours, never change each other."""
    n, k, group = 64, 1088, 32
    offset = bits == 4
    q, scale, zero, bias = _weight(n, k, group, "offsets" if offset else "symmetric", 3, bits)
    packed = _packed(q, scale, zero, offset, bits)
    x = np.random.default_rng(4).standard_normal((40, k), dtype=np.float32)
    whole = _product(x, packed, bias, n, k, group, offset, refine, threads=2, bits=bits)
    for threads in (1, 3):
        assert np.array_equal(_product(x, packed, bias, n, k, group, offset, refine, threads, bits), whole)
    for start, rows in [(0, 1), (1, 1), (2, 2), (5, 3), (9, 4), (13, 5), (30, 10)]:
        alone = _product(x[start:start + rows], packed, bias, n, k, group, offset, refine, bits=bits)
        assert np.array_equal(alone, whole[start:start + rows])


@pytest.mark.parametrize("bits,form,offset", [(4, "offsets", True), (8, "symmetric", False)], ids=["int4", "int8"])
def test_refined_inputs_come_within_the_second_rounding(bits, form, offset):
    """QUANT_REFINE (a model's logits): the input and its rounding's residual each rounded to int8, two products:
    ~1/128 of the one rounding's error against the float64 product of the same weights."""
    n, k, group = 32, 576, 32
    q, scale, zero, bias = _weight(n, k, group, form, 5, bits)
    packed = _packed(q, scale, zero, offset, bits)
    w = _held(packed, n, k, group, bits, offset)
    x = np.random.default_rng(6).standard_normal((3, k), dtype=np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + bias
    once = np.abs(_product(x, packed, bias, n, k, group, offset, bits=bits) - exact).max()
    twice = np.abs(_product(x, packed, bias, n, k, group, offset, refine=True, bits=bits) - exact).max()
    assert twice < once / 30 and twice < 1e-3


def test_rows_holding_inf_or_nan_are_multiplied_in_float32():
    """int8 cannot hold inf or NaN: such a row takes the float32 product of the dequantized rows, so they propagate
    as float32 arithmetic has them (inf times a weight of 0 is NaN); the other rows of the call are unaffected."""
    n, k, group = 8, 128, 32
    q, scale, zero, bias = _weight(n, k, group, "zero points", 8)
    q[3, 10] &= 0xF0  # weight (3, 20): code 0 (element 20's low nibble)
    zero[3, 0] = 0.0  # and row 3's first group's zero point 0: the weight is exactly 0
    packed = _packed(q, scale, zero, False)
    w = _held(packed, n, k, group, 4, False)
    assert w[3, 20] == 0.0
    x = np.random.default_rng(9).standard_normal((3, k), dtype=np.float32)
    x[0, 20], x[2, 100] = np.inf, np.nan
    got = _product(x, packed, bias, n, k, group, False)
    with np.errstate(invalid="ignore", over="ignore"):
        want = x @ w.T + bias
    assert np.array_equal(np.isnan(got[0]), np.isnan(want[0])) and np.isnan(got[0, 3])
    assert np.isinf(got[0]).sum() == n - 1 and np.isnan(got[2]).all()
    assert np.array_equal(got[1], _product(x[1:2], packed, bias, n, k, group, False)[0])


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(576, 256), torch.nn.Linear(256, 576, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("executor", ["native", "python"])
@pytest.mark.parametrize("mode,group", [("int4", 32), ("int4", 64), ("int8", 64)])
def test_a_programs_weights_run_in_the_lanes_form_and_are_held_once(mode, group, executor, monkeypatch):
    """Exported int4 and int8 linears on the CPU: the prepared kernels (python) and the native executor's
    instructions run the lanes form, for one row and for as many as take integer products (quant.lanes_rows), with
    the same bits either way; more rows (a long prompt's) take the float GEMM on the stored weights, read from the
    file's pages. The form is made once per program from the file's pages, and the stored codes, scales and zero
    points are never also copied into resident memory."""
    from kiln.runtime.backends.cpu import quant

    monkeypatch.setenv("KILN_EXECUTOR", executor)
    torch.manual_seed(0)
    model = _TwoLayers().eval()
    exported = kiln.export(model, (torch.randn(3, 576),), quantize=Quantize(mode, group_size=group, symmetric=True),
                           dynamic_shapes=({0: torch.export.Dim("rows", min=1, max=64)},))
    program = exported.load()
    calls = []
    lib = native.library()

    class Spy:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return (lambda *args: calls.append(name) or fn(*args)) if name.startswith("kiln_q") else fn

    monkeypatch.setattr(native, "library", Spy)
    session = program.session("cpu")
    x = np.random.default_rng(1).standard_normal((40, 576), dtype=np.float32)
    rows = quant.lanes_rows(int(mode[3:]))
    many = session.run("forward", x[:rows])[0]
    one = session.run("forward", x[7:8])[0]
    assert np.array_equal(one, many[7:8])
    if executor == "python":
        assert {c for c in calls if c.endswith("_f32")} == {"kiln_qlanes_linear_f32"}  # (the products run)
    else:  # (inside the executor's one compiled call)
        assert all(plan.lowered is not None for plan in session._plans["forward"].values())
        assert not {"kiln_qgemm_f32", "kiln_qlinear_dot_f32", "kiln_qlanes_linear_f32"} & set(calls)
    calls.clear()
    longer = session.run("forward", x)[0]
    assert "kiln_qgemm_f32" in calls and "kiln_qlanes_linear_f32" not in calls
    monkeypatch.setenv("KILN_QUANT_DOT", "float")  # the float32 kernel: the same weights, inputs not rounded
    want = exported.load().session("cpu").run("forward", x)[0]
    assert np.abs(many - want[:rows]).max() < 0.02 * np.abs(want).max()
    assert np.abs(longer - want).max() < 1e-4 * np.abs(want).max()
    forms = program.backend_cache[resident.LANES_KEY].forms
    assert len(forms) == 2
    quantized = {c.blob for c in program.ir.constants if c.name.endswith((".q", ".scale", ".zero"))}
    copied = program.backend_cache[resident.CACHE_KEY].filled if resident.CACHE_KEY in program.backend_cache else set()
    assert quantized and not quantized & copied
