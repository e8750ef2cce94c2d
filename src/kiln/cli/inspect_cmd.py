"""`kiln inspect`: what is inside a .kiln file, as text for people or JSON for scripts. Torch-free."""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from typing import Any

from kiln.cli.common import CliError, compact_json, human_bytes, load_program, shape_text
from kiln.ir.graph import PASS_STATS_KEY, Value
from kiln.ir.symbolic import UNBOUNDED
from kiln.runtime import Program

PREVIEW_CHARS = 200
"""Characters of a long metadata value the text view shows."""

HELP = "show the methods, shapes, ops, constants and state buffers of a .kiln file"
DESCRIPTION = """\
Show what a .kiln file holds: its size and format/op set versions, metadata, each method's inputs and outputs
with their symbolic shapes and the bounds of every symbol, a histogram of the ops each method runs, the constants
(and how many distinct blobs store them after deduplication), and the state buffers shared by the methods.
Metadata values longer than 200 characters are shown cut short, with their size; --metadata KEY prints one in
full, and --json prints them all in full. The file is fully validated on the way (checksums included), so
`kiln inspect` also checks a file is intact."""
EPILOG = """\
examples:
  kiln inspect model.kiln
  kiln inspect model.kiln --passes      # what each export graph pass removed or fused
  kiln inspect llm.kiln --metadata kiln.llm.tokenizer_json > tokenizer.json   # one value, in full
  kiln inspect model.kiln --json | python -c "import json,sys; print(json.load(sys.stdin)['methods'][0]['ops'])"
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the .kiln file")
    p.add_argument("--json", action="store_true", help="print the same information as one JSON object")
    p.add_argument("--metadata", metavar="KEY",
                   help="print the metadata value KEY in full, as stored, and nothing else (the summary shows long "
                        f"values, such as an LLM's tokenizer JSON, cut to their first {PREVIEW_CHARS} characters)")
    p.add_argument("--passes", action="store_true",
                   help="print, per method, each graph pass of the export with how many nodes it rewrote and the "
                        "node count after it (from the file's metadata)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    program = load_program(args.model)
    if args.metadata is not None:
        print(metadata_value(program, args.metadata))
        return 0
    if args.passes:
        raw = program.ir.metadata.get(PASS_STATS_KEY)
        if raw is None:
            print(f"{args.model}: no pass statistics (exported by a kiln without them)")
            return 0
        stats = json.loads(raw)
        print(compact_json(stats) if args.json else render_passes(stats))
        return 0
    info = describe(program)
    print(compact_json(info) if args.json else render(info))
    return 0


def metadata_value(program: Program, key: str) -> str:
    """One metadata value in full; a missing key is a user error that lists the keys there are."""
    metadata = program.ir.metadata
    if key not in metadata:
        keys = ", ".join(sorted(metadata)) or "none"
        raise CliError(f"{program.path or 'the program'} has no metadata key {key!r}; its keys: {keys}")
    return metadata[key]


def preview(key: str, value: str, limit: int = PREVIEW_CHARS) -> str:
    """A metadata value as the summary shows it: whole when short, else its start on one line (line breaks shown
    as \\n) and its size, so a 1.4 MB tokenizer does not flood the terminal."""
    if len(value) <= limit:
        return value
    start = value[:limit].replace("\n", "\\n").replace("\r", "\\r")
    return f"{start}... ({len(value.encode())} bytes; --metadata {key} prints it)"


def render_passes(stats: dict[str, dict]) -> str:
    """Each method's pass statistics as a table: pass, rewrites, nodes after it."""
    lines = []
    for method, s in stats.items():
        final = s["passes"][-1][2] if s["passes"] else s["nodes"]
        drop = 100 * (1 - final / s["nodes"]) if s["nodes"] else 0.0
        lines.append(f"method {method}: {s['nodes']} nodes as lowered, {final} after passes (-{drop:.0f}%)")
        lines.append(f"  {'pass':<24} {'rewrites':>8} {'nodes after':>11}")
        lines += [f"  {name:<24} {changed:>8} {after:>11}" for name, changed, after in s["passes"]]
    return "\n".join(lines)


