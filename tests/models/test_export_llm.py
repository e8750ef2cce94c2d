"""export_llm and `kiln export-llm`: from a model object or a checkpoint folder to a program that carries its
tokenizer, chat template and stop tokens, and generates what transformers generates."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.models.llm import export_llm  # noqa: E402
from kiln.models.zoo import CHAT_TEMPLATE, tiny_decoder, tiny_tokenizer  # noqa: E402
from kiln.runtime.llm import info  # noqa: E402
from kiln.runtime.llm.decoding import greedy_generate  # noqa: E402
from tests.models.greedy_reference import greedy_reference  # noqa: E402

PROMPT = [11, 13, 6, 40, 41, 42, 43, 44, 45, 46, 47]  # longer than one 8-token chunk


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama saved as transformers saves a checkpoint: config, safetensors, tokenizer files."""
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    model = tiny_decoder("llama")
    model.generation_config.eos_token_id = [2, 4]
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder, model


def test_checkpoint_folder_carries_tokenizer_template_and_stop_tokens(checkpoint):
    folder, model = checkpoint
    program = export_llm(folder, max_context=48, prefill_chunk=8).load()
    meta = info.LLMInfo.from_metadata(program.metadata)
    assert (meta.max_context, meta.prefill_chunk, meta.vocab_size) == (48, 8, 128)
    assert meta.stop_token_ids == (2, 4) and meta.chat_template == CHAT_TEMPLATE
    assert meta.special_tokens["eos_token"] == "</s>" and meta.name == "tiny-llama" and meta.model_type == "llama"
    assert json.loads(meta.tokenizer_json) == json.loads(tiny_tokenizer().backend_tokenizer.to_str())
    assert greedy_generate(program.session(), PROMPT, 32) == greedy_reference(model, PROMPT, 32, 1e-4)


def test_model_object_without_tokenizer_keeps_token_ids_only():
    model = tiny_decoder("qwen2")
    meta = export_llm(model, max_context=32, prefill_chunk=4).load().metadata
    assert info.TOKENIZER_KEY not in meta and info.CHAT_TEMPLATE_KEY not in meta
    assert meta[info.MAX_CONTEXT_KEY] == "32" and meta[info.RING_CACHE_KEY] == "0"


def test_sliding_window_model_records_its_ring_cache():
    meta = export_llm(tiny_decoder("mistral"), max_context=64, prefill_chunk=8).load().metadata
    assert info.LLMInfo.from_metadata(meta).ring_cache and info.LLMInfo.from_metadata(meta).max_rewind(30) == 8


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_half_precision_generates_what_transformers_does(dtype, torch_dtype):
    model = tiny_decoder("llama")
    program = export_llm(model, max_context=48, prefill_chunk=8, dtype=dtype).load()
    assert program.ir.methods["decode"].values[program.ir.methods["decode"].outputs[0]].dtype.name == dtype
    reference = tiny_decoder("llama").to(torch_dtype)
    with torch.no_grad():
        want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False)[0, len(PROMPT):]
    assert greedy_generate(program.session(), PROMPT, 16) == want.tolist()


def test_quantized_export_uses_quantized_ops():
    program = export_llm(tiny_decoder("llama"), max_context=32, prefill_chunk=4, quantize="int8").load()
    assert any(n.op == "quantized_linear" for n in program.ir.methods["decode"].nodes)


def test_bad_sources_and_options_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        export_llm(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="neither a .gguf file nor a checkpoint folder"):
        export_llm(tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_llm(tiny_decoder("llama"), dtype="int8")


def test_cli_export_llm_writes_a_generating_program(checkpoint, tmp_path, capsys):
    folder, model = checkpoint
    out = tmp_path / "tiny.kiln"
    assert main(["export-llm", str(folder), "-o", str(out), "--max-context", "40", "--prefill-chunk", "8"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "methods: prefill" in printed
    program = kiln.load(out)
    assert program.metadata[info.MAX_CONTEXT_KEY] == "40"
    assert greedy_generate(program.session(), PROMPT, 8) == greedy_reference(model, PROMPT, 8, 1e-4)
    assert main(["export-llm", str(tmp_path / "nope"), "-o", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_export_llm_slots(checkpoint, tmp_path, capsys):
    folder, model = checkpoint
    out = tmp_path / "slots.kiln"
    assert main(["export-llm", str(folder), "-o", str(out), "--max-context", "40", "--prefill-chunk", "8",
                 "--slots", "3"]) == 0
    program = kiln.load(out)
    assert info.LLMInfo.from_metadata(program.metadata).slots == 3
    assert greedy_generate(program.session(), PROMPT, 8) == greedy_reference(model, PROMPT, 8, 1e-4)
    capsys.readouterr()
    assert main(["export-llm", str(folder), "-o", str(out), "--slots", "0"]) == 2
    assert "--slots must be at least 1" in capsys.readouterr().err
