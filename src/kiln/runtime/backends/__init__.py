"""Backends by name. Each is imported only when asked for, so a machine without CuPy (or MLX) never imports it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kiln.errors import BackendUnavailableError

if TYPE_CHECKING:
    from kiln.runtime.backends.base import Backend
    from kiln.runtime.program import Program

BACKENDS: dict[str, str] = {
    "cpu": "kiln.runtime.backends.cpu:CPUBackend",
    "cuda": "kiln.runtime.backends.cuda:CUDABackend",
    "mlx": "kiln.runtime.backends.mlx:MLXBackend",
}


def create(name: str, program: Program) -> Backend:
    spec = BACKENDS.get(name)
    if spec is None:
        raise BackendUnavailableError(f"unknown backend {name!r}; available: {sorted(BACKENDS)}")
    module, cls = spec.split(":")
    return getattr(importlib.import_module(module), cls)(program)
