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


class FileFormatError(KilnError, ValueError):
    """A file given to kiln (audio, an image, model weights in another format) is malformed or lies about its
    sizes; each reader raises its own subclass, naming the file and the defect."""


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
    """The first place in user code it occurs ('' when torch recorded none)."""
    sources: tuple[str, ...] = ()
    """Every distinct place it occurs, in order of appearance (the first is `source`)."""


MAX_SOURCES = 3
"""Places listed per op in the message; the rest are counted, so a model that repeats one op in 40 layers still
gets a short message."""


class UnsupportedOpsError(KilnError):
    """Export found ATen ops it cannot lower. Lists every one of them at once; nothing was written."""

    def __init__(self, ops: list[UnsupportedOp]):
        self.ops = ops
        lines = [f"cannot export: {len(ops)} unsupported op(s); nothing was written."]
        for op in ops:
            lines.append(f"  - {op.target} (x{op.count}): {op.reason}")
            places = op.sources or ((op.source,) if op.source else ())
            lines += [f"      at {place}" for place in places[:MAX_SOURCES]]
            if len(places) > MAX_SOURCES:
                lines.append(f"      and {len(places) - MAX_SOURCES} more place(s)")
        lines.append(
            "Rewrite these calls in the model, or add a lowering for them in kiln/export/lower/."
        )
        if any(op.reason.startswith(DATA_DEPENDENT) for op in ops):
            lines.append(DATA_DEPENDENT_HINT)
        super().__init__("\n".join(lines))


DATA_DEPENDENT = "its size depends on tensor values"
"""How the reason of an op whose result size comes from tensor data (`.item()`, nonzero) begins."""

DATA_DEPENDENT_HINT = (
    "A kiln program's sizes follow from its input shapes alone. Where a size comes from tensor values "
    "(tensor.item(), int(tensor), nonzero, unique, masked_select), make it a Python int fixed at export, derive it "
    "from an input's shape (x.shape[0]), or use a fixed-size form (torch.nonzero_static, a mask with torch.where)."
)


class TorchExportError(KilnError):
    """torch.export could not capture the model, neither non-strict (kiln's default) nor strict (its retry).

    Both errors are kept (`non_strict`, `strict`) and shown shortened: torch's own messages run to pages, and the
    first lines say what went wrong.
    """

    def __init__(self, what: str, non_strict: BaseException, strict: BaseException):
        self.non_strict = non_strict
        self.strict = strict
        super().__init__(
            f"torch.export could not capture {what}.\n"
            f"  non-strict export failed: {brief(non_strict)}\n"
            f"  strict export (tried next) failed: {brief(strict)}\n"
            "Fix what these errors point at in the model (the non-strict one is usually closer to the cause); the "
            "full errors are this exception's `non_strict` and `strict` attributes (and its __cause__)."
        )


def brief(error: BaseException, lines: int = 4, chars: int = 600) -> str:
    """An exception as 'Type: first lines of its message', cut to `chars` characters."""
    text = "\n".join([line for line in str(error).splitlines() if line.strip()][:lines])
    if len(text) > chars:
        text = text[:chars] + " ..."
    text = text.replace("\n", "\n    ")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
