"""LLMEngine without HTTP: greedy rows reduced where the logits live, and a batch that mixes greedy and sampled
sequences (whose logits then come to the host) giving each greedy sequence what it gets alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kiln
from kiln.runtime.llm.sampling import Sampler
from kiln.runtime.serve.engine import Generation, LLMEngine


def test_argmax_rows_is_numpy_argmax_where_the_rows_live(backend, llm_path) -> None:
    """Ties go to the first index, as np.argmax and the greedy Sampler pick them; half precision too."""
    session = kiln.load(llm_path).session(backend)
    rows = np.array([[0.5, 2.0, 2.0, -1.0], [3.0, 3.0, 0.0, 3.0], [-4.0, -2.0, -3.0, -2.0]])
    for dtype in (np.float32, np.float16):
        picks = session.backend.argmax_rows(session.backend.asarray(rows.astype(dtype)))
        assert picks.tolist() == [1, 0, 1]


def run_together(engine: LLMEngine, requests: list[tuple[list[int], int, Sampler]]) -> list[list[int]]:
    """Submit every request at once; each one's token ids when all are done."""
    tokens: list[list[int]] = [[] for _ in requests]
    done = threading.Semaphore(0)

    def emit_for(k: int):
        def emit(event) -> None:
            if event.kind == "token":
                tokens[k].append(event.token_id)
            elif event.kind in ("done", "error"):
                assert event.kind == "done", event.message
                done.release()
        return emit

    for k, (prompt, max_tokens, sampler) in enumerate(requests):
        engine.submit(Generation(prompt, max_tokens, sampler, [], [], emit_for(k)))
    for _ in requests:
        assert done.acquire(timeout=120)
    return tokens


@pytest.mark.parametrize("mixed", [False, True], ids=["greedy", "mixed"])
def test_greedy_sequences_in_a_batch_get_what_they_get_alone(llm_path, mixed) -> None:
    engine = LLMEngine(kiln.load(llm_path)).start()
    try:
        prompts = [[9, 10, 11], [12, 13], [20, 21, 22, 23], [30]]
        alone = [run_together(engine, [(p, 10, Sampler())])[0] for p in prompts]
        samplers = [Sampler(), Sampler(temperature=1.2, seed=3), Sampler(), Sampler(temperature=0.8, seed=4)] \
            if mixed else [Sampler() for _ in prompts]
        together = run_together(engine, [(p, 10, s) for p, s in zip(prompts, samplers)])
    finally:
        engine.shutdown()
    for k, sampler in enumerate(samplers):
        assert len(together[k]) == 10
        if sampler.greedy:
            assert together[k] == alone[k]
