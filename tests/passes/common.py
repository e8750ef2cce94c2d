"""What the pass tests share: export a model, check it still matches eager, and look at its graph."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import kiln


def export_checked(model: nn.Module, args: tuple, tol: float = 1e-5, **export_options):
    """Export `model`, run the program on `args` (validate mode) and compare every output with eager."""
    program = kiln.export(model.eval(), args, **export_options).load()
    out = program.session(validate=True).run("forward", *[a.numpy() for a in args])
    with torch.no_grad():
        ref = model(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(out, ref, strict=True):
        np.testing.assert_allclose(o, r.numpy(), rtol=tol, atol=tol)
    return program


def ops(program, method: str = "forward") -> list[str]:
    return [n.op for n in program.ir.methods[method].nodes]


def nodes(program, op: str, method: str = "forward") -> list:
    return [n for n in program.ir.methods[method].nodes if n.op == op]
