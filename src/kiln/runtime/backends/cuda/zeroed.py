"""Device scratch that must read zero when a kernel first runs, and that the kernel itself leaves zero after every
launch (gemv.cu's add_rms_norm_route: a ticket counting the blocks that finished, reset by the last).

Outside a graph capture that is `cp.zeros`. Inside one, a memset would be recorded into the graph and replayed
before every launch of the kernel: one more node, and the kernel after a memset cannot be launched early
(launch.py). So a capture's scratch is listed here and CUDABackend.capture zeroes the list once, after the capture
ends and before the graph's first replay, and keeps it as long as the graph. It does not come from the graph's own
pool: that pool hands a capture's freed temporaries out again, so the scratch's memory could be written, at every
replay, by a kernel captured before it was allocated (a whole decode step's first replays picked wrong experts so).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_pending = threading.local()  # (each thread captures on its own)


def zeroed(cp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """An array that reads zero before the first kernel that uses it runs (see the module's docstring)."""
    if not cp.cuda.get_current_stream().is_capturing():
        return cp.zeros(shape, dtype=dtype)
    nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
    array = cp.ndarray(shape, dtype=dtype, memptr=cp.get_default_memory_pool().malloc(nbytes))
    _list().append(array)
    return array


def take_pending() -> list[Any]:
    """The arrays this thread's capture handed out uncleared since the last call (the capture zeroes them and
    keeps them with its graph)."""
    arrays = _list()
    _pending.arrays = []
    return arrays


def _list() -> list[Any]:
    if not hasattr(_pending, "arrays"):
        _pending.arrays = []
    return _pending.arrays
