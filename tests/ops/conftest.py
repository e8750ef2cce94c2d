"""The op tests' session: one directory of exported programs for every backend's run of a case (harness.PROGRAMS)."""

from __future__ import annotations

import os

import pytest

from tests.ops import harness


@pytest.fixture(scope="session", autouse=True)
def _shared_programs(tmp_path_factory):
    """pytest-xdist's workers each have a directory of their own under one for the run: the programs go there."""
    root = tmp_path_factory.getbasetemp()
    harness.PROGRAMS = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "op-programs"
    harness.PROGRAMS.mkdir(exist_ok=True)
    yield
    harness.PROGRAMS = None
