"""The CPU sdpa narrows k/v to the keys some query can see (a static cache's unwritten slots cost nothing)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.runtime.backends.cpu import attention


def _reference(q, k, v, mask):
    scores = np.where(mask, q.astype(np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]), -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("lo,hi", [(0, 5), (3, 9), (2, 16), (0, 16)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_masked_out_key_ranges_do_not_change_the_result(lo, hi, kv_heads):
    rng = np.random.default_rng(lo * 100 + hi)
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv_heads, 16, 8)).astype(np.float32) for _ in range(2))
    mask = np.zeros((1, 1, 3, 16), dtype=bool)
    for i in range(3):  # a sliding window ending at a different key per query, inside [lo, hi)
        mask[..., i, max(lo, hi - 3 - i):hi - i] = True
    got = attention.sdpa(q, k, v, mask, causal=False, scale=None)
    g = 4 // kv_heads
    want = _reference(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1), mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_narrowing_reads_only_the_visible_range():
    k = np.arange(2 * 10 * 4, dtype=np.float32).reshape(1, 2, 10, 4)
    mask = np.zeros((1, 1, 2, 10), dtype=bool)
    mask[..., 0, 2:4] = mask[..., 1, 3:6] = True
    nk, nv, nmask = attention._visible_keys(k, k, mask)
    assert nk.shape == (1, 2, 4, 4) and np.array_equal(nk, k[..., 2:6, :]) and nmask.shape == (1, 1, 2, 4)
    everything = np.ones_like(mask)
    assert attention._visible_keys(k, k, everything)[0] is k
