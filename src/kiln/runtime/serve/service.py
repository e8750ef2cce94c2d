"""What every kind of served program shares: its service's constructor, lifecycle and model check.

A service is built from (program, backend, model id, metrics, ServeOptions), adds its routes, and may start and
stop work of its own (the LLM engine's thread); `app.SERVICES` names the class for each kind of program.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.routing import Route

from kiln.runtime.serve.metrics import Metrics
from kiln.runtime.serve.protocol import APIError


@dataclass(frozen=True)
class ServeOptions:
    """Server options some kinds use. max_queue: language models' most requests waiting for a KV-cache slot;
    tokenizer: a kiln.runtime.text.TextTokenizer for an embedding program that carries none; prefill_tokens:
    language models' most prompt tokens per decode step (None: the engine's default); engine_process: run a
    language model's engine in a process of its own (serve/engine_process.py) rather than on a thread; overlap:
    the engine's overlapped steps (LLMEngine's overlap; None: where they help)."""

    max_queue: int = 64
    tokenizer: Any = None
    prefill_tokens: int | None = None
    engine_process: bool = False
    overlap: bool | None = None


class Service:
    kind = ""

    def __init__(self, model_id: str, metrics: Metrics):
        self.model_id = model_id
        self.metrics = metrics

    def routes(self) -> list[Route]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Extra fields of the model's card in GET /v1/models."""
        return {}

    def start(self) -> None:
        """Called when the server starts (before the first request)."""

    def shutdown(self) -> None:
        """Called when the server stops; must end what is in flight and may be called twice."""

    def check_model(self, model: Any) -> None:
        """A request's `model` must name the served model (400 model_not_found otherwise, as OpenAI answers)."""
        if not isinstance(model, str):
            raise APIError(400, "'model' is a required string property", param="model",
                           code="missing_required_parameter" if model is None else "invalid_type")
        if model != self.model_id:
            raise APIError(400, f"the model '{model}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")


__all__ = ["ServeOptions", "Service"]
