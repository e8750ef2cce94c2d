"""Running test work on threads started together (tests/runtime: concurrency and load tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_threads(count: int, work: Callable[[int], Any], timeout: float = 120) -> list[Any]:
    """work(k) on `count` threads started together; re-raises the first failure; results by thread."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def target(k: int) -> None:
        try:
            barrier.wait()
            results[k] = work(k)
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=target, args=(k,), daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results
