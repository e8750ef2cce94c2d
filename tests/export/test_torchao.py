"""A torchao-quantized model exports with its quantization kept (kiln.export.torchao_weights): the stored weights
dequantize to torchao's own, bit for bit, and the program's outputs are torchao's; other torchao formats are
refused by name."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

import kiln  # noqa: E402
from kiln.export.torchao_weights import UnsupportedQuantizationError  # noqa: E402
from kiln.runtime.backends.array_api.quant import dequantize  # noqa: E402


def _configs():
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    return {"int4-g32": (IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)), 4, 32),
            "int2-g16": (IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(16)), 4, 16),
            "int8-row": (IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)), 8, None),
            "int6-g32": (IntxWeightOnlyConfig(weight_dtype=torch.int6, granularity=PerGroup(32)), 8, 32),
            "int8-weight-only": (Int8WeightOnlyConfig(), 8, None)}


def _model(config):
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32)).eval()
    quantize_(model, config)
    return model


@pytest.mark.parametrize("name", ["int4-g32", "int2-g16", "int8-row", "int6-g32", "int8-weight-only"])
def test_torchao_weights_are_kept(name, monkeypatch):
    config, bits, group = _configs()[name]
    model = _model(config)
    x = torch.randn(3, 64)
    program = kiln.export(model, (x,)).load()
    method = program.method("forward")
    nodes = [n for n in method.nodes if n.op == "quantized_linear"]
    assert [(n.attrs["bits"], n.attrs["group_size"]) for n in nodes] == [(bits, group or 64), (bits, group or 96)]
    assert not any(n.op == "linear" for n in method.nodes)
    for node, layer in zip(nodes, (model[0], model[2]), strict=True):
        q, scale, zero = (None if i < 0 else program.constant(method.values[i].ref) for i in node.inputs[1:4])
        stored = dequantize(np, q, scale, zero, node.attrs["bits"], node.attrs["group_size"])
        weight = layer.weight
        want = weight.qdata.float() if type(weight).__name__ == "Int8Tensor" else weight.dequantize()
        assert np.array_equal(stored, want.numpy())  # (Int8Tensor: codes here, its scales multiply after)
    monkeypatch.setenv("KILN_QUANT_DOT", "float")  # (the CPU's default rounds inputs to int8, as llama.cpp does)
    with torch.no_grad():
        want = model(x).numpy()
    np.testing.assert_allclose(program.session().run("forward", x.numpy())[0], want, rtol=1e-5, atol=1e-5)


def test_formats_kiln_cannot_store_are_refused_by_name():
    from torchao.quantization import Float8WeightOnlyConfig

    try:
        model = _model(Float8WeightOnlyConfig())
    except Exception as e:  # noqa: BLE001 - a torchao build without its float8 path here
        pytest.skip(f"torchao cannot make float8 weights here: {e}")
    with pytest.raises(UnsupportedQuantizationError, match=r"0\.weight \(Float8Tensor\).*IntxWeightOnlyConfig"):
        kiln.export(model, (torch.randn(2, 64),))
