"""Mixture-of-experts decoders (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss) at small random-weight sizes: the
experts run as gathered_linear nodes (only the picked experts' weights read), the logits equal transformers' own
expert loop, and int8 programs equal the model with its weights dequantized. test_zoo.py runs the same families
through the decoder checks every family gets (chunked prefill and decode logits, greedy tokens against generate).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kiln.export import Quantize  # noqa: E402 - after the importorskip
from kiln.export.quantize import quantize_rows  # noqa: E402
from kiln.ir.graph import ValueKind  # noqa: E402
from kiln.models.llm import export_llama  # noqa: E402
from kiln.models.zoo import VOCAB, tiny_decoder  # noqa: E402
from kiln.runtime.backends.array_api.quant import dequantize  # noqa: E402
from kiln.runtime.llm.decoding import prefill  # noqa: E402

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]
PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
MAX_CONTEXT, CHUNK = 32, 8


def _moe_layers(model) -> int:
    return sum(1 for m in model.modules() if type(m).__name__.endswith("Experts"))


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_are_gathered_linears_and_match_the_expert_loop(family, backend):
    model = tiny_decoder(family)
    program = export_llama(model, MAX_CONTEXT, CHUNK)
    for name in ("prefill", "decode"):
        method = program.methods[name]
        ops = [n.op for n in method.nodes]
        gated = ops.count("gated_gathered_linear")  # the gate/up product with its activation (not gpt-oss's own)
        assert ops.count("gathered_linear") + gated == 2 * _moe_layers(model), (family, name)
        assert gated == (0 if family == "gpt_oss" else _moe_layers(model)), (family, name)
        for node in method.nodes:  # no expert stack is copied out by an index any more
            if node.op == "index":
                assert not (method.values[node.inputs[0]].kind == ValueKind.CONSTANT
                            and len(method.values[node.inputs[0]].shape) == 3), (family, name)
    session = program.load().session(backend)
    got = prefill(session, PROMPT)
    model.set_experts_implementation("eager")  # transformers' loop over the experts hit: the definition
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_gpt_oss_attention_is_one_sdpa_with_sinks():
    """gpt-oss's attention (transformers' eager function: scores, mask, a sink column, max, softmax, the column
    dropped, the product) exports as one sdpa node a layer with the layer's sinks as its fifth input, after one
    rope_cache_update; the model keeps transformers' own attention implementation."""
    model = tiny_decoder("gpt_oss")
    before = model.config._attn_implementation
    program = export_llama(model, MAX_CONTEXT, CHUNK)
    assert model.config._attn_implementation == before
    layers = model.config.num_hidden_layers
    for name in ("prefill", "decode"):
        method = program.methods[name]
        ops = [n.op for n in method.nodes]
        assert ops.count("softmax") == ops.count("amax") == 0, name
        attention = [n for n in method.nodes if n.op == "sdpa"]
        assert len(attention) == layers and ops.count("rope_cache_update") == layers, name
        sinks = [method.values[n.inputs[4]] for n in attention]
        assert all(v.kind == ValueKind.CONSTANT and v.name.endswith("self_attn.sinks") for v in sinks), name


def _dequantized_copy(model, config: Quantize):
    """The model with every weight matrix (linear, embedding, router, expert stacks) replaced by its quantized
    and dequantized values, quantized by rows as the export quantizes them (gpt-oss's [E, K, N] stacks as the
    [E, N, K] the export stores)."""
    for module in model.modules():
        transposed = getattr(module, "is_transposed", False)
        for name, p in list(module.named_parameters(recurse=False)):
            if p.ndim < 2 or name.endswith("_bias"):
                continue
            w = p.detach().numpy()
            rows = np.ascontiguousarray(w.transpose(0, 2, 1) if transposed and w.ndim == 3 else w)
            k = rows.shape[-1]
            group = config.group_for(k)
            q, scale, zero = quantize_rows(rows.reshape(-1, k), config.bits, group, config.symmetric)
            back = dequantize(np, q, scale.astype(np.float32), None if zero is None else zero.astype(np.float32),
                              config.bits, group).reshape(rows.shape)
            if transposed and w.ndim == 3:
                back = back.transpose(0, 2, 1)
            p.data = torch.from_numpy(np.ascontiguousarray(back))
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_experts_equal_the_dequantized_model(family, backend, monkeypatch):
    # the CPU's int8 linears by default quantize their input rows too (byte dot products, as llama.cpp does):
    # the float kernels compute exactly the dequantized model's products
    monkeypatch.setenv("KILN_QUANT_DOT", "float")
    config = Quantize("int8")
    program = export_llama(tiny_decoder(family), MAX_CONTEXT, CHUNK, quantize=config)
    ops = [n.op for n in program.methods["decode"].nodes]
    assert "gathered_quantized_linear" in ops and "gathered_linear" not in ops
    got = prefill(program.load().session(backend), PROMPT)
    reference = _dequantized_copy(tiny_decoder(family), config)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0, -1].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


