"""A program's constants as MLX arrays: converted once per program, on first use, and shared by all its MLX
sessions; and the forms that plan-time specializations convert weights into (prepare.py), kept the same way."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kiln.runtime.backends.mlx.arrays import to_mlx
from kiln.runtime.program import Program

_CACHE: weakref.WeakKeyDictionary[Program, ProgramArrays] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class ProgramArrays:
    """One program's MLX arrays: constants by index, and derived forms by key."""

    def __init__(self, program: Program):
        self.program = program
        self._constants: dict[int, mx.array] = {}
        self._derived: dict[tuple, Any] = {}
        self._lock = threading.RLock()

    def array(self, index: int) -> mx.array:
        arr = self._constants.get(index)
        if arr is None:
            with self._lock:
                arr = self._constants.get(index)
                if arr is None:
                    arr = to_mlx(self.program.constant(index))
                    mx.eval(arr)
                    self._constants[index] = arr
        return arr

    def derived(self, key: tuple, make: Callable[[], Any], evaluate: bool = True) -> Any:
        """make()'s result for key (a conversion of constants, or a fact about the program: key names it), computed
        once; MLX arrays in it evaluated unless `evaluate` is False."""
        if key not in self._derived:
            with self._lock:
                if key not in self._derived:
                    value = make()
                    if evaluate and value is not None:
                        mx.eval(value)
                    self._derived[key] = value
        return self._derived[key]


def for_program(program: Program) -> ProgramArrays:
    arrays = _CACHE.get(program)
    if arrays is None:
        with _LOCK:
            arrays = _CACHE.get(program)
            if arrays is None:
                arrays = _CACHE[program] = ProgramArrays(program)
    return arrays
