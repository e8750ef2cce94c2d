"""Compiled CUDA kernel modules kept on disk between processes (no CuPy here: nvrtc.py compiles and loads).

CuPy's RawModule keeps what NVRTC builds on disk, but not a module compiled with name expressions, which is how a
template kernel's instances are named: CuPy compiles such a module again in every process, to learn the instances'
C++ names. kiln's kernel sources are templates (quant.cu: 162 instances, tens of seconds of NVRTC), so every
process that ran a quantized program on the GPU paid that compile. Here the binary is stored with the instances'
C++ names, under a key of everything that changes it (the source with common.cuh, the options, the instances, the
GPU's architecture and the NVRTC and CuPy versions), and the next process loads it. The folder is
kiln.runtime.cache_dir's "cuda"; files are written whole (a temporary file renamed), so processes that compile at
once never read half a file, and a file that does not match its recorded digest is compiled again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger("kiln.runtime.cuda")


def key(source: str, options: Sequence[str], expressions: Sequence[str], target: str) -> str:
    """The module's cache key: `target` names the GPU architecture and the compilers' versions."""
    parts = (source, "\0".join(options), "\0".join(expressions), target)
    return hashlib.sha256("\1".join(parts).encode()).hexdigest()[:24]


def paths(folder: Path, name: str, module_key: str) -> tuple[Path, Path]:
    """(binary, names) of a module: the binary NVRTC gave, and a JSON record of its digest and C++ names."""
    stem = folder / f"{name}-{module_key}"
    return stem.with_suffix(".cubin"), stem.with_suffix(".json")


def stored(folder: Path, name: str, module_key: str) -> tuple[Path, dict[str, str]] | None:
    """The binary's path and the instances' C++ names, where both are on disk and the binary matches its digest."""
    binary, names = paths(folder, name, module_key)
    try:
        record = json.loads(names.read_text())
        if hashlib.sha256(binary.read_bytes()).hexdigest() != record["sha256"]:
            return None
        return binary, dict(record["names"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(folder: Path, name: str, module_key: str, binary: bytes, names: dict[str, str]) -> Path | None:
    """Write the module (binary first, then its record) and return the binary's path; None where the folder cannot
    be written (the module then lives in this process only)."""
    binary_path, names_path = paths(folder, name, module_key)
    record = json.dumps({"sha256": hashlib.sha256(binary).hexdigest(), "names": names})
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write(binary_path, binary)
        _write(names_path, record.encode())
        return binary_path
    except OSError as exc:
        log.warning("could not keep the compiled %s.cu in %s (%s): the next process compiles it again", name, folder,
                    exc)
        return None


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
