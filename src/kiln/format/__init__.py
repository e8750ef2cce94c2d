"""The .kiln file format: a fixed header, a FlatBuffers metadata table (program.fbs), a constant segment.

    offset 0   header (64 bytes, little-endian; see header.py)
    64         metadata: a FlatBuffers `Program` table (program.fbs)
    aligned    constant segment: every blob 64-byte aligned, deduplicated by content

writer.py serializes a kiln.ir.graph.Program; reader.py validates a file and returns one.
"""

FORMAT_VERSION = 1
ALIGNMENT = 64
