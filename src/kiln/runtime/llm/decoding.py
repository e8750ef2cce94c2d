"""The two model calls of an exported decoder LM, without torch: prefill a prompt in chunks, and greedy decoding.

The program is what `kiln.models.llm.export_llama` writes: `prefill(tokens [1, T], cache_position [T])` and
`decode(token [1, 1], cache_position [1])`, each returning the last position's logits [1, vocab], with the KV cache
in the session's state buffers. Positions are consecutive and continue where the cache ends (0 after a reset).
`Generator` (generator.py) builds sampling, stop tokens and cache reuse on these; `greedy_generate` is the plain
argmax loop the model tests compare with transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.errors import InputError
from kiln.runtime.llm.info import LLMInfo
from kiln.runtime.session import Session


def prefill(session: Session, prompt_ids: Sequence[int], start: int = 0) -> np.ndarray:
    """Feed `prompt_ids` at positions start, start+1, ... in chunks; returns the last token's logits [vocab]."""
    chunk = LLMInfo.from_metadata(session.program.metadata).prefill_chunk
    ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise InputError("the prompt is empty; give at least one token")
    logits = None
    for lo in range(0, ids.size, chunk):
        piece = ids[lo:lo + chunk]
        positions = np.arange(start + lo, start + lo + piece.size, dtype=np.int64)
        logits = session.run("prefill", piece[None, :], positions)[0]
    return session.backend.to_numpy(logits).reshape(-1)


def decode_step(session: Session, token: int, position: int) -> np.ndarray:
    """Feed one token at `position`; returns its logits [vocab] (the distribution of the token after it)."""
    logits = session.run("decode", np.array([[token]], dtype=np.int64), np.array([position], dtype=np.int64))[0]
    return session.backend.to_numpy(logits).reshape(-1)


def greedy_generate(session: Session, prompt_ids: Sequence[int], max_new_tokens: int,
                    eos_token_id: int | None = None, reset: bool = True) -> list[int]:
    """The `max_new_tokens` tokens (fewer at eos or when the cache is full) that argmax decoding picks.

    reset: start from an empty cache (the positions always start at 0, so only turn this off when the cache is
    known to be empty). Stops early after `eos_token_id` (which is included) or when the cache is full.
    """
    max_context = LLMInfo.from_metadata(session.program.metadata).max_context
    n_prompt = len(prompt_ids)
    if n_prompt > max_context:
        raise InputError(f"the prompt has {n_prompt} tokens but the program's cache holds {max_context}")
    if reset:
        session.reset_state()
    logits = prefill(session, prompt_ids)
    out: list[int] = []
    position = n_prompt
    while len(out) < max_new_tokens:
        token = int(np.argmax(logits))
        out.append(token)
        if token == eos_token_id or position >= max_context:
            break
        logits = decode_step(session, token, position)
        position += 1
    return out


__all__ = ["decode_step", "greedy_generate", "prefill"]
