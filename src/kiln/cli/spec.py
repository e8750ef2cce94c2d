"""Resolve a factory SPEC (`path/to/file.py:factory` or `package.module:factory`) to the callable it names.

Kept apart from the export command so the rules and their error messages are in one small place.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from kiln.cli.common import CliError

FORMS = "give path/to/file.py:factory or package.module:factory"


@contextlib.contextmanager
def importable_from(directory: Path | None) -> Iterator[None]:
    """Let a factory file import its sibling modules while it loads and runs, as `python file.py` would."""
    if directory is None:
        yield
        return
    entry = str(directory)
    sys.path.insert(0, entry)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(entry)


def split(spec: str) -> tuple[str, str, Path | None]:
    """SPEC -> (module or file, attribute path, the file's path if it names a file)."""
    target, sep, attr = spec.rpartition(":")  # rpartition: a Windows drive letter stays with the path
    if not sep or not target or not attr:
        raise CliError(f"SPEC {spec!r} has no factory after ':'; {FORMS}")
    looks_like_file = target.endswith(".py") or "/" in target or "\\" in target
    if looks_like_file:
        path = Path(target)
        if not path.is_file():
            raise CliError(f"SPEC {spec!r}: no such file {target!r}")
        return target, attr, path.resolve()
    return target, attr, None


def _import_file(path: Path) -> ModuleType:
    name = f"_kiln_factory_{abs(hash(str(path))):x}_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise CliError(f"cannot import {path} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name while it executes
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import_module(target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (target == missing or target.startswith(missing + ".")):
            raise CliError(f"no module named {missing!r} (from SPEC {target!r}); is it installed and on "
                           f"PYTHONPATH? For a file, {FORMS}") from None
        raise  # the module exists but something it imports does not: the traceback says what


def resolve(spec: str) -> tuple[Callable[..., Any], Path | None]:
    """The factory named by SPEC, and the directory to keep importable while it runs (for a file)."""
    target, attr, path = split(spec)
    directory = path.parent if path else None
    with importable_from(directory):
        module = _import_file(path) if path else _import_module(target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            available = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise CliError(f"SPEC {spec!r}: {target} has no attribute {attr!r}"
                           + (f"; callables there: {', '.join(available)}" if available else ""))
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(f"SPEC {spec!r}: {attr} is a {type(obj).__name__}, not a callable factory")
    return obj, directory
