"""ATen to kiln lowering: one module per op family, all registering into registry.HANDLERS."""

from kiln.export.lower import (  # noqa: F401 - importing registers the handlers
    attention,
    conv,
    creation,
    distance,
    elementwise,
    folded,
    index,
    linalg,
    norm,
    reduce,
    resize,
    scan,
    scatter,
    shape,
    sort,
    strided,
)
from kiln.export.lower.registry import HANDLERS, LowerContext, Unsupported, lowering

__all__ = ["HANDLERS", "LowerContext", "Unsupported", "lowering"]
