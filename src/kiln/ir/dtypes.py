"""The element types a .kiln program may use, with their stable codes in the file format."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.IntEnum):
    """Element type. The integer value is the code stored in the file; never renumber."""

    float32 = 0
    float16 = 1
    bfloat16 = 2
    float64 = 3
    int8 = 4
    int16 = 5
    int32 = 6
    int64 = 7
    uint8 = 8
    bool = 9

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY[self]

    @property
    def itemsize(self) -> int:
        return _NUMPY[self].itemsize

    @property
    def is_float(self) -> bool:
        return self in (DType.float32, DType.float16, DType.bfloat16, DType.float64)

    @classmethod
    def from_numpy(cls, dtype: np.dtype | type) -> DType:
        dt = np.dtype(dtype)
        for member, np_dt in _NUMPY.items():
            if np_dt == dt:
                return member
        raise TypeError(f"kiln has no dtype for NumPy dtype {dt}")


_NUMPY: dict[DType, np.dtype] = {
    DType.float32: np.dtype(np.float32),
    DType.float16: np.dtype(np.float16),
    DType.bfloat16: np.dtype(ml_dtypes.bfloat16),
    DType.float64: np.dtype(np.float64),
    DType.int8: np.dtype(np.int8),
    DType.int16: np.dtype(np.int16),
    DType.int32: np.dtype(np.int32),
    DType.int64: np.dtype(np.int64),
    DType.uint8: np.dtype(np.uint8),
    DType.bool: np.dtype(np.bool_),
}
