"""The MLX backend's kernels, one module per family; importing this package registers all of them (and the
compositions of the fused ops that have no kernel of their own here)."""

from kiln.runtime.backends.mlx.kernels import (  # noqa: F401 - importing the families registers their kernels
    attention,
    conv,
    elementwise,
    experts,
    index,
    linalg,
    norm,
    quant,
    reduce,
    resize,
    shape,
    sort,
)
from kiln.runtime.backends.mlx.registry import MLX_KERNELS

MLX_KERNELS.compose()

__all__ = ["MLX_KERNELS"]
