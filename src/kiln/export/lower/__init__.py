"""ATen to kiln lowering: one module per op family, all registering into registry.HANDLERS."""

from kiln.export.lower import (  # noqa: F401 - importing registers the handlers
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
from kiln.export.lower.registry import HANDLERS, LowerContext, Unsupported, lowering

__all__ = ["HANDLERS", "LowerContext", "Unsupported", "lowering"]
