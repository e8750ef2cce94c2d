"""The MLX backend: a program's ops with Apple's MLX, on an Apple GPU (Metal) on a Mac and on the CPU elsewhere.

MLX builds a lazy graph of array operations and runs it when a result is needed. The backend follows that model
rather than calling MLX op by op from Python: each method, per input-shape signature, becomes one function of its
inputs and state buffers compiled with mx.compile (kiln.runtime.session), which traces the kernels once and lets
MLX fuse elementwise chains; KILN_MLX_COMPILE=0 or `graphs=False` turns that off. Constants become MLX arrays once
per program, shared by its sessions (constants.py); weights that MLX has a faster format for (quantized linear
and embedding) and graph patterns that map onto its fused primitives (RoPE) are converted when a session plans a
method (prepare.py). State buffers (KV caches) are values: a run returns their new versions, and an update written
in place on the old buffer (index_put, slice_scatter, rope_cache_update with in_place) reuses its memory when
nothing else holds it, which MLX decides when it evaluates.

Inputs may be NumPy or MLX arrays; outputs are MLX arrays (`backend.to_numpy` copies one to NumPy).

Importing this module needs nothing; a session on "mlx" needs `pip install mlx` (macOS) or `pip install
"mlx[cpu]"` (Linux): `pip install "kiln[mlx]"` picks the right one.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.errors import BackendUnavailableError
from kiln.ir.graph import Method, Node, StateBuffer
from kiln.runtime.backends.base import Backend, Kernel
from kiln.runtime.program import Program

INSTALL = 'pip install mlx' if platform.system() == "Darwin" else 'pip install "mlx[cpu]"'


def _mlx() -> Any:
    """mlx.core, or a BackendUnavailableError that says what to install."""
    try:
        import mlx.core as mx
    except ImportError as e:
        raise BackendUnavailableError(f"the mlx backend needs MLX: `{INSTALL}` (or `pip install \"kiln[mlx]\"`); "
                                      f"the cpu backend needs nothing ({e})") from None
    return mx


class MLXBackend(Backend):
    name = "mlx"
    can_compile = True
    graphs_by_default = os.environ.get("KILN_MLX_COMPILE", "1") != "0"

    def __init__(self, program: Program):
        self.mx = _mlx()
        from kiln.runtime.backends.mlx import arrays, constants, prepare
        from kiln.runtime.backends.mlx.kernels import MLX_KERNELS

        self.program = program
        self.kernels = MLX_KERNELS.kernels
        self._arrays = arrays
        self._constants = constants.for_program(program)
        self._prepare = prepare

    def constant(self, index: int) -> Any:
        return self._constants.array(index)

    def initial_state(self, index: int, buffer: StateBuffer) -> Any:
        """Evaluated at once: an unevaluated array belongs to the stream of the thread that made it, and a session
        made on one thread may run on another (a server's engine thread)."""
        mx = self.mx
        if buffer.init >= 0:
            state = mx.array(self.constant(buffer.init))  # its own array object: kernels may rebind it
        else:
            state = mx.zeros(buffer.shape, dtype=self._arrays.mx_dtype(buffer.dtype))
        mx.eval(state)
        return state

    def asarray(self, x: Any) -> Any:
        return self._arrays.to_mlx(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        return self._arrays.to_numpy(x)

    def numpy_dtype(self, x: Any) -> np.dtype:
        if isinstance(x, self.mx.array):
            return self._arrays.NUMPY_OF_MX[x.dtype]
        return np.asarray(x).dtype

    def copy(self, x: Any) -> Any:
        """A new array object with x's value (MLX arrays are values; only the object is new)."""
        return self.mx.array(x)

    def compile(self, fn: Callable[[list[Any], list[Any]], tuple[list[Any], list[Any]]]) -> Callable[..., Any]:
        return self.mx.compile(fn)

    def dispatch(self, arrays: list[Any]) -> None:
        self.mx.async_eval([a for a in arrays if isinstance(a, self.mx.array)])

    def plan_hints(self, method: Method, arrays: list[Any], env: dict[str, int]) -> dict[str, int]:
        from kiln.runtime.backends.mlx import visible

        return visible.hints(self._constants, method, self._prepare.producers(self._constants, method), arrays, env)

    def prepare(self, method: Method, node: Node, kernel: Kernel,
                env: dict[str, int]) -> tuple[Kernel, tuple[int, ...]] | None:
        return self._prepare.prepare(self._constants, method, node, env)
