"""The CPU backend's native executor (cpu/executor.py, native/executor.c): a method whose every node it lowers runs
in one compiled call and gives the bits the Python path gives; what it does not lower, or declines at run time,
runs from Python with the same results and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln.errors import KilnError
from kiln.models.llm import export_llama
from kiln.models.zoo import tiny_decoder
from kiln.runtime.backends.cpu import native
from kiln.runtime.llm.decoding import prefill_chunk

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler: the compiled helpers are not built")

CONTEXT, CHUNK = 32, 4


def _sessions(program) -> tuple[kiln.Session, kiln.Session]:
    """(native, python) sessions: the executor is chosen when a plan is built (a method's first run with new
    shapes), so each is run under its own KILN_EXECUTOR (_run)."""
    return program.session("cpu"), program.session("cpu")


def _run(session, method, *inputs, executor, monkeypatch):
    monkeypatch.setenv("KILN_EXECUTOR", executor)
    return session.run(method, *inputs)


def _lowered(session, method: str) -> bool:
    return all(plan.lowered is not None for plan in session._plans[method].values())


def _runs(session, method: str) -> int:
    """Lowered runs of steps in the method's plans (a method that does not lower whole)."""
    return sum(step.steps is not None for plan in session._plans[method].values() for step in plan.steps)


LOWERED = {"llama": True, "qwen3": True, "gemma": True, "mistral": True, "phi3": False, "gpt2": False}
"""Whether each family's decode lowers whole (phi3's partial rotary and GPT-2's LayerNorm and tanh do not: those
nodes run from Python, the runs of nodes between them lowered)."""


@pytest.mark.parametrize("family", sorted(LOWERED))
@pytest.mark.parametrize("quantize", [None, "int8", "int4"], ids=["float32", "int8", "int4"])
def test_decode_gives_the_python_paths_bits(family, quantize, monkeypatch):
    """Prefill chunks and decode steps of the zoo's decoders, float32 and quantized: the same logits to the bit and
    the same KV cache whichever way each method ran."""
    options = {} if quantize is None else {"quantize": quantize}
    program = export_llama(tiny_decoder(family), CONTEXT, CHUNK, **options).load()
    monkeypatch.setenv("KILN_THREADS", "2")
    native_session, python_session = _sessions(program)
    prompt = np.arange(3, 12, dtype=np.int64)
    for session, executor in ((native_session, "native"), (python_session, "python")):
        monkeypatch.setenv("KILN_EXECUTOR", executor)  # (prefill_chunk runs the session itself)
        for start in range(0, len(prompt), CHUNK):
            prefill_chunk(session, prompt[start:start + CHUNK], start, ())
    token = 5
    for position in range(len(prompt), len(prompt) + 6):
        args = (np.array([[token]], np.int64), np.array([position], np.int64))
        (got,) = _run(native_session, "decode", *args, executor="native", monkeypatch=monkeypatch)
        (want,) = _run(python_session, "decode", *args, executor="python", monkeypatch=monkeypatch)
        assert got.dtype == want.dtype and np.array_equal(got, want)
        token = int(want.reshape(-1).argmax())
    for got, want in zip(native_session.state, python_session.state, strict=True):
        assert np.array_equal(got, want)
    assert _lowered(native_session, "decode") == LOWERED[family]
    assert (_runs(native_session, "decode") > 0) == (not LOWERED[family])
    assert not any(plan.lowered for plan in python_session._plans["decode"].values())
    assert _runs(python_session, "decode") == 0


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # lowered whole; in runs between Python steps
def test_outputs_are_new_arrays_and_bad_inputs_raise_the_python_paths_errors(family, monkeypatch):
    """A run's outputs are never rewritten by the next run; a token outside the vocabulary or a position outside
    the cache, which an instruction declines at run time, raise what the Python path raises, the cache unharmed."""
    program = export_llama(tiny_decoder(family), CONTEXT, CHUNK, quantize="int4").load()
    def lowered(session) -> bool:
        return _lowered(session, "decode") if family == "llama" else _runs(session, "decode") > 0

    native_session, python_session = _sessions(program)
    def step(session, token, position):
        executor = "native" if session is native_session else "python"
        args = (np.array([[token]], np.int64), np.array([position], np.int64))
        return _run(session, "decode", *args, executor=executor, monkeypatch=monkeypatch)[0]

    first = step(native_session, 7, 0)
    kept = first.copy()
    second = step(native_session, 9, 1)
    assert second is not first and np.array_equal(first, kept) and lowered(native_session)
    step(python_session, 7, 0)
    step(python_session, 9, 1)
    for token, position in ((1000, 2), (7, CONTEXT), (-1000, 2)):
        with pytest.raises(KilnError) as lowered_error:
            step(native_session, token, position)
        with pytest.raises(KilnError) as python_error:
            step(python_session, token, position)
        assert str(lowered_error.value) == str(python_error.value)
    assert lowered(native_session)
    # the declined runs wrote nothing the Python path did not write too
    for got, want in zip(native_session.state, python_session.state, strict=True):
        assert np.array_equal(got, want)


