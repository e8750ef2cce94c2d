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
    first, second = llama_program.session("cuda"), llama_program.session("cuda")
    assert first.backend.constant(0) is second.backend.constant(0)
