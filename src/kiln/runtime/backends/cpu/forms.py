"""Forms of a weight array made once and kept while the array lives: a program's constants are transformed or
packed the first time a kernel meets them, not on every call (the array's identity is the key, so a weight computed
at run time, a new array each run, is simply made again)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np

from kiln.runtime.backends.cpu import native

_forms: dict[tuple[str, int], tuple[weakref.ref, np.ndarray]] = {}


def derived(kind: str, weight: np.ndarray, make: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """make(weight), made once per weight array and kind; dropped with the array."""
    key = (kind, id(weight))
    cached = _forms.get(key)
    if cached is not None and cached[0]() is weight:
        return cached[1]
    form = make(weight)
    _forms[key] = (weakref.ref(weight, lambda _, key=key: _forms.pop(key, None)), form)
    return form


def packed_gemm_weight(weight: np.ndarray) -> np.ndarray:
    """The float32 weight as [rows, everything else] in gemm.c's panels (native.pack_gemm_weight)."""
    return derived("gemm", weight, lambda w: native.pack_gemm_weight(w.reshape(w.shape[0], -1)))
