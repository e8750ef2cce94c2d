"""Nsight Compute's view of chosen kernels, one compact row a launch: whether a kernel that the timing benchmarks
call slow waits on memory, on issue, on occupancy or on latency, in one device call.

    PYTHONPATH=src python3 benchmarks/gpu_ncu.py --kernels 'gemm_rows$' [--skip 1] [--count 4] [--stalls] -- \
        python3 benchmarks/gpu_quant_linear.py --rows 64 --calls 2 --kernels dot --layers gate/up

Runs the command under `ncu --clock-control none` (the clocks as they are: the device's METHOD.md) into a report
file, collects the launches whose kernel name matches --kernels (a regular expression, ncu's `-k regex:`), the
first --skip left out and at most --count kept, and prints for each: grid x block, registers a thread, dynamic
shared memory, duration, DRAM and SM throughput (% of peak), issue slots busy, warp instructions executed, achieved
occupancy and warp cycles per issued instruction; with --stalls, the three largest stall reasons (warps stalled a
cycle per issued instruction). ncu replays each launch once a section: a launch costs a second or more, so choose
--count small and let the command run few calls.
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "ComputeWorkloadAnalysis", "InstructionStats",
            "WarpStateStats")

STALLS = ("long_scoreboard", "short_scoreboard", "wait", "barrier", "math_pipe_throttle", "mio_throttle",
          "lg_throttle", "not_selected", "dispatch_stall", "no_instruction", "membar", "branch_resolving",
          "drain", "imc_miss", "tex_throttle", "sleeping")
"""ncu's stall reasons, each read as smsp__average_warps_issue_stalled_<reason>_per_issue_active.ratio."""

COLUMNS = {  # column: (ncu metric name, unit it is shown in)
    "us": ("Duration", "us"),
    "DRAM %": ("DRAM Throughput", "%"),
    "SM %": ("Compute (SM) Throughput", "%"),
    "issue %": ("Issue Slots Busy", "%"),
    "warp inst": ("Executed Instructions", ""),
    "occupancy %": ("Achieved Occupancy", "%"),
    "cycles/issue": ("Warp Cycles Per Issued Instruction", ""),
    "regs": ("Registers Per Thread", ""),
    "smem KB": ("Dynamic Shared Memory Per Block", "KB"),
}

_SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
          "byte": 1 / 1024, "Kbyte": 1.0, "Mbyte": 1024.0, "KB": 1.0, "B": 1 / 1024}


def number(text: str) -> float | None:
    """ncu's printed value as a number ("127,029" -> 127029.0), None where it is not one."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def short_name(name: str) -> str:
    """A kernel's name without its return type and parameters: gemm_rows<BF16, 4>."""
    return name.removeprefix("void ").split("(")[0].strip()


def launches(report_csv: str) -> list[dict]:
    """The launches of `ncu --import R --csv --page details`, each {"name", "grid", "block", metric: (value, unit)}
    in the report's order."""
    rows: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(report_csv)):
        if not row.get("ID") or not row.get("Metric Name"):
            continue
        launch = rows.setdefault(row["ID"], {"name": short_name(row.get("Kernel Name", "")),
                                             "grid": row.get("Grid Size", ""), "block": row.get("Block Size", "")})
        value = number(row.get("Metric Value", ""))
        if value is not None:
            launch[row["Metric Name"]] = (value, row.get("Metric Unit", ""))
    return [rows[i] for i in sorted(rows, key=int)]


def cell(launch: dict, metric: str, unit: str) -> str:
    """One column's value of a launch in the column's unit ("" where ncu gave none)."""
    if metric not in launch:
        return ""
    value, given = launch[metric]
    if unit in ("us", "KB"):
        value *= _SCALE.get(given.split("/")[0], 1.0)
    if unit == "%" or abs(value) < 100:
        return f"{value:.1f}" if value != int(value) or unit == "%" else f"{value:.0f}"
    return f"{value:,.0f}"


def stall_cell(launch: dict) -> str:
    """The three largest stall reasons of a launch: "long_scoreboard 2.1, barrier 0.9, wait 0.4"."""
    found = [(launch[m][0], reason) for reason in STALLS
             if (m := f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio") in launch]
    return ", ".join(f"{reason} {value:.1f}" for value, reason in sorted(found, reverse=True)[:3])


def table(found: list[dict], stalls: bool) -> str:
    """The launches as a Markdown table."""
    head = ["kernel", "grid x block", *COLUMNS] + (["top stalls"] if stalls else [])
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * len(COLUMNS) + ("---|" if stalls else "")]
    for launch in found:
        cells = [launch["name"], f"{launch['grid']} x {launch['block']}"]
        cells += [cell(launch, metric, unit) for metric, unit in COLUMNS.values()]
        lines.append("| " + " | ".join(cells + ([stall_cell(launch)] if stalls else [])) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="gpu_ncu.py [options] -- COMMAND [ARGS...]")
    parser.add_argument("--kernels", required=True, help="regular expression the kernel's name matches")
    parser.add_argument("--skip", type=int, default=0, help="matching launches left out first (default 0)")
    parser.add_argument("--count", type=int, default=4, help="matching launches profiled (default 4)")
    parser.add_argument("--stalls", action="store_true", help="also the three largest stall reasons a launch")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu", help="the ncu binary")
    parser.add_argument("--keep", type=Path, help="also keep the report file here (open it with ncu --import)")
    args = parser.parse_args(own)
    if not command:
        parser.error("give the command to profile after --")
    if not Path(args.ncu).exists():
        parser.error(f"no ncu at {args.ncu} (--ncu PATH)")
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "kernels"
        profile = [args.ncu, "--clock-control", "none", "--kernel-name", f"regex:{args.kernels}",
                   "--launch-skip", str(args.skip), "--launch-count", str(args.count), "-o", str(report), "-f"]
        for section in SECTIONS:
            profile += ["--section", section]
        if args.stalls:
            profile += ["--metrics", ",".join(f"smsp__average_warps_issue_stalled_{r}_per_issue_active.ratio"
                                              for r in STALLS)]
        done = subprocess.run(profile + command)
        path = report.with_suffix(".ncu-rep")
        if not path.exists():
            print(f"gpu_ncu: ncu wrote no report (exit {done.returncode}); no launch matched {args.kernels!r}?",
                  file=sys.stderr)
            return 1
        if args.keep:
            shutil.copy(path, args.keep)
        text = subprocess.run([args.ncu, "--import", str(path), "--csv", "--page", "details"],
                              capture_output=True, text=True, check=True).stdout
    found = launches(text)
    if not found:  # (a report in a layout this script does not read: show its head rather than nothing)
        print("gpu_ncu: no launch read from ncu's CSV; its first lines:\n" + "\n".join(text.splitlines()[:5]),
              file=sys.stderr)
        return 1
    print(f"\n{len(found)} launch(es) of {args.kernels!r} (ncu {args.ncu}, clocks as they are):\n")
    print(table(found, args.stalls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
