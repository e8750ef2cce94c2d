"""The verifier: every node of every method checked against its op's shape and dtype rule (rules.py), every
value's size bounded.

Why: a program that loads must run. The reader checks the file's structure (ids, types, order); this checks that
the shapes and dtypes the file declares are the ones its ops produce, so a table edited by hand or by an attacker
(with its checksums recomputed) is refused at load, naming the node and the rule, instead of failing inside a
kernel. The writer runs it too, so the exporter cannot write a file its loader would refuse.

How: shapes may hold expressions over the method's symbols, and the rules are arithmetic on concrete sizes, so each
method is checked at a few bindings of its symbols (all at their minimum, all at their maximum, and one between;
an unbounded symbol takes its minimum plus a margin). At each, every input, constant and state value gets its
declared shape, every node's rule gives its outputs, and those must equal the declared outputs. At the largest
binding, no value may exceed the byte cap (KILN_MAX_BUFFER_BYTES, default 64 GiB); an unbounded symbol is sized
by its caller's own inputs, so only bounded ones are held to it.
"""

from __future__ import annotations

import math
import os
from typing import Any

from kiln.errors import ProgramFormatError
from kiln.ir import ops
from kiln.ir.graph import NO_VALUE, Method, Program
from kiln.ir.ops import REQUIRED, AttrType
from kiln.ir.rules import CHOICES, RULES, RuleError, Spec
from kiln.ir.symbolic import UNBOUNDED, ExprError, Symbol, parse

DEFAULT_MAX_BUFFER_BYTES = 64 << 30
UNBOUNDED_MARGIN = 61
"""An unbounded symbol's sample above its minimum (odd, so no accidental multiple of a tile or a group)."""


def max_buffer_bytes() -> int:
    """The cap on any one value's bytes at the symbols' bounds: KILN_MAX_BUFFER_BYTES, else 64 GiB."""
    text = os.environ.get("KILN_MAX_BUFFER_BYTES", "")
    return int(text) if text.isdigit() else DEFAULT_MAX_BUFFER_BYTES


def bindings(symbols: list[Symbol]) -> list[dict[str, int]]:
    """The symbol values each method is checked at: minimum, maximum (minimum + a margin when unbounded), and a
    value between; the first binding with a maximum of every bounded symbol comes second."""
    def top(s: Symbol) -> int:
        return s.min + UNBOUNDED_MARGIN if s.max == UNBOUNDED else s.max

    low = {s.name: s.min for s in symbols}
    high = {s.name: top(s) for s in symbols}
    middle = {s.name: min(top(s), s.min + 3) for s in symbols}
    out = []
    for env in (low, high, middle):
        if env not in out:
            out.append(env)
    return out


def verify_program(program: Program, cap: int | None = None) -> None:
    """Raise ProgramFormatError naming the method, node and rule where a declared shape or dtype disagrees with
    what the node's op gives, or where a value outgrows the cap."""
    cap = max_buffer_bytes() if cap is None else cap
    for i, state in enumerate(program.states):  # a session allocates every state buffer, read or not
        size = state.dtype.itemsize * math.prod(state.shape)
        if size > cap:
            raise ProgramFormatError(f"state buffer {i} ({state.name}) {state.dtype.name}{list(state.shape)} takes "
                                     f"{size} bytes, more than the cap of {cap} (KILN_MAX_BUFFER_BYTES)")
    for method in program.methods.values():
        envs = bindings(method.symbols)
        for k, env in enumerate(envs):
            _verify_at(program, method, env, cap if k == 1 or len(envs) == 1 else None)


TRACED_MIN = 2
"""torch.export traces a dynamic dim assuming its size is not 0 or 1 (it specializes those), while the range it
reports may start at 0: a graph can then be wrong at 0 or 1 (x[-1:] declared one row)."""


