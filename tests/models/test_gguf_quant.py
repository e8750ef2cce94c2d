"""A GGUF file's quantization kept exactly (kiln.models.gguf_quant): every decoder against the gguf package's own
dequantization bit for bit, and export_llm of small GGUF files of mixed types against transformers loading them."""

from __future__ import annotations

import logging

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kiln.models.gguf_quant import DECODERS, decode, dequantize  # noqa: E402
from tests.models.gguf_files import quantized, random_blocks, write_llama  # noqa: E402


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("type_name", sorted(DECODERS))
def test_decoded_blocks_dequantize_to_the_gguf_packages_values_bit_for_bit(type_name):
    """Random blocks (every code and sub-scale bit pattern is a weight) and, where the package quantizes, quantized
    random weights: kiln's layout, dequantized by the op's own definition, is the package's dequantization."""
    rng = np.random.default_rng(len(type_name))
    qtype = gguf.GGMLQuantizationType[type_name]
    for raw in (random_blocks(type_name, 24, 512, rng), quantized(type_name, 24, 512, rng)):
        want = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(24, 512)
        stored = decode(type_name, raw, (24, 512))
        layout = DECODERS[type_name][0]
        assert (stored.bits, stored.group, stored.offset) == (layout.bits, layout.group, layout.offset)
        assert stored.q.dtype == (np.uint8 if stored.bits == 4 else np.int8)
        assert _same_bits(dequantize(stored), want)


def test_offsets_with_a_zero_scale_are_kept():
    """A Q4_1 block whose values are all equal has scale 0 and its value as the min: W = offset."""
    block = np.zeros((1, 20), np.uint8)
    block[0, 0:2] = np.array([0.0], np.float16).view(np.uint8)
    block[0, 2:4] = np.array([-0.75], np.float16).view(np.uint8)
    block[0, 4:] = 0x5A  # codes that a zero scale ignores
    stored = decode("Q4_1", block, (1, 32))
    assert np.all(dequantize(stored) == -0.75)


def _greedy(model, ids: list[int], count: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=count, do_sample=False)
    return out[0, len(ids):].tolist()


def _stored_formats(program) -> set[tuple]:
    """(op, bits, group, offset) of the quantized nodes, a fused linear's (add_rms_norm_quantized_linear,
    gated_quantized_linear) counted as quantized_linear."""
    method = program.method("decode")
    return {("quantized_linear" if n.op.endswith("quantized_linear") else n.op, n.attrs["bits"],
             n.attrs["group_size"], bool(n.attrs.get("offset", False)))
            for n in method.nodes if "quantized" in n.op}


MIXED = {"embd": "Q8_0", "q": "Q4_K", "k": "Q5_K", "v": "Q6_K", "o": "Q3_K", "gate": "Q2_K", "up": "Q4_K",
         "down": "Q5_0", "out": "Q4_1"}
"""Every exact type in one model (Q4_0, Q5_1 and the rest of the legacy family are covered above)."""


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    from kiln.models.llm import export_llm
    from kiln.models.llm_source import load_causal_lm

    path = write_llama(tmp_path_factory.mktemp("gguf") / "mixed.gguf", MIXED)
    program = export_llm(path, max_context=64, prefill_chunk=8).load()
    model, _ = load_causal_lm(path)
    return path, program, model


def test_export_keeps_every_exact_type(mixed):
    _, program, _ = mixed
    assert _stored_formats(program) == {
        ("quantized_embedding", 8, 32, False),  # Q8_0
        ("quantized_linear", 4, 32, True),  # Q4_K, Q4_1 (the untied output)
        ("quantized_linear", 8, 32, True),  # Q5_K
        ("quantized_linear", 8, 16, False),  # Q6_K
        ("quantized_linear", 4, 16, False),  # Q3_K
        ("quantized_linear", 4, 16, True),  # Q2_K
        ("quantized_linear", 8, 32, False),  # Q5_0
    }
    assert not any(n.op == "linear" for n in program.method("decode").nodes)  # (the projections of one format stack)


def test_kept_quantization_generates_what_transformers_does(mixed, backend, monkeypatch):
    """transformers runs the GGUF's dequantized weights in float32; kiln runs the same weights from their blocks
    (the CPU's float kernels: its default int8 inputs round activations as llama.cpp does, which moves a random
    model's near-tied logits)."""
    from kiln.runtime.llm.decoding import greedy_generate

    _, program, model = mixed
    monkeypatch.setenv("KILN_QUANT_DOT", "float")
    ids = [5, 9, 17, 33, 4]
    assert greedy_generate(program.session(backend), ids, 12) == _greedy(model, ids, 12)


def test_dequantize_and_quantize_choose_otherwise(mixed):
    from kiln.models.llm import export_llm

    path, program, _ = mixed
    floats = export_llm(path, max_context=64, prefill_chunk=8, dequantize=True).load()
    assert _stored_formats(floats) == set()
    again = export_llm(path, max_context=64, prefill_chunk=8, quantize="int8").load()
    assert {(f[1], f[3]) for f in _stored_formats(again)} == {(8, False)}  # int8 per channel from the floats
    assert program.constant_bytes < floats.constant_bytes / 3


def test_types_without_an_exact_format_are_requantized_with_a_warning(tmp_path, caplog):
    """IQ4_NL maps 4-bit codes through a non-uniform table: stored as int4 groups of 32 from its values, said."""
    from kiln.models.llm import export_llm

    path = write_llama(tmp_path / "iq.gguf", {"gate": "IQ4_NL", "up": "IQ4_NL"}, layers=1)
    with caplog.at_level(logging.INFO, logger="kiln.models.llm"):
        program = export_llm(path, max_context=32, prefill_chunk=8).load()
    assert ("quantized_linear", 4, 32, False) in _stored_formats(program)
    text = caplog.text
    assert "re-quantized" in text and "2 IQ4_NL" in text and "RMS error" in text
    assert "kept the GGUF's quantization exactly" in text


def test_export_llm_command_keeps_or_dequantizes(mixed, tmp_path, capsys, caplog):
    import kiln
    from kiln.cli import main

    path, _, _ = mixed
    with caplog.at_level(logging.INFO, logger="kiln.models.llm"):
        assert main(["export-llm", str(path), "-o", str(tmp_path / "kept.kiln"), "--max-context", "32"]) == 0
    assert "kept the GGUF's quantization exactly" in caplog.text
    assert _stored_formats(kiln.load(tmp_path / "kept.kiln"))
    assert main(["export-llm", str(path), "-o", str(tmp_path / "f.kiln"), "--max-context", "32", "--dequantize"]) == 0
    assert not _stored_formats(kiln.load(tmp_path / "f.kiln"))
    assert main(["export-llm", str(path), "-o", str(tmp_path / "x.kiln"), "--dequantize", "--quantize", "int8"]) == 2
    assert "--dequantize applies to a .gguf SOURCE without --quantize" in capsys.readouterr().err
