"""Compile kiln's CUDA kernel sources with nvcc, every instance NVRTC would compile at run time, for a GPU
architecture, on a machine without a GPU: each source's compile time, and the instances that spill registers.

    PYTHONPATH=src python3 scripts/cuda_check.py [quant gemv ...] [--arch sm_90] [--all] [--fail-on-spills]

A kernel change can be checked here before it takes device time: a compile error, or a new spill (a few bytes of
local memory in a loop that streams weights cost more than the change gains), shows in minutes. The instances are
kiln.runtime.backends.cuda.sources' (the `// kernel<N>:` lines), compiled as one translation unit per source with
the options nvrtc.py gives NVRTC (C++17, no fast math). Needs nvcc on PATH (the CUDA toolkit, no GPU); the
translation of a large source (quant.cu: ~300 instances) takes minutes on two cores.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kiln.runtime.backends.cuda import sources

_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def translation_unit(name: str) -> str:
    """kernels/<name>.cu as NVRTC sees it, each declared instance named once so nvcc instantiates it."""
    text = sources.read(name)
    uses = [f"void* kiln_instance_{i} = (void*)&{expression};"
            for i, expression in enumerate(sources.instances(text, name))]
    return "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + text + "\n" + "\n".join(uses) + "\n"


def ptxas_report(log: str) -> list[tuple[str, int, int]]:
    """(mangled entry, registers, spilled bytes stored + loaded) of every entry ptxas compiled."""
    report, entry, spilled = [], None, 0
    for line in log.splitlines():
        if found := _ENTRY.search(line):
            entry, spilled = found.group(1), 0
        elif (found := _SPILLS.search(line)) and entry:
            spilled = int(found.group(2)) + int(found.group(3))
        elif (found := _REGISTERS.search(line)) and entry:
            report.append((entry, int(found.group(1)), spilled))
            entry = None
    return report


def demangled(names: list[str]) -> list[str]:
    """C++ names of the mangled ones, through cu++filt or c++filt where either is installed (else as given)."""
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if not tool or not names:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return out if len(out) == len(names) else names


def check(name: str, arch: str, show_all: bool) -> tuple[bool, int]:
    """Compile one source; print its summary and spilling instances. (compiled, instances that spill)."""
    with tempfile.TemporaryDirectory() as folder:
        unit = Path(folder) / f"{name}.cu"
        unit.write_text(translation_unit(name))
        start = time.perf_counter()
        done = subprocess.run(["nvcc", *sources.OPTIONS, f"-arch={arch}", "-c", "-Xptxas", "-v", str(unit),
                               "-o", str(Path(folder) / f"{name}.o")], capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        print(f"{name}.cu: nvcc failed ({len(errors)} errors)\n" + "\n".join(errors[:20] or done.stderr[-3000:]))
        return False, 0
    report = ptxas_report(done.stderr)
    spilling = [r for r in report if r[2]]
    print(f"{name}.cu: {len(report)} instances in {seconds:.0f} s, registers {min(r[1] for r in report)}-"
          f"{max(r[1] for r in report)}, {len(spilling)} spilling")
    shown = report if show_all else spilling
    for (_, registers, spilled), label in zip(shown, demangled([r[0] for r in shown]), strict=True):
        short = label.split("(")[0].removeprefix("void ")  # (the parameters repeat for every instance)
        print(f"  {short}: {registers} registers" + (f", {spilled} bytes spilled" if spilled else ""))
    return True, len(spilling)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"sources to compile (default all: {', '.join(sources.names())})")
    parser.add_argument("--arch", default="sm_90", help="GPU architecture (default sm_90: H100, H200)")
    parser.add_argument("--all", action="store_true", help="list every instance's registers, not only spills")
    parser.add_argument("--fail-on-spills", action="store_true", help="exit 1 when any instance spills")
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        parser.error("nvcc is not on PATH (install the CUDA toolkit; no GPU is needed)")
    unknown = sorted(set(args.names) - set(sources.names()))
    if unknown:
        parser.error(f"no such kernel source: {', '.join(unknown)} (there are {', '.join(sources.names())})")
    results = [check(name, args.arch, args.all) for name in args.names or sources.names()]
    failed = not all(ok for ok, _ in results) or (args.fail_on_spills and any(n for _, n in results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
