"""Memory planning: the exporter records each value's last reader and the runtime drops temporaries there, so a
chain of large intermediates never holds more than a few of them at once."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from torch import nn

import kiln
from kiln.export.plan import plan_memory
from kiln.ir.dtypes import DType
from kiln.ir.graph import Method, Node, StateUpdate, Value, ValueKind

N = 1 << 19  # float32 elements per intermediate: 2 MiB each


class Chain(nn.Module):
    """Ten large elementwise intermediates in a row; x is read again at the end, so the input stays alive."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x * 1.5
        b = torch.sin(a)
        c = b + 2.0
        d = torch.cos(c)
        e = d * d
        f = torch.abs(e)
        g = f - 0.5
        h = torch.tanh(g)
        i = h * 3.0
        j = torch.exp(i)
        return j + x


@pytest.fixture(scope="module")
def chain_bytes() -> bytes:
    return kiln.export(Chain(), (torch.randn(N),)).to_bytes()


def last_readers(method: Method) -> dict[int, int]:
    last = {}
    for j, node in enumerate(method.nodes):
        for i in node.inputs:
            last[i] = j
    return last


def test_exporter_records_last_uses(chain_bytes):
    method = kiln.load(chain_bytes).ir.methods["forward"]
    temps = [i for i, v in enumerate(method.values) if v.kind == ValueKind.TEMP]
    assert len(temps) == 11
    freed = {i: j for j, node in enumerate(method.nodes) for i in node.free_after}
    assert sum(len(node.free_after) for node in method.nodes) == len(freed)  # nothing freed twice
    assert all(node.free_after for node in method.nodes[1:])  # every later step drops the step before it
    for output in method.outputs:
        assert output not in freed
    for i in set(temps) - set(method.outputs):
        assert freed[i] == last_readers(method)[i], method.values[i].name
    for i, v in enumerate(method.values):
        if v.kind in (ValueKind.CONSTANT, ValueKind.STATE):
            assert i not in freed, v.name
    assert freed[method.inputs[0]] == len(method.nodes) - 1  # the input is read by the last node


def test_plan_memory_rules():
    """Hand-built: an unread result is dropped where it is made; state updates, outputs, constants are kept."""
    f32 = DType.float32
    values = [Value("x", f32, (4,), ValueKind.INPUT), Value("w", f32, (4,), ValueKind.CONSTANT, 0),
              Value("s", f32, (4,), ValueKind.STATE, 0), Value("a", f32, (4,)), Value("unused", f32, (4,)),
              Value("new_s", f32, (4,)), Value("out", f32, (4,))]
    nodes = [Node("add", [0, 1], [3]), Node("neg", [3], [4]), Node("add", [2, 3], [5]), Node("mul", [5, 1], [6])]
    method = Method("forward", values, [0], [6], nodes, state_updates=[StateUpdate(5, 0)])
    nodes[0].free_after = [99]  # stale plans are replaced, not extended
    plan_memory(method)
    assert [n.free_after for n in nodes] == [[0], [4], [3], []]


def peak_bytes(program: kiln.Program, x: np.ndarray) -> tuple[int, np.ndarray]:
    session = program.session()
    session.run("forward", x)  # plan built and constants wrapped outside the measurement
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        out = session.run("forward", x)[0]
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return peak, out


def test_freeing_keeps_peak_memory_far_below_the_sum_of_intermediates(chain_bytes):
    x = np.random.default_rng(0).standard_normal(N, dtype=np.float32)
    freeing = kiln.load(chain_bytes)
    hoarding = kiln.load(chain_bytes)  # the same program with its memory plan removed
    for node in hoarding.ir.methods["forward"].nodes:
        node.free_after = []
    method = freeing.ir.methods["forward"]
    intermediates = sum(4 * N for i, v in enumerate(method.values)
                        if v.kind == ValueKind.TEMP and i not in method.outputs)
    assert intermediates == 10 * 4 * N

    peak_free, out_free = peak_bytes(freeing, x)
    peak_hoard, out_hoard = peak_bytes(hoarding, x)
    np.testing.assert_array_equal(out_free, out_hoard)
    with torch.no_grad():
        np.testing.assert_allclose(out_free, Chain()(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)
    # With the plan, about two intermediates and the output are alive at once; without it, all of them.
    assert peak_free < 0.5 * intermediates, (peak_free, intermediates)
    assert peak_hoard >= 0.9 * intermediates, (peak_hoard, intermediates)
    assert peak_hoard > 2 * peak_free
