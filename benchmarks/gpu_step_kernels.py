"""Each GPU kernel's time in one batched decode step of a slotted LLM program, read by Nsight Compute (the kernels'
own durations, one at a time, without the launch gaps an op-by-op timing has), summed by kernel name.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python3 benchmarks/gpu_step_kernels.py PROGRAM.kiln --batch 64 > step.csv
    python3 benchmarks/gpu_step_kernels.py --summarize step.csv

The first form runs the decode step once to plan it, then once between cudaProfilerStart and Stop (no CUDA graph,
so Nsight sees each kernel); the second prints the table: kernel, launches, microseconds, share.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict
from pathlib import Path


def summarize(path: Path, top: int) -> str:
    text = path.read_text()
    start = text.find('"ID"')
    rows = csv.DictReader(io.StringIO(text[start:]))
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0]
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(row["Metric Unit"], 1.0)
        totals[name][0] += 1
        totals[name][1] += float(row["Metric Value"].replace(",", "")) * scale
    whole = sum(us for _, us in totals.values())
    lines = [f"kernels of one step: {whole:.0f} us in {sum(int(n) for n, _ in totals.values())} launches",
             "| kernel | launches | us | share |", "|---|---:|---:|---:|"]
    for name, (n, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {name[:70]} | {n} | {us:.0f} | {100 * us / whole:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", type=Path, nargs="?")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--position", type=int, default=400)
    parser.add_argument("--summarize", type=Path, metavar="CSV", help="print the table of an ncu CSV")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize, args.top))
        return 0
    import cupy as cp

    import kiln
    from kiln.runtime.llm.info import LLMInfo

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_slot_decode import step_inputs  # rows past the slots: prompt runs, as the serving engine feeds them

    program = kiln.load(args.program)
    info = LLMInfo.from_metadata(program.metadata)
    session = program.session("cuda", graphs=False)
    inputs = step_inputs(info, args.batch, args.position)
    session.run("decode", *inputs)
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.start()
    session.run("decode", *inputs)
    cp.cuda.Device().synchronize()
    cp.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
