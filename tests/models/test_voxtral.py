"""Voxtral (speech in, text out) at a scaled-down random-weight config: the exported encode / embed / prefill_embeds
/ decode methods against transformers' VoxtralForConditionalGeneration, greedy answers and transcriptions of
beckett.wav equal to transformers' generate on its own features, on every backend; the transcriber the program
asks for, and a prompt longer than the cache refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kiln.errors import InputError  # noqa: E402 - after the importorskip
from kiln.models.voxtral import export_voxtral  # noqa: E402
from kiln.models.zoo import tiny_voxtral, voxtral_tokenizer  # noqa: E402
from kiln.runtime.audio import SAMPLE_RATE, load_audio, whisper_log_mel  # noqa: E402
from kiln.runtime.speech import VoxtralTranscriber, transcriber  # noqa: E402
from tests.conftest import to_numpy  # noqa: E402
from tests.runtime.test_audio import beckett_path  # noqa: E402

MAX_CONTEXT, CHUNK, NEW_TOKENS = 448, 64, 12


@pytest.fixture(scope="module")
def beckett():
    return beckett_path()


@pytest.fixture(scope="module")
def program():
    return export_voxtral(tiny_voxtral(), MAX_CONTEXT, CHUNK, tokenizer=voxtral_tokenizer()).load()


def _reference_features(path) -> torch.Tensor:
    """transformers' own Whisper features of the first 30 s (128 mel bins), independent of kiln's front end."""
    from transformers import WhisperFeatureExtractor

    samples = load_audio(path, SAMPLE_RATE)
    extractor = WhisperFeatureExtractor(feature_size=128)
    return extractor(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features


def test_methods_equal_the_model(program, beckett, backend):
    model = tiny_voxtral()
    session = program.session(backend)
    features = whisper_log_mel(load_audio(beckett, SAMPLE_RATE), 128)
    np.testing.assert_allclose(features, _reference_features(beckett)[0].numpy(), atol=2e-5)
    with torch.no_grad():
        want = model.get_audio_features(torch.from_numpy(features)[None]).pooler_output.numpy()
    got = to_numpy(session.run("encode", features[None])[0])
    assert got.shape == (375, 32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    ids = np.array([[1, 3, 5, 6, 6, 40]])
    with torch.no_grad():
        want = model.get_input_embeddings()(torch.from_numpy(ids)).numpy()
    np.testing.assert_array_equal(to_numpy(session.run("embed", ids)[0]), want)


@pytest.mark.parametrize("question", [None, "w12 w40 w7"], ids=["transcribe", "question"])
def test_greedy_tokens_equal_transformers_generate(program, beckett, backend, question):
    voxtral = VoxtralTranscriber(program, backend)
    got = voxtral.generate(beckett, question, NEW_TOKENS)
    prompt = voxtral.prompt(1, question)
    with torch.no_grad():
        out = tiny_voxtral().generate(input_ids=torch.tensor([prompt]), input_features=_reference_features(beckett),
                                      max_new_tokens=NEW_TOKENS, do_sample=False)
    assert got == out[0, len(prompt):].tolist()


def test_the_program_asks_for_the_voxtral_transcriber(program, beckett):
    model = transcriber(program)
    assert isinstance(model, VoxtralTranscriber)
    result = model.transcribe(beckett, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == [model.generate(beckett, None, NEW_TOKENS)]
    assert result.text == model.tokenizer.decode(result.token_ids[0]) and result.audio_seconds > 0
    assert model.answer(beckett, "w12 w40 w7", NEW_TOKENS) == model.tokenizer.decode(
        model.generate(beckett, "w12 w40 w7", NEW_TOKENS))


def test_audio_longer_than_the_cache_is_refused(beckett):
    small = export_voxtral(tiny_voxtral(), 400, CHUNK, tokenizer=voxtral_tokenizer()).load()
    samples = load_audio(beckett, SAMPLE_RATE)
    with pytest.raises(InputError, match="cache holds 400"):
        VoxtralTranscriber(small).generate(np.concatenate([samples] * 7), None, 4)  # 70 s: three windows


def test_voxtral_commands(tmp_path, beckett):
    from tests.test_cli import cli

    folder = tmp_path / "voxtral"
    tiny_voxtral().save_pretrained(folder)
    voxtral_tokenizer().save_pretrained(folder)
    code, out, err = cli("export-voxtral", folder, "-o", tmp_path / "v.kiln", "--max-context", "448",
                         "--prefill-chunk", "64")
    assert code == 0, err
    assert "methods: encode" in out and "prefill_embeds" in out
    voxtral = VoxtralTranscriber(tmp_path / "v.kiln")
    code, out, err = cli("transcribe", tmp_path / "v.kiln", beckett, "--max-new-tokens", "6")
    assert code == 0, err
    assert out.strip() == voxtral.tokenizer.decode(voxtral.generate(beckett, None, 6)) and "real-time factor" in err
    code, out, err = cli("generate", tmp_path / "v.kiln", "--audio", beckett, "--prompt", "w12 w40 w7",
                         "--max-new-tokens", "6")
    assert code == 0, err
    assert out.strip() == voxtral.answer(beckett, "w12 w40 w7", 6) and "6 new tokens" in err
    code, _, err = cli("transcribe", tmp_path / "v.kiln", beckett, "--task", "translate")
    assert code == 2 and "Whisper programs only" in err
    code, _, err = cli("generate", tmp_path / "v.kiln", "--audio", beckett, "--prompt", "w1", "--temperature", "0.5")
    assert code == 2 and "answered greedily" in err
    code, _, err = cli("export-voxtral", tmp_path / "missing", "-o", tmp_path / "x.kiln")
    assert code == 2 and "not a folder" in err


def _tekken_json(folder) -> None:
    """A small tekken.json (Mistral's own tokenizer file, what real Voxtral checkpoints ship instead of a
    tokenizer.json) with the tiny Voxtral's special words at their ids and byte-level tokens after them."""
    import base64
    import json

    from kiln.models.zoo import VOCAB, VOXTRAL_WORDS

    merged = [b"th", b"he", b"the", b" t", b" th", b" the", b"in", b"an", b"er", b"on"]
    tokens = ([bytes([b]) for b in range(32, 127)] + merged)[:VOCAB - len(VOXTRAL_WORDS)]
    pattern = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    (folder / "tekken.json").write_text(json.dumps({
        "config": {"pattern": pattern, "num_vocab_tokens": len(tokens), "default_vocab_size": VOCAB,
                   "default_num_special_tokens": len(VOXTRAL_WORDS), "version": "v7"},
        "vocab": [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("latin-1")}
                  for i, t in enumerate(tokens)],
        "special_tokens": [{"rank": i, "token_str": word, "is_control": True} for i, word in enumerate(VOXTRAL_WORDS)],
    }))


def test_a_checkpoint_with_tekken_json_only_exports_and_transcribes(tmp_path, beckett, program):
    """Real Voxtral folders ship Mistral's tekken.json, no tokenizer.json: transformers reads it (its tekken
    converter), the export stores it as a tokenizer.json, and the program transcribes as one exported with the
    word-level tokenizer of the same ids does; the torch-free runtime encodes text with it."""
    folder = tmp_path / "voxtral"
    tiny_voxtral().save_pretrained(folder)
    _tekken_json(folder)
    assert not (folder / "tokenizer.json").exists()
    tekken = export_voxtral(folder, MAX_CONTEXT, CHUNK).load()
    tekken_transcriber, words = VoxtralTranscriber(tekken), VoxtralTranscriber(program)
    assert tekken_transcriber.generate(beckett, None, 6) == words.generate(beckett, None, 6)
    ids = tekken_transcriber.tokenizer.encode("the cat")
    assert ids and tekken_transcriber.tokenizer.decode(ids) == "the cat"
