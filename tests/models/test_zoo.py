"""The transformers model zoo at small random-weight sizes: every family exports and matches eager PyTorch.

Decoders (Llama, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Mistral, Phi-3, GPT-2) go through `export_llama` (prefill +
decode with a static KV cache) and are checked two ways: logits of a chunked prefill and several decode steps
against the eager wrapper and against the model without any cache, and greedy tokens against transformers'
`generate(do_sample=False)`. ViT and Whisper (encoder, and decoder without a cache) are plain forward exports.
BERT is covered by test_minilm.py. Builders live in kiln.models.zoo. Each runs on every backend present (cuda on a
GPU machine: `-m cuda`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kiln.export import export  # noqa: E402 - after the importorskip
from kiln.models.llm import StaticCacheLM, export_llama  # noqa: E402
from kiln.models.zoo import (  # noqa: E402
    DECODERS,
    SLIDING_WINDOW,
    VOCAB,
    ViTOutputs,
    WhisperDecoder,
    WhisperEncoder,
    tiny_decoder,
    tiny_vit,
    tiny_whisper,
)
from kiln.runtime.llm.decoding import greedy_generate, prefill  # noqa: E402
from tests.conftest import to_numpy  # noqa: E402
from tests.models.greedy_reference import greedy_reference  # noqa: E402

MAX_CONTEXT = 64
CHUNK = 8
PROMPT = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(1)).tolist()
"""10 tokens: two prefill chunks (8 + 2), and longer than the sliding window, so both matter."""
NEW_TOKENS = 32
LOGITS_ATOL = 1e-4
"""As in test_llama.py: logits reach ~|10| and are sums over two layers of float32 products that BLAS and torch
accumulate in different orders, which leaves up to ~1e-5 absolute error on logits near zero (measured max 4.1e-6
over these families); atol 1e-4 is still far below any real error, and rtol stays 1e-5."""
TOL = 1e-5
"""Encoders (ViT, Whisper): float32, measured max differences ~1e-6 (ViT's last hidden state 5e-6, values ~|3|)."""


@pytest.fixture(scope="module", params=sorted(DECODERS))
def decoder(request):
    """(model, program) per family, exported once for the tests below."""
    model = tiny_decoder(request.param)
    return model, export_llama(model, MAX_CONTEXT, CHUNK).load()


def test_decoder_logits_match_eager(decoder, backend):
    model, program = decoder
    session = program.session(backend, validate=True)
    eager = StaticCacheLM(model, MAX_CONTEXT)
    with torch.no_grad():
        want = eager.prefill(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))[0].numpy()
    np.testing.assert_allclose(prefill(session, PROMPT), want, rtol=1e-5, atol=LOGITS_ATOL)
    tokens = [7, 99, 3, 42]
    for k, token in enumerate(tokens):
        position = np.array([len(PROMPT) + k])
        with torch.no_grad():
            want = eager.decode(torch.tensor([[token]]), torch.from_numpy(position))[0].numpy()
        got = to_numpy(session.run("decode", np.array([[token]]), position)[0])[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=LOGITS_ATOL)
    # the eager wrapper is our own code too: the model without any cache is the reference it must agree with
    with torch.no_grad():
        want = model(torch.tensor([PROMPT + tokens])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=LOGITS_ATOL)


def test_decoder_greedy_tokens_match_transformers_generate(decoder, backend):
    model, program = decoder
    ref = greedy_reference(model, PROMPT, NEW_TOKENS, LOGITS_ATOL)
    assert greedy_generate(program.session(backend), PROMPT, NEW_TOKENS) == ref


def test_export_leaves_the_model_in_eval_mode(decoder):
    """export_llama wraps the model in a fresh (training-mode) module; export must not switch dropout back on."""
    model, _ = decoder
    assert not any(m.training for m in model.modules())