class Views(torch.nn.Module):
    """Views the executor resolves to strides (a transpose read by a reshape, which needs a copy; a strided slice
    as an output, copied into its own array), a comparison with a broadcast, and few-row linears."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(12, 16)
        self.up = torch.nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.proj(x.transpose(1, 2).reshape(2, 12))
        mask = torch.arange(16).reshape(1, 16) <= limit.reshape(-1, 1)
        return self.up(h)[:, 1:7:2], mask, h.permute(1, 0)


def test_views_copies_and_outputs_of_a_small_graph(monkeypatch):
    model = Views().eval()
    x, limit = torch.randn(2, 3, 4), torch.tensor([3, 11])
    program = kiln.export(model, (x, limit)).load()
    native_session, python_session = _sessions(program)
    got = _run(native_session, "forward", x.numpy(), limit.numpy(), executor="native", monkeypatch=monkeypatch)
    want = _run(python_session, "forward", x.numpy(), limit.numpy(), executor="python", monkeypatch=monkeypatch)
    assert _lowered(native_session, "forward")
    with torch.no_grad():
        eager = model(x, limit)
    for g, w, e in zip(got, want, eager, strict=True):
        assert g.shape == w.shape == tuple(e.shape) and g.dtype == w.dtype and g.flags.c_contiguous
        assert np.array_equal(g, w)
        np.testing.assert_allclose(g, e.numpy(), rtol=1e-5, atol=1e-5)


def test_executor_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KILN_EXECUTOR", "python")
    program = kiln.export(Views().eval(), (torch.randn(2, 3, 4), torch.tensor([3, 11]))).load()
    session = program.session("cpu")
    session.run("forward", np.zeros((2, 3, 4), np.float32), np.array([1, 2]))
    assert not _lowered(session, "forward")


def test_session_threads_reach_every_kernel_and_change_no_bit(monkeypatch):
    """Session(threads=N): the kernels run from Python see N (native.threads() inside the run), the lowered plan
    passes N; threads=1 and threads=2 give the same bits; a count that is not a positive integer is refused."""
    program = export_llama(tiny_decoder("llama"), CONTEXT, CHUNK, quantize="int8").load()
    monkeypatch.setenv("KILN_THREADS", "3")
    outputs = []
    for threads in (1, 2):
        session = program.session("cpu", threads=threads)
        with session.backend.execution_context():
            assert native.threads() == threads
        assert native.threads() == 3
        prefill_chunk(session, np.arange(3, 7, dtype=np.int64), 0, ())
        outputs.append(session.run("decode", np.array([[5]], np.int64), np.array([4], np.int64))[0])
        plan = next(iter(session._plans["decode"].values()))
        assert plan.lowered is not None and plan.lowered.threads == threads
    assert np.array_equal(outputs[0], outputs[1])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(KilnError, match="threads"):
            program.session("cpu", threads=bad)


class Arithmetic(torch.nn.Module):
    """Elementwise arithmetic with broadcasting: int64 (a remainder of negative numbers and by a negative divisor,
    as a sliding window's positions take it; wrapping products), float32, and bool masks combined."""

    def forward(self, i: torch.Tensor, j: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        window = (i - j.reshape(-1, 1)) % 5
        back = (i - 3) % -4
        keep = (window >= 2) & (i.reshape(1, -1) < 6) | (back == 0)
        return window, back, i * j.reshape(-1, 1) - i, keep, (x + y) * x / (y - 0.5), x - y.reshape(-1, 1)


def test_elementwise_arithmetic_gives_numpys_bits(monkeypatch):
    args = (torch.arange(-6, 6), torch.tensor([3, -2, 2**62]), torch.randn(12), torch.randn(3, 12))
    program = kiln.export(Arithmetic(), args).load()
    native_session, python_session = _sessions(program)
    inputs = [a.numpy() for a in args]
    got = _run(native_session, "forward", *inputs, executor="native", monkeypatch=monkeypatch)
    want = _run(python_session, "forward", *inputs, executor="python", monkeypatch=monkeypatch)
    assert _lowered(native_session, "forward")
    with torch.no_grad():
        eager = Arithmetic()(*args)
    for g, w, e in zip(got, want, eager, strict=True):
        assert g.dtype == w.dtype and np.array_equal(g, w)
        assert np.array_equal(g, e.numpy()) if g.dtype != np.float32 else np.allclose(g, e.numpy(), atol=1e-6)


@pytest.mark.parametrize("quantize", [None, "int4"], ids=["float32", "int4"])
def test_serving_decode_steps_lower_whole(quantize, monkeypatch):
    """A serving program's decode step (several sequences, each at its own slot and position: the slotted RoPE +
    cache write and slot_attention) runs lowered, to the Python path's bits, state included; a slot outside the
    cache raises what the Python path raises."""
    options = {} if quantize is None else {"quantize": quantize}
    program = export_llama(tiny_decoder("llama"), CONTEXT, CHUNK, slots=4, **options).load()
    native_session, python_session = _sessions(program)
    steps = [([[5], [7]], [0, 3], [2, 0]), ([[9], [1]], [1, 4], [2, 0]), ([[3], [4], [8]], [2, 5, 0], [2, 0, 3])]
    for tokens, positions, slots in steps:
        args = (np.array(tokens, np.int64), np.array(positions, np.int64), np.array(slots, np.int64))
        (got,) = _run(native_session, "decode", *args, executor="native", monkeypatch=monkeypatch)
        (want,) = _run(python_session, "decode", *args, executor="python", monkeypatch=monkeypatch)
        assert np.array_equal(got, want)
    assert _lowered(native_session, "decode")
    for got, want in zip(native_session.state, python_session.state, strict=True):
        assert np.array_equal(got, want)
    bad = (np.array([[5]], np.int64), np.array([1], np.int64), np.array([4], np.int64))
    with pytest.raises(KilnError) as lowered_error:
        _run(native_session, "decode", *bad, executor="native", monkeypatch=monkeypatch)
    with pytest.raises(KilnError) as python_error:
        _run(python_session, "decode", *bad, executor="python", monkeypatch=monkeypatch)
    assert str(lowered_error.value) == str(python_error.value)


class SmallNet(torch.nn.Module):
    """Every compiled convolution route (conv.ROUTES: a 3-channel stem, depthwise, Winograd, a packed 1x1, squeeze-
    and-excitation's 1x1 convolutions of 1x1 maps, a packed im2col band) with fused activations, a mean and a sum over
    the maps, a broadcast product, max pooling, ReLU, a residual add and the classifier; with `blas`, also a grouped
    convolution, which runs by BLAS from Python between two lowered runs."""

    def __init__(self, blas: bool):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.mix = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.expand = torch.nn.Conv2d(16, 32, 1)
        self.se_reduce, self.se_expand = torch.nn.Conv2d(32, 8, 1), torch.nn.Conv2d(8, 32, 1)
        self.down = torch.nn.Conv2d(32, 32, 3, stride=2, padding=1)
        self.narrow = torch.nn.Conv2d(32, 8, 3, padding=1, groups=2) if blas else None
        self.head = torch.nn.Linear(8 if blas else 32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.hardswish(self.stem(x))
        x = self.expand(torch.relu(self.mix(torch.nn.functional.relu6(self.dw(x)))))
        s = x.mean((2, 3), keepdim=True)
        x = x * torch.nn.functional.hardsigmoid(self.se_expand(torch.relu(self.se_reduce(s))))
        x = torch.relu(self.down(x)) + torch.nn.functional.max_pool2d(x, 2)
        if self.narrow is not None:
            x = self.narrow(x)
        return self.head(x.sum((2, 3)) / 64)


@pytest.mark.parametrize("blas", [False, True], ids=["whole", "runs"])
def test_convolution_networks_lower_with_the_python_paths_bits(blas, monkeypatch):
    """A small CNN over every compiled convolution route runs lowered (whole, or in runs around a grouped
    convolution by BLAS), to the Python path's bits and eager's values, two images at once."""
    from kiln.runtime.backends.cpu import conv

    torch.manual_seed(0)
    model = SmallNet(blas).eval()
    x = torch.randn(2, 3, 32, 32)
    program = kiln.export(model, (x,)).load()
    routes = set()

    def recording(*args):
        r = route(*args)
        routes.add(None if r is None else r.name)
        return r

    route = conv.route
    monkeypatch.setattr(conv, "route", recording)
    native_session, python_session = _sessions(program)
    (got,) = _run(native_session, "forward", x.numpy(), executor="native", monkeypatch=monkeypatch)
    (want,) = _run(python_session, "forward", x.numpy(), executor="python", monkeypatch=monkeypatch)
    assert routes == set(conv.ROUTES) | ({"blas"} if blas else set())
    assert _lowered(native_session, "forward") == (not blas)
    assert (_runs(native_session, "forward") == 2) == blas
    with torch.no_grad():
        eager = model(x).numpy()
    assert np.array_equal(got, want)
    np.testing.assert_allclose(got, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [4, 12], ids=["few-rows", "packed-gemm"])
def test_linear_layers_of_few_and_many_rows_lower_with_the_python_paths_bits(rows, monkeypatch):
    """Linear layers lower at any row count: up to linalg.FEW_ROWS by the few-row helper, above by the GEMM with
    the weight packed once when the plan is built; the Python path's bits, eager's values."""
    from kiln.runtime.backends.cpu import linalg

    assert (rows <= linalg.FEW_ROWS) == (rows == 4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 56), torch.nn.GELU(), torch.nn.Linear(56, 24)).eval()
    x = torch.randn(rows, 40)
    program = kiln.export(model, (x,)).load()
    native_session, python_session = _sessions(program)
    (got,) = _run(native_session, "forward", x.numpy(), executor="native", monkeypatch=monkeypatch)
    (want,) = _run(python_session, "forward", x.numpy(), executor="python", monkeypatch=monkeypatch)
    assert _lowered(native_session, "forward")
    assert np.array_equal(got, want)
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-4, atol=1e-5)


def test_the_arena_reuses_the_bytes_of_values_no_longer_read(monkeypatch):
    """A chain of layers needs two live values at a time: the plan's arena holds about that, not every value one
    after another (an EfficientNet's arena was 24 MB that way), and the results are still the Python path's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)))
    x = torch.randn(4, 64)
    program = kiln.export(model.eval(), (x,)).load()
    native_session, python_session = _sessions(program)
    (got,) = _run(native_session, "forward", x.numpy(), executor="native", monkeypatch=monkeypatch)
    (want,) = _run(python_session, "forward", x.numpy(), executor="python", monkeypatch=monkeypatch)
    assert _lowered(native_session, "forward") and np.array_equal(got, want)
    plan = next(iter(native_session._plans["forward"].values())).lowered
    value_bytes = 4 * 64 * 4
    assert len(plan.code) == 12  # six linears and six GELUs, each a value of value_bytes
    assert plan.arena_bytes <= 3 * value_bytes
    # other plans (here another program's, of another shape) place their temporaries in the same arena, the
    # thread's, one run at a time
    other = kiln.export(model.eval(), (x[:1],)).load().session("cpu")
    small = _run(other, "forward", x.numpy()[:1], executor="native", monkeypatch=monkeypatch)[0]
    assert _lowered(other, "forward") and np.array_equal(small, got[:1])
    assert np.array_equal(_run(native_session, "forward", x.numpy(), executor="native", monkeypatch=monkeypatch)[0],
                          want)


class RepeatedKeys(torch.nn.Module):
    """GQA's repeat_kv as eager attention writes it: [B, Hkv, S, D] expanded to [B, Hkv, G, S, D] (a 5-d view with
    a zero stride) and reshaped to [B, Hkv * G, S, D], then read by a product."""

    def forward(self, q, k):
        b, hkv, s, d = k.shape
        keys = k[:, :, None].expand(b, hkv, 3, s, d).reshape(b, hkv * 3, s, d)
        return torch.relu(q @ keys.transpose(2, 3))


def test_a_five_dim_view_copies_as_the_dims_it_merges_into(monkeypatch):
    from kiln.runtime.backends.cpu.executor import _merged_dims

    assert _merged_dims((1, 2, 3, 5, 4), (40, 20, 0, 4, 1)) == ((2, 3, 20), (20, 0, 1))
    assert _merged_dims((1, 1), (7, 7)) == ((1,), (0,))
    q, k = torch.randn(1, 6, 5, 4), torch.randn(1, 2, 5, 4)
    program = kiln.export(RepeatedKeys(), (q, k)).load()
    native_session, python_session = _sessions(program)
    (got,) = _run(native_session, "forward", q.numpy(), k.numpy(), executor="native", monkeypatch=monkeypatch)
    (want,) = _run(python_session, "forward", q.numpy(), k.numpy(), executor="python", monkeypatch=monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        np.testing.assert_allclose(got, RepeatedKeys()(q, k).numpy(), rtol=1e-5, atol=1e-5)
    # one lowered run of the six view nodes before the product (the 5-d copy among them); the product (no
    # lowering) and the two nodes after it run from Python
    (plan,) = native_session._plans["forward"].values()
    assert [step.steps is not None for step in plan.steps] == [True, False, False, False]
