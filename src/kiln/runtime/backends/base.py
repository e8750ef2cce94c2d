"""What a backend provides to a session: kernels by op name, and array conversions."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.ir.graph import StateBuffer

Kernel = Callable[..., Any]


class KernelRegistry:
    """Kernels of one backend by kiln op name; registering an op twice is a bug."""

    def __init__(self, backend: str):
        self.backend = backend
        self.kernels: dict[str, Kernel] = {}

    def register(self, *names: str) -> Callable[[Kernel], Kernel]:
        def deco(fn: Kernel) -> Kernel:
            for name in names:
                if name in self.kernels:
                    raise ValueError(f"{self.backend} kernel for {name!r} registered twice")
                self.kernels[name] = fn
            return fn
        return deco

    def add(self, name: str, fn: Kernel) -> None:
        self.register(name)(fn)


class Backend:
    """A backend instance bound to one program and one session."""

    name: str = ""
    kernels: dict[str, Kernel] = {}

    def constant(self, index: int) -> Any:
        raise NotImplementedError

    def initial_state(self, index: int, buffer: StateBuffer) -> Any:
        raise NotImplementedError

    def asarray(self, x: Any) -> Any:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def execution_context(self) -> contextlib.AbstractContextManager:
        """Entered around each run (e.g. the CPU backend's floating-point error mode)."""
        return contextlib.nullcontext()
