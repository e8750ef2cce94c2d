"""kiln: ship a PyTorch model as one .kiln file and run it anywhere, without PyTorch.

    import kiln
    kiln.export(model, (x,)).save("model.kiln")      # needs torch
    outputs = kiln.load("model.kiln").session().run("forward", x_numpy)   # does not

`import kiln` and `kiln.load` never import torch; `kiln.export` imports it on first use.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import (
    BackendUnavailableError,
    InputError,
    KernelError,
    KilnError,
    ProgramFormatError,
    UnsupportedOpsError,
)
from kiln.runtime import Program, Session, load

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "export":
        import importlib

        return importlib.import_module("kiln.export")
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


__all__ = ["BackendUnavailableError", "InputError", "KernelError", "KilnError", "Program", "ProgramFormatError",
           "Session", "UnsupportedOpsError", "export", "load"]
