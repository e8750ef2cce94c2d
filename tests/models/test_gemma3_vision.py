"""Gemma 3 with images at a scaled-down random-weight config: the torch-free preprocessing equal to transformers'
Gemma 3 image processor, and the exported program's logits (prefill over the image and the prompt, then decode
steps) and greedy tokens equal to transformers' model given the same pixels and token types, on every backend; the
image's tokens attend each other both ways (it matters: a causal mask gives other logits)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("PIL")

from PIL import Image  # noqa: E402

from kiln.errors import InputError  # noqa: E402
from kiln.models.gemma3_vision import export_gemma3_vision  # noqa: E402
from kiln.models.zoo import GEMMA3_IMAGE_WORDS, gemma3_image_tokenizer, tiny_gemma3_vision  # noqa: E402
from kiln.runtime.image_text import ImageTextInfo, ImageTextModel, preprocess  # noqa: E402
from kiln.runtime.llm.decoding import decode_step  # noqa: E402
from tests.conftest import BACKENDS  # noqa: E402

PROMPT = "w12 w40 w7 w3 w90"
IMAGE_TOKEN = GEMMA3_IMAGE_WORDS.index("<image_soft_token>")


@pytest.fixture(scope="module")
def picture() -> Path:
    matplotlib = pytest.importorskip("matplotlib")
    return Path(matplotlib.__file__).parent / "mpl-data" / "sample_data" / "grace_hopper.jpg"


@pytest.fixture(scope="module")
def program():
    return export_gemma3_vision(tiny_gemma3_vision(), max_context=64, prefill_chunk=8,
                                tokenizer=gemma3_image_tokenizer()).load()


def _processor_pixels(image, size: int) -> torch.Tensor:
    from transformers import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": size, "width": size})(image, return_tensors="pt").pixel_values


def _reference_logits(model, ids: list[int], pixels: torch.Tensor, bidirectional: bool = True) -> np.ndarray:
    types = torch.tensor([[1 if i == IMAGE_TOKEN else 0 for i in ids]]) if bidirectional else None
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=types).logits[0, -1].numpy()


@pytest.mark.parametrize("size", [32, 57])
def test_preprocessing_equals_the_processor(picture, size):
    info = ImageTextInfo("gemma3", size, 4, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), {})
    wide = Image.open(picture).convert("RGB").crop((0, 100, 512, 400))  # not square, resized both ways
    for image in (Image.open(picture), wide, wide.convert("L")):
        np.testing.assert_allclose(preprocess(image, info), _processor_pixels(image, size).numpy(), atol=1e-5)


def test_logits_and_greedy_tokens_equal_transformers(program, picture, backend):
    model = tiny_gemma3_vision()
    vlm = ImageTextModel(program, backend)
    pixels = _processor_pixels(Image.open(picture), 32)
    ids, got = vlm.prefill(str(picture), PROMPT)
    assert len(ids) > vlm.llm.prefill_chunk  # the prompt takes two prefill chunks
    np.testing.assert_allclose(got, _reference_logits(model, ids, pixels), rtol=1e-4, atol=1e-4)
    sequence = list(ids)
    for _ in range(4):  # decode steps after the image: the cache holds what transformers recomputes
        sequence.append(int(np.argmax(got)))
        got = decode_step(vlm.session, sequence[-1], len(sequence) - 1, info=vlm.llm)
        np.testing.assert_allclose(got, _reference_logits(model, sequence, pixels), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=8, do_sample=False,
                              token_type_ids=torch.tensor([[int(i == IMAGE_TOKEN) for i in ids]]))
    assert vlm.generate(str(picture), PROMPT, 8) == want[0, len(ids):].tolist()


@pytest.mark.parametrize("all_sliding", [False, True], ids=["full-layers", "sliding-ring-layers"])
def test_image_tokens_attend_each_other_both_ways(program, picture, all_sliding):
    """Without the block overlay (a causal mask over the image's tokens) the logits are another function; kiln's
    are transformers' with it, in full layers and in sliding layers kept in ring caches."""
    model = tiny_gemma3_vision(all_sliding=all_sliding)
    if all_sliding:
        program = export_gemma3_vision(model, max_context=32, prefill_chunk=8, tokenizer=gemma3_image_tokenizer())
        assert program.metadata["kiln.llm.ring_cache"] == "1"
        program = program.load()
    # sliding layers: a short prompt, so that the image stays inside the windows the last position reaches
    ids, got = ImageTextModel(program).prefill(str(picture), [20, 48] if all_sliding else PROMPT)
    assert len(ids) > 8  # two prefill chunks
    pixels = _processor_pixels(Image.open(picture), 32)
    want, causal = _reference_logits(model, ids, pixels), _reference_logits(model, ids, pixels, bidirectional=False)
    assert np.abs(causal - want).max() > 1e-2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_programs_too_small_for_an_image_are_refused(picture):
    with pytest.raises(ValueError, match="cannot hold an image's 4 tokens"):
        export_gemma3_vision(tiny_gemma3_vision(), max_context=64, prefill_chunk=5, tokenizer=gemma3_image_tokenizer())
    small = export_gemma3_vision(tiny_gemma3_vision(), max_context=12, prefill_chunk=8,
                                 tokenizer=gemma3_image_tokenizer()).load()
    with pytest.raises(InputError, match="cache holds 12"):
        ImageTextModel(small).generate(str(picture), PROMPT + " w1 w2", 4)


def test_vlm_commands(tmp_path, picture):
    from tests.test_cli import cli

    folder = tmp_path / "gemma3"
    tiny_gemma3_vision().save_pretrained(folder)
    gemma3_image_tokenizer().save_pretrained(folder)
    code, out, err = cli("export-vlm", folder, "-o", tmp_path / "g.kiln", "--max-context", "64", "--prefill-chunk", "8")
    assert code == 0, err
    assert "methods: " in out and "encode_image" in out
    model = ImageTextModel(tmp_path / "g.kiln")
    code, out, err = cli("generate", tmp_path / "g.kiln", "--image", picture, "--prompt", PROMPT, "--max-new-tokens",
                         "6", "--backend", "mlx" if "mlx" in BACKENDS else "cpu")
    assert code == 0, err
    assert out.strip() == model.answer(str(picture), PROMPT, 6) and "image, 6 new tokens" in err
    code, _, err = cli("generate", tmp_path / "g.kiln", "--image", tmp_path / "missing.jpg", "--prompt", PROMPT)
    assert code == 2 and "missing.jpg" in err
    code, _, err = cli("generate", tmp_path / "g.kiln", "--image", picture, "--audio", picture, "--prompt", PROMPT)
    assert code == 2 and "not allowed with" in err
    code, _, err = cli("export-vlm", tmp_path / "nowhere", "-o", tmp_path / "x.kiln")
    assert code == 2 and "not a folder" in err
