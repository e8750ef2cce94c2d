"""Whether a state dict read from a downloaded file fits the model it is meant for, said as the file's fault.

Why: load_state_dict on a mismatch raises torch's long RuntimeError after the model is allocated; the readers
build a skeleton on the meta device, compare first, and name what is missing, extra or misshapen."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def misfit(expected: Mapping[str, tuple[int, ...]], state: Mapping[str, Any], optional: Iterable[str] = ()) -> str:
    """'' when state holds exactly the expected names (those in optional may be absent) at the expected shapes;
    else what is missing, unexpected and of the wrong shape (eight of each at most)."""
    optional = set(optional)
    missing = [k for k in expected if k not in state and k not in optional]
    unexpected = [k for k in state if k not in expected]
    wrong = [f"{k} {list(v.shape)} (expected {list(expected[k])})" for k, v in state.items()
             if k in expected and tuple(v.shape) != expected[k]]
    if not (missing or unexpected or wrong):
        return ""
    return f"missing {missing[:8]}, unexpected {unexpected[:8]}, of the wrong shape {wrong[:8]}"
