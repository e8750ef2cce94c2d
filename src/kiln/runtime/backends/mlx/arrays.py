"""MLX arrays and NumPy arrays: element types both ways, and conversions that keep every kiln dtype exact.

MLX has kiln's element types, with two catches: NumPy float64 arrays become float32 unless the type is named (so
it always is), and MLX's bfloat16 arrays do not export a buffer NumPy understands (they travel as their uint16
bits). float64 exists on MLX's CPU device only; Apple GPUs refuse it.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np

from kiln.ir.dtypes import DType

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

MX_OF_NUMPY: dict[np.dtype, Any] = {
    np.dtype(np.float32): mx.float32, np.dtype(np.float16): mx.float16, BFLOAT16: mx.bfloat16,
    np.dtype(np.float64): mx.float64, np.dtype(np.int8): mx.int8, np.dtype(np.int16): mx.int16,
    np.dtype(np.int32): mx.int32, np.dtype(np.int64): mx.int64, np.dtype(np.uint8): mx.uint8,
    np.dtype(np.uint16): mx.uint16, np.dtype(np.uint32): mx.uint32, np.dtype(np.uint64): mx.uint64,
    np.dtype(np.bool_): mx.bool_,
}
NUMPY_OF_MX: dict[Any, np.dtype] = {v: k for k, v in MX_OF_NUMPY.items()}

FLOATS = (mx.float32, mx.float16, mx.bfloat16, mx.float64)
LOW_PRECISION = (mx.float16, mx.bfloat16)
"""Float types whose math kiln defines in float32, rounded back (as PyTorch computes them)."""


def mx_dtype(dtype: DType | np.dtype | Any) -> Any:
    """The MLX type of a kiln DType or a NumPy dtype."""
    if isinstance(dtype, DType):
        dtype = dtype.numpy
    return MX_OF_NUMPY[np.dtype(dtype)]


def to_mlx(x: Any) -> mx.array:
    """x (an MLX array, a NumPy array or anything np.asarray takes) as an MLX array of the same element type."""
    if isinstance(x, mx.array):
        return x
    arr = np.asarray(x)
    dtype = MX_OF_NUMPY.get(arr.dtype)
    if dtype is None:
        raise TypeError(f"kiln has no MLX type for NumPy dtype {arr.dtype}")
    if dtype == mx.bfloat16:
        bits = (arr if arr.flags.c_contiguous else arr.copy()).view(np.uint16)  # (ascontiguousarray makes 0-d 1-d)
        return mx.array(bits).view(mx.bfloat16)
    return mx.array(arr, dtype=dtype)


def to_numpy(x: Any) -> np.ndarray:
    """An MLX array as a NumPy array (a copy: MLX may reuse the memory of an array it no longer holds)."""
    if not isinstance(x, mx.array):
        return np.asarray(x)
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16)).view(BFLOAT16)
    return np.array(x)


def is_float(x: mx.array) -> bool:
    return x.dtype in FLOATS


def is_integer(x: mx.array) -> bool:
    return mx.issubdtype(x.dtype, mx.integer)
