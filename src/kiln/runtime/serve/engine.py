"""Continuous batching for one language-model program: one engine thread, a bounded queue, a KV-cache slot per
running sequence.

A request (a `Generation`) waits in the queue until a slot is free, is prefilled into that slot a chunk at a time,
then joins the running batch: every decode step runs all decoding sequences as one `decode` call (the slotted
program's batch: each its own token, position and slot) and samples each row with the sequence's own sampler. A
sequence leaves the batch when it ends (a stop token, a stop string, max_tokens, the end of the context, or its
client going away) and its slot is free for the next one at once; the slot is not cleared, since a program's
attention reads only the positions a sequence has written.

Where the program's decode takes more rows than it has slots (programs exported with `decode_rows`, see
kiln.runtime.llm.info) and the backend attends to many rows of one slot in place, prompts are fed as rows of the
decode steps themselves: a step carries one token of every decoding sequence and up to `prefill_tokens` prompt
tokens (of one or more sequences, each token a row at its own position), so decoding and prefilling share one
read of the weights, and a running stream waits for a prompt's chunk only as long as that chunk's share of the
step. The rows whose logits are sampled (the decode rows, then each prompt's last token) come first, so the
logits that leave the device are one leading slice. Otherwise each turn of the loop runs at most one chunk of the
`prefill` method and then one decode step, so a long prompt delays the running streams by one chunk per token,
not by the whole prompt.

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
from kiln.runtime.graphs import WARMUP_RUNS
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
        self.ahead: tuple[_InFlight, int] | None = None
        """With the engine's overlap: the launched step (and row of its picks) whose pick this generation feeds at
        `position` next, before the host has read it."""
        self.completion_tokens = 0
        self.handle: int | None = None
        """The engine process's number for it (engine_process.EngineProcess); None in an engine thread."""
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


@dataclass
class _InFlight:
    """A launched decode step whose greedy picks the host has not read yet (LLMEngine's overlap): the picks stay
    where the logits are, for the next step to take as its tokens, while `fetch` brings them to the host."""

    ids: Any  # the backend's int64 [len(sampled)] (None: no row sampled)
    fetch: Callable[[], np.ndarray]
    sampled: list[Generation]
    positions: list[int]  # where each pick is fed (the generation's position after this step)
    decoding: int  # sampled[:decoding] were decoding rows, the rest prompts this step ended
    started: float


