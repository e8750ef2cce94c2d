"""kiln.llm.Sampler: greedy, temperature, top-k and top-p, checked against hand-computed distributions and against
transformers' own logits warpers; seeded reproducibility; argument errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kiln.llm import Sampler


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def random_logits(seed: int, n: int = 128) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3


def test_temperature_zero_is_argmax():
    for seed in range(5):
        logits = random_logits(seed)
        assert Sampler()(logits) == int(np.argmax(logits))
    assert Sampler()(np.array([1.0, 3.0, 3.0, 2.0])) == 1  # ties: the lowest id, as argmax


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = random_logits(0) / 3  # fairly flat: many tokens are likely
    runs = [[s(logits) for _ in range(30)] for s in (Sampler(1.0, seed=7), Sampler(1.0, seed=7), Sampler(1.0, seed=8))]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len(set(runs[0])) > 5  # really sampling, not a constant


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_and_tiny_top_p_are_greedy(seed):
    logits = random_logits(seed)
    for sampler in (Sampler(temperature=2.0, top_k=1, seed=seed), Sampler(temperature=2.0, top_p=1e-9, seed=seed)):
        assert [sampler(logits) for _ in range(10)] == [int(np.argmax(logits))] * 10
    tied = np.array([0.5, 2.0, 1.0, 2.0])
    assert Sampler(1.0, top_k=1)(tied) == 1 and Sampler(1.0, top_p=1e-9)(tied) == 1


def test_distribution_by_hand():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    ids, probs = Sampler(temperature=1.0).distribution(logits)  # no filter: every token, in id order
    np.testing.assert_array_equal(ids, [0, 1, 2, 3])
    np.testing.assert_allclose(probs, [0.1, 0.4, 0.2, 0.3])
    ids, probs = Sampler(temperature=1.0, top_k=2).distribution(logits)
    np.testing.assert_array_equal(ids, [1, 3])
    np.testing.assert_allclose(probs, [0.4 / 0.7, 0.3 / 0.7])
    ids, probs = Sampler(temperature=1.0, top_p=0.7).distribution(logits)  # 0.4 + 0.3 reaches 0.7: two tokens
    np.testing.assert_array_equal(ids, [1, 3])
    ids, _ = Sampler(temperature=1.0, top_p=0.71).distribution(logits)  # needs the third
    np.testing.assert_array_equal(ids, [1, 3, 2])
    ids, probs = Sampler(temperature=2.0).distribution(logits)
    np.testing.assert_allclose(probs, softmax(logits / 2))


def test_samples_follow_the_distribution():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    sampler = Sampler(temperature=1.0, seed=0)
    counts = np.bincount([sampler(logits) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, [0.1, 0.4, 0.2, 0.3], atol=0.015)
    sampler = Sampler(temperature=1.0, top_k=3, top_p=0.6, seed=0)  # top-3 = {1, 3, 2} renormalized; top-p keeps 1, 3
    counts = np.bincount([sampler(logits) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, [0, 4 / 7, 0, 3 / 7], atol=0.015)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (1.3, 20, 1.0), (1.0, 50, 0.5), (0.5, 5, 0.95)])
def test_filters_match_transformers_warpers(temperature, top_k, top_p):
    """The candidates and probabilities are those transformers samples from after its temperature, top-k and top-p
    warpers (applied in that order), on logits with no near-ties at the cut-offs."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = random_logits(3, 1000).astype(np.float64)
    warpers = [lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1:
        warpers.append(lp.TopPLogitsWarper(top_p))
    scores = torch.from_numpy(logits)[None]
    for warper in warpers:
        scores = warper(None, scores)
    want_probs = torch.softmax(scores, dim=-1)[0].numpy()
    ids, probs = Sampler(temperature, top_k, top_p).distribution(logits)
    assert sorted(ids.tolist()) == np.flatnonzero(want_probs > 0).tolist()
    np.testing.assert_allclose(probs, want_probs[ids], rtol=1e-9)


def test_half_precision_logits():
    logits = random_logits(4).astype(ml_dtypes.bfloat16)
    assert Sampler()(logits) == int(np.argmax(logits.astype(np.float32)))
    assert Sampler(1.0, top_k=1)(logits) == int(np.argmax(logits.astype(np.float32)))
    assert 0 <= Sampler(1.0, seed=0)(logits.astype(np.float16)) < 128


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be"),
    ({"temperature": "hot"}, "temperature must be"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p must be"),
    ({"seed": -3}, "seed must be None or an integer >= 0"),
    ({"seed": True}, "seed must be"),
])
def test_bad_arguments_are_explained(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampler(**kwargs)


def test_unusable_logits_are_explained():
    with pytest.raises(ValueError, match="logits are empty"):
        Sampler()(np.array([]))
    with pytest.raises(ValueError, match="NaN logits"):
        Sampler(1.0)(np.array([0.0, np.nan]))


def test_device_noise_samples_the_softmax():
    """The Gumbel-max draw that sample_rows makes (sampling.sample_rows_reference, the kernel's NumPy twin) picks
    token i with probability softmax(logits / T)[i], the same seed and counter give the same pick, and another
    counter another draw."""
    from kiln.runtime.llm.sampling import device_noise, sample_rows_reference

    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    temperature = 0.5
    draws = 20000
    picks = sample_rows_reference(np.tile(logits, (draws, 1)), np.full(draws, 1 / temperature, np.float32),
                                  np.full(draws, 7, np.uint64), np.arange(draws))
    want = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    np.testing.assert_allclose(np.bincount(picks, minlength=4) / draws, want, atol=0.012)
    np.testing.assert_array_equal(device_noise(7, 3, 50), device_noise(7, 3, 50))
    assert not np.array_equal(device_noise(7, 3, 50), device_noise(7, 4, 50))
    assert not np.array_equal(device_noise(7, 3, 50), device_noise(8, 3, 50))
    greedy = sample_rows_reference(np.array([[0.0, 2.0, 2.0], [np.nan, 0.0, 1.0]]), np.zeros(2, np.float32),
                                   np.zeros(2, np.uint64), np.zeros(2, np.int64))
    assert greedy.tolist() == [1, -1]  # inverse temperature 0: the argmax (ties: lowest id); a NaN row: -1


def test_device_draws_are_a_function_of_seed_and_count():
    """Sampler.device_draw: 1/T, the seed (one drawn once without a seed) and a counter that advances; only a
    temperature alone goes to the device (top-k and top-p need the host's sort)."""
    sampler = Sampler(0.8, seed=11)
    assert [sampler.device_draw() for _ in range(3)] == [(1 / 0.8, 11, 1), (1 / 0.8, 11, 2), (1 / 0.8, 11, 3)]
    unseeded = Sampler(1.0)
    first, second = unseeded.device_draw(), unseeded.device_draw()
    assert first[1] == second[1] and (first[2], second[2]) == (1, 2)
    assert Sampler(0.7).on_device and not Sampler().on_device
    assert not Sampler(0.7, top_k=5).on_device and not Sampler(0.7, top_p=0.9).on_device