def tighten_traced_bounds(program: Program) -> list[str]:
    """For each method that fails the verifier only because a symbol may be 0 or 1, raise those symbols' minimum
    to TRACED_MIN (what the graph was traced for) and say which ("method.symbol"); a method that fails
    otherwise is left for the verifier to report."""
    raised = []
    for method in program.methods.values():
        low = [s for s in method.symbols if s.min < TRACED_MIN and (s.max == UNBOUNDED or s.max >= TRACED_MIN)]
        if not low:
            continue
        try:
            for env in bindings(method.symbols):
                _verify_at(program, method, env, None)
            continue
        except ProgramFormatError:
            pass
        tightened = [Symbol(s.name, TRACED_MIN, s.max) if s in low else s for s in method.symbols]
        try:
            for env in bindings(tightened):
                _verify_at(program, method, env, None)
        except ProgramFormatError:
            continue
        method.symbols[:] = tightened
        raised += [f"{method.name}.{s.name}" for s in low]
    return raised


def _where(method: Method, env: dict[str, int]) -> str:
    at = ", ".join(f"{name}={value}" for name, value in env.items())
    return f"method {method.name!r}" + (f" (at {at})" if at else "")


def _declared(method: Method, index: int, env: dict[str, int], where: str) -> Spec:
    value = method.values[index]
    try:
        shape = tuple(d if isinstance(d, int) else parse(d).evaluate(env) for d in value.shape)
    except (ExprError, ZeroDivisionError, ValueError, OverflowError) as e:
        raise ProgramFormatError(f"{where}: value {index} ({value.name}): shape {list(value.shape)} cannot be "
                                 f"evaluated: {e}") from None
    if any(d < 0 for d in shape):
        raise ProgramFormatError(f"{where}: value {index} ({value.name}) has a negative size {list(shape)}")
    return Spec(value.dtype, shape)


def _attrs(node_attrs: dict[str, Any], opdef: ops.OpDef, env: dict[str, int], where: str) -> dict[str, Any]:
    """The node's attributes with defaults filled in and symbolic ints evaluated."""
    out = {}
    for adef in opdef.attrs:
        value = node_attrs.get(adef.name, None if adef.default is REQUIRED else adef.default)
        try:
            if adef.type == AttrType.SYMINT and isinstance(value, str):
                value = parse(value).evaluate(env)
            elif adef.type == AttrType.SYMINTS and value is not None:
                value = tuple(parse(v).evaluate(env) if isinstance(v, str) else v for v in value)
        except (ExprError, ZeroDivisionError, ValueError, OverflowError) as e:
            raise ProgramFormatError(f"{where}: attribute {adef.name!r} cannot be evaluated: {e}") from None
        choices = CHOICES.get((opdef.name, adef.name))
        if choices is not None and value not in choices:
            raise ProgramFormatError(f"{where}: attribute {adef.name!r} is {str(value)[:40]!r}, not one of "
                                     f"{sorted(choices)}")
        out[adef.name] = value
    return out


def _verify_at(program: Program, method: Method, env: dict[str, int], cap: int | None) -> None:
    base = _where(method, env)
    specs: dict[int, Spec] = {}
    produced = {i for node in method.nodes for i in node.outputs}
    for i in range(len(method.values)):
        if i not in produced:
            specs[i] = _declared(method, i, env, base)
    for j, node in enumerate(method.nodes):
        where = f"{base} node {j} ({node.op}{', ' + node.source if node.source else ''})"
        opdef = ops.OPS[node.op]
        rule = RULES.get(node.op)
        if rule is None:
            raise ProgramFormatError(f"{where}: op {node.op!r} has no shape rule in this kiln")
        inputs = [None if i == NO_VALUE else specs[i] for i in node.inputs]
        try:
            expected = rule(inputs, _attrs(node.attrs, opdef, env, where))
        except RuleError as e:
            ins = ", ".join("-" if s is None else str(s) for s in inputs)
            raise ProgramFormatError(f"{where}: inputs ({ins}) break the op's rule: {e}") from None
        for k, (index, want) in enumerate(zip(node.outputs, expected)):
            got = _declared(method, index, env, where)
            if got != want:
                raise ProgramFormatError(f"{where}: output {k} is declared {got} but the op gives {want}")
            specs[index] = got
    if cap is not None:
        for i, spec in specs.items():
            size = spec.dtype.itemsize
            for d in spec.shape:
                size *= d
            if size > cap:
                raise ProgramFormatError(f"{base}: value {i} ({method.values[i].name}) {spec} takes {size} bytes, "
                                         f"more than the cap of {cap} (KILN_MAX_BUFFER_BYTES)")
