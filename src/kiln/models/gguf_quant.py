"""A GGUF file's quantized tensors in kiln's weight-only formats, exactly.

Every GGUF block format of the legacy and K-quant families is an integer code per weight times a scale per small
group, plus (for the "_1" and K types with a min) an additive term per group: W = code * scale + offset. kiln's
quantized_linear / quantized_embedding hold that form (int4 or int8 codes, a float scale per group, zero points or,
with the op's `offset`, additive offsets), so each of these GGUF types maps onto one kiln format without rounding
anything again:

| GGUF | codes | group | kiln format |
|---|---|---:|---|
| Q4_0 | nibble - 8 | 32 | int4, symmetric (zero point 8) |
| Q4_1, Q4_K | nibble | 32 | int4 + offset |
| Q2_K | 2 bits | 16 | int4 + offset |
| Q3_K | 3 bits - 4 | 16 | int4, symmetric |
| Q5_0 | 5 bits - 16 | 32 | int8, symmetric |
| Q5_1, Q5_K | 5 bits | 32 | int8 + offset |
| Q6_K | 6 bits - 32 | 16 | int8, symmetric |
| Q8_0 | int8 | 32 | int8, symmetric |

The scale of a K-quant group is the super-block's float16 scale times the group's 6- or 4-bit scale (exact in
float32), its offset minus the float16 min times the group's min (exact too), so kiln's dequantization rounds
each weight once, where GGUF's own does: `decode` checks every tensor against the gguf package's dequantization
bit for bit before it is used. Other types (the IQ and ternary families, MXFP4, ...) are codebooks or other grids
kiln has no format for; they are not decoded here (the exporter re-quantizes them and says so).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.export.known_weights import RowIndex, SourceTensor, same_bits
from kiln.export.known_weights import dequantized as dequantize
from kiln.export.quantize import QuantizedWeight

QK_K = 256


@dataclass(frozen=True)
class KilnLayout:
    """Where a GGUF type goes: kiln bits, group size, and whether groups carry an offset."""

    bits: int
    group: int
    offset: bool


@dataclass
class Decoded:
    """A tensor's weights as code * scale (+ offset), codes [N, K] int, scale/offset [N, K / group] float32."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields ([..., 2] bytes) as float32 [...]."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _nibbles_split(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes [..., width] -> [..., 2 * width] codes: the low nibbles first, then the high ones (GGUF's order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q8_0(b: np.ndarray) -> Decoded:
    return Decoded(b[:, 2:].view(np.int8).astype(np.int16), _f16(b[:, :2])[:, None], None)


def _q4_0(b: np.ndarray) -> Decoded:
    return Decoded(_nibbles_split(b[:, 2:], 16).astype(np.int16) - 8, _f16(b[:, :2])[:, None], None)


