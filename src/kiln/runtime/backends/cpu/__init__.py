"""The CPU backend: NumPy kernels for every kiln op. The default; runs on any machine.

Its own kernels (the families imported below: compiled fast paths, and functions NumPy lacks) come first; every
other op runs its portable kernel (kiln.runtime.backends.array_api) bound to NumPy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

import kiln.runtime.backends.cpu.attention
import kiln.runtime.backends.cpu.conv
import kiln.runtime.backends.cpu.elementwise
import kiln.runtime.backends.cpu.experts
import kiln.runtime.backends.cpu.linalg
import kiln.runtime.backends.cpu.norm
import kiln.runtime.backends.cpu.quant
import kiln.runtime.backends.cpu.reduce  # noqa: F401 - importing the kernel families registers them
from kiln.ir.graph import Method, Node, StateBuffer
from kiln.runtime.backends.array_api import PORTABLE
from kiln.runtime.backends.base import Backend, Kernel
from kiln.runtime.backends.cpu import executor, native, prepare, resident
from kiln.runtime.backends.cpu.registry import CPU_KERNELS
from kiln.runtime.program import Program

CPU_KERNELS.adopt(PORTABLE.kernels, np)


class CPUBackend(Backend):
    name = "cpu"
    kernels = CPU_KERNELS.kernels

    def __init__(self, program: Program):
        self.program = program

    def constant(self, index: int) -> np.ndarray:
        return resident.constant(self.program, index)

    def initial_state(self, index: int, buffer: StateBuffer) -> np.ndarray:
        if buffer.init >= 0:
            return np.array(self.program.constant(buffer.init))
        return np.zeros(buffer.shape, dtype=buffer.dtype.numpy)

    def asarray(self, x: Any) -> np.ndarray:
        return x if type(x) is np.ndarray else np.asarray(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def prepare(self, method: Method, node: Node, kernel: Kernel,
                env: dict[str, int]) -> tuple[Kernel, tuple[int, ...]] | None:
        return prepare.prepare(self.program, method, node, env)

    def lower(self, method: Method, steps: list[tuple[Node, dict[str, Any]]],
              env: dict[str, int]) -> executor.NativePlan | None:
        return executor.lower(self.program, method, steps, env, self.threads)

    def lower_runs(self, method: Method, steps: list[tuple[Node, dict[str, Any]]], reads: list[tuple[int, ...]],
                   env: dict[str, int]) -> list[executor.Run]:
        return executor.lower_runs(self.program, method, steps, reads, env, self.threads)

    @contextlib.contextmanager
    def execution_context(self) -> Iterator[None]:
        """IEEE results (inf, nan) as PyTorch gives them, without NumPy's divide/overflow warnings; the compiled
        helpers split their work over the session's threads."""
        with np.errstate(all="ignore"), native.thread_limit(self.threads):
            yield
