"""Text generation with an exported language model, without torch: `Generator` and `ChatSession`.

A Generator owns one session of the program, so one KV cache, and remembers which token ids that cache holds. A
new prompt that starts with some of them only prefills the rest: the next turn of a chat, whose rendered prompt
repeats the whole conversation, costs only the new message. A cache can be rewound (its tail overwritten) by up
to `LLMInfo.max_rewind` positions; beyond that it is reset and the prompt prefilled from the start.

Generation never runs past the cache: a prompt longer than max_context is refused with the numbers, and a
generation that reaches the end of the cache stops with stop_reason "context_full".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kiln.errors import InputError
from kiln.runtime.llm.decoding import decode_batch, prefill
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.llm.sampling import Sampler
from kiln.runtime.llm.tokenizer import LLMTokenizer, Message
from kiln.runtime.program import Program, load

STOP_REASONS = ("stop_token", "max_new_tokens", "context_full")

Prompt = str | Sequence[int] | Sequence[Message]
"""Text, token ids, or chat messages ({"role", "content"} mappings, rendered with the chat template)."""


class ContextFullError(InputError):
    """A prompt (or a chat's history plus room for the reply) does not fit in the program's context.

    needed: the tokens it would take; max_context: the tokens the program's cache holds.
    """

    def __init__(self, message: str, needed: int, max_context: int):
        super().__init__(message)
        self.needed, self.max_context = needed, max_context


@dataclass
class GenerationStats:
    """What one generation did and how fast.

    prompt_tokens: the prompt's length; cached_tokens of them were already in the KV cache from the previous call
    and were not run again, so prefill ran prompt_tokens - cached_tokens (`prefilled_tokens`).
    new_tokens: tokens generated, not counting a stop token (stop_token_id says which one ended it).
    decode_steps: single-token `decode` calls (new_tokens - 1, or new_tokens when a stop token was sampled: the
    first token comes from the prefill's logits and the last one is never fed back).
    Seconds cover the model calls (prefill, decode) including copying the logits to NumPy (or, greedy, picking the
    argmax where they are), not sampling.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_tokens: int = 0
    decode_steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str | None = None
    stop_token_id: int | None = None

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefilled_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def summary(self) -> str:
        """One line for a terminal: prompt, prefill speed, new tokens, decode speed, why it stopped."""
        cached = f", {self.cached_tokens} from cache" if self.cached_tokens else ""
        reason = self.stop_reason or "running"
        if self.stop_reason == "stop_token":
            reason += f" {self.stop_token_id}"
        return (f"prompt {self.prompt_tokens} tokens{cached} (prefill {self.prefill_tokens_per_second:.1f} tokens/s), "
                f"{self.new_tokens} new tokens (decode {self.decode_tokens_per_second:.1f} tokens/s), stop: {reason}")


class TokenEvent(NamedTuple):
    """One step of a stream: the token generated, and the text it completed.

    text is "" while a character or word is still incomplete, and always "" without a tokenizer. The last event
    of a stream may carry token_id None: the text held back until then (only when the generation ended inside a
    multi-byte character).
    """

    token_id: int | None
    text: str


@dataclass
class GenerationResult:
    """A finished generation: text (None without a tokenizer), the new token ids (no stop token), stats."""

    text: str | None
    token_ids: list[int]
    stats: GenerationStats


class Stream(Iterator[TokenEvent]):
    """The generation in progress: iterate for TokenEvents; text, token_ids and stats fill in as it runs.

    A Generator runs one generation at a time: starting another one (or resetting) ends this stream, and
    resuming it afterwards raises RuntimeError.
    """

    def __init__(self, steps: Iterator[TokenEvent], stats: GenerationStats, has_text: bool,
                 on_finish: Callable[[Stream], None] | None = None):
        self._steps = steps
        self.stats = stats
        self.token_ids: list[int] = []
        self._pieces: list[str] = []
        self._has_text = has_text
        self.on_finish = on_finish
        """Called with this stream once, when it ends (ChatSession uses it to add the reply to the history)."""
        self.finished = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> TokenEvent:
        try:
            event = next(self._steps)
        except StopIteration:
            if not self.finished:
                self.finished = True
                if self.on_finish is not None:
                    self.on_finish(self)
            raise
        if event.token_id is not None:
            self.token_ids.append(event.token_id)
        self._pieces.append(event.text)
        return event

    @property
    def text(self) -> str | None:
        """The text generated so far (None when the program has no tokenizer)."""
        return "".join(self._pieces) if self._has_text else None

    def result(self) -> GenerationResult:
        """Run to the end and return the whole generation."""
        for _ in self:
            pass
        return GenerationResult(self.text, list(self.token_ids), self.stats)


class Generator:
    """Generates text (or token ids) with an exported language model on one backend.

    program_or_path: a loaded kiln Program or the path of a .kiln file, made by `kiln export-llm` (or
    kiln.models.llm.export_llm / export_llama). Without a tokenizer in the program, prompts must be token ids and
    results carry no text.

        gen = Generator("smollm2.kiln")
        for event in gen.stream("Tell me a joke.", chat=True, max_new_tokens=64):
            print(event.text, end="", flush=True)
    """

    def __init__(self, program_or_path: Program | str | os.PathLike, backend: str = "cpu"):
        self.program = program_or_path if isinstance(program_or_path, Program) else load(program_or_path)
        self.info = LLMInfo.from_metadata(self.program.metadata)
        if not {"prefill", "decode"} <= set(self.program.methods):
            raise InputError(f"this program has methods {self.program.methods}, not prefill and decode: it is not a "
                             "language model exported with `kiln export-llm` (kiln.models.llm.export_llm)")
        self.tokenizer = LLMTokenizer.from_info(self.info) if self.info.tokenizer_json else None
        self.session = self.program.session(backend)
        self.cached: list[int] = []
        """The token ids whose keys and values the cache holds, at positions 0, 1, ..."""
        self._epoch = 0

    @property
    def max_context(self) -> int:
        return self.info.max_context

    def reset(self) -> None:
        """Empty the KV cache (the next prompt is prefilled from the start); ends a running stream."""
        self._epoch += 1
        self.session.reset_state()
        self.cached = []

    def _require_tokenizer(self, what: str) -> LLMTokenizer:
        if self.tokenizer is None:
            raise InputError(f"{what} needs a tokenizer, and this program carries none, so it takes token ids only; "
                             "re-export the model with `kiln export-llm` from a checkpoint that has a tokenizer.json")
        return self.tokenizer

    def encode_prompt(self, prompt: Prompt, chat: bool = False, system: str | None = None) -> list[int]:
        """The token ids generation starts from.

        prompt: text (encoded with the tokenizer's special tokens, e.g. BOS, as transformers does), token ids (used
        as they are), or chat messages. chat: treat text as one user message and apply the chat template, with
        `system` as a system message before it; messages always go through the template.
        """
        if isinstance(prompt, str):
            tokenizer = self._require_tokenizer("a text prompt")
            if not chat:
                if system is not None:
                    raise ValueError("system= is a chat option; pass chat=True to use it")
                return tokenizer.encode(prompt, add_special_tokens=True)
            messages: list[Message] = [{"role": "user", "content": prompt}]
        else:
            items = list(prompt)
            if not items or not isinstance(items[0], Mapping):
                if chat or system is not None:
                    raise ValueError("chat=True and system= need text or messages, not token ids")
                if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) for t in items):
                    raise InputError("a prompt given as a list must hold token ids (ints) or chat messages (dicts)")
                return [int(t) for t in items]
            messages = items
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return self._require_tokenizer("a chat prompt").apply_chat_template(messages, add_generation_prompt=True)

    def stream(self, prompt: Prompt, max_new_tokens: int | None = 128, sampler: Sampler | None = None, *,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
               stop_token_ids: Sequence[int] | None = None, chat: bool = False,
               system: str | None = None) -> Stream:
        """Start generating; iterate the returned Stream for TokenEvents as each token is produced.

        max_new_tokens: the most tokens to generate (None: until a stop token or the end of the context; 0 only
        prefills the prompt, which warms the cache for a later call that extends it).
        sampler: how to pick tokens; without one, a Sampler(temperature, top_k, top_p, seed) (greedy by default).
        stop_token_ids: tokens that end the generation (default: the program's); the stop token is neither in the
        token ids nor in the text (stats.stop_token_id records it).
        chat, system: see encode_prompt.
        Raises InputError (ContextFullError) before running anything when the prompt does not fit the context.
        """
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or max_new_tokens < 0):
            raise ValueError(f"max_new_tokens must be None or >= 0, got {max_new_tokens!r}")
        if sampler is None:
            sampler = Sampler(temperature, top_k, top_p, seed)
        elif (temperature, top_k, top_p, seed) != (0.0, 0, 1.0, None):
            raise ValueError("give either a sampler or temperature/top_k/top_p/seed, not both")
        stops = frozenset(int(t) for t in (self.info.stop_token_ids if stop_token_ids is None else stop_token_ids))
        ids = self.encode_prompt(prompt, chat, system)
        self._check_prompt(ids)
        stats = GenerationStats(prompt_tokens=len(ids))
        self._epoch += 1
        detokenizer = self.tokenizer.detokenizer() if self.tokenizer is not None else None
        steps = self._run(ids, max_new_tokens, sampler, stops, stats, detokenizer, self._epoch)
        return Stream(steps, stats, has_text=detokenizer is not None)

    def generate(self, prompt: Prompt, max_new_tokens: int | None = 128, sampler: Sampler | None = None,
                 **options: Any) -> GenerationResult:
        """The whole generation at once: text, token ids and stats (the options are those of `stream`)."""
        return self.stream(prompt, max_new_tokens, sampler, **options).result()

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InputError("the prompt is empty: give at least one token")
        if len(ids) > self.max_context:
            raise ContextFullError(f"the prompt has {len(ids)} tokens but the program's context holds "
                                   f"{self.max_context}; shorten the prompt, or re-export the model with a larger "
                                   "--max-context", len(ids), self.max_context)
        vocab = self.info.vocab_size
        if vocab is not None:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InputError(f"token ids must be in [0, {vocab}), the model's vocabulary; got {bad[:5]}")

    def _check_epoch(self, epoch: int) -> None:
        if self._epoch != epoch:
            raise RuntimeError("this generation was ended by a later call on the same Generator (a new generation "
                               "or reset); a Generator runs one generation at a time")

    def _reuse(self, ids: list[int]) -> int:
        """How many leading prompt tokens the cache already holds and keeps; resets the cache when it keeps none."""
        common = 0
        for cached, new in zip(self.cached, ids):
            if cached != new:
                break
            common += 1
        common = min(common, len(ids) - 1)  # the last prompt token must run again: its logits pick the next token
        if len(self.cached) - common > self.info.max_rewind(len(self.cached)):
            common = 0
        if common == 0:
            self.session.reset_state()
        return common

    def _run(self, ids: list[int], max_new_tokens: int | None, sampler: Sampler, stops: frozenset[int],
             stats: GenerationStats, detokenizer: Any, epoch: int) -> Iterator[TokenEvent]:
        self._check_epoch(epoch)  # (the body runs at the first next(), maybe after another call began)
        start = self._reuse(ids)
        stats.cached_tokens = start
        self.cached = []  # until prefill succeeds the cache's contents are unknown: the next call starts over
        t0 = time.perf_counter()
        logits = prefill(self.session, ids[start:], start, info=self.info)
        stats.prefill_seconds = time.perf_counter() - t0
        self.cached = list(ids)
        position = len(ids)
        if max_new_tokens == 0:
            stats.stop_reason = "max_new_tokens"
            return
        token = sampler(logits)
        while True:
            if token in stops:
                stats.stop_reason, stats.stop_token_id = "stop_token", token
                break
            stats.new_tokens += 1
            yield TokenEvent(token, detokenizer.push(token) if detokenizer is not None else "")
            self._check_epoch(epoch)
            if max_new_tokens is not None and stats.new_tokens >= max_new_tokens:
                stats.stop_reason = "max_new_tokens"
                break
            if position >= self.max_context:
                stats.stop_reason = "context_full"
                break
            t0 = time.perf_counter()
            fed = token
            logits = decode_batch(self.session, [fed], [position], [0], self.info, host=not sampler.greedy)
            # greedy: the argmax where the logits are (a GPU sends one integer, not the vocabulary's logits), the
            # same pick as the sampler's (ties to the lowest id); timed as the logits' copy was, with the step
            picked = None if isinstance(logits, np.ndarray) else int(self.session.backend.argmax_rows(logits)[0])
            stats.decode_seconds += time.perf_counter() - t0
            token = sampler(logits) if picked is None else picked
            stats.decode_steps += 1
            self.cached.append(fed)
            position += 1
        if detokenizer is not None:
            tail = detokenizer.finish()
            if tail:
                yield TokenEvent(None, tail)


