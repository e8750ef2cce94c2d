"""One loaded program, many threads, one session each: results equal serial runs and state stays per session."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from tests.conftest import to_numpy
from tests.format import small_models
from tests.runtime.threads import run_threads

THREADS = 8
RUNS = 50


@pytest.fixture(scope="module")
def dynamic_program() -> kiln.Program:
    return small_models.export_dynamic().load()


@pytest.fixture(scope="module")
def stateful_program() -> kiln.Program:
    return small_models.export_accumulator().load()


def thread_inputs(k: int) -> list[np.ndarray]:
    """Different inputs for every run of every thread, in shapes that vary (each session builds several plans)."""
    rng = np.random.default_rng(100 + k)
    return [rng.standard_normal((1 + (k + r) % 4, 3 + r % 7, 8), dtype=np.float32) for r in range(RUNS)]


def test_threads_with_own_sessions_match_serial_runs(dynamic_program, backend):
    serial = dynamic_program.session(backend)
    expected = [[to_numpy(serial.run("forward", x)[0]) for x in thread_inputs(k)] for k in range(THREADS)]

    def work(k: int) -> list[np.ndarray]:
        session = dynamic_program.session(backend)
        return [to_numpy(session.run("forward", x)[0]) for x in thread_inputs(k)]

    results = run_threads(THREADS, work)
    for k in range(THREADS):
        for r in range(RUNS):
            np.testing.assert_array_equal(results[k][r], expected[k][r], err_msg=f"thread {k} run {r}")
    with torch.no_grad():  # and the serial runs are right
        x = thread_inputs(0)[0]
        want = small_models.DynamicBlock()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(expected[0][0], want, rtol=1e-5, atol=1e-5)


def test_threads_share_the_constants(dynamic_program, backend):
    def work(k: int) -> list[int]:
        session = dynamic_program.session(backend)
        return [id(session.backend.constant(i)) for i in range(len(dynamic_program.ir.constants))]

    ids = run_threads(THREADS, work)
    assert all(i == ids[0] for i in ids)  # one wrapped view per constant, whichever thread asked first


def stateful_inputs(k: int) -> list[np.ndarray]:
    rng = np.random.default_rng(200 + k)
    return [rng.standard_normal((3, 8), dtype=np.float32) * (k + 1) for _ in range(RUNS)]


def test_each_thread_has_its_own_state(stateful_program, backend):
    def work(k: int) -> tuple[list[np.ndarray], np.ndarray]:
        session = stateful_program.session(backend)
        outs = [to_numpy(session.run("forward", x)[0]) for x in stateful_inputs(k)]
        return outs, to_numpy(session.state[0])

    results = run_threads(THREADS, work)
    for k, (outs, state) in enumerate(results):
        replay = stateful_program.session(backend)  # the same sequence, alone
        want = [to_numpy(replay.run("forward", x)[0]) for x in stateful_inputs(k)]
        for r in range(RUNS):
            np.testing.assert_array_equal(outs[r], want[r], err_msg=f"thread {k} run {r}")
        np.testing.assert_array_equal(state, to_numpy(replay.state[0]))
        np.testing.assert_allclose(state, np.arange(8) + np.sum(stateful_inputs(k), axis=(0, 1)), rtol=1e-4)
    assert len({results[k][1].tobytes() for k in range(THREADS)}) == THREADS  # the states really differ
    fresh = stateful_program.session(backend)
    np.testing.assert_array_equal(to_numpy(fresh.state[0]), np.arange(8, dtype=np.float32))  # program untouched


class Store(torch.nn.Module):
    """The new state is the input itself, and is also returned: the session must not alias either."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last.copy_(x)
        return self.last


def test_state_does_not_alias_the_callers_arrays():
    session = kiln.export(Store(), (torch.randn(4),)).load().session()
    x = np.arange(4, dtype=np.float32)
    out = session.run("forward", x)[0]
    x[:] = -1  # the caller refills its input buffer for the next call
    out[:] = 7  # and edits what it got back
    np.testing.assert_array_equal(session.state[0], np.arange(4, dtype=np.float32))
