"""Continuous batching for one language-model program: one engine thread, a bounded queue, a KV-cache slot per
running sequence.

A request (a `Generation`) waits in the queue until a slot is free, is prefilled into that slot a chunk at a time,
then joins the running batch: every decode step runs all decoding sequences as one `decode` call (the slotted
program's batch: each its own token, position and slot) and samples each row with the sequence's own sampler. A
sequence leaves the batch when it ends (a stop token, a stop string, max_tokens, the end of the context, or its
client going away) and its slot is free for the next one at once; the slot is not cleared, since a program's
attention reads only the positions a sequence has written.

Each turn of the loop runs at most one prefill chunk and then one decode step, so a long prompt being prefilled
delays the running streams by one chunk per token, not by the whole prompt.

Programs exported without slots run too, one sequence at a time (slot 0). The engine thread is the only one that
runs the session; events reach the requester through its `emit` callback, called on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.llm.decoding import decode_batch, prefill_chunk, slot_inputs
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.llm.sampling import Sampler
from kiln.runtime.llm.tokenizer import LLMTokenizer
from kiln.runtime.program import Program
from kiln.runtime.serve.stops import StopText

log = logging.getLogger("kiln.serve")

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class QueueFullError(KilnError, RuntimeError):
    """The engine's queue holds as many waiting requests as it may; try again later."""


class EngineStoppedError(KilnError, RuntimeError):
    """The engine is shutting down and takes no more requests."""


@dataclass(frozen=True)
class Event:
    """What a generation did. kind "token": one token was generated (text: what it adds to the visible text, ""
    while a character, word or possible stop string is incomplete); "text": held-back text released at the end;
    "done": it ended (finish_reason); "error": it failed (message)."""

    kind: str
    text: str = ""
    token_id: int | None = None
    finish_reason: str | None = None
    message: str | None = None


class Generation:
    """One request in the engine: its prompt and options, its progress, and where its events go.

    emit: called on the engine thread with each Event; it must not block (e.g. hand the event to an event loop).
    """

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int, sampler: Sampler,
                 stop_token_ids: Sequence[int], stop_texts: Sequence[str], emit: Callable[[Event], None],
                 detokenizer: Any = None):
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.max_tokens = int(max_tokens)
        self.sampler = sampler
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.stops = StopText(stop_texts)
        self.emit = emit
        self.detokenizer = detokenizer
        self.slot: int | None = None
        self.prefilled = 0
        self.position = 0
        self.pending: int | None = None
        """The last token sampled, to be fed at `position` by the next decode step (None while prefilling)."""
        self.completion_tokens = 0
        self.cancelled = False
        self.finish_reason: str | None = None
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineMetrics:
    """What the engine reports as it runs; the server's Prometheus metrics implement it (the default does nothing)."""

    def step(self, batch: int, seconds: float) -> None:
        """One decode step over `batch` sequences took `seconds`."""

    def token(self, first: bool, seconds: float) -> None:
        """A token was sampled: the first of its request `seconds` after it arrived, or `seconds` after the last."""

    def finished(self, generation: Generation) -> None:
        """A generation ended (its finish_reason says how)."""


