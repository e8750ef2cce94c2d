"""The language-model engine in a process of its own, behind LLMEngine's surface.

Why: in one process the engine thread and the HTTP event loop share one interpreter lock, so every token's HTTP
work (an SSE frame, a socket write) and every step's host work (launching the step, detokenizing, stop strings)
run one after the other. Measured on the H100 (Llama-3.2-1B shape, 64 streams): the engine alone sustains 12.4k
output tokens/s, the same engine behind the server in one process 8.5k. With the engine in a child process, the
two run on two cores at once.

The parent keeps the program's metadata and tokenizer (to render prompts and check requests) and no session; the
child loads the program on the backend, warms it up and runs an LLMEngine. They talk over one pipe:
- parent -> child: ("submit", id, prompt ids, max_tokens, sampler, stop token ids, stop texts, detokenize),
  ("cancel", id), ("shutdown", message);
- child -> parent: ("ready", slots) or ("failed", message) once; then ("events", [(id, Event)...], [(batch,
  seconds) per decode step], queue depth, running, the child's CPU seconds) as the engine produces them, all
  events of a step in one message; ("closed",) after a shutdown.
A reader thread in the parent hands each event to its Generation's `emit` (the request's event loop) and keeps
the request's counts and the server's metrics. If the child dies, every request in flight ends with an error event
and new ones are refused (EngineStoppedError).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.llm.tokenizer import LLMTokenizer
from kiln.runtime.program import load
from kiln.runtime.serve.engine import EngineMetrics, EngineStoppedError, Event, Generation, LLMEngine, QueueFullError

log = logging.getLogger("kiln.serve")

START_TIMEOUT = 900.0
"""Seconds the child may take to load the program and capture its graphs before the server gives up."""


class EngineProcess:
    """LLMEngine's surface (submit, cancel, shutdown, warm_up, start, queue_depth, running, capacity, info,
    tokenizer) over an engine running in a child process (see the module's docstring).

    path: the .kiln file (the child loads it itself); the other arguments as LLMEngine's. The child starts in
    warm_up(), which returns once it has captured its graphs, and raises KilnError if it could not."""

    def __init__(self, path: str | os.PathLike, backend: str = "cpu", max_queue: int = 64,
                 metrics: EngineMetrics | None = None, prefill_tokens: int | None = None, overlap: bool | None = None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if prefill_tokens is not None and prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.path = os.fspath(path)
        program = load(self.path)
        self.info = LLMInfo.from_metadata(program.metadata)
        if not {"prefill", "decode"} <= set(program.methods):
            raise KilnError(f"this program has methods {program.methods}, not prefill and decode: it is not a "
                            "language model exported with `kiln export-llm`")
        self.tokenizer = LLMTokenizer.from_info(self.info) if self.info.tokenizer_json else None
        self.backend = backend
        self.capacity = self.info.slots or 1
        self.max_queue = max_queue
        self.prefill_tokens = prefill_tokens
        self.overlap = overlap
        self.metrics = metrics or EngineMetrics()
        self._generations: dict[int, Generation] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # _generations, _stopping, and sending on the pipe
        self._stopping = False
        self._shutting_down = threading.Lock()
        self._closed = threading.Event()  # the reader has seen the child's last message
        self._queue_depth = self._running = 0
        self.cpu_seconds = 0.0
        """The child's CPU time (user + system) as of its last message (the server's /metrics)."""
        self._conn: Any = None
        self._process: Any = None
        self._reader = threading.Thread(target=self._read, name="kiln-engine-reader", daemon=True)

    @property
    def queue_depth(self) -> int:
        return self._queue_depth

    @property
    def running(self) -> int:
        return self._running

    def warm_up(self) -> EngineProcess:
        """Start the child; returns once its engine is ready (graphs captured)."""
        if self._process is not None:
            return self
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copied locks, CUDA or threads
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_child_main, name="kiln-engine", daemon=True,
                                        args=(child_end, self.path, self.backend, self.prefill_tokens, self.overlap))
        self._process.start()
        child_end.close()  # only the child holds its end now, so its exit reads as end of file here
        if not self._conn.poll(START_TIMEOUT):
            self._process.terminate()
            raise KilnError(f"the engine process did not start within {START_TIMEOUT:.0f} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise KilnError(f"the engine process ended while starting (exit code {self._process.exitcode})") from None
        if message[0] != "ready":
            self._process.join(5)
            raise KilnError(f"the engine process could not start: {message[1]}")
        return self

    def start(self) -> EngineProcess:
        self.warm_up()
        if not self._reader.is_alive():
            self._reader.start()
        return self

    def submit(self, generation: Generation) -> None:
        """Queue a generation; raises QueueFullError when max_queue requests already wait for a slot,
        EngineStoppedError after shutdown or once the child has died."""
        with self._lock:
            if self._stopping or self._closed.is_set() or self._process is None:
                raise EngineStoppedError("the server is shutting down" if self._stopping
                                         else "the engine is not running")
            waiting = len(self._generations) - self.capacity
            if waiting >= self.max_queue:
                raise QueueFullError(f"{waiting} requests are already waiting for one of {self.capacity} slots")
            key = next(self._ids)
            generation.handle = key
            self._generations[key] = generation
            self._send(("submit", key, generation.prompt_ids, generation.max_tokens, generation.sampler,
                        sorted(generation.stop_token_ids), list(generation.stops.stops),
                        generation.detokenizer is not None))

    def cancel(self, generation: Generation) -> None:
        """End a generation whose client has gone: the child frees its slot at its next step."""
        generation.cancelled = True
        with self._lock:
            if generation.handle in self._generations and not self._closed.is_set():
                self._send(("cancel", generation.handle))

    def shutdown(self, message: str = "the server is shutting down", timeout: float = 30.0) -> None:
        """Stop taking requests; the child ends every queued and running generation with an error event (which
        reaches its stream) and exits. May be called twice."""
        with self._shutting_down:  # a second call (the server's signal handler, then its lifespan) waits for the first
            with self._lock:
                first = not self._stopping
                self._stopping = True
                if first and self._process is not None and not self._closed.is_set():
                    self._send(("shutdown", message))
            if self._process is None or not first:
                return
            if self._reader.is_alive():
                self._closed.wait(timeout)
            else:  # never started: nobody reads the child's goodbye
                self._closed.set()
            self._process.join(timeout)
            if self._process.is_alive():
                log.warning("the engine process did not stop within %.0f s: terminating it", timeout)
                self._process.terminate()
                self._process.join(5)
            self._fail_all(message)

    # ---- the reader thread ----

    def _send(self, message: tuple) -> None:
        """(with self._lock held) a message to the child; a child that has gone reads as closed."""
        try:
            self._conn.send(message)
        except (OSError, ValueError):
            self._closed.set()

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "closed":
                break
            _, events, steps, self._queue_depth, self._running, self.cpu_seconds = message
            for batch, seconds in steps:
                self.metrics.step(batch, seconds)
            for key, event in events:
                self._deliver(key, event)
        if not self._stopping:
            code = self._process.exitcode if self._process is not None else None
            log.error("the engine process ended unexpectedly (exit code %s): failing the requests in flight", code)
        self._closed.set()
        self._fail_all("the engine process ended unexpectedly" if not self._stopping
                       else "the server is shutting down")

    def _deliver(self, key: int, event: Event) -> None:
        generation = self._generations.get(key)
        if generation is None:
            return
        now = time.perf_counter()
        if event.kind == "token":
            first = generation.first_token_at is None
            self.metrics.token(first, now - (generation.submitted if first else generation.last_token_at))
            if first:
                generation.first_token_at = now
            generation.last_token_at = now
            generation.completion_tokens += 1
        elif event.kind in ("done", "error"):
            generation.finish_reason = event.finish_reason if event.kind == "done" else "error"
            with self._lock:
                self._generations.pop(key, None)
            self.metrics.finished(generation)
        generation.emit(event)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            left, self._generations = list(self._generations.values()), {}
        for generation in left:
            if not generation.finished:
                generation.finish_reason = "error"
                self.metrics.finished(generation)
                generation.emit(Event("error", message=message))


class _Outbox:
    """The child's side: the engine thread's events and step times, sent to the parent by a thread of their own,
    everything that piled up since the last send in one message (a decode step's events arrive together)."""

    def __init__(self, conn: Any, engine: Callable[[], LLMEngine | None]):
        self._conn = conn
        self._engine = engine
        self._events: list[tuple[int, Event]] = []
        self._steps: list[tuple[int, float]] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kiln-engine-outbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, key: int, event: Event) -> None:
        with self._cond:
            self._events.append((key, event))
            self._cond.notify()

    def step(self, batch: int, seconds: float) -> None:
        with self._cond:
            self._steps.append((batch, seconds))

    def close(self) -> None:
        """Send what is left, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._events and not self._closing:
                    self._cond.wait()
                events, self._events = self._events, []
                steps, self._steps = self._steps, []
                closing = self._closing
            engine = self._engine()
            depth, running = (engine.queue_depth, engine.running) if engine is not None else (0, 0)
            if events or steps:
                try:
                    self._conn.send(("events", events, steps, depth, running, time.process_time()))
                except (OSError, ValueError):  # the parent has gone
                    return
            if closing:
                return


class _StepMetrics(EngineMetrics):
    """The child's engine metrics: decode steps go to the parent; tokens and finished requests the parent counts
    itself, from the events it receives."""

    def __init__(self, outbox: _Outbox):
        self.outbox = outbox

    def step(self, batch: int, seconds: float) -> None:
        self.outbox.step(batch, seconds)


def _child_main(conn: Any, path: str, backend: str, prefill_tokens: int | None, overlap: bool | None = None) -> None:
    """The engine process: load, warm up, say ready, then follow the parent's messages until shutdown or until
    the parent goes away. Ctrl-C and SIGTERM are the parent's to handle: it tells this process to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine: LLMEngine | None = None
    outbox = _Outbox(conn, lambda: engine)
    try:
        # the parent bounds the queue (it knows what it has sent): the child takes whatever arrives
        engine = LLMEngine(load(path), backend, max_queue=1 << 30, metrics=_StepMetrics(outbox),
                           prefill_tokens=prefill_tokens, overlap=overlap).warm_up()
    except BaseException as e:  # noqa: BLE001 (anything that stops the start is the parent's error message)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    generations: dict[int, Generation] = {}

    def emitter(key: int) -> Callable[[Event], None]:
        def emit(event: Event) -> None:
            if event.kind in ("done", "error"):
                generations.pop(key, None)
            outbox.post(key, event)
        return emit

    conn.send(("ready", engine.capacity))
    outbox.start()
    engine.start()
    message = "the server is shutting down"
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent has gone: stop
            break
        if request[0] == "submit":
            _, key, prompt_ids, max_tokens, sampler, stop_ids, stop_texts, detokenize = request
            detokenizer = engine.tokenizer.detokenizer() if detokenize and engine.tokenizer is not None else None
            generation = Generation(prompt_ids, max_tokens, sampler, stop_ids, stop_texts, emitter(key),
                                    detokenizer)
            generations[key] = generation
            try:
                engine.submit(generation)
            except KilnError as e:
                generations.pop(key, None)
                outbox.post(key, Event("error", message=str(e)))
        elif request[0] == "cancel":
            generation = generations.get(request[1])
            if generation is not None:
                engine.cancel(generation)
        elif request[0] == "shutdown":
            message = request[1]
            break
    engine.shutdown(message)
    outbox.close()
    try:
        conn.send(("closed",))
    except (OSError, ValueError):
        pass


__all__ = ["EngineProcess"]
