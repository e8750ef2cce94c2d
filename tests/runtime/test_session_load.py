"""Sessions under load: thousands of runs on one session leak neither memory nor file descriptors, many threads
each with a session of one program agree bit for bit with serial runs, and threads that share one session take
turns (never a silently wrong result).

test_concurrency.py covers the basics (own sessions match serial runs, shared constants, per-session state); these
tests push harder: long runs, state and shape changes together, different CPU thread counts per session, and one
session shared by several threads.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.errors import KilnError
from kiln.runtime.session import MAX_PLANS_PER_METHOD, _Plan
from tests.conftest import BACKENDS, to_numpy
from tests.format import small_models
from tests.runtime.threads import run_threads

FEATURES = 64
SOAK_RUNS = 10_000
WARMUP_RUNS = 500
RSS_SLACK = 4 << 20
"""RSS a long soak may grow by after its warm-up (allocator noise). A leak of one output per run (2 KiB) over
SOAK_RUNS runs is 20 MiB."""

STRESS_THREADS = 8
STRESS_RUNS = 200


def _mlx_imports() -> bool:
    try:
        import mlx.core  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or installed without a working build
        return False
    return True


LOAD_BACKENDS = [
    "cpu",
    pytest.param("mlx", marks=pytest.mark.skipif(not _mlx_imports(), reason="mlx.core does not import")),
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif("cuda" not in BACKENDS, reason="no CUDA device with CuPy")]),
]

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS and fds from /proc (Linux)")


def rss_bytes() -> int:
    """This process's resident set size now (not its peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled() -> tuple[int, int]:
    """(RSS, open fds) after a full collection, so garbage that cycles hold is not counted."""
    gc.collect()
    return rss_bytes(), open_fds()


class Counter(nn.Module):
    """A state buffer that counts the runs, and an MLP of the input whose temporaries live in a native arena.
    Each run's outputs say which run it was (the count) and whose input it came from (y, which no state touches)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(FEATURES, 4 * FEATURES)
        self.down = nn.Linear(4 * FEATURES, FEATURES)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.count.add_(1.0)
        return torch.tanh(self.down(torch.relu(self.up(x)))), self.count.clone()


class Running(nn.Module):
    """A running sum of the inputs' means in a state buffer, under dynamic batch and sequence sizes: every output
    depends on every run before it, so one run that went wrong, or read another session's state, shows in all the
    outputs after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.register_buffer("total", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x.mean((0, 1)))
        return F.gelu(self.proj(self.norm(x))) * self.total


RUNNING_SHAPES = [(1, 2), (2, 5), (3, 7), (4, 11)]
"""(batch, sequence) of the stress runs: a few plans per session (and on mlx a few compiled functions)."""


@pytest.fixture(scope="module")
def counter_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("load") / "counter.kiln"
    kiln.export(Counter(), (torch.randn(8, FEATURES),)).save(path)
    return path


@pytest.fixture(scope="module")
def counter(counter_path) -> kiln.Program:
    return kiln.load(counter_path)


@pytest.fixture(scope="module")
def running() -> kiln.Program:
    batch = torch.export.Dim("batch", min=1, max=8)
    seq = torch.export.Dim("seq", min=2, max=16)
    return kiln.export(Running(), (torch.randn(2, 5, 16),), dynamic_shapes=({0: batch, 1: seq},)).load()


def counter_inputs(seed: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((8, FEATURES), dtype=np.float32) for _ in range(count)]


