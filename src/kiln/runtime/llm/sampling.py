"""Choosing the next token from a logits vector, with NumPy: greedy, or temperature + top-k + top-p sampling.

The filters run in transformers' order (temperature, then top-k, then top-p), so a setting means what it means
there. Ties go to the lowest token id, as argmax gives them, so top_k=1 (or a tiny top_p) is exactly greedy.
"""

from __future__ import annotations

import math

import numpy as np


class Sampler:
    """Picks a token id from logits [vocab].

    temperature: 0 picks the argmax (greedy; top_k, top_p and seed are then unused); above 0 samples from
    softmax(logits / temperature), flatter for larger values.
    top_k: keep only the k most likely tokens (0: all).
    top_p: then keep the smallest set of most likely tokens whose probability adds up to at least top_p (nucleus
    sampling; 1.0: all). At least one token always remains.
    seed: seeds the sampler's own `np.random.default_rng`, so the same seed, settings and logits give the same
    tokens; None draws fresh entropy. The generator advances with every sampled token.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 keeps every token), got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise ValueError(f"seed must be None or an integer >= 0, got {seed!r}")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __repr__(self) -> str:
        if self.greedy:
            return "Sampler(greedy)"
        return f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, seed={self.seed})"

    def __call__(self, logits: np.ndarray) -> int:
        """The next token id."""
        scores = np.asarray(logits).reshape(-1).astype(np.float64)  # float64: also from bfloat16/float16 logits
        if scores.size == 0:
            raise ValueError("logits are empty")
        if self.greedy:
            return int(np.argmax(scores))
        candidates, weights = self._weights(scores)
        cumulative = np.cumsum(weights)  # unnormalized: one pass fewer over a large vocabulary
        pick = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
        pick = min(pick, weights.size - 1)
        return int(candidates[pick]) if candidates is not None else pick

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate token ids, their probabilities) after temperature, top-k and top-p, most likely first when
        a filter is on; the probabilities sum to 1. For a greedy sampler: the argmax alone."""
        scores = np.asarray(logits).reshape(-1).astype(np.float64)
        if self.greedy:
            return np.array([int(np.argmax(scores))]), np.ones(1)
        candidates, weights = self._weights(scores)
        return (np.arange(scores.size) if candidates is None else candidates), weights / weights.sum()

    def _weights(self, scores: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(candidate ids, or None for every id in order; their unnormalized probabilities exp(score / T - max))
        after the filters."""
        scores = scores / self.temperature
        top = scores.max()
        if not np.isfinite(top):
            raise ValueError(f"cannot sample: the largest logit / temperature is {top} (NaN logits, or a "
                             "temperature so small that it overflows; use temperature=0 for greedy)")
        if self.top_k and self.top_k < scores.size:
            order = _largest(scores, self.top_k)[:self.top_k]
            weights = np.exp(scores[order] - top)
            if self.top_p < 1:  # `order` is sorted by probability
                keep = int(np.searchsorted(np.cumsum(weights / weights.sum()), self.top_p, side="left")) + 1
                order, weights = order[:keep], weights[:keep]
            return order, weights
        weights = np.exp(scores - top)
        if self.top_p < 1:  # (also when top_k >= vocab)
            order = _nucleus(scores, weights, self.top_p)
            return order, weights[order]
        return None, weights


def _largest(scores: np.ndarray, count: int) -> np.ndarray:
    """The ids of the `count` largest scores, and every id tied with the smallest of them, most likely first, ties
    by id: the first ids of a stable sort by -score, without sorting the vocabulary (argpartition is O(vocab))."""
    if count >= scores.size:
        return np.argsort(-scores, kind="stable")
    part = np.argpartition(-scores, count - 1)[:count]
    ids = np.flatnonzero(scores >= scores[part].min())  # in id order, so the stable sort keeps ties by id
    return ids[np.argsort(-scores[ids], kind="stable")]


NUCLEUS_FIRST = 256
"""Candidates _nucleus sorts first (then 8x as many, until the nucleus is inside): a stable sort of a 128k
vocabulary took 11 ms a token, where the nucleus of a real distribution is a few hundred tokens at most."""


def _nucleus(scores: np.ndarray, weights: np.ndarray, top_p: float) -> np.ndarray:
    """The most likely ids (ties by id) whose probability first adds up to at least top_p, found among the largest
    scores only, growing the set until it holds them."""
    total = weights.sum()
    count = NUCLEUS_FIRST
    while True:
        order = _largest(scores, count)
        keep = int(np.searchsorted(np.cumsum(weights[order]) / total, top_p, side="left")) + 1
        if keep <= order.size or order.size == scores.size:
            return order[:keep]
        count *= 8


__all__ = ["Sampler"]
