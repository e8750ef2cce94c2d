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


def test_padded_rows_keeps_graphs_few_and_padding_small() -> None:
    from kiln.runtime.serve.engine import padded_rows

    sizes = {padded_rows(n, 320) for n in range(1, 321)}
    assert sorted(sizes) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 128, 192, 256, 320]
    assert [padded_rows(n, 320) for n in (3, 9, 33, 65, 300)] == [4, 16, 40, 128, 320]
    assert padded_rows(60, 50) == 50 and all(padded_rows(n, 320) >= n for n in range(1, 321))


@pytest.mark.parametrize("prefill_tokens", [3, 16], ids=["prompt-split-over-steps", "prompts-share-a-step"])
def test_prompts_fed_as_decode_rows_give_what_the_prefill_method_gives(llm_path, backend, prefill_tokens) -> None:
    """Prompts ridden in decode steps (a prompt over several steps beside running streams, or several prompts in
    one step) generate exactly what the engine that prefills by the prefill method generates, greedy, alone and
    together; a sampled sequence's rows leave the device with the others."""
    program = kiln.load(llm_path)
    prompts = [[9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24], [30]]
    reference = LLMEngine(program, backend, prefill_in_steps=False).start()
    try:
        want = [run_together(reference, [(p, 8, Sampler())])[0] for p in prompts]
    finally:
        reference.shutdown()
    engine = LLMEngine(program, backend, prefill_tokens=prefill_tokens, prefill_in_steps=True).start()
    try:
        assert engine.prefill_in_steps and engine.max_rows == engine.capacity + engine.info.prefill_chunk
        alone = [run_together(engine, [(p, 8, Sampler())])[0] for p in prompts]
        together = run_together(engine, [(p, 8, Sampler()) for p in prompts])
        with_sampled = run_together(engine, [(p, 8, Sampler(temperature=0.9, seed=1) if k == 1 else Sampler())
                                             for k, p in enumerate(prompts)])
    finally:
        engine.shutdown()
    assert alone == want and together == want
    assert [t for k, t in enumerate(with_sampled) if k != 1] == [t for k, t in enumerate(want) if k != 1]
    assert len(with_sampled[1]) == 8


def test_prompts_in_steps_need_a_program_with_room_for_them(tmp_path) -> None:
    """A slotted program whose decode takes only its slots' rows (exported before decode_rows) prefills by its
    prefill method, and refuses prompts in steps with a message that says why."""
    pytest.importorskip("transformers")
    from kiln.errors import KilnError
    from kiln.runtime.llm.info import DECODE_ROWS_KEY, LLMInfo
    from tests.runtime.tiny_llm import export_tiny_llm

    program = kiln.load(export_tiny_llm(slots=2)[1].save(tmp_path / "tiny.kiln"))
    assert LLMEngine(program).max_rows == 2 + LLMInfo.from_metadata(program.metadata).prefill_chunk
    del program.ir.metadata[DECODE_ROWS_KEY]  # as a program exported before decode_rows reads
    assert LLMInfo.from_metadata(program.metadata).decode_rows == 2
    engine = LLMEngine(program)
    assert not engine.prefill_in_steps and engine.max_rows == 2
    with pytest.raises(KilnError, match="no room for prompt tokens"):
        LLMEngine(program, prefill_in_steps=True)


def test_warm_up_captures_every_padded_step_before_serving(llm_path) -> None:
    """On a backend that captures graphs, warm_up leaves one graph per padded row count a step can have, so no
    stream waits for a capture; a no-op elsewhere."""
    from tests.conftest import BACKENDS

    if "cuda" not in BACKENDS:
        pytest.skip("needs the cuda backend (the only one that captures)")
    from kiln.runtime.serve.engine import padded_rows

    engine = LLMEngine(kiln.load(llm_path), "cuda").warm_up()
    assert engine.prefill_in_steps
    want = {padded_rows(n, engine.max_rows) for n in range(1, engine.max_rows + 1)}
    assert engine.session.captured_graphs == {"decode": len(want)}
    engine.start()
    try:
        assert run_together(engine, [([9, 10, 11], 4, Sampler())])[0]
    finally:
        engine.shutdown()


def run_with_stops(engine: LLMEngine, requests: list[tuple[list[int], int, Sampler, list[int], list[str]]]
                   ) -> list[tuple[list[int], str, str]]:
    """Submit every request at once; each one's (token ids, text, finish reason) when all are done."""
    results: list[list] = [[[], "", None] for _ in requests]
    done = threading.Semaphore(0)

    def emit_for(k: int):
        def emit(event) -> None:
            if event.kind == "token":
                results[k][0].append(event.token_id)
                results[k][1] += event.text
            elif event.kind == "text":
                results[k][1] += event.text
            elif event.kind in ("done", "error"):
                assert event.kind == "done", event.message
                results[k][2] = event.finish_reason
                done.release()
        return emit

    for k, (prompt, max_tokens, sampler, stop_ids, stop_texts) in enumerate(requests):
        detokenizer = engine.tokenizer.detokenizer() if engine.tokenizer is not None else None
        engine.submit(Generation(prompt, max_tokens, sampler, stop_ids, stop_texts, emit_for(k), detokenizer))
    for _ in requests:
        assert done.acquire(timeout=120)
    return [tuple(r) for r in results]


