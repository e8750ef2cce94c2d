"""Greedy generation with an exported decoder LM: kept for compatibility, it lives in kiln.runtime.llm.decoding.

New code should use `kiln.llm.Generator` (sampling, stop tokens, text in and out, cache reuse across calls).
"""

from __future__ import annotations

from kiln.runtime.llm.decoding import decode_step, greedy_generate, prefill
from kiln.runtime.llm.info import MAX_CONTEXT_KEY, PREFILL_CHUNK_KEY

__all__ = ["MAX_CONTEXT_KEY", "PREFILL_CHUNK_KEY", "decode_step", "greedy_generate", "prefill"]