class ChatSession:
    """A conversation with a chat model: the message history, rendered with the chat template each turn.

    Each `send` renders the whole history plus the new user message; the Generator's cache already holds all of it
    but the new message, so only that is prefilled. The reply is appended to the history when its stream ends.
    When the history plus `reply_room` tokens no longer fits in the context, `send` raises ContextFullError: call
    `clear()` to start over (keeping the system prompt).

    generation options (max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, sampler) are those of
    Generator.stream and apply to every turn; with a seed, the turns share one sampler (reproducible as a whole).
    """

    OPTIONS = frozenset({"max_new_tokens", "sampler", "temperature", "top_k", "top_p", "seed", "stop_token_ids"})

    def __init__(self, generator: Generator, system: str | None = None, reply_room: int = 32, **options: Any):
        unknown = sorted(set(options) - self.OPTIONS)
        if unknown:
            raise TypeError(f"ChatSession got unknown option(s) {unknown}; it takes {sorted(self.OPTIONS)}")
        if reply_room < 0:
            raise ValueError(f"reply_room must be >= 0, got {reply_room}")
        generator._require_tokenizer("a chat")
        if not generator.tokenizer.chat_template:
            raise InputError("this program has no chat template, so it cannot chat; use plain prompts (`kiln "
                             "generate`), or re-export a chat (instruct) model with `kiln export-llm`")
        self.generator = generator
        self.system = system
        self.reply_room = reply_room
        if "sampler" not in options:
            sampling = {k: options.pop(k) for k in ("temperature", "top_k", "top_p", "seed") if k in options}
            options["sampler"] = Sampler(**sampling)
        self.options = options
        self.messages: list[dict[str, str]] = []
        self.clear()

    def clear(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def send(self, user_text: str) -> Stream:
        """Start the assistant's reply to `user_text`; iterate the Stream for its text. The exchange joins the
        history when the stream ends (a stream abandoned midway leaves the history as it was)."""
        messages = [*self.messages, {"role": "user", "content": user_text}]
        ids = self.generator.tokenizer.apply_chat_template(messages)
        max_new = self.options.get("max_new_tokens", 128)
        room = min(self.reply_room, max_new) if max_new is not None else self.reply_room
        if len(ids) + room > self.generator.max_context:
            raise ContextFullError(f"the context is full: the conversation takes {len(ids)} tokens, and with room "
                                   f"for a {room}-token reply that exceeds the model's {self.generator.max_context}; "
                                   "clear() the history to go on", len(ids) + room, self.generator.max_context)

        def commit(stream: Stream) -> None:
            self.messages = [*messages, {"role": "assistant", "content": stream.text or ""}]

        stream = self.generator.stream(ids, **self.options)
        stream.on_finish = commit
        return stream

    def ask(self, user_text: str) -> str:
        """The whole reply to `user_text` at once."""
        return self.send(user_text).result().text or ""


__all__ = ["ChatSession", "ContextFullError", "GenerationResult", "GenerationStats", "Generator", "STOP_REASONS",
           "Stream", "TokenEvent"]
