"""The one way kiln's tables of handlers are filled (export lowerings, backend kernels and preparers, the CPU
executor's lowerings): a decorator entering a function under several names, where a name entered twice is a bug
(two modules claiming one op would otherwise depend on import order)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


def register_once(table: dict[Any, Any], label: str, names: tuple[Hashable, ...]) -> Callable[[Any], Any]:
    """A decorator entering fn under each of `names` in `table`; ValueError if a name is there already."""
    def deco(fn: Any) -> Any:
        for name in names:
            if name in table:
                raise ValueError(f"{label} for {name!r} registered twice")
            table[name] = fn
        return fn
    return deco
