"""Mixture-of-experts GGUF files as llama.cpp users bring them (Qwen3-MoE "qwen3moe" and Qwen2-MoE "qwen2moe": the
experts as ffn_{gate,up,down}_exps stacks): loaded at their own expert widths (transformers' GGUF mapping leaves
expert_feed_forward_length and the shared expert's out), the expert stacks kept in the file's quantization exactly
(gathered_quantized_linear over the stack's rows), and the logits and greedy tokens what transformers computes from
the dequantized file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from tests.models.gguf_files import write_qwen_moe  # noqa: E402

EXPERT_TYPES = {"Q8_0": (8, 32, False), "Q4_K": (4, 32, True), "Q6_K": (8, 16, False), "Q4_0": (4, 32, False)}
"""GGUF type -> the kiln format its experts are kept in (bits, group, offset)."""


FILES = [("qwen3moe", t) for t in sorted(EXPERT_TYPES)] + [("qwen2moe", "Q4_K")]


@pytest.fixture(scope="module", params=FILES, ids=lambda f: "-".join(f))
def moe_file(request, tmp_path_factory):
    from kiln.models.llm import export_llm
    from kiln.models.llm_source import load_causal_lm

    arch, expert_type = request.param
    path = write_qwen_moe(tmp_path_factory.mktemp("gguf") / f"{arch}-{expert_type}.gguf", expert_type, arch)
    model, _ = load_causal_lm(path)
    model.set_experts_implementation("eager")  # transformers' own loop over the experts hit: the reference
    return expert_type, path, export_llm(path, max_context=32, prefill_chunk=8).load(), model


def test_expert_stacks_keep_the_files_quantization(moe_file):
    expert_type, _, program, model = moe_file
    assert model.config.moe_intermediate_size == 256  # the file's expert width, not transformers' default 768
    if model.config.model_type == "qwen2_moe":
        assert model.config.shared_expert_intermediate_size == 512
    for name in ("prefill", "decode"):
        experts = [n for n in program.method(name).nodes if n.op.startswith("gathered")]
        assert len(experts) == 2 * model.config.num_hidden_layers
        assert {(n.op, n.attrs["bits"], n.attrs["group_size"], bool(n.attrs.get("offset", False)))
                for n in experts} == {("gathered_quantized_linear", *EXPERT_TYPES[expert_type])}


def test_logits_and_greedy_tokens_match_transformers(moe_file, backend, monkeypatch):
    from kiln.runtime.llm.decoding import greedy_generate, prefill

    _, _, program, model = moe_file
    monkeypatch.setenv("KILN_QUANT_DOT", "float")  # (the CPU's float kernels: the dequantized model's products)
    ids = [5, 9, 17, 33, 4, 21]
    session = program.session(backend)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0, -1].numpy()
        tokens = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    np.testing.assert_allclose(prefill(session, ids), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert greedy_generate(program.session(backend), ids, 8) == tokens


def test_dequantize_keeps_the_experts_float(moe_file):
    from kiln.models.llm import export_llm

    _, path, program, _ = moe_file
    floats = export_llm(path, max_context=32, prefill_chunk=8, dequantize=True).load()
    ops = [n.op for n in floats.method("decode").nodes]
    assert "gathered_linear" in ops and "gathered_quantized_linear" not in ops
    assert program.constant_bytes < floats.constant_bytes / 2
