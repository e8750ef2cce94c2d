"""Symbolic shapes from torch.export: sympy expressions turned into kiln's dimension expression text."""

from __future__ import annotations

import re
from typing import Any

import sympy
import torch

from kiln.ir.symbolic import UNBOUNDED, Symbol, parse


class Unsupported(Exception):
    """Raised by a lowering handler (or a helper) when it cannot lower a node; the message says why."""


def _as_int(bound: Any, infinite: int) -> int:
    """A sympy range bound as int; torch's int_oo and sympy's oo claim to be finite, so test by value."""
    if str(bound) in ("oo", "-oo", "int_oo", "-int_oo", "zoo"):
        return infinite
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError):
        return infinite


class SymbolTable:
    """The symbols of one method: torch's names (s0, s17, ...) renamed after the user's Dim names."""

    def __init__(self, range_constraints: dict[Any, Any], user_names: dict[str, str]):
        self.names: dict[str, str] = {}
        self.symbols: list[Symbol] = []
        used: set[str] = set()
        for sym, vr in sorted(range_constraints.items(), key=lambda kv: str(kv[0])):
            if not isinstance(sym, sympy.Symbol):
                continue
            base = re.sub(r"\W", "_", user_names.get(str(sym), str(sym))) or "s"
            if base[0].isdigit():
                base = "d" + base
            name, k = base, 1
            while name in used:
                name, k = f"{base}_{k}", k + 1
            used.add(name)
            self.names[str(sym)] = name
            lo, hi = _as_int(vr.lower, 0), _as_int(vr.upper, UNBOUNDED)
            self.symbols.append(Symbol(name, max(lo, 0), hi))
        self.known: dict[str, int] = {}

    def bind(self, size: Any, value: int) -> None:
        """Fix a data-dependent size (torch's unbacked u0, ...) that the exporter computed from constant data."""
        expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.sympify(size)
        if expr.is_number:
            return
        if not isinstance(expr, sympy.Symbol):
            raise Unsupported(f"data-dependent size {expr} is not a plain symbol")
        self.known[str(expr)] = int(value)
        name = self.names.get(str(expr))
        self.symbols[:] = [s for s in self.symbols if s.name != name]

    def dim(self, d: Any) -> int | str:
        """A tensor dimension (int or SymInt) as kiln dim: an int, or expression text."""
        if isinstance(d, int):
            return d
        if isinstance(d, torch.SymInt):
            expr = d.node.expr
            if self.known and expr.free_symbols:
                expr = expr.xreplace({s: sympy.Integer(self.known[str(s)]) for s in expr.free_symbols
                                      if str(s) in self.known})
            if expr.is_number:
                return int(expr)
            text = self.text(expr)
            parse(text)  # fail here, at export, on anything the runtime could not read
            return text
        raise Unsupported(f"dimension {d!r} of type {type(d).__name__} is not an int or SymInt")

    def shape(self, shape: Any) -> tuple[int | str, ...]:
        return tuple(self.dim(d) for d in shape)

    def text(self, e: Any) -> str:
        if e.is_Integer:
            return str(int(e))
        if e.is_Symbol:
            if str(e) not in self.names:
                raise Unsupported(f"symbol {e} is data-dependent (not bound by an input shape)")
            return self.names[str(e)]
        if isinstance(e, sympy.Add):
            return " + ".join(self.text(a) for a in e.args)
        if isinstance(e, sympy.Mul):
            return "*".join(self._operand(a) for a in e.args)
        if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:
            return "*".join([self._operand(e.base)] * int(e.exp))
        name = type(e).__name__
        if name in ("FloorDiv", "CleanDiv", "IntTrueDiv") and len(e.args) == 2:
            return f"{self._operand(e.args[0])}//{self._operand(e.args[1])}"
        if name in ("Mod", "PythonMod") and len(e.args) == 2:
            return f"{self._operand(e.args[0])}%{self._operand(e.args[1])}"
        if name == "CeilDiv" and len(e.args) == 2:
            return f"-((-{self._operand(e.args[0])})//{self._operand(e.args[1])})"
        if name in ("Max", "Min"):  # (sympy's and torch's own)
            return f"{name.lower()}({', '.join(self.text(a) for a in e.args)})"
        raise Unsupported(f"symbolic expression {e} ({name}) has no kiln form")

    def _operand(self, e: Any) -> str:
        text = self.text(e)
        return text if (e.is_Integer and int(e) >= 0) or e.is_Symbol or type(e).__name__ in ("Max", "Min") \
            else f"({text})"