def _q4_1(b: np.ndarray) -> Decoded:
    return Decoded(_nibbles_split(b[:, 4:], 16).astype(np.int16), _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None])


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits per block (a little-endian uint32) as [n, 32] 0/1, element j from bit j."""
    word = np.ascontiguousarray(qh).view("<u4")[:, 0]
    return ((word[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)


def _q5_0(b: np.ndarray) -> Decoded:
    codes = _nibbles_split(b[:, 6:], 16).astype(np.int16) | (_fifth_bits(b[:, 2:6]) << 4)
    return Decoded(codes - 16, _f16(b[:, :2])[:, None], None)


def _q5_1(b: np.ndarray) -> Decoded:
    codes = _nibbles_split(b[:, 8:], 16).astype(np.int16) | (_fifth_bits(b[:, 4:8]) << 4)
    return Decoded(codes, _f16(b[:, :2])[:, None], _f16(b[:, 2:4])[:, None])


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins ([n, 8] each): scales and mins 0-3 are the low
    6 bits of bytes 0-3 and 4-7; 4-7 take their low 4 bits from the nibbles of bytes 8-11 and their top 2 bits from
    the top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    a, m, hi = packed[:, 0:4].astype(np.int16), packed[:, 4:8].astype(np.int16), packed[:, 8:12].astype(np.int16)
    scales = np.concatenate([a & 63, (hi & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([m & 63, (hi >> 4) | ((m >> 6) << 4)], axis=-1)
    return scales, mins


def _k_min_form(b: np.ndarray, codes: np.ndarray) -> Decoded:
    """Q4_K/Q5_K: d * scale_g * code - dmin * min_g per group of 32."""
    scales, mins = _k_scales_mins(b[:, 4:16])
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    return Decoded(codes, d * scales.astype(np.float32), -(dmin * mins.astype(np.float32)))


def _q4_k(b: np.ndarray) -> Decoded:
    qs = b[:, 16:144].reshape(-1, 4, 32)  # four 64-weight pieces: the low nibbles, then the high ones
    return _k_min_form(b, _nibbles_split(qs, 32).reshape(-1, QK_K).astype(np.int16))


def _q5_k(b: np.ndarray) -> Decoded:
    qh = b[:, 16:48].astype(np.int16)  # bit i of byte j: the fifth bit of element 32 * i + j
    qs = b[:, 48:176].reshape(-1, 4, 32)
    low = _nibbles_split(qs, 32).reshape(-1, 8, 32).astype(np.int16)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.int16)[None, :, None]) & 1
    return _k_min_form(b, (low | (high << 4)).reshape(-1, QK_K))


def _q6_k(b: np.ndarray) -> Decoded:
    ql, qh = b[:, 0:128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    low = _nibbles_split(ql, 64).reshape(-1, 2, 4, 32).astype(np.int16)  # per half: 4 pieces of 32
    high = (qh[:, :, None, :].astype(np.int16) >> (2 * np.arange(4, dtype=np.int16))[None, None, :, None]) & 3
    codes = (low | (high << 4)).reshape(-1, QK_K) - 32
    d = _f16(b[:, 208:210])[:, None]
    return Decoded(codes, d * b[:, 192:208].view(np.int8).astype(np.float32), None)


def _q2_k(b: np.ndarray) -> Decoded:
    packed = b[:, 0:16].astype(np.int16)
    qs = b[:, 16:80].reshape(-1, 2, 1, 32).astype(np.int16)  # two halves of 128: 4 shifts of 32 bytes
    codes = ((qs >> (2 * np.arange(4, dtype=np.int16))[None, None, :, None]) & 3).reshape(-1, QK_K)
    d, dmin = _f16(b[:, 80:82])[:, None], _f16(b[:, 82:84])[:, None]
    return Decoded(codes, d * (packed & 15).astype(np.float32), -(dmin * (packed >> 4).astype(np.float32)))


def _q3_k(b: np.ndarray) -> Decoded:
    hmask, qs, packed = b[:, 0:32].astype(np.int16), b[:, 32:96].astype(np.int16), b[:, 96:108].astype(np.int16)
    low4 = np.concatenate([packed[:, 0:8] & 15, packed[:, 0:8] >> 4], axis=-1)  # scales 0-7, then 8-15
    top2 = ((packed[:, 8:12, None] >> (2 * np.arange(4, dtype=np.int16))[None, None, :]) & 3)
    top2 = top2.transpose(0, 2, 1).reshape(-1, 16)  # scale i's top bits: byte 8 + i % 4, shift 2 * (i // 4)
    scales = (low4 | (top2 << 4)) - 32
    ql = (qs.reshape(-1, 2, 1, 32) >> (2 * np.arange(4, dtype=np.int16))[None, None, :, None]) & 3
    high = (hmask[:, None, :] >> np.arange(8, dtype=np.int16)[None, :, None]) & 1
    codes = ql.reshape(-1, 8, 32) - 4 * (1 - high)  # a clear high bit subtracts 4
    return Decoded(codes.reshape(-1, QK_K), _f16(b[:, 108:110])[:, None] * scales.astype(np.float32), None)


DECODERS: dict[str, tuple[KilnLayout, Callable[[np.ndarray], Decoded]]] = {
    "Q8_0": (KilnLayout(8, 32, False), _q8_0),
    "Q4_0": (KilnLayout(4, 32, False), _q4_0),
    "Q4_1": (KilnLayout(4, 32, True), _q4_1),
    "Q5_0": (KilnLayout(8, 32, False), _q5_0),
    "Q5_1": (KilnLayout(8, 32, True), _q5_1),
    "Q2_K": (KilnLayout(4, 16, True), _q2_k),
    "Q3_K": (KilnLayout(4, 16, False), _q3_k),
    "Q4_K": (KilnLayout(4, 32, True), _q4_k),
    "Q5_K": (KilnLayout(8, 32, True), _q5_k),
    "Q6_K": (KilnLayout(8, 16, False), _q6_k),
}
"""GGUF type name -> (the kiln format that holds it exactly, the block decoder)."""


def decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8, any shape holding rows * blocks * block bytes) of numpy shape [N, K] as a
    kiln quantized weight. Raises KeyError for a type DECODERS lacks."""
    layout, decoder = DECODERS[type_name]
    n, k = shape
    blocks = np.ascontiguousarray(raw).reshape(-1)
    block_bytes = blocks.size // (n * k // _block_size(type_name))
    decoded = decoder(blocks.reshape(-1, block_bytes))
    codes = decoded.codes.reshape(n, k)
    scale = decoded.scale.reshape(n, k // layout.group)
    offset = None if decoded.offset is None else decoded.offset.reshape(n, k // layout.group)
    if layout.bits == 4:
        nibbles = (codes + (0 if layout.offset else 8)).astype(np.uint8)
        q = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    else:
        q = codes.astype(np.int8)
    return QuantizedWeight(q, scale, offset, layout.bits, layout.group, layout.offset, f"GGUF {type_name}")


def _block_size(type_name: str) -> int:
    return QK_K if type_name.endswith("_K") else 32


FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
"""GGUF types that are not quantized: a model's float weights, left to the export's own choice."""


class GGUFQuantization(RowIndex):
    """A GGUF file's quantized 2-d tensors (and expert stacks, as their rows), found again among a model's float
    weights by their rows (RowIndex).

    transformers loads a GGUF model by dequantizing it (and reorders the rows of Llama's query and key weights, and
    the export stacks projections), so a weight of the exported graph is some rows of some GGUF tensors. Tensors of
    types kiln has no exact format for (IQ*, TQ*, MXFP4, ...) are re-quantized from their dequantized values (int4
    in groups of 32 for types of 4.5 bits or fewer, int8 above), with a warning naming them and the error that adds.
    """

    def __init__(self, path: str | os.PathLike):
        import gguf  # (the export side's dependency: transformers reads GGUF with it too)

        from kiln.models.gguf_file import check_gguf

        # kiln's own walk of the file (checked, and ~30x faster than GGUFReader, which parses every vocabulary
        # string into arrays) gives each tensor's place; its bytes are read through one memory map
        data = np.memmap(path, dtype=np.uint8, mode="r")
        tensors: list[SourceTensor] = []
        self.mismatched: list[str] = []
        for t in check_gguf(path).tensors:
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            if len(t.dims) not in (2, 3) or qtype.name in FLOAT_TYPES:
                continue
            # GGUF lists the fastest dimension first; a mixture-of-experts stack [E, R, K] (ffn_*_exps) is its
            # E * R rows, as the export quantizes an expert stack by rows
            shape = (int(np.prod(t.dims[1:])), int(t.dims[0]))
            raw = np.asarray(data[t.offset:t.offset + t.nbytes]).reshape(shape[0], -1)
            values = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(shape)
            weight = None
            if qtype.name in DECODERS:
                weight = decode(qtype.name, raw, shape)
                if not same_bits(dequantize(weight), values):  # never seen; guards a file or package kiln misreads
                    self.mismatched.append(t.name)
                    weight = None
            tensors.append(SourceTensor(t.name, qtype.name, weight, values if weight is None else None))
        del data
        super().__init__(tensors)
        self._rows_index(np.dtype(np.float32))  # (the rows of float32 models, indexed while the file is warm)
        self.requantized: dict[str, str] = {}  # tensor name -> its GGUF type, for the ones re-quantized
        self.requantized_error = 0.0  # the largest relative RMS error re-quantizing added to a weight

    def types(self) -> dict[str, int]:
        """GGUF type name -> how many 2-d quantized tensors of it the file has."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    def fallback(self, weight: np.ndarray, used: list[SourceTensor]) -> QuantizedWeight:
        return self._requantize(weight, used)

    def _requantize(self, weight: np.ndarray, used: list[SourceTensor]) -> QuantizedWeight:
        from kiln.export.quantize import quantize_rows

        from_types = sorted({t.type_name for t in used})
        bits = 4 if all(_bits_per_weight(name) <= 4.5 for name in from_types) else 8
        group = 32 if weight.shape[1] % 32 == 0 else weight.shape[1]
        q, scale, zero = quantize_rows(weight.astype(np.float64), bits, group, symmetric=False)
        stored = QuantizedWeight(q, scale, zero, bits, group, False, f"int{bits} from GGUF {'+'.join(from_types)}")
        values = weight.astype(np.float64)
        error = np.sqrt(np.mean((dequantize(stored) - values) ** 2) / max(np.mean(values ** 2), 1e-30))
        for t in used:
            self.requantized[t.name] = t.type_name
        self.requantized_error = max(self.requantized_error, float(error))
        return stored

    def summary(self) -> list[str]:
        """What happened to the file's quantized tensors, a line each (after the export looked them up)."""
        lines = []
        kept = _count(self.kept)
        if kept:
            lines.append("kept the GGUF's quantization exactly: " + ", ".join(
                f"{n} {name} ({_format_name(DECODERS[name][0])})" for name, n in kept.items()))
        if self.requantized:
            lines.append("re-quantized (kiln has no exact format for " + ", ".join(
                f"{n} {name}" for name, n in _count(self.requantized).items()) + "): int4/int8 in groups of 32 from "
                f"their dequantized values, adding up to {100 * self.requantized_error:.1f}% RMS error to a weight")
        others = [t.name for t in self.tensors if t.name not in self.kept and t.name not in self.requantized]
        if others:
            lines.append(f"left as float (not a weight kiln stores quantized, or its rows were not found): "
                         f"{', '.join(others[:4])}{' ...' if len(others) > 4 else ''}")
        if self.mismatched:
            lines.append(f"not kept, decoded differently from the gguf package's dequantization: "
                         f"{', '.join(self.mismatched)}")
        return lines


def _count(types: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in types.values():
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def _format_name(layout: KilnLayout) -> str:
    return f"int{layout.bits} g{layout.group}{' + offset' if layout.offset else ''}"


def _bits_per_weight(type_name: str) -> float:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return 8 * size / block


