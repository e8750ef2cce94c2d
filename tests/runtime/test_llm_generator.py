"""kiln.llm.Generator and ChatSession on a tiny exported Llama with its tokenizer in the program: greedy tokens as
transformers generates them, seeded sampling, stop tokens, the context limit, KV-cache reuse across calls (also
with a sliding-window ring cache), and chat turns."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from kiln.errors import InputError  # noqa: E402
from kiln.llm import ChatSession, ContextFullError, Generator, Sampler  # noqa: E402
from kiln.runtime.llm.decoding import greedy_generate  # noqa: E402
from tests.models.greedy_reference import greedy_reference  # noqa: E402
from tests.runtime.tiny_llm import MAX_CONTEXT, STOP_TOKENS, export_tiny_llm, words  # noqa: E402

PROMPT = [11, 13, 6, 40, 41, 42, 43, 44, 45, 46, 47]
"""11 tokens: a full prefill chunk of 8 and a partial one."""
NO_STOP: list[int] = []


@pytest.fixture(scope="module")
def llama():
    model, builder = export_tiny_llm()
    return model, builder.load()


@pytest.fixture()
def gen(llama) -> Generator:
    return Generator(llama[1])


def counting(gen: Generator) -> list[int]:
    """Records how many tokens each `prefill` call of the generator's session runs."""
    calls: list[int] = []
    run = gen.session.run

    def spy(method, *inputs):
        if method == "prefill":
            calls.append(inputs[0].shape[1])
        return run(method, *inputs)

    gen.session.run = spy
    return calls


def test_greedy_stream_matches_greedy_generate_and_transformers(llama, gen):
    model, program = llama
    want = greedy_reference(model, PROMPT, 24, 1e-4)
    assert greedy_generate(program.session(), PROMPT, 24) == want
    stream = gen.stream(PROMPT, max_new_tokens=24, stop_token_ids=NO_STOP)
    events = list(stream)
    assert [e.token_id for e in events] == want == stream.token_ids
    assert "".join(e.text for e in events) == stream.text == gen.tokenizer.decode(want)
    stats = stream.stats
    assert (stats.prompt_tokens, stats.cached_tokens, stats.new_tokens, stats.decode_steps) == (11, 0, 24, 23)
    assert stats.stop_reason == "max_new_tokens" and stats.stop_token_id is None
    assert stats.prefill_seconds > 0 and stats.decode_tokens_per_second > 0
    assert "prompt 11 tokens" in stats.summary() and "24 new tokens" in stats.summary()


def test_text_prompt_is_the_tokenized_prompt(gen):
    text = gen.tokenizer.decode(PROMPT)
    assert gen.encode_prompt(text) == PROMPT  # this tokenizer adds no BOS
    result = gen.generate(text, max_new_tokens=10, stop_token_ids=NO_STOP)
    assert result.token_ids == Generator(gen.program).generate(PROMPT, 10, stop_token_ids=NO_STOP).token_ids
    assert result.text == gen.tokenizer.decode(result.token_ids)


def test_seeded_sampling_is_reproducible(llama):
    def sample(seed):
        return Generator(llama[1]).generate(PROMPT, 24, temperature=1.5, seed=seed, stop_token_ids=NO_STOP).token_ids

    assert sample(1) == sample(1)
    given = Generator(llama[1]).generate(PROMPT, 24, Sampler(temperature=1.5, seed=1), stop_token_ids=NO_STOP)
    assert given.token_ids == sample(1)
    assert sample(1) != sample(2)
    greedy = Generator(llama[1]).generate(PROMPT, 24, stop_token_ids=NO_STOP).token_ids
    assert sample(1) != greedy


@pytest.mark.parametrize("options", [{"top_k": 1}, {"top_p": 1e-6}])
def test_top_k_one_and_tiny_top_p_are_greedy(llama, options):
    greedy = Generator(llama[1]).generate(PROMPT, 16, stop_token_ids=NO_STOP).token_ids
    sampled = Generator(llama[1]).generate(PROMPT, 16, temperature=2.0, seed=0, stop_token_ids=NO_STOP, **options)
    assert sampled.token_ids == greedy


def test_stop_tokens_end_the_generation_unprinted(llama, gen):
    greedy = Generator(llama[1]).generate(PROMPT, 24, stop_token_ids=NO_STOP).token_ids
    stop = greedy[5]
    cut = greedy.index(stop)
    result = gen.generate(PROMPT, 24, stop_token_ids=[stop])
    assert result.token_ids == greedy[:cut]
    assert result.stats.stop_reason == "stop_token" and result.stats.stop_token_id == stop
    assert result.text == gen.tokenizer.decode(greedy[:cut])  # the stop token's own text is not in it
    assert result.stats.new_tokens == cut and result.stats.decode_steps == cut


