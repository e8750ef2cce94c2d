"""A fixed-seed sample of the .kiln fuzzer (mutator.py): every mutant is refused with ProgramFormatError or loads
and runs; no other exception, no crash, no hang. The long campaign: `python -m tests.format.fuzz_campaign`."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.format.fuzz_seeds import seeds
from tests.format.mutator import encode, judge, mutant

MUTANTS_PER_SEED = 500


@pytest.fixture(scope="module")
def seed_programs():
    return seeds()


def test_seeds_load_and_run(seed_programs):
    for seed in seed_programs:
        assert judge(encode(seed.program, seed.data)) == "ran", seed.name


@pytest.mark.parametrize("index", range(4))
def test_mutants_never_escape(seed_programs, index):
    seed = seed_programs[index]
    rng = random.Random(f"kiln-fuzz-{seed.name}")
    outcomes: Counter = Counter()
    for _ in range(MUTANTS_PER_SEED):
        raw = mutant(seed, rng)
        outcomes["unencodable" if raw is None else judge(raw)] += 1
    # the sample must reach both sides of the verifier, or it tests nothing
    assert outcomes["rejected"] > MUTANTS_PER_SEED // 4, outcomes
    assert outcomes["ran"] + outcomes["input-error"] > 0, outcomes
