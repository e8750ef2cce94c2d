"""The fixed 64-byte header at the start of every .kiln file."""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"\x89KILN\r\n\x1a"  # PNG-style: catches text-mode transfers and truncation to 7 bits
HEADER_SIZE = 64
_LAYOUT = struct.Struct("<8sIIQQQQQII")
assert _LAYOUT.size == HEADER_SIZE


@dataclass(frozen=True)
class Header:
    format_version: int
    opset_version: int
    meta_offset: int
    meta_size: int
    const_offset: int
    const_size: int
    file_size: int
    meta_crc32: int
    const_crc32: int

    def pack(self) -> bytes:
        return _LAYOUT.pack(MAGIC, self.format_version, self.opset_version, self.meta_offset, self.meta_size,
                            self.const_offset, self.const_size, self.file_size, self.meta_crc32, self.const_crc32)

    @classmethod
    def unpack(cls, data: bytes) -> tuple[bytes, Header]:
        magic, *fields = _LAYOUT.unpack_from(data, 0)
        return magic, cls(*fields)