def test_default_stop_tokens_are_the_programs(gen):
    assert gen.info.stop_token_ids == tuple(STOP_TOKENS)
    greedy = gen.generate(PROMPT, 24, stop_token_ids=NO_STOP).token_ids
    gen.info = dataclasses.replace(gen.info, stop_token_ids=(greedy[3],))  # as if the program listed it
    result = gen.generate(PROMPT, 24)
    assert result.stats.stop_reason == "stop_token" and result.token_ids == greedy[:greedy.index(greedy[3])]


def test_generation_stops_when_the_context_is_full(llama, gen):
    prompt = [8 + i % 100 for i in range(60)]
    result = gen.generate(prompt, max_new_tokens=100, stop_token_ids=NO_STOP)
    assert result.stats.stop_reason == "context_full"
    assert len(result.token_ids) == MAX_CONTEXT - 60 + 1  # the last token is sampled but never fed back
    assert result.token_ids == greedy_generate(llama[1].session(), prompt, 100)
    unlimited = Generator(llama[1]).generate(PROMPT, max_new_tokens=None, stop_token_ids=NO_STOP)
    assert unlimited.stats.stop_reason == "context_full" and len(unlimited.token_ids) == MAX_CONTEXT - 11 + 1


def test_a_prompt_longer_than_the_context_is_refused(gen):
    with pytest.raises(ContextFullError, match="the prompt has 65 tokens but the program's context holds 64"):
        gen.stream([9] * 65)
    assert issubclass(ContextFullError, InputError)
    result = gen.generate([9] * 64, stop_token_ids=NO_STOP)  # exactly full: one token, from the prefill
    assert len(result.token_ids) == 1 and result.stats.stop_reason == "context_full"


def test_bad_prompts_are_explained(gen):
    with pytest.raises(InputError, match="the prompt is empty"):
        gen.generate([])
    with pytest.raises(InputError, match=r"token ids must be in \[0, 128\)"):
        gen.generate([5, 128])
    with pytest.raises(InputError, match="token ids .ints. or chat messages"):
        gen.generate([5, "w1"])
    with pytest.raises(ValueError, match="max_new_tokens must be None or >= 0"):
        gen.generate(PROMPT, -1)
    with pytest.raises(ValueError, match="chat=True and system= need text"):
        gen.generate(PROMPT, chat=True)
    with pytest.raises(ValueError, match="either a sampler or temperature"):
        gen.generate(PROMPT, sampler=Sampler(), temperature=1.0)
    with pytest.raises(TypeError, match="unknown option.*'temprature'"):
        ChatSession(gen, temprature=1.0)


def test_an_extended_prompt_prefills_only_its_new_tokens(llama, gen):
    calls = counting(gen)
    first = gen.generate(PROMPT, 6, stop_token_ids=NO_STOP)
    assert calls == [8, 3]
    follow_up = PROMPT + first.token_ids + [50, 51, 52]
    calls.clear()
    second = gen.generate(follow_up, 12, stop_token_ids=NO_STOP)
    # the cache holds the prompt and 5 generated tokens (the 6th was never fed): 4 new tokens to prefill
    assert second.stats.cached_tokens == len(PROMPT) + 5 and calls == [4]
    assert second.token_ids == Generator(llama[1]).generate(follow_up, 12, stop_token_ids=NO_STOP).token_ids


def test_a_diverging_prompt_rewinds_the_cache(llama, gen):
    calls = counting(gen)
    gen.generate(PROMPT, 4, stop_token_ids=NO_STOP)
    other = PROMPT[:5] + [90, 91, 92]
    calls.clear()
    result = gen.generate(other, 10, stop_token_ids=NO_STOP)
    assert result.stats.cached_tokens == 5 and calls == [3]
    assert result.token_ids == Generator(llama[1]).generate(other, 10, stop_token_ids=NO_STOP).token_ids
    calls.clear()
    again = gen.generate(other, 10, stop_token_ids=NO_STOP)  # the same prompt: only its last token runs again
    assert calls == [1] and again.token_ids == result.token_ids


