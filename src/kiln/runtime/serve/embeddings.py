"""A sentence-embedding program served as OpenAI's embeddings route (POST /v1/embeddings).

Texts are tokenized with the tokenizer the program carries (or one given to the server), run as one batch per
request on a worker thread (the session is not shared between threads: one lock), and returned as float lists or
base64 of little-endian float32, as OpenAI's `encoding_format` asks.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kiln.errors import InputError
from kiln.runtime.program import Program
from kiln.runtime.serve.metrics import Metrics
from kiln.runtime.serve.protocol import bad_field, field, read_json
from kiln.runtime.serve.service import ServeOptions, Service
from kiln.runtime.text import TextTokenizer, program_tokenizer

MAX_INPUTS = 2048


class EmbeddingService(Service):
    kind = "embedding"

    def __init__(self, program: Program, backend: str, model_id: str, metrics: Metrics, options: ServeOptions):
        super().__init__(model_id, metrics)
        self.session = program.session(backend)
        self.tokenizer: TextTokenizer | None = options.tokenizer or program_tokenizer(program.metadata)
        self._lock = threading.Lock()

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"])]

    async def embeddings(self, request: Request) -> Response:
        body = await read_json(request)
        self.check_model(body.get("model"))
        encoding = field(body, "encoding_format", "string", "float",
                         lambda v: None if v in ("float", "base64") else "must be 'float' or 'base64'")
        if body.get("dimensions") is not None:
            raise bad_field("dimensions", "'dimensions' is not supported: this model's size is fixed",
                            code="unsupported_parameter")
        ids, mask = self._tokens(body.get("input"))
        vectors = await asyncio.to_thread(self._run, ids, mask)
        tokens = int(mask.sum())
        self.metrics.count("kiln_prompt_tokens_total", "prompt tokens of finished requests", tokens)
        data = [{"object": "embedding", "index": k, "embedding": _encode(v, encoding)} for k, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": self.model_id,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _tokens(self, value: Any) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask) of a string, a list of strings, token ids, or a list of token id lists."""
        if value is None:
            raise bad_field("input", "'input' is a required property", code="missing_required_parameter")
        items = [value] if isinstance(value, str) or (isinstance(value, list) and value
                                                       and all(isinstance(t, int) for t in value)) else value
        if not isinstance(items, list) or not items:
            raise bad_field("input", "'input' must be a string, an array of strings or token ids (non-empty)",
                            code="invalid_type")
        if len(items) > MAX_INPUTS:
            raise bad_field("input", f"'input' holds at most {MAX_INPUTS} items, got {len(items)}",
                            code="invalid_value")
        if all(isinstance(t, str) for t in items):
            if self.tokenizer is None:
                raise bad_field("input", "this program carries no tokenizer: give token ids, or start the server "
                                "with --tokenizer")
            if any(not t for t in items):
                raise bad_field("input", "'input' must not contain empty strings", code="invalid_value")
            return self.tokenizer(items)
        if all(isinstance(t, list) and t and all(isinstance(i, int) and not isinstance(i, bool) for i in t)
               for t in items):
            longest = max(len(t) for t in items)
            ids = np.zeros((len(items), longest), dtype=np.int64)
            mask = np.zeros((len(items), longest), dtype=np.int64)
            for k, t in enumerate(items):
                ids[k, :len(t)], mask[k, :len(t)] = t, 1
            return ids, mask
        raise bad_field("input", "'input' must be a string, an array of strings, an array of token ids, or an "
                        "array of such arrays", code="invalid_type")

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        try:
            with self._lock:
                (out,) = self.session.run("forward", ids, mask)
        except InputError as e:  # too many tokens or texts for the program's bounds, an id past its vocabulary
            raise bad_field("input", f"the program cannot take this input: {e}", code="invalid_value") from None
        return np.asarray(self.session.backend.to_numpy(out), dtype=np.float32)


def _encode(vector: np.ndarray, encoding: str) -> Any:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


__all__ = ["EmbeddingService"]
