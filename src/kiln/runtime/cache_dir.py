"""Where the runtime keeps what it builds on a machine (the CPU helpers' library, the CUDA kernels' binaries):
$KILN_CACHE_DIR/<kind>, else $XDG_CACHE_HOME/kiln/<kind>, else ~/.cache/kiln/<kind>."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """The folder for `kind` ("native", "cuda"); not created here."""
    if os.environ.get("KILN_CACHE_DIR"):
        return Path(os.environ["KILN_CACHE_DIR"]) / kind
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln" / kind