def test_a_ring_cache_rewinds_at_most_one_chunk(llama):
    """With ring_cache set, rewinding more than prefill_chunk positions resets the cache instead."""
    gen = Generator(llama[1])
    gen.info = dataclasses.replace(gen.info, ring_cache=True)
    first = gen.generate(PROMPT, 10, stop_token_ids=NO_STOP).token_ids  # caches 11 + 9 = 20 positions
    near = PROMPT + first[:1] + [60] * 3  # keeps 12: rewinds 8
    assert gen.generate(near, 2, stop_token_ids=NO_STOP).stats.cached_tokens == 12
    gen.generate(PROMPT, 10, stop_token_ids=NO_STOP)
    far = PROMPT + [60] * 3  # keeps 11: would rewind 9
    assert gen.generate(far, 2, stop_token_ids=NO_STOP).stats.cached_tokens == 0
    gen.info = dataclasses.replace(gen.info, ring_cache=False)  # a full cache rewinds as far as it must
    gen.generate(PROMPT, 10, stop_token_ids=NO_STOP)
    assert gen.generate(far, 2, stop_token_ids=NO_STOP).stats.cached_tokens == 11


def test_sliding_window_model_reuses_its_ring_cache_correctly():
    """Mistral with a 4-token window keeps 4 + 8 - 1 = 11 ring slots: reusing and rewinding it still gives what a
    fresh generator gives (the tokens cross the ring several times)."""
    _, builder = export_tiny_llm("mistral", with_tokenizer=False)
    program = builder.load()
    gen = Generator(program)
    assert gen.info.ring_cache and gen.tokenizer is None
    first = gen.generate(PROMPT, 20, stop_token_ids=NO_STOP)
    assert first.text is None
    assert len(gen.cached) == 30
    for keep in (30, 23, 22):  # extend, rewind 7, rewind 8 (the most a ring of this chunk size allows)
        prompt = PROMPT + first.token_ids[:keep - len(PROMPT)] + [70, 71]
        gen.generate(PROMPT, 20, stop_token_ids=NO_STOP)  # the cache holds the same 30 tokens again
        got = gen.generate(prompt, 12, stop_token_ids=NO_STOP)
        assert got.stats.cached_tokens == keep
        assert got.token_ids == Generator(program).generate(prompt, 12, stop_token_ids=NO_STOP).token_ids
    with pytest.raises(InputError, match="carries none.*kiln export-llm"):
        gen.generate("w1 w2")


def test_a_new_call_ends_the_running_stream(gen):
    old = gen.stream(PROMPT, 10)
    next(old)
    gen.generate([20, 21], 3)
    with pytest.raises(RuntimeError, match="ended by a later call"):
        next(old)
    stale = gen.stream(PROMPT, 10)
    gen.reset()
    with pytest.raises(RuntimeError, match="ended by a later call"):
        next(stale)


def test_chat_turns_reuse_the_cache(llama, gen):
    chat = ChatSession(gen, system=words(1, 2), max_new_tokens=6, stop_token_ids=NO_STOP)
    first = chat.send(words(3, 4, 5))
    assert chat.messages == [{"role": "system", "content": "w1 w2"}]  # the exchange joins when the reply ends
    reply = first.result()
    assert chat.messages[-2:] == [{"role": "user", "content": "w3 w4 w5"},
                                  {"role": "assistant", "content": reply.text}]
    rendered = gen.tokenizer.apply_chat_template(chat.messages[:2])
    assert reply.token_ids == Generator(llama[1]).generate(rendered, 6, stop_token_ids=NO_STOP).token_ids
    second = chat.send(words(6)).result()
    # the history (system, user, the reply's fed tokens) is cached; only the reply's end and the new message run
    assert second.stats.cached_tokens == reply.stats.prompt_tokens + 5
    fresh = Generator(llama[1]).generate(gen.tokenizer.apply_chat_template(chat.messages[:4]), 6,
                                         stop_token_ids=NO_STOP)
    assert second.token_ids == fresh.token_ids
    assert chat.ask(words(7)) == chat.messages[-1]["content"]


def test_chat_says_when_the_context_is_full(gen):
    chat = ChatSession(gen, max_new_tokens=8, reply_room=8, stop_token_ids=NO_STOP)
    message = words(*range(10, 30))  # 20 words: 26 tokens with the template
    chat.ask(message)
    with pytest.raises(ContextFullError, match="the context is full.*clear"):
        chat.send(message)  # 26 + 8 reply + 5 + 26 > 64
    chat.clear()
    assert chat.messages == []
    assert chat.ask(message)


def test_sampled_chat_is_reproducible_with_a_seed(llama):
    def conversation():
        chat = ChatSession(Generator(llama[1]), temperature=1.0, seed=3, max_new_tokens=5, stop_token_ids=NO_STOP)
        return [chat.ask(words(1, 2)), chat.ask(words(3))]

    assert conversation() == conversation()
