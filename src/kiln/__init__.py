"""kiln: ship a PyTorch model as one .kiln file and run it anywhere, without PyTorch.

    import kiln
    kiln.export(model, (x,)).save("model.kiln")      # needs torch
    outputs = kiln.load("model.kiln").session().run("forward", x_numpy)   # does not

`import kiln` and `kiln.load` never import torch; `kiln.export` imports it on first use.
"""

from __future__ import annotations

import os
from typing import Any

# The CPU backend's compiled helpers split few-row work over their own thread pool, between NumPy's BLAS calls.
# OpenBLAS's threads busy-wait 2^28 cycles (~0.1 s) after each call and took those cores: a decode step right after
# a prefill ran 7x slower for its first ~0.1 s (docs/benchmarks.md). 2^20 cycles (~0.4 ms) still covers the gap
# between a prefill's BLAS calls. OpenBLAS reads this when NumPy loads it, so it applies where kiln is imported
# first (the command line, `python -m kiln.demo`); a value already set wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")

from kiln.errors import (  # noqa: E402 - after the environment above, before NumPy loads
    BackendUnavailableError,
    InputError,
    KernelError,
    KilnError,
    ProgramFormatError,
    TorchExportError,
    UnsupportedOpsError,
)
from kiln.runtime import Program, Session, load  # noqa: E402

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "export":
        import importlib

        return importlib.import_module("kiln.export")
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


__all__ = ["BackendUnavailableError", "TorchExportError", "InputError", "KernelError", "KilnError", "Program",
           "ProgramFormatError", "Session", "UnsupportedOpsError", "export", "load"]