# (gpt-oss's quantized experts lower as the others' do: float32 alone covers its attention with sinks and its cat)
@pytest.mark.parametrize("family,mode", [(f, m) for f in FAMILIES for m in (None, "int8", "int4")
                                         if f != "gpt_oss" or m is None],
                         ids=lambda v: {None: "float32"}.get(v, v))
def test_cpu_decode_lowers_whole_into_the_native_executor(family, mode, monkeypatch):
    """route_experts and the gathered linears, float and quantized, with their combine, have executor
    instructions (and gpt-oss's attention with sinks and its rotary table's halves repeated by a cat): a MoE
    decode step is one native call, and it generates what the Python plan does (both call native/experts.c)."""
    from kiln.runtime.backends.cpu import native
    from kiln.runtime.llm.decoding import greedy_generate

    if native.library() is None:
        pytest.skip("no C compiler: no native executor")
    config = None if mode is None else Quantize(mode, group_size=16 if mode == "int4" else None)
    program = export_llama(tiny_decoder(family), MAX_CONTEXT, CHUNK, quantize=config).load()
    results = {}
    for executor in ("native", "python"):
        monkeypatch.setenv("KILN_EXECUTOR", executor)
        session = program.session("cpu")
        tokens = greedy_generate(session, PROMPT, 6)
        results[executor] = tokens, next(iter(session._plans["decode"].values())).lowered is not None
    assert results["native"] == (results["python"][0], True) and results["python"][1] is False


@pytest.mark.parametrize("family,mode", [("qwen3_moe", None), ("qwen3_moe", "int8"), ("gpt_oss", None)],
                         ids=["qwen3_moe-float32", "qwen3_moe-int8", "gpt_oss-float32"])
def test_a_serving_batch_of_experts_lowers_whole_too(family, mode, monkeypatch):
    """A slotted program's decode step over 6 sequences routes 12 rows (several to one expert, more than the 8 rows
    the few-row linears take at once): it still runs as one native call (gpt-oss's too: slot_attention with sinks,
    its rotary halves a cat of a row a sequence), and decodes what the Python plan does."""
    from kiln.runtime.backends.cpu import native
    from kiln.runtime.llm.decoding import decode_batch

    if native.library() is None:
        pytest.skip("no C compiler: no native executor")
    config = None if mode is None else Quantize(mode)
    program = export_llama(tiny_decoder(family), MAX_CONTEXT, CHUNK, slots=6, quantize=config).load()
    prompts = [PROMPT[i:i + 3 + i] for i in range(6)]
    results = {}
    for executor in ("native", "python"):
        monkeypatch.setenv("KILN_EXECUTOR", executor)
        session = program.session("cpu")
        last = [int(np.argmax(prefill(session, p, 0, slot))) for slot, p in enumerate(prompts)]
        positions, tokens = [len(p) for p in prompts], [list(last)]
        for _ in range(4):
            logits = decode_batch(session, tokens[-1], positions, list(range(6)))
            tokens.append([int(np.argmax(row)) for row in logits])
            positions = [q + 1 for q in positions]
        lowered = any(plan.lowered is not None for plan in session._plans["decode"].values())
        results[executor] = tokens, lowered
    assert results["native"] == (results["python"][0], True) and results["python"][1] is False
