"""Live servers on 127.0.0.1 (a free port each), started in this process on a thread, and OpenAI clients."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from kiln.runtime.serve import Server, create_app  # noqa: E402


@contextlib.contextmanager
def live_server(program: Path, **options) -> Iterator[Server]:
    server = Server(create_app(program, **options), port=0, log_level="warning", graceful_seconds=5)
    server.start_in_thread()
    try:
        yield server
    finally:
        server.stop()


def client(server: Server) -> openai.OpenAI:
    """The official client, without retries (a 503 must reach the test) and with a bounded timeout."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="package")
def llm_path(tmp_path_factory) -> Path:
    """The tiny Llama with its word tokenizer and chat template, 4 slots, context 64."""
    pytest.importorskip("transformers")
    from tests.runtime.tiny_llm import export_tiny_llm

    return export_tiny_llm(slots=4)[1].save(tmp_path_factory.mktemp("serve") / "tiny.kiln")
