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

    def adopt(self, portable: dict[str, Kernel], xp: Any) -> None:
        """The portable kernels (kiln.runtime.backends.array_api) bound to array module xp, and the compositions of
        fused ops (kiln.runtime.backends.composite), for every op this backend has no kernel of its own for. Called
        once, after the backend's own kernels are registered."""
        from kiln.runtime.backends.array_api import bind
        from kiln.runtime.backends.composite import COMPOSITES
        from kiln.runtime.backends.composite import bind as bind_composite

        for name, fn in portable.items():
            if name not in self.kernels:
                self.kernels[name] = bind(fn, xp)
        for name, composite in COMPOSITES.items():  # fused ops this backend has no kernel of its own for
            if name not in self.kernels:
                self.kernels[name] = bind_composite(composite, self.kernels)


class Backend:
    """A backend instance bound to one program and one session."""

    name: str = ""
    kernels: dict[str, Kernel] = {}
    can_capture: bool = False
    """Whether `capture` works: sessions then replay each method as a graph (kiln.runtime.graphs)."""
    graphs_by_default: bool = False

    def constant(self, index: int) -> Any:
        raise NotImplementedError

    def initial_state(self, index: int, buffer: StateBuffer) -> Any:
        raise NotImplementedError

    def asarray(self, x: Any) -> Any:
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def empty_like(self, x: Any) -> Any:
        """A new uninitialized array of this backend with x's shape and dtype."""
        raise NotImplementedError

    def copy_into(self, target: Any, source: Any) -> None:
        """Write source (of target's shape and dtype; a host or a backend array) into target."""
        target[...] = source

    def copy(self, x: Any) -> Any:
        return x.copy()

    def capture(self, body: Callable[[], list[Any]]) -> tuple[Any, list[Any]]:
        """Record body's kernels as one graph without running them: (graph with launch(), body's outputs), or
        CaptureError when body cannot be captured."""
        raise NotImplementedError

    def execution_context(self) -> contextlib.AbstractContextManager:
        """Entered around each run (e.g. the CPU backend's floating-point error mode)."""
        return contextlib.nullcontext()
