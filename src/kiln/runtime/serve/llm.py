"""A language-model program served as OpenAI's chat completions and completions, stream or not, on LLMEngine.

Each request is checked field by field (protocol.py), rendered to token ids (the program's chat template and
tokenizer), and handed to the engine as a Generation whose events come back to the request's task through an
asyncio queue. A stream is Server-Sent Events as OpenAI sends them (`data: {chunk}` ... `data: [DONE]`); a client
that goes away mid-stream cancels its generation, which frees its slot at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kiln.runtime.llm.sampling import Sampler
from kiln.runtime.program import Program
from kiln.runtime.serve.engine import EngineStoppedError, Event, Generation, LLMEngine, QueueFullError
from kiln.runtime.serve.engine_process import EngineProcess
from kiln.runtime.serve.metrics import Metrics
from kiln.runtime.serve.protocol import (
    APIError,
    at_least,
    bad_field,
    field,
    in_range,
    int_list,
    new_id,
    now,
    read_json,
    refuse_unsupported,
    string_list,
)
from kiln.runtime.serve.service import ServeOptions, Service

UNSUPPORTED = {
    "n": lambda v: v == 1, "best_of": lambda v: v == 1, "logprobs": lambda v: v in (False, None),
    "top_logprobs": lambda v: v == 0, "echo": lambda v: v is False, "suffix": lambda v: v == "",
    "presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0, "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [], "functions": lambda v: v == [],
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
}
"""Fields that would change the answer in ways the server does not implement: refused unless at their default."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
RETRY_AFTER_SECONDS = 1


@dataclass
class Options:
    """A request's generation settings, checked."""

    max_tokens: int
    sampler: Sampler
    stop_texts: list[str]
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool


class LoopMailbox:
    """Engine events on their way to one event loop, handed over in batches: the engine thread appends, and only
    the first event since the loop last emptied the box wakes the loop (call_soon_threadsafe writes to the loop's
    wake-up pipe; one write per token of every stream was a system call per token)."""

    _boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue[Event], Event]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        box = cls._boxes.get(loop)
        if box is None:
            box = cls._boxes[loop] = cls(loop)
        return box

    def post(self, queue: asyncio.Queue[Event], event: Event) -> None:
        with self._lock:
            self._pending.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, event in pending:
            queue.put_nowait(event)


