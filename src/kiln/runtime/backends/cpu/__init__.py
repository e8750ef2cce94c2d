"""The CPU backend: NumPy kernels for every kiln op. The default; runs on any machine."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.ir.graph import StateBuffer
from kiln.runtime.backends.base import Backend
from kiln.runtime.backends.cpu import (  # noqa: F401 - importing registers the kernels
    attention,
    conv,
    creation,
    elementwise,
    index,
    linalg,
    norm,
    reduce,
    shape,
)
from kiln.runtime.backends.cpu.registry import CPU_KERNELS
from kiln.runtime.program import Program


class CPUBackend(Backend):
    name = "cpu"
    kernels = CPU_KERNELS.kernels

    def __init__(self, program: Program):
        self.program = program

    def constant(self, index: int) -> np.ndarray:
        return self.program.constant(index)

    def initial_state(self, index: int, buffer: StateBuffer) -> np.ndarray:
        if buffer.init >= 0:
            return np.array(self.program.constant(buffer.init))
        return np.zeros(buffer.shape, dtype=buffer.dtype.numpy)

    def asarray(self, x: Any) -> np.ndarray:
        return x if type(x) is np.ndarray else np.asarray(x)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)
