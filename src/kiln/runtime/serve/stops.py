"""Stop strings on streamed text: the text a stream may show now, and whether a stop string has appeared.

A stop string can arrive split over several tokens, so the tail of the text that could still grow into one is held
back until the next token settles it; when one appears, the text before it is the rest of the stream (the stop
string itself is not part of the output, as in OpenAI's API).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Feed text pieces in order; each call returns (text safe to show now, stopped)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        text = self._held + piece
        if not self.stops:
            return text, False
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)], True
        keep = self._partial_tail(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def finish(self) -> str:
        """The held-back text, once the stream ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_tail(self, text: str) -> int:
        """The length of the longest end of `text` that is the start of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best


__all__ = ["StopText"]
