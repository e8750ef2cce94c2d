"""Program constants on the GPU: uploaded once per program, on first use, and shared by every CUDA session of that
program. No kernel writes them, so a kernel launched early (launch.py) may read one before the kernel before it
has finished: `is_constant` tells a kernel's launcher which of its operands those are."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from kiln.runtime.program import Program

_UPLOADED: weakref.WeakKeyDictionary[Program, dict[int, Any]] = weakref.WeakKeyDictionary()
_ALLOCATIONS: weakref.WeakKeyDictionary[Program, set[int]] = weakref.WeakKeyDictionary()
"""Each program's constants, and the device allocations they live in (an allocation's address is unique while the
program, which holds the arrays, lives; the entry goes with the program)."""
_LOCK = threading.Lock()


def constant(program: Program, index: int, cp: Any) -> Any:
    """The program's constant `index` on the current GPU, uploaded by the first caller."""
    arrays = _UPLOADED.get(program)
    array = None if arrays is None else arrays.get(index)
    if array is None:
        with _LOCK:
            arrays = _UPLOADED.setdefault(program, {})
            array = arrays.get(index)
            if array is None:
                array = arrays[index] = cp.asarray(program.constant(index))
                _ALLOCATIONS.setdefault(program, set()).add(array.data.mem.ptr)
    return array


def is_constant(array: Any) -> bool:
    """Whether `array` is an uploaded program constant or a view of one."""
    allocation = array.data.mem.ptr
    return any(allocation in allocations for allocations in list(_ALLOCATIONS.values()))
