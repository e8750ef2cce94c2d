"""A torchao-quantized model's weights, stored as torchao quantized them (kiln.export.known_weights).

torchao (PyTorch's quantization library) replaces a linear's weight by a tensor subclass holding integer codes
and scales. torch.export traces through it: IntxWeightOnlyConfig's weights become a dequantize_affine of constants,
which the export folds into a float weight; Int8WeightOnlyConfig's become a product with the integer codes as
floats, then a multiplication by the per-row scale. Either way the graph holds float constants whose rows are
known here, so the export stores them in kiln's formats instead:
- IntxUnpackedToInt8Tensor (IntxWeightOnlyConfig, int1..int8, per group or per row): codes of up to 4 bits as
  kiln's int4 (nibble = code + 8, zero point + 8), wider as int8, with the float zero points, group = the block's
  width; kiln's (q - z) * s equals torchao's dequantization bit for bit (the difference is an exact integer).
- Int8Tensor (Int8WeightOnlyConfig): the folded constant is the codes themselves, so the linear is stored as int8
  codes with unit scales per row and the graph's own multiplication by torchao's scales follows it, as traced.
Other torchao weight types (float8, NVFP4, MX formats, the packed int4 layouts) are refused by name: kiln has no
format that holds them.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.export.known_weights import RowIndex, SourceTensor
from kiln.export.quantize import QuantizedWeight

SUPPORTED = ("IntxUnpackedToInt8Tensor", "Int8Tensor")


class UnsupportedQuantizationError(KilnError, ValueError):
    """A model's weights are quantized in a format kiln cannot store."""


class TorchaoQuantization(RowIndex):
    """The torchao-quantized weights of a module (KnownQuantization)."""

    def summary(self) -> list[str]:
        kept: dict[str, int] = {}
        for kind in self.kept.values():
            kept[kind] = kept.get(kind, 0) + 1
        lines = [f"kept torchao's quantization: {', '.join(f'{n} {k}' for k, n in kept.items())}"] if kept else []
        missed = [t.name for t in self.tensors if t.name not in self.kept]
        if missed:
            lines.append(f"torchao weights not found in the graph (stored as the graph holds them): "
                         f"{', '.join(missed[:4])}{' ...' if len(missed) > 4 else ''}")
        return lines


def torchao_quantization(module: torch.nn.Module) -> TorchaoQuantization | None:
    """The module's torchao weights, or None when it has none. Raises UnsupportedQuantizationError naming each
    weight of a torchao type kiln cannot store."""
    tensors, refused = [], []
    for name, param in module.named_parameters():
        data = param.data if isinstance(param, torch.nn.Parameter) else param
        kind = type(data)
        if not kind.__module__.startswith("torchao"):
            continue
        if kind.__name__ not in SUPPORTED or data.dim() != 2:
            refused.append(f"{name} ({kind.__name__})")
            continue
        tensors.append(_source(name, data))
    if refused:
        raise UnsupportedQuantizationError(
            f"kiln cannot store these torchao weights: {', '.join(refused)}; it keeps IntxWeightOnlyConfig "
            "(int1..int8, per group or per row) and Int8WeightOnlyConfig weights. Quantize with one of those, or "
            "export the float model and use kiln's own quantize=")
    return TorchaoQuantization(tensors) if tensors else None


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _source(name: str, w: torch.Tensor) -> SourceTensor:
    qdata = w.qdata.detach().cpu().to(torch.int32).numpy()
    n, k = qdata.shape
    kind = type(w).__name__
    if kind == "Int8Tensor":  # the graph multiplies by the scale after the product: unit scales here
        values = qdata.astype(np.float32)
        stored = QuantizedWeight(qdata.astype(np.int8), np.ones((n, 1), np.float32), None, 8, k, False,
                                 "torchao Int8Tensor")
        return SourceTensor(name, kind, stored, values)
    block = int(w.block_size[-1])
    scale = _numpy(w.scale).astype(np.float32).reshape(n, k // block)
    zero = w.zero_point.detach().cpu().to(torch.float32).numpy().reshape(n, k // block)
    values = _numpy(w.dequantize()).reshape(n, k)
    if qdata.min() >= -8 and qdata.max() <= 7:  # int1..int4 codes: kiln's unsigned nibbles around 8
        nibbles = (qdata + 8).astype(np.uint8)
        stored = QuantizedWeight(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scale, zero + 8, 4, block, False,
                                 "torchao int4")
    else:
        stored = QuantizedWeight(qdata.astype(np.int8), scale, zero, 8, block, False, "torchao int8")
    if block % 2 and stored.bits == 4:
        return SourceTensor(name, kind, None, values)  # (an odd group cannot split into nibble pairs)
    return SourceTensor(name, kind, stored, values)  # (torchao's own values: a bf16 model's rounding is torchao's)