class LLMEngine:
    """Runs generations of one language-model program with continuous batching (see the module's docstring).

    max_queue: the most requests waiting for a slot; `submit` raises QueueFullError beyond it.
    """

    def __init__(self, program: Program, backend: str = "cpu", max_queue: int = 64,
                 metrics: EngineMetrics | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.program = program
        self.info = LLMInfo.from_metadata(program.metadata)
        if not {"prefill", "decode"} <= set(program.methods):
            raise KilnError(f"this program has methods {program.methods}, not prefill and decode: it is not a "
                            "language model exported with `kiln export-llm`")
        self.tokenizer = LLMTokenizer.from_info(self.info) if self.info.tokenizer_json else None
        self.session = program.session(backend)
        self.capacity = self.info.slots or 1
        self.max_queue = max_queue
        self.metrics = metrics or EngineMetrics()
        self._pad_batches = bool(getattr(self.session.backend, "can_capture", False))
        self._waiting: deque[Generation] = deque()
        self._running: list[Generation] = []
        self._free = list(range(self.capacity - 1, -1, -1))
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self) -> LLMEngine:
        self._thread.start()
        return self

    def submit(self, generation: Generation) -> None:
        """Queue a generation; raises QueueFullError when max_queue requests already wait, EngineStoppedError
        after shutdown."""
        with self._cond:
            if self._stopping:
                raise EngineStoppedError("the server is shutting down")
            if len(self._waiting) >= self.max_queue and not self._free:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting for one of "
                                     f"{self.capacity} slots")
            self._waiting.append(generation)
            self._cond.notify()

    def cancel(self, generation: Generation) -> None:
        """End a generation whose client has gone: it leaves the queue or frees its slot at the next step."""
        generation.cancelled = True
        with self._cond:
            self._cond.notify()

    def shutdown(self, message: str = "the server is shutting down", timeout: float = 30.0) -> None:
        """Stop taking requests, end every queued and running generation with an error event, stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for generation in [*self._waiting, *self._running]:
            self._finish(generation, "error", message)
        self._waiting.clear()

    # ---- the engine thread ----

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    return
                self._admit()
            for generation in [g for g in self._running if g.cancelled]:
                self._finish(generation, "cancelled")
            prefilling = next((g for g in self._running if g.pending is None), None)
            if prefilling is not None:
                self._guarded([prefilling], self._prefill_chunk)
            decoding = [g for g in self._running if g.pending is not None and not g.cancelled]
            if decoding:
                self._guarded(decoding, self._decode_step)

    def _admit(self) -> None:
        """Waiting generations into free slots, in arrival order (called with the lock held)."""
        while self._waiting and self._free:
            generation = self._waiting.popleft()
            if generation.cancelled:
                self._finish(generation, "cancelled")
                continue
            generation.slot = self._free.pop()
            self._running.append(generation)

    def _guarded(self, generations: list[Generation], step: Callable[[list[Generation]], None]) -> None:
        """Run one step; a failure ends the generations it was for, with the error, and the engine goes on."""
        try:
            step(generations)
        except Exception as e:  # a kernel or input failure must not stop the server
            log.exception("generation step failed")
            for generation in generations:
                self._finish(generation, "error", f"{type(e).__name__}: {e}")

    def _prefill_chunk(self, generations: list[Generation]) -> None:
        (generation,) = generations
        chunk = self.info.prefill_chunk
        start = generation.prefilled
        ids = np.asarray(generation.prompt_ids[start:start + chunk], dtype=np.int64)
        slot_input = slot_inputs(self.info, [generation.slot])
        logits = prefill_chunk(self.session, ids, start, slot_input)
        generation.prefilled += ids.size
        if generation.prefilled < generation.prompt_tokens:
            return
        row = self.session.backend.to_numpy(logits).reshape(-1)
        generation.position = generation.prompt_tokens
        self._accept(generation, generation.sampler(row))

    def _decode_step(self, generations: list[Generation]) -> None:
        tokens = [g.pending for g in generations]
        positions = [g.position for g in generations]
        slots = [g.slot for g in generations]
        size = len(generations)
        if self._pad_batches:  # one captured graph per power of two instead of one per batch size
            padded = min(self.capacity, 1 << (size - 1).bit_length())
            extra = padded - size  # repeats of the last row: the same keys written to the same place
            tokens, positions, slots = tokens + tokens[-1:] * extra, positions + positions[-1:] * extra, \
                slots + slots[-1:] * extra
        t0 = time.perf_counter()
        logits = decode_batch(self.session, tokens, positions, slots, self.info, host=False)
        picks = self._sample(generations, logits)
        self.metrics.step(size, time.perf_counter() - t0)
        for generation, token in zip(generations, picks):
            generation.position += 1
            generation.pending = None
            self._accept(generation, token)

    def _sample(self, generations: list[Generation], logits: Any) -> list[int]:
        """Each sequence's next token from its row of the step's logits (the backend's array, maybe padded with
        extra rows): when every sequence is greedy, the argmax of each row where the logits are (a GPU sends back
        one integer per row); otherwise the rows come to the host and each sampler picks from its own."""
        if all(g.sampler.greedy for g in generations):
            return [int(t) for t in self.session.backend.argmax_rows(logits)[:len(generations)]]
        rows = self.session.backend.to_numpy(logits)
        return [g.sampler(row) for g, row in zip(generations, rows)]

    def _accept(self, generation: Generation, token: int) -> None:
        """A sampled token: emitted, then the generation ends or waits for the next decode step."""
        now = time.perf_counter()
        first = generation.first_token_at is None
        self.metrics.token(first, now - (generation.submitted if first else generation.last_token_at))
        if first:
            generation.first_token_at = now
        generation.last_token_at = now
        if token in generation.stop_token_ids:
            self._finish(generation, "stop")
            return
        generation.completion_tokens += 1
        piece = generation.detokenizer.push(token) if generation.detokenizer is not None else ""
        text, stopped = generation.stops.feed(piece)
        generation.emit(Event("token", text, token))
        if stopped:
            self._finish(generation, "stop")
        elif generation.completion_tokens >= generation.max_tokens or generation.position >= self.info.max_context:
            self._finish(generation, "length")
        else:
            generation.pending = token

    def _finish(self, generation: Generation, reason: str, message: str | None = None) -> None:
        if generation.finished:
            return
        generation.finish_reason = reason
        if reason in ("stop", "length"):
            tail = generation.detokenizer.finish() if generation.detokenizer is not None else ""
            text, _ = generation.stops.feed(tail)
            text += generation.stops.finish()
            if text:
                generation.emit(Event("text", text))
        if generation.slot is not None:
            with self._cond:
                if generation in self._running:
                    self._running.remove(generation)
                self._free.append(generation.slot)
            generation.slot = None
        self.metrics.finished(generation)
        if reason == "error":
            generation.emit(Event("error", message=message or "generation failed"))
        else:
            generation.emit(Event("done", finish_reason=reason))


__all__ = ["EngineMetrics", "EngineStoppedError", "Event", "FINISH_REASONS", "Generation", "LLMEngine",
           "QueueFullError"]