def _value(v: Value) -> dict[str, Any]:
    return {"name": v.name, "dtype": v.dtype.name, "shape": list(v.shape)}


def describe(program: Program) -> dict[str, Any]:
    """Everything `kiln inspect` shows, as plain JSON-ready data (the text view renders this)."""
    ir = program.ir
    methods = []
    for name, m in ir.methods.items():
        ops = Counter(node.op for node in m.nodes)
        methods.append({
            "name": name,
            "inputs": [_value(v) for v in m.input_specs()],
            "outputs": [_value(v) for v in m.output_specs()],
            "symbols": [{"name": s.name, "min": s.min, "max": None if s.max == UNBOUNDED else s.max}
                        for s in m.symbols],
            "nodes": len(m.nodes),
            "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
            "updates_state": [ir.states[u.state].name for u in m.state_updates],
        })
    states = []
    for s in ir.states:
        count = 1
        for d in s.shape:
            count *= d
        states.append({"name": s.name, "dtype": s.dtype.name, "shape": list(s.shape),
                       "bytes": count * s.dtype.itemsize, "initial": "zeros" if s.init < 0 else "constant"})
    file_bytes = os.path.getsize(program.path) if program.path else program.header.file_size
    return {
        "path": program.path,
        "file_bytes": file_bytes,
        "format_version": program.header.format_version,
        "opset_version": program.header.opset_version,
        "metadata": dict(sorted(ir.metadata.items())),
        "methods": methods,
        "constants": {"count": len(ir.constants), "bytes": sum(c.nbytes for c in ir.constants),
                      "blobs": len(ir.blobs), "blob_bytes": sum(b.nbytes for b in ir.blobs)},
        "states": states,
    }


def _spec(v: dict[str, Any]) -> str:
    return f"{v['name']}: {v['dtype']}{shape_text(v['shape'])}"


def _bounds(s: dict[str, Any]) -> str:
    return f"{s['name']} in [{s['min']}, {'inf' if s['max'] is None else s['max']}]"


def render(info: dict[str, Any]) -> str:
    """The text view of `describe`'s data."""
    lines = [f"{info['path'] or '<bytes>'}: {human_bytes(info['file_bytes'])}, format version "
             f"{info['format_version']}, op set version {info['opset_version']}"]
    shown = {k: v for k, v in info["metadata"].items() if k != PASS_STATS_KEY}
    if shown:
        lines.append("metadata:")
        lines += [f"  {k}: {preview(k, v)}" for k, v in shown.items()]
    for m in info["methods"]:
        lines.append(f"method {m['name']}: {m['nodes']} nodes")
        lines.append("  inputs:")
        lines += [f"    {_spec(v)}" for v in m["inputs"]] or ["    (none)"]
        lines.append("  outputs:")
        lines += [f"    {_spec(v)}" for v in m["outputs"]]
        if m["symbols"]:
            lines.append("  symbols: " + ", ".join(_bounds(s) for s in m["symbols"]))
        if m["updates_state"]:
            lines.append("  updates state: " + ", ".join(m["updates_state"]))
        lines.append(f"  ops ({len(m['ops'])} kinds):")
        width = len(str(max(m["ops"].values(), default=0)))
        lines += [f"    {count:>{width}}  {op}" for op, count in m["ops"].items()]
    c = info["constants"]
    lines.append(f"constants: {c['count']} ({human_bytes(c['bytes'])}), stored in {c['blobs']} blob(s) "
                 f"({human_bytes(c['blob_bytes'])}) after deduplication")
    lines.append(f"state buffers: {len(info['states'])}")
    for s in info["states"]:
        lines.append(f"  {s['name']}: {s['dtype']}{shape_text(s['shape'])}, {human_bytes(s['bytes'])}, "
                     f"initially {s['initial']}")
    return "\n".join(lines)