def padded_rows(rows: int, most: int) -> int:
    """The row count a step of `rows` rows is padded to where graphs are captured per row count: a power of two
    up to 8, a multiple of 8 up to 64, then of 64 (at most `most`): few graphs, and little padding at the batch
    sizes a GPU serves (a step of 33 sequences runs 40 rows, not 64)."""
    step = 64 if rows > 64 else 8 if rows > 8 else 0
    padded = -(-rows // step) * step if step else 1 << (rows - 1).bit_length()
    return min(most, padded)


class LLMEngine:
    """Runs generations of one language-model program with continuous batching (see the module's docstring).

    max_queue: the most requests waiting for a slot; `submit` raises QueueFullError beyond it.
    prefill_tokens: the most prompt tokens one decode step carries where prompts ride in decode steps (default:
    the program's prefill chunk); fewer keep each step shorter for the running streams, more fill the slots faster.
    prefill_in_steps: feed prompts as rows of the decode steps (True), or by the prefill method (False); default:
    where the program and the backend allow it (see the module's docstring).
    overlap: launch each decode step before reading the step before's greedy picks, which it takes as its tokens
    where they lie (a GPU's memory): the host's work between two steps (building the rows, detokenizing, stop
    strings, handing events on) runs while the device computes, instead of between its steps. A sequence that
    stops at a step has then already been given a row of the next one, whose result is dropped. Steps with a
    sequence whose sampler needs the logits on the host (top-k or top-p, or any sampling where the backend does not
    sample on the device) run as before. Needs prompts in decode steps. Default (None): on where prompts ride in
    decode steps on a backend that captures its steps (a GPU's: measured on the H200, 1B bf16, 64 streams 15.4k ->
    19.9k tokens/s, one stream 1.10 -> 0.93 ms a token); a CPU's steps are synchronous, so there is nothing to hide.
    """

    def __init__(self, program: Program, backend: str = "cpu", max_queue: int = 64,
                 metrics: EngineMetrics | None = None, prefill_tokens: int | None = None,
                 prefill_in_steps: bool | None = None, overlap: bool | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if prefill_tokens is not None and prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
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
        self.max_rows = self.info.decode_rows or 1
        room = self.max_rows > self.capacity
        if prefill_in_steps is None:
            prefill_in_steps = room and self.session.backend.attends_rows_in_place
        if prefill_in_steps and not room:
            raise KilnError(f"this program's decode takes at most {self.max_rows} rows for {self.capacity} slots: "
                            "no room for prompt tokens in a step; export it again with --slots to serve prompts "
                            "in decode steps")
        self.prefill_in_steps = bool(prefill_in_steps)
        if overlap is None:
            overlap = self.prefill_in_steps and self._pad_batches
        if overlap and not self.prefill_in_steps:
            raise KilnError("overlap needs prompts fed in the decode steps (prefill_in_steps; a program exported "
                            "with --slots, on a backend that reads a slot's rows in place)")
        self.overlap = bool(overlap)
        self._inflight: _InFlight | None = None
        self.prefill_tokens = min(prefill_tokens or self.info.prefill_chunk, self.max_rows - 1) \
            if prefill_in_steps else 0
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

    def warm_up(self) -> LLMEngine:
        """Run each padded row count a decode step can have (padded_rows) until the backend has captured its
        graph, before any request: otherwise the first steps of each size pay for a run op by op and a capture
        (tens of milliseconds on a GPU) in the middle of the streams. Writes go to slot 0 at the first positions,
        which a sequence always rewrites before reading them. Nothing to do where steps are not padded (cpu).
        Call before start()."""
        if not self._pad_batches or self._thread.is_alive():
            return self
        most = self.max_rows if self.prefill_in_steps else self.capacity
        for rows in sorted({padded_rows(n, most) for n in range(1, most + 1)}):
            positions = [p % self.info.max_context for p in range(rows)]
            for _ in range(WARMUP_RUNS + 1):
                decode_batch(self.session, [0] * rows, positions, [0] * rows, self.info, host=False)
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
            if self.overlap:
                self._overlapped_step()
                continue
            if self.prefill_in_steps:
                self._step_with_prompts()
                continue
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
            self._fail(generations, e)

    def _fail(self, generations: list[Generation], error: Exception) -> None:
        """A failed step's generations end with its error (logged once); the engine goes on."""
        log.exception("generation step failed")
        for generation in generations:
            self._finish(generation, "error", f"{type(error).__name__}: {error}")

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
        self._run_step([(g.pending, g.position, g.slot) for g in generations], generations, [], self.capacity)

    def _run_rows(self, rows: list[tuple[int, int, int]], most: int) -> Any:
        """One decode call over rows of (token, position, slot); the backend's logits, a row each (and the
        padding's after them). Where graphs are captured, the rows are padded (padded_rows) with repeats of the
        last row: the same keys written to the same place."""
        tokens, positions, slots = zip(*self._padded(rows, most))
        return decode_batch(self.session, tokens, positions, slots, self.info, host=False)

    def _padded(self, rows: list[tuple[int, int, int]], most: int) -> list[tuple[int, int, int]]:
        """Where graphs are captured, rows padded to padded_rows(len(rows), most) with repeats of the last row."""
        if not self._pad_batches:
            return rows
        return rows + rows[-1:] * (padded_rows(len(rows), most) - len(rows))

    def _step_with_prompts(self) -> None:
        """One decode step carrying every decoding sequence's token and up to prefill_tokens prompt tokens (the
        module's docstring; the rows as _step_rows orders them)."""
        decoding = [g for g in self._running if g.pending is not None and not g.cancelled]
        chunks, rows = self._step_rows(decoding, [g for g in self._running if not g.cancelled])
        if rows:
            self._guarded(decoding + [g for g, _, _ in chunks],
                          lambda _: self._run_step(rows, decoding, chunks, self.max_rows))

    def _step_rows(self, decoding: list[Generation], live: list[Generation]
                   ) -> tuple[list[tuple[Generation, int, bool]], list[tuple[int, int, int]]]:
        """A step's prompt chunks (generation, its prompt tokens this step, whether they end it) from the live
        generations still prompting, up to prefill_tokens and the rows left beside `decoding`; and its rows of
        (token, position, slot): decoding sequences first (a token below 0 stands for pick -1 - t of the step in
        flight, with the overlap), then each prompt's last token where this step ends it, then the other prompt
        tokens, so the rows sampled are the leading ones."""
        room = min(self.prefill_tokens, self.max_rows - len(decoding))
        chunks: list[tuple[Generation, int, bool]] = []
        for generation in live:
            if room <= 0:
                break
            if generation.pending is None and generation.ahead is None:
                left = generation.prompt_tokens - generation.prefilled
                count = min(room, left)
                chunks.append((generation, count, count == left))
                room -= count
        rows = [(g.pending if g.pending is not None else -1 - g.ahead[1], g.position, g.slot) for g in decoding]
        rows += [(g.prompt_ids[-1], g.prompt_tokens - 1, g.slot) for g, _, ends in chunks if ends]
        for generation, count, ends in chunks:  # an ending prompt's last token is already a row
            first = generation.prefilled
            rows += [(generation.prompt_ids[p], p, generation.slot) for p in range(first, first + count - ends)]
        return chunks, rows

    def _run_step(self, rows: list[tuple[int, int, int]], decoding: list[Generation],
                  chunks: list[tuple[Generation, int, bool]], most: int) -> None:
        """One decode call over `rows` (decoding's rows first, then the last token of each chunk that ends its
        prompt): prompts advance by their chunks, and the sequences whose rows lead get their next token."""
        t0 = time.perf_counter()
        logits = self._run_rows(rows, most)
        sampled = decoding + [g for g, _, ends in chunks if ends]
        picks = self._sample(sampled, logits) if sampled else []
        if decoding:
            self.metrics.step(len(decoding), time.perf_counter() - t0)
        for generation, count, ends in chunks:
            generation.prefilled += count
            if ends:
                generation.position = generation.prompt_tokens
        for generation, token in zip(sampled, picks):
            if generation.pending is not None:  # a decoding sequence (an ended prompt has none yet)
                generation.position += 1
                generation.pending = None
            self._accept(generation, token)

    def _continues(self, generation: Generation) -> bool:
        """Whether a generation whose pick is in flight may need another step: not if that pick is its last by
        count or by the context (a stop token or string the host only sees when it reads the pick)."""
        return generation.completion_tokens + 1 < generation.max_tokens and \
            generation.position < self.info.max_context

    def _overlapped_step(self) -> None:
        """_step_with_prompts's step, launched before the step in flight (if any) is read: decoding sequences
        whose pick is in flight take it as their token on the device. Then the step before is read and its
        picks accepted while this one runs."""
        previous = self._inflight
        live = [g for g in self._running if not g.cancelled and not g.finished]
        decoding = [g for g in live if g.pending is not None or (g.ahead is not None and self._continues(g))]
        chunks, rows = self._step_rows(decoding, live)
        sampled = decoding + [g for g, _, ends in chunks if ends]
        if not sampled and not chunks or not self._picks_on_device(sampled):
            self._drain()  # nothing to launch, or a sequence whose sampler needs the logits on the host
            if sampled or chunks:
                self._step_with_prompts()
            return
        try:
            step = self._launch(rows, sampled, len(decoding), previous)
        except Exception as e:  # as _guarded: the step's generations end with the error, the engine goes on
            self._fail(sampled + [g for g, _, _ in chunks], e)
            self._drain()
            return
        for generation, count, ends in chunks:
            generation.prefilled += count
            if ends:
                generation.position = generation.prompt_tokens
        for index, generation in enumerate(decoding):
            generation.pending = None
            generation.position += 1
            generation.ahead = (step, index)
        for index, generation in enumerate(sampled[len(decoding):], start=len(decoding)):
            generation.ahead = (step, index)
        step.positions = [g.position for g in sampled]
        self._inflight = step
        if previous is not None:
            self._read(previous)

    def _launch(self, rows: list[tuple[int, int, int]], sampled: list[Generation], decoding: int,
                previous: _InFlight | None) -> _InFlight:
        """Queue one decode call over rows of (token, position, slot), a token below 0 standing for pick -1 - t
        of the step in flight, and the greedy pick of its first len(sampled) rows; nothing waits for the device."""
        started = time.perf_counter()
        backend = self.session.backend
        tokens, positions, slots = (np.asarray(column, dtype=np.int64)
                                    for column in zip(*self._padded(rows, self.max_rows)))
        ahead = np.flatnonzero(tokens < 0)
        token_input = backend.upload(np.where(tokens < 0, 0, tokens))
        if ahead.size:
            token_input = backend.put_rows(token_input, ahead, previous.ids, -1 - tokens[ahead])
        slot_input = tuple(backend.upload(a) for a in slot_inputs(self.info, slots.tolist()))
        logits = self.session.run("decode", token_input.reshape(-1, 1), backend.upload(positions), *slot_input)[0]
        if not sampled:  # prompt rows alone: nothing to pick
            return _InFlight(None, lambda: np.zeros(0, np.int64), sampled, [], decoding, started)
        ids = self._pick_here(sampled, logits.reshape(-1, logits.shape[-1])[:len(sampled)])
        return _InFlight(ids, backend.fetch(ids), sampled, [], decoding, started)

    def _read(self, step: _InFlight) -> None:
        """The host reads a launched step's picks and accepts them (a generation already finished, by a stop
        seen in the step before or by an error, drops its pick); one whose next row was not launched yet takes
        its pick as its pending token."""
        try:
            picks = np.asarray(self._check_picks(step.fetch().tolist()))
        except Exception as e:
            self._fail(step.sampled, e)
            return
        if step.decoding:
            self.metrics.step(step.decoding, time.perf_counter() - step.started)
        for index, (generation, token) in enumerate(zip(step.sampled, picks.tolist())):
            if generation.finished:
                continue
            last = generation.ahead is not None and generation.ahead[0] is step
            self._accept(generation, int(token), position=step.positions[index], feed=False)
            if last:
                generation.ahead = None
                if not generation.finished:
                    generation.pending = int(token)

    def _drain(self) -> None:
        """Read the step in flight, if any: every generation then has its pick on the host (pending)."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._read(step)

    def _sample(self, generations: list[Generation], logits: Any) -> list[int]:
        """Each sequence's next token from its row of the step's logits (the backend's array, maybe padded with
        extra rows): greedy and device-sampled ones picked where the logits are (_pick_here: a GPU sends back one
        integer per row), the others' rows to the host (only theirs: a Llama-3 row is 250 KB), where each sampler
        picks from its own."""
        backend = self.session.backend
        logits = logits[:len(generations)]
        picks = self._check_picks(backend.to_numpy(self._pick_here(generations, logits)).tolist())
        sampled = [i for i, g in enumerate(generations) if not self._picks_on_device([g])]
        if sampled:
            rows = backend.to_numpy(logits[sampled[0]:sampled[-1] + 1])  # one copy of the span they lie in
            for i in sampled:
                picks[i] = generations[i].sampler(rows[i - sampled[0]])
        return picks

    def _picks_on_device(self, generations: list[Generation]) -> bool:
        """Whether every pick of these generations can be made where the logits are: greedy, or (where the
        backend samples on the device) a temperature alone."""
        on_device = self.session.backend.samples_on_device
        return all(g.sampler.greedy or on_device and g.sampler.on_device for g in generations)

    def _pick_here(self, generations: list[Generation], logits: Any) -> Any:
        """The picks of the rows of `logits` (one a generation) as the backend's int64 array, made where the
        logits are: each device-sampled sequence's draw (sample_rows with its sampler's next device draw), the
        argmax for the others (a greedy sequence's pick; a host-sampled one's row is sampled again on the host).
        A device-sampled sequence so draws the same noise whatever its neighbors."""
        backend = self.session.backend
        drawn = [not g.sampler.greedy and self._picks_on_device([g]) for g in generations]
        if not any(drawn):
            return backend.argmax_rows_here(logits)
        draws = [g.sampler.device_draw() if d else (0.0, 0, 0) for g, d in zip(generations, drawn)]
        inv_temperature, seeds, counters = (np.asarray(column) for column in zip(*draws))
        return backend.sample_rows_here(logits, inv_temperature.astype(np.float32), seeds.astype(np.uint64),
                                        counters.astype(np.int64))

    @staticmethod
    def _check_picks(picks: list[int]) -> list[int]:
        """A pick of -1 is a row with NaN logits, which the host sampler refuses too."""
        if any(p < 0 for p in picks):
            raise ValueError("cannot sample: NaN logits")
        return picks

    def _accept(self, generation: Generation, token: int, position: int | None = None, feed: bool = True) -> None:
        """A sampled token: emitted, then the generation ends or (feed) waits for the next decode step with it.
        position: where the token is fed (the overlap's generations have moved on already); default the
        generation's."""
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
        elif generation.completion_tokens >= generation.max_tokens or \
                (generation.position if position is None else position) >= self.info.max_context:
            self._finish(generation, "length")
        elif feed:
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
        self.metrics.finished(generation)  # before the slot is free: whoever sees it free sees the count
        if generation.slot is not None:
            with self._cond:
                if generation in self._running:
                    self._running.remove(generation)
                self._free.append(generation.slot)
            generation.slot = None
        if reason == "error":
            generation.emit(Event("error", message=message or "generation failed"))
        else:
            generation.emit(Event("done", finish_reason=reason))


__all__ = ["EngineMetrics", "EngineStoppedError", "Event", "FINISH_REASONS", "Generation", "LLMEngine",
           "QueueFullError", "padded_rows"]
