"""A/B of the batch-norm folding pass: one model exported with and without it, timed interleaved in one process.

    PYTHONPATH=. OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/fold_batch_norm_ab.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import kiln
import kiln.export as kiln_export
from kiln.models import vision
from tests.models.test_vision import randomized


def export(model: torch.nn.Module, x: torch.Tensor, fold: bool) -> kiln.Program:
    """The program with or without the pass (switched off by replacing it with a no-op for this one export)."""
    original = kiln_export.fold_batch_norm
    if not fold:
        kiln_export.fold_batch_norm = lambda method, builder: 0
    try:
        return kiln_export.export(model, (x,)).load()
    finally:
        kiln_export.fold_batch_norm = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=15, help="interleaved timed runs per variant (default 15)")
    args = parser.parse_args()
    torch.manual_seed(0)
    models = {"mobilenet_v3_small": randomized(vision.mobilenet_v3_small(), seed=1),
              "efficientnet_lite0": vision.efficientnet_lite0().eval()}
    print(f"{'model':<20} {'variant':<8} {'bn nodes':>8} {'max |err|':>10} {'median ms':>10}")
    for name, model in models.items():
        x = torch.randn(1, 3, 224, 224)
        with torch.no_grad():
            ref = model(x).numpy()
        sessions = {fold: export(model, x, fold).session() for fold in (False, True)}
        xs = x.numpy()
        times: dict[bool, list[float]] = {False: [], True: []}
        for session in sessions.values():
            session.run("forward", xs)  # warm-up: plans
        for _ in range(args.repeat):
            for fold, session in sessions.items():
                t0 = time.perf_counter()
                session.run("forward", xs)
                times[fold].append(time.perf_counter() - t0)
        for fold, session in sessions.items():
            err = np.abs(session.run("forward", xs)[0] - ref).max()
            bn = sum(n.op == "batch_norm" for n in session.program.ir.methods["forward"].nodes)
            print(f"{name:<20} {'fold' if fold else 'no fold':<8} {bn:>8} {err:>10.2e} "
                  f"{np.median(times[fold]) * 1e3:>10.1f}")


if __name__ == "__main__":
    main()
