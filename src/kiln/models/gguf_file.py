"""A GGUF file checked from end to end before transformers (through the `gguf` package's GGUFReader) reads it.

GGUFReader trusts the file: an array that declares 2**60 elements past the file's end makes it loop forever, a
duplicate key raises KeyError, a tensor past the end a NumPy reshape error, an unknown type a bare ValueError, and
transformers then builds a model as large as the metadata says. `check_gguf` walks the same layout (GGUF versions
2 and 3, little-endian: the header, the key-value pairs, the tensor infos, the aligned data section) with every
count, length and offset bounded by the bytes actually in the file, every string UTF-8 and every type known, each
tensor's data inside the file, and the sizes transformers builds the model from (layer count, embedding and
feed-forward widths) matching the tensors the file holds. A file that passes is one GGUFReader reads; one that
does not raises GGUFFormatError saying what is wrong and where. It reads only the metadata (the tensor data is
never touched) and needs neither torch nor transformers.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kiln.errors import FileFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
"""GGML_MAX_DIMS: no ggml tensor has more."""
MAX_NESTING = 4
"""Arrays of arrays deeper than this are refused (no GGUF writer nests at all; the reader recurses)."""
MAX_ITEMS = 1 << 22
"""Most strings or arrays one array may hold (vocabularies and merge lists have a few hundred thousand): each is
walked in Python, here and in GGUFReader, so a file of 100 million empty strings would take minutes."""

STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value types of fixed size, by code, as struct formats (7 is bool, one byte)."""
MIN_VALUE_BYTES = {**{code: struct.calcsize(fmt) for code, fmt in SCALARS.items()}, STRING: 8, ARRAY: 12}
"""The fewest bytes a value of each type takes: what bounds an array's declared length by the bytes left."""


class GGUFFormatError(FileFormatError):
    """A GGUF file that is truncated, corrupt or inconsistent: says what is wrong and at which byte."""


@dataclass
class GGUFTensor:
    name: str
    dims: tuple[int, ...]
    """ggml order: dims[0] is the fastest-varying (a weight's input features)."""
    ggml_type: int
    offset: int
    """Of its data from the start of the file."""
    nbytes: int


@dataclass
class GGUFSummary:
    """What check_gguf found: the version, the key-value pairs (arrays of over 16 values kept as their length) and
    the tensor infos."""

    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[GGUFTensor] = field(default_factory=list)


def check_gguf(path: str | os.PathLike) -> GGUFSummary:
    """The GGUF file at `path` checked as described in the module docstring; its summary if it is sound."""
    path = Path(path)
    with open(path, "rb") as f:
        summary = _Parser(f, os.fstat(f.fileno()).st_size, str(path)).parse()
    _check_model_sizes(summary, str(path))
    return summary


