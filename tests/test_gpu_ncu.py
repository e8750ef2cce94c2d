"""benchmarks/gpu_ncu.py on the CPU: a stand-in `ncu` records how it was called, runs the profiled command and
prints a report in Nsight Compute's CSV layout, so the options it passes, the parsing of its report and the table
are checked without a GPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_ncu  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(launch: int, kernel: str, metric: str, unit: str, value: str, section: str = "Section") -> str:
    return (f'"{launch}","963","python3","host","{kernel}","1","7","(128, 1, 1)","(256, 1, 2)","0","9.0",'
            f'"{section}","{metric}","{unit}","{value}"')


REPORT = "\n".join([
    HEADER,
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)", "Duration", "usecond", "70.27"),
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)", "DRAM Throughput", "%", "5.77"),
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)", "Executed Instructions", "inst", "26,292,224"),
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)", "Dynamic Shared Memory Per Block", "Kbyte/block",
         "58.37"),
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)", "Registers Per Thread", "register/thread", "96"),
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)",
         "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "", "1.95"),
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)",
         "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "", "0.40"),
    _row(0, "void gemm_rows<BF16, 4>(const T *, float *, int)", "Block Limit Registers", "block", "n/a"),
    _row(1, "gemm_rows_reduce<BF16>(const float *)", "Duration", "nsecond", "5150"),
]) + "\n"


def test_a_report_becomes_one_row_a_launch_in_the_columns_units() -> None:
    found = gpu_ncu.launches(REPORT)
    assert [f["name"] for f in found] == ["gemm_rows<BF16, 4>", "gemm_rows_reduce<BF16>"]
    table = gpu_ncu.table(found, stalls=True).splitlines()
    assert table[0].startswith("| kernel | grid x block | us | DRAM % |") and table[0].endswith("top stalls |")
    first = [c.strip() for c in table[2].split("|")[1:-1]]
    columns = ["kernel", "grid", *gpu_ncu.COLUMNS, "stalls"]
    cells = dict(zip(columns, first, strict=True))
    assert cells["us"] == "70.3" and cells["DRAM %"] == "5.8" and cells["warp inst"] == "26,292,224"
    assert cells["regs"] == "96" and cells["smem KB"] == "58.4" and cells["issue %"] == ""
    assert cells["stalls"] == "wait 1.9, barrier 0.4"
    second = [c.strip() for c in table[3].split("|")[1:-1]]
    assert second[2] == "5.2"  # 5150 ns


def test_main_runs_the_command_under_ncu_and_prints_the_table(tmp_path) -> None:
    calls = tmp_path / "calls.txt"
    (tmp_path / "report.csv").write_text(REPORT)
    ncu = tmp_path / "ncu"
    ncu.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import subprocess, sys
        args = sys.argv[1:]
        open({str(calls)!r}, "a").write(" ".join(args) + "\\n")
        if "--import" in args:
            print(open({str(tmp_path / "report.csv")!r}).read(), end="")
            raise SystemExit(0)
        out = args[args.index("-o") + 1]
        open(out + ".ncu-rep", "w").write("report")
        command = args[args.index("WarpStateStats") + 1:]
        if "--metrics" in command:
            command = command[2:]
        raise SystemExit(subprocess.run(command).returncode)
    """))
    ncu.chmod(0o755)
    marker = tmp_path / "ran"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_ncu.py"), "--ncu", str(ncu), "--kernels",
                           "gemm_rows$", "--skip", "1", "--count", "2", "--stalls", "--",
                           sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    profile, imported = calls.read_text().splitlines()
    assert "--clock-control none --kernel-name regex:gemm_rows$ --launch-skip 1 --launch-count 2" in profile
    assert "--section SpeedOfLight" in profile and "--metrics smsp__average_warps_issue_stalled_" in profile
    assert imported.startswith("--import ") and imported.endswith("--csv --page details")
    assert "2 launch(es) of 'gemm_rows$'" in done.stdout and "| gemm_rows<BF16, 4> |" in done.stdout


def test_main_says_so_when_no_launch_matched(tmp_path) -> None:
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!{sys.executable}\nraise SystemExit(0)\n")
    ncu.chmod(0o755)
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_ncu.py"), "--ncu", str(ncu), "--kernels", "none",
                           "--", sys.executable, "-c", "pass"], capture_output=True, text=True)
    assert done.returncode == 1 and "no launch matched 'none'" in done.stderr
