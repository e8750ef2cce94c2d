"""The engine in a process of its own (serve/engine_process.py): the same tokens as the engine on a thread,
cancellation, queue bounds, a clean shutdown, and a child that dies failing what is in flight instead of hanging."""

from __future__ import annotations

import threading

import pytest

from kiln.runtime.llm.sampling import Sampler
from kiln.runtime.program import load
from kiln.runtime.serve.engine import EngineStoppedError, Event, Generation, LLMEngine, QueueFullError
from kiln.runtime.serve.engine_process import EngineProcess


class Collect:
    """A generation's events, and a flag set when it has ended."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ended = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.kind in ("done", "error"):
            self.ended.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.kind == "token"]


def generation(prompt: list[int], max_tokens: int, **options) -> tuple[Generation, Collect]:
    collect = Collect()
    return Generation(prompt, max_tokens, Sampler(**options), [], [], collect), collect


@pytest.fixture
def engine(llm_path):
    process = EngineProcess(llm_path, max_queue=2).start()
    yield process
    process.shutdown(timeout=10)


def test_same_tokens_as_the_engine_on_a_thread(engine, llm_path):
    thread_engine = LLMEngine(load(llm_path)).start()
    try:
        prompts = [[5 + k, 9, 30 + 2 * k] for k in range(6)]  # 6 requests, 4 slots, 2 queued
        results = []
        for which in (engine, thread_engine):
            runs = [generation(p, 6 + k) for k, p in enumerate(prompts)]
            for g, _ in runs:
                which.submit(g)
            assert all(c.ended.wait(60) for _, c in runs)
            results.append([(c.tokens, g.finish_reason) for g, c in runs])
        assert results[0] == results[1]
        assert all(reason == "length" for _, reason in results[0])
        g, _ = runs[0]
        assert g.completion_tokens == 6  # counted where the events arrive too
    finally:
        thread_engine.shutdown()


def test_cancel_and_queue_bound(engine):
    long_prompt = list(range(10, 66))  # 7 prefill chunks of 8: the cancel arrives long before the first token
    g, c = generation(long_prompt, 4)
    engine.submit(g)
    engine.cancel(g)
    assert c.ended.wait(60)
    assert g.finish_reason == "cancelled" and c.tokens == []
    held = [generation(long_prompt, 4) for _ in range(6)]  # 4 slots + max_queue 2
    for h, _ in held:
        engine.submit(h)
    with pytest.raises(QueueFullError):
        engine.submit(generation([5], 2)[0])
    assert all(hc.ended.wait(60) for _, hc in held)


def test_shutdown_ends_what_is_in_flight(llm_path):
    engine = EngineProcess(llm_path).start()
    runs = [generation(list(range(10, 66)), 8) for _ in range(3)]
    for g, _ in runs:
        engine.submit(g)
    engine.shutdown("stopping for the test", timeout=30)
    assert all(c.ended.is_set() for _, c in runs)
    assert all(g.finish_reason in ("error", "length") for g, _ in runs)
    assert any(e.message == "stopping for the test" for _, c in runs for e in c.events)
    with pytest.raises(EngineStoppedError):
        engine.submit(generation([5], 2)[0])
    assert not engine._process.is_alive()


def test_a_dead_engine_process_fails_requests_instead_of_hanging(llm_path):
    engine = EngineProcess(llm_path).start()
    try:
        g, c = generation(list(range(10, 66)), 40)
        engine.submit(g)
        engine._process.kill()
        assert c.ended.wait(30)
        assert g.finish_reason == "error" and "ended unexpectedly" in c.events[-1].message
        with pytest.raises(EngineStoppedError):
            engine.submit(generation([5], 2)[0])
    finally:
        engine.shutdown(timeout=5)


def test_a_program_that_cannot_start_is_a_clear_error(tmp_path, llm_path):
    engine = EngineProcess(llm_path, backend="no-such-backend")
    with pytest.raises(Exception, match="could not start"):
        engine.warm_up()