def test_sliding_window_is_applied():
    """With the window the prompt's early tokens are invisible to the last one; without it they are not, so the
    sliding models' agreement above is not an accident of a window too wide to matter."""
    model = tiny_decoder("mistral")
    assert model.config.sliding_window == SLIDING_WINDOW < len(PROMPT)
    with torch.no_grad():
        windowed = StaticCacheLM(model, MAX_CONTEXT).prefill(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
        model.config.sliding_window = None
        full = StaticCacheLM(model, MAX_CONTEXT).prefill(torch.tensor([PROMPT]), torch.arange(len(PROMPT)))
    assert float((windowed - full).abs().max()) > 1e-2


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_layers_keep_a_ring_written_in_place(family):
    """Sliding layers cache window + chunk - 1 slots, not max_context, and the program writes them in place; the
    greedy tokens above (prompt + 32 tokens = 42 positions in an 11-slot ring) cover wrapping around."""
    model = tiny_decoder(family)
    lm = StaticCacheLM(model, MAX_CONTEXT, CHUNK)
    assert lm.ring_size == SLIDING_WINDOW + CHUNK - 1
    sizes = [getattr(lm, f"key_cache_{i}").shape[2] for i in range(lm.num_layers)]
    want = [lm.ring_size if kind == "sliding_attention" else MAX_CONTEXT
            for kind in (getattr(model.config, "layer_types", None) or ["sliding_attention"] * lm.num_layers)]
    assert sizes == want
    program = export_llama(lm, MAX_CONTEXT, CHUNK).load()
    for method in ("prefill", "decode"):
        fused = ("rope_cache_update", "norm_rope_cache_update")  # (Gemma 3's q/k norms folded in)
        writes = [n for n in program.ir.methods[method].nodes  # each layer's k and v writes, fused by RoPE
                  if n.op in ("index_put", "index_copy", *fused)]
        count = sum(2 if n.op in fused else 1 for n in writes)
        assert count == 2 * lm.num_layers and all(n.attrs.get("in_place") for n in writes), method


def test_ring_prefill_refuses_chunks_longer_than_it_was_sized_for():
    lm = StaticCacheLM(tiny_decoder("mistral"), MAX_CONTEXT, prefill_chunk=4)
    with pytest.raises(ValueError, match="at most 4 tokens"):
        lm.prefill(torch.tensor([PROMPT[:5]]), torch.arange(5))


def test_static_cache_refuses_unknown_layer_types():
    model = tiny_decoder("qwen2")
    model.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        StaticCacheLM(model, MAX_CONTEXT)


def test_vit_matches_eager(backend):
    model = tiny_vit()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    batch = torch.export.Dim("batch", min=1, max=8)
    program = export(ViTOutputs(model), (images,), dynamic_shapes=({0: batch},)).load()
    session = program.session(backend, validate=True)
    for n in (2, 3):
        images = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))
        logits, hidden = (to_numpy(o) for o in session.run("forward", images.numpy()))
        with torch.no_grad():
            out = model(pixel_values=images)
            want_hidden = model.vit(pixel_values=images).last_hidden_state
        assert hidden.shape == (n, 17, 32)  # 16 patches + CLS
        np.testing.assert_allclose(logits, out.logits.numpy(), rtol=TOL, atol=TOL)
        np.testing.assert_allclose(hidden, want_hidden.numpy(), rtol=TOL, atol=TOL)


@pytest.fixture(scope="module")
def whisper():
    model = tiny_whisper()
    features = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(3))  # [1, n_mels, 2 * 16 positions]
    return model, features


def test_whisper_encoder_matches_eager(whisper, backend):
    model, features = whisper
    program = export(WhisperEncoder(model), (features,)).load()
    got = to_numpy(program.session(backend, validate=True).run("forward", features.numpy())[0])
    with torch.no_grad():
        want = model.get_encoder()(input_features=features).last_hidden_state.numpy()
    assert got.shape == (1, 16, 32)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_whisper_decoder_matches_eager(whisper, backend):
    model, features = whisper
    with torch.no_grad():
        hidden = model.get_encoder()(input_features=features).last_hidden_state
    tokens = torch.tensor([[1, 5, 9, 33, 7]])
    seq = torch.export.Dim("seq", min=1, max=32)
    program = export(WhisperDecoder(model), (tokens, hidden), dynamic_shapes=({1: seq}, None)).load()
    session = program.session(backend, validate=True)
    for n in (1, 5, 12):
        tokens = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n))
        got = to_numpy(session.run("forward", tokens.numpy(), hidden.numpy())[0])
        with torch.no_grad():  # the whole model: encoder + decoder + projection, no cache
            want = model(input_features=features, decoder_input_ids=tokens).logits.numpy()
        assert got.shape == (1, n, VOCAB)
        np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