class EventQueue:
    """Engine events handed to the request's event loop (the engine thread must never block on a client)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._mailbox = LoopMailbox.of(asyncio.get_running_loop())

    def emit(self, event: Event) -> None:
        self._mailbox.post(self.queue, event)


class LLMService(Service):
    """The routes of one language-model program."""

    kind = "llm"

    def __init__(self, program: Program, backend: str, model_id: str, metrics: Metrics, options: ServeOptions):
        super().__init__(model_id, metrics)
        if options.engine_process:
            if program.path is None:
                raise ValueError("engine_process needs a program loaded from a file (the engine process loads it)")
            self.engine: LLMEngine | EngineProcess = EngineProcess(program.path, backend, options.max_queue, metrics,
                                                                   options.prefill_tokens, options.overlap)
        else:
            self.engine = LLMEngine(program, backend, options.max_queue, metrics, options.prefill_tokens,
                                    overlap=options.overlap)
        self.info = self.engine.info
        self.tokenizer = self.engine.tokenizer
        metrics.gauge("kiln_queue_depth", "requests waiting for a KV-cache slot", lambda: self.engine.queue_depth)
        metrics.gauge("kiln_running_sequences", "sequences holding a KV-cache slot", lambda: self.engine.running)
        metrics.gauge("kiln_slots", "KV-cache slots of the program", lambda: self.engine.capacity)
        if isinstance(self.engine, EngineProcess):
            metrics.sampled("kiln_engine_process_cpu_seconds_total", "CPU time (user + system) of the engine's "
                            "process, as of its last message", lambda: self.engine.cpu_seconds, kind="counter")

    def routes(self) -> list[Route]:
        return [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"])]

    def describe(self) -> dict[str, Any]:
        return {"max_context": self.info.max_context, "slots": self.engine.capacity}

    def start(self) -> None:
        self.engine.warm_up().start()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- routes ----

    async def chat(self, request: Request) -> Response:
        body = await read_json(request)
        self.check_model(body.get("model"))
        messages = field(body, "messages", "array", check=lambda v: None if v else "must not be empty")
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions", param="messages")
        checked = self._messages(messages)
        try:
            ids = self.tokenizer.apply_chat_template(checked, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (raise_exception) and rendering errors
            raise bad_field("messages", f"the chat template cannot render these messages: {e}") from None
        options = self._options(body, len(ids), ("max_completion_tokens", "max_tokens"))
        return await self._respond(request, ids, options, chat=True)

    async def completions(self, request: Request) -> Response:
        body = await read_json(request)
        self.check_model(body.get("model"))
        ids = self._prompt_ids(body.get("prompt", None))
        options = self._options(body, len(ids), ("max_tokens",), default_max=16)
        return await self._respond(request, ids, options, chat=False)

    # ---- request fields ----

    @staticmethod
    def _messages(messages: list[Any]) -> list[dict[str, str]]:
        out = []
        for k, m in enumerate(messages):
            where = f"messages[{k}]"
            if not isinstance(m, dict):
                raise bad_field(where, f"'{where}' must be an object with 'role' and 'content'", code="invalid_type")
            role = m.get("role")
            if role not in ROLES:
                raise bad_field(f"{where}.role", f"'{where}.role' must be one of {sorted(ROLES)}, got "
                                f"{json.dumps(role)}", code="invalid_value")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise bad_field(f"{where}.content", "only text content parts ({'type': 'text', 'text': ...}) "
                                    "are supported", code="invalid_value")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise bad_field(f"{where}.content", f"'{where}.content' must be a string or an array of text "
                                "parts", code="invalid_type")
            out.append({"role": ROLES[role], "content": content})
        return out

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise bad_field("prompt", "this model carries no tokenizer: give the prompt as token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt)
            vocab = self.info.vocab_size
            if vocab is not None and any(not 0 <= t < vocab for t in ids):
                raise bad_field("prompt", f"token ids must be in [0, {vocab})", code="invalid_value")
        elif prompt is None:
            raise bad_field("prompt", "'prompt' is a required property", code="missing_required_parameter")
        else:
            raise bad_field("prompt", "'prompt' must be a string, an array of token ids, or an array holding one of "
                            "them (one prompt per request)", code="invalid_type")
        if not ids:
            raise bad_field("prompt", "the prompt is empty", code="invalid_value")
        return ids

    def _options(self, body: dict[str, Any], prompt_tokens: int, max_names: tuple[str, ...],
                 default_max: int | None = None) -> Options:
        refuse_unsupported(body, UNSUPPORTED)
        context = self.info.max_context
        if prompt_tokens >= context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, your prompt is "
                           f"{prompt_tokens} tokens, leaving no room for a completion. Please shorten it.",
                           param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
        room = context - prompt_tokens
        max_tokens, name = None, max_names[0]
        for name in max_names:
            max_tokens = field(body, name, "integer", None, at_least(1))
            if max_tokens is not None:
                break
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
                           f"completion). Please reduce the prompt or '{name}'.", param=name,
                           code="context_length_exceeded")
        temperature = field(body, "temperature", "number", 1.0, in_range(0, 2))
        top_p = field(body, "top_p", "number", 1.0, in_range(0, 1, low_open=True))
        top_k = field(body, "top_k", "integer", 0, at_least(-1))
        seed = field(body, "seed", "integer", None, at_least(0))
        stop = string_list("stop", body["stop"], 4) if body.get("stop") is not None else []
        stop_ids = int_list("stop_token_ids", body["stop_token_ids"]) if body.get("stop_token_ids") else []
        ignore_eos = field(body, "ignore_eos", "boolean", False)  # (vLLM's: fixed output lengths for benchmarks)
        stream = field(body, "stream", "boolean", False)
        stream_options = field(body, "stream_options", "object", {})
        include_usage = stream_options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad_field("stream_options.include_usage", "'stream_options.include_usage' must be a boolean",
                            code="invalid_type")
        sampler = Sampler(float(temperature), max(top_k, 0), float(top_p), seed)
        program_stops = [] if ignore_eos else list(self.info.stop_token_ids)
        return Options(max_tokens, sampler, stop, [*program_stops, *stop_ids], stream, include_usage)

    # ---- running it ----

    def _submit(self, ids: list[int], options: Options) -> tuple[Generation, EventQueue]:
        events = EventQueue()
        detokenizer = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        generation = Generation(ids, options.max_tokens, options.sampler, options.stop_token_ids,
                                options.stop_texts, events.emit, detokenizer)
        try:
            self.engine.submit(generation)
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}; retry in a moment", type="server_overloaded",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), type="server_unavailable", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        return generation, events

    async def _respond(self, request: Request, ids: list[int], options: Options, chat: bool) -> Response:
        generation, events = self._submit(ids, options)
        reply = Reply(new_id("chatcmpl" if chat else "cmpl"), self.model_id, chat)
        if options.stream:
            return StreamingResponse(self._stream(generation, events, reply, options.include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        text: list[str] = []
        try:
            while True:
                event = await _next_event(events, request)
                if event is None:  # the client went away
                    return Response(status_code=499)
                if event.kind in ("token", "text"):
                    text.append(event.text)
                elif event.kind == "error":
                    raise APIError(500, f"generation failed: {event.message}", type="server_error")
                else:
                    return JSONResponse(reply.whole("".join(text), event.finish_reason, generation))
        finally:
            if not generation.finished:
                self.engine.cancel(generation)

    async def _stream(self, generation: Generation, events: EventQueue, reply: Reply,
                      include_usage: bool) -> AsyncIterator[str]:
        """The SSE body. Events that are already waiting when the stream wakes go out in one write (several
        `data:` frames, each still one chunk, as OpenAI's clients read them): a stream that falls behind catches up
        in one system call instead of one per token."""
        try:
            if reply.chat:
                yield sse(reply.chunk({"role": "assistant", "content": ""}))
            queue = events.queue
            ended = False
            while not ended:
                frames = []
                event: Event | None = await queue.get()
                while event is not None:
                    if event.kind in ("token", "text"):
                        if event.text:
                            frames.append(reply.token_frame(event.text))
                    elif event.kind == "error":
                        frames.append(sse(APIError(500, f"generation failed: {event.message}",
                                                   type="server_error").body()))
                        ended = True
                        break
                    else:
                        frames.append(sse(reply.chunk({} if reply.chat else "", event.finish_reason)))
                        if include_usage:
                            frames.append(sse(reply.usage_chunk(generation)))
                        ended = True
                        break
                    event = None if queue.empty() else queue.get_nowait()
                if frames:
                    yield "".join(frames)
            yield "data: [DONE]\n\n"
        finally:
            if not generation.finished:
                self.engine.cancel(generation)


async def _next_event(events: EventQueue, request: Request, poll: float = 0.5) -> Event | None:
    """The next event, or None once the client has disconnected (checked every `poll` seconds)."""
    while True:
        try:
            return await asyncio.wait_for(events.queue.get(), poll)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Reply:
    """The response objects of one request: chat.completion(.chunk) or text_completion."""

    def __init__(self, id: str, model: str, chat: bool):
        self.id, self.model, self.chat, self.created = id, model, chat, now()
        # a token's frame is the same JSON every time but for its text: built once around a marker, then filled
        # with the text's JSON string (a stream's per-token cost is what limits a server at thousands of tokens/s)
        marker = "\0text\0"
        head, _, tail = sse(self.chunk({"content": marker} if chat else marker)).rpartition(json.dumps(marker))
        self._frame_head, self._frame_tail = head, tail

    def token_frame(self, text: str) -> str:
        """`data: {chunk}` for a piece of generated text: the same bytes as sse(chunk(...)) would give."""
        return self._frame_head + json.dumps(text, ensure_ascii=False) + self._frame_tail

    def _head(self, object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def chunk(self, delta: Any, finish_reason: str | None = None) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, generation: Generation) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(generation)}

    def whole(self, text: str, finish_reason: str | None, generation: Generation) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(generation)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(generation)}


def usage(generation: Generation) -> dict[str, int]:
    return {"prompt_tokens": generation.prompt_tokens, "completion_tokens": generation.completion_tokens,
            "total_tokens": generation.prompt_tokens + generation.completion_tokens}


__all__ = ["LLMService", "Reply"]
