"""The dtypes the CUDA kernels treat specially: bfloat16 (an ml_dtypes type that CuPy builds know) and float16."""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
    BFLOAT16 = None

LOW_PRECISION: tuple[np.dtype, ...] = (np.dtype(np.float16),) + ((BFLOAT16,) if BFLOAT16 is not None else ())
"""Float types whose math runs in float32 and is rounded back, as PyTorch computes them."""
