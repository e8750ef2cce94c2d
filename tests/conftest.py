"""Shared test helpers: available backends, seeded generators, export-and-run against eager."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import kiln


def available_backends() -> list[str]:
    """cpu always; cuda when kiln has a cuda backend and CuPy sees a GPU; mlx when MLX is installed."""
    from kiln.runtime.backends import BACKENDS as REGISTERED

    backends = ["cpu"]
    if "mlx" in REGISTERED and importlib.util.find_spec("mlx") is not None:
        backends.append("mlx")
    if "cuda" in REGISTERED and importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                backends.append("cuda")
        except Exception:  # noqa: BLE001 - no driver, no device: no cuda backend
            pass
    return backends


BACKENDS = available_backends()


@pytest.fixture(params=[pytest.param(b, marks=pytest.mark.cuda) if b == "cuda" else b for b in BACKENDS])
def backend(request) -> str:
    """Each backend present; cuda cases carry the `cuda` marker so `-m cuda` selects them."""
    return request.param


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def to_numpy(x) -> np.ndarray:
    """A backend's array (NumPy, CuPy, MLX) as NumPy."""
    if hasattr(x, "get"):
        x = x.get()
    if type(x).__module__.startswith("mlx"):
        from kiln.runtime.backends.mlx.arrays import to_numpy as mlx_to_numpy

        return mlx_to_numpy(x)
    return np.asarray(x)


def export_run(module: torch.nn.Module, args: tuple, backend: str = "cpu", dynamic_shapes=None,
               run_args: tuple | None = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Export `module`, run it with the runtime (validating every kernel) and eagerly; returns (kiln, eager)."""
    program = kiln.export(module, args, dynamic_shapes=dynamic_shapes).load()
    run_args = args if run_args is None else run_args
    outs = program.session(backend, validate=True).run("forward", *[a.numpy() for a in run_args])
    with torch.no_grad():
        ref = module(*run_args)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    return [to_numpy(o) for o in outs], [r.detach().numpy() for r in ref]


def pytest_terminal_summary(terminalreporter) -> None:
    """How wide the op tests reached: distinct ATen ops lowered by the table-driven cases of this run."""
    from tests.ops.harness import COVERED_ATEN_OPS

    if COVERED_ATEN_OPS:
        ops = sorted(o for o in COVERED_ATEN_OPS if o.startswith("aten."))
        terminalreporter.write_line(f"op tests covered {len(ops)} distinct ATen ops")
