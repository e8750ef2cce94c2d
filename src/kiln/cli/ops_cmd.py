"""`kiln ops`: which Core ATen ops kiln exports, which are not applicable to inference, and which are not yet done."""

from __future__ import annotations

import argparse
import json

HELP = "list every Core ATen op with its export status (supported / not yet / not applicable) and the counts"
DESCRIPTION = """\
Print every Core ATen op overload (the op set of a decomposed torch.export graph) with its status in kiln:
supported (lowered, decomposed at capture, or a shape expression), not applicable (backward, random, out= and
training ops never appear in an inference graph: each with the reason) or not yet (with what is missing), then the
counts. Non-core ATen ops that kiln lowers (kept whole at capture, such as linear and scaled_dot_product_attention)
follow the table. Needs torch (it reads torch's op registry)."""
EPILOG = """\
examples:
  kiln ops
  kiln ops --missing
  kiln ops --json | python -c "import json,sys; print(json.load(sys.stdin)['counts'])"
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ops", help=HELP, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--missing", action="store_true", help="show only the ops that are not yet supported")
    p.add_argument("--json", action="store_true", help="print the table and the counts as one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kiln.export.coverage import NOT_YET, report  # imports torch: only this command pays for it

    info = report()
    if args.missing:
        info = {"core": [s for s in info["core"] if s["status"] == NOT_YET], "counts": info["counts"]}
    print(json.dumps(info, indent=1) if args.json else render(info, only_missing=args.missing))
    return 0


def render(info: dict, only_missing: bool = False) -> str:
    """Core ops grouped by status (not yet first: what needs doing), sorted by name, then the non-core lowerings."""
    from kiln.export.coverage import STATUSES

    lines = []
    width = max((len(s["name"]) for s in info["core"] + info.get("non_core", [])), default=10)
    for status in STATUSES:
        group = [s for s in info["core"] if s["status"] == status]
        if not group:
            continue
        lines.append(f"{status} ({len(group)}):")
        lines += [f"  {s['name']:<{width}}  {s['reason']}" for s in group]
        lines.append("")
    if not only_missing and info.get("non_core"):
        lines.append(f"non-core ATen ops kiln lowers ({len(info['non_core'])}):")
        lines += [f"  {s['name']:<{width}}  {s['reason']}" for s in info["non_core"]]
        lines.append("")
    c = info["counts"]
    lines.append(f"Core ATen: {sum(c.values())} ops: " + ", ".join(f"{n} {k}" for k, n in c.items()))
    return "\n".join(lines)
