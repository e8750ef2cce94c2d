"""The cuda backend: a clear error without CuPy or a GPU; on a GPU, an LLM program runs there end to end."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import kiln
from tests.conftest import BACKENDS

HAS_GPU = "cuda" in BACKENDS


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_the_error_says_what_to_install():
    import torch

    program = kiln.export(torch.nn.Linear(2, 2), (torch.randn(1, 2),)).load()
    with pytest.raises(kiln.BackendUnavailableError, match="needs CuPy"):
        program.session("cuda")


@pytest.fixture(scope="module")
def llama_program():
    from kiln.models.llm import export_llm
    from kiln.models.zoo import tiny_decoder

    return export_llm(tiny_decoder("llama"), max_context=48, prefill_chunk=8).load()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with CuPy")
def test_llm_runs_on_the_gpu_like_the_cpu(llama_program):
    import cupy

    from kiln.runtime.llm.decoding import greedy_generate

    prompt = [11, 13, 6, 40, 41, 42, 43, 44, 45, 46, 47]
    cpu = greedy_generate(llama_program.session("cpu"), prompt, 24)
    session = llama_program.session("cuda", validate=True)
    assert greedy_generate(session, prompt, 24) == cpu
    assert session.backend.host_ops == set(), "every op of a Llama step has a CUDA kernel"
    logits = session.run("decode", np.array([[5]]), np.array([35]))[0]
    assert isinstance(logits, cupy.ndarray)
    again = session.run("decode", cupy.asarray([[5]]), cupy.asarray([35]))[0]  # CuPy inputs too
    np.testing.assert_allclose(cupy.asnumpy(again), cupy.asnumpy(logits), rtol=1e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with CuPy")
def test_constants_are_uploaded_once_per_program(llama_program):
    from kiln.runtime.backends.cuda import constants

    first, second = llama_program.session("cuda"), llama_program.session("cuda")
    assert first.backend.constant(0) is second.backend.constant(0)
    weight = first.backend.constant(0)
    assert constants.is_constant(weight) and constants.is_constant(weight.T), "early GEMVs may read it first"
    assert not constants.is_constant(weight.copy()) and not constants.is_constant(first.backend.empty_like(weight))


def test_graphs_are_refused_by_a_backend_that_cannot_capture(llama_program):
    with pytest.raises(kiln.KilnError, match="cannot capture or compile graphs"):
        llama_program.session("cpu", graphs=True)
    assert llama_program.session("cpu").graphs is False


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with CuPy")
def test_decode_replays_as_a_graph_with_the_same_tokens(llama_program):
    from kiln.runtime.graphs import Replay
    from kiln.runtime.llm.decoding import greedy_generate

    prompt = [11, 13, 6, 40, 41, 42, 43, 44, 45, 46, 47]
    op_by_op = llama_program.session("cuda", graphs=False)
    graphed = llama_program.session("cuda", graphs=True)
    want = greedy_generate(op_by_op, prompt, 24)
    assert greedy_generate(graphed, prompt, 24) == want
    decode_plans = list(graphed._plans["decode"].values())
    assert len(decode_plans) == 1 and isinstance(decode_plans[0].replay, Replay)
    # a reset keeps the buffers the graphs write (and a second generation replays the same graphs)
    state = list(graphed.state)
    assert greedy_generate(graphed, prompt, 24) == want
    assert all(a is b for a, b in zip(state, graphed.state, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with CuPy")
def test_a_replay_does_not_rewrite_outputs_handed_out_before(llama_program):
    import cupy

    session = llama_program.session("cuda", graphs=True)
    outs = [session.run("decode", np.array([[t]]), np.array([3]))[0] for t in (5, 5, 5, 9)]
    first, second, third, other = (cupy.asnumpy(o) for o in outs)
    np.testing.assert_allclose(second, first, rtol=1e-5, atol=1e-5)  # op by op, then captured
    np.testing.assert_allclose(third, first, rtol=1e-5, atol=1e-5)  # replayed
    assert not np.allclose(other, first)
    np.testing.assert_array_equal(cupy.asnumpy(outs[2]), third)  # still what it was


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with CuPy")
def test_graphs_per_signature_are_bounded(llama_program, monkeypatch):
    import kiln.runtime.session as session_module

    monkeypatch.setattr(session_module, "MAX_GRAPHS_PER_METHOD", 2)
    session = llama_program.session("cuda", graphs=True)
    for length in (2, 3, 4, 2):
        tokens = np.arange(length)[None] + 5
        for _ in range(3):
            session.run("prefill", tokens, np.arange(length))
    kept = [dict(key) for key in session._graphed["prefill"]]
    assert [sorted(env.values()) for env in kept] == [[4], [2]]  # 2's graph was evicted by 4, then captured again


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with CuPy")
def test_a_method_with_a_host_op_runs_op_by_op_and_correctly():
    import torch

    class Odd(torch.nn.Module):
        def forward(self, x, index, source):  # an int16 product scatter: no atomic form, so it runs on the host
            return x.scatter_reduce(0, index, source, "prod") * 2

    args = (torch.arange(1, 6, dtype=torch.int16), torch.tensor([0, 1, 1, 4]), torch.tensor([2, 3, -1, 5],
                                                                                              dtype=torch.int16))
    want = Odd()(*args).numpy()
    program = kiln.export(Odd(), args).load()
    session = program.session("cuda", graphs=True)
    for _ in range(3):
        got = session.run("forward", *[a.numpy() for a in args])[0]
        np.testing.assert_array_equal(session.backend.to_numpy(got), want)
    assert session.backend.host_ops == {"scatter_reduce"}
    assert [p.replay for p in session._plans["forward"].values()] == [False]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with CuPy")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bfloat16_llm_steps_on_the_gpu_are_as_accurate_as_on_the_cpu(family):
    """bfloat16 end to end (cuBLAS bf16 products, the fused kernels, the split-key decode attention over a cache
    of several chunks), teacher-forced so that every step sees the same inputs: the GPU's distance to the same
    weights run in float32 is within twice the CPU's (both round differently, neither may be worse)."""
    import copy

    import cupy
    import torch

    from kiln.models.llm import export_llm
    from kiln.models.zoo import tiny_decoder

    model = tiny_decoder(family).to(torch.bfloat16)
    reference = export_llm(copy.deepcopy(model).float(), max_context=160, prefill_chunk=8).load().session("cpu")
    program = export_llm(model, max_context=160, prefill_chunk=8).load()
    sessions = {"ref": reference, "cpu": program.session("cpu"), "gpu": program.session("cuda")}
    tokens = [11, 13, 6, 40, 41, 42, 43, 44] + list(range(50, 70))
    steps = [{k: s.run("prefill", np.array([tokens[:8]]), np.arange(8))[0] for k, s in sessions.items()}]
    for position in range(8, len(tokens)):
        token, at = np.array([[tokens[position]]]), np.array([position])
        steps.append({k: s.run("decode", token, at)[0] for k, s in sessions.items()})
    assert sessions["gpu"].backend.host_ops == set()
    for step in steps:
        ref = step["ref"]
        cpu_error = np.abs(step["cpu"].astype(np.float32) - ref).max()
        gpu_error = np.abs(cupy.asnumpy(step["gpu"]).astype(np.float32) - ref).max()
        assert gpu_error <= 2 * cpu_error + 0.01 * np.abs(ref).max(), (gpu_error, cpu_error)