@pytest.mark.parametrize("prefill_tokens", [3, 16], ids=["prompt-split-over-steps", "prompts-share-a-step"])
def test_overlapped_steps_give_what_the_steps_one_after_another_give(llm_path, backend, prefill_tokens) -> None:
    """LLMEngine(overlap=True): each step launched before the host reads the step before's picks, which it takes
    as its tokens where they lie. The same tokens, text and finish reasons as the engine without overlap, for
    requests that end by max_tokens, by a stop token and by a stop string (each seen only when its pick is read,
    after the next step was launched with a row for it), at the context's end, beside a sampled one (whose steps
    run without overlap), alone and together, with more requests than slots (a finished sequence's slot taken by
    the next one while its dropped row is in flight)."""
    program = kiln.load(llm_path)
    info = LLMEngine(program, backend, prefill_in_steps=False).info
    prompts = [[9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24], [30], [40, 41], [5] * 9]
    probe = LLMEngine(program, backend, prefill_tokens=prefill_tokens, prefill_in_steps=True).start()
    try:
        free = run_together(probe, [(p, 12, Sampler()) for p in prompts])
    finally:
        probe.shutdown()
    # a stop token that sequence 1 meets at its 5th token, a stop string of sequence 2's 4th token's text
    stop_ids = {1: [free[1][4]]}
    text = probe.tokenizer.decode(free[2][:4]) if probe.tokenizer is not None else ""
    stop_texts = {2: [text[-3:]]} if len(text) >= 3 else {}
    long_prompt = list(range(3, 3 + info.max_context - 4))  # 4 positions left: ends by the context
    requests = [(p, 12, Sampler(), stop_ids.get(k, []), stop_texts.get(k, [])) for k, p in enumerate(prompts)]
    requests.append((long_prompt, 12, Sampler(), [], []))
    with_sampled = requests[:3] + [(prompts[3], 12, Sampler(temperature=0.9, seed=5), [], [])] + requests[4:]
    results = {}
    for overlap in (False, True):
        engine = LLMEngine(program, backend, prefill_tokens=prefill_tokens, prefill_in_steps=True,
                           overlap=overlap).start()
        try:
            results[overlap] = (
                [run_with_stops(engine, [r])[0] for r in requests],
                run_with_stops(engine, requests),
                run_with_stops(engine, with_sampled),
            )
        finally:
            engine.shutdown()
    alone, together, mixed = results[True]
    assert alone == results[False][0] and together == results[False][0]
    assert [r for k, r in enumerate(mixed) if k != 3] == [r for k, r in enumerate(results[False][0]) if k != 3]
    reasons = [r[2] for r in alone]
    assert reasons[1] == "stop" and len(alone[1][0]) == 4 and reasons[-1] == "length" and len(alone[-1][0]) < 12
    assert reasons[0] == "length" and len(alone[0][0]) == 12


def test_overlap_is_on_by_default_where_steps_are_captured(llm_path, backend) -> None:
    """A GPU's captured steps run asynchronously, so the engine overlaps them unless told not to; a CPU's or MLX's
    steps leave nothing to hide."""
    program = kiln.load(llm_path)
    engine = LLMEngine(program, backend)
    assert engine.overlap == (backend == "cuda")
    assert not LLMEngine(program, backend, overlap=False).overlap


def test_overlap_needs_prompts_in_steps(llm_path) -> None:
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match="overlap needs prompts fed in the decode steps"):
        LLMEngine(kiln.load(llm_path), prefill_in_steps=False, overlap=True)


def test_sampling_on_the_device_is_batch_invariant_and_overlaps(llm_path, backend, monkeypatch) -> None:
    """Backend.samples_on_device (the CPU's NumPy twin of the CUDA kernel here): a seeded temperature-only sequence
    draws the noise of (seed, its token count), so it samples the same tokens alone, beside others, and with the
    engine's overlapped steps, which now take such sequences too; a top-p sequence beside them still samples on
    the host; greedy rows in the same step keep their argmax."""
    program = kiln.load(llm_path)
    engine_backend = type(kiln.load(llm_path).session(backend).backend)
    monkeypatch.setattr(engine_backend, "samples_on_device", True)
    calls = {"device draws": 0, "steps without overlap": 0}
    sample_rows_here, step_with_prompts = engine_backend.sample_rows_here, LLMEngine._step_with_prompts

    def counted_sample(self, *a):
        calls["device draws"] += 1
        return sample_rows_here(self, *a)

    def counted_step(self):
        calls["steps without overlap"] += 1
        return step_with_prompts(self)

    monkeypatch.setattr(engine_backend, "sample_rows_here", counted_sample)
    monkeypatch.setattr(LLMEngine, "_step_with_prompts", counted_step)
    prompts = [[9, 10, 11, 12, 13], [12, 13], [20, 21, 22, 23, 24], [30]]

    def samplers():
        return [Sampler(0.9, seed=1), Sampler(), Sampler(1.3, seed=2), Sampler(0.8, top_p=0.9, seed=3)]

    results = {}
    for overlap in (False, True):
        engine = LLMEngine(program, backend, prefill_tokens=16, prefill_in_steps=True, overlap=overlap).start()
        try:
            calls.update({"device draws": 0, "steps without overlap": 0})
            first = run_together(engine, [(prompts[0], 8, samplers()[0])])[0]
            # (8 tokens: the first from the step that ends the prompt, 7 more; every step overlapped when asked)
            assert calls["device draws"] >= 8 and (calls["steps without overlap"] == 0) == overlap
            alone = [first] + [run_together(engine, [(p, 8, s)])[0] for p, s in zip(prompts[1:], samplers()[1:])]
            together = run_together(engine, [(p, 8, s) for p, s in zip(prompts, samplers())])
        finally:
            engine.shutdown()
        results[overlap] = (alone, together)
    for overlap in (False, True):
        alone, together = results[overlap]
        assert together[:3] == alone[:3] == results[False][0][:3]
        assert len(together[3]) == 8
    assert len(set(results[False][0][0])) > 1  # really sampling, not a constant
