"""The ASGI app of `kiln serve`: one program, the routes of its kind, and the routes every server has.

The kind of a program is read from its metadata (a registry: language model, sentence embedding, speech); each
kind's service adds its OpenAI routes. Every server has GET /v1/models, GET /health and GET /metrics (Prometheus
text). Errors are OpenAI's JSON shape everywhere, 404 and 405 included; an unexpected failure is a 500 with its
message, logged, and the server goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.errors import KilnError
from kiln.runtime.llm.info import MAX_CONTEXT_KEY
from kiln.runtime.program import Program, load
from kiln.runtime.serve.embeddings import EmbeddingService
from kiln.runtime.serve.llm import LLMService
from kiln.runtime.serve.metrics import Metrics
from kiln.runtime.serve.protocol import APIError, now
from kiln.runtime.serve.service import ServeOptions, Service
from kiln.runtime.serve.speech import SpeechService
from kiln.runtime.speech.info import MODEL_KIND_KEY

log = logging.getLogger("kiln.serve")

KINDS: list[tuple[str, Callable[[Mapping[str, str]], bool]]] = [
    ("llm", lambda meta: MAX_CONTEXT_KEY in meta),
    ("speech", lambda meta: MODEL_KIND_KEY in meta),
    ("embedding", lambda meta: meta.get("task") == "sentence-embedding"),
]
"""How a program says what it is, tried in order."""
SERVICES: dict[str, type[Service]] = {"llm": LLMService, "speech": SpeechService, "embedding": EmbeddingService}
"""The service that serves each kind."""


def program_kind(metadata: Mapping[str, str]) -> str:
    for kind, matches in KINDS:
        if matches(metadata):
            return kind
    raise KilnError("kiln serve serves language models (`kiln export-llm`), sentence-embedding programs and speech "
                    "programs (`kiln export-whisper`, `kiln export-parakeet`); this program is none of them")


def model_name(program: Program, path: str | None) -> str:
    """The id clients name the model by: what the program calls itself, else its file name."""
    meta = program.metadata
    for key in ("kiln.llm.name", "kiln.speech.name", "model"):
        if meta.get(key):
            return meta[key]
    return Path(path).stem if path else "kiln-model"


def create_app(program: Program | str | os.PathLike, backend: str = "cpu", model_id: str | None = None,
               max_queue: int = 64, tokenizer: Any = None, prefill_tokens: int | None = None,
               engine_process: bool = False, overlap: bool | None = None) -> Starlette:
    """The server's app for one program (a loaded Program or a .kiln path).

    model_id: the name clients use in `model` (default: the program's own name, else its file name).
    max_queue: for a language model, the most requests waiting for a KV-cache slot (then 503 with Retry-After).
    tokenizer: a kiln.runtime.text.TextTokenizer for an embedding program that carries none.
    prefill_tokens: for a language model, the most prompt tokens a decode step carries (see LLMEngine).
    engine_process: for a language model loaded from a file, run its engine in a process of its own (the HTTP
    work and the engine's host work then use two cores; see serve/engine_process.py); default: a thread.
    overlap: for a language model, the engine's overlapped steps (LLMEngine's overlap; default: where they help).
    """
    path = None if isinstance(program, Program) else os.fspath(program)
    program = program if isinstance(program, Program) else load(program)
    kind = program_kind(program.metadata)
    model_id = model_id or model_name(program, path)
    metrics = Metrics(model_id)
    options = ServeOptions(max_queue, tokenizer, prefill_tokens, engine_process, overlap)
    service = SERVICES[kind](program, backend, model_id, metrics, options)

    async def models(request: Request) -> Response:
        card = {"id": model_id, "object": "model", "created": created, "owned_by": "kiln", "kind": kind,
                **service.describe()}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model_id, "kind": kind})

    async def metrics_route(request: Request) -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.shutdown()

    created = now()
    routes = [*service.routes(), Route("/v1/models", models), Route("/health", health),
              Route("/metrics", metrics_route)]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(CountRequests, metrics=metrics)],
                    exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.service, app.state.metrics, app.state.model_id = service, metrics, model_id
    return app


class CountRequests:
    """ASGI middleware counting answered requests by path and status (plain ASGI: a streamed response passes
    through untouched)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count("kiln_requests_total", "HTTP requests answered, by path and status",
                                   path=scope["path"], status=str(message["status"]))
            await send(message)

        await self.app(scope, receive, sending)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return APIError(exc.status_code, message, type=kind, headers=dict(exc.headers or {})).response()


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()


__all__ = ["KINDS", "SERVICES", "create_app", "model_name", "program_kind"]
