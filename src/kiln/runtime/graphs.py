"""What a session keeps to replay a method as one captured graph (CUDA graphs on the cuda backend) or to run it as
one compiled function (mx.compile on the mlx backend).

A decode step of a small LLM is hundreds of kernels of a few microseconds each; launched one by one from Python,
the launches, not the GPU, set the pace. Captured once per input-shape signature and replayed, the step costs one
launch. A graph reads and writes fixed addresses, so a capture owns static input buffers (each run's inputs are
copied in), its intermediates' memory (a private pool, kept while the graph lives) and its outputs (copied out
after each replay, since the next replay rewrites them), and the session's state buffers stay the same arrays.

A compiled function is the functional form of the same idea: it takes the inputs and the state buffers and returns
the outputs and the new state, so the Python loop over the nodes runs once, when the function is traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError

WARMUP_RUNS = 1
"""Runs of a signature op by op before it is captured: the first compiles kernels and sets up cuBLAS, which must
not happen inside a capture; and a signature seen once (a prefill of an odd length) is not worth compiling."""

MAX_GRAPHS_PER_METHOD = 16
"""Captured signatures kept per method; the least recently used gives its graph and memory back. A serving
engine's decode steps come in 15 padded row counts (kiln.runtime.serve.engine.padded_rows) for 64 slots and a
256-token prefill chunk."""


class CaptureError(KilnError):
    """A method could not be captured (a kernel synchronizes with the host, or runs on the host): it runs op by
    op instead."""


@dataclass
class Replay:
    inputs: list[Any]
    outputs: list[Any]
    graph: Any  # the backend's captured graph: launch() replays it; holding it keeps its memory


@dataclass
class Compiled:
    function: Any  # (inputs, state) -> (outputs, new values of the updated state buffers)
    calls: int = 0