def _quant_sizes() -> dict[int, tuple[int, int]]:
    """ggml type code -> (block size in elements, bytes per block), from the gguf package GGUFReader itself uses,
    so the two never disagree about a type."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}


class _Parser:
    """A cursor over the file that refuses, with the byte offset, to read past its end (it reads the metadata only,
    in small pieces, so a multi-gigabyte file is never loaded)."""

    def __init__(self, f: BinaryIO, size: int, where: str):
        self.f, self.size, self.at, self.where = f, size, 0, where

    def left(self) -> int:
        return self.size - self.at

    def fail(self, message: str, at: int | None = None) -> GGUFFormatError:
        return GGUFFormatError(f"{self.where}: {message} (at byte {self.at if at is None else at} of {self.size})")

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes but the file ends: truncated or a length that lies")
        data = self.f.read(n)
        if len(data) != n:  # (the file shrank while being read)
            raise self.fail(f"{what}: the file ended early")
        self.at += n
        return data

    def skip(self, n: int) -> None:
        """Move past n bytes already known to be in the file."""
        self.at += n
        self.f.seek(self.at)

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        at = self.at
        raw = self.take(self.scalar("<Q", f"the length of {what}"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8: {raw[:40]!r}", at) from None

    def count(self, what: str, smallest: int) -> int:
        """A u64 count of items that take at least `smallest` bytes each, bounded by the bytes left."""
        at = self.at
        n = self.scalar("<Q", f"the count of {what}")
        room = self.left() // max(smallest, 1)
        if n > room:
            raise self.fail(f"the file declares {n} {what}, but the {self.left()} bytes left hold at most {room}", at)
        return n

    def parse(self) -> GGUFSummary:
        if self.size < 4 or self.take(4, "the magic") != MAGIC:
            raise self.fail("not a GGUF file: it does not start with 'GGUF'", 0)
        version = self.scalar("<I", "the version")
        if version not in VERSIONS:
            kind = "a big-endian file" if version & 0xFFFF == 0 else f"version {version}"
            raise self.fail(f"{kind}; kiln reads little-endian GGUF versions {VERSIONS}", 4)
        summary = GGUFSummary(version)
        tensor_count = self.scalar("<Q", "the tensor count")
        kv_count = self.count("key-value pairs", 8 + 4 + 1)
        for _ in range(kv_count):
            self.key_value(summary.metadata)
        if tensor_count > self.left() // (8 + 4 + 4 + 8):
            raise self.fail(f"the file declares {tensor_count} tensors, more than the bytes left can describe")
        infos = [self.tensor_info() for _ in range(tensor_count)]
        self.tensors(summary, infos)
        return summary

    def key_value(self, metadata: dict[str, Any]) -> None:
        at = self.at
        key = self.string("a key")
        if key in metadata:
            raise self.fail(f"the key {key!r} appears twice", at)
        if key.startswith("GGUF."):  # (GGUFReader keeps GGUF.version and so on among the keys)
            raise self.fail(f"the key {key!r} is reserved for the header", at)
        code = self.scalar("<I", f"the type of {key!r}")
        metadata[key] = self.value(code, key, 0)
        if key == "general.alignment":  # (GGUFReader requires a uint32)
            alignment = metadata[key]
            if code != 4 or alignment < 1 or alignment & (alignment - 1):
                raise self.fail(f"general.alignment is {alignment!r}: a uint32 power of two expected", at)

    def value(self, code: int, key: str, depth: int) -> Any:
        """One value of GGUF type `code`; arrays of more than 16 values are summarized by their length."""
        if code in SCALARS:
            return self.scalar(SCALARS[code], f"the value of {key!r}")
        if code == STRING:
            return self.string(f"the value of {key!r}")
        if code != ARRAY:
            raise self.fail(f"{key!r} has unknown value type {code}")
        if depth >= MAX_NESTING:
            raise self.fail(f"{key!r} nests arrays more than {MAX_NESTING} deep")
        item = self.scalar("<I", f"the item type of {key!r}")
        if item not in MIN_VALUE_BYTES:
            raise self.fail(f"{key!r} is an array of unknown value type {item}")
        n = self.count(f"items in {key!r}", MIN_VALUE_BYTES[item])
        if item in SCALARS:  # fixed-size items: only the first few read, the rest skipped (count checked above)
            width = struct.calcsize(SCALARS[item])
            raw = self.take(min(n, 16) * width, f"the items of {key!r}")
            values = [struct.unpack_from(SCALARS[item], raw, i * width)[0] for i in range(min(n, 16))]
            self.skip((n - min(n, 16)) * width)
        else:
            if n > MAX_ITEMS:
                raise self.fail(f"{key!r} holds {n} strings or arrays; kiln reads at most {MAX_ITEMS}")
            values = [self.value(item, key, depth + 1) for _ in range(n)]
        return values if n <= 16 else n

    def tensor_info(self) -> tuple[int, str, tuple[int, ...], int, int]:
        at = self.at
        name = self.string("a tensor name")
        n_dims = self.scalar("<I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions; ggml tensors have 1 to {MAX_DIMS}", at)
        dims = struct.unpack(f"<{n_dims}Q", self.take(8 * n_dims, f"the dimensions of tensor {name!r}"))
        ggml_type = self.scalar("<I", f"the type of tensor {name!r}")
        offset = self.scalar("<Q", f"the data offset of tensor {name!r}")
        return at, name, dims, ggml_type, offset

    def tensors(self, summary: GGUFSummary, infos: list[tuple[int, str, tuple[int, ...], int, int]]) -> None:
        """Each tensor's type known, its shape whole blocks, its data inside the file after the aligned header."""
        alignment = summary.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        start = -(-self.at // alignment) * alignment
        if infos and start > self.size:
            raise self.fail(f"the tensor data should start at byte {start}, past the end of the file")
        quant = _quant_sizes()
        names: set[str] = set()
        for at, name, dims, ggml_type, offset in infos:
            if name in names:
                raise self.fail(f"the tensor name {name!r} appears twice", at)
            names.add(name)
            if ggml_type not in quant:
                raise self.fail(f"tensor {name!r} has unknown ggml type {ggml_type}", at)
            block, block_bytes = quant[ggml_type]
            if any(d < 1 for d in dims) or (dims and dims[0] % block):
                raise self.fail(f"tensor {name!r} has dimensions {list(dims)}: each must be at least 1, the first a "
                                f"multiple of its type's block of {block}", at)
            elements = 1
            for d in dims:
                elements *= d
            nbytes = elements // block * block_bytes
            if offset % alignment or start + offset + nbytes > self.size:
                raise self.fail(f"tensor {name!r} ({list(dims)}, {nbytes} bytes) at data offset {offset} is "
                                f"misaligned or runs past the end of the file", at)
            summary.tensors.append(GGUFTensor(name, tuple(dims), ggml_type, start + offset, nbytes))


LAYER = re.compile(r"blk\.(\d+)\.")


def _check_model_sizes(summary: GGUFSummary, where: str) -> None:
    """The sizes transformers builds the model from, held to the tensors present: `<arch>.block_count` layers
    numbered 0..n-1, and the embedding width, vocabulary and feed-forward width of the token embedding's and the
    first layer's feed-forward weights. A file that lies about them would otherwise make transformers allocate a
    model as large as the lie before loading a single weight."""
    meta = summary.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFFormatError(f"{where}: no general.architecture string: not a model GGUF file")
    shapes = {t.name: t.dims for t in summary.tensors}
    layers = {int(m.group(1)) for m in map(LAYER.match, shapes) if m}
    blocks = meta.get(f"{arch}.block_count")
    if blocks is not None and (not isinstance(blocks, int) or blocks != len(layers)
                               or layers != set(range(len(layers)))):
        raise GGUFFormatError(f"{where}: {arch}.block_count is {blocks!r} but the file holds the tensors of "
                              f"{len(layers)} layers {sorted(layers)[:8]}")
    checks = ((f"{arch}.embedding_length", "token_embd.weight", 0), (f"{arch}.vocab_size", "token_embd.weight", 1),
              (f"{arch}.feed_forward_length", "blk.0.ffn_up.weight", 1))
    for key, tensor, axis in checks:
        value = meta.get(key)
        if isinstance(value, int) and tensor in shapes and len(shapes[tensor]) > axis \
                and value != shapes[tensor][axis]:
            raise GGUFFormatError(f"{where}: {key} is {value} but {tensor} is {list(shapes[tensor])}")


__all__ = ["GGUFFormatError", "GGUFSummary", "GGUFTensor", "check_gguf"]
