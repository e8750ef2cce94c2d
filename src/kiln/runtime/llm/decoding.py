"""The two model calls of an exported decoder LM, without torch: prefill a prompt in chunks, and greedy decoding.

The program is what `kiln.models.llm.export_llama` writes: `prefill(tokens [1, T], cache_position [T])` and
`decode(token [1, 1], cache_position [1])`, each returning the last position's logits [1, vocab], with the KV cache
in the session's state buffers; a slotted program (exported with slots=N) takes each call's slots as a last input
and decodes several sequences per call. Positions are consecutive and continue where the cache ends (0 after a reset).
`Generator` (generator.py) builds sampling, stop tokens and cache reuse on these; `greedy_generate` is the plain
argmax loop the model tests compare with transformers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from kiln.errors import InputError
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.session import Session


def slot_inputs(info: LLMInfo, slots: Sequence[int]) -> tuple[np.ndarray, ...]:
    """The slot input of a slotted program's methods (none for a program of one sequence, where only slot 0
    exists)."""
    if info.slots is None:
        if any(s != 0 for s in slots):
            raise InputError(f"this program holds one sequence (slot 0), not slots {list(slots)}; export it with "
                             "--slots N to hold several")
        return ()
    if any(not 0 <= s < info.slots for s in slots):
        raise InputError(f"slots must be in [0, {info.slots}), got {list(slots)}")
    return (np.asarray(slots, dtype=np.int64),)


def _info(session: Session, info: LLMInfo | None) -> LLMInfo:
    """The program's LLM metadata: the caller's parsed copy (a loop calling once per token passes it), else
    parsed now."""
    return info if info is not None else LLMInfo.from_metadata(session.program.metadata)


def prefill(session: Session, prompt_ids: Sequence[int], start: int = 0, slot: int = 0,
            info: LLMInfo | None = None) -> np.ndarray:
    """Feed `prompt_ids` at positions start, start+1, ... in chunks (into `slot` of a slotted program); returns
    the last token's logits [vocab]."""
    info = _info(session, info)
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise InputError("the prompt is empty; give at least one token")
    slot_input = slot_inputs(info, [slot])
    logits = None
    for lo in range(0, ids.size, info.prefill_chunk):
        logits = prefill_chunk(session, ids[lo:lo + info.prefill_chunk], start + lo, slot_input)
    return session.backend.to_numpy(logits).reshape(-1)


def prefill_chunk(session: Session, ids: np.ndarray, start: int, slot_input: tuple[np.ndarray, ...] = ()) -> Any:
    """One prefill call: at most prefill_chunk tokens at positions start, start+1, ...; the backend's logits
    [1, vocab]. slot_input: () for a program of one sequence, (int64 [slot],) for a slotted one."""
    positions = np.arange(start, start + ids.size, dtype=np.int64)
    return session.run("prefill", ids.reshape(1, -1), positions, *slot_input)[0]


def decode_step(session: Session, token: int, position: int, slot: int = 0,
                info: LLMInfo | None = None) -> np.ndarray:
    """Feed one token at `position` (of `slot` in a slotted program); returns its logits [vocab] (the distribution
    of the token after it)."""
    return decode_batch(session, [token], [position], [slot], info).reshape(-1)


def decode_batch(session: Session, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                 info: LLMInfo | None = None, host: bool = True) -> Any:
    """One decode step of several sequences at once (a slotted program; one sequence otherwise): token b at
    positions[b] in slots[b]; returns logits [R, vocab] as NumPy, or with host=False as the backend's array (left
    where it is: a GPU's logits of a large vocabulary cost more to move than to reduce there). R = min(B, N) for a
    program with N slots (its LM head takes the first N rows: a step samples at most one row a slot; programs
    exported before it gave all B), B otherwise."""
    slot_input = slot_inputs(_info(session, info), slots)
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1, 1)
    logits = session.run("decode", ids, np.asarray(positions, dtype=np.int64).reshape(-1), *slot_input)[0]
    logits = logits.reshape(-1, logits.shape[-1])
    return session.backend.to_numpy(logits) if host else logits


def greedy_generate(session: Session, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | None = None, reset: bool = True) -> list[int]:
    """The `max_new_tokens` tokens (fewer at eos or when the cache is full) that argmax decoding picks.

    reset: start from an empty cache (the positions always start at 0, so only turn this off when the cache is
    known to be empty). Stops early after `eos_token_id` (which is included) or when the cache is full.
    """
    info = LLMInfo.from_metadata(session.program.metadata)
    max_context = info.max_context
    n_prompt = len(prompt_ids)
    if n_prompt > max_context:
        raise InputError(f"the prompt has {n_prompt} tokens but the program's cache holds {max_context}")
    if reset:
        session.reset_state()
    logits = prefill(session, prompt_ids, info=info)
    return greedy_continue(session, logits, n_prompt, max_new_tokens, () if eos_token_id is None else (eos_token_id,),
                           info)


def greedy_continue(session: Session, logits: Any, position: int, max_new_tokens: int,
                    stops: Collection[int] = (), info: LLMInfo | None = None) -> list[int]:
    """The argmax tokens after a prefill whose last logits are `logits` and whose next position is `position`: up
    to `max_new_tokens`, ending after a token of `stops` (included) or when the cache is full. Every token but a
    stop token is fed back (the last one too), so the cache then holds what was returned."""
    info = _info(session, info)
    scores = session.backend.to_numpy(logits).reshape(-1)
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(np.argmax(scores))
        out.append(token)
        if token in stops or position >= info.max_context:
            break
        scores = decode_step(session, token, position, info=info)
        position += 1
    return out


def prefill_embedded(session: Session, ids: Sequence[int], placeholder: int, rows: np.ndarray,
                     info: LLMInfo | None = None, blocks: np.ndarray | None = None) -> np.ndarray:
    """A multimodal prompt from an empty cache: the `embed` rows of `ids`, the rows of the `placeholder` tokens
    replaced in order by `rows` (an encoder's output), fed to `prefill_embeds` in chunks (with each position's block
    id when the program takes them); returns the last logits [vocab]."""
    info = _info(session, info)
    if len(ids) >= info.max_context:
        raise InputError(f"the prompt takes {len(ids)} positions (its media included); the program's cache holds "
                         f"{info.max_context}: give a shorter prompt or export with a larger max_context")
    embedded = np.array(session.backend.to_numpy(session.run("embed", np.array([ids], dtype=np.int64))[0]))
    embedded[0, np.asarray(ids) == placeholder] = rows.astype(embedded.dtype, copy=False)
    session.reset_state()
    logits = None
    for lo in range(0, len(ids), info.prefill_chunk):
        hi = min(lo + info.prefill_chunk, len(ids))
        extra = () if blocks is None else (blocks[lo:hi],)
        logits = session.run("prefill_embeds", embedded[:, lo:hi], np.arange(lo, hi, dtype=np.int64), *extra)[0]
    return session.backend.to_numpy(logits).reshape(-1)


__all__ = ["decode_batch", "decode_step", "greedy_continue", "greedy_generate", "prefill", "prefill_chunk",
           "prefill_embedded", "slot_inputs"]
