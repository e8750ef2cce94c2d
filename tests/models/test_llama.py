"""A small random Llama (GQA) exported with a static KV cache: prefill + decode against transformers."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kiln.errors import InputError
from kiln.models.llm import StaticCacheLM, export_llama
from kiln.runtime.llm.decoding import greedy_generate, prefill
from tests.conftest import to_numpy
from tests.models.greedy_reference import greedy_reference

MAX_CONTEXT = 64
CHUNK = 8
"""A 10-token prompt takes two prefill chunks (8 + 2), so the dynamic chunk length is exercised."""
NEW_TOKENS = 20
LOGITS_ATOL = 1e-4
"""Logits reach |7|; they are sums over two layers of float32 products that NumPy/BLAS and torch accumulate in
different orders, which leaves ~1e-5 absolute error on logits near zero (measured max 1.03e-5): above 1e-5, far
below 1e-4. rtol stays 1e-5."""


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    # initializer_range 0.2 (not 0.02) makes the logits peaked enough that greedy choices are not near-ties
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=MAX_CONTEXT,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def program(llama):
    return export_llama(llama, MAX_CONTEXT, CHUNK).load()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(1)).tolist()


def test_methods_share_the_kv_cache(program):
    assert sorted(program.methods) == ["decode", "prefill"]
    states = program.ir.states
    assert [s.name for s in states] == ["key_cache_0", "value_cache_0", "key_cache_1", "value_cache_1"]
    assert all(s.shape == (1, 2, MAX_CONTEXT, 16) for s in states)
    for name in program.methods:
        assert len(program.method(name).state_updates) == len(states)
    (seq,) = program.info("prefill").symbols
    assert (seq.min, seq.max) == (1, CHUNK)


def test_greedy_tokens_match_transformers_generate(llama, program, prompt, backend):
    ref = greedy_reference(llama, prompt, NEW_TOKENS, LOGITS_ATOL)
    assert greedy_generate(program.session(backend), prompt, NEW_TOKENS) == ref


def test_logits_match_eager(llama, program, prompt, backend):
    session = program.session(backend, validate=True)
    eager = StaticCacheLM(llama, MAX_CONTEXT)
    with torch.no_grad():
        want = eager.prefill(torch.tensor([prompt]), torch.arange(len(prompt)))[0].numpy()
    got = to_numpy(prefill(session, prompt))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=LOGITS_ATOL)
    tokens = [7, 99, 3, 42, 127, 0]
    for k, token in enumerate(tokens):
        position = len(prompt) + k
        with torch.no_grad():
            want = eager.decode(torch.tensor([[token]]), torch.tensor([position]))[0].numpy()
        got = to_numpy(session.run("decode", np.array([[token]]), np.array([position]))[0])[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=LOGITS_ATOL)
    # and against the model without any cache: the whole sequence at once
    with torch.no_grad():
        want = llama(torch.tensor([prompt + tokens])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=LOGITS_ATOL)


def test_state_persists_across_calls_and_resets(program, prompt, backend):
    session = program.session(backend)
    assert all(not to_numpy(s).any() for s in session.state)
    first = to_numpy(prefill(session, prompt))
    written = to_numpy(session.state[0])
    assert written[:, :, :len(prompt)].any(axis=-1).all()  # every prompt position was written
    assert not written[:, :, len(prompt):].any()  # and nothing past it
    token, position = np.array([[5]]), np.array([len(prompt)])
    after_prompt = to_numpy(session.run("decode", token, position)[0])
    # the same decode step on an empty cache sees no prompt, so it must differ
    cold = to_numpy(program.session(backend).run("decode", token, position)[0])
    assert np.abs(after_prompt - cold).max() > 1e-2
    session.reset_state()
    assert all(not to_numpy(s).any() for s in session.state)
    assert np.array_equal(to_numpy(session.run("decode", token, position)[0]), cold)
    session.reset_state()
    np.testing.assert_array_equal(to_numpy(prefill(session, prompt)), first)
    np.testing.assert_array_equal(to_numpy(session.run("decode", token, position)[0]), after_prompt)


def test_prefill_rejects_chunks_past_the_bound(program):
    session = program.session()
    with pytest.raises(InputError, match="seq"):
        session.run("prefill", np.zeros((1, CHUNK + 1), dtype=np.int64), np.arange(CHUNK + 1))


def test_generate_stops_when_the_cache_is_full(llama, program):
    prompt = [(7 * i) % 128 for i in range(MAX_CONTEXT - 7)]  # 57 = 7 chunks of 8 and one of 1
    tokens = greedy_generate(program.session(), prompt, 20)
    assert len(tokens) == 8  # positions 57..63 are decoded; the token after the last one is still returned
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert tokens == ref[0, len(prompt):].tolist()


def test_generate_does_not_import_torch():
    code = "import sys, kiln.runtime.llm.decoding; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