@pytest.fixture
def eager_switching() -> Iterator[None]:
    """The interpreter switches threads every microsecond rather than every 5 ms, so runs that are not kept
    apart do interleave within a test's few thousand runs."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


# --- soak: one session, many runs ---------------------------------------------------------------------------------

@needs_proc
def test_soak_one_session_leaks_no_memory_or_fds(counter):
    session = counter.session("cpu")
    inputs = counter_inputs(0, 16)  # a rotating pool: the soak allocates nothing of its own
    for r in range(WARMUP_RUNS):
        session.run("forward", inputs[r % len(inputs)])
    rss, fds = settled()
    for r in range(SOAK_RUNS):
        y, count = session.run("forward", inputs[r % len(inputs)])
    grown, fds_after = settled()
    grown -= rss
    print(f"\nsoak: {SOAK_RUNS} runs, RSS {rss / 2**20:.1f} MiB, grew by {grown / 2**10:.0f} KiB, fds {fds}")
    assert fds_after == fds, f"open file descriptors went from {fds} to {fds_after} over {SOAK_RUNS} runs"
    assert grown < RSS_SLACK, f"RSS grew by {grown / 2**20:.1f} MiB over {SOAK_RUNS} runs of one session"
    # and the runs really ran, right to the last one
    assert count.tolist() == [WARMUP_RUNS + SOAK_RUNS]
    np.testing.assert_array_equal(to_numpy(session.state[0]), [WARMUP_RUNS + SOAK_RUNS])
    fresh_y, _ = counter.session("cpu").run("forward", inputs[(SOAK_RUNS - 1) % len(inputs)])
    np.testing.assert_array_equal(y, fresh_y)


@needs_proc
def test_plans_for_many_input_shapes_stay_bounded():
    """A server meets a new prompt length every few requests: a session keeps at most MAX_PLANS_PER_METHOD plans
    per method, and the plans it drops (with their arenas) are freed."""
    program = small_models.export_dynamic().load()
    session = program.session("cpu")
    shapes = [(b, s) for b in range(1, 6) for s in range(3, 21)]  # 90 signatures, more than the cache holds
    assert len(shapes) > MAX_PLANS_PER_METHOD
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((b, s, 8), dtype=np.float32) for b, s in shapes]
    alive_before = sum(type(o) is _Plan for o in gc.get_objects())
    for x in inputs:  # the first round fills the cache
        session.run("forward", x)
    rss, fds = settled()
    for _ in range(4):
        for x in inputs:
            session.run("forward", x)
    grown, fds_after = settled()
    grown -= rss
    alive = sum(type(o) is _Plan for o in gc.get_objects()) - alive_before
    print(f"\nplans: {4 * len(shapes)} runs over {len(shapes)} signatures, {alive} plans alive, "
          f"RSS grew by {grown / 2**10:.0f} KiB")
    assert alive <= MAX_PLANS_PER_METHOD, f"{alive} plans alive for one method of one session"
    assert fds_after == fds
    assert grown < RSS_SLACK, f"RSS grew by {grown / 2**20:.1f} MiB while plans were replaced"
    x = inputs[0]  # the first signature was dropped long ago; rebuilt, it gives the same bits
    np.testing.assert_array_equal(session.run("forward", x)[0], program.session("cpu").run("forward", x)[0])


@needs_proc
def test_loading_and_dropping_programs_gives_back_fds_and_memory(counter_path):
    """A server that reloads a model: each load maps the file (one fd while the program lives); once the program
    and its sessions are gone, the fd and the memory come back."""
    x = counter_inputs(2, 1)[0]

    def cycle() -> np.ndarray:
        program = kiln.load(counter_path)
        return program.session("cpu").run("forward", x)[0]

    want = cycle()
    rss, fds = settled()
    for _ in range(300):
        np.testing.assert_array_equal(cycle(), want)
    grown, fds_after = settled()
    grown -= rss
    print(f"\nreloads: 300 load+run cycles, RSS grew by {grown / 2**10:.0f} KiB, fds {fds} -> {fds_after}")
    assert fds_after == fds, f"open file descriptors went from {fds} to {fds_after} over 300 loads"
    assert grown < RSS_SLACK, f"RSS grew by {grown / 2**20:.1f} MiB over 300 loads"


# --- stress: one program, a session per thread --------------------------------------------------------------------

def running_inputs(k: int) -> list[np.ndarray]:
    """Thread k's inputs: its own values, in shapes that change every run."""
    rng = np.random.default_rng(300 + k)
    return [rng.standard_normal((*RUNNING_SHAPES[(k + r) % len(RUNNING_SHAPES)], 16), dtype=np.float32)
            for r in range(STRESS_RUNS)]


def session_threads(backend: str, k: int) -> int | None:
    """A different CPU thread count for some sessions (results are the same bits for any count)."""
    return [None, 1, 2][k % 3] if backend == "cpu" else None


