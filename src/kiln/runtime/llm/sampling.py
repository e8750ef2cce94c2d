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
        self._device_seed: int | None = None
        self._draws = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def on_device(self) -> bool:
        """Whether a backend that samples where the logits are (Backend.samples_on_device) can take this sampler's
        draws: a temperature alone, drawn by the Gumbel-max trick (device_noise); top-k and top-p need the host."""
        return not self.greedy and self.top_k == 0 and self.top_p == 1.0

    def device_draw(self) -> tuple[float, int, int]:
        """(1 / temperature, seed, counter) of this sampler's next draw on the device: the noise of draw n is a
        function of (seed, n), so a seeded sequence samples the same tokens alone or in any batch. Without a
        seed, one is drawn from the sampler's generator once."""
        if self._device_seed is None:
            self._device_seed = self.seed if self.seed is not None else int(self.rng.integers(0, 1 << 63))
        self._draws += 1
        return 1.0 / self.temperature, self._device_seed, self._draws

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
        cumulative = np.cumsum(weights, out=weights)  # unnormalized: one pass fewer over a large vocabulary
        pick = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
        pick = min(pick, cumulative.size - 1)
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
        after the filters. scores: the caller's own float64 copy, divided in place (no second copy of a large
        vocabulary: each costs its page faults)."""
        scores /= self.temperature
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
        weights = scores - top
        np.exp(weights, out=weights)
        if self.top_p < 1:  # (also when top_k >= vocab)
            order = _nucleus(scores, weights, self.top_p)
            return order, weights[order]
        return None, weights


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's mixer on uint64 arrays (wrapping), as kernels/argmax.cu's mix64."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def device_noise(seed: int, counter: int, size: int) -> np.ndarray:
    """The Gumbel noise (float32 [size]) of draw `counter` of `seed` that kernels/argmax.cu's sample_rows adds to
    logits / temperature: -log(-log(u)), u from 24 bits of a counter hash of (seed, counter, index), in (0, 1)."""
    key = _mix64(np.array([seed], np.uint64) ^ _mix64(np.array([counter], np.uint64)))
    bits = _mix64(key ^ _mix64(np.arange(size, dtype=np.uint64))) >> np.uint64(40)
    u = (bits.astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
    return -np.log(-np.log(u))


def sample_rows_reference(rows: np.ndarray, inv_temperature: np.ndarray, seeds: np.ndarray,
                          counters: np.ndarray) -> np.ndarray:
    """sample_rows in NumPy: each row's index of the largest row * inv_temperature + device_noise (the argmax
    where inv_temperature is 0; -1 for a row with a NaN), in float32 as the kernel computes it."""
    rows = np.asarray(rows).reshape(len(inv_temperature), -1).astype(np.float32)
    picks = np.empty(rows.shape[0], np.int64)
    for r, row in enumerate(rows):
        if np.isnan(row).any():
            picks[r] = -1
            continue
        scale = np.float32(inv_temperature[r])
        values = row if scale == 0 else row * scale + device_noise(int(seeds[r]), int(counters[r]), row.size)
        picks[r] = int(np.argmax(values))
    return picks


def _largest(scores: np.ndarray, count: int) -> np.ndarray:
    """The ids of the `count` largest scores, and every id tied with the smallest of them, most likely first, ties
    by id: the first ids of a stable sort by -score, without sorting the vocabulary (argpartition is O(vocab))."""
    if count >= scores.size:
        return np.argsort(-scores, kind="stable")
    part = np.argpartition(scores, scores.size - count)[scores.size - count:]  # (no negated copy of the scores)
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


__all__ = ["Sampler", "device_noise", "sample_rows_reference"]
