"""Table-driven op tests: a case is a torch function and input specs; it is exported, run on every backend, and
compared with eager PyTorch under per-dtype tolerances."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kiln

COVERED_ATEN_OPS: set[str] = set()
"""ATen ops lowered by the op cases run in this session; conftest reports the count."""

PROGRAMS: Path | None = None
"""Where each case's exported program is kept for the session (tests/ops/conftest.py sets it; shared by
pytest-xdist's workers). A case runs on every backend and its export, most of a case's time, is the same for all:
the first backend's is written here and the others load it; a worker that finds none exports it itself."""

TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-7, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class In:
    """One input: shape, dtype, how to fill it, and whether to pass it as a non-contiguous view."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    fill: str = "randn"  # randn | positive | int | index:N | bool | special
    noncontiguous: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    inputs: tuple[In, ...]
    dynamic: Any = None
    run_shapes: tuple[tuple[int, ...], ...] | None = None
    """Shapes to run with (for dynamic cases); default: the export shapes."""
    tol: float | None = None
    extra: dict = field(default_factory=dict)
    """min_torch: (version, reason) for a case that older PyTorch cannot export (the device machine has 2.11).
    float32_reference: why the expected output is the float32 computation rounded to the case's half dtype (where
    PyTorch's own half-precision kernel is less accurate than that on some CPUs)."""

    def __str__(self) -> str:
        return self.name


class FnModule(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def make(spec: In, gen: torch.Generator, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    shape = spec.shape if shape is None else shape
    full = tuple(reversed(shape)) if spec.noncontiguous else shape
    if spec.fill == "bool":
        t = torch.rand(full, generator=gen) > 0.5
    elif spec.fill == "int":
        t = torch.randint(-8, 9, full, generator=gen)
    elif spec.fill.startswith("index:"):
        t = torch.randint(0, int(spec.fill.split(":")[1]), full, generator=gen)
    elif spec.fill == "positive":
        t = torch.rand(full, generator=gen) * 4 + 0.1
    elif spec.fill == "special":
        t = torch.randn(full, generator=gen) * 3
        flat = t.view(-1)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
        flat[: min(5, flat.numel())] = specials[: min(5, flat.numel())]
    else:
        t = torch.randn(full, generator=gen) * 2
    t = t.to(spec.dtype)
    if spec.noncontiguous:
        t = t.permute(*reversed(range(t.dim())))
    return t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def compare(got: Any, want: torch.Tensor, tol: float | None, label: str) -> None:
    from tests.conftest import to_numpy as backend_to_numpy

    got = backend_to_numpy(got)
    assert got.shape == tuple(want.shape), f"{label}: shape {got.shape} != {tuple(want.shape)}"
    if want.dtype.is_floating_point:
        t = tol if tol is not None else TOLERANCE[want.dtype]
        np.testing.assert_allclose(got.astype(np.float64), want.double().numpy(), rtol=t, atol=t, equal_nan=True,
                                   err_msg=label)
    else:
        np.testing.assert_array_equal(got, to_numpy(want), err_msg=label)


def reference(case: Case, args: tuple[Any, ...]) -> list[Any]:
    """Eager PyTorch's outputs for args (see Case.extra's float32_reference)."""
    with torch.no_grad():
        if "float32_reference" in case.extra:
            half = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16)}
            want = case.fn(*[a.float() if isinstance(a, torch.Tensor) and a.dtype in half else a for a in args])
            want = want.to(half.pop()) if half else want
        else:
            want = case.fn(*args)
    return list(want) if isinstance(want, (tuple, list)) else [want]


def check(case: Case, backend: str) -> None:
    if "min_torch" in case.extra:
        version, reason = case.extra["min_torch"]
        if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < version:
            pytest.skip(f"{case.name}: torch {torch.__version__} cannot export it ({reason})")
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))  # str hash() is salted per process
    args = tuple(make(s, gen) for s in case.inputs)
    dynamic = None if case.dynamic is None else (tuple(case.dynamic),)  # FnModule.forward takes *args
    program = exported(case, args, dynamic)
    session = program.session(backend, validate=True)
    runs = [args] if case.run_shapes is None else [
        tuple(make(s, gen, shape) for s, shape in zip(case.inputs, shapes)) for shapes in case.run_shapes]
    for run_args in runs:
        want = reference(case, run_args)
        got = session.run("forward", *[to_numpy(a) for a in run_args])
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            compare(g, w, case.tol, f"{case.name} output {k} on {backend}")
    host_ops = getattr(session.backend, "host_ops", set())
    assert not host_ops, f"{case.name}: {sorted(host_ops)} ran on the host"
    if session.backend.can_capture or session.backend.can_compile:
        check_replayed(program, backend, runs, case)


def _key(case: Case) -> str:
    """A file name for the case's program: its name and a digest of what its export depends on (its function, down
    to the line a lambda is on, and its input specs; the arguments come from the name's seed)."""
    fn = case.fn
    code = getattr(fn, "__code__", None)
    what = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn)),
            code.co_firstlineno if code is not None else None, case.inputs, str(case.dynamic))
    return f"{''.join(c if c.isalnum() or c in '_-' else '_' for c in case.name)}-{zlib.crc32(repr(what).encode()):08x}"


def exported(case: Case, args: tuple[Any, ...], dynamic: Any) -> Any:
    """The case's program, exported (or, where another backend's test of it ran first, loaded from PROGRAMS)."""
    path = None if PROGRAMS is None else PROGRAMS / f"{_key(case)}.kiln"
    if path is not None and path.exists():
        COVERED_ATEN_OPS.update(path.with_suffix(".ops").read_text().split())
        return kiln.load(path.read_bytes())
    # constant folding would compute all-constant cases (arange, full, ...) at export with the CPU kernels and so
    # never run the backend's own kernel
    builder = kiln.export(FnModule(case.fn), args, dynamic_shapes=dynamic, skip_passes={"fold_constants"})
    COVERED_ATEN_OPS.update(builder.source_ops)
    data = builder.to_bytes()
    if path is not None:  # (the ops first: a program found means its ops are there; each file written whole)
        for suffix, payload in ((".ops", " ".join(builder.source_ops).encode()), (".kiln", data)):
            temporary = path.with_suffix(f"{suffix}.{os.getpid()}")
            temporary.write_bytes(payload)
            os.replace(temporary, path.with_suffix(suffix))
    return kiln.load(data)


def check_replayed(program: Any, backend: str, runs: list[tuple[Any, ...]], case: Case) -> None:
    """Each run again on a session that captures (or compiles) graphs: op by op first, then captured and replayed;
    an op with a kernel on the device must be capturable (no host synchronization inside it)."""
    session = program.session(backend, graphs=True)
    for run_args in runs:
        want = reference(case, run_args)
        for attempt in ("op by op", "captured", "replayed"):
            got = session.run("forward", *[to_numpy(a) for a in run_args])
            for k, (g, w) in enumerate(zip(got, want)):
                compare(g, w, case.tol, f"{case.name} output {k} on {backend}, {attempt}")
    if not getattr(session.backend, "host_ops", None):
        failed = [p.env for p in session._plans["forward"].values() if p.replay is False]
        assert not failed, f"{case.name}: capture failed for {failed} though every op has a {backend} kernel"
