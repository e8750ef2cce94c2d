"""A coverage-guided campaign over the .kiln loader with atheris (`pip install atheris`): libFuzzer mutates a
program's metadata table, and each input is wrapped in a header with fresh checksums around the seed's constant
segment (checksums would otherwise stop nearly every mutant at the first check), then judged as in mutator.py.

    python -m tests.format.atheris_campaign -max_total_time=600 -rss_limit_mb=4096

libFuzzer's own flags follow; it stops at the first escape, printing the exception and saving the input.
"""

from __future__ import annotations

import sys
import zlib

import atheris

with atheris.instrument_imports(include=["kiln"]):
    import kiln  # noqa: F401 - instrumented for coverage
    from kiln.format import ALIGNMENT
    from kiln.format.header import HEADER_SIZE, Header
    from tests.format.mutator import encode, judge

SEED: dict[str, bytes] = {}


def wrap(meta: bytes) -> bytes:
    """meta inside a consistent header (sizes and both checksums) before the seed's constant segment."""
    const = SEED["const"]
    const_offset = -(-(HEADER_SIZE + len(meta)) // ALIGNMENT) * ALIGNMENT
    head = Header(1, SEED["opset"][0], HEADER_SIZE, len(meta), const_offset, len(const), const_offset + len(const),
                  zlib.crc32(meta), zlib.crc32(const))
    return head.pack() + meta + b"\0" * (const_offset - HEADER_SIZE - len(meta)) + const


def target(data: bytes) -> None:
    judge(wrap(data))  # raises Escape (an AssertionError) for anything but refusal or a clean run


def main() -> None:
    from tests.format.fuzz_seeds import seeds

    seed = next(s for s in seeds() if s.name == "stateful")
    raw = encode(seed.program, seed.data)
    h = Header.unpack(raw)[1]
    SEED["const"] = raw[h.const_offset:]
    SEED["opset"] = bytes([h.opset_version])
    corpus = sys.argv[1:] if any(not a.startswith("-") for a in sys.argv[1:]) else []
    if not corpus:  # start from the seed's own table
        import tempfile
        from pathlib import Path

        folder = Path(tempfile.mkdtemp(prefix="kiln-atheris-"))
        (folder / "seed").write_bytes(raw[h.meta_offset:h.meta_offset + h.meta_size])
        sys.argv.append(str(folder))
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
