"""Symbolic dimensions: named symbols with bounds, and small integer expressions over them.

A dynamic dimension is stored as an expression string such as ``"seq"``, ``"seq*4"`` or ``"max(1, seq - 1)"``.
The grammar is deliberately tiny so that the loader can parse untrusted text safely (no ``eval``):

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "//" | "%") unary)*
    unary  := "-" unary | atom
    atom   := INT | NAME | NAME "(" expr ("," expr)* ")" | "(" expr ")"

Functions: ``max``, ``min`` (two or more arguments). ``//`` and ``%`` are floor division and modulo as in Python.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

MAX_EXPR_LEN = 512
MAX_DEPTH = 32
UNBOUNDED = -1

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(//|[-+*%(),]))")
_FUNCS: dict[str, Callable[..., int]] = {"max": max, "min": min}


@dataclass(frozen=True)
class Symbol:
    """A named dynamic dimension with inclusive bounds (``max == UNBOUNDED`` means no upper bound)."""

    name: str
    min: int
    max: int

    def describe(self) -> str:
        hi = "inf" if self.max == UNBOUNDED else str(self.max)
        return f"{self.name} in [{self.min}, {hi}]"


class ExprError(ValueError):
    """Raised for text that is not a valid dimension expression."""


@dataclass(frozen=True)
class Expr:
    """A parsed expression: its canonical text, the symbols it reads, and a compiled evaluator."""

    text: str
    symbols: frozenset[str]
    evaluate: Callable[[dict[str, int]], int]

    @property
    def is_symbol(self) -> bool:
        return self.text in self.symbols


_CACHE: dict[str, Expr] = {}


def parse(text: str) -> Expr:
    """Parse and compile an expression; raises ExprError with the reason if it is malformed."""
    cached = _CACHE.get(text)
    if cached is not None:
        return cached
    if not isinstance(text, str) or not text or len(text) > MAX_EXPR_LEN:
        raise ExprError(f"dimension expression must be 1..{MAX_EXPR_LEN} characters, got {text!r}")
    tokens = _tokenize(text)
    parser = _Parser(tokens, text)
    fn = parser.expr(0)
    if parser.pos != len(tokens):
        raise ExprError(f"unexpected {tokens[parser.pos]!r} in dimension expression {text!r}")
    expr = Expr(text, frozenset(parser.names), fn)
    if len(_CACHE) < 65536:
        _CACHE[text] = expr
    return expr


def _tokenize(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise ExprError(f"bad character {text[pos]!r} in dimension expression {text!r}")
        tokens.append(m.group(m.lastindex))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], text: str):
        self.tokens, self.text, self.pos, self.names = tokens, text, 0, set()

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise ExprError(f"expected {expected or 'a term'} in dimension expression {self.text!r}")
        self.pos += 1
        return tok

    def expr(self, depth: int) -> Callable[[dict[str, int]], int]:
        if depth > MAX_DEPTH:
            raise ExprError(f"dimension expression nested too deeply: {self.text!r}")
        fn = self.term(depth)
        while self.peek() in ("+", "-"):
            op, rhs, lhs = self.take(), self.term(depth), fn
            fn = (lambda a, b: lambda e: a(e) + b(e))(lhs, rhs) if op == "+" else \
                (lambda a, b: lambda e: a(e) - b(e))(lhs, rhs)
        return fn

    def term(self, depth: int) -> Callable[[dict[str, int]], int]:
        fn = self.unary(depth)
        while self.peek() in ("*", "//", "%"):
            op, rhs, lhs = self.take(), self.unary(depth), fn
            fn = _BINARY[op](lhs, rhs)
        return fn

    def unary(self, depth: int) -> Callable[[dict[str, int]], int]:
        if self.peek() == "-":
            self.take()
            inner = self.unary(depth + 1)
            return lambda e: -inner(e)
        return self.atom(depth)

    def atom(self, depth: int) -> Callable[[dict[str, int]], int]:
        tok = self.take()
        if tok.isdigit():
            value = int(tok)
            return lambda e: value
        if tok == "(":
            inner = self.expr(depth + 1)
            self.take(")")
            return inner
        if tok[0].isalpha() or tok[0] == "_":
            if self.peek() == "(":
                if tok not in _FUNCS:
                    raise ExprError(f"unknown function {tok!r} in dimension expression {self.text!r}")
                self.take("(")
                args = [self.expr(depth + 1)]
                while self.peek() == ",":
                    self.take()
                    args.append(self.expr(depth + 1))
                self.take(")")
                func = _FUNCS[tok]
                if len(args) < 2:
                    raise ExprError(f"{tok}() needs two or more arguments in {self.text!r}")
                return lambda e: func(*(a(e) for a in args))
            self.names.add(tok)
            return lambda e: e[tok]
        raise ExprError(f"unexpected {tok!r} in dimension expression {self.text!r}")


def _floordiv(a, b):
    def fn(e):
        d = b(e)
        if d == 0:
            raise ExprError("division by zero in dimension expression")
        return a(e) // d
    return fn


def _mod(a, b):
    def fn(e):
        d = b(e)
        if d == 0:
            raise ExprError("modulo by zero in dimension expression")
        return a(e) % d
    return fn


_BINARY = {
    "*": lambda a, b: lambda e: a(e) * b(e),
    "//": _floordiv,
    "%": _mod,
}


Dim = int | str
"""One dimension of a shape: a static size, or the text of an expression over symbols."""


def resolve(dim: Dim, env: dict[str, int]) -> int:
    """The concrete size of a dimension under a binding of symbols."""
    return dim if isinstance(dim, int) else parse(dim).evaluate(env)


def resolve_shape(shape: tuple[Dim, ...], env: dict[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else parse(d).evaluate(env) for d in shape)


def format_shape(shape: tuple[Dim, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
