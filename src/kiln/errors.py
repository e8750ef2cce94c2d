"""The three kinds of error a user can act on, one per stage: export, load, run.

Each carries a message that says what was expected, what was found, and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class ProgramFormatError(KilnError):
    """A .kiln file is truncated, corrupted, from a newer kiln, or internally inconsistent."""


class InputError(KilnError, ValueError):
    """The inputs given to `Session.run` do not match the method's input specs."""


class KernelError(KilnError, RuntimeError):
    """A kernel failed or produced a result that does not match the program; says which node and source line."""


class BackendUnavailableError(KilnError, RuntimeError):
    """The requested backend cannot run on this machine (e.g. no GPU or no CuPy)."""


@dataclass(frozen=True)
class UnsupportedOp:
    """One ATen op the exporter could not lower: how often, why, and where in user code."""

    target: str
    count: int
    reason: str
    source: str


class UnsupportedOpsError(KilnError):
    """Export found ATen ops it cannot lower. Lists every one of them at once; nothing was written."""

    def __init__(self, ops: list[UnsupportedOp]):
        self.ops = ops
        lines = [f"cannot export: {len(ops)} unsupported op(s); nothing was written."]
        for op in ops:
            lines.append(f"  - {op.target} (x{op.count}): {op.reason}")
            if op.source:
                lines.append(f"      at {op.source}")
        lines.append(
            "Rewrite these calls in the model, or add a lowering for them in kiln/export/lower/."
        )
        super().__init__("\n".join(lines))
