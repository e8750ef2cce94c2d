"""StaticCacheLM's rotary tables: a decode step gathers its positions' cos and sin rows, which the model's own
rotary module computed for every position up front, instead of computing them per step (about ten small kernels
on a GPU). The rows are the module's results bit for bit; what the table cannot stand for is left alone."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from kiln.export import Quantize  # noqa: E402
from kiln.models.llm import StaticCacheLM, _RotaryTable, export_llama  # noqa: E402
from kiln.models.zoo import tiny_decoder  # noqa: E402

MAX_CONTEXT = 48


def _rotary(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "Rotary" in type(m).__name__]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}],
                         ids=["default", "llama3"])
def test_the_table_gives_the_modules_values_bit_for_bit(dtype, scaling) -> None:
    model = tiny_decoder("llama")
    if scaling is not None:
        config = copy.deepcopy(model.config)
        config.rope_parameters = {**config.rope_parameters, **scaling}
        model = type(model)(config).eval()
    model = model.to(dtype)
    (original,) = _rotary(model)
    assert original.rope_type == ("default" if scaling is None else "llama3")
    StaticCacheLM(model, MAX_CONTEXT)
    (table,) = _rotary(model)
    assert isinstance(table, _RotaryTable) and not table.training
    x = torch.zeros(1, 3, model.config.hidden_size, dtype=dtype)
    positions = torch.tensor([[0, 17, MAX_CONTEXT - 1]])
    for want, got in zip(original(x, positions), table(x, positions), strict=True):
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("quantize", [None, Quantize("int8")], ids=["float", "int8"])
def test_a_decode_step_gathers_instead_of_computing(quantize) -> None:
    """Two index nodes read the tables, which weight quantization leaves as they are (it takes embeddings)."""
    lm = StaticCacheLM(tiny_decoder("llama"), MAX_CONTEXT, 8)
    options = {} if quantize is None else {"quantize": quantize}
    method = export_llama(lm, MAX_CONTEXT, 8, **options).load().method("decode")
    ops = [node.op for node in method.nodes]
    assert "cos" not in ops and "sin" not in ops
    tables = [method.values[node.inputs[0]] for node in method.nodes if node.op == "index"]
    assert [(t.shape, t.dtype.name) for t in tables] == [((MAX_CONTEXT, 8), "float32")] * 2
    assert ops.count("quantized_embedding" if quantize else "embedding") == 1  # the tokens'


def test_what_the_table_cannot_stand_for_is_left_alone() -> None:
    """Gemma 3's module takes a layer type, and a dynamic RoPE rescales its frequencies with the positions seen."""
    gemma3 = tiny_decoder("gemma3")
    StaticCacheLM(gemma3, MAX_CONTEXT)
    assert not any(isinstance(m, _RotaryTable) for m in gemma3.modules())
    llama = tiny_decoder("llama")
    (rotary,) = _rotary(llama)
    rotary.rope_type = "dynamic"
    StaticCacheLM(llama, MAX_CONTEXT)
    assert _rotary(llama) == [rotary]