@pytest.mark.parametrize("backend", LOAD_BACKENDS)
def test_stress_sessions_of_one_program_match_serial_runs(running, backend):
    serial = []
    for k in range(STRESS_THREADS):  # each thread's sequence alone, in a session of its own
        session = running.session(backend)
        outs = [to_numpy(session.run("forward", x)[0]) for x in running_inputs(k)]
        serial.append((outs, to_numpy(session.state[0])))

    def work(k: int) -> tuple[list[np.ndarray], np.ndarray]:
        session = running.session(backend, threads=session_threads(backend, k))
        outs = [to_numpy(session.run("forward", x)[0]) for x in running_inputs(k)]
        return outs, to_numpy(session.state[0])

    results = run_threads(STRESS_THREADS, work)
    for k, ((outs, state), (want, want_state)) in enumerate(zip(results, serial, strict=True)):
        for r in range(STRESS_RUNS):
            np.testing.assert_array_equal(outs[r], want[r], err_msg=f"thread {k} run {r}")
        np.testing.assert_array_equal(state, want_state, err_msg=f"thread {k}'s final state")
    # the serial runs are right (against the eager model), and the threads' sequences really differ
    model = Running()
    with torch.no_grad():
        for r, x in enumerate(running_inputs(0)[:5]):
            np.testing.assert_allclose(serial[0][0][r], model(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-5)
    assert len({state.tobytes() for _, state in serial}) == STRESS_THREADS


# --- one session shared by several threads ------------------------------------------------------------------------

SHARED_THREADS = 4
SHARED_RUNS = 200


@pytest.mark.parametrize("backend", LOAD_BACKENDS)
def test_threads_sharing_a_session_take_turns(counter, backend, eager_switching):
    """Every run sees the state the run before it left (the counts are 1..N, each once, rising within a thread)
    and computes on its own input (y equals a lone run's bits): never two runs interleaved."""
    session = counter.session(backend)
    inputs = [counter_inputs(400 + k, SHARED_RUNS) for k in range(SHARED_THREADS)]

    def work(k: int) -> list[tuple[np.ndarray, int]]:
        results = []
        for x in inputs[k]:
            y, count = session.run("forward", x)
            results.append((to_numpy(y), int(to_numpy(count)[0])))
        return results

    results = run_threads(SHARED_THREADS, work)
    total = SHARED_THREADS * SHARED_RUNS
    counts = [c for thread in results for _, c in thread]
    assert sorted(counts) == list(range(1, total + 1)), "two runs saw the same state: an update was lost"
    for k, thread in enumerate(results):
        mine = [c for _, c in thread]
        assert mine == sorted(mine), f"thread {k}'s runs saw the state go back"
    assert to_numpy(session.state[0]).tolist() == [total]
    alone = counter.session(backend)
    for k, thread in enumerate(results):
        for r, (y, _) in enumerate(thread):
            np.testing.assert_array_equal(y, to_numpy(alone.run("forward", inputs[k][r])[0]),
                                          err_msg=f"thread {k} run {r}: another run's work leaked into it")


def python_kernel_node(program: kiln.Program) -> int:
    """A node of Counter's forward whose kernel a validating CPU session calls from Python as it is (no prepared
    form), so a test can wrap it."""
    nodes = program.ir.methods["forward"].nodes
    return next(k for k, node in enumerate(nodes) if node.op in ("tanh", "relu"))


def test_reset_waits_for_the_run_in_progress(counter):
    """reset_state from another thread while a run is inside the session: it waits for that run to return, and the
    state it leaves is the initial one (the run's update does not land on top of it)."""
    session = counter.session("cpu", validate=True)  # validate: kernels run from Python, so one can hold the run
    x = counter_inputs(5, 1)[0]
    op = counter.ir.methods["forward"].nodes[python_kernel_node(counter)].op
    inside, release = threading.Event(), threading.Event()
    kernel = session.backend.kernels[op]

    def held(*args: Any, **attrs: Any) -> Any:
        inside.set()
        release.wait(timeout=30)
        return kernel(*args, **attrs)

    session.backend.kernels = {**session.backend.kernels, op: held}  # (this session's plans are not built yet)
    outputs: list[Any] = []
    runner = threading.Thread(target=lambda: outputs.extend(session.run("forward", x)), daemon=True)
    runner.start()
    assert inside.wait(timeout=30), "the held kernel never ran"
    resetter = threading.Thread(target=session.reset_state, daemon=True)
    resetter.start()
    resetter.join(timeout=0.2)
    assert resetter.is_alive(), "reset_state did not wait for the run in progress"
    release.set()
    runner.join(timeout=30)
    resetter.join(timeout=30)
    assert not runner.is_alive() and not resetter.is_alive()
    assert outputs[1].tolist() == [1.0]
    np.testing.assert_array_equal(session.state[0], [0.0])  # the run finished first, then the reset


def test_a_run_that_reenters_its_own_session_raises(counter):
    """A kernel (or callback) that calls back into the session running it would wait on itself forever; it raises
    KilnError instead, and the session works afterwards."""
    session = counter.session("cpu", validate=True)
    x = counter_inputs(6, 1)[0]
    want = counter.session("cpu").run("forward", x)
    op = counter.ir.methods["forward"].nodes[python_kernel_node(counter)].op
    kernel = session.backend.kernels[op]
    reentered: list[bool] = []

    def reentrant(*args: Any, **attrs: Any) -> Any:
        if not reentered:  # once: the session's next run goes through
            reentered.append(True)
            session.run("forward", x)
        return kernel(*args, **attrs)

    session.backend.kernels = {**session.backend.kernels, op: reentrant}
    errors: list[BaseException] = []

    def target() -> None:
        try:
            session.run("forward", x)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "a run that re-entered its own session hung"
    assert reentered and len(errors) == 1 and isinstance(errors[0], KilnError), errors
    assert "already running" in str(errors[0])
    got = session.run("forward", x)  # the failed run left the state as it was, and the session usable
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
